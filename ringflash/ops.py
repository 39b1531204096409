"""Sequence-parallel attention as ``torch.library`` custom operators (namespace ``ringflash``).

Under ``torch.compile`` the ring and Ulysses/hybrid entry points run as opaque ops, so a
compiled model traces them without a graph break and Inductor leaves the kernels and the
communication inside alone. The process group travels as its registered name
(``comm.group_name``), layouts as strings, packed documents' ``cu_seqlens`` as a tensor or an
int list; validation, the ranks' agreement check and planning happen inside the real
implementations, when the op runs. Sinks stay outside (``merge_sinks``, plain torch ops), so the
LSE is differentiable: a gradient on it enters the backward as delta_i -= dlse_i.

    ring_attn_forward(q, k, v, group_name, layout, ...) -> (out, lse)
    ring_attn_backward(dout, q, k, v, out, lse, dlse, group_name, layout, ...) -> (dq, dk, dv)
    ulysses_attn_forward(q, k, v, group_name, layout, ulysses_size, ...)
        -> (out, lse, qkv_h, out_h, lse_h)   (the last three: head layout, for the backward)
    ulysses_attn_backward(dout, dlse, qkv_h, out_h, lse_h, heads_k, group_name, ...) -> (dq, dk, dv)

In eager mode, plain tensors take the autograd.Function path of ring.py/ulysses.py instead
(``kernels.ops.use_ops``). Both run the same planned calls, which dense setups replay from the
library's CUDA graphs (``graph_replay.py``): the ops' backward finds the forward's plan, and so
its graphs, again (the ring's setup cache; ``_FORWARD_PLANS`` for Ulysses). ALiBi with
Ulysses/hybrid is not available under compile yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import group_from_name, group_name
from .kernels.ops import check_scalar_args
from .layouts import layout_name
from .mesh import check_ulysses_size, ulysses_ring_mesh
from .ring import replayed_ring_backward, replayed_ring_forward, ring_replays, ring_setup
from .setup_cache import SetupCache
from .ulysses import (
    UlyssesPlan,
    heads_plan,
    kv_heads_for,
    plan_replays,
    replayed_ulysses_backward,
    replayed_ulysses_forward,
    split_heads,
    ulysses_setup,
)


def _cu(cu_seqlens: Tensor | None, cu_seqlens_list: list[int] | None):
    return cu_seqlens if cu_seqlens is not None else cu_seqlens_list


def _ring_plan(
    q,
    k,
    v,
    group_name,
    layout,
    cu_seqlens,
    cu_seqlens_list,
    softmax_scale,
    causal,
    window_left,
    window_right,
    softcap,
    alibi_slopes,
    deterministic,
    check_ranks,
):
    """``ring.ring_setup`` on the op arguments: validation, the ranks' agreement, the plan."""
    base, plan, comm, _ = ring_setup(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=(window_left, window_right),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=None,
        deterministic=deterministic,
        group=group_from_name(group_name),
        layout=layout,
        cu_seqlens=_cu(cu_seqlens, cu_seqlens_list),
        check_ranks=check_ranks,
    )
    return base, plan, comm


@torch.library.custom_op("ringflash::ring_attn_forward", mutates_args=())
def _ring_forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    layout: str,
    cu_seqlens: Tensor | None,
    cu_seqlens_list: list[int] | None,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    check_ranks: bool,
) -> tuple[Tensor, Tensor]:
    args = (
        group_name,
        layout,
        cu_seqlens,
        cu_seqlens_list,
        softmax_scale,
        causal,
        window_left,
        window_right,
        softcap,
        alibi_slopes,
        deterministic,
    )
    base, plan, comm = _ring_plan(q, k, v, *args, check_ranks)
    out, lse, _ = replayed_ring_forward(q, k.contiguous(), v.contiguous(), base, plan, comm)
    return out, lse


@_ring_forward_op.register_fake
def _ring_forward_fake(q, *_):
    b, n, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op("ringflash::ring_attn_backward", mutates_args=())
