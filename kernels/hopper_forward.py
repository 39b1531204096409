"""Attention forward for Hopper (sm_90) in Gluon, warp-specialized as in FlashAttention-3.

One program per (128-row query tile, query head, sequence), its warps specialized
(``gl.warp_specialize``):

- loader, 1 warp: the two 64-row halves of the query tile, then K and V tiles by TMA into
  two-stage rings (K and V each with their own ready/empty mbarriers, so a K stage is refilled
  as soon as QK^T has read it, while V waits for P V);
- two compute warpgroups of 4 warps, one per 64-row half, at 240 registers. Each issues
  S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back and computes the softmax of S_j while
  P V runs. The warpgroups run free of each other: making them take turns at issuing their
  products (FlashAttention-3's ping-pong, through an mbarrier pair) measured no faster on an
  H200 (medians within -3%..+1% over 5 interleaved rounds, docs/experiments.md).

A softcap (constexpr SOFTCAP: ``tanh.approx.f32`` per score) and ALiBi (HAS_ALIBI: a bias from
global positions) are built in only where a problem has them (docs/experiments.md, 2026-11-24).

Key tiles are walked last to first, so that under a causal mask the one tile that straddles
the diagonal is the first, and the masked code runs once, outside the loop. Every row then sees
at least its own key, so no row's running max stays -inf.

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from .forward import LOG2E
from .hopper_path import HEAD_DIM
from .hopper_tma import rows_descriptor
from .problem import AttentionProblem

BLOCK_M = 128  # query rows per program, 64 per compute warpgroup
BLOCK_N = 128  # key rows per tile
HALF_M = BLOCK_M // 2
NUM_WARPS = 4  # the first compute warpgroup; the second and the loader are workers
# Entry cap; warp specialization pads the loader warp to a warpgroup and redistributes:
# 2 x 4 x 32 x 240 + 4 x 32 x 24 = 12 warps x 32 x 168, within the 64K register file.
MAX_REGISTERS = 168
COMPUTE_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)


@aggregate
class Shared:
    """What the partitions share: descriptors, shared-memory tiles and rings with their
    mbarriers, and the program's rows/columns in the descriptors' (rows, heads * head_dim)
    views: the query tile's first row ``q_row``, the sequence's first key row ``k_row0``/
    ``v_row0``, the query head's column ``qcol``, the KV head's ``kcol`` and the number of
    key tiles ``n_tiles``."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    q_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    q_row: gl.tensor
    k_row0: gl.tensor
    v_row0: gl.tensor
    qcol: gl.tensor
    kcol: gl.tensor
    n_tiles: gl.tensor

    @gluon.constexpr_function
    def __init__(
        self, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
        q_row, k_row0, v_row0, qcol, kcol, n_tiles,
    ):  # fmt: skip
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.q_smem = q_smem
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.q_bar = q_bar
        self.k_ready = k_ready
        self.k_empty = k_empty
        self.v_ready = v_ready
        self.v_empty = v_empty
        self.q_row = q_row
        self.k_row0 = k_row0
        self.v_row0 = v_row0
        self.qcol = qcol
        self.kcol = kcol
        self.n_tiles = n_tiles


@gluon.jit
def tanh_approx(x):
    """tanh by the special-function unit (``tanh.approx.f32``, relative error about 2^-11), as
    FlashAttention-3 computes its softcap: one MUFU op per score, beside the softmax's exp2."""
    return gl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.jit
