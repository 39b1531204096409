"""Appending new keys/values to a KV cache in place, one launch for both
(``flash_attn_with_kvcache``): new token i of sequence b goes to position cache_seqlens[b] + i
of the sequence's cache row (``batch_idx``) or of its pages (``block_table``)."""

from __future__ import annotations

import triton
import triton.language as tl

from .configs import block_d, next_power_of_2
from .launcher import PreparedLaunch


@triton.jit
def _append_kernel(
    K_NEW, V_NEW, K_CACHE, V_CACHE, SEQLENS, BATCH_IDX, BLOCK_TABLE, heads_k, page_size, table_stride,
    key_offset, local_capacity, spread_from, spread_rank, spread_world, slots,
    stride_nb, stride_ns, stride_nh, stride_mb, stride_ms, stride_mh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PAGED: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, SPREAD: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    position = tl.load(SEQLENS + b).to(tl.int64) + i
    pos = position - key_offset  # the slot in this cache (a shard: maybe none)
    here = (pos >= 0) & (pos < local_capacity)
    if SPREAD:  # positions from spread_from on: every spread_world-th to this rank, after its range
        dealt = tl.maximum(position - spread_from, 0)
        mine = (position >= spread_from) & (dealt % spread_world == spread_rank)
        pos = tl.where(mine, local_capacity + dealt // spread_world, pos)
        here = (here & (position < spread_from)) | (mine & (pos < slots))
    pos = tl.where(here, pos, 0)
    if PAGED:
        row = tl.load(BLOCK_TABLE + b * table_stride + pos // page_size).to(tl.int64)
        pos = pos % page_size
    elif HAS_BATCH_IDX:
        row = tl.load(BATCH_IDX + b).to(tl.int64)
    else:
        row = b
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # ``here`` broadcast by hand: Triton 3.9's interpreter rejects a scalar in a mask expression
    here = tl.full([BLOCK_H, BLOCK_D], 1, tl.int1) & here
    mask = (offs_h[:, None] < heads_k) & (offs_d[None, :] < HEAD_DIM) & here
    src = b * stride_nb + i * stride_ns + offs_h[:, None] * stride_nh + offs_d[None, :]
    src_v = b * stride_mb + i * stride_ms + offs_h[:, None] * stride_mh + offs_d[None, :]
    k = tl.load(K_NEW + src, mask=mask)
    v = tl.load(V_NEW + src_v, mask=mask)
    dst_k = row * stride_kb + pos * stride_ks + offs_h[:, None] * stride_kh + offs_d[None, :]
    dst_v = row * stride_vb + pos * stride_vs + offs_h[:, None] * stride_vh + offs_d[None, :]
    tl.store(K_CACHE + dst_k, k, mask=mask)
    tl.store(V_CACHE + dst_v, v, mask=mask)


def plan_append(
    new_shape: tuple[int, int, int, int],
    k_stride: tuple[int, ...],
    v_stride: tuple[int, ...],
    cache_shape: tuple[int, int, int, int],
    k_cache_stride: tuple[int, ...],
    v_cache_stride: tuple[int, ...],
    *,
    table_stride: int | None,
    batch_idx: bool,
    key_offset: int,
    held: int,
    spread: tuple[int, int, int, int] | None = None,
) -> tuple[tuple[int, int], PreparedLaunch] | None:
    """The append's grid and launch for new k/v of ``new_shape`` (batch, seqlen_new, heads_k,
    head_dim) into caches of ``cache_shape`` (tensors given by their strides; ``table_stride``
    None for a dense cache), or None when there is nothing to
    append. ``spread``: as ``decode.plan_split_kv``'s (slots past ``held`` for the positions
    from spread_from on that are dealt to this rank)."""
    batch, seqlen_new, heads_k, head_dim = new_shape
    if batch * seqlen_new == 0:
        return None
    ints = (
        heads_k, cache_shape[1], table_stride or 0, key_offset, held, *(spread or (0, 0, 1, held)),
        *k_stride[:3], *v_stride[:3],
        *k_cache_stride[:3], *v_cache_stride[:3],
    )  # fmt: skip
    meta = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_H=max(1, next_power_of_2(heads_k)),
        PAGED=table_stride is not None, HAS_BATCH_IDX=batch_idx, SPREAD=spread is not None,
    )  # fmt: skip
    return (seqlen_new, batch), PreparedLaunch(_append_kernel, ints, meta)

