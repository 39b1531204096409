"""ringflash: exact attention over sequences too long for one GPU.

Single device: ``flash_attn_func``, ``flash_attn_varlen_func`` (Triton FlashAttention-2 with LSE).
Sequence parallel: ``ring_flash_attn_func`` over a process group, with ``shard_sequence`` /
``gather_sequence`` to move between full sequences and per-rank shards.
"""

from .kernels import flash_attn_func, flash_attn_varlen_func
from .layouts import LAYOUTS, layout_indices, zigzag_indices
from .merge import merge_partial
from .ring import ring_flash_attn_func
from .sharding import gather_sequence, shard_sequence

__version__ = "0.1.0"

__all__ = [
    "LAYOUTS",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "gather_sequence",
    "layout_indices",
    "merge_partial",
    "ring_flash_attn_func",
    "shard_sequence",
    "zigzag_indices",
]
