"""Autograd-aware single-device attention with flash-attn's call signatures."""

from __future__ import annotations

import torch

from .backward import attention_backward, attention_delta
from .forward import attention_forward
from .problem import AttentionProblem, build_problem


class _FlashAttention(torch.autograd.Function):
    """(out, lse) of attention, both differentiable.

    A gradient on the LSE only changes delta: d lse_i / d S_ij = P_ij and dS = P * (dP - delta),
    so backpropagating dlse as well is delta_i -= dlse_i; calls that ignore the LSE skip it.
    """

    @staticmethod
    def forward(ctx, q, k, v, problem: AttentionProblem):
        out, lse = attention_forward(q, k, v, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        problem = ctx.problem
        if dout is None:
            dout = torch.zeros_like(out)
        elif dout.stride(-1) != 1:
            dout = dout.contiguous()
        delta = attention_delta(out, dout, problem)
        if dlse is not None:
            delta.sub_(dlse)
        dq, dk, dv = attention_backward(dout, q, k, v, lse, delta, problem)
        return dq, dk, dv, None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention without materializing the score matrix, differentiable.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16/bfloat16/float32, CUDA (or CPU with
            TRITON_INTERPRET=1).
        k, v: (batch, seqlen_k, heads_k, head_dim), same dtype/device; heads_q % heads_k == 0
            (GQA/MQA). head_dim: a multiple of 8 up to 256.
        softmax_scale: defaults to 1/sqrt(head_dim).
        causal: mask keys after the query; with seqlen_q != seqlen_k the mask is aligned to
            the bottom-right corner, as in flash-attn.
        window_size: (left, right) sliding window, -1 = unbounded; query i sees keys
            [i - left, i + right] (bottom-right aligned).
        return_lse: also return the row logsumexp.

    Returns:
        out (batch, seqlen_q, heads_q, head_dim) in q's dtype, and if ``return_lse`` the
        float32 LSE (batch, heads_q, seqlen_q); rows that see no key give out 0, LSE -inf.
    """
    problem = build_problem(q, k, v, softmax_scale, causal, window_size)
    out, lse = _FlashAttention.apply(q, k, v, problem)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences; never attends across a sequence boundary.

    Args:
        q: (total_q, heads_q, head_dim); k, v: (total_k, heads_k, head_dim).
        cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) cumulative lengths starting at 0.
        max_seqlen_q, max_seqlen_k: the longest sequence on each side.
        Other arguments as in ``flash_attn_func``; masks align each sequence's queries to the
        end of its keys.

    Returns:
        out (total_q, heads_q, head_dim), and if ``return_lse`` the float32 LSE (heads_q, total_q).
    """
    problem = build_problem(
        q, k, v, softmax_scale, causal, window_size,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )  # fmt: skip
    out, lse = _FlashAttention.apply(q, k, v, problem)
    return (out, lse) if return_lse else out
