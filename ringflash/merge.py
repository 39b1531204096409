"""The online-softmax merge rule for attention partials computed over disjoint key blocks.

The rule itself is one fused Triton pass, ``kernels.merge_attention_partial`` (a single-device
operation); this is the name the ring engine and users call it by (the engine, whose buffers fit by
construction, calls it without the checks: ``merge_unchecked``). ``merge_sinks`` adds
attention sinks to the final merged (out, lse), once, in differentiable torch ops.
"""

import torch

from .kernels.merge import launch_merge as merge_unchecked
from .kernels.merge import merge_attention_partial as merge_partial
from .kernels.merge import merge_sinks

__all__ = ["apply_sinks", "merge_partial", "merge_sinks", "merge_unchecked"]


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None):
    """The final (out, lse) with the sinks joining every row's softmax (``merge_sinks``), or as
    they are. Differentiable in out, lse and sinks."""
    return (out, lse) if sinks is None else merge_sinks(out, lse, sinks)
