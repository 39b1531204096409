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

A plan's steady state goes further still (``BoundLaunch``, ``launch_or_bind``): at a launch
key's second call its argument list is laid out once, and later calls only put their tensors'
addresses (and their TMA descriptors' encodings, kept by address) into it.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any

import torch
import triton
from triton import knobs
from triton.runtime import driver

from .configs import INTERPRET, environment_value

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


def _binding() -> str:
    """RINGFLASH_TRITON_BINDING: "0" (default) this module's launches, "1" Triton's binding,
    "run" this module's key but the compiled kernel's ``run`` (no direct C launches). Read at
    every launch (tests and benchmarks change it at run time)."""
    if INTERPRET:
        return "1"
    value = environment_value(_BINDING_VARIABLE)
    return "0" if value is None else value


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
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST as _TMA_HOST_TYPES
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


_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1


def classes_key(args: tuple) -> tuple:
    """``_args_key`` with each int by the class Triton specializes it on, as a small int: bit 0
    divisibility by 16, bit 1 == 1 (a constant), bits 2-3 its type (i32, i64 or u64 by range).
    Ints of one class share a compiled kernel. (Inline: a function call per int cost more
    than the rest of the key.)"""
    return tuple([
        (a & 15 == 0) + 2 * (a == 1) + 4 * (not _I32_MIN <= a <= _I32_MAX) + 4 * (a > _I64_MAX)
        if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) if type(a) is Tensor
        else None if a is None else _arg_key(a)
        for a in args
    ])  # fmt: skip


def _args_key(args: tuple) -> tuple:
    """The arguments' part of a launch key: ints and tensors inline (``_arg_key``'s keys without
    its call), anything else through ``_arg_key``; TypeError for an argument not keyed on."""
    return tuple([a if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) if type(a) is Tensor
                  else _arg_key(a) for a in args])  # fmt: skip


class PreparedLaunch:
    """``launch`` of one kernel whose trailing arguments and keyword arguments are fixed (a
    plan's sizes, strides, scales and constexprs): their part of the launch key is made once,
    and a call keys only its leading arguments (its tensors).

    ``PreparedLaunch(kernel, tail, kwargs)(grid, *lead)`` is ``launch(kernel, grid, *lead,
    *tail, **kwargs)``."""

    __slots__ = ("kernel", "tail", "kwargs", "_fixed")
    _lead_key = staticmethod(_args_key)  # the leading arguments' part of the launch key

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
            key = (self.kernel, _current_device(), self._lead_key(lead), self._fixed)
            hit = _COMPILED.get(key)
        except TypeError:
            self.kernel[grid](*args, **self.kwargs)
            return
        _run(self.kernel, grid, args, self.kwargs, key, hit, binding)


class SizedLaunch(PreparedLaunch):
    """A ``PreparedLaunch`` whose leading arguments also hold ints that change call by call
    (sizes and strides that follow a sequence's length): the launch key takes each such int by
    the class Triton specializes it on (== 1, divisible by 16, its integer type), not by its
    value, so that a new length reuses the compiled kernel of its class instead of compiling or
    binding anew. ``SizedLaunch(kernel, tail, kwargs)(grid, *lead)`` is still ``launch(kernel,
    grid, *lead, *tail, **kwargs)``."""

    __slots__ = ()
    _lead_key = staticmethod(classes_key)


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


def _hooked() -> bool:
    """Whether a Triton launch hook would run (a bound launch then steps aside for ``launch``)."""
    runtime = knobs.runtime
    return _hook(runtime.launch_enter_hook) is not None or _hook(runtime.launch_exit_hook) is not None


def compiled_launches() -> int:
    """How many distinct launch keys have been compiled or found (tests count them)."""
    return len(_COMPILED)


# What a plan stores under a launch's key after its first call: problems built per call (never
# seen twice) then pay no binding, and a layout's second call binds its launch.
SEEN_ONCE = "seen once"


