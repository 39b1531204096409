"""How a full sequence is split over the W ranks of a sequence-parallel group.

A layout says, for each rank, which global token positions its local tokens hold, as a list of
segments with affine positions. That is all the ring engine needs: which (query segment, key
segment) pairs to compute, and with which mask, follows from the positions alone.

- ``contiguous``: rank r holds the r-th of W equal slices.
- ``zigzag``: 2W equal chunks; rank r holds chunks r and 2W-1-r, so every rank has the same
  amount of causal work.
- ``stripe``: token t lives on rank t mod W (positions r, r+W, r+2W, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import TokenPositions

LAYOUTS = ("contiguous", "zigzag", "stripe")


@dataclass(frozen=True)
class Segment:
    """Local tokens [local_start, local_start + length) sit at global ``positions``."""

    local_start: int
    length: int
    positions: TokenPositions


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def shard_multiple(layout: str, world_size: int) -> int:
    """The full sequence length must be a multiple of this."""
    return 2 * world_size if check_layout(layout) == "zigzag" else world_size


def check_total_length(layout: str, total: int, world_size: int, what: str = "sequence length") -> int:
    """Validate that ``total`` tokens split evenly; return the per-rank length."""
    m = shard_multiple(layout, world_size)
    if total % m != 0:
        need = -(-total // m) * m
        raise ValueError(
            f"{what} {total} cannot be split by layout {layout!r} over {world_size} ranks: it must be "
            f"a multiple of {m} (pad to {need})"
        )
    return total // world_size


def segments(layout: str, rank: int, world_size: int, local_len: int) -> list[Segment]:
    """The segments of rank ``rank``'s local tokens under ``layout``."""
    check_layout(layout)
    if layout == "contiguous":
        return [Segment(0, local_len, TokenPositions(rank * local_len, 1))]
    if layout == "stripe":
        return [Segment(0, local_len, TokenPositions(rank, world_size))]
    if local_len % 2:
        raise ValueError(f"zigzag needs an even local sequence length, got {local_len}")
    c = local_len // 2
    return [
        Segment(0, c, TokenPositions(rank * c, 1)),
        Segment(c, c, TokenPositions((2 * world_size - 1 - rank) * c, 1)),
    ]


def layout_indices(
    layout: str, rank: int, world_size: int, total: int, ulysses_size: int = 1
) -> torch.Tensor:
    """Global positions (int64, in local order) of rank ``rank``'s tokens.

    With ``ulysses_size`` U > 1 (Ulysses or hybrid sequence parallelism) the sequence is first
    split by ``layout`` over the W/U ring groups, and each ring shard is then cut into U
    contiguous pieces, one per rank of the Ulysses group (ranks g*U .. g*U+U-1). After the
    Ulysses all-to-all, a group thus holds its ring shard in the ring's own local order.
    """
    if world_size % ulysses_size:
        raise ValueError(f"ulysses_size {ulysses_size} must divide the group size {world_size}")
    ring_size = world_size // ulysses_size
    check_total_length(layout, total, ring_size)
    ring_len = total // ring_size
    if ring_len % ulysses_size:
        raise ValueError(
            f"sequence length {total} cannot be split over {ring_size} ring x {ulysses_size} Ulysses ranks: "
            f"it must be a multiple of {shard_multiple(layout, ring_size) * ulysses_size}"
        )
    ring_rank, piece = divmod(rank, ulysses_size)
    parts = [
        s.positions.start + s.positions.stride * torch.arange(s.length)
        for s in segments(layout, ring_rank, ring_size, ring_len)
    ]
    n = ring_len // ulysses_size
    return torch.cat(parts)[piece * n : (piece + 1) * n]


def zigzag_indices(rank: int, world_size: int, total: int) -> torch.Tensor:
    """Global positions of rank ``rank``'s tokens in the zigzag layout."""
    return layout_indices("zigzag", rank, world_size, total)
