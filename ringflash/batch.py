"""Sharding a causal-LM batch over a sequence-parallel group (packed documents included)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import RingComm
from .layouts import ChunkLayout, cumulative_lengths, shard_multiple
from .mesh import check_ulysses_size
from .position_ids import position_restarts
from .sharding import shard_sequence

_PER_TOKEN = ("input_ids", "labels", "position_ids", "attention_mask", "token_type_ids", "inputs_embeds")


def shard_batch(
    batch: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
    layout: str | ChunkLayout = "zigzag",
    ulysses_size: int = 1,
    ignore_index: int = -100,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """This rank's shard of a causal-LM batch.

    batch: ``input_ids`` (batch, seqlen) and optionally ``labels`` (batch, seqlen; default: the
    input ids), ``position_ids`` (default: 0..seqlen-1), ``attention_mask`` (only all-ones is
    accepted: pad-free batches), ``token_type_ids`` (batch, seqlen: Gemma-3's image tokens,
    PaliGemma's prefix) and ``inputs_embeds`` (batch, seqlen, hidden: the whole sequence's
    embeddings, image features merged in, which a shard's model cannot merge itself; sharded
    differentiably, so the vision tower's gradients flow through it), the last two not with
    packed documents. Any other entry raises ValueError: shard other per-token tensors with
    ``shard_sequence`` (same layout), and pass what is not per token to the model as it is.
    Labels are shifted *before* sharding, so the target of the last token of one shard (the
    first token of the next) is not lost. ``layout``: a name, or a ``ChunkLayout`` (e.g.
    ``balanced_layout``'s for a block mask), as ``shard_sequence`` takes.

    Packed sequences: where ``position_ids`` restart inside a row (e.g. transformers'
    DataCollatorWithFlattening), each run of increasing positions is a document. All documents
    of all rows become one packed row; each is padded at its end (``pad_token_id``, no target,
    positions continuing) to a multiple of what the layout needs and split on its own, its last
    token gets no target, and the result has a ``cu_seqlens`` entry (int32, on the CPU) to pass
    to ``sp_attn_func`` / ``SequenceParallelAttention`` / the Hugging Face integration
    (``cu_seq_lens_q=``), which keep attention inside each document.

    Returns ``input_ids``, ``position_ids`` (rotary positions follow their tokens),
    ``target_ids`` (already shifted; ``ignore_index`` after each sequence's last token) and
    ``token_type_ids`` and ``inputs_embeds`` if given, each (batch, seqlen / W)
    (``inputs_embeds``: (batch, seqlen / W, hidden)) in the layout ``sp_attn_func`` expects ((1,
    padded total / W) when packed), plus ``cu_seqlens`` when packed. Pass ``target_ids`` to
    ``sequence_parallel_cross_entropy``, not to a model that shifts labels itself.
    """
    if "input_ids" not in batch:
        raise ValueError("batch needs 'input_ids' of shape (batch, seqlen)")
    unknown = sorted(set(batch) - set(_PER_TOKEN))
    if unknown:
        raise ValueError(
            f"shard_batch shards {', '.join(_PER_TOKEN)}; got also {', '.join(map(str, unknown))}: shard "
            "other per-token tensors with shard_sequence (the same layout), and pass entries that are not "
            "per token (e.g. pixel_values) to the model as they are"
        )
    for name, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(ids.shape)}")
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("attention_mask with padding is not supported: pack sequences without padding")
    labels = batch.get("labels", ids)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    types = batch.get("token_type_ids")
    if any(t.shape != ids.shape for t in (labels, positions) + (() if types is None else (types,))):
        raise ValueError("labels, position_ids and token_type_ids must have the shape of input_ids")
    embeds = batch.get("inputs_embeds")
    if embeds is not None and (embeds.dim() != 3 or embeds.shape[:2] != ids.shape):
        raise ValueError(
            f"inputs_embeds must be (batch, seqlen, hidden) with input_ids' (batch, seqlen) "
            f"{tuple(ids.shape)}, got {tuple(embeds.shape)}"
        )
    per_token = {n: t for n, t in (("token_type_ids", types), ("inputs_embeds", embeds)) if t is not None}

    def shard(t: torch.Tensor, cu=None) -> torch.Tensor:
        return shard_sequence(t, group, 1, layout=layout, ulysses_size=ulysses_size, cu_seqlens=cu)

    restarts = position_restarts(positions)
    if not bool(restarts.any()):
        targets = torch.full_like(labels, ignore_index)
        targets[:, :-1] = labels[:, 1:]
        shards = {"input_ids": shard(ids), "position_ids": shard(positions), "target_ids": shard(targets)}
        return shards | {name: shard(t) for name, t in per_token.items()}
    if per_token:
        raise ValueError(
            f"{' and '.join(per_token)} with packed documents (position_ids that restart) are not supported: "
            "the sequence-parallel attention cannot apply image blocks or a prefix beside documents"
        )
    world = RingComm(group).world_size
    ulysses_size = check_ulysses_size(ulysses_size, world)
    multiple = shard_multiple(layout, world // ulysses_size) * ulysses_size
    packed = _pack_documents(ids, labels, positions, restarts, multiple, ignore_index, pad_token_id)
    cu = packed.pop("cu_seqlens")
    return {name: shard(t, cu) for name, t in packed.items()} | {"cu_seqlens": cu}


def _pack_documents(
    ids: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor,
    restarts: torch.Tensor,
    multiple: int,
    ignore_index: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """One row of documents, each shifted within itself and padded to ``multiple`` tokens."""
    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "position_ids": [], "target_ids": []}
    lens = []
    for row in range(ids.shape[0]):
        cuts = [0, *(restarts[row].nonzero().flatten() + 1).tolist(), ids.shape[1]]
        for a, b in zip(cuts, cuts[1:]):
            n = b - a
            pad = -n % multiple
            target = torch.full((n + pad,), ignore_index, dtype=labels.dtype, device=labels.device)
            target[: n - 1] = labels[row, a + 1 : b]
            last = positions[row, b - 1]
            parts["input_ids"].append(torch.cat([ids[row, a:b], ids.new_full((pad,), pad_token_id)]))
            parts["position_ids"].append(
                torch.cat([positions[row, a:b], last + 1 + torch.arange(pad, device=positions.device)])
            )
            parts["target_ids"].append(target)
            lens.append(n + pad)
    packed = {name: torch.cat(ts)[None] for name, ts in parts.items()}
    packed["cu_seqlens"] = cumulative_lengths(lens)
    return packed
