"""Compile the attention kernels for a GPU that is not here, and read what they use of it.

Triton ships ptxas, so a CPU machine can build the kernels for Hopper (sm_90) exactly as a
GPU launch would, and see:
- shared memory per program (Triton's allocation; a launch above the chip's limit fails only
  on the GPU, with "out of resource: shared memory");
- registers per thread and bytes spilled to local memory (``ptxas -v``). Spills alone do not
  rank tiles: on an H200 (2026-11-23) a head_dim-256 dK/dV tile spilling 4.2 KB ran 3.6x faster
  than one spilling 8.2 KB, but TMA-load variants of the head_dim-128 dK/dV kernel that cut its
  1.8 KB spill to 0.04-0.8 KB ran slower (docs/experiments.md). Time candidates on a GPU.

Import this in a process without TRITON_INTERPRET=1: under the interpreter ``triton.jit``
returns interpreted functions, which cannot be compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Collection
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

from .backward import _dkdv_kernel, _dq_kernel
from .configs import TileConfig, backward_kv_config, backward_q_config, block_d, forward_config
from .forward import _fwd_kernel

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = {90: 232448}  # bytes per program (H100/H200: 227 KiB)
_FP32_ARGS = {"qk_scale", "softmax_scale", "softcap_log2", "LSE", "DELTA", "ALIBI"}
KERNELS = {"forward": _fwd_kernel, "dkdv": _dkdv_kernel, "dq": _dq_kernel}
# The Triton releases whose Gluon the Hopper kernels (hopper/) build with for sm_90, their builds
# checked here (tests/test_compile.py): 3.6 as validated on H100/H200 GPUs, 3.9 through
# hopper/gluon_api.py (Gluon's names that changed). Which releases run them on a GPU is
# hopper/dispatch.py's decision.
GLUON_BUILDS = ("3.6.", "3.9.")


def gluon_build(version: str | None = None) -> str | None:
    """The entry of ``GLUON_BUILDS`` that Triton ``version`` (default: the installed one) is a
    release of, or None: the Gluon kernels do not build with it."""
    version = triton.__version__ if version is None else version
    return next((build for build in GLUON_BUILDS if version.startswith(build)), None)


@dataclass(frozen=True)
class ResourceUsage:
    registers: int  # per thread
    spill_bytes: int  # spill stores per thread
    shared_bytes: int  # per program


def compile_kernel(
    kernel: triton.JITFunction,
    constexprs: dict,
    ones: tuple[str, ...] = (),
    dtype: str = "bf16",
    num_warps: int = 4,
    num_stages: int = 2,
    target: GPUTarget = HOPPER,
    float32: Collection[str] = (),
    aligned: Collection[str] = (),
) -> triton.compiler.CompiledKernel:
    """Compile ``kernel`` for ``target``. Tensor arguments are ``dtype`` (float32 for the LSE,
    delta, ALiBi slopes and scales, and those named in ``float32``); integer arguments named in
    ``ones`` are specialized to the constant 1, as Triton does at launch when such an argument
    equals 1; other arguments given in ``constexprs`` to their value there (arguments launched as
    None: ``ALIBI=None``). Arguments named in ``aligned`` get the hint a launch gives a pointer or
    integer divisible by 16, which lets Triton pipeline loops (more shared memory)."""
    sig, consts = {}, {}
    float32 = _FP32_ARGS | set(float32)
    for name, param in zip(kernel.arg_names, kernel.params):
        if param.is_constexpr:
            consts[name] = constexprs[name]
        elif name in constexprs:
            sig[name], consts[name] = "constexpr", constexprs[name]
        elif name in ones:
            sig[name], consts[name] = "constexpr", 1
        elif name.startswith("CU_"):
            sig[name] = "*i32"
        elif name[0].isupper():
            sig[name] = "*fp32" if name in float32 else f"*{dtype}"
        else:
            sig[name] = "fp32" if name in float32 else "i32"
    attrs = _aligned_attrs(kernel, sig, aligned)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def _aligned_attrs(kernel: triton.JITFunction, sig: dict, aligned: Collection[str]) -> dict:
    """The divisible-by-16 hint on each runtime argument named in ``aligned``. A compile-time
    constant has no argument to carry it (Triton 3.6 ignored the hint there, 3.9 fails on it)."""
    return {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name in aligned
        if sig.get(name) != "constexpr" and not kernel.params[kernel.arg_names.index(name)].is_constexpr
    }


def _ptxas(target: GPUTarget = HOPPER) -> str:
    """The ptxas Triton itself assembles ``target`` with: Triton 3.9 uses its ``ptxas-blackwell``
    (a newer CUDA) for sm_90 too, whose PTX the plain ``ptxas`` rejects. ``TRITON_PTXAS_PATH`` /
    ``TRITON_PTXAS_BLACKWELL_PATH`` override it, as for Triton."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(target.arch).path


