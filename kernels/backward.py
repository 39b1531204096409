"""FlashAttention-2 backward in Triton: dQ, dK, dV recomputed from the forward's LSE.

Three launches, no atomics (deterministic):
  1. delta = rowsum(dO * O), float32, once per call (or passed in, e.g. once per ring backward);
  2. dK/dV: one program per (key tile, KV head, sequence); it walks the query tiles that can see
     its keys (last first), for every query head of its GQA group, so dK/dV need no reduction
     afterwards;
  3. dQ: one program per (query tile, query head, sequence), walking the visible key tiles.
Both walk with the same ``visible_tiles`` spans as the forward. With ``accumulate=True`` the
kernels add into the given gradient buffers (the ring engine's float32 accumulators). A softcap
and ALiBi (scores.py) are recomputed from q . k and the positions exactly as in the forward;
the softcap's derivative 1 - tanh^2 multiplies dS (nothing extra is stored), and ALiBi, a
constant bias, changes only P. Both are constexpr-gated: calls without them run the plain
kernels.

On an H100/H200 at head_dim 64-256 (multiples of 8; between 64, 128 and 256 at the next
build, hopper/dispatch.py) a call that wants dQ and dK/dV together runs the fused Gluon kernel of
hopper/backward.py instead (five products per tile pair instead of seven), where
``uses_fused_backward`` says it can.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import backward_kv_config, backward_q_config, block_d
from .forward import as_4d, dot_precision, lse_strides
from .hopper.dispatch import enabled, hopper_module, uses_fused_backward
from .launcher import bound_launch, launch, launch_or_bind
from .problem import AttentionProblem, check_token_stride, wide_offsets
from .scores import alibi_slope_log2, alibi_tensor, log2_scores, score_constexprs, score_scales, softcap_grad
from .tiling import (
    listed_tile,
    mask_bits,
    program_tile,
    row_pointers,
    seq_bounds,
    tile_grid,
    visibility_mask,
    visible_tiles,
)


# packed_docs changes with every packed batch: a constant or alignment hint of it would recompile.
@triton.jit(do_not_specialize=["packed_docs"])
def _delta_kernel(
    O, DO, DELTA, CU_Q, stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh, seqlen_q, packed_docs, DQ, stride_zb, stride_zs, stride_zh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
    ZERO_DQ: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) per row; under ZERO_DQ the same rows of DQ (a float32 buffer like O,
    which the fused backward adds dQ into) set to zero, as FlashAttention-3's preprocessing
    kernel clears its dQ accumulator: a fill launch less per backward."""
    pid_m, h, b = program_tile(CU_Q, packed_docs, BLOCK_M, IS_VARLEN)
    q0, len_q, _, _, pb = seq_bounds(CU_Q, CU_Q, b, seqlen_q, seqlen_q, IS_VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < len_q
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q0 + offs_m).to(tl.int64)
    h64 = h.to(tl.int64)
    o = tl.load(
        O + pb * stride_ob + h64 * stride_oh + rows[:, None] * stride_os + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    do = tl.load(
        DO + pb * stride_db + h64 * stride_dh + rows[:, None] * stride_ds + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pb * stride_lb + h64 * stride_lh + rows, delta, mask=row_ok)
    if ZERO_DQ:
        dq_ptrs = DQ + pb * stride_zb + h64 * stride_zh + rows[:, None] * stride_zs + offs_d[None, :]
        tl.store(dq_ptrs, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), mask=mask)


