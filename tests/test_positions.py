"""The mask model in pure Python: bounds from arguments, token positions, and block classification
against a brute-force check of every (query, key) pair."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from reference import visibility

from ringflash.kernels import MaskBounds, TokenPositions, Visibility, block_visibility


def _visible(pq: int, pk: int, b: MaskBounds) -> bool:
    return (b.left is None or pk >= pq - b.left) and (b.right is None or pk <= pq + b.right)


@pytest.mark.parametrize(
    ("causal", "window", "expected"),
    [
        (False, (-1, -1), MaskBounds(None, None)),
        (True, (-1, -1), MaskBounds(None, 0)),
        (False, (3, 5), MaskBounds(3, 5)),
        (False, (0, 0), MaskBounds(0, 0)),
        (False, (3, 0), MaskBounds(3, 0)),
        (False, (-1, 4), MaskBounds(None, 4)),
        (False, (4, -1), MaskBounds(4, None)),
        (True, (8, 4), MaskBounds(8, 0)),  # causal clamps the right side to 0
        (True, (8, 0), MaskBounds(8, 0)),
        (True, (-1, 7), MaskBounds(None, 0)),
        (True, (0, -1), MaskBounds(0, 0)),
    ],
)
def test_bounds_from_arguments(causal, window, expected):
    bounds = MaskBounds.from_args(causal, window)
    assert bounds == expected
    assert bounds.is_full == (expected.left is None and expected.right is None)


def test_bounds_agree_with_reference_visibility():
    """MaskBounds.from_args + the visibility rule is the test reference's mask, for every window."""
    pos_q, pos_k = torch.arange(-6, 14), torch.arange(0, 17)
    for causal, left, right in itertools.product((False, True), range(-1, 6), range(-1, 6)):
        b = MaskBounds.from_args(causal, (left, right))
        got = torch.tensor([[_visible(pq, pk, b) for pk in pos_k.tolist()] for pq in pos_q.tolist()])
        assert torch.equal(got, visibility(pos_q, pos_k, causal, (left, right))), (causal, left, right)


def test_positions_validate():
    with pytest.raises(ValueError, match="TokenPositions.stride must be >= 1, got 0"):
        TokenPositions(0, 0)
    with pytest.raises(ValueError, match="TokenPositions.stride must be >= 1, got -2"):
        TokenPositions(5, -2)
    with pytest.raises(TypeError, match="TokenPositions needs int start and stride"):
        TokenPositions(0.5, 1)
    with pytest.raises(TypeError, match="TokenPositions needs int start and stride"):
        TokenPositions(0, 2.0)
    with pytest.raises(TypeError, match="TokenPositions needs int start and stride"):
        TokenPositions("0", 1)


def test_positions_arithmetic():
    p = TokenPositions(3, 2)
    assert [p.at(i) for i in range(4)] == [3, 5, 7, 9]
    assert p.shifted(4) == TokenPositions(11, 2) and p.shifted(4).at(1) == p.at(5)
    assert TokenPositions() == TokenPositions(0, 1)
    assert TokenPositions(-7, 3).at(2) == -1  # negative starts: seqlen_q > seqlen_k alignment
    with pytest.raises(AttributeError):
        p.start = 4  # frozen: problems are shared between launches


_BOUNDS = [
    MaskBounds(None, None),
    MaskBounds(None, 0),
    MaskBounds(0, 0),
    MaskBounds(3, 0),
    MaskBounds(8, 4),
    MaskBounds(2, 5),
    MaskBounds(0, None),
    MaskBounds(6, None),
    MaskBounds(None, 3),
    MaskBounds(25, 0),
]


