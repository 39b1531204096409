"""ring-flash-attn's qkv- and kv-packed ring entry points.

Each takes q, k, v (or k, v) stacked in one tensor, as ring-flash-attn's ``*_qkvpacked_func`` /
``*_kvpacked_func`` do, with their arguments, positional order, defaults and returns, and runs
the unpacked entry of the same layout on views of it (autograd stacks the gradients back into
the packed tensor's). ringflash's extras stay keyword-only, as on the unpacked entries.

A packed tensor of the wrong shape on one rank still joins the ranks' argument check (it goes
on as q, k and v, with its error), so every rank raises instead of waiting for that one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .kernels.functional import unstack_packed
from .ring_functions import _ring_entry
from .ring_varlen import _varlen_entry

_DENSE_SHAPE = "(batch, local_seqlen, {parts}, heads, head_dim)"
_VARLEN_SHAPE = "(local_tokens, {parts}, heads, head_dim)"
_Q_SHAPE = {False: "(batch, local_seqlen, heads_q, head_dim)", True: "(local_tokens, heads_q, head_dim)"}


def unstacked_or_error(name: str, packed: object, parts: int, varlen: bool) -> tuple[tuple, Exception | None]:
    """(views, None), or where ``packed`` is a tensor of the wrong shape (packed repeated, the
    error) for the entry to raise after the rank check. Not a tensor at all: raised here, as the
    unpacked entries raise for a q that is not one."""
    try:
        return unstack_packed(name, packed, parts, varlen), None
    except ValueError as e:
        return (packed,) * parts, e


def _dense_qkv(qkv, args, layout, extras):
    (q, k, v), error = unstacked_or_error("qkv", qkv, 3, varlen=False)
    return _ring_entry(q, k, v, *args, layout=layout, error=error, **extras)


def _dense_kv(q, kv, args, layout, extras):
    (k, v), error = unstacked_or_error("kv", kv, 2, varlen=False)
    return _ring_entry(q, k, v, *args, layout=layout, error=error, **extras)


def _varlen_qkv(qkv, args, layout, extras):
    (q, k, v), error = unstacked_or_error("qkv", qkv, 3, varlen=True)
    return _varlen_entry(q, k, v, *args, layout=layout, error=error, **extras)


def _varlen_kv(q, kv, args, layout, extras):
    (k, v), error = unstacked_or_error("kv", kv, 2, varlen=True)
    return _varlen_entry(q, k, v, *args, layout=layout, error=error, **extras)


def ring_flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
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
    args = (dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
            return_attn_probs, group)  # fmt: skip
    extras = dict(cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks, return_lse=return_lse)
    return _dense_qkv(qkv, args, "contiguous", extras)


def ring_flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
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
    args = (dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
            return_attn_probs, group)  # fmt: skip
    extras = dict(cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks, return_lse=return_lse)
    return _dense_kv(q, kv, args, "contiguous", extras)


def zigzag_ring_flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
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
    args = (dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
            return_attn_probs, group)  # fmt: skip
    extras = dict(cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks, return_lse=return_lse)
    return _dense_qkv(qkv, args, "zigzag", extras)


def zigzag_ring_flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
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
    args = (dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
            return_attn_probs, group)  # fmt: skip
    extras = dict(cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks, return_lse=return_lse)
    return _dense_kv(q, kv, args, "zigzag", extras)


def stripe_flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
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
    args = (dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
            return_attn_probs, group)  # fmt: skip
    extras = dict(cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks, return_lse=return_lse)
    return _dense_qkv(qkv, args, "stripe", extras)


def stripe_flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
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
    args = (dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
            return_attn_probs, group)  # fmt: skip
    extras = dict(cu_seqlens=cu_seqlens, softcap=softcap, sinks=sinks, return_lse=return_lse)
    return _dense_kv(q, kv, args, "stripe", extras)


def ring_flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
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
    args = (cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
            deterministic, return_attn_probs, group)  # fmt: skip
    return _varlen_qkv(qkv, args, "contiguous", dict(softcap=softcap, sinks=sinks, return_lse=return_lse))


def ring_flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
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
    args = (cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
            deterministic, return_attn_probs, group)  # fmt: skip
    return _varlen_kv(q, kv, args, "contiguous", dict(softcap=softcap, sinks=sinks, return_lse=return_lse))


def zigzag_ring_flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
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
    args = (cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
            deterministic, return_attn_probs, group)  # fmt: skip
    return _varlen_qkv(qkv, args, "zigzag", dict(softcap=softcap, sinks=sinks, return_lse=return_lse))


def zigzag_ring_flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
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
    args = (cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
            deterministic, return_attn_probs, group)  # fmt: skip
    return _varlen_kv(q, kv, args, "zigzag", dict(softcap=softcap, sinks=sinks, return_lse=return_lse))


_DOC = """ring-flash-attn's ``{name}``: ``{entry}`` on {what} stacked in one tensor (same
    arguments, order, defaults and returns).

    Args:
        {packed}: {shape}, in {entry}'s shard layout; float16/bfloat16/float32. Its gradient is
            stacked the same way.{q}
        Other arguments, the returns and the errors as in ``{entry}``.
    """


def _document(func, entry: str, packed: str) -> None:
    varlen = "varlen" in entry
    parts = 3 if packed == "qkv" else 2
    shape = (_VARLEN_SHAPE if varlen else _DENSE_SHAPE).format(parts=parts)
    q = ""
    if packed == "kv":
        q = f"\n        q: {_Q_SHAPE[varlen]}; heads_q a multiple of kv's heads."
    what = "q, k and v" if packed == "qkv" else "k and v"
    func.__doc__ = _DOC.format(name=func.__name__, entry=entry, what=what, packed=packed, shape=shape, q=q)


for _func, _entry in (
    (ring_flash_attn_qkvpacked_func, "ring_flash_attn_func"),
    (ring_flash_attn_kvpacked_func, "ring_flash_attn_func"),
    (zigzag_ring_flash_attn_qkvpacked_func, "zigzag_ring_flash_attn_func"),
    (zigzag_ring_flash_attn_kvpacked_func, "zigzag_ring_flash_attn_func"),
    (stripe_flash_attn_qkvpacked_func, "stripe_flash_attn_func"),
    (stripe_flash_attn_kvpacked_func, "stripe_flash_attn_func"),
    (ring_flash_attn_varlen_qkvpacked_func, "ring_flash_attn_varlen_func"),
    (ring_flash_attn_varlen_kvpacked_func, "ring_flash_attn_varlen_func"),
    (zigzag_ring_flash_attn_varlen_qkvpacked_func, "zigzag_ring_flash_attn_varlen_func"),
    (zigzag_ring_flash_attn_varlen_kvpacked_func, "zigzag_ring_flash_attn_varlen_func"),
):
    _document(_func, _entry, "qkv" if "qkvpacked" in _func.__name__ else "kv")
