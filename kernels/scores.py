"""The score of a (query, key) pair as the Triton kernels compute it: scale, softcap, ALiBi.

In flash-attn's order, with ``x = q . k * softmax_scale``:

    score = softcap * tanh(x / softcap)  (softcap > 0; else score = x)  -  slope * |pq - pk|

where pq, pk are global token positions (``positions.TokenPositions``), so the bias stays exact
when a ring splits the sequence, and the slope is per (sequence, query head). The kernels work
in the log2 domain (``exp2``), so every term is carried times log2(e); the ALiBi bias is not
multiplied by softmax_scale. The features are constexprs (HAS_SOFTCAP, HAS_ALIBI): with both
off the kernels compile to the plain ``q . k * scale * log2(e)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .problem import AttentionProblem

LOG2E = 1.4426950408889634


@triton.jit
def tanh(x):
    """float32 tanh from exp2 of -2|x|, which never overflows (tanh of +-inf or of huge |x| is
    +-1, never NaN). libdevice's tanh does not run under the Triton interpreter."""
    e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|): 2.885... = 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def log2_scores(
    qk, qk_scale, softcap_log2, slope_log2, row_pos, col_start, col_stride, cols,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Scores of a [rows, cols] tile of dot products ``qk`` in the log2 domain, and the tile's
    tanh values (for the softcap's derivative 1 - tanh^2 in the backward; ``qk`` when off).

    qk_scale, softcap_log2: from ``score_scales``. slope_log2: the ALiBi slope times log2(e).
    row_pos [rows] and col_start + col_stride * cols [cols]: global positions, only read with
    HAS_ALIBI (computed here, so builds without it keep their callers' order of operations).
    |pq - pk| is symmetric: a dK/dV tile with keys as rows passes key positions as row_pos."""
    if HAS_SOFTCAP:
        th = tanh(qk * qk_scale)
        s = th * softcap_log2
    else:
        th = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        col_pos = col_start + col_stride * cols
        s -= slope_log2 * tl.abs(row_pos[:, None] - col_pos[None, :]).to(tl.float32)
    return s, th


@triton.jit
def softcap_grad(ds, th, HAS_SOFTCAP: tl.constexpr):
    """dL/dx from dL/dscore: the softcap's derivative is 1 - tanh^2 (recomputed, not stored)."""
    if HAS_SOFTCAP:
        ds = ds * (1.0 - th * th)
    return ds


@triton.jit
def alibi_slope_log2(ALIBI, b, h, heads_q, HAS_ALIBI: tl.constexpr):
    """Slope of sequence b, query head h from the (batch, heads_q) float32 ALIBI, times log2(e);
    0.0 without ALiBi (then ALIBI may be None)."""
    if HAS_ALIBI:
        return tl.load(ALIBI + b.to(tl.int64) * heads_q + h) * 1.4426950408889634
    else:
        return 0.0


def score_scales(problem: AttentionProblem) -> tuple[float, float | None]:
    """(qk_scale, softcap_log2) for ``log2_scores``: with a softcap, qk_scale scales q . k to the
    tanh argument (softmax_scale / softcap) and softcap_log2 = softcap * log2(e) scales tanh back
    into the log2 domain; without, qk_scale = softmax_scale * log2(e) and softcap_log2 is None,
    which Triton compiles as a constant: no kernel parameter, the same code as without the
    feature (likewise the ALIBI pointer, ``alibi_tensor``)."""
    if problem.softcap:
        return problem.softmax_scale / problem.softcap, problem.softcap * LOG2E
    return problem.softmax_scale * LOG2E, None


def score_constexprs(problem: AttentionProblem) -> dict[str, bool]:
    return dict(HAS_SOFTCAP=problem.softcap > 0, HAS_ALIBI=problem.alibi_slopes is not None)


def alibi_tensor(problem: AttentionProblem) -> torch.Tensor | None:
    """The launch's ALIBI argument: the (batch, heads_q) float32 slopes, or None. The problem may
    have been rebuilt with ``dataclasses.replace`` (a ring step's varlen call) after
    ``build_problem`` checked it, so the shape is checked again here, before a kernel reads it."""
    slopes = problem.alibi_slopes
    if slopes is None:
        return None
    if tuple(slopes.shape) != (problem.batch, problem.heads_q) or not slopes.is_contiguous():
        raise ValueError(
            f"alibi_slopes must be a contiguous (batch, heads_q) = ({problem.batch}, {problem.heads_q}) "
            f"tensor for this call, got shape {tuple(slopes.shape)}: build the problem with build_problem"
        )
    return slopes
