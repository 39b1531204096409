"""Work over query tiles, the frame of the Hopper forward (forward.py) and of the dQ kernel of
the head_dim-256 build (dq.py): items of one (128-row query tile, query head, sequence), or in a
packed batch of unequal lengths one (tile of the packed batch, query head), walked by programs
whose warps are specialized into a loader warp and two compute warpgroups of 4 warps, one per
64-row half of the tile (registers: 240 per compute thread, 24 per loader thread). The forward
is persistent (a program per SM walks items: ``persistent_programs``), the dQ kernel runs a
program per item.

``allocate_rings`` sets up a program's shared memory (``Rings``: Q stages, two-stage K/V rings,
their mbarriers), ``query_tiles`` gathers the launch's scalars (``QueryTiles``), and
``query_tile_item`` works out what an item walks: the sequence's rows in the packed or dense
tensors, the key tiles that any of its rows sees and those that every row sees in full
(``spans.key_tiles``), as a ``Shared`` and each half's ``Mask``. ``load_key_tiles`` is the
loader's walk over an item's key tiles, ``store_rows`` a compute warpgroup's store of its rows,
and ``query_tile_launch`` the arguments a launch passes (grid, TMA descriptors, constexprs).

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate

from ..problem import AttentionProblem
from ..tiling import packed_tile, tile_grid
from .dispatch import run_head_dim
from .scores import Mask
from .spans import key_tiles
from .tma import load_tile, rows_descriptor, tile_layout

BLOCK_M = 128  # query rows per program, 64 per compute warpgroup
HALF_M = BLOCK_M // 2
HEAD_DIMS = (64, 128, 256)  # the builds; a head_dim between two runs at the next (run_head_dim)
NUM_WARPS = 4  # the first compute warpgroup; the second and the loader are workers
# Entry cap; warp specialization pads the loader warp to a warpgroup and redistributes:
# 2 x 4 x 32 x 240 + 4 x 32 x 24 = 12 warps x 32 x 168, within the 64K register file.
MAX_REGISTERS = 168
COMPUTE_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)


@aggregate
class Rings:
    """A program's shared-memory tiles and rings with their mbarriers, allocated once and reused
    by every query tile it walks: ``q_stages`` query tiles of two 64-row halves (``q_bar``: loaded,
    ``q_empty``: released by the half's warpgroup; half w of stage s at index 2 s + w), and
    two-stage K and V rings (``*_ready``: loaded, ``*_empty``: released by both warpgroups); per Q
    stage, the work item whose query tile it holds (``items``: ``publish_item``)."""

    q_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    items: gl.shared_memory_descriptor
    q_stages: gl.constexpr

    @gluon.constexpr_function
    def __init__(
        self, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, items, q_stages
    ):
        self.q_smem = q_smem
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.q_bar = q_bar
        self.q_empty = q_empty
        self.k_ready = k_ready
        self.k_empty = k_empty
        self.v_ready = v_ready
        self.v_empty = v_empty
        self.items = items
        self.q_stages = gl.constexpr(q_stages)


@gluon.jit
def allocate_rings(
    q_desc, k_desc, v_desc, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    Q_STAGES: gl.constexpr,
) -> Rings:  # fmt: skip
    """Shared memory for ``Rings`` at the build's HEAD_DIM, its mbarriers initialized (before the
    warps specialize)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_STAGES, HALF_M, HEAD_DIM], tile_layout(q_desc.layout))
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], tile_layout(k_desc.layout))
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], tile_layout(v_desc.layout))
    q_bar = gl.allocate_shared_memory(gl.int64, [2 * Q_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_STAGES, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    items = gl.allocate_shared_memory(gl.int32, [Q_STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(2 * Q_STAGES):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a stage
        mbarrier.init(v_empty.index(i), count=2)
    return Rings(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, items, Q_STAGES)


@gluon.jit
def q_stage(rings: Rings, k):
    """(index of the first half, mbarrier phase) of the Q stage that holds a program's k-th
    query tile: the stages in turn, the phase flipping at each round over them."""
    return (k % rings.q_stages) * 2, (k // rings.q_stages) & 1


@gluon.jit
def publish_item(rings: Rings, k, item):
    """The loader's record that Q stage k mod q_stages holds work item ``item``, before the
    stage's mbarriers are armed (their completion orders it for the compute warpgroups)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    rings.items.index(k % rings.q_stages).store(gl.full([1], item, gl.int32, layout))


@gluon.jit
def await_item(rings: Rings, k, w: gl.constexpr):
    """Compute warpgroup w's wait for its half of the program's k-th query tile, then that
    tile's work item as ``publish_item`` recorded it (past the last item: the end)."""
    slot, phase = q_stage(rings, k)
    mbarrier.wait(rings.q_bar.index(slot + w), phase)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    return gl.max(rings.items.index(k % rings.q_stages).load(layout), 0)


@aggregate
class QueryTiles:
    """The launch's query tiles: q/k/v's descriptors and, as runtime scalars (launches make
    arguments equal to 1 constants; ``+ 0`` makes them tensors again, folded back by the
    compiler), cu_seqlens, lengths, packed documents, rows per batch entry, positions, window
    bounds, and the tile grid's extents ``n_m`` (query tiles or packed slots) by ``n_h`` heads by
    ``n_b`` sequences (1 for a packed grid)."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    cu_q: gl.tensor
    cu_k: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    packed_docs: gl.tensor
    q_batch_rows: gl.tensor
    k_batch_rows: gl.tensor
    v_batch_rows: gl.tensor
    q_start: gl.tensor
    q_stride: gl.tensor
    k_start: gl.tensor
    k_stride: gl.tensor
    q_per_len: gl.tensor
    k_per_len: gl.tensor
    left: gl.tensor
    right: gl.tensor
    n_m: gl.tensor
    n_h: gl.tensor
    n_b: gl.tensor

    @gluon.constexpr_function
    def __init__(
        self, q_desc, k_desc, v_desc, cu_q, cu_k, seqlen_q, seqlen_k, packed_docs, q_batch_rows, k_batch_rows,
        v_batch_rows, q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right, n_m, n_h, n_b,
    ):  # fmt: skip
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.cu_q = cu_q
        self.cu_k = cu_k
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.packed_docs = packed_docs
        self.q_batch_rows = q_batch_rows
        self.k_batch_rows = k_batch_rows
        self.v_batch_rows = v_batch_rows
        self.q_start = q_start
        self.q_stride = q_stride
        self.k_start = k_start
        self.k_stride = k_stride
        self.q_per_len = q_per_len
        self.k_per_len = k_per_len
        self.left = left
        self.right = right
        self.n_m = n_m
        self.n_h = n_h
        self.n_b = n_b


@gluon.jit
def query_tiles(
    q_desc, k_desc, v_desc, CU_Q, CU_K, seqlen_q, seqlen_k, packed_docs, q_batch_rows, k_batch_rows,
    v_batch_rows, q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right, n_m, n_h, n_b,
) -> QueryTiles:  # fmt: skip
    """``QueryTiles`` from a kernel's arguments (``query_tile_launch``'s)."""
    zero = gl.program_id(0) * 0
    return QueryTiles(
        q_desc, k_desc, v_desc, CU_Q, CU_K, seqlen_q + zero, seqlen_k + zero, packed_docs + zero,
        q_batch_rows + zero, k_batch_rows + zero, v_batch_rows + zero, q_start + zero, q_stride + zero,
        k_start + zero, k_stride + zero, q_per_len + zero, k_per_len + zero, left + zero, right + zero,
        n_m + zero, n_h + zero, n_b + zero,
    )  # fmt: skip


@aggregate
class Shared:
    """What the partitions share about the query tile they walk: descriptors, the program's
    ``Rings``, this tile's Q stage (halves at ``q_slot``, ``q_slot + 1``; its mbarriers' phase
    ``q_phase``) and the K/V rings' position at its first key tile (``ring0``: walk step i uses
    ring step ring0 + i); the tile's rows/columns in the descriptors' (rows, heads * head_dim)
    views: the query tile's first row ``q_row``, the sequence's first key row ``k_row0``/
    ``v_row0``, the query head ``q_head``, the KV head ``k_head``; the key tiles walked,
    ``n_tiles`` of them from tile ``t_last`` down; the tensors' head_dim ``tensor_dim`` (below the
    build's where it lies between two builds)."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    rings: Rings
    q_slot: gl.tensor
    q_phase: gl.tensor
    ring0: gl.tensor
    q_row: gl.tensor
    k_row0: gl.tensor
    v_row0: gl.tensor
    q_head: gl.tensor
    k_head: gl.tensor
    t_last: gl.tensor
    n_tiles: gl.tensor
    tensor_dim: gl.constexpr

    @gluon.constexpr_function
    def __init__(
        self, q_desc, k_desc, v_desc, rings, q_slot, q_phase, ring0, q_row, k_row0, v_row0, q_head, k_head,
        t_last, n_tiles, tensor_dim,
    ):  # fmt: skip
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.rings = rings
        self.q_slot = q_slot
        self.q_phase = q_phase
        self.ring0 = ring0
        self.q_row = q_row
        self.k_row0 = k_row0
        self.v_row0 = v_row0
        self.q_head = q_head
        self.k_head = k_head
        self.t_last = t_last
        self.n_tiles = n_tiles
        self.tensor_dim = gl.constexpr(tensor_dim)


@gluon.jit
def load_key_tiles(p: Shared, BLOCK_N: gl.constexpr, first, end, blocks=0, LISTED: gl.constexpr = False):
    """The loader's walk over steps [first, end) of the tile's key tiles (all: 0, p.n_tiles),
    the last tile first, into the K and V rings (here and in dq.py); LISTED: the tiles listed at
    ``blocks``, in the list's order (a block mask's, block_lists.py)."""
    tile_bytes: gl.constexpr = p.k_desc.block_type.nbytes
    for i in range(first, end):
        j = p.ring0 + i
        s = j % 2
        if LISTED:
            n0 = gl.load(blocks + i) * BLOCK_N
        else:
            n0 = (p.t_last - i) * BLOCK_N  # last key tile first
        # mbarriers start in phase 1 complete: the first wait on each empty slot passes.
        mbarrier.wait(p.rings.k_empty.index(s), ((j // 2) & 1) ^ 1)
        bar = p.rings.k_ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        load_tile(p.k_desc, p.k_row0 + n0, p.k_head, bar, p.rings.k_smem.index(s))
        mbarrier.wait(p.rings.v_empty.index(s), ((j // 2) & 1) ^ 1)
        bar = p.rings.v_ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        load_tile(p.v_desc, p.v_row0 + n0, p.k_head, bar, p.rings.v_smem.index(s))


@gluon.jit
def store_rows(ptr, off, stride_s, value, p: Shared, w: gl.constexpr, rows_left, ACCUMULATE: gl.constexpr):
    """Warpgroup w's float32 (rows, head_dim) tile ``value`` stored at ptr + off, rows stride_s
    apart, in ptr's dtype (added to what is there under ACCUMULATE): the rows below
    ``rows_left``, the columns below the tensors' head_dim (past it: zero padding, not stored).
    The output here, dQ in dq.py."""
    layout: gl.constexpr = value.type.layout
    HALF_M: gl.constexpr = value.shape[0]
    HEAD_DIM: gl.constexpr = value.shape[1]
    rows = w * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offs = off + rows.to(gl.int64)[:, None] * stride_s + cols[None, :]
    keep = (rows < rows_left)[:, None]
    if p.tensor_dim < HEAD_DIM:
        keep = keep & (cols < p.tensor_dim)[None, :]
    if ACCUMULATE:
        value += gl.load(ptr + offs, mask=keep, other=0.0).to(gl.float32)
    gl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=keep)


@gluon.jit
def tile_of_item(qt: QueryTiles, item):
    """(query tile or packed slot, query head, sequence) of work item ``item`` of a persistent
    program, numbered as a (n_m, n_h, n_b) grid launches its programs: tiles of one head next to
    each other, so that the programs at work at once share their K/V tiles in L2."""
    m = item % qt.n_m
    rest = item // qt.n_m
    return m, rest % qt.n_h, rest // qt.n_h


@gluon.jit
def query_tile_item(
    qt: QueryTiles, rings: Rings, pid_m, h, b, k, ring0,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TENSOR_DIM: gl.constexpr,
    VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
):  # fmt: skip
    """What the query tile (pid_m, h, b) of the grid (``tile_of_item``, or program ids), its
    program's k-th, walks, here and in the dQ kernel (dq.py): its ``Shared`` (Q stage k mod
    q_stages, K/V rings from step ``ring0``), the ``Mask`` of each 64-row half, the first row of
    its sequence in the packed rows (0 unless VARLEN), its sequence's index, the batch index of
    its dense outputs, and the rows of its sequence from the tile's first on. A packed grid's
    slot pid_m (``qt.packed_docs`` > 0: ``tiling.tile_grid``) is a sequence's tile, packed
    documents read in place: one batch of packed rows, document b from row cu[b]. Causal: the
    heaviest query tiles (the last) come first."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    if HAS_RIGHT:
        pid_m = qt.n_m - 1 - pid_m
    if VARLEN:
        if qt.packed_docs > 0:
            b, pid_m = packed_tile(pid_m, qt.cu_q, qt.packed_docs, BLOCK_M)
    m0 = pid_m * BLOCK_M
    if VARLEN:
        q_first = gl.load(qt.cu_q + b)
        len_q = gl.load(qt.cu_q + b + 1) - q_first
        k_first = gl.load(qt.cu_k + b)
        len_k = gl.load(qt.cu_k + b + 1) - k_first
        q_row0 = q_first
        k_row0 = k_first
        v_row0 = k_first
        ob = b * 0
    else:
        q_first = b * 0
        len_q = qt.seqlen_q + b * 0
        len_k = qt.seqlen_k + b * 0
        q_row0 = b * qt.q_batch_rows
        k_row0 = b * qt.k_batch_rows
        v_row0 = b * qt.v_batch_rows
        ob = b
    q_pos0 = qt.q_start + qt.q_per_len * len_q + m0 * qt.q_stride
    k_start = qt.k_start + qt.k_per_len * len_k
    rows_left = len_q - m0
    q_hi = q_pos0 + (gl.minimum(rows_left, BLOCK_M) - 1) * qt.q_stride
    t_lo, t_hi, t_full_lo, t_full_hi = key_tiles(
        q_pos0, q_hi, k_start, qt.k_stride, len_k, qt.left, qt.right, HAS_LEFT, HAS_RIGHT, BLOCK_N
    )
    n_tiles = gl.where(rows_left > 0, t_hi - t_lo, 0)
    q_slot, q_phase = q_stage(rings, k)
    p = Shared(
        qt.q_desc, qt.k_desc, qt.v_desc, rings, q_slot, q_phase, ring0, q_row0 + m0, k_row0, v_row0, h,
        h // GROUP, t_hi - 1, n_tiles, TENSOR_DIM,
    )  # fmt: skip
    mk0 = Mask(q_pos0, qt.q_stride, k_start, qt.k_stride, qt.left, qt.right, len_k, t_full_lo, t_full_hi)
    mk1 = Mask(
        q_pos0 + HALF_M * qt.q_stride, qt.q_stride, k_start, qt.k_stride, qt.left, qt.right, len_k, t_full_lo,
        t_full_hi,
    )  # fmt: skip
    return p, mk0, mk1, q_first + m0, b, ob, rows_left


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(grid: tuple[int, int, int], device: torch.device) -> int:
    """Programs of a persistent launch over ``grid``'s query tiles (``tile_of_item``): one per SM,
    or one per tile where there are fewer. The next tile's loads then overlap the last one's
    softmax and store, where a program per tile would wait for its first loads with the SM idle
    (one 384-thread program with up to 192 KiB of shared memory fills an SM)."""
    return min(grid[0] * grid[1] * grid[2], _sm_count(device.index or 0))


class QueryTileLaunch(NamedTuple):
    """What a launch of a kernel over query tiles (``query_tile_item``: the forward and
    dq.py's) passes: the grid and ``packed_docs`` (``tiling.tile_grid``), q/k/v's TMA
    descriptors and rows per batch entry, the LSE's (batch, head) strides, cu_seqlens (or
    stand-ins never read), ALiBi's slopes (or a stand-in), the window's bounds and the
    constexprs with the launch options."""

    grid: tuple[int, int, int]
    packed_docs: int
    descriptors: tuple
    rows: tuple[int, int, int]
    lse_strides: tuple[int, int]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    slopes: torch.Tensor
    window: tuple[int, int]
    constexprs: dict


def query_tile_launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, lse: torch.Tensor,
    block_n: int,
) -> QueryTileLaunch:  # fmt: skip
    """The launch arguments shared by the kernels over query tiles, for ``problem`` at the build
    that runs its head_dim (``run_head_dim`` over HEAD_DIMS), with key tiles of ``block_n`` rows
    (q/k/v and lse as the kernels' wrappers take them)."""
    varlen = problem.varlen
    total_q = q.shape[0] if varlen else None
    head_dim, grid, packed_docs, window, constexprs = problem.derive(
        ("query_tiles", block_n, total_q), lambda: _query_tile_constants(problem, block_n, total_q)
    )
    q4, k4, v4 = (t.unsqueeze(0) if varlen else t for t in (q, k, v))
    qd, q_rows = rows_descriptor(q4, HALF_M, head_dim)
    kd, k_rows = rows_descriptor(k4, block_n, head_dim)
    vd, v_rows = rows_descriptor(v4, block_n, head_dim)
    return QueryTileLaunch(
        grid=grid,
        packed_docs=packed_docs,
        descriptors=(qd, kd, vd),
        rows=(q_rows, k_rows, v_rows),
        lse_strides=(0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1)),
        cu_q=problem.cu_seqlens_q if varlen else lse,
        cu_k=problem.cu_seqlens_k if varlen else lse,
        slopes=lse if problem.alibi_slopes is None else problem.alibi_slopes,
        window=window,
        constexprs=constexprs,
    )


def _query_tile_constants(problem: AttentionProblem, block_n: int, total_q: int | None) -> tuple:
    """What ``query_tile_launch`` takes from the problem alone: (build head_dim, grid,
    packed_docs, window, constexprs), derived once per problem."""
    head_dim = run_head_dim(problem.head_dim, HEAD_DIMS)
    bounds = problem.bounds
    grid, packed_docs = tile_grid(problem.max_seqlen_q, problem.heads_q, problem.batch, BLOCK_M, total_q)
    constexprs = dict(
        GROUP=problem.group, BLOCK_M=BLOCK_M, BLOCK_N=block_n, HEAD_DIM=head_dim,
        TENSOR_DIM=problem.head_dim, VARLEN=problem.varlen, HAS_LEFT=bounds.left is not None,
        HAS_RIGHT=bounds.right is not None, SOFTCAP=bool(problem.softcap),
        HAS_ALIBI=problem.alibi_slopes is not None, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return head_dim, grid, packed_docs, (bounds.left or 0, bounds.right or 0), constexprs
