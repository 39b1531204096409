"""Packed documents seen through position_ids: the documents on one device, and the check that a
sequence-parallel shard's positions are those of one unbroken sequence in its layout."""

from __future__ import annotations

import pytest
import torch
from distributed import errors_of

from ringflash import LAYOUTS, shard_sequence
from ringflash.position_ids import check_shard_position_ids, documents_from_position_ids


def test_documents_from_position_ids():
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [3, 4, 5, 6, 0, 1, 2, 3]])
    assert documents_from_position_ids(packed, 2, 8).tolist() == [0, 3, 5, 8, 12, 16]
    assert documents_from_position_ids(torch.arange(8)[None] + 4, 2, 8) is None  # broadcast, offset
    assert documents_from_position_ids(torch.tensor([[0, 1, 5, 6]]), 1, 4) is None  # a jump: one document
    assert documents_from_position_ids(torch.tensor([[7], [0]]), 2, 1) is None  # decoding
    with pytest.raises(ValueError, match=r"position_ids must be an int tensor of shape \(2, 8\)"):
        documents_from_position_ids(torch.arange(16)[None], 2, 8)


def _check_shards(layout: str, ulysses_size: int):
    """Every rank's error for an unpacked row (positions from 5) and a packed one (12, 36)."""
    rows = {
        "unpacked": torch.arange(48)[None] + 5,
        "packed": torch.cat([torch.arange(12), torch.arange(36)])[None],
    }

    def check(positions):
        shard = shard_sequence(positions, None, 1, layout=layout, ulysses_size=ulysses_size)
        check_shard_position_ids(shard, 1, shard.shape[1], group=None, layout=layout,
                                 ulysses_size=ulysses_size, packed_hint="pass cu_seqlens")  # fmt: skip

    return errors_of({name: (lambda p=p: check(p)) for name, p in rows.items()})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ulysses_size", [1, 2])
def test_shard_position_ids_checked_over_all_ranks(rank_pool, layout, ulysses_size):
    for rank, errors in enumerate(rank_pool(2).run(_check_shards, layout, ulysses_size, timeout=60)):
        assert errors["unpacked"] is None, (rank, errors)
        assert errors["packed"] is not None and errors["packed"].endswith("pass cu_seqlens"), (rank, errors)


def test_compiled_one_device_check_asserts_without_a_sync():
    """Under torch.compile (fullgraph: no graph break, no host read-back) restarting positions
    fail the step through a device-side assert; unpacked ones pass."""
    from ringflash.position_ids import assert_unpacked_in_graph

    def step(x, positions):
        assert_unpacked_in_graph(
            positions, 1, 8, group=None, layout="zigzag", ulysses_size=1, packed_hint="hint"
        )
        return x + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert compiled(torch.zeros(2), torch.arange(8)[None] + 3).tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="hint"):
        compiled(torch.zeros(2), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))


def _compiled_shard_check(layout: str):
    from ringflash.position_ids import assert_unpacked_in_graph

    def step(positions):
        assert_unpacked_in_graph(positions, 1, positions.shape[1], group=None, layout=layout, ulysses_size=1,
                                 packed_hint="hint")  # fmt: skip
        return positions.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    packed = torch.cat([torch.arange(24), torch.arange(24)])[None]
    errors = {}
    for name, positions in (("unpacked", torch.arange(48)[None]), ("packed", packed)):
        try:
            compiled(shard_sequence(positions, None, 1, layout=layout))
            errors[name] = None
        except RuntimeError as e:  # the device-side assert (CPU: raised at once)
            errors[name] = str(e)
    return errors


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_compiled_shard_check_asserts_on_some_rank(rank_pool, layout):
    """Compiled, sequence parallel: documents (24, 24) restart exactly at the contiguous shards'
    boundary, invisible to each shard alone; rank 1's positions are not its layout's, and its
    assert stops the step."""
    errors = rank_pool(2).run(_compiled_shard_check, layout, timeout=120)
    assert all(e["unpacked"] is None for e in errors), errors
    assert any(e["packed"] is not None and "hint" in e["packed"] for e in errors), errors
