"""The ring's public entry points: ring-flash-attn's ``ring_flash_attn_func``,
``zigzag_ring_flash_attn_func`` and ``stripe_flash_attn_func``, and the dispatch between the eager
engine (``ring.py``) and its custom op (``ops.py``) under torch.compile. Layers: these entries
-> the op -> the engine; nothing below imports this module."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .conventions import attention_returns, check_dropout
from .kernels import check_sinks
from .kernels.ops import use_ops
from .layouts import ChunkLayout
from .merge import apply_sinks
from .ops import ring_attention_op
from .ring import ring_attention


def dispatch_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object):
    """(out, lse) of ``ring.ring_attention`` (same keyword arguments): traced by torch.compile
    (``use_ops``), the opaque op ``ringflash::ring_attn_forward``, which checks and plans when it
    runs (sinks stay outside it, in plain torch ops); eager, the engine itself."""
    # Under a dispatch mode (not traced), what no op takes, and an error the engine raises after
    # the ranks' check, stay on the engine.
    op_takes_it = not (
        options.get("block_mask") is not None
        or options.get("error") is not None
        or isinstance(options.get("layout"), ChunkLayout)
    )
    if not (isinstance(q, torch.Tensor) and use_ops(q, op_takes_it)):  # a non-tensor q: the engine raises
        return ring_attention(q, k, v, **options)
    if options.get("block_mask") is not None:  # no custom op takes a mask: a graph break
        return _ring_attention_eager(q, k, v, **options)
    options.pop("block_mask", None)
    error, sinks = options.pop("error", None), options.pop("sinks", None)
    if error is not None:
        raise error
    if sinks is not None:
        check_sinks(sinks, q.shape[2], q.device)
    return apply_sinks(*ring_attention_op(q, k, v, **options), sinks)


_ring_attention_eager = torch.compiler.disable(ring_attention)


def _ring_entry(
    q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
    return_attn_probs, group, *, layout, cu_seqlens, softcap, sinks, return_lse, block_mask=None, error=None,
):  # fmt: skip
    """The dense entry points' one body; ``error``: an argument error the caller found (a packed
    tensor of the wrong shape, ``ring_packed``), raised after the rank check as this one's are."""
    try:
        check_dropout(dropout_p)
    except (ValueError, TypeError) as e:
        error = error or e  # raised after the rank check, which every rank must join
    out, lse = dispatch_ring_attention(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, deterministic=deterministic, group=group, layout=layout,
        cu_seqlens=cu_seqlens, block_mask=block_mask, error=error,
    )  # fmt: skip
    return attention_returns(out, lse, return_attn_probs, return_lse)


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "contiguous",
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    block_mask: object = None,
) -> torch.Tensor | tuple:
    """Exact attention over a sequence sharded across ``group``, differentiable; ring-flash-attn's
    ``ring_flash_attn_func`` (same arguments, order, defaults and returns; contiguous shards).

    Args:
        q: this rank's shard (batch, local_seqlen, heads_q, head_dim) of the full sequence,
            split by ``layout`` (``shard_sequence(x, group, layout=layout)``); float16/bfloat16/float32.
        k, v: this rank's shards (batch, local_seqlen, heads_k, head_dim); heads_q % heads_k == 0.
        dropout_p: must be 0.0 (no dropout; anything else is a ValueError).
        softmax_scale, causal, window_size: as in ``flash_attn_func``, over the full sequence.
        alibi_slopes: float32 (heads_q,) or (batch, heads_q): bias -slope * |i - j| in global
            token positions, as in flash-attn.
        deterministic: only kernels that sum in a fixed order.
        return_attn_probs: return (out, lse, None), as ring-flash-attn does (no probabilities).
        group: the sequence-parallel process group (default: the world).
        layout: how the sequence is split: "contiguous" (ring-flash-attn's ``ring_flash_attn_func``;
            the default), "zigzag" (balanced causal work, ``zigzag_ring_flash_attn_func``) or
            "stripe" (``stripe_flash_attn_func``). It must be the layout the shards were cut with
            (``shard_sequence``'s default is "zigzag"): the data cannot tell.
        cu_seqlens: packed documents (batch must be 1): int cumulative lengths (0, ..., total)
            of the documents of the *full* sequence, the same on every rank; attention stays
            inside each document, and each is split by ``layout`` on its own (shard with
            ``shard_sequence(..., cu_seqlens=...)``). A CPU tensor or a list avoids a device sync.
        softcap: scores -> softcap * tanh(scores / softcap) (Gemma-2); 0.0 = off.
        sinks: (heads_q,) learned sink logits (gpt-oss): each joins every row's softmax
            denominator with no value; applied once to the merged result. Its gradient is this
            rank's rows' contribution: sum it over the group as for any replicated parameter
            (``reduce_gradients`` does).
        return_lse: return (out, lse).
        block_mask: ringflash's: any mask, block-sparse (``TileMask`` or FlexAttention's
            ``BlockMask``) over the *full* sequence in global positions, the same on every rank;
            replaces causal/window_size; not with cu_seqlens, alibi_slopes or layout "stripe";
            each shard (zigzag: each half) a whole number of the mask's blocks (``sp_attn_func``).

    Returns:
        out: (batch, local_seqlen, heads_q, head_dim) in q's dtype, in q's token order; with
        ``return_lse`` also the float32 LSE (batch, heads_q, local_seqlen) (including the sinks,
        differentiable). Every rank of the group must call this with the same shapes and options,
        else every rank raises ValueError naming what differs.
    """
    return _ring_entry(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
        return_attn_probs, group, layout=layout, cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks,
        return_lse=return_lse, block_mask=block_mask,
    )  # fmt: skip


def zigzag_ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    block_mask: object = None,
) -> torch.Tensor | tuple:
    """``ring_flash_attn_func`` on zigzag shards (rank r holds chunks r and 2W-1-r of 2W), as
    ring-flash-attn's ``zigzag_ring_flash_attn_func``; causal=False and ``block_mask`` work too."""
    return _ring_entry(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
        return_attn_probs, group, layout="zigzag", cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks,
        return_lse=return_lse, block_mask=block_mask,
    )  # fmt: skip


def stripe_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple:
    """``ring_flash_attn_func`` on stripe shards (token t on rank t mod W), as ring-flash-attn's
    ``stripe_flash_attn_func``; windows and causal=False work too."""
    return _ring_entry(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
        return_attn_probs, group, layout="stripe", cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks,
        return_lse=return_lse,
    )  # fmt: skip
