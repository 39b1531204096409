"""The 2D sequence-parallel mesh: Ulysses groups inside, ring groups across."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .comm import resolve_group


@dataclass(frozen=True)
class UlyssesRingMesh:
    """A group of W = ulysses_size x ring_size ranks. Ulysses groups are runs of consecutive
    group ranks (usually within a node); ring groups join the ranks at the same Ulysses index."""

    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    ulysses_size: int
    ring_size: int


_MESHES: dict[tuple[tuple[int, ...], int], UlyssesRingMesh] = {}


def check_ulysses_type(ulysses_size: object) -> int:
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1:
        raise TypeError(f"ulysses_size must be a positive int, got {ulysses_size!r}")
    return ulysses_size


def check_ulysses_size(ulysses_size: object, world_size: int) -> int:
    check_ulysses_type(ulysses_size)
    if world_size % ulysses_size:
        raise ValueError(
            f"ulysses_size {ulysses_size} must divide the sequence-parallel group size {world_size}"
        )
    return ulysses_size


def ulysses_ring_mesh(group: dist.ProcessGroup | None, ulysses_size: int) -> UlyssesRingMesh:
    """The mesh of ``group`` (default: world) with Ulysses groups of ``ulysses_size``; created
    on first use (every rank of ``group`` must make that first call) and cached."""
    group = resolve_group(group)
    ranks = tuple(dist.get_process_group_ranks(group))
    u = check_ulysses_size(ulysses_size, len(ranks))
    key = (ranks, u)
    if key not in _MESHES:
        me = dist.get_rank()
        idx = ranks.index(me)
        # Each rank creates only its own two subgroups; local synchronization means ranks
        # outside them (and outside `group`) need not take part.
        uly_ranks = list(ranks[(idx // u) * u : (idx // u + 1) * u])
        ring_ranks = list(ranks[idx % u :: u])
        _MESHES[key] = UlyssesRingMesh(
            ulysses_group=dist.new_group(uly_ranks, use_local_synchronization=True),
            ring_group=dist.new_group(ring_ranks, use_local_synchronization=True),
            ulysses_size=u,
            ring_size=len(ranks) // u,
        )
    return _MESHES[key]
