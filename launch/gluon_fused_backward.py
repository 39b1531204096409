"""Experiment: an FA3-style fused attention backward in Gluon (Triton 3.6), for Hopper.

Not used by the library. Our Triton backward (``ringflash.kernels``) runs 7 matrix products per
tile pair because its dQ kernel recomputes QK^T and dP; cuDNN runs 5. This kernel runs 5: one
program per (key tile, head, sequence) keeps K/V in shared memory, streams Q/dO tiles in by TMA
(two stages, mbarriers), issues S^T = K Q^T and dP^T = V dO^T as async wgmma, adds dV += P^T dO
and dK += dS^T Q with register operands, and sends each dQ tile (dS K) out through shared memory
and one TMA reduce-add into a float32 buffer.

Measured on an H200 (2026-11-23, docs/performance.md, "Eighth session"): exact (same error as
our kernels against float64), but 0.87-0.94x our backward's speed. The ``DQ_MODE`` diagnostics
(1: no reduce; 2: dQ never stored, so ptxas drops most of its product; both leave dQ wrong) show
where the time goes: with dQ live, each thread spills 33-36 registers per tile inside the loop. Mode 3 adds
dQ with relaxed float32 atomics from registers instead (exact, slower). Mode 5 computes dQ in two
column halves after dK/dV, which leaves no spills in the loop at head_dim 128 (compiled only, not
yet run on a GPU). Kept as the starting point for the next GPU session.

Restrictions: dense (batch, seqlen, heads, head_dim) contiguous bf16/fp16, MHA, seqlen a multiple
of 128, head_dim 64 or 128, causal with aligned positions or no mask.

    python launch/gluon_fused_backward.py compile   # any machine: build for sm_90, registers/spills
    python launch/gluon_fused_backward.py check     # GPU: dQ/dK/dV vs float64 and vs our kernels
    python launch/gluon_fused_backward.py bench     # GPU: backward TFLOP/s vs ours and cuDNN
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634


@builtin
def tma_reduce_add(desc, coord, src, _semantic=None):
    """cp.reduce.async.bulk.tensor add: shared tile ``src`` added into global at ``coord``."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _tile_grads(
    st_tok, dpt_tok, dv, dk, q_s, do_s, k_smem, ds_smem, dq_zero, lse_ptr, delta_ptr, m0, offs_n, diag_end,
    qk_scale, a_layout: gl.constexpr, qcol_layout: gl.constexpr, dtype: gl.constexpr, CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr, DQ_MODE: gl.constexpr,
):  # fmt: skip
    """Softmax gradient of one tile pair from its in-flight S^T/dP^T products; issues dV, dK
    and dQ products (async) and returns their tokens."""
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=qcol_layout)
    lse2 = gl.load(lse_ptr + offs_m) * 1.4426950408889634
    delta = gl.load(delta_ptr + offs_m)
    st = warpgroup_mma_wait(1, deps=(st_tok,))
    pt = gl.exp2(st * qk_scale - lse2[None, :])
    if CAUSAL:
        if m0 < diag_end:  # only tiles that cross the diagonal need the mask
            pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
    dpt = warpgroup_mma_wait(0, deps=(dpt_tok,))
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_s, dv, is_async=True)
    dst16 = (pt * (dpt - delta[None, :])).to(dtype)
    ds_smem.store(dst16)
    fence_async_shared()
    dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_s, dk, is_async=True)
    if DQ_MODE == 2:
        dq = warpgroup_mma(
            ds_smem.slice(0, 64).permute((1, 0)), k_smem.slice(0, 64), dq_zero, use_acc=False, is_async=True
        )
    else:
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
    return dv, dk, dq


