"""Attention forward for Hopper (sm_90) in Gluon, warp-specialized as in FlashAttention-3.

One program per (128-row query tile, query head, sequence), its warps specialized
(``gl.warp_specialize``):

- loader, 1 warp: the two 64-row halves of the query tile, then K and V tiles by TMA into
  two-stage rings (K and V each with their own ready/empty mbarriers, so a K stage is refilled
  as soon as QK^T has read it, while V waits for P V);
- two compute warpgroups of 4 warps, one per 64-row half, at 240 registers. Each issues
  S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back and computes the softmax of S_j while
  P V runs. The warpgroups run free of each other: making them take turns at issuing their
  products (FlashAttention-3's ping-pong, through an mbarrier pair) measured no faster on an
  H200 (medians within -3%..+1% over 5 interleaved rounds, docs/experiments.md).

Every mask the library takes runs here: any lengths, packed documents (``cu_seqlens``: one
program per query tile of a document, reading the packed tensors in place), windows and
causal masks in global positions (``TokenPositions``: a ring step's shifted or strided blocks).
``key_tiles`` works out, per program, the key tiles that any of its rows sees and among them
those that every row sees in full; only the others (window edges, a document's last tile) are
masked, in loops of their own, and tiles that no row sees are never loaded.

Key tiles are walked last to first, so that under a causal mask the tile on the diagonal comes
first. A row that has seen no key yet keeps a running max of -inf, which the softmax update
treats as 0 (``_online_softmax``); a row that sees no key at all gets output 0 and LSE -inf.

A softcap (constexpr SOFTCAP: ``tanh.approx.f32`` per score) and ALiBi (HAS_ALIBI: a bias from
global positions) are built in only where a problem has them (docs/experiments.md, 2026-11-24).

No ``from __future__ import annotations``: Gluon aggregates check their fields against real types.
"""

from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from ..forward import LOG2E
from ..problem import AttentionProblem
from .dispatch import run_head_dim
from .spans import key_tiles
from .tma import load_tile, rows_descriptor, tile_layout

BLOCK_M = 128  # query rows per program, 64 per compute warpgroup
HALF_M = BLOCK_M // 2
# Key rows per tile, by head_dim: at 256 two stages of 128-row K and V tiles (256 KiB) would not
# fit beside Q in shared memory (227 KiB), so its tiles are 64 rows (Q 64 + K/V 128 KiB).
BLOCK_N = {64: 128, 128: 128, 256: 64}
HEAD_DIMS = tuple(BLOCK_N)
NUM_WARPS = 4  # the first compute warpgroup; the second and the loader are workers
# Entry cap; warp specialization pads the loader warp to a warpgroup and redistributes:
# 2 x 4 x 32 x 240 + 4 x 32 x 24 = 12 warps x 32 x 168, within the 64K register file.
MAX_REGISTERS = 168
COMPUTE_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)


def forward_supports(problem: AttentionProblem) -> bool:
    """Whether this kernel computes ``problem`` (beyond what ``dispatch.hopper_path_ok``
    checks of every Hopper kernel): its head_dim is one it is built for, or a multiple of 8
    between two builds (run at the next one, ``dispatch.run_head_dim``)."""
    return run_head_dim(problem.head_dim, HEAD_DIMS) is not None


@aggregate
class Shared:
    """What the partitions share: descriptors, shared-memory tiles and rings with their
    mbarriers, and the program's rows/columns in the descriptors' (rows, heads * head_dim)
    views: the query tile's first row ``q_row``, the sequence's first key row ``k_row0``/
    ``v_row0``, the query head ``q_head``, the KV head ``k_head``; the key tiles walked,
    ``n_tiles`` of them from tile ``t_last`` down; the tensors' head_dim ``tensor_dim`` (below the
    build's where it lies between two builds)."""

    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    q_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
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
        self, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
        q_row, k_row0, v_row0, q_head, k_head, t_last, n_tiles, tensor_dim,
    ):  # fmt: skip
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.q_smem = q_smem
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.q_bar = q_bar
        self.k_ready = k_ready
        self.k_empty = k_empty
        self.v_ready = v_ready
        self.v_empty = v_empty
        self.q_row = q_row
        self.k_row0 = k_row0
        self.v_row0 = v_row0
        self.q_head = q_head
        self.k_head = k_head
        self.t_last = t_last
        self.n_tiles = n_tiles
        self.tensor_dim = gl.constexpr(tensor_dim)


