"""Decoding over a KV cache sharded across a process group: ``sp_flash_attn_with_kvcache``.

A model trained on sequences longer than one GPU holds has a KV cache that does not fit one GPU
either. Here each rank's cache holds a contiguous range of every sequence's positions (rank r:
r * C .. (r + 1) * C - 1, C the capacity of each rank's cache), so the cache fills rank by
rank as the sequence grows. A call runs on every rank with the same arguments (q, the new k/v
and the sequences' lengths are the same everywhere, as in a decode step of a model whose
activations are replicated across the group); each rank appends the new tokens whose positions
it holds, attends its keys with the split-KV kernel (masks, ALiBi and rotary in the sequences'
positions), and the ranks' float32 partials (out, lse) are all-gathered (one small exchange) and
merged with the LSE rule, then the sinks. The result equals ``flash_attn_with_kvcache`` over the
whole cache on one device. With ``spread_from`` the tokens generated past a prompt are dealt out
round-robin instead, each rank keeping its own after its range, so the shards stay balanced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_gather_async, resolve_group
from .consistency import call_signature, check_ranks_agree
from .kernels.decode import merge_splits
from .kernels.kvcache import kvcache_attention
from .merge import apply_sinks


def sp_flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    sinks: torch.Tensor | None = None,
    check_bounds: bool = True,
    shard_range: tuple[int, int] | None = None,
    spread_from: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_with_kvcache`` (same arguments, same order, then ``group``) over a cache
    sharded across ``group`` (default: the world).

    Rank r's k_cache/v_cache (or its pages, through its own ``block_table``) hold positions
    r * C .. (r + 1) * C - 1 of each sequence, C its capacity (the same on every rank; a paged
    cache's is pages per sequence x page_size). Every other argument is the same on every rank:
    q (batch, seqlen_q, heads_q, head_dim), the new k/v (batch, seqlen_new, heads_k, head_dim),
    ``cache_seqlens`` the whole sequences' lengths before the append (so the new tokens go to
    positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1, into the ranks that hold
    them), rotary tables, masks (bottom-right aligned over the whole sequence), ALiBi slopes,
    sinks. A rank whose arguments differ from the others', or fail its checks, makes every rank
    raise ValueError (the ranks that passed theirs may have appended already).

    ``shard_range=(start, length)`` (ringflash's keyword) sets the positions this rank's cache
    holds instead, e.g. after a prefill through the ring over contiguous shards of P tokens
    (rank r: (r * P, P), the last rank (r * P, P + the tokens to generate)); the ranges must
    tile the sequences' positions in rank order (not checked across ranks); the last rank checks
    that the appended tokens fit its range.

    ``spread_from=T`` (ringflash's keyword) keeps the shards balanced as tokens are generated:
    positions from T on are dealt out round-robin (position p to rank (p - T) % world), each
    rank keeping its own in the slots of its cache after its range of positions before T (by
    default (r * T / world, T / world): T a multiple of the world size; else pass
    ``shard_range``); every rank checks that the positions dealt to it fit its capacity. With
    it, the kernel masks each key by its position but skips no tiles by window bounds.

    Returns:
        out (batch, seqlen_q, heads_q, head_dim) in q's dtype, the same on every rank; with
        ``return_softmax_lse`` (out, lse), lse float32 (batch, heads_q, seqlen_q).
    """
    group = resolve_group(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    error, partial = None, None
    try:
        if not isinstance(return_softmax_lse, bool):
            raise TypeError(f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}")
        start, held = _shard_range(shard_range, rank, k_cache, block_table, spread_from, world)
        spread = None if spread_from is None else (spread_from, rank, world)
        # This rank's (out, lse) go straight into the buffer the all-gather sends.
        send = None
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[-1]:
            send = torch.empty(q.numel() + q.numel() // q.shape[-1], device=q.device, dtype=torch.float32)
        partial = kvcache_attention(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
            num_splits, sinks=None, check_bounds=check_bounds, key_offset=start, held=held,
            last_shard=rank == world - 1, out_dtype=torch.float32, into=send, spread=spread,
        )  # fmt: skip
    except (ValueError, TypeError, NotImplementedError) as e:
        error = e
    # With shard ranges the ranks' caches may differ in capacity (the last holds the new tokens):
    # only what every rank must share is compared then.
    caches = (k_cache, v_cache, block_table)
    if shard_range is not None or spread_from is not None:
        caches = _shared_dims(*caches)
    signature = call_signature(
        q, k, v, caches=caches, cache_seqlens=cache_seqlens, ranges_given=shard_range is not None,
        spread_from=spread_from,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits, sinks=sinks,
    )  # fmt: skip
    check_ranks_agree(group, signature, error)
    out, lse = partial
    gathered = torch.empty(world, send.numel(), device=out.device, dtype=torch.float32)
    all_gather_async([gathered], [send], group, world).wait()
    parts = gathered[:, : out.numel()].view(world, *out.shape)
    lses = gathered[:, out.numel() :].view(world, *lse.shape)
    merged = torch.empty(out.shape, device=out.device, dtype=q.dtype)
    merged_lse = torch.empty_like(lse)
    merge_splits(parts, lses, merged, merged_lse)
    merged, merged_lse = apply_sinks(merged, merged_lse, sinks)
    return (merged, merged_lse) if return_softmax_lse else merged


def _shared_dims(*tensors: object) -> tuple:
    """What ranks with different cache capacities still share: each tensor's dims past the
    capacity (heads_k, head_dim; a block table's batch) and dtype."""
    shared = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = (tuple(t.shape[2:] if t.dim() == 4 else t.shape[:1]), str(t.dtype))
        shared.append(t)
    return tuple(shared)


def _shard_range(
    shard_range: object, rank: int, k_cache: object, block_table: object, spread_from: object, world: int
) -> tuple[int, int]:
    """(first position, positions) this rank's cache holds: ``shard_range``; with
    ``spread_from`` T, (rank * T / world, T / world); else (rank * C, C) with C its capacity
    (its checks come after)."""
    if spread_from is not None:
        if isinstance(spread_from, bool) or not isinstance(spread_from, int):
            raise TypeError(f"spread_from must be an int (a position) or None, got {spread_from!r}")
        if spread_from < 0:
            raise ValueError(f"spread_from must be >= 0, got {spread_from}")
        if shard_range is None:
            if spread_from % world:
                raise ValueError(
                    f"spread_from ({spread_from}) is not a multiple of the group's {world} ranks: pass "
                    "shard_range=(start, length) for this rank's positions before it"
                )
            return rank * (spread_from // world), spread_from // world
    if shard_range is not None:
        ok = isinstance(shard_range, (tuple, list)) and len(shard_range) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard_range):
            raise TypeError(f"shard_range must be a pair of ints (start, length), got {shard_range!r}")
        return int(shard_range[0]), int(shard_range[1])
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be a 4-D tensor (cache_rows or pages, capacity or page_size, heads_k, head_dim)"
        )
    capacity = k_cache.shape[1]
    if isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
        capacity *= block_table.shape[1]
    return rank * capacity, capacity
