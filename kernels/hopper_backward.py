"""Fused attention backward for Hopper (sm_90) in Gluon: five products per tile pair.

The Triton backward (backward.py) runs seven matrix products per (query tile, key tile) pair,
because its dQ kernel recomputes QK^T and dP. Here, as in FlashAttention-3, one program per
(key tile, KV head, sequence) keeps K/V in shared memory and walks the query tiles of every
query head of its GQA group, with its warps specialized (``gl.warp_specialize``):

- loader, 1 warp: K/V once, then Q/dO tiles by TMA and their LSE/delta rows by cp.async into a
  two-stage ring (ready/empty mbarriers);
- dQ writer, 1 warp: adds each float32 dQ tile from a two-buffer ring in shared memory into the
  dQ buffer with one TMA reduce-add;
- compute, 8 warps at 240 registers: S^T = K Q^T and dP^T = V dO^T, P^T and dS^T (scaled by
  softmax_scale, which serves dK and dQ), dV += P^T dO, dQ = dS K, dK += dS^T Q, the dK product
  left in flight while the next tile's S^T/dP^T are issued.

A softcap (SOFTCAP) and ALiBi (HAS_ALIBI) are built in as in the forward.

dQ tiles from different key tiles meet in the reduce-adds, so dQ's float32 summation order
varies between runs; under ``torch.use_deterministic_algorithms(True)`` the Triton kernels run.

Measured on an H200 (docs/performance.md; history in docs/experiments.md): exact like the Triton
kernels against float64; at head_dim 128 its backward runs 0.90-0.98x cuDNN's and 1.18-1.34x
the Triton kernels' (causal or not, MHA and GQA 32/8). At head_dim 64 it tied with the Triton
kernels, so only 128 takes this path.

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from .hopper_forward import alibi_args, score_scales, tanh_approx
from .hopper_path import HEAD_DIM
from .hopper_tma import rows_descriptor
from .problem import AttentionProblem

BLOCK_M = 64  # query rows per tile
BLOCK_N = 128  # key rows per program
NUM_WARPS = 8  # compute warps; the two workers add one warp each
# At entry; warp specialization pads the two 1-warp workers to a warpgroup and redistributes:
# 8 x 32 x 240 + 4 x 32 x 24 = 12 warps x 32 x 168, the 64K register file.
MAX_REGISTERS = 168
WORKER_REGS = gl.constexpr(24)


@builtin
def tma_reduce_add(desc, coord, src, _semantic=None):
    """cp.reduce.async.bulk.tensor add: shared tile ``src`` added into global at ``coord``."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@aggregate
