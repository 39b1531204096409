"""All-gather sequence parallelism: every rank gathers the whole sequence's K/V, a few heads at a time.

Each rank keeps its query shard and gathers the K/V shards of every rank, ``heads_k_stride`` K/V
heads per step, into the full sequence's natural token order; the gather of the next heads is
issued before the current heads' kernels, so it overlaps them. A local query segment then sees
one contiguous run of keys (its document, for packed documents), so each query row is computed
by exactly one kernel call: no partial results to merge, and packed documents need no padding
beyond the layout's own. Backward: the same gathers again; each rank computes dK/dV of the whole
sequence for its queries into a float32 buffer and a reduce-scatter sums the ranks' buffers into
each shard's owner, overlapping the next heads' kernels.

Against the ring: the same bytes cross the links (W-1 shards' K/V forward, plus their gradients
backward), but in collectives rather than W-1 dependent steps, and each rank holds
(W x shard) x ``heads_k_stride`` K/V heads at a time (two such buffers where there are several
strides) instead of two shards of all heads. ``llama3.py`` runs ring-flash-attn's llama3 forms
on the same engine.

Dense setups replay their forward and backward from CUDA graphs with the collectives issued
between them (``graph_replay.py``, as the ring's).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.distributed as dist

from .block_masks import MaskedCall, check_block_mask, converted_block_mask, dense_calls, gathered_keys_mask
from .comm import all_gather_async, reduce_scatter_async, resolve_group_or_raise
from .consistency import join_cached_rank_check, join_rank_check
from .graph_replay import ReplayCache, Replays, backward_replay, replay_wanted
from .kernels import (
    AttentionProblem,
    MaskBounds,
    TokenPositions,
    Visibility,
    attention_delta,
    block_visibility,
    build_problem,
    check_sinks,
)
from .kernels.tile_mask import TileMask
from .layouts import cumulative_lengths, full_document_lengths, layout_indices, segments
from .ring import check_shards
from .setup_cache import SetupCache
from .word_views import as_words

_UNMASKED = MaskBounds(None, None)


@dataclass(frozen=True)
class GatherCall(MaskedCall):
    """One kernel launch of one head stride: index tuples of its q rows/heads in the local
    (batch, n, heads_q, head_dim) tensors, its key rows in the gathered (batch, S, stride,
    head_dim) K/V, its LSE entries in the local (batch, heads_q, n) LSE, its problem, and its
    view of the block mask where the call has one."""

    q_index: tuple
    k_index: tuple
    lse_index: tuple
    problem: AttentionProblem
    mask: TileMask | None = None


@dataclass(frozen=True)
class GatherPlan:
    """What a call runs, built once per call signature (``SETUPS``): ``steps[i]``, the kernel
    calls of head stride i (K/V heads [i * stride, (i + 1) * stride)); ``order``: the gathered
    rows (shard after shard) that make the natural token order, None where they already do."""

    stride: int
    steps: tuple[tuple[GatherCall, ...], ...]
    order: torch.Tensor | None
    complete: bool  # every local query row is computed by some call (else out/LSE start as 0/-inf)


@dataclass(frozen=True)
class RowCall:
    """A call over all K/V heads, before the plan cuts it into head strides: q rows ``q_rows``
    of the local shard against gathered key rows ``k_rows`` (natural order), ``varlen``: over
    packed documents of the single batch row (3-D views), else dense over every batch row."""

    q_rows: slice
    k_rows: slice
    varlen: bool
    problem: AttentionProblem


def default_heads_k_stride(heads_k: int) -> int:
    """K/V heads per gather when the caller does not say: all of them, one gather. Smaller strides
    overlap the gathers with kernels but give each kernel fewer heads: on 2 H200s (GQA 32/8, causal
    zigzag, 4K-64K tokens per rank) 4 strides of 2 heads ran fwd+bwd at 0.39-0.98x one stride of 8
    (docs/experiments.md). Pass a divisor of heads_k to bound the memory of the gathered K/V."""
    return heads_k


def check_heads_k_stride(heads_k_stride: object, heads_k: int) -> int:
    if heads_k_stride is None:
        return default_heads_k_stride(heads_k)
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int):
        raise TypeError(f"heads_k_stride must be an int or None, got {type(heads_k_stride).__name__}")
    if heads_k_stride < 1 or heads_k % heads_k_stride:
        raise ValueError(
            f"heads_k_stride must be a positive divisor of the k/v heads ({heads_k}), got {heads_k_stride}"
        )
    return heads_k_stride


def _stride_call(call: RowCall, i: int, stride: int, group: int, mask: TileMask | None) -> GatherCall:
    hq = slice(i * stride * group, (i + 1) * stride * group)
    p = replace(call.problem, heads_q=stride * group, heads_k=stride)
    if p.alibi_slopes is not None:
        p = replace(p, alibi_slopes=p.alibi_slopes[:, hq].contiguous())
    if call.varlen:
        return GatherCall((0, call.q_rows, hq), (0, call.k_rows), (0, hq, call.q_rows), p)
    every = slice(None)
    mask = None if mask is None else mask.select_heads(hq.start, hq.stop)
    return GatherCall((every, call.q_rows, hq), (every, call.k_rows), (every, hq, call.q_rows), p, mask)


def gather_plan(
    calls: Sequence[RowCall], heads_k: int, stride: int, rows: int, order: torch.Tensor | None,
    mask: TileMask | None = None,
) -> GatherPlan:  # fmt: skip
    """Cut ``calls`` (over all heads) into head strides; ``rows``: the local query rows;
    ``mask``: the local queries' view of a block mask over the gathered keys (natural order)."""
    covered = sum(c.q_rows.stop - c.q_rows.start for c in calls)
    group = calls[0].problem.group if calls else 1
    steps = tuple(
        tuple(_stride_call(c, i, stride, group, mask) for c in calls) for i in range(heads_k // stride)
    )
    return GatherPlan(stride, steps, order, complete=covered == rows)


def layout_calls(
    base: AttentionProblem, layout: str, rank: int, world: int, doc_lens: tuple[int, ...], varlen: bool,
    device: torch.device,
) -> list[RowCall]:  # fmt: skip
    """The calls of ``sp_mode="allgather"``: each local segment of ``layout`` against the keys it
    can see in the gathered sequence (natural order): dense, the run of keys within reach of its
    queries; packed documents, each document's chunk against the whole document (one varlen call
    per segment)."""
    total = sum(doc_lens)
    calls = []
    for seg in segments(layout, rank, world, doc_lens):
        q_rows = slice(seg.local_start, seg.local_start + seg.length)
        if varlen:
            k_pos = TokenPositions()
            seen = {
                block_visibility(seg.positions, nq, k_pos, nk, base.bounds)
                for nq, nk in zip(seg.seq_lens, doc_lens)
            }
            if seen == {Visibility.NONE}:
                continue
            full = seen == {Visibility.FULL} and base.alibi_slopes is None
            slopes = None if base.alibi_slopes is None else base.alibi_slopes[:1].expand(len(doc_lens), -1)
            problem = replace(
                base, batch=len(doc_lens), max_seqlen_q=max(seg.seq_lens), max_seqlen_k=max(doc_lens),
                cu_seqlens_q=cumulative_lengths(seg.seq_lens, device),
                cu_seqlens_k=cumulative_lengths(doc_lens, device), q_positions=seg.positions,
                k_positions=k_pos, bounds=_UNMASKED if full else base.bounds, alibi_slopes=slopes,
            )  # fmt: skip
            calls.append(RowCall(q_rows, slice(0, total), True, problem))
            continue
        q_pos = seg.positions.resolved(seg.length)
        lo, hi = q_pos.start, q_pos.at(seg.length - 1)  # the segment's first and last query
        b = base.bounds
        k_lo = 0 if b.left is None else min(max(0, lo - b.left), total)
        k_hi = total if b.right is None else max(0, min(total, hi + b.right + 1))
        k_pos = TokenPositions(k_lo)
        vis = block_visibility(q_pos, seg.length, k_pos, k_hi - k_lo, b)
        if vis is Visibility.NONE:
            continue
        masked = vis is Visibility.PARTIAL or base.alibi_slopes is not None
        problem = replace(
            base, max_seqlen_q=seg.length, max_seqlen_k=k_hi - k_lo, q_positions=q_pos, k_positions=k_pos,
            bounds=base.bounds if masked else _UNMASKED,
        )  # fmt: skip
        calls.append(RowCall(q_rows, slice(k_lo, k_hi), False, problem))
    return calls


def natural_order(
    layout: str, world: int, total: int, cu_seqlens: tuple[int, ...] | None, device: torch.device | str
) -> torch.Tensor | None:
    """Rows of the gathered shards (rank 0's local tokens, rank 1's, ...) in global token
    order, or None where that is already the case (contiguous shards of one sequence). Built
    once per arguments: a call must not wait for its copy to the device."""
    if layout == "contiguous" and cu_seqlens is None or world == 1:
        return None
    return _natural_order(layout, world, total, cu_seqlens, torch.device(device))


@lru_cache(maxsize=64)
def _natural_order(layout, world, total, cu_seqlens, device) -> torch.Tensor:
    held = torch.cat([layout_indices(layout, r, world, total, cu_seqlens=cu_seqlens) for r in range(world)])
    return torch.argsort(held).to(device)


def _gathered_natural(buf: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """(W, B, n, h, D) gathered shards -> (B, W * n, h, D) in natural token order (a view for
    contiguous shards of batch 1)."""
    w, b, n, h, d = buf.shape
    seq = buf.view(w * n, h, d)[None] if b == 1 else buf.permute(1, 0, 2, 3, 4).reshape(b, w * n, h, d)
    # index_select runs near bandwidth on 2-byte rows already (docs/experiments.md §84).
    return seq if order is None else seq.index_select(1, order)


def _to_shards(grad: torch.Tensor, order: torch.Tensor | None, world: int) -> torch.Tensor:
    """The transpose of ``_gathered_natural``: (B, S, h, D) in natural order -> (W, B, n, h, D),
    contiguous (a view for contiguous shards of batch 1)."""
    b, total, h, d = grad.shape
    if order is not None:  # the scatter, unlike the gather, runs 1.4-2.3x faster on 8-byte words
        (words,) = as_words([grad])
        grad = torch.empty_like(words).index_copy_(1, order, words).view(grad.dtype)
    shards = grad.view(b, world, total // world, h, d).transpose(0, 1)
    return shards if b == 1 else shards.contiguous()


class _Gather:
    """The double-buffered, overlapped all-gather of K/V, one head stride after another."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, plan: GatherPlan, group: dist.ProcessGroup) -> None:
        self.k, self.v, self.plan, self.group = k, v, plan, group
        self.world = w = dist.get_world_size(group)
        b, n, _, d = k.shape
        copies = min(2, len(plan.steps))  # double-buffered where there is a next stride to gather
        self.bufs = [[k.new_empty((w, b, n, plan.stride, d)) for _ in range(2)] for _ in range(copies)]
        self.pending = self._start(0)

    def _start(self, i: int):
        s = self.plan.stride
        heads = slice(i * s, (i + 1) * s)
        buf = self.bufs[i % 2]
        return all_gather_async(buf, (self.k[:, :, heads], self.v[:, :, heads]), self.group, self.world)

    def take(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stride i's gathered K/V in natural order; starts stride i + 1's gather first."""
        self.pending.wait()
        self.pending = self._start(i + 1) if i + 1 < len(self.plan.steps) else None
        buf = self.bufs[i % 2]
        return _gathered_natural(buf[0], self.plan.order), _gathered_natural(buf[1], self.plan.order)


def gather_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: GatherPlan, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over local shards q (B, n, Hq, D), k/v (B, n, Hk, D); returns (out, lse (B, Hq, n))."""
    b, n, hq, _ = q.shape
    if plan.complete:
        out = torch.empty_like(q)
        lse = torch.empty((b, hq, n), device=q.device, dtype=torch.float32)
    else:  # rows no call computes see no key
        out = torch.zeros_like(q)
        lse = torch.full((b, hq, n), float("-inf"), device=q.device, dtype=torch.float32)
    gather = _Gather(k, v, plan, group)
    for i, calls in enumerate(plan.steps):
        k_all, v_all = gather.take(i)
        for c in calls:
            c.forward(q[c.q_index], k_all[c.k_index], v_all[c.k_index], out[c.q_index], lse[c.lse_index])
    return out, lse


def gather_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    base: AttentionProblem,
    plan: GatherPlan,
    group: dist.ProcessGroup,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward from the final (out, lse); returns (dq, dk, dv) in the inputs' dtypes. ``base``:
    the dense problem of the local shard (for delta); ``dlse``: the returned LSE's gradient, if
    any (delta_i -= dlse_i, as in ``ring.ring_backward``).

    Stride i's dK/dV of the whole sequence go into one of two float32 buffer pairs, whose
    reduce-scatter to the shards' owners runs while stride i + 1 computes; a pair is reused only
    after its previous reduce-scatter is done."""
    delta = attention_delta(out, dout, base)
    if dlse is not None:
        delta -= dlse
    w = dist.get_world_size(group)
    b, n, hk, d = k.shape
    s = plan.stride
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    f32 = dict(device=k.device, dtype=torch.float32)
    copies = min(2, len(plan.steps))
    total = [[torch.empty((b, w * n, s, d), **f32) for _ in range(2)] for _ in range(copies)]
    mine = [[torch.empty((b, n, s, d), **f32) for _ in range(2)] for _ in range(copies)]
    pending: list = [None, None]
    gather = _Gather(k, v, plan, group)

    def finish(i: int) -> None:
        pending[i % 2].wait()
        heads = slice(i * s, (i + 1) * s)
        dk[:, :, heads].copy_(mine[i % 2][0])
        dv[:, :, heads].copy_(mine[i % 2][1])

    for i, calls in enumerate(plan.steps):
        k_all, v_all = gather.take(i)
        if i >= 2:
            finish(i - 2)
        grads = total[i % 2]
        for t in grads:
            t.zero_()
        for c in calls:
            qi, li = c.q_index, c.lse_index
            c.backward(dout[qi], q[qi], k_all[c.k_index], v_all[c.k_index], lse[li], delta[li], dq=dq[qi],
                       dk=grads[0][c.k_index], dv=grads[1][c.k_index], accumulate=True)  # fmt: skip
        shards = [_to_shards(t, plan.order, w) for t in grads]
        pending[i % 2] = reduce_scatter_async(mine[i % 2], shards, group, w)
    for i in range(max(0, len(plan.steps) - 2), len(plan.steps)):
        finish(i)
    return dq.to(q.dtype), dk, dv


# The all-gather mode's graphs by (plan, group), as the ring's (``ring.REPLAYS``).
REPLAYS = ReplayCache()


def gather_replays(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: AttentionProblem, plan: GatherPlan, group
) -> Replays | None:
    """The graphs of this plan where its calls replay (``graph_replay.replay_wanted``; more than
    one rank), else None; dense plans (no packed documents, no block mask) by default, as the
    ring's (``ring.ring_replays``)."""
    if not replay_wanted(q, k, v, dense=dense_calls(plan.steps)) or dist.get_world_size(group) == 1:
        return None
    return REPLAYS.get(plan, group, lambda: (
        lambda q, k, v: gather_forward(q, k, v, plan, group),
        lambda dout, q, k, v, out, lse: gather_backward(dout, q, k, v, out, lse, base, plan, group),
    ))  # fmt: skip


def replayed_gather_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: AttentionProblem, plan: GatherPlan, group
) -> tuple[torch.Tensor, torch.Tensor, Replays | None]:
    """(out, lse, the replays taken or None) of a planned call: replayed from the plan's graphs
    where ``gather_replays`` gives them, else ``gather_forward``. The autograd Function and the
    custom op both run this."""
    replays = gather_replays(q, k, v, base, plan, group)
    out, lse = gather_forward(q, k, v, plan, group) if replays is None else replays.forward(q, k, v)
    return out, lse, replays


def replayed_gather_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    base: AttentionProblem,
    plan: GatherPlan,
    group,
    replays: Replays | None,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a planned call (dout contiguous): replayed from ``replays`` where
    ``backward_replay`` allows, else ``gather_backward``."""
    replay = backward_replay(replays, dlse)
    if replay is not None:
        return replay(dout, q, k, v, out, lse)
    return gather_backward(dout, q, k, v, out, lse, base, plan, group, dlse=dlse)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, base: AttentionProblem, plan: GatherPlan, group):
        out, lse, replays = replayed_gather_forward(q, k, v, base, plan, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (base, plan, group)
        ctx.replays = replays
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = replayed_gather_backward(dout, q, k, v, out, lse, *ctx.args, ctx.replays, dlse)
        return dq, dk, dv, None, None, None


def run_gather_attention(
    q, k, v, base: AttentionProblem, plan: GatherPlan, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a planned all-gather attention, differentiable in q, k, v."""
    return _AllGatherAttention.apply(q, k, v, base, plan, group)


def layout_setup(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    deterministic: bool,
    group: dist.ProcessGroup | None,
    layout: str,
    cu_seqlens: torch.Tensor | Sequence[int] | None,
    heads_k_stride: int | None,
    check_ranks: bool = True,
    error: Exception | None = None,
    block_mask: object = None,
) -> tuple[AttentionProblem, GatherPlan, dist.ProcessGroup, torch.Tensor | None]:
    """Validate and plan ``sp_mode="allgather"`` over local shards (batch, local_seqlen, heads,
    head_dim) cut by ``layout`` (any: the gathered K/V are put in natural order): (base problem,
    plan, group, checked sinks). Arguments as in ``ring.ring_setup``, plus ``heads_k_stride`` (K/V
    heads gathered at a time; None: all of them, ``default_heads_k_stride``). ``error``: an
    argument error the caller found, raised after the ranks' check, which this rank still joins.
    ``block_mask``: a TileMask or BlockMask over the full sequence (``block_masks.py``)."""
    block_mask, error = converted_block_mask(block_mask, error)
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, deterministic=deterministic, layout=layout,
                   cu_seqlens=cu_seqlens, block_mask=block_mask)  # fmt: skip
    key, resolved, hit = SETUPS.lookup(q, k, v, group, error, heads_k_stride=heads_k_stride, **options)
    if hit is not None:  # built before for this signature; the ranks' check still runs
        (base, plan, digests), group = hit, resolved
        sinks = join_cached_rank_check(group, check_ranks, q, k, v, heads_q=base.heads_q, digests=digests,
                                       sinks=sinks, heads_k_stride=heads_k_stride, sp_mode="allgather",
                                       **options)  # fmt: skip
        return base, plan, group, sinks
    stride = view = None
    shard_options = {n: x for n, x in options.items() if n != "block_mask"}
    try:
        base, sinks = check_shards(q, k, v, sinks=sinks, mode="all-gather", **shard_options)
        stride = check_heads_k_stride(heads_k_stride, base.heads_k)
    except (ValueError, TypeError) as e:
        error = error or e
    group = resolve_group_or_raise(group, error)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    total = q.shape[1] * world
    if block_mask is not None and error is None:
        try:
            check_block_mask(
                block_mask, causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                cu_seqlens=cu_seqlens, total=total, batch=q.shape[0], heads_q=base.heads_q, device=q.device,
            )  # fmt: skip
            view = gathered_keys_mask(block_mask, layout, rank, world)
        except (ValueError, TypeError) as e:
            error = e
    digests: dict = {}  # the check's memo, kept with the setup
    join_rank_check(group, check_ranks, error, q, k, v, digests=digests, sinks=sinks,
                    heads_k_stride=heads_k_stride, sp_mode="allgather", **options)  # fmt: skip
    doc_lens = full_document_lengths(layout, q.shape[1], world, cu_seqlens)
    bounds = None if cu_seqlens is None else (0, *itertools.accumulate(doc_lens))
    if view is None:
        calls = layout_calls(base, layout, rank, world, doc_lens, cu_seqlens is not None, q.device)
    else:  # one block-sparse call of the local queries over every gathered key
        calls = [RowCall(slice(0, q.shape[1]), slice(0, total), False, replace(base, max_seqlen_k=total))]
    order = natural_order(layout, world, total, bounds, q.device)
    plan = gather_plan(calls, base.heads_k, stride, q.shape[1], order, view)
    weak = () if block_mask is None else (block_mask,)
    SETUPS.put(key, (base, plan, digests), group, alibi_slopes, cu_seqlens, weak=weak)
    return base, plan, group, sinks


# All-gather setups by call signature (layout_setup).
SETUPS = SetupCache()


def _check_local_k_slice(local_k_slice: object, gathered: int) -> slice:
    if not isinstance(local_k_slice, slice) or local_k_slice.step not in (None, 1):
        raise TypeError(f"local_k_slice must be a slice with step 1, got {local_k_slice!r}")
    start, stop = local_k_slice.start, local_k_slice.stop
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= gathered):
        raise ValueError(
            f"local_k_slice must lie in the gathered sequence [0, {gathered}) and be non-empty, got "
            f"{local_k_slice!r} (llama3_flash_attn_prepare_cu_seqlens makes it)"
        )
    return local_k_slice


