"""Tensors seen as 8-byte words along their last dim, for copies that move that dim whole.

PyTorch's strided copy and scatter kernels (``copy_`` of a permuted view, ``index_copy_``) move a
fixed count of elements per thread, so 2-byte elements run them at a fraction of the memory's
bandwidth: 1.53 TB/s for a bf16 permuting copy against 3.39 TB/s for the same bytes as int64 on an
H200; ``index_copy_`` of 16K tokens x 8 heads x 128 took 54 / 23 µs (bf16 / words), while
``index_select`` ran near bandwidth either way (docs/experiments.md §84). The sequence-parallel
modes' layout changes that move whole head_dim rows (Ulysses' all-to-alls, the all-gather mode's
gradient back to shard order) view them as words first and back after. NCCL takes int64 buffers
(not complex128, which copied a little faster still).
"""

from __future__ import annotations

import torch

WORD = torch.int64


def as_words(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` (one dtype) viewed with ``WORD`` elements along their last dim, the same
    storage, where every one allows it (its bytes a multiple of 8, the other strides and the
    offset too); else the tensors as they are. ``.view(dtype)`` turns a result back. Integer
    views carry no gradient: for the engines' copies, which run outside autograd."""
    if len({t.dtype for t in tensors}) != 1:
        raise TypeError(f"as_words takes tensors of one dtype, got {[t.dtype for t in tensors]}")
    try:
        return [t.view(WORD) for t in tensors]
    except RuntimeError:
        return tensors
