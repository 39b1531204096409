"""What the Hopper kernels do to a tile of raw scores before the softmax, and the scales and
positions their launches pass for it: the ``Mask`` of a warpgroup's rows (window bounds, the keys'
count, the key tiles seen in full), the softcap (``tanh.approx.f32``), ALiBi's bias from global
positions. The forward and the dQ kernel (forward.py, dq.py) apply them through ``logits``; the
fused backward (backward.py) takes the scales and the tanh.

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate

from ..forward import LOG2E
from ..problem import AttentionProblem


@aggregate
class Mask:
    """Where a tile's scores are masked: positions (first query row of the warpgroup ``q_pos``,
    first key ``k_start``, strides), window bounds (a key at pk is seen by a query at pq iff
    pq - left <= pk <= pq + right), the keys' count ``len_k`` and the span of key tiles seen in
    full, [t_full_lo, t_full_hi)."""

    q_pos: gl.tensor
    q_stride: gl.tensor
    k_start: gl.tensor
    k_stride: gl.tensor
    left: gl.tensor
    right: gl.tensor
    len_k: gl.tensor
    t_full_lo: gl.tensor
    t_full_hi: gl.tensor

    @gluon.constexpr_function
    def __init__(self, q_pos, q_stride, k_start, k_stride, left, right, len_k, t_full_lo, t_full_hi):
        self.q_pos = q_pos
        self.q_stride = q_stride
        self.k_start = k_start
        self.k_stride = k_stride
        self.left = left
        self.right = right
        self.len_k = len_k
        self.t_full_lo = t_full_lo
        self.t_full_hi = t_full_hi


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
def mask_scores(s, mk: Mask, t, row_offs, col_offs, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Key tile t's scores with -inf where the key lies past the sequence or outside the window
    (row_offs/col_offs: the tile's rows'/columns' position offsets, index * stride). Each row's
    window becomes a range of column offsets, so a score costs two compares, not a position
    difference held over the whole tile (which spilled)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    n0 = t * BLOCK_N
    rel = row_offs + (mk.q_pos - (mk.k_start + n0 * mk.k_stride))  # pq - (first key's position)
    last = (mk.len_k - 1 - n0) * mk.k_stride  # the sequence's last key, as a column offset
    if HAS_RIGHT:
        keep = col_offs[None, :] <= gl.minimum(rel + mk.right, last)[:, None]
    else:
        keep = col_offs[None, :] <= last
    if HAS_LEFT:
        keep = keep & (col_offs[None, :] >= (rel - mk.left)[:, None])
    return gl.where(keep, s, -float("inf"))


@gluon.jit
def logits(
    s, t, mk: Mask, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
    MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    """Key tile t's raw scores S made logits: softcap, then ALiBi (which scales them to the log2
    domain here; without it the scale is folded into the softmax's exp2), then the mask."""
    if SOFTCAP:
        s = tanh_approx(s * tanh_scale)
    if HAS_ALIBI:
        BLOCK_N: gl.constexpr = s.shape[1]
        pos_diff = mk.q_pos - (mk.k_start + t * BLOCK_N * mk.k_stride)
        s = s * qk_scale + alibi_bias(alibi2, row_offs, col_offs, pos_diff)
    if MASKED:
        s = mask_scores(s, mk, t, row_offs, col_offs, HAS_LEFT, HAS_RIGHT)
    return s
