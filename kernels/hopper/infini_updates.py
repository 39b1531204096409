"""Infini-attention's per-segment memory updates (``infini/memory.py``'s ``memory_updates``) and
their backward (``memory_updates_backward`` without the delta rule's terms) for Hopper (sm_90)
in Gluon: bf16, head_dim 128. For segment s of a batch row and kv head:

    dM_s = sigma(K_s)^T V_s  (128 x 128, float32),   dz_s = sum over the tokens of sigma(K_s)
    dV = sigma(K) gdM_s,   dK = (V gdM_s^T + gdz_s) sigma'(K)   (gdM_s bf16, gdz_s float32)

The Triton kernel moves its bytes at 45% of an H200's bandwidth, a third of its stalls on
sigma(K)'s round trip through shared memory on its way to the product (docs/experiments.md §41).
Here persistent programs walk the (segment, kv head) items; a loader warp streams 64-token
blocks of k (two 64 x 64 tiles) and v (64 x 128) by TMA through a ring of STAGES blocks, across
item boundaries, so the ring stays full while the compute stores an item's results. Two compute
warpgroups own 64 rows of dM each, the rows of k's columns w * 64: a warpgroup writes sigma of
its k tile over the tile, and that tile, transposed by its shared-memory descriptor, is the
product's operand; dz is the same operand times a tile of ones.

With GRAM the compute warpgroups also build the delta rule's A_s (``memory_gram``) from the
same sigma(K) tiles (``_gram_block``), alone (k only) or beside dM and dz (the backward's rebuild
of the memories: one read of k for both). A launch walks every segment or every other one
(``_selected_item``): a rebuild from the memories kept before the even segments takes dM of those
alone, so the odd ones' A_s come from a launch over k alone.

The backward walks (row chunk, segment, kv head) items the same way, gdM_s loaded once per item
into one of two buffers; its warpgroups take alternate 64-token blocks (each writes dV and dK
of its own tokens, M = 64): sigma(K) goes over the block's k tile as dV's operand, and sigma'(K)
is read back from it (1 above 1, sigma below: bf16's rounding, as the outputs').

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import named_barriers
from .gluon_api import tma
from .tma import gl_dtype, make_context_current, shared_layout

HEAD_DIM = gl.constexpr(128)
HALF = gl.constexpr(64)  # rows of dM per compute warpgroup; columns per k tile
BLOCK_T = gl.constexpr(64)  # tokens per ring stage
STAGES = gl.constexpr(4)
ONES = gl.constexpr(8)  # columns of the ones tile (the narrowest wgmma)
COMPUTE_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)
MAX_REGISTERS = 168  # 2 x 4 x 32 x 240 + 4 x 32 x 24 = 12 warps x 32 x 168
GRAM_READY = named_barriers.FIRST_ID  # both warpgroups' halves of a block's sigma(K) written


@gluon.constexpr_function
def block_layout(cols=128):
    """The registers of a 64-row block's (64, cols) product, one compute warpgroup's."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.jit
def sigma(x):
    """ELU + 1, Infini-attention's feature map (``infini/memory.py``'s ``_sigma``). e^x as
    2^(x log2 e): ptxas builds gl.exp's ex2 with a guard for results below 2^-126 (five
    instructions per element where this takes two; the flushed results are below 1e-38)."""
    return gl.where(x > 0, x + 1.0, gl.exp2(x * 1.4426950408889634))


@gluon.jit
def inverse(x):
    """1 / x, and 0 where x = 0 (an empty memory retrieves nothing; ``infini/memory.py``'s
    ``_inverse``)."""
    return gl.where(x > 0, 1.0 / gl.where(x > 0, x, 1.0), 0.0)


@gluon.jit
def _item(item, seqlen, n_seg, segment_len, kv_heads):
    """(batch row, kv head, first token, end token) of item = (b * n_seg + s) * kv_heads + h."""
    pid_bs = item // kv_heads
    start = (pid_bs % n_seg) * segment_len
    return pid_bs // n_seg, item % kv_heads, start, gl.minimum(start + segment_len, seqlen)


