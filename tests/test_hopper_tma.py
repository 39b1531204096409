"""kernels/hopper/tma.py on the host: ``tma_layout_ok`` takes a packed (total, heads, head_dim)
tensor as the one batch entry it is, so its callers pass varlen tensors without a view."""

from __future__ import annotations

import pytest
import torch

tma = pytest.importorskip("ringflash.kernels.hopper.tma", reason="this Triton has no Gluon TMA API")


def _packed_tensors():
    base = torch.zeros(4096, dtype=torch.bfloat16)
    yield base[: 10 * 2 * 64].view(10, 2, 64)  # contiguous
    yield base[: 10 * 4 * 64].view(10, 4, 64)[:, 1:3]  # heads sliced: rows wider than heads
    yield base[: 10 * 2 * 64].view(10, 2, 64).transpose(0, 1).contiguous().transpose(0, 1)  # heads apart
    yield base[8 : 8 + 10 * 2 * 64].view(10, 2, 64)  # 16 bytes off: aligned
    yield base[1 : 1 + 10 * 2 * 64].view(10, 2, 64)  # 2 bytes off: not
    yield base[: 10 * 2 * 60].view(10, 2, 60)  # rows of 240 bytes
    yield base[: 10 * 2 * 36].view(10, 2, 36)  # rows of 144 bytes
    yield base[: 2 * 64].view(1, 2, 64)  # one token
    yield base[: 10 * 64].view(10, 64)[:, None, :20]  # one head, not a row of its own


@pytest.mark.parametrize("i", range(9))
def test_packed_tensor_reads_as_its_one_batch_entry(i):
    t = list(_packed_tensors())[i]
    assert tma.tma_layout_ok(t) == tma.tma_layout_ok(t.unsqueeze(0))


def test_cases_cover_both_answers():
    answers = {tma.tma_layout_ok(t) for t in _packed_tensors()}
    assert answers == {True, False}


def test_descriptors_of_one_geometry_share_nothing_but_their_numbers():
    """``rows_descriptor`` keeps the shapes, strides and blocks of a geometry: a second tensor
    of the same geometry gets its own base and its own lists equal to the first's; another
    stride, dtype, block or build width gets numbers of its own (as made afresh)."""
    big = torch.zeros(3, 50, 4, 96, dtype=torch.bfloat16)
    a, b = big[:, 10:40], big[:, 20:50]  # same geometry, other data
    da, rows_a = tma.rows_descriptor(a, 64, 128)
    db, rows_b = tma.rows_descriptor(b, 64, 128)
    assert (db.base.data_ptr(), rows_b) == (b.data_ptr(), rows_a) and db.base is b
    assert (db.shape, db.strides, db.block_shape) == (da.shape, da.strides, da.block_shape)
    assert db.shape is not da.shape and db.strides is not da.strides and db.block_shape is not da.block_shape
    cases = [
        (a, 64, 128), (a, 128, 128), (a.contiguous(), 64, 128), (a.half(), 64, 128),
        (torch.zeros(2, 30, 4, 128, dtype=torch.bfloat16), 64, None),
    ]  # fmt: skip
    for case in cases:  # every geometry in the cache at once, then each one read from it
        tma.rows_descriptor(*case)
    for case in cases:
        cached = tma.rows_descriptor(*case)
        tma._GEOMETRIES.clear()
        fresh = tma.rows_descriptor(*case)
        assert cached[1] == fresh[1] and cached[0].layout is fresh[0].layout
        assert (cached[0].shape, cached[0].strides, cached[0].block_shape) == (
            fresh[0].shape, fresh[0].strides, fresh[0].block_shape
        ), case[1:]  # fmt: skip
        for other in cases:
            tma.rows_descriptor(*other)
