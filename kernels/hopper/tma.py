"""TMA descriptors for the Hopper Gluon kernels (forward.py, backward.py).

A (batch, seqlen, heads, head_dim) tensor is seen as a 2D (rows, heads * head_dim) tensor: token
i of sequence b is row ``b * batch_rows + i`` and head h's columns start at ``h * head_dim``.
Slices along the sequence (the ring's shards) need no copy, as long as heads are packed in
each token's row.

A head_dim between two builds (96 under the 128 build, 192 under 256) is read through a 3D
(rows, heads, head_dim) descriptor whose blocks are the build's width: TMA fills the columns past
the tensor's head_dim with zeros on loads and drops them on reduce-adds, so the kernels run the
build on the tensors as they are, with no zero-padded copies. A zero column adds nothing to a
score and gives zero columns of the output and gradients, which the kernels do not store.
Gluon's TMA names come from gluon_api.py (they changed between Triton releases).
"""

import ctypes
import dataclasses
import functools
import threading

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_api import reinterpret, tma, tma_reduce_add


def gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


@functools.cache
def shared_layout(block: tuple[int, ...], dtype) -> gl.NVMMASharedLayout:
    """``gl.NVMMASharedLayout.get_default_for(block, dtype)``, made once per block shape and
    dtype: made per launch, the layouts of a fwd+bwd's descriptors took a few tenths of a
    millisecond of host time (about 10 us each), which short kernels wait for."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


_THREAD = threading.local()


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def make_context_current(device: torch.device) -> None:
    """Make ``device``'s primary CUDA context current on this thread where none is. A launch
    encodes its TMA descriptors through the driver, which needs a current context; autograd runs
    a backward on a thread of its own, where none is until a runtime call or a Triton launch
    makes one current (a Hopper kernel first in a backward failed with "invalid device
    context")."""
    if device.type != "cuda" or getattr(_THREAD, "has_context", False):  # offline builds: CPU tensors
        return
    lib = _libcuda()
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or ctx.value:
        _THREAD.has_context = ctx.value is not None
        return
    dev = ctypes.c_int()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if lib.cuDeviceGet(ctypes.byref(dev), index) or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        raise RuntimeError(f"no CUDA context for {device}")
    lib.cuCtxSetCurrent(ctx)
    _THREAD.has_context = True  # a context stays current on a thread (set_device switches, never clears)


def rows_descriptor(
    t: torch.Tensor, block_rows: int, build_dim: int | None = None
) -> tuple[TensorDescriptor, int]:
    """A TMA descriptor over ``t`` (batch, seqlen, heads, head_dim) as (rows, heads * head_dim)
    with (block_rows, head_dim) blocks, or with ``build_dim`` > head_dim as (rows, heads, head_dim)
    with (block_rows, 1, build_dim) blocks (columns past head_dim read as zeros); returns it and
    batch_rows."""
    make_context_current(t.device)
    key = (t.shape, t.stride(), t.dtype, block_rows, build_dim)
    geometry = _GEOMETRIES.get(key)
    if geometry is None:
        geometry = _geometry(t, block_rows, build_dim)
        if len(_GEOMETRIES) >= _MAX_GEOMETRIES:
            _GEOMETRIES.clear()
        _GEOMETRIES[key] = geometry
    shape, strides, block, layout, batch_rows = geometry
    return _descriptor(t, list(shape), list(strides), list(block), layout), batch_rows


# rows_descriptor's shapes, strides, blocks and layouts by tensor geometry: the same few recur
# call after call (about 2.5 us of a descriptor's 4.7 went to working them out again).
_GEOMETRIES: dict[tuple, tuple] = {}
_MAX_GEOMETRIES = 4096


def _geometry(t: torch.Tensor, block_rows: int, build_dim: int | None) -> tuple:
    """(shape, strides, block, layout, batch_rows) of ``rows_descriptor``'s descriptor over ``t``
    (tuples: each descriptor gets lists of its own)."""
    batch, seqlen, heads, head_dim = t.shape
    batch_rows = t.stride(0) // t.stride(1)
    rows = (batch - 1) * batch_rows + seqlen
    if build_dim is None or build_dim == head_dim:
        block = (block_rows, head_dim)
        shape, strides = (rows, heads * head_dim), (t.stride(1), 1)
    else:
        block = (block_rows, 1, build_dim)
        shape, strides = (rows, heads, head_dim), (t.stride(1), head_dim, 1)
    return shape, strides, block, shared_layout(block, gl_dtype(t.dtype)), batch_rows


_FIELDS = ("base", "shape", "strides", "block_shape", "layout", "padding")
_UNCHECKED = tuple(f.name for f in dataclasses.fields(TensorDescriptor)) == _FIELDS


def _descriptor(t: torch.Tensor, shape: list, strides: list, block: list, layout) -> TensorDescriptor:
    """``TensorDescriptor(t, shape, strides, block, layout)`` without its ``__post_init__``
    checks (about 5 us of a launch's host time each) where this Triton's dataclass has the
    fields they would set: ``rows_descriptor``'s callers pass tensors that ``tma_layout_ok``
    accepts (aligned base and rows, packed heads, rows > 0) and blocks of their tile tables."""
    if not _UNCHECKED:
        return TensorDescriptor(t, shape, strides, block, layout)
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding = (
        t, shape, strides, block, layout, "zero"
    )  # fmt: skip
    return desc


@gluon.constexpr_function
def by_head(layout) -> bool:
    """Whether a descriptor of this layout is a (rows, heads, head_dim) one (``rows_descriptor``)."""
    return layout.rank == 3


@gluon.constexpr_function
def tile_layout(layout):
    """The shared layout of a descriptor's tile as the kernels hold it, (rows, build head_dim):
    a (rows, heads, head_dim) descriptor's (rows, 1, build) block has the same bytes and swizzle."""
    if layout.rank == 2:
        return layout
    return gl.NVMMASharedLayout(
        swizzle_byte_width=layout.swizzle_byte_width, element_bitwidth=layout.element_bitwidth, rank=2
    )


@gluon.jit
def load_tile(desc, row, head, bar, smem):
    """TMA copy of the rows from ``row`` of head ``head`` (a block of desc's rows, the build's
    head_dim wide) into the 2D tile ``smem``, completing on ``bar``."""
    if by_head(desc.layout):
        tile = reinterpret(smem, smem.dtype, desc.block_type.shape, desc.layout)
        tma.async_copy_global_to_shared(desc, [row, head, 0], bar, tile)
    else:
        tma.async_copy_global_to_shared(desc, [row, head * smem.shape[1]], bar, smem)


# A TMA reduce-add (cp.reduce.async.bulk.tensor .add; gluon_api.tma_reduce_add: Triton 3.6 has it
# in its IR builder only, 3.9 as tma.async_atomic_add) adds a shared tile into global memory. Like
# a TMA store it reads the tile asynchronously, in the bulk async-group of the thread that issued
# it: the tile may be written again once ``tma.store_wait`` has seen its group read (backward.py's
# dQ writer). Reduce-adds of several programs into the same rows need no lock between them.
# (This comment and the one line of the module docstring keep the source lines of load_tile and
# reduce_add_tile where the builds validated under 3.6 have them, debug line info included.)
@gluon.jit
def reduce_add_tile(desc, row, head, smem):
    """TMA reduce-add of the 2D tile ``smem`` into the rows from ``row`` of head ``head``;
    columns past the tensor's head_dim are dropped."""
    if by_head(desc.layout):
        tma_reduce_add(
            desc, [row, head, 0], reinterpret(smem, smem.dtype, desc.block_type.shape, desc.layout)
        )
    else:
        tma_reduce_add(desc, [row, head * smem.shape[1]], smem)


def tma_layout_ok(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t`` (batch, seqlen, heads, head_dim), or packed (total, heads,
    head_dim) as one batch entry, as rows of heads * head_dim: heads packed, 16-byte aligned
    rows, batches a whole number of rows apart."""
    if t.dim() == 3:
        (s, h, d), (ss, sh, sd), b, sb = t.shape, t.stride(), 1, 0
    else:
        (b, s, h, d), (sb, ss, sh, sd) = t.shape, t.stride()
    return (
        sd == 1
        and (h == 1 or sh == d)
        and (s == 1 or ss >= h * d)
        and ss * t.element_size() % 16 == 0
        and (b == 1 or sb % ss == 0)
        and t.data_ptr() % 16 == 0
    )
