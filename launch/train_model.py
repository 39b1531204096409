"""Models for launch/train.py: Llama-shaped presets (random init), the loss wrapper DeepSpeed
runs, and the FLOP count behind the MFU estimate."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringflash.loss import sequence_parallel_chunked_cross_entropy

# Shapes of Llama-3.2-1B and Llama-3-8B; "tiny" runs on a CPU, "small" learns the recall task fast.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0),
    "small": dict(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, rope_theta=500000.0),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}  # fmt: skip


def build_model(
    preset: str, seq_len: int, attn_implementation: str, dtype: torch.dtype, device: torch.device, seed: int
) -> nn.Module:
    """A randomly initialised LlamaForCausalLM of the preset's shape, the same on every rank and
    in every run with the same seed and device type. Built directly on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **PRESETS[preset], max_position_embeddings=seq_len, attention_dropout=0.0, use_cache=False
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model


class CausalLMLoss(nn.Module):
    """What the DeepSpeed engine runs: decoder -> last hidden state -> chunked lm_head + loss.

    forward(input_ids, position_ids, target_ids, answer_mask), each (batch, local_seqlen) ->
    (loss, recall): loss is the float32 mean cross-entropy over the sequence-parallel group
    (``sequence_parallel_chunked_cross_entropy``), recall a float32 (3,) tensor with this rank's
    answer-token loss sum, correct count and token count (no gradient). lm_head is always called
    as a module, even on an empty answer set, so ZeRO-3's parameter gathering stays collective.
    """

    def __init__(self, lm: nn.Module, sp_group: dist.ProcessGroup, chunk_size: int) -> None:
        super().__init__()
        self.lm, self.sp_group, self.chunk_size = lm, sp_group, chunk_size

    def forward(self, input_ids, position_ids, target_ids, answer_mask):
        hidden = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)[0]
        head = self.lm.get_output_embeddings()
        loss = sequence_parallel_chunked_cross_entropy(
            hidden, head, target_ids, self.sp_group, self.chunk_size
        )
        with torch.no_grad():
            logits = head(hidden[answer_mask]).float()
            targets = target_ids[answer_mask]
            recall = torch.stack(
                [
                    F.cross_entropy(logits, targets, reduction="sum"),
                    (logits.argmax(-1) == targets).sum().float(),
                    torch.tensor(float(targets.numel()), device=logits.device),
                ]
            )
        return loss, recall


def matmul_params(model: nn.Module) -> int:
    """Weights used in matrix multiplies per token: every nn.Linear, the output head included
    (counted even when tied to the input embedding, whose lookup costs no FLOPs)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def flops_per_token(model: nn.Module, seq_len: int, segment_len: int | None = None) -> float:
    """Model FLOPs per trained token, forward + backward: 6 x matmul params, plus causal
    attention's QK^T and PV over the full sequence (2 x 2 x seq_len x heads x head_dim per layer
    forward, halved for causality, x3 for the backward). Recomputation is not counted.
    Infini-attention (``segment_len``): the causal attention spans one segment, and the memory
    adds a retrieval per query head and an update per key/value head (2 x head_dim^2 each)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    span = seq_len if segment_len is None else min(segment_len, seq_len)
    attention = 6.0 * cfg.num_hidden_layers * span * cfg.num_attention_heads * head_dim
    if segment_len is not None:
        heads = cfg.num_attention_heads + cfg.num_key_value_heads
        attention += 6.0 * cfg.num_hidden_layers * heads * head_dim * head_dim
    return 6.0 * matmul_params(model) + attention
