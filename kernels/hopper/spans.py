"""Which tiles a Hopper program visits: ``tiling.visible_tiles``'s rule in Gluon, from token
positions (start + stride * index) and the window's bounds (a query at pq sees a key at pk iff
pq - left <= pk <= pq + right), in non-negative integer math. The forward walks key tiles per
query tile (``key_tiles``), the backward query tiles per key tile (``query_span``). (A program
of a packed batch finds its sequence with ``tiling.packed_tile``: scalar Triton code, which
Gluon kernels call as it is.)"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def first_at_or_after(pos, base, stride):
    """Smallest index i >= 0 with base + stride * i >= pos (``tiling.py``'s rule, in non-negative
    integer math only)."""
    return (gl.maximum(pos - base, 0) + stride - 1) // stride


@gluon.jit
def count_at_or_before(pos, base, stride):
    """Number of indices i >= 0 with base + stride * i <= pos."""
    return gl.maximum(pos - base + stride, 0) // stride


@gluon.jit
def key_tiles(
    q_lo, q_hi, k_start, k_stride, len_k, left, right,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """For query rows at positions q_lo..q_hi, the key tiles of ``len_k`` keys (positions
    k_start + k_stride * i) that any row sees, [t_lo, t_hi), and those that every row sees in
    full, [t_full_lo, t_full_hi) (empty: t_full_lo == t_full_hi); the last, partial tile of the
    keys is never full. The same rule as ``tiling.visible_tiles``, in tiles."""
    zero = len_k * 0  # a runtime scalar, so that every branch yields one type
    lo = zero
    full_lo = zero
    hi = len_k
    full_hi = len_k
    if HAS_LEFT:
        lo = first_at_or_after(q_lo - left, k_start, k_stride)
        full_lo = first_at_or_after(q_hi - left, k_start, k_stride)
    if HAS_RIGHT:
        hi = gl.minimum(count_at_or_before(q_hi + right, k_start, k_stride), len_k)
        full_hi = gl.minimum(count_at_or_before(q_lo + right, k_start, k_stride), len_k)
    t_lo = lo // BLOCK_N
    t_hi = gl.where(lo < hi, (hi + BLOCK_N - 1) // BLOCK_N, t_lo)
    t_full_lo = gl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo)
    t_full_hi = full_hi // BLOCK_N
    t_full_hi = gl.where(t_full_lo < t_full_hi, t_full_hi, t_full_lo)
    return t_lo, t_hi, t_full_lo, t_full_hi


@gluon.jit
def query_span(
    key_lo, key_hi, q_start, q_stride, len_q, left, right,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
):  # fmt: skip
    """The outer span of tiling.visible_tiles seen from a key tile at positions key_lo..key_hi (a
    query at pq sees a key at pk iff pk - right <= pq <= pk + left): the query rows [start, end)
    of the tiles that see some key, start a multiple of BLOCK_M, end clamped to len_q, both 0
    when none does."""
    lo = len_q * 0
    if HAS_RIGHT:
        lo = first_at_or_after(key_lo - right, q_start, q_stride)
    hi = len_q + lo * 0
    if HAS_LEFT:
        hi = gl.minimum(count_at_or_before(key_hi + left, q_start, q_stride), len_q)
    empty = lo >= hi
    return gl.where(empty, 0, (lo // BLOCK_M) * BLOCK_M), gl.where(empty, 0, hi)
