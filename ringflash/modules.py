"""nn.Module wrappers: sequence-parallel attention as a layer, and a small reference decoder."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .kernels import flash_attn_func
from .ulysses import sp_attn_func


class SequenceParallelAttention(nn.Module):
    """Drop-in attention core: (q, k, v) shards (batch, local_seqlen, heads, head_dim) -> output.

    With ``group=None`` and no initialized torch.distributed it is single-device attention, so
    the same model runs with and without sequence parallelism.
    """

    def __init__(
        self,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        softmax_scale: float | None = None,
        group: dist.ProcessGroup | None = None,
        layout: str = "zigzag",
        sp_mode: str = "ring",
        ulysses_size: int | None = None,
    ) -> None:
        super().__init__()
        self.causal, self.window_size, self.softmax_scale = causal, window_size, softmax_scale
        self.group, self.layout, self.sp_mode, self.ulysses_size = group, layout, sp_mode, ulysses_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            return flash_attn_func(q, k, v, self.softmax_scale, self.causal, self.window_size)
        return sp_attn_func(
            q, k, v, self.softmax_scale, self.causal, self.window_size, self.group,
            self.layout, self.sp_mode, self.ulysses_size,
        )  # fmt: skip


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        attn = self.attention(_rotary(q, positions), _rotary(k, positions), v.contiguous())
        x = x + self.out(attn.reshape(b, s, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ReferenceDecoder(nn.Module):
    """A small Llama-style causal LM (RMSNorm, rotary, GQA, SwiGLU) for demos and tests.

    forward(input_ids (B, S_local), position_ids (B, S_local)) -> logits (B, S_local, vocab);
    every attention layer is ``attention`` (default: causal ``SequenceParallelAttention``).
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

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids)
        return self.head(self.norm(x))
