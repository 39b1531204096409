"""Hugging Face transformers: ``attn_implementation="sequence_parallel"`` for Llama/Qwen/Mistral-style models.

    import ringflash.integrations.hf as rf_hf
    rf_hf.enable(group=sp_group)                      # once per process
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=rf_hf.NAME)
    shard = ringflash.shard_batch(batch, sp_group)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
    loss = ringflash.sequence_parallel_cross_entropy(logits, shard["target_ids"], sp_group)

Packed documents (position_ids restarting inside a row): pass ``cu_seq_lens_q=shard["cu_seqlens"]``
to the model as well; attention then stays inside each document.

The model sees only this rank's tokens; rotary embeddings follow ``position_ids``. transformers
builds no mask for an implementation it has no mask function for, so no S x S mask is made.
The name avoids "flash": transformers treats any implementation whose name contains it as
FlashAttention and tries to load a hub kernel for it.
"""

from __future__ import annotations

import torch.distributed as dist

from ..modules import sequence_parallel_attention

NAME = "sequence_parallel"


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
    from transformers import AttentionInterface

    def attention(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw
    ):
        """Called with q/k/v (batch, heads, seqlen, head_dim); returns (batch, seqlen, heads, head_dim)."""
        if kw.get("output_attentions"):
            raise ValueError("ringflash attention cannot return attention weights (output_attentions=True)")
        if dropout:
            raise ValueError(
                "ringflash attention does not support attention dropout; set attention_dropout=0"
            )
        if attention_mask is not None:
            raise ValueError(
                "ringflash attention takes no attention mask: use pad-free batches (shard_batch)"
            )
        causal = bool(getattr(module, "is_causal", True))
        window = (
            (sliding_window - 1, -1) if sliding_window else (-1, -1)
        )  # HF: the last `sliding_window` keys
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        # Packed documents: shard_batch's cu_seqlens (of the full sequence), passed to the model
        # under transformers' own keyword.
        cu_seqlens = kw.get("cu_seq_lens_q")
        out = sequence_parallel_attention(
            q, k, v, scaling, causal, window, group, layout, sp_mode, ulysses_size, cu_seqlens
        )
        return out, None

    AttentionInterface.register(NAME, attention)
    return NAME


def is_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["NAME", "enable", "is_available"]
