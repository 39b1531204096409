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
function registered with it (``padding_mask_refusal``) builds no S x S mask: an all-ones 2D
``attention_mask`` is dropped, one with padding raises ValueError (on every rank of the group), and
so does a mask pattern the attention cannot apply (``unhonoured_mask_patterns``: e.g. Llama-4's
attention chunks, Gemma-3's bidirectional image blocks), and so do keys that do not end at the last
query (a StaticCache, whose unfilled slots the attention would see). Without it transformers would
drop both before the attention function sees them.
The name avoids "flash": transformers treats any implementation whose name contains it as
FlashAttention and tries to load a hub kernel for it.

Every keyword the model passes is honoured or refused: ``scaling``, ``sliding_window`` (causal
only: bidirectional sliding windows are refused),
``softcap`` (Gemma-2), ``s_aux`` (gpt-oss attention sinks, which get their gradient),
``is_causal``, ``position_ids`` and the packed-document ``cu_seq_lens_q``/``cu_seq_lens_k`` are used; the
plumbing keywords in ``IGNORED`` do not change the attention's result and are ignored; any
other keyword that is not None, and dropout, an attention mask or ``output_attentions=True``,
raise ValueError. README "Hugging Face model families" lists which families were checked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import host_values_agree, resolve_group
from ..modules import is_sequence_parallel, sequence_parallel_attention
from ..position_ids import assert_unpacked_in_graph, check_shard_position_ids, documents_from_position_ids

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


def unhonoured_mask_patterns(mask_function: object, total_keys: int) -> list[str]:
    """Names of the parts of a transformers mask function that ringflash attention cannot apply
    (chunked attention with chunks shorter than the ``total_keys`` of the whole sequence,
    bidirectional overlays such as Gemma-3's image blocks, bidirectional windows, any
    model-specific function); empty when it applies all of them."""
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    if getattr(mask_function, "__module__", None) != "transformers.masking_utils":
        return [name]
    if name in _HONOURED_PATTERNS:
        return []
    if name == "chunked_overlay.<locals>.inner_mask":  # Llama-4: one chunk holding every key is causal
        return [] if _closure(mask_function)["chunk_size"] >= total_keys else [name]
    if name in _COMBINED_PATTERNS:
        inner = _closure(mask_function)[_COMBINED_PATTERNS[name]]
        parts = inner if isinstance(inner, tuple) else (inner,)
        return [p for f in parts for p in unhonoured_mask_patterns(f, total_keys)]
    if name == "or_masks.<locals>.or_mask":  # a union widens what is seen: name what it joins
        joined = _closure(mask_function)["mask_functions"]
        return [name, *(getattr(f, "__qualname__", repr(f)) for f in joined)]
    return [name]


def _closure(fn) -> dict[str, object]:
    """The variables a nested function closes over, by name."""
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


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


def padding_mask_refusal(group: dist.ProcessGroup | None, hint: str = PADDING_HINT):
    """A transformers mask function (``AttentionMaskInterface``) that builds no mask and refuses
    what the attention function cannot apply. Without one, transformers drops the model's 2D
    ``attention_mask`` and its mask pattern before the attention function is called, so padded
    keys would silently be attended to and e.g. Llama-4's chunked attention run as causal.

    It returns None (no mask: the attention function applies causality, windows and packed
    documents itself) when the pattern is one of those (``unhonoured_mask_patterns``) and the 2D
    mask, if any, is all ones and covers every key, and the last query sits at the last key (the
    attention aligns them bottom-right: a StaticCache's unfilled slots are refused); otherwise
    ValueError. Sequence parallel
    (``group`` given, or torch.distributed initialized), a 2D mask's check joins every rank of the
    group in a 16-byte host all-reduce, so padding in one rank's shard fails every rank instead of
    leaving the others waiting in the ring; under torch.compile a device-side assert stops the
    step instead, and the pattern is not checked (torch.compile cannot read closures).
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
        **kw,
    ) -> None:
        # The pattern is read from the mask function's closures, which torch.compile cannot trace:
        # compiled, it is not checked (run one step eagerly to check a new model family).
        unhonoured = []
        if not torch.compiler.is_compiling():
            world = dist.get_world_size(resolve_group(group)) if is_sequence_parallel(group) else 1
            unhonoured = unhonoured_mask_patterns(mask_function, kv_length * world)
        if unhonoured:
            raise ValueError(
                f"ringflash attention cannot honour the model's attention pattern {unhonoured} (it applies "
                "causal or bidirectional attention, causal sliding windows, packed documents and attention "
                "chunks longer than the sequence only)"
            )
        _check_key_alignment(mask_function, q_length, q_offset, kv_length, kv_offset, cache_position)
        if attention_mask is None:
            return None
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
        return None

    return mask


def _softcap(softcap: object) -> float:
    return 0.0 if softcap is None else softcap  # type: ignore[return-value]


def enable(
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    sp_mode: str = "ring",
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
        _check_keywords(kw)
        if dropout:
            raise ValueError(
                "ringflash attention does not support attention dropout; set attention_dropout=0"
            )
        if attention_mask is not None:
            raise ValueError(
                "ringflash attention takes no attention mask: use pad-free batches (shard_batch)"
            )
        if cu_seq_lens_k is not None and (
            cu_seq_lens_q is None
            or not torch.equal(torch.as_tensor(cu_seq_lens_k), torch.as_tensor(cu_seq_lens_q))
        ):
            raise ValueError(
                "ringflash attention needs cu_seq_lens_k equal to cu_seq_lens_q (self-attention)"
            )
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if sliding_window and not causal:
            raise ValueError(
                f"ringflash attention cannot honour sliding_window={sliding_window} with bidirectional "
                "attention (is_causal=False): transformers' FlashAttention and eager paths disagree on its "
                "width, so use a causal model or no sliding window"
            )
        window = (
            (sliding_window - 1, -1) if sliding_window else (-1, -1)
        )  # HF: the last `sliding_window` keys
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        # Packed documents: shard_batch's cu_seqlens (of the full sequence), passed to the model
        # under transformers' own keyword, or (one device) found from restarting position_ids.
        batch, seqlen = q.shape[:2]
        if cu_seq_lens_q is None and position_ids is not None:
            u = 1 if sp_mode == "ring" else None if sp_mode == "ulysses" else ulysses_size
            shard = dict(group=group, layout=layout, ulysses_size=u, packed_hint=PACKED_HINT)
            if torch.compiler.is_compiling():  # no host sync in a graph: device-side asserts
                assert_unpacked_in_graph(position_ids, batch, seqlen, **shard)
            elif is_sequence_parallel(group):
                check_shard_position_ids(position_ids, batch, seqlen, **shard)
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

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, padding_mask_refusal(group))
    return NAME


def is_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = [
    "IGNORED", "NAME", "PACKED_HINT", "PADDING_HINT", "enable", "is_available", "padding_mask_refusal",
    "unhonoured_mask_patterns",
]  # fmt: skip
