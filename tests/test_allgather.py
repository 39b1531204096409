"""sp_mode="allgather" against float64 attention over the full sequence on 2-4 gloo ranks: every
layout, masks, GQA with several head strides, batch > 1, packed documents, softcap/ALiBi/sinks;
out, LSE, dq/dk/dv and d sinks. And the plan's pieces on their own."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from distributed import errors_of, worker_device
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err

import ringflash
from ringflash import sp_functions
from ringflash.allgather import check_heads_k_stride, default_heads_k_stride, natural_order
from ringflash.layouts import layout_indices


@dataclass(frozen=True)
class Case:
    world: int
    layout: str
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    seqlen: int = 16
    batch: int = 1
    heads: int = 4
    kv_heads: int = 2
    heads_k_stride: int | None = None
    cu_seqlens: tuple[int, ...] | None = None
    features: bool = False  # softcap + ALiBi + sinks
    head_dim: int = 16
    dtype: torch.dtype = torch.float32


def _inputs(case: Case):
    g = torch.Generator().manual_seed(7)
    mk = lambda h, s=1.0: s * torch.randn(case.batch, case.seqlen, h, case.head_dim, generator=g)  # noqa: E731
    q, k, v, dout = mk(case.heads, 2.0), mk(case.kv_heads, 2.0), mk(case.kv_heads), mk(case.heads)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(case.heads)])
    sinks = torch.randn(case.heads, generator=g) + 2.0
    return q, k, v, dout, slopes, sinks


def _options(case: Case, slopes, sinks) -> dict:
    if not case.features:
        return {}
    return dict(softcap=1.0, alibi_slopes=slopes, sinks=sinks)


def _run(case: Case):
    q, k, v, dout, slopes, sinks = (t.to(worker_device()) for t in _inputs(case))
    shard = lambda t: ringflash.shard_sequence(t, layout=case.layout, cu_seqlens=case.cu_seqlens)  # noqa: E731
    q, k, v, dout = (shard(t).to(case.dtype) for t in (q, k, v, dout))
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    out, lse = ringflash.sp_attn_func(
        q, k, v, causal=case.causal, window_size=case.window, layout=case.layout, sp_mode="allgather",
        heads_k_stride=case.heads_k_stride, cu_seqlens=case.cu_seqlens, return_lse=True,
        **_options(case, slopes, sinks),
    )  # fmt: skip
    out.backward(dout)
    dsinks = None if sinks.grad is None else sinks.grad.cpu()
    return out.detach().float().cpu(), lse.detach().cpu(), *(t.grad.float().cpu() for t in (q, k, v)), dsinks


def check(rank_pool, case: Case) -> None:
    results = rank_pool(case.world).run(_run, case)
    q, k, v, dout, slopes, sinks = _inputs(case)
    q, k, v, dout = (t.to(case.dtype).double() for t in (q, k, v, dout))  # the inputs the ranks saw
    q, k, v, sinks = (t.double().requires_grad_() for t in (q, k, v, sinks))
    opts = dict(causal=case.causal, window_size=case.window, **_options(case, slopes.double(), sinks))
    if case.cu_seqlens is None:
        ref_out, ref_lse = reference_attention(q, k, v, **opts)
    else:
        ref_out, ref_lse = reference_attention_packed(q, k, v, list(case.cu_seqlens), **opts)
    ref_out.backward(dout.double())
    expected = (ref_out, ref_lse, q.grad, k.grad, v.grad)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        got = torch.empty(expected[i].shape, dtype=results[0][i].dtype)
        for r, res in enumerate(results):
            idx = layout_indices(case.layout, r, case.world, case.seqlen, cu_seqlens=case.cu_seqlens)
            got.index_copy_(2 if name == "lse" else 1, idx, res[i])
        assert not got.isnan().any(), f"{case}: {name} has NaN"
        err = rel_err(got, expected[i])
        assert err < TOLERANCE[case.dtype], f"{case}: {name} rel err {err:.2e}"
    if case.features:
        err = rel_err(sum(res[5] for res in results), sinks.grad)
        assert err < TOLERANCE[torch.float32], f"{case}: dsinks rel err {err:.2e}"


CASES = {
    "contiguous-causal-2strides": Case(2, "contiguous", heads_k_stride=1),
    "zigzag-causal": Case(2, "zigzag"),
    "stripe-window": Case(2, "stripe", window=(3, 0)),
    "contiguous-full-batch2-window": Case(2, "contiguous", causal=False, window=(2, 5), batch=2),
    "zigzag-mqa-4ranks": Case(4, "zigzag", kv_heads=1, seqlen=32),
    "packed-zigzag": Case(2, "zigzag", seqlen=24, cu_seqlens=(0, 8, 12, 24)),
    "packed-contiguous-full": Case(2, "contiguous", causal=False, seqlen=20, cu_seqlens=(0, 6, 20)),
    "packed-stripe-features": Case(2, "stripe", seqlen=24, cu_seqlens=(0, 10, 24), features=True),
    "zigzag-features-2strides": Case(2, "zigzag", heads_k_stride=1, features=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_allgather_matches_float64(rank_pool, name):
    check(rank_pool, CASES[name])


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "case",
    [
        Case(2, "zigzag", seqlen=4096, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16),
        Case(
            2,
            "zigzag",
            seqlen=4096,
            heads=8,
            kv_heads=2,
            head_dim=128,
            dtype=torch.bfloat16,
            heads_k_stride=1,
            cu_seqlens=(0, 1024, 3072, 3584, 4096),
        ),  # fmt: skip
        Case(
            2,
            "contiguous",
            causal=False,
            seqlen=4096,
            heads=8,
            kv_heads=2,
            head_dim=128,
            dtype=torch.bfloat16,
            batch=2,
        ),  # fmt: skip
    ],
    ids=["zigzag", "packed-2strides", "contiguous-full-batch2"],
)
def test_allgather_bf16_real_size_on_gpus(rank_pool, case):
    """The sizes and dtype where the Hopper kernels run, on NCCL: the benchmark's path, checked."""
    check(rank_pool, case)


