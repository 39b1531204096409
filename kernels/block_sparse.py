"""Block-sparse attention in Triton: the forward and backward over a ``TileMask``'s visible blocks.

The programs are those of forward.py / backward.py (one per query tile, or per key tile for
dK/dV), and so are the tile loops (``_fwd_tiles``, ``_dq_tiles``, ``_dkdv_tiles``); only the
walk differs: instead of a span of key tiles from the causal/window bounds, a program walks its
block's list of visible blocks (``tile_mask.py``): first the partial ones with their bit
masks, then the full ones without a mask, each group in one flat loop (``tiling.listed_tile``)
that the software pipeline runs across block boundaries, as FlexAttention's kernels do.
Blocks (multiples of 128 positions) hold whole kernel tiles (at most 128 rows), so a program's
tile lies in one mask block. The dK/dV program walks the key block's list of query blocks for
each query head of its GQA group in turn (heads may have different masks).

Softcap, ALiBi (flash-attn's bottom-right distances, as ``flash_attn_func``) and GQA are those
of the other kernels; the mask replaces causal/window bounds and packed documents. On Hopper
the forward of 128-position blocks at head_dim up to 128 runs the warp-specialized kernel
(hopper/forward.py, walking the lists as hopper/block_lists.py says), where
``uses_fused_forward`` allows it (``RINGFLASH_FUSED_FORWARD=0`` keeps these kernels); so does
the backward of 128-key blocks, dQ and dK/dV in one launch (hopper/backward.py, SPARSE), where
``uses_fused_backward`` allows it (not under deterministic algorithms, nor with
``RINGFLASH_FUSED_BACKWARD=0``) and the caller wants both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backward import (
    _dkdv_tiles,
    _dq_tiles,
    _fused_attention_backward,
    _store_grad,
    attention_delta,
    gradient_buffers,
)
from .configs import block_d, sparse_dq_config, sparse_forward_config, sparse_kv_config
from .forward import _fwd_tiles, dot_precision
from .hopper.dispatch import hopper_module, uses_fused_backward, uses_fused_forward
from .launcher import launch
from .problem import AttentionProblem, wide_offsets
from .scores import alibi_slope_log2, alibi_tensor, score_constexprs, score_scales
from .tile_mask import TileMask


@triton.jit
def _block_list(COUNT, INDEX, KIND, b64, h64, block, stride_cb, stride_ch, stride_ib, stride_ih, stride_im,
                SIZE: tl.constexpr):  # fmt: skip
    """The list of (batch b64, head h64, block ``block``) as a walk takes it: (end of its partial
    blocks, end of its full ones, both in positions of a walk over SIZE-position blocks laid end
    to end; its block numbers; their kinds)."""
    counts = COUNT + b64 * stride_cb + h64 * stride_ch + block * 2  # (partial, full) per block
    partial_end = tl.load(counts) * SIZE
    full_end = partial_end + tl.load(counts + 1) * SIZE
    entries = b64 * stride_ib + h64 * stride_ih + block * stride_im
    return partial_end, full_end, INDEX + entries, KIND + entries


@triton.jit
def _ordered_program(ORDER, TILES: tl.constexpr):
    """(tile, head) of this program of a (blocks * TILES, heads, batch) grid over a mask's
    blocks of TILES tiles each, renumbered from the launch order by ORDER (``TileMask.kv_order``
    or ``q_order``: the blocks, longest list first, then how many are long): the long blocks'
    tiles first for every head, then each head's tiles of the other blocks. A long list started
    late would run on alone after the rest; one head's programs at work together share its
    other side's tiles in L2."""
    heads = tl.num_programs(1)
    n = tl.num_programs(0)
    launched = tl.program_id(0) + n * tl.program_id(1)
    n_long = tl.load(ORDER + n // TILES) * TILES
    rest = launched - n_long * heads
    n_rest = tl.maximum(n - n_long, 1)
    head = tl.where(rest < 0, launched % heads, rest // n_rest)
    t = tl.where(rest < 0, launched // heads, n_long + rest % n_rest)
    return tl.load(ORDER + t // TILES) * TILES + t % TILES, head


@triton.jit
def _sparse_fwd_kernel(
    Q, K, V, O, LSE, ALIBI, COUNT, INDEX, KIND, BITS, ORDER,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_im,
    seqlen_q, seqlen_k, qk_scale, softcap_log2, q_start,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK_Q: tl.constexpr, MASK_K: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    pid_m, h = _ordered_program(ORDER, MASK_Q // BLOCK_M)  # query tiles, longest lists first
    b = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    hk = h64 // GROUP
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    k_base = K + b64 * stride_kb + hk * stride_kh
    v_base = V + b64 * stride_vb + hk * stride_vh
    tile_m = tl.arange(0, BLOCK_M)
    offs_m = m0 + tile_m
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :], mask=io_mask, other=0.0)
    row_pos = q_start + offs_m
    slope_log2 = alibi_slope_log2(ALIBI, b, h, tl.num_programs(1), HAS_ALIBI)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qb = m0 // MASK_Q
    partial_end, full_end, blocks, kinds = _block_list(
        COUNT, INDEX, KIND, b64, h64, qb, stride_cb, stride_ch, stride_ib, stride_ih, stride_im, MASK_K
    )  # the row's partial blocks, then its full ones
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, 0, partial_end, row_pos, 0, 1, seqlen_k,
        0, 0, qk_scale, softcap_log2, slope_log2, True, False, False, HAS_SOFTCAP, HAS_ALIBI,
        BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION, WIDE, blocks, kinds, BITS,
        q_start + qb * MASK_Q, MASK_K, True, MASK_K // 32, MASK_Q * MASK_K // 32,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, partial_end, full_end, row_pos, 0, 1,
        seqlen_k, 0, 0, qk_scale, softcap_log2, slope_log2, False, False, False, HAS_SOFTCAP, HAS_ALIBI,
        BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION, WIDE, blocks, kinds, BITS, 0, MASK_K,
    )  # fmt: skip
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = O + b64 * stride_ob + h64 * stride_oh + offs_m[:, None].to(tl.int64) * stride_os
    o_ptrs += offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=io_mask)
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + offs_m, lse, mask=row_ok)


@triton.jit
def _sparse_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, ALIBI, COUNT, INDEX, KIND, BITS, ORDER,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
    stride_cb, stride_ch, stride_ib, stride_ih, stride_im,
    seqlen_q, seqlen_k, softmax_scale, qk_scale, softcap_log2, q_start,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK_Q: tl.constexpr, MASK_K: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    pid_m, h = _ordered_program(ORDER, MASK_Q // BLOCK_M)  # query tiles, longest lists first
    b = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    hk = h64 // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + h64 * stride_qh + rows[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    do_ptrs = DO + b64 * stride_db + h64 * stride_dh + rows[:, None] * stride_ds + offs_d[None, :]
    do = tl.load(do_ptrs, mask=io_mask, other=0.0)
    lse2 = tl.load(LSE + b64 * stride_lb + h64 * stride_lh + rows, mask=row_ok, other=0.0)
    lse2 = lse2 * 1.4426950408889634
    delta = tl.load(DELTA + b64 * stride_lb + h64 * stride_lh + rows, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + hk * stride_kh
    v_base = V + b64 * stride_vb + hk * stride_vh
    row_pos = q_start + offs_m
    slope_log2 = alibi_slope_log2(ALIBI, b, h, tl.num_programs(1), HAS_ALIBI)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qb = m0 // MASK_Q
    partial_end, full_end, blocks, kinds = _block_list(
        COUNT, INDEX, KIND, b64, h64, qb, stride_cb, stride_ch, stride_ib, stride_ih, stride_im, MASK_K
    )  # the row's partial blocks, then its full ones
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, 0, partial_end, row_pos, 0, 1, seqlen_k,
        0, 0, qk_scale, softcap_log2, slope_log2, True, False, False, HAS_SOFTCAP, HAS_ALIBI,
        BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION, WIDE, blocks, kinds, BITS,
        q_start + qb * MASK_Q, MASK_K, True, MASK_K // 32, MASK_Q * MASK_K // 32,
    )  # fmt: skip
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, partial_end, full_end, row_pos, 0, 1,
        seqlen_k, 0, 0, qk_scale, softcap_log2, slope_log2, False, False, False, HAS_SOFTCAP, HAS_ALIBI,
        BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION, WIDE, blocks, kinds, BITS, 0, MASK_K,
    )  # fmt: skip
    dq = dq * softmax_scale
    dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh + rows[:, None] * stride_dqs + offs_d[None, :]
    _store_grad(dq_ptrs, dq, io_mask, ACCUMULATE)


@triton.jit
def _sparse_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, ALIBI, COUNT, INDEX, KIND, BITS, ORDER,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh, stride_cb, stride_ch, stride_ib, stride_ih, stride_im,
    seqlen_q, seqlen_k, softmax_scale, qk_scale, softcap_log2, q_start,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK_Q: tl.constexpr, MASK_K: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    pid_n, hk = _ordered_program(ORDER, MASK_K // BLOCK_N)  # key tiles, longest lists first
    b = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    krow = offs_n.to(tl.int64)
    k_ptrs = K + b64 * stride_kb + hk64 * stride_kh + krow[:, None] * stride_ks + offs_d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v_ptrs = V + b64 * stride_vb + hk64 * stride_vh + krow[:, None] * stride_vs + offs_d[None, :]
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    kb = n0 // MASK_K
    for g in range(0, GROUP):
        h64 = hk64 * GROUP + g
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DO + b64 * stride_db + h64 * stride_dh
        lse_base = LSE + b64 * stride_lb + h64 * stride_lh
        delta_base = DELTA + b64 * stride_lb + h64 * stride_lh
        alibi_h = ALIBI
        if HAS_ALIBI:
            alibi_h = ALIBI + b64 * tl.num_programs(1) * GROUP + h64
        partial_end, full_end, blocks, kinds = _block_list(
            COUNT, INDEX, KIND, b64, h64, kb, stride_cb, stride_ch, stride_ib, stride_ih, stride_im, MASK_Q
        )
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, stride_qh,
            stride_dh, stride_lh, 0, partial_end, offs_n, q_start, 1, seqlen_q, 0, 0, qk_scale, softcap_log2,
            alibi_h, True, False, False, HAS_SOFTCAP, HAS_ALIBI, 1, BLOCK_M, BLOCK_D, HEAD_DIM,
            DOT_PRECISION, WIDE, blocks, kinds, BITS, kb * MASK_K, MASK_Q, True,
            MASK_K // 32, MASK_Q * MASK_K // 32,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds, stride_qh,
            stride_dh, stride_lh, partial_end, full_end, offs_n, q_start, 1, seqlen_q, 0, 0, qk_scale,
            softcap_log2, alibi_h, False, False, False, HAS_SOFTCAP, HAS_ALIBI, 1, BLOCK_M, BLOCK_D,
            HEAD_DIM, DOT_PRECISION, WIDE, blocks, kinds, BITS, 0, MASK_Q,
        )  # fmt: skip
    dk = dk * softmax_scale
    dk_ptrs = DK + b64 * stride_dkb + hk64 * stride_dkh + krow[:, None] * stride_dks + offs_d[None, :]
    dv_ptrs = DV + b64 * stride_dvb + hk64 * stride_dvh + krow[:, None] * stride_dvs + offs_d[None, :]
    _store_grad(dk_ptrs, dk, kv_mask, ACCUMULATE)
    _store_grad(dv_ptrs, dv, kv_mask, ACCUMULATE)


def check_tile_mask(mask: object, problem: AttentionProblem, device: torch.device) -> TileMask:
    """``mask`` if it is a TileMask that fits the problem's (dense) shapes and q's device."""
    if problem.varlen:
        raise ValueError("block_mask describes dense (batch, seqlen) inputs: it cannot take cu_seqlens")
    shape = (problem.batch, problem.heads_q, problem.max_seqlen_q, problem.max_seqlen_k)
    return check_mask_fits(mask, *shape, device)


def check_mask_fits(
    mask: object, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, device: torch.device
) -> TileMask:
    """``mask`` if it is a TileMask for ``batch`` sequences (or shared), ``heads_q`` heads (or
    shared), seqlen_q x seqlen_k, on ``device``; shapes only (a trace checks it too)."""
    if not isinstance(mask, TileMask):
        raise TypeError(f"block_mask must be a ringflash TileMask or a FlexAttention BlockMask, got {mask!r}")
    if (mask.seqlen_q, mask.seqlen_k) != (seqlen_q, seqlen_k):
        raise ValueError(
            f"block_mask is for seqlen_q, seqlen_k = {mask.seqlen_q}, {mask.seqlen_k}; the call has "
            f"{seqlen_q}, {seqlen_k}"
        )
    if mask.batch not in (1, batch) or mask.heads not in (1, heads_q):
        raise ValueError(
            f"block_mask has batch {mask.batch} and heads {mask.heads}: each must be 1 or the call's "
            f"({batch} sequences, {heads_q} query heads)"
        )
    if mask.device != device:
        raise ValueError(f"block_mask is on {mask.device}, q on {device}")
    return mask


def _mask_args(mask: TileMask, lists: str) -> tuple:
    """The (COUNT, INDEX, KIND) tensors of ``lists`` ("kv": per query block, "q": per key block),
    BITS, and their strides (0 where the mask is shared by the batch or the heads)."""
    count, index, kind = (getattr(mask, f"{lists}_{n}") for n in ("count", "index", "kind"))
    bs = lambda t, d: 0 if t.shape[d] == 1 else t.stride(d)  # noqa: E731
    strides = (bs(count, 0), bs(count, 1), bs(index, 0), bs(index, 1), index.stride(2))
    return (count, index, kind, mask.bits), strides


def sparse_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: TileMask,
    problem: AttentionProblem,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q (batch, seqlen_q, heads_q, head_dim) over k/v (batch, seqlen_k, heads_k,
    head_dim) where ``mask`` leaves pairs visible (``check_tile_mask`` first); out in q's dtype,
    lse float32 (batch, heads_q, seqlen_q), rows that see nothing 0 / -inf. ``out``/``lse``:
    buffers (views with a unit last stride) to write instead of new tensors (a ring step's)."""
    out = torch.empty_like(q) if out is None else out
    if lse is None:
        lse = torch.empty(problem.lse_shape(q.shape[0]), device=q.device, dtype=torch.float32)
    tensors, strides = _mask_args(mask, "kv")
    fused = hopper_module("forward") if uses_fused_forward(problem, q, k, v) else None
    if fused is not None and fused.sparse_supports(problem, mask):
        fused.fused_forward(q, k, v, problem, out, lse, mask_lists=(tensors, strides))
        return out, lse
    cfg = sparse_forward_config(problem.head_dim, q.dtype == torch.float32, problem.max_seqlens)
    grid = (_listed_tiles(mask.kv_count, mask.block_q, cfg.block_m), problem.heads_q, problem.batch)
    launch(
        _sparse_fwd_kernel, grid, q, k, v, out, lse, alibi_tensor(problem), *tensors, mask.kv_order,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], lse.stride(0), lse.stride(1),
        *strides, problem.max_seqlen_q, problem.max_seqlen_k, *score_scales(problem),
        problem.q_positions.start, GROUP=problem.group, HEAD_DIM=problem.head_dim,
        BLOCK_D=block_d(problem.head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_Q=mask.block_q,
        MASK_K=mask.block_k, **score_constexprs(problem), DOT_PRECISION=dot_precision(q.dtype),
        WIDE=_wide(problem, q, k, v, out),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, lse


def sparse_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    mask: TileMask,
    problem: AttentionProblem,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``sparse_forward`` given dout (and dlse, a gradient on the LSE, or None)."""
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    delta = attention_delta(out, dout, problem, dlse)
    return sparse_gradients(dout, q, k, v, lse, delta, mask, problem)


def sparse_gradients(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: TileMask,
    problem: AttentionProblem,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    accumulate: bool = False,
    compute_dkdv: bool = True,
    compute_dq: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The dK/dV and dQ kernels under ``mask``, arguments as ``attention_backward``'s: lse the
    final LSE of these queries over all their keys, delta from ``attention_delta``; dq/dk/dv
    buffers written (added to with ``accumulate``) or, missing, allocated like q/k/v; one of the
    two kernels alone with ``compute_dkdv``/``compute_dq`` (a ring step ships dK/dV early)."""
    dq, dk, dv = gradient_buffers(dout, q, k, v, dq, dk, dv, accumulate, compute_dkdv, compute_dq)
    both = compute_dq and compute_dkdv and lse.stride(-1) == 1 and lse.stride() == delta.stride()
    if both and uses_fused_sparse_backward(problem, mask, q, k, v):
        lists = _mask_args(mask, "q")
        return _fused_attention_backward(
            dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate, mask_lists=lists, mask_q=mask.block_q,
            mask_order=mask.q_order,
        )  # fmt: skip
    fp32, scales = q.dtype == torch.float32, score_scales(problem)
    common = dict(
        GROUP=problem.group, HEAD_DIM=problem.head_dim, BLOCK_D=block_d(problem.head_dim),
        MASK_Q=mask.block_q, MASK_K=mask.block_k, **score_constexprs(problem),
        DOT_PRECISION=dot_precision(q.dtype), ACCUMULATE=accumulate,
        WIDE=_wide(problem, q, k, v, dout) or _wide(problem, dq, dk, dv, None),  # the buffers' strides too
    )  # fmt: skip
    tail = (problem.max_seqlen_q, problem.max_seqlen_k, problem.softmax_scale, *scales,
            problem.q_positions.start)  # fmt: skip
    if compute_dkdv:
        cfg = sparse_kv_config(problem.head_dim, fp32, problem.max_seqlens)
        tensors, strides = _mask_args(mask, "q")
        launch(
            _sparse_dkdv_kernel,
            (_listed_tiles(mask.q_count, mask.block_k, cfg.block_n), problem.heads_k, problem.batch),
            q, k, v, dout, lse, delta, dk, dv, alibi_tensor(problem), *tensors, mask.q_order,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3],
            *dv.stride()[:3], lse.stride(0), lse.stride(1), *strides, *tail, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if compute_dq:
        cfg = sparse_dq_config(problem.head_dim, fp32, problem.max_seqlens)
        tensors, strides = _mask_args(mask, "kv")
        launch(
            _sparse_dq_kernel,
            (_listed_tiles(mask.kv_count, mask.block_q, cfg.block_m), problem.heads_q, problem.batch),
            q, k, v, dout, lse, delta, dq, alibi_tensor(problem), *tensors, mask.kv_order,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3],
            lse.stride(0), lse.stride(1), *strides, *tail, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return dq, dk, dv


def uses_fused_sparse_backward(
    problem: AttentionProblem, mask: TileMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """Whether ``sparse_gradients`` computing dQ and dK/dV together (with an LSE of unit last
    stride) runs them in one launch of the Hopper backward's listed walk: where
    ``uses_fused_backward`` holds and that kernel takes the mask's blocks."""
    if not uses_fused_backward(problem, q, k, v):
        return False
    return hopper_module("backward").sparse_supports(problem, mask)


def _listed_tiles(count: torch.Tensor, block: int, tile: int) -> int:
    """Grid axis 0 of a Triton walk over the blocks ``count`` lists (``_ordered_program``): whole
    blocks of tiles; a tile past the sequence's end loads and stores nothing."""
    return count.shape[2] * (block // tile)


def _wide(problem: AttentionProblem, q, k, v, o) -> bool:
    return wide_offsets(problem.max_seqlen_q, q, o) or wide_offsets(problem.max_seqlen_k, k, v)


class BlockSparseAttention(torch.autograd.Function):
    """(out, lse) of ``sparse_forward``, both differentiable (a gradient on the LSE enters the
    backward as delta -= dlse, as in ops.py)."""

    @staticmethod
    def forward(ctx, q, k, v, mask: TileMask, problem: AttentionProblem):
        out, lse = sparse_forward(q, k, v, mask, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.problem = mask, problem
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        return (*sparse_backward(dout, q, k, v, out, lse, dlse, ctx.mask, ctx.problem), None, None)
