"""How a full sequence is split over the W ranks of a sequence-parallel group.

A layout says, for each rank, which global token positions its local tokens hold, as a list of
segments with affine positions. That is all the ring engine needs: which (query segment, key
segment) pairs to compute, and with which mask, follows from the positions alone.

- ``contiguous``: rank r holds the r-th of W equal slices.
- ``zigzag``: 2W equal chunks; rank r holds chunks r and 2W-1-r, so every rank has the same
  amount of causal work.
- ``stripe``: token t lives on rank t mod W (positions r, r+W, r+2W, ...).
- a ``ChunkLayout``: C equal chunks, rank r holding the chunks its entry lists, in that order
  (``block_masks.balanced_layout`` makes one that balances a block mask's work; zigzag is
  ``ChunkLayout(((0, 3), (1, 2)))`` on two ranks).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kernels import TokenPositions, cu_seqlens_tensor
from .kernels.problem import cu_seqlens_host

LAYOUTS = ("contiguous", "zigzag", "stripe")


@dataclass(frozen=True)
class ChunkLayout:
    """A layout chunk by chunk: the sequence (each packed document) is cut into C equal chunks,
    and ring rank r holds chunks ``chunks[r]`` in that order (every rank as many; together
    each chunk once). Pass it wherever a layout name goes (``layout=``)."""

    chunks: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        ok = isinstance(self.chunks, tuple) and len(self.chunks) > 0
        ok = ok and all(isinstance(r, tuple) and len(r) == len(self.chunks[0]) > 0 for r in self.chunks)
        ok = ok and all(isinstance(c, int) and not isinstance(c, bool) for r in self.chunks for c in r)
        if not ok or sorted(c for r in self.chunks for c in r) != list(range(self.count)):
            raise ValueError(
                "ChunkLayout.chunks must be a tuple of equally long tuples of ints, one per rank, "
                f"listing every chunk 0..C-1 once; got {self.chunks!r}"
            )

    @property
    def count(self) -> int:
        """C, the number of chunks."""
        return sum(len(r) for r in self.chunks)


@dataclass(frozen=True)
class Segment:
    """Local tokens [local_start, local_start + length): the same chunk of every document, at
    document-relative ``positions`` (``per_len`` scales with each document's chunk length).
    ``seq_lens`` is each document's chunk length (they sum to ``length``); an unpacked sequence
    is a single document."""

    local_start: int
    length: int
    positions: TokenPositions
    seq_lens: tuple[int, ...]


def check_layout(layout: object) -> str | ChunkLayout:
    if not isinstance(layout, ChunkLayout) and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or a ChunkLayout, got {layout!r}")
    return layout  # type: ignore[return-value]


def layout_name(layout: object) -> str:
    """``layout`` checked as a layout name: the compiled ops' schemas take strings, so a
    ``ChunkLayout`` under torch.compile raises NotImplementedError."""
    if isinstance(check_layout(layout), ChunkLayout):
        raise NotImplementedError(
            f"layout={layout!r} under torch.compile: the compiled ops take layout names"
        )
    return layout  # type: ignore[return-value]


def shard_multiple(layout: str | ChunkLayout, world_size: int) -> int:
    """The full sequence length (each packed document's length) must be a multiple of this."""
    if isinstance(layout, ChunkLayout):
        if len(layout.chunks) != world_size:
            raise ValueError(
                f"the ChunkLayout is for {len(layout.chunks)} ring ranks, the ring has {world_size}"
            )
        return layout.count
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


def host_bounds(cu_seqlens: object) -> list[int]:
    """The values of ``cu_seqlens`` (a 1-D int32/int64 tensor, or a sequence of ints) on the host,
    unchecked beyond their type. An int32 tensor is read back once per tensor and version
    (``cu_seqlens_host``), every layer of a packed batch passing the same one."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")  # fmt: skip
        return list(cu_seqlens_host(cu_seqlens)) if cu_seqlens.dtype == torch.int32 else cu_seqlens.tolist()
    if isinstance(cu_seqlens, (list, tuple)) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in cu_seqlens
    ):
        return list(cu_seqlens)
    raise TypeError(
        f"cu_seqlens must be an int tensor or a sequence of ints, got {type(cu_seqlens).__name__}"
    )


def document_lengths(
    cu_seqlens: torch.Tensor | Sequence[int], total: int, layout: str, ring_size: int
) -> tuple[int, ...]:
    """Validated document lengths of a packed sequence of ``total`` tokens.

    cu_seqlens: cumulative lengths (0, L_0, L_0 + L_1, ..., total) of the documents of the *full*
    sequence, as an int tensor (CPU avoids a device sync) or a sequence of ints. Each document
    is split by ``layout`` over the ``ring_size`` ring ranks on its own, so each length must be
    a positive multiple of the layout's ``shard_multiple``.
    """
    bounds = host_bounds(cu_seqlens)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the full sequence length {total}, got {bounds}")
    lens = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    m = shard_multiple(layout, ring_size)
    bad = [(i, n) for i, n in enumerate(lens) if n <= 0 or n % m]
    if bad:
        i, n = bad[0]
        raise ValueError(
            f"packed document {i} has length {n}: with layout {layout!r} over {ring_size} ring ranks "
            f"every document must be a positive multiple of {m}; pad each document (shard_batch does)"
        )
    return lens


def full_document_lengths(
    layout: str, local_len: int, world_size: int, cu_seqlens: torch.Tensor | Sequence[int] | None
) -> tuple[int, ...]:
    """The documents of the full sequence whose shards of ``local_len`` tokens the ranks hold:
    one of world_size x local_len tokens, or ``cu_seqlens``' (``document_lengths``), validated."""
    total = local_len * world_size
    if cu_seqlens is None:
        check_total_length(layout, total, world_size, "full sequence length")
        return (total,)
    return document_lengths(cu_seqlens, total, layout, world_size)


def cumulative_lengths(lens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """int32 (0, l0, l0 + l1, ..., sum) of ``lens``: the inverse of ``document_lengths``; the
    kernels validate it without reading it back."""
    return cu_seqlens_tensor([0, *itertools.accumulate(lens)], device)


def segments(layout: str, rank: int, world_size: int, doc_lens: tuple[int, ...]) -> list[Segment]:
    """The segments of rank ``rank``'s local tokens under ``layout``, for a full sequence made of
    documents of lengths ``doc_lens`` (one document: an unpacked sequence), each split on its
    own. Packed local order: chunk c of every document, then (zigzag) the mirrored chunk."""
    if isinstance(layout, ChunkLayout):
        lens = tuple(n // layout.count for n in doc_lens)
        length = sum(lens)
        return [Segment(j * length, length, TokenPositions(0, 1, per_len=c), lens)
                for j, c in enumerate(layout.chunks[rank])]  # fmt: skip
    check_layout(layout)
    if layout == "stripe":
        return [Segment(0, sum(doc_lens) // world_size, TokenPositions(rank, world_size),
                        tuple(n // world_size for n in doc_lens))]  # fmt: skip
    if layout == "contiguous" or world_size == 1:
        lens = tuple(n // world_size for n in doc_lens)
        return [Segment(0, sum(lens), TokenPositions(0, 1, per_len=rank), lens)]
    lens = tuple(n // (2 * world_size) for n in doc_lens)
    c = sum(lens)
    return [
        Segment(0, c, TokenPositions(0, 1, per_len=rank), lens),
        Segment(c, c, TokenPositions(0, 1, per_len=2 * world_size - 1 - rank), lens),
    ]


def layout_indices(
    layout: str,
    rank: int,
    world_size: int,
    total: int,
    ulysses_size: int = 1,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Global positions (int64, in local order) of rank ``rank``'s tokens.

    With ``ulysses_size`` U > 1 (Ulysses or hybrid sequence parallelism) the sequence is first
    split by ``layout`` over the W/U ring groups, and each ring shard is then cut into U
    contiguous pieces, one per rank of the Ulysses group (ranks g*U .. g*U+U-1). After the
    Ulysses all-to-all, a group thus holds its ring shard in the ring's own local order.
    With ``cu_seqlens`` (packed documents, see ``document_lengths``) each document is split on
    its own.
    """
    if world_size % ulysses_size:
        raise ValueError(f"ulysses_size {ulysses_size} must divide the group size {world_size}")
    ring_size = world_size // ulysses_size
    if cu_seqlens is None:
        check_total_length(layout, total, ring_size)
        doc_lens: tuple[int, ...] = (total,)
    else:
        doc_lens = document_lengths(cu_seqlens, total, layout, ring_size)
    ring_len = total // ring_size
    if ring_len % ulysses_size:
        raise ValueError(
            f"sequence length {total} cannot be split over {ring_size} ring x {ulysses_size} Ulysses ranks: "
            f"it must be a multiple of {shard_multiple(layout, ring_size) * ulysses_size}"
        )
    ring_rank, piece = divmod(rank, ulysses_size)
    starts = [0, *itertools.accumulate(doc_lens)]
    parts = []
    for seg in segments(layout, ring_rank, ring_size, doc_lens):
        for doc_start, n in zip(starts, seg.seq_lens):
            pos = seg.positions.resolved(n)
            parts.append(doc_start + pos.start + pos.stride * torch.arange(n))
    n = ring_len // ulysses_size
    return torch.cat(parts)[piece * n : (piece + 1) * n]


def zigzag_indices(rank: int, world_size: int, total: int) -> torch.Tensor:
    """Global positions of rank ``rank``'s tokens in the zigzag layout."""
    return layout_indices("zigzag", rank, world_size, total)