class Shared:
    """What the partitions share: descriptors, shared-memory rings (``rows_smem``: each Q/dO
    stage's LSE and delta rows, at 2 * stage and 2 * stage + 1) and their barriers, and the
    program's coordinates in the descriptors' (rows, heads * head_dim) views: each tensor's
    first row of this sequence (``*_row0``), the first query row ``lo``, the query-tile count
    per head ``n_tiles``, the first query head's column ``qcol`` and the KV head's ``kcol``."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    dq_desc: tma.tensor_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    rows_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    qdo_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor
    dq_ready: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor
    q_row0: gl.tensor
    do_row0: gl.tensor
    dq_row0: gl.tensor
    k_row: gl.tensor
    v_row: gl.tensor
    n0: gl.tensor
    lo: gl.tensor
    qcol: gl.tensor
    kcol: gl.tensor
    n_tiles: gl.tensor

    @gluon.constexpr_function
    def __init__(
        self, q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, rows_smem, ds_smem,
        dq_smem, kv_bar, qdo_ready, qdo_empty, dq_ready, dq_empty, q_row0, do_row0, dq_row0, k_row, v_row, n0,
        lo, qcol, kcol, n_tiles,
    ):  # fmt: skip
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.do_desc = do_desc
        self.dq_desc = dq_desc
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.q_smem = q_smem
        self.do_smem = do_smem
        self.rows_smem = rows_smem
        self.ds_smem = ds_smem
        self.dq_smem = dq_smem
        self.kv_bar = kv_bar
        self.qdo_ready = qdo_ready
        self.qdo_empty = qdo_empty
        self.dq_ready = dq_ready
        self.dq_empty = dq_empty
        self.q_row0 = q_row0
        self.do_row0 = do_row0
        self.dq_row0 = dq_row0
        self.k_row = k_row
        self.v_row = v_row
        self.n0 = n0
        self.lo = lo
        self.qcol = qcol
        self.kcol = kcol
        self.n_tiles = n_tiles


@gluon.jit
def _load_partition(
    p: Shared,
    lse_ptr,
    delta_ptr,
    stride_lh,
    GROUP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
):
    rows_layout: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    mbarrier.expect(p.kv_bar, 2 * p.k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(p.k_desc, [p.k_row, p.kcol], p.kv_bar, p.k_smem)
    tma.async_copy_global_to_shared(p.v_desc, [p.v_row, p.kcol], p.kv_bar, p.v_smem)
    tile_bytes: gl.constexpr = 2 * p.q_desc.block_type.nbytes
    for i in range(GROUP * p.n_tiles):
        s = i % 2
        # mbarriers start in phase 1 complete: the first wait on each empty slot passes.
        mbarrier.wait(p.qdo_empty.index(s), ((i // 2) & 1) ^ 1)
        bar = p.qdo_ready.index(s)
        m0 = p.lo + (i % p.n_tiles) * BLOCK_M
        g = i // p.n_tiles
        # Loaded by the compute warps, these rows sat on their critical path (1-11% of the
        # backward on an H200); staged here, they arrive with the tile. Each lane's async arrive
        # adds itself to the barrier's count; issued before the expect, it keeps the phase open
        # until its copies land.
        rows = g * stride_lh + m0 + gl.arange(0, BLOCK_M, layout=rows_layout)
        async_copy.async_copy_global_to_shared(p.rows_smem.index(2 * s), lse_ptr + rows)
        async_copy.async_copy_global_to_shared(p.rows_smem.index(2 * s + 1), delta_ptr + rows)
        async_copy.mbarrier_arrive(bar)
        mbarrier.expect(bar, tile_bytes)
        col = p.qcol + g * HEAD_DIM
        tma.async_copy_global_to_shared(p.q_desc, [p.q_row0 + m0, col], bar, p.q_smem.index(s))
        tma.async_copy_global_to_shared(p.do_desc, [p.do_row0 + m0, col], bar, p.do_smem.index(s))


@gluon.jit
def _dq_partition(p: Shared, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    for i in range(GROUP * p.n_tiles):
        j = i % 2
        mbarrier.wait(p.dq_ready.index(j), (i // 2) & 1)
        m0 = p.lo + (i % p.n_tiles) * BLOCK_M
        col = p.qcol + (i // p.n_tiles) * HEAD_DIM
        tma_reduce_add(p.dq_desc, [p.dq_row0 + m0, col], p.dq_smem.index(j))
        tma.store_wait(1)  # the previous tile's reduce has read its buffer
        mbarrier.arrive(p.dq_empty.index(1 - j), count=1, pred=i > 0)
    tma.store_wait(0)


@gluon.jit
def _alibi_bias_t(alibi2, k_pos, offs_m, q_start, q_stride):
    """ALiBi's log2-domain bias over an S^T tile, -alibi2 * |pk - pq|: k_pos the key rows'
    positions (float32), offs_m the query columns' indices (positions q_start + offs_m * q_stride),
    exact in float32 (the gate keeps positions below 2^22). Query positions come from this tile's
    indices: offsets taken from outside the tile loop were hoisted by the compiler as per-score
    differences and spilled (24-33 registers per tile)."""
    q_pos = (q_start + offs_m * q_stride).to(gl.float32)
    return -alibi2 * gl.abs(k_pos[:, None] - q_pos[None, :])


@gluon.jit
def _compute_tile(
    p: Shared, i, t, dk, dv, st_zero, dq_zero, offs_n, qk_scale, tanh_scale, softmax_scale,
    alibi2, k_pos, q_start, q_stride,
    a_layout: gl.constexpr, qcol_layout: gl.constexpr, BLOCK_M: gl.constexpr, MASKED: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    """Query tile t (ring slot i): dV and dK (left in flight) added to dv/dk, its dQ tile handed to
    the writer. Under SOFTCAP the scores are tanh(S^T * tanh_scale) (``score_scales``) and dS^T
    takes the factor 1 - tanh^2; under HAS_ALIBI the logits get ALiBi's bias (``_alibi_bias_t``)."""
    dtype: gl.constexpr = p.q_desc.dtype
    s = i % 2
    m0 = p.lo + t * BLOCK_M
    mbarrier.wait(p.qdo_ready.index(s), (i // 2) & 1)
    q_s = p.q_smem.index(s)
    do_s = p.do_smem.index(s)
    st = warpgroup_mma(p.k_smem, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(p.v_smem, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    # In flight, oldest first: the previous tile's dK, S^T, dP^T.
    dk = warpgroup_mma_init(warpgroup_mma_wait(2, deps=(dk,)))
    if i > 0:  # the previous tile's dK product has read its Q stage
        mbarrier.arrive(p.qdo_empty.index(1 - s), count=1)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=qcol_layout)
    lse2 = p.rows_smem.index(2 * s).load(qcol_layout) * 1.4426950408889634
    delta = p.rows_smem.index(2 * s + 1).load(qcol_layout)
    s_t = warpgroup_mma_wait(1, deps=(st,))
    if SOFTCAP:
        # Across the dP^T wait, P^T only in dtype (for dV) and P^T * softmax_scale * (1 - tanh^2)
        # (for dS^T): P^T and that factor both in float32 there spilled 32 registers per tile.
        if HAS_ALIBI:
            bias = _alibi_bias_t(alibi2, k_pos, offs_m, q_start, q_stride) - lse2[None, :]
            t = tanh_approx(s_t * tanh_scale)
            pt = gl.exp2(t * qk_scale + bias)
        else:
            t = tanh_approx(s_t * tanh_scale)
            pt = gl.exp2(t * qk_scale - lse2[None, :])
        if MASKED:
            pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
        pv = pt.to(dtype)
        pt = pt * (softmax_scale - (softmax_scale * t) * t)
    else:
        if MASKED:  # a no-op past the first BLOCK_N // BLOCK_M tiles, kept there for one tile loop
            s_t = gl.where(offs_n[:, None] <= offs_m[None, :], s_t, -float("inf"))
        if HAS_ALIBI:
            bias = _alibi_bias_t(alibi2, k_pos, offs_m, q_start, q_stride)
            pt = gl.exp2(s_t * qk_scale + bias - lse2[None, :])
        else:
            pt = gl.exp2(s_t * qk_scale - lse2[None, :])
        pv = pt
    dp_t = warpgroup_mma_wait(0, deps=(dpt,))
    dv = warpgroup_mma(gl.convert_layout(pv.to(dtype), a_layout), do_s, dv, is_async=True)
    if SOFTCAP:
        dst16 = (pt * (dp_t - delta[None, :])).to(dtype)
    else:
        dst16 = (pt * (dp_t - delta[None, :]) * softmax_scale).to(dtype)
    p.ds_smem.store(dst16)
    fence_async_shared()
    mbarrier.wait(p.dq_empty.index(s), ((i // 2) & 1) ^ 1)
    # wgmma groups retire in issue order: dK goes after dQ so that it can stay in flight.
    dq = warpgroup_mma(p.ds_smem.permute((1, 0)), p.k_smem, dq_zero, use_acc=False, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_s, dk, is_async=True)
    dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))
    p.dq_smem.index(s).store(dq)
    fence_async_shared()
    mbarrier.arrive(p.dq_ready.index(s), count=1)
    return dk, dv


@gluon.jit
def _compute_partition(
    p: Shared, qk_scale, tanh_scale, softmax_scale, alibi_ptr, q_start, q_stride, k_start, k_stride,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
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

    # dK is carried through the loops as an in-flight product (see _compute_tile).
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    offs_n = p.n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    if HAS_ALIBI:
        k_pos = (k_start + offs_n * k_stride).to(gl.float32)
    else:
        k_pos = 0.0
        alibi2 = 0.0
    # One tile loop, masked throughout under CAUSAL: with the diagonal tiles in a loop of their
    # own, dK in flight from one loop into the next made ptxas serialize every wgmma (silently,
    # no C7512 in its log): 64 of 64 HGMMAs waited on the previous one.
    mbarrier.wait(p.kv_bar, 0)
    for g in range(GROUP):
        base = g * p.n_tiles
        if HAS_ALIBI:  # query head g's slope (slopes (batch, heads_q), contiguous)
            alibi2 = gl.load(alibi_ptr + g) * 1.4426950408889634
        for t in range(p.n_tiles):
            dk, dv = _compute_tile(
                p, base + t, t, dk, dv, st_zero, dq_zero, offs_n, qk_scale, tanh_scale, softmax_scale,
                alibi2, k_pos, q_start, q_stride, a_layout, qcol_layout, BLOCK_M, CAUSAL, SOFTCAP, HAS_ALIBI,
            )  # fmt: skip
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    return dk, dv


@gluon.jit
def _store_grad(ptr, value, offs, ACCUMULATE: gl.constexpr):
    if ACCUMULATE:
        value += gl.load(ptr + offs).to(gl.float32)
    gl.store(ptr + offs, value.to(ptr.dtype.element_ty))


@gluon.jit
def _fused_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, DK, DV, LSE, DELTA,
    seqlen_q, q_batch_rows, do_batch_rows, dq_batch_rows, k_batch_rows, v_batch_rows,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_lb, stride_lh,
    qk_scale, tanh_scale, softmax_scale, ALIBI, q_start, q_stride, k_start, k_stride,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, ACCUMULATE: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    pid_n = gl.program_id(0)
    hk = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * BLOCK_N
    dtype: gl.constexpr = q_desc.dtype
    ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], do_desc.layout)
    rows_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_smem_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(qdo_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=1)
        mbarrier.init(dq_ready.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)

    if CAUSAL:  # aligned square blocks: key tile n0 is seen from query row n0 on
        lo = n0
    else:
        lo = 0
    n_tiles = (seqlen_q - lo) // BLOCK_M
    p = Shared(
        q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, rows_smem, ds_smem,
        dq_smem, kv_bar, qdo_ready, qdo_empty, dq_ready, dq_empty, b * q_batch_rows, b * do_batch_rows,
        b * dq_batch_rows, b * k_batch_rows + n0, b * v_batch_rows + n0, n0, lo, hk * GROUP * HEAD_DIM,
        hk * HEAD_DIM, n_tiles,
    )  # fmt: skip
    b64 = b.to(gl.int64)
    hk64 = hk.to(gl.int64)
    lse_off = b64 * stride_lb + hk64 * GROUP * stride_lh
    alibi_ptr = ALIBI + (b * gl.num_programs(1) + hk) * GROUP  # this group's first query head
    dk, dv = gl.warp_specialize(
        [
            (
                _compute_partition,
                (
                    p,
                    qk_scale,
                    tanh_scale,
                    softmax_scale,
                    alibi_ptr,
                    q_start,
                    q_stride,
                    k_start,
                    k_stride,
                    GROUP,
                    BLOCK_M,
                    BLOCK_N,
                    HEAD_DIM,
                    CAUSAL,
                    SOFTCAP,
                    HAS_ALIBI,
                    num_warps,
                ),
            ),  # fmt: skip
            (_load_partition, (p, LSE + lse_off, DELTA + lse_off, stride_lh, GROUP, BLOCK_M, HEAD_DIM)),
            (_dq_partition, (p, GROUP, BLOCK_M, HEAD_DIM)),
        ],
        [1, 1],
        [WORKER_REGS, WORKER_REGS],
    )
    layout: gl.constexpr = dk.type.layout
    rows = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))).to(gl.int64)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))[None, :]
    dk_offs = b64 * stride_dkb + hk64 * stride_dkh + rows[:, None] * stride_dks + cols
    dv_offs = b64 * stride_dvb + hk64 * stride_dvh + rows[:, None] * stride_dvs + cols
    _store_grad(DK, dk, dk_offs, ACCUMULATE)
    _store_grad(DV, dv, dv_offs, ACCUMULATE)


