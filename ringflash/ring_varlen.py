"""ring-flash-attn's varlen entry points: packed documents in flash-attn's 3-D layout.

As in ring-flash-attn, ``cu_seqlens`` are the cumulative lengths of each document's piece *on
this rank* (the same on every rank), not of the full documents: document i of local length l_i
is a full document of W * l_i tokens, split by the function's layout. Local token order:
- ``ring_flash_attn_varlen_func`` (contiguous) and ``stripe_flash_attn_varlen_func``: each
  document's piece in turn, the order ringflash's packed ring uses too;
- ``zigzag_ring_flash_attn_varlen_func``: each document's front chunk then its mirrored back
  chunk, document after document. ringflash's packed zigzag keeps all front chunks before all
  back chunks, so these calls permute q/k/v in and out/LSE back (one gather each).
ringflash's own form is ``ring_flash_attn_func(q[None], ..., cu_seqlens=<full documents>)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .comm import group_from_name, group_name, resolve_group_or_raise
from .conventions import attention_returns, check_dropout
from .kernels import check_sinks
from .kernels.ops import check_scalar_args, use_ops
from .layouts import ChunkLayout, host_bounds, layout_name
from .merge import apply_sinks
from .ring import ring_attention, ring_backward, ring_forward, ring_setup


def _local_bounds(cu_seqlens: object, tokens: int, max_seqlen: object) -> list[int]:
    bounds = host_bounds(cu_seqlens)
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != tokens or min(lens) <= 0:
        raise ValueError(
            f"cu_seqlens must be the cumulative lengths of this rank's pieces of the documents (as in "
            f"ring-flash-attn), from 0 to the local token count {tokens}, each piece non-empty; got {bounds}"
        )
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < max(lens):
        raise ValueError(
            f"max_seqlen must be an int >= the longest local piece ({max(lens)}), got {max_seqlen!r}"
        )
    return bounds


def _zigzag_order(bounds: list[int], device: torch.device) -> torch.Tensor:
    """Indices that take ring-flash-attn's zigzag varlen order (per document: front, back) to
    ringflash's (all fronts, then all backs)."""
    halves = [(a, (b - a) // 2) for a, b in zip(bounds, bounds[1:])]
    fronts = [torch.arange(a, a + c) for a, c in halves]
    backs = [torch.arange(a + c, a + 2 * c) for a, c in halves]
    return torch.cat(fronts + backs).to(device)


def _checked_bounds(cu_seqlens: object, tokens: int, max_seqlen: object, layout: str) -> list[int]:
    """This rank's piece bounds from ``cu_seqlens``, validated; reads cu_seqlens on the host."""
    bounds = _local_bounds(cu_seqlens, tokens, max_seqlen)
    if layout == "zigzag" and any((b - a) % 2 for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"zigzag needs every local piece of even length (two chunks), got cu_seqlens {bounds}"
        )
    return bounds


def _ringflash_form(
    bounds: list[int], layout: str, world: int, device: torch.device
) -> tuple[list[int], torch.Tensor | None]:
    """(ringflash's full-document cu_seqlens, the order that takes this rank's tokens to
    ringflash's packed zigzag order, or None where they are in it already)."""
    order = _zigzag_order(bounds, device) if layout == "zigzag" and world > 1 else None
    return [b * world for b in bounds], order


def _check_varlen_tensors(q: object, k: object, v: object, alibi_slopes: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (local_tokens, heads, head_dim)")
    if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() != 1:
        raise ValueError(
            "alibi_slopes for the ring varlen functions must be (heads_q,), one slope per head for "
            f"every document; got shape {tuple(alibi_slopes.shape)}"
        )


def _varlen_entry(
    q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
    deterministic, return_attn_probs, group, *, layout, softcap, sinks, return_lse, error=None,
):  # fmt: skip
    """The varlen entry points' one body; ``error``: an argument error the caller found (a packed
    tensor of the wrong shape, ``ring_packed``), raised after the rank check as this one's are."""
    # Traced (or under a dispatch mode): one opaque op reads cu_seqlens, checks the ranks and plans
    # when it runs. Under a mode (not traced), an error the engine raises after the ranks' check
    # and a layout no op takes stay on the engine.
    if use_ops(q, error is None and not isinstance(layout, ChunkLayout)):
        if error is not None:
            raise error
        check_dropout(dropout_p)
        _check_varlen_tensors(q, k, v, alibi_slopes)
        if not isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = torch.tensor(_local_bounds(cu_seqlens, q.shape[0], max_seqlen), dtype=torch.int64)
        if sinks is not None:
            check_sinks(sinks, q.shape[1], q.device)
        scale, causal, (left, right), softcap, deterministic = check_scalar_args(
            softmax_scale, causal, window_size, softcap, deterministic
        )
        args = (cu_seqlens, max_seqlen, group_name(group), layout_name(layout), scale, causal, left, right,
                softcap, alibi_slopes, deterministic)  # fmt: skip
        out, lse = _varlen_forward_op(q, k, v, *args)
        out, lse = apply_sinks(out[None], lse[None], sinks)
        return attention_returns(out[0], lse[0], return_attn_probs, return_lse)
    full_cu, order, bounds = None, None, []
    if error is None:  # a caller's error first; the arguments may not be tensors at all then
        try:
            check_dropout(dropout_p)
            _check_varlen_tensors(q, k, v, alibi_slopes)
            bounds = _checked_bounds(cu_seqlens, q.shape[0], max_seqlen, layout)
        except (ValueError, TypeError) as e:
            error = e
    world = dist.get_world_size(resolve_group_or_raise(group, error))
    if error is None:
        full_cu, order = _ringflash_form(bounds, layout, world, q.device)
    if order is not None:
        q, k, v = (t.index_select(0, order) for t in (q, k, v))
    q4, k4, v4 = (t[None] if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    out, lse = ring_attention(
        q4, k4, v4, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, deterministic=deterministic, group=group, layout=layout,
        cu_seqlens=full_cu, error=error,
    )  # fmt: skip
    out, lse = out[0], lse[0]
    if order is not None:
        back = torch.argsort(order)
        out, lse = out.index_select(0, back), lse.index_select(1, back)
    return attention_returns(out, lse, return_attn_probs, return_lse)


def _varlen_setup(q, k, v, cu_seqlens, max_seqlen, group_name_, layout, softmax_scale, causal, window_left,
                  window_right, softcap, alibi_slopes, deterministic, check_ranks):  # fmt: skip
    """(base, plan, comm, order) of an op call: cu_seqlens read on the host, and an error in them
    raised after the ranks' check, which this rank joins first."""
    group, order, full_cu, error = group_from_name(group_name_), None, None, None
    try:
        bounds = _checked_bounds(cu_seqlens, q.shape[0], max_seqlen, layout)
        full_cu, order = _ringflash_form(bounds, layout, dist.get_world_size(group), q.device)
    except (ValueError, TypeError) as e:
        error = e
    base, plan, comm, _ = ring_setup(  # q, k, v for their shapes: the token order does not matter
        q[None], k[None], v[None], softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes, sinks=None,
        deterministic=deterministic, group=group, layout=layout, cu_seqlens=full_cu, check_ranks=check_ranks,
        error=error,
    )  # fmt: skip
    return base, plan, comm, order


@torch.library.custom_op("ringflash::ring_varlen_attn_forward", mutates_args=())
def _varlen_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    group_name: str,
    layout: str,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (cu_seqlens, max_seqlen, group_name, layout, softmax_scale, causal, window_left, window_right,
            softcap, alibi_slopes, deterministic)  # fmt: skip
    _, plan, comm, order = _varlen_setup(q, k, v, *args, True)
    if order is not None:
        q, k, v = (t.index_select(0, order) for t in (q, k, v))
    out, lse = ring_forward(q[None], k[None].contiguous(), v[None].contiguous(), plan, comm)
    out, lse = out[0], lse[0]
    if order is not None:
        back = torch.argsort(order)
        out, lse = out.index_select(0, back), lse.index_select(1, back)
    return out, lse


@_varlen_forward_op.register_fake
def _varlen_forward_fake(q, *_):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("ringflash::ring_varlen_attn_backward", mutates_args=())
def _varlen_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    group_name: str,
    layout: str,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (cu_seqlens, max_seqlen, group_name, layout, softmax_scale, causal, window_left, window_right,
            softcap, alibi_slopes, deterministic)  # fmt: skip
    base, plan, comm, order = _varlen_setup(q, k, v, *args, False)  # the forward checked the ranks
    if order is not None:
        dout, q, k, v, out = (t.index_select(0, order) for t in (dout, q, k, v, out))
        lse, dlse = (None if t is None else t.index_select(1, order) for t in (lse, dlse))
    grads = ring_backward(
        dout.contiguous()[None], q[None], k[None].contiguous(), v[None].contiguous(), out[None], lse[None],
        base, plan, comm, dlse=None if dlse is None else dlse[None],
    )  # fmt: skip
    grads = [g[0] for g in grads]
    if order is not None:
        back = torch.argsort(order)
        grads = [g.index_select(0, back) for g in grads]
    return tuple(grads)


@_varlen_backward_op.register_fake
def _varlen_backward_fake(dout, q, k, v, *_):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, *args = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = args
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = _varlen_backward_op(dout, q, k, v, out, lse, dlse, *ctx.args)
    return dq, dk, dv, *(None,) * len(ctx.args)


_varlen_forward_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


_VARLEN_DOC = """Ring attention over packed documents in flash-attn's varlen layout; ring-flash-attn's
    ``{name}`` (same arguments, order, defaults and returns; {shards}).

    Args:
        q: this rank's tokens (local_tokens, heads_q, head_dim); k, v: (local_tokens, heads_k, head_dim).
        cu_seqlens: int cumulative lengths of this rank's pieces of the documents (0, ...,
            local_tokens), the same on every rank (ring-flash-attn's meaning, see the module).
        max_seqlen: an int >= the longest local piece.
        alibi_slopes: float32 (heads_q,) only (per-document slopes are refused).
        return_attn_probs: (out, lse, None), as ring-flash-attn returns with flash-attn 2.x's
            current varlen LSE layout: lse float32 (heads_q, local_tokens), in q's token order.
        return_lse: (out, lse), the same lse.
        Other arguments as in ``ring_flash_attn_func``.

    Returns:
        out (local_tokens, heads_q, head_dim) in q's dtype (and the LSE as above). Attention
        never crosses a document boundary.
    """


def ring_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple:
    return _varlen_entry(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, layout="contiguous", softcap=softcap, sinks=sinks,
        return_lse=return_lse,
    )  # fmt: skip


def zigzag_ring_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple:
    return _varlen_entry(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, layout="zigzag", softcap=softcap, sinks=sinks,
        return_lse=return_lse,
    )  # fmt: skip


def stripe_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple:
    return _varlen_entry(
        q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, group, layout="stripe", softcap=softcap, sinks=sinks,
        return_lse=return_lse,
    )  # fmt: skip


ring_flash_attn_varlen_func.__doc__ = _VARLEN_DOC.format(
    name="ring_flash_attn_varlen_func", shards="contiguous pieces of each document"
)
zigzag_ring_flash_attn_varlen_func.__doc__ = _VARLEN_DOC.format(
    name="zigzag_ring_flash_attn_varlen_func",
    shards="zigzag pieces: front and mirrored back chunk of each document",
)
stripe_flash_attn_varlen_func.__doc__ = _VARLEN_DOC.format(
    name="stripe_flash_attn_varlen_func", shards="stripe pieces: token t of a document on rank t mod W"
)
