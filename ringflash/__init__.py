"""ringflash: exact attention over sequences too long for one GPU.

Single device: ``flash_attn_func``, ``flash_attn_varlen_func`` and their qkv/kv-packed forms
(Triton FlashAttention-2 with LSE, flash-attn 2.x's signatures); any mask block-sparse through
``flash_attn_func(..., block_mask=TileMask or FlexAttention BlockMask)``.
Sequence parallel: ``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``,
``stripe_flash_attn_func``, their ``*_varlen_func`` and qkv/kv-packed forms, the llama3 forms
(``llama3_flash_attn_varlen_func``: all-gathered K/V, documents of any length) and the Hugging Face
adapter (``substitute_hf_flash_attn``, ``update_ring_flash_attn_params``): all of ring-flash-attn's
names, arguments and shard layouts; ``ulysses_attn_func`` (all-to-all over heads) and
``sp_attn_func`` (one entry point for ring / ulysses / hybrid / allgather) over a process group,
with ``shard_sequence`` / ``gather_sequence`` to move between full sequences and shards;
``use_high_priority_comm`` (call before ``init_process_group``) lets ring transfers start beside
the attention kernels.
Training: ``sequence_parallel_groups`` (D x S groups), ``shard_batch``,
``sequence_parallel_cross_entropy`` (and its chunked form, which never makes all logits),
``reduce_gradients``, ``SequenceParallelAttention``; ``integrations.hf`` and
``integrations.deepspeed``; ``attention_checkpoint_context`` (activation checkpointing that keeps
attention's outputs instead of recomputing them).
Bounded memory: ``infini_attention`` (Infini-attention: causal attention inside segments plus a
compressive memory, sequence parallel by a prefix sum or a relay of the memory).
"""

from . import flop_counts  # noqa: F401  (registers the ops' FlopCounterMode formulas)
from .batch import shard_batch
from .block_masks import balanced_layout, layout_work
from .checkpointing import ATTENTION_OPS, attention_checkpoint_context
from .comm import use_high_priority_comm
from .graph_replay import release_graphs
from .groups import ParallelGroups, reduce_gradients, sequence_parallel_groups
from .infini import InfiniAttention, InfiniMemory, infini_attention
from .integrations.hf import substitute_hf_flash_attn, update_ring_flash_attn_params
from .kernels import (
    TileMask,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .layouts import LAYOUTS, ChunkLayout, layout_indices, zigzag_indices
from .llama3 import (
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
)
from .loss import sequence_parallel_chunked_cross_entropy, sequence_parallel_cross_entropy
from .merge import merge_partial
from .modules import ReferenceDecoder, SequenceParallelAttention
from .ring_functions import ring_flash_attn_func, stripe_flash_attn_func, zigzag_ring_flash_attn_func
from .ring_packed import (
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_varlen_qkvpacked_func,
    stripe_flash_attn_kvpacked_func,
    stripe_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_kvpacked_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
)
from .ring_varlen import (
    ring_flash_attn_varlen_func,
    stripe_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_func,
)
from .sharding import gather_sequence, shard_sequence
from .sp_functions import SP_MODES, sp_attn_func, ulysses_attn_func
from .sp_kvcache import sp_flash_attn_with_kvcache

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_OPS",
    "LAYOUTS",
    "ChunkLayout",
    "InfiniAttention",
    "InfiniMemory",
    "ParallelGroups",
    "ReferenceDecoder",
    "SequenceParallelAttention",
    "SP_MODES",
    "TileMask",
    "attention_checkpoint_context",
    "balanced_layout",
    "layout_work",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "gather_sequence",
    "infini_attention",
    "layout_indices",
    "llama3_flash_attn_prepare_cu_seqlens",
    "llama3_flash_attn_varlen_func",
    "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func",
    "merge_partial",
    "reduce_gradients",
    "release_graphs",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "sequence_parallel_chunked_cross_entropy",
    "sequence_parallel_cross_entropy",
    "sequence_parallel_groups",
    "shard_batch",
    "shard_sequence",
    "sp_attn_func",
    "sp_flash_attn_with_kvcache",
    "stripe_flash_attn_func",
    "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func",
    "stripe_flash_attn_varlen_func",
    "substitute_hf_flash_attn",
    "ulysses_attn_func",
    "update_ring_flash_attn_params",
    "use_high_priority_comm",
    "zigzag_indices",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]
