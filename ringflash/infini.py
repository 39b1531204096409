"""Infini-attention (Munkhdalai et al., 2024): causal attention inside fixed-length segments plus
a compressive memory per key/value head that carries everything before the segment.

For segment s (``segment_len`` tokens; the sequence's last segment may be shorter), with
sigma = ELU + 1 and the memory (M, z) left by the segments before it:

    A_local = causal softmax attention inside the segment (our kernels: one varlen call over all
              segments of all batch rows)
    A_mem   = sigma(Q_s) M / (sigma(Q_s) z), and 0 while the memory is empty (z = 0)
    linear: M += sigma(K_s)^T V_s
    delta:  M += sigma(K_s)^T (V_s - sigma(K_s) M / (sigma(K_s) z))     (retrieval 0 while z = 0)
    z += sum over the segment's tokens of sigma(K_s)
    out     = sigmoid(beta) * A_mem + (1 - sigmoid(beta)) * A_local      (beta: one gate per head)

The memory is float32 (batch, kv_heads, head_dim, head_dim) and (batch, kv_heads, head_dim);
query head h reads the memory of key/value head h // (heads / kv_heads), as in GQA.

Linear update: each segment's contribution (sigma(K_s)^T V_s, sum of sigma(K_s)) is computed for
all segments at once by one kernel, and the memory before each segment is an exclusive scan over
segments (a chunked linear-attention form); one more kernel does the retrieval, the division and
the gate for every token (``kernels/infini/memory.py``, ``kernels/infini/retrieval.py``: bf16
inputs run the head_dim x head_dim products on tensor cores with float32 accumulation; on an
H100/H200 at head_dim 128 the updates, the retrieval and their backwards are Gluon kernels,
``kernels/hopper/infini_*.py``, and on one device the retrieval runs in the epilogue of the local
attention's forward, ``kernels/infini/local.py``). What
stays for the backward is the inputs, the local attention's output and LSE, z before each
segment, and the memories before each segment when they take at most 1% of the bytes of q, k,
v and out (segments of 4096 tokens and more at head_dim 128 without GQA), else those before
every other segment when these do (2048), the backward stepping once from each with the even
segments' updates alone (on Hopper the linear rule's rebuild reads no odd segment's tokens, the
delta rule's only their k, for A_s); otherwise the backward rebuilds them from k and v
(``infini_memory_bytes``). The local attention runs inside the same
autograd Function (``_GatedMemory``): its backward adds into the memory path's
dq, dk, dv, runs on the output gradient itself with its delta from the retrieval's backward pass
and its LSE shifted by -log(1 - gate) (which scales its gradients by 1 - gate), so neither the
local attention's output gradient nor sums of two gradients are made; where the fused Hopper
backward runs, the updates' backward (the delta rule's with its Gram terms) is added into its dK
and dV while each key tile's K and V are in shared memory (``kernels/infini/local.py``), without
a pass of its own.

Delta update: M_{s+1} = M_s + B_s - A_s M_s with B_s the linear rule's update and A_s =
sigma(K_s)^T diag(1 / (sigma(K_s) z_s)) sigma(K_s), computed for all segments at once by a pass
over the tokens (on Hopper one pass for both, after one for z's sums); only the head_dim x
head_dim recurrence runs in order over the segments, and the backward runs it in reverse
(``kernels/infini/delta.py``), inside ``_GatedMemory`` as the linear rule (the memories kept,
kept before every other segment or rebuilt by the same rule, A_s rebuilt by the backward, in
the same pass as B_s where memories are rebuilt; z stays).

Sequence parallel (``group=``): each rank holds consecutive whole segments (contiguous shards),
and the exchanges run inside ``_GatedMemory`` too, so the local attention and the updates'
backward stay in the same kernels as on one device. Linear: the memory entering rank r is the
sum of the earlier ranks' contributions, one exclusive prefix sum over the group
(``comm.exclusive_prefix_sum``; world_size x kv_heads x (head_dim^2 + head_dim) floats per batch
row, independent of the length), issued before the local attention and awaited after it; the
backward's one all-gather of twice as many floats gives each rank the gradient of its own total
update (``_ranks_grads``). Delta: z is such a prefix sum too, so every rank computes its B_s and
A_s in parallel; M_s depends on rank r - 1's final memory, so the memory is relayed rank to rank
(``comm.relay_receive``/``relay_send``, one kv_heads x head_dim^2 message per hop) and the ranks'
head_dim x head_dim recurrences run one after another: about world_size x one rank's recurrence
(0.3 ms forward, 0.4 ms backward at 1M tokens per rank, segment 2048, 8 heads of 128, on an
H200) on top of the parallel work; A_s is built before the wait, the retrieval runs before the
final memory's broadcast. The backward relays the memory's gradient back from the last rank the
same way, each rank's reversed recurrence waiting for the next rank's (S after the send), then
gathers z's gradients as the linear rule does.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import comm
from .consistency import call_signature, check_ranks_agree
from .kernels import (
    build_problem,
    cu_seqlens_tensor,
    flash_attn_varlen_func,
)
from .kernels.infini.delta import (
    delta_gram_grads,
    delta_memories,
    delta_normalizer_updates,
    delta_scan,
    delta_updates,
    expand_kept_memories,
    gram_gradient,
)
from .kernels.infini.local import local_backward, local_forward
from .kernels.infini.memory import (
    memory_gram,
    memory_scan,
    memory_updates,
    memory_updates_and_gram,
    memory_updates_backward,
    operand_dtype,
)
from .kernels.infini.retrieval import memory_retrieval, memory_retrieval_backward

UPDATES = ("linear", "delta")


class InfiniMemory(NamedTuple):
    """Compressive memory: ``matrix`` (batch, kv_heads, head_dim, head_dim) and ``normalizer``
    (batch, kv_heads, head_dim), both float32; zeros = empty."""

    matrix: torch.Tensor
    normalizer: torch.Tensor


def infini_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    segment_len: int,
    *,
    group: dist.ProcessGroup | None = None,
    update: str = "linear",
    memory: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_memory: bool = False,
    softmax_scale: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, InfiniMemory]:
    """Infini-attention over segments of ``segment_len`` tokens (see the module docstring).

    Args:
        q: (batch, seqlen, heads, head_dim); k, v: (batch, seqlen, kv_heads, head_dim); float16,
            bfloat16 or float32, one device; heads % kv_heads == 0. Under ``group``: this rank's
            contiguous shard (``shard_sequence(..., layout="contiguous")``).
        beta: (heads,) gate logits, any float dtype; sigmoid(beta) weighs the memory. Under a
            group its gradient on each rank is that rank's contribution (``reduce_gradients``
            sums them, as for every replicated parameter).
        segment_len: tokens per segment (> 0). The last segment of the sequence may be shorter;
            under a group of more than one rank every shard must be a whole number of segments.
        group: the sequence-parallel process group; None: the whole sequence is on this device
            (no communication, even when torch.distributed is initialized). Every rank of the
            group calls with the same segment_len, update and return_memory, and either every
            rank or no rank runs a backward through ``out`` (the backward communicates).
        update: "linear" or "delta".
        memory: the memory before this call's sequence (``InfiniMemory`` or (matrix,
            normalizer)), the same on every rank of the group; None: empty. Gradients flow into
            it (under a group, each rank's contribution).
        return_memory: also return the memory after the whole sequence (on every rank). Passing
            it to the next call continues the sequence: two calls equal one call when the first
            one's length is a whole number of segments (a shorter last segment ends there).
        softmax_scale: for the local attention; defaults to 1/sqrt(head_dim).

    Returns:
        out (batch, seqlen, heads, head_dim) in q's dtype, and with ``return_memory`` the
        ``InfiniMemory`` after the sequence (float32, differentiable).

    Raises:
        ValueError / TypeError naming the argument: shapes, dtypes, segment_len, update, memory,
        or a shard that is not a whole number of segments.
    """
    error = None
    try:
        _check_inputs(q, k, v, beta, segment_len, update)
        if group is not None and q.shape[1] % segment_len:
            raise ValueError(
                f"under sequence parallelism every shard must be a whole number of segments: "
                f"local seqlen {q.shape[1]} is not a multiple of segment_len {segment_len}"
            )
        m0, z0 = _initial_memory(memory, q.shape[0], k.shape[2], q.shape[3], q.device)
    except (ValueError, TypeError) as e:
        error = e  # under a group: raised after the rank check, which every rank must join
    world = 1
    if group is not None:
        group = comm.resolve_group_or_raise(group, error)
        world = dist.get_world_size(group)
        if world > 1:
            check_ranks_agree(group, _group_signature(q, k, v, beta, segment_len, update, memory,
                                                      return_memory, softmax_scale), error)  # fmt: skip
    if error is not None:
        raise error
    head_dim = q.shape[3]

    gate = torch.sigmoid(beta.float())
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    # The local attention runs inside the memory path's autograd Function, whose backward adds
    # the local attention's dq, dk, dv into its own (no autograd sums), and under a group the
    # exchanges between the ranks (and in the backward their gradients') too.
    local = None if head_dim % 8 == 0 else segment_local_attention(q, k, v, segment_len, softmax_scale)
    group = group if world > 1 else None
    out, *final = _GatedMemory.apply(q, k, v, local, gate, m0, z0, segment_len, scale, group, update)
    return (out, InfiniMemory(*final)) if return_memory else out


# The forward keeps the memories before each segment (in the products' operand dtype) for the
# backward, which then makes no second update pass over k and v (nor, under the delta rule, a
# second recurrence), when they take at most this share of the bytes of q, k, v and out; else
# those before every other segment if they fit (the backward steps once from each to the next:
# an update pass, no recurrence); else none, and the backward rebuilds them all.
KEPT_MEMORIES_SHARE = 0.01


def infini_memory_bytes(
    batch: int, kv_heads: int, head_dim: int, seqlen: int, segment_len: int, heads: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> int:  # fmt: skip
    """Bytes of memory state that the forward keeps for the backward, under either rule and on
    one device or a group alike: z before each segment (float32, batch x segments x kv_heads x
    head_dim x 4), and M before each segment (bf16 for bf16 inputs, else float32) when that is at
    most KEPT_MEMORIES_SHARE of the bytes of q, k, v and out (``heads`` query heads, default
    kv_heads, in ``dtype``), else M before every other segment (the first, third, ...) when
    that is, else none: the backward rebuilds what is not kept from k and v."""
    z_bytes = 4 * batch * -(-seqlen // segment_len) * kv_heads * head_dim
    heads = heads or kv_heads
    return z_bytes + _kept_matrix_bytes(batch, heads, kv_heads, head_dim, seqlen, segment_len, dtype)


def _kept_matrix_bytes(batch, heads, kv_heads, head_dim, seqlen, segment_len, dtype) -> int:
    """Bytes of the memories the forward keeps (``_kept_stride``)."""
    stride = _kept_stride(batch, heads, kv_heads, head_dim, seqlen, segment_len, dtype)
    return _every_stride_bytes(batch, kv_heads, head_dim, seqlen, segment_len, dtype, stride) if stride else 0


def _kept_stride(batch, heads, kv_heads, head_dim, seqlen, segment_len, dtype) -> int:
    """Which memories the forward keeps (KEPT_MEMORIES_SHARE): 1 those before every segment, 2
    before every other one (segments 0, 2, ...), 0 none."""
    budget = KEPT_MEMORIES_SHARE * 2 * batch * seqlen * (heads + kv_heads) * head_dim * dtype.itemsize
    shape = (batch, kv_heads, head_dim, seqlen, segment_len, dtype)
    return next((st for st in (1, 2) if _every_stride_bytes(*shape, st) <= budget), 0)


def _every_stride_bytes(batch, kv_heads, head_dim, seqlen, segment_len, dtype, stride) -> int:
    """Bytes of the memories before segments 0, stride, 2 * stride, ... (the operand dtype)."""
    n_seg = -(-seqlen // segment_len)
    kept = -(-n_seg // stride)
    return batch * kept * kv_heads * head_dim * head_dim * operand_dtype(dtype).itemsize


def _check_inputs(q, k, v, beta, segment_len, update) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, seqlen, heads, head_dim), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"k and v must have q's batch, seqlen and head_dim and equal shapes: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] < 1:
        raise ValueError(f"q, k, v need at least one token (seqlen >= 1), got shape {tuple(q.shape)}")
    if q.shape[2] < 1 or k.shape[2] < 1:
        raise ValueError(f"heads and kv_heads must be >= 1, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads ({q.shape[2]}) must be a multiple of kv_heads ({k.shape[2]})")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if tuple(beta.shape) != (q.shape[2],) or not beta.is_floating_point():
        raise ValueError(
            f"beta must be a floating tensor of shape ({q.shape[2]},) (one gate per head), "
            f"got {beta.dtype} {tuple(beta.shape)}"
        )
    if beta.device != q.device:
        raise ValueError(f"beta is on {beta.device} but q is on {q.device}")
    if isinstance(segment_len, bool) or not isinstance(segment_len, int) or segment_len <= 0:
        raise ValueError(f"segment_len must be a positive int, got {segment_len!r}")
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")


def _group_signature(q, k, v, beta, segment_len, update, memory, return_memory, softmax_scale) -> dict:
    """What every rank of the group must pass alike (``consistency.check_ranks_agree``): all but
    the local seqlen, which only sizes this rank's own segments. Ranks that differ in batch,
    heads or head_dim, in segment_len, update or memory exchange mismatched memories (a hang,
    or a wrong answer without an error)."""
    no_seqlen = [t[:, :0] if isinstance(t, torch.Tensor) and t.dim() == 4 else t for t in (q, k, v)]
    return call_signature(*no_seqlen, beta=beta, segment_len=segment_len, update=update, memory=memory,
                          return_memory=return_memory, softmax_scale=softmax_scale)  # fmt: skip


def _initial_memory(memory, batch: int, kv_heads: int, head_dim: int, device: torch.device):
    shapes = ((batch, kv_heads, head_dim, head_dim), (batch, kv_heads, head_dim))
    if memory is None:
        return tuple(torch.zeros(s, device=device) for s in shapes)
    if not isinstance(memory, tuple) or len(memory) != 2:
        raise TypeError("memory must be an InfiniMemory or a (matrix, normalizer) tuple of tensors")
    for name, t, shape in zip(("matrix", "normalizer"), memory, shapes):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"memory {name} must be a floating torch.Tensor")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"memory {name} must have shape {shape} (batch, kv_heads, head_dim"
                f"{', head_dim' if name == 'matrix' else ''}), got {tuple(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"memory {name} is on {t.device} but q is on {device}")
    return memory[0].float(), memory[1].float()


def _flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """(batch * seqlen, heads, head_dim) views of (batch, seqlen, heads, head_dim) tensors."""
    return [t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in tensors]


def _local_problem(q, k, v, segment_len: int, scale: float):
    """The local attention as one varlen problem over every segment of every batch row, on
    ``_flat`` views."""
    b, s = q.shape[:2]
    cu = _segment_bounds(b, s, segment_len, q.device)
    longest = min(segment_len, s)
    flat = _flat(q, k, v)
    return flat, build_problem(*flat, scale, True, (-1, -1), cu_seqlens_q=cu, cu_seqlens_k=cu,
                               max_seqlen_q=longest, max_seqlen_k=longest)  # fmt: skip


class _GatedMemory(torch.autograd.Function):
    """gate A_mem + (1 - gate) local, with the memories before the segments from k and v by the
    ``rule`` ("linear" or "delta") and ``m``, ``z`` (the memory given to the call, (B, Hk, D, D)
    and (B, Hk, D)); the outputs are (out, M after the call, z after it). The z's stay for the
    backward, and the M's too when they are small (``KEPT_MEMORIES_SHARE``), else those before
    every other segment when those are (the backward steps once from each), else the backward
    rebuilds them from k and v.

    ``local`` None: the local attention runs here (``_local_problem``); the backward writes the
    memory path's dq, dk, dv and the local attention's backward adds into them, run on dout with
    its delta from the retrieval's backward pass and its LSE shifted by the gate (the updates'
    backward inside it where the fused Hopper kernel runs: ``local_backward``).

    ``group`` (more than one rank, each holding consecutive whole segments; m, z alike on every
    rank): z entering this rank is z plus the earlier ranks' updates, an exclusive prefix sum of
    the ranks' totals in flight during the local attention, and so is M under the linear rule;
    under the delta rule rank 0 starts from m and every later rank waits for the previous rank's
    final M (``comm.relay_receive``) before its recurrence and hands its own on. M and z after the
    call are the sequence's (alike on every rank). The backward mirrors it: the linear rule's
    gradients of the ranks' totals come from one all-gather (``_ranks_grads``), the delta rule's
    M gradient goes back rank by rank and its z gradients by one all-gather."""

    @staticmethod
    def forward(ctx, q, k, v, local, gate, m, z, segment_len, scale, group, rule):
        ctx.rule, ctx.segment_len, ctx.fused_local = rule, segment_len, local is None
        ctx.group = group
        ctx.set_materialize_grads(False)  # an unused final memory: no gradient to add
        # On one device the memories come before the local attention, which spends about a
        # millisecond of host time before its kernel starts: the GPU runs them meanwhile.
        if group is None and rule == "linear":
            dm, dz = memory_updates(k, v, segment_len)
            m_before, m_final = memory_scan(dm, m, operand_dtype(q.dtype))
            z_before, z_final = memory_scan(dz, z, torch.float32)
        elif group is None:
            m_before, m_final, z_before, z_final = delta_memories(k, v, m, z, segment_len)
        elif rule == "delta":  # the earlier ranks' totals, in flight during the local attention
            dm, dz = delta_normalizer_updates(k, v, segment_len)
            pending = comm.exclusive_prefix_sum(dz.sum(1), group)
        else:
            dm, dz = memory_updates(k, v, segment_len)
            totals = torch.cat([dm.sum(1).flatten(2), dz.sum(1)], dim=-1)
            pending = comm.exclusive_prefix_sum(totals, group)
        lse = out = None
        if local is None:  # on one device the retrieval comes out of the attention's epilogue
            flat, problem = _local_problem(q, k, v, segment_len, scale)
            ctx.problem = problem  # the backward's too: built again, its kernels waited for the host
            memory = (gate, m_before, z_before) if group is None else None
            local, lse, out = local_forward(*flat, problem, memory)
            local = local.view(q.shape)
        if group is not None:
            prefix, total = pending.wait()
            if rule == "linear":
                (prefix_m, prefix), (total_m, total) = (_split_memory(t, q.shape[3]) for t in (prefix, total))
                m, m_final = m + prefix_m, m + total_m
                m_before = memory_scan(dm, m, operand_dtype(q.dtype))[0]
            z, z_final = z + prefix, z + total
            z_before = memory_scan(dz, z, torch.float32)[0]
            if rule == "delta":
                # B_s, A_s before the wait: only the recurrence is on the ranks' chain
                dm, gram = delta_updates(k, v, z_before, segment_len, dm)
                received = comm.relay_receive(m, group)
                m = m if received is None else received
                m_before, m_last = delta_scan(dm, gram, m, q.dtype)
                comm.relay_send(m_last, group)
        b, s, heads, d = q.shape
        ctx.kept = _kept_stride(b, heads, k.shape[2], d, s, segment_len, q.dtype)
        kept = m if ctx.kept == 0 else m_before[:, :: ctx.kept].to(operand_dtype(q.dtype)).contiguous()
        ctx.save_for_backward(q, k, v, local, lse, gate, kept, z_before)
        if out is None:
            out = memory_retrieval(q, local, gate, m_before, z_before, segment_len)
        out = out.view(q.shape)
        if group is not None and rule == "delta":  # after the retrieval, which does not wait for it
            m_final = comm.broadcast_from_last(m_last, group)
        return out, m_final, z_final

    @staticmethod
    def backward(ctx, dout, *final_grads):
        q, k, v, local, lse, gate, m, z_before = ctx.saved_tensors
        seg, matrix_dtype, group = ctx.segment_len, operand_dtype(q.dtype), ctx.group
        if dout is None:
            dout = torch.zeros_like(q)
        elif ctx.fused_local:
            dout = dout.contiguous()  # the local attention's backward reads it as its dO, flattened
        # m: the memories kept before every segment (ctx.kept 1), every other one (2: one step
        # from each to the next, no recurrence), or the memory entering the call (0)
        if ctx.kept == 1:
            m_before = m
            gram = memory_gram(k, z_before, seg) if ctx.rule == "delta" else None
        else:
            even = ctx.kept == 2  # the step from M_2p to M_2p+1 takes segment 2p's update alone
            if ctx.rule == "linear":
                (dm, _), gram = memory_updates(k, v, seg, even_updates=even), None
            else:
                dm, _, gram = memory_updates_and_gram(k, v, z_before, seg, even_updates=even)
            if even:
                m_before = expand_kept_memories(m, dm, gram, z_before.shape[1], q.dtype)
            elif gram is None:
                m_before = memory_scan(dm, m, matrix_dtype)[0]
            else:
                m_before = delta_scan(dm, gram, m, q.dtype)[0]
            del dm
        delta = torch.empty_like(lse) if ctx.fused_local else None
        # The local attention's fused backward adds its dQ into a float32 buffer: the memory
        # path's dq, written in float32, is that buffer (no separate add of the two).
        dq, dlocal, dgate, gm, gz = memory_retrieval_backward(
            q, local, gate, m_before, z_before, seg, dout, delta, torch.float32 if ctx.fused_local else None
        )
        g_mfinal, g_zfinal = final_grads
        gram_grad = None
        if ctx.rule == "linear":
            del m_before
            if group is not None:  # the reversed scans start from this rank's totals' gradients
                pairs = [(gm, g_mfinal), (gz, g_zfinal)]
                (gm_given, gz_given), (g_mfinal, g_zfinal) = _ranks_grads(pairs, group)
            grad_dm, gm = memory_scan(gm, g_mfinal, matrix_dtype, reverse=True)
        else:
            if group is not None:  # this rank's final M is the next rank's given one (the last's: shared)
                shared = torch.zeros_like(gm[:, 0]) if g_mfinal is None else g_mfinal
                shared = comm.sum_over_ranks(shared, group)
                g_mfinal = comm.relay_receive(shared, group, backward=True)
                g_mfinal = shared if g_mfinal is None else g_mfinal
            grad_dm, gm = delta_scan(gm, gram, g_mfinal, k.dtype, transpose=True)
            if group is not None:  # before S: only the reversed recurrence is on the ranks' chain
                comm.relay_send(gm, group, backward=True)
                gm_given = gm if dist.get_rank(group) == 0 else torch.zeros_like(gm)  # m entered rank 0 only
            s_grad = gram_gradient(grad_dm, m_before, k.dtype)
            del m_before, gram
            gz = delta_gram_grads(k, z_before, seg, s_grad, gz)
            if group is not None:
                (gz_given,), (g_zfinal,) = _ranks_grads([(gz, g_zfinal)], group)
            gram_grad = (s_grad, z_before)
        grad_dz, gz = memory_scan(gz, g_zfinal, torch.float32, reverse=True)
        if group is not None:
            gm, gz = gm_given, gz_given
        if ctx.fused_local:  # the updates' backward added into the local attention's dK, dV
            flat, problem = _flat(q, k, v), ctx.problem
            # The local attention's backward runs on dout itself (dlocal = (1 - gate) dout is
            # never made): its LSE shifted by -log(1 - gate) scales the probabilities it
            # recomputes, and so every gradient, by 1 - gate.
            lse = lse - torch.log1p(-gate)[:, None]
            dout_flat, dq_flat = (t.view(t.shape[0] * t.shape[1], *t.shape[2:]) for t in (dout, dq))
            updates_grads = (grad_dm, grad_dz) if gram_grad is None else (grad_dm, grad_dz, gram_grad)
            grads = local_backward(dout_flat, *flat, lse, delta, problem, dq_flat, seg, *updates_grads)
            dk, dv = (t.view(k.shape) for t in grads)
            dq = dq.to(q.dtype)
        else:
            dk, dv = memory_updates_backward(k, v, seg, grad_dm, grad_dz, gram_grad)
        return dq, dk, dv, dlocal, dgate, gm, gz, None, None, None, None


def _ranks_grads(pairs, group):
    """Gradients across the ranks of ``group`` (``_GatedMemory``'s backward) for each (gradient
    of a memory part before each of this rank's segments (B, n_seg, ...), this rank's gradient of
    the shared final part or None) in ``pairs``, by one all-gather: ([per pair, the gradient of
    the part the call was given: the first summed over the segments plus the second], [per pair,
    the gradient of this rank's total update of the part: the later ranks' sums plus the
    second's sum over the ranks]). Summed over the ranks the first is the full gradient."""
    given = [g.float().sum(1) for g, _ in pairs]
    finals = [torch.zeros_like(t) if f is None else f.float() for t, (_, f) in zip(given, pairs)]
    flat = [t.flatten(2) for t in given + finals]
    widths = [t.shape[-1] for t in flat]
    mine = torch.cat(flat, dim=-1)
    prefix, total = comm.exclusive_prefix_sum(mine, group).wait()
    half = sum(widths) // 2
    later = total[..., :half] - prefix[..., :half] - mine[..., :half]
    parts = (mine[..., :half] + mine[..., half:], later + total[..., half:])
    return [[t.view(g.shape) for t, g in zip(p.split(widths[: len(pairs)], dim=-1), given)] for p in parts]


def _split_memory(flat: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, z = flat.split([head_dim * head_dim, head_dim], dim=-1)
    return m.unflatten(-1, (head_dim, head_dim)), z


@functools.lru_cache(maxsize=64)
def _segment_bounds(batch: int, seqlen: int, segment_len: int, device: torch.device) -> torch.Tensor:
    starts = range(0, seqlen, segment_len)
    bounds = [row * seqlen + s for row in range(batch) for s in starts] + [batch * seqlen]
    return cu_seqlens_tensor(bounds, device)


def segment_local_attention(q, k, v, segment_len: int, softmax_scale: float | None) -> torch.Tensor:
    """Causal attention inside each segment: the batch rows' segments packed into one varlen call."""
    b, s, heads, d = q.shape
    cu = _segment_bounds(b, s, segment_len, q.device)
    longest = min(segment_len, s)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = flash_attn_varlen_func(*_flat(q, k, v), cu, cu, longest, longest, softmax_scale=scale, causal=True)
    return out.view(b, s, heads, d)


class InfiniAttention(torch.nn.Module):
    """Infini-attention as an attention core: (q, k, v) (batch, seqlen, heads, head_dim) shards
    -> output, with the learned gate ``beta`` (heads,) as a parameter (initialised to 0: an even
    mix of memory and local attention).

    With ``group=None`` it uses the world group when torch.distributed is initialized and runs
    on one device otherwise, as ``SequenceParallelAttention`` does; shards are contiguous
    (``shard_batch(..., layout="contiguous")``). Under sequence parallelism ``beta``'s gradient
    on each rank is that rank's contribution: ``reduce_gradients`` sums them.
    """

    def __init__(
        self,
        heads: int,
        segment_len: int,
        update: str = "linear",
        softmax_scale: float | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
            raise ValueError(f"heads must be a positive int, got {heads!r}")
        if isinstance(segment_len, bool) or not isinstance(segment_len, int) or segment_len <= 0:
            raise ValueError(f"segment_len must be a positive int, got {segment_len!r}")
        if update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
        self.beta = torch.nn.Parameter(torch.zeros(heads))
        self.segment_len, self.update = segment_len, update
        self.softmax_scale, self.group = softmax_scale, group

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        if cu_seqlens is not None:
            raise ValueError(
                "InfiniAttention does not take packed documents (cu_seqlens): the memory spans the row"
            )
        group = self.group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        return infini_attention(
            q, k, v, self.beta, self.segment_len,
            group=group, update=self.update, softmax_scale=self.softmax_scale,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"heads={self.beta.numel()}, segment_len={self.segment_len}, update={self.update!r}"
