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
"""

from __future__ import annotations

import dataclasses


def configure() -> None:
    """The suite's settings for a process that runs kernels under the interpreter: the
    helper-call shortcut installed, overflow checks skipped (conftest turns them on for the
    tests marked ``overflow_checks``)."""
    skip_repeated_language_patching()
    set_overflow_checks(False)


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