@gluon.jit
def _selected_item(item, first, step, n_sel, seqlen, n_seg, segment_len, kv_heads):
    """(state, batch row, kv head, first token, end token) of item = (b * n_sel + p) * kv_heads + h
    over the segments first + p * step (all of them: 0, 1, n_seg), state numbering all of them."""
    bp = item // kv_heads
    state = ((bp // n_sel) * n_seg + first + step * (bp % n_sel)) * kv_heads + item % kv_heads
    b, h, start, end = _item(state, seqlen, n_seg, segment_len, kv_heads)
    return state, b, h, start, end


@gluon.jit
def _loader(
    k_desc, v_desc, k_smem, v_smem, ready, empty, seqlen, n_seg, segment_len, kv_heads, first, step, n_sel,
    k_batch_rows, v_batch_rows, n_items, UPDATES: gl.constexpr,
):  # fmt: skip
    """Block j of the program (counted over its items) into ring stage j % STAGES: k as two
    64 x 64 tiles (one per compute warpgroup), v as one 64 x 128 tile (with UPDATES)."""
    V_BYTES: gl.constexpr = v_desc.block_type.nbytes if UPDATES else 0
    block_bytes: gl.constexpr = 2 * k_desc.block_type.nbytes + V_BYTES
    j = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        args = (seqlen, n_seg, segment_len, kv_heads)
        state, b, h, start, end = _selected_item(item, first, step, n_sel, *args)
        for t in range(start, end, BLOCK_T):
            s = j % STAGES
            # mbarriers start in phase 1 complete: the first wait on each empty stage passes.
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, block_bytes)
            for c in gl.static_range(2):
                tma.async_copy_global_to_shared(
                    k_desc, [b * k_batch_rows + t, h * HEAD_DIM + c * HALF], bar, k_smem.index(s * 2 + c)
                )
            if UPDATES:
                v_coord = [b * v_batch_rows + t, h * HEAD_DIM]
                tma.async_copy_global_to_shared(v_desc, v_coord, bar, v_smem.index(s))
            j += 1


@gluon.jit
def _gram_block(phi, z_half, k_smem, a_smem, den_smem, s, j, acc0, acc1, w: gl.constexpr):
    """One 64-token block of the delta rule's A_s rows [w * 64, w * 64 + 64): ``phi`` is
    sigma(K)'s columns [w * 64, w * 64 + 64), which the warpgroup has written over its k tile.
    The weights wt = 1 / (sigma(K) z_s) take the whole rows, so the two warpgroups swap their
    halves' row sums through ``den_smem`` (two slots per block parity: the other warpgroup reads
    this block's before either writes the next but one); then (wt sigma(K))^T over the two k
    tiles of sigma(K). Operands bf16 as the Triton kernel's (sigma(K) and wt sigma(K) rounded).
    The products stay in flight while the next block's elementwise work runs: the caller waits
    until they are the last two outstanding, so that the block before's are done (its stage can
    go, its wt sigma(K) buffer of two be rewritten)."""
    part = gl.sum(phi * z_half[None, :], axis=1)
    den_smem.index((j % 2) * 2 + w).store(part)
    named_barriers.sync(GRAM_READY, 256)  # both halves of sigma(K) and of the row sums written
    weights = inverse(part + den_smem.index((j % 2) * 2 + 1 - w).load(part.type.layout))
    a_tile = a_smem.index(w * 2 + j % 2)
    a_tile.store((phi * weights[:, None]).to(a_tile.dtype))
    fence_async_shared()
    operand = a_tile.permute((1, 0))  # (wt sigma(K))^T: (64 of head_dim, 64 tokens)
    acc0 = warpgroup_mma(operand, k_smem.index(s * 2), acc0, is_async=True)
    acc1 = warpgroup_mma(operand, k_smem.index(s * 2 + 1), acc1, is_async=True)
    return acc0, acc1


@gluon.jit
def _compute(
    k_smem, v_smem, ones_smem, a_smem, den_smem, ready, empty, DM, DZ, Z, A, seqlen, n_seg, segment_len,
    kv_heads, first, step, n_sel, n_items, w: gl.constexpr, UPDATES: gl.constexpr, GRAM: gl.constexpr,
):  # fmt: skip
    """Compute warpgroup w: rows [w * 64, w * 64 + 64) of every item's dM and dz (UPDATES, at the
    item's index: the selected segments') and of its A_s (GRAM: ``_gram_block``, at its
    segment's; Z: z before each segment, float32), from one sigma(K)."""
    dtype: gl.constexpr = k_smem.dtype
    tile_l: gl.constexpr = block_layout(HALF)
    acc_l: gl.constexpr = block_layout(HEAD_DIM)
    dz_l: gl.constexpr = block_layout(ONES)
    ones = ones_smem.index(w)
    ones.store(gl.full([BLOCK_T, ONES], 1.0, dtype, dz_l))
    fence_async_shared()
    tokens = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, tile_l))
    out_rows = w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_l))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_l))
    dz_rows = w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, dz_l))
    dz_cols = gl.arange(0, ONES, layout=gl.SliceLayout(0, dz_l))
    half_cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, tile_l))
    j = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        args = (seqlen, n_seg, segment_len, kv_heads)
        state, b, h, start, end = _selected_item(item, first, step, n_sel, *args)
        state = state.to(gl.int64)  # as z and A_s lay out their states
        out = item.to(gl.int64)  # as dm and dz do
        if GRAM:
            z_half = gl.load(Z + state * HEAD_DIM + w * HALF + half_cols)
            acc0 = gl.zeros([HALF, HALF], gl.float32, tile_l)
            acc1 = gl.zeros([HALF, HALF], gl.float32, tile_l)
        if UPDATES:
            acc = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_l)
            dz = gl.zeros([HALF, ONES], gl.float32, dz_l)
        for t in range(start, end, BLOCK_T):
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            k_tile = k_smem.index(s * 2 + w)
            x = k_tile.load(tile_l).to(gl.float32)
            # sigma(0) is 1: tokens past the segment (the next segment's, or TMA's zero fill
            # past the tensor) must add nothing.
            x = gl.where(((t + tokens) < end)[:, None], sigma(x), 0.0)
            k_tile.store(x.to(dtype))  # each thread rewrites what it read
            fence_async_shared()
            if UPDATES:
                operand = k_tile.permute((1, 0))  # sigma(K)^T: (64 of head_dim, 64 tokens)
                acc = warpgroup_mma(operand, v_smem.index(s), acc, is_async=True)
                dz = warpgroup_mma(operand, ones, dz, is_async=True)
                if not GRAM:
                    acc, dz = warpgroup_mma_wait(0, deps=(acc, dz))
                    mbarrier.arrive(empty.index(s), count=1)
            if GRAM:  # this block's Gram products stay in flight, the rest done
                acc0, acc1 = _gram_block(x, z_half, k_smem, a_smem, den_smem, s, j, acc0, acc1, w)
                if UPDATES:
                    acc, dz, acc0, acc1 = warpgroup_mma_wait(2, deps=(acc, dz, acc0, acc1))
                else:
                    acc0, acc1 = warpgroup_mma_wait(2, deps=(acc0, acc1))
                if t > start:  # the block before's products are done
                    mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1)
            j += 1
        if GRAM:
            if UPDATES:
                acc, dz, acc0, acc1 = warpgroup_mma_wait(0, deps=(acc, dz, acc0, acc1))
            else:
                acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), count=1)
            # A_s (bf16) stored from a blocked layout: converted to bf16 in the products'
            # registers, ptxas serialized every wgmma of the kernel.
            out_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
            rows = w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, out_l))
            ocols = gl.arange(0, HALF, layout=gl.SliceLayout(0, out_l))
            offs = (state * HEAD_DIM + rows)[:, None] * HEAD_DIM + ocols[None, :]
            gl.store(A + offs, gl.convert_layout(acc0, out_l).to(A.dtype.element_ty))
            gl.store(A + offs + HALF, gl.convert_layout(acc1, out_l).to(A.dtype.element_ty))
        if UPDATES:
            gl.store(DM + (out * HEAD_DIM + out_rows)[:, None] * HEAD_DIM + out_cols[None, :], acc)
            gl.store(DZ + out * HEAD_DIM + dz_rows, gl.sum(gl.where(dz_cols[None, :] == 0, dz, 0.0), 1))


