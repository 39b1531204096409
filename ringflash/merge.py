"""The online-softmax merge rule for attention partials computed over disjoint key blocks.

The rule itself is one fused Triton pass, ``kernels.merge_attention_partial`` (a single-device
operation); this is the name the ring engine and users call it by. ``merge_sinks`` adds
attention sinks to the final merged (out, lse), once, in differentiable torch ops.
"""

from .kernels.merge import merge_attention_partial as merge_partial
from .kernels.merge import merge_sinks

__all__ = ["merge_partial", "merge_sinks"]
