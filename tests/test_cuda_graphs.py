"""Steady-state calls make no host synchronization, and a forward + backward captured in a CUDA
graph replays to the results of eager calls: single device (``gpu``; also through
``torch.compile(mode="reduce-overhead")``) and the zigzag ring, Ulysses and the all-gather mode
over NCCL (``multigpu``). GPU only: CUDA graphs and the sync debug mode need a device."""

from __future__ import annotations

import pytest
import torch
from distributed import worker_device
from reference import rel_err

import ringflash
from ringflash.kernels import cu_seqlens_tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(shape, kv_heads, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    b, s, h, d = shape
    q = torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(b, s, kv_heads, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    return q, k, v, torch.randn_like(q)


def _step(f, q, k, v, dout):
    out = f(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, dq, dk, dv


def _captured_matches_eager(f, shape, kv_heads, dtype, device):
    """Capture f's forward + backward on static inputs, replay on new values copied in, compare
    with eager calls on the same values."""
    static = [t.requires_grad_(i < 3) for i, t in enumerate(_inputs(shape, kv_heads, dtype, device, 0))]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for _ in range(2):
            _step(f, *static)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(f, *static)
    errors = []
    for seed in (1, 2):
        fresh = _inputs(shape, kv_heads, dtype, device, seed)
        with torch.no_grad():
            for s, t in zip(static, fresh):
                s.copy_(t)
        graph.replay()
        eager = _step(f, *(t.clone().requires_grad_(i < 3) for i, t in enumerate(fresh)))
        errors.append([rel_err(c, e) for c, e in zip(captured, eager)])
    return errors


def _no_syncs(f, shape, kv_heads, dtype, device):
    q, k, v, dout = _inputs(shape, kv_heads, dtype, device, 0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _step(f, q, k, v, dout)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            _step(f, q, k, v, dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _dense(q, k, v):
    return ringflash.flash_attn_func(q, k, v, causal=True)


_CU = {}


def _varlen(q, k, v):
    """Three packed documents; the cu_seqlens tensor made once, as a batch's is for every layer."""
    b, s = q.shape[:2]
    if s not in _CU:
        _CU[s] = cu_seqlens_tensor([0, s // 4, s // 2 + 8, b * s], q.device)
    cu = _CU[s]
    flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
    return ringflash.flash_attn_varlen_func(*flat, cu, cu, s, s, causal=True).view(q.shape)


CASES = {
    "dense-bf16": (_dense, (2, 512, 8, 128), 2, torch.bfloat16),
    "dense-fp32": (_dense, (1, 256, 4, 64), 4, torch.float32),
    "varlen-bf16": (_varlen, (1, 1024, 8, 128), 2, torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_steady_state_calls_do_not_sync(name):
    f, shape, kv_heads, dtype = CASES[name]
    _no_syncs(f, shape, kv_heads, dtype, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_captured_step_replays_like_eager(name):
    f, shape, kv_heads, dtype = CASES[name]
    for out, dq, dk, dv in _captured_matches_eager(f, shape, kv_heads, dtype, torch.device("cuda")):
        assert out == 0 and dk == 0 and dv == 0, (out, dk, dv)
        assert dq < 1e-3  # the Hopper backward adds dQ tiles in a varying order


@pytest.mark.gpu
def test_reduce_overhead_compile_replays_like_eager():
    """``torch.compile(mode="reduce-overhead")`` (CUDA graphs through Inductor's cudagraph trees)
    of a forward + backward through ``flash_attn_func``: each call on new inputs equals eager."""
    compiled = torch.compile(_dense, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # the first calls record, the later ones replay
        q, k, v, dout = _inputs((2, 512, 8, 128), 2, torch.bfloat16, torch.device("cuda"), seed)
        torch.compiler.cudagraph_mark_step_begin()
        got = [t.clone() for t in _step(compiled, *(t.clone().requires_grad_() for t in (q, k, v)), dout)]
        want = _step(_dense, *(t.clone().requires_grad_() for t in (q, k, v)), dout)
        errors = [rel_err(g, w) for g, w in zip(got, want)]
        assert max(errors[0], errors[2], errors[3]) == 0 and errors[1] < 1e-3, (seed, errors)


def _ring(q, k, v):
    return ringflash.zigzag_ring_flash_attn_func(q, k, v, causal=True)


def _ulysses(q, k, v):
    return ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="ulysses")


def _allgather(q, k, v):
    return ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="allgather")


SP_CASES = {"zigzag-ring": _ring, "ulysses": _ulysses, "allgather": _allgather}


def _sp_on_rank(name):
    device = worker_device()
    shape = (1, 1024, 8, 128)
    _no_syncs(SP_CASES[name], shape, 2, torch.bfloat16, device)
    return _captured_matches_eager(SP_CASES[name], shape, 2, torch.bfloat16, device)


@pytest.mark.multigpu
@pytest.mark.parametrize("name", sorted(SP_CASES))
def test_sequence_parallel_captured_on_gpus_replays_like_eager(rank_pool, name):
    for errors in rank_pool(2).run(_sp_on_rank, name):
        for out, dq, dk, dv in errors:
            assert out == 0 and max(dq, dk, dv) < 1e-3, (name, out, dq, dk, dv)
