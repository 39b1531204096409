"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Forward: at each step every rank sends the K/V shard it holds to the next rank while its kernel
runs its queries against that shard, and folds the partial (out, LSE) into a float32
accumulator with ``merge_partial``. Backward: K/V travel the ring again; each rank adds its
dK/dV contribution for the visiting shard to a float32 accumulator that travels with it and
arrives back at the shard's owner, which adds its own contribution last. The transfer of step
i+1's data is issued before step i's kernels, so it overlaps them. Buffers are allocated once per
call.

This module is the engine (eager, plain tensors); the public entry points, which run it or its
custom op under torch.compile, are in ``ring_functions.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .block_masks import MaskedCall, check_block_mask, converted_block_mask, dense_calls, ring_step_masks
from .comm import RingComm, resolve_group_or_raise
from .consistency import join_cached_rank_check, join_rank_check
from .graph_replay import ReplayCache, Replays, backward_replay, replay_wanted
from .kernels import (
    AttentionProblem,
    MaskBounds,
    TileMask,
    TokenPositions,
    attention_delta,
    build_problem,
    check_sinks,
)
from .layouts import check_layout, cumulative_lengths, full_document_lengths, segments
from .merge import apply_sinks, merge_unchecked
from .schedule import BlockTask, ring_schedule
from .setup_cache import SetupCache

_UNMASKED = MaskBounds(None, None)


@dataclass(frozen=True)
class KernelCall(MaskedCall):
    """One kernel launch of a ring step: index tuples of its q rows, k rows and LSE rows in the
    local (batch, seqlen, ...) tensors, the query slice for the merge, its problem, and the
    step's view of the block mask where the call has one (``block_mask``)."""

    q_index: tuple
    k_index: tuple
    lse_index: tuple
    q_slice: slice
    problem: AttentionProblem
    mask: TileMask | None = None


def _kernel_call(base: AttentionProblem, task: BlockTask, cu_local: torch.Tensor | None) -> KernelCall:
    qs = slice(task.q_start, task.q_start + task.q_len)
    ks = slice(task.k_start, task.k_start + task.k_len)
    if task.masked:
        problem = replace(base, q_positions=task.q_positions, k_positions=task.k_positions)
    elif task.q_positions is not None:  # ALiBi: the bias needs the global positions of every block
        problem = replace(base, bounds=_UNMASKED, q_positions=task.q_positions, k_positions=task.k_positions)
    else:
        problem = replace(base, bounds=_UNMASKED, q_positions=TokenPositions(), k_positions=TokenPositions())
    if task.seq_lens is None:
        problem = replace(problem, max_seqlen_q=task.q_len, max_seqlen_k=task.k_len)
        return KernelCall((slice(None), qs), (slice(None), ks), (slice(None), slice(None), qs), qs, problem)
    # Packed documents: a varlen call over the (len, heads, dim) tokens of the single row.
    longest = max(task.seq_lens)
    alibi = (
        None if base.alibi_slopes is None else base.alibi_slopes.expand(len(task.seq_lens), -1).contiguous()
    )
    problem = replace(problem, batch=len(task.seq_lens), max_seqlen_q=longest, max_seqlen_k=longest,
                      cu_seqlens_q=cu_local, cu_seqlens_k=cu_local, alibi_slopes=alibi)  # fmt: skip
    return KernelCall((0, qs), (0, ks), (0, slice(None), qs), qs, problem)


RingPlan = tuple[tuple[KernelCall, ...], ...]  # plan[i]: the kernel calls of ring step i


