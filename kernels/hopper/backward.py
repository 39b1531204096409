"""Fused attention backward for Hopper (sm_90) in Gluon: five products per tile pair.

The Triton backward (backward.py) runs seven matrix products per (query tile, key tile) pair,
because its dQ kernel recomputes QK^T and dP. Here, as in FlashAttention-3, one program per
(key tile, KV head, sequence) keeps K/V in shared memory and walks the query tiles of every
query head of its GQA group, with its warps specialized (``gl.warp_specialize``):

- loader, 1 warp: K/V once, then Q/dO tiles by TMA and their LSE/delta rows by cp.async into a
  two-stage ring (ready/empty mbarriers);
- dQ writer, 1 warp: adds each float32 dQ tile from a two-buffer ring in shared memory into the
  dQ buffer with one TMA reduce-add (idle at head_dim 256, below);
- compute, 8 warps at 240 registers: S^T = K Q^T and dP^T = V dO^T, P^T and dS^T (scaled by
  softmax_scale, which serves dK and dQ), dV += P^T dO, dQ = dS K, dK += dS^T Q, the dK product
  left in flight while the next tile's S^T/dP^T are issued (S^T only at head_dim 64 under Triton
  3.9: ``_dk_retired_before_dpt``).

The compute warps hand stages back to the loader and dQ tiles to the writer by mbarriers, or at
head_dim 64 by named barriers that they pass without waiting for each other (QDO_FREE, DQ_FULL;
docs/experiments.md §35).

A softcap (SOFTCAP) and ALiBi (HAS_ALIBI) are built in as in the forward. For
Infini-attention's local attention (MEMORY) the memory updates' backward of each key tile (GRAM:
the delta rule's, with its Gram terms) is added into its dK and dV at the end, while K and V are
still in shared memory; a whole key tile's dK and dV then leave through those tiles by TMA.

Masks. Each program computes, from its key tile's positions, the span of query tiles that see
any of its keys (the ``tiling.visible_tiles`` rule, in non-negative integer math) and walks
only that span, for every query head of its GQA group. Three variants (constexprs):
- unmasked: lengths multiples of the tiles, every pair visible;
- DIAGONAL: causal between blocks at equal positions with whole tiles (a shard's own block):
  the key tile's span starts at its own row, and an index compare masks every tile (a no-op
  past the first two), as the kernel always did;
- MASKED (HAS_LEFT/HAS_RIGHT: the window's sides; VARLEN: packed documents, cu_seqlens; any
  lengths, positions, seqlen_q != seqlen_k): every tile masked by positions (``_visible_t``;
  with unit strides about 100 SASS instructions per tile more than unmasked, without spills).
  Masking only the boundary tiles, behind a runtime branch inside the loop, made ptxas
  serialize every wgmma ("insufficient register resources", with the branch before or after
  the dP^T wait); a loop of their own serializes them too (above).
Rows past a sequence's end arrive by TMA anyway (the next sequence's rows, or zeros past the
tensor); their P is set to exactly 0 after the exp, so their dS is 0 and the dQ reduce-add adds
exact zeros (x + 0 = x) to rows this program does not own, and TMA clips rows past the tensor's
end. Their LSE/delta rows are not read (masked cp.async), and dK/dV stores stop at the
sequence's end. A key tile that no query sees stores dK = dV = 0 (or adds nothing).

Block masks (SPARSE, ``sparse_supports``; block_lists.py): the key tile is one 128-key block of a
``TileMask``, and each program walks, for each query head of its group, the query blocks in that
key block's list (each MASK_Q // BLOCK_M query tiles) instead of a span: the partial ones first,
P^T masked by their bits after the exp as MASKED masks it, then the full ones unmasked. The
loader and the dQ writer read the same lists for their tiles' rows. Blocks cut by the sequences'
ends are always partial, so rows past them get P = 0 as under MASKED.

Tiles per head_dim (``TILES``): 64 query x 128 key rows at head_dim 128 and 64, as
FlashAttention-3's sm90 backward at 128. At 64 it takes 128 x 128 with two MMA warpgroups that
split the work differently; here, with eight compute warps sharing every product, 128 x 128
spilled 32-62 registers per tile and serialized every wgmma (sm_90 build, 2026-11-24), while
64 x 128 spills none.

Head_dim 256 takes 64 x 64 tiles, as FlashAttention-3's sm90 backward does (64 x 64 or 64 x 80),
and changes three things (constexprs SPLIT_N and DKDV_ONLY, derived from the tiles):
- dK + dV of a 64-row key tile take 128 float32 registers per thread; 64 rows are one wgmma's M,
  so the two warpgroups split columns instead of rows (S^T/dP^T: 32 queries each; dK/dV: 128
  of head_dim each), and P^T and dS^T, which each warpgroup needs whole, go to the dV and dK
  products through shared memory (P^T in a buffer of its own, dS^T in the one dK reads);
- shared memory: K, V and the two Q/dO stages (2 x 2 x 64 x 256 x 2 bytes) take 192 KiB of the
  227 KiB, with dS^T and P^T 208 KiB, leaving no room for the float32 dQ ring (2 x 64 KiB). Adding
  dQ tiles into a float32 buffer by atomic adds from registers instead (as FlashAttention-3's
  does at 256) took half of the kernel's time (docs/experiments.md §28), so here this kernel
  computes dK and dV only (four products per tile pair), and dq.py's kernel computes dQ as the
  forward computes O (three products, no atomics); the writer warp idles;
- dK is retired at the end of each tile: left in flight into the next tile's S^T/dP^T, ptxas
  serialized every wgmma (C7515), and the three loops of the masked variant spilled 65-91
  registers per tile, so every masked launch runs one masked loop.

Up to head_dim 128, dQ tiles from different key tiles meet in the reduce-adds, so dQ's float32
summation order varies between runs; under ``torch.use_deterministic_algorithms(True)`` the
Triton kernels run.

Measured on an H200 (docs/performance.md; history in docs/experiments.md): exact like the Triton
kernels against float64; at head_dim 128 its backward runs 0.90-0.98x cuDNN's and 1.18-1.34x
the Triton kernels' (causal or not, MHA and GQA 32/8), with 64 x 128 tiles.

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
Gluon names that changed between Triton releases come from gluon_api.py.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from ..launcher import bound_launch, launch, launch_or_bind
from ..positions import MaskBounds
from ..problem import AttentionProblem
from ..tiling import packed_tile, tile_grid
from .block_lists import BlockLists, bits_visible_t, block_list, block_lists, tile_bits
from .dispatch import ALIBI_POSITION_LIMIT, POSITION_LIMIT, run_head_dim
from .gluon_api import WGMMA_COPIES_A, async_copy, reinterpret, tma
from .infini_updates import matrix_descriptor, updates_backward_dk, updates_backward_dv
from .named_barriers import FIRST_ID
from .named_barriers import arrive as named_arrive
from .named_barriers import sync as named_sync
from .scores import score_scales, tanh_approx
from .spans import count_at_or_before, first_at_or_after, query_span
from .tma import load_tile, reduce_add_tile, rows_descriptor, tile_layout, tma_layout_ok

# head_dim -> (query rows per tile, key rows per program)
TILES = {64: (64, 128), 128: (64, 128), 256: (64, 64)}
NUM_WARPS = 8  # compute warps; the two workers add one warp each
# At entry; warp specialization pads the two 1-warp workers to a warpgroup and redistributes:
# 8 x 32 x 240 + 4 x 32 x 24 = 12 warps x 32 x 168, the 64K register file.
MAX_REGISTERS = 168
WORKER_REGS = gl.constexpr(24)
# Hand-overs from the compute warps to a worker, one per ring slot s: Q/dO stage s back to the
# loader, dQ buffer s to the writer. At head_dim 64 by named barriers (named_barriers.py: the
# compute warps arrive without waiting, the worker syncs; QDO_FREE + s, DQ_FULL + s), elsewhere by
# mbarriers (qdo_empty, dq_ready: a bar.sync of the eight compute warps before each arrive).
# Named, the backward measured 1-5% faster at 64 and 0-4% slower at 128 on an H100
# (docs/experiments.md §35).
QDO_FREE = gl.constexpr(FIRST_ID)
DQ_FULL = gl.constexpr(FIRST_ID + 2)
HANDOFF_THREADS = gl.constexpr(NUM_WARPS * 32 + 32)


@aggregate
class Shared:
    """What the partitions share: descriptors, shared-memory rings (``rows_smem``: each Q/dO
    stage's LSE and delta rows, at 2 * stage and 2 * stage + 1) and their mbarriers (at head_dim
    64 the hand-overs back to the workers go by named barriers instead: QDO_FREE, DQ_FULL), and the
    program's coordinates in the descriptors' (rows, heads * head_dim) views: each tensor's
    first row of this sequence (``*_row0``), the key tile's first row ``n0`` in its sequence,
    the first visible query row ``lo``, the query-tile count per head ``n_tiles``, the sequence's
    query length ``len_q``, the group's first query head ``q_head``, the KV head ``k_head`` and
    the tensors' head_dim ``tensor_dim`` (below the build's where it lies between two builds)."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    do_desc: tma.tensor_descriptor
    dq_desc: tma.tensor_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    rows_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    p_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    qdo_ready: gl.shared_memory_descriptor
    qdo_empty: gl.shared_memory_descriptor
    dq_ready: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor
    q_row0: gl.tensor
    do_row0: gl.tensor
    dq_row0: gl.tensor
    k_row: gl.tensor
    v_row: gl.tensor
    n0: gl.tensor
    lo: gl.tensor
    q_head: gl.tensor
    k_head: gl.tensor
    n_tiles: gl.tensor
    len_q: gl.tensor
    tensor_dim: gl.constexpr

    @gluon.constexpr_function
    def __init__(
        self, q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, rows_smem, ds_smem,
        p_smem, dq_smem, kv_bar, qdo_ready, qdo_empty, dq_ready, dq_empty, q_row0, do_row0, dq_row0, k_row,
        v_row, n0, lo, q_head, k_head, n_tiles, len_q, tensor_dim,
    ):  # fmt: skip
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.do_desc = do_desc
        self.dq_desc = dq_desc
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.q_smem = q_smem
        self.do_smem = do_smem
        self.rows_smem = rows_smem
        self.ds_smem = ds_smem
        self.p_smem = p_smem
        self.dq_smem = dq_smem
        self.kv_bar = kv_bar
        self.qdo_ready = qdo_ready
        self.qdo_empty = qdo_empty
        self.dq_ready = dq_ready
        self.dq_empty = dq_empty
        self.q_row0 = q_row0
        self.do_row0 = do_row0
        self.dq_row0 = dq_row0
        self.k_row = k_row
        self.v_row = v_row
        self.n0 = n0
        self.lo = lo
        self.q_head = q_head
        self.k_head = k_head
        self.n_tiles = n_tiles
        self.len_q = len_q
        self.tensor_dim = gl.constexpr(tensor_dim)


