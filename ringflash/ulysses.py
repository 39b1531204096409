"""The Ulysses and hybrid (Ulysses x ring) sequence-parallel engine; its entry point,
``sp_attn_func``, is in ``sp_functions.py``, its custom ops in ``ops.py``.

Ulysses re-partitions q, k, v from "my tokens, all heads" to "my heads, the tokens of my Ulysses
group" with one all-to-all (q, k, v batched together), runs attention there, and swaps back.
In the hybrid, that attention is itself a ring over the ring group; with a single Ulysses group
it is plain single-device attention (pure Ulysses), with Ulysses groups of one it is the ring.
The token layout is ``layouts.layout_indices(layout, rank, W, S, ulysses_size)``.

A call is planned once per call signature (``ulysses_setup``, ``SETUPS``) and runs as one
autograd Function (all-to-all, attention, all-to-all), whose dense setups replay from CUDA graphs
with the all-to-alls issued between them, as the ring's and the all-gather mode's
(``graph_replay.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from .block_masks import check_block_mask, converted_block_mask, dense_calls, heads_view
from .comm import RingComm, all_to_all_async, resolve_group_or_raise
from .consistency import join_cached_rank_check, join_rank_check
from .graph_replay import ReplayCache, Replays, backward_replay, replay_wanted
from .kernels import (
    AttentionProblem,
    attention_forward,
    attention_gradients,
    build_problem,
    check_sinks,
    check_window,
)
from .kernels.plans import cached_problem
from .kernels.problem import check_alibi_slopes
from .layouts import cumulative_lengths, document_lengths
from .mesh import UlyssesRingMesh, mode_ulysses_size, ulysses_ring_mesh
from .ring import RingPlan, ring_backward, ring_forward, ring_setup
from .setup_cache import SetupCache
from .word_views import as_words


def kv_heads_for(heads_q: int, heads_k: int, u: int) -> int:
    """K/V heads to send so each Ulysses rank gets the ones its query heads use."""
    if heads_q % u:
        raise ValueError(f"Ulysses needs q heads ({heads_q}) divisible by the Ulysses group size ({u})")
    if heads_k % u == 0:
        return heads_k
    if u % heads_k == 0:
        return u  # replicate each K/V head only as far as needed: one per rank
    raise ValueError(
        f"Ulysses needs k/v heads ({heads_k}) divisible by, or dividing, the Ulysses group size ({u})"
    )


# ---- the all-to-alls ---------------------------------------------------------------------


def _exchanged(x: torch.Tensor, group: dist.ProcessGroup, u: int):
    """(a new tensor like ``x``, the pending all-to-all into it): chunk i of ``x`` (dim 0) goes
    to rank i, chunk j of the result came from rank j; ``wait`` before reading."""
    out = torch.empty_like(x)
    return out, all_to_all_async(out, x, group, u)


def _sendable(parts: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous all-to-all buffer of ``parts`` joined along dim 3: a tensor already laid
    out so (batch 1, one tensor) goes as it is, without a copy."""
    if len(parts) == 1 and parts[0].is_contiguous():
        return parts[0]
    return torch.cat(parts, dim=3)