def _assemble(compiled: triton.compiler.CompiledKernel, target: GPUTarget, tmp: str, *flags: str):
    """Assemble the kernel's PTX with ptxas into ``tmp`` (sm_90a for Hopper, as Triton builds
    it); returns (cubin path, ptxas's stderr)."""
    arch = f"sm_{target.arch}a" if target.arch == 90 else f"sm_{target.arch}"
    ptx, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
    with open(ptx, "w") as f:
        f.write(compiled.asm["ptx"])
    command = [_ptxas(target), *flags, f"--gpu-name={arch}", ptx, "-o", cubin]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    return cubin, run.stderr


def resource_usage(compiled: triton.compiler.CompiledKernel, target: GPUTarget = HOPPER) -> ResourceUsage:
    """Registers and spills from ``ptxas -v`` on the kernel's PTX (sm_90a, as Triton builds
    for Hopper), shared memory from Triton's metadata."""
    with tempfile.TemporaryDirectory() as tmp:
        _, log = _assemble(compiled, target, tmp, "-v")
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output: {log[-500:]}")
    return ResourceUsage(int(registers.group(1)), int(spills.group(1)), compiled.metadata.shared)


def table_launch(
    name: str, head_dim: int, causal: bool, fp32: bool = False, group: int = 1,
    softcap: bool = False, alibi: bool = False,
) -> tuple[triton.JITFunction, dict, TileConfig]:  # fmt: skip
    """(kernel, constexprs, TileConfig) of a dense launch with the ``configs`` table's tiles, as
    ``attention_forward``/``attention_backward`` make it, with a softcap and ALiBi slopes when
    asked (scores.py)."""
    config_of = {"forward": forward_config, "dkdv": backward_kv_config, "dq": backward_q_config}[name]
    cfg: TileConfig = config_of(head_dim, fp32)
    constexprs = dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, IS_VARLEN=False, HAS_LEFT=False, HAS_RIGHT=causal,
        DOT_PRECISION="ieee" if fp32 else "tf32", ACCUMULATE=False, WIDE=False,
        HAS_SOFTCAP=softcap, HAS_ALIBI=alibi,
    )  # fmt: skip
    if not softcap:
        constexprs["softcap_log2"] = None  # as launches pass them (scores.score_scales)
    if not alibi:
        constexprs["ALIBI"] = None
    return KERNELS[name], constexprs, cfg


