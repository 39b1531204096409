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

from .comm import resolve_group_or_raise
from .ring import attention_returns, check_dropout, ring_attention


def _local_bounds(cu_seqlens: object, tokens: int, max_seqlen: object) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")  # fmt: skip
        bounds = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in cu_seqlens
    ):
        bounds = list(cu_seqlens)
    else:
        raise TypeError(
            f"cu_seqlens must be an int tensor or a sequence of ints, got {type(cu_seqlens).__name__}"
        )
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


def _varlen_entry(
    q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
    deterministic, return_attn_probs, group, *, layout, softcap, sinks, return_lse, error=None,
):  # fmt: skip
    """The varlen entry points' one body; ``error``: an argument error the caller found (a packed
    tensor of the wrong shape, ``ring_packed``), raised after the rank check as this one's are."""
    full_cu, order, bounds = None, None, []
    if error is None:  # a caller's error first; the arguments may not be tensors at all then
        try:
            check_dropout(dropout_p)
            for name, t in (("q", q), ("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    raise ValueError(f"{name} must be a 3-D tensor (local_tokens, heads, head_dim)")
            bounds = _local_bounds(cu_seqlens, q.shape[0], max_seqlen)
            if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() != 1:
                raise ValueError(
                    "alibi_slopes for the ring varlen functions must be (heads_q,), one slope per head for "
                    f"every document; got shape {tuple(alibi_slopes.shape)}"
                )
            if layout == "zigzag" and any((b - a) % 2 for a, b in zip(bounds, bounds[1:])):
                raise ValueError(
                    f"zigzag needs every local piece of even length (two chunks), got cu_seqlens {bounds}"
                )
        except (ValueError, TypeError) as e:
            error = e
    world = dist.get_world_size(resolve_group_or_raise(group, error))
    if error is None:
        full_cu = [b * world for b in bounds]
        if layout == "zigzag" and world > 1:
            order = _zigzag_order(bounds, q.device)
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
