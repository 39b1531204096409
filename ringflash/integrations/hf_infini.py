"""Hugging Face transformers: Infini-attention in Llama/Qwen/Mistral-style models.

    import ringflash.integrations.hf_infini as rf_infini
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation=rf_infini.enable(segment_len=2048, group=sp_group)
    )
    rf_infini.add_gates(model)          # one gate parameter per attention layer, before the optimizer
    shard = ringflash.shard_batch(batch, sp_group, layout="contiguous")
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits

Each attention layer's softmax attention becomes ``ringflash.infini_attention`` with the gate
``infini_beta`` (heads,) that ``add_gates`` attaches to the layer (initialised to 0). Rotary
embeddings follow ``position_ids``, as with ``integrations.hf``. Packed documents (``cu_seq_lens_q``
or restarting ``position_ids``), padding masks and sliding windows are refused: the memory spans the
whole row. Infini-attention is causal and has no softcap or sinks: ``is_causal=False`` (or a layer
whose ``is_causal`` is False) and any other keyword that is not None and not in
``integrations.hf.IGNORED`` raise ValueError too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..infini import UPDATES, infini_attention
from ..position_ids import check_shard_position_ids, documents_from_position_ids
from .hf import IGNORED, padding_mask_refusal

NAME = "infini_sequence_parallel"
GATE = "infini_beta"
PACKED_HINT = "Infini-attention's memory spans the whole row, so give it one sequence per row"
# Keywords used (position_ids) or checked above (output_attentions) besides hf.IGNORED.
_HANDLED = IGNORED | {"position_ids", "output_attentions"}


def enable(segment_len: int, group: dist.ProcessGroup | None = None, update: str = "linear") -> str:
    """Register Infini-attention as a transformers attention implementation; returns its name.

    segment_len, update: as in ``infini_attention``. group: the sequence-parallel group (contiguous
    shards); None: the world when torch.distributed is initialized, else one device. Calling it
    again replaces the settings.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    if isinstance(segment_len, bool) or not isinstance(segment_len, int) or segment_len <= 0:
        raise ValueError(f"segment_len must be a positive int, got {segment_len!r}")
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")

    def attention(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw
    ):
        """Called with q/k/v (batch, heads, seqlen, head_dim); returns (batch, seqlen, heads, head_dim)."""
        if kw.get("output_attentions"):
            raise ValueError("Infini-attention cannot return attention weights (output_attentions=True)")
        if dropout:
            raise ValueError("Infini-attention does not support attention dropout; set attention_dropout=0")
        if attention_mask is not None or kw.get("cu_seq_lens_q") is not None:
            raise ValueError(
                "Infini-attention takes no attention mask or packed documents: one sequence per row"
            )
        if sliding_window:
            raise ValueError("Infini-attention replaces the sliding window: use a config without one")
        is_causal = kw.pop("is_causal", None)
        if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
            raise ValueError("Infini-attention is causal: got is_causal=False (bidirectional attention)")
        refused = sorted(n for n, x in kw.items() if n not in _HANDLED and x is not None)
        if refused:
            raise ValueError(
                f"Infini-attention cannot honour the keyword argument(s) {refused} passed by the model "
                "(it has no softcap, sinks, head mask or bias): use a model that does not pass them"
            )
        beta = getattr(module, GATE, None)
        if beta is None:
            raise ValueError(
                f"{type(module).__name__} has no {GATE}: call add_gates(model) after building it"
            )
        sp_group = group
        if sp_group is None and dist.is_available() and dist.is_initialized():
            sp_group = dist.group.WORLD
        position_ids = kw.get("position_ids")
        if position_ids is not None:  # restarting positions would be packed documents: refused
            batch, seqlen = query.shape[0], query.shape[2]
            if sp_group is not None:
                check_shard_position_ids(position_ids, batch, seqlen, group=sp_group, layout="contiguous",
                                         ulysses_size=1, packed_hint=PACKED_HINT)  # fmt: skip
            elif documents_from_position_ids(position_ids, batch, seqlen) is not None:
                raise ValueError(f"position_ids restart (packed documents): {PACKED_HINT}")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = infini_attention(
            q, k, v, beta, segment_len, group=sp_group, update=update, softmax_scale=scaling
        )
        return out, None

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, padding_mask_refusal(group, PACKED_HINT))
    return NAME


def add_gates(model: nn.Module) -> int:
    """Attach ``infini_beta`` (heads,) zeros, in the layer's dtype and device, to every attention
    layer (a module with ``q_proj`` and ``head_dim``) that lacks one; returns how many were added."""
    added = 0
    for module in model.modules():
        if hasattr(module, "q_proj") and hasattr(module, "head_dim") and not hasattr(module, GATE):
            weight = module.q_proj.weight
            heads = weight.shape[0] // module.head_dim
            setattr(module, GATE, nn.Parameter(torch.zeros(heads, dtype=weight.dtype, device=weight.device)))
            added += 1
    if not added and not any(hasattr(m, GATE) for m in model.modules()):
        raise ValueError("add_gates found no attention layer (a module with q_proj and head_dim)")
    return added


__all__ = ["GATE", "NAME", "add_gates", "enable"]