@aggregate
class Mask:
    """What the compute warps need to mask a tile: the sequence's query length and its keys' from
    the key tile's first, the window's bounds and both sides' positions (start + stride * index,
    int32; keys indexed from the tile's first)."""

    len_q: gl.tensor
    len_k: gl.tensor
    left: gl.tensor
    right: gl.tensor
    q_start: gl.tensor
    q_stride: gl.tensor
    k_start: gl.tensor
    k_stride: gl.tensor

    @gluon.constexpr_function
    def __init__(self, len_q, len_k, left, right, q_start, q_stride, k_start, k_stride):
        self.len_q = len_q
        self.len_k = len_k
        self.left = left
        self.right = right
        self.q_start = q_start
        self.q_stride = q_stride
        self.k_start = k_start
        self.k_stride = k_stride


@gluon.constexpr_function
def _named_handoff(head_dim) -> bool:
    """Whether the hand-overs to the workers go by named barriers (see QDO_FREE)."""
    return head_dim == 64


@gluon.constexpr_function
def _dk_retired_before_dpt(head_dim) -> bool:
    """Whether the compute warps retire the previous tile's dK before they issue dP^T (S^T in
    flight) rather than after: at head_dim 64, where S^T and dP^T take K and V from registers, if
    the wgmma lowering copies such operands (``gluon_api.WGMMA_COPIES_A``, Triton 3.9). With V's
    copy made while dK and S^T were in flight, and dS^T's for dK while dV and dQ were, ptxas 13.4
    serialized all 24 wgmma of the build (C7513); with dK retired before V's copy, none (sm_90
    builds, 2026-11-28; as little with dV retired before dS^T's copy, at one wait more)."""
    return head_dim == 64 and WGMMA_COPIES_A.value


