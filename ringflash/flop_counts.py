"""FLOP formulas of the sequence-parallel attention ops, for ``FlopCounterMode``.

The convention of ``kernels.flop_counts`` (torch's: dense, masks not modeled, packed documents
each on its own), applied to the whole sequence and split evenly: each rank counts 1/W of the
dense work of the full sequence (or of each full document), W the group's size. That is what the
ring, Ulysses, the hybrid and the all-gather mode each run per rank, whatever the layout, and the
ranks' counts add up to the single-device count of the same attention. The llama3 forms count
their own varlen call: this rank's queries against the gathered keys [k_start, k_stop).

Calls that no op takes (a block mask in the sequence-parallel modes, a ``ChunkLayout``, ALiBi
with Ulysses or the hybrid) run eagerly and count zero, as do the shards of sequence-parallel
decoding (``sp_flash_attn_with_kvcache`` calls the cache's engine, not its op).

Importing this module registers the formulas (``ringflash/__init__`` does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import register_flop_formula

from . import allgather_ops, ops, ring_varlen  # noqa: F401  (the ops must exist to register on)
from .comm import group_from_name
from .kernels.flop_counts import backward_flops, document_pairs, forward_flops, host_values

Tensor = torch.Tensor


def _world(group_name: str) -> int:
    return dist.get_world_size(group_from_name(group_name))


def _rank_pairs(q: Tensor, world: int, cu_seqlens: Tensor | None, cu_seqlens_list: list[int] | None) -> int:
    """This rank's 1/world of the (query, key) pairs per head of the full sequence: q (batch, n,
    heads, head_dim) is its shard; cu_seqlens (or the list) the full documents' bounds."""
    bounds = cu_seqlens_list
    if bounds is None and cu_seqlens is not None:
        bounds = host_values(cu_seqlens)  # None where unreadable: the full sequence's bound below
    if bounds is None:
        batch, n = q.shape[0], q.shape[1]
        return batch * n * (world * n)
    return sum((b - a) ** 2 for a, b in zip(bounds, bounds[1:])) // world


def _heads_dims(q: Tensor, v: Tensor) -> tuple[int, int, int]:
    return q.shape[-2], q.shape[-1], v.shape[-1]


@register_flop_formula(torch.ops.ringflash.ring_attn_forward, get_raw=True)
def _ring_forward(q, k, v, group_name, layout, cu_seqlens, cu_seqlens_list, *_, out_val=None, **__) -> int:
    return forward_flops(_rank_pairs(q, _world(group_name), cu_seqlens, cu_seqlens_list), *_heads_dims(q, v))


@register_flop_formula(torch.ops.ringflash.ring_attn_backward, get_raw=True)
def _ring_backward(dout, q, k, v, out, lse, dlse, group_name, layout, cu_seqlens, cu_seqlens_list, *_,
                   out_val=None, **__) -> int:  # fmt: skip
    return backward_flops(_rank_pairs(q, _world(group_name), cu_seqlens, cu_seqlens_list), *_heads_dims(q, v))


def _varlen_pairs(cu_seqlens: Tensor, max_seqlen: int, world: int) -> int:
    """ring-flash-attn's varlen form: cu_seqlens bound this rank's pieces l_i of documents of
    world·l_i tokens; 1/world of Σ (world·l_i)² is Σ world·l_i²."""
    bounds = host_values(cu_seqlens)
    if bounds is None:
        return (cu_seqlens.shape[0] - 1) * world * max_seqlen**2
    return sum(world * (b - a) ** 2 for a, b in zip(bounds, bounds[1:]))


@register_flop_formula(torch.ops.ringflash.ring_varlen_attn_forward, get_raw=True)
def _varlen_forward(q, k, v, cu_seqlens, max_seqlen, group_name, *_, out_val=None, **__) -> int:
    return forward_flops(_varlen_pairs(cu_seqlens, max_seqlen, _world(group_name)), *_heads_dims(q, v))


@register_flop_formula(torch.ops.ringflash.ring_varlen_attn_backward, get_raw=True)
def _varlen_backward(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, group_name, *_, out_val=None,
                     **__) -> int:  # fmt: skip
    return backward_flops(_varlen_pairs(cu_seqlens, max_seqlen, _world(group_name)), *_heads_dims(q, v))


@register_flop_formula(torch.ops.ringflash.ulysses_attn_forward, get_raw=True)
def _ulysses_forward(q, k, v, group_name, layout, ulysses_size, cu_seqlens, cu_seqlens_list, *_, out_val=None,
                     **__) -> int:  # fmt: skip
    return forward_flops(_rank_pairs(q, _world(group_name), cu_seqlens, cu_seqlens_list), *_heads_dims(q, v))


@register_flop_formula(torch.ops.ringflash.ulysses_attn_backward, get_raw=True)
def _ulysses_backward(dout, dlse, qkv_h, out_h, lse_h, heads_k, group_name, layout, ulysses_size, cu_seqlens,
                      cu_seqlens_list, *_, out_val=None, **__) -> int:  # fmt: skip
    # dout is this rank's shard like q; Ulysses keeps one head_dim for q, k and v.
    pairs = _rank_pairs(dout, _world(group_name), cu_seqlens, cu_seqlens_list)
    return backward_flops(pairs, dout.shape[-2], dout.shape[-1], dout.shape[-1])


def _allgather_pairs(q, group_name, cu_seqlens, cu_seqlens_list, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k) -> int:  # fmt: skip
    if cu_seqlens_q is not None:  # a llama3 form: one varlen call against the gathered keys
        return document_pairs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _rank_pairs(q, _world(group_name), cu_seqlens, cu_seqlens_list)


@register_flop_formula(torch.ops.ringflash.allgather_attn_forward, get_raw=True)
def _allgather_forward(q, k, v, group_name, layout, *rest, out_val=None, **__) -> int:
    return forward_flops(_allgather_pairs(q, group_name, *rest[:6]), *_heads_dims(q, v))


@register_flop_formula(torch.ops.ringflash.allgather_attn_backward, get_raw=True)
def _allgather_backward(dout, q, k, v, out, lse, dlse, group_name, layout, *rest, out_val=None, **__) -> int:
    return backward_flops(_allgather_pairs(q, group_name, *rest[:6]), *_heads_dims(q, v))
