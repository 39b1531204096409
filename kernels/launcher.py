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
through Triton's binding, ``RINGFLASH_TRITON_BINDING=run`` through the compiled kernel's ``run``
(to compare, or to rule this module out).

Under the Triton releases in ``DIRECT_RELEASES`` a later call goes one step further down: to
the compiled kernel's C launcher itself, with its TMA descriptors encoded here, skipping the
Python wrappers around it (scratch allocation, which these kernels do not use, and a loop
over every argument that looks for descriptors). Kernels that need scratch memory, and every
other release, go through the compiled kernel's ``run``.
"""

from __future__ import annotations

import inspect
import os
from collections import OrderedDict
from typing import Any

import torch
import triton
from triton import knobs
from triton.runtime import driver

from .configs import INTERPRET

# Compiled kernels by launch key; bounded: a key holds only values, never a tensor.
_MAX_KEYS = 4096
_COMPILED: OrderedDict[tuple, tuple[Any, tuple, tuple | None]] = OrderedDict()  # (kernel, tail, direct)
_DEFAULTS: dict[object, tuple[tuple[str, Any], ...]] = {}
_MAX_LAYOUTS = 1024
_LAYOUTS: dict[int, object] = {}


def _parameters(kernel) -> tuple[tuple[str, Any], ...]:
    """The kernel's parameters (name, default) in order, read once per kernel."""
    found = _DEFAULTS.get(kernel)
    if found is None:
        found = tuple((p.name, p.default) for p in inspect.signature(kernel.fn).parameters.values())
        _DEFAULTS[kernel] = found
    return found


Tensor = torch.Tensor
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
        # The layout by identity (hashing the dataclass cost microseconds per call), pinned in
        # _LAYOUTS so that its id is never reused; tma.shared_layout makes each layout once.
        layout = a.layout
        if _LAYOUTS.get(id(layout)) is not layout:
            if len(_LAYOUTS) >= _MAX_LAYOUTS:  # layouts made per call: key on their value
                return ("desc", base.dtype, tuple(a.block_shape), layout, a.padding)
            _LAYOUTS[id(layout)] = layout
        return ("desc", base.dtype, tuple(a.block_shape), id(layout), a.padding)
    raise TypeError  # anything else: Triton's binding


# The releases whose launcher internals ``_direct_launcher`` reads (validated on an H100/H200).
DIRECT_RELEASES = ("3.6.",)


_BINDING_VARIABLE = "RINGFLASH_TRITON_BINDING"
try:  # os.environ's own dict (bytes on POSIX): a lookup there is 0.1 us, os.environ.get 1 us
    _ENVIRON, _BINDING_KEY = os.environ._data, os.environ.encodekey(_BINDING_VARIABLE)
except AttributeError:
    _ENVIRON = None


def _binding() -> str:
    """RINGFLASH_TRITON_BINDING: "0" (default) this module's launches, "1" Triton's binding,
    "run" this module's key but the compiled kernel's ``run`` (no direct C launches). Read at
    every launch (tests and benchmarks change it at run time)."""
    if INTERPRET:
        return "1"
    if _ENVIRON is None:
        return os.environ.get(_BINDING_VARIABLE, "0")
    value = _ENVIRON.get(_BINDING_KEY)
    return "0" if value is None else os.environ.decodevalue(value)


# The current device and its current stream, straight from torch's C bindings where they exist
# (Triton's own driver calls the second): torch.cuda.current_device() and Triton's lazily
# bound driver each add about a microsecond per launch.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def bypass_enabled() -> bool:
    return _binding() != "1"


def _direct_launcher(compiled, n_args: int) -> tuple | None:
    """(C launch function, cooperative, pdl, ((argument index, descriptor metadata), ...)) of a
    compiled kernel whose launcher can be called directly, or None. Reads Triton 3.6's
    ``CudaLauncher`` and the closure of its descriptor wrapper (``wrap_handle_tensordesc``)."""
    if not triton.__version__.startswith(DIRECT_RELEASES):
        return None
    run = compiled.run
    if type(run).__name__ != "CudaLauncher" or run.global_scratch_size or run.profile_scratch_size:
        return None
    fn, descriptors = run.launch, ()
    if getattr(fn, "__name__", None) == "inner":  # the descriptor wrapper around the C launcher
        try:
            cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
            fn, meta = cells["launcher"], cells["tensordesc_meta"]
            indices = sorted(cells["tensordesc_indices"])
        except (KeyError, TypeError, ValueError):
            return None
        meta = list(meta) if meta else [None] * len(indices)
        if len(meta) != len(indices) or any(i >= n_args for i in indices):
            return None  # a descriptor among the keyword arguments: not a shape this reads
        descriptors = tuple(zip(indices, meta))
    return fn, run.launch_cooperative_grid, run.launch_pdl, descriptors