def seq_to_heads(tensors: list[torch.Tensor], group: dist.ProcessGroup, u: int) -> torch.Tensor:
    """[(B, n, h_i, D)] local tokens, all heads (one dtype) -> (B, U*n, sum h_i/U, D) group tokens,
    my heads (tensor i's in its run of heads): one all-to-all for all tensors."""
    dtype, words = tensors[0].dtype, as_words(tensors)
    b, n, _, d = words[0].shape
    # Concatenated straight into the all-to-all's layout (destination rank first): one copy, of words.
    x = _sendable([t.reshape(b, n, u, t.shape[2] // u, d).permute(2, 0, 1, 3, 4) for t in words])
    y, pending = _exchanged(x, group, u)  # (U source ranks, B, n, sum h, D)
    pending.wait()
    return y.permute(1, 0, 2, 3, 4).reshape(b, u * n, x.shape[3], d).view(dtype)


def _to_seq_start(tensors: list[torch.Tensor], group: dist.ProcessGroup, u: int):
    """Start moving [(B, U*n, h_i, D)] (one dtype) back to local tokens: (buffer, pending); the
    buffer may hold 8-byte words (``word_views``), which ``_to_seq_finish`` views back."""
    words = as_words(tensors)
    b, un, _, d = words[0].shape
    x = _sendable([t.reshape(b, u, un // u, t.shape[2], d).permute(1, 0, 2, 3, 4) for t in words])
    return _exchanged(x, group, u)  # (U head groups, B, n, sum h, D)


def _to_seq_finish(y: torch.Tensor, heads: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """[(B, n, U*h_i, D)] of ``dtype`` from ``_to_seq_start``'s buffer, once its all-to-all is
    waited for."""
    u, b, n, _, d = y.shape
    starts = [sum(heads[:i]) for i in range(len(heads))]
    return [y[:, :, :, s : s + h].permute(1, 2, 0, 3, 4).reshape(b, n, u * h, d).view(dtype)
            for s, h in zip(starts, heads)]  # fmt: skip


def _lse_as_tokens(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, S) -> (B, S, H, 1): the LSE in the layout the all-to-alls move."""
    return lse.transpose(1, 2).unsqueeze(-1)


def _lse_from_tokens(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze(-1).transpose(1, 2).contiguous()


# ---- attention over this rank's heads --------------------------------------------------------


@dataclass(frozen=True, eq=False)
class HeadsPlan:
    """The attention of one Ulysses rank over its heads of its Ulysses group's tokens: one
    dense or varlen (packed documents, row 0) kernel call of ``problem`` (one ring rank, no block
    mask), else the ring over the ring group (``ring``: base problem, plan, comm; one ring rank
    with a block mask is the ring's single block-sparse call)."""

    problem: AttentionProblem | None
    ring: tuple[AttentionProblem, RingPlan, RingComm] | None

    @cached_property  # decided once per plan (a frozen dataclass keeps a __dict__ for it)
    def dense(self) -> bool:
        """No packed documents and no block mask: a setup that recurs call after call."""
        if self.problem is not None:
            return self.problem.cu_seqlens_q is None
        return dense_calls(self.ring[1])


def heads_plan(
    q_h: torch.Tensor,
    k_h: torch.Tensor,
    v_h: torch.Tensor,
    mesh: UlyssesRingMesh,
    *,
    layout: str,
    cu_seqlens: torch.Tensor | Sequence[int] | None,
    alibi_slopes: torch.Tensor | None,
    block_mask: object,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    deterministic: bool,
) -> HeadsPlan:
    """The plan of attention over q_h (B, U*n, hq/U, D), k_h/v_h (B, U*n, kv/U, D), whose values
    it does not read (any tensors of those shapes, dtype and device); ``alibi_slopes``: this
    rank's (B, hq/U); ``block_mask``: this rank's heads' view of a checked TileMask. The ranks
    have been checked already."""
    if mesh.ring_size == 1 and block_mask is None:
        left, right = window_size
        if cu_seqlens is None:
            problem = cached_problem(q_h, k_h, v_h, None, None, 0, 0, softmax_scale, causal, left, right,
                                     softcap, alibi_slopes, deterministic)  # fmt: skip
            return HeadsPlan(problem, None)
        # One ring rank: every layout is the natural token order.
        doc_lens = document_lengths(cu_seqlens, q_h.shape[1], layout, 1)
        cu, n = cumulative_lengths(doc_lens, q_h.device), max(doc_lens)
        if alibi_slopes is not None:  # one slope per head, the same for every document
            alibi_slopes = alibi_slopes[0].expand(len(doc_lens), -1)
        problem = build_problem(
            q_h[0], k_h[0], v_h[0], softmax_scale, causal, window_size, cu_seqlens_q=cu, cu_seqlens_k=cu,
            max_seqlen_q=n, max_seqlen_k=n, softcap=softcap, alibi_slopes=alibi_slopes,
            deterministic=deterministic,
        )  # fmt: skip
        return HeadsPlan(problem, None)
    if mesh.ring_size == 1:  # whole chunks of the mask's blocks whatever the layout's chunks
        layout = "contiguous"
    base, plan, comm, _ = ring_setup(
        q_h, k_h, v_h, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=None, deterministic=deterministic, group=mesh.ring_group,
        layout=layout, cu_seqlens=cu_seqlens, check_ranks=False, block_mask=block_mask,
    )  # fmt: skip
    return HeadsPlan(None, (base, plan, comm))


def heads_forward(
    q_h: torch.Tensor, k_h: torch.Tensor, v_h: torch.Tensor, plan: HeadsPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_h (B, U*n, hq/U, D), lse_h float32 (B, hq/U, U*n)) of ``plan``."""
    if plan.problem is None:
        _, ring, comm = plan.ring
        return ring_forward(q_h, k_h.contiguous(), v_h.contiguous(), ring, comm)
    if plan.problem.varlen:
        out, lse = attention_forward(q_h[0], k_h[0], v_h[0], plan.problem)
        return out[None], lse[None]
    return attention_forward(q_h, k_h, v_h, plan.problem)


def heads_backward(
    dout_h: torch.Tensor,
    q_h: torch.Tensor,
    k_h: torch.Tensor,
    v_h: torch.Tensor,
    out_h: torch.Tensor,
    lse_h: torch.Tensor,
    plan: HeadsPlan,
    dlse_h: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_h, dk_h, dv_h) of ``heads_forward``; ``dlse_h``: the LSE's gradient, or None."""
    if plan.problem is None:
        base, ring, comm = plan.ring
        return ring_backward(dout_h.contiguous(), q_h, k_h.contiguous(), v_h.contiguous(), out_h, lse_h, base,
                             ring, comm, dlse=dlse_h)  # fmt: skip
    if plan.problem.varlen:
        row0 = [None if t is None else t[0] for t in (dout_h, q_h, k_h, v_h, out_h, lse_h, dlse_h)]
        return tuple(g[None] for g in attention_gradients(*row0[:6], plan.problem, row0[6]))
    return attention_gradients(dout_h, q_h, k_h, v_h, out_h, lse_h, plan.problem, dlse_h)


# ---- the whole call ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class UlyssesPlan:
    """What a Ulysses or hybrid call runs: its mesh, the caller's K/V heads and the K/V heads sent
    (replicated up to one per Ulysses rank where there are fewer), the attention over this rank's
    heads, and whether the LSE goes back to the token layout (a caller that returns it or applies
    sinks to it)."""

    mesh: UlyssesRingMesh
    heads_k: int
    kv_heads: int
    heads: HeadsPlan
    with_lse: bool = True


def split_heads(qkv_h: torch.Tensor, heads_q: int) -> list[torch.Tensor]:
    """q_h, k_h, v_h from ``seq_to_heads``'s (B, U*n, hq/U + 2 kv/U, D) result."""
    hk = (qkv_h.shape[2] - heads_q) // 2
    return list(torch.split(qkv_h, [heads_q, hk, hk], dim=2))


def ulysses_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan) -> tuple:
    """(out (B, n, Hq, D), qkv_h, out_h, lse_h[, lse (B, Hq, n) float32 where ``plan.with_lse``])
    over local shards q (B, n, Hq, D), k/v (B, n, Hk, D); the head-layout tensors are what
    ``ulysses_backward`` takes."""
    mesh, u = plan.mesh, plan.mesh.ulysses_size
    if plan.kv_heads != plan.heads_k:
        rep = plan.kv_heads // plan.heads_k
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    qkv_h = seq_to_heads([q, k, v], mesh.ulysses_group, u)
    out_h, lse_h = heads_forward(*split_heads(qkv_h, q.shape[2] // u), plan.heads)
    out_buf, out_pending = _to_seq_start([out_h], mesh.ulysses_group, u)
    if plan.with_lse:
        lse_buf, lse_pending = _to_seq_start([_lse_as_tokens(lse_h)], mesh.ulysses_group, u)
    out_pending.wait()
    (out,) = _to_seq_finish(out_buf, [out_h.shape[2]], out_h.dtype)
    if not plan.with_lse:
        return out, qkv_h, out_h, lse_h
    lse_pending.wait()
    (lse,) = _to_seq_finish(lse_buf, [lse_h.shape[1]], lse_h.dtype)
    return out, qkv_h, out_h, lse_h, _lse_from_tokens(lse)


def ulysses_backward(
    dout: torch.Tensor,
    qkv_h: torch.Tensor,
    out_h: torch.Tensor,
    lse_h: torch.Tensor,
    plan: UlyssesPlan,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the local layout from dout (B, n, Hq, D) and the LSE's gradient dlse
    (B, Hq, n) or None; the other tensors are ``ulysses_forward``'s."""
    mesh, u = plan.mesh, plan.mesh.ulysses_size
    dout_h = seq_to_heads([dout], mesh.ulysses_group, u)
    dlse_h = None
    if dlse is not None:  # (B, H, n) -> (B, H/U, U*n), as the LSE went the other way
        dlse_h = _lse_from_tokens(seq_to_heads([_lse_as_tokens(dlse)], mesh.ulysses_group, u))
    grads = heads_backward(dout_h, *split_heads(qkv_h, out_h.shape[2]), out_h, lse_h, plan.heads, dlse_h)
    buf, pending = _to_seq_start(list(grads), mesh.ulysses_group, u)
    pending.wait()
    dq, dk, dv = _to_seq_finish(buf, [g.shape[2] for g in grads], grads[0].dtype)
    if plan.kv_heads != plan.heads_k:  # K/V heads were replicated for the Ulysses ranks: sum the copies
        b, n, _, d = dk.shape
        dk, dv = (g.reshape(b, n, plan.heads_k, -1, d).sum(3) for g in (dk, dv))
    return dq, dk, dv


# The Ulysses and hybrid modes' graphs by (plan, group), as the ring's (``ring.REPLAYS``).
REPLAYS = ReplayCache()


def ulysses_replays(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan) -> Replays | None:
    """The graphs of this plan where its calls replay (``graph_replay.replay_wanted``: dense
    plans by default, as the ring's), else None."""
    if not replay_wanted(q, k, v, dense=plan.heads.dense):
        return None
    return plan_replays(plan)


def plan_replays(plan: UlyssesPlan) -> Replays:
    """The graphs of this plan, whether or not its calls should replay."""
    return REPLAYS.get(plan, plan.mesh.ulysses_group, lambda: (
        lambda q, k, v: ulysses_forward(q, k, v, plan),
        lambda dout, qkv_h, out_h, lse_h: ulysses_backward(dout, qkv_h, out_h, lse_h, plan),
    ))  # fmt: skip


def replayed_ulysses_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan, take: tuple[int, ...] | None = None
) -> tuple[tuple, Replays | None]:
    """(``ulysses_forward``'s outputs, the replays taken or None) of a planned call: replayed
    from the plan's graphs where ``ulysses_replays`` gives them (``take``: the outputs copied out
    of them, the others None). The autograd Function and the custom op both run this."""
    replays = ulysses_replays(q, k, v, plan)
    if replays is None:
        return ulysses_forward(q, k, v, plan), None
    return replays.forward(q, k, v, take=take), replays


def replayed_ulysses_backward(
    dout: torch.Tensor,
    qkv_h: torch.Tensor,
    out_h: torch.Tensor,
    lse_h: torch.Tensor,
    plan: UlyssesPlan,
    replays: Replays | None,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a planned call (dout contiguous): replayed from ``replays`` where
    ``backward_replay`` allows, else ``ulysses_backward``."""
    replay = backward_replay(replays, dlse)
    if replay is not None:
        return replay(dout, qkv_h, out_h, lse_h)
    return ulysses_backward(dout, qkv_h, out_h, lse_h, plan, dlse)


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: UlyssesPlan, differentiable: bool):
        # Without a backward to come, the head-layout tensors it would take stay in the graph.
        take = None if differentiable else _WITHOUT_BACKWARD[plan.with_lse]
        (out, qkv_h, out_h, lse_h, *lse), replays = replayed_ulysses_forward(q, k, v, plan, take)
        ctx.save_for_backward(qkv_h, out_h, lse_h)
        ctx.plan, ctx.replays = plan, replays
        ctx.set_materialize_grads(False)
        return out, lse[0] if lse else None

    @staticmethod
    def backward(ctx, dout, dlse):
        qkv_h, out_h, lse_h = ctx.saved_tensors
        if dout is None:  # only the LSE was used
            b, un, h, d = out_h.shape
            u = ctx.plan.mesh.ulysses_size
            dout = out_h.new_zeros((b, un // u, u * h, d))
        dout = dout.contiguous()
        dq, dk, dv = replayed_ulysses_backward(dout, qkv_h, out_h, lse_h, ctx.plan, ctx.replays, dlse)
        return dq, dk, dv, None, None


# The outputs a call without a backward takes from ulysses_forward: out (and lse), by plan.with_lse.
_WITHOUT_BACKWARD = {False: (0,), True: (0, 4)}


def run_ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: UlyssesPlan
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse or None where the plan has no LSE) of a planned call, differentiable in q, k, v."""
    differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _UlyssesAttention.apply(q, k, v, plan, differentiable)


# ---- validation and planning, once per call signature ------------------------------------------


def check_ulysses_arguments(
    q: object,
    k: object,
    v: object,
    *,
    causal: object,
    window_size: object,
    alibi_slopes: object,
    sinks: object,
    cu_seqlens: object,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What a Ulysses or hybrid call must satisfy before its all-to-all: (alibi_slopes as float32
    (batch, heads_q), checked sinks); raises ValueError/TypeError."""
    check_window(causal, window_size)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, local_seqlen, heads, head_dim)")
    if k.shape[:2] != q.shape[:2] or v.shape != k.shape:
        raise ValueError(
            "Ulysses needs q, k and v shards of the same batch and local length, and k and v of one shape, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    alibi_slopes = check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
    sinks = check_sinks(sinks, q.shape[2], q.device)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got batch {q.shape[0]}")
    return alibi_slopes, sinks


def _placeholder(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` with t's dtype and device that holds no memory (planning reads shapes)."""
    return t.new_empty((1,) * (len(shape) - 1) + (shape[-1],)).expand(shape)


def ulysses_setup(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    sp_mode: str,
    ulysses_size: int | None,
    layout: str,
    cu_seqlens: torch.Tensor | Sequence[int] | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    block_mask: object,
    with_lse: bool,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    deterministic: bool,
    check_ranks: bool = True,
    error: Exception | None = None,
) -> tuple[UlyssesPlan, torch.Tensor | None]:
    """Validate a Ulysses (``sp_mode="ulysses"``: U = the group's size) or hybrid call and plan
    it: (plan, checked sinks). Built once per call signature (``SETUPS``); the ranks' check runs
    on every call. ``with_lse``: the LSE goes back to the token layout. ``error``: an argument
    error the caller found, raised after the ranks' check, which this rank still joins."""
    block_mask, error = converted_block_mask(block_mask, error)
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   deterministic=deterministic, sp_mode=sp_mode, ulysses_size=ulysses_size, layout=layout,
                   cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes, block_mask=block_mask,
                   with_lse=with_lse)  # fmt: skip
    key, resolved, hit = SETUPS.lookup(q, k, v, group, error, **options)
    if hit is not None:  # built before for this signature; the ranks' check still runs
        plan, digests = hit
        sinks = join_cached_rank_check(resolved, check_ranks, q, k, v, heads_q=q.shape[2], digests=digests,
                                       sinks=sinks, **options)  # fmt: skip
        return plan, sinks
    checked_alibi = u = mask = None
    try:
        checked_alibi, sinks = check_ulysses_arguments(q, k, v, causal=causal, window_size=window_size,
                                                       alibi_slopes=alibi_slopes, sinks=sinks,
                                                       cu_seqlens=cu_seqlens)  # fmt: skip
    except (ValueError, TypeError) as e:
        error = error or e
    group = resolve_group_or_raise(group, error)
    world = dist.get_world_size(group)
    if error is None:
        try:
            u = mode_ulysses_size(sp_mode, ulysses_size, world)
            kv_heads = kv_heads_for(q.shape[2], k.shape[2], u)
            if block_mask is not None:
                mask = check_block_mask(
                    block_mask, causal=causal, window_size=window_size, alibi_slopes=alibi_slopes,
                    cu_seqlens=cu_seqlens, total=q.shape[1] * world, batch=q.shape[0], heads_q=q.shape[2],
                    device=q.device,
                )  # fmt: skip
        except (ValueError, TypeError) as e:
            error = e
    digests: dict = {}  # the check's memo, kept with the setup
    join_rank_check(group, check_ranks, error, q, k, v, digests=digests, sinks=sinks, **options)
    mesh = ulysses_ring_mesh(group, u)
    j, per_rank = dist.get_rank(mesh.ulysses_group), q.shape[2] // u
    heads = slice(j * per_rank, (j + 1) * per_rank)  # this rank's query heads after the all-to-all
    if mask is not None and mask.heads > 1:
        mask = heads_view(mask, heads.start, heads.stop)
    if checked_alibi is not None:
        checked_alibi = checked_alibi[:, heads].contiguous()
    b, n, _, d = q.shape
    q_h = _placeholder(q, (b, u * n, per_rank, d))
    k_h, v_h = (_placeholder(t, (b, u * n, kv_heads // u, t.shape[3])) for t in (k, v))
    inner = heads_plan(
        q_h, k_h, v_h, mesh, layout=layout, cu_seqlens=cu_seqlens, alibi_slopes=checked_alibi,
        block_mask=mask, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        deterministic=deterministic,
    )  # fmt: skip
    plan = UlyssesPlan(mesh, k.shape[2], kv_heads, inner, with_lse)
    weak = () if block_mask is None else (block_mask,)
    SETUPS.put(key, (plan, digests), group, alibi_slopes, cu_seqlens, weak=weak)
    return plan, sinks


# Ulysses and hybrid setups by call signature (ulysses_setup).
SETUPS = SetupCache()
