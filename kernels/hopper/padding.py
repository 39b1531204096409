"""Head dims between the Hopper kernels' builds run the next larger build on zero-padded copies.

The Hopper kernels are built for head_dim 64, 128 and 256 (tile shapes, register and shared
memory budgets per head_dim). A head_dim between two builds (Phi-3-mini's 96, Phi-2's 80, or
192) runs the next larger one on copies of its operands with zero columns appended: a zero
column adds nothing to a score and gives a zero column of the output and of every gradient, so
slicing the first head_dim columns back is exact. The Triton kernels round head_dim up to the
next power of two inside their tiles (``configs.block_d``: the same 128 or 256), so the padded
Hopper kernel does the same arithmetic at its higher rate; the padding adds one copy of each
operand and gradient per call. Below the smallest build the Triton kernels run: padding 32 up
to 64 would double the matrix work.

Pure torch, importable without Gluon: the Hopper modules call it with their kernel function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from ..problem import AttentionProblem


def run_head_dim(head_dim: int, built: Iterable[int]) -> int | None:
    """The built head_dim a problem of ``head_dim`` runs at: itself where it is built, else the
    smallest build above it, when head_dim is above the smallest build and a multiple of 8
    (16-byte rows). None: the Triton kernels run it."""
    built = sorted(built)
    if head_dim in built:
        return head_dim
    if head_dim % 8 or head_dim < built[0]:
        return None
    return next((d for d in built if d > head_dim), None)


def _pad(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    return F.pad(t, (0, head_dim - t.shape[-1]))


def _widened(t: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*t.shape[:-1], head_dim, device=t.device, dtype=dtype)


def padded_forward(
    kernel: Callable[..., None],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    out: torch.Tensor,
    lse: torch.Tensor,
    head_dim: int,
) -> None:
    """``kernel(q, k, v, problem, out, lse)`` (``forward.fused_forward``'s signature) at
    ``head_dim`` > problem.head_dim: q/k/v zero-padded to it, the output's first
    problem.head_dim columns copied into ``out`` (same shapes and dtypes as the kernel's own
    arguments); lse is written directly (padding changes no score). ``problem.softmax_scale``
    stays the caller's (from the real head_dim)."""
    wide = dataclasses.replace(problem, head_dim=head_dim)
    out_wide = _widened(out, head_dim, out.dtype)
    kernel(_pad(q, head_dim), _pad(k, head_dim), _pad(v, head_dim), wide, out_wide, lse)
    out.copy_(out_wide[..., : problem.head_dim])


def padded_backward(
    kernel: Callable[..., None],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    problem: AttentionProblem,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    accumulate: bool,
    head_dim: int,
) -> None:
    """``kernel(dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate)``
    (``backward.fused_backward``'s signature and contract: dQ added into the float32
    ``dq``, dK/dV written, or added with ``accumulate``) at ``head_dim`` > problem.head_dim, on
    zero-padded copies; the gradients' first problem.head_dim columns go to the caller's
    buffers. delta (rowsum(dout * out)) is unchanged by the padding."""
    wide = dataclasses.replace(problem, head_dim=head_dim)
    dq_wide = _widened(dq, head_dim, torch.float32).zero_()
    dk_wide, dv_wide = _widened(dk, head_dim, dk.dtype), _widened(dv, head_dim, dv.dtype)
    padded = (_pad(t, head_dim) for t in (dout, q, k, v))
    kernel(*padded, lse, delta, wide, dq_wide, dk_wide, dv_wide, False)
    d = problem.head_dim
    dq.add_(dq_wide[..., :d])
    for buf, wide_buf in ((dk, dk_wide), (dv, dv_wide)):
        buf.add_(wide_buf[..., :d]) if accumulate else buf.copy_(wide_buf[..., :d])