class BoundLaunch:
    """One launch recorded with every argument laid out for the compiled kernel's C launcher
    (``DIRECT_RELEASES``), to repeat with new tensors in a few positions (its slots): a plan's
    steady-state launch. A call checks what the launch key would (the current device, each
    tensor's 16-byte alignment, and for a TMA descriptor an aligned base), encodes the slots'
    descriptors (kept by address: the same buffers recur call after call) and calls the C
    launcher with addresses for pointers (a tensor there costs a ``data_ptr`` call and a driver
    query per pointer); it returns False, launching nothing, where the caller must take the
    general path.

    ``BoundLaunch.record(kernel, grid, args, kwargs, slots)`` launches ``kernel[grid](*args,
    **kwargs)`` through ``launch`` and returns the binding, or None where it cannot bind (the
    interpreter, ``RINGFLASH_TRITON_BINDING``, other releases, launch hooks). ``slots``: objects
    among ``args`` (tensors, or TMA descriptors over a tensor), matched by identity wherever they
    occur; a call passes one tensor per slot (for a descriptor, a tensor of the recorded one's
    geometry, of which only the address is read). Every argument that may change between calls
    must be a slot (every descriptor is): the others are kept as recorded (a plan's sizes, its
    cu_seqlens and ALiBi slopes)."""

    __slots__ = ("_fn", "_template", "_tensor_slots", "_desc_slots", "_device", "_keep")

    @staticmethod
    def record(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, slots: tuple) -> BoundLaunch | None:
        launch(kernel, grid, *args, **kwargs)
        if _binding() != "0" or _hooked():
            return None
        try:
            device = _current_device()
            hit = _COMPILED.get((kernel, device, _args_key(args), tuple(kwargs.items())))
        except TypeError:
            return None
        if hit is None or hit[2] is None:
            return None
        compiled, tail, (fn, cooperative, pdl, descriptors) = hit
        bound = object.__new__(BoundLaunch)
        grid = (*grid, 1, 1)
        head = [grid[0], grid[1], grid[2], None, compiled.function, cooperative, pdl, None, None,
                compiled.packed_metadata, None, None, None]  # fmt: skip
        meta_at = dict(descriptors)
        slot_of = {id(o): j for j, o in reversed(tuple(enumerate(slots)))}  # the first slot of an object
        template, tensor_slots, desc_slots, keep = head, [], [], [compiled]  # its function handle is used
        for i, a in enumerate(args):
            slot = slot_of.get(id(a))
            if i in meta_at:
                encoder = _descriptor_encoder(a, meta_at[i])
                if encoder is None:
                    return None
                if slot is None:  # its address would be kept: every descriptor must be a slot
                    return None
                encode, geometry = encoder
                desc_slots.append((len(template), slot, encode))
                template.extend((None, *geometry))
                continue
            if slot is not None:
                if not isinstance(a, torch.Tensor):
                    return None
                tensor_slots.append((len(template), slot, a.data_ptr() % 16 == 0))
                a = None
            elif isinstance(a, torch.Tensor):  # kept alive by the binding, passed by address
                keep.append(a)
                a = a.data_ptr()
            template.append(a)
        template.extend(tail)
        bound._fn, bound._template, bound._device, bound._keep = fn, template, device, keep
        bound._tensor_slots, bound._desc_slots = tuple(tensor_slots), tuple(desc_slots)
        return bound

    def __call__(self, *values: torch.Tensor) -> bool:
        if _binding() != "0" or _current_device() != self._device or _hooked():
            return False
        args = self._template.copy()
        for at, slot, aligned in self._tensor_slots:
            ptr = values[slot].data_ptr()  # an address: the C launcher then asks the driver nothing
            if (ptr % 16 == 0) != aligned:
                return False
            args[at] = ptr
        for at, slot, encode in self._desc_slots:
            ptr = values[slot].data_ptr()
            if ptr % 16:
                return False
            args[at] = encode(ptr)
        device = self._device
        args[3] = _current_stream(device) if _current_stream else driver.active.get_current_stream(device)
        self._fn(*args)
        return True


# Encoded TMA descriptors per geometry by address: a training step's buffers recur at the same
# addresses step after step (PyTorch's caching allocator), so most calls encode nothing.
_MAX_ENCODED = 256


def _descriptor_encoder(desc: object, meta: dict | None) -> tuple | None:
    """(f(address) -> the tensor map of a descriptor of ``desc``'s geometry at that address,
    (*shape, *strides) after it): Triton's ``make_tensordesc_arg`` in two parts, or None for what
    this does not encode (host-side decomposition, fp4 padding)."""
    if not isinstance(meta, dict) or meta.get("fp4_padded") or list(desc.strides)[-1] != 1:
        return None
    fill = driver.active.utils.fill_tma_descriptor
    swizzle, elem_size, block = meta["swizzle"], meta["elem_size"], meta["block_size"]
    host_type = _TMA_HOST_TYPES[meta["elem_type"]]
    shape, strides, padding = list(desc.shape), list(desc.strides), 1 if desc.padding == "nan" else 0
    encoded: dict[int, object] = {}

    def encode(ptr: int) -> object:
        found = encoded.get(ptr)
        if found is None:
            if len(encoded) >= _MAX_ENCODED:
                encoded.clear()
            found = encoded[ptr] = fill(ptr, swizzle, elem_size, host_type, block, shape, strides, padding)
        return found

    return encode, (*shape, *strides)


def launch_or_bind(
    plans: dict, key: tuple, kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, slots: tuple
) -> None:
    """``launch(kernel, grid, *args, **kwargs)``, remembering in ``plans`` under ``key`` (which
    names everything the arguments depend on) that it ran: the second call of the key binds the
    launch (``BoundLaunch.record``), which later calls find with ``bound_launch``. Problems built
    per call, never seen twice, pay no binding."""
    state = plans.get(key)
    if state is SEEN_ONCE and _binding() == "0" and not _hooked():  # else bind at a later call
        plans[key] = BoundLaunch.record(kernel, grid, args, kwargs, slots) or False
        return
    if state is None:
        plans[key] = SEEN_ONCE
    launch(kernel, grid, *args, **kwargs)


def bound_launch(plans: dict, key: tuple) -> BoundLaunch | None:
    """The launch bound under ``key`` by ``launch_or_bind``, or None."""
    bound = plans.get(key)
    return bound if type(bound) is BoundLaunch else None
