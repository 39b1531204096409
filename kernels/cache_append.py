"""Appending new keys/values to a KV cache in place, one launch for both
(``flash_attn_with_kvcache``): new token i of sequence b goes to position cache_seqlens[b] + i
of the sequence's cache row (``batch_idx``) or of its pages (``block_table``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import block_d, next_power_of_2
from .launcher import launch


@triton.jit
def _append_kernel(
    K_NEW, V_NEW, K_CACHE, V_CACHE, SEQLENS, BATCH_IDX, BLOCK_TABLE, heads_k, page_size, table_stride,
    key_offset, local_capacity,
    stride_nb, stride_ns, stride_nh, stride_mb, stride_ms, stride_mh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PAGED: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(SEQLENS + b).to(tl.int64) + i - key_offset  # in this cache (a shard: maybe not)
    here = (pos >= 0) & (pos < local_capacity)
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


def append_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_seqlens: torch.Tensor,
    batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    key_offset: int,
    held: int,
) -> None:
    """Write k/v (batch, seqlen_new, heads_k, head_dim) into the caches at positions
    cache_seqlens[b] + i, in place; the caches hold ``held`` positions from ``key_offset`` on
    (0 and their capacity on one device; a shard's range with sequence parallelism), and tokens
    outside them are not written here. Caches: dense (rows, capacity, heads_k, head_dim) with
    the sequence's row ``batch_idx[b]`` (or b), or paged (pages, page_size, heads_k, head_dim)
    with ``block_table`` (batch, pages per sequence) int32. Unit stride in head_dim; positions
    and pages in range (the caller checks them)."""
    batch, seqlen_new, heads_k, head_dim = k.shape
    if batch * seqlen_new == 0:
        return
    launch(
        _append_kernel, (seqlen_new, batch),
        k, v, k_cache, v_cache, cache_seqlens, batch_idx, block_table, heads_k, k_cache.shape[1],
        0 if block_table is None else block_table.stride(0), key_offset,
        held, *k.stride()[:3], *v.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_H=max(1, next_power_of_2(heads_k)),
        PAGED=block_table is not None, HAS_BATCH_IDX=batch_idx is not None,
    )  # fmt: skip
