"""Which kernel calls each ring step makes: one schedule for every layout and mask.

At step i, rank r holds the K/V shard that started on rank (r - i) mod W. Each (query segment,
key segment) pair of the two shards is classified from its global positions as skipped, full
(no mask) or partial (masked). Full pairs that tile a larger rectangle are coalesced into one
call, so e.g. zigzag's off-diagonal steps are a single unmasked call; under a plain causal mask
the first step (the rank's own shard) is one causal call in local positions wherever the shard's
chunks keep their global order (``_own_shard_task``). The ring runs only as
many steps as some rank still has visible keys for: a short sliding window stops it early.
Packed documents: a segment holds the same chunk of every document, and a pair is one varlen
call over all documents; it is skipped only if no document sees anything, and unmasked only if
every document sees everything. With ALiBi (``positions=True``) every task keeps its positions,
since the bias depends on them even where nothing is masked, and nothing is coalesced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from .kernels import MaskBounds, TokenPositions, Visibility, block_visibility
from .layouts import Segment, segments


@dataclass(frozen=True)
class BlockTask:
    """Queries [q_start, q_start+q_len) of the local shard against keys [k_start, k_start+k_len)
    of the visiting shard; positions are given when the pair needs a mask (``masked``) or the
    schedule was asked to keep them. ``seq_lens``: for packed documents, each document's length
    on both sides (a varlen call)."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    q_positions: TokenPositions | None = None
    k_positions: TokenPositions | None = None
    seq_lens: tuple[int, ...] | None = None
    masked: bool = False


@dataclass(frozen=True)
class RingSchedule:
    steps: tuple[tuple[BlockTask, ...], ...]  # steps[i]: tasks against the shard of rank (r - i) % W


def _pair_visibility(qs: Segment, ks: Segment, bounds: MaskBounds) -> Visibility:
    """One class for a segment pair over all its documents."""
    seen = {
        block_visibility(qs.positions, nq, ks.positions, nk, bounds)
        for nq, nk in zip(qs.seq_lens, ks.seq_lens)
    }
    return seen.pop() if len(seen) == 1 else Visibility.PARTIAL


def block_tasks(
    q_segs: list[Segment],
    k_segs: list[Segment],
    bounds: MaskBounds,
    varlen: bool = False,
    positions: bool = False,
) -> tuple[BlockTask, ...]:
    tasks = []
    for qs in q_segs:
        for ks in k_segs:
            vis = _pair_visibility(qs, ks, bounds)
            if vis is Visibility.NONE:
                continue
            task = BlockTask(qs.local_start, qs.length, ks.local_start, ks.length,
                             seq_lens=qs.seq_lens if varlen else None)  # fmt: skip
            if vis is Visibility.PARTIAL or positions:
                task = replace(task, q_positions=qs.positions, k_positions=ks.positions,
                               masked=vis is Visibility.PARTIAL)  # fmt: skip
            tasks.append(task)
    # Packed chunks of one document are not adjacent in the shard: no coalescing. Tasks that keep
    # their positions are not coalesced either (two segments' positions are not one affine run).
    return tuple(tasks) if varlen or positions else _coalesce(tasks)


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
    layout: str,
    rank: int,
    world_size: int,
    doc_lens: tuple[int, ...],
    bounds: MaskBounds,
    varlen: bool,
    positions: bool = False,
) -> RingSchedule:
    """The tasks of every ring step for ``rank``; the same step count on every rank of the ring.

    doc_lens: lengths of the full sequence's documents (one for an unpacked sequence); varlen:
    make varlen tasks over the documents (packed inputs); positions: every task carries its
    global positions (ALiBi)."""
    segs = [segments(layout, r, world_size, doc_lens) for r in range(world_size)]
    pairs = lambda r, i: block_tasks(segs[r], segs[(r - i) % world_size], bounds, varlen, positions)  # noqa: E731
    n_steps = 1
    for i in range(world_size):
        if any(pairs(r, i) for r in range(world_size)):
            n_steps = i + 1
    own = _own_shard_task(segs[rank], bounds, varlen, positions)
    first = pairs(rank, 0) if own is None else (own,)
    return RingSchedule((first, *(pairs(rank, i) for i in range(1, n_steps))))


def _own_shard_task(
    segs: list[Segment], bounds: MaskBounds, varlen: bool, positions: bool
) -> BlockTask | None:
    """Step 0 (the rank's own shard) as one causal call over the whole shard in local
    positions, where that is the same mask as its segments' calls in global positions: causal
    without a window (key visible iff pk <= pq), one unpacked sequence, no ALiBi (its bias needs
    global distances), and segments that follow each other in global order (zigzag's two
    chunks; not a ChunkLayout that deals a rank's chunks out of order). A map that keeps the
    order keeps pk <= pq, so local causal attention is the global one. Zigzag's first step is
    then one call instead of three (a diagonal block, a full block, a diagonal block) and no
    merge; None where the segments' tasks stay (one segment: already one task)."""
    if varlen or positions or bounds != MaskBounds(None, 0) or len(segs) < 2:
        return None
    spans = []
    for seg in segs:
        p = seg.positions.resolved(seg.length)
        spans.append((seg.local_start, seg.length, p.start, p.at(seg.length - 1)))
    for (start, length, _, last), (next_start, _, next_first, _) in zip(spans, spans[1:]):
        if next_start != start + length or next_first <= last:
            return None
    n = spans[-1][0] + spans[-1][1] - spans[0][0]
    return BlockTask(spans[0][0], n, spans[0][0], n, TokenPositions(), TokenPositions(), masked=True)
