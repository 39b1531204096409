"""dQ of attention for Hopper (sm_90) in Gluon, at the head_dim-256 build (head dims 136-256),
where the fused backward (backward.py) has no room for its float32 dQ ring in shared memory.

There the fused backward added every (query tile, key tile) pair's dQ into a float32 buffer by
atomic adds from registers, and half of its time went to them (docs/experiments.md §28). This
kernel computes dQ as the forward computes O, with the forward's programs (one per 128-row
query tile, query head and sequence: ``query_tiles.query_tile_item``), walk over the key tiles
a tile sees, masks, softcap and ALiBi: Q and dO of the tile stay in shared memory while 32-row
K and V tiles stream through two-stage rings, and per key tile

    S = Q K^T,  dP = dO V^T,  P = exp(S - LSE),  dS = P (dP - delta) * scale,  dQ += dS K

three products where the fused backward's dQ took one, and no atomics: the fused backward then
computes dK and dV only. dQ is written once per row in dq's dtype (or added to it), so the
result does not depend on an order of additions.

Shared memory: Q and dO (2 x 128 x 256 x 2 bytes) and two stages of 32-row K and V tiles
(2 x 2 x 32 x 256 x 2) take 192 KiB of the 227; 64-row tiles would take 256.

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ..launcher import launch as launch_kernel
from ..problem import AttentionProblem
from .dispatch import run_head_dim
from .query_tiles import (
    COMPUTE_REGS,
    HALF_M,
    LOADER_REGS,
    Shared,
    allocate_rings,
    load_key_tiles,
    query_tile_item,
    query_tile_launch,
    query_tiles,
    store_rows,
)
from .query_tiles import HEAD_DIMS as QUERY_TILE_BUILDS
from .scores import Mask, logits, score_scales, tanh_approx
from .tma import load_tile, rows_descriptor, tile_layout

BLOCK_N = {256: 32}  # key rows per tile, by build
HEAD_DIMS = tuple(BLOCK_N)


@gluon.jit
def _load_partition(p: Shared, do_desc, do_smem, do_row, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr):
    tile_bytes: gl.constexpr = p.q_desc.block_type.nbytes + do_desc.block_type.nbytes
    for w in gl.static_range(2):
        bar = p.rings.q_bar.index(p.q_slot + w)
        mbarrier.expect(bar, tile_bytes)
        load_tile(p.q_desc, p.q_row + w * HALF_M, p.q_head, bar, p.rings.q_smem.index(p.q_slot + w))
        load_tile(do_desc, do_row + w * HALF_M, p.q_head, bar, do_smem.index(w))
    load_key_tiles(p, BLOCK_N, 0, p.n_tiles)


@gluon.jit
def _tile_step(
    p: Shared, mk: Mask, i, dq, s_zero, q_s, do_s, lse2, delta, row_offs, col_offs, qk_scale, tanh_scale,
    softmax_scale, alibi2, ds_layout: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    """Walk step i (key tile t_last - i): S and dP issued together, P from S while dP runs, then
    dQ += dS K; the tile's K and V stages are released as their last products finish."""
    dtype: gl.constexpr = p.q_desc.dtype
    j = p.ring0 + i
    st = j % 2
    phase = (j // 2) & 1
    mbarrier.wait(p.rings.k_ready.index(st), phase)
    mbarrier.wait(p.rings.v_ready.index(st), phase)
    s = warpgroup_mma(q_s, p.rings.k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_s, p.rings.v_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    if SOFTCAP:
        s = tanh_approx(s * tanh_scale)
        t = s
    x = logits(
        s, p.t_last - i, mk, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
        MASKED, HAS_LEFT, HAS_RIGHT, False, HAS_ALIBI,
    )  # fmt: skip
    if HAS_ALIBI:  # logits already in the log2 domain
        pr = gl.exp2(x - lse2[:, None])
    else:
        pr = gl.exp2(x * qk_scale - lse2[:, None])
    if SOFTCAP:  # d tanh: the scale times 1 - tanh^2
        pr = pr * (softmax_scale - (softmax_scale * t) * t)
    else:
        pr = pr * softmax_scale
    dp = warpgroup_mma_wait(0, deps=(dp,))
    mbarrier.arrive(p.rings.v_empty.index(st), count=1)
    ds = (pr * (dp - delta[:, None])).to(dtype)
    dq = warpgroup_mma(gl.convert_layout(ds, ds_layout), p.rings.k_smem.index(st), dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    mbarrier.arrive(p.rings.k_empty.index(st), count=1)
    return dq


@gluon.jit
def _compute_partition(
    p: Shared, mk: Mask, do_smem, DQ, dq_off, stride_dqs, lse_ptr, delta_ptr, rows_left, qk_scale,
    tanh_scale, softmax_scale, alibi_ptr, w: gl.constexpr, BLOCK_N: gl.constexpr, HALF_M: gl.constexpr,
    HEAD_DIM: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr, ACCUMULATE: gl.constexpr,
):  # fmt: skip
    """Warpgroup w: dQ of query rows [q_row + w * HALF_M, + HALF_M), stored (or added, under
    ACCUMULATE) for the rows below ``rows_left``. Rows past the sequence and rows that see no key
    (LSE -inf) take an LSE of +inf, so that their P is 0 rather than NaN."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = w * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
    ok = rows < rows_left
    lse = gl.load(lse_ptr + rows, mask=ok, other=float("inf"))
    lse2 = gl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634)
    delta = gl.load(delta_ptr + rows, mask=ok, other=0.0)
    row_offs = gl.arange(0, HALF_M, layout=row_layout) * mk.q_stride
    col_offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)) * mk.k_stride
    alibi2 = 0.0
    if HAS_ALIBI:
        alibi2 = gl.load(alibi_ptr) * 1.4426950408889634  # log2(e): logits in the log2 domain
    q_s = p.rings.q_smem.index(p.q_slot + w)
    do_s = do_smem.index(w)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([HALF_M, HEAD_DIM], gl.float32, dq_layout)
    mbarrier.wait(p.rings.q_bar.index(p.q_slot + w), p.q_phase)

    # Walk step i visits key tile t_last - i: tiles at or above t_full_hi come first (masked),
    # then the full ones down to t_full_lo, then the masked rest (as the forward's _attend).
    full_first = gl.minimum(gl.maximum(p.t_last + 1 - mk.t_full_hi, 0), p.n_tiles)
    full_end = gl.minimum(gl.maximum(p.t_last + 1 - mk.t_full_lo, full_first), p.n_tiles)
    for i in range(0, full_first):
        dq = _tile_step(
            p, mk, i, dq, s_zero, q_s, do_s, lse2, delta, row_offs, col_offs, qk_scale, tanh_scale,
            softmax_scale, alibi2, ds_layout, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
    for i in range(full_first, full_end):
        dq = _tile_step(
            p, mk, i, dq, s_zero, q_s, do_s, lse2, delta, row_offs, col_offs, qk_scale, tanh_scale,
            softmax_scale, alibi2, ds_layout, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
    for i in range(full_end, p.n_tiles):
        dq = _tile_step(
            p, mk, i, dq, s_zero, q_s, do_s, lse2, delta, row_offs, col_offs, qk_scale, tanh_scale,
            softmax_scale, alibi2, ds_layout, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip

    store_rows(DQ, dq_off, stride_dqs, dq, p, w, rows_left, ACCUMULATE)


# packed_docs changes with every packed batch: a constant or alignment hint of it would recompile.
@gluon.jit(do_not_specialize=["packed_docs"])
def _dq_kernel(
    q_desc, k_desc, v_desc, do_desc, DQ, LSE, DELTA, CU_Q, CU_K,
    seqlen_q, seqlen_k, packed_docs, q_batch_rows, k_batch_rows, v_batch_rows, do_batch_rows,
    stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, qk_scale, tanh_scale, softmax_scale,
    ALIBI, q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    TENSOR_DIM: gl.constexpr, VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, ACCUMULATE: gl.constexpr,
):  # fmt: skip
    HALF_M: gl.constexpr = BLOCK_M // 2
    qt = query_tiles(
        q_desc, k_desc, v_desc, CU_Q, CU_K, seqlen_q, seqlen_k, packed_docs, q_batch_rows, k_batch_rows,
        v_batch_rows, q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right,
        gl.num_programs(0), gl.num_programs(1), gl.num_programs(2),
    )  # fmt: skip
    rings = allocate_rings(q_desc, k_desc, v_desc, HALF_M, BLOCK_N, HEAD_DIM, 1)
    zero = gl.program_id(0) * 0  # the program's first and only query tile, from ring step 0
    p, mk0, mk1, q_tile_row, b, ob, rows_left = query_tile_item(
        qt, rings, gl.program_id(0), gl.program_id(1), gl.program_id(2), zero, zero,
        GROUP, BLOCK_M, BLOCK_N, TENSOR_DIM, VARLEN, HAS_LEFT, HAS_RIGHT,
    )  # fmt: skip
    do_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF_M, HEAD_DIM], tile_layout(do_desc.layout))
    if VARLEN:  # one packed batch: the tile's row is the same in every packed tensor
        do_row = q_tile_row
    else:
        do_row = b * do_batch_rows + q_tile_row
    h64 = p.q_head.to(gl.int64)
    dq_off = ob.to(gl.int64) * stride_dqb + h64 * stride_dqh + q_tile_row.to(gl.int64) * stride_dqs
    lse_off = ob.to(gl.int64) * stride_lb + h64 * stride_lh + q_tile_row
    alibi_ptr = ALIBI + b * gl.num_programs(1) + p.q_head  # slopes (batch, heads_q)
    lse_ptr = LSE + lse_off
    delta_ptr = DELTA + lse_off
    # fmt: off
    gl.warp_specialize(
        [
            (
                _compute_partition,
                (p, mk0, do_smem, DQ, dq_off, stride_dqs, lse_ptr, delta_ptr, rows_left, qk_scale, tanh_scale,
                 softmax_scale, alibi_ptr, 0, BLOCK_N, HALF_M, HEAD_DIM, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                 HAS_ALIBI, ACCUMULATE),
            ),
            (
                _compute_partition,
                (p, mk1, do_smem, DQ, dq_off, stride_dqs, lse_ptr, delta_ptr, rows_left, qk_scale, tanh_scale,
                 softmax_scale, alibi_ptr, 1, BLOCK_N, HALF_M, HEAD_DIM, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                 HAS_ALIBI, ACCUMULATE),
            ),
            (_load_partition, (p, do_desc, do_smem, do_row, HALF_M, BLOCK_N)),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )
    # fmt: on


def dq_supports(problem: AttentionProblem) -> bool:
    """Whether ``fused_dq`` computes ``problem``'s dQ: head dims that run at the 256 build."""
    return run_head_dim(problem.head_dim, QUERY_TILE_BUILDS) in HEAD_DIMS


def fused_dq(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    problem: AttentionProblem,
    dq: torch.Tensor,
    accumulate: bool,
) -> None:
    """Write (or with ``accumulate`` add) dQ into ``dq``.

    q/dout: (batch, seqlen_q, heads_q, head_dim), k/v: (batch, seqlen_k, heads_k, head_dim), or
    (total, heads, head_dim) with ``problem.varlen``; bf16/fp16 on an sm_90 GPU in layouts
    ``tma_layout_ok`` accepts; head_dim per ``dq_supports``. dq: q's shape, any float dtype,
    unit stride in head_dim; lse/delta: float32 in ``problem.lse_shape``, sharing strides, last
    stride 1. Any mask the problem describes, a softcap and ALiBi, as in the forward."""
    build = run_head_dim(problem.head_dim, QUERY_TILE_BUILDS)
    launch = query_tile_launch(q, k, v, problem, lse, BLOCK_N[build])
    do4, dq4 = (t.unsqueeze(0) if problem.varlen else t for t in (dout, dq))
    dod, do_rows = rows_descriptor(do4, HALF_M, launch.constexprs["HEAD_DIM"])
    launch_kernel(
        _dq_kernel, launch.grid,
        *launch.descriptors, dod, dq, lse, delta, launch.cu_q, launch.cu_k, problem.max_seqlen_q,
        problem.max_seqlen_k, launch.packed_docs, *launch.rows, do_rows, *dq4.stride()[:3],
        *launch.lse_strides, *score_scales(problem), problem.softmax_scale, launch.slopes,
        *problem.position_args(), *launch.window, ACCUMULATE=accumulate, **launch.constexprs,
    )  # fmt: skip
