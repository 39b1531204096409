"""The mask model: block classification against a brute-force check of every pair."""

import itertools
import random

import pytest

from ringflash.kernels import MaskBounds, TokenPositions, Visibility, block_visibility


def _visible(pq, pk, b: MaskBounds) -> bool:
    return (b.left is None or pk >= pq - b.left) and (b.right is None or pk <= pq + b.right)


def test_bounds_from_arguments():
    assert MaskBounds.from_args(False, (-1, -1)) == MaskBounds(None, None)
    assert MaskBounds.from_args(True, (-1, -1)) == MaskBounds(None, 0)
    assert MaskBounds.from_args(True, (8, 4)) == MaskBounds(8, 0)  # causal clamps the right side
    assert MaskBounds.from_args(True, (8, -3 + 2)) == MaskBounds(8, 0)
    assert MaskBounds.from_args(False, (3, 5)) == MaskBounds(3, 5)


def test_positions_validate():
    with pytest.raises(ValueError, match="stride must be >= 1"):
        TokenPositions(0, 0)
    with pytest.raises(TypeError, match="int start and stride"):
        TokenPositions(0.5, 1)
    assert TokenPositions(3, 2).shifted(4) == TokenPositions(11, 2)


def test_block_visibility_matches_brute_force():
    rng = random.Random(0)
    bounds_set = [
        MaskBounds(None, None),
        MaskBounds(None, 0),
        MaskBounds(3, 0),
        MaskBounds(2, 5),
        MaskBounds(0, 0),
    ]
    for _ in range(3000):
        qp = TokenPositions(rng.randrange(0, 40), rng.choice([1, 1, 2, 3]))
        kp = TokenPositions(rng.randrange(0, 40), qp.stride if rng.random() < 0.7 else 1)
        nq, nk = rng.randrange(1, 12), rng.randrange(1, 12)
        b = rng.choice(bounds_set)
        pairs = [_visible(qp.at(i), kp.at(j), b) for i, j in itertools.product(range(nq), range(nk))]
        got = block_visibility(qp, nq, kp, nk, b)
        if got is Visibility.FULL:
            assert all(pairs)
        elif got is Visibility.NONE:
            assert not any(pairs)
        else:  # PARTIAL: a mask is needed unless strides hide every pair (then the kernel finds none)
            assert not all(pairs)
            if qp.stride == kp.stride == 1:
                assert any(pairs)
    assert (
        block_visibility(TokenPositions(), 0, TokenPositions(), 4, MaskBounds(None, None)) is Visibility.NONE
    )