@gluon.jit
def _send_dq(
    dq, dq_smem, dq_desc, DQ, row, col, rows, cols, heads, HEAD_DIM: gl.constexpr, DQ_MODE: gl.constexpr
):
    """Add one float32 dQ tile (registers) into the dQ buffer at (row, col). Mode 0: shared memory
    and a TMA reduce-add, after the previous tile's reduce has read the buffer; 1 (diagnostic):
    shared memory only; 3: relaxed atomics from registers (rows/cols: aranges in dQ's layout)."""
    if DQ_MODE == 0:
        tma.store_wait(0)
        dq_smem.store(dq)
        fence_async_shared()
        tma_reduce_add(dq_desc, [row, col], dq_smem)
    elif DQ_MODE == 1:
        dq_smem.store(dq)
    elif DQ_MODE == 3:
        offs = (row + rows).to(gl.int64)[:, None] * (heads * HEAD_DIM) + col + cols[None, :]
        gl.atomic_add(DQ + offs, dq, sem="relaxed")


@gluon.jit
def _dq_in_halves(
    ds_smem, k_smem, dq_smem, dq_desc, row, col, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """DQ_MODE 5: dQ = dS K in two column halves of 16 registers per thread each (instead of one
    of 32), stored into the halves of the dQ tile, then one TMA reduce-add. With dK/dV finished
    first, this leaves no spills in the loop at head_dim 128 (SASS, ``loop_spills``; modes 0/1
    store 33-34 and reload 35-36 registers per thread per tile there). Compiled only: not yet run on
    a GPU."""
    HALF: gl.constexpr = HEAD_DIM // 2
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, HALF // (num_warps // 4), 16]
    )
    tma.store_wait(0)  # the previous tile's reduce has read dq_smem
    for half in gl.static_range(2):
        k_half = k_smem.slice(half * HALF, HALF, dim=1)
        zero = gl.zeros([BLOCK_M, HALF], gl.float32, half_layout)
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_half, zero, use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        dq_smem.slice(half * HALF, HALF, dim=1).store(dq)
    fence_async_shared()
    tma_reduce_add(dq_desc, [row, col], dq_smem)


