"""The online-softmax merge rule for attention partials computed over disjoint key blocks.

The rule itself is one fused Triton pass, ``kernels.merge_attention_partial`` (a single-device
operation); this is the name the ring engine and users call it by. ``merge_sinks`` adds
attention sinks to the final merged (out, lse), once, in differentiable torch ops.
"""

import torch

from .kernels.merge import merge_attention_partial as merge_partial
from .kernels.merge import merge_sinks

__all__ = ["apply_sinks", "merge_partial", "merge_sinks"]


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None):
    """The final (out, lse) with the sinks joining every row's softmax (``merge_sinks``), or as
    they are. Differentiable in out, lse and sinks."""
    return (out, lse) if sinks is None else merge_sinks(out, lse, sinks)
