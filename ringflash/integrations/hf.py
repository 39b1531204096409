"""Hugging Face transformers: ``attn_implementation="sequence_parallel"`` for models that call
transformers' attention interface (Llama, Qwen, Mistral, Gemma, Phi-3, OLMo-2, GPT-NeoX, gpt-oss...).

    import ringflash.integrations.hf as rf_hf
    rf_hf.enable(group=sp_group)                      # once per process
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=rf_hf.NAME)
    shard = ringflash.shard_batch(batch, sp_group)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
    loss = ringflash.sequence_parallel_cross_entropy(logits, shard["target_ids"], sp_group)

Packed documents (position_ids restarting inside a row, as transformers'
``DataCollatorWithFlattening`` makes them): on one device the documents follow from
``position_ids`` alone, as in transformers' FlashAttention path. Sequence parallel, a rank's shard
cannot show where documents start: pass ``cu_seq_lens_q=shard["cu_seqlens"]`` from ``shard_batch``
to the model as well (without it, positions that restart raise ValueError on every rank).
Attention then stays inside each document. Under torch.compile these checks cannot read positions
back; device-side asserts stop the step instead (``position_ids.assert_unpacked_in_graph``), so a
compiled model with packed documents passes ``cu_seq_lens_q`` on one device too.

The model sees only this rank's tokens; rotary embeddings follow ``position_ids``. The mask
function registered with it (``padding_mask_refusal``) builds no S x S mask for the patterns the
kernels apply themselves (causal, bidirectional, causal windows, packed documents; Llama-4's chunks,
sequence parallel as the block mask ``chunk_block_mask`` over the whole sequence): an all-ones 2D
``attention_mask`` is dropped, one with padding raises ValueError (on
every rank of the group). On one device any other pattern (Gemma-3's bidirectional image blocks,
prefix-LM overlays, bidirectional windows) becomes a block-sparse ``TileMask`` evaluated from the
model's mask function once per forward (``pattern_tile_mask``); sequence parallel, a pattern of
positions and blockwise overlays (Gemma-3's image blocks, PaliGemma's prefix) becomes a block mask
over the whole sequence (``hf_blockwise``: pass ``token_type_ids=shard["token_type_ids"]``), and
any other raises ValueError naming it, as do keys that do not end at the last query (a
StaticCache, whose unfilled slots the attention would see). A ``TileMask`` handed in as the
``attention_mask`` (PaliGemma gives its text model the mask it made) is taken as made. Without
the mask function transformers would drop both before the attention function sees them.
The name avoids "flash": transformers treats any implementation whose name contains it as
FlashAttention and tries to load a hub kernel for it.

Every keyword the model passes is honoured or refused: ``scaling``, ``sliding_window`` (causal
only: bidirectional sliding windows are refused),
``softcap`` (Gemma-2), ``s_aux`` (gpt-oss attention sinks, which get their gradient),
``is_causal``, ``position_ids`` and the packed-document ``cu_seq_lens_q``/``cu_seq_lens_k`` are used; the
plumbing keywords in ``IGNORED`` do not change the attention's result and are ignored; any
other keyword that is not None, and dropout, an attention mask or ``output_attentions=True``,
raise ValueError. README "Hugging Face model families" lists which families were checked.

ring-flash-attn's adapter, for code written for it (also exported from ``ringflash``):

    substitute_hf_flash_attn(group, heads_k_stride=1)          # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flash_attention_2")
    update_ring_flash_attn_params(cu_seqlens, group)           # before each forward: whole packed row
    logits = model(input_ids=ids.chunk(W, 1)[rank], position_ids=positions.chunk(W, 1)[rank]).logits

It registers, under transformers' "flash_attention_2", an attention function with the keyword
handling above that calls ``llama3_flash_attn_varlen_func`` (K/V all-gathered ``heads_k_stride``
heads at a time) with the parameters ``update_ring_flash_attn_params`` prepared (``DATA_PARAMS``),
and ``padding_mask_refusal`` as its mask function. The documents come from those cu_seqlens alone
(transformers' own FlashAttention path would find them in the shard's position_ids, blind to the
other ranks); causal only, batch 1, no padding: anything else raises ValueError. Each forward
checks, on every rank at once, that the shard fits the prepared row: its length, and restarts of
position_ids only where documents start (a stale update raises instead of mixing documents).
transformers refuses "flash_attention_2" without the flash-attn package (and, on a CPU, without a
GPU); while substituted, its check lets the name through for models that support FlashAttention.
``use_ring_attn(False)`` gives the name back to transformers' FlashAttention.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm import host_values_agree, resolve_group
from ..kernels import TileMask, flash_attn_func
from ..layouts import ChunkLayout, host_bounds
from ..llama3 import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func
from ..modules import is_sequence_parallel, sequence_parallel_attention
from ..position_ids import assert_unpacked_in_graph, check_shard_position_ids, documents_from_position_ids
from ..sp_functions import sp_attn_func
from ..sp_kvcache import sp_flash_attn_with_kvcache
from .hf_blockwise import closure_of, sharded_pattern_mask

NAME = "sequence_parallel"

# Keywords transformers (5.x) passes down to the attention function that do not change its
# result: there is no KV cache in a sequence-parallel forward (a cache would make k longer than q,
# which the ring refuses), max lengths follow from cu_seq_lens, MoE router output is elsewhere.
# (position_ids are used: rotary positions are already applied to q/k, but restarts mark packed
# documents.)
IGNORED = frozenset({
    "use_cache", "cache_position", "max_length_q", "max_length_k", "output_router_logits",
    "output_hidden_states", "num_items_in_batch",  # loss and output plumbing (Trainer passes the latter)
})  # fmt: skip

PACKED_HINT = (
    "one rank's shard cannot show where the documents start, so without cu_seq_lens_q attention would "
    "cross them. Shard the batch with ringflash.shard_batch (it finds the documents from the full "
    'position_ids and pads each one) and pass cu_seq_lens_q=shard["cu_seqlens"] to the model, with '
    'position_ids=shard["position_ids"]'
)


def _check_keywords(kw: dict) -> None:
    if kw.get("output_attentions"):
        raise ValueError("ringflash attention cannot return attention weights (output_attentions=True)")
    refused = sorted(
        n for n, x in kw.items() if n not in IGNORED and n != "output_attentions" and x is not None
    )
    if refused:
        raise ValueError(
            f"ringflash attention cannot honour the keyword argument(s) {refused} passed by the model: "
            "it refuses what it does not implement instead of ignoring it (see "
            "ringflash.integrations.hf for what is supported)"
        )


PADDING_HINT = (
    "ringflash attention takes pad-free batches: pack the sequences instead (restarting position_ids, "
    "or shard_batch's cu_seqlens passed as cu_seq_lens_q)"
)


# transformers.masking_utils mask functions whose pattern the attention function applies itself:
# causality (``is_causal``), a causal window (the model passes ``sliding_window`` too, as
# transformers' FlashAttention path relies on) and packed documents (``position_ids`` /
# ``cu_seq_lens_q``). ``and_masks`` and the packed-position remap are looked into.
_HONOURED_PATTERNS = frozenset({
    "causal_mask_function", "bidirectional_mask_function", "sliding_window_overlay.<locals>.inner_mask",
    "packed_sequence_mask_function.<locals>.inner_mask",
})  # fmt: skip
_COMBINED_PATTERNS = {
    "and_masks.<locals>.and_mask": "mask_functions",
    "remap_positions_for_packed_sequence.<locals>.inner_mask": "mask_function",
}


def unhonoured_mask_patterns(mask_function: object, total_keys: int, chunks: bool = False) -> list[str]:
    """Names of the parts of a transformers mask function that ringflash attention cannot apply
    (chunked attention with chunks shorter than the ``total_keys`` of the whole sequence, unless
    ``chunks`` (one device: ``AttentionChunks``), bidirectional overlays such as Gemma-3's image
    blocks, bidirectional windows, any model-specific function); empty when it applies all."""
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    if getattr(mask_function, "__module__", None) != "transformers.masking_utils":
        return [name]
    if name in _HONOURED_PATTERNS:
        return []
    if name == "chunked_overlay.<locals>.inner_mask":  # Llama-4: one chunk holding every key is causal
        return [] if chunks or closure_of(mask_function)["chunk_size"] >= total_keys else [name]
    if name in _COMBINED_PATTERNS:
        inner = closure_of(mask_function)[_COMBINED_PATTERNS[name]]
        parts = inner if isinstance(inner, tuple) else (inner,)
        return [p for f in parts for p in unhonoured_mask_patterns(f, total_keys, chunks)]
    if name == "or_masks.<locals>.or_mask":  # a union widens what is seen: name what it joins
        joined = closure_of(mask_function)["mask_functions"]
        return [name, *(getattr(f, "__qualname__", repr(f)) for f in joined)]
    return [name]


def chunk_size_of(mask_function: object) -> int | None:
    """The chunk size of a transformers mask function's ``chunked_overlay`` (Llama-4's chunked
    attention), looked for through ``and_masks``; None without one."""
    name = getattr(mask_function, "__qualname__", None)
    if getattr(mask_function, "__module__", None) != "transformers.masking_utils":
        return None
    if name == "chunked_overlay.<locals>.inner_mask":
        return int(closure_of(mask_function)["chunk_size"])
    if name in _COMBINED_PATTERNS:
        inner = closure_of(mask_function)[_COMBINED_PATTERNS[name]]
        for f in inner if isinstance(inner, tuple) else (inner,):
            if (size := chunk_size_of(f)) is not None:
                return size
    return None


class AttentionChunks(NamedTuple):
    """What the mask function hands the attention instead of a mask for chunked attention on
    one device (Llama-4: causal within chunks of ``size`` positions, the chunks counted from
    position 0): the queries start at position ``q_offset`` and the keys at ``kv_offset`` (a
    sliding cache layer hands only the last keys)."""

    size: int
    q_offset: int
    kv_offset: int


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: AttentionChunks, **options: object
) -> torch.Tensor:
    """Causal attention within chunks: q (batch, seqlen_q, heads_q, head_dim) at positions
    chunks.q_offset.., k/v (batch, seqlen_k, heads_k, head_dim) at chunks.kv_offset.., the last
    query at the last key. One call per chunk the queries touch, each over its chunk's keys up
    to its last query (bottom-right causal); ``options`` go to ``sequence_parallel_attention``
    on one device (no group). Returns (batch, seqlen_q, heads_q, head_dim) in q's dtype."""
    size, q_start, k_start = chunks
    outs, t = [], 0
    while t < q.shape[1]:
        chunk = (q_start + t) // size
        end = min(q.shape[1], (chunk + 1) * size - q_start)  # the queries of this chunk
        keys = slice(max(chunk * size - k_start, 0), q_start + end - k_start)
        outs.append(sequence_parallel_attention(q[:, t:end], k[:, keys], v[:, keys], causal=True, **options))
        t = end
    return torch.cat(outs, dim=1)