def _expand(args: tuple, descriptors: tuple) -> list:
    """The arguments with each TMA descriptor replaced by what the C launcher takes for it
    (Triton's ``make_tensordesc_arg``: the encoded tensor map, then the shape and strides)."""
    out, start = [], 0
    for i, meta in descriptors:
        out.extend(args[start:i])
        out.extend(_make_tensordesc_arg(args[i], meta))
        start = i + 1
    out.extend(args[start:])
    return out


try:
    from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
except ImportError:  # no NVIDIA backend: no direct launches
    DIRECT_RELEASES = ()


def launch(kernel, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)`` for a ``triton.jit``/``gluon.jit`` kernel, ``grid`` a
    tuple of 1-3 ints; the keyword arguments (constexprs and launch options) come in the same
    order at every call site, as Python keeps them."""
    binding = _binding()
    if binding == "1":
        kernel[grid](*args, **kwargs)
        return
    try:
        key = (kernel, _current_device(), _args_key(args), tuple(kwargs.items()))
        hit = _COMPILED.get(key)
    except TypeError:  # an argument this module does not key on, or one not hashable
        kernel[grid](*args, **kwargs)
        return
    _run(kernel, grid, args, kwargs, key, hit, binding)


class PreparedLaunch:
    """``launch`` of one kernel whose trailing arguments and keyword arguments are fixed (a
    plan's sizes, strides, scales and constexprs): their part of the launch key is made once,
    and a call keys only its leading arguments (its tensors).

    ``PreparedLaunch(kernel, tail, kwargs)(grid, *lead)`` is ``launch(kernel, grid, *lead,
    *tail, **kwargs)``."""

    __slots__ = ("kernel", "tail", "kwargs", "_fixed")

    def __init__(self, kernel, tail: tuple, kwargs: dict[str, object]) -> None:
        self.kernel, self.tail, self.kwargs = kernel, tuple(tail), dict(kwargs)
        try:
            self._fixed = (_args_key(self.tail), tuple(self.kwargs.items()))
            hash(self._fixed)
        except TypeError:  # keyed per call by ``launch`` (or bound by Triton)
            self._fixed = None

    def __call__(self, grid: tuple[int, ...], *lead: object) -> None:
        binding = _binding()
        if binding == "1" or self._fixed is None:
            launch(self.kernel, grid, *lead, *self.tail, **self.kwargs)
            return
        args = (*lead, *self.tail)
        try:
            key = (self.kernel, _current_device(), _args_key(lead), self._fixed)
            hit = _COMPILED.get(key)
        except TypeError:
            self.kernel[grid](*args, **self.kwargs)
            return
        _run(self.kernel, grid, args, self.kwargs, key, hit, binding)


def _args_key(args: tuple) -> tuple:
    """The arguments' part of a launch key: ints and tensors inline (``_arg_key``'s keys without
    its call), anything else through ``_arg_key``; TypeError for an argument not keyed on."""
    return tuple([a if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) if type(a) is Tensor
                  else _arg_key(a) for a in args])  # fmt: skip


def _run(kernel, grid: tuple, args: tuple, kwargs: dict, key: tuple, hit: tuple | None, binding: str) -> None:
    """The launch of ``key``: compiled (and remembered) through ``kernel[grid]`` on a miss, else
    handed to the compiled kernel's launcher."""
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # compiled asynchronously
            compiled = compiled.result()
        if compiled is None:  # nothing to reuse (Triton returned no kernel)
            return
        names = _parameters(kernel)
        tail = tuple(kwargs[n] if n in kwargs else d for n, d in names[len(args) :])
        _COMPILED[key] = (compiled, tail, _direct_launcher(compiled, len(args)))
        if len(_COMPILED) > _MAX_KEYS:
            _COMPILED.popitem(last=False)
        return
    compiled, tail, direct = hit
    device = key[1]
    stream = _current_stream(device) if _current_stream else driver.active.get_current_stream(device)
    grid = (*grid, 1, 1)
    enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    hooked = enter is not None or leave is not None
    metadata = compiled.launch_metadata(grid, stream, *args, *tail) if hooked else None
    if direct is None or binding == "run":
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata,
            enter, leave, *args, *tail,
        )  # fmt: skip
        return
    fn, cooperative, pdl, descriptors = direct
    fn(
        grid[0], grid[1], grid[2], stream, compiled.function, cooperative, pdl, None, None,
        compiled.packed_metadata, metadata, enter, leave,
        *(_expand(args, descriptors) if descriptors else args), *tail,
    )  # fmt: skip


def _hook(hook: object) -> object:
    """A Triton launch hook, or None where nothing would run: Triton 3.6 keeps each as a chain
    (``knobs.HookChain``) that is never None, so every launch built its metadata and called two
    empty chains from C. A hook registered later is seen at the next launch."""
    calls = getattr(hook, "calls", None)
    return None if hook is None or (type(calls) is list and not calls) else hook


def compiled_launches() -> int:
    """How many distinct launch keys have been compiled or found (tests count them)."""
    return len(_COMPILED)
