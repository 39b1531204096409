"""``sp_attn_func``, the one entry point for every sequence-parallel mode, and
``ulysses_attn_func``: the eager engines (``ring.py``, ``ulysses.py``, ``allgather.py``) or, traced
by torch.compile, their custom ops (``ops.py``, ``allgather_ops.py``). Layers: these entries -> the
ops -> the engines; nothing below imports this module."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .allgather_ops import allgather_attention
from .comm import resolve_group
from .conventions import attention_returns, check_dropout
from .kernels.ops import traced, use_ops
from .layouts import ChunkLayout, check_layout
from .merge import apply_sinks
from .mesh import check_ulysses_type, contradiction, mode_ulysses_size
from .ops import ulysses_attention_op
from .ring_functions import dispatch_ring_attention
from .ulysses import check_ulysses_arguments, run_ulysses_attention, ulysses_setup

SP_MODES = ("ring", "ulysses", "hybrid", "allgather", "auto")

# sp_mode="auto" (the default) runs the all-gather mode up to this many tokens per rank (batch x
# local_seqlen), the ring above. Measured fwd+bwd (GQA 32/8 and MHA 32/32, head_dim 128, causal,
# zigzag; docs/performance.md): on 2 H200s the all-gather mode ran 1.0-1.5x the ring up to 8K
# tokens per rank (one gather against the ring's latency-bound steps), equal at 16K; on 4 H200s
# 1.98 / 1.43 / 1.03x the ring at 2K / 4K / 8K, 1.02x at 16K. The ring keeps less memory (the
# all-gather mode holds the whole sequence's K/V), hence the second bound.
AUTO_ALLGATHER_MAX_LOCAL = 8192
AUTO_ALLGATHER_MAX_TOTAL = 131072


def auto_sp_mode(q: object, group: dist.ProcessGroup | None) -> str:
    """The mode ``sp_mode="auto"`` runs for shards like ``q`` (batch, local_seqlen, heads,
    head_dim) over ``group``: "allgather" when this rank's batch x local_seqlen tokens are at most
    ``AUTO_ALLGATHER_MAX_LOCAL`` and the group's at most ``AUTO_ALLGATHER_MAX_TOTAL``, else
    "ring". Both accept the same shards (any layout) and options and give the same results; ranks
    that pass shards of different sizes may choose differently, and each engine's rank check then
    raises on every rank. Anything that is not a 4-D tensor, or a group that cannot be resolved,
    gets "ring", whose checks say why."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return "ring"
    try:
        world = dist.get_world_size(resolve_group(group))
    except (RuntimeError, TypeError, ValueError):
        return "ring"
    tokens = q.shape[0] * q.shape[1]
    short = tokens <= AUTO_ALLGATHER_MAX_LOCAL and tokens * world <= AUTO_ALLGATHER_MAX_TOTAL
    return "allgather" if short else "ring"


def check_sp_mode(sp_mode: str, ulysses_size: object) -> None:
    """What ``sp_mode`` and ``ulysses_size`` must satisfy whatever the group's size (so that a
    model configured for sequence parallelism fails on one device too, not first on many)."""
    if sp_mode not in SP_MODES:
        raise ValueError(f"sp_mode must be one of {SP_MODES}, got {sp_mode!r}")
    if sp_mode in ("ring", "allgather", "auto") and ulysses_size not in (None, 1):
        raise ValueError(contradiction(ulysses_size, sp_mode, "1 (or None)"))
    if sp_mode == "hybrid" and ulysses_size is None:
        raise ValueError('sp_mode="hybrid" needs ulysses_size')
    if ulysses_size is not None:
        check_ulysses_type(ulysses_size)