KEY_ALIGNMENT_HINT = (
    "ringflash attention aligns the last query with the last key (flash-attn's bottom-right alignment), "
    "but transformers' mask arguments place the queries at positions {queries} and the keys at {keys}: "
    "a StaticCache (it hands the attention every slot, unfilled ones too) or keys beyond the queries "
    "(e.g. a prefix under a mask) cannot be honoured; use a DynamicCache (the default) or no cache"
)


def _check_key_alignment(
    mask_function: object, q_length: object, q_offset: object, kv_length: int, kv_offset: object,
    cache_position: torch.Tensor | None,
) -> None:  # fmt: skip
    """Raise ValueError unless the last query sits at the last key, as the attention assumes.
    transformers 5.x passes q_length/q_offset (a tensor for a StaticCache), 4.5x cache_position.
    Bidirectional attention has no alignment (cross-attention may have more keys)."""
    if getattr(mask_function, "__qualname__", None) == "bidirectional_mask_function":
        return
    if q_length is not None:
        query_start, query_end = q_offset, q_offset + q_length
    elif cache_position is not None:
        query_start, query_end = cache_position[0], cache_position[-1] + 1
    else:
        return
    key_end = kv_offset + kv_length
    if isinstance(query_end, torch.Tensor):
        if torch.compiler.is_compiling():  # no host read in a graph: a device-side assert
            torch._assert_async(
                query_end == key_end, "ringflash attention: keys do not end at the last query"
            )
            return
        query_start, query_end = int(query_start), int(query_end)
    if query_end != key_end:
        raise ValueError(
            KEY_ALIGNMENT_HINT.format(
                queries=f"{query_start}..{query_end - 1}", keys=f"{kv_offset}..{key_end - 1}"
            )
        )


