"""A block-sparse mask across a sequence-parallel group: each rank's views of one global mask.

Every rank passes the same ``block_mask`` over the full sequence in global positions (a
``TileMask`` or a FlexAttention ``BlockMask``). A ring step needs the mask of this rank's queries
over the visiting shard's keys; a Ulysses rank the mask of its query heads. Both are block
selections (``TileMask.take``, ``TileMask.select_heads``), so a layout must hand each rank whole
mask blocks: "contiguous" and "zigzag" do when each chunk of the sequence is a multiple of the
block size; "stripe" never does. Views are built once per plan (the ring's setup cache) or per
mask object (``heads_view``) and steps with nothing visible are dropped from the plan.

``balanced_layout`` deals a mask's query blocks to the ring's ranks so that each computes about
the same number of visible blocks (what zigzag does for a causal mask), as a ``ChunkLayout``
that ``shard_sequence``, ``gather_sequence`` and every ``layout=`` take; ``layout_work`` counts
each rank's visible blocks per ring step, to compare layouts.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from .kernels import AttentionProblem, TileMask, attention_backward, attention_forward, uses_fused_backward
from .kernels.block_sparse import (
    check_mask_fits,
    sparse_forward,
    sparse_gradients,
    uses_fused_sparse_backward,
)
from .kernels.tile_mask import as_tile_mask
from .layouts import ChunkLayout, layout_indices


class MaskedCall:
    """What the engines' kernel calls (``ring.KernelCall``, ``allgather.GatherCall``) share: they
    launch the dense kernels for their ``problem``, or the block-sparse ones where they carry
    their view of a block mask (``mask``)."""

    problem: AttentionProblem
    mask: TileMask | None

    def forward(self, q, k, v, out, lse) -> None:
        """Write the call's (out, lse) of q over k/v (already indexed) into out/lse."""
        if self.mask is None:
            attention_forward(q, k, v, self.problem, out=out, lse=lse)
        else:
            sparse_forward(q, k, v, self.mask, self.problem, out=out, lse=lse)

    def fused_backward(self, q, k, v) -> bool:
        """Whether the call's backward, computing dQ and dK/dV together, runs one fused kernel."""
        if self.mask is None:
            return uses_fused_backward(self.problem, q, k, v)
        return uses_fused_sparse_backward(self.problem, self.mask, q, k, v)

    def backward(self, dout, q, k, v, lse, delta, **buffers) -> None:
        """The call's gradients into the buffers (``attention_backward``'s keyword arguments)."""
        if self.mask is None:
            attention_backward(dout, q, k, v, lse, delta, self.problem, **buffers)
        else:
            sparse_gradients(dout, q, k, v, lse, delta, self.mask, self.problem, **buffers)


def dense_calls(steps: Iterable[Iterable[MaskedCall]]) -> bool:
    """Whether a plan's kernel calls (its steps, each a few calls) hold no packed documents and no
    block mask: the setups that recur call after call, which ``graph_replay`` replays by default
    (the others are built anew wherever the documents or the mask change)."""
    return all(c.mask is None and c.problem.cu_seqlens_q is None for calls in steps for c in calls)


def converted_block_mask(block_mask: object, error: Exception | None) -> tuple[object, Exception | None]:
    """(``block_mask`` as a TileMask, ``error``): a BlockMask converted once (``as_tile_mask``),
    so that a setup cache keys the same TileMask by identity on every call; an object that is no
    mask comes back as it is, with the conversion's error where there was none before."""
    if block_mask is None or error is not None:
        return block_mask, error
    try:
        return as_tile_mask(block_mask), None
    except (ValueError, TypeError) as e:
        return block_mask, e


def check_block_mask(
    block_mask: object,
    *,
    causal: object,
    window_size: object,
    alibi_slopes: object,
    cu_seqlens: object,
    total: int,
    batch: int,
    heads_q: int,
    device: torch.device,
) -> TileMask:
    """The TileMask of a sequence-parallel call's ``block_mask`` (a FlexAttention BlockMask
    converted once), checked against the call: the full sequence of ``total`` tokens, ``batch``
    sequences, ``heads_q`` query heads, on q's ``device``, no causal/window/ALiBi/packed
    documents beside it."""
    if causal is not False or tuple(window_size) != (-1, -1):
        raise ValueError(
            "block_mask replaces causal and window_size: fold them into the mask (e.g. a mask_mod "
            f"q_idx >= kv_idx) and pass causal=False, window_size=(-1, -1); got causal={causal!r}, "
            f"window_size={window_size!r}"
        )
    if alibi_slopes is not None:
        raise ValueError("block_mask with alibi_slopes is not supported in sequence-parallel attention")
    if cu_seqlens is not None:
        raise ValueError(
            "block_mask describes dense sequences: it cannot take cu_seqlens (put the documents in "
            "the mask: TileMask.within_documents(bounds, bounds) cuts it by them, or a mask_mod "
            "comparing document ids; shard the sequence without cu_seqlens)"
        )
    mask = as_tile_mask(block_mask)
    if (mask.seqlen_q, mask.seqlen_k) != (total, total):
        raise ValueError(
            f"block_mask must cover the full sequence ({total} tokens, the group's shards together), "
            f"got seqlen_q, seqlen_k = {mask.seqlen_q}, {mask.seqlen_k}"
        )
    return check_mask_fits(mask, batch, heads_q, total, total, device)


