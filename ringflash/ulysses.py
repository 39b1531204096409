"""Ulysses and hybrid (Ulysses x ring) sequence parallelism, and the one entry point for all modes.

Ulysses re-partitions q, k, v from "my tokens, all heads" to "my heads, the tokens of my Ulysses
group" with one all-to-all (q, k, v batched together), runs attention there, and swaps back.
In the hybrid, that attention is itself a ring over the ring group; with a single Ulysses group
it is plain single-device attention (pure Ulysses), with Ulysses groups of one it is the ring.
The token layout is ``layouts.layout_indices(layout, rank, W, S, ulysses_size)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .comm import all_to_all, resolve_group
from .kernels import check_window, flash_attn_func, flash_attn_varlen_func
from .kernels.ops import use_ops
from .layouts import check_layout, cumulative_lengths, document_lengths
from .mesh import UlyssesRingMesh, check_ulysses_size, ulysses_ring_mesh
from .ring import ring_flash_attn_func

SP_MODES = ("ring", "ulysses", "hybrid")


def _kv_heads_for(heads_q: int, heads_k: int, u: int) -> int:
    """K/V heads to send so each Ulysses rank gets the ones its query heads use."""
    if heads_q % u:
        raise ValueError(f"Ulysses needs q heads ({heads_q}) divisible by the Ulysses group size ({u})")
    if heads_k % u == 0:
        return heads_k
    if u % heads_k == 0:
        return u  # replicate each K/V head only as far as needed: one per rank
    raise ValueError(
        f"Ulysses needs k/v heads ({heads_k}) divisible by, or dividing, the Ulysses group size ({u})"
    )


def seq_to_heads(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """[(B, n, h_i, D)] local tokens, all heads -> [(B, U*n, h_i/U, D)] group tokens, my heads.
    One all-to-all for all tensors."""
    u = dist.get_world_size(group)
    b, n, _, d = tensors[0].shape
    per_rank = [t.shape[2] // u for t in tensors]
    x = torch.cat([t.reshape(b, n, u, h, d) for t, h in zip(tensors, per_rank)], dim=3)
    y = all_to_all(x.permute(2, 0, 1, 3, 4), group)  # (U source ranks, B, n, sum h, D)
    y = y.permute(1, 0, 2, 3, 4).reshape(b, u * n, sum(per_rank), d)
    return list(torch.split(y, per_rank, dim=2))


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, U*n, h, D) group tokens, my heads -> (B, n, U*h, D) local tokens, all heads."""
    u = dist.get_world_size(group)
    b, un, h, d = x.shape
    y = all_to_all(
        x.reshape(b, u, un // u, h, d).permute(1, 0, 2, 3, 4), group
    )  # (U head groups, B, n, h, D)
    return y.permute(1, 2, 0, 3, 4).reshape(b, un // u, u * h, d)


def _lse_to_seq(lse: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, h, U*n) -> (B, U*h, n), like ``heads_to_seq`` for the LSE."""
    return heads_to_seq(lse.transpose(1, 2).unsqueeze(-1), group).squeeze(-1).transpose(1, 2)


def whole_sequence_attention(q, k, v, softmax_scale, causal, window_size, doc_lens):
    """(out, lse) of attention over a whole sequence held by one rank, (batch, seqlen, heads,
    head_dim): dense, or varlen over packed documents of lengths ``doc_lens`` (batch 1; with one
    ring rank every layout is the natural token order)."""
    if doc_lens is None:
        return flash_attn_func(q, k, v, softmax_scale, causal, window_size, return_lse=True)
    cu = cumulative_lengths(doc_lens, q.device)
    n = max(doc_lens)
    out, lse = flash_attn_varlen_func(
        q[0], k[0], v[0], cu, cu, n, n, softmax_scale, causal, window_size, return_lse=True
    )
    return out[None], lse[None]


def _mesh_attention(q, k, v, mesh: UlyssesRingMesh, layout, softmax_scale, causal, window_size, cu_seqlens):
    u = mesh.ulysses_size
    kv_heads = _kv_heads_for(q.shape[2], k.shape[2], u)
    if kv_heads != k.shape[2]:
        rep = kv_heads // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    q, k, v = seq_to_heads([q, k, v], mesh.ulysses_group)
    if mesh.ring_size == 1:
        doc_lens = None
        if cu_seqlens is not None:
            doc_lens = document_lengths(cu_seqlens, q.shape[1], layout, 1)
        out, lse = whole_sequence_attention(q, k, v, softmax_scale, causal, window_size, doc_lens)
    else:
        out, lse = ring_flash_attn_func(
            q, k, v, softmax_scale, causal, window_size, group=mesh.ring_group, layout=layout,
            return_lse=True, cu_seqlens=cu_seqlens,
        )  # fmt: skip
    return heads_to_seq(out, mesh.ulysses_group), _lse_to_seq(lse.detach(), mesh.ulysses_group)


def sp_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    sp_mode: str = "ring",
    ulysses_size: int | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across ``group``, in any sequence-parallel mode.

    Args:
        q: this rank's shard (batch, local_seqlen, heads_q, head_dim), laid out as
            ``shard_sequence(x, group, layout=layout, ulysses_size=U)`` makes it.
        k, v: (batch, local_seqlen, heads_k, head_dim); heads_q % heads_k == 0.
        softmax_scale, causal, window_size: as in ``flash_attn_func``, over the full sequence.
        group: the sequence-parallel group of W ranks (default: the world).
        layout: token layout of the ring part ("zigzag", "stripe", "contiguous").
        sp_mode: "ring" (U = 1), "ulysses" (U = W: heads_q must be divisible by W) or "hybrid"
            (U = ``ulysses_size``, Ulysses within groups of U consecutive ranks, ring across).
        ulysses_size: the Ulysses group size U for "hybrid".
        return_lse: also return the float32 LSE (batch, heads_q, local_seqlen).
        cu_seqlens: packed documents (batch 1), cumulative lengths over the full sequence, as in
            ``ring_flash_attn_func``; shard with ``shard_sequence(..., ulysses_size=U, cu_seqlens=...)``.

    Returns:
        out (batch, local_seqlen, heads_q, head_dim) in q's dtype (and the LSE).
    """
    if sp_mode not in SP_MODES:
        raise ValueError(f"sp_mode must be one of {SP_MODES}, got {sp_mode!r}")
    if sp_mode == "ring":
        return ring_flash_attn_func(
            q, k, v, softmax_scale, causal, window_size, group, layout, return_lse, cu_seqlens
        )
    if use_ops(q):  # traced: one opaque op; it checks the arguments when it runs
        from .ops import ulysses_attention  # ops.py builds on this module

        if sp_mode == "hybrid" and ulysses_size is None:
            raise ValueError('sp_mode="hybrid" needs ulysses_size')
        u = 0 if sp_mode == "ulysses" else ulysses_size
        args = (softmax_scale, causal, window_size, group, layout, u, cu_seqlens)
        out, lse = ulysses_attention(q, k, v, *args)
        return (out, lse) if return_lse else out
    group = resolve_group(group)
    world = dist.get_world_size(group)
    if sp_mode == "ulysses":
        ulysses_size = world
    elif ulysses_size is None:
        raise ValueError('sp_mode="hybrid" needs ulysses_size')
    mesh = ulysses_ring_mesh(group, check_ulysses_size(ulysses_size, world))
    check_layout(layout)
    check_window(causal, window_size)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, local_seqlen, heads, head_dim)")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got batch {q.shape[0]}")
    out, lse = _mesh_attention(q, k, v, mesh, layout, softmax_scale, causal, window_size, cu_seqlens)
    return (out, lse) if return_lse else out


def ulysses_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    group: dist.ProcessGroup | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed-Ulysses attention: ``sp_attn_func(..., sp_mode="ulysses")``. Shards are
    contiguous slices of the sequence (``shard_sequence(x, group, layout="contiguous")``)."""
    return sp_attn_func(
        q, k, v, softmax_scale, causal, window_size, group, "contiguous", "ulysses", return_lse=return_lse
    )