def _query_span(
    q_length: int | None, q_offset: object, cache_position: torch.Tensor | None, what: str
) -> tuple[int, int]:
    """(first position, count) of the queries a mask function is called for: transformers 5.x
    passes q_length/q_offset, 4.5x cache_position; neither: ValueError naming ``what``."""
    if q_length is not None:
        return int(q_offset), int(q_length)
    if cache_position is not None:
        return int(cache_position[0]), len(cache_position)
    raise ValueError(f"ringflash attention cannot place the queries of {what}")


def pattern_tile_mask(
    mask_function: object, batch_size: int, q_length: int | None, q_offset: object, kv_length: int,
    kv_offset: object, cache_position: torch.Tensor | None, device: object,
) -> TileMask:  # fmt: skip
    """The block-sparse mask of a transformers mask function (``mask_function(batch_idx, head_idx,
    q_idx, kv_idx)``, FlexAttention's ``mask_mod`` convention, absolute positions) over these
    queries and keys, evaluated once per forward (as transformers' SDPA path builds its mask) for
    every layer of the pattern: any pattern on one device (Gemma-3's bidirectional image blocks,
    prefix-LM overlays...)."""
    query_start, queries = _query_span(q_length, q_offset, cache_position, "the model's attention pattern")
    key_start = int(kv_offset)

    def mask_mod(b, h, q, kv):
        return mask_function(b, h, q + query_start, kv + key_start)

    device = device if device is not None else "cpu"
    return TileMask.from_mask_mod(mask_mod, batch_size, 1, queries, kv_length, device=device)


# The pattern is read from the mask function's closures, which torch.compile cannot trace. It
# decides which attention runs, so it is never skipped: compiled, reading it (and building a
# pattern's block mask, which reads the mask back) is a graph break (fullgraph=True refuses it).
_PATTERN_REASON = "ringflash reads the attention pattern from transformers' mask function"


@torch.compiler.disable(reason=_PATTERN_REASON)
def _read_pattern(mask_function: object, total_keys: int) -> tuple[list[str], int | None]:
    """(``unhonoured_mask_patterns`` with attention chunks honoured, ``chunk_size_of``) of a mask
    function."""
    return unhonoured_mask_patterns(mask_function, total_keys, chunks=True), chunk_size_of(mask_function)


# Llama-4's chunks over a whole sequence, as a block mask (sequence parallel), per (chunk size,
# tokens, device): every layer and step of a run asks for the same one.
_CHUNK_MASKS: dict[tuple, TileMask] = {}
_MAX_CHUNK_MASKS = 8