def shard_blocks(positions: torch.Tensor, block: int, layout: str | ChunkLayout) -> torch.Tensor:
    """The mask blocks of a rank's tokens at global ``positions`` (in local order): each run of
    ``block`` local tokens must be one whole block, else ValueError."""
    runs = positions.view(-1, block) if positions.numel() % block == 0 else None
    if (
        runs is None
        or bool((runs[:, 0] % block).any())
        or not torch.equal(runs, runs[:, :1] + torch.arange(block))
    ):
        raise ValueError(
            f"block_mask needs every rank's shard to be whole blocks of the mask ({block} tokens): layout "
            f"{layout!r} cuts them otherwise (contiguous shards must be multiples of {block} tokens; zigzag "
            f"chunks, half a shard, too; stripe never fits)"
        )
    return runs[:, 0] // block


def ring_step_masks(
    mask: TileMask, layout: str | ChunkLayout, rank: int, world_size: int
) -> tuple[TileMask | None, ...]:
    """The ring's steps for rank ``rank``: step i's mask of its queries over the keys of rank
    (rank - i) % world_size (where the ring has brought them), or None where it leaves nothing
    visible. Steps after the last one that leaves something visible on any rank are dropped:
    every rank drops the same ones (all compute them from the same mask), and the ring stops
    before them, its K/V transfers with them. Reads the mask back (device syncs): call it once
    per plan."""
    total = mask.seqlen_q
    where = [layout_indices(layout, r, world_size, total) for r in range(world_size)]
    q_blocks = shard_blocks(where[rank], mask.block_q, layout)
    needed = layout_work(mask, layout, world_size).sum(0).nonzero()
    n_steps = 1 if needed.numel() == 0 else int(needed.max()) + 1
    steps = []
    for i in range(n_steps):
        view = mask.take(q_blocks, shard_blocks(where[(rank - i) % world_size], mask.block_k, layout))
        steps.append(view if int(view.kv_count.sum()) > 0 else None)
    return tuple(steps)


def gathered_keys_mask(mask: TileMask, layout: str | ChunkLayout, rank: int, world_size: int) -> TileMask:
    """The mask of rank ``rank``'s queries over every key in natural order (the all-gather
    mode's gathered K/V)."""
    positions = layout_indices(layout, rank, world_size, mask.seqlen_q)
    k_blocks = torch.arange(mask.kv_index.shape[3])
    return mask.take(shard_blocks(positions, mask.block_q, layout), k_blocks)


_HEAD_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> {(start, stop): view}


def heads_view(mask: TileMask, start: int, stop: int) -> TileMask:
    """``mask.select_heads(start, stop)``, built once per mask object and head range, so that the
    ring's setup cache (keyed by the mask's identity) finds the same view on every call."""
    views = _HEAD_VIEWS.setdefault(mask, {})
    if (start, stop) not in views:
        views[(start, stop)] = mask.select_heads(start, stop)
    return views[(start, stop)]


def _query_blocks(mask: TileMask, world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    nq = mask.kv_count.shape[2]
    if mask.seqlen_q % mask.block_q or nq % world_size:
        raise ValueError(
            f"the mask's {mask.seqlen_q} queries must be a whole number of its blocks ({mask.block_q}), "
            f"and their {nq} blocks a multiple of world_size {world_size}: pad the sequence"
        )
    return nq


def balanced_layout(block_mask: object, world_size: int) -> ChunkLayout:
    """A ``ChunkLayout`` of ``block_mask``'s query blocks over ``world_size`` ring ranks (W, or
    W / U for hybrid) that evens out the ranks' work. A query block costs its visible key
    blocks (partial and full alike, summed over the mask's sequences and heads); the costliest
    are dealt first, each to the least loaded rank that still has room (every rank holds
    NQ / world_size), and each rank keeps its blocks in position order. Reads the mask's counts
    back once. Every rank computes the same layout from the same mask.

    block_mask: a ``TileMask`` or FlexAttention ``BlockMask`` over the full sequence, whose
    query blocks are a multiple of ``world_size``. Returns the layout to pass as ``layout=``
    to ``shard_sequence``, ``sp_attn_func``/``ring_flash_attn_func`` and ``gather_sequence``.
    """
    mask = as_tile_mask(block_mask)
    nq = _query_blocks(mask, world_size)
    cost = mask.kv_count.sum(-1).sum((0, 1)).tolist()
    room = nq // world_size
    load, held = [0] * world_size, [[] for _ in range(world_size)]
    for block in sorted(range(nq), key=lambda i: (-cost[i], i)):
        rank = min((r for r in range(world_size) if len(held[r]) < room), key=lambda r: (load[r], r))
        held[rank].append(block)
        load[rank] += cost[block]
    return ChunkLayout(tuple(tuple(sorted(h)) for h in held))


def layout_work(block_mask: object, layout: str | ChunkLayout, world_size: int) -> torch.Tensor:
    """(world_size ranks, world_size ring steps) int64: the visible blocks (summed over the mask's
    sequences and heads) rank r computes at ring step i, over the keys of rank (r - i) % W, with
    ``layout``. Its row sums are each rank's work; a ring step lasts about its slowest rank's."""
    mask = as_tile_mask(block_mask)
    _query_blocks(mask, world_size)
    where = [layout_indices(layout, r, world_size, mask.seqlen_q) for r in range(world_size)]
    rank_k = torch.empty(mask.kv_index.shape[3], dtype=torch.int64)  # each key block's rank
    for r, w in enumerate(where):
        rank_k[shard_blocks(w, mask.block_k, layout)] = r
    rank_k = rank_k.to(mask.device)
    visible = (mask.grid() > -2).sum((0, 1))  # (NQ, NK), summed on the device: one small read back
    work = torch.zeros(world_size, world_size, dtype=torch.int64, device=mask.device)
    for r, w in enumerate(where):
        rows = shard_blocks(w, mask.block_q, layout).to(mask.device)
        # Rank r's visible blocks per key block, at the ring step that brings that key block.
        work[r].index_add_(0, (r - rank_k) % world_size, visible[rows].sum(0))
    return work.cpu()