def test_window_that_sees_no_earlier_shard(rank_pool):
    """A window of 1 on contiguous shards: each segment's keys end inside its own shard, and the
    calls are cut to the keys within reach."""
    check(rank_pool, Case(2, "contiguous", window=(1, 0), heads=2, kv_heads=1))


def test_natural_order():
    """The gathered shards, reordered, are the sequence in token order, for every layout."""
    for layout in ("contiguous", "zigzag", "stripe"):
        for cu in (None, [0, 8, 24]):
            held = torch.cat([layout_indices(layout, r, 2, 24, cu_seqlens=cu) for r in range(2)])
            order = natural_order(layout, 2, 24, None if cu is None else tuple(cu), "cpu")
            assert torch.equal(held if order is None else held[order], torch.arange(24)), (layout, cu)


def test_heads_k_stride():
    assert [default_heads_k_stride(h) for h in (1, 2, 8)] == [1, 2, 8]
    with pytest.raises(ValueError, match="heads_k_stride must be a positive divisor of the k/v heads"):
        check_heads_k_stride(3, 8)
    with pytest.raises(TypeError, match="heads_k_stride must be an int"):
        check_heads_k_stride(2.0, 8)


def _bad_stride_on_rank_1():
    rank = torch.distributed.get_rank()
    q = torch.randn(1, 8, 2, 16, device=worker_device())
    ringflash.sp_attn_func(q, q, q, causal=True, sp_mode="allgather", heads_k_stride=1 + rank)


def test_one_rank_wrong_raises_everywhere(rank_pool):
    """A heads_k_stride wrong on one rank only: every rank raises instead of one waiting in a gather."""
    errors = rank_pool(2).run(errors_of, {"call": _bad_stride_on_rank_1})
    assert all(e["call"] and "ValueError" in e["call"] for e in errors), errors


