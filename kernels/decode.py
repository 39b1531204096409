"""Split-KV attention over a KV cache ("flash-decoding"): the kernel behind ``flash_attn_with_kvcache``.

A decode step has one query row (or a few: chunked prefill, speculative tokens) per head, too
few rows to fill a GPU by tiling the queries, so the keys are split instead: program (split,
sequence x KV head, query tile) walks its split's key tiles once for all the query heads that
share the KV head (``group`` of them: each K/V byte is read once per split), and writes a
float32 partial output and LSE, and ``merge_splits`` folds the splits with the merge rule in
one more launch (a single split writes the result itself).

Keys sit in a cache, dense (cache_rows, capacity, heads_k, head_dim) with the sequence's row
from ``batch_idx``, or paged (pages, page_size, heads_k, head_dim) with the row of key j on page
``block_table[b, j // page_size]``. Sequence b has ``seqlens_k[b]`` keys; query t of
``seqlen_q`` sits at position seqlens_k[b] - seqlen_q + t (the bottom-right alignment of
flash-attn's causal mask), and the window/causal bounds, softcap and ALiBi are those of the
other kernels (``scores.py``), in the log2 domain.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .configs import INTERPRET, block_d, next_power_of_2
from .forward import dot_precision
from .launcher import PreparedLaunch, launch
from .scores import LOG2E, tanh

NUM_WARPS, NUM_STAGES = 4, 3
# A paged cache's tile waits for its page-table entry before its keys can be asked for, which
# the software pipeline does not hide: more programs per SM do (measured on an H200, pages of
# 16-256 tokens: 1.5-2.2x the dense time at one program per SM, 1.02-1.07x at four, with
# 64-key tiles and two stages). And the fewest keys a split is given.
PAGED_PROGRAMS_PER_SM = 4
PAGED_BLOCK_N, PAGED_STAGES = 64, 2
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 128
# The split kernel's integer arguments that follow the caches' length come first (after its
# tensors), this many: a launch over keys whose number changes call by call keys them by
# Triton's specialization of them, not their values (``launcher.SizedLaunch``).
SIZED_INTS = 9


@triton.jit
def _split_kv_kernel(
    Q, K, V, OUT, LSE, SEQLENS, BATCH_IDX, BLOCK_TABLE, SLOPES, LEFTPAD,
    # The SIZED_INTS: what follows the caches' length (few_queries.py passes them per call).
    seqlen_new, local_capacity, keys_per_split, slots, page_size, stride_kb, stride_kh, stride_vb, stride_vh,
    seqlen_q, key_offset, group, heads_k, table_stride, slopes_stride, lse_base, spread_from, spread_rank,
    spread_world, stride_qb, stride_qs, stride_qh, stride_ks, stride_vs,
    stride_os, stride_ob, stride_oq, stride_oh, stride_ls, stride_lb, stride_lh,
    qk_scale, softcap_log2, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    PAGED: tl.constexpr, WHOLE_TILES: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPREAD: tl.constexpr, HAS_SEQLENS: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    bk = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = bk // heads_k
    hk = bk % heads_k
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row r: query t = r // group, head hk * group + r % group
    row_ok = rows < seqlen_q * group
    t = rows // group
    h = hk * group + rows % group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if HAS_SEQLENS:
        seqlen_k = tl.load(SEQLENS + b) + seqlen_new  # the cache's keys, then the appended ones
    else:  # keys given whole (few_queries.py): seqlen_new of them, every sequence alike
        seqlen_k = seqlen_new
    q_pos = seqlen_k - seqlen_q + t  # bottom-right aligned, in the sequence's positions
    # This cache holds the keys at positions key_offset .. key_offset + local_capacity - 1 (all
    # of them on one device; a shard of them with sequence parallelism); j below is local. With
    # SPREAD, slots local_capacity .. slots - 1 then hold positions spread_from + spread_rank,
    # + spread_world, ...: the tokens past spread_from that this rank of spread_world took.
    local_k = tl.minimum(tl.maximum(seqlen_k - key_offset, 0), local_capacity)
    if SPREAD:
        tail = seqlen_k - spread_from - spread_rank
        local_k += tl.where(tail > 0, (tail + spread_world - 1) // spread_world, 0)
        local_k = tl.minimum(local_k, slots)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, local_k)
    # Tiles outside the rows' bounds are skipped where positions follow the slots (not SPREAD).
    if HAS_RIGHT and not SPREAD:  # no key past the last row's bound
        last = seqlen_k - seqlen_q + (pid_m * BLOCK_M + BLOCK_M - 1) // group
        end = tl.minimum(end, last + window_right + 1 - key_offset)
    if HAS_LEFT and not SPREAD:  # no tile before the first row's bound
        first = seqlen_k - seqlen_q + (pid_m * BLOCK_M) // group - window_left - key_offset
        start = tl.maximum(start, tl.maximum(first, 0) // BLOCK_N * BLOCK_N)
    if HAS_LEFTPAD:  # the sequence's keys start at position LEFTPAD[b] (flash-attn's cache_leftpad)
        leftpad = tl.load(LEFTPAD + b)
        if not SPREAD:
            start = tl.maximum(start, tl.maximum(leftpad - key_offset, 0) // BLOCK_N * BLOCK_N)
    b64 = b.to(tl.int64)
    q_ptrs = (
        Q + b64 * stride_qb + t[:, None].to(tl.int64) * stride_qs + h[:, None] * stride_qh + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b64 * slopes_stride + h, mask=row_ok, other=0.0) * 1.4426950408889634
    hk64 = hk.to(tl.int64)  # a head stride may be a whole sequence's (keys given as (b, h, s, d) views)
    if PAGED:
        k_base = K + hk64 * stride_kh
        v_base = V + hk64 * stride_vh
    else:
        row = b64
        if HAS_BATCH_IDX:
            row = tl.load(BATCH_IDX + b).to(tl.int64)
        k_base = K + row * stride_kb + hk64 * stride_kh
        v_base = V + row * stride_vb + hk64 * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        if PAGED and WHOLE_TILES:  # the tile lies in one page: one table entry, contiguous rows
            page = tl.load(BLOCK_TABLE + b64 * table_stride + n0 // page_size).to(tl.int64)
            in_page = (n0 % page_size + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_rows = page * stride_kb + in_page * stride_ks
            v_rows = page * stride_vb + in_page * stride_vs
        elif PAGED:
            page = tl.load(BLOCK_TABLE + b64 * table_stride + cols // page_size, mask=col_ok, other=0).to(
                tl.int64
            )
            k_rows = page * stride_kb + (cols % page_size) * stride_ks
            v_rows = page * stride_vb + (cols % page_size) * stride_vs
        else:
            k_rows = cols.to(tl.int64) * stride_ks
            v_rows = cols.to(tl.int64) * stride_vs
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            s = tanh(qk * qk_scale) * softcap_log2
        else:
            s = qk * qk_scale
        if SPREAD:
            k_pos = tl.where(
                cols < local_capacity, key_offset + cols,
                spread_from + spread_rank + (cols - local_capacity) * spread_world,
            )  # fmt: skip
        else:
            k_pos = key_offset + cols
        if HAS_ALIBI:
            s -= slope[:, None] * tl.abs((q_pos[:, None] - k_pos[None, :]).to(tl.float32))
        visible = row_ok[:, None] & col_ok[None, :]
        if HAS_RIGHT:
            visible &= k_pos[None, :] <= q_pos[:, None] + window_right
        if HAS_LEFT:
            visible &= k_pos[None, :] >= q_pos[:, None] - window_left
        if HAS_LEFTPAD:
            visible &= k_pos[None, :] >= leftpad
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen: no NaN
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    o_ptrs = (
        OUT + split * stride_os + b64 * stride_ob + t[:, None].to(tl.int64) * stride_oq
        + h[:, None] * stride_oh + offs_d[None, :]
    )  # fmt: skip
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + lse_base + split * stride_ls + b64 * stride_lb + h * stride_lh + t, lse, mask=row_ok)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_m(rows: int) -> int:
    """Query rows (tokens x the query heads of one KV head) per program."""
    return max(16, min(64, next_power_of_2(rows)))


def block_n(head_dim: int, element_size: int) -> int:
    """Keys per tile: 32 KiB of K rows (128 rows of bf16 head_dim 128; 64 of 256 or of float32
    128), so that three pipelined K and V tiles fit in shared memory."""
    if INTERPRET:  # small tiles: CPU tests cross tile, split and page boundaries at small sizes
        return 16
    return max(16, min(128, 32768 // (block_d(head_dim) * element_size)))


def default_splits(
    batch: int, heads_k: int, rows: int, capacity: int, device: torch.device, paged: bool = False
) -> int:
    """``num_splits=0``: as many splits as fit the batch's (sequence, KV head, query tile)
    programs (``rows`` query rows per KV head) into one program per SM, rounded down (a few
    programs more than the SMs would make a second wave of nearly nothing: measured on an
    H200, 17 splits over 8 KV heads ran 0.9x of 16), or ``PAGED_PROGRAMS_PER_SM`` per SM over
    a paged cache, each split at least ``MIN_KEYS_PER_SPLIT`` keys of the cache's
    ``capacity`` (the keys in use are on the device: the host reads none)."""
    query_tiles = -(-rows // _block_m(rows))
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 1
    fitting = (PAGED_PROGRAMS_PER_SM if paged else 1) * sms // (batch * heads_k * query_tiles)
    return max(1, min(fitting, -(-capacity // MIN_KEYS_PER_SPLIT), MAX_SPLITS))


class SplitKVPlan(NamedTuple):
    """What a split-KV call derives from shapes, strides and options (``plan_split_kv``):
    built once per such key by the caller, run by ``run_split_kv`` with the call's tensors."""

    grid: tuple[int, int, int]
    split: PreparedLaunch  # the kernel with its arguments after the tensors (sizes, strides, scales)
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    lse_shape: tuple[int, ...]
    parts: int  # float32 elements of the splits' partials (0: one split writes the result)
    merge: tuple[tuple[int], PreparedLaunch] | None  # the merge's grid and launch