def _ring_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    group_name: str,
    layout: str,
    cu_seqlens: Tensor | None,
    cu_seqlens_list: list[int] | None,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    args = (
        group_name,
        layout,
        cu_seqlens,
        cu_seqlens_list,
        softmax_scale,
        causal,
        window_left,
        window_right,
        softcap,
        alibi_slopes,
        deterministic,
    )
    base, plan, comm = _ring_plan(q, k, v, *args, False)  # the forward checked the ranks
    k, v = k.contiguous(), v.contiguous()
    # The forward's setup, so the forward's graphs (the same cached plan: ``ring_replays``).
    replays = ring_replays(q, k, v, base, plan, comm)
    return replayed_ring_backward(dout.contiguous(), q, k, v, out, lse, base, plan, comm, replays, dlse)


@_ring_backward_op.register_fake
def _ring_backward_fake(dout, q, k, v, *_):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup_context(ctx, inputs, output) -> None:
    q, k, v, *args, _check_ranks = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = args
    ctx.set_materialize_grads(False)


def _ring_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = _ring_backward_op(dout, q, k, v, out, lse, dlse, *ctx.args)
    return dq, dk, dv, *(None,) * (len(ctx.args) + 1)


_ring_forward_op.register_autograd(_ring_backward, setup_context=_ring_setup_context)


def _sp_args(
    group, layout, cu_seqlens, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
):
    """The op arguments after the tensors, in schema types (the group as its name)."""
    scale, causal, (left, right), softcap, deterministic = check_scalar_args(
        softmax_scale, causal, window_size, softcap, deterministic
    )
    layout_name(layout)
    cu_tensor = cu_seqlens if isinstance(cu_seqlens, Tensor) else None
    cu_list = None if cu_seqlens is None or cu_tensor is not None else [int(c) for c in cu_seqlens]
    return (
        group_name(group),
        layout,
        cu_tensor,
        cu_list,
        scale,
        causal,
        left,
        right,
        softcap,
        alibi_slopes,
        deterministic,
    )