@torch.compiler.disable(reason="ringflash builds the block mask of the attention chunks")
def chunk_block_mask(size: int, tokens: int, device: torch.device) -> TileMask:
    """Causal attention within chunks of ``size`` positions counted from 0 (Llama-4's chunked
    attention) over a whole sequence of ``tokens``, as the ``TileMask`` every rank passes to
    ``sp_attn_func``: made once per (size, tokens, device), from its ``mask_mod`` (seqlen^2
    evaluations, like FlexAttention's ``create_block_mask``)."""
    key = (size, tokens, torch.device(device))
    mask = _CHUNK_MASKS.get(key)
    if mask is None:
        if len(_CHUNK_MASKS) >= _MAX_CHUNK_MASKS:
            _CHUNK_MASKS.clear()
        mask = _CHUNK_MASKS[key] = TileMask.from_mask_mod(
            lambda b, h, q, kv: (q // size == kv // size) & (kv <= q), 1, 1, tokens, tokens, device=device
        )
    return mask


def _check_pad_free(attention_mask: torch.Tensor | None, kv_length: int, hint: str) -> None:
    """ValueError naming ``hint`` where a 2D ``attention_mask``'s last ``kv_length`` keys hold padding."""
    if attention_mask is not None and not bool(attention_mask[:, -kv_length:].bool().all()):
        raise ValueError(f"attention_mask with padding (zeros) is not supported: {hint}")


@torch.compiler.disable(reason=_PATTERN_REASON)
def _pattern_block_mask(
    mask_function: object, batch_size: int, q_length: int | None, q_offset: object, kv_length: int,
    kv_offset: object, cache_position: torch.Tensor | None, device: object,
    attention_mask: torch.Tensor | None, hint: str,
) -> TileMask:  # fmt: skip
    """``pattern_tile_mask`` of these arguments, built eagerly, for a pad-free ``attention_mask``
    (ValueError naming ``hint`` otherwise)."""
    _check_pad_free(attention_mask, kv_length, hint)
    return pattern_tile_mask(
        mask_function, batch_size, q_length, q_offset, kv_length, kv_offset, cache_position, device
    )


@torch.compiler.disable(reason=_PATTERN_REASON)
def _sharded_pattern_block_mask(
    mask_function: object, batch_size: int, q_length: int | None, q_offset: object, kv_length: int,
    kv_offset: object, cache_position: torch.Tensor | None, device: object,
    attention_mask: torch.Tensor | None, hint: str, group: dist.ProcessGroup | None, layout: object,
    ulysses_size: int | None,
) -> TileMask:  # fmt: skip
    """Sequence parallel, the whole sequence's block mask of a pattern made of positions and
    blockwise overlays (``hf_blockwise.sharded_pattern_mask``); every rank joins, and what one
    rank finds wrong (a cache, padding) is raised on all of them."""
    error = None
    try:
        start, queries = _query_span(q_length, q_offset, cache_position, "the model's attention pattern")
        if start or int(kv_offset) or queries != kv_length:
            raise ValueError(
                "sequence parallel, ringflash applies the model's attention pattern to whole sequences from "
                f"position 0 (training, no cache); got {queries} queries from {start} over {kv_length} keys "
                f"from {int(kv_offset)}"
            )
        _check_pad_free(attention_mask, kv_length, hint)
    except ValueError as e:
        error = e
    return sharded_pattern_mask(
        mask_function, batch_size, kv_length, error, group=resolve_group(group), layout=layout,
        ulysses_size=ulysses_size, device=device,
    )  # fmt: skip


def padding_mask_refusal(
    group: dist.ProcessGroup | None,
    hint: str = PADDING_HINT,
    *,
    layout: object = None,
    ulysses_size: int | None = 1,
):
    """A transformers mask function (``AttentionMaskInterface``) that builds no mask and refuses
    what the attention function cannot apply. Without one, transformers drops the model's 2D
    ``attention_mask`` and its mask pattern before the attention function is called, so padded
    keys would silently be attended to and e.g. Llama-4's chunked attention run as causal.

    It returns None (no mask: the attention function applies causality, windows and packed
    documents itself) when the pattern is one of those (``unhonoured_mask_patterns``) and the 2D
    mask, if any, is all ones and covers every key, and the last query sits at the last key (the
    attention aligns them bottom-right: a StaticCache's unfilled slots are refused). Any other
    pattern becomes a ``TileMask``: on one device of exactly the pattern (``pattern_tile_mask``);
    sequence parallel, given the shards' ``layout`` (and ``ulysses_size`` as in
    ``layouts.layout_indices``), of the whole sequence when the pattern is made of positions and
    blockwise overlays (``hf_blockwise``: Gemma-3's image blocks, PaliGemma's prefix); otherwise
    ValueError. A ``TileMask`` as the ``attention_mask`` was made here before and is returned as
    it is. Sequence parallel
    (``group`` given, or torch.distributed initialized), a 2D mask's check joins every rank of the
    group in a 16-byte host all-reduce, so padding in one rank's shard fails every rank instead of
    leaving the others waiting in the ring; under torch.compile a device-side assert stops the
    step instead. Compiled, reading the pattern (and building a block mask) is a graph break:
    it decides which attention runs, so it is never skipped (``fullgraph=True`` refuses it).
    """

    # Keyword-only with defaults: transformers 4.53-4.5x pass cache_position where 5.x passes
    # q_length/q_offset.
    def mask(
        *,
        kv_length: int,
        mask_function: object = None,
        attention_mask: torch.Tensor | None = None,
        q_length: int | None = None,
        q_offset: int | torch.Tensor = 0,
        kv_offset: int = 0,
        cache_position: torch.Tensor | None = None,
        batch_size: int = 1,
        device: torch.device | str | None = None,
        **kw,
    ) -> AttentionChunks | TileMask | None:
        if isinstance(attention_mask, TileMask):  # made here before (PaliGemma hands it to its text model)
            return attention_mask
        one_device = not is_sequence_parallel(group)
        world = 1 if one_device else dist.get_world_size(resolve_group(group))
        unhonoured, chunk = _read_pattern(mask_function, kv_length * world)
        if unhonoured and one_device and mask_function is not None:  # any other pattern: block-sparse
            return _pattern_block_mask(mask_function, batch_size, q_length, q_offset, kv_length, kv_offset,
                                       cache_position, device, attention_mask, hint)  # fmt: skip
        if unhonoured and layout is not None and mask_function is not None:  # blockwise overlays...
            return _sharded_pattern_block_mask(
                mask_function, batch_size, q_length, q_offset, kv_length, kv_offset, cache_position, device,
                attention_mask, hint, group, layout, ulysses_size,
            )  # fmt: skip
        if unhonoured:
            raise ValueError(
                f"ringflash attention cannot honour the model's attention pattern {unhonoured} sequence "
                "parallel (it applies causal or bidirectional attention, causal sliding windows, packed "
                "documents and attention chunks there; on one device any pattern)"
            )
        _check_key_alignment(mask_function, q_length, q_offset, kv_length, kv_offset, cache_position)
        chunks = None
        if chunk is not None:  # chunks that split the keys go to the attention
            query_start, queries = _query_span(q_length, q_offset, cache_position, "chunked attention")
            last = query_start + (queries - 1 if one_device else queries * world - 1)
            if int(kv_offset) // chunk != last // chunk:
                chunks = AttentionChunks(chunk, query_start, int(kv_offset))
        if attention_mask is None:
            return chunks
        message = f"attention_mask with padding (zeros) is not supported: {hint}"
        keys = attention_mask[:, -kv_length:]  # as transformers' FlashAttention mask: the last keys
        if keys.shape[-1] != kv_length:
            raise ValueError(f"{message} (the mask covers {keys.shape[-1]} of {kv_length} keys)")
        if torch.compiler.is_compiling():
            torch._assert_async(keys.bool().all(), message)
            return None
        padded = int(not bool(keys.bool().all()))
        if is_sequence_parallel(group):
            padded |= int(not host_values_agree(padded, resolve_group(group)))
        if padded:
            raise ValueError(message)
        return chunks

    return mask


def _attention_options(
    module: torch.nn.Module, dropout: float, attention_mask: object, sliding_window: int | None,
    is_causal: bool | None, kw: dict, mask_hint: str = "use pad-free batches (shard_batch)",
) -> tuple[bool, tuple[int, int]]:  # fmt: skip
    """The keyword handling every ringflash attention function shares: refuses (ValueError) what
    it cannot honour and returns (causal, window_size) in flash-attn's terms."""
    _check_keywords(kw)
    if dropout:
        raise ValueError("ringflash attention does not support attention dropout; set attention_dropout=0")
    if attention_mask is not None:
        raise ValueError(f"ringflash attention takes no attention mask: {mask_hint}")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if sliding_window and not causal:
        raise ValueError(
            f"ringflash attention cannot honour sliding_window={sliding_window} with bidirectional "
            "attention (is_causal=False): transformers' FlashAttention and eager paths disagree on its "
            "width, so use a causal model or no sliding window"
        )
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)  # HF: the last `sliding_window` keys
    return causal, window


