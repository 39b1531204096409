"""TMA descriptors for the Hopper Gluon kernels (forward.py, backward.py).

A (batch, seqlen, heads, head_dim) tensor is seen as a 2D (rows, heads * head_dim) tensor: token
i of sequence b is row ``b * batch_rows + i`` and head h's columns start at ``h * head_dim``.
Slices along the sequence (the ring's shards) need no copy, as long as heads are packed in
each token's row.
"""

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


def rows_descriptor(t: torch.Tensor, block_rows: int) -> tuple[TensorDescriptor, int]:
    """A TMA descriptor over ``t`` (batch, seqlen, heads, head_dim) as (rows, heads * head_dim)
    with (block_rows, head_dim) blocks; returns it and batch_rows."""
    batch, seqlen, heads, head_dim = t.shape
    batch_rows = t.stride(0) // t.stride(1)
    rows = (batch - 1) * batch_rows + seqlen
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], gl_dtype(t.dtype))
    return TensorDescriptor(
        t, [rows, heads * head_dim], [t.stride(1), 1], [block_rows, head_dim], layout
    ), batch_rows


def tma_layout_ok(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t`` (batch, seqlen, heads, head_dim) as rows of heads * head_dim:
    heads packed, 16-byte aligned rows, batches a whole number of rows apart."""
    b, s, h, d = t.shape
    size = t.element_size()
    return (
        t.stride(3) == 1
        and (h == 1 or t.stride(2) == d)
        and (s == 1 or t.stride(1) >= h * d)
        and t.stride(1) * size % 16 == 0
        and (b == 1 or t.stride(0) % t.stride(1) == 0)
        and t.data_ptr() % 16 == 0
    )
