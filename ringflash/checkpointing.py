"""Activation checkpointing that keeps attention's outputs instead of recomputing them.

``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`` runs ``fn``'s forward again
during the backward. At long context attention is most of that recompute, and sequence parallel
it brings its communication with it (the ring's K/V passes, Ulysses' all-to-alls, the
all-gather). torch's selective activation checkpointing keeps the outputs of the ops it is
given and recomputes the rest; under it (as under any ``TorchDispatchMode``) every ringflash
attention call runs as one dispatcher op (``kernels.ops.use_ops``), so listing ringflash's
forward ops (``ATTENTION_OPS``) keeps each call's outputs, and the backward runs attention's
backward only:

    from functools import partial
    from torch.utils.checkpoint import checkpoint

    y = checkpoint(layer, x, use_reentrant=False, context_fn=ringflash.attention_checkpoint_context)
    # Hugging Face models (older transformers: gradient_checkpointing_enable(
    # gradient_checkpointing_kwargs=...)):
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": ringflash.attention_checkpoint_context})
    # with ops of your own kept too (torchtitan's policy keeps matmuls):
    context_fn = partial(ringflash.attention_checkpoint_context, save=[torch.ops.aten.mm.default])

Memory: each kept call holds its output (q's size) and LSE; Ulysses and the hybrid also the
head-layout q/k/v, output and LSE their backward takes. Calls that no op takes run eagerly and
are recomputed as before: a block mask in the sequence-parallel modes, a ``ChunkLayout``, ALiBi
with Ulysses or the hybrid.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

# Importing the modules registers the ops.
from . import allgather_ops, ops, ring_varlen  # noqa: F401
from .kernels import block_sparse_ops  # noqa: F401
from .kernels import ops as kernel_ops  # noqa: F401

# The forward op of every attention entry point that autograd differentiates: their outputs are
# what the backward ops take (the backward ops themselves run outside the recompute).
ATTENTION_OPS: tuple[torch._ops.OpOverload, ...] = (
    torch.ops.ringflash.flash_attn_forward.default,
    torch.ops.ringflash.block_sparse_forward.default,
    torch.ops.ringflash.ring_attn_forward.default,
    torch.ops.ringflash.ring_varlen_attn_forward.default,
    torch.ops.ringflash.ulysses_attn_forward.default,
    torch.ops.ringflash.allgather_attn_forward.default,
)


def attention_checkpoint_context(
    save: Iterable[torch._ops.OpOverload] = (),
) -> tuple[AbstractContextManager, AbstractContextManager]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    torch's selective checkpointing contexts that keep the outputs of ringflash's attention
    (``ATTENTION_OPS``) and of the ops in ``save`` (OpOverloads such as
    ``torch.ops.aten.mm.default``), and recompute everything else.

    Raises:
        TypeError: ``save`` holds something that is not an OpOverload.
    """
    extra = list(save)
    for op in extra:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(
                f"save must hold OpOverloads such as torch.ops.aten.mm.default, got {type(op).__name__}"
            )
    return create_selective_checkpoint_contexts([*ATTENTION_OPS, *extra])
