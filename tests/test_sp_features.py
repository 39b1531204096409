"""softcap, ALiBi and attention sinks under ring (every layout), Ulysses and hybrid sequence
parallelism against float64 attention over the full sequence: out, LSE, dq/dk/dv and d sinks.

Magnitudes are chosen so that each feature changes the answer: scaled scores of standard
deviation ~2 against a softcap of 1, ALiBi slopes that move scores by several units across
the sequence, sink logits near the rows' LSE."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from distributed import worker_device
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err

import ringflash
from ringflash.layouts import layout_indices


@dataclass(frozen=True)
class Case:
    world: int
    ulysses: int  # 1: ring; world: Ulysses; otherwise hybrid
    layout: str
    feature: str  # "softcap", "alibi", "sinks" or "all"
    causal: bool = True
    seqlen: int = 16
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 16
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def sp_mode(self) -> str:
        return {1: "ring", self.world: "ulysses"}.get(self.ulysses, "hybrid")

    def options(self, slopes: torch.Tensor, sinks: torch.Tensor) -> dict:
        on = lambda f: self.feature in (f, "all")  # noqa: E731
        return dict(
            softcap=1.0 if on("softcap") else 0.0,
            alibi_slopes=slopes if on("alibi") else None,
            sinks=sinks if on("sinks") else None,
        )


def _inputs(case: Case):
    g = torch.Generator().manual_seed(11)
    b = 1
    mk = lambda h, s=1.0: s * torch.randn(b, case.seqlen, h, case.head_dim, generator=g)  # noqa: E731
    q, k, v, dout = mk(case.heads, 2.0), mk(case.kv_heads, 2.0), mk(case.kv_heads), mk(case.heads)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(case.heads)])
    sinks = torch.randn(case.heads, generator=g) + 2.0
    return q, k, v, dout, slopes, sinks


def _run(case: Case):
    q, k, v, dout, slopes, sinks = (t.to(worker_device()) for t in _inputs(case))
    shard = lambda t: ringflash.shard_sequence(  # noqa: E731
        t, layout=case.layout, ulysses_size=case.ulysses, cu_seqlens=case.cu_seqlens
    )
    q, k, v, dout = (shard(t) for t in (q, k, v, dout))
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    out, lse = ringflash.sp_attn_func(
        q, k, v, causal=case.causal, layout=case.layout, sp_mode=case.sp_mode, ulysses_size=case.ulysses,
        cu_seqlens=case.cu_seqlens, return_lse=True, **case.options(slopes, sinks),
    )  # fmt: skip
    out.backward(dout)
    grads = tuple(t.grad.cpu() for t in (q, k, v))
    dsinks = None if sinks.grad is None else sinks.grad.cpu()
    return out.detach().cpu(), lse.detach().cpu(), *grads, dsinks


def check_features(rank_pool, case: Case) -> None:
    results = rank_pool(case.world).run(_run, case)
    q, k, v, dout, slopes, sinks = _inputs(case)
    q, k, v, sinks = (t.double().requires_grad_() for t in (q, k, v, sinks))
    opts = case.options(slopes, sinks)
    if case.cu_seqlens is None:
        ref_out, ref_lse = reference_attention(q, k, v, causal=case.causal, **opts)
    else:
        cu = list(case.cu_seqlens)
        ref_out, ref_lse = reference_attention_packed(q, k, v, cu, causal=case.causal, **opts)
    ref_out.backward(dout.double())
    expected = (ref_out, ref_lse, q.grad, k.grad, v.grad)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 2 if name == "lse" else 1
        got = torch.empty(expected[i].shape, dtype=results[0][i].dtype)
        for r, res in enumerate(results):
            idx = layout_indices(case.layout, r, case.world, case.seqlen, case.ulysses, case.cu_seqlens)
            got.index_copy_(dim, idx, res[i])
        err = rel_err(got, expected[i])
        assert err < TOLERANCE[torch.float32], f"{case}: {name} rel err {err:.2e}"
    if opts["sinks"] is not None:
        # Each rank holds its rows' part of d sinks; reduce_gradients would sum them.
        got = sum(res[5] for res in results)
        err = rel_err(got, sinks.grad)
        assert err < TOLERANCE[torch.float32], f"{case}: dsinks rel err {err:.2e}"
    else:
        assert all(res[5] is None for res in results)


FEATURES = ["softcap", "alibi", "sinks"]


@pytest.mark.parametrize("feature", FEATURES)
def test_ring_features(rank_pool, feature):
    check_features(rank_pool, Case(2, 1, "contiguous", feature))


@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
def test_ring_all_features(rank_pool, layout):
    """softcap + ALiBi + sinks together; a feature dropped by a layout's schedule fails this."""
    check_features(rank_pool, Case(2, 1, layout, "all"))


