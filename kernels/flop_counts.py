"""FLOP formulas of the single-device attention ops, for ``torch.utils.flop_counter.FlopCounterMode``.

Under any dispatch mode ringflash's calls run as dispatcher ops (``ops.use_ops``), so
FlopCounterMode (and tools on it, such as Lightning's ``measure_flops``) sees one op per call;
without a formula it would count them as zero. The counts follow torch's own attention formulas
(``sdpa_flop_count``), so that swapping SDPA for ringflash leaves a model's count unchanged:

- dense, 2·m·n·k per matmul: the forward 2·Sq·Sk·(D + Dv) per query head, the backward
  2·Sq·Sk·(3·D + 2·Dv) (the scores recomputed, dP, dV, dQ, dK: 2.5 forwards at D = Dv);
- causal masks, windows and block masks are not modeled (upper bounds, as torch's are);
- packed documents count each document's own Sq·Sk, read from ``cu_seqlens`` (a host read, as
  torch's varlen formulas make; under fake tensors the upper bound, documents × max lengths);
- a KV-cache call counts each sequence's keys (``cache_seqlens``, less ``cache_leftpad``, plus
  the appended ones), read the same way.

Importing this module registers the formulas (``kernels/__init__`` does).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.flop_counter import register_flop_formula

from . import block_sparse_ops, kvcache, ops  # noqa: F401  (the ops must exist to register on)
from .problem import cu_seqlens_host

Tensor = torch.Tensor


def forward_flops(pairs: int, heads: int, head_dim: int, head_dim_v: int) -> int:
    """A forward's FLOPs over ``pairs`` (query, key) pairs per head: S = QKᵀ, O = PV."""
    return 2 * pairs * heads * (head_dim + head_dim_v)


def backward_flops(pairs: int, heads: int, head_dim: int, head_dim_v: int) -> int:
    """A backward's FLOPs: S = QKᵀ again, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q."""
    return 2 * pairs * heads * (3 * head_dim + 2 * head_dim_v)


def host_values(t: Tensor) -> tuple[int, ...] | None:
    """A 1-D index tensor's values (``cu_seqlens_host``: read once per tensor and version, so a
    layer's count reads nothing the op itself did not), or None where they cannot be read."""
    if t.device.type == "meta" or is_fake(t):  # traced (Inductor estimates with fake tensors)
        return None
    return cu_seqlens_host(t)


def document_pairs(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int) -> int:
    """Σ over documents of Sq_i · Sk_i (the bound documents × max lengths where unreadable)."""
    bounds_q, bounds_k = host_values(cu_seqlens_q), host_values(cu_seqlens_k)
    if bounds_q is None or bounds_k is None:
        return (cu_seqlens_q.shape[0] - 1) * max_seqlen_q * max_seqlen_k
    return sum(
        (q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])
    )


def _pairs(q: Tensor, k: Tensor, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int) -> int:
    """(query, key) pairs per head of a (batch, S, heads, D) or packed (total, heads, D) call."""
    if cu_seqlens_q is not None:
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        return document_pairs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return q.shape[0] * q.shape[1] * k.shape[1]


@register_flop_formula(torch.ops.ringflash.flash_attn_forward, get_raw=True)
def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_, out_val=None, **__) -> int:
    pairs = _pairs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return forward_flops(pairs, q.shape[-2], q.shape[-1], v.shape[-1])


@register_flop_formula(torch.ops.ringflash.flash_attn_backward, get_raw=True)
def _backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_,
              out_val=None, **__) -> int:  # fmt: skip
    pairs = _pairs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return backward_flops(pairs, q.shape[-2], q.shape[-1], v.shape[-1])


@register_flop_formula(torch.ops.ringflash.attention_probs, get_raw=True)
def _probs(q, k, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_, out_val=None, **__) -> int:
    pairs = _pairs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return 2 * pairs * q.shape[-2] * q.shape[-1]  # S = QKᵀ only


@register_flop_formula(torch.ops.ringflash.block_sparse_forward, get_raw=True)
def _sparse_forward(q, k, v, *_, out_val=None, **__) -> int:
    return forward_flops(q.shape[0] * q.shape[1] * k.shape[1], q.shape[2], q.shape[3], v.shape[3])


@register_flop_formula(torch.ops.ringflash.block_sparse_backward, get_raw=True)
def _sparse_backward(dout, q, k, v, *_, out_val=None, **__) -> int:
    return backward_flops(q.shape[0] * q.shape[1] * k.shape[1], q.shape[2], q.shape[3], v.shape[3])


@register_flop_formula(torch.ops.ringflash.kvcache_attention, get_raw=True)
def _kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, *_, out_val=None, **__) -> int:  # fmt: skip
    batch, seqlen_q, heads, head_dim = q.shape
    appended = 0 if k is None else k.shape[1]
    lengths = host_values(cache_seqlens)
    pads = [0] * batch if cache_leftpad is None else host_values(cache_leftpad)
    if lengths is None or pads is None:  # the bound: every sequence its whole cache
        capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
        keys = batch * capacity
    else:  # keys [leftpad, cache_seqlens) and the appended ones
        keys = sum(n - p + appended for n, p in zip(lengths, pads))
    return forward_flops(seqlen_q * keys, heads, head_dim, v_cache.shape[-1])