@aggregate
class Mask:
    """Where a tile's scores are masked: positions (first query row of the warpgroup ``q_pos``,
    first key ``k_start``, strides), window bounds (a key at pk is seen by a query at pq iff
    pq - left <= pk <= pq + right), the keys' count ``len_k`` and the span of key tiles seen in
    full, [t_full_lo, t_full_hi)."""

    q_pos: gl.tensor
    q_stride: gl.tensor
    k_start: gl.tensor
    k_stride: gl.tensor
    left: gl.tensor
    right: gl.tensor
    len_k: gl.tensor
    t_full_lo: gl.tensor
    t_full_hi: gl.tensor

    @gluon.constexpr_function
    def __init__(self, q_pos, q_stride, k_start, k_stride, left, right, len_k, t_full_lo, t_full_hi):
        self.q_pos = q_pos
        self.q_stride = q_stride
        self.k_start = k_start
        self.k_stride = k_stride
        self.left = left
        self.right = right
        self.len_k = len_k
        self.t_full_lo = t_full_lo
        self.t_full_hi = t_full_hi


@gluon.jit
def tanh_approx(x):
    """tanh by the special-function unit (``tanh.approx.f32``, relative error about 2^-11), as
    FlashAttention-3 computes its softcap: one MUFU op per score, beside the softmax's exp2."""
    return gl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.jit