@gluon.jit
def _await_stage(p: Shared, i, HEAD_DIM: gl.constexpr):
    """The loader, before loading tile i into Q/dO stage i % 2: tile i - 2 has released it."""
    s = i % 2
    if _named_handoff(HEAD_DIM):
        if i >= 2:
            named_sync(QDO_FREE + s, HANDOFF_THREADS)
    else:  # mbarriers start in phase 1 complete: the first wait on each empty slot passes
        mbarrier.wait(p.qdo_empty.index(s), ((i // 2) & 1) ^ 1)


@gluon.jit
def _release_stage(p: Shared, i, n_total, HEAD_DIM: gl.constexpr):
    """The compute warps at tile i of n_total: tile i - 1's stage back to the loader, where it
    loads another tile into it. A named barrier's next arrive for the same stage (two tiles on)
    needs a tile that the loader loads only after its sync on this one, so no warp arrives twice
    before the barrier completes."""
    s = i % 2
    if _named_handoff(HEAD_DIM):
        named_arrive(QDO_FREE + 1 - s, HANDOFF_THREADS, (i > 0) & (i + 1 < n_total))
    elif i > 0:
        mbarrier.arrive(p.qdo_empty.index(1 - s), count=1)


@gluon.jit
def _hand_dq(p: Shared, i, HEAD_DIM: gl.constexpr):
    """The compute warps: tile i's dQ stored in buffer i % 2 (and fenced for TMA), to the writer.
    The buffer comes back (dq_empty) only after the writer's sync on this hand-over, so a named
    barrier's next arrive for it follows that sync."""
    s = i % 2
    if _named_handoff(HEAD_DIM):
        named_arrive(DQ_FULL + s, HANDOFF_THREADS, i >= 0)
    else:
        mbarrier.arrive(p.dq_ready.index(s), count=1)


@gluon.jit
def _await_dq(p: Shared, i, HEAD_DIM: gl.constexpr):
    """The writer, before adding tile i's dQ (buffer i % 2) into the dQ buffer."""
    if _named_handoff(HEAD_DIM):
        named_sync(DQ_FULL + i % 2, HANDOFF_THREADS)
    else:
        mbarrier.wait(p.dq_ready.index(i % 2), (i // 2) & 1)


@gluon.jit
def _load_stage(
    p: Shared, i, m0, g, lse_ptr, delta_ptr, stride_lh, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
    MASKED: gl.constexpr,
):  # fmt: skip
    """Query rows m0.. of the group's query head g (Q, dO, their LSE and delta rows) into Q/dO
    stage i % 2, once tile i - 2 has released it."""
    rows_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    tile_bytes: gl.constexpr = 2 * p.q_desc.block_type.nbytes
    s = i % 2
    _await_stage(p, i, HEAD_DIM)
    bar = p.qdo_ready.index(s)
    # Loaded by the compute warps, these rows sat on their critical path (1-11% of the
    # backward on an H200); staged here, they arrive with the tile. Each lane's async arrive
    # adds itself to the barrier's count; issued before the expect, it keeps the phase open
    # until its copies land.
    offs = m0 + gl.arange(0, BLOCK_M, layout=rows_layout)
    rows = g * stride_lh + offs
    if MASKED:  # rows past the sequence: not read (zero-filled; their P is masked to 0)
        ok = offs < p.len_q
        async_copy.async_copy_global_to_shared(p.rows_smem.index(2 * s), lse_ptr + rows, mask=ok)
        async_copy.async_copy_global_to_shared(p.rows_smem.index(2 * s + 1), delta_ptr + rows, mask=ok)
    else:
        async_copy.async_copy_global_to_shared(p.rows_smem.index(2 * s), lse_ptr + rows)
        async_copy.async_copy_global_to_shared(p.rows_smem.index(2 * s + 1), delta_ptr + rows)
    async_copy.mbarrier_arrive(bar)
    mbarrier.expect(bar, tile_bytes)
    load_tile(p.q_desc, p.q_row0 + m0, p.q_head + g, bar, p.q_smem.index(s))
    load_tile(p.do_desc, p.do_row0 + m0, p.q_head + g, bar, p.do_smem.index(s))


@gluon.jit
def _group_step(
    bl: BlockLists, b, h0, kb, t, FULL: gl.constexpr, GROUP: gl.constexpr, TILES_PER_BLOCK: gl.constexpr
):  # fmt: skip
    """Step t of a program's walk over its group's partial blocks (query heads h0.. in turn, each
    head's list for key block kb of sequence b), or under FULL over their full ones: (the head's
    offset g in the group, the step's place in that head's list in query tiles, pointers to the
    list's block numbers and kinds). Each step finds its head from the group's counts (GROUP
    cached loads) instead of a loop per head: with GQA, loops per head made ptxas serialize
    every wgmma."""
    g = t * 0
    local = t
    seen = t * 0
    for j in gl.static_range(GROUP):
        n_partial, n_blocks, blocks, kinds = block_list(bl, b, h0 + j, kb)
        if FULL:
            n = TILES_PER_BLOCK * (n_blocks - n_partial)
            skip = TILES_PER_BLOCK * n_partial
        else:
            n = TILES_PER_BLOCK * n_partial
            skip = n * 0
        here = (t >= seen) & (t < seen + n)
        g = gl.where(here, j, g)
        local = gl.where(here, t - seen + skip, local)
        seen += n
    n_partial, n_blocks, blocks, kinds = block_list(bl, b, h0 + g, kb)
    return g, local, blocks, kinds


@gluon.jit
def _listed_tile(blocks, t, TILES_PER_BLOCK: gl.constexpr):
    """The query tile (in tiles from the sequence's first row) of step t of a listed walk."""
    return gl.load(blocks + t // TILES_PER_BLOCK) * TILES_PER_BLOCK + t % TILES_PER_BLOCK


@gluon.jit
def _load_partition(
    p: Shared,
    bl: BlockLists,
    b,
    kb,
    n_masked,
    lse_ptr,
    delta_ptr,
    stride_lh,
    GROUP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    MASKED: gl.constexpr,
    SPARSE: gl.constexpr,
    TILES_PER_BLOCK: gl.constexpr,
):
    mbarrier.expect(p.kv_bar, 2 * p.k_desc.block_type.nbytes)
    load_tile(p.k_desc, p.k_row, p.k_head, p.kv_bar, p.k_smem)
    load_tile(p.v_desc, p.v_row, p.k_head, p.kv_bar, p.v_smem)
    if SPARSE:  # the group's partial blocks, then its full ones (_group_step), TILES_PER_BLOCK tiles each
        for t in range(n_masked):
            g, local, blocks, kinds = _group_step(bl, b, p.q_head, kb, t, False, GROUP, TILES_PER_BLOCK)
            m0 = _listed_tile(blocks, local, TILES_PER_BLOCK) * BLOCK_M
            _load_stage(p, t, m0, g, lse_ptr, delta_ptr, stride_lh, BLOCK_M, HEAD_DIM, True)
        for t in range(p.n_tiles - n_masked):
            g, local, blocks, kinds = _group_step(bl, b, p.q_head, kb, t, True, GROUP, TILES_PER_BLOCK)
            m0 = _listed_tile(blocks, local, TILES_PER_BLOCK) * BLOCK_M
            _load_stage(p, n_masked + t, m0, g, lse_ptr, delta_ptr, stride_lh, BLOCK_M, HEAD_DIM, True)
    else:
        for i in range(GROUP * p.n_tiles):
            m0 = p.lo + (i % p.n_tiles) * BLOCK_M
            _load_stage(p, i, m0, i // p.n_tiles, lse_ptr, delta_ptr, stride_lh, BLOCK_M, HEAD_DIM, MASKED)


@gluon.jit
def _add_dq(p: Shared, i, m0, g, HEAD_DIM: gl.constexpr):
    """The writer: tile i's dQ (rows m0.. of query head g) added into the dQ buffer by TMA."""
    j = i % 2
    _await_dq(p, i, HEAD_DIM)
    reduce_add_tile(p.dq_desc, p.dq_row0 + m0, p.q_head + g, p.dq_smem.index(j))
    tma.store_wait(1)  # the previous tile's reduce has read its buffer
    mbarrier.arrive(p.dq_empty.index(1 - j), count=1, pred=i > 0)


@gluon.jit
def _dq_partition(
    p: Shared, bl: BlockLists, b, kb, n_masked, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr, DKDV_ONLY: gl.constexpr, SPARSE: gl.constexpr, TILES_PER_BLOCK: gl.constexpr,
):  # fmt: skip
    # Rows of a tile past the sequence get exact zeros (their dS is 0): harmless to the next
    # sequence's rows, and clipped past the tensor's end. Under DKDV_ONLY (dQ by dq.py's kernel)
    # this warp idles.
    if SPARSE:
        for t in range(n_masked):
            g, local, blocks, kinds = _group_step(bl, b, p.q_head, kb, t, False, GROUP, TILES_PER_BLOCK)
            _add_dq(p, t, _listed_tile(blocks, local, TILES_PER_BLOCK) * BLOCK_M, g, HEAD_DIM)
        for t in range(p.n_tiles - n_masked):
            g, local, blocks, kinds = _group_step(bl, b, p.q_head, kb, t, True, GROUP, TILES_PER_BLOCK)
            _add_dq(p, n_masked + t, _listed_tile(blocks, local, TILES_PER_BLOCK) * BLOCK_M, g, HEAD_DIM)
        tma.store_wait(0)
    elif not DKDV_ONLY:
        for i in range(GROUP * p.n_tiles):
            _add_dq(p, i, p.lo + (i % p.n_tiles) * BLOCK_M, i // p.n_tiles, HEAD_DIM)
        tma.store_wait(0)


@gluon.jit
def _alibi_bias_t(alibi2, k_pos, offs_m, q_start, q_stride):
    """ALiBi's log2-domain bias over an S^T tile, -alibi2 * |pk - pq|: k_pos the key rows'
    positions (float32), offs_m the query columns' indices (positions q_start + offs_m * q_stride),
    exact in float32 (the gate keeps positions below 2^22). Query positions come from this tile's
    indices: offsets taken from outside the tile loop were hoisted by the compiler as per-score
    differences and spilled (24-33 registers per tile)."""
    q_pos = (q_start + offs_m * q_stride).to(gl.float32)
    return -alibi2 * gl.abs(k_pos[:, None] - q_pos[None, :])


@gluon.jit
def _visible_t(mk: Mask, offs_n, offs_m, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """[keys, queries] visibility of an S^T tile: both rows inside their sequences, and pk - pq =
    (k_stride * n - q_stride * m) - (q_start - k_start) inside [-left, right]. Written as that
    difference, no int32 sum overflows (both products are non-negative, positions and bounds
    below POSITION_LIMIT), and with unit strides (constants at launch) each compare folds into
    one of the tile's offset against an immediate, as an index mask does: 546-552 SASS
    instructions per tile with a causal tail or window, none spilled, where comparing positions
    took 591-656 and spilled 5-8 registers."""
    vis = (offs_n < mk.len_k)[:, None] & (offs_m < mk.len_q)[None, :]
    rel = (mk.k_stride * offs_n)[:, None] - (mk.q_stride * offs_m)[None, :]
    d = mk.q_start - mk.k_start
    if HAS_RIGHT:
        vis = vis & (rel <= d + mk.right)
    if HAS_LEFT:
        vis = vis & (rel >= d - mk.left)
    return vis


@gluon.jit
def _compute_tile(
    p: Shared, k_op, v_op, mk: Mask, i, t, g, n_total, dk, dv, st_zero, dq_zero, offs_n, qk_scale, tanh_scale,
    softmax_scale, alibi2, k_pos, a_layout: gl.constexpr, qcol_layout: gl.constexpr, BLOCK_M: gl.constexpr,
    DIAGONAL: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, SPLIT_N: gl.constexpr, DKDV_ONLY: gl.constexpr,
    HEAD_DIM: gl.constexpr, bits=0, BITS_MASKED: gl.constexpr = False,
):  # fmt: skip
    """Query tile t of the group's query head g (ring slot i of n_total): dV and dK added to
    dv/dk (dK left in flight), its dQ tile handed to the writer; under DKDV_ONLY no dQ, and dK
    retired. Under SPLIT_N the two warpgroups hold halves of the columns (queries of S^T,
    head_dim of dK/dV), so P^T and dS^T reach the dV and dK products from shared memory
    (p_smem, ds_smem) rather than from registers. Under SOFTCAP the scores are tanh(S^T *
    tanh_scale) (``score_scales``) and dS^T takes the factor 1 - tanh^2; under HAS_ALIBI the
    logits get ALiBi's bias (``_alibi_bias_t``). Under MASKED, P^T = 0 where a pair is not
    visible, set after the exp, so that the LSE of rows past a sequence (never loaded) cannot
    reach it. Under BITS_MASKED (a block mask's partial block, block_lists.py) likewise where the
    block's ``bits`` (``tile_bits``) hide the pair."""
    dtype: gl.constexpr = p.q_desc.dtype
    s = i % 2
    m0 = p.lo + t * BLOCK_M
    mbarrier.wait(p.qdo_ready.index(s), (i // 2) & 1)
    q_s = p.q_smem.index(s)
    do_s = p.do_smem.index(s)
    st = warpgroup_mma(k_op, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    if _dk_retired_before_dpt(HEAD_DIM):  # in flight, oldest first: the previous tile's dK, S^T
        dk = warpgroup_mma_init(warpgroup_mma_wait(1, deps=(dk,)))
    dpt = warpgroup_mma(v_op, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    if not _dk_retired_before_dpt(HEAD_DIM):
        # In flight, oldest first: the previous tile's dK, S^T, dP^T.
        dk = warpgroup_mma_init(warpgroup_mma_wait(2, deps=(dk,)))
    _release_stage(p, i, n_total, HEAD_DIM)  # the previous tile's dK product has read its Q stage
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=qcol_layout)
    lse2 = p.rows_smem.index(2 * s).load(qcol_layout) * 1.4426950408889634
    delta = p.rows_smem.index(2 * s + 1).load(qcol_layout)
    s_t = warpgroup_mma_wait(1, deps=(st,))
    if SOFTCAP:
        # Across the dP^T wait, P^T only in dtype (for dV) and P^T * softmax_scale * (1 - tanh^2)
        # (for dS^T): P^T and that factor both in float32 there spilled 32 registers per tile.
        t = tanh_approx(s_t * tanh_scale)
        if HAS_ALIBI:
            bias = _alibi_bias_t(alibi2, k_pos, offs_m, mk.q_start, mk.q_stride) - lse2[None, :]
            pt = gl.exp2(t * qk_scale + bias)
        else:
            pt = gl.exp2(t * qk_scale - lse2[None, :])
    else:
        if DIAGONAL:  # a no-op past the first BLOCK_N // BLOCK_M tiles, kept there for one tile loop
            s_t = gl.where(offs_n[:, None] <= offs_m[None, :], s_t, -float("inf"))
        if HAS_ALIBI:
            bias = _alibi_bias_t(alibi2, k_pos, offs_m, mk.q_start, mk.q_stride)
            pt = gl.exp2(s_t * qk_scale + bias - lse2[None, :])
        else:
            pt = gl.exp2(s_t * qk_scale - lse2[None, :])
    if MASKED:  # on every tile: behind a runtime branch, ptxas serialized every wgmma
        pt = gl.where(_visible_t(mk, offs_n, offs_m, HAS_LEFT, HAS_RIGHT), pt, 0.0)
    if BITS_MASKED:
        words: gl.constexpr = offs_n.shape[0] // 32
        pt = gl.where(bits_visible_t(bits, offs_n, offs_m - m0, words), pt, 0.0)
    if DIAGONAL and SOFTCAP:
        pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
    if SOFTCAP:
        pv = pt.to(dtype)
        pt = pt * (softmax_scale - (softmax_scale * t) * t)
    else:
        pv = pt
    if SPLIT_N:
        p.p_smem.store(pv.to(dtype))
        fence_async_shared()
    dp_t = warpgroup_mma_wait(0, deps=(dpt,))
    if SPLIT_N:
        dv = warpgroup_mma(p.p_smem, do_s, dv, is_async=True)
    else:
        dv = warpgroup_mma(gl.convert_layout(pv.to(dtype), a_layout), do_s, dv, is_async=True)
    if SOFTCAP:
        dst16 = (pt * (dp_t - delta[None, :])).to(dtype)
    else:
        dst16 = (pt * (dp_t - delta[None, :]) * softmax_scale).to(dtype)
    p.ds_smem.store(dst16)
    fence_async_shared()
    if not DKDV_ONLY:
        mbarrier.wait(p.dq_empty.index(s), ((i // 2) & 1) ^ 1)
        # wgmma groups retire in issue order: dK goes after dQ so that it can stay in flight.
        dq = warpgroup_mma(p.ds_smem.permute((1, 0)), p.k_smem, dq_zero, use_acc=False, is_async=True)
    if SPLIT_N:
        dk = warpgroup_mma(p.ds_smem, q_s, dk, is_async=True)
    else:
        dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_s, dk, is_async=True)
    if DKDV_ONLY:
        # dK retired here: left in flight into the next tile's S^T/dP^T at head_dim 256, it made
        # ptxas serialize every wgmma (C7515).
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        dk = warpgroup_mma_init(dk)
    else:
        dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))
        p.dq_smem.index(s).store(dq)
        fence_async_shared()
        _hand_dq(p, i, HEAD_DIM)
    return dk, dv


@gluon.jit
def _compute_partition(
    p: Shared, mk: Mask, bl: BlockLists, b, kb, t_full_lo, t_full_hi, qk_scale, tanh_scale, softmax_scale,
    alibi_ptr,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    DIAGONAL: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, SPLIT_N: gl.constexpr, DKDV_ONLY: gl.constexpr,
    SPARSE: gl.constexpr, TILES_PER_BLOCK: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    # Key rows split between the warpgroups, or (SPLIT_N: a key tile of one wgmma's 64 rows)
    # the columns: queries of S^T/dP^T, head_dim of dK/dV.
    col_groups: gl.constexpr = num_warps // 4 if SPLIT_N else 1
    # At head_dim 64 K and V (16 registers each) are the A operands of S^T and dP^T from registers:
    # read from shared memory by every tile's products, they were 15% of its shared-memory
    # traffic, which binds more at 64 than at 128 (dS^T's reads do not shrink with head_dim).
    KV_IN_REGS: gl.constexpr = HEAD_DIM == 64 and not SPLIT_N
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps // col_groups, col_groups],
        instr_shape=[16, BLOCK_M // col_groups, 16],
    )  # fmt: skip
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps // col_groups, col_groups],
        instr_shape=[16, HEAD_DIM // col_groups, 16],
    )  # fmt: skip
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4], instr_shape=[16, HEAD_DIM // (num_warps // 4), 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    qcol_layout: gl.constexpr = gl.SliceLayout(0, st_layout)

    # dK is carried through the loops as an in-flight product (see _compute_tile).
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # from the tile's first key
    if HAS_ALIBI:
        k_pos = (mk.k_start + offs_n * mk.k_stride).to(gl.float32)
    else:
        k_pos = 0.0
        alibi2 = 0.0
    if DIAGONAL:  # an index mask: the keys' rows in the sequence
        offs_n += p.n0
    # One tile loop, masked tiles inside it behind a runtime branch: with the diagonal tiles in a
    # loop of their own, dK in flight from one loop into the next made ptxas serialize every
    # wgmma (silently, no C7512 in its log): 64 of 64 HGMMAs waited on the previous one.
    mbarrier.wait(p.kv_bar, 0)
    if KV_IN_REGS:
        k_op = p.k_smem.load(gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2))
        v_op = p.v_smem.load(gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2))
    else:
        k_op = p.k_smem
        v_op = p.v_smem
    # A block mask's walk: the group's partial blocks (each head's in turn), masked by their bits,
    # then its full ones: two loops in all. A pair of loops per head serialized every wgmma of the
    # GQA builds (Triton 3.6 and 3.8, offline sm_90 builds); one loop masking each tile if it is
    # partial spilled 20-28 registers per tile and ran slower (docs/experiments.md §65).
    if SPARSE:  # t_full_lo: the group's tiles of partial blocks (_group_step)
        for t in range(t_full_lo):
            g, local, blocks, kinds = _group_step(bl, b, p.q_head, kb, t, False, GROUP, TILES_PER_BLOCK)
            if HAS_ALIBI:
                alibi2 = gl.load(alibi_ptr + g) * 1.4426950408889634
            bits = tile_bits(bl, kinds, local, TILES_PER_BLOCK, BLOCK_M, BLOCK_N // 32)
            dk, dv = _compute_tile(
                p, k_op, v_op, mk, t, _listed_tile(blocks, local, TILES_PER_BLOCK), g, p.n_tiles, dk, dv,
                st_zero, dq_zero, offs_n, qk_scale, tanh_scale, softmax_scale, alibi2, k_pos, a_layout,
                qcol_layout, BLOCK_M, False, False, False, False, SOFTCAP, HAS_ALIBI, SPLIT_N, DKDV_ONLY,
                HEAD_DIM, bits, True,
            )  # fmt: skip
        dk = warpgroup_mma_init(warpgroup_mma_wait(0, deps=(dk,)))  # between loops, as below
        for t in range(p.n_tiles - t_full_lo):
            g, local, blocks, kinds = _group_step(bl, b, p.q_head, kb, t, True, GROUP, TILES_PER_BLOCK)
            if HAS_ALIBI:
                alibi2 = gl.load(alibi_ptr + g) * 1.4426950408889634
            dk, dv = _compute_tile(
                p, k_op, v_op, mk, t_full_lo + t, _listed_tile(blocks, local, TILES_PER_BLOCK), g, p.n_tiles,
                dk, dv, st_zero, dq_zero, offs_n, qk_scale, tanh_scale, softmax_scale, alibi2, k_pos,
                a_layout, qcol_layout, BLOCK_M, False, False, False, False, SOFTCAP, HAS_ALIBI, SPLIT_N,
                DKDV_ONLY, HEAD_DIM,
            )  # fmt: skip
    else:
        n_total = GROUP * p.n_tiles
        for g in range(GROUP):
            base = g * p.n_tiles
            if HAS_ALIBI:  # query head g's slope (slopes (batch, heads_q), contiguous)
                alibi2 = gl.load(alibi_ptr + g) * 1.4426950408889634
            # Masked, unmasked middle, masked; at head_dim 256 (DKDV_ONLY) the three loops spilled
            # 65-91 registers per tile where one masked loop spills none.
            if MASKED and GROUP == 1 and not (SOFTCAP or HAS_ALIBI or DKDV_ONLY):
                for t in range(t_full_lo):
                    dk, dv = _compute_tile(
                        p, k_op, v_op, mk, base + t, t, g, n_total, dk, dv, st_zero, dq_zero, offs_n,
                        qk_scale, tanh_scale, softmax_scale, alibi2, k_pos, a_layout, qcol_layout, BLOCK_M,
                        False, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, SPLIT_N, DKDV_ONLY, HEAD_DIM,
                    )  # fmt: skip
                # dK retired between the loops: in flight from one loop into the next, ptxas
                # serializes every wgmma at head_dim 128 (see above).
                dk = warpgroup_mma_init(warpgroup_mma_wait(0, deps=(dk,)))
                for t in range(t_full_lo, t_full_hi):
                    dk, dv = _compute_tile(
                        p, k_op, v_op, mk, base + t, t, g, n_total, dk, dv, st_zero, dq_zero, offs_n,
                        qk_scale, tanh_scale, softmax_scale, alibi2, k_pos, a_layout, qcol_layout, BLOCK_M,
                        False, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, SPLIT_N, DKDV_ONLY, HEAD_DIM,
                    )  # fmt: skip
                dk = warpgroup_mma_init(warpgroup_mma_wait(0, deps=(dk,)))
                for t in range(t_full_hi, p.n_tiles):
                    dk, dv = _compute_tile(
                        p, k_op, v_op, mk, base + t, t, g, n_total, dk, dv, st_zero, dq_zero, offs_n,
                        qk_scale, tanh_scale, softmax_scale, alibi2, k_pos, a_layout, qcol_layout, BLOCK_M,
                        False, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, SPLIT_N, DKDV_ONLY, HEAD_DIM,
                    )  # fmt: skip
            else:  # with GQA, a softcap or ALiBi three loops serialized every wgmma: one, masked if MASKED
                for t in range(p.n_tiles):
                    dk, dv = _compute_tile(
                        p, k_op, v_op, mk, base + t, t, g, n_total, dk, dv, st_zero, dq_zero, offs_n,
                        qk_scale, tanh_scale, softmax_scale, alibi2, k_pos, a_layout, qcol_layout, BLOCK_M,
                        DIAGONAL, MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, SPLIT_N, DKDV_ONLY,
                        HEAD_DIM,
                    )  # fmt: skip
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    return dk, dv


@gluon.jit
def _store_grad(ptr, value, offs, mask, ACCUMULATE: gl.constexpr):
    if ACCUMULATE:
        value += gl.load(ptr + offs, mask=mask).to(gl.float32)
    gl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=mask)


# packed_docs changes with every packed batch: a constant or alignment hint of it would recompile.
@gluon.jit(do_not_specialize=["packed_docs"])
def _fused_bwd_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, gdm_desc, s_desc, dk_desc, dv_desc, DK, DV, LSE, DELTA, CU_Q,
    CU_K, ALIBI, GDZ, ZB, COUNT, INDEX, KIND, BITS, ORDER, stride_cb, stride_ch, stride_ib, stride_ih,
    stride_im,
    seqlen_q, seqlen_k, packed_docs, q_batch_rows, do_batch_rows, dq_batch_rows,
    k_batch_rows, v_batch_rows, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    qk_scale, tanh_scale, softmax_scale, q_start0, q_stride, k_start0, k_stride, q_per_len, k_per_len,
    win_left, win_right,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    TENSOR_DIM: gl.constexpr, VARLEN: gl.constexpr, DIAGONAL: gl.constexpr, MASKED: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
    ACCUMULATE: gl.constexpr, MEMORY: gl.constexpr, GRAM: gl.constexpr, SPARSE: gl.constexpr,
    MASK_Q: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """One program per (key tile, KV head, sequence), or with ``packed_docs`` > 0 per (slot of the
    packed batch's key tiles, KV head) (``tiling.tile_grid``). Unless MASKED, every length is a
    multiple of its tile and every pair visible, or under DIAGONAL a key at index n visible to a
    query at index m iff n <= m (causal, equal positions on both sides). VARLEN: sequence b's
    rows start at CU_Q[b] / CU_K[b] of one packed batch (then *_batch_rows and stride_dkb/dvb/lb
    are 0); per_len folds each sequence's length into its positions' start (positions.py). Past
    head_dim 128 (DKDV_ONLY) it computes dK and dV only, and dq_desc is not read. MEMORY
    (Infini-attention's local attention, head_dim 128, VARLEN: sequence b is segment b of a
    batch row): the memory updates' backward of the key tile is added into dK and dV,
    from gdM (gdm_desc: (segments * kv_heads * 128, 128) rows) and gdz (GDZ) of state
    b * kv_heads + kv head (``infini_updates.updates_backward_dv`` and ``_dk``); GRAM (the delta rule)
    with the Gram matrices' terms, from S = dA + dA^T (s_desc) and z before the segment (ZB);
    dK and dV of a whole key tile are then stored by TMA (dk_desc, dv_desc), else row by row from
    shared memory; without MEMORY from registers. SPARSE (block-sparse attention, not VARLEN,
    not MASKED): key tile pid_n is key block pid_n of a block mask (block_lists.py: COUNT, INDEX,
    KIND, BITS and the lists' strides, ``tile_mask.TileMask``'s per-key-block lists), whose
    listed query blocks (MASK_Q rows: MASK_Q // BLOCK_M query tiles each) it walks for each query
    head of the group, the partial ones masked by their bits; ORDER: ``TileMask.q_order``, by
    which the programs take the long lists' key blocks first, each block's for every KV head,
    then each head's of the other blocks; else they stand in, unread."""
    # A key tile of 64 rows, one wgmma's M: the warpgroups split columns instead (_compute_tile).
    SPLIT_N: gl.constexpr = BLOCK_N < 16 * num_warps
    # Past head_dim 128 the float32 dQ ring (2 x 64 x 256 x 4 bytes) leaves no room for two
    # Q/dO stages: dQ comes from dq.py's kernel instead (atomic adds from here took half the time).
    DKDV_ONLY: gl.constexpr = HEAD_DIM > 128
    pid_n = gl.program_id(0)
    hk = gl.program_id(1)
    b = gl.program_id(2)
    if SPARSE:  # the programs in launch order: the long lists' first (TileMask.q_order)
        heads = gl.num_programs(1)
        launched = pid_n + gl.num_programs(0) * hk
        n_long = gl.load(ORDER + gl.num_programs(0))
        rest = launched - n_long * heads
        n_rest = gl.maximum(gl.num_programs(0) - n_long, 1)
        hk = gl.where(rest < 0, launched % heads, rest // n_rest)
        pid_n = gl.load(ORDER + gl.where(rest < 0, launched // heads, n_long + rest % n_rest))
    if VARLEN:
        if packed_docs > 0:  # program ids: a slot of the packed batch's key tiles, key head
            b, pid_n = packed_tile(pid_n, CU_K, packed_docs, BLOCK_N)
    n0 = pid_n * BLOCK_N
    if VARLEN:
        q0 = gl.load(CU_Q + b)
        len_q = gl.load(CU_Q + b + 1) - q0
        k0 = gl.load(CU_K + b)
        len_k = gl.load(CU_K + b + 1) - k0
    else:
        q0 = b * 0
        len_q = seqlen_q + q0
        k0 = q0
        len_k = seqlen_k + q0
    bl = block_lists(COUNT, INDEX, KIND, BITS, stride_cb, stride_ch, stride_ib, stride_ih, stride_im)
    TILES_PER_BLOCK: gl.constexpr = MASK_Q // BLOCK_M
    dtype: gl.constexpr = q_desc.dtype
    ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], tile_layout(k_desc.layout))
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], tile_layout(v_desc.layout))
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], tile_layout(q_desc.layout))
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], tile_layout(do_desc.layout))
    rows_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_smem_layout)
    # Buffers a variant does not use stand in for ones it does not allocate.
    if SPLIT_N:
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_smem_layout)
    else:
        p_smem = ds_smem
    if DKDV_ONLY:
        dq_smem = rows_smem
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], tile_layout(dq_desc.layout))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(qdo_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=1)
        mbarrier.init(dq_ready.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)

    # per_len: offsets that scale with each sequence's length (positions.py). New names, not
    # reassigned arguments: Triton specializes an argument equal to 1 as a constant.
    q_start = q_start0 + q_per_len * len_q
    zero = len_q * 0  # arguments that arrive as the constant 1 made scalars for the aggregate
    k_start = k_start0 + k_per_len * len_k
    if MASKED:
        key_lo = k_start + k_stride * n0
        key_hi = k_start + k_stride * (gl.minimum(n0 + BLOCK_N, len_k) - 1)
        lo, hi = query_span(
            key_lo, key_hi, q_start, q_stride, len_q, win_left, win_right, HAS_LEFT, HAS_RIGHT, BLOCK_M
        )
        # Programs past their sequence's keys walk nothing and store nothing. Every partition
        # takes its trip counts from n_tiles; with none, dK/dV of the key tile are stored as 0.
        n_tiles = gl.where(n0 < len_k, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
        # The query tiles in which every pair is visible run unmasked: rows from full_lo up to
        # full_hi see every key of a whole key tile.
        full_lo = len_q * 0
        full_hi = len_q
        if HAS_RIGHT:
            full_lo = first_at_or_after(key_hi - win_right, q_start, q_stride)
        if HAS_LEFT:
            full_hi = gl.minimum(count_at_or_before(key_lo + win_left, q_start, q_stride), len_q)
        t_full_lo = gl.minimum((gl.maximum(full_lo - lo, 0) + BLOCK_M - 1) // BLOCK_M, n_tiles)
        t_full_hi = gl.minimum(gl.maximum(full_hi - lo, 0) // BLOCK_M, n_tiles)
        none_full = (n0 + BLOCK_N > len_k) | (t_full_hi <= t_full_lo)
        t_full_lo = gl.where(none_full, n_tiles, t_full_lo)
        t_full_hi = gl.where(none_full, n_tiles, t_full_hi)
    elif SPARSE:  # every head's listed tiles (n_tiles: all of them; the walks read the lists again)
        lo = len_q * 0
        n_tiles = lo
        t_full_lo = lo  # here: the tiles of partial blocks, which the walks take first
        for g in range(GROUP):
            n_partial, n_blocks, blocks, kinds = block_list(bl, b, hk * GROUP + g, pid_n)
            n_tiles += TILES_PER_BLOCK * n_blocks
            t_full_lo += TILES_PER_BLOCK * n_partial
        t_full_hi = n_tiles
    elif DIAGONAL:  # aligned square tiles: key tile n0 is seen from query row n0 on
        lo = n0
        n_tiles = (len_q - lo) // BLOCK_M
        t_full_lo = n_tiles
        t_full_hi = n_tiles
    else:
        lo = len_q * 0
        n_tiles = len_q // BLOCK_M
        t_full_lo = n_tiles
        t_full_hi = n_tiles
    dq_row0 = b * dq_batch_rows + q0
    p = Shared(
        q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, rows_smem, ds_smem,
        p_smem, dq_smem, kv_bar, qdo_ready, qdo_empty, dq_ready, dq_empty, b * q_batch_rows + q0,
        b * do_batch_rows + q0, dq_row0, b * k_batch_rows + k0 + n0, b * v_batch_rows + k0 + n0, n0, lo,
        hk * GROUP, hk, n_tiles, len_q, TENSOR_DIM,
    )  # fmt: skip
    # Keys counted from the tile's first (its length and position start moved by n0): the compute
    # warps' key offsets are then constants. Taken from packed_tile, n0 is no program id that
    # ptxas could recompute, and kept beside them it cost spills at head_dim 128.
    keys_left = len_k - n0
    mk = Mask(
        len_q, keys_left, win_left + zero, win_right + zero, q_start, q_stride + zero,
        k_start + k_stride * n0, k_stride + zero,
    )  # fmt: skip
    b64 = b.to(gl.int64)
    hk64 = hk.to(gl.int64)
    lse_off = b64 * stride_lb + hk64 * GROUP * stride_lh + q0
    alibi_ptr = ALIBI + (b * gl.num_programs(1) + hk) * GROUP  # this group's first query head
    key_row0 = k0 + n0
    dk, dv = gl.warp_specialize(
        [
            (
                _compute_partition,
                (
                    p,
                    mk,
                    bl,
                    b,
                    pid_n,
                    t_full_lo,
                    t_full_hi,
                    qk_scale,
                    tanh_scale,
                    softmax_scale,
                    alibi_ptr,
                    GROUP,
                    BLOCK_M,
                    BLOCK_N,
                    HEAD_DIM,
                    DIAGONAL,
                    MASKED,
                    HAS_LEFT,
                    HAS_RIGHT,
                    SOFTCAP,
                    HAS_ALIBI,
                    SPLIT_N,
                    DKDV_ONLY,
                    SPARSE,
                    TILES_PER_BLOCK,
                    num_warps,
                ),
            ),
            (
                _load_partition,
                (p, bl, b, pid_n, t_full_lo, LSE + lse_off, DELTA + lse_off, stride_lh, GROUP, BLOCK_M,
                 HEAD_DIM, MASKED, SPARSE, TILES_PER_BLOCK),
            ),
            (_dq_partition,
             (p, bl, b, pid_n, t_full_lo, GROUP, BLOCK_M, HEAD_DIM, DKDV_ONLY, SPARSE, TILES_PER_BLOCK)),
        ],
        [1, 1],
        [WORKER_REGS, WORKER_REGS],
    )
    if MEMORY:
        # The sequence again (b from packed_tile is not kept past the loop); the Q and dO
        # stages, done with, take gdM and S; kv_bar completes its second phase.
        doc = gl.program_id(2)
        if packed_docs > 0:
            doc = packed_tile(gl.program_id(0), CU_K, packed_docs, BLOCK_N)[0]
        g_smem = reinterpret(q_smem, dtype, gdm_desc.block_type.shape, gdm_desc.layout)
        s_smem = reinterpret(do_smem, dtype, s_desc.block_type.shape, s_desc.layout)
        state = doc * gl.num_programs(1) + hk
        # gdz and z wait for their use in the LSE/delta rows' buffer (1 KB)
        vec_smem = reinterpret(rows_smem, gl.float32, [2, HEAD_DIM], rows_smem.layout)
        t, p, w = updates_backward_dv(
            k_smem, v_smem, g_smem, s_smem, vec_smem, kv_bar, 1, gdm_desc, s_desc, GDZ, ZB, state, dv, GRAM
        )
        # dK and dV leave through the K and V tiles (the products are done with them), dV while
        # dK's terms are added: a whole key tile by TMA, a tile cut by its segment's end row by
        # row from there (st.global from the products' layout writes half of each 32-byte
        # sector per instruction). Issued together at the end, the CTA waited for both TMA
        # stores to read their tiles before it could exit (docs/experiments.md §49).
        fence_async_shared()
        whole = keys_left >= BLOCK_N
        if whole:
            tma.async_copy_shared_to_global(dv_desc, [key_row0, hk * HEAD_DIM], v_smem)
        else:
            _store_rows_from_shared(DV, v_smem, key_row0, keys_left, hk64 * stride_dvh, stride_dvs)
        dk = updates_backward_dk(k_smem, vec_smem, dk, t, p, w, GRAM)
        k_smem.store(dk.to(dtype))
        fence_async_shared()
        if whole:
            tma.async_copy_shared_to_global(dk_desc, [key_row0, hk * HEAD_DIM], k_smem)
            tma.store_wait(0)
        else:
            _store_rows_from_shared(DK, k_smem, key_row0, keys_left, hk64 * stride_dkh, stride_dks)
    else:
        _store_key_tile(DK, DV, dk, dv, key_row0, keys_left, b64, hk64, stride_dkb, stride_dks, stride_dkh,
                        stride_dvb, stride_dvs, stride_dvh, BLOCK_N, HEAD_DIM, TENSOR_DIM, VARLEN,
                        MASKED or SPARSE, ACCUMULATE)  # fmt: skip


@gluon.jit
def _store_rows_from_shared(ptr, tile, row0, rows_left, head_off, stride_s):
    """The first ``rows_left`` rows of a (rows, head_dim) shared tile to rows row0.. of a packed
    (total, heads, head_dim) tensor at ptr + head_off, 16 bytes per thread and store."""
    ROWS: gl.constexpr = tile.shape[0]
    COLS: gl.constexpr = tile.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // COLS, COLS // 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    offs = head_off + (row0 + rows).to(gl.int64)[:, None] * stride_s + cols[None, :]
    gl.store(ptr + offs, tile.load(layout), mask=(rows < rows_left)[:, None])


@gluon.jit
def _store_key_tile(
    DK, DV, dk, dv, key_row0, keys_left, b64, hk64, stride_dkb, stride_dks, stride_dkh, stride_dvb,
    stride_dvs, stride_dvh, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, TENSOR_DIM: gl.constexpr,
    VARLEN: gl.constexpr, MASKED: gl.constexpr, ACCUMULATE: gl.constexpr,
):  # fmt: skip
    """The key tile's dK and dV from registers: the rows in its sequence (MASKED), the columns
    below the tensors' head_dim."""
    layout: gl.constexpr = dk.type.layout
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    rows = (key_row0 + offs_n).to(gl.int64)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))[None, :]
    if VARLEN:  # one packed batch: no batch stride (b, from packed_tile, is not kept past the loop)
        dk_offs = hk64 * stride_dkh + rows[:, None] * stride_dks + cols
        dv_offs = hk64 * stride_dvh + rows[:, None] * stride_dvs + cols
    else:
        dk_offs = b64 * stride_dkb + hk64 * stride_dkh + rows[:, None] * stride_dks + cols
        dv_offs = b64 * stride_dvb + hk64 * stride_dvh + rows[:, None] * stride_dvs + cols
    if MASKED:
        ok = (offs_n < keys_left)[:, None] & (cols < TENSOR_DIM)
    elif TENSOR_DIM < HEAD_DIM:  # columns past the tensors' head_dim: zero padding, not stored
        ok = (offs_n >= 0)[:, None] & (cols < TENSOR_DIM)
    else:
        ok = None
    _store_grad(DK, dk, dk_offs, ok, ACCUMULATE)
    _store_grad(DV, dv, dv_offs, ok, ACCUMULATE)


def backward_supports(problem: AttentionProblem) -> bool:
    """Whether ``fused_backward`` computes ``problem`` (the GPU, dtype and tensor layouts are the
    gate's to check, dispatch.py): head_dim 64, 128 or 256 (``TILES``) or a multiple of 8
    between them (run at the next build, ``dispatch.run_head_dim``), and every position and
    window bound of magnitude below ``POSITION_LIMIT`` (int32 sums), with ALiBi below
    ``ALIBI_POSITION_LIMIT`` (float32 differences). Any lengths, packed documents, windows,
    positions, GQA/MQA, softcap and ALiBi."""
    if run_head_dim(problem.head_dim, TILES) is None:
        return False
    extremes = []
    for pos, n in ((problem.q_positions, problem.max_seqlen_q), (problem.k_positions, problem.max_seqlen_k)):
        # Linear in a sequence's length L <= n: extreme at L = 0 or L = n.
        extremes += [pos.start, pos.start + pos.per_len * n, pos.start + (pos.per_len + pos.stride) * n]
    bounds = [x for x in (problem.bounds.left, problem.bounds.right) if x is not None]
    limit = POSITION_LIMIT if problem.alibi_slopes is None else ALIBI_POSITION_LIMIT
    return max(abs(x) for x in extremes + bounds) < limit


def sparse_supports(problem: AttentionProblem, mask) -> bool:
    """Whether ``fused_backward`` runs block-sparse ``problem`` under ``mask`` (a TileMask) with
    ``mask_lists``: each key block is the build's key tile and each query block whole query tiles
    (128-key blocks at head_dim 64 and 128 and those between; not the 256 build's 64-key tiles,
    whose dQ is another kernel's), dense sequences and no window (the mask holds it)."""
    build = run_head_dim(problem.head_dim, TILES)
    if build is None or build > 128:
        return False
    block_m, block_n = TILES[build]
    return (
        mask.block_k == block_n and mask.block_q % block_m == 0 and not problem.varlen
        and problem.bounds.left is None and problem.bounds.right is None
    )  # fmt: skip


def computes_dq(problem: AttentionProblem) -> bool:
    """Whether ``fused_backward`` computes dQ for ``problem``: up to the 128 build; at 256 it
    computes dK/dV only and ``dq.fused_dq`` computes dQ."""
    return run_head_dim(problem.head_dim, TILES) <= 128


def _aligned_diagonal(problem: AttentionProblem, block_m: int, block_n: int) -> bool:
    """Causal between blocks at equal positions (stride 1) whose lengths are multiples of the
    tiles: the DIAGONAL variant's index mask, cheaper than MASKED's positions (591 instead of
    451 instructions per tile at head_dim 128)."""
    n = problem.max_seqlen_q
    return (
        not problem.varlen
        and problem.bounds == MaskBounds(None, 0)
        and n == problem.max_seqlen_k
        and n % block_m == 0
        and n % block_n == 0
        and problem.q_positions.resolved(n) == problem.k_positions.resolved(n)
        and problem.q_positions.stride == 1
    )


def fused_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    problem: AttentionProblem,
    dq: torch.Tensor | None,
    dk: torch.Tensor,
    dv: torch.Tensor,
    accumulate: bool,
    updates_grads: tuple[torch.Tensor, ...] | None = None,
    bind_key: tuple | None = None,
    mask_lists: tuple | None = None,
    mask_q: int = 128,
    mask_order: torch.Tensor | None = None,
) -> None:
    """Add dQ into the float32 ``dq`` and write (or with ``accumulate`` add) dK/dV into dk/dv;
    where ``computes_dq`` is False (the 256 build) dK/dV only, and dq is None (dq.py's kernel
    computes dQ).

    q/dout: (batch, seqlen_q, heads_q, head_dim), k/v: (batch, seqlen_k, heads_k, head_dim), or
    (total, heads, head_dim) with ``problem.varlen``; bf16/fp16 on an sm_90 GPU, in layouts
    ``tma_layout_ok`` accepts (dq too); lse/delta: float32 in ``problem.lse_shape``, last stride 1.
    The caller checks the rest (``backward_supports`` and the gate). Any mask the problem
    describes, a softcap and ALiBi are honoured as in the forward. dq is added to, never
    overwritten: zero it first for a plain backward. A head_dim between two builds runs the next
    larger one, its tiles zero-filled past the tensors' head_dim by TMA (``tma.rows_descriptor``).

    ``updates_grads`` (Infini-attention's local attention: packed segments, head_dim 128):
    (gdM (batch, segments, kv_heads, 128, 128) in q's dtype, gdz (batch, segments, kv_heads, 128)
    float32), contiguous, the gradients of the memory's per-segment updates, and for the delta
    rule also (S = dA + dA^T in gdM's shape and dtype, z before each segment in gdz's): their
    backward (``infini.memory.memory_updates_backward``, with ``gram_grad`` = (S, z)) is added
    into dK/dV (the MEMORY epilogue).

    ``bind_key``: the launch key to bind under instead of this function's own, for a caller
    whose key fixes every argument's layout and finds the binding itself
    (``backward.attention_gradients``).

    ``mask_lists`` (block-sparse attention, ``sparse_supports``): ((count, index, kind, bits),
    their five strides) of a ``TileMask``'s per-key-block lists (``block_sparse._mask_args``)
    whose query blocks are ``mask_q`` rows and key blocks the build's key tiles (the caller
    checks ``sparse_supports``); its mask replaces the problem's (no window, dense sequences);
    ``mask_order``: its ``q_order``, the order in which the programs take the key blocks.
    Launched without binding (the lists are the mask's, not the call's)."""
    if mask_order is not None and mask_lists is None:
        raise ValueError("fused_backward's mask_order orders mask_lists' key blocks: pass both or neither")
    key = bind_key
    # The steady state: the launch a call of these layouts bound.
    if key is None and updates_grads is None and mask_lists is None:
        key = ("bound_backward", q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.stride(), dout.stride(),
               dout.dtype, None if dq is None else (dq.dtype, dq.stride()), dk.dtype, dk.stride(), dv.dtype,
               dv.stride(), lse.stride(), delta.stride(), accumulate)  # fmt: skip
        bound = bound_launch(problem.derived, key)
        if bound is not None and bound(q, k, v, dout, q if dq is None else dq, dk, dv, lse, delta):
            return
    if (dq is None) == computes_dq(problem):
        wanted = "a float32 buffer" if computes_dq(problem) else "None (dq.fused_dq computes dQ)"
        raise ValueError(f"fused_backward at head_dim {problem.head_dim} takes dq={wanted}")
    head_dim = run_head_dim(problem.head_dim, TILES)
    varlen = problem.varlen
    if varlen:
        dout, q, k, v, dk, dv = (t.unsqueeze(0) for t in (dout, q, k, v, dk, dv))
        dq = None if dq is None else dq.unsqueeze(0)
    if k.shape[1] == 0:
        return
    if q.shape[1] == 0:  # no queries (TMA takes no empty tensor): zero gradients for the keys
        if not accumulate:
            dk.zero_()
            dv.zero_()
        return
    block_m, block_n = TILES[head_dim]
    qd, q_rows = rows_descriptor(q, block_m, head_dim)
    dod, do_rows = rows_descriptor(dout, block_m, head_dim)
    dqd, dq_rows = (qd, q_rows) if dq is None else rows_descriptor(dq, block_m, head_dim)
    kd, k_rows = rows_descriptor(k, block_n, head_dim)
    vd, v_rows = rows_descriptor(v, block_n, head_dim)
    dk_strides, dv_strides = list(dk.stride()[:3]), list(dv.stride()[:3])
    lse_strides = [lse.stride(0), lse.stride(1)]
    if varlen:  # one packed batch: sequences start at their cu_seqlens rows
        q_rows = do_rows = dq_rows = k_rows = v_rows = dk_strides[0] = dv_strides[0] = 0
        lse_strides = [0, lse.stride(0)]
    b = problem.bounds
    sparse = mask_lists is not None
    # Whole query tiles per block, and dQ from this kernel (the 256 build's is another kernel's).
    walkable = mask_q % block_m == 0 and computes_dq(problem)
    refused = updates_grads is not None or varlen or not b.is_full or not walkable
    # The kernel reads one key block of mask_order per key tile, then the count of long ones.
    key_tiles = -(-problem.max_seqlen_k // block_n)
    if sparse and (refused or mask_order is None or mask_order.numel() != key_tiles + 1):
        raise ValueError(
            "fused_backward's mask_lists take dense sequences, no window, whole query tiles, head_dim "
            f"<= 128, and a mask_order of {key_tiles} key blocks (TileMask.q_order)"
        )
    diagonal = not sparse and _aligned_diagonal(problem, block_m, block_n)
    tails = problem.max_seqlen_q % block_m != 0 or problem.max_seqlen_k % block_n != 0
    masked = not (diagonal or sparse) and (varlen or not b.is_full or tails)
    cu_q = problem.cu_seqlens_q if varlen else lse  # never read unless varlen
    cu_k = problem.cu_seqlens_k if varlen else lse
    slopes = lse if problem.alibi_slopes is None else problem.alibi_slopes
    gdm_desc = s_desc = dkd = dvd = qd  # stand-ins, never read without MEMORY (GRAM)
    gdz = z_before = lse
    if updates_grads is not None:
        if len(updates_grads) not in (2, 4):
            raise ValueError(f"updates_grads takes (gdM, gdz) or (gdM, gdz, S, z), got {len(updates_grads)}")
        gdm, gdz = updates_grads[:2]
        if not (varlen and problem.head_dim == head_dim == 128 and gdm.dtype == q.dtype):
            raise ValueError("updates_grads needs packed segments at head_dim 128 and gdM in q's dtype")
        states = (problem.batch, problem.heads_k)
        if (gdm.shape[0] * gdm.shape[1], gdm.shape[2]) != states or gdz.shape != gdm.shape[:4]:
            raise ValueError(f"updates_grads: one state per segment and kv head, got {tuple(gdm.shape)}")
        if len(updates_grads) == 4:
            s_grad, z_before = updates_grads[2:]
            if (s_grad.shape, s_grad.dtype, z_before.shape) != (gdm.shape, gdm.dtype, gdz.shape):
                raise ValueError("updates_grads: S must match gdM's shape and dtype, z gdz's shape")
            s_desc = matrix_descriptor(s_grad)
        if not all(t.is_contiguous() for t in updates_grads):
            raise ValueError("updates_grads must be contiguous")
        gdm_desc = matrix_descriptor(gdm)
        if not (tma_layout_ok(dk) and tma_layout_ok(dv) and dk.dtype == dv.dtype == q.dtype) or accumulate:
            raise ValueError("updates_grads: dk and dv are written in q's dtype, in layouts TMA writes")
        dkd, dvd = (rows_descriptor(t, block_n, head_dim)[0] for t in (dk, dv))
    grid, packed_docs = tile_grid(
        problem.max_seqlen_k, problem.heads_k, problem.batch, block_n, k.shape[1] if varlen else None
    )
    lists = (lse,) * 5 + (0,) * 5 if mask_lists is None else (*mask_lists[0], mask_order, *mask_lists[1])
    args = (
        qd, kd, vd, dod, dqd, gdm_desc, s_desc, dkd, dvd, dk, dv, lse, delta, cu_q, cu_k, slopes, gdz,
        z_before, *lists,
        problem.max_seqlen_q, problem.max_seqlen_k, packed_docs, q_rows, do_rows, dq_rows, k_rows,
        v_rows, *dk_strides, *dv_strides, *lse_strides,
        *score_scales(problem), problem.softmax_scale, *problem.position_args(), b.left or 0, b.right or 0,
    )  # fmt: skip
    kwargs = dict(
        GROUP=problem.group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        TENSOR_DIM=problem.head_dim, VARLEN=varlen,
        DIAGONAL=diagonal, MASKED=masked, HAS_LEFT=b.left is not None, HAS_RIGHT=b.right is not None,
        SOFTCAP=bool(problem.softcap), HAS_ALIBI=problem.alibi_slopes is not None, ACCUMULATE=accumulate,
        MEMORY=updates_grads is not None, GRAM=updates_grads is not None and len(updates_grads) == 4,
        SPARSE=sparse, MASK_Q=mask_q if sparse else block_m, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    if key is None:
        launch(_fused_bwd_kernel, grid, *args, **kwargs)
    else:
        slots = (qd, kd, vd, dod, dqd, dk, dv, lse, delta)
        launch_or_bind(problem.derived, key, _fused_bwd_kernel, grid, args, kwargs, slots)
