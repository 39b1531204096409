"""The Ulysses and hybrid (Ulysses x ring) sequence-parallel engine (eager); its entry point,
``sp_attn_func``, is in ``sp_functions.py``.

Ulysses re-partitions q, k, v from "my tokens, all heads" to "my heads, the tokens of my Ulysses
group" with one all-to-all (q, k, v batched together), runs attention there, and swaps back.
In the hybrid, that attention is itself a ring over the ring group; with a single Ulysses group
it is plain single-device attention (pure Ulysses), with Ulysses groups of one it is the ring.
The token layout is ``layouts.layout_indices(layout, rank, W, S, ulysses_size)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .block_masks import heads_view
from .comm import all_to_all
from .kernels import flash_attn_func, flash_attn_varlen_func
from .layouts import cumulative_lengths, document_lengths
from .mesh import UlyssesRingMesh
from .ring import ring_attention


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
    # Concatenated straight into the all-to-all's layout (destination rank first): one copy.
    x = torch.cat([t.reshape(b, n, u, h, d).permute(2, 0, 1, 3, 4) for t, h in zip(tensors, per_rank)], dim=3)
    y = all_to_all(x, group)  # (U source ranks, B, n, sum h, D)
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
    head_dim): dense, or varlen over packed documents of lengths ``doc_lens`` (batch 1; with one
    ring rank every layout is the natural token order). softcap, alibi_slopes ((heads,) or
    (batch, heads)), sinks (heads,), deterministic: as in ``ring_flash_attn_func``."""
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


def _head_slice(x: torch.Tensor | None, mesh: UlyssesRingMesh) -> torch.Tensor | None:
    """The query heads this rank holds after ``seq_to_heads`` (a contiguous run, by Ulysses rank)
    of a per-head tensor (..., heads_q); differentiable, so a gradient scatters back to them."""
    if x is None:
        return None
    per_rank = x.shape[-1] // mesh.ulysses_size
    j = dist.get_rank(mesh.ulysses_group)
    return x[..., j * per_rank : (j + 1) * per_rank]


def mesh_attention(
    q, k, v, mesh: UlyssesRingMesh, *, layout, cu_seqlens, alibi_slopes, sinks, block_mask=None,
    with_lse=True, **options,
):  # fmt: skip
    """(out, lse) of Ulysses or hybrid attention over ``mesh`` (eager): the all-to-all to heads,
    single-device attention or the ring across the ring group, the all-to-all back.
    ``block_mask``: a checked TileMask over the full sequence (``block_masks.check_block_mask``);
    each rank takes its query heads' part of it. ``with_lse=False``: lse is None (the sinks are
    applied inside the attention, so only a caller returning the LSE needs its all-to-all)."""
    u = mesh.ulysses_size
    if block_mask is not None and block_mask.heads > 1:
        per_rank = q.shape[2] // u
        j = dist.get_rank(mesh.ulysses_group)
        block_mask = heads_view(block_mask, j * per_rank, (j + 1) * per_rank)
    kv_heads = _kv_heads_for(q.shape[2], k.shape[2], u)
    if kv_heads != k.shape[2]:
        rep = kv_heads // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    alibi_slopes, sinks = _head_slice(alibi_slopes, mesh), _head_slice(sinks, mesh)
    q, k, v = seq_to_heads([q, k, v], mesh.ulysses_group)
    if mesh.ring_size == 1 and block_mask is not None:  # one ring rank: the natural token order
        out, lse = flash_attn_func(q, k, v, sinks=sinks, return_lse=True, block_mask=block_mask, **options)
    elif mesh.ring_size == 1:
        doc_lens = None
        if cu_seqlens is not None:
            doc_lens = document_lengths(cu_seqlens, q.shape[1], layout, 1)
        out, lse = whole_sequence_attention(
            q, k, v, doc_lens=doc_lens, alibi_slopes=alibi_slopes, sinks=sinks, **options
        )
    else:
        out, lse = ring_attention(
            q, k, v, group=mesh.ring_group, layout=layout, cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes,
            sinks=sinks, check_ranks=False, block_mask=block_mask, **options,
        )  # fmt: skip
    return heads_to_seq(out, mesh.ulysses_group), _lse_to_seq(lse, mesh.ulysses_group) if with_lse else None