def _receive_buffers(k: torch.Tensor, v: torch.Tensor, plan: RingPlan):
    """Two K/V receive buffers (double buffering), or none when the ring never moves."""
    if len(plan) == 1:
        return None
    return [torch.empty_like(k), torch.empty_like(v)], [torch.empty_like(k), torch.empty_like(v)]


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, comm: RingComm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring forward for local shards q (B, n, Hq, D), k/v (B, n, Hk, D); returns (out, lse (B, Hq, n))."""
    b, n, hq, d = q.shape
    c = _single_call(plan, n)
    if c is not None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty((b, hq, n), device=q.device, dtype=torch.float32)
        c.forward(q[c.q_index], k[c.k_index], v[c.k_index], out[c.q_index], lse[c.lse_index])
        return out, lse
    # A call whose query rows nothing has written yet writes the accumulator itself (a row's
    # first partial is its merge with the empty (0, -inf)); later calls over them merge. Where
    # the first step reaches every row so, the accumulator needs no fill.
    first = _first_writes(plan[0], n)
    if first is not None:
        acc_out = torch.empty((b, n, hq, d), device=q.device, dtype=torch.float32)
        acc_lse = torch.empty((b, hq, n), device=q.device, dtype=torch.float32)
    else:
        acc_out = torch.zeros((b, n, hq, d), device=q.device, dtype=torch.float32)
        acc_lse = torch.full((b, hq, n), float("-inf"), device=q.device, dtype=torch.float32)
    if first is None or len(plan) > 1 or not all(first):
        blk_out = torch.empty_like(acc_out)
        blk_lse = torch.empty_like(acc_lse)
    bufs = _receive_buffers(k, v, plan)
    kv = [k, v]
    for i, calls in enumerate(plan):
        pending = comm.exchange(kv, bufs[i % 2]) if i + 1 < len(plan) else None
        for j, c in enumerate(calls):
            direct = i == 0 and first is not None and first[j]
            out, lse = (acc_out, acc_lse) if direct else (blk_out, blk_lse)
            c.forward(q[c.q_index], kv[0][c.k_index], kv[1][c.k_index], out[c.q_index], lse[c.lse_index])
            if not direct:
                qs = c.q_slice
                merge_unchecked(acc_out[:, qs], acc_lse[:, :, qs], blk_out[:, qs], blk_lse[:, :, qs])
        if pending is not None:
            pending.wait()
            kv = bufs[i % 2]
    return acc_out.to(q.dtype), acc_lse


def _single_call(plan: RingPlan, n: int) -> KernelCall | None:
    """The plan's only kernel call where the ring never moves and that call covers every query
    and key row of the shard (one rank, or a block mask that no rank needs another's keys for):
    it writes out, LSE and the gradients in place, in the inputs' dtypes, without the float32
    accumulators of a ring that merges partials."""
    if len(plan) != 1 or len(plan[0]) != 1:
        return None
    c = plan[0][0]
    whole = (0, n, 1)
    return c if c.q_slice.indices(n) == whole and c.k_index[1].indices(n) == whole else None


def _first_writes(calls: tuple[KernelCall, ...], n: int) -> tuple[bool, ...] | None:
    """For each call of a step, in order: whether nothing before it wrote its query rows (True)
    or an earlier call wrote all of them (False); None where a call half-overlaps the rows
    written before it or the calls miss a row of [0, n)."""
    written: list[tuple[int, int]] = []
    first = []
    for c in calls:
        a, b = c.q_slice.start, c.q_slice.stop
        if all(b <= lo or a >= hi for lo, hi in written):
            written.append((a, b))
            first.append(True)
        elif any(lo <= a and b <= hi for lo, hi in written):
            first.append(False)
        else:
            return None
    end = 0
    for lo, hi in sorted(written):
        if lo != end:
            return None
        end = hi
    return tuple(first) if end == n else None


def backward_is_fused(plan: RingPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether every kernel call of the plan computes dQ and dK/dV in one fused kernel
    (``MaskedCall.fused_backward``: the Hopper backward, with a block mask its listed walk);
    ``ring_backward`` then runs its fused schedule."""
    return all(c.fused_backward(q[c.q_index], k[c.k_index], v[c.k_index]) for step in plan for c in step)


def _key_rows(calls: tuple[KernelCall, ...]) -> list[slice]:
    """The key rows a step's calls write, as disjoint slices of the shard's sequence dim."""
    spans: list[list[int]] = []
    for a, b in sorted((c.k_index[1].start, c.k_index[1].stop) for c in calls):
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [slice(a, b) for a, b in spans]


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    base: AttentionProblem,
    plan: RingPlan,
    comm: RingComm,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring backward from the final (out, lse); returns (dq, dk, dv) in the inputs' dtypes.
    ``base``: the dense problem of the whole local shard (for delta). ``dlse``: the gradient of
    the returned LSE, if it has one (e.g. through attention sinks): since dlse_i / dscore_ij =
    p_ij, it enters as delta_i -= dlse_i.

    Each shard's float32 dK/dV accumulator starts on the next rank and visits the others; its
    owner adds its own contribution last, after the accumulator's trip home. That saves one
    accumulator transfer per call against starting at home (1 of 2 on two ranks).

    Separate dQ and dK/dV kernels: the dK/dV kernels add straight into the accumulator once it
    has arrived, and the accumulator travels on while the dQ kernels run (no scratch buffers).
    Fused kernels (``backward_is_fused``): there is no dQ kernel to hide the trip behind, so a
    step computes its dK/dV into a scratch pair (in k's dtype) while the accumulator is still on
    its way, then adds the scratch into it; the owner's own part waits in a second pair. Two
    pairs in k's dtype more memory, one add pass per step, and the transfer overlaps the step.
    On a ring of two steps (two ranks, or a plan that stops after step 1) nothing overlaps the
    trip home, and the accumulator would hold one contribution, the scratch: so the scratch
    itself travels home, in k's dtype (half the bytes of float32, the same sums), into the K/V
    receive pair that step 1 leaves unused, and no float32 accumulator travels.
    """
    delta = attention_delta(out, dout, base)
    if dlse is not None:
        delta -= dlse

    def block(c: KernelCall, kv) -> tuple:
        qi, ki = c.q_index, c.k_index
        return dout[qi], q[qi], kv[0][ki], kv[1][ki], lse[c.lse_index], delta[c.lse_index]

    single = _single_call(plan, q.shape[1])
    if single is not None:
        grads = [torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v)]
        qi, ki = single.q_index, single.k_index
        single.backward(*block(single, [k, v]), dq=grads[0][qi], dk=grads[1][ki], dv=grads[2][ki])
        return tuple(grads)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    own, last = plan[0], len(plan) - 1
    fused = backward_is_fused(plan, q, k, v)
    scratch_home = fused and last == 1  # the scratch travels home itself (docstring)
    f32 = dict(device=k.device, dtype=torch.float32)
    travel = None
    if not scratch_home:
        travel = [[torch.empty(k.shape, **f32), torch.empty(v.shape, **f32)] for _ in range(2)]

    def launch(c: KernelCall, kv, grads=None) -> None:
        """dQ (grads None), dK/dV added into ``grads``, or both (fused)."""
        dkdv = {} if grads is None else dict(dk=grads[0][c.k_index], dv=grads[1][c.k_index])
        c.backward(
            *block(c, kv), dq=dq[c.q_index] if grads is None or fused else None, **dkdv, accumulate=True,
            compute_dkdv=grads is not None, compute_dq=grads is None or fused,
        )  # fmt: skip

    def launch_fused(calls: tuple[KernelCall, ...], kv, scratch, whole: bool = False) -> list[slice]:
        """A step's fused calls, dK/dV into zeroed rows of ``scratch`` (``whole``: all of it
        zeroed, as a pair that travels); returns the rows they write."""
        rows = _key_rows(calls)
        for r in [slice(None)] if whole else rows:
            for t in scratch:
                t[:, r].zero_()
        for c in calls:
            launch(c, kv, scratch)
        return rows

    def add_rows(acc, scratch, rows: list[slice]) -> None:
        for r in rows:
            for a, t in zip(acc, scratch):
                a[:, r].add_(t[:, r])

    bufs = _receive_buffers(k, v, plan)
    kv_pending = comm.exchange([k, v], bufs[1]) if last > 0 else None
    # The owner's dQ (fused: and its dK/dV, kept for the end) overlaps the first K/V transfer.
    if fused:
        home, scratch = [torch.empty_like(k), torch.empty_like(v)], [torch.empty_like(k), torch.empty_like(v)]
        home_rows = launch_fused(own, [k, v], home)
    else:
        for call in own:
            launch(call, [k, v])
    # travel[1] is where the accumulation starts: the first hop's (zeroed before anything
    # arrives in it) or, on a one-step ring, the owner's own.
    for a in () if scratch_home else travel[1]:
        a.zero_()
    grads_pending = None
    for i in range(1, last + 1):
        kv_pending.wait()
        kv = bufs[i % 2]
        kv_pending = comm.exchange(kv, bufs[(i + 1) % 2]) if i < last else None
        if fused:  # before the wait: the accumulator arrives while this runs
            rows = launch_fused(plan[i], kv, scratch, whole=scratch_home)
        if scratch_home:
            grads_pending = comm.exchange(scratch, bufs[0], offset=-1)
            break
        acc = travel[i % 2]
        if grads_pending is not None:
            grads_pending.wait()
        if fused:
            add_rows(acc, scratch, rows)
        else:
            for call in plan[i]:
                launch(call, kv, acc)
        # Pass the accumulator on (after the last step: home, `last` ranks back); unfused, while
        # this step's dQ kernels run.
        grads_pending = comm.exchange(acc, travel[(i + 1) % 2], offset=1 if i < last else -last)
        if not fused:
            for call in plan[i]:
                launch(call, kv)
    if grads_pending is not None:
        grads_pending.wait()
    acc = [t.float() for t in bufs[0]] if scratch_home else travel[(last + 1) % 2]
    if fused:
        add_rows(acc, home, home_rows)
    else:
        for call in own:
            launch(call, [k, v], acc)
    dk, dv = acc
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# The ring's graphs by (plan, group).
REPLAYS = ReplayCache()


def ring_replays(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: AttentionProblem, plan: RingPlan, comm: RingComm
) -> Replays | None:
    """The graphs of this plan where its calls replay (``graph_replay.replay_wanted``; a ring
    that moves), else None. Dense plans (no packed documents, no block mask) replay by default:
    the others are built anew wherever the documents or the mask change, often every batch, and
    would capture as often."""
    if comm.world_size == 1 or not replay_wanted(q, k, v, dense=dense_calls(plan)):
        return None
    return REPLAYS.get(plan, comm.group, lambda: (
        lambda q, k, v: ring_forward(q, k, v, plan, comm),
        lambda dout, q, k, v, out, lse: ring_backward(dout, q, k, v, out, lse, base, plan, comm),
    ))  # fmt: skip


def replayed_ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: AttentionProblem, plan: RingPlan, comm: RingComm
) -> tuple[torch.Tensor, torch.Tensor, Replays | None]:
    """(out, lse, the replays taken or None) of a planned call (k, v contiguous): replayed from the
    plan's graphs where ``ring_replays`` gives them, else ``ring_forward``. The autograd Function
    and the custom op both run this."""
    replays = ring_replays(q, k, v, base, plan, comm)
    out, lse = ring_forward(q, k, v, plan, comm) if replays is None else replays.forward(q, k, v)
    return out, lse, replays


def replayed_ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    base: AttentionProblem,
    plan: RingPlan,
    comm: RingComm,
    replays: Replays | None,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a planned call (dout contiguous): replayed from ``replays`` where
    ``backward_replay`` allows (no LSE gradient, not inside the caller's capture), else
    ``ring_backward``."""
    replay = backward_replay(replays, dlse)
    if replay is not None:
        return replay(dout, q, k, v, out, lse)
    return ring_backward(dout, q, k, v, out, lse, base, plan, comm, dlse=dlse)


class _RingFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, base: AttentionProblem, plan: RingPlan, comm: RingComm):
        out, lse, replays = replayed_ring_forward(q, k, v, base, plan, comm)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (base, plan, comm)
        ctx.replays = replays
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = replayed_ring_backward(dout, q, k, v, out, lse, *ctx.args, ctx.replays, dlse)
        return dq, dk, dv, None, None, None


