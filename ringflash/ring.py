"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Forward: at each step every rank sends the K/V shard it holds to the next rank while its kernel
runs its queries against that shard, and folds the partial (out, LSE) into a float32
accumulator with ``merge_partial``. Backward: K/V travel the ring again; each rank adds its
dK/dV contribution for the visiting shard to a float32 accumulator that travels with it and
arrives back at the shard's owner after the last step. The transfer of step i+1's data is
issued before step i's kernels, so it overlaps them. Buffers are allocated once per call.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from .comm import RingComm
from .kernels import (
    AttentionProblem,
    MaskBounds,
    TokenPositions,
    attention_backward,
    attention_delta,
    attention_forward,
    build_problem,
)
from .layouts import check_layout, check_total_length
from .merge import merge_partial
from .schedule import BlockTask, RingSchedule, ring_schedule

_UNMASKED = MaskBounds(None, None)


def _task_problem(base: AttentionProblem, task: BlockTask) -> AttentionProblem:
    if task.masked:
        return replace(
            base, max_seqlen_q=task.q_len, max_seqlen_k=task.k_len,
            q_positions=task.q_positions, k_positions=task.k_positions,
        )  # fmt: skip
    return replace(
        base, max_seqlen_q=task.q_len, max_seqlen_k=task.k_len, bounds=_UNMASKED,
        q_positions=TokenPositions(), k_positions=TokenPositions(),
    )  # fmt: skip


def _receive_buffers(k: torch.Tensor, v: torch.Tensor, schedule: RingSchedule):
    """Two K/V receive buffers (double buffering), or none when the ring never moves."""
    if schedule.n_steps == 1:
        return None
    return [torch.empty_like(k), torch.empty_like(v)], [torch.empty_like(k), torch.empty_like(v)]


def _slices(task: BlockTask) -> tuple[slice, slice]:
    return slice(task.q_start, task.q_start + task.q_len), slice(task.k_start, task.k_start + task.k_len)


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    base: AttentionProblem,
    schedule: RingSchedule,
    comm: RingComm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring forward for local shards q (B, n, Hq, D), k/v (B, n, Hk, D); returns (out, lse (B, Hq, n))."""
    b, n, hq, d = q.shape
    acc_out = torch.zeros((b, n, hq, d), device=q.device, dtype=torch.float32)
    acc_lse = torch.full((b, hq, n), float("-inf"), device=q.device, dtype=torch.float32)
    blk_out = torch.empty_like(acc_out)
    blk_lse = torch.empty_like(acc_lse)
    bufs = _receive_buffers(k, v, schedule)
    kv = [k, v]
    for i, tasks in enumerate(schedule.steps):
        pending = comm.exchange(kv, bufs[i % 2]) if i + 1 < schedule.n_steps else None
        for task in tasks:
            qs, ks = _slices(task)
            o, lse = attention_forward(
                q[:, qs], kv[0][:, ks], kv[1][:, ks], _task_problem(base, task),
                out=blk_out[:, qs], lse=blk_lse[:, :, qs],
            )  # fmt: skip
            merge_partial(acc_out[:, qs], acc_lse[:, :, qs], o, lse)
        if pending is not None:
            pending.wait()
            kv = bufs[i % 2]
    return acc_out.to(q.dtype), acc_lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    base: AttentionProblem,
    schedule: RingSchedule,
    comm: RingComm,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring backward from the final (out, lse); returns (dq, dk, dv) in the inputs' dtypes."""
    delta = attention_delta(out, dout, base)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    f32 = dict(device=k.device, dtype=torch.float32)
    scratch = [torch.empty(k.shape, **f32), torch.empty(v.shape, **f32)]
    travel = [[torch.empty(k.shape, **f32), torch.empty(v.shape, **f32)] for _ in range(2)]
    bufs = _receive_buffers(k, v, schedule)
    kv = [k, v]
    last = schedule.n_steps - 1
    grads_pending = None
    for i, tasks in enumerate(schedule.steps):
        kv_pending = comm.exchange(kv, bufs[i % 2]) if i < last else None
        calls = [(*_slices(t), _task_problem(base, t)) for t in tasks]

        def launch(qs, ks, problem, kv=kv, **which):
            attention_backward(
                dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], lse[:, :, qs], delta[:, :, qs], problem,
                dq=dq[:, qs], dk=scratch[0][:, ks], dv=scratch[1][:, ks], accumulate=True, **which,
            )  # fmt: skip

        # dK/dV first, so their transfer overlaps this step's dQ kernels (after the last step
        # this hides the trip home).
        if calls:
            for g in scratch:
                g.zero_()
            for call in calls:
                launch(*call, compute_dq=False)
        acc = travel[i % 2]  # this shard's dK/dV so far, received from the previous rank
        if grads_pending is None:
            for a, s in zip(acc, scratch):
                a.copy_(s) if calls else a.zero_()
        else:
            grads_pending.wait()
            if calls:
                for a, s in zip(acc, scratch):
                    a.add_(s)
        # Pass the accumulator on; after the last step it goes straight home, `last` ranks back.
        grads_pending = comm.exchange(acc, travel[(i + 1) % 2], offset=1 if i < last else -last)
        for call in calls:
            launch(*call, compute_dkdv=False)
        if kv_pending is not None:
            kv_pending.wait()
            kv = bufs[i % 2]
    grads_pending.wait()
    dk, dv = travel[schedule.n_steps % 2]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, base: AttentionProblem, schedule: RingSchedule, comm: RingComm):
        out, lse = ring_forward(q, k, v, base, schedule, comm)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (base, schedule, comm)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across ``group``, differentiable.

    Args:
        q: this rank's shard (batch, local_seqlen, heads_q, head_dim) of the full sequence,
            split by ``layout`` (see ``shard_sequence``); float16/bfloat16/float32.
        k, v: this rank's shards (batch, local_seqlen, heads_k, head_dim); heads_q % heads_k == 0.
        softmax_scale, causal, window_size: as in ``flash_attn_func``, over the full sequence.
        group: the sequence-parallel process group (default: the world).
        layout: "zigzag" (balanced causal work), "stripe" or "contiguous".
        return_lse: also return the float32 LSE (batch, heads_q, local_seqlen).

    Returns:
        out: (batch, local_seqlen, heads_q, head_dim) in q's dtype, in q's token order; and
        the LSE if ``return_lse``. Every rank of the group must call this with the same shapes.
    """
    comm = RingComm(group)
    check_layout(layout)
    base = build_problem(q, k, v, softmax_scale, causal, window_size)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            "ring attention needs q and k/v shards of the same local length, "
            f"got {q.shape[1]} and {k.shape[1]}"
        )
    local_len = q.shape[1]
    check_total_length(layout, local_len * comm.world_size, comm.world_size, "full sequence length")
    schedule = ring_schedule(layout, comm.rank, comm.world_size, local_len, base.bounds)
    k, v = k.contiguous(), v.contiguous()  # P2P sends need dense buffers
    out, lse = _RingFlashAttention.apply(q, k, v, base, schedule, comm)
    return (out, lse) if return_lse else out
