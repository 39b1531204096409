"""The torch, Triton and numpy releases ringflash runs on, and what it refuses on which.

pyproject.toml gives lower bounds only (torch >= 2.11, Triton >= 3.6): installing ringflash
never replaces a newer torch, Triton or numpy that is already there. What a combination of
releases cannot do is refused here, at import, with an error that names the fix; what a
release has not been validated on falls back to kernels that have been
(``hopper.dispatch.gluon_validated``).

Tested (README, "Supported versions"): torch 2.11 through 2.15 and Triton 3.6 through 3.9.
"""

from __future__ import annotations

import re


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"2.15.0+cu130"`` or ``"3.9.0"``.

    Raises:
        ValueError: ``version`` does not start with two dot-separated integers.
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"version must start with MAJOR.MINOR, got {version!r}")
    return int(match.group(1)), int(match.group(2))


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter (``TRITON_INTERPRET=1``) cannot run ringflash's kernels with
    these releases, or None where it can.

    Triton 3.6's interpreter turns a scalar tensor into a Python int with ``int()`` of a
    one-element array, which numpy 2.4 made a TypeError: every kernel with a loop fails deep
    inside Triton ("only 0-dimensional arrays can be converted to Python scalars"). Triton 3.7
    and newer work with numpy 2.4 (3.7.1, 3.8.0 and 3.9.0 checked).
    """
    if release(triton_version) < (3, 7) and release(numpy_version) >= (2, 4):
        return (
            f"TRITON_INTERPRET=1 with Triton {triton_version} needs numpy < 2.4 (numpy "
            f"{numpy_version} is installed): Triton 3.6's interpreter converts one-element arrays "
            "to Python ints, which numpy 2.4 refuses. Install 'numpy<2.4', or Triton >= 3.7 "
            "(the interpreter runs on the CPU; a GPU needs neither)."
        )
    return None


def check_interpreter() -> None:
    """Raise ImportError where ``interpreter_problem`` finds the installed releases cannot run
    the kernels under the interpreter; call only when ``TRITON_INTERPRET=1``."""
    import numpy
    import triton

    problem = interpreter_problem(triton.__version__, numpy.__version__)
    if problem is not None:
        raise ImportError(problem)