def prepared_setup(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    local_k_slice: slice,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    deterministic: bool,
    group: dist.ProcessGroup | None,
    heads_k_stride: int | None,
    check_ranks: bool = True,
    error: Exception | None = None,
) -> tuple[AttentionProblem, GatherPlan, dist.ProcessGroup, torch.Tensor | None]:
    """Validate and plan one varlen call of this rank's tokens q, k, v (local_tokens, heads,
    head_dim) against the gathered keys in ``local_k_slice`` with the caller's cu_seqlens (the
    llama3 forms, ``llama3.py``); returns as ``layout_setup``, the plan for q[None]. cu_seqlens
    and the slice differ between ranks by design; the rest must agree."""
    problem = base = stride = ks = None
    if error is None:
        try:
            for name, t in (("q", q), ("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    raise ValueError(f"{name} must be a 3-D tensor (local_tokens, heads, head_dim)")
            if q.shape[0] != k.shape[0]:
                raise ValueError(
                    f"q and k/v must hold the same local tokens, got {q.shape[0]} and {k.shape[0]}"
                )
        except (ValueError, TypeError) as e:
            error = e
    group = resolve_group_or_raise(group, error)
    if error is None:
        try:
            ks = _check_local_k_slice(local_k_slice, dist.get_world_size(group) * k.shape[0])
            stride = check_heads_k_stride(heads_k_stride, k.shape[1])
            # The keys' shape without the keys (gathered later): a zero-stride view of one token.
            k_keys = k[:1].expand(ks.stop - ks.start, -1, -1)
            problem = build_problem(
                q, k_keys, k_keys, softmax_scale, causal, window_size, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
            )  # fmt: skip
            base = build_problem(q[None], k[None], v[None], softmax_scale, False, (-1, -1))
            sinks = check_sinks(sinks, q.shape[1], q.device)
        except (ValueError, TypeError) as e:
            error = e
    join_rank_check(
        group, check_ranks, error, q, k, v, heads_k_stride=heads_k_stride, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        deterministic=deterministic, sp_mode="llama3",
    )  # fmt: skip
    calls = [RowCall(slice(0, q.shape[0]), ks, True, problem)]
    return base, gather_plan(calls, k.shape[1], stride, q.shape[0], None), group, sinks
