"""Infini-attention's local attention with the memory's passes fused into it: the forward with
the retrieval, the backward with the memory updates' backward.

The forward (``local_forward``): where the fused Hopper forward runs, each query tile's rows
get their memory retrieval and the gate in its epilogue while Q is in shared memory and the
attention's output in registers (forward.py's MEMORY): no pass of its own over q and the local
output. Elsewhere the caller runs ``memory_retrieval`` after it.

The local attention (causal inside each segment: one varlen problem whose sequences are the
segments) and the per-segment updates dM_s = sigma(K_s)^T V_s, dz_s = sum sigma(K_s) both give
gradients to k and v. Where the fused Hopper backward runs, it adds the updates' backward into
the dK and dV of each key tile while that tile's K and V are still in shared memory (its MEMORY
epilogue): no pass of its own over k and v, and no read of the updates' dK and dV back. Elsewhere
``memory_updates_backward`` writes them first and the attention's backward adds into them.
The delta rule's updates (B_s as the linear rule's, and A_s = sigma(K_s)^T diag(w) sigma(K_s))
take the same way, with the Gram matrices' terms.
"""

from __future__ import annotations

import torch

from ..backward import attention_backward
from ..forward import attention_forward
from ..hopper.dispatch import hopper_module, uses_fused_retrieval_forward, uses_fused_updates_backward
from ..problem import AttentionProblem
from .memory import memory_updates_backward


def local_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    memory: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The local attention's (output, LSE) and, where the fused Hopper forward takes the
    retrieval (``uses_fused_retrieval_forward``) and ``memory`` is given, the gated output
    ``memory_retrieval`` would return; else None for it.

    q: (batch * seqlen, heads, head_dim), k, v: (batch * seqlen, kv_heads, head_dim), the
    flattened views of (batch, seqlen, ...) tensors; ``problem``: the varlen problem over the
    segments (sequence b * segments + s is segment s of batch row b); ``memory``: (gate (heads,),
    M (batch, segments, kv_heads, head_dim, head_dim), z (batch, segments, kv_heads, head_dim))
    before each segment, any float dtypes. The outputs come in q's flattened shape and dtype,
    the LSE float32 in ``problem.lse_shape``."""
    if memory is None or not uses_fused_retrieval_forward(problem, q, k, v):
        return (*attention_forward(q, k, v, problem), None)
    gate, m, z = memory
    local, out = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(problem.lse_shape(q.shape[0]), device=q.device, dtype=torch.float32)
    retrieval = (out, m.to(torch.bfloat16).contiguous(), z.float().contiguous(), gate.float().contiguous())
    hopper_module("forward").fused_forward(q, k, v, problem, local, lse, retrieval)
    return local, lse, out


def local_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    problem: AttentionProblem,
    dq: torch.Tensor,
    segment_len: int,
    grad_dm: torch.Tensor,
    grad_dz: torch.Tensor,
    gram_grad: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the local attention's dQ into ``dq`` and return (dk, dv), the local attention's and
    the memory updates' gradients summed.

    dout, q: (batch * seqlen, heads, head_dim), k, v: (batch * seqlen, kv_heads, head_dim), the
    flattened views of (batch, seqlen, ...) tensors; ``problem``: the varlen problem over the
    segments (sequence b * segments + s is segment s of batch row b); lse, delta: float32 in
    ``problem.lse_shape``; dq float32 in q's shape; grad_dm (batch, segments, kv_heads,
    head_dim, head_dim) and grad_dz (batch, segments, kv_heads, head_dim) float32: the gradients
    of ``memory_updates``' outputs; ``gram_grad`` (the delta rule): (S, z before each segment) as
    ``memory_updates_backward`` takes them. dk, dv come in k's dtype."""
    if uses_fused_updates_backward(problem, q, k, v, dq):
        dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (k, v))
        # the matrices as the products' operands (bf16/fp16), the vectors float32
        updates = [grad_dm.to(q.dtype), grad_dz.float()]
        if gram_grad is not None:
            updates += [gram_grad[0].to(q.dtype), gram_grad[1].float()]
        updates = tuple(t.contiguous() for t in updates)
        backward = hopper_module("backward")
        backward.fused_backward(dout, q, k, v, lse, delta, problem, dq, dk, dv, False, updates)
        return dk, dv
    batch = grad_dm.shape[0]
    k4, v4 = (t.view(batch, t.shape[0] // batch, *t.shape[1:]) for t in (k, v))
    grads = memory_updates_backward(k4, v4, segment_len, grad_dm, grad_dz, gram_grad)
    dk, dv = (t.view(k.shape) for t in grads)
    attention_backward(dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate=True)
    return dk, dv
