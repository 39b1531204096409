"""All-gather attention's entry machinery: in eager mode the autograd Function of ``allgather.py``,
traced by torch.compile the opaque custom ops below (namespace ``ringflash``), which validate,
check the ranks and plan when they run, as the ring's ops do (``ops.py``).

    allgather_attn_forward(q, k, v, group_name, layout, ...) -> (out, lse)
    allgather_attn_backward(dout, q, k, v, out, lse, dlse, group_name, layout, ...) -> (dq, dk, dv)

One pair serves both plans: ``sp_mode="allgather"`` (q (batch, n, heads, head_dim) cut by
``layout``, packed documents by ``cu_seqlens``) and the llama3 forms (q (n, heads, head_dim), one
varlen call with the caller's ``cu_seqlens_q``/``cu_seqlens_k`` against the gathered keys
[k_start, k_stop)). Sinks stay outside the ops (``merge_sinks``), so the LSE is differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .allgather import (
    gather_replays,
    layout_setup,
    prepared_setup,
    replayed_gather_backward,
    replayed_gather_forward,
    run_gather_attention,
)
from .comm import group_from_name, group_name
from .kernels import check_sinks
from .kernels.ops import check_scalar_args, use_ops
from .layouts import ChunkLayout, layout_name
from .merge import apply_sinks


def _setup(q: Tensor, k: Tensor, v: Tensor, args: tuple, check_ranks: bool):
    """(base, plan, group) from the op arguments after the tensors (``_forward_op``'s, from
    group_name to heads_k_stride, which is 0 for the default)."""
    (name, layout, cu_seqlens, cu_seqlens_list, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
     k_start, k_stop, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic,
     heads_k_stride) = args  # fmt: skip
    options = dict(
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=None, deterministic=deterministic, group=group_from_name(name),
        heads_k_stride=heads_k_stride or None, check_ranks=check_ranks,
    )  # fmt: skip
    if cu_seqlens_q is None:
        cu = cu_seqlens if cu_seqlens is not None else cu_seqlens_list
        base, plan, group, _ = layout_setup(q, k, v, layout=layout, cu_seqlens=cu, **options)
    else:
        ks = slice(k_start, k_stop)
        base, plan, group, _ = prepared_setup(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ks, **options
        )
    return base, plan, group


def _as_4d(*tensors: Tensor) -> list[Tensor]:
    """The engine's (batch, n, heads, head_dim) view of the llama3 forms' (n, heads, head_dim)."""
    return [t if t.dim() == 4 else t[None] for t in tensors]


@torch.library.custom_op("ringflash::allgather_attn_forward", mutates_args=())
def _forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group_name: str,
    layout: str,
    cu_seqlens: Tensor | None,
    cu_seqlens_list: list[int] | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    k_start: int,
    k_stop: int,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    heads_k_stride: int,
    check_ranks: bool,
) -> tuple[Tensor, Tensor]:
    args = (group_name, layout, cu_seqlens, cu_seqlens_list, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, k_start, k_stop, softmax_scale, causal, window_left, window_right, softcap,
            alibi_slopes, deterministic, heads_k_stride)  # fmt: skip
    base, plan, group = _setup(q, k, v, args, check_ranks)
    out, lse, _ = replayed_gather_forward(*_as_4d(q, k, v), base, plan, group)
    return (out, lse) if q.dim() == 4 else (out[0], lse[0])


@_forward_op.register_fake
def _forward_fake(q, *_):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("ringflash::allgather_attn_backward", mutates_args=())
def _backward_op(
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
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    k_start: int,
    k_stop: int,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
    heads_k_stride: int,
) -> tuple[Tensor, Tensor, Tensor]:
    args = (group_name, layout, cu_seqlens, cu_seqlens_list, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, k_start, k_stop, softmax_scale, causal, window_left, window_right, softcap,
            alibi_slopes, deterministic, heads_k_stride)  # fmt: skip
    base, plan, group = _setup(q, k, v, args, False)  # the forward checked the ranks
    dout4, q4, k4, v4, out4 = _as_4d(dout.contiguous(), q, k, v, out)
    if q.dim() == 3:
        lse, dlse = lse[None], None if dlse is None else dlse[None]
    # The forward's setup, so the forward's graphs (the same cached plan: ``gather_replays``).
    replays = gather_replays(q4, k4, v4, base, plan, group)
    dq, dk, dv = replayed_gather_backward(dout4, q4, k4, v4, out4, lse, base, plan, group, replays, dlse)
    return (dq, dk, dv) if q.dim() == 4 else (dq[0], dk[0], dv[0])


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, *_):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *args, _check_ranks = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = args
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, dlse, *ctx.args)
    return dq, dk, dv, *(None,) * (len(ctx.args) + 1)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _op_args(group, softmax_scale, causal, window_size, softcap, deterministic, heads_k_stride) -> dict:
    scale, causal, (left, right), softcap, deterministic = check_scalar_args(
        softmax_scale, causal, window_size, softcap, deterministic
    )
    if heads_k_stride is not None:  # 0 stands for None in the op: refuse it here, as the eager path does
        if type(heads_k_stride) is not int:
            raise TypeError(f"heads_k_stride must be an int or None, got {type(heads_k_stride).__name__}")
        if heads_k_stride < 1:
            raise ValueError(
                f"heads_k_stride must be a positive divisor of the k/v heads, got {heads_k_stride}"
            )
    return dict(group_name=group_name(group), softmax_scale=scale, causal=causal, window_left=left,
                window_right=right, softcap=softcap, deterministic=deterministic,
                heads_k_stride=heads_k_stride or 0)  # fmt: skip


def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    deterministic: bool,
    group: dist.ProcessGroup | None,
    layout: str,
    cu_seqlens: Tensor | Sequence[int] | None,
    heads_k_stride: int | None,
    error: Exception | None = None,
    block_mask: object = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``sp_mode="allgather"`` over local shards (batch, local_seqlen, heads,
    head_dim), differentiable in q, k, v and sinks; arguments as in ``allgather.layout_setup``
    (a call with ``block_mask`` is not traced: sp_attn_func runs it eagerly)."""
    # Traced (or under a dispatch mode): the op validates, checks the ranks and plans when it runs.
    # Under a mode (not traced), an error the engine raises after the ranks' check and a layout no
    # op takes stay on the engine.
    op_takes_it = error is None and not isinstance(layout, ChunkLayout)
    if use_ops(q, op_takes_it) and block_mask is None:
        if error is not None:
            raise error
        layout_name(layout)
        sinks = None if sinks is None else check_sinks(sinks, q.shape[2], q.device)
        cu_tensor = cu_seqlens if isinstance(cu_seqlens, Tensor) else None
        cu_list = None if cu_seqlens is None or cu_tensor is not None else [int(c) for c in cu_seqlens]
        args = _op_args(group, softmax_scale, causal, window_size, softcap, deterministic, heads_k_stride)
        out, lse = _forward_op(
            q, k, v, layout=layout, cu_seqlens=cu_tensor, cu_seqlens_list=cu_list, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, k_start=0, k_stop=0, alibi_slopes=alibi_slopes,
            check_ranks=True, **args,
        )  # fmt: skip
        return apply_sinks(out, lse, sinks)
    base, plan, group, sinks = layout_setup(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, deterministic=deterministic, group=group, layout=layout,
        cu_seqlens=cu_seqlens, heads_k_stride=heads_k_stride, error=error, block_mask=block_mask,
    )  # fmt: skip
    return apply_sinks(*run_gather_attention(q, k, v, base, plan, group), sinks)