@pytest.mark.parametrize("seed", range(4))
def test_block_visibility_matches_brute_force(seed):
    """FULL iff every pair is visible (exact for any strides: the block ends are real tokens);
    NONE only if no pair is visible; with stride 1 on both sides NONE iff no pair is visible,
    so PARTIAL means some but not all. With strides > 1 a window can fall between tokens:
    PARTIAL with nothing visible is allowed (the kernel then finds no keys)."""
    rng = random.Random(seed)
    seen = {v: 0 for v in Visibility}
    for _ in range(1500):
        stride_q = rng.randint(1, 3)
        stride_k = stride_q if rng.random() < 0.6 else rng.randint(1, 3)
        qp = TokenPositions(rng.randint(-30, 50), stride_q)
        kp = TokenPositions(rng.randint(-30, 50), stride_k)
        nq, nk = rng.randint(1, 14), rng.randint(1, 14)
        windows = [
            (-1, -1),
            (0, 0),
            (3, 0),
            (8, 4),
            (2, 5),
            (0, -1),
            (-1, 3),
            (rng.randint(0, 30), rng.randint(0, 30)),
        ]
        b = MaskBounds.from_args(rng.random() < 0.5, rng.choice(windows))
        if rng.random() < 0.3:
            b = rng.choice(_BOUNDS)
        pairs = [_visible(qp.at(i), kp.at(j), b) for i, j in itertools.product(range(nq), range(nk))]
        got = block_visibility(qp, nq, kp, nk, b)
        seen[got] += 1
        ctx = (qp, nq, kp, nk, b, got)
        if got is Visibility.FULL:
            assert all(pairs), ctx
        elif got is Visibility.NONE:
            assert not any(pairs), ctx
        else:
            assert not all(pairs), ctx
            if qp.stride == kp.stride == 1:
                assert any(pairs), ctx
        if all(pairs):
            assert got is Visibility.FULL, ctx
        if not any(pairs) and qp.stride == kp.stride == 1:
            assert got is Visibility.NONE, ctx
    assert min(seen.values()) > 50, seen  # every class exercised


def test_block_visibility_stripe_layout():
    """Stripe ring (token t on rank t mod 4), causal: blocks of 8 tokens per rank."""
    w, n = 4, 8
    for r, s in itertools.product(range(w), repeat=2):
        got = block_visibility(TokenPositions(r, w), n, TokenPositions(s, w), n, MaskBounds(None, 0))
        assert got is Visibility.PARTIAL  # the first query never sees the last key, something is seen
        pairs = [r + w * i >= s + w * j for i, j in itertools.product(range(n), repeat=2)]
        assert any(pairs) and not all(pairs)


@pytest.mark.parametrize(
    ("q", "nq", "k", "nk", "bounds", "expected"),
    [
        (TokenPositions(100), 16, TokenPositions(0), 16, MaskBounds(None, 0), Visibility.FULL),
        (TokenPositions(0), 16, TokenPositions(100), 16, MaskBounds(None, 0), Visibility.NONE),
        (TokenPositions(0), 16, TokenPositions(0), 16, MaskBounds(None, 0), Visibility.PARTIAL),
        (TokenPositions(15), 1, TokenPositions(0), 16, MaskBounds(None, 0), Visibility.FULL),
        (TokenPositions(100), 16, TokenPositions(0), 16, MaskBounds(20, 0), Visibility.NONE),
        (TokenPositions(20), 4, TokenPositions(0), 4, MaskBounds(20, 0), Visibility.PARTIAL),
        (TokenPositions(1, 2), 5, TokenPositions(0, 2), 5, MaskBounds(0, 0), Visibility.PARTIAL),
        (TokenPositions(-5), 4, TokenPositions(0), 4, MaskBounds(None, 0), Visibility.NONE),
        (TokenPositions(), 0, TokenPositions(), 4, MaskBounds(None, None), Visibility.NONE),
        (TokenPositions(), 4, TokenPositions(), 0, MaskBounds(None, None), Visibility.NONE),
        (TokenPositions(), 4, TokenPositions(), 4, MaskBounds(None, None), Visibility.FULL),
    ],
)
def test_block_visibility_cases(q, nq, k, nk, bounds, expected):
    assert block_visibility(q, nq, k, nk, bounds) is expected
