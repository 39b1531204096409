"""The least host time a replayed sequence-parallel call can take (``bench_host.py --floor``).

Every replayed ring, Ulysses or all-gather call runs at least this, forward and backward: an
autograd Function, its inputs copied into a replay's static buffers, one graph replay, fresh
outputs copied out (``ringflash.graph_replay.GraphReplay``). ``ReplayFloor`` is exactly that
around the single-device kernels of the same problem, with no process group, setup lookup or
transfer, so no replayed sequence-parallel fwd+bwd of these shapes can cost the host less (a
forward without gradients can: it need not copy out the LSE). With a ``group``
each forward also joins the ranks' host check (``ringflash.comm.host_values_agree``, what every
sequence-parallel call does per forward), so the difference between the two is what that check
costs when the ranks' hosts set the pace. A reference point for the benchmark, not an API.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ringflash
from ringflash.comm import host_values_agree
from ringflash.graph_replay import GraphReplay
from ringflash.kernels.backward import attention_gradients
from ringflash.kernels.forward import attention_forward
from ringflash.kernels.plans import cached_problem


class _Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, replays):
        out, lse = replays[0](q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.replays = replays
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*ctx.replays[1](dout, *ctx.saved_tensors), None)


class ReplayFloor:
    """``f(q, k, v) -> out``, (batch, seqlen, heads, head_dim) CUDA tensors: the single-device
    attention (``causal``) replayed from graphs as a sequence-parallel call replays, one pair
    of replays per layout; ``group``: join the ranks' check every call (every rank must)."""

    def __init__(self, causal: bool, group: dist.ProcessGroup | None = None) -> None:
        self.causal, self.group = causal, group
        self._replays: dict[tuple, tuple[GraphReplay, GraphReplay]] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.group is not None and not host_values_agree(1, self.group):
            raise RuntimeError("the ranks' check failed on equal values")
        key = tuple((t.shape, t.stride(), t.dtype) for t in (q, k, v))
        replays = self._replays.get(key)
        if replays is None:
            problem = cached_problem(
                q.detach(), k.detach(), v.detach(), None, None, q.shape[1], k.shape[1], None, self.causal,
                -1, -1, 0.0, None, False,
            )  # fmt: skip
            forward = lambda q, k, v: attention_forward(q, k, v, problem)  # noqa: E731
            backward = lambda do, q, k, v, o, lse: attention_gradients(do, q, k, v, o, lse, problem)  # noqa: E731
            replays = self._replays[key] = (GraphReplay(forward), GraphReplay(backward))
        return _Replayed.apply(q, k, v, replays)


def check_exact(
    floor: ReplayFloor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor
) -> None:
    """Raise unless ``floor``'s eager, capturing and replayed calls give ``flash_attn_func``'s
    output bit for bit and its gradients to their dtype's rounding (dQ's float32 additions from
    different key tiles come in any order): it must run the same kernels, not nothing."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    ref = ringflash.flash_attn_func(q, k, v, causal=floor.causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for call in range(3):
        out = floor(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        close = all(torch.allclose(g, r, rtol=1e-2, atol=1e-3) for g, r in zip(grads, ref_grads))
        if not (torch.equal(out, ref) and close):
            raise RuntimeError(f"the replay floor's call {call + 1} differs from flash_attn_func")
