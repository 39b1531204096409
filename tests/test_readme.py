"""The README's examples that a reader copies whole run as written: each block marked
``<!-- readme-test: NAME -->`` is executed here, on CPU ranks over gloo."""

from __future__ import annotations

import contextlib
import io
import math
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_block(name: str) -> str:
    """The ```python block right after ``<!-- readme-test: name -->`` in README.md."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- readme-test: {name} -->\n```python\n(.*?)```", text, re.S)
    assert match is not None, f"README.md has no python block marked readme-test: {name}"
    return match.group(1)


def _run_deepspeed_example(code: str) -> str:
    import importlib

    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # as torchrun sets it
    # DeepSpeed JIT-compiles a shared-memory all-reduce on the CPU (about a minute on 2 cores)
    # that only its inference path uses (tests/test_deepspeed.py does the same).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    printed, cwd = io.StringIO(), os.getcwd()
    os.chdir(ROOT)  # the example names its config relative to the repository
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md (DeepSpeed example)", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)  # the pool's ranks run other tests after this one
    return printed.getvalue()


def test_deepspeed_example_trains_a_step(rank_pool):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    printed = rank_pool(2).run(_run_deepspeed_example, readme_block("deepspeed"))
    losses = []
    for rank, text in enumerate(printed):
        match = re.search(rf"rank {rank}: loss (\S+)", text)
        assert match is not None, text
        losses.append(float(match.group(1)))
    # One sequence over both ranks: the same global loss, near ln(vocab) at initialization.
    assert losses[0] == losses[1] and abs(losses[0] - math.log(512)) < 0.5, losses
