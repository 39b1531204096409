"""ringflash/setup_cache.py through the ring: a call signature seen before builds no setup, the
results stay exact, and ranks whose caches differ still all raise on disagreeing calls (the check
runs on every call, cached or not)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from distributed import errors_of, worker_device

import ringflash
from ringflash import ring
from ringflash.setup_cache import SetupCache


def _qkv(seqlen: int, seed: int = 0, heads: int = 2, head_dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seqlen, heads, head_dim, generator=g).to(worker_device()) for _ in range(3)]


def _builds_and_results():
    shape = dict(heads=3, head_dim=24)  # a signature no other test of the pool's ranks uses
    first = ringflash.ring_flash_attn_func(*_qkv(8, **shape), causal=True)
    built = ring.SETUPS.builds
    fresh = [ringflash.ring_flash_attn_func(*_qkv(8, seed, **shape), causal=True) for seed in (1, 0)]
    same_shapes = ring.SETUPS.builds - built
    ringflash.ring_flash_attn_func(*_qkv(8, **shape), causal=False)  # another option
    ringflash.ring_flash_attn_func(*(t[:, :4] for t in _qkv(8, **shape)), causal=True)  # another length
    return same_shapes, ring.SETUPS.builds - built, torch.equal(first, fresh[1]), torch.equal(first, fresh[0])


def test_same_signature_builds_one_setup(rank_pool):
    for same_shapes, total, repeat_equal, other_equal in rank_pool(2).run(_builds_and_results):
        assert same_shapes == 0 and total == 2
        assert repeat_equal and not other_equal


def _ulysses_op_builds():
    """Problems built by a second and third Ulysses fwd+bwd of one signature through its custom
    op (the path torch.compile takes): its whole-sequence problem comes from kernels/plans.py's
    cache, as the eager path's does, so its launches get bound too."""
    from ringflash import sp_functions
    from ringflash import ulysses as ops
    from ringflash.kernels.plans import problem_builds

    shape = dict(heads=4, head_dim=24)  # a signature no other test of the pool's ranks uses
    built, direct = [], [0]  # problems from the cache's builds, and built outside it
    build, use_ops = ops.build_problem, sp_functions.use_ops
    ops.build_problem = lambda *a, **kw: direct.__setitem__(0, direct[0] + 1) or build(*a, **kw)
    sp_functions.use_ops = lambda x, op_takes_it=True: True
    try:
        for seed in range(3):
            q, k, v = (t.requires_grad_() for t in _qkv(8, seed, **shape))
            ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="ulysses").sum().backward()
            built.append(problem_builds() + direct[0])
    finally:
        ops.build_problem, sp_functions.use_ops = build, use_ops
    return built[2] - built[0]


def test_ulysses_op_builds_its_problem_once(rank_pool):
    assert rank_pool(2).run(_ulysses_op_builds) == [0, 0]


def _ulysses_builds():
    """Setups built by repeated eager Ulysses calls (fwd+bwd) of one signature, then of another
    option, and whether a repeat on other values computes anew."""
    from ringflash import ulysses

    shape = dict(heads=4, head_dim=40)  # a signature no other test of the pool's ranks uses
    outs, builds = [], []
    for seed, causal in ((0, True), (1, True), (0, True), (0, False)):
        q, k, v = (t.requires_grad_() for t in _qkv(8, seed, **shape))
        out = ringflash.sp_attn_func(q, k, v, causal=causal, sp_mode="ulysses")
        out.sum().backward()
        outs.append(out.detach())
        builds.append(ulysses.SETUPS.builds)
    return [b - builds[0] for b in builds], torch.equal(outs[0], outs[2]), torch.equal(outs[0], outs[1])


def test_ulysses_same_signature_builds_one_setup(rank_pool):
    for builds, repeat_equal, other_equal in rank_pool(2).run(_ulysses_builds):
        assert builds == [0, 0, 0, 1]
        assert repeat_equal and not other_equal


