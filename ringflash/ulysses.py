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

from .allgather_ops import allgather_attention
from .comm import all_to_all, resolve_group
from .consistency import call_signature, check_ranks_agree
from .kernels import check_sinks, check_window, flash_attn_func, flash_attn_varlen_func
from .kernels.ops import use_ops
from .kernels.problem import check_alibi_slopes
from .layouts import check_layout, cumulative_lengths, document_lengths
from .mesh import UlyssesRingMesh, check_ulysses_size, check_ulysses_type, ulysses_ring_mesh
from .ring import apply_sinks, attention_returns, check_dropout, ring_attention

SP_MODES = ("ring", "ulysses", "hybrid", "allgather")


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


def _mesh_attention(q, k, v, mesh: UlyssesRingMesh, *, layout, cu_seqlens, alibi_slopes, sinks, **options):
    u = mesh.ulysses_size
    kv_heads = _kv_heads_for(q.shape[2], k.shape[2], u)
    if kv_heads != k.shape[2]:
        rep = kv_heads // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    alibi_slopes, sinks = _head_slice(alibi_slopes, mesh), _head_slice(sinks, mesh)
    q, k, v = seq_to_heads([q, k, v], mesh.ulysses_group)
    if mesh.ring_size == 1:
        doc_lens = None
        if cu_seqlens is not None:
            doc_lens = document_lengths(cu_seqlens, q.shape[1], layout, 1)
        out, lse = whole_sequence_attention(
            q, k, v, doc_lens=doc_lens, alibi_slopes=alibi_slopes, sinks=sinks, **options
        )
    else:
        out, lse = ring_attention(
            q, k, v, group=mesh.ring_group, layout=layout, cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes,
            sinks=sinks, check_ranks=False, **options,
        )  # fmt: skip
    return heads_to_seq(out, mesh.ulysses_group), _lse_to_seq(lse, mesh.ulysses_group)


def check_sp_mode(sp_mode: str, ulysses_size: object) -> None:
    """What ``sp_mode`` and ``ulysses_size`` must satisfy whatever the group's size (so that a
    model configured for sequence parallelism fails on one device too, not first on many)."""
    if sp_mode not in SP_MODES:
        raise ValueError(f"sp_mode must be one of {SP_MODES}, got {sp_mode!r}")
    if sp_mode in ("ring", "allgather") and ulysses_size not in (None, 1):
        raise ValueError(_contradiction(ulysses_size, sp_mode, "1 (or None)"))
    if sp_mode == "hybrid" and ulysses_size is None:
        raise ValueError('sp_mode="hybrid" needs ulysses_size')
    if ulysses_size is not None:
        check_ulysses_type(ulysses_size)


def _contradiction(ulysses_size: object, sp_mode: str, expected: str) -> str:
    return (
        f'ulysses_size={ulysses_size!r} contradicts sp_mode="{sp_mode}", whose Ulysses group size is '
        f"{expected}: shards cut for another size hold other tokens; pass the sp_mode they were cut for"
    )


