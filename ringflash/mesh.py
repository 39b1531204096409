"""The 2D sequence-parallel mesh: Ulysses groups inside, ring groups across."""

from __future__ import annotations

import weakref
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


# Meshes by (id of the group, Ulysses size), each with a weak reference to its group: a group
# destroyed and replaced (a new one at the same ranks, or at a reused id) gets a new mesh.
_MESHES: dict[tuple[int, int], tuple[weakref.ref, UlyssesRingMesh]] = {}


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


def contradiction(ulysses_size: object, sp_mode: str, expected: str) -> str:
    """The message for a ``ulysses_size`` that ``sp_mode`` does not take."""
    return (
        f'ulysses_size={ulysses_size!r} contradicts sp_mode="{sp_mode}", whose Ulysses group size is '
        f"{expected}: shards cut for another size hold other tokens; pass the sp_mode they were cut for"
    )


def mode_ulysses_size(sp_mode: str, ulysses_size: object, world_size: int) -> int:
    """The Ulysses group size U of ``sp_mode`` "ulysses" (the group's size; ``ulysses_size`` must
    be None or that) or "hybrid" (``ulysses_size``, a divisor of the group's size)."""
    if sp_mode != "ulysses":
        return check_ulysses_size(ulysses_size, world_size)
    if ulysses_size not in (None, world_size):
        raise ValueError(contradiction(ulysses_size, sp_mode, f"the group size {world_size} (or None)"))
    return world_size


def ulysses_ring_mesh(group: dist.ProcessGroup | None, ulysses_size: int) -> UlyssesRingMesh:
    """The mesh of ``group`` (default: world) with Ulysses groups of ``ulysses_size``; created
    on first use (every rank of ``group`` must make that first call) and cached."""
    group = resolve_group(group)
    ranks = tuple(dist.get_process_group_ranks(group))
    u = check_ulysses_size(ulysses_size, len(ranks))
    key = (id(group), u)
    hit = _MESHES.get(key)
    if hit is not None and hit[0]() is group:
        return hit[1]
    me = dist.get_rank()
    idx = ranks.index(me)
    # Each rank creates only its own two subgroups; local synchronization means ranks
    # outside them (and outside `group`) need not take part.
    uly_ranks = list(ranks[(idx // u) * u : (idx // u + 1) * u])
    ring_ranks = list(ranks[idx % u :: u])
    mesh = UlyssesRingMesh(
        ulysses_group=dist.new_group(uly_ranks, use_local_synchronization=True),
        ring_group=dist.new_group(ring_ranks, use_local_synchronization=True),
        ulysses_size=u,
        ring_size=len(ranks) // u,
    )
    drop = lambda _ref, key=key: _MESHES.pop(key, None)  # noqa: E731 (the group is gone: so is its entry)
    _MESHES[key] = (weakref.ref(group, drop), mesh)
    return mesh