def _caches_differ():
    """Both ranks cache signatures A and B; then rank 0 calls A while rank 1 calls B, both
    found in their caches: a cache that skipped the check would hang here."""
    first = dist.get_rank() == 0
    a, b, c = _qkv(8), _qkv(12), _qkv(16)
    call = lambda qkv: lambda: ringflash.ring_flash_attn_func(*qkv, causal=True)  # noqa: E731
    return errors_of({
        "A": call(a),
        "B": call(b),
        "A on rank 0, B on the others": call(a if first else b),
        "cached on rank 0 only": call(a if first else c),
        "A again": call(a),
    })  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_different_caches_all_raise(rank_pool, world):
    for errors in rank_pool(world).run(_caches_differ, timeout=120):
        assert errors["A"] is None and errors["B"] is None and errors["A again"] is None
        for name in ("A on rank 0, B on the others", "cached on rank 0 only"):
            assert "called with different arguments" in errors[name], errors[name]
            assert "q: rank 0: ('tensor', (1, 8, 2, 16)" in errors[name]


def _memoized_checks():
    """A cached setup's calls take the check's digest from its memo (no signature built); what
    the memo is keyed by (gradients flowing, sinks) still makes disagreeing ranks raise, in the
    ring, the all-gather mode and Ulysses, after both ranks cached the setup."""
    from unittest import mock

    from ringflash import consistency

    rank, device = dist.get_rank(), worker_device()
    shape = dict(heads=2, head_dim=40)  # a signature no other test of the pool's ranks uses
    q, k, v = _qkv(8, **shape)
    built = []
    real = consistency.call_signature
    counting = lambda *a, **kw: built.append(1) or real(*a, **kw)  # noqa: E731
    ring_call = lambda **kw: ringflash.ring_flash_attn_func(q, k, v, causal=True, **kw)  # noqa: E731
    gather_call = lambda **kw: ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="allgather", **kw)  # noqa: E731
    ulysses_call = lambda **kw: ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="ulysses", **kw)  # noqa: E731
    grads = [t.detach().requires_grad_(rank == 0) for t in (q, k, v)]
    sinks = torch.zeros(2, device=device) if rank == 0 else None
    signatures = {}
    with mock.patch.object(consistency, "call_signature", counting):
        for name, call in (("ring", ring_call), ("allgather", gather_call), ("ulysses", ulysses_call)):
            for _ in range(2):  # the setup, then its memo
                call()
            built.clear()
            call()
            signatures[name] = len(built)
        errors = errors_of({
            "grad on rank 0 only": lambda: ringflash.ring_flash_attn_func(*grads, causal=True),
            "sinks on rank 0 only": lambda: ring_call(sinks=sinks),
            "allgather sinks on rank 0 only": lambda: gather_call(sinks=sinks),
            "ulysses sinks on rank 0 only": lambda: ulysses_call(sinks=sinks),
            "ring again": ring_call,
        })  # fmt: skip
    return signatures, errors


def test_cached_calls_check_their_memoized_digest(rank_pool):
    for signatures, errors in rank_pool(2).run(_memoized_checks, timeout=120):
        assert signatures == {"ring": 0, "allgather": 0, "ulysses": 0}
        assert "grad: rank 0: True, rank 1: False" in errors["grad on rank 0 only"]
        for name in ("sinks on rank 0 only", "allgather sinks on rank 0 only",
                     "ulysses sinks on rank 0 only"):  # fmt: skip
            assert "sinks: rank 0: ('tensor', (2,), 'float32'), rank 1: None" in errors[name], errors[name]
        assert errors["ring again"] is None


def test_cache_holds_the_group_weakly():
    """A cached setup must not keep a process group alive past destroy_process_group (its
    destruction at interpreter exit aborted a gloo rank), nor serve a new group at a reused id."""

    class Group:  # stands in for a ProcessGroup: weakly referenceable
        pass

    cache = SetupCache()
    group = Group()
    alive = weakref.ref(group)
    q = torch.zeros(1, 4, 1, 8)
    key = cache.key(q, q, q, group, causal=True)
    cache.put(key, "setup", group)
    assert cache.get(key, group) == "setup"
    del group
    gc.collect()
    assert alive() is None
    assert cache.get(key, Group()) is None
