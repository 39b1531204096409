"""The Gluon names of the Hopper kernels that differ between the Triton releases they build with.

Gluon (``triton.experimental.gluon``) is experimental, and between Triton 3.6 (the release the
kernels were written for and validated on H100/H200 GPUs with) and 3.9 it renamed some of what
they call; the old names are still there in 3.9, but raise "... has been removed":

- TMA tile copies: ``tma.async_copy_global_to_shared`` is 3.9's ``tma.async_load``,
  ``tma.async_copy_shared_to_global`` its ``tma.async_store``;
- cp.async of a pointer tensor into shared memory: ``async_copy.async_copy_global_to_shared``
  (Ampere's) is 3.9's ``async_copy.async_load``;
- the TMA reduce-add (``cp.reduce.async.bulk.tensor`` .add), only in 3.6's IR builder, is public
  in 3.9 as ``tma.async_atomic_add``: here ``tma_reduce_add``;
- a shared memory view as another dtype, shape and layout: 3.6's ``smem._reinterpret`` is 3.9's
  ``smem.reinterpret``: here ``reinterpret(smem, dtype, shape, layout)``;
- not a name: 3.9's wgmma lowering copies a register A operand (a mov before the ``wgmma.fence``,
  triton-lang/triton#9514 and #9530) where 3.6's reads the registers in place, which made ptxas
  serialize the head_dim-64 fused backward's wgmma: ``WGMMA_COPIES_A`` (a constexpr) tells
  hopper/backward.py to order its waits otherwise (``_dk_retired_before_dpt``).

The kernel modules that call these import ``tma``, ``async_copy``, ``tma_reduce_add`` and
``reinterpret`` from here (query_tiles.py reads only ``tma.tensor_descriptor``, the same in both,
from Triton's module) and keep the 3.6 spellings: under 3.6 ``tma`` and ``async_copy`` are
Triton's own modules and the kernels' source positions have not moved, so a 3.6 build is
byte-identical to the one validated on GPUs (debug line info included), but for the fused
backward's debug line numbers (hopper/backward.py gained lines for ``WGMMA_COPIES_A``; its SASS
is the same instruction for instruction). Each name is chosen by what the installed Gluon has,
not by its version. Which releases the offline builds are checked under, and what 3.9 builds
differently (spills): ``offline_compile.GLUON_BUILDS``, tests/test_compile.py; which run the
kernels on a GPU: ``dispatch``.
"""

import functools
import types

from triton._C.libtriton import ir
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma as _tma


def _renamed(module: types.ModuleType, **old_names) -> types.ModuleType:
    """``module`` under its older names: a module (as Gluon's kernels may read attributes of)
    with ``old_names`` bound to their successors and every other name looked up in ``module``."""
    view = types.ModuleType(f"{__name__}.{module.__name__.rpartition('.')[2]}", module.__doc__)
    view.__dict__.update(old_names, __getattr__=functools.partial(getattr, module))
    return view


if hasattr(_tma, "async_load"):  # 3.9
    tma = _renamed(
        _tma, async_copy_global_to_shared=_tma.async_load, async_copy_shared_to_global=_tma.async_store
    )
else:  # 3.6
    tma = _tma

if hasattr(_async_copy, "async_load"):  # 3.9
    async_copy = _renamed(_async_copy, async_copy_global_to_shared=_async_copy.async_load)
else:  # 3.6
    async_copy = _async_copy

if hasattr(_tma, "async_atomic_add"):  # 3.9
    tma_reduce_add = _tma.async_atomic_add
else:  # 3.6

    @builtin
    def tma_reduce_add(desc, coord, src, _semantic=None):
        """cp.reduce.async.bulk.tensor add: shared tile ``src`` added into global at ``coord``."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        add = ir.DESCRIPTOR_REDUCE_KIND.ADD
        _semantic.builder.create_async_tma_reduce(add, desc.handle, coord, src.handle)


# The copies (made in the lowering to LLVM IR, triton#9514 of 2026-02-19) show nowhere in Python;
# Gluon's async_load (triton#10083, 2026-04-20) came after them, so a Gluon with it copies. A Gluon
# between the two (no release of offline_compile.GLUON_BUILDS) keeps 3.6's order: still correct,
# its wgmma may serialize.
WGMMA_COPIES_A = gl.constexpr(hasattr(_tma, "async_load"))

_REINTERPRET = "reinterpret" if hasattr(gl.shared_memory_descriptor, "reinterpret") else "_reinterpret"


@builtin
def reinterpret(smem, dtype, shape, layout, _semantic=None):
    """``smem`` (a shared memory descriptor) seen as ``dtype``, ``shape`` and ``layout``."""
    return getattr(smem, _REINTERPRET)(dtype, shape, layout, _semantic=_semantic)
