"""Triton's interpreter in the CPU suite: no repeated patching, overflow checks where they matter.

Under TRITON_INTERPRET=1 a kernel launch replaces the builtins of ``triton.language`` (and
``tl.math``, ``tl.tensor``) with numpy-backed ones, and undoes it when the launch ends. Triton
3.6 also redoes the replacement on every call of a ``@triton.jit`` helper inside a kernel
(``InterpretedFunction.__call__``), walking those modules with ``inspect.getmembers`` each time:
about 1.3 ms per call, which the kernels' per-tile helpers make thousands of per launch (a quarter
of a kernel-heavy test's time). The repeat changes nothing while the launch's replacement is in
place, so ``skip_repeated_language_patching`` makes ``_patch_lang`` return at once for a
function whose language modules are all replaced already. Launches, and anything not already
patched, go through Triton's own code. Applied in this process (conftest) and in every gloo
rank (distributed.py); a Triton without these internals is left as it is.

The interpreter also prepares an int32 overflow check for every integer +, - and * (the
operands cast to int64, the result compared with int32's bounds: eight more numpy ops each, 40%
of a rank's kernel time in the distributed tests) and then drops it: ``device_assert`` does
nothing unless the options' ``debug`` is set, which the interpreter's never are in this Triton.
``set_overflow_checks`` makes the checks live (``debug`` on: an overflow raises) for the kernel
tests, marked ``overflow_checks``, whose positions, strides and windows reach the kernels'
int32 limits, and skips their preparation everywhere else: the other tests' kernels get the
same problems on small positions (the ring's steps are ordinary ``build_problem`` calls).

The interpreter runs a kernel on the tensors' own memory through raw addresses, so a store past a
tensor would silently corrupt the process's heap (and crash later, elsewhere).
``check_store_bounds`` makes every store and atomic check its addresses against the launch's
tensor arguments and raise instead.
"""

from __future__ import annotations

import dataclasses


def configure() -> None:
    """The suite's settings for a process that runs kernels under the interpreter: the
    helper-call shortcut installed, overflow checks skipped (conftest turns them on for the
    tests marked ``overflow_checks``), stores checked against the launch's tensors."""
    skip_repeated_language_patching()
    set_overflow_checks(False)
    check_store_bounds()


# The byte ranges [start, end) of the storages of the running launch's tensor arguments.
_LAUNCH_RANGES: list[tuple[int, int]] = []


def check_store_bounds() -> bool:
    """Make every store and atomic of an interpreted kernel check its addresses (where its mask
    is set) against the storages of the launch's tensor arguments, raising IndexError outside
    them. The interpreter writes through raw addresses into the tensors' own memory: a store
    past a tensor would corrupt the process's heap silently, to crash later elsewhere; on a GPU it
    would be an illegal access or a silent overwrite. True where this Triton's interpreter has
    the internals it wraps."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    init = getattr(executor, "_init_args_hst", None)
    store = getattr(builder, "create_masked_store", None)
    rmw = getattr(builder, "create_atomic_rmw", None)
    if init is None or store is None or rmw is None:
        return False
    if getattr(init, "records_ranges", False):
        return True

    def storages(arg, found):
        if isinstance(arg, tuple):
            for a in arg:
                storages(a, found)
        elif hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a TensorDescriptor
            storages(arg.base, found)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            found.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        found: list[tuple[int, int]] = []
        for arg in (*args_hst, *kwargs_hst.values()):
            storages(arg, found)
        _LAUNCH_RANGES[:] = found
        return args_hst, kwargs_hst

    def check(ptrs, value, mask) -> None:
        addresses = ptrs.data
        if mask is not None:
            addresses = addresses[np.broadcast_to(mask.data, addresses.shape)]
        if addresses.size == 0:
            return
        size = value.data.dtype.itemsize
        first, last = int(addresses.min()), int(addresses.max()) + size
        if any(lo <= first and last <= hi for lo, hi in _LAUNCH_RANGES):
            return  # all in one tensor: the common case, two reductions
        addresses = addresses.astype(np.uint64).ravel()
        end = addresses + np.uint64(size)
        inside = np.zeros(addresses.shape, dtype=bool)
        for lo, hi in _LAUNCH_RANGES:
            inside |= (addresses >= lo) & (end <= hi)
        if not inside.all():
            bad = int(addresses[~inside][0])
            raise IndexError(
                f"an interpreted kernel stores {int((~inside).sum())} element(s) outside its tensor "
                f"arguments (first at {bad:#x}; the arguments' storages: "
                f"{', '.join(f'[{lo:#x}, {hi:#x})' for lo, hi in _LAUNCH_RANGES)})"
            )

    def masked_store(self, ptrs, value, mask, *rest):
        check(ptrs, value, mask)
        return store(self, ptrs, value, mask, *rest)

    def atomic_rmw(self, op, ptr, val, mask, *rest):
        check(ptr, val, mask)
        return rmw(self, op, ptr, val, mask, *rest)

    init_args.records_ranges = True
    executor._init_args_hst = init_args
    builder.create_masked_store = masked_store
    builder.create_atomic_rmw = atomic_rmw
    return True


def skip_repeated_language_patching() -> bool:
    """Install the shortcut; True where it was installed (Triton's interpreter has the
    ``_patch_lang`` / ``_LangPatchScope`` internals it wraps)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or getattr(original, "skips_repeats", False):
        return original is not None and scope_type is not None

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        # ``arange`` stands for all the builtins: one ``_patch_lang`` call replaces every one of
        # them, and the launch's restore undoes them all.
        if langs and all(not tl.core.is_builtin(getattr(lang, "arange", None)) for lang in langs):
            return scope_type()  # nothing replaced here, so the caller's restore() has nothing to undo
        return original(fn)

    patch_lang.skips_repeats = True
    interpreter._patch_lang = patch_lang
    return True


def set_overflow_checks(live: bool) -> bool:
    """Make the interpreter's int32 overflow checks live (``debug`` on, an overflowing integer
    +, - or * raises) or skip them (neither prepared nor asserted); True where this Triton's
    interpreter has the options to do it."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not {"debug", "sanitize_overflow"} <= vars(options).keys():
        return False
    builder.options = dataclasses.replace(options, debug=live, sanitize_overflow=live)
    return True