@triton.jit
def _store_grad(ptrs, value, mask, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        value += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, stride_qh, stride_dh,
    stride_lh, lo, hi, key_pos, q_start, q_stride, len_q, win_left, win_right, qk_scale, softcap_log2,
    ALIBI_H0, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDE: tl.constexpr, blocks=0, kinds=0, bits=0, bits_col0=0, LISTED: tl.constexpr = 0,
    HAS_BITS: tl.constexpr = False, BITS_WORDS: tl.constexpr = 1, BITS_STRIDE: tl.constexpr = 0,
):  # fmt: skip
    """Add the query tiles in [lo, hi) of every query head of the GQA group (the *_base pointers
    and ALIBI_H0, its slopes, are at its first head) to dk/dv, last tile first. One flat loop,
    tile-major and head-minor: the group's heads are visited at the same positions.
    Block-sparse: LISTED/HAS_BITS as in ``_fwd_tiles``, over listed query blocks (the keys'
    block starts at position bits_col0).

    Why last tile first: under a causal mask the dK/dV programs of a launch start at different
    query tiles (their diagonals) but all end at the last one. Walking backwards, programs
    that run together read the same Q/dO tiles at about the same time, which the L2 cache
    serves (measured on an H200: 1-3% faster dK/dV, docs/experiments.md)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    zero64 = (len_q * 0).to(tl.int64)  # head offsets in int64 (the loop index is a plain int)
    for it in range(0, n_tiles * GROUP):
        tile = n_tiles - 1 - it // GROUP
        g = zero64 + it % GROUP
        at = lo + tile * BLOCK_M
        m0, block0 = listed_tile(at, blocks, LISTED)
        rows = m0 + offs_m
        io_mask = d_ok
        row_mask = rows < len_q
        if MASKED:
            io_mask = io_mask & row_mask[:, None]
        q_rows = row_pointers(q_base + g * stride_qh, m0, offs_m, stride_qs, WIDE)
        q = tl.load(q_rows + offs_d[None, :], mask=io_mask, other=0.0)
        lse2 = tl.load(lse_base + g * stride_lh + rows, mask=row_mask, other=0.0) * 1.4426950408889634
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        slope_log2 = 0.0
        if HAS_ALIBI:
            slope_log2 = tl.load(ALIBI_H0 + g) * 1.4426950408889634
        # Keys are this program's rows, queries its columns.
        s_t, th_t = log2_scores(
            qk_t, qk_scale, softcap_log2, slope_log2, key_pos, q_start, q_stride, rows, HAS_SOFTCAP, HAS_ALIBI
        )
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            # The window's sides swap too.
            vis = visibility_mask(
                key_pos, q_start + q_stride * rows, rows, len_q, win_right, win_left, HAS_RIGHT, HAS_LEFT
            )
            if HAS_BITS:  # keys are the rows here: the block's (query, key) bits transposed
                block_bits = bits + tl.load(kinds + at // LISTED).to(tl.int64) * BITS_STRIDE
                in_rows, in_cols = (rows - block0)[None, :], (key_pos - bits_col0)[:, None]
                vis = vis & mask_bits(block_bits, in_rows, in_cols, BITS_WORDS)
            p_t = tl.where(vis, p_t, 0.0)
        do_rows = row_pointers(do_base + g * stride_dh, m0, offs_m, stride_ds, WIDE)
        do = tl.load(do_rows + offs_d[None, :], mask=io_mask, other=0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        delta = tl.load(delta_base + g * stride_lh + rows, mask=row_mask, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = softcap_grad(p_t * (dp_t - delta[None, :]), th_t, HAS_SOFTCAP)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


# packed_docs changes with every packed batch: a constant or alignment hint of it would recompile.
@triton.jit(do_not_specialize=["packed_docs"])
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, ALIBI,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, softmax_scale, qk_scale, softcap_log2,
    q_start0, q_stride, k_start0, k_stride, q_per_len, k_per_len, win_left, win_right, packed_docs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    pid_n, hk, b = program_tile(CU_K, packed_docs, BLOCK_N, IS_VARLEN)
    q0, len_q, k0, len_k, pb = seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 < len_k:
        # per_len: block offsets that scale with each sequence's length (see positions.py). New
        # names, not reassigned arguments: Triton specializes an argument equal to 1 as a constant.
        q_start = q_start0 + q_per_len * len_q
        k_start = k_start0 + k_per_len * len_k
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        kv_mask = (offs_n[:, None] < len_k) & (offs_d[None, :] < HEAD_DIM)
        krow = (k0 + offs_n).to(tl.int64)
        hk64 = hk.to(tl.int64)  # new name: see the per_len note
        k = tl.load(
            K + pb * stride_kb + hk64 * stride_kh + krow[:, None] * stride_ks + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            V + pb * stride_vb + hk64 * stride_vh + krow[:, None] * stride_vs + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        key_pos = k_start + k_stride * offs_n
        key_lo = k_start + k_stride * n0
        key_hi = k_start + k_stride * (tl.minimum(n0 + BLOCK_N, len_k) - 1)
        # Seen from the key side, a key at k is visible to queries with k - right <= q <= k + left.
        start, full_start, full_end, end = visible_tiles(
            key_lo, key_hi, q_start, q_stride, len_q, win_right, win_left, HAS_RIGHT, HAS_LEFT, BLOCK_M
        )
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        h0 = hk64 * GROUP
        q_base = Q + pb * stride_qb + h0 * stride_qh + q0.to(tl.int64) * stride_qs
        do_base = DO + pb * stride_db + h0 * stride_dh + q0.to(tl.int64) * stride_ds
        lse_base = LSE + pb * stride_lb + h0 * stride_lh + q0
        delta_base = DELTA + pb * stride_lb + h0 * stride_lh + q0
        alibi_h0 = ALIBI
        if HAS_ALIBI:
            alibi_h0 = ALIBI + b.to(tl.int64) * tl.num_programs(1) * GROUP + h0
        # The spans last to first, as the tiles inside them (see _dkdv_tiles).
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, stride_qh, stride_dh,
            stride_lh, full_end, end, key_pos, q_start, q_stride, len_q, win_left, win_right, qk_scale,
            softcap_log2, alibi_h0, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, GROUP,
            BLOCK_M, BLOCK_D, HEAD_DIM, DOT_PRECISION, WIDE,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, stride_qh, stride_dh,
            stride_lh, full_start, full_end, key_pos, q_start, q_stride, len_q, win_left, win_right, qk_scale,
            softcap_log2, alibi_h0, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, GROUP,
            BLOCK_M, BLOCK_D, HEAD_DIM, DOT_PRECISION, WIDE,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, stride_qh, stride_dh,
            stride_lh, start, full_start, key_pos, q_start, q_stride, len_q, win_left, win_right, qk_scale,
            softcap_log2, alibi_h0, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, GROUP,
            BLOCK_M, BLOCK_D, HEAD_DIM, DOT_PRECISION, WIDE,
        )  # fmt: skip
        dk = dk * softmax_scale
        dk_ptrs = DK + pb * stride_dkb + hk64 * stride_dkh + krow[:, None] * stride_dks + offs_d[None, :]
        dv_ptrs = DV + pb * stride_dvb + hk64 * stride_dvh + krow[:, None] * stride_dvs + offs_d[None, :]
        _store_grad(dk_ptrs, dk, kv_mask, ACCUMULATE)
        _store_grad(dv_ptrs, dv, kv_mask, ACCUMULATE)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs,
    lo, hi, row_pos, k_start, k_stride, len_k, win_left, win_right, qk_scale, softcap_log2, slope_log2,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDE: tl.constexpr, blocks=0, kinds=0, bits=0, bits_row0=0, LISTED: tl.constexpr = 0,
    HAS_BITS: tl.constexpr = False, BITS_WORDS: tl.constexpr = 1, BITS_STRIDE: tl.constexpr = 0,
):  # fmt: skip
    """dq plus the key tiles in [lo, hi); masks and block-sparse walks as in ``_fwd_tiles``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    for it in range(lo, hi, BLOCK_N):
        start_n, block0 = listed_tile(it, blocks, LISTED)
        cols = start_n + offs_n
        kv_mask = d_ok
        if MASKED:
            kv_mask = kv_mask & (cols[:, None] < len_k)
        k = tl.load(
            row_pointers(k_base, start_n, offs_n, stride_ks, WIDE) + offs_d[None, :], mask=kv_mask, other=0.0
        )
        v = tl.load(
            row_pointers(v_base, start_n, offs_n, stride_vs, WIDE) + offs_d[None, :], mask=kv_mask, other=0.0
        )
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s, th = log2_scores(
            qk, qk_scale, softcap_log2, slope_log2, row_pos, k_start, k_stride, cols, HAS_SOFTCAP, HAS_ALIBI
        )
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            col_pos = k_start + k_stride * cols
            vis = visibility_mask(row_pos, col_pos, cols, len_k, win_left, win_right, HAS_LEFT, HAS_RIGHT)
            if HAS_BITS:
                block_bits = bits + tl.load(kinds + it // LISTED).to(tl.int64) * BITS_STRIDE
                in_rows, in_cols = (row_pos - bits_row0)[:, None], (cols - block0)[None, :]
                vis = vis & mask_bits(block_bits, in_rows, in_cols, BITS_WORDS)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = softcap_grad(p * (dp - delta[:, None]), th, HAS_SOFTCAP)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


# packed_docs changes with every packed batch: a constant or alignment hint of it would recompile.
@triton.jit(do_not_specialize=["packed_docs"])
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, ALIBI,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, softmax_scale, qk_scale, softcap_log2,
    q_start0, q_stride, k_start0, k_stride, q_per_len, k_per_len, win_left, win_right, packed_docs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    pid_m, h, b = program_tile(CU_Q, packed_docs, BLOCK_M, IS_VARLEN)
    q0, len_q, k0, len_k, pb = seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 < len_q:
        # per_len: block offsets that scale with each sequence's length (see positions.py). New
        # names, not reassigned arguments: Triton specializes an argument equal to 1 as a constant.
        q_start = q_start0 + q_per_len * len_q
        k_start = k_start0 + k_per_len * len_k
        h64 = h.to(tl.int64)
        hk = h64 // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < len_q
        io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        qrow = (q0 + offs_m).to(tl.int64)
        q = tl.load(
            Q + pb * stride_qb + h64 * stride_qh + qrow[:, None] * stride_qs + offs_d[None, :],
            mask=io_mask,
            other=0.0,
        )
        do = tl.load(
            DO + pb * stride_db + h64 * stride_dh + qrow[:, None] * stride_ds + offs_d[None, :],
            mask=io_mask,
            other=0.0,
        )
        lse2 = tl.load(LSE + pb * stride_lb + h64 * stride_lh + qrow, mask=row_ok, other=0.0)
        lse2 = lse2 * 1.4426950408889634
        delta = tl.load(DELTA + pb * stride_lb + h64 * stride_lh + qrow, mask=row_ok, other=0.0)
        k_base = K + pb * stride_kb + hk * stride_kh + k0.to(tl.int64) * stride_ks
        v_base = V + pb * stride_vb + hk * stride_vh + k0.to(tl.int64) * stride_vs
        row_pos = q_start + q_stride * offs_m
        row_lo = q_start + q_stride * m0
        row_hi = q_start + q_stride * (tl.minimum(m0 + BLOCK_M, len_q) - 1)
        start, full_start, full_end, end = visible_tiles(
            row_lo, row_hi, k_start, k_stride, len_k, win_left, win_right, HAS_LEFT, HAS_RIGHT, BLOCK_N
        )
        slope_log2 = alibi_slope_log2(ALIBI, b, h, tl.num_programs(1), HAS_ALIBI)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, start, full_start, row_pos,
            k_start, k_stride, len_k, win_left, win_right, qk_scale, softcap_log2, slope_log2,
            True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
            WIDE,
        )  # fmt: skip
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, full_start, full_end, row_pos,
            k_start, k_stride, len_k, win_left, win_right, qk_scale, softcap_log2, slope_log2,
            False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
            WIDE,
        )  # fmt: skip
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, full_end, end, row_pos,
            k_start, k_stride, len_k, win_left, win_right, qk_scale, softcap_log2, slope_log2,
            True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
            WIDE,
        )  # fmt: skip
        dq = dq * softmax_scale
        dq_ptrs = DQ + pb * stride_dqb + h64 * stride_dqh + qrow[:, None] * stride_dqs + offs_d[None, :]
        _store_grad(dq_ptrs, dq, io_mask, ACCUMULATE)


