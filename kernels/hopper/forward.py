"""Attention forward for Hopper (sm_90) in Gluon, warp-specialized as in FlashAttention-3.

Persistent: one program per SM walks work items, each a (128-row query tile, query head,
sequence) (query_tiles.py), numbered as a grid over them would launch its programs; a program
starts with the item of its id and claims each next one from a counter in global memory
(``TILE_COUNTER``, an atomic add) as it starts loading the last, so that uneven items (causal
rows, documents of different lengths) balance as a grid's would. Its warps are specialized
(``gl.warp_specialize``):

- loader, 1 warp: per item, the two 64-row halves of the query tile into one of two Q stages
  (published with the item's number, ``query_tiles.publish_item``), then K and V tiles by TMA
  into two-stage rings that run on across items (K and V each with their own ready/empty
  mbarriers, so a K stage is refilled as soon as QK^T has read it, while V waits for P V). The
  next item's Q and first key tiles thus load while the compute warpgroups finish the last one,
  where a program per item started with its loads and the SM idle: 4.3 us per program against
  cuDNN's 1.1 (docs/experiments.md §37-38);
- two compute warpgroups of 4 warps, one per 64-row half, at 240 registers. Each issues
  S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, then the softmax of S_j. ptxas places
  the wait for P V before the softmax (the SASS reorders it), so a warpgroup's softmax overlaps
  the other warpgroup's products rather than its own; pinning the wait after the softmax
  measured no faster (docs/experiments.md §34), nor did making the warpgroups take turns at
  issuing their products (FlashAttention-3's ping-pong, §12 and §27). They run free of each other.

Every mask the library takes runs here: any lengths, packed documents (``cu_seqlens``: one
item per query tile of a document, reading the packed tensors in place), windows and
causal masks in global positions (``TokenPositions``: a ring step's shifted or strided blocks).
``key_tiles`` works out, per item, the key tiles that any of its rows sees and among them
those that every row sees in full; only the others (window edges, a document's last tile) are
masked, in loops of their own, and tiles that no row sees are never loaded.

Key tiles are walked last to first, so that under a causal mask the tile on the diagonal comes
first. A row that has seen no key yet keeps a running max of -inf, which the softmax update
treats as 0 (``_online_softmax``); a row that sees no key at all gets output 0 and LSE -inf.

MEMORY (Infini-attention's local attention over packed segments, head_dim 128): each query
tile's rows also get their memory retrieval and the gate in the epilogue, while Q is still in
its stage and the output in registers (``infini_retrieval.retrieve_rows``; the loader brings the
segment's memory after the tile's first two key tiles), and both outputs leave by TMA.

A softcap (constexpr SOFTCAP: ``tanh.approx.f32`` per score) and ALiBi (HAS_ALIBI: a bias from
global positions) are built in only where a problem has them (docs/experiments.md, 2026-11-24).

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

import threading

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.runtime import driver

from ..launcher import bound_launch, launch_or_bind
from ..launcher import launch as launch_kernel
from ..problem import AttentionProblem
from .block_lists import (
    BlockLists,
    bits_scores,
    block_list,
    block_lists,
    listed_walk,
)
from .dispatch import run_head_dim
from .infini_retrieval import allocate_memory_barriers, load_memory, retrieve_rows
from .infini_updates import matrix_descriptor
from .query_tiles import BLOCK_M as QUERY_ROWS
from .query_tiles import (
    COMPUTE_REGS,
    HEAD_DIMS,
    LOADER_REGS,
    QueryTiles,
    Rings,
    Shared,
    allocate_rings,
    await_item,
    load_key_tiles,
    persistent_programs,
    publish_item,
    q_stage,
    query_tile_item,
    query_tile_launch,
    query_tiles,
    store_rows,
    tile_of_item,
)
from .query_tiles import HALF_M as HALF_ROWS
from .scores import Mask, logits, mask_scores, score_scales
from .tma import load_tile, rows_descriptor, tma_layout_ok

# Key rows per tile, by build: at 256 two stages of 128-row K and V tiles (256 KiB) would not
# fit beside Q in shared memory (227 KiB), so its tiles are 64 rows (Q 64 + K/V 128 KiB).
BLOCK_N = {64: 128, 128: 128, 256: 64}
# Query tiles in shared memory, by build: with two the loader fetches a program's next query tile
# while the last one's key tiles run; at 256 a second (64 KiB) does not fit beside the K/V rings.
Q_STAGES = {64: 2, 128: 2, 256: 1}


def forward_supports(problem: AttentionProblem) -> bool:
    """Whether this kernel computes ``problem`` (beyond what ``dispatch.hopper_path_ok``
    checks of every Hopper kernel): its head_dim is one it is built for, or a multiple of 8
    between two builds (run at the next one, ``dispatch.run_head_dim``)."""
    return run_head_dim(problem.head_dim, HEAD_DIMS) is not None


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale, MASKED: gl.constexpr, HAS_ALIBI: gl.constexpr):
    """One tile's softmax update: (P, new running max, new running sum, rescale factor of the
    old accumulator). A row whose scores are all -inf so far (masked tiles only) computes with
    a max of 0, so that P and the rescale factor come out 0 instead of NaN."""
    if HAS_ALIBI:
        m_new = gl.maximum(m_i, gl.max(s, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = m_new
    if MASKED:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    if HAS_ALIBI:
        pr = gl.exp2(s - m_use[:, None])
    else:
        pr = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    return pr, m_new, l_i * alpha + gl.sum(pr, 1), alpha


@gluon.jit
def _load_partition(
    qt: QueryTiles, rings: Rings, TILE_COUNTER, m_desc, Z, m_smem, z_smem, m_bar, bl: BlockLists,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TENSOR_DIM: gl.constexpr,
    VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, MEMORY: gl.constexpr,
    SPARSE: gl.constexpr,
):  # fmt: skip
    """The program's work items in turn (the first its program id, each next one claimed from
    ``TILE_COUNTER`` as the last starts): the item published with its Q stage, each half of Q
    loaded once the stage is released, then the key tiles. The rings run on across items, so an
    item's loads overlap the last one's end. Past the last item, a stage published with
    ``n_items`` and no Q tells the compute warpgroups to stop. MEMORY: after the first two key
    tiles, the item's memory matrix once both warpgroups are done with the last one's. SPARSE:
    the key tiles the item's block list holds (block_lists.py)."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    n_items = qt.n_m * qt.n_h * qt.n_b
    k = gl.program_id(0) * 0
    ring = k
    item = gl.program_id(0) + k
    while item < n_items:
        # Claimed now, so that the atomic's round trip overlaps this item's loads.
        next_item = gl.atomic_add(TILE_COUNTER, 1) + gl.num_programs(0)
        pid_m, h, b = tile_of_item(qt, item)
        p, mk0, mk1, q_tile_row, b, ob, rows_left = query_tile_item(
            qt, rings, pid_m, h, b, k, ring, GROUP, BLOCK_M, BLOCK_N, TENSOR_DIM, VARLEN, HAS_LEFT, HAS_RIGHT
        )
        if SPARSE:
            n_partial, n_blocks, blocks, kinds = block_list(bl, b, h, pid_m)
            p = listed_walk(p, n_blocks)
        for w in gl.static_range(2):
            mbarrier.wait(p.rings.q_empty.index(p.q_slot + w), p.q_phase ^ 1)
        publish_item(rings, k, item)
        for w in gl.static_range(2):
            bar = p.rings.q_bar.index(p.q_slot + w)
            mbarrier.expect(bar, p.q_desc.block_type.nbytes)
            load_tile(p.q_desc, p.q_row + w * HALF_M, p.q_head, bar, p.rings.q_smem.index(p.q_slot + w))
        if MEMORY:
            # The rings hold two key tiles: with the item's first two loaded the loader would
            # wait for the last item's end anyway, after which its memory matrix is free.
            ahead = gl.minimum(p.n_tiles, 2)
            load_key_tiles(p, BLOCK_N, 0, ahead)
            load_memory(m_desc, Z, b * (qt.n_h // GROUP) + p.k_head, m_bar, m_smem, z_smem, k)
            load_key_tiles(p, BLOCK_N, ahead, p.n_tiles)
        elif SPARSE:
            load_key_tiles(p, BLOCK_N, 0, p.n_tiles, blocks, True)
        else:
            load_key_tiles(p, BLOCK_N, 0, p.n_tiles)
        k += 1
        ring += p.n_tiles
        # A launch's claims take 0 .. n_items - 1 once each (one per item, so the last is past
        # the end): whoever takes the last sets the counter back to 0 for the next launch on
        # this stream (``_tile_counter``), here, where the claim's round trip is long over.
        gl.atomic_xchg(TILE_COUNTER, 0, mask=next_item == n_items - 1 + gl.num_programs(0))
        item = next_item
    slot, phase = q_stage(rings, k)
    for w in gl.static_range(2):
        mbarrier.wait(rings.q_empty.index(slot + w), phase ^ 1)
    publish_item(rings, k, n_items)
    for w in gl.static_range(2):
        mbarrier.arrive(rings.q_bar.index(slot + w), count=1)


@gluon.jit
def _tile_step(
    p: Shared, mk: Mask, i, pr, m_i, l_i, o, s_zero, row_offs, col_offs, qk_scale, tanh_scale, alibi2, q_s,
    blocks, kinds, bits, w: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
    MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr, SPARSE: gl.constexpr,
):  # fmt: skip
    """Walk step i (key tile t_last - i; SPARSE: the tile listed at blocks[i], MASKED by its bits):
    S_i = Q K_i^T issued beside O += P_{i-1} V_{i-1}, the softmax of S_i written to run while P V
    does (ptxas waits for P V first: module docstring)."""
    dtype: gl.constexpr = p.q_desc.dtype
    j = p.ring0 + i
    st = j % 2
    prev = 1 - st
    mbarrier.wait(p.rings.k_ready.index(st), (j // 2) & 1)
    mbarrier.wait(p.rings.v_ready.index(prev), ((j - 1) // 2) & 1)
    s = warpgroup_mma(q_s, p.rings.k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    o = warpgroup_mma(gl.convert_layout(pr.to(dtype), p_layout), p.rings.v_smem.index(prev), o, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    mbarrier.arrive(p.rings.k_empty.index(st), count=1)
    if SPARSE:
        s = logits(
            s, gl.load(blocks + i), mk, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
            False, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
        if MASKED:
            s = bits_scores(s, bits, gl.load(kinds + i), w)
    else:
        s = logits(
            s, p.t_last - i, mk, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
            MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
    pr, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, MASKED, HAS_ALIBI)
    o = warpgroup_mma_wait(0, deps=(o,))
    mbarrier.arrive(p.rings.v_empty.index(prev), count=1)
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return pr, m_i, l_i, o


@gluon.jit
def _attend(
    p: Shared, mk: Mask, q_s, row_offs, col_offs, qk_scale, tanh_scale, alibi2, blocks, kinds, n_partial,
    bits, w: gl.constexpr, RELEASE_Q: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, SPARSE: gl.constexpr,
):  # fmt: skip
    """(O unnormalized, running max, running sum) of warpgroup w over the tile's n_tiles >= 1 key
    tiles: the first tile (masked where it needs it) before the loop; then the masked tiles at
    the high end, the full tiles and the masked tiles at the low end, each span in a loop of its
    own so that only the edges pay for the mask; P V of the last tile after the loops, Q's half
    released before it under RELEASE_Q. SPARSE: the listed tiles, the n_partial first masked by
    their bits, the rest full."""
    dtype: gl.constexpr = p.q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    st = p.ring0 % 2
    mbarrier.wait(p.rings.k_ready.index(st), (p.ring0 // 2) & 1)
    s = warpgroup_mma(q_s, p.rings.k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(p.rings.k_empty.index(st), count=1)
    if SPARSE:
        s = logits(
            s, gl.load(blocks), mk, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
            False, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
        if n_partial > 0:
            s = bits_scores(s, bits, gl.load(kinds), w)
        # steps [1, full_first) partial, the rest full
        full_first = gl.minimum(gl.maximum(n_partial, 1), p.n_tiles)
        full_end = p.n_tiles
    else:
        s = logits(
            s, p.t_last, mk, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
            False, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
        if (p.t_last >= mk.t_full_hi) | (p.t_last < mk.t_full_lo):
            s = mask_scores(s, mk, p.t_last, row_offs, col_offs, HAS_LEFT, HAS_RIGHT)
        # Walk step i visits key tile t_last - i: tiles at or above t_full_hi come first (masked),
        # then the full ones down to t_full_lo, then the masked rest.
        full_first = gl.minimum(gl.maximum(p.t_last + 1 - mk.t_full_hi, 1), p.n_tiles)
        full_end = gl.minimum(gl.maximum(p.t_last + 1 - mk.t_full_lo, full_first), p.n_tiles)
    m_i = gl.full([HALF_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, row_layout)
    pr, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, True, HAS_ALIBI)
    o = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)

    for i in range(1, full_first):
        pr, m_i, l_i, o = _tile_step(
            p, mk, i, pr, m_i, l_i, o, s_zero, row_offs, col_offs, qk_scale, tanh_scale, alibi2, q_s,
            blocks, kinds, bits, w, o_layout, p_layout, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, SPARSE,
        )  # fmt: skip
    for i in range(full_first, full_end):
        pr, m_i, l_i, o = _tile_step(
            p, mk, i, pr, m_i, l_i, o, s_zero, row_offs, col_offs, qk_scale, tanh_scale, alibi2, q_s,
            blocks, kinds, bits, w, o_layout, p_layout, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
            SPARSE,
        )  # fmt: skip
    for i in range(full_end, p.n_tiles):  # none under SPARSE
        pr, m_i, l_i, o = _tile_step(
            p, mk, i, pr, m_i, l_i, o, s_zero, row_offs, col_offs, qk_scale, tanh_scale, alibi2, q_s,
            blocks, kinds, bits, w, o_layout, p_layout, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, SPARSE,
        )  # fmt: skip

    if RELEASE_Q:  # every QK^T of the tile is done: the loader may fetch the next tile's Q
        mbarrier.arrive(p.rings.q_empty.index(p.q_slot + w), count=1)
    last = p.ring0 + p.n_tiles - 1
    st = last % 2
    mbarrier.wait(p.rings.v_ready.index(st), (last // 2) & 1)
    o = warpgroup_mma(gl.convert_layout(pr.to(dtype), p_layout), p.rings.v_smem.index(st), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o,))
    mbarrier.arrive(p.rings.v_empty.index(st), count=1)
    return o, m_i, l_i


@gluon.jit
def _compute_partition(
    qt: QueryTiles, rings: Rings, O, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, qk_scale,
    tanh_scale, ALIBI, m_smem, z_smem, m_bar, o_desc, out_desc, OUT, GATE, bl: BlockLists, w: gl.constexpr,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    TENSOR_DIM: gl.constexpr, VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, MEMORY: gl.constexpr, SPARSE: gl.constexpr,
):  # fmt: skip
    """Warpgroup w, for each of the program's query tiles: rows [q_row + w * HALF_M, + HALF_M)
    against the tile's key tiles, output and LSE stored for the rows below ``rows_left`` (the
    sequence's rows from the tile's first on). Under SOFTCAP each score tile becomes
    tanh(S * tanh_scale) before the mask (``score_scales``); under HAS_ALIBI the logits get
    ALiBi's bias (slopes (batch, heads_q) at ``ALIBI``). MEMORY (Infini-attention: sequence b is
    a segment): OUT gets the gated sum of the rows' memory retrieval and their output
    (``infini_retrieval.retrieve_rows``), Q's half released only after it."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_offs = gl.arange(0, HALF_M, layout=row_layout) * qt.q_stride
    col_offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)) * qt.k_stride
    # Q as QK^T's A operand from registers at head_dim 64 (16 of them): less shared-memory
    # traffic, and Q's stage is free as soon as it is read.
    Q_IN_REGS: gl.constexpr = HEAD_DIM == 64
    n_items = qt.n_m * qt.n_h * qt.n_b
    k = gl.program_id(0) * 0
    ring = k
    item = await_item(rings, k, w)
    while item < n_items:
        pid_m, h, b = tile_of_item(qt, item)
        p, mk0, mk1, q_tile_row, b, ob, rows_left = query_tile_item(
            qt, rings, pid_m, h, b, k, ring, GROUP, BLOCK_M, BLOCK_N, TENSOR_DIM, VARLEN, HAS_LEFT, HAS_RIGHT
        )
        if w == 0:
            mk = mk0
        else:
            mk = mk1
        if SPARSE:
            n_partial, n_blocks, blocks, kinds = block_list(bl, b, h, pid_m)
            p = listed_walk(p, n_blocks)
        else:  # stand-ins, never read
            n_partial = p.n_tiles
            blocks = bl.index
            kinds = bl.kind
        alibi2 = 0.0
        if HAS_ALIBI:  # log2(e): logits in the log2 domain
            alibi2 = gl.load(ALIBI + b * qt.n_h + p.q_head) * 1.4426950408889634
        q_s = p.rings.q_smem.index(p.q_slot + w)
        if Q_IN_REGS:
            q_op = q_s.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
            # the loader's next TMA write (async proxy) into the stage follows these generic
            # reads: a proxy fence between (docs/experiments.md §51)
            fence_async_shared()
            mbarrier.arrive(p.rings.q_empty.index(p.q_slot + w), count=1)
        else:
            q_op = q_s

        o = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([HALF_M], -float("inf"), gl.float32, row_layout)
        l_i = gl.zeros([HALF_M], gl.float32, row_layout)
        if p.n_tiles > 0:
            o, m_i, l_i = _attend(
                p, mk, q_op, row_offs, col_offs, qk_scale, tanh_scale, alibi2, blocks, kinds, n_partial,
                bl.bits, w, not (Q_IN_REGS or MEMORY), HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, HALF_M,
                BLOCK_N, HEAD_DIM, SPARSE,
            )  # fmt: skip
        else:
            if not (Q_IN_REGS or MEMORY):
                mbarrier.arrive(p.rings.q_empty.index(p.q_slot + w), count=1)

        # Rows that saw no key: l = 0, output 0, LSE -inf (m_i = -inf).
        h64 = p.q_head.to(gl.int64)
        o_off = ob.to(gl.int64) * stride_ob + h64 * stride_oh + q_tile_row.to(gl.int64) * stride_os
        l_o = gl.convert_layout(gl.where(l_i == 0.0, 1.0, l_i), gl.SliceLayout(1, o_layout))
        o = o / l_o[:, None]
        if MEMORY:
            whole = rows_left >= (w + 1) * HALF_M
            row = p.q_row + w * HALF_M
            gated = retrieve_rows(
                q_s, o, m_smem, z_smem, m_bar, GATE, p.q_head, k, o_desc, out_desc, row, whole
            )
            fence_async_shared()  # q's generic reads before the loader's TMA write, as above
            mbarrier.arrive(p.rings.q_empty.index(p.q_slot + w), count=1)
            if not whole:
                store_rows(O, o_off, stride_os, o, p, w, rows_left, False)
                store_rows(OUT, o_off, stride_os, gated, p, w, rows_left, False)
        else:
            store_rows(O, o_off, stride_os, o, p, w, rows_left, False)
        # log2-domain max and sum back to a natural-log LSE (0.693... = ln 2).
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        rows = w * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
        lse_off = ob.to(gl.int64) * stride_lb + h64 * stride_lh + q_tile_row
        gl.store(LSE + lse_off + rows, lse, mask=rows < rows_left)
        k += 1
        ring += p.n_tiles
        item = await_item(rings, k, w)


# packed_docs changes with every packed batch: a constant or alignment hint of it would recompile.
@gluon.jit(do_not_specialize=["packed_docs"])
def _fused_fwd_kernel(
    q_desc, k_desc, v_desc, O, LSE, CU_Q, CU_K,
    seqlen_q, seqlen_k, packed_docs, q_batch_rows, k_batch_rows, v_batch_rows,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, qk_scale, tanh_scale,
    ALIBI, q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right, n_m, n_h, n_b,
    TILE_COUNTER, m_desc, o_desc, out_desc, OUT, Z, GATE, COUNT, INDEX, KIND, BITS, stride_cb, stride_ch,
    stride_ib, stride_ih, stride_im, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, TENSOR_DIM: gl.constexpr, VARLEN: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
    Q_STAGES: gl.constexpr, MEMORY: gl.constexpr, SPARSE: gl.constexpr,
):  # fmt: skip
    qt = query_tiles(
        q_desc, k_desc, v_desc, CU_Q, CU_K, seqlen_q, seqlen_k, packed_docs, q_batch_rows, k_batch_rows,
        v_batch_rows, q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right, n_m, n_h, n_b,
    )  # fmt: skip
    rings = allocate_rings(q_desc, k_desc, v_desc, BLOCK_M // 2, BLOCK_N, HEAD_DIM, Q_STAGES)
    bl = block_lists(COUNT, INDEX, KIND, BITS, stride_cb, stride_ch, stride_ib, stride_ih, stride_im)
    if MEMORY:  # one memory (32.5 KiB: 225 of the 227 KiB with the rings at head_dim 128)
        m_smem = gl.allocate_shared_memory(m_desc.dtype, m_desc.block_type.shape, m_desc.layout)
        z_smem = gl.allocate_shared_memory(gl.float32, [HEAD_DIM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        m_bar = allocate_memory_barriers()
    else:  # stand-ins, never touched
        m_smem = rings.q_smem
        z_smem = rings.q_smem
        m_bar = rings.q_bar
    # fmt: off
    gl.warp_specialize(
        [
            (
                _compute_partition,
                (qt, rings, O, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, qk_scale,
                 tanh_scale, ALIBI, m_smem, z_smem, m_bar, o_desc, out_desc, OUT, GATE, bl, 0, GROUP,
                 BLOCK_M, BLOCK_N, HEAD_DIM, TENSOR_DIM, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
                 MEMORY, SPARSE),
            ),
            (
                _compute_partition,
                (qt, rings, O, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, qk_scale,
                 tanh_scale, ALIBI, m_smem, z_smem, m_bar, o_desc, out_desc, OUT, GATE, bl, 1, GROUP,
                 BLOCK_M, BLOCK_N, HEAD_DIM, TENSOR_DIM, VARLEN, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
                 MEMORY, SPARSE),
            ),
            (
                _load_partition,
                (qt, rings, TILE_COUNTER, m_desc, Z, m_smem, z_smem, m_bar, bl, GROUP, BLOCK_M, BLOCK_N,
                 TENSOR_DIM, VARLEN, HAS_LEFT, HAS_RIGHT, MEMORY, SPARSE),
            ),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )
    # fmt: on


def fused_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    out: torch.Tensor,
    lse: torch.Tensor,
    retrieval: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    mask_lists: tuple | None = None,
) -> None:
    """Write attention's output into ``out`` and its row logsumexp into ``lse``.

    q: (batch, seqlen_q, heads_q, head_dim) or packed (total_q, heads_q, head_dim) with
    ``problem.cu_seqlens_q``; k/v likewise with heads_k; ``forward_supports``' head_dims; bf16/fp16 on
    an sm_90 GPU, in layouts ``tma_layout_ok`` accepts. out: q's shape, any float dtype, unit
    stride in head_dim (e.g. a float32 ring buffer's view); lse: ``problem.lse_shape`` float32,
    unit stride in the sequence. Any lengths, window and positions (``problem.bounds``,
    ``q_positions``/``k_positions``); a softcap (``problem.softcap``) is applied to the scaled
    scores before the mask, then ALiBi's bias (``problem.alibi_slopes``) in global positions.
    A head_dim between two builds runs the next larger one, its tiles zero-filled past the
    tensors' head_dim by TMA (``tma.rows_descriptor``).

    ``retrieval`` (Infini-attention's local attention, ``infini.local.local_forward``: packed
    segments, bf16, head_dim 128): (gated, M, z, gate), and ``gated`` (out's shape and strides)
    gets gate * sigma(q) M / (sigma(q) z) + (1 - gate) * out per segment, in the epilogue
    (``infini_retrieval.retrieve_rows``): M (segments * kv_heads, 128, 128) bf16 and z
    (segments * kv_heads, 128) float32 before sequence b at state b * kv_heads + kv head, gate
    (heads_q,) float32, contiguous.

    ``mask_lists`` (block-sparse attention, ``sparse_supports``; dense q/k/v and no window):
    ((COUNT, INDEX, KIND, BITS), strides) of a ``TileMask``'s per-query-block lists, as
    ``block_sparse._mask_args(mask, "kv")`` gives them; each query tile walks its list
    (block_lists.py). Launched without binding (the lists are the mask's, not the call's)."""
    build = run_head_dim(problem.head_dim, HEAD_DIMS)
    launch = query_tile_launch(q, k, v, problem, lse, BLOCK_N[build])
    programs = persistent_programs(launch.grid, q.device)
    if programs == 0:  # no query rows
        return
    o4 = out.unsqueeze(0) if problem.varlen else out
    qd = launch.descriptors[0]
    descs, memory = (qd, qd, qd), (lse, lse, lse)  # stand-ins, never read
    if retrieval is not None:
        gated, m, z, gate = retrieval
        _check_retrieval(problem, q, out, gated, m, z, gate)
        rows = [rows_descriptor(t.unsqueeze(0), HALF_ROWS, 128)[0] for t in (out, gated)]
        descs, memory = (matrix_descriptor(m), *rows), (gated, z, gate)
    counter = _tile_counter(q.device)
    lists = (lse,) * 4 + (0,) * 5 if mask_lists is None else (*mask_lists[0], *mask_lists[1])  # stand-ins
    args = (
        *launch.descriptors, out, lse, launch.cu_q, launch.cu_k, problem.max_seqlen_q, problem.max_seqlen_k,
        launch.packed_docs, *launch.rows, *o4.stride()[:3], *launch.lse_strides, *score_scales(problem),
        launch.slopes, *problem.position_args(), *launch.window, *launch.grid, counter, *descs, *memory,
        *lists,
    )  # fmt: skip
    sparse = mask_lists is not None
    kwargs = dict(Q_STAGES=Q_STAGES[build], MEMORY=retrieval is not None, SPARSE=sparse, **launch.constexprs)
    if retrieval is not None or sparse:
        launch_kernel(_fused_fwd_kernel, (programs,), *args, **kwargs)
        return
    slots = (*launch.descriptors, out, lse, counter)
    key = _bound_key(q, k, v, out, lse)
    launch_or_bind(problem.derived, key, _fused_fwd_kernel, (programs,), args, kwargs, slots)


def sparse_supports(problem: AttentionProblem, mask) -> bool:
    """Whether this kernel runs block-sparse ``problem`` under ``mask`` (a TileMask): its blocks
    are the build's query and key tiles (128 x 128: head_dim 64 and 128, and those between; not
    the 256 build's 64-key tiles), dense sequences and no window (the mask holds it)."""
    build = run_head_dim(problem.head_dim, HEAD_DIMS)
    return (
        build is not None and (mask.block_q, mask.block_k) == (QUERY_ROWS, BLOCK_N[build])
        and not problem.varlen and problem.bounds.left is None and problem.bounds.right is None
    )  # fmt: skip


def _bound_key(q, k, v, out, lse) -> tuple:
    """What a bound forward launch depends on besides its problem: every tensor's layout."""
    return ("bound_forward", q.shape, q.stride(), q.dtype, k.shape, k.stride(), v.stride(), out.stride(),
            out.dtype, lse.stride())  # fmt: skip


def bound_forward(problem: AttentionProblem, q, k, v, out, lse) -> bool:
    """``fused_forward(q, k, v, problem, out, lse)`` through the launch that a call with these
    layouts bound (``launcher.launch_or_bind``): nothing checked or built again but what a
    launch key checks (alignment, device). False, having run nothing, where there is none or it
    does not fit: the caller then takes the general path."""
    bound = bound_launch(problem.derived, _bound_key(q, k, v, out, lse))
    return bound is not None and bound(q, k, v, out, lse, _tile_counter(q.device))


# The persistent forward's tile counters, one per (device, stream), each zero between launches
# (the kernel resets it: ``_load_partition``): launches on one stream run in order, those on
# other streams get their own. A fill per call cost a torch.zeros and a kernel launch.
_TILE_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _tile_counter(device: torch.device) -> torch.Tensor:
    """The tile counter for a launch on ``device``'s current stream, made on the first launch
    there; a first launch inside a CUDA graph's capture gets a fresh one, whose fill the graph
    records."""
    key = (device.index, driver.active.get_current_stream(device.index))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(1, dtype=torch.int32, device=device)
        counter = _TILE_COUNTERS[key] = _new_counter(device)
    return counter


def _new_counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 counter from the ordinary memory pool, made on a thread of its own: this
    thread's allocations may be routed to a CUDA graph's private pool (torch.compile's
    cudagraph trees warm up so), which must hold no tensor that outlives the graph. The current
    stream waits for its fill."""
    made: dict = {}

    def make() -> None:
        try:
            with torch.cuda.device(device):
                made["counter"] = torch.zeros(1, dtype=torch.int32, device=device)
                made["filled"] = torch.cuda.Event()
                made["filled"].record()
        except Exception as e:  # raised below, on the caller's thread
            made["error"] = e

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]
    torch.cuda.current_stream(device).wait_event(made["filled"])
    return made["counter"]


def _check_retrieval(problem: AttentionProblem, q, out, gated, m, z, gate) -> None:
    """What ``fused_forward``'s ``retrieval`` must be (its callers check the user's inputs)."""
    states = problem.batch * problem.heads_k
    if not (problem.varlen and problem.head_dim == 128 and q.dtype == torch.bfloat16):
        raise ValueError("retrieval needs packed segments of bf16 q, k, v at head_dim 128")
    same = all(t.shape == q.shape and t.stride() == q.stride() and t.dtype == q.dtype for t in (out, gated))
    if not same or not tma_layout_ok(q):
        raise ValueError("retrieval: the output and the gated output must have q's shape, strides and dtype")
    if m.shape[-2:] != (128, 128) or m.numel() != states * 128 * 128 or m.dtype != torch.bfloat16:
        raise ValueError(f"retrieval: M must be {states} bf16 128 x 128 matrices, got {m.dtype} {m.shape}")
    if z.numel() != states * 128 or z.dtype != torch.float32 or gate.shape != (problem.heads_q,):
        raise ValueError("retrieval: z must be float32 with 128 values per state, gate (heads_q,) float32")
    if gate.dtype != torch.float32 or not all(t.is_contiguous() for t in (m, z, gate)):
        raise ValueError("retrieval: gate must be float32 and M, z, gate contiguous")
