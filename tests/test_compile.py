"""The attention kernels compile for Hopper (sm_90) on any machine, with the integer arguments
that Triton specializes at launch (a value of 1 becomes a compile-time constant).

The CPU tests run the kernels under the Triton interpreter, which never specializes, so a kernel
that is correct there can still fail to compile on a GPU (e.g. reassigning an argument that
arrived as the constant 1). Compiling for a GPU target needs no GPU: Triton ships ptxas. The
check runs in a subprocess because the test process imports the kernels in interpreter mode.
The same build also gives each tile config's shared memory, checked against the chip's limit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ringflash.kernels.hopper.dispatch import GLUON_UNVALIDATED_VARIABLE, GLUON_VALIDATED, gluon_validated
from ringflash.kernels.offline_compile import GLUON_BUILDS, gluon_build

# Run once per kernel (argv[1]: a KERNELS key), so that pytest -n spreads the builds.
_SPECIALIZED = r"""
import itertools, sys
from ringflash.kernels.offline_compile import KERNELS, compile_kernel

# Integer arguments that can arrive as 1 (positions of a stripe, a one-token sequence).
ONES = ("q_start0", "q_stride", "k_start0", "k_stride", "q_per_len", "k_per_len", "seqlen_q", "seqlen_k")
OFF = dict(softcap_log2=None, ALIBI=None)

# Dense unmasked without softcap and ALiBi (whose arguments a launch then passes as None),
# and varlen with window bounds, 64-bit tile offsets, softcap and ALiBi: each with and without
# the specializations.
kernel = KERNELS[sys.argv[1]]
for ones, varlen in itertools.product(((), ONES), (False, True)):
    window = features = varlen
    compile_kernel(
        kernel,
        dict(GROUP=2, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, IS_VARLEN=varlen,
             HAS_LEFT=window, HAS_RIGHT=window, DOT_PRECISION="tf32", ACCUMULATE=varlen, WIDE=varlen,
             HAS_SOFTCAP=features, HAS_ALIBI=features, **({} if features else OFF)),
        ones,
    )
print("compiled")
"""

# Every bf16/fp16 GPU tile config of the table, as launched, must fit in an H100/H200's shared
# memory: otherwise only a GPU launch would tell. (The fp32 tiles compile to FMA code, up to 76 s
# each here; all 9 fit, 145 KiB at most, checked on 2026-11-23 with table_launch(fp32=True).)
_TABLE = r"""
import sys
from ringflash.kernels.offline_compile import (
    SHARED_MEMORY_LIMIT, compile_kernel, resource_usage, table_launch,
)