@gluon.jit
def _bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, DQ, DK, DV, LSE, DELTA,
    seqlen, heads, qk_scale, softmax_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
    PIPELINE: gl.constexpr, DQ_MODE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    pid_n = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * BLOCK_N
    row0 = b * seqlen
    col = h * HEAD_DIM
    dtype: gl.constexpr = q_desc.dtype

    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, HEAD_DIM // (num_warps // 4), 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    qcol_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    krow_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_smem_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + n0, col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row0 + n0, col], kv_bar, v_smem)

    if CAUSAL:
        lo = n0
    else:
        lo = 0
    n_tiles = (seqlen - lo) // BLOCK_M
    tile_bytes: gl.constexpr = 2 * q_desc.block_type.nbytes
    mbarrier.expect(bars.index(0), tile_bytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + lo, col], bars.index(0), q_smem.index(0))
    tma.async_copy_global_to_shared(do_desc, [row0 + lo, col], bars.index(0), do_smem.index(0))
    mbarrier.wait(kv_bar, 0)

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=krow_layout)
    lse_row = (b * heads + h).to(gl.int64) * seqlen
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    if PIPELINE:
        gl.static_assert(DQ_MODE != 5, "DQ_MODE 5 runs in order (PIPELINE=False)")
        # Software-pipelined: tile i+1's S^T/dP^T products are issued before tile i's dQ is
        # stored and reduced, so the tensor cores have work while dQ goes out.
        mbarrier.wait(bars.index(0), 0)
        st_tok = warpgroup_mma(k_smem, q_smem.index(0).permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(
            v_smem, do_smem.index(0).permute((1, 0)), st_zero, use_acc=False, is_async=True
        )
        if n_tiles > 1:
            mbarrier.expect(bars.index(1), tile_bytes)
            tma.async_copy_global_to_shared(
                q_desc, [row0 + lo + BLOCK_M, col], bars.index(1), q_smem.index(1)
            )
            tma.async_copy_global_to_shared(
                do_desc, [row0 + lo + BLOCK_M, col], bars.index(1), do_smem.index(1)
            )
        for i in range(n_tiles - 1):
            s = i % 2
            m0 = lo + i * BLOCK_M
            q_s = q_smem.index(s)
            do_s = do_smem.index(s)
            dv, dk, dq = _tile_grads(
                st_tok, dpt_tok, dv, dk, q_s, do_s, k_smem, ds_smem, dq_zero, LSE + lse_row, DELTA + lse_row,
                m0, offs_n, n0 + BLOCK_N, qk_scale, a_layout, qcol_layout, dtype, CAUSAL, BLOCK_M, DQ_MODE,
            )  # fmt: skip
            mbarrier.wait(bars.index(1 - s), ((i + 1) // 2) & 1)
            st_tok = warpgroup_mma(
                k_smem, q_smem.index(1 - s).permute((1, 0)), st_zero, use_acc=False, is_async=True
            )
            dpt_tok = warpgroup_mma(
                v_smem, do_smem.index(1 - s).permute((1, 0)), st_zero, use_acc=False, is_async=True
            )
            dv, dk, dq = warpgroup_mma_wait(2, deps=(dv, dk, dq))
            if i + 2 < n_tiles:
                mbarrier.expect(bars.index(s), tile_bytes)
                tma.async_copy_global_to_shared(q_desc, [row0 + m0 + 2 * BLOCK_M, col], bars.index(s), q_s)
                tma.async_copy_global_to_shared(do_desc, [row0 + m0 + 2 * BLOCK_M, col], bars.index(s), do_s)
            _send_dq(dq, dq_smem, dq_desc, DQ, row0 + m0, col, dq_rows, dq_cols, heads, HEAD_DIM, DQ_MODE)
        i = n_tiles - 1
        s = i % 2
        m0 = lo + i * BLOCK_M
        dv, dk, dq = _tile_grads(
            st_tok, dpt_tok, dv, dk, q_smem.index(s), do_smem.index(s), k_smem, ds_smem, dq_zero,
            LSE + lse_row, DELTA + lse_row, m0, offs_n, n0 + BLOCK_N, qk_scale, a_layout, qcol_layout, dtype,
            CAUSAL, BLOCK_M, DQ_MODE,
        )  # fmt: skip
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        tma.store_wait(0)
        dq_smem.store(dq)
        fence_async_shared()
        tma_reduce_add(dq_desc, [row0 + m0, col], dq_smem)
    else:
        # In order, one tile at a time. Under CAUSAL this path masks every tile, as it was measured.
        for i in range(n_tiles):
            s = i % 2
            m0 = lo + i * BLOCK_M
            if i + 1 < n_tiles:
                mbarrier.expect(bars.index(1 - s), tile_bytes)
                tma.async_copy_global_to_shared(
                    q_desc, [row0 + m0 + BLOCK_M, col], bars.index(1 - s), q_smem.index(1 - s)
                )
                tma.async_copy_global_to_shared(
                    do_desc, [row0 + m0 + BLOCK_M, col], bars.index(1 - s), do_smem.index(1 - s)
                )
            mbarrier.wait(bars.index(s), (i // 2) & 1)
            q_s = q_smem.index(s)
            do_s = do_smem.index(s)
            st = warpgroup_mma(k_smem, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=qcol_layout)
            lse2 = gl.load(LSE + lse_row + offs_m) * 1.4426950408889634
            delta = gl.load(DELTA + lse_row + offs_m)
            st = warpgroup_mma_wait(1, deps=(st,))
            pt = gl.exp2(st * qk_scale - lse2[None, :])
            if CAUSAL:
                pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
            dpt = warpgroup_mma_wait(0, deps=(dpt,))
            pt16 = pt.to(dtype)
            dv = warpgroup_mma(gl.convert_layout(pt16, a_layout), do_s, dv, is_async=True)
            dst16 = (pt * (dpt - delta[None, :])).to(dtype)
            ds_smem.store(dst16)
            fence_async_shared()
            dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_s, dk, is_async=True)
            if DQ_MODE == 2:
                dq = warpgroup_mma(
                    ds_smem.slice(0, 64).permute((1, 0)),
                    k_smem.slice(0, 64),
                    dq_zero,
                    use_acc=False,
                    is_async=True,
                )
            elif DQ_MODE == 5:
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                _dq_in_halves(ds_smem, k_smem, dq_smem, dq_desc, row0 + m0, col, BLOCK_M, HEAD_DIM, num_warps)
            else:
                dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
            if DQ_MODE != 5:
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
                _send_dq(dq, dq_smem, dq_desc, DQ, row0 + m0, col, dq_rows, dq_cols, heads, HEAD_DIM, DQ_MODE)
    tma.store_wait(0)
    mbarrier.invalidate(kv_bar)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))

    store_dkdv(DK, DV, dk, dv, row0 + n0, col, heads, softmax_scale, BLOCK_N, HEAD_DIM)


@gluon.jit
def store_dkdv(DK, DV, dk, dv, row, col, heads, softmax_scale, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Store a program's float32 dK (scaled) and dV tiles, rows from ``row`` and columns from
    ``col`` of the (B*S, H*D) views, in DK's dtype; the index layout is dk's."""
    layout: gl.constexpr = dk.type.layout
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offs = (row + rows).to(gl.int64)[:, None] * (heads * HEAD_DIM) + col + cols[None, :]
    gl.store(DK + offs, (dk * softmax_scale).to(DK.dtype.element_ty))
    gl.store(DV + offs, dv.to(DV.dtype.element_ty))


def _descs(q, k, v, do, dq_acc, block_m, block_n):
    B, S, H, D = q.shape
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def desc(t, rows, dt):
        lay = gl.NVMMASharedLayout.get_default_for([rows, D], dt)
        t2 = t.view(B * S, H * D)
        return TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [rows, D], lay)

    return (
        desc(q, block_m, gdt), desc(k, block_n, gdt), desc(v, block_n, gdt), desc(do, block_m, gdt),
        desc(dq_acc, block_m, gl.float32),
    )  # fmt: skip


def gluon_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    *,
    block_m: int = 64,
    block_n: int = 128,
    pipeline: bool = True,
    dq_mode: int = 0,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) like q/k/v. q/k/v/do: (batch, seqlen, heads, head_dim) contiguous bf16/fp16;
    lse, delta: (batch, heads, seqlen) float32, the forward's LSE and rowsum(do * out)."""
    B, S, H, D = q.shape
    if S % block_n or k.shape != q.shape or v.shape != q.shape or D not in (64, 128):
        raise ValueError(
            f"needs MHA shapes with seqlen % {block_n} == 0 and head_dim 64 or 128, got {q.shape}"
        )
    lse, delta = lse.contiguous(), delta.contiguous()
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    qd, kd, vd, dod, dqd = _descs(q, k, v, do, dq_acc, block_m, block_n)
    grid = (S // block_n, H, B)
    _bwd_kernel[grid](
        qd, kd, vd, dod, dqd, dq_acc, dk, dv, lse, delta, S, H, softmax_scale * LOG2E, softmax_scale,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D, CAUSAL=causal, PIPELINE=pipeline, DQ_MODE=dq_mode,
        num_warps=num_warps,
    )  # fmt: skip
    return (dq_acc * softmax_scale).to(q.dtype), dk, dv


def compile_for_hopper(head_dim: int, causal: bool, pipeline: bool, dq_mode: int = 0):
    """Build the kernel for sm_90 without a GPU (Triton ships ptxas); returns the compiled kernel."""
    block_m = 64 if head_dim == 128 else 128
    consts = dict(CAUSAL=causal, PIPELINE=pipeline, DQ_MODE=dq_mode)
    return compile_gluon_for_hopper(_bwd_kernel, head_dim, block_m, dict(DQ="*fp32"), consts)


def compile_gluon_for_hopper(kernel, head_dim: int, block_m: int, pointers: dict, consts: dict, **options):
    """Build a Gluon backward kernel of these experiments for sm_90 without a GPU: bf16 descriptors
    of 128-row K/V and ``block_m``-row Q/dO tiles, DK/DV/LSE/DELTA and ``pointers``, the shared
    scalars and constexprs plus ``consts``; ``options`` go to triton.compile (e.g. maxnreg)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    t = torch.empty(1, 1024, 2, head_dim, dtype=torch.bfloat16)
    acc = torch.empty(1, 1024, 2, head_dim, dtype=torch.float32)
    descs = _descs(t, t, t, t, acc, block_m, 128)
    sig = dict(zip(["q_desc", "k_desc", "v_desc", "do_desc", "dq_desc"], [mangle_type(d) for d in descs]))
    sig.update(pointers)
    sig.update(DK="*bf16", DV="*bf16", LSE="*fp32", DELTA="*fp32", seqlen="i32", heads="i32")
    sig.update(qk_scale="fp32", softmax_scale="fp32")
    consts = dict(BLOCK_M=block_m, BLOCK_N=128, HEAD_DIM=head_dim, **consts, num_warps=8)
    sig.update({name: "constexpr" for name in consts})
    src = GluonASTSource(kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, **options})


def loop_spills(kernel) -> tuple[int, int]:
    """(spill stores, spill loads) per thread inside the kernel's main loop: STL/LDL instructions
    between the target and the source of its longest backward branch, read from the SASS that
    Triton's bundled ptxas and nvdisasm make of the PTX."""
    import os
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    bindir = os.path.join(os.path.dirname(nvidia.__file__), "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        subprocess.run([os.path.join(bindir, "ptxas"), "--gpu-name=sm_90a", ptx, "-o", cubin], check=True)
        sass = subprocess.run(
            [os.path.join(bindir, "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
        ).stdout
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
    lo, hi = max(back, key=lambda r: r[1] - r[0])
    inside = [line for a, line in instrs if lo <= a <= hi]
    return sum("STL" in x for x in inside), sum("LDL" in x for x in inside)


def _inputs(B, S, H, D, causal, seed=0):
    from ringflash.kernels import attention_delta, attention_forward, build_problem

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (
        torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    problem = build_problem(q, k, v, None, causal, (-1, -1))
    out, lse = attention_forward(q, k, v, problem)
    return q, k, v, do, lse, attention_delta(out, do, problem), problem


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference_grads(q, k, v, do, causal: bool) -> list[torch.Tensor]:
    """[dq, dk, dv] of softmax(q k^T / sqrt(D)) v in float64, (batch, seqlen, heads, head_dim)."""
    S, D = q.shape[1], q.shape[-1]
    qd, kd, vd = (t.double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    s_ = qd @ kd.transpose(-1, -2) * D**-0.5
    if causal:
        s_ = s_.masked_fill(torch.ones(S, S, device=q.device, dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(s_, -1) @ vd).backward(do.double().transpose(1, 2))
    return [t.grad.transpose(1, 2) for t in (qd, kd, vd)]


# (block_m, block_n, pipelined, dq_mode) per head_dim, as measured in docs/performance.md (mode 5:
# added after the GPU runs, not measured yet).
VARIANTS = {
    128: [(64, 128, False, 0), (64, 128, True, 0), (64, 128, True, 3), (64, 128, False, 3),
          (64, 128, False, 1), (64, 128, False, 2), (64, 128, False, 5)],
    64: [(128, 128, False, 0), (128, 128, False, 3), (128, 128, False, 1), (128, 128, False, 2)],
}  # fmt: skip


def check() -> bool:
    """Every variant that computes dQ (modes 0, 3 and 5) against float64 attention."""
    from ringflash.kernels import attention_backward

    ok_all = True
    for D in (128, 64):
        for causal in (False, True):
            B, S, H = 2, 1024, 3
            q, k, v, do, lse, delta, problem = _inputs(B, S, H, D, causal)
            scale = D**-0.5
            ref = reference_grads(q, k, v, do, causal)
            ours = [_rel(x, r) for x, r in zip(attention_backward(do, q, k, v, lse, delta, problem), ref)]
            for bm, bn, pipe, mode in VARIANTS[D]:
                if mode not in (0, 3, 5):
                    continue
                grads = gluon_backward(
                    q, k, v, do, lse, delta, scale, causal,
                    block_m=bm, block_n=bn, pipeline=pipe, dq_mode=mode,
                )  # fmt: skip
                errs = [_rel(x, r) for x, r in zip(grads, ref)]
                ok = not any(torch.isnan(x).any().item() for x in grads) and max(errs) < 2e-2
                ok_all &= ok
                print(
                    f"D={D} causal={causal} tile {bm}x{bn} pipelined={pipe} mode={mode}: dq/dk/dv rel. error "
                    + " ".join(f"{e:.2e}" for e in errs) + " | ours " + " ".join(f"{e:.2e}" for e in ours)
                    + (" OK" if ok else " FAIL"),
                    flush=True,
                )  # fmt: skip
    return ok_all


def _bench_case(B: int, S: int, H: int, D: int, causal: bool) -> tuple[float, dict[str, float], float]:
    """Backward TFLOP/s of ours, each Gluon variant and cuDNN on one shape."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ringflash.kernels import attention_backward

    q, k, v, do, lse, delta, problem = _inputs(B, S, H, D, causal)
    scale = D**-0.5
    flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)

    def tflops(fn):
        return flops / triton.testing.do_bench(fn) * 1e-9

    ours = tflops(functools.partial(attention_backward, do, q, k, v, lse, delta, problem))
    variants = {}
    for bm, bn, pipe, mode in VARIANTS[D]:
        name = f"{bm}x{bn}{' pipelined' if pipe else ''}{'' if mode == 0 else f' mode {mode}'}"
        variants[name] = tflops(
            functools.partial(
                gluon_backward,
                q,
                k,
                v,
                do,
                lse,
                delta,
                scale,
                causal,
                block_m=bm,
                block_n=bn,
                pipeline=pipe,
                dq_mode=mode,
            )
        )
    qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    g = do.transpose(1, 2).contiguous()
    cudnn = tflops(lambda: torch.autograd.grad(o, (qs, ks, vs), g, retain_graph=True))
    return ours, variants, cudnn


def bench(seqlens: list[int], head_dims: list[int], tokens: int = 65536, H: int = 16) -> None:
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for D in head_dims:
        for S in seqlens:
            B = max(1, tokens // S)
            for causal in (False, True):
                ours, variants, cudnn = _bench_case(B, S, H, D, causal)
                exact = {n: t for n, t in variants.items() if "mode 1" not in n and "mode 2" not in n}
                best = max(exact, key=exact.get)
                rows.append((D, S, causal, ours, best, exact[best], cudnn))
                print(
                    f"D={D} S={S} B={B} causal={causal}: ours {ours:.0f}, cuDNN {cudnn:.0f}, Gluon "
                    + ", ".join(f"{n} {t:.0f}" for n, t in variants.items()),
                    flush=True,
                )
    print("\n| head_dim | S | causal | ours | Gluon (best exact variant) | cuDNN | Gluon / ours |")
    print("|---|---|---|---|---|---|---|")
    for D, S, c, ours, name, t, cudnn in rows:
        print(f"| {D} | {S} | {c} | {ours:.0f} | {t:.0f} ({name}) | {cudnn:.0f} | {t / ours:.2f} |")


def run_cli(doc: str, compile_report, check_fn, bench_fn) -> None:
    """The ``compile|check|bench`` command line of the Gluon experiments. compile_report(head_dims)
    prints; check_fn() returns whether every check passed; bench_fn(seqlens, head_dims) prints."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("compile", "check", "bench"))
    p.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], choices=(64, 128))
    args = p.parse_args()
    if args.what == "compile":
        compile_report(args.head_dims)
    elif args.what == "check":
        sys.exit(0 if check_fn() else 1)
    else:
        bench_fn(args.seqlens, args.head_dims)


def compile_report(head_dims: list[int]) -> None:
    from ringflash.kernels.offline_compile import resource_usage

    for D in head_dims:
        for causal in (False, True):
            for pipe, mode in ((False, 0), (True, 0), (False, 1), (False, 2), (False, 5)):
                k = compile_for_hopper(D, causal, pipe, mode)
                u, (stl, ldl) = resource_usage(k), loop_spills(k)
                print(
                    f"head_dim {D} causal={causal} pipelined={pipe} mode {mode}: {u.registers} "
                    f"registers, {u.spill_bytes} B spilled, {stl}/{ldl} spill stores/loads in the loop, "
                    f"{u.shared_bytes} B shared memory"
                )


if __name__ == "__main__":
    run_cli(__doc__, compile_report, check, bench)