def plan_split_kv(
    q_shape: tuple[int, int, int, int],
    q_stride: tuple[int, ...],
    dtype: torch.dtype,
    cache_shape: tuple[int, int, int, int],
    k_stride: tuple[int, ...],
    v_stride: tuple[int, ...],
    seqlen_new: int,
    *,
    softmax_scale: float,
    window: tuple[int | None, int | None],
    softcap: float,
    alibi_batch_stride: int | None,
    batch_idx: bool,
    table_stride: int | None,
    leftpad: bool,
    num_splits: int,
    key_offset: int,
    held: int,
    out_dtype: torch.dtype,
    spread: tuple[int, int, int, int] | None = None,
    seqlens: bool = True,
    out_stride: tuple[int, ...] | None = None,
) -> SplitKVPlan:
    """The launch of ``_split_kv_kernel`` (and of the merge) for q of ``q_shape`` (batch,
    seqlen_q, heads_q, head_dim) over caches of ``cache_shape``; arguments as
    ``split_kv_attention``'s, tensors given by what the launch needs of them: strides,
    ``alibi_batch_stride`` (0 for slopes shared by the batch; None: no ALiBi),
    ``table_stride`` (None: a dense cache), whether ``batch_idx``/``leftpad`` are given.
    ``spread``: None, or (spread_from, rank, world, slots): the cache's slots past ``held``
    (up to ``slots``) hold the positions from spread_from on that fall to ``rank`` of ``world``
    when they are dealt out round-robin (position p on rank (p - spread_from) % world).
    ``seqlens=False``: no cache_seqlens tensor (the launch passes None for it): every sequence
    has ``seqlen_new`` keys, all in the cache. ``out_stride``: the output's strides (unit
    stride in head_dim; default contiguous)."""
    batch, seqlen_q, heads_q, head_dim = q_shape
    heads_k = cache_shape[2]
    group = heads_q // heads_k
    rows = seqlen_q * group
    block_m = _block_m(rows)
    query_tiles = -(-rows // block_m)
    tile, stages = block_n(head_dim, dtype.itemsize), NUM_STAGES
    paged = table_stride is not None
    page_size = cache_shape[1]
    if paged:  # see PAGED_PROGRAMS_PER_SM
        tile, stages = min(tile, PAGED_BLOCK_N), PAGED_STAGES
    spread_from, spread_rank, spread_world, slots = spread or (0, 0, 1, held)
    keys_per_split = -(-slots // (num_splits * tile)) * tile
    lse_shape = (batch, heads_q, seqlen_q)
    n_out, n_lse = batch * seqlen_q * heads_q * head_dim, batch * heads_q * seqlen_q
    out_strides = (seqlen_q * heads_q * head_dim, heads_q * head_dim, head_dim)
    if out_stride is not None:
        out_strides = tuple(out_stride[:3])
    if num_splits == 1:  # the kernel writes the result (out, lse): strides of those
        part_strides = (0, *out_strides)
        lse_strides = (0, heads_q * seqlen_q, seqlen_q)
        lse_base, parts = 0, 0
    else:  # float32 partials (splits, *q_shape), then their LSEs (splits, *lse_shape), one buffer
        part_strides = (n_out, seqlen_q * heads_q * head_dim, heads_q * head_dim, head_dim)
        lse_strides = (n_lse, heads_q * seqlen_q, seqlen_q)
        lse_base, parts = num_splits * n_out, num_splits * (n_out + n_lse)
    left, right = window
    qk_scale, softcap_log2 = (
        (softmax_scale / softcap, softcap * LOG2E) if softcap else (softmax_scale * LOG2E, None)
    )
    ints = (
        seqlen_new, held, keys_per_split, slots, page_size, k_stride[0], k_stride[2], v_stride[0],
        v_stride[2], seqlen_q, key_offset, group, heads_k, table_stride or 0, alibi_batch_stride or 0,
        lse_base, spread_from, spread_rank, spread_world, *q_stride[:3], k_stride[1], v_stride[1],
        *part_strides, *lse_strides, qk_scale, softcap_log2, left or 0, right or 0,
    )  # fmt: skip
    meta = (
        ("HEAD_DIM", head_dim), ("BLOCK_D", block_d(head_dim)), ("BLOCK_M", block_m), ("BLOCK_N", tile),
        ("HAS_LEFT", left is not None), ("HAS_RIGHT", right is not None), ("HAS_SOFTCAP", bool(softcap)),
        ("HAS_ALIBI", alibi_batch_stride is not None), ("PAGED", paged),
        ("WHOLE_TILES", paged and page_size % tile == 0), ("HAS_BATCH_IDX", batch_idx),
        ("HAS_LEFTPAD", leftpad), ("DOT_PRECISION", dot_precision(dtype)), ("SPREAD", spread is not None),
        ("HAS_SEQLENS", seqlens),
        ("num_warps", NUM_WARPS), ("num_stages", stages),
    )  # fmt: skip
    merge = None
    if num_splits > 1:
        merge_grid, merge_ints, merge_meta = _merge_launch(
            num_splits, q_shape, part_strides, lse_base, lse_strides, out_strides,
            (heads_q * seqlen_q, seqlen_q),
        )
        merge = (merge_grid, PreparedLaunch(_merge_splits_kernel, merge_ints, dict(merge_meta)))
    grid = (num_splits, batch * heads_k, query_tiles)
    split = PreparedLaunch(_split_kv_kernel, ints, dict(meta))
    return SplitKVPlan(grid, split, tuple(q_shape), out_dtype, lse_shape, parts, merge)


def run_split_kv(
    plan: SplitKVPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    leftpad: torch.Tensor | None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``plan``'s launches over these tensors (those it was planned for: same shapes, strides,
    dtypes): (out, lse) as ``split_kv_attention``'s, written into ``out``/``lse`` where given
    (contiguous, of the plan's shapes and dtypes)."""
    if out is None:
        out = torch.empty(plan.out_shape, device=q.device, dtype=plan.out_dtype)
    if lse is None:
        lse = torch.empty(plan.lse_shape, device=q.device, dtype=torch.float32)
    work = torch.empty(plan.parts, device=q.device, dtype=torch.float32) if plan.parts else None
    plan.split(
        plan.grid, q, k_cache, v_cache, out if work is None else work, lse if work is None else work,
        cache_seqlens, batch_idx, block_table, alibi_slopes, leftpad,
    )  # fmt: skip
    if work is not None:
        grid, merge = plan.merge
        merge(grid, work, work, out, lse)
    return out, lse


def split_kv_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    seqlen_new: int,
    *,
    softmax_scale: float,
    window: tuple[int | None, int | None],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    num_splits: int,
    key_offset: int,
    held: int,
    out_dtype: torch.dtype | None = None,
    leftpad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q (batch, seqlen_q, heads_q, head_dim) over the cache's first
    cache_seqlens[b] + seqlen_new keys of each sequence, checked by the caller (``kvcache.py``,
    which plans once per key: ``plan_split_kv`` + ``run_split_kv``, this function's two halves).
    The cache holds the keys from position ``key_offset`` on (0; more for a shard of a sequence
    whose earlier keys are elsewhere): the first cache_seqlens[b] + seqlen_new - key_offset of
    them, at most ``held`` (at most its capacity); masks and ALiBi see the sequence's positions.
    out_dtype: the output's (default q's; float32 keeps a shard's partial unrounded for a later merge).
    leftpad: (batch,) int32 or None: sequence b's keys start at that position (earlier rows
    are padding), as flash-attn's cache_leftpad; positions stay the cache's rows.

    k_cache/v_cache: (cache_rows, capacity, heads_k, head_dim), or (pages, page_size, heads_k,
    head_dim) with ``block_table`` (batch, pages per sequence) int32; unit stride in head_dim.
    cache_seqlens: (batch,) int32 on q's device. window: (left, right) bounds around each
    query's position, None = unbounded (causal: right 0). alibi_slopes: float32 (heads_q,) or
    (batch, heads_q), unit stride in heads, or None. batch_idx: (batch,) int32 cache rows or
    None (row b). num_splits >= 1: one writes the result directly, more write float32 partials
    that the merge rule folds in one more launch. Returns out (batch, seqlen_q, heads_q,
    head_dim) in q's dtype and float32 lse (batch, heads_q, seqlen_q); rows that see no key get
    out 0 and lse -inf."""
    alibi_batch_stride = None
    if alibi_slopes is not None:
        alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    plan = plan_split_kv(
        tuple(q.shape), q.stride(), q.dtype, tuple(k_cache.shape), k_cache.stride(), v_cache.stride(),
        seqlen_new, softmax_scale=softmax_scale, window=window, softcap=softcap,
        alibi_batch_stride=alibi_batch_stride,
        batch_idx=batch_idx is not None, table_stride=None if block_table is None else block_table.stride(0),
        leftpad=leftpad is not None, num_splits=num_splits, key_offset=key_offset, held=held,
        out_dtype=out_dtype or q.dtype,
    )  # fmt: skip
    tensors = (cache_seqlens, batch_idx, block_table, alibi_slopes, leftpad)
    return run_split_kv(plan, q, k_cache, v_cache, *tensors)


@triton.jit
def _merge_splits_kernel(
    PARTS, LSES, OUT, LSE, seqlen_q, heads, splits, lse_base,
    stride_ps, stride_pb, stride_pq, stride_ph, stride_ls, stride_lb, stride_lh,
    stride_ob, stride_oq, stride_oh, stride_eb, stride_eh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # (b, t, h) of out
    h = row % heads
    t = (row // heads) % seqlen_q
    b = (row // heads // seqlen_q).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < splits
    l_ptrs = LSES + lse_base + offs_s * stride_ls + b * stride_lb + h * stride_lh + t
    lses = tl.load(l_ptrs, mask=s_ok, other=float("-inf"))
    top = tl.max(lses, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: out 0, lse -inf
    w = tl.exp(lses - top)
    total = tl.sum(w, 0)
    p_ptrs = (
        PARTS + offs_s[:, None].to(tl.int64) * stride_ps + b * stride_pb + t * stride_pq + h * stride_ph
        + offs_d[None, :]
    )  # fmt: skip
    parts = tl.load(p_ptrs, mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    o_ptrs = OUT + b * stride_ob + t * stride_oq + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
    lse = tl.where(total > 0.0, top + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(LSE + b * stride_eb + h * stride_eh + t, lse)


def _merge_launch(
    splits: int, shape: tuple, part_strides: tuple, lse_base: int, lse_strides: tuple, out_strides: tuple,
    merged_lse_strides: tuple,
) -> tuple:
    """(grid, ints, meta) of ``_merge_splits_kernel`` over partials of (splits, *shape)."""
    batch, seqlen_q, heads, head_dim = shape
    ints = (seqlen_q, heads, splits, lse_base, *part_strides, *lse_strides, *out_strides, *merged_lse_strides)
    block_s = max(2, next_power_of_2(splits))
    meta = (("HEAD_DIM", head_dim), ("BLOCK_D", block_d(head_dim)), ("BLOCK_S", block_s))
    return (batch * seqlen_q * heads,), ints, meta


def merge_splits(parts: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The merge rule over the leading split dimension, in one launch: parts (splits, batch,
    seqlen, heads, head_dim) float32 and lses (splits, batch, heads, seqlen) float32 into out
    (batch, seqlen, heads, head_dim, any float dtype, unit stride in head_dim) and lse (batch,
    heads, seqlen, unit stride in seqlen); a row that no split saw gets out 0 and lse -inf."""
    splits, batch, seqlen_q, heads, head_dim = parts.shape
    if batch * seqlen_q * heads == 0:
        return
    grid, ints, meta = _merge_launch(
        splits, (batch, seqlen_q, heads, head_dim), parts.stride()[:4], 0, lses.stride()[:3],
        out.stride()[:3], lse.stride()[:2],
    )  # fmt: skip
    launch(_merge_splits_kernel, grid, parts, lses, out, lse, *ints, **dict(meta))
