"""The Hopper Gluon kernels run only under the Triton releases whose builds have run on a GPU;
any other release falls back to the Triton kernels instead of failing, unless the run that
validates it asks for them (kernels/hopper/dispatch.py)."""

from __future__ import annotations

import pytest
import triton

from ringflash.kernels.hopper import dispatch


@pytest.fixture
def fresh_gate():
    dispatch.hopper_module.cache_clear()
    yield
    dispatch.hopper_module.cache_clear()


@pytest.mark.skipif(not dispatch.gluon_validated(), reason="a Triton release not validated on a GPU")
def test_the_gluon_release_imports_the_hopper_modules(fresh_gate):
    for name in ("tma", "scores", "query_tiles", "named_barriers", "forward", "backward", "dq"):
        assert dispatch.hopper_module(name) is not None, name
    # The forward's key tiles are given per build of the programs over query tiles.
    assert tuple(dispatch.hopper_module("forward").BLOCK_N) == dispatch.hopper_module("query_tiles").HEAD_DIMS


def test_another_triton_release_turns_the_hopper_path_off(fresh_gate, monkeypatch):
    monkeypatch.delenv(dispatch.GLUON_UNVALIDATED_VARIABLE, raising=False)
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    for name in ("tma", "forward", "backward"):
        assert dispatch.hopper_module(name) is None, name


def test_validated_releases(monkeypatch):
    monkeypatch.delenv(dispatch.GLUON_UNVALIDATED_VARIABLE, raising=False)
    assert dispatch.gluon_validated("3.6.0")
    assert not dispatch.gluon_validated("3.9.0") and not dispatch.gluon_validated("3.8.0")
    monkeypatch.setenv(dispatch.GLUON_UNVALIDATED_VARIABLE, "1")  # the GPU run that validates one
    assert dispatch.gluon_validated("3.9.0")
