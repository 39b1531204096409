"""Which kernel calls each ring step makes: one schedule for every layout and mask.

At step i, rank r holds the K/V shard that started on rank (r - i) mod W. Each (query segment,
key segment) pair of the two shards is classified from its global positions as skipped, full
(no mask) or partial (masked). Full pairs that tile a larger rectangle are coalesced into one
call, so e.g. zigzag's off-diagonal steps are a single unmasked call. The ring runs only as
many steps as some rank still has visible keys for: a short sliding window stops it early.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .kernels import MaskBounds, TokenPositions, Visibility, block_visibility
from .layouts import Segment, segments


@dataclass(frozen=True)
class BlockTask:
    """Queries [q_start, q_start+q_len) of the local shard against keys [k_start, k_start+k_len)
    of the visiting shard; positions are given only when the pair needs a mask."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    q_positions: TokenPositions | None = None
    k_positions: TokenPositions | None = None

    @property
    def masked(self) -> bool:
        return self.q_positions is not None


@dataclass(frozen=True)
class RingSchedule:
    steps: tuple[tuple[BlockTask, ...], ...]  # steps[i]: tasks against the shard of rank (r - i) % W

    @property
    def n_steps(self) -> int:
        return len(self.steps)


def block_tasks(q_segs: list[Segment], k_segs: list[Segment], bounds: MaskBounds) -> tuple[BlockTask, ...]:
    tasks = []
    for qs in q_segs:
        for ks in k_segs:
            vis = block_visibility(qs.positions, qs.length, ks.positions, ks.length, bounds)
            if vis is Visibility.FULL:
                tasks.append(BlockTask(qs.local_start, qs.length, ks.local_start, ks.length))
            elif vis is Visibility.PARTIAL:
                tasks.append(
                    BlockTask(
                        qs.local_start, qs.length, ks.local_start, ks.length, qs.positions, ks.positions
                    )
                )
    return _coalesce(tasks)


def _coalesce(tasks: list[BlockTask]) -> tuple[BlockTask, ...]:
    """Merge unmasked tasks that are adjacent along q (same keys) or along k (same queries)."""
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(tasks):
            for j, b in enumerate(tasks):
                if i == j or a.masked or b.masked:
                    continue
                if a.k_start == b.k_start and a.k_len == b.k_len and a.q_start + a.q_len == b.q_start:
                    joined = BlockTask(a.q_start, a.q_len + b.q_len, a.k_start, a.k_len)
                elif a.q_start == b.q_start and a.q_len == b.q_len and a.k_start + a.k_len == b.k_start:
                    joined = BlockTask(a.q_start, a.q_len, a.k_start, a.k_len + b.k_len)
                else:
                    continue
                tasks = [t for n, t in enumerate(tasks) if n not in (i, j)] + [joined]
                merged = True
                break
            if merged:
                break
    return tuple(sorted(tasks, key=lambda t: (t.q_start, t.k_start)))


@lru_cache(maxsize=256)
def ring_schedule(
    layout: str, rank: int, world_size: int, local_len: int, bounds: MaskBounds
) -> RingSchedule:
    """The tasks of every ring step for ``rank``; the same step count on every rank of the ring."""
    segs = [segments(layout, r, world_size, local_len) for r in range(world_size)]
    n_steps = 1
    for i in range(world_size):
        if any(block_tasks(segs[r], segs[(r - i) % world_size], bounds) for r in range(world_size)):
            n_steps = i + 1
    steps = tuple(block_tasks(segs[rank], segs[(rank - i) % world_size], bounds) for i in range(n_steps))
    return RingSchedule(steps)