def pattern_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: TileMask,
    scaling: float | None, dropout: float, softcap: float | None, s_aux: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None, kw: dict, attend: Callable = flash_attn_func,
) -> torch.Tensor:  # fmt: skip
    """Attention of q/k/v (batch, heads, seqlen, head_dim) under the block-sparse mask the mask
    function built from the model's pattern (``pattern_tile_mask``; sequence parallel, over the
    whole sequence), which holds all of it: causality, a sliding window, packed documents,
    overlays. ``attend`` runs it (flash-attn's layout and keywords, ``block_mask=``): one
    device's ``flash_attn_func`` or a sequence-parallel call. Returns (batch, seqlen_q, heads,
    head_dim)."""
    _check_keywords(kw)
    if dropout:
        raise ValueError("ringflash attention does not support attention dropout; set attention_dropout=0")
    if cu_seq_lens_q is not None:
        raise ValueError(
            "ringflash attention cannot take cu_seq_lens_q with a mask pattern it builds as a block mask: "
            "pass position_ids instead (the pattern then holds the documents)"
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return attend(q, k, v, softmax_scale=scaling, softcap=_softcap(softcap), sinks=s_aux, block_mask=mask)


def _sharded_cache_step(key: torch.Tensor) -> tuple | None:
    """What a ``ShardedKVCache`` layer handed to the attention call receiving ``key`` (generate()
    over a sharded cache), or None."""
    from .hf_sharded_cache import take_pending

    return take_pending(key)


def _softcap(softcap: object) -> float:
    return 0.0 if softcap is None else softcap  # type: ignore[return-value]


def enable(
    group: dist.ProcessGroup | None = None,
    layout: str | ChunkLayout = "zigzag",
    sp_mode: str = "auto",
    ulysses_size: int | None = None,
) -> str:
    """Register ringflash as a transformers attention implementation; returns its name.

    group: the sequence-parallel group (default: the world, or single-device attention when
    torch.distributed is not initialized). layout, sp_mode, ulysses_size: as in ``sp_attn_func``
    and ``shard_batch``. Calling it again replaces the settings.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        softcap: float | None = None,
        s_aux: torch.Tensor | None = None,
        is_causal: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kw,
    ) -> tuple[torch.Tensor, None]:
        """Called with q/k/v (batch, heads, seqlen, head_dim); returns (batch, seqlen, heads,
        head_dim) and no weights. s_aux: (heads_q,) sink logits; softcap: Gemma-2's logit cap;
        position_ids: int (batch or 1, seqlen), restarting where a packed document starts."""
        chunks = attention_mask if isinstance(attention_mask, AttentionChunks) else None
        if isinstance(attention_mask, TileMask):  # any other pattern, from the mask function
            attend = flash_attn_func
            if is_sequence_parallel(group):  # the whole sequence's mask
                attend = functools.partial(sharded_block_mask_attention, position_ids=position_ids)
            return pattern_attention(query, key, value, attention_mask, scaling, dropout, softcap,
                                     s_aux, cu_seq_lens_q, kw, attend), None  # fmt: skip
        if chunks is not None:  # Llama-4's chunked attention, from the mask function (one device)
            attention_mask = None
        causal, window = _attention_options(module, dropout, attention_mask, sliding_window, is_causal, kw)
        if cu_seq_lens_k is not None and (
            cu_seq_lens_q is None
            or not torch.equal(torch.as_tensor(cu_seq_lens_k), torch.as_tensor(cu_seq_lens_q))
        ):
            raise ValueError(
                "ringflash attention needs cu_seq_lens_k equal to cu_seq_lens_q (self-attention)"
            )
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        pending = _sharded_cache_step(key)
        if pending is not None:  # generate() over a ShardedKVCache: the new tokens, every rank alike
            if chunks is not None:
                raise ValueError(
                    "ringflash attention cannot apply attention chunks (Llama-4) over a ShardedKVCache; "
                    "generate on one device, where the chunks run with a cache"
                )
            layer, k_new, v_new, before = pending
            out = sp_flash_attn_with_kvcache(
                q, layer.keys, layer.values, k_new, v_new, cache_seqlens=before, softmax_scale=scaling,
                causal=causal, window_size=window, softcap=_softcap(softcap), group=layer.group, sinks=s_aux,
                shard_range=layer.shard_range, spread_from=layer.spread_from,
                check_bounds=not layer.ranges_known,  # checked by the layer on the host, no device read
            )  # fmt: skip
            return out, None
        if chunks is not None and is_sequence_parallel(group):
            return _sharded_chunked_attention(q, k, v, chunks, position_ids, cu_seq_lens_q, scaling, window,
                                              softcap, s_aux), None  # fmt: skip
        if chunks is not None:
            packed = None if position_ids is None else documents_from_position_ids(position_ids, *q.shape[:2])
            if cu_seq_lens_q is not None or packed is not None:
                raise ValueError(
                    "ringflash attention cannot apply attention chunks and packed documents together"
                )
            out = chunked_attention(
                q, k, v, chunks, softmax_scale=scaling, window_size=window, group=group, layout=layout,
                sp_mode=sp_mode, ulysses_size=ulysses_size, cu_seqlens=None, softcap=_softcap(softcap),
                sinks=s_aux,
            )  # fmt: skip
            return out, None
        # Packed documents: shard_batch's cu_seqlens (of the full sequence), passed to the model
        # under transformers' own keyword, or (one device) found from restarting position_ids.
        batch, seqlen = q.shape[:2]
        if cu_seq_lens_q is None and position_ids is not None:
            if torch.compiler.is_compiling() or is_sequence_parallel(group):
                check_unpacked(position_ids, batch, seqlen)
            else:
                cu_seq_lens_q = documents_from_position_ids(position_ids, batch, seqlen)
                if cu_seq_lens_q is not None:
                    if k.shape[1] != seqlen:
                        raise ValueError(
                            f"position_ids restart (packed documents) but keys ({k.shape[1]}) outnumber "
                            f"queries ({seqlen}): packed documents need self-attention without a KV cache"
                        )
                    q, k, v = (t.reshape(1, batch * seqlen, *t.shape[2:]) for t in (q, k, v))
        out = sequence_parallel_attention(
            q, k, v, softmax_scale=scaling, causal=causal, window_size=window, group=group, layout=layout,
            sp_mode=sp_mode, ulysses_size=ulysses_size, cu_seqlens=cu_seq_lens_q, softcap=_softcap(softcap),
            sinks=s_aux,
        )  # fmt: skip
        return out.reshape(batch, seqlen, *out.shape[2:]), None

    # The shards' Ulysses size, as layouts.layout_indices takes it (None: the whole group).
    shard_ulysses_size = None if sp_mode == "ulysses" else ulysses_size if sp_mode == "hybrid" else 1

    def check_unpacked(position_ids: torch.Tensor, batch: int, seqlen: int) -> None:
        """ValueError where position_ids restart inside this rank's tokens (packed documents the
        call was not told of); under torch.compile a device-side assert (no host sync in a graph)."""
        shard = dict(group=group, layout=layout, ulysses_size=shard_ulysses_size, packed_hint=PACKED_HINT)
        if torch.compiler.is_compiling():
            assert_unpacked_in_graph(position_ids, batch, seqlen, **shard)
        else:
            check_shard_position_ids(position_ids, batch, seqlen, **shard)

    def _sharded_chunked_attention(
        q, k, v, chunks, position_ids, cu_seq_lens_q, scaling, window, softcap, sinks
    ):  # fmt: skip
        """Llama-4's chunks sequence parallel: each rank's shard of a whole sequence (from
        position 0, no cache) under the chunks' block mask over the full sequence."""
        batch, seqlen = q.shape[:2]
        if chunks.q_offset or chunks.kv_offset or k.shape[1] != seqlen:
            raise ValueError(
                "sequence-parallel chunked attention runs on whole sequences from position 0 (training, "
                f"no cache); got queries from {chunks.q_offset}, keys from {chunks.kv_offset}"
            )
        if cu_seq_lens_q is not None:
            raise ValueError(
                "ringflash attention cannot apply attention chunks and packed documents together"
            )
        tokens = seqlen * dist.get_world_size(resolve_group(group))
        mask = chunk_block_mask(chunks.size, tokens, q.device)
        return sharded_block_mask_attention(
            q, k, v, position_ids=position_ids, softmax_scale=scaling, window_size=window,
            softcap=_softcap(softcap), sinks=sinks, block_mask=mask,
        )  # fmt: skip

    def sharded_block_mask_attention(q, k, v, *, position_ids, **options) -> torch.Tensor:
        """``sp_attn_func`` of this rank's shards (batch, seqlen, heads, head_dim) under a block
        mask over the whole sequence (``options``), the shard's position_ids checked unpacked."""
        if position_ids is not None:
            check_unpacked(position_ids, *q.shape[:2])
        return sp_attn_func(
            q, k, v, group=group, layout=layout, sp_mode=sp_mode, ulysses_size=ulysses_size, **options
        )

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(
        NAME, padding_mask_refusal(group, layout=layout, ulysses_size=shard_ulysses_size)
    )
    return NAME


