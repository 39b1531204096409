"""Triton helpers shared by the forward and backward kernels: which tiles a program visits.

A program owns a tile of rows (queries in forward/dQ, keys in dK/dV) and walks the tiles of
the other side. From the affine positions of both sides and the mask bounds it computes, with
non-negative integer math only (Triton and the interpreter round negative division
differently), the span of tiles that can see the row tile, and inside it the span where every
pair is visible and no mask is needed:

    [start, full_start)  masked      [full_start, full_end)  unmasked      [full_end, end)  masked

Which tile a program owns: ``tile_grid`` launches one program per (tile, head, sequence), or per
(tile of a packed batch, head) where lengths differ, and ``packed_tile`` finds the latter's
sequence (the Hopper kernels use both too: Gluon calls this scalar code as it is).
"""

import triton
import triton.language as tl


@triton.jit
def _first_at_or_after(pos, base, stride):
    """Smallest index i >= 0 with base + stride * i >= pos."""
    return (tl.maximum(pos - base, 0) + stride - 1) // stride


@triton.jit
def _count_at_or_before(pos, base, stride):
    """Number of indices i >= 0 with base + stride * i <= pos."""
    return tl.maximum(pos - base + stride, 0) // stride


@triton.jit
def visible_tiles(
    row_lo,
    row_hi,
    col_base,
    col_stride,
    n_cols,
    lo_off,
    hi_off,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Column tile spans for a row tile whose positions run from row_lo to row_hi.

    A column at position c is visible to a row at position r iff r - lo_off <= c <= r + hi_off
    (each side only when HAS_LO / HAS_HI). Returns (start, full_start, full_end, end), all
    multiples of BLOCK except end, which is clamped to n_cols.
    """
    zero = n_cols * 0  # a runtime scalar, so every branch below yields the same type
    lo = zero
    full_lo = zero
    if HAS_LO:
        lo = _first_at_or_after(row_lo - lo_off, col_base, col_stride)
        full_lo = _first_at_or_after(row_hi - lo_off, col_base, col_stride)
    hi = n_cols + zero
    full_hi = n_cols + zero
    if HAS_HI:
        hi = tl.minimum(_count_at_or_before(row_hi + hi_off, col_base, col_stride), n_cols)
        full_hi = tl.minimum(_count_at_or_before(row_lo + hi_off, col_base, col_stride), n_cols)
    empty = lo >= hi
    start = tl.where(empty, 0, (lo // BLOCK) * BLOCK)
    hi = tl.where(empty, 0, hi)
    full_start = tl.maximum(((full_lo + BLOCK - 1) // BLOCK) * BLOCK, start)
    full_end = (full_hi // BLOCK) * BLOCK
    # No mask-free tile (or nothing visible): one masked span [start, hi).
    no_full = empty | (full_start >= full_end)
    full_start = tl.where(no_full, start, full_start)
    full_end = tl.where(no_full, start, full_end)
    return start, full_start, full_end, hi


@triton.jit
def visibility_mask(
    row_pos, col_pos, col_idx, n_cols, lo_off, hi_off, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr
):
    """[rows, cols] boolean mask for a tile: inside n_cols and inside the window."""
    mask = col_idx[None, :] < n_cols
    if HAS_LO:
        mask = mask & (col_pos[None, :] >= row_pos[:, None] - lo_off)
    if HAS_HI:
        mask = mask & (col_pos[None, :] <= row_pos[:, None] + hi_off)
    return mask


@triton.jit
def listed_tile(it, blocks, LISTED: tl.constexpr):
    """(first row of the tile at offset ``it`` of a walk, first row of its block). A plain walk
    (LISTED 0) is over rows themselves: (it, 0). A block-sparse walk is over a list of blocks of
    LISTED rows (``blocks``: their numbers, int32) laid end to end: offset it is row it % LISTED
    of block blocks[it // LISTED]. One flat loop over a list pipelines across its blocks."""
    if LISTED > 0:
        block0 = tl.multiple_of(tl.load(blocks + it // LISTED) * LISTED, LISTED)
        return tl.multiple_of(block0 + it % LISTED, 16), block0
    else:
        return it, 0


@triton.jit
def mask_bits(bits, rows, cols, WORDS: tl.constexpr):
    """Bit (row, col) of a block's element mask (``tile_mask.TileMask.bits``: int32 words, WORDS
    per row, col's bit at col % 32 of word col // 32), for broadcastable rows/cols local to the
    block: True where the pair is visible."""
    words = tl.load(bits + rows * WORDS + cols // 32)
    return ((words >> (cols % 32)) & 1) != 0


@triton.jit
def row_pointers(base, first, rows, stride, WIDE: tl.constexpr):
    """[len(rows), 1] pointers to rows ``first + rows`` of ``base`` at a row stride.

    WIDE (for sequences that reach 2^31 elements from their start; ``problem.wide_offsets``)
    moves the base to the tile's first row with a 64-bit offset, rows inside the tile in 32
    bits. Otherwise all offsets are 32-bit: on an H200 the WIDE form in every loop made the
    kernels 5-10% slower (docs/experiments.md), so it is compiled only for inputs that need it.
    """
    if WIDE:
        return base + tl.cast(first, tl.int64) * stride + rows[:, None] * stride
    else:
        return base + (first + rows)[:, None] * stride


@triton.jit
def seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(q offset, q length, k offset, k length, int64 batch index for pointers) of sequence b.

    Varlen tensors are launched as one batch of packed tokens, so their batch index is 0.
    """
    if IS_VARLEN:
        q0 = tl.load(CU_Q + b)
        len_q = tl.load(CU_Q + b + 1) - q0
        k0 = tl.load(CU_K + b)
        len_k = tl.load(CU_K + b + 1) - k0
        pb = b.to(tl.int64) * 0
    else:
        q0 = b * 0
        len_q = seqlen_q + b * 0
        k0 = b * 0
        len_k = seqlen_k + b * 0
        pb = b.to(tl.int64)
    return q0, len_q, k0, len_k, pb


def tile_grid(
    max_len: int, heads: int, batch: int, block: int, packed_total: int | None = None
) -> tuple[tuple[int, int, int], int]:
    """The launch grid of programs over row tiles of ``block`` rows, and its ``packed_docs``
    argument: one program per (tile of the longest sequence, head, sequence), packed_docs 0; or,
    for a packed batch of ``packed_total`` rows (varlen), one per (slot, head) with packed_docs
    = batch (``packed_tile``: packed_total // block + batch slots) where that is fewer programs.
    Where lengths differ the first idles most programs (12 random lengths summing to 64K: 2 in 3;
    one document of 32K among 128 of 256 tokens: 32,512 of 33,024)."""
    per_sequence = -(-max_len // block)
    if packed_total is not None:
        slots = packed_total // block + batch
        if slots < per_sequence * batch:
            return (slots, heads, 1), batch
    return (per_sequence, heads, batch), 0


@triton.jit
def packed_tile(slot, CU, n_docs, BLOCK: tl.constexpr):
    """(sequence, tile index) of slot ``slot`` in a packed batch of ``n_docs`` sequences
    (cu_seqlens ``CU``), tiles of BLOCK rows numbered sequence by sequence: sequence b's tiles take
    the slots from cu[b] // BLOCK + b on (``tile_grid``). That start grows by at least each
    sequence's tile count, so a slot belongs to the last sequence starting at or before it
    (binary search over CU); a slot between two sequences gets a tile index past its rows."""
    lo = slot * 0
    hi = lo + n_docs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(CU + mid) // BLOCK + mid <= slot:
            lo = mid
        else:
            hi = mid
    return lo, slot - tl.load(CU + lo) // BLOCK - lo


@triton.jit
def program_tile(CU, packed_docs, BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(row tile, head, sequence) of this program, launched over ``tile_grid``'s grid."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if IS_VARLEN:
        if packed_docs > 0:
            b, t = packed_tile(t, CU, packed_docs, BLOCK)
    return t, h, b
