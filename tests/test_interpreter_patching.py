"""The CPU suite's interpreter settings (interpreter_patching.py): the helper-call shortcut is
installed on the pinned Triton, a kernel calling jit helpers computes the same with it and
leaves triton.language as it found it; overflow checks are skipped in unmarked tests and raise
in tests marked ``overflow_checks``; a store or atomic outside the launch's tensors raises."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _offsets(start, BLOCK: tl.constexpr):
    return start + tl.arange(0, BLOCK)


@triton.jit
def _helper_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = _offsets(tl.program_id(0) * BLOCK, BLOCK)  # helpers called in a loop too
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(3):
        acc += _scaled(tl.load(X + offs, mask=offs < n, other=0.0), i + 1)
    tl.store(Y + offs, acc, mask=offs < n)


def test_shortcuts_installed_and_exact():
    from interpreter_patching import skip_repeated_language_patching

    assert skip_repeated_language_patching()  # conftest installed it; a second call keeps it
    from triton.runtime import interpreter

    assert interpreter._patch_lang.skips_repeats
    x = torch.randn(37)
    y = torch.empty_like(x)
    _helper_kernel[(3,)](x, y, 37, BLOCK=16)
    torch.testing.assert_close(y, x * 6.0)
    assert tl.core.is_builtin(tl.arange), "the launch left triton.language patched"


@triton.jit
def _add_kernel(X, Y, c):
    tl.store(Y, tl.load(X) + c)


def _overflowing_add() -> int:
    x = torch.tensor([5], dtype=torch.int32)
    y = torch.empty_like(x)
    _add_kernel[(1,)](x, y, 2147483647)
    return y.item()


def test_overflow_checks_skipped_where_unmarked():
    """Unmarked tests skip the checks, which could not fire there anyway (``debug`` off: an
    int32 add wraps either way)."""
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert not options.sanitize_overflow and not options.debug
    assert _overflowing_add() == 5 + 2147483647 - 2**32


@pytest.mark.overflow_checks
def test_overflow_checks_live_where_marked():
    with pytest.raises(Exception, match="int32 overflow detected for operation add"):
        _overflowing_add()
    x = torch.randn(37)  # and an ordinary kernel runs as before
    y = torch.empty_like(x)
    _helper_kernel[(3,)](x, y, 37, BLOCK=16)
    torch.testing.assert_close(y, x * 6.0)


@triton.jit
def _store_kernel(Y, n, BLOCK: tl.constexpr, ATOMIC: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if ATOMIC:
        tl.atomic_add(Y + offs, 1.0, mask=offs < n)
    else:
        tl.store(Y + offs, 1.0, mask=offs < n)


@pytest.mark.parametrize("atomic", [False, True])
def test_stores_outside_the_arguments_raise(atomic):
    from interpreter_patching import check_store_bounds

    assert check_store_bounds()  # conftest installed it; a second call keeps it
    buffer = torch.zeros(24)
    y = buffer[4:20]  # a view: its storage's whole range is the argument's
    _store_kernel[(1,)](y, 20, BLOCK=32, ATOMIC=atomic)  # past the view, inside its storage
    assert buffer[4:].eq(1).all() and buffer[:4].eq(0).all()
    with pytest.raises(Exception, match="outside its tensor arguments"):
        _store_kernel[(1,)](y, 21, BLOCK=32, ATOMIC=atomic)  # one element past the storage
