"""Kernel launches without Triton's per-call argument binding.

``kernel[grid](*args, **kwargs)`` binds every argument in Python on every call: it specializes
each one (type, 16-byte alignment, divisibility by 16, == 1), hashes the result, looks the
compiled kernel up, then launches it. For a call of a few microseconds of GPU work that costs
more than the kernel (docs/experiments.md §54: about a third of a forward's host time).
``launch`` keys the compiled kernel on the arguments as they are, a refinement of Triton's own
key: tensors by dtype and 16-byte alignment (what Triton specializes them on), TMA descriptors
by dtype, block shape, layout and padding, every other argument by value (Triton specializes
ints on classes of their values, so equal values always share a compiled kernel). The first
call of a key goes through ``kernel[grid]``, which compiles or finds the kernel; later calls of
the key hand the arguments to the compiled kernel's launcher directly.

The interpreter (TRITON_INTERPRET=1) has no compiled kernels: there ``launch`` is
``kernel[grid](...)``. ``RINGFLASH_TRITON_BINDING=1`` in the environment makes every call go
through Triton's binding (to compare, or to rule this module out).
"""

from __future__ import annotations

import inspect
import os
from collections import OrderedDict
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

from .configs import INTERPRET

# Compiled kernels by launch key; bounded: a key holds only values, never a tensor.
_MAX_KEYS = 4096
_COMPILED: OrderedDict[tuple, tuple[Any, tuple]] = OrderedDict()
_DEFAULTS: dict[object, tuple[tuple[str, Any], ...]] = {}


def _parameters(kernel) -> tuple[tuple[str, Any], ...]:
    """The kernel's parameters (name, default) in order, read once per kernel."""
    found = _DEFAULTS.get(kernel)
    if found is None:
        found = tuple((p.name, p.default) for p in inspect.signature(kernel.fn).parameters.values())
        _DEFAULTS[kernel] = found
    return found


_TYPED_VALUES = frozenset((float, bool, str, type(None)))


def _arg_key(a: object) -> object:
    """An argument's part of the launch key (ints, the most common, are their own key: the
    caller skips this call for them). Other values carry their type: True == 1 == 1.0 in Python,
    but Triton compiles a bool, the int 1 and a float differently."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if type(a) in _TYPED_VALUES:
        return (type(a), a)
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(a, "block_shape"):  # a TMA descriptor
        return ("desc", base.dtype, tuple(a.block_shape), a.layout, a.padding)
    raise TypeError  # anything else: Triton's binding


def bypass_enabled() -> bool:
    return not INTERPRET and os.environ.get("RINGFLASH_TRITON_BINDING", "0") != "1"


def launch(kernel, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)`` for a ``triton.jit``/``gluon.jit`` kernel, ``grid`` a
    tuple of 1-3 ints; the keyword arguments (constexprs and launch options) come in the same
    order at every call site, as Python keeps them."""
    if not bypass_enabled():
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    try:
        key = (
            kernel,
            device,
            tuple([a if type(a) is int else _arg_key(a) for a in args]),
            tuple(kwargs.items()),
        )
        hit = _COMPILED.get(key)
    except TypeError:  # an argument this module does not key on, or one not hashable
        kernel[grid](*args, **kwargs)
        return
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # compiled asynchronously
            compiled = compiled.result()
        if compiled is None:  # nothing to reuse (Triton returned no kernel)
            return
        names = _parameters(kernel)
        tail = tuple(kwargs[n] if n in kwargs else d for n, d in names[len(args) :])
        _COMPILED[key] = (compiled, tail)
        if len(_COMPILED) > _MAX_KEYS:
            _COMPILED.popitem(last=False)
        return
    compiled, tail = hit
    stream = driver.active.get_current_stream(device)
    grid = (*grid, 1, 1)
    enter = knobs.runtime.launch_enter_hook
    metadata = compiled.launch_metadata(grid, stream, *args, *tail) if enter is not None else None
    compiled.run(
        grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata,
        enter, knobs.runtime.launch_exit_hook, *args, *tail,
    )  # fmt: skip


def compiled_launches() -> int:
    """How many distinct launch keys have been compiled or found (tests count them)."""
    return len(_COMPILED)
