"""FlashAttention-2 forward in Triton: output and row logsumexp (LSE) for a query block against a key block.

One program per (query tile, query head, sequence). It walks the key tiles that its queries can
see (``tiling.visible_tiles``), applies the mask only on tiles that straddle a boundary, keeps a
running max and sum in the log2 domain (``log2(e)`` folded into the scale, so ``exp2`` is used)
and rescales once at the end. Scores may be softcapped (``softcap * tanh(score / softcap)``) and
ALiBi-biased (``-slope * |pq - pk|`` in global positions, on every tile, mask-free ones too)
as in flash-attn (scores.py); both are constexpr-gated, so calls without them run the plain
kernel.

On an H100/H200 at head_dim 128 ``attention_forward`` runs the warp-specialized Gluon kernel of
hopper/forward.py instead, where ``uses_fused_forward`` says it can.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import block_d, forward_config
from .hopper.dispatch import enabled, hopper_module, uses_fused_forward
from .launcher import launch
from .problem import AttentionProblem, check_token_stride, wide_offsets
from .scores import LOG2E as LOG2E  # re-exported: the Hopper kernels take it from here
from .scores import alibi_slope_log2, alibi_tensor, log2_scores, score_constexprs, score_scales
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


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs,
    lo, hi, row_pos, k_start, k_stride, len_k, win_left, win_right, qk_scale, softcap_log2, slope_log2,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDE: tl.constexpr, blocks=0, kinds=0, bits=0, bits_row0=0, LISTED: tl.constexpr = 0,
    HAS_BITS: tl.constexpr = False, BITS_WORDS: tl.constexpr = 1, BITS_STRIDE: tl.constexpr = 0,
):  # fmt: skip
    """The key tiles in [lo, hi) folded into (acc, l_i, m_i). MASKED: keys past len_k and the
    window hidden. Block-sparse (block_sparse.py): LISTED > 0 walks the key blocks listed at
    ``blocks`` (``tiling.listed_tile``; lo/hi offsets into the list), and HAS_BITS hides what
    each one's bit mask does (block ``kinds[entry]`` of ``bits``, BITS_STRIDE words each; its
    rows from position bits_row0)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    for it in range(lo, hi, BLOCK_N):
        start_n, block0 = listed_tile(it, blocks, LISTED)
        cols = start_n + offs_n
        kv_mask = d_ok
        if MASKED:
            kv_mask = kv_mask & (cols[:, None] < len_k)
        k_rows = row_pointers(k_base, start_n, offs_n, stride_ks, WIDE)
        k = tl.load(k_rows + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            col_pos = k_start + k_stride * cols
            vis = visibility_mask(row_pos, col_pos, cols, len_k, win_left, win_right, HAS_LEFT, HAS_RIGHT)
            if HAS_BITS:
                block_bits = bits + tl.load(kinds + it // LISTED).to(tl.int64) * BITS_STRIDE
                in_rows, in_cols = (row_pos - bits_row0)[:, None], (cols - block0)[None, :]
                vis = vis & mask_bits(block_bits, in_rows, in_cols, BITS_WORDS)
        # ALiBi biases every tile, the mask-free ones too.
        qk, _ = log2_scores(
            qk, qk_scale, softcap_log2, slope_log2, row_pos, k_start, k_stride, cols, HAS_SOFTCAP, HAS_ALIBI
        )
        if MASKED:
            qk = tl.where(vis, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen nothing yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = m_new
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = row_pointers(v_base, start_n, offs_n, stride_vs, WIDE)
        v = tl.load(v_rows + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# packed_docs changes with every packed batch: a constant or alignment hint of it would recompile.
@triton.jit(do_not_specialize=["packed_docs"])
def _fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, ALIBI,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, qk_scale, softcap_log2, q_start0, q_stride, k_start0, k_stride, q_per_len, k_per_len,
    win_left, win_right, packed_docs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    pid_m, h, b = program_tile(CU_Q, packed_docs, BLOCK_M, IS_VARLEN)
    q0, len_q, k0, len_k, pb = seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 < len_q:
        # per_len: block offsets that scale with each sequence's length (see positions.py). New
        # names, not reassigned arguments: Triton specializes an argument equal to 1 as a constant.
        q_start = q_start0 + q_per_len * len_q
        k_start = k_start0 + k_per_len * len_k
        hk = h // GROUP
        q_base = Q + pb * stride_qb + h.to(tl.int64) * stride_qh + q0.to(tl.int64) * stride_qs
        k_base = K + pb * stride_kb + hk.to(tl.int64) * stride_kh + k0.to(tl.int64) * stride_ks
        v_base = V + pb * stride_vb + hk.to(tl.int64) * stride_vh + k0.to(tl.int64) * stride_vs
        tile_m = tl.arange(0, BLOCK_M)
        offs_m = m0 + tile_m
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < len_q
        io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(
            row_pointers(q_base, m0, tile_m, stride_qs, WIDE) + offs_d[None, :], mask=io_mask, other=0.0
        )
        row_pos = q_start + q_stride * offs_m
        row_lo = q_start + q_stride * m0
        row_hi = q_start + q_stride * (tl.minimum(m0 + BLOCK_M, len_q) - 1)
        start, full_start, full_end, end = visible_tiles(
            row_lo, row_hi, k_start, k_stride, len_k, win_left, win_right, HAS_LEFT, HAS_RIGHT, BLOCK_N
        )
        slope_log2 = alibi_slope_log2(ALIBI, b, h, tl.num_programs(1), HAS_ALIBI)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, start, full_start, row_pos,
            k_start, k_stride, len_k, win_left, win_right, qk_scale, softcap_log2, slope_log2,
            True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
            WIDE,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, full_start, full_end, row_pos,
            k_start, k_stride, len_k, win_left, win_right, qk_scale, softcap_log2, slope_log2,
            False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
            WIDE,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, full_end, end, row_pos,
            k_start, k_stride, len_k, win_left, win_right, qk_scale, softcap_log2, slope_log2,
            True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
            WIDE,
        )  # fmt: skip
        # Rows that saw no key: output 0 and LSE -inf, never NaN.
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        out = acc / l_safe[:, None]
        # log2-domain max and sum back to a natural-log LSE (0.693... = ln 2).
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        o_base = O + pb * stride_ob + h.to(tl.int64) * stride_oh + q0.to(tl.int64) * stride_os
        o_rows = row_pointers(o_base, m0, tile_m, stride_os, WIDE)
        tl.store(o_rows + offs_d[None, :], out.to(O.dtype.element_ty), mask=io_mask)
        lse_base = LSE + pb * stride_lb + h.to(tl.int64) * stride_lh + q0
        tl.store(lse_base + offs_m, lse, mask=row_ok)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (tf32 would miss the 1e-4 bar); halves are unaffected."""
    return "ieee" if dtype == torch.float32 else "tf32"


def as_4d(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    """Varlen (total, heads, dim) tensors are launched as one batch of (1, total, heads, dim)."""
    return t.unsqueeze(0) if varlen else t


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel for a validated problem (see ``problem.build_problem``).

    q: (batch, seqlen_q, heads_q, head_dim) or varlen (total_q, heads_q, head_dim); k, v likewise
    with heads_k heads. ``out`` (q's shape, any supported float dtype, e.g. a float32 ring
    accumulator view) and ``lse`` (float32, ``problem.lse_shape``) may be given to write into.
    Returns (out, lse); lse is the natural-log logsumexp of each query row, -inf where the row
    sees no key. On an H100/H200 the Hopper kernel runs where ``uses_fused_forward`` says so.
    """
    if out is None:  # q's strides, or contiguous ones: within what build_problem checked of q
        out = torch.empty_like(q)
    else:
        check_token_stride(out=out)
    if lse is None:
        lse = torch.empty(problem.lse_shape(q.shape[0]), device=q.device, dtype=torch.float32)
    fused = hopper_module("forward")
    if fused is not None and enabled("RINGFLASH_FUSED_FORWARD"):
        if fused.bound_forward(problem, q, k, v, out, lse):  # a launch bound by an earlier call
            return out, lse
    if lse.stride(-1) == 1 and uses_fused_forward(problem, q, k, v):
        fused.fused_forward(q, k, v, problem, out, lse)
        return out, lse
    cfg = forward_config(problem.head_dim, q.dtype == torch.float32, problem.max_seqlens)
    vl = problem.varlen
    q4, k4, v4, o4 = (as_4d(t, vl) for t in (q, k, v, out))
    grid, packed_docs = tile_grid(
        problem.max_seqlen_q, problem.heads_q, problem.batch, cfg.block_m, q.shape[0] if vl else None
    )
    if grid[0] == 0 or problem.max_seqlen_k == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    b = problem.bounds
    launch(
        _fwd_kernel, grid,
        q4, k4, v4, o4, lse, problem.cu_seqlens_q, problem.cu_seqlens_k, alibi_tensor(problem),
        q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2), o4.stride(0), o4.stride(1), o4.stride(2),
        *lse_strides(lse, vl),
        problem.max_seqlen_q, problem.max_seqlen_k, *score_scales(problem), *problem.position_args(),
        b.left or 0, b.right or 0, packed_docs,
        GROUP=problem.group, HEAD_DIM=problem.head_dim, BLOCK_D=block_d(problem.head_dim),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, IS_VARLEN=vl,
        HAS_LEFT=b.left is not None, HAS_RIGHT=b.right is not None, **score_constexprs(problem),
        DOT_PRECISION=dot_precision(q.dtype),
        WIDE=wide_offsets(problem.max_seqlen_q, q, out) or wide_offsets(problem.max_seqlen_k, k, v),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, lse