def alibi_bias(alibi2, row_offs, col_offs, pos_diff):
    """ALiBi's bias in the log2 domain, -alibi2 * |position difference|, over a score tile: the
    rows' positions minus the columns' are pos_diff (that of the tile's first row and column)
    plus row_offs[r] - col_offs[c] (int32 offsets within the tile). The int difference becomes a
    float through the exponent bits of 1.5 * 2^23 (one integer add and one float subtract, exact
    below 2^22: the gate keeps positions there) instead of a conversion per score."""
    d = (row_offs + pos_diff)[:, None] - col_offs[None, :]
    df = (d + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0
    return -alibi2 * gl.abs(df)


def alibi_args(problem: AttentionProblem, alibi_fallback: torch.Tensor) -> tuple:
    """(slopes, q_start, q_stride, k_start, k_stride) for both Hopper kernels: the (batch,
    heads_q) float32 slopes (``alibi_fallback``, never read, without ALiBi) and the positions."""
    qp = problem.q_positions.resolved(problem.max_seqlen_q)
    kp = problem.k_positions.resolved(problem.max_seqlen_k)
    slopes = alibi_fallback if problem.alibi_slopes is None else problem.alibi_slopes
    return slopes, qp.start, qp.stride, kp.start, kp.stride


def score_scales(problem: AttentionProblem) -> tuple[float, float]:
    """(qk_scale, tanh_scale) for both Hopper kernels: the log2-domain logit is qk * qk_scale, or
    under a softcap tanh(qk * tanh_scale) * qk_scale (= softcap * tanh(qk * scale / softcap) *
    log2 e); tanh_scale is unused without one."""
    if problem.softcap:
        return problem.softcap * LOG2E, problem.softmax_scale / problem.softcap
    return problem.softmax_scale * LOG2E, 1.0


@gluon.jit
def _load_partition(p: Shared, BLOCK_N: gl.constexpr, HALF_M: gl.constexpr):
    for w in gl.static_range(2):
        bar = p.q_bar.index(w)
        mbarrier.expect(bar, p.q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(p.q_desc, [p.q_row + w * HALF_M, p.qcol], bar, p.q_smem.index(w))
    tile_bytes: gl.constexpr = p.k_desc.block_type.nbytes
    for i in range(p.n_tiles):
        s = i % 2
        n0 = (p.n_tiles - 1 - i) * BLOCK_N  # last key tile first
        # mbarriers start in phase 1 complete: the first wait on each empty slot passes.
        mbarrier.wait(p.k_empty.index(s), ((i // 2) & 1) ^ 1)
        bar = p.k_ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        tma.async_copy_global_to_shared(p.k_desc, [p.k_row0 + n0, p.kcol], bar, p.k_smem.index(s))
        mbarrier.wait(p.v_empty.index(s), ((i // 2) & 1) ^ 1)
        bar = p.v_ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        tma.async_copy_global_to_shared(p.v_desc, [p.v_row0 + n0, p.kcol], bar, p.v_smem.index(s))


@gluon.jit
def _compute_partition(
    p: Shared, O, LSE, o_off, stride_os, lse_off, qk_scale, tanh_scale,
    alibi_ptr, q_pos0, q_stride, k_start, k_stride,
    w: gl.constexpr, BLOCK_N: gl.constexpr, HALF_M: gl.constexpr, HEAD_DIM: gl.constexpr,
    CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    """Warpgroup w: query rows [q_row + w * HALF_M, + HALF_M) against every key tile. Under
    SOFTCAP each score tile becomes tanh(S * tanh_scale) before the mask (``score_scales``); under
    HAS_ALIBI the logits get ALiBi's bias (slope at ``alibi_ptr``; the tile's first query at
    position q_pos0, key k at k_start + k * k_stride)."""
    dtype: gl.constexpr = p.q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    q_s = p.q_smem.index(w)
    if HAS_ALIBI:
        alibi2 = gl.load(alibi_ptr) * 1.4426950408889634  # log2(e): logits in the log2 domain
        row_offs = gl.arange(0, HALF_M, layout=row_layout) * q_stride
        col_offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)) * k_stride
        q_pos = q_pos0 + w * HALF_M * q_stride
    mbarrier.wait(p.q_bar.index(w), 0)

    # First (last) key tile: under CAUSAL the diagonal one, masked here and only here.
    last = p.n_tiles - 1
    mbarrier.wait(p.k_ready.index(0), 0)
    s = warpgroup_mma(q_s, p.k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(p.k_empty.index(0), count=1)
    if SOFTCAP:
        s = tanh_approx(s * tanh_scale)
    if HAS_ALIBI:  # logits scaled here, not after the row max
        k_pos = k_start + last * BLOCK_N * k_stride
        s = s * qk_scale + alibi_bias(alibi2, row_offs, col_offs, q_pos - k_pos)
    if CAUSAL:
        rows = w * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(cols[None, :] <= rows[:, None], s, -float("inf"))
    if HAS_ALIBI:
        m_i = gl.max(s, 1)
        pr = gl.exp2(s - m_i[:, None])
    else:
        m_i = gl.max(s, 1) * qk_scale
        pr = gl.exp2(s * qk_scale - m_i[:, None])
    l_i = gl.sum(pr, 1)
    o = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)

    for i in range(1, p.n_tiles):
        st = i % 2
        prev = 1 - st
        mbarrier.wait(p.k_ready.index(st), (i // 2) & 1)
        mbarrier.wait(p.v_ready.index(prev), ((i - 1) // 2) & 1)
        s = warpgroup_mma(q_s, p.k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o = warpgroup_mma(gl.convert_layout(pr.to(dtype), p_layout), p.v_smem.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(p.k_empty.index(st), count=1)
        if SOFTCAP:
            s = tanh_approx(s * tanh_scale)
        if HAS_ALIBI:
            n0 = (last - i) * BLOCK_N
            s = s * qk_scale + alibi_bias(alibi2, row_offs, col_offs, q_pos - (k_start + n0 * k_stride))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            pr = gl.exp2(s - m_new[:, None])
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            pr = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(pr, 1)
        m_i = m_new
        o = warpgroup_mma_wait(0, deps=(o,))
        mbarrier.arrive(p.v_empty.index(prev), count=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

    st = last % 2
    mbarrier.wait(p.v_ready.index(st), (last // 2) & 1)
    o = warpgroup_mma(gl.convert_layout(pr.to(dtype), p_layout), p.v_smem.index(st), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o,))
    mbarrier.arrive(p.v_empty.index(st), count=1)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = o / l_o[:, None]
    rows_o = (w * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))).to(gl.int64)
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + o_off + rows_o[:, None] * stride_os + cols_o[None, :], out.to(O.dtype.element_ty))
    # log2-domain max and sum back to a natural-log LSE (0.693... = ln 2).
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + lse_off + w * HALF_M + gl.arange(0, HALF_M, layout=row_layout), lse)


@gluon.jit
def _fused_fwd_kernel(
    q_desc, k_desc, v_desc, O, LSE,
    seqlen_k, q_batch_rows, k_batch_rows, v_batch_rows,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, qk_scale, tanh_scale,
    ALIBI, q_start, q_stride, k_start, k_stride,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    CAUSAL: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    # Causal: the heaviest query tiles (the last) are launched first.
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    m0 = pid_m * BLOCK_M
    hk = h // GROUP
    dtype: gl.constexpr = q_desc.dtype
    HALF_M: gl.constexpr = BLOCK_M // 2

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a stage
        mbarrier.init(v_empty.index(i), count=2)

    if CAUSAL:  # aligned square blocks: query tile m0 sees key tiles 0 .. m0 / BLOCK_N
        n_tiles = m0 // BLOCK_N + 1
    else:
        n_tiles = seqlen_k // BLOCK_N
    p = Shared(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
        b * q_batch_rows + m0, b * k_batch_rows, b * v_batch_rows, h * HEAD_DIM, hk * HEAD_DIM, n_tiles,
    )  # fmt: skip
    b64 = b.to(gl.int64)
    h64 = h.to(gl.int64)
    o_off = b64 * stride_ob + h64 * stride_oh + m0.to(gl.int64) * stride_os
    lse_off = b64 * stride_lb + h64 * stride_lh + m0
    alibi_ptr = ALIBI + b * gl.num_programs(1) + h  # slopes (batch, heads_q), contiguous
    q_pos0 = q_start + m0 * q_stride
    gl.warp_specialize(
        [
            (
                _compute_partition,
                (
                    p,
                    O,
                    LSE,
                    o_off,
                    stride_os,
                    lse_off,
                    qk_scale,
                    tanh_scale,
                    alibi_ptr,
                    q_pos0,
                    q_stride,
                    k_start,
                    k_stride,
                    0,
                    BLOCK_N,
                    HALF_M,
                    HEAD_DIM,
                    CAUSAL,
                    SOFTCAP,
                    HAS_ALIBI,
                ),
            ),
            (
                _compute_partition,
                (
                    p,
                    O,
                    LSE,
                    o_off,
                    stride_os,
                    lse_off,
                    qk_scale,
                    tanh_scale,
                    alibi_ptr,
                    q_pos0,
                    q_stride,
                    k_start,
                    k_stride,
                    1,
                    BLOCK_N,
                    HALF_M,
                    HEAD_DIM,
                    CAUSAL,
                    SOFTCAP,
                    HAS_ALIBI,
                ),
            ),
            (_load_partition, (p, BLOCK_N, HALF_M)),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )


def fused_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Write attention's output into ``out`` and its row logsumexp into ``lse``.

    q: (batch, seqlen_q, heads_q, 128), k/v: (batch, seqlen_k, heads_k, 128), bf16/fp16 on an
    sm_90 GPU, in layouts ``tma_layout_ok`` accepts; out: q's shape, any float dtype, unit stride
    in head_dim (e.g. a float32 ring buffer's view); lse: (batch, heads_q, seqlen_q) float32,
    unit stride in the sequence. The caller (``attention_forward``) checks the rest: no window,
    causal only on aligned square blocks, lengths multiples of 128. A softcap (``problem.softcap``)
    is applied to the scaled scores before the mask, then ALiBi's bias (``problem.alibi_slopes``)
    in the problem's global positions."""
    batch, seqlen_q = q.shape[:2]
    qd, q_rows = rows_descriptor(q, HALF_M)
    kd, k_rows = rows_descriptor(k, BLOCK_N)
    vd, v_rows = rows_descriptor(v, BLOCK_N)
    grid = (seqlen_q // BLOCK_M, problem.heads_q, batch)
    _fused_fwd_kernel[grid](
        qd, kd, vd, out, lse, problem.max_seqlen_k, q_rows, k_rows, v_rows,
        *out.stride()[:3], lse.stride(0), lse.stride(1), *score_scales(problem), *alibi_args(problem, lse),
        GROUP=problem.group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
        CAUSAL=problem.bounds.right is not None, SOFTCAP=bool(problem.softcap),
        HAS_ALIBI=problem.alibi_slopes is not None,
        num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