def alibi_bias(alibi2, row_offs, col_offs, pos_diff):
    """ALiBi's bias in the log2 domain, -alibi2 * |position difference|, over a score tile: the
    rows' positions minus the columns' are pos_diff (that of the tile's first row and column)
    plus row_offs[r] - col_offs[c] (int32 offsets within the tile). The int difference becomes a
    float through the exponent bits of 1.5 * 2^23 (one integer add and one float subtract, exact
    below 2^22: the gate keeps positions there) instead of a conversion per score."""
    d = (row_offs + pos_diff)[:, None] - col_offs[None, :]
    df = (d + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0
    return -alibi2 * gl.abs(df)


def alibi_args(problem: AttentionProblem, alibi_fallback: torch.Tensor) -> tuple:
    """(slopes, q_start, q_stride, k_start, k_stride) for both Hopper kernels: the (batch,
    heads_q) float32 slopes (``alibi_fallback``, never read, without ALiBi) and the positions."""
    qp = problem.q_positions.resolved(problem.max_seqlen_q)
    kp = problem.k_positions.resolved(problem.max_seqlen_k)
    slopes = alibi_fallback if problem.alibi_slopes is None else problem.alibi_slopes
    return slopes, qp.start, qp.stride, kp.start, kp.stride


def score_scales(problem: AttentionProblem) -> tuple[float, float]:
    """(qk_scale, tanh_scale) for both Hopper kernels: the log2-domain logit is qk * qk_scale, or
    under a softcap tanh(qk * tanh_scale) * qk_scale (= softcap * tanh(qk * scale / softcap) *
    log2 e); tanh_scale is unused without one."""
    if problem.softcap:
        return problem.softcap * LOG2E, problem.softmax_scale / problem.softcap
    return problem.softmax_scale * LOG2E, 1.0


@gluon.jit
def _mask_scores(s, mk: Mask, t, row_offs, col_offs, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr):
    """Key tile t's scores with -inf where the key lies past the sequence or outside the window
    (row_offs/col_offs: the tile's rows'/columns' position offsets, index * stride). Each row's
    window becomes a range of column offsets, so a score costs two compares, not a position
    difference held over the whole tile (which spilled)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    n0 = t * BLOCK_N
    rel = row_offs + (mk.q_pos - (mk.k_start + n0 * mk.k_stride))  # pq - (first key's position)
    last = (mk.len_k - 1 - n0) * mk.k_stride  # the sequence's last key, as a column offset
    if HAS_RIGHT:
        keep = col_offs[None, :] <= gl.minimum(rel + mk.right, last)[:, None]
    else:
        keep = col_offs[None, :] <= last
    if HAS_LEFT:
        keep = keep & (col_offs[None, :] >= (rel - mk.left)[:, None])
    return gl.where(keep, s, -float("inf"))


@gluon.jit
def logits(
    s, t, mk: Mask, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
    MASKED: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    """Key tile t's raw scores S made logits: softcap, then ALiBi (which scales them to the log2
    domain here; without it the scale is folded into the softmax's exp2), then the mask."""
    if SOFTCAP:
        s = tanh_approx(s * tanh_scale)
    if HAS_ALIBI:
        BLOCK_N: gl.constexpr = s.shape[1]
        pos_diff = mk.q_pos - (mk.k_start + t * BLOCK_N * mk.k_stride)
        s = s * qk_scale + alibi_bias(alibi2, row_offs, col_offs, pos_diff)
    if MASKED:
        s = _mask_scores(s, mk, t, row_offs, col_offs, HAS_LEFT, HAS_RIGHT)
    return s


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
def _load_partition(p: Shared, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr):
    for w in gl.static_range(2):
        bar = p.q_bar.index(w)
        mbarrier.expect(bar, p.q_desc.block_type.nbytes)
        load_tile(p.q_desc, p.q_row + w * HALF_M, p.q_head, bar, p.q_smem.index(w))
    load_key_tiles(p, BLOCK_N)


@gluon.jit
def load_key_tiles(p: Shared, BLOCK_N: gl.constexpr):
    """The loader's walk over the program's key tiles, the last first, into the K and V rings
    (here and in dq.py)."""
    tile_bytes: gl.constexpr = p.k_desc.block_type.nbytes
    for i in range(p.n_tiles):
        s = i % 2
        n0 = (p.t_last - i) * BLOCK_N  # last key tile first
        # mbarriers start in phase 1 complete: the first wait on each empty slot passes.
        mbarrier.wait(p.k_empty.index(s), ((i // 2) & 1) ^ 1)
        bar = p.k_ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        load_tile(p.k_desc, p.k_row0 + n0, p.k_head, bar, p.k_smem.index(s))
        mbarrier.wait(p.v_empty.index(s), ((i // 2) & 1) ^ 1)
        bar = p.v_ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        load_tile(p.v_desc, p.v_row0 + n0, p.k_head, bar, p.v_smem.index(s))


@gluon.jit
def _tile_step(
    p: Shared, mk: Mask, i, pr, m_i, l_i, o, s_zero, row_offs, col_offs, qk_scale, tanh_scale, alibi2, q_s,
    o_layout: gl.constexpr, p_layout: gl.constexpr, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    """Walk step i (key tile t_last - i): S_i = Q K_i^T issued beside O += P_{i-1} V_{i-1}, the
    softmax of S_i computed while P V runs."""
    dtype: gl.constexpr = p.q_desc.dtype
    st = i % 2
    prev = 1 - st
    mbarrier.wait(p.k_ready.index(st), (i // 2) & 1)
    mbarrier.wait(p.v_ready.index(prev), ((i - 1) // 2) & 1)
    s = warpgroup_mma(q_s, p.k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    o = warpgroup_mma(gl.convert_layout(pr.to(dtype), p_layout), p.v_smem.index(prev), o, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    mbarrier.arrive(p.k_empty.index(st), count=1)
    s = logits(
        s, p.t_last - i, mk, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
        MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
    )  # fmt: skip
    pr, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, MASKED, HAS_ALIBI)
    o = warpgroup_mma_wait(0, deps=(o,))
    mbarrier.arrive(p.v_empty.index(prev), count=1)
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return pr, m_i, l_i, o


@gluon.jit
def _attend(
    p: Shared, mk: Mask, q_s, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
    HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """(O unnormalized, running max, running sum) over the program's n_tiles >= 1 key tiles:
    the first tile (masked where it needs it) before the loop; then the masked tiles at the high
    end, the full tiles and the masked tiles at the low end, each span in a loop of its own so
    that only the edges pay for the mask; P V of the last tile after the loops."""
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
    mbarrier.wait(p.k_ready.index(0), 0)
    s = warpgroup_mma(q_s, p.k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(p.k_empty.index(0), count=1)
    s = logits(
        s, p.t_last, mk, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
        False, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
    )  # fmt: skip
    if (p.t_last >= mk.t_full_hi) | (p.t_last < mk.t_full_lo):
        s = _mask_scores(s, mk, p.t_last, row_offs, col_offs, HAS_LEFT, HAS_RIGHT)
    m_i = gl.full([HALF_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, row_layout)
    pr, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, True, HAS_ALIBI)
    o = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)

    # Walk step i visits key tile t_last - i: tiles at or above t_full_hi come first (masked),
    # then the full ones down to t_full_lo, then the masked rest.
    full_first = gl.minimum(gl.maximum(p.t_last + 1 - mk.t_full_hi, 1), p.n_tiles)
    full_end = gl.minimum(gl.maximum(p.t_last + 1 - mk.t_full_lo, full_first), p.n_tiles)
    for i in range(1, full_first):
        pr, m_i, l_i, o = _tile_step(
            p, mk, i, pr, m_i, l_i, o, s_zero, row_offs, col_offs, qk_scale, tanh_scale, alibi2, q_s,
            o_layout, p_layout, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
    for i in range(full_first, full_end):
        pr, m_i, l_i, o = _tile_step(
            p, mk, i, pr, m_i, l_i, o, s_zero, row_offs, col_offs, qk_scale, tanh_scale, alibi2, q_s,
            o_layout, p_layout, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip
    for i in range(full_end, p.n_tiles):
        pr, m_i, l_i, o = _tile_step(
            p, mk, i, pr, m_i, l_i, o, s_zero, row_offs, col_offs, qk_scale, tanh_scale, alibi2, q_s,
            o_layout, p_layout, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
        )  # fmt: skip

    last = p.n_tiles - 1
    st = last % 2
    mbarrier.wait(p.v_ready.index(st), (last // 2) & 1)
    o = warpgroup_mma(gl.convert_layout(pr.to(dtype), p_layout), p.v_smem.index(st), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o,))
    mbarrier.arrive(p.v_empty.index(st), count=1)
    return o, m_i, l_i


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
def _compute_partition(
    p: Shared, mk: Mask, O, LSE, o_off, stride_os, lse_off, rows_left, qk_scale, tanh_scale, alibi_ptr,
    w: gl.constexpr, BLOCK_N: gl.constexpr, HALF_M: gl.constexpr, HEAD_DIM: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    """Warpgroup w: query rows [q_row + w * HALF_M, + HALF_M) against the program's key tiles,
    its output and LSE stored for the rows below ``rows_left`` (the sequence's rows from the
    program's first on). Under SOFTCAP each score tile becomes tanh(S * tanh_scale) before the
    mask (``score_scales``); under HAS_ALIBI the logits get ALiBi's bias (slope at
    ``alibi_ptr``)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_s = p.q_smem.index(w)
    row_offs = gl.arange(0, HALF_M, layout=row_layout) * mk.q_stride
    col_offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)) * mk.k_stride
    alibi2 = 0.0
    if HAS_ALIBI:
        alibi2 = gl.load(alibi_ptr) * 1.4426950408889634  # log2(e): logits in the log2 domain
    mbarrier.wait(p.q_bar.index(w), 0)
    if HEAD_DIM == 64:  # Q as QK^T's A operand from registers (16 of them): less shared-memory traffic
        q_op = q_s.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        q_op = q_s

    o = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([HALF_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, row_layout)
    if p.n_tiles > 0:
        o, m_i, l_i = _attend(
            p, mk, q_op, row_offs, col_offs, qk_scale, tanh_scale, alibi2,
            HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, HALF_M, BLOCK_N, HEAD_DIM,
        )  # fmt: skip

    # Rows that saw no key: l = 0, output 0, LSE -inf (m_i = -inf).
    l_o = gl.convert_layout(gl.where(l_i == 0.0, 1.0, l_i), gl.SliceLayout(1, o_layout))
    out = o / l_o[:, None]
    store_rows(O, o_off, stride_os, out, p, w, rows_left, False)
    # log2-domain max and sum back to a natural-log LSE (0.693... = ln 2).
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    rows = w * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
    gl.store(LSE + lse_off + rows, lse, mask=rows < rows_left)


@gluon.jit
def query_tile_program(
    q_desc, k_desc, v_desc, CU_Q, CU_K, seqlen_q, seqlen_k, q_batch_rows, k_batch_rows, v_batch_rows,
    q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    TENSOR_DIM: gl.constexpr, VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
):  # fmt: skip
    """What a program over one query tile (program ids: query tile, query head, sequence) walks,
    here and in the dQ kernel (dq.py): its ``Shared`` (two-stage K/V rings over the key tiles it
    sees, barriers initialized), the ``Mask`` of each 64-row half, the first row of its sequence
    in the packed rows (0 unless VARLEN), the batch index of its dense outputs, and the rows of
    its sequence from the tile's first on. Packed documents are read in place: one batch of
    packed rows, document b from row cu[b]. Causal: the heaviest query tiles (the last) are
    launched first."""
    if HAS_RIGHT:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    m0 = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype
    HALF_M: gl.constexpr = BLOCK_M // 2
    if VARLEN:
        q_first = gl.load(CU_Q + b)
        len_q = gl.load(CU_Q + b + 1) - q_first
        k_first = gl.load(CU_K + b)
        len_k = gl.load(CU_K + b + 1) - k_first
        q_row0 = q_first
        k_row0 = k_first
        v_row0 = k_first
        ob = b * 0
    else:
        q_first = b * 0
        len_q = seqlen_q + b * 0
        len_k = seqlen_k + b * 0
        q_row0 = b * q_batch_rows
        k_row0 = b * k_batch_rows
        v_row0 = b * v_batch_rows
        ob = b
    q_pos0 = q_start + q_per_len * len_q + m0 * q_stride
    k_start = k_start + k_per_len * len_k
    rows_left = len_q - m0
    q_hi = q_pos0 + (gl.minimum(rows_left, BLOCK_M) - 1) * q_stride
    t_lo, t_hi, t_full_lo, t_full_hi = key_tiles(
        q_pos0, q_hi, k_start, k_stride, len_k, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_N
    )
    n_tiles = gl.where(rows_left > 0, t_hi - t_lo, 0)

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], tile_layout(q_desc.layout))
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], tile_layout(k_desc.layout))
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], tile_layout(v_desc.layout))
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a stage
        mbarrier.init(v_empty.index(i), count=2)

    p = Shared(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
        q_row0 + m0, k_row0, v_row0, h, h // GROUP, t_hi - 1, n_tiles, TENSOR_DIM,
    )  # fmt: skip
    # Launches specialize integer arguments equal to 1 into constants; the aggregate holds tensors
    # (constants folded back by the compiler).
    zero = b * 0
    q_stride_t = q_stride + zero
    k_stride_t = k_stride + zero
    left_t = left + zero
    right_t = right + zero
    mk0 = Mask(q_pos0, q_stride_t, k_start, k_stride_t, left_t, right_t, len_k, t_full_lo, t_full_hi)
    mk1 = Mask(
        q_pos0 + HALF_M * q_stride, q_stride_t, k_start, k_stride_t, left_t, right_t, len_k, t_full_lo,
        t_full_hi,
    )  # fmt: skip
    return p, mk0, mk1, q_first + m0, ob, rows_left


@gluon.jit
def _fused_fwd_kernel(
    q_desc, k_desc, v_desc, O, LSE, CU_Q, CU_K,
    seqlen_q, seqlen_k, q_batch_rows, k_batch_rows, v_batch_rows,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, qk_scale, tanh_scale,
    ALIBI, q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    TENSOR_DIM: gl.constexpr, VARLEN: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
):  # fmt: skip
    HALF_M: gl.constexpr = BLOCK_M // 2
    p, mk0, mk1, q_tile_row, ob, rows_left = query_tile_program(
        q_desc, k_desc, v_desc, CU_Q, CU_K, seqlen_q, seqlen_k, q_batch_rows, k_batch_rows, v_batch_rows,
        q_start, q_stride, k_start, k_stride, q_per_len, k_per_len, left, right,
        GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, TENSOR_DIM, VARLEN, HAS_LEFT, HAS_RIGHT,
    )  # fmt: skip
    h64 = p.q_head.to(gl.int64)
    o_off = ob.to(gl.int64) * stride_ob + h64 * stride_oh + q_tile_row.to(gl.int64) * stride_os
    lse_off = ob.to(gl.int64) * stride_lb + h64 * stride_lh + q_tile_row
    alibi_ptr = ALIBI + gl.program_id(2) * gl.num_programs(1) + p.q_head  # slopes (batch, heads_q)
    gl.warp_specialize(
        [
            (
                _compute_partition,
                (
                    p,
                    mk0,
                    O,
                    LSE,
                    o_off,
                    stride_os,
                    lse_off,
                    rows_left,
                    qk_scale,
                    tanh_scale,
                    alibi_ptr,
                    0,
                    BLOCK_N,
                    HALF_M,
                    HEAD_DIM,
                    HAS_LEFT,
                    HAS_RIGHT,
                    SOFTCAP,
                    HAS_ALIBI,
                ),
            ),
            (
                _compute_partition,
                (
                    p,
                    mk1,
                    O,
                    LSE,
                    o_off,
                    stride_os,
                    lse_off,
                    rows_left,
                    qk_scale,
                    tanh_scale,
                    alibi_ptr,
                    1,
                    BLOCK_N,
                    HALF_M,
                    HEAD_DIM,
                    HAS_LEFT,
                    HAS_RIGHT,
                    SOFTCAP,
                    HAS_ALIBI,
                ),
            ),
            (_load_partition, (p, HALF_M, BLOCK_N)),
        ],
        [4, 1],
        [COMPUTE_REGS, LOADER_REGS],
    )


class QueryTileLaunch(NamedTuple):
    """What a launch of a kernel over query tiles (``query_tile_program``: this kernel and
    dq.py's) passes: the grid, q/k/v's TMA descriptors and rows per batch entry, the LSE's
    (batch, head) strides, cu_seqlens (or stand-ins never read), ALiBi's slopes (or a stand-in),
    the window's bounds and the constexprs with the launch options."""

    grid: tuple[int, int, int]
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
    head_dim = run_head_dim(problem.head_dim, HEAD_DIMS)
    varlen = problem.varlen
    q4, k4, v4 = (t.unsqueeze(0) if varlen else t for t in (q, k, v))
    qd, q_rows = rows_descriptor(q4, HALF_M, head_dim)
    kd, k_rows = rows_descriptor(k4, block_n, head_dim)
    vd, v_rows = rows_descriptor(v4, block_n, head_dim)
    bounds = problem.bounds
    return QueryTileLaunch(
        grid=((problem.max_seqlen_q + BLOCK_M - 1) // BLOCK_M, problem.heads_q, problem.batch),
        descriptors=(qd, kd, vd),
        rows=(q_rows, k_rows, v_rows),
        lse_strides=(0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1)),
        cu_q=problem.cu_seqlens_q if varlen else lse,
        cu_k=problem.cu_seqlens_k if varlen else lse,
        slopes=lse if problem.alibi_slopes is None else problem.alibi_slopes,
        window=(bounds.left or 0, bounds.right or 0),
        constexprs=dict(
            GROUP=problem.group, BLOCK_M=BLOCK_M, BLOCK_N=block_n, HEAD_DIM=head_dim,
            TENSOR_DIM=problem.head_dim, VARLEN=varlen, HAS_LEFT=bounds.left is not None,
            HAS_RIGHT=bounds.right is not None, SOFTCAP=bool(problem.softcap),
            HAS_ALIBI=problem.alibi_slopes is not None, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
        ),
    )  # fmt: skip


def fused_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    out: torch.Tensor,
    lse: torch.Tensor,
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
    tensors' head_dim by TMA (``tma.rows_descriptor``)."""
    launch = query_tile_launch(q, k, v, problem, lse, BLOCK_N[run_head_dim(problem.head_dim, HEAD_DIMS)])
    o4 = out.unsqueeze(0) if problem.varlen else out
    _fused_fwd_kernel[launch.grid](
        *launch.descriptors, out, lse, launch.cu_q, launch.cu_k, problem.max_seqlen_q, problem.max_seqlen_k,
        *launch.rows, *o4.stride()[:3], *launch.lse_strides, *score_scales(problem), launch.slopes,
        *problem.position_args(), *launch.window, **launch.constexprs,
    )  # fmt: skip