def is_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# ring-flash-attn's Hugging Face adapter: attn_implementation="flash_attention_2" runs the llama3
# all-gather attention on contiguous shards of one packed row (see the module's docstring).

FLASH_ATTENTION_2 = "flash_attention_2"

# What update_ring_flash_attn_params prepared for this rank: ring-flash-attn's DATA_PARAMS (the
# arguments of llama3_flash_attn_varlen_func), and host-side facts about the packed row that each
# forward is checked against.
DATA_PARAMS: dict[str, object] = {}
_PACKED: dict[str, object] = {}
_RING = {"on": True}  # use_ring_attn's switch
_ORIGINAL: dict[str, object] = {}  # transformers' own "flash_attention_2" functions (use_ring_attn(False))

UPDATE_HINT = (
    "call ringflash.update_ring_flash_attn_params(cu_seqlens, group) with the cu_seqlens of the whole "
    "packed row (every document, every rank's tokens) before each forward"
)
LLAMA3_PADDING_HINT = (
    "pack the sequences into one row without padding and pass their boundaries to "
    "update_ring_flash_attn_params"
)


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group: dist.ProcessGroup) -> None:
    """ring-flash-attn's: prepare this rank's llama3 call for the next forwards of a model that
    ``substitute_hf_flash_attn`` switched over. cu_seqlens: the documents of the whole packed row
    ((0, ..., T) int32 on the model's device, T a multiple of the group's size W), of which this
    rank's shard is the rank-th of W contiguous slices. Call it before each forward of a new
    batch: the attention refuses a shard whose length or position_ids restarts contradict it."""
    group = resolve_group(process_group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prepared = llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, rank, world)
    bounds = host_bounds(cu_seqlens)  # read once: prepare reads the same cached values
    n = bounds[-1] // world
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "local_k_slice")
    DATA_PARAMS.clear()
    DATA_PARAMS.update(zip(names, prepared))
    _PACKED.clear()  # also forgets the last forward checked
    starts = [b - rank * n for b in bounds if rank * n < b < (rank + 1) * n]  # documents starting here
    _PACKED.update(rank=rank, world=world, tokens=n, bounds=bounds, starts=starts)