name = sys.argv[1]  # run once per kernel
for head_dim in (64, 128, 256):
    kernel, constexprs, cfg = table_launch(name, head_dim, causal=True)
    k = compile_kernel(kernel, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert k.metadata.shared <= SHARED_MEMORY_LIMIT[90], (name, head_dim, cfg, k.metadata.shared)
    if (name, head_dim) == ("forward", 64):
        use = resource_usage(k)  # ptxas -v, read back
        assert 0 < use.registers <= 255 and use.spill_bytes >= 0, use
    print(name, head_dim, cfg, k.metadata.shared)
print("fits")
"""


# The fused Hopper backward (kernels/hopper/backward.py) must keep building for sm_90: its TMA
# reduce-add comes from Triton's IR builder, not a public API. Compute warps at 240 registers and
# the two 1-warp workers at 24, one TMA reduce-add group per dQ tile, one tile loop (5 x 8 wgmma
# per warpgroup at head_dim 128, 5 x 8 minus the halved dQ products at 64, causal or not; three
# in the masked variant without GQA, softcap or ALiBi) whose wgmma ptxas did not serialize, and
# few registers reloaded from local memory per tile: an address or two unmasked, more with GQA's
# per-head loop and softcap + ALiBi (the worst before its logits were reordered: 37, at a 30% loss
# of backward speed); the masked loops of the three-loop variant reload 19 at head_dim 128, 60
# with runtime position strides (they run only the edge tiles). At head_dim 256 (64 x 64 tiles)
# dK and dV only (dQ: hopper/dq.py, below): 40 wgmma per tile loop (S^T and dP^T 16 k-steps
# each, dV and dK 4 each), one tile loop for every mask, and 0-4 reloads.
# (causal, group, accumulate, softcap + ALiBi, head_dim, mask, most loop spills) as measured on
# 2026-11-24 (docs in the module); mask: "" none or DIAGONAL (causal alone), "tail" lengths not
# multiples of the tiles, "left" a window's left bound, "varlen" packed documents; "t96"/"t192":
# tensors of that head_dim at this build, read through (rows, heads, head_dim) descriptors (3D
# TMA; 2026-11-25: a few spills more than the build's own, from the column masks); "memory"
# (Infini-attention's MEMORY epilogue, "gram" with the delta rule's terms; 2026-11-26: 24 / 29
# in all, dV's store issued before dK's terms, 26 / 33 with sigma's e^x as exp2 (fewer
# instructions); the tile loops 0 / 0, 3 / 8, 1 / 5 as without).
# The bounds are 3.6's; Triton 3.9's builds (2026-11-28, assembled by its ptxas 13.4 as a launch
# does) have the same wgmma, registers and operands, but where they spill more their own bounds
# (MOST, TILE_MOST). At head_dim 64 3.9 copies S^T's and dP^T's K and V (register A operands) with
# a mov before each wgmma (triton-lang/triton#9514), which made ptxas 13.4 serialize all 24 wgmma
# (C7513) until the compute warps retired the previous tile's dK before dP^T's copy of V
# (hopper/backward.py ``_dk_retired_before_dpt``, 2026-11-28: then 2 full waits per build as under
# 3.6, operands and spills unchanged).
_FUSED = r"""
import re, sys
from ringflash.kernels.offline_compile import (
    SHARED_MEMORY_LIMIT, compile_fused_backward, disassemble, gluon_build, loop_spills, serialized_wgmma,
    tile_loop_spills, wgmma_operands,
)

CASES = {
    "plain": [
        (False, 1, False, False, 128, "", 2), (True, 1, True, False, 128, "", 2),
        (True, 4, True, False, 128, "", 6), (False, 1, False, True, 128, "", 8),
    ],
    "masked": [
        (True, 1, False, False, 128, "tail", 20), (True, 1, False, False, 128, "left", 20),
        (True, 4, True, False, 128, "left varlen", 10), (True, 1, False, True, 128, "varlen", 6),
        (True, 1, False, False, 128, "left strides", 64), (True, 1, False, False, 128, "varlen memory", 34),
        (True, 1, False, False, 128, "varlen memory gram", 34),
        (False, 1, False, False, 64, "", 0),
        (True, 2, True, False, 64, "left varlen", 0), (False, 1, False, True, 64, "tail", 0),
        (True, 2, True, True, 64, "left varlen ones", 0),
    ],
    "d256": [
        (False, 1, False, False, 256, "", 0), (True, 4, True, False, 256, "", 0),
        (True, 1, False, True, 256, "", 0), (True, 1, False, False, 256, "tail", 0),
        (True, 4, True, False, 256, "left varlen", 2), (False, 1, False, True, 256, "varlen", 0),
        (True, 1, False, False, 256, "left strides", 6), (True, 2, True, True, 256, "left varlen ones", 6),
    ],
    "between": [
        (False, 1, False, False, 128, "t96", 2), (True, 4, True, False, 128, "t96", 12),
        (True, 1, False, False, 128, "t96 left varlen", 20), (False, 4, False, False, 256, "t192", 18),
        (True, 1, False, False, 256, "t192 varlen", 24),
    ],
}[sys.argv[1]]
RELEASE = gluon_build()
# Triton 3.9 (2026-11-28), cases whose loop spills exceed 3.6's bounds: the most measured, stores /
# loads (3.6's in brackets). The other cases stay within them (most spill the same or less).
MOST = {
    "3.9.": {
        (True, 4, True, False, 128, ""): 9,  # GQA: 9 / 8 (5 / 5)
        (True, 4, True, False, 128, "left varlen"): 13,  # 10 / 13 (4 / 4)
        (True, 1, False, True, 128, "varlen"): 13,  # softcap + ALiBi: 9 / 13 (6 / 6)
        (True, 1, False, False, 128, "left strides"): 75,  # masked loops: 69 / 75 (51 / 53)
        (True, 1, False, False, 128, "t96 left varlen"): 25,  # masked loops: 18 / 25 (11 / 14)
    },
}.get(RELEASE, {})
# MEMORY's tile loops, stores and loads: 3.9 spills 4 / 8 in both variants (3.6: 3 / 8).
TILE_MOST = {"3.9.": (4, 8)}.get(RELEASE, (3, 8))
# "ones": every integer argument that a launch can specialize to the constant 1 (one-token
# sequences, unit strides and offsets, a window of 1): the kernel must not reassign them.
# "strides": positions with runtime strides (stripes); otherwise unit strides, as most launches.
ONES = (
    "q_stride", "k_stride", "seqlen_q", "seqlen_k", "win_left", "win_right", "q_per_len", "k_per_len",
    "q_start0", "k_start0", "stride_lh", "q_batch_rows",
)
for causal, group, accumulate, softcap, head_dim, mask, most in CASES:
    most = MOST.get((causal, group, accumulate, softcap, head_dim, mask), most)
    tensor_dim = next((int(w[1:]) for w in mask.split() if w[0] == "t" and w[1:].isdigit()), None)
    mask = " ".join(w for w in mask.split() if not (w[0] == "t" and w[1:].isdigit()))
    k = compile_fused_backward(
        causal, group, accumulate, softcap, alibi=softcap, head_dim=head_dim, left="left" in mask,
        varlen="varlen" in mask, tail="tail" in mask, memory="memory" in mask, gram="gram" in mask,
        ones=ONES if "ones" in mask else () if "strides" in mask else ONES[:2], tensor_dim=tensor_dim,
    )
    case = (causal, group, softcap, head_dim, mask)
    ptx = k.asm["ptx"]
    regs = sorted(set(int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    assert regs == [24, 240], regs
    assert ("cp.async.bulk.tensor.3d" in ptx) == (tensor_dim is not None), case
    # One TMA reduce-add per dQ tile, or at head_dim 256 no dQ (hopper/dq.py's kernel); no atomics.
    # MEMORY: also dK's and dV's TMA stores of a whole key tile (a group each).
    dkdv_only = head_dim == 256
    stores = 2 if "memory" in mask else 0
    assert ptx.count("cp.async.bulk.commit_group") == (0 if dkdv_only else 1) + stores, case
    assert "atom.global" not in ptx, case
    # MASKED without GQA, softcap or ALiBi: masked edges, unmasked middle, masked edges (3 loops).
    loops = 3 if mask and group == 1 and not softcap and not dkdv_only else 1
    # MEMORY (Infini-attention's updates' backward in the epilogue): sigma(K) gdM and V gdM^T,
    # K = 128, both operands from shared memory; GRAM (the delta rule) also sigma(K) S.
    memory = (24 if "gram" in mask else 16) if "memory" in mask else 0
    wgmma = ptx.count("wgmma.mma_async")
    assert wgmma == loops * {64: 24, 128: 32, 256: 40}[head_dim] + memory, wgmma
    assert ("tanh.approx.f32" in ptx) == softcap
    # Hand-overs back to the workers: at head_dim 64 by named barriers, where the compute warps
    # arrive without waiting (two per tile loop), elsewhere by mbarriers (hopper/backward.py).
    assert ptx.count("bar.arrive") == (2 * loops if head_dim == 64 else 0), case
    sass = disassemble(k)
    assert not serialized_wgmma(sass), case
    # dV and dK take P^T and dS^T from registers (not under SPLIT_N, head_dim 256); at head_dim
    # 64 S^T and dP^T take K and V from them too: all but dQ's 8 k-steps per loop.
    in_regs, hgmma = wgmma_operands(sass)
    expected = {64: hgmma - 8 * loops, 128: (hgmma - memory) // 4, 256: 0}[head_dim]
    assert in_regs == expected, (case, in_regs, hgmma)
    stores, loads = loop_spills(sass)
    assert stores <= most and loads <= most, (case, stores, loads)
    if "memory" in mask:  # the MEMORY epilogue's spills come once per program: the tile loops'
        tile_stores, tile_loads = tile_loop_spills(sass)  # are the build's without it
        assert tile_stores <= TILE_MOST[0] and tile_loads <= TILE_MOST[1], (case, tile_stores, tile_loads)
    assert k.metadata.shared <= SHARED_MEMORY_LIMIT[90], k.metadata.shared
print("fused ok")
"""

# Which problems the Hopper kernels compute (they import only outside the interpreter).
_SUPPORTS = r"""
import dataclasses, torch
from ringflash.kernels.hopper import backward as hb
from ringflash.kernels.positions import MaskBounds, TokenPositions
from ringflash.kernels.problem import AttentionProblem

base = AttentionProblem(
    1, 4, 2, 64, 100, 50, 0.1, MaskBounds(None, 0), TokenPositions(-50), TokenPositions(0), None, None
)
def ok(**kw):
    return hb.backward_supports(dataclasses.replace(base, **kw))
assert ok() and ok(head_dim=128) and ok(head_dim=256)
assert ok(bounds=MaskBounds(4096, 0), k_positions=TokenPositions(1, 2, -1))
assert ok(head_dim=96) and ok(head_dim=192)  # at the next build (dispatch.run_head_dim)
assert not ok(head_dim=32) and not ok(head_dim=512)
from ringflash.kernels.hopper import forward as hf
assert all(hf.forward_supports(dataclasses.replace(base, head_dim=d)) for d in (64, 96, 128, 192, 256))
assert not hf.forward_supports(dataclasses.replace(base, head_dim=32))
from ringflash.kernels.hopper import dq as hdq
dims = (64, 96, 128, 136, 192, 256)
assert [d for d in dims if hdq.dq_supports(dataclasses.replace(base, head_dim=d))] == [136, 192, 256]
assert [d for d in (64, 128, 136, 256) if hb.computes_dq(dataclasses.replace(base, head_dim=d))] == [64, 128]
assert not ok(q_positions=TokenPositions(2**30)) and not ok(bounds=MaskBounds(2**30, 0))
assert not ok(q_positions=TokenPositions(0, 2**24, -1))  # 100 tokens 2^24 apart: past POSITION_LIMIT
slopes = torch.ones(1, 4)
assert ok(alibi_slopes=slopes) and not ok(alibi_slopes=slopes, q_positions=TokenPositions(2**22))
print("supports ok")
"""

# The warp-specialized Hopper forward (kernels/hopper/forward.py): persistent (one atomic claim
# of the next work item), both compute warpgroups at 240 registers and the loader at 24, wgmma
# never serialized, shared memory within the chip's, and at most a few spilled scalars in a
# key-tile loop (2026-11-25: 0-3 stores and 0-5 loads per tile, the most masks at once). Built:
# the most masks at once (packed documents, causal window, GQA, float32 out), head_dim 256 with
# softcap and ALiBi (64-row key tiles), head_dim 64 dense, and tensors of head_dim 96 and 192 at
# the 128 and 256 builds (3D TMA, zero-filled columns).
_FORWARD = r"""
import re
from ringflash.kernels.offline_compile import (
    SHARED_MEMORY_LIMIT, compile_fused_forward, disassemble, gluon_build, serialized_wgmma, tile_loop_spills,
    wgmma_operands,
)
from ringflash.kernels.hopper.forward import BLOCK_N

# Builds whose key-tile loops spill more under another release: (build, (stores, loads) most). Triton
# 3.9 (2026-11-28): head_dim-96 tensors at the 128 build with a window and packed documents reload
# 22 per key tile (2 stores; 3.6: 2 / 3); the other builds spill as much or less than under 3.6.
TILE_MOST = {
    "3.9.": [(dict(causal=False, head_dim=128, tensor_dim=96, window=True, varlen=True), (4, 22))],
}.get(gluon_build(), [])

for kw in (
    dict(causal=True, window=True, varlen=True, group=4, out_dtype="fp32"),
    dict(causal=True, head_dim=256, softcap=True, alibi=True),
    dict(causal=False, head_dim=64),
    dict(causal=False, head_dim=128, tensor_dim=96, window=True, varlen=True),
    dict(causal=True, head_dim=256, tensor_dim=192),
    dict(causal=True, varlen=True, group=4, memory=True),
):
    k = compile_fused_forward(**kw)
    ptx = k.asm["ptx"]
    assert ("tanh.approx.f32" in ptx) == kw.get("softcap", False)
    assert ("cp.async.bulk.tensor.3d" in ptx) == ("tensor_dim" in kw), kw
    assert len(re.findall(r"atom\.global\S*\.add", ptx)) == 1, kw
    regs = set(int(r) for r in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx))
    assert {24, 240} <= regs, regs
    sass = disassemble(k)
    assert not serialized_wgmma(sass), kw
    # P V (block_n / 16 k-steps) takes P from registers; at head_dim 64 QK^T (head_dim / 16)
    # takes Q from them too; with memory the retrieval's sigma(q) M (8 per warpgroup) its sigma(q).
    in_regs, hgmma = wgmma_operands(sass)
    d = kw.get("head_dim", 128)
    pv = BLOCK_N[d] // 16
    retrieval = 16 if kw.get("memory") else 0
    attention = hgmma - retrieval
    want = attention if d == 64 else attention * pv // (pv + d // 16)
    assert in_regs == want + retrieval, (kw, in_regs, hgmma)
    # the retrieval's two outputs go out by TMA (st.global only where a half is cut by its sequence)
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == kw.get("memory", False), kw
    stores, loads = tile_loop_spills(sass)
    most_stores, most_loads = next((most for build, most in TILE_MOST if build == kw), (4, 8))
    assert stores <= most_stores and loads <= most_loads, (kw, stores, loads)
    assert k.metadata.shared <= SHARED_MEMORY_LIMIT[90], k.metadata.shared
print("forward ok")
"""


# What a warp-specialized build of the Gluon kernels must show (prepended to the scripts below):
# its wgmma count, the compute (240) and loader (24) register budgets, no serialized wgmma, at most
# so many spill stores and loads in its loops, shared memory within the chip's.
_WARP_SPECIALIZED = r"""
import re
from ringflash.kernels.offline_compile import (
    SHARED_MEMORY_LIMIT, disassemble, gluon_build, loop_spills, serialized_wgmma,
)

RELEASE = gluon_build()


def check_build(k, wgmma, max_stores, max_loads, what):
    ptx = k.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == wgmma, (what, ptx.count("wgmma.mma_async"))
    regs = set(int(r) for r in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx))
    assert {24, 240} <= regs, (what, regs)
    sass = disassemble(k)
    assert not serialized_wgmma(sass), what
    stores, loads = loop_spills(sass)
    assert stores <= max_stores and loads <= max_loads, (what, stores, loads)
    assert k.metadata.shared <= SHARED_MEMORY_LIMIT[90], (what, k.metadata.shared)
    return ptx
"""

# The dQ kernel of the head_dim-256 build (kernels/hopper/dq.py): the forward's programs with Q
# and dO resident and 32-row K/V tiles; per tile S, dP (16 k-steps each) and dQ (2), in the
# forward's three span loops of both compute warpgroups (204 wgmma), none serialized, within
# shared memory, few reloads (2026-11-25: 0-4 loads per tile, 11 with softcap and ALiBi).
_DQ = _WARP_SPECIALIZED + r"""
from ringflash.kernels.offline_compile import compile_fused_dq

for kw in (
    dict(causal=False),
    dict(causal=True, window=True, varlen=True, group=4, dq_dtype="fp32", accumulate=True),
    dict(causal=True, softcap=True, alibi=True),
    dict(causal=True, tensor_dim=192),
):
    ptx = check_build(compile_fused_dq(**kw), 204, 8, 16, kw)
    assert ("tanh.approx.f32" in ptx) == kw.get("softcap", False)
    assert ("cp.async.bulk.tensor.3d" in ptx) == ("tensor_dim" in kw), kw
    assert "atom.global" not in ptx, kw
print("dq ok")
"""

# Infini-attention's Hopper kernels. The retrieval (hopper/infini_retrieval.py): per 64-token
# block and warpgroup sigma(q) M (8 wgmma, K = 128), no spills. Its backward: per step
# and warpgroup six products, dout M^T in two halves (2 x 8 wgmma, K = 128), the memory's and z's
# gradients over two token halves (2 x 4 each, K = 64), none serialized, within shared memory;
# the compute warpgroups' 240 registers spill (2026-11-26: 85 stores and 91 loads in the loops).
# The group of query heads is a runtime loop: one build. The memory updates
# (hopper/infini_updates.py): per 64-token block and warpgroup sigma(K)^T V and sigma(K)^T 1 (4
# wgmma each, K = 64), no spills, and the delta rule's Gram build the same (two 64-column
# halves of (w sigma(K))^T sigma(K), A_s stored in bf16 after a layout conversion: stored from
# the products' registers, ptxas serialized all 16); their backward: sigma(K) gdM and V gdM^T (8
# wgmma each, K = 128), 24 spill stores and 32 loads in the loops (2026-11-26). The delta rule's z
# gradient (hopper/infini_gram_den.py): sigma(K) S (8 wgmma, K = 128), 14 spill stores and 15
# loads in the loop (2026-11-26: sigma(K), P and the token sum in float32 registers).
_INFINI = _WARP_SPECIALIZED + r"""
from ringflash.kernels import offline_compile as oc

check_build(oc.compile_infini_retrieval(), 2 * 8, 0, 0, "retrieval")
check_build(oc.compile_infini_retrieval_backward(), 2 * (2 * 8 + 2 * 4 + 2 * 4), 95, 95, "backward")
check_build(oc.compile_infini_updates(), 2 * (4 + 4), 0, 0, "updates")
check_build(oc.compile_infini_updates(updates=False, gram=True), 2 * (4 + 4), 0, 0, "gram")
check_build(oc.compile_infini_updates(gram=True), 2 * (4 + 4 + 4 + 4), 0, 0, "updates and gram")
check_build(oc.compile_infini_updates_backward(), 2 * (8 + 8), 40, 40, "updates backward")
# Triton 3.9 (2026-11-28): the z gradient's loop spills 32 stores and 34 loads (3.6: 13 / 14).
check_build(oc.compile_infini_gram_den(), 2 * 8, *{"3.9.": (32, 34)}.get(RELEASE, (16, 16)), "gram den")
print("infini ok")
"""


def _compile_in_subprocess(script: str, tmp_path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    run = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=900
    )
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("this Triton install has no ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


KERNEL_NAMES = ["forward", "dkdv", "dq"]  # offline_compile.KERNELS, each built in its own test


def test_kernel_names_are_every_kernel():
    from ringflash.kernels.offline_compile import KERNELS

    assert sorted(KERNELS) == sorted(KERNEL_NAMES)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_kernels_compile_for_sm90_with_specialized_arguments(tmp_path, kernel):
    assert _compile_in_subprocess(_SPECIALIZED, tmp_path, kernel).strip().endswith("compiled")


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_table_configs_fit_sm90_shared_memory(tmp_path, kernel):
    out = _compile_in_subprocess(_TABLE, tmp_path, kernel)
    assert out.strip().endswith("fits")
    assert len(out.strip().splitlines()) == 3 + 1  # every head_dim ran


GLUON = pytest.mark.skipif(
    gluon_build() is None,
    reason=f"the Gluon kernels build with Triton {', '.join(b + 'x' for b in GLUON_BUILDS)} only "
    "(offline_compile.GLUON_BUILDS)",
)
# The fused kernels' whole builds (about 230 s of CPU) run under the release that the GPUs run them
# with (dispatch.GLUON_VALIDATED), or under another of GLUON_BUILDS where RINGFLASH_GLUON_UNVALIDATED=1
# is set, as for the GPU run that validates it. Elsewhere the dQ kernel's build stands in as a
# canary of Gluon's API.
GLUON_VALIDATED = pytest.mark.skipif(
    gluon_build() is None or not gluon_validated(),
    reason=f"the fused Gluon kernels' builds run under Triton {', '.join(b + 'x' for b in GLUON_VALIDATED)}"
    f" (dispatch.GLUON_VALIDATED), or with {GLUON_UNVALIDATED_VARIABLE}=1",
)


@GLUON_VALIDATED
@pytest.mark.parametrize("cases", ["plain", "masked", "d256", "between"])
def test_fused_backward_compiles_for_sm90(tmp_path, cases):
    assert _compile_in_subprocess(_FUSED, tmp_path, cases).strip().endswith("fused ok")


@GLUON
def test_hopper_kernels_support(tmp_path):
    assert _compile_in_subprocess(_SUPPORTS, tmp_path).strip().endswith("supports ok")


@GLUON_VALIDATED
def test_fused_forward_compiles_for_sm90(tmp_path):
    assert _compile_in_subprocess(_FORWARD, tmp_path).strip().endswith("forward ok")


@GLUON
def test_dq_kernel_compiles_for_sm90(tmp_path):
    assert _compile_in_subprocess(_DQ, tmp_path).strip().endswith("dq ok")


def test_tile_config_parse():
    from ringflash.kernels.configs import TileConfig

    assert TileConfig.parse("64,128,8,3") == TileConfig(64, 128, 8, 3)
    for bad in ("64,64,8", "64,64,8,2,3", "a,64,8,2", "48,64,8,2", "64,8,4,2", "64,64,6,2", "64,64,8,0"):
        with pytest.raises(ValueError):
            TileConfig.parse(bad)


@GLUON_VALIDATED
def test_infini_hopper_kernels_compile_for_sm90(tmp_path):
    assert _compile_in_subprocess(_INFINI, tmp_path).strip().endswith("infini ok")
