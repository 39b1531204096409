"""Float64 reference attention and error metrics shared by the tests."""

from __future__ import annotations

import math

import torch


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window_size=(-1, -1)) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: key visible to query under causal/window at these positions."""
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    mask = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if left >= 0:
        mask &= k_pos[None, :] >= q_pos[:, None] - left
    if right >= 0:
        mask &= k_pos[None, :] <= q_pos[:, None] + right
    return mask


def reference_attention(
    q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None, q_pos=None, k_pos=None,
    softcap=0.0, alibi_slopes=None, sinks=None, mask=None,
):  # fmt: skip
    """Attention in float64 on the CPU. q (B, Sq, H, D); k, v (B, Sk, Hk, D).

    Positions default to flash-attn's bottom-right alignment. softcap: scores -> softcap *
    tanh(scores / softcap) (scaled scores, before the mask); alibi_slopes (H,) or (B, H): bias
    -slope * |pq - pk| added after the softcap (flash-attn's order); sinks (H,): one extra logit
    per head in each row's softmax denominator, with no value (gpt-oss); mask: bool (B or 1, H or
    1, Sq, Sk), pairs it leaves False hidden too (a block-sparse mask). Returns (out (B, Sq, H,
    D), lse (B, H, Sq)), the LSE including the sink; rows that see no key give out 0 and lse -inf
    (with sinks: lse = the sink). Differentiable, sinks included.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qd, kd, vd = (t.to("cpu", torch.float64) for t in (q, k, v))
    kd = kd.repeat_interleave(h // hk, dim=2)
    vd = vd.repeat_interleave(h // hk, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(sq) + (sk - sq) if q_pos is None else q_pos
    k_pos = torch.arange(sk) if k_pos is None else k_pos
    if alibi_slopes is not None:
        slopes = alibi_slopes.to("cpu", torch.float64).expand(b, h)[:, :, None, None]
        scores = scores - slopes * (q_pos[:, None] - k_pos[None, :]).abs().to(torch.float64)
    scores = scores.masked_fill(~visibility(q_pos, k_pos, causal, window_size), -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask.to("cpu").expand(b, h, sq, sk), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:
        sink = sinks.to("cpu", torch.float64)[None, :, None].expand_as(lse)
        # A row with no key and a -inf sink stays -inf with zero gradients: logaddexp gets 0s
        # there (its gradient at two -infs is NaN), and ``where`` passes the other rows' alone.
        empty = torch.isneginf(lse) & torch.isneginf(sink)
        safe = lambda t: torch.where(empty, 0.0, t)  # noqa: E731
        lse = torch.where(empty, -math.inf, torch.logaddexp(safe(lse), safe(sink)))
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float64).min))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vd)
    return out, lse


def reference_attention_packed(q, k, v, cu_seqlens, **kw):
    """``reference_attention`` on each packed document [cu[i], cu[i+1]) of dim 1 on its own,
    concatenated back: (out (B, S, H, D), lse (B, H, S))."""
    parts = [
        reference_attention(*(t[:, a:b] for t in (q, k, v)), **kw) for a, b in zip(cu_seqlens, cu_seqlens[1:])
    ]
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| over finite expected entries; inf if actual has NaN.
    Meaningless where the exact answer is ~0 (e.g. dq of a query that sees one key): test
    such cases with an absolute bound instead.
    """
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if torch.isnan(a).any():
        return math.inf
    finite = torch.isfinite(e)
    if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], e[~finite]):
        return math.inf  # -inf LSE rows must match exactly
    return (a[finite] - e[finite]).norm().item() / max(e[finite].norm().item(), 1e-30)


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
