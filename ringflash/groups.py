"""Process groups for training: W = D x S ranks, sequence-parallel inside, data-parallel across."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import resolve_group


@dataclass(frozen=True)
class ParallelGroups:
    """Sequence-parallel groups are runs of ``sp_size`` consecutive ranks (e.g. one node);
    data-parallel groups join the ranks at the same position of every sequence-parallel group."""

    sp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    sp_size: int
    dp_size: int
    sp_rank: int
    dp_rank: int


_GROUPS: dict[int, ParallelGroups] = {}


def sequence_parallel_groups(sp_size: int) -> ParallelGroups:
    """Split the world into data-parallel x sequence-parallel groups; every rank of the world
    must call this (with the same ``sp_size``) the first time. Cached per ``sp_size``."""
    resolve_group(None)
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1 or world % sp_size:
        raise ValueError(f"sp_size must be a positive int dividing the world size {world}, got {sp_size!r}")
    if sp_size not in _GROUPS:
        mine_sp = mine_dp = None
        # new_group is collective over the world: every rank creates every group, in one order.
        for start in range(0, world, sp_size):
            g = dist.new_group(list(range(start, start + sp_size)))
            if start <= rank < start + sp_size:
                mine_sp = g
        for offset in range(sp_size):
            g = dist.new_group(list(range(offset, world, sp_size)))
            if rank % sp_size == offset:
                mine_dp = g
        _GROUPS[sp_size] = ParallelGroups(
            mine_sp, mine_dp, sp_size, world // sp_size, rank % sp_size, rank // sp_size
        )
    return _GROUPS[sp_size]


def reduce_gradients(module: torch.nn.Module, groups: ParallelGroups) -> None:
    """Make every parameter's .grad the gradient of the full-sequence loss, averaged over
    data-parallel replicas: sum the partial gradients of the ranks that share a sequence (each
    saw only its shard's tokens), then average across data-parallel groups. Call after
    ``backward`` with a loss from ``sequence_parallel_cross_entropy``."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if groups.sp_size > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.sp_group)
    if groups.dp_size > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.dp_group)
        flat /= groups.dp_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