def _delta_key(out: torch.Tensor, dout: torch.Tensor, zero_dq: torch.Tensor | None) -> tuple:
    """What ``attention_delta``'s bound launch depends on besides its problem: the layouts."""
    return ("bound_delta", out.shape, out.stride(), out.dtype, dout.stride(), dout.dtype,
            None if zero_dq is None else zero_dq.stride())  # fmt: skip


def attention_delta(
    out: torch.Tensor,
    dout: torch.Tensor,
    problem: AttentionProblem,
    dlse: torch.Tensor | None = None,
    *,
    zero_dq: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """delta = rowsum(dout * out) in float32, shaped like the LSE (``problem.lse_shape``); minus
    ``dlse``, a gradient on the LSE, where given (d lse_i / d s_ij = p_ij, so it enters the
    backward only through delta). ``zero_dq``: a float32 tensor of out's shape (last stride 1)
    that the same launch fills with zeros, the fused backward's dQ accumulator. ``lse``: the
    forward's LSE (float32, that shape); where it is contiguous, delta is allocated like it
    (``empty_like``: a few µs of host time less than by shape), always contiguous as before."""
    vl = problem.varlen
    shape = problem.lse_shape(out.shape[0])
    if lse is not None and (lse.shape != shape or lse.dtype != torch.float32):
        raise ValueError(f"lse must be float32 of shape {tuple(shape)}, got {lse.dtype} {tuple(lse.shape)}")
    if lse is not None and lse.is_contiguous():
        delta = torch.empty_like(lse)
    else:
        delta = torch.empty(shape, device=out.device, dtype=torch.float32)
    zero = zero_dq is not None
    if zero and (zero_dq.shape != out.shape or zero_dq.dtype != torch.float32 or zero_dq.stride(-1) != 1):
        raise ValueError(f"zero_dq must be float32 of out's shape {tuple(out.shape)} with a last stride of 1")
    key = _delta_key(out, dout, zero_dq)
    bound = bound_launch(problem.derived, key)
    if bound is None or not bound(out, dout, delta, *((zero_dq,) if zero else ())):
        o4, do4 = as_4d(out, vl), as_4d(dout, vl)
        z4 = as_4d(zero_dq, vl) if zero else o4  # never written without ZERO_DQ
        block_m = 64
        grid, packed_docs = tile_grid(
            problem.max_seqlen_q, problem.heads_q, problem.batch, block_m, out.shape[0] if vl else None
        )
        if grid[0] > 0:
            args = (
                o4, do4, delta, problem.cu_seqlens_q, o4.stride(0), o4.stride(1), o4.stride(2),
                do4.stride(0), do4.stride(1), do4.stride(2), *lse_strides(delta, vl), problem.max_seqlen_q,
                packed_docs, z4, z4.stride(0), z4.stride(1), z4.stride(2),
            )  # fmt: skip
            kwargs = dict(
                HEAD_DIM=problem.head_dim, BLOCK_D=block_d(problem.head_dim), BLOCK_M=block_m, IS_VARLEN=vl,
                ZERO_DQ=zero,
            )
            slots = (o4, do4, delta, z4) if zero else (o4, do4, delta)
            launch_or_bind(problem.derived, key, _delta_kernel, grid, args, kwargs, slots)
    if dlse is not None:
        delta.sub_(dlse)
    return delta


def attention_gradients(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    problem: AttentionProblem,
    dlse: torch.Tensor | None = None,
    *,
    float32_dq: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), new tensors like q, k, v: the whole backward of one attention call, what
    autograd asks for. dout: like q; out and lse (float32, ``problem.lse_shape``): the
    forward's; dlse: a gradient on the LSE, or None. ``float32_dq``: dq may come back as the
    float32 buffer that the fused kernel added it into (q's shape, contiguous), uncast: autograd's
    engine casts a gradient to its input's dtype itself, in C++, for less host time than a cast
    here (docs/experiments.md §83).

    The steady state of a layout that runs the fused Hopper backward with a float32 dQ
    accumulator takes a short path: both launches (delta with the accumulator's zero fill, then
    the fused kernel) bound at the layout's second call (``launch_or_bind``) under a key of the
    inputs' layouts, which fix every buffer's. What ``uses_fused_backward`` decided is fixed by
    that key, the problem and the device (the bound launches check the device and the
    alignments), except two switches read on every call: ``RINGFLASH_FUSED_BACKWARD`` and
    deterministic algorithms."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    fused = hopper_module("backward")
    if fused is not None:
        key = ("plain_backward", q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.shape, v.stride(),
               dout.stride(), dout.dtype, lse.stride(), out.stride(), out.dtype)  # fmt: skip
        derived = problem.derived
        bound = bound_launch(derived, key)
        if bound is not None:  # the key and the problem fix all else the general path checks
            plain = enabled("RINGFLASH_FUSED_BACKWARD") and not torch.are_deterministic_algorithms_enabled()
        else:
            plain = (
                uses_fused_backward(problem, q, k, v)
                and fused.computes_dq(problem)
                and hopper_module("tma").tma_layout_ok(dout)
            )
        if plain:
            # empty_like: cheaper on the host than allocating by shape (~4 µs each, experiments §67).
            dq32 = torch.empty_like(q, dtype=torch.float32, memory_format=torch.contiguous_format)
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            delta = None
            bound_delta = derived.get(("delta", key)) if bound is not None else None
            if bound_delta is not None:  # delta like the LSE, contiguous (the key fixes lse's strides)
                delta = torch.empty_like(lse)
                if not bound_delta(out, dout, delta, dq32):
                    delta = None
                elif dlse is not None:
                    delta.sub_(dlse)
            if delta is None:
                delta = attention_delta(out, dout, problem, dlse, zero_dq=dq32, lse=lse)
                if bound is not None and lse.is_contiguous():  # delta's launch, bound by now or never
                    derived[("delta", key)] = bound_launch(derived, _delta_key(out, dout, dq32))
            if bound is not None and bound(q, k, v, dout, dq32, dk, dv, lse, delta):
                return dq32 if float32_dq else dq32.to(q.dtype), dk, dv
            if bound is None and lse.stride() == delta.stride():
                check_token_stride(dout=dout, dq=dq32, dk=dk, dv=dv)
                fused.fused_backward(dout, q, k, v, lse, delta, problem, dq32, dk, dv, False, bind_key=key)
                return dq32 if float32_dq else dq32.to(q.dtype), dk, dv
            # A bound launch that stepped aside (alignment, device, Triton's binding asked for),
            # or an LSE that attention_backward refuses.
            return attention_backward(dout, q, k, v, lse, delta, problem, dk=dk, dv=dv)
    delta = attention_delta(out, dout, problem, dlse)
    return attention_backward(dout, q, k, v, lse, delta, problem)


def _fused_attention_backward(dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate, **mask):
    """attention_backward on the fused kernel: dQ goes through a float32 buffer that the kernel
    adds into (the caller's own when it is one); at the 256 build the fused kernel computes dK/dV
    and the dQ kernel (hopper/dq.py) writes dq directly. ``mask``: a block mask's ``mask_lists``
    and ``mask_q`` for ``fused_backward`` (block_sparse.py; not the 256 build)."""
    module = hopper_module("backward")
    tma_ok = hopper_module("tma").tma_layout_ok
    if not tma_ok(dout):
        dout = dout.contiguous()
    if not module.computes_dq(problem):
        module.fused_backward(dout, q, k, v, lse, delta, problem, None, dk, dv, accumulate)
        # The dQ kernel stores rows with a unit stride in head_dim: any other dq gets a copy.
        out = dq if dq.stride(-1) == 1 else torch.empty(q.shape, device=q.device, dtype=dq.dtype)
        hopper_module("dq").fused_dq(dout, q, k, v, lse, delta, problem, out, accumulate and out is dq)
        if out is not dq:
            dq.add_(out) if accumulate else dq.copy_(out)
        return dq, dk, dv
    direct = dq.dtype == torch.float32 and tma_ok(dq)
    dq32 = dq if direct else torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    if direct and not accumulate:
        dq32.zero_()
    module.fused_backward(dout, q, k, v, lse, delta, problem, dq32, dk, dv, accumulate, **mask)
    if not direct:
        dq.add_(dq32) if accumulate else dq.copy_(dq32)
    return dq, dk, dv


def gradient_buffers(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    accumulate: bool,
    compute_dkdv: bool,
    compute_dq: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The (dq, dk, dv) buffers a backward launch writes: the caller's, or, missing, new ones like
    q/k/v for the kernels that run; ValueError where ``accumulate`` has no buffer to add into or
    a token stride is too large for the kernels (``check_token_stride``)."""
    if accumulate and ((compute_dq and dq is None) or (compute_dkdv and (dk is None or dv is None))):
        raise ValueError(
            "accumulate=True needs the buffers to add into: dq with compute_dq, dk and dv with compute_dkdv"
        )
    if compute_dq and dq is None:
        dq = torch.empty_like(q)
    if compute_dkdv:
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
    check_token_stride(dout=dout, dq=dq, dk=dk, dv=dv)
    return dq, dk, dv


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    problem: AttentionProblem,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    accumulate: bool = False,
    compute_dkdv: bool = True,
    compute_dq: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch the dK/dV and dQ kernels for a validated problem.

    dout: like q. lse: the forward's float32 LSE of these queries over *all* keys they attend
    to (for a ring step, the final merged LSE). delta: ``attention_delta(out, dout, problem)``.
    dq/dk/dv buffers (shapes of q/k/v, any supported float dtype) are written, or added to when
    ``accumulate`` is True; missing ones are allocated in q's dtype. Returns (dq, dk, dv).
    ``compute_dkdv``/``compute_dq`` launch only one of the two kernels, so a caller can ship
    dK/dV while dQ is still being computed: the other kernel's buffers are then neither needed
    nor touched, and come back as given (None if not given).
    """
    dq, dk, dv = gradient_buffers(dout, q, k, v, dq, dk, dv, accumulate, compute_dkdv, compute_dq)
    if lse.stride() != delta.stride():
        raise ValueError(f"lse and delta must share strides, got {lse.stride()} and {delta.stride()}")
    if compute_dq and compute_dkdv and lse.stride(-1) == 1 and uses_fused_backward(problem, q, k, v):
        return _fused_attention_backward(dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate)
    vl = problem.varlen
    q4, k4, v4, do4 = (as_4d(t, vl) for t in (q, k, v, dout))
    if problem.max_seqlen_q == 0 or problem.max_seqlen_k == 0:
        if not accumulate:
            for g, launched in ((dq, compute_dq), (dk, compute_dkdv), (dv, compute_dkdv)):
                if launched:
                    g.zero_()
        return dq, dk, dv
    b = problem.bounds
    alibi = alibi_tensor(problem)
    common = dict(
        GROUP=problem.group, HEAD_DIM=problem.head_dim, BLOCK_D=block_d(problem.head_dim),
        IS_VARLEN=vl, HAS_LEFT=b.left is not None, HAS_RIGHT=b.right is not None,
        **score_constexprs(problem), ACCUMULATE=accumulate, DOT_PRECISION=dot_precision(q.dtype),
        WIDE=wide_offsets(problem.max_seqlen_q, q, dout, dq)
        or wide_offsets(problem.max_seqlen_k, k, v, dk, dv),
    )  # fmt: skip
    scalars = (
        problem.max_seqlen_q, problem.max_seqlen_k, problem.softmax_scale, *score_scales(problem),
        *problem.position_args(), b.left or 0, b.right or 0,
    )  # fmt: skip
    qkv_strides = (
        q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2), do4.stride(0), do4.stride(1), do4.stride(2),
    )  # fmt: skip
    cfg = backward_kv_config(problem.head_dim, q.dtype == torch.float32, problem.max_seqlens)
    grid, packed_docs = tile_grid(
        problem.max_seqlen_k, problem.heads_k, problem.batch, cfg.block_n, k.shape[0] if vl else None
    )
    if compute_dkdv:
        dk4, dv4 = as_4d(dk, vl), as_4d(dv, vl)
        launch(
            _dkdv_kernel, grid,
            q4, k4, v4, do4, lse, delta, dk4, dv4, problem.cu_seqlens_q, problem.cu_seqlens_k, alibi,
            *qkv_strides, *dk4.stride()[:3], *dv4.stride()[:3],
            *lse_strides(lse, vl), *scalars, packed_docs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )  # fmt: skip
    cfg = backward_q_config(problem.head_dim, q.dtype == torch.float32, problem.max_seqlens)
    grid, packed_docs = tile_grid(
        problem.max_seqlen_q, problem.heads_q, problem.batch, cfg.block_m, q.shape[0] if vl else None
    )
    if compute_dq:
        dq4 = as_4d(dq, vl)
        launch(
            _dq_kernel, grid,
            q4, k4, v4, do4, lse, delta, dq4, problem.cu_seqlens_q, problem.cu_seqlens_k, alibi,
            *qkv_strides, dq4.stride(0), dq4.stride(1), dq4.stride(2),
            *lse_strides(lse, vl), *scalars, packed_docs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )  # fmt: skip
    return dq, dk, dv
