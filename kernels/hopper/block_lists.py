"""A block mask's lists as the Hopper kernels walk them (forward.py and backward.py, SPARSE):
block-sparse attention (``tile_mask.TileMask``) on the warp-specialized kernels.

A query tile (128 rows) is one mask block; its list holds the key blocks it sees, its partial
blocks first, then its full ones (``kv_count``, ``kv_index``, ``kv_kind``). The loader brings the
listed key tiles (``query_tiles.load_key_tiles`` with LISTED) into the same K/V rings as a dense
walk; the compute warpgroups take the same steps, each partial block's scores masked by its bits
(``bits_scores``), the full ones unmasked. Key tiles are mask blocks too (128 keys: the 64 and
128 builds; ``forward.sparse_supports``), and a block that the sequences' ends cut is always
partial, so its bits hide what lies past the keys (TMA fills those rows with zeros).

The backward's program is one key block (128 keys) and walks that block's list of query blocks
(``q_count``/``q_index``/``q_kind``, the same ``BlockLists`` and ``block_list``), each block whole
64-row query tiles; a partial block's bits, still [query row][key word], mask its S^T tiles
(``tile_bits``, ``bits_visible_t``).

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate

from .query_tiles import Shared


@aggregate
class BlockLists:
    """A mask's lists in global memory (per query block; per key block for the backward): counts
    (partial, full) per block, the blocks' numbers and kinds (a partial block's index into
    ``bits``), the bits (int32 words, WORDS per row); strides of the (batch, head) dimensions, 0
    where the mask is shared."""

    count: gl.tensor
    index: gl.tensor
    kind: gl.tensor
    bits: gl.tensor
    stride_cb: gl.tensor
    stride_ch: gl.tensor
    stride_ib: gl.tensor
    stride_ih: gl.tensor
    stride_im: gl.tensor

    @gluon.constexpr_function
    def __init__(self, count, index, kind, bits, stride_cb, stride_ch, stride_ib, stride_ih, stride_im):
        self.count = count
        self.index = index
        self.kind = kind
        self.bits = bits
        self.stride_cb = stride_cb
        self.stride_ch = stride_ch
        self.stride_ib = stride_ib
        self.stride_ih = stride_ih
        self.stride_im = stride_im


@gluon.jit
def block_lists(
    COUNT, INDEX, KIND, BITS, stride_cb, stride_ch, stride_ib, stride_ih, stride_im
) -> BlockLists:
    """``BlockLists`` from a kernel's arguments (``+ 0``: strides equal to 1 or 0 are made
    constants by a launch; the aggregate takes tensors)."""
    zero = gl.program_id(0) * 0
    return BlockLists(
        COUNT, INDEX, KIND, BITS, stride_cb + zero, stride_ch + zero, stride_ib + zero, stride_ih + zero,
        stride_im + zero,
    )  # fmt: skip


@gluon.jit
def block_list(bl: BlockLists, b, h, qb):
    """(partial blocks, all blocks, pointer to their numbers, pointer to their kinds) of query
    block ``qb`` of sequence b, query head h."""
    b64 = b.to(gl.int64)
    h64 = h.to(gl.int64)
    counts = bl.count + b64 * bl.stride_cb + h64 * bl.stride_ch + qb * 2
    n_partial = gl.load(counts)
    n_blocks = n_partial + gl.load(counts + 1)
    entries = b64 * bl.stride_ib + h64 * bl.stride_ih + qb * bl.stride_im
    return n_partial, n_blocks, bl.index + entries, bl.kind + entries


@gluon.jit
def listed_walk(p: Shared, n_blocks) -> Shared:
    """``p`` walking ``n_blocks`` listed key tiles instead of its dense span (``t_last`` unused)."""
    return Shared(
        p.q_desc, p.k_desc, p.v_desc, p.rings, p.q_slot, p.q_phase, p.ring0, p.q_row, p.k_row0, p.v_row0,
        p.q_head, p.k_head, n_blocks * 0, n_blocks, p.tensor_dim,
    )  # fmt: skip


@gluon.jit
def bits_scores(s, bits, kind, w: gl.constexpr):
    """Warpgroup w's (64 rows of the block) scores with -inf where partial block ``kind``'s bits
    hide the pair: word c // 32 of row r, bit c % 32 (``tile_mask.TileMask.bits``; the block is
    the query tile, both halves, by the key tile). Each score's word is read from global memory
    (a block's 2 KiB, cached: four words per row)."""
    HALF_M: gl.constexpr = s.shape[0]
    BLOCK_N: gl.constexpr = s.shape[1]
    WORDS: gl.constexpr = BLOCK_N // 32
    layout: gl.constexpr = s.type.layout
    rows = w * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    base = bits + kind.to(gl.int64) * (2 * HALF_M * WORDS)
    words = gl.load(base + rows[:, None] * WORDS + (cols // 32)[None, :])
    keep = ((words >> (cols % 32)[None, :]) & 1) != 0
    return gl.where(keep, s, -float("inf"))


@gluon.jit
def tile_bits(
    bl: BlockLists, kinds, t, TILES_PER_BLOCK: gl.constexpr, BLOCK_M: gl.constexpr, WORDS: gl.constexpr
):
    """The backward's walk (backward.py, SPARSE): the bit words of its tile t, query tile t %
    TILES_PER_BLOCK of listed block t // TILES_PER_BLOCK (partial, its kind read at ``kinds``):
    BLOCK_M rows of WORDS words from that row on."""
    kind = gl.load(kinds + t // TILES_PER_BLOCK).to(gl.int64)
    return bl.bits + kind * (TILES_PER_BLOCK * BLOCK_M * WORDS) + (t % TILES_PER_BLOCK) * (BLOCK_M * WORDS)


@gluon.jit
def bits_visible_t(bits, offs_n, offs_m, WORDS: gl.constexpr):
    """[keys, queries] visibility of the backward's S^T tile from its bits (``tile_bits``): key
    offs_n of the block, query offs_m of the tile, word offs_m * WORDS + offs_n // 32, bit
    offs_n % 32 (``tile_mask.TileMask.bits``), each score's word read from global memory (cached)."""
    words = gl.load(bits + offs_m[None, :] * WORDS + (offs_n // 32)[:, None])
    return ((words >> (offs_n % 32)[:, None]) & 1) != 0
