"""transformers' attention patterns sequence parallel: a mask function made of positions and of
blockwise overlays (``masking_utils.blockwise_overlay``: Gemma-3's bidirectional image blocks,
PaliGemma's bidirectional prefix), as one block mask over the whole sequence.

Each rank's model sees only its shard, so the ``block_sequence_ids`` its mask function closes
over number the blocks of that rank's tokens alone. Every rank gathers every rank's ids (one
all-gather per mask, after a host check that the ranks agree on the shapes, which also carries
any rank's local error to all of them), puts them in global order (``layouts.layout_indices``)
and numbers the blocks again over the whole sequence: **a block is a run of consecutive
positions whose ids are >= 0**. That is what Gemma-3 counts (an image is a run of image tokens;
touching image tokens are one image) and what PaliGemma's prefix is. A rank cannot tell whether
its first block continues another rank's last one: touching blocks are taken as one. Where a
rank's own ids say the blocks are not runs (one id on two runs of its tokens, or two ids
touching inside a run of consecutive positions) the blocks cannot be recovered from shards, and
every rank raises ValueError (every rank sees the same gathered ids).

The mask function is then rebuilt over the whole sequence with transformers' own combinators:
the parts that read only positions as they are (causal, bidirectional, sliding windows, and
EmbeddingGemma's own bidirectional parts: ``_MODEL_POSITIONS_ONLY``), each
blockwise overlay over the global ids, the parts transformers adds where a shard's positions jump
(it takes zigzag's shards for packed sequences) left out, as the attention checks that each
row's positions are one sequence's over the group. Any other part (a model's own function, packed
documents, chunks beside an overlay) is refused, named. The result is a ``TileMask`` (batch, 1,
tokens, tokens) evaluated from it once per call (tokens^2 evaluations, as one device's pattern
mask and FlexAttention's ``create_block_mask``), which every rank passes to ``sp_attn_func``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm import RingComm
from ..consistency import check_ranks_agree
from ..kernels import TileMask
from ..layouts import ChunkLayout, layout_indices

BLOCKWISE = "blockwise_overlay.<locals>.inner_mask"
# Parts that read nothing but the positions: valid over the whole sequence as they are.
_POSITIONS_ONLY = frozenset({
    "causal_mask_function", "bidirectional_mask_function", "sliding_window_overlay.<locals>.inner_mask",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask",
})  # fmt: skip
# transformers takes a shard whose positions jump (zigzag's two chunks) for packed sequences: it
# remaps the positions and keeps each "sequence" apart. The attention checks that every row's
# positions are one unbroken sequence's over the group (``check_shard_position_ids``), so over the
# whole sequence the remap changes no difference of positions, and the separation nothing.
_PACKED = "packed_sequence_mask_function.<locals>.inner_mask"
_REMAPPED = "remap_positions_for_packed_sequence.<locals>.inner_mask"
_COMBINATORS = {"and_masks.<locals>.and_mask": "and_masks", "or_masks.<locals>.or_mask": "or_masks"}
# A model's own parts that read nothing but the positions (module, qualified name): EmbeddingGemma
# (Gemma-3, ``use_bidirectional_attention``) ORs its full layers' causal mask with a constant True
# and its sliding layers' with |q - kv| < window. Taken only while they close over numbers alone.
_MODEL_POSITIONS_ONLY = frozenset({
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3TextModel.forward.<locals>.<lambda>"),
    ("transformers.models.gemma3.modeling_gemma3", "_bidirectional_window_overlay.<locals>.inner_mask"),
})  # fmt: skip


def closure_of(fn: Callable) -> dict[str, object]:
    """The variables a nested function closes over, by name."""
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _closes_over_numbers(fn: Callable) -> bool:
    """Whether ``fn`` closes over nothing but Python numbers (no tensor a shard could own)."""
    return all(type(v) in (int, float, bool) for v in closure_of(fn).values())


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def block_ids_in(mask_function: Callable) -> list[torch.Tensor]:
    """The ``block_sequence_ids`` of every blockwise overlay in a transformers mask function,
    (batch, tokens) each; ValueError naming the parts that are neither positions-only parts,
    blockwise overlays, nor ``and_masks``/``or_masks`` of those."""
    found: list[torch.Tensor] = []
    refused = _walk(mask_function, lambda ids: found.append(ids) or ids)[1]
    if refused:
        raise ValueError(
            f"ringflash attention cannot honour the model's attention pattern {refused} sequence parallel: "
            "there it applies causal or bidirectional attention, sliding windows (EmbeddingGemma's "
            "bidirectional ones too), packed documents, attention chunks, and transformers' blockwise "
            "overlays (Gemma-3's image blocks, PaliGemma's prefix) combined with them; on one device "
            "any pattern"
        )
    return found


def _walk(
    fn: object, overlay: Callable[[torch.Tensor], torch.Tensor] | None
) -> tuple[Callable | None, list[str]]:
    """(``fn`` rebuilt over the whole sequence, each blockwise overlay's ids replaced by
    ``overlay(ids)`` (None: ``fn`` has no overlay), the names of the parts that cannot be
    rebuilt)."""
    from transformers import masking_utils

    name = _name(fn)
    module = getattr(fn, "__module__", None)
    if (module, name) in _MODEL_POSITIONS_ONLY and _closes_over_numbers(fn):
        return fn, []  # type: ignore[return-value]
    if module != "transformers.masking_utils":
        return None, [name]
    if name in _POSITIONS_ONLY:
        return fn, []  # type: ignore[return-value]
    if name == BLOCKWISE:
        return masking_utils.blockwise_overlay(overlay(closure_of(fn)["block_sequence_ids"])), []
    if name == _PACKED:  # the shard's jumps, not documents (the attention checks): every pair
        return masking_utils.bidirectional_mask_function, []
    if name == _REMAPPED:  # the same positions, less the row's offset: the same differences
        return _walk(closure_of(fn)["mask_function"], overlay)
    if name in _COMBINATORS:
        parts = [_walk(f, overlay) for f in closure_of(fn)["mask_functions"]]
        refused = [n for _, names in parts for n in names]
        combine = getattr(masking_utils, _COMBINATORS[name])
        return (None if refused else combine(*(f for f, _ in parts))), refused
    return None, [name]


def global_block_ids(parts: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]) -> torch.Tensor:
    """The blocks of the whole sequence, numbered from 0 in order (-1 outside blocks), int64
    (batch, tokens), from each rank's ``parts[r]`` (batch, local tokens), ids numbered on that
    rank's tokens alone, at global ``positions[r]`` (local tokens,), which together cover
    0..tokens-1 once. A block is a run of consecutive positions with ids >= 0; ValueError where a
    rank's own ids contradict that (see the module's docstring)."""
    batch = parts[0].shape[0]
    total = sum(len(p) for p in positions)
    ids = torch.full((batch, total), -1, dtype=torch.int64, device=parts[0].device)
    for rank, (part, where) in enumerate(zip(parts, positions)):
        where = where.to(part.device)
        _check_runs(part, where, rank)
        ids[:, where] = part.to(torch.int64)
    inside = ids >= 0
    starts = inside & ~torch.nn.functional.pad(inside, (1, 0))[:, :-1]
    return torch.where(inside, starts.cumsum(1) - 1, -1)


_RUNS_HINT = (
    "sequence parallel, ringflash takes each block of transformers' blockwise overlay (block_sequence_ids: "
    "Gemma-3's images, PaliGemma's prefix) to be a run of consecutive tokens, numbered on each rank's shard"
)


def _check_runs(part: torch.Tensor, where: torch.Tensor, rank: int) -> None:
    """ValueError unless rank ``rank``'s block ids (batch, local tokens) at global positions
    ``where`` are runs: each id on one run of local tokens, and no two ids touching where the
    local tokens are consecutive positions too."""
    inside = part >= 0
    adjacent = (where[1:] == where[:-1] + 1)[None]  # local neighbours that are global neighbours
    touching = inside[:, 1:] & inside[:, :-1] & (part[:, 1:] != part[:, :-1]) & adjacent
    if bool(touching.any()):
        row, at = (int(i) for i in touching.nonzero()[0])
        raise ValueError(
            f"{_RUNS_HINT}; rank {rank}'s ids {int(part[row, at])} and {int(part[row, at + 1])} touch at "
            f"position {int(where[at + 1])} of sequence {row}, so blocks that touch across shards could not "
            "be told apart"
        )
    starts = inside & ~torch.nn.functional.pad(inside[:, 1:] & (part[:, 1:] == part[:, :-1]), (1, 0))
    for row in range(part.shape[0]):
        first_ids = part[row][starts[row]]
        if first_ids.numel() != first_ids.unique().numel():
            raise ValueError(
                f"{_RUNS_HINT}; rank {rank}'s sequence {row} has a block id on two runs of its tokens, a "
                "block the shards cannot recover"
            )


def sharded_pattern_mask(
    mask_function: Callable,
    batch: int,
    local_tokens: int,
    error: Exception | None,
    *,
    group: dist.ProcessGroup,
    layout: str | ChunkLayout,
    ulysses_size: int | None,
    device: torch.device | str | None,
) -> TileMask:
    """The ``TileMask`` (batch, 1, tokens, tokens) of a transformers mask function over the
    whole sequence of ``local_tokens`` x W tokens from position 0, ``group``'s shards in
    ``layout`` (``ulysses_size`` as in ``layout_indices``; None: W). Every rank of ``group``
    must call it with its shard's mask function; ``error``, what the caller found wrong on this
    rank, is raised on every rank (ValueError), as are parts that cannot be rebuilt."""
    comm = RingComm(group)
    ids = None
    if error is None:
        try:
            found = block_ids_in(mask_function)
            ids = torch.stack([t.to(torch.int64) for t in found]) if found else None
            if ids is not None and ids.shape[1:] != (batch, local_tokens):
                raise ValueError(
                    f"the model's block_sequence_ids have shape {tuple(ids.shape[1:])}, not (batch, tokens) "
                    f"= {(batch, local_tokens)}: sequence parallel, they must cover this rank's tokens"
                )
        except ValueError as e:
            error = e
    shapes = {"batch": batch, "tokens": local_tokens, "overlays": None if ids is None else ids.shape[0]}
    check_ranks_agree(comm.group, shapes, error)
    world = comm.world_size
    total = local_tokens * world
    u = world if ulysses_size is None else ulysses_size
    where = [layout_indices(layout, r, world, total, u) for r in range(world)]
    if ids is None:  # positions only (less the shard's packed-sequence parts): the same every row
        return TileMask.from_mask_mod(_walk(mask_function, None)[0], 1, 1, total, total, device=device)
    gathered = comm.all_gather(ids)  # (overlays, batch, local tokens) per rank
    whole = [global_block_ids([g[i] for g in gathered], where) for i in range(ids.shape[0])]
    rebuilt = _walk(mask_function, lambda _: whole.pop(0))[0]
    return TileMask.from_mask_mod(rebuilt, batch, 1, total, total, device=device)