def _compile_gluon(
    kernel, descs: dict, consts: dict, pointers: dict, options: dict, target: GPUTarget,
    aligned: tuple[str, ...] = (),
):  # fmt: skip
    """Build a Gluon kernel: TMA descriptor arguments from ``descs`` (example descriptors),
    pointer arguments typed by ``pointers``, other scalars i32 (fp32 when named *scale*). Arguments
    named in ``aligned`` get the hint a launch gives a pointer or integer divisible by 16."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {}
    for name in kernel.arg_names:
        if name in descs:
            sig[name] = mangle_type(descs[name])
        elif name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if "scale" in name else "i32"
    attrs = _aligned_attrs(kernel, sig, aligned)
    return triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=target, options=options)


# Contiguous positions, as most launches have them: Triton specializes an integer argument equal to
# 1 into a constant.
_UNIT_STRIDES = dict(q_stride=1, k_stride=1)


def _example_descriptor(
    heads: int, block_rows: int, dtype: str = "bfloat16", head_dim: int = 128, tensor_dim: int | None = None
):
    """A TMA descriptor as a launch makes it over 1024 tokens of ``heads`` heads (the compiled
    kernel depends on its block shape, dtype and layout, not on the sizes); with ``tensor_dim``
    below head_dim, the descriptor of a head_dim between two builds (``tma.rows_descriptor``)."""
    import torch

    from .hopper.tma import rows_descriptor

    t = torch.empty(1, 1024, heads, tensor_dim or head_dim, dtype=getattr(torch, dtype))
    return rows_descriptor(t, block_rows, head_dim)[0]


def compile_fused_backward(
    causal: bool, group: int = 1, accumulate: bool = False, softcap: bool = False, alibi: bool = False,
    target: GPUTarget = HOPPER, *, head_dim: int = 128, left: bool = False, varlen: bool = False,
    tail: bool = False, ones: tuple[str, ...] = tuple(_UNIT_STRIDES), tensor_dim: int | None = None,
    memory: bool = False, gram: bool = False, sparse: bool = False,
) -> triton.compiler.CompiledKernel:  # fmt: skip
    """Build hopper/backward.py's fused Gluon kernel for ``target`` as a bf16 launch makes it, with
    bf16 dK/dV (float32 with ``accumulate``, the ring's buffers), with or without a softcap and
    ALiBi, at ``head_dim``. Masks: ``causal`` alone builds the DIAGONAL variant (aligned causal
    blocks); ``left`` (a left bound, with ``causal`` a right one too), ``varlen`` (packed
    documents) or ``tail`` (lengths that are not multiples of the tiles) the MASKED one. Integer
    arguments named in ``ones`` arrive as the constant 1 (a launch's specialization). With
    ``tensor_dim`` below head_dim: tensors of a head_dim between two builds, run at this one.
    ``memory``: the MEMORY epilogue (Infini-attention's memory updates' backward added), with
    ``gram`` the delta rule's Gram terms. ``sparse``: the walk over a block mask's lists of
    128-row query blocks (SPARSE, block_lists.py)."""
    import torch

    from .hopper import backward as hb
    from .hopper.infini_updates import matrix_descriptor

    block_m, block_n = hb.TILES[head_dim]
    masked = left or varlen or tail
    diagonal = causal and not masked
    kv = _example_descriptor(1, block_n, head_dim=head_dim, tensor_dim=tensor_dim)
    q = _example_descriptor(group, block_m, head_dim=head_dim, tensor_dim=tensor_dim)
    dq = _example_descriptor(group, block_m, "float32", head_dim=head_dim, tensor_dim=tensor_dim)
    gdm = matrix_descriptor(torch.empty(1, 1, 128, 128, dtype=torch.bfloat16)) if memory else q
    descs = dict(q_desc=q, k_desc=kv, v_desc=kv, do_desc=q, dq_desc=dq, gdm_desc=gdm, s_desc=gdm)
    descs.update(dk_desc=kv, dv_desc=kv)
    consts = dict(
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, TENSOR_DIM=tensor_dim or head_dim,
        VARLEN=varlen, DIAGONAL=diagonal,
        MASKED=masked, HAS_LEFT=left, HAS_RIGHT=causal, SOFTCAP=softcap,
        HAS_ALIBI=alibi, ACCUMULATE=accumulate, MEMORY=memory, GRAM=gram, SPARSE=sparse,
        MASK_Q=128 if sparse else block_m, num_warps=hb.NUM_WARPS, **dict.fromkeys(ones, 1),
    )  # fmt: skip
    grads = "*fp32" if accumulate else "*bf16"
    cu = "*i32" if varlen else "*fp32"
    lists = "*i32" if sparse else "*fp32"  # the mask's int32 lists, or the LSE as their stand-in
    pointers = {
        "DK": grads, "DV": grads, "LSE": "*fp32", "DELTA": "*fp32", "ALIBI": "*fp32", "CU_Q": cu, "CU_K": cu,
        "GDZ": "*fp32", "ZB": "*fp32", **dict.fromkeys(("COUNT", "INDEX", "KIND", "BITS", "ORDER"), lists),
    }  # fmt: skip
    options = {"num_warps": hb.NUM_WARPS, "maxnreg": hb.MAX_REGISTERS}
    return _compile_gluon(hb._fused_bwd_kernel, descs, consts, pointers, options, target)


def compile_fused_forward(
    causal: bool, group: int = 1, out_dtype: str = "bf16", softcap: bool = False, alibi: bool = False,
    head_dim: int = 128, window: bool = False, varlen: bool = False, target: GPUTarget = HOPPER,
    tensor_dim: int | None = None, memory: bool = False, sparse: bool = False,
) -> triton.compiler.CompiledKernel:  # fmt: skip
    """Build hopper/forward.py's Gluon kernel for ``target`` as a bf16 launch makes it, writing its
    output in ``out_dtype`` ("fp32": the ring's block buffers), with or without a softcap, ALiBi,
    a left window bound (``window``) and packed documents (``varlen``); with ``tensor_dim`` below
    head_dim, on tensors of a head_dim between two builds. ``memory``: the MEMORY epilogue
    (Infini-attention's retrieval; packed segments at head_dim 128). ``sparse``: the walk over a
    block mask's lists (SPARSE, block_lists.py)."""
    import torch

    from .hopper import forward as hf
    from .hopper import query_tiles as qt
    from .hopper.infini_updates import matrix_descriptor

    block_n = hf.BLOCK_N[head_dim]
    kv = _example_descriptor(1, block_n, head_dim=head_dim, tensor_dim=tensor_dim)
    q = _example_descriptor(group, qt.HALF_M, head_dim=head_dim, tensor_dim=tensor_dim)
    m = matrix_descriptor(torch.empty(1, 1, 128, 128, dtype=torch.bfloat16)) if memory else q
    descs = dict(q_desc=q, k_desc=kv, v_desc=kv, m_desc=m, o_desc=q, out_desc=q)
    consts = dict(
        GROUP=group, BLOCK_M=qt.BLOCK_M, BLOCK_N=block_n, HEAD_DIM=head_dim,
        TENSOR_DIM=tensor_dim or head_dim, VARLEN=varlen, HAS_LEFT=window, HAS_RIGHT=causal,
        SOFTCAP=softcap, HAS_ALIBI=alibi, Q_STAGES=hf.Q_STAGES[head_dim], MEMORY=memory, SPARSE=sparse,
        **_UNIT_STRIDES,
    )  # fmt: skip
    if varlen:
        consts["n_b"] = 1  # a packed grid's one sequence, specialized as a launch does
    lists = "*i32" if sparse else "*fp32"  # the mask's int32 lists, or the LSE as their stand-in
    pointers = {
        "O": f"*{out_dtype}", "LSE": "*fp32", "ALIBI": "*fp32", "CU_Q": "*i32", "CU_K": "*i32",
        "TILE_COUNTER": "*i32", "OUT": f"*{out_dtype}" if memory else "*fp32", "Z": "*fp32", "GATE": "*fp32",
        "COUNT": lists, "INDEX": lists, "KIND": lists, "BITS": lists,
    }  # fmt: skip
    options = {"num_warps": qt.NUM_WARPS, "maxnreg": qt.MAX_REGISTERS}
    return _compile_gluon(hf._fused_fwd_kernel, descs, consts, pointers, options, target)


def compile_fused_dq(
    causal: bool, group: int = 1, dq_dtype: str = "bf16", softcap: bool = False, alibi: bool = False,
    head_dim: int = 256, window: bool = False, varlen: bool = False, accumulate: bool = False,
    target: GPUTarget = HOPPER, tensor_dim: int | None = None,
) -> triton.compiler.CompiledKernel:  # fmt: skip
    """Build hopper/dq.py's Gluon kernel for ``target`` as a bf16 launch makes it, writing dQ in
    ``dq_dtype`` (added to it with ``accumulate``), with the masks and score options of
    ``compile_fused_forward``."""
    from .hopper import dq as hdq
    from .hopper import query_tiles as qt

    block_n = hdq.BLOCK_N[head_dim]
    kv = _example_descriptor(1, block_n, head_dim=head_dim, tensor_dim=tensor_dim)
    q = _example_descriptor(group, qt.HALF_M, head_dim=head_dim, tensor_dim=tensor_dim)
    descs = dict(q_desc=q, k_desc=kv, v_desc=kv, do_desc=q)
    consts = dict(
        GROUP=group, BLOCK_M=qt.BLOCK_M, BLOCK_N=block_n, HEAD_DIM=head_dim,
        TENSOR_DIM=tensor_dim or head_dim, VARLEN=varlen, HAS_LEFT=window, HAS_RIGHT=causal,
        SOFTCAP=softcap, HAS_ALIBI=alibi, ACCUMULATE=accumulate, **_UNIT_STRIDES,
    )  # fmt: skip
    pointers = {
        "DQ": f"*{dq_dtype}", "LSE": "*fp32", "DELTA": "*fp32", "ALIBI": "*fp32", "CU_Q": "*i32",
        "CU_K": "*i32",
    }  # fmt: skip
    options = {"num_warps": qt.NUM_WARPS, "maxnreg": qt.MAX_REGISTERS}
    return _compile_gluon(hdq._dq_kernel, descs, consts, pointers, options, target)


def compile_infini_retrieval_backward(target: GPUTarget = HOPPER) -> triton.compiler.CompiledKernel:
    """Build hopper/infini_retrieval.py's Gluon kernel for ``target`` as a launch makes it (bf16,
    head_dim 128; one build for every group of query heads)."""
    import torch

    from .hopper import infini_retrieval as hir

    q = torch.empty(1, 1024, 1, 128, dtype=torch.bfloat16)
    m = torch.empty(1, 8, 1, 128, 128, dtype=torch.bfloat16)
    descs = dict(zip(("q_desc", "do_desc", "m_desc", "lo_desc"), hir.descriptors(q, q, m, q)))
    pointers = {name: "*fp32" for name in ("DQ", "Z", "GATE", "GGATE", "DELTA", "GM", "GZ")}
    options = {"num_warps": 4, "maxnreg": hir.MAX_REGISTERS}
    consts = dict(LOCAL_DELTA=True)
    return _compile_gluon(hir.retrieval_backward_kernel, descs, consts, pointers, options, target)


def compile_infini_retrieval(target: GPUTarget = HOPPER) -> triton.compiler.CompiledKernel:
    """Build hopper/infini_retrieval.py's forward kernel for ``target`` as a launch makes it
    (bf16, head_dim 128; one build for every group of query heads)."""
    import torch

    from .hopper import infini_retrieval as hir
    from .hopper.infini_updates import matrix_descriptor, token_descriptor

    q = torch.empty(1, 1024, 1, 128, dtype=torch.bfloat16)
    m = torch.empty(1, 8, 1, 128, 128, dtype=torch.bfloat16)
    descs = {name: token_descriptor(q, 128)[0] for name in ("q_desc", "lo_desc", "out_desc")}
    descs["m_desc"] = matrix_descriptor(m)
    pointers = {"OUT": "*bf16", "Z": "*fp32", "GATE": "*fp32"}
    options = {"num_warps": 4, "maxnreg": hir.MAX_REGISTERS}
    return _compile_gluon(hir.retrieval_kernel, descs, {}, pointers, options, target)


def compile_infini_updates(
    updates: bool = True, gram: bool = False, target: GPUTarget = HOPPER
) -> triton.compiler.CompiledKernel:  # fmt: skip
    """Build hopper/infini_updates.py's Gluon kernel for ``target`` as a launch makes it (bf16,
    head_dim 128): the updates, the delta rule's Gram matrices, or both."""
    import torch

    from .hopper import infini_updates as hiu

    k = torch.empty(1, 1024, 1, 128, dtype=torch.bfloat16)
    descs = {"k_desc": hiu.token_descriptor(k, 64)[0], "v_desc": hiu.token_descriptor(k, 128)[0]}
    pointers = {"DM": "*fp32", "DZ": "*fp32", "Z": "*fp32", "A": "*bf16"}
    options = {"num_warps": 4, "maxnreg": hiu.MAX_REGISTERS}
    consts = {"UPDATES": updates, "GRAM": gram}
    return _compile_gluon(hiu.updates_kernel, descs, consts, pointers, options, target)


def compile_infini_updates_backward(target: GPUTarget = HOPPER) -> triton.compiler.CompiledKernel:
    """Build hopper/infini_updates.py's backward kernel for ``target`` as a launch makes it (bf16,
    head_dim 128, dk and dv in bf16)."""
    import torch

    from .hopper import infini_updates as hiu
    from .hopper.infini_updates import TensorDescriptor, gl

    k = torch.empty(1, 1024, 1, 128, dtype=torch.bfloat16)
    g = torch.empty(1024, 128, dtype=torch.bfloat16)
    g_layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16)
    descs = {
        **{name: hiu.token_descriptor(k, 128)[0] for name in ("k_desc", "v_desc", "dk_desc", "dv_desc")},
        "g_desc": TensorDescriptor(g, [1024, 128], [128, 1], [128, 128], g_layout),
    }  # fmt: skip
    pointers = {"GZ": "*fp32", "DK": "*bf16", "DV": "*bf16"}
    options = {"num_warps": 4, "maxnreg": hiu.MAX_REGISTERS}
    return _compile_gluon(hiu.updates_backward_kernel, descs, {}, pointers, options, target)


def compile_infini_gram_den(target: GPUTarget = HOPPER) -> triton.compiler.CompiledKernel:
    """Build hopper/infini_gram_den.py's Gluon kernel for ``target`` as a launch makes it (bf16,
    head_dim 128)."""
    import torch

    from .hopper import infini_gram_den as hgd
    from .hopper.infini_updates import matrix_descriptor, token_descriptor

    k = torch.empty(1, 1024, 1, 128, dtype=torch.bfloat16)
    s = torch.empty(1, 8, 1, 128, 128, dtype=torch.bfloat16)
    descs = {"k_desc": token_descriptor(k, 128)[0], "s_desc": matrix_descriptor(s)}
    pointers = {"Z": "*fp32", "PARTS": "*fp32"}
    options = {"num_warps": 4, "maxnreg": hgd.MAX_REGISTERS}
    return _compile_gluon(hgd.gram_den_kernel, descs, {}, pointers, options, target)


def disassemble(compiled: triton.compiler.CompiledKernel, target: GPUTarget = HOPPER) -> str:
    """The SASS that Triton's ptxas and nvdisasm make of the kernel's PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin, _ = _assemble(compiled, target, tmp)
        nvdisasm = triton.knobs.nvidia.nvdisasm.path  # Triton's own (TRITON_NVDISASM_PATH overrides)
        return subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout


def serialized_wgmma(sass: str) -> bool:
    """Whether ptxas serialized the kernel's wgmma: a wait for all groups (``WARPGROUP.DEPBAR.LE
    gsb0, 0x0``) after every HGMMA. It does so silently at times (no C7512 in its log); the fused
    backward lost 8-13% of its causal speed that way until a profile showed it."""
    return sass.count("HGMMA") > 0 and sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") >= sass.count("HGMMA")


def wgmma_operands(sass: str) -> tuple[int, int]:
    """(HGMMA with the A operand in registers, all HGMMA) in a kernel's SASS: an A operand read
    from shared memory shows as a ``gdesc[...]`` descriptor in the first source slot."""
    lines = [line for line in sass.splitlines() if "HGMMA." in line]
    sources = [line.split("HGMMA", 1)[1].split(",")[1].strip() for line in lines]
    return sum(1 for x in sources if x.startswith("R")), len(sources)


def _sass_loops(sass: str) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """A SASS listing's (address, line) instructions and its loops as (first, last) addresses:
    the targets and sources of its backward branches."""
    labels, pending, instrs = {}, None, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        addr = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if label:
            pending = label.group(1)
        elif addr:
            a = int(addr.group(1), 16)
            if pending:
                labels[pending], pending = a, None
            instrs.append((a, line))
    back = [
        (labels[m.group(1)], a)
        for a, line in instrs
        if (m := re.search(r"BRA[^`]*`\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), a) < a
    ]
    return instrs, back


def _spills(instrs: list[tuple[int, str]], lo: int, hi: int) -> tuple[int, int]:
    inside = [line for a, line in instrs if lo <= a <= hi]
    return sum("STL" in x for x in inside), sum("LDL" in x for x in inside)


def loop_spills(sass: str) -> tuple[int, int]:
    """(spill stores, spill loads) per thread inside a kernel's main loop: STL/LDL instructions
    between the target and the source of its longest backward branch, in its SASS
    (``disassemble``). ``resource_usage`` counts spills anywhere; a spill outside the loop costs
    once per program, one inside it once per tile."""
    instrs, back = _sass_loops(sass)
    return _spills(instrs, *max(back, key=lambda r: r[1] - r[0]))


def tile_loop_spills(sass: str, min_instructions: int = 200) -> tuple[int, int]:
    """The most (spill stores, spill loads) per thread in any innermost loop of at least
    ``min_instructions`` SASS instructions: the tile loops of a persistent kernel, whose longest
    loop is the one over work items (a spill there costs once per item)."""
    instrs, back = _sass_loops(sass)
    inner = [
        (lo, hi)
        for lo, hi in back
        if not any(lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi) for l2, h2 in back)
        and sum(lo <= a <= hi for a, _ in instrs) >= min_instructions
    ]
    counts = [_spills(instrs, lo, hi) for lo, hi in inner]
    return max(c[0] for c in counts), max(c[1] for c in counts)