def ring_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    group,
    layout: str,
    cu_seqlens: Tensor | Sequence[int] | None,
    check_ranks: bool = True,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``ring.ring_attention`` (without sinks) through the
    ``ringflash::ring_attn_forward`` op, both differentiable. Arguments and shapes as there."""
    args = _sp_args(
        group, layout, cu_seqlens, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
    )
    return _ring_forward_op(q, k, v, *args, check_ranks)


def _ulysses_mesh(group: dist.ProcessGroup, ulysses_size: int):
    world = dist.get_world_size(group)
    return ulysses_ring_mesh(group, check_ulysses_size(ulysses_size or world, world))


# The plans of forward ops that replayed from graphs, by what their backward op receives (the
# head-layout tensors' layouts and the options): the backward replays the same plan's graphs.
_FORWARD_PLANS = SetupCache()


def _plan_key(
    saved: tuple[Tensor, ...], group: dist.ProcessGroup, heads_k: int, options: tuple
) -> tuple | None:
    """``_FORWARD_PLANS``' key: the saved (qkv_h, out_h, lse_h), the caller's K/V heads, and the
    options both Ulysses ops take after them (group_name to deterministic; tensors by identity)."""
    return _FORWARD_PLANS.key(*saved, group, heads_k=heads_k, options=options)


@torch.library.custom_op("ringflash::ulysses_attn_forward", mutates_args=())
def _ulysses_forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    layout: str,
    ulysses_size: int,
    cu_seqlens: Tensor | None,
    cu_seqlens_list: list[int] | None,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    group = group_from_name(group_name)
    options = (group_name, layout, ulysses_size, cu_seqlens, cu_seqlens_list, softmax_scale, causal,
               window_left, window_right, softcap, deterministic)  # fmt: skip
    plan, _ = ulysses_setup(
        q, k, v, group=group, sp_mode="hybrid" if ulysses_size else "ulysses",
        ulysses_size=ulysses_size or None, layout=layout, cu_seqlens=_cu(cu_seqlens, cu_seqlens_list),
        alibi_slopes=None, sinks=None, block_mask=None, with_lse=True, softmax_scale=softmax_scale,
        causal=causal, window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
    )  # fmt: skip
    with torch.no_grad():
        (out, qkv_h, out_h, lse_h, lse), replays = replayed_ulysses_forward(q, k, v, plan)
    # Contiguous, as the fake implementation promises (views of the all-to-alls' buffers may not be).
    saved = qkv_h.contiguous(), out_h.contiguous(), lse_h.contiguous()
    if replays is not None:  # the backward op replays the same plan's graphs
        key = _plan_key(saved, group, k.shape[2], options)
        if _FORWARD_PLANS.get(key, group) is not plan:
            _FORWARD_PLANS.put(key, plan, group, cu_seqlens)
    return out.contiguous(), lse.contiguous(), *saved


@_ulysses_forward_op.register_fake
def _ulysses_forward_fake(q, k, v, group_name, layout, ulysses_size, *_):
    mesh = _ulysses_mesh(group_from_name(group_name), ulysses_size)
    u = mesh.ulysses_size
    b, n, hq, d = q.shape
    hk = kv_heads_for(hq, k.shape[2], u)
    return (
        q.new_empty(q.shape),
        q.new_empty((b, hq, n), dtype=torch.float32),
        q.new_empty((b, u * n, (hq + 2 * hk) // u, d)),
        q.new_empty((b, u * n, hq // u, d)),
        q.new_empty((b, hq // u, u * n), dtype=torch.float32),
    )


@torch.library.custom_op("ringflash::ulysses_attn_backward", mutates_args=())
def _ulysses_backward_op(
    dout: Tensor,
    dlse: Tensor | None,
    qkv_h: Tensor,
    out_h: Tensor,
    lse_h: Tensor,
    heads_k: int,
    group_name: str,
    layout: str,
    ulysses_size: int,
    cu_seqlens: Tensor | None,
    cu_seqlens_list: list[int] | None,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    group = group_from_name(group_name)
    options = (group_name, layout, ulysses_size, cu_seqlens, cu_seqlens_list, softmax_scale, causal,
               window_left, window_right, softcap, deterministic)  # fmt: skip
    key = _plan_key((qkv_h, out_h, lse_h), group, heads_k, options)
    plan = _FORWARD_PLANS.get(key, group)
    replays = None if plan is None else plan_replays(plan)
    if plan is None:  # the forward ran eagerly: its plan, built again
        mesh = _ulysses_mesh(group, ulysses_size)
        q_h, k_h, v_h = split_heads(qkv_h, out_h.shape[2])
        inner = heads_plan(
            q_h, k_h, v_h, mesh, layout=layout, cu_seqlens=_cu(cu_seqlens, cu_seqlens_list),
            alibi_slopes=None, block_mask=None, softmax_scale=softmax_scale, causal=causal,
            window_size=(window_left, window_right), softcap=softcap, deterministic=deterministic,
        )  # fmt: skip
        plan = UlyssesPlan(mesh, heads_k, k_h.shape[2] * mesh.ulysses_size, inner)
    with torch.no_grad():
        dq, dk, dv = replayed_ulysses_backward(dout.contiguous(), qkv_h, out_h, lse_h, plan, replays, dlse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_ulysses_backward_op.register_fake
def _ulysses_backward_fake(dout, dlse, qkv_h, out_h, lse_h, heads_k, *_):
    b, n, hq, d = dout.shape
    return dout.new_empty(dout.shape), dout.new_empty((b, n, heads_k, d)), dout.new_empty((b, n, heads_k, d))


def _ulysses_setup_context(ctx, inputs, output) -> None:
    q, k, v, *args = inputs
    _, _, *saved = output
    ctx.save_for_backward(*saved)
    ctx.heads_k, ctx.out_shape, ctx.args = k.shape[2], output[0].shape, args
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)


def _ulysses_backward(ctx, dout, dlse, *_):
    qkv_h, out_h, lse_h = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = out_h.new_zeros(ctx.out_shape)
    dq, dk, dv = _ulysses_backward_op(dout, dlse, qkv_h, out_h, lse_h, ctx.heads_k, *ctx.args)
    return dq, dk, dv, *(None,) * len(ctx.args)


_ulysses_forward_op.register_autograd(_ulysses_backward, setup_context=_ulysses_setup_context)


def ulysses_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    deterministic: bool,
    group,
    layout: str,
    ulysses_size: int,
    cu_seqlens: Tensor | Sequence[int] | None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``sp_attn_func`` in "ulysses" (``ulysses_size`` 0: the whole group) or
    "hybrid" mode (without sinks and ALiBi) through the ``ringflash::ulysses_attn_forward`` op,
    both differentiable. Shapes as there; the op checks that the ranks agree when it runs."""
    args = _sp_args(
        group, layout, cu_seqlens, softmax_scale, causal, window_size, softcap, None, deterministic
    )
    out, lse, *_ = _ulysses_forward_op(q, k, v, *args[:2], ulysses_size, *args[2:-2], args[-1])
    return out, lse
