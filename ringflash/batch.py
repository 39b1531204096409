"""Sharding a causal-LM batch over a sequence-parallel group, and the loss over all its tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import resolve_group
from .sharding import shard_sequence


def shard_batch(
    batch: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    ulysses_size: int = 1,
    ignore_index: int = -100,
) -> dict[str, torch.Tensor]:
    """This rank's shard of a causal-LM batch.

    batch: ``input_ids`` (batch, seqlen) and optionally ``labels`` (batch, seqlen; default: the
    input ids), ``position_ids`` (default: 0..seqlen-1) and ``attention_mask`` (only all-ones is
    accepted: pad-free batches). Labels are shifted *before* sharding, so the target of the last
    token of one shard (the first token of the next) is not lost.

    Returns ``input_ids``, ``position_ids`` (rotary positions follow their tokens) and
    ``target_ids`` (already shifted; ``ignore_index`` after each sequence's last token), each
    (batch, seqlen / W) in the layout ``sp_attn_func`` expects. Pass ``target_ids`` to
    ``sequence_parallel_cross_entropy``, not to a model that shifts labels itself.
    """
    if "input_ids" not in batch:
        raise ValueError("batch needs 'input_ids' of shape (batch, seqlen)")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(ids.shape)}")
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("attention_mask with padding is not supported: pack sequences without padding")
    labels = batch.get("labels", ids)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    if labels.shape != ids.shape or positions.shape != ids.shape:
        raise ValueError("labels and position_ids must have the shape of input_ids")
    if bool((positions[:, 1:] <= positions[:, :-1]).any()):
        raise ValueError(
            "position_ids restart inside a row (packed sequences): ring attention over packed "
            "sequences is not supported yet; use one sequence per row"
        )
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    shard = lambda t: shard_sequence(t, group, dim=1, layout=layout, ulysses_size=ulysses_size)  # noqa: E731
    return {"input_ids": shard(ids), "position_ids": shard(positions), "target_ids": shard(targets)}


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


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over every target token of the sequence-parallel group.

    logits: (batch, local_seqlen, vocab); target_ids: (batch, local_seqlen) from
    ``shard_batch``. Token-count weighted across ranks, so a sharded run reports the same
    number as a single-device run; the same value on every rank. After ``backward``, sum the
    parameter gradients over the group (``groups.reduce_gradients``).
    """
    group = resolve_group(group)
    local = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        target_ids.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (target_ids != ignore_index).sum().to(torch.float32)
    dist.all_reduce(count, group=group)
    return _SumOverGroup.apply(local, group) / count.clamp_min(1.0)
