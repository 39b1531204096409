"""The attention probabilities of a call, materialized in torch for ``return_attn_probs=True``.

The kernels never form the score matrix; this recomputes it from q, k and the call's final LSE,
in float32 and O(seqlen_q x seqlen_k) memory per head: for tests and inspection, not training.
Varlen calls slice their sequences by cu_seqlens read on the host, so under torch.compile this
runs inside the opaque ``ringflash::attention_probs`` op (``ops.flash_attention_probs``), never
traced: there the lengths would be data-dependent sizes.
"""

from __future__ import annotations

import torch

from .problem import AttentionProblem, cu_seqlens_host


def _block_probs(q, k, lse, problem: AttentionProblem, slopes):
    """q (n_q, heads_q, d), k (n_k, heads_k, d), lse (heads_q, n_q), slopes (heads_q,) or None
    -> probabilities (heads_q, n_q, n_k) of one sequence."""
    n_q, n_k = q.shape[0], k.shape[0]
    k = k.repeat_interleave(problem.group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * problem.softmax_scale
    if problem.softcap:
        scores = problem.softcap * torch.tanh(scores / problem.softcap)
    qp, kp = problem.q_positions.resolved(n_q), problem.k_positions.resolved(n_k)
    q_pos = qp.start + qp.stride * torch.arange(n_q, device=q.device)
    k_pos = kp.start + kp.stride * torch.arange(n_k, device=q.device)
    offset = k_pos[None, :] - q_pos[:, None]
    if slopes is not None:
        scores = scores - slopes[:, None, None] * offset.abs().float()
    visible = torch.ones_like(offset, dtype=torch.bool)
    if problem.bounds.left is not None:
        visible &= offset >= -problem.bounds.left
    if problem.bounds.right is not None:
        visible &= offset <= problem.bounds.right
    scores = scores.masked_fill(~visible, float("-inf"))
    # A row that sees nothing has lse -inf: clamp so that it gives 0, not exp(-inf + inf) = NaN.
    return torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])


@torch.no_grad()
def attention_probs(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, problem: AttentionProblem
) -> torch.Tensor:
    """softmax(scores) of every (query, key) pair, as the kernels define the scores.

    q, k: as given to ``attention_forward`` for ``problem``, (batch, seqlen, heads, head_dim) or
    varlen (total, heads, head_dim); lse: the call's float32 LSE (``problem.lse_shape``), which
    with attention sinks includes them (rows then sum to less than 1: the sink takes the rest).
    Returns float32 (batch, heads_q, max_seqlen_q, max_seqlen_k), not differentiable; for
    varlen calls sequence i fills [i, :, :len_q_i, :len_k_i] and the rest is 0. Masked pairs
    are 0, and so are rows that see no key.
    """
    probs = torch.zeros(
        problem.batch, problem.heads_q, problem.max_seqlen_q, problem.max_seqlen_k,
        device=q.device, dtype=torch.float32,
    )  # fmt: skip
    slopes = problem.alibi_slopes
    if not problem.varlen:
        for b in range(problem.batch):
            probs[b] = _block_probs(q[b], k[b], lse[b], problem, None if slopes is None else slopes[b])
        return probs
    cu_q, cu_k = cu_seqlens_host(problem.cu_seqlens_q), cu_seqlens_host(problem.cu_seqlens_k)
    for b in range(problem.batch):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        block = _block_probs(
            q[q0:q1], k[k0:k1], lse[:, q0:q1], problem, None if slopes is None else slopes[b]
        )
        probs[b, :, : q1 - q0, : k1 - k0] = block
    return probs