def check_shards(
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
    layout: str,
    cu_seqlens: torch.Tensor | Sequence[int] | None,
    mode: str,
) -> tuple[AttentionProblem, torch.Tensor | None]:
    """What a sequence-parallel call over local shards (batch, local_seqlen, heads, head_dim) must
    satisfy on this rank alone: (the base problem of the local shard, the checked sinks); raises
    ValueError/TypeError. ``mode`` names the attention in the messages ("ring", "all-gather")."""
    check_layout(layout)
    base = build_problem(q, k, v, softmax_scale, causal, window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, deterministic=deterministic)  # fmt: skip
    sinks = check_sinks(sinks, base.heads_q, q.device)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{mode} attention needs q and k/v shards of the same local length, got {q.shape[1]} "
            f"and {k.shape[1]}"
        )
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got batch {q.shape[0]}")
    return base, sinks


def ring_setup(
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
    check_ranks: bool = True,
    error: Exception | None = None,
    block_mask: object = None,
) -> tuple[AttentionProblem, RingPlan, RingComm, torch.Tensor | None]:
    """Validate a ring call and plan it: (base problem, plan, comm, checked sinks); arguments as
    in ``ring_attention``. Built once per call signature (``SETUPS``; a block mask by identity);
    the ranks' check runs on every call."""
    block_mask, error = converted_block_mask(block_mask, error)
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, deterministic=deterministic, layout=layout,
                   cu_seqlens=cu_seqlens, block_mask=block_mask)  # fmt: skip
    key, resolved, hit = SETUPS.lookup(q, k, v, group, error, **options)
    if hit is not None:
        base, plan, rank, world_size, digests = hit
        comm = RingComm.known(resolved, rank, world_size)
        sinks = join_cached_rank_check(comm.group, check_ranks, q, k, v, heads_q=base.heads_q,
                                       digests=digests, sinks=sinks, **options)  # fmt: skip
        return base, plan, comm, sinks
    shard_options = {n: x for n, x in options.items() if n != "block_mask"}
    try:
        base, sinks = check_shards(q, k, v, sinks=sinks, mode="ring", **shard_options)
    except (ValueError, TypeError) as e:
        error = error or e
    comm = RingComm(resolve_group_or_raise(group, error))
    if block_mask is not None and error is None:
        try:
            check_block_mask(block_mask, causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                             cu_seqlens=cu_seqlens, total=q.shape[1] * comm.world_size, batch=q.shape[0],
                             heads_q=base.heads_q, device=q.device)  # fmt: skip
            steps = ring_step_masks(block_mask, layout, comm.rank, comm.world_size)
        except (ValueError, TypeError) as e:
            error = e
    digests: dict = {}  # the check's memo, kept with the setup
    join_rank_check(comm.group, check_ranks, error, q, k, v, digests=digests, sinks=sinks, **options)
    if block_mask is None:
        doc_lens = full_document_lengths(layout, q.shape[1], comm.world_size, cu_seqlens)
        plan = ring_plan(base, layout, comm, doc_lens, cu_seqlens is not None, q.device)
    else:
        plan = block_sparse_ring_plan(base, steps)
    weak = () if block_mask is None else (block_mask,)
    SETUPS.put(key, (base, plan, comm.rank, comm.world_size, digests), comm.group, alibi_slopes, cu_seqlens,
               weak=weak)  # fmt: skip
    return base, plan, comm, sinks