def prepared_allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    local_k_slice: slice,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    deterministic: bool,
    group: dist.ProcessGroup | None,
    heads_k_stride: int | None,
    error: Exception | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (n, heads_q, head_dim), lse (heads_q, n)) of the llama3 forms' call, differentiable;
    arguments as in ``allgather.prepared_setup``."""
    if use_ops(q, error is None):
        if error is not None:
            raise error
        if not isinstance(local_k_slice, slice) or not all(
            isinstance(x, int) for x in (local_k_slice.start, local_k_slice.stop)
        ):
            raise TypeError(f"local_k_slice must be a slice of ints, got {local_k_slice!r}")
        sinks = None if sinks is None else check_sinks(sinks, q.shape[1], q.device)
        args = _op_args(group, softmax_scale, causal, window_size, softcap, deterministic, heads_k_stride)
        out, lse = _forward_op(
            q, k, v, layout="contiguous", cu_seqlens=None, cu_seqlens_list=None, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            k_start=local_k_slice.start, k_stop=local_k_slice.stop, alibi_slopes=alibi_slopes,
            check_ranks=True, **args,
        )  # fmt: skip
        out, lse = apply_sinks(out[None], lse[None], sinks)
        return out[0], lse[0]
    base, plan, group, sinks = prepared_setup(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, deterministic=deterministic, group=group,
        heads_k_stride=heads_k_stride, error=error,
    )  # fmt: skip
    out, lse = apply_sinks(*run_gather_attention(q[None], k[None], v[None], base, plan, group), sinks)
    return out[0], lse[0]
