"""Single-device Triton FlashAttention (imported as ``ringflash.kernels``).

Knows nothing of torch.distributed. ``flash_attn_func``/``flash_attn_varlen_func`` and their
packed forms (flash-attn 2.x's names and signatures) are the autograd-aware entry points,
``flash_attn_with_kvcache`` the inference one (a KV cache, split-KV decoding);
``attention_forward``/``attention_backward`` with ``build_problem`` are the low-level calls the
ring engine uses, with masks in global token positions (``TokenPositions``);
``merge_attention_partial`` and ``merge_sinks`` are the merge rule; ``pad_head_dim`` serves
head dims that are not multiples of 8; ``TileMask`` is a block-sparse mask (any mask, from a
FlexAttention ``mask_mod``/``BlockMask`` or ranges) for ``flash_attn_func(..., block_mask=)``.
"""

if __name__ != "ringflash.kernels":
    # This folder is also importable as a top-level ``kernels`` wherever a checkout's root is on
    # sys.path (``python -m pytest`` or a REPL started there), and transformers imports
    # ``kernels`` (Hugging Face's kernel hub) to read its version. A second copy of this package
    # registers ringflash's torch.library ops a second time, after which a fake-tensor call of
    # one under torch.compile raised "vector::reserve" or crashed the process (the first copy's
    # handles to the ops dangling, most likely; docs/experiments.md §80). So that name gets the
    # one ``ringflash.kernels``; without ringflash installed it stays an empty package.
    import importlib as _importlib
    import sys as _sys

    try:
        _sys.modules[__name__] = _importlib.import_module("ringflash.kernels")
    except ImportError:
        pass
else:
    from . import flop_counts  # noqa: F401  (registers the ops' FlopCounterMode formulas)
    from .backward import attention_backward, attention_delta, attention_gradients
    from .forward import attention_forward
    from .functional import (
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
        pad_head_dim,
        padded_head_dim,
    )
    from .hopper.dispatch import uses_fused_backward, uses_fused_forward
    from .kvcache import flash_attn_with_kvcache
    from .merge import check_sinks, merge_attention_partial, merge_sinks
    from .positions import MaskBounds, TokenPositions, Visibility, block_visibility
    from .problem import AttentionProblem, build_problem, check_window, cu_seqlens_tensor
    from .probs import attention_probs
    from .tile_mask import TileMask

__all__ = [
    "AttentionProblem",
    "MaskBounds",
    "TileMask",
    "TokenPositions",
    "Visibility",
    "attention_backward",
    "attention_delta",
    "attention_gradients",
    "attention_forward",
    "attention_probs",
    "block_visibility",
    "build_problem",
    "cu_seqlens_tensor",
    "check_sinks",
    "check_window",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention_partial",
    "merge_sinks",
    "pad_head_dim",
    "padded_head_dim",
    "uses_fused_backward",
    "uses_fused_forward",
]
