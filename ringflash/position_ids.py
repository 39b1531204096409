"""What ``position_ids`` say about packed documents, for callers that get positions but no
``cu_seqlens`` (transformers passes ``position_ids`` to every attention call).

A row's positions *restart* where one is not greater than the one before it (transformers'
``DataCollatorWithFlattening`` packs documents that way): a new document starts there, as in
``shard_batch``. On one device the documents follow from the positions
(``documents_from_position_ids``). A sequence-parallel shard holds only some of the tokens, so a
restart in another rank's tokens is invisible here; ``check_shard_position_ids`` instead checks,
with every rank, that the positions are those of one unbroken sequence in the layout.
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.distributed as dist

from .comm import host_values_agree, resolve_group
from .layouts import layout_indices
from .mesh import check_ulysses_size

# Values exchanged by check_shard_position_ids besides a digest of the offsets (a digest is >= 0).
_NOT_CONSECUTIVE, _LOCAL_ERROR = -1, -2


def position_restarts(positions: torch.Tensor) -> torch.Tensor:
    """bool (batch, seqlen - 1): True where token i + 1 starts a new document (its position is
    not greater than token i's)."""
    return positions[:, 1:] <= positions[:, :-1]


def _rows(position_ids: object, batch: int, seqlen: int) -> torch.Tensor:
    """position_ids as (batch, seqlen); (1, seqlen) is broadcast over the batch, as transformers
    builds it when the caller passes none."""
    if (
        not isinstance(position_ids, torch.Tensor)
        or position_ids.is_floating_point()
        or position_ids.dim() != 2
        or position_ids.shape[0] not in (1, batch)
        or position_ids.shape[1] != seqlen
    ):
        what = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids)
        raise ValueError(
            f"position_ids must be an int tensor of shape ({batch}, {seqlen}) or (1, {seqlen}) "
            f"(batch, local seqlen of the query), got {what}"
        )
    return position_ids.expand(batch, seqlen)


def documents_from_position_ids(position_ids: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor | None:
    """cu_seqlens (int32, CPU) of the documents of all rows flattened into one packed row of
    ``batch * seqlen`` tokens (every row boundary is a document boundary too), or None when no
    row's positions restart (then the rows are ordinary sequences).

    position_ids: int (batch, seqlen) or (1, seqlen). Reads the starts back from the device:
    one synchronization per call (none for a single token), like transformers' own
    ``_is_packed_sequence`` check, which makes it only for batch 1 (rows that restart in a larger
    batch attend across documents there).
    """
    positions = _rows(position_ids, batch, seqlen)
    if seqlen == 1:  # a decoding step: nothing can restart, and no sync
        return None
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=positions.device)
    starts[:, 1:] = position_restarts(positions)
    cu = starts.flatten().nonzero().flatten()
    if cu.numel() == batch:
        return None
    total = torch.tensor([batch * seqlen], dtype=cu.dtype, device=cu.device)
    return torch.cat([cu, total]).to(device="cpu", dtype=torch.int32)


@functools.lru_cache(maxsize=64)
def _layout_positions(
    layout: str, rank: int, world: int, total: int, ulysses_size: int, device: torch.device
) -> torch.Tensor:
    return layout_indices(layout, rank, world, total, ulysses_size).to(device)


def check_shard_position_ids(
    position_ids: torch.Tensor,
    batch: int,
    seqlen: int,
    *,
    group: dist.ProcessGroup | None,
    layout: str,
    ulysses_size: int | None,
    packed_hint: str,
) -> None:
    """Raise ValueError on every rank of ``group`` unless each row's positions, over all ranks'
    shards, are those of one unbroken sequence: offset + the global index of each local token in
    ``layout`` (``layouts.layout_indices``; the offset may differ between rows). Positions that
    restart (packed documents) or jump fail: the documents cannot be recovered from shards
    (``packed_hint`` tells the caller what to do instead; it ends the error message).

    position_ids: int (batch, seqlen) or (1, seqlen), this rank's shard (seqlen local tokens).
    ulysses_size: U as in ``layout_indices`` (1 for the ring; None: W, pure Ulysses).
    Every rank of ``group`` must call it: one small device comparison read back to the host (a
    synchronization per call, like transformers' own ``_is_packed_sequence`` check) and one
    16-byte all-reduce on the host, so that a restart seen by one rank fails every rank instead
    of leaving the others waiting in the ring.
    """
    group = resolve_group(group)
    value, error = _LOCAL_ERROR, None
    try:
        positions = _rows(position_ids, batch, seqlen)
        world = dist.get_world_size(group)
        u = check_ulysses_size(world if ulysses_size is None else ulysses_size, world)
        expected = _layout_positions(layout, dist.get_rank(group), world, seqlen * world, u, positions.device)
        offset = positions - expected
        low, high = torch.stack([offset.amin(dim=1), offset.amax(dim=1)]).tolist()
        if low != high:
            value = _NOT_CONSECUTIVE
        else:
            value = int.from_bytes(hashlib.blake2b(repr(low).encode(), digest_size=7).digest(), "big")
    except (ValueError, TypeError) as e:
        error = e
    agree = host_values_agree(value, group)  # every rank joins, whatever it found
    if error is not None:
        raise error
    if value == _NOT_CONSECUTIVE or not agree:
        raise ValueError(
            "position_ids restart (packed documents) or jump inside the sequence (checked over every "
            f"rank's shard in layout {layout!r}): {packed_hint}"
        )


def assert_unpacked_in_graph(
    position_ids: torch.Tensor,
    batch: int,
    seqlen: int,
    *,
    group: dist.ProcessGroup | None,
    layout: str,
    ulysses_size: int | None,
    packed_hint: str,
) -> None:
    """The checks above as a traced graph can hold them (under ``torch.compile``), with no host
    synchronization: device-side asserts that fail the step (RuntimeError; on a GPU a CUDA
    device-side assert) instead of attending across documents.

    On one device (``group`` None and no process group), positions must not restart: documents
    cannot be found without reading them back, so a compiled model with packed documents passes
    ``cu_seq_lens_q``. Sequence parallel, positions must equal the layout's global index of each
    local token (``layouts.layout_indices``, offset 0, as ``shard_batch`` gives them), which a
    restart in any rank's tokens breaks on some rank; that rank's assert stops the step.
    """
    positions = _rows(position_ids, batch, seqlen)
    message = f"position_ids restart (packed documents) or jump inside the sequence: {packed_hint}"
    if group is None and not (dist.is_available() and dist.is_initialized()):
        torch._assert_async(~position_restarts(positions).any(), message)
        return
    group = resolve_group(group)
    world = dist.get_world_size(group)
    u = check_ulysses_size(world if ulysses_size is None else ulysses_size, world)
    expected = _layout_positions(layout, dist.get_rank(group), world, seqlen * world, u, positions.device)
    torch._assert_async((positions == expected).all(), message + " (compiled: positions must start at 0)")
