"""The causal-LM loss over all tokens of a sequence-parallel group.

Every rank computes the same global mean: its own token-loss sum, summed over the group, over
the group's target count. ``sequence_parallel_chunked_cross_entropy`` does it without the
logits: at 64K-512K tokens x a 128K vocabulary they alone take tens to hundreds of GiB, so each
chunk's logits are made from the last hidden state, reduced to a cross-entropy sum and dropped;
the backward pass makes them again (activation checkpointing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .comm import resolve_group


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group; backward: identity. Every rank computes the same global
    loss and back-propagates it, so each rank's local term receives exactly its own gradient."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _group_mean(local_sum: torch.Tensor, target_ids: torch.Tensor, group, ignore_index: int) -> torch.Tensor:
    """The group's loss sum over the group's target count (token-count weighted across ranks)."""
    count = (target_ids != ignore_index).sum().to(torch.float32)
    dist.all_reduce(count, group=group)
    return _SumOverGroup.apply(local_sum, group) / count.clamp_min(1.0)


def _class_ids(target_ids: object) -> torch.Tensor:
    """``target_ids`` as int64 class ids (any integer dtype is exact), else a TypeError."""
    if not isinstance(target_ids, torch.Tensor):
        raise TypeError(f"target_ids must be a torch.Tensor of class ids, got {type(target_ids).__name__}")
    if target_ids.is_floating_point() or target_ids.is_complex() or target_ids.dtype == torch.bool:
        raise TypeError(f"target_ids must be an integer tensor of class ids, got {target_ids.dtype}")
    return target_ids.long()


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over every target token of the sequence-parallel group.

    logits: (batch, local_seqlen, vocab); target_ids: (batch, local_seqlen) from
    ``shard_batch``, any integer dtype. The shapes must match exactly: a flattened or
    transposed target tensor is a ValueError, not a silently different pairing. Token-count
    weighted across ranks, so a sharded run reports the same number as a single-device run;
    the same float32 value on every rank. After ``backward``, sum the parameter gradients over
    the group (``reduce_gradients``).
    """
    group = resolve_group(group)
    target_ids = _class_ids(target_ids)
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2 or target_ids.shape != logits.shape[:-1]:
        # A flattened (batch * seqlen) match would let transposed targets through silently.
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"logits must be (batch, seqlen, vocab) and target_ids (batch, seqlen), got {got} "
            f"and {tuple(target_ids.shape)}"
        )
    local = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        target_ids.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return _group_mean(local, target_ids, group, ignore_index)


def _chunk_loss_sum(
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def sequence_parallel_chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    target_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over every target token of the sequence-parallel group, computed from
    the last hidden state in chunks of ``chunk_size`` tokens.

    hidden: (batch, local_seqlen, dim), any float dtype; lm_head: maps (n, dim) to logits
    (n, vocab), e.g. the model's output ``nn.Linear`` (pass the module, not its weight, so that
    ZeRO-3 gathers the weight when it is called); target_ids: (batch, local_seqlen) int64 from
    ``shard_batch`` (any integer dtype). Returns a float32 scalar, the same on every rank and
    equal to ``sequence_parallel_cross_entropy(lm_head(hidden), target_ids, group)``: the
    log-softmax runs in float32 and the sum is token-count weighted across ranks. Peak extra
    memory is one chunk's logits (chunk_size x vocab x 4 bytes, e.g. 2 GiB at 4096 x 128K), not
    the whole sequence's.

    Gradients: after ``backward``, sum the parameter gradients over the group (as with
    ``sequence_parallel_cross_entropy``). Each chunk is checkpointed non-reentrantly, so every
    parameter still gets one gradient accumulation per backward (what ZeRO's hooks expect).
    """
    group = resolve_group(group)
    target_ids = _class_ids(target_ids)
    if hidden.dim() != 3 or target_ids.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be (batch, seqlen, dim) and target_ids (batch, seqlen), got "
            f"{tuple(hidden.shape)} and {tuple(target_ids.shape)}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = target_ids.reshape(-1)
    # Zero-size start keeps the graph connected to ``hidden`` even for an empty shard.
    local = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_targets.numel(), chunk_size):
        h, t = flat_hidden[start : start + chunk_size], flat_targets[start : start + chunk_size]
        local = local + checkpoint(_chunk_loss_sum, lm_head, h, t, ignore_index, use_reentrant=False)
    return _group_mean(local, target_ids, group, ignore_index)


__all__ = ["sequence_parallel_chunked_cross_entropy", "sequence_parallel_cross_entropy"]