def use_ring_attn(flag: bool) -> None:
    """ring-flash-attn's switch: False hands "flash_attention_2" back to transformers' own
    FlashAttention (which needs the flash-attn package), True (the default) to the ring."""
    _RING["on"] = bool(flag)


def _packed_row_error(group: dist.ProcessGroup, tokens: int, position_ids, cu_seq_lens_q, cu_seq_lens_k):
    """Why this rank's shard is not the one update_ring_flash_attn_params prepared, or None."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (rank, world) != (_PACKED["rank"], _PACKED["world"]):
        return (
            f"update_ring_flash_attn_params prepared rank {_PACKED['rank']} of {_PACKED['world']}, but this "
            f"is rank {rank} of {world} in substitute_hf_flash_attn's group: pass both the same group"
        )
    if tokens != _PACKED["tokens"]:
        total = _PACKED["bounds"][-1]
        return (
            f"this rank's shard has {tokens} tokens, but update_ring_flash_attn_params prepared a packed row "
            f"of {total} tokens ({_PACKED['tokens']} per rank): {UPDATE_HINT}"
        )
    for name, cu in (("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)):
        if cu is not None and (given := torch.as_tensor(cu).tolist()) != _PACKED["bounds"]:
            return (
                f"the model got {name}={given}, but the attention follows the cu_seqlens given to "
                f"update_ring_flash_attn_params, {_PACKED['bounds']}"
            )
    if position_ids is not None:
        pos = torch.as_tensor(position_ids).reshape(-1)
        restarts = ((pos[1:] != pos[:-1] + 1).nonzero().reshape(-1) + 1).tolist()
        if stray := sorted(set(restarts) - set(_PACKED["starts"])):
            return (
                f"position_ids restart at this rank's tokens {stray}, where update_ring_flash_attn_params' "
                f"cu_seqlens start no document (here they start at {_PACKED['starts']}): {UPDATE_HINT}"
            )
    return None


def _check_packed_row(group: object, tokens: int, position_ids, cu_seq_lens_q, cu_seq_lens_k) -> None:
    """Once per forward (the model hands every layer the same position_ids): raise ValueError on
    every rank of the group (one host all-reduce) if any rank's shard is not the one
    update_ring_flash_attn_params prepared, instead of leaving the others waiting in the gather."""
    if torch.compiler.is_compiling():  # host reads and a host collective: not in a graph
        return
    seen = (position_ids, cu_seq_lens_q, cu_seq_lens_k)
    checked = _PACKED.get("checked")
    if checked is not None and all(a is b for a, b in zip(checked, seen)):
        return
    group = resolve_group(group)
    error = _packed_row_error(group, tokens, *seen)
    if dist.get_world_size(group) > 1 and not host_values_agree(int(error is not None), group):
        error = error or f"another rank of the group refused this forward's packed row: {UPDATE_HINT}"
    if error is not None:
        raise ValueError(error)
    _PACKED["checked"] = seen


def _ring_flash_attention(group: object, heads_k_stride: int):
    """The "flash_attention_2" attention function of substitute_hf_flash_attn."""

    def ring(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        softcap: float | None = None,
        s_aux: torch.Tensor | None = None,
        is_causal: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kw,
    ) -> tuple[torch.Tensor, None]:
        """q/k/v (1, heads, local_tokens, head_dim), this rank's shard; returns (1, local_tokens,
        heads, head_dim) and no weights."""
        causal, window = _attention_options(
            module, dropout, attention_mask, sliding_window, is_causal, kw, mask_hint=LLAMA3_PADDING_HINT
        )
        if not causal:
            raise ValueError(
                "substitute_hf_flash_attn's attention is causal only (as ring-flash-attn's), but the model "
                "asks for bidirectional attention (is_causal=False)"
            )
        if query.shape[0] != 1:
            raise ValueError(
                f"substitute_hf_flash_attn's attention takes batch 1 (one packed row), got batch "
                f"{query.shape[0]}: {LLAMA3_PADDING_HINT}"
            )
        if not DATA_PARAMS:
            raise ValueError(f"the ring attention does not know the packed row's documents: {UPDATE_HINT}")
        _check_packed_row(group, query.shape[2], position_ids, cu_seq_lens_q, cu_seq_lens_k)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        p = DATA_PARAMS
        out = llama3_flash_attn_varlen_func(
            q, k, v, p["cu_seqlens_q"].to(q.device), p["cu_seqlens_k"].to(q.device), p["max_seqlen_q"],
            p["max_seqlen_k"], heads_k_stride, p["local_k_slice"], softmax_scale=scaling, causal=True,
            window_size=window, deterministic=os.environ.get("FLASH_ATTENTION_DETERMINISTIC") == "1",
            group=group, softcap=_softcap(softcap), sinks=s_aux,
        )  # fmt: skip
        return out[None], None

    def attention(*args, **kw):  # switched off: transformers' own, called as the model called it
        return (ring if _RING["on"] else _ORIGINAL["attention"])(*args, **kw)

    return attention


def _ring_flash_mask(group: object):
    """The "flash_attention_2" mask function of substitute_hf_flash_attn: padding_mask_refusal's
    checks (no padding, only patterns the attention applies, no StaticCache), or transformers'
    own function while the ring is switched off."""
    refusal = padding_mask_refusal(group, hint=LLAMA3_PADDING_HINT)

    def mask(*args, **kw):
        return refusal(*args, **kw) if _RING["on"] else _ORIGINAL["mask"](*args, **kw)

    return mask


def _loadable(check_attn_implementation):
    """transformers' attn_implementation check, passing "flash_attention_2" while the ring is on:
    it then needs neither the flash-attn package nor a GPU (and transformers must not load a Hub
    kernel in its place, which would bypass the ring). A model that does not support
    FlashAttention (its attention would not come here) still gets transformers' error."""

    def check(self, attn_implementation, *args, **kw):
        supported = getattr(self, "_supports_flash_attn", False)
        if attn_implementation == FLASH_ATTENTION_2 and _RING["on"] and supported:
            return attn_implementation
        return check_attn_implementation(self, attn_implementation, *args, **kw)

    check.ringflash_original = check_attn_implementation
    return check