def fused_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    problem: AttentionProblem,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    accumulate: bool,
) -> None:
    """Add dQ into the float32 ``dq`` and write (or with ``accumulate`` add) dK/dV into dk/dv.

    q/dout: (batch, seqlen_q, heads_q, 128), k/v: (batch, seqlen_k, heads_k, 128), bf16/fp16 on
    an sm_90 GPU, in layouts ``tma_layout_ok`` accepts (dq too); lse/delta: (batch, heads_q,
    seqlen_q) float32. The caller (``attention_backward``) checks the rest: no window, causal only
    on aligned square blocks, lengths multiples of 128. A softcap and ALiBi are honoured as in the
    forward. dq is added to, never overwritten: zero it first for a plain backward."""
    batch, seqlen_q = q.shape[:2]
    qd, q_rows = rows_descriptor(q, BLOCK_M)
    dod, do_rows = rows_descriptor(dout, BLOCK_M)
    dqd, dq_rows = rows_descriptor(dq, BLOCK_M)
    kd, k_rows = rows_descriptor(k, BLOCK_N)
    vd, v_rows = rows_descriptor(v, BLOCK_N)
    grid = (problem.max_seqlen_k // BLOCK_N, problem.heads_k, batch)
    _fused_bwd_kernel[grid](
        qd, kd, vd, dod, dqd, dk, dv, lse, delta, seqlen_q, q_rows, do_rows, dq_rows, k_rows, v_rows,
        *dk.stride()[:3], *dv.stride()[:3], lse.stride(0), lse.stride(1),
        *score_scales(problem), problem.softmax_scale, *alibi_args(problem, lse),
        GROUP=problem.group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
        CAUSAL=problem.bounds.right is not None, SOFTCAP=bool(problem.softcap),
        HAS_ALIBI=problem.alibi_slopes is not None, ACCUMULATE=accumulate,
        num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
