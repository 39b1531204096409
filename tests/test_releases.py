"""Which releases ringflash runs on (kernels/releases.py): a release pair the interpreter cannot
run is refused at import with the fix named, and pyproject.toml never caps torch, Triton or
numpy, so installing ringflash cannot replace a newer stack. (Which Triton releases run the
Hopper kernels: tests/test_hopper_release.py.)"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from ringflash.kernels.releases import interpreter_problem, release

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_release_parses_local_and_dev_versions():
    assert release("2.15.0+cu130") == (2, 15)
    assert release("3.9.0") == (3, 9)
    assert release("2.4.0rc1") == (2, 4)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        release("nightly")


@pytest.mark.parametrize(
    ("triton", "numpy", "refused"),
    [
        ("3.6.0", "2.3.5", False),
        ("3.6.0", "2.4.0", True),
        ("3.6.0", "2.4.6", True),
        ("3.7.1", "2.4.6", False),
        ("3.8.0", "2.4.6", False),
        ("3.9.0", "2.4.6", False),
        ("3.9.0", "1.26.4", False),
    ],
)
def test_interpreter_problem(triton, numpy, refused):
    problem = interpreter_problem(triton, numpy)
    assert (problem is not None) == refused
    if refused:
        assert "numpy<2.4" in problem and f"Triton {triton}" in problem


def test_import_refuses_triton_36_with_numpy_24_under_the_interpreter():
    """The refusal happens at import, before any kernel (which would fail deep inside Triton)."""
    script = (
        "import numpy, triton\n"
        "numpy.__version__, triton.__version__ = '2.4.1', '3.6.0'\n"
        "try:\n"
        "    import ringflash\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    expected = "refused: TRITON_INTERPRET=1 with Triton 3.6.0 needs numpy < 2.4"
    assert run.stdout.startswith(expected), run.stdout


def test_pyproject_never_caps_torch_triton_or_numpy():
    """Lower bounds only: pip never downgrades a user's newer stack to install ringflash (the
    CI checks the same on a real install: `.ci/run`'s README install from PyPI must leave the newest)."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    specs = dict(re.findall(r'"([a-z]+)([^"]*)"', deps))
    assert set(specs) == {"torch", "triton", "numpy"}
    assert specs["torch"] == ">=2.11" and specs["triton"] == ">=3.6", specs
    assert all("<" not in spec and "==" not in spec for spec in specs.values()), specs