def sp_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "zigzag",
    sp_mode: str = "ring",
    ulysses_size: int | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    heads_k_stride: int | None = None,
) -> torch.Tensor | tuple:
    """Exact attention over a sequence sharded across ``group``, in any sequence-parallel mode.

    Positional arguments as in ``ring_flash_attn_func`` (flash-attn's order, ``dropout_p`` fourth).

    Args:
        q: this rank's shard (batch, local_seqlen, heads_q, head_dim), laid out as
            ``shard_sequence(x, group, layout=layout, ulysses_size=U)`` makes it.
        k, v: (batch, local_seqlen, heads_k, head_dim); heads_q % heads_k == 0.
        dropout_p: must be 0.0.
        softmax_scale, causal, window_size: as in ``flash_attn_func``, over the full sequence.
        alibi_slopes: float32 (heads_q,) or (batch, heads_q), as in flash-attn.
        deterministic: only kernels that sum in a fixed order.
        return_attn_probs: return (out, lse, None), as ring-flash-attn does.
        group: the sequence-parallel group of W ranks (default: the world).
        layout: token layout of the ring part ("zigzag", "stripe", "contiguous").
        sp_mode: "ring" (U = 1), "ulysses" (U = W: heads_q must be divisible by W), "hybrid"
            (U = ``ulysses_size``, Ulysses within groups of U consecutive ranks, ring across) or
            "allgather" (U = 1: every rank gathers the whole sequence's K/V, ``heads_k_stride``
            heads at a time, overlapped with the kernels; any ``layout``, see ``allgather.py``).
        ulysses_size: the Ulysses group size U for "hybrid"; with "ring" only None or 1, with
            "ulysses" only None or W (any other value raises ValueError).
        cu_seqlens: packed documents (batch 1), cumulative lengths over the full sequence, as in
            ``ring_flash_attn_func``; shard with ``shard_sequence(..., ulysses_size=U, cu_seqlens=...)``.
        softcap: scores -> softcap * tanh(scores / softcap); 0.0 = off.
        sinks: (heads_q,) sink logits (gpt-oss), applied once to each head's merged result; its
            gradient is this rank's contribution (sum over the group: ``reduce_gradients``).
        return_lse: also return the float32 LSE (batch, heads_q, local_seqlen).
        heads_k_stride: "allgather" only: K/V heads gathered at a time, a divisor of heads_k
            (None: all, one gather); memory: the full sequence's K/V of heads_k_stride heads (twice,
            double-buffered, when heads_k_stride < heads_k, so the next gather overlaps the kernels).

    Returns:
        out (batch, local_seqlen, heads_q, head_dim) in q's dtype (and the LSE). Every rank of the
        group must pass the same shapes and options, else every rank raises ValueError.
    """
    error = None
    try:
        check_dropout(dropout_p)
        check_sp_mode(sp_mode, ulysses_size)
        check_layout(layout)
        if heads_k_stride is not None and sp_mode != "allgather":
            raise ValueError(f'heads_k_stride={heads_k_stride!r} is for sp_mode="allgather", not "{sp_mode}"')
        if sp_mode in ("ulysses", "hybrid"):
            check_window(causal, window_size)
            for name, t in (("q", q), ("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 4:
                    raise ValueError(f"{name} must be a 4-D tensor (batch, local_seqlen, heads, head_dim)")
            alibi_slopes = check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
            sinks = check_sinks(sinks, q.shape[2], q.device)
            if cu_seqlens is not None and q.shape[0] != 1:
                raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got batch {q.shape[0]}")
    except (ValueError, TypeError) as e:
        error = e
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                   deterministic=deterministic)  # fmt: skip
    if sp_mode == "allgather":
        out, lse = allgather_attention(
            q, k, v, group=group, layout=layout, cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes,
            sinks=sinks, heads_k_stride=heads_k_stride, error=error, **options,
        )  # fmt: skip
        return attention_returns(out, lse, return_attn_probs, return_lse)
    if sp_mode != "ring" and use_ops(q):  # traced: one opaque op, which checks the ranks when it runs
        from .ops import ulysses_attention_op  # ops.py builds on this module

        if error is not None:
            raise error
        if alibi_slopes is not None:
            raise NotImplementedError("alibi_slopes with Ulysses/hybrid under torch.compile")
        if sp_mode == "ulysses" and ulysses_size is not None:
            world = dist.get_world_size(resolve_group(group))
            if ulysses_size != world:
                raise ValueError(_contradiction(ulysses_size, sp_mode, f"the group size {world} (or None)"))
        u = 0 if sp_mode == "ulysses" else ulysses_size
        out, lse = ulysses_attention_op(
            q, k, v, group=group, layout=layout, ulysses_size=u, cu_seqlens=cu_seqlens, **options
        )
        return attention_returns(*apply_sinks(out, lse, sinks), return_attn_probs, return_lse)
    if sp_mode == "ring" and error is None:
        out, lse = ring_attention(q, k, v, group=group, layout=layout, cu_seqlens=cu_seqlens,
                                  alibi_slopes=alibi_slopes, sinks=sinks, **options)  # fmt: skip
        return attention_returns(out, lse, return_attn_probs, return_lse)
    try:
        group = resolve_group(group)
    except (RuntimeError, TypeError):
        if error is not None:
            raise error from None
        raise
    world = dist.get_world_size(group)
    if error is None:
        try:
            if sp_mode == "ulysses" and ulysses_size not in (None, world):
                raise ValueError(_contradiction(ulysses_size, sp_mode, f"the group size {world} (or None)"))
            u = world if sp_mode == "ulysses" else check_ulysses_size(ulysses_size, world)
        except (ValueError, TypeError) as e:
            error = e
    signature = call_signature(
        q, k, v, sp_mode=sp_mode, ulysses_size=ulysses_size, layout=layout, cu_seqlens=cu_seqlens,
        alibi_slopes=alibi_slopes, sinks=sinks, **options,
    )  # fmt: skip
    check_ranks_agree(group, signature, error)
    mesh = ulysses_ring_mesh(group, u)
    out, lse = _mesh_attention(q, k, v, mesh, layout=layout, cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes,
                               sinks=sinks, **options)  # fmt: skip
    return attention_returns(out, lse, return_attn_probs, return_lse)


def ulysses_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple:
    """DeepSpeed-Ulysses attention: ``sp_attn_func(..., sp_mode="ulysses")``. Shards are
    contiguous slices of the sequence (``shard_sequence(x, group, layout="contiguous")``)."""
    return sp_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
        return_attn_probs, group, layout="contiguous", sp_mode="ulysses", softcap=softcap, sinks=sinks,
        return_lse=return_lse,
    )  # fmt: skip
