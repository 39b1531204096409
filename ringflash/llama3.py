"""ring-flash-attn's llama3 forms: packed documents of any length over contiguous shards, K/V
all-gathered ``heads_k_stride`` heads at a time (``allgather.py``'s engine).

The packed sequence of T tokens is cut into W contiguous shards of T / W tokens, whatever the
documents' lengths: a document may cross shards. ``llama3_flash_attn_prepare_cu_seqlens`` gives
each rank the varlen call its queries need against the gathered sequence: its documents' pieces
(``cu_seqlens_q``), their keys (``cu_seqlens_k``, from each document's start) and the slice of
the gathered sequence they lie in (``local_k_slice``). With ``causal=True`` every piece's keys end
at its last query, so flash-attn's bottom-right alignment puts each piece where it is in its
document; with ``causal=False`` the keys run to each document's end, exact for full attention.
(A two-sided window without ``causal`` is exact only where a piece starts its document: the
alignment of a piece in the middle of a document cannot be expressed, as in ring-flash-attn.)
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist

from .allgather_ops import prepared_allgather_attention
from .conventions import attention_returns, check_dropout
from .kernels import cu_seqlens_tensor
from .layouts import host_bounds
from .ring_packed import unstacked_or_error


def llama3_flash_attn_prepare_cu_seqlens(
    cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, int, int, slice]:
    """What rank ``rank`` of ``world_size`` passes to ``llama3_flash_attn_varlen_func``, as in
    ring-flash-attn (same arguments and returns).

    Args:
        cu_seqlens: cumulative lengths (0, ..., T) of the documents of the whole packed sequence
            (int32/int64 tensor, or a list); T a multiple of ``world_size``, documents of any length.
        causal: the attention's ``causal`` (the keys of a piece end at its last query when True,
            at its document's end otherwise).
        rank, world_size: this rank's place in the sequence-parallel group.

    Returns:
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice): int32 tensors on
        cu_seqlens' device (CPU for a list), the longest piece and key run, and the slice of the
        gathered sequence holding the keys. Reads cu_seqlens to the host (once per batch).
    """
    bounds = host_bounds(cu_seqlens)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, x in (("rank", rank), ("world_size", world_size)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
    total = bounds[-1] if bounds else 0
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])) or total <= 0:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end above 0, got {bounds}")
    if total % world_size:
        raise ValueError(
            f"the packed length {total} must be a multiple of world_size {world_size} (pad the batch)"
        )
    n = total // world_size
    lo, hi = rank * n, (rank + 1) * n
    left = bisect.bisect_left(bounds, lo)
    right = bisect.bisect_left(bounds, hi)
    if bounds[left] != lo:
        left -= 1
    docs = bounds[left : right + 1]  # the documents that hold this rank's tokens
    q_bounds = [0, *(b - lo for b in docs[1:-1]), n]
    slice_left = docs[0]
    slice_right = hi if causal else docs[-1]
    k_bounds = [b - slice_left for b in docs[:-1]] + [slice_right - slice_left]
    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
    max_q = max(b - a for a, b in zip(q_bounds, q_bounds[1:]))
    max_k = max(b - a for a, b in zip(k_bounds, k_bounds[1:]))
    cu_q, cu_k = cu_seqlens_tensor(q_bounds, device), cu_seqlens_tensor(k_bounds, device)
    return cu_q, cu_k, max_q, max_k, slice(slice_left, slice_right)


def _llama3_entry(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice, dropout_p,
    softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group, *, softcap,
    sinks, return_lse, error=None,
):  # fmt: skip
    """The llama3 forms' one body; ``error``: an argument error the caller found (a packed tensor
    of the wrong shape), raised after the ranks' check as this one's are."""
    if error is None:
        try:
            check_dropout(dropout_p)
        except (ValueError, TypeError) as e:
            error = e
    out, lse = prepared_allgather_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, deterministic=deterministic, group=group,
        heads_k_stride=heads_k_stride, error=error,
    )  # fmt: skip
    return attention_returns(out, lse, return_attn_probs, return_lse)


def llama3_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    heads_k_stride: int,
    local_k_slice: slice,
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
    """ring-flash-attn's ``llama3_flash_attn_varlen_func`` (same arguments, order, defaults and
    returns): attention over packed documents of any length, cut into contiguous shards.

    Args:
        q: this rank's tokens (local_tokens, heads_q, head_dim), the rank-th of W contiguous slices of
            the packed sequence; k, v: (local_tokens, heads_k, head_dim); float16/bfloat16/float32.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice: this rank's, from
            ``llama3_flash_attn_prepare_cu_seqlens`` (int32 cu_seqlens on q's device).
        heads_k_stride: K/V heads gathered at a time (a divisor of heads_k); memory 2 x the whole
            sequence x heads_k_stride K/V heads, and the next stride's gather overlaps this one's kernels.
        dropout_p: must be 0.0. softmax_scale, causal, window_size: flash-attn's, applied to the
            call of q against the gathered keys in ``local_k_slice`` (see the module).
        alibi_slopes: float32 (heads_q,) or (num_pieces, heads_q) (ring-flash-attn refuses ALiBi).
        deterministic: only kernels that sum in a fixed order.
        return_attn_probs: return (out, lse, None) with lse (heads_q, local_tokens) float32.
        group: the sequence-parallel process group (default: the world).
        softcap, sinks, return_lse: ringflash's extras, as in ``ring_flash_attn_func``.

    Returns:
        out (local_tokens, heads_q, head_dim) in q's dtype (and the LSE as above). Every rank of the
        group must pass the same shapes, heads_k_stride and options, else every rank raises ValueError.
    """
    return _llama3_entry(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
        softcap=softcap, sinks=sinks, return_lse=return_lse,
    )  # fmt: skip


def llama3_flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    heads_k_stride: int,
    local_k_slice: slice,
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
    """``llama3_flash_attn_varlen_func`` on qkv (local_tokens, 3, heads, head_dim) stacked in one
    tensor (ring-flash-attn's; its gradient is stacked the same way). Other arguments and returns
    as there."""
    (q, k, v), error = unstacked_or_error("qkv", qkv, 3, varlen=True)
    return _llama3_entry(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
        softcap=softcap, sinks=sinks, return_lse=return_lse, error=error,
    )  # fmt: skip


def llama3_flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    heads_k_stride: int,
    local_k_slice: slice,
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
    """``llama3_flash_attn_varlen_func`` with k and v stacked in kv (local_tokens, 2, heads_k,
    head_dim) (ring-flash-attn's); q (local_tokens, heads_q, head_dim). Other arguments and
    returns as there."""
    (k, v), error = unstacked_or_error("kv", kv, 2, varlen=True)
    return _llama3_entry(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride, local_k_slice,
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
        softcap=softcap, sinks=sinks, return_lse=return_lse, error=error,
    )  # fmt: skip
