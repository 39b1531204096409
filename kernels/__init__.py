"""Single-device Triton FlashAttention (imported as ``ringflash.kernels``).

Knows nothing of torch.distributed. ``flash_attn_func``/``flash_attn_varlen_func`` are the
autograd-aware entry points; ``attention_forward``/``attention_backward`` with
``build_problem`` are the low-level calls the ring engine uses, with masks in global token
positions (``TokenPositions``).
"""

from .backward import attention_backward, attention_delta, uses_fused_backward
from .forward import attention_forward, uses_fused_forward
from .functional import flash_attn_func, flash_attn_varlen_func
from .merge import check_sinks, merge_attention_partial, merge_sinks
from .positions import MaskBounds, TokenPositions, Visibility, block_visibility
from .problem import AttentionProblem, build_problem, check_window

__all__ = [
    "AttentionProblem",
    "MaskBounds",
    "TokenPositions",
    "Visibility",
    "attention_backward",
    "attention_delta",
    "attention_forward",
    "block_visibility",
    "build_problem",
    "check_sinks",
    "check_window",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "merge_attention_partial",
    "merge_sinks",
    "uses_fused_backward",
    "uses_fused_forward",
]
