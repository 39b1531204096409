"""nn.Module wrappers: sequence-parallel attention as a layer, and a small reference decoder."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .kernels import check_sinks, flash_attn_func, flash_attn_varlen_func
from .kernels.problem import check_alibi_slopes
from .layouts import ChunkLayout, check_layout, cumulative_lengths, document_lengths
from .sp_functions import check_sp_mode, sp_attn_func


class SequenceParallelAttention(nn.Module):
    """Drop-in attention core: (q, k, v) shards (batch, local_seqlen, heads, head_dim) -> output.

    With ``group=None`` and no initialized torch.distributed it is single-device attention, so
    the same model runs with and without sequence parallelism. ``forward(..., cu_seqlens=...)``
    keeps attention inside packed documents (batch 1; ``shard_batch``'s ``cu_seqlens``).
    softcap (float, 0 = off) and alibi_slopes (float32 (heads_q,), kept as a buffer) are fixed
    at construction; sinks (heads_q,) are the caller's parameter, passed to ``forward``. Every
    argument is validated when the layer runs; none is ignored.
    """

    def __init__(
        self,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        softmax_scale: float | None = None,
        group: dist.ProcessGroup | None = None,
        layout: str | ChunkLayout = "zigzag",
        sp_mode: str = "auto",
        ulysses_size: int | None = None,
        *,
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.causal, self.window_size, self.softmax_scale = causal, window_size, softmax_scale
        self.group, self.layout, self.sp_mode, self.ulysses_size = group, layout, sp_mode, ulysses_size
        self.softcap = softcap
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        # .half() / .to(dtype) cast every float buffer; the slopes follow the device but stay
        # float32 (rounded slopes would bias long distances, and the kernels take float32 only).
        slopes = self.alibi_slopes
        module = super()._apply(fn, recurse)
        if slopes is not None and slopes.is_floating_point():
            self.alibi_slopes = slopes.to(self.alibi_slopes.device)
        return module

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return sequence_parallel_attention(
            q, k, v, softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
            group=self.group, layout=self.layout, sp_mode=self.sp_mode, ulysses_size=self.ulysses_size,
            cu_seqlens=cu_seqlens, softcap=self.softcap, alibi_slopes=self.alibi_slopes, sinks=sinks,
        )  # fmt: skip


def is_sequence_parallel(group: dist.ProcessGroup | None) -> bool:
    """Whether ``sequence_parallel_attention`` runs over a group (else on this device alone)."""
    return group is not None or (dist.is_available() and dist.is_initialized())


def sequence_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    group: dist.ProcessGroup | None,
    layout: str | ChunkLayout,
    sp_mode: str,
    ulysses_size: int | None,
    cu_seqlens: torch.Tensor | Sequence[int] | None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sp_attn_func`` over ``group``, or single-device attention (dense, or varlen over packed
    documents) when there is no group and torch.distributed is not initialized. Shapes as in
    ``sp_attn_func``: (batch, local_seqlen, heads, head_dim)."""
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes)  # fmt: skip
    if is_sequence_parallel(group):
        return sp_attn_func(q, k, v, group=group, layout=layout, sp_mode=sp_mode, ulysses_size=ulysses_size,
                            cu_seqlens=cu_seqlens, sinks=sinks, **options)  # fmt: skip
    check_layout(layout)
    check_sp_mode(sp_mode, ulysses_size)
    doc_lens = None
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got batch {q.shape[0]}")
        doc_lens = document_lengths(cu_seqlens, q.shape[1], "contiguous", 1)  # any lengths on one device
    if alibi_slopes is not None:
        alibi_slopes = check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
    sinks = check_sinks(sinks, q.shape[2], q.device)
    return whole_sequence_attention(q, k, v, doc_lens=doc_lens, sinks=sinks, **options)[0]


def whole_sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    doc_lens: tuple[int, ...] | None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over a whole sequence held by one rank, (batch, seqlen, heads,
    head_dim): dense, or varlen over packed documents of lengths ``doc_lens`` (batch 1). softcap,
    alibi_slopes ((heads,) or (batch, heads)), sinks (heads,), deterministic: as in
    ``ring_flash_attn_func``. (The module wrappers' one-device path.)"""
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   deterministic=deterministic)  # fmt: skip
    if doc_lens is None:
        return flash_attn_func(q, k, v, alibi_slopes=alibi_slopes, sinks=sinks, return_lse=True, **options)
    cu = cumulative_lengths(doc_lens, q.device)
    n = max(doc_lens)
    if alibi_slopes is not None:  # one slope per head, the same for every document
        alibi_slopes = alibi_slopes.reshape(-1, alibi_slopes.shape[-1])[0].expand(len(doc_lens), -1)
    out, lse = flash_attn_varlen_func(
        q[0], k[0], v[0], cu, cu, n, n, alibi_slopes=alibi_slopes, sinks=sinks, return_lse=True, **options
    )
    return out[None], lse[None]


def _rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, heads, head_dim) at integer ``positions`` (batch, seqlen)."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * freqs  # (B, S, half)
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, attention: nn.Module) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.attention = attention

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}  # custom attention may lack it
        attn = self.attention(_rotary(q, positions), _rotary(k, positions), v.contiguous(), **packed)
        x = x + self.out(attn.reshape(b, s, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ReferenceDecoder(nn.Module):
    """A small Llama-style causal LM (RMSNorm, rotary, GQA, SwiGLU) for demos and tests.

    forward(input_ids (B, S_local), position_ids (B, S_local), cu_seqlens=None) -> logits
    (B, S_local, vocab); every attention layer is ``attention`` (default: causal
    ``SequenceParallelAttention``); ``cu_seqlens``: packed documents, as ``shard_batch`` gives.
    """

    def __init__(
        self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, attention: nn.Module | None = None
    ) -> None:
        super().__init__()
        attention = attention or SequenceParallelAttention()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads, kv_heads, attention) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids, cu_seqlens)
        return self.head(self.norm(x))