def substitute_hf_flash_attn(process_group: dist.ProcessGroup, heads_k_stride: int) -> None:
    """ring-flash-attn's: from now on, models with attn_implementation="flash_attention_2" (loaded
    before or after this call) run their attention through ``llama3_flash_attn_varlen_func`` over
    ``process_group``, all-gathering K/V ``heads_k_stride`` heads at a time (a divisor of the
    model's K/V heads), on this rank's contiguous shard of one packed row whose documents the last
    ``update_ring_flash_attn_params`` gave. Causal, batch 1, no padding. transformers then loads
    "flash_attention_2" without the flash-attn package. Calling it again replaces the group and
    the stride."""
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int):
        raise TypeError(f"heads_k_stride must be an int, got {type(heads_k_stride).__name__}")
    if heads_k_stride < 1:
        raise ValueError(f"heads_k_stride must be a positive int, got {heads_k_stride!r}")
    from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel

    if not _ORIGINAL:
        _ORIGINAL["attention"] = AttentionInterface._global_mapping[FLASH_ATTENTION_2]
        _ORIGINAL["mask"] = AttentionMaskInterface._global_mapping[FLASH_ATTENTION_2]
    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)  # transformers >= 4.54
    if check is not None and not hasattr(check, "ringflash_original"):
        PreTrainedModel._check_and_adjust_attn_implementation = _loadable(check)
    AttentionInterface.register(FLASH_ATTENTION_2, _ring_flash_attention(process_group, heads_k_stride))
    AttentionMaskInterface.register(FLASH_ATTENTION_2, _ring_flash_mask(process_group))


__all__ = [
    "DATA_PARAMS", "IGNORED", "NAME", "PACKED_HINT", "PADDING_HINT", "AttentionChunks", "chunk_size_of",
    "chunked_attention", "enable", "is_available", "padding_mask_refusal", "substitute_hf_flash_attn",
    "unhonoured_mask_patterns", "update_ring_flash_attn_params", "use_ring_attn",
]  # fmt: skip
