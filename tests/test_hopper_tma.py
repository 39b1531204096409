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