# Ring setups by call signature (ring_setup).
SETUPS = SetupCache()


def ring_attention(
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
    check_ranks: bool = True,
    error: Exception | None = None,
    block_mask: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ring attention over local shards (batch, local_seqlen, heads, head_dim); the
    machinery behind every ring entry point. Arguments wrong on their own raise first, then a
    missing process group; ``check_ranks``: check that every rank passed the same arguments
    (``consistency.check_ranks_agree``; callers that checked a larger group already skip it).
    ``error``: an argument error the caller found; it is raised after the check, which this
    rank must still join. ``block_mask``: a TileMask or BlockMask over the full sequence
    (``block_masks.py``), run by the block-sparse kernels. Eager only: traced by torch.compile,
    the entry points run the custom op ``ringflash::ring_attn_forward`` instead
    (``ring_functions.dispatch_ring_attention``)."""
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, deterministic=deterministic, group=group, layout=layout,
                   cu_seqlens=cu_seqlens, check_ranks=check_ranks, block_mask=block_mask)  # fmt: skip
    base, plan, comm, sinks = ring_setup(q, k, v, sinks=sinks, error=error, **options)
    k, v = k.contiguous(), v.contiguous()  # P2P sends need dense buffers
    out, lse = _RingFlashAttention.apply(q, k, v, base, plan, comm)
    return apply_sinks(out, lse, sinks)


def ring_plan(
    base: AttentionProblem,
    layout: str,
    comm: RingComm,
    doc_lens: tuple[int, ...],
    varlen: bool,
    device: torch.device,
) -> RingPlan:
    """The kernel calls of every ring step for this rank (``ring_forward``/``ring_backward``
    take it): ``doc_lens`` of the full sequence, varlen calls when ``varlen`` (packed)."""
    positions = base.alibi_slopes is not None
    schedule = ring_schedule(layout, comm.rank, comm.world_size, doc_lens, base.bounds, varlen, positions)
    cu_local = None
    if varlen:  # every packed segment holds the same chunk length of each document
        seq_lens = segments(layout, comm.rank, comm.world_size, doc_lens)[0].seq_lens
        cu_local = cumulative_lengths(seq_lens, device)
    return tuple(tuple(_kernel_call(base, t, cu_local) for t in step) for step in schedule.steps)


def block_sparse_ring_plan(base: AttentionProblem, steps: tuple[TileMask | None, ...]) -> RingPlan:
    """One block-sparse call per ring step over the whole local shards, under the step's view of
    the mask (``block_masks.ring_step_masks``); none where the view leaves nothing visible."""
    whole = (slice(None), slice(None))
    rows = slice(0, base.max_seqlen_q)
    return tuple(() if m is None else (KernelCall(whole, whole, (*whole, slice(None)), rows, base, m),)
                 for m in steps)  # fmt: skip
