"""Moving a full sequence to per-rank shards and back, in any layout."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .comm import RingComm, resolve_group_or_raise
from .consistency import check_ranks_agree, cu_seqlens_values, describe
from .layouts import check_layout, layout_indices


def _check_dim(x: object, dim: object) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [-{x.dim()}, {x.dim()}), got {dim!r}")
    return dim % x.dim()


def shard_sequence(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = 1,
    *,
    layout: str,
    ulysses_size: int = 1,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor.

    x: any tensor whose ``dim`` is the full sequence (e.g. (batch, seqlen, heads, head_dim),
    or (batch, seqlen) token ids). Returns the tokens this rank holds under ``layout``, in the
    local order ``ring_flash_attn_func`` expects: (..., seqlen / W, ...). For Ulysses or hybrid
    parallelism pass the Ulysses group size (``sp_attn_func``'s U; W for pure Ulysses).
    Packed documents: ``cu_seqlens`` (cumulative document lengths of the full sequence) splits
    each document on its own, as ``ring_flash_attn_func(..., cu_seqlens=...)`` expects.
    Differentiable. Raises ValueError if seqlen does not split evenly (zigzag: multiple of 2W).

    ``layout`` has no default: it must name the layout the attention call is given (e.g.
    ``ring_flash_attn_func`` defaults to "contiguous", as ring-flash-attn's does, while
    ``sp_attn_func`` and ``shard_batch`` default to "zigzag"), since shards cut one way and
    attended another give a wrong answer that nothing downstream can detect.
    """
    dim = _check_dim(x, dim)
    comm = RingComm(group)
    idx = layout_indices(
        check_layout(layout), comm.rank, comm.world_size, x.shape[dim], ulysses_size, cu_seqlens
    )
    return x.index_select(dim, idx.to(x.device))


def gather_sequence(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = 1,
    *,
    layout: str,
    ulysses_size: int = 1,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """The full sequence on every rank, from each rank's shard (inverse of ``shard_sequence``).

    x: this rank's shard, same shape on every rank; returns (..., seqlen_local * W, ...).
    Not differentiable (an all-gather of activations for checking and logging). Every rank must
    pass the same shard shape, dim, layout, ulysses_size and cu_seqlens, else every rank raises
    ValueError naming what differs (``consistency.check_ranks_agree``).
    """
    error = None
    try:
        dim = _check_dim(x, dim)
        check_layout(layout)
    except (ValueError, TypeError) as e:
        error = e  # raised after the rank check, which every rank must join
    comm = RingComm(resolve_group_or_raise(group, error))
    signature = {name: describe(value) for name, value in
                 (("x", x), ("dim", dim), ("layout", layout), ("ulysses_size", ulysses_size))}  # fmt: skip
    signature["cu_seqlens"] = cu_seqlens_values(cu_seqlens)
    check_ranks_agree(comm.group, signature, error)
    parts = comm.all_gather(x.detach())
    total = x.shape[dim] * comm.world_size
    full = torch.empty((*x.shape[:dim], total, *x.shape[dim + 1 :]), dtype=x.dtype, device=x.device)
    for r, part in enumerate(parts):
        idx = layout_indices(layout, r, comm.world_size, total, ulysses_size, cu_seqlens).to(x.device)
        full.index_copy_(dim, idx, part)
    return full