def sp_attn_func(
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
    layout: str = "zigzag",
    sp_mode: str = "auto",
    ulysses_size: int | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    heads_k_stride: int | None = None,
    block_mask: object = None,
) -> torch.Tensor | tuple:
    """Exact attention over a sequence sharded across ``group``, in any sequence-parallel mode.

    Positional arguments as in ``ring_flash_attn_func`` (flash-attn's order, ``dropout_p`` fourth).

    Args:
        q: this rank's shard (batch, local_seqlen, heads_q, head_dim), laid out as
            ``shard_sequence(x, group, layout=layout, ulysses_size=U)`` makes it.
        k, v: (batch, local_seqlen, heads_k, head_dim); heads_q % heads_k == 0.
        dropout_p: must be 0.0.
        softmax_scale, causal, window_size: as in ``flash_attn_func``, over the full sequence.
        alibi_slopes: float32 (heads_q,) or (batch, heads_q), as in flash-attn.
        deterministic: only kernels that sum in a fixed order.
        return_attn_probs: return (out, lse, None), as ring-flash-attn does.
        group: the sequence-parallel group of W ranks (default: the world).
        layout: token layout of the ring part ("zigzag", "stripe", "contiguous").
        sp_mode: "auto" (the default, U = 1: "allgather" for up to ``AUTO_ALLGATHER_MAX_LOCAL``
            tokens per rank and ``AUTO_ALLGATHER_MAX_TOTAL`` in the group, else "ring"; both take
            the same shards and give the same results; ``auto_sp_mode``), "ring" (U = 1),
            "ulysses" (U = W: heads_q must be divisible by W), "hybrid" (U = ``ulysses_size``,
            Ulysses within groups of U consecutive ranks, ring across) or "allgather" (U = 1:
            every rank gathers the whole sequence's K/V, ``heads_k_stride`` heads at a time,
            overlapped with the kernels; any ``layout``, see ``allgather.py``).
        ulysses_size: the Ulysses group size U for "hybrid"; with "auto", "ring" and "allgather"
            only None or 1, with "ulysses" only None or W (any other value raises ValueError).
        cu_seqlens: packed documents (batch 1), cumulative lengths over the full sequence, as in
            ``ring_flash_attn_func``; shard with ``shard_sequence(..., ulysses_size=U, cu_seqlens=...)``.
        softcap: scores -> softcap * tanh(scores / softcap); 0.0 = off.
        sinks: (heads_q,) sink logits (gpt-oss), applied once to each head's merged result; its
            gradient is this rank's contribution (sum over the group: ``reduce_gradients``).
        return_lse: also return the float32 LSE (batch, heads_q, local_seqlen).
        heads_k_stride: "allgather" only: K/V heads gathered at a time, a divisor of heads_k
            (None: all, one gather); memory: the full sequence's K/V of heads_k_stride heads (twice,
            double-buffered, when heads_k_stride < heads_k, so the next gather overlaps the kernels).
        block_mask: any mask, block-sparse: a ``TileMask`` or FlexAttention ``BlockMask`` over the
            *full* sequence in global positions, the same on every rank (each rank takes its part:
            ``block_masks.py``); it replaces causal/window_size and cannot take cu_seqlens or
            alibi_slopes. Every mode; layouts "contiguous", "zigzag" or a ``ChunkLayout``
            (``balanced_layout``) with every chunk (a shard; zigzag: half a shard) a whole number
            of the mask's blocks. Runs eagerly under torch.compile (a graph break).

    Returns:
        out (batch, local_seqlen, heads_q, head_dim) in q's dtype (and the LSE). Every rank of the
        group must pass the same shapes and options, else every rank raises ValueError.
    """
    # Traced, Ulysses and the hybrid take their op, which refuses a ChunkLayout and ALiBi; under a
    # dispatch mode (not traced), the op where it takes the call, else the engine (use_ops).
    op_takes_it = block_mask is None and alibi_slopes is None and not isinstance(layout, ChunkLayout)
    ulysses_op = use_ops(q, op_takes_it)
    if block_mask is not None and traced(q):  # no custom op takes a mask: run eagerly
        return _sp_attn_eager(
            q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
            return_attn_probs, group, layout=layout, sp_mode=sp_mode, ulysses_size=ulysses_size,
            cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks, return_lse=return_lse,
            heads_k_stride=heads_k_stride, block_mask=block_mask,
        )  # fmt: skip
    error = None
    try:
        check_dropout(dropout_p)
        check_sp_mode(sp_mode, ulysses_size)
        check_layout(layout)
        if heads_k_stride is not None and sp_mode != "allgather":
            raise ValueError(f'heads_k_stride={heads_k_stride!r} is for sp_mode="allgather", not "{sp_mode}"')
        if sp_mode == "auto":
            sp_mode = auto_sp_mode(q, group)
        if sp_mode in ("ulysses", "hybrid") and ulysses_op:  # the eager engine checks these in its setup
            alibi_slopes, sinks = check_ulysses_arguments(q, k, v, causal=causal, window_size=window_size,
                                                          alibi_slopes=alibi_slopes, sinks=sinks,
                                                          cu_seqlens=cu_seqlens)  # fmt: skip
    except (ValueError, TypeError) as e:
        error = e
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   deterministic=deterministic)  # fmt: skip
    if sp_mode == "allgather":
        out, lse = allgather_attention(
            q, k, v, group=group, layout=layout, cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes,
            sinks=sinks, heads_k_stride=heads_k_stride, error=error, block_mask=block_mask, **options,
        )  # fmt: skip
        return attention_returns(out, lse, return_attn_probs, return_lse)
    # Traced: one opaque op, which checks the ranks when it runs. Under a dispatch mode, an error
    # goes to the engine, which raises it after the ranks' check.
    if sp_mode != "ring" and ulysses_op and (error is None or traced(q)):
        if error is not None:
            raise error
        if alibi_slopes is not None:
            raise NotImplementedError("alibi_slopes with Ulysses/hybrid under torch.compile")
        if sp_mode == "ulysses":
            mode_ulysses_size(sp_mode, ulysses_size, dist.get_world_size(resolve_group(group)))
        u = 0 if sp_mode == "ulysses" else ulysses_size
        out, lse = ulysses_attention_op(
            q, k, v, group=group, layout=layout, ulysses_size=u, cu_seqlens=cu_seqlens, **options
        )
        return attention_returns(*apply_sinks(out, lse, sinks), return_attn_probs, return_lse)
    if sp_mode == "ring" and error is None:
        out, lse = dispatch_ring_attention(q, k, v, group=group, layout=layout, cu_seqlens=cu_seqlens,
                                  alibi_slopes=alibi_slopes, sinks=sinks, block_mask=block_mask,
                                  **options)  # fmt: skip
        return attention_returns(out, lse, return_attn_probs, return_lse)
    with_lse = return_lse or return_attn_probs or sinks is not None
    plan, sinks = ulysses_setup(
        q, k, v, group=group, sp_mode=sp_mode, ulysses_size=ulysses_size, layout=layout,
        cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes, sinks=sinks, block_mask=block_mask,
        with_lse=with_lse, error=error, **options,
    )  # fmt: skip
    out, lse = run_ulysses_attention(q, k, v, plan)
    return attention_returns(*apply_sinks(out, lse, sinks), return_attn_probs, return_lse)


# Traced by torch.compile, a call with a block mask runs eagerly: a graph break, as on one device.
_sp_attn_eager = torch.compiler.disable(sp_attn_func)


def ulysses_attn_func(
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
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple:
    """DeepSpeed-Ulysses attention: ``sp_attn_func(..., sp_mode="ulysses")``. Shards are
    contiguous slices of the sequence (``shard_sequence(x, group, layout="contiguous")``)."""
    return sp_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
        return_attn_probs, group, layout="contiguous", sp_mode="ulysses", softcap=softcap, sinks=sinks,
        return_lse=return_lse,
    )  # fmt: skip