@gluon.jit
def updates_kernel(
    k_desc, v_desc, DM, DZ, Z, A, seqlen, n_seg, segment_len, kv_heads, first, step, n_sel, k_batch_rows,
    v_batch_rows, n_items, UPDATES: gl.constexpr, GRAM: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = k_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [STAGES * 2, BLOCK_T, HALF], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_T, HEAD_DIM], v_desc.layout)
    ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, ONES], dtype)
    ones_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_T, ONES], ones_layout)
    # GRAM: each warpgroup's two wt sigma(K) tiles, and the row sums the warpgroups swap
    a_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_T, HALF], k_desc.layout)
    den_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both compute warpgroups release a stage
    # fmt: off
    gl.warp_specialize(
        [
            (_compute, (k_smem, v_smem, ones_smem, a_smem, den_smem, ready, empty, DM, DZ, Z, A, seqlen,
                        n_seg, segment_len, kv_heads, first, step, n_sel, n_items, 0, UPDATES, GRAM)),
            (_compute, (k_smem, v_smem, ones_smem, a_smem, den_smem, ready, empty, DM, DZ, Z, A, seqlen,
                        n_seg, segment_len, kv_heads, first, step, n_sel, n_items, 1, UPDATES, GRAM)),
            (_loader, (k_desc, v_desc, k_smem, v_smem, ready, empty, seqlen, n_seg, segment_len, kv_heads,
                       first, step, n_sel, k_batch_rows, v_batch_rows, n_items, UPDATES)),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )
    # fmt: on


@gluon.jit
def chunk_item(item, seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks):
    """(state, batch row, kv head, first token, end token) of item = state * n_chunks + chunk
    index, state = (b * n_seg + s) * kv_heads + h: the chunks of a state side by side (its
    head_dim x head_dim matrix read from L2 after the first). The backward's and the
    retrieval's items (infini_retrieval.py)."""
    state = item // n_chunks
    b, h, start, end = _item(state, seqlen, n_seg, segment_len, kv_heads)
    lo = start + (item % n_chunks) * chunk
    return state, b, h, lo, gl.minimum(lo + chunk, end)


@gluon.jit
def await_item_matrix(item, i, m_smem, m_ready, seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks):
    """A compute warpgroup of an item stream at its program's i-th item: (state, batch row, kv
    head, first token, end token, the item's matrix in shared memory) once the matrix has landed.
    Both warpgroups wait, blocks or not: an arrival on the matrix's empty barrier before it
    arrived could release the buffer while the other warpgroup still reads it."""
    state, b, h, lo, hi = chunk_item(item, seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks)
    mbarrier.wait(m_ready.index(i % 2), (i // 2) & 1)
    return state, b, h, lo, hi, m_smem.index(i % 2)


@gluon.jit
def allocate_stream(a_desc, b_desc, m_desc):
    """Shared memory of an item stream (``stream_loader``), its mbarriers initialized: a ring of
    STAGES blocks of two 64 x 128 tiles (ready, empty: one warpgroup's each) and two buffers of
    a 128 x 128 matrix (m_ready, m_empty: both warpgroups finish an item)."""
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_T, HEAD_DIM], a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_T, HEAD_DIM], b_desc.layout)
    m_smem = gl.allocate_shared_memory(dtype, [2, HEAD_DIM, HEAD_DIM], m_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    m_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    m_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(m_ready.index(i), count=1)
        mbarrier.init(m_empty.index(i), count=2)
    return a_smem, b_smem, m_smem, ready, empty, m_ready, m_empty


@gluon.jit
def stream_loader(
    a_desc, b_desc, m_desc, a_smem, b_smem, m_smem, ready, empty, m_ready, m_empty, seqlen, n_seg,
    segment_len, kv_heads, group, chunk, n_chunks, a_batch_rows, b_batch_rows, n_items, B_TILE: gl.constexpr,
):  # fmt: skip
    """The loader of an item stream (``chunk_item``'s items): per item the state's 128 x 128
    matrix into buffer i % 2, then per head of the group (the kv head's query heads in a, b;
    group 1: the kv head's own) and 64-token block the block's a and (``B_TILE``) b tiles into
    ring stage j % STAGES. The memory updates' backward streams k, v and gdM; the retrieval q,
    local and M (infini_retrieval.py); the delta rule's z gradient k and S
    (infini_gram_den.py)."""
    block_bytes: gl.constexpr = a_desc.block_type.nbytes + (b_desc.block_type.nbytes if B_TILE else 0)
    i = 0
    j = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        state, b, kvh, lo, hi = chunk_item(item, seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks)
        buf = i % 2
        mbarrier.wait(m_empty.index(buf), ((i // 2) & 1) ^ 1)
        m_bar = m_ready.index(buf)
        mbarrier.expect(m_bar, m_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(m_desc, [state * HEAD_DIM, 0], m_bar, m_smem.index(buf))
        for g in range(group):
            col = (kvh * group + g) * HEAD_DIM
            for t in range(lo, hi, BLOCK_T):
                s = j % STAGES
                mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, block_bytes)
                tma.async_copy_global_to_shared(a_desc, [b * a_batch_rows + t, col], bar, a_smem.index(s))
                if B_TILE:
                    tma.async_copy_global_to_shared(b_desc, [b * b_batch_rows + t, col], bar, b_smem.index(s))
                j += 1
        i += 1


@gluon.jit
def store_block(desc, tile, value, ptr, b, h, t, hi, batch_rows, stride_b, stride_s, stride_h):
    """A 64-token block's (64, 128) output ``value`` at tokens [t, t + 64) of head h, batch row
    b: a whole block through ``tile`` (a stage's tile that the products are done with) by TMA,
    which the caller waits for before it releases the stage; a block that the chunk ends inside
    (at ``hi``) by masked stores (TMA would write the next chunk's rows)."""
    if t + BLOCK_T <= hi:
        tile.store(value.to(tile.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [b * batch_rows + t, h * HEAD_DIM], tile)
    else:
        layout: gl.constexpr = value.type.layout
        rows = t + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        offs = b.to(gl.int64) * stride_b + h * stride_h + rows.to(gl.int64)[:, None] * stride_s
        offs += cols[None, :]
        gl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=(rows < hi)[:, None])


@gluon.jit
def _bwd_compute(
    k_smem, v_smem, g_smem, ready, empty, g_ready, g_empty, dk_desc, dv_desc, GZ, DK, DV, seqlen, n_seg,
    segment_len, kv_heads, chunk, n_chunks, n_items, dk_batch_rows, dv_batch_rows, stride_dkb, stride_dks,
    stride_dkh, stride_dvb, stride_dvs, stride_dvh, w: gl.constexpr,
):  # fmt: skip
    """Compute warpgroup w: the blocks j of the program with j % 2 == w; dV and dK go back
    through its stage's k and v tiles (``store_block``)."""
    dtype: gl.constexpr = k_smem.dtype
    acc_l: gl.constexpr = block_layout(HEAD_DIM)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_l))
    zero = gl.zeros([BLOCK_T, HEAD_DIM], gl.float32, acc_l)
    i = 0
    j = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        args = (seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks)
        state, b, h, lo, hi, gm = await_item_matrix(item, i, g_smem, g_ready, *args)
        for t in range(lo, hi, BLOCK_T):
            if j % 2 == w:
                s = j % STAGES
                mbarrier.wait(ready.index(s), (j // STAGES) & 1)
                k_tile = k_smem.index(s)
                v_tile = v_smem.index(s)
                x = k_tile.load(acc_l).to(gl.float32)
                sig = sigma(x)
                grad = gl.where(x > 0, 1.0, sig).to(dtype)  # sigma'(K), held across the products
                k_tile.store(sig.to(dtype))  # each thread rewrites what it read
                fence_async_shared()
                dv = warpgroup_mma(k_tile, gm, zero, use_acc=False, is_async=True)
                dk = warpgroup_mma(v_tile, gm.permute((1, 0)), zero, use_acc=False, is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                gz = gl.load(GZ + state.to(gl.int64) * HEAD_DIM + cols)
                dk = (dk + gz[None, :]) * grad.to(gl.float32)
                store_block(dv_desc, k_tile, dv, DV, b, h, t, hi, dv_batch_rows, stride_dvb, stride_dvs,
                            stride_dvh)  # fmt: skip
                store_block(dk_desc, v_tile, dk, DK, b, h, t, hi, dk_batch_rows, stride_dkb, stride_dks,
                            stride_dkh)  # fmt: skip
                tma.store_wait(0)  # the tiles read: the stage can be reloaded
                mbarrier.arrive(empty.index(s), count=1)
            j += 1
        mbarrier.arrive(g_empty.index(i % 2), count=1)
        i += 1


@gluon.jit
def updates_backward_kernel(
    k_desc, v_desc, g_desc, dk_desc, dv_desc, GZ, DK, DV, seqlen, n_seg, segment_len, kv_heads, chunk,
    n_chunks, k_batch_rows, v_batch_rows, dk_batch_rows, dv_batch_rows, n_items, stride_dkb, stride_dks,
    stride_dkh, stride_dvb, stride_dvs, stride_dvh,
):  # fmt: skip
    k_smem, v_smem, g_smem, ready, empty, g_ready, g_empty = allocate_stream(k_desc, v_desc, g_desc)
    # fmt: off
    gl.warp_specialize(
        [
            (_bwd_compute, (k_smem, v_smem, g_smem, ready, empty, g_ready, g_empty, dk_desc, dv_desc, GZ, DK,
                            DV, seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks, n_items, dk_batch_rows,
                            dv_batch_rows, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
                            stride_dvh, 0)),
            (_bwd_compute, (k_smem, v_smem, g_smem, ready, empty, g_ready, g_empty, dk_desc, dv_desc, GZ, DK,
                            DV, seqlen, n_seg, segment_len, kv_heads, chunk, n_chunks, n_items, dk_batch_rows,
                            dv_batch_rows, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
                            stride_dvh, 1)),
            (stream_loader, (k_desc, v_desc, g_desc, k_smem, v_smem, g_smem, ready, empty, g_ready, g_empty,
                             seqlen, n_seg, segment_len, kv_heads, 1, chunk, n_chunks, k_batch_rows,
                             v_batch_rows, n_items, True)),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )
    # fmt: on


@gluon.jit
def updates_backward_dv(
    k_smem, v_smem, g_smem, s_smem, vec_smem, bar, phase, g_desc, s_desc, GZ, Z, state, dv,
    GRAM: gl.constexpr,
):  # fmt: skip
    """The memory updates' backward of one key tile (``_bwd_compute``'s dV and dK) added into
    the local attention's dK and dV of that tile (hopper/backward.py's MEMORY epilogue), with
    its K and V (head_dim 128) still in shared memory, in two calls: this one, then
    ``updates_backward_dk``. gdM of ``state`` comes by TMA into ``g_smem`` (completing ``bar``
    at ``phase``) and sigma(K) goes over K as dV's operand.

        dV += sigma(K) gdM,   dK += (V gdM^T + gdz) sigma'(K)   (sigma' = min(sigma, 1) in bf16)

    GRAM (the delta rule): S = dA + dA^T of state into ``s_smem`` too, and dK gains the terms of
    A = sigma(K)^T diag(w) sigma(K), w = 1 / (sigma(K) z) with z before the segment (``Z``), as
    ``memory._update_backward_kernel``'s GRAM pass: (w P + dden z^T) sigma'(K), P = sigma(K) S,
    dden = -w^2 rowsum(P * sigma(K)) / 2 (w from float32 sigma(K), the rest from its bf16).

    Here: dV goes over V in shared memory (bf16, not yet fenced for TMA) once V's product is
    done, so that it can leave while the rest runs; returns (V gdM^T, with GRAM P's product in
    flight and w). gdz and z go to ``vec_smem`` ((2, 128) float32) while gdM and S load and are
    read back where used: held in registers beside dK, dV and two products they spilled, loaded
    there from global memory their latency came after the products (docs/experiments.md §49)."""
    layout: gl.constexpr = dv.type.layout
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    if GRAM:
        mbarrier.expect(bar, g_desc.block_type.nbytes + s_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(s_desc, [state * HEAD_DIM, 0], bar, s_smem)
    else:
        mbarrier.expect(bar, g_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(g_desc, [state * HEAD_DIM, 0], bar, g_smem)
    x = sigma(k_smem.load(layout).to(gl.float32))
    if GRAM:
        z = gl.load(Z + state.to(gl.int64) * HEAD_DIM + cols)
        w = inverse(gl.sum(x * z[None, :], 1))
        vec_smem.index(1).store(z)
    else:
        w = gl.zeros([dv.shape[0]], gl.float32, gl.SliceLayout(1, layout))
    k_smem.store(x.to(k_smem.dtype))
    vec_smem.index(0).store(gl.load(GZ + state.to(gl.int64) * HEAD_DIM + cols))
    fence_async_shared()
    mbarrier.wait(bar, phase)
    zero = gl.zeros_like(dv)
    dv = warpgroup_mma(k_smem, g_smem, dv, is_async=True)
    t = warpgroup_mma(v_smem, g_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    dv, t = warpgroup_mma_wait(0, deps=(dv, t))
    # Each warpgroup's products read only its own rows of V: they are free to take its dV.
    v_smem.store(dv.to(v_smem.dtype))
    if GRAM:
        p = warpgroup_mma(k_smem, s_smem, zero, use_acc=False, is_async=True)
    else:
        p = t
    return t, p, w


@gluon.jit
def updates_backward_dk(k_smem, vec_smem, dk, t, p, w, GRAM: gl.constexpr):
    """``updates_backward_dv``'s second half: dK with the updates' terms added, from that
    call's (V gdM^T, P's product in flight, w)."""
    layout: gl.constexpr = dk.type.layout
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    gz = vec_smem.index(0).load(cols.type.layout)
    dk += (t + gz[None, :]) * gl.minimum(k_smem.load(layout).to(gl.float32), 1.0)
    if GRAM:
        p = warpgroup_mma_wait(0, deps=(p,))
        dden = -0.5 * w * w * gl.sum(p * k_smem.load(layout).to(gl.float32), 1)
        z = vec_smem.index(1).load(cols.type.layout)
        t = p * w[:, None] + dden[:, None] * z[None, :]
        dk += t * gl.minimum(k_smem.load(layout).to(gl.float32), 1.0)
    return dk


def token_descriptor(t: torch.Tensor, block_cols: int) -> tuple[TensorDescriptor, int]:
    """t (batch, seqlen, kv_heads, 128) as (rows, kv_heads * 128) with (64, block_cols) blocks,
    and its rows per batch row (``tma.tma_layout_ok`` layouts)."""
    make_context_current(t.device)
    b, s, heads, d = t.shape
    batch_rows = t.stride(0) // t.stride(1)
    layout = shared_layout((BLOCK_T.value, block_cols), gl.bfloat16)
    rows = (b - 1) * batch_rows + s
    block = [BLOCK_T.value, block_cols]
    return TensorDescriptor(t, [rows, heads * d], [t.stride(1), 1], block, layout), batch_rows


def matrix_descriptor(m: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor of 16-bit (..., 128, 128) matrices, contiguous, one matrix per block."""
    make_context_current(m.device)
    d = m.shape[-1]
    layout = shared_layout((d, d), gl_dtype(m.dtype))
    return TensorDescriptor(m, [m.numel() // d, d], [d, 1], [d, d], layout)


def launch_updates(
    k: torch.Tensor, v: torch.Tensor, segment_len: int, dm: torch.Tensor | None, dz: torch.Tensor | None,
    z_before: torch.Tensor | None = None, gram: torch.Tensor | None = None, even_updates: bool = False,
) -> None:  # fmt: skip
    """Write ``memory.memory_updates``' outputs, ``memory.memory_gram``'s or both from one read of
    k: k, v (batch, seqlen, kv_heads, 128) bf16 in layouts ``dispatch.uses_infini_updates``
    accepts; dm (batch, segments, kv_heads, 128, 128) and dz (batch, segments, kv_heads, 128),
    float32, contiguous, or both None (v not read); with ``z_before`` ((batch, segments,
    kv_heads, 128) float32, contiguous: z before each segment) A_s into ``gram`` (bf16,
    contiguous, one per segment). ``even_updates``: dm and dz of the even segments only
    (ceil(segments / 2) of them), the odd ones' A_s from a second launch that reads k alone."""
    b, s, kv_heads, _ = k.shape
    n_seg = -(-s // segment_len)
    (kd, k_rows), (vd, v_rows) = token_descriptor(k, HALF.value), token_descriptor(v, HEAD_DIM.value)
    updates, with_gram = dm is not None, z_before is not None
    out = dm if updates else gram
    dm, dz, z_before, gram = (out if t is None else t for t in (dm, dz, z_before, gram))  # unused pointers
    # (first segment, step, segments per batch row, UPDATES) of each launch
    launches = [(0, 1, n_seg, updates)]
    if even_updates:
        launches = [(0, 2, -(-n_seg // 2), updates)] + ([(1, 2, n_seg // 2, False)] if with_gram else [])
    sms = torch.cuda.get_device_properties(k.device).multi_processor_count
    for first, step, n_sel, with_updates in launches:
        n_items = b * n_sel * kv_heads
        if n_items == 0:
            continue
        updates_kernel[(min(n_items, sms),)](
            kd, vd, dm, dz, z_before, gram, s, n_seg, segment_len, kv_heads, first, step, n_sel, k_rows,
            v_rows, n_items, UPDATES=with_updates, GRAM=with_gram, num_warps=4, maxnreg=MAX_REGISTERS,
        )  # fmt: skip


def launch_updates_backward(
    k: torch.Tensor,
    v: torch.Tensor,
    grad_dm: torch.Tensor,
    grad_dz: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    segment_len: int,
    chunk: int,
) -> None:
    """Write ``memory.memory_updates_backward``'s dk, dv (k's and v's shapes, layouts
    ``dispatch.uses_infini_updates`` accepts): k, v as ``launch_updates`` takes them; grad_dm
    (batch, segments, kv_heads, 128, 128) bf16 and grad_dz (batch, segments, kv_heads, 128)
    float32, contiguous; ``chunk`` rows per item, a multiple of 64."""
    b, s, kv_heads, d = k.shape
    n_seg = grad_dm.shape[1]
    n_chunks = -(-min(segment_len, s) // chunk)
    n_items = b * n_seg * kv_heads * n_chunks
    (kd, k_rows), (vd, v_rows) = token_descriptor(k, d), token_descriptor(v, d)
    (dkd, dk_rows), (dvd, dv_rows) = token_descriptor(dk, d), token_descriptor(dv, d)
    gd = matrix_descriptor(grad_dm)
    programs = min(n_items, torch.cuda.get_device_properties(k.device).multi_processor_count)
    updates_backward_kernel[(programs,)](
        kd, vd, gd, dkd, dvd, grad_dz, dk, dv, s, n_seg, segment_len, kv_heads, chunk, n_chunks, k_rows,
        v_rows, dk_rows, dv_rows, n_items, *dk.stride()[:3], *dv.stride()[:3], num_warps=4,
        maxnreg=MAX_REGISTERS,
    )  # fmt: skip