def test_heads_k_stride_only_with_allgather():
    with pytest.raises(ValueError, match='heads_k_stride=2 is for sp_mode="allgather"'):
        ringflash.sp_attn_func(*[torch.zeros(1, 4, 2, 16)] * 3, sp_mode="ring", heads_k_stride=2)


def _auto_against_pinned(max_local: int, batch: int):
    """On a rank: sp_mode="auto" (given, and as the default) with AUTO_ALLGATHER_MAX_LOCAL =
    max_local against the mode it picked, pinned, bit for bit (same engine), on shards of batch x
    8 tokens; returns the mode auto picked."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(batch, 8, h, 16, generator=g).to(worker_device()) for h in (4, 2, 2))
    with _auto_bound(max_local):
        picked = sp_functions.auto_sp_mode(q, None)
        auto = ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="auto", return_lse=True)
        default = ringflash.sp_attn_func(q, k, v, causal=True, return_lse=True)
    pinned = ringflash.sp_attn_func(q, k, v, causal=True, sp_mode=picked, return_lse=True)
    assert all(torch.equal(a, p) and torch.equal(d, p) for a, d, p in zip(auto, default, pinned))
    return picked


@contextmanager
def _auto_bound(max_local: int):
    """AUTO_ALLGATHER_MAX_LOCAL set for a block (a rank's process serves later tests too)."""
    saved = sp_functions.AUTO_ALLGATHER_MAX_LOCAL
    sp_functions.AUTO_ALLGATHER_MAX_LOCAL = max_local
    try:
        yield
    finally:
        sp_functions.AUTO_ALLGATHER_MAX_LOCAL = saved


# The bound counts batch x local_seqlen tokens: 2 x 8 is over 12.
@pytest.mark.parametrize(
    "max_local, batch, mode", [(8192, 1, "allgather"), (4, 1, "ring"), (12, 2, "ring"), (16, 2, "allgather")]
)
def test_auto_runs_allgather_for_short_shards_else_the_ring(rank_pool, max_local, batch, mode):
    assert rank_pool(2).run(_auto_against_pinned, max_local, batch) == [mode, mode]


def test_auto_sp_mode_bounds():
    from ringflash.sp_functions import AUTO_ALLGATHER_MAX_LOCAL, AUTO_ALLGATHER_MAX_TOTAL, auto_sp_mode

    assert AUTO_ALLGATHER_MAX_TOTAL >= AUTO_ALLGATHER_MAX_LOCAL
    assert auto_sp_mode(torch.zeros(1, AUTO_ALLGATHER_MAX_LOCAL, 1, 8), None) == "ring"  # no process group
    assert auto_sp_mode("not a tensor", None) == "ring"  # the ring's checks name what is wrong
    with pytest.raises(ValueError, match="ulysses_size=2 contradicts"):
        ringflash.sp_attn_func(*[torch.zeros(1, 4, 2, 16)] * 3, sp_mode="auto", ulysses_size=2)


def _auto_with_lengths_that_differ():
    """Rank 0's shard is under the bound, rank 1's over it: they pick different engines."""
    n = 8 if torch.distributed.get_rank() == 0 else 12
    q = torch.randn(1, n, 2, 16, device=worker_device())
    with _auto_bound(10):
        ringflash.sp_attn_func(q, q, q, causal=True, sp_mode="auto")


def test_auto_with_shards_that_differ_raises_everywhere(rank_pool):
    """One rank in the all-gather engine, the other in the ring's: both rank checks still meet, so
    both raise instead of one waiting in a gather."""
    errors = rank_pool(2).run(errors_of, {"call": _auto_with_lengths_that_differ})
    assert all(e["call"] and "ValueError" in e["call"] for e in errors), errors
