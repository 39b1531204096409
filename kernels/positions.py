"""Token positions and the attention mask they imply.

Every kernel call sees a block of queries and a block of keys. Each block knows where its
tokens sit in the full sequence as an affine map ``position(i) = start + per_len * n + stride * i``
where n is the block's length (per sequence in varlen calls): a contiguous shard has stride 1,
a stripe shard (token t on rank t mod W) has stride W, and ``per_len`` places blocks whose
offset scales with their length, such as chunk c of every packed document (per_len = c) or
flash-attn's bottom-right alignment (per_len = -1 on both sides).

A key at position ``pk`` is visible to a query at position ``pq`` when

    pq - left <= pk <= pq + right

with ``left``/``right`` taken from ``window_size`` (``-1`` = unbounded) and ``right`` clamped
to 0 by ``causal``. This single rule covers full, causal, sliding-window and causal
sliding-window attention, for any offsets between the two blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class TokenPositions:
    """Global positions of a block's tokens: ``start + per_len * n + stride * i`` for local index
    ``i`` of a block (sequence) of length ``n``."""

    start: int = 0
    stride: int = 1
    per_len: int = 0

    def __post_init__(self) -> None:
        if not all(isinstance(x, int) for x in (self.start, self.stride, self.per_len)):
            raise TypeError(
                f"TokenPositions needs int start and stride (and per_len), got "
                f"{self.start!r}, {self.stride!r}, {self.per_len!r}"
            )
        if self.stride < 1:
            raise ValueError(f"TokenPositions.stride must be >= 1, got {self.stride}")

    def resolved(self, n: int) -> TokenPositions:
        """The same positions for a block of length ``n``, with ``per_len`` folded into start."""
        return TokenPositions(self.start + self.per_len * n, self.stride)

    def at(self, i: int) -> int:
        """Position of local index ``i`` (``per_len`` must be resolved first)."""
        if self.per_len:
            raise ValueError("TokenPositions.at needs resolved positions: call .resolved(n) first")
        return self.start + self.stride * i

    def shifted(self, n: int) -> TokenPositions:
        """Positions of the sub-block that starts at local index ``n`` (resolved positions)."""
        return TokenPositions(self.at(n), self.stride)


@dataclass(frozen=True)
class MaskBounds:
    """Resolved visibility bounds: key visible iff ``pq - left <= pk <= pq + right``; None = unbounded."""

    left: int | None
    right: int | None

    @staticmethod
    def from_args(causal: bool, window_size: tuple[int, int]) -> MaskBounds:
        left, right = window_size
        left_b = None if left < 0 else left
        right_b = None if right < 0 else right
        if causal:
            right_b = 0 if right_b is None else min(right_b, 0)
        return MaskBounds(left_b, right_b)

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None


class Visibility(Enum):
    NONE = "none"  # no query sees any key: skip the block
    FULL = "full"  # every query sees every key: no mask needed
    PARTIAL = "partial"  # some pairs are masked


def block_visibility(
    q_pos: TokenPositions, n_q: int, k_pos: TokenPositions, n_k: int, bounds: MaskBounds
) -> Visibility:
    """Classify a (query block, key block) pair under ``bounds`` with exact integer math."""
    if n_q == 0 or n_k == 0:
        return Visibility.NONE
    q_pos, k_pos = q_pos.resolved(n_q), k_pos.resolved(n_k)
    q_lo, q_hi = q_pos.start, q_pos.at(n_q - 1)
    k_lo, k_hi = k_pos.start, k_pos.at(n_k - 1)
    # Some pair visible: the extreme keys are within reach of the extreme queries...
    if bounds.right is not None and k_lo > q_hi + bounds.right:
        return Visibility.NONE
    if bounds.left is not None and k_hi < q_lo - bounds.left:
        return Visibility.NONE
    full = (bounds.right is None or k_hi <= q_lo + bounds.right) and (
        bounds.left is None or k_lo >= q_hi - bounds.left
    )
    if full:
        return Visibility.FULL
    # With strides > 1 a narrow window can fall between tokens; the kernel's per-tile bounds
    # then find no keys, so PARTIAL stays correct and costs only an empty launch.
    return Visibility.PARTIAL