def test_ulysses_all_features(rank_pool):
    check_features(rank_pool, Case(2, 2, "contiguous", "all", causal=False))


def test_hybrid_all_features(rank_pool):
    """2 Ulysses x 2 ring ranks, softcap + ALiBi + sinks together, zigzag."""
    check_features(rank_pool, Case(4, 2, "zigzag", "all"))


def test_ring_packed_all_features(rank_pool):
    """Packed documents: ALiBi positions restart in each document; sinks join every row."""
    check_features(rank_pool, Case(2, 1, "zigzag", "all", seqlen=24, cu_seqlens=(0, 8, 24)))


def test_features_change_the_answer():
    """The magnitudes above make each feature matter: dropping it moves the float64 answer far
    beyond the tolerance (so the tests above would fail if a feature were dropped)."""
    for feature in FEATURES:
        case = Case(1, 1, "contiguous", feature)
        q, k, v, _, slopes, sinks = (t.double() for t in _inputs(case))
        with_it = reference_attention(q, k, v, causal=True, **case.options(slopes, sinks))[0]
        without = reference_attention(q, k, v, causal=True)[0]
        assert rel_err(without, with_it) > 100 * TOLERANCE[torch.float32], feature


BOUNDARY_SINKS = (float("-inf"), -1e4)  # their terms are exactly 0: each row's denominator is its keys' 1


def _run_boundary_sinks(case: Case):
    """``_run`` with ``BOUNDARY_SINKS`` and the loss reading the LSE as well as out."""
    q, k, v, dout, _, _ = (t.to(worker_device()) for t in _inputs(case))
    shard = lambda t: ringflash.shard_sequence(t, layout=case.layout, ulysses_size=case.ulysses)  # noqa: E731
    q, k, v, dout = (shard(t) for t in (q, k, v, dout))
    dlse = dout[..., 0].transpose(1, 2).contiguous()  # (batch, heads, local seqlen): random, as dout
    sinks = torch.tensor(BOUNDARY_SINKS, device=worker_device())
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    out, lse = ringflash.sp_attn_func(
        q, k, v, causal=True, layout=case.layout, sp_mode=case.sp_mode, ulysses_size=case.ulysses,
        sinks=sinks, return_lse=True,
    )  # fmt: skip
    torch.autograd.backward((out, lse), (dout, dlse))
    return out.detach().cpu(), lse.detach().cpu(), *(t.grad.cpu() for t in (q, k, v, sinks))


@pytest.mark.parametrize(("ulysses", "layout"), [(1, "zigzag"), (2, "contiguous")], ids=["ring", "ulysses"])
def test_sinks_on_the_merge_boundary(rank_pool, ulysses, layout):
    """Sinks of -inf and -1e4 leave every row's merged denominator exactly at its keys' 1: the
    boundary where an operator's gradient depends on the torch release (clamp_min passed none
    there from torch 2.15). With the loss reading the LSE, dq/dk/dv must still equal float64's,
    the LSE must be the one without sinks, and dsinks 0."""
    case = Case(2, ulysses, layout, "sinks")
    results = rank_pool(2).run(_run_boundary_sinks, case)
    q, k, v, dout, _, _ = _inputs(case)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    sinks = torch.tensor(BOUNDARY_SINKS, dtype=torch.float64, requires_grad=True)
    dlse = dout[..., 0].transpose(1, 2).double()
    ref_out, ref_lse = reference_attention(q, k, v, causal=True, sinks=sinks)
    torch.autograd.backward((ref_out, ref_lse), (dout.double(), dlse))
    expected = (ref_out, ref_lse, q.grad, k.grad, v.grad)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 2 if name == "lse" else 1
        got = torch.empty(expected[i].shape, dtype=results[0][i].dtype)
        for r, res in enumerate(results):
            got.index_copy_(dim, layout_indices(layout, r, 2, case.seqlen, ulysses), res[i])
        err = rel_err(got, expected[i])
        assert err < TOLERANCE[torch.float32], f"{case}: {name} rel err {err:.2e}"
    assert torch.equal(sum(res[5] for res in results), torch.zeros(2))
