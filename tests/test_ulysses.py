"""Ulysses and hybrid sequence parallelism against float64 full-sequence attention."""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from distributed import errors_of, worker_device
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err

import ringflash
from ringflash import ulysses as ulysses_engine
from ringflash.layouts import layout_indices


@dataclass(frozen=True)
class Case:
    world: int
    ulysses: int  # Ulysses group size U; ring size W / U
    causal: bool = True
    kv_heads: int = 4
    layout: str = "zigzag"
    heads: int = 4
    seqlen: int = 32
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    cu_seqlens: tuple[int, ...] | None = None  # packed documents (batch 1)


def _full(case: Case):
    g = torch.Generator().manual_seed(1)
    b = 2 if case.cu_seqlens is None else 1
    mk = lambda h: torch.randn(b, case.seqlen, h, case.head_dim, generator=g).to(case.dtype)  # noqa: E731
    return mk(case.heads), mk(case.kv_heads), mk(case.kv_heads), mk(case.heads)


def _run(case: Case):
    full = [t.to(worker_device()) for t in _full(case)]
    q, k, v, dout = (
        ringflash.shard_sequence(t, layout=case.layout, ulysses_size=case.ulysses, cu_seqlens=case.cu_seqlens)
        for t in full
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mode = {1: "ring", case.world: "ulysses"}.get(case.ulysses, "hybrid")
    out, lse = ringflash.sp_attn_func(
        q,
        k,
        v,
        causal=case.causal,
        layout=case.layout,
        sp_mode=mode,
        ulysses_size=case.ulysses,
        return_lse=True,
        cu_seqlens=case.cu_seqlens,
    )
    out.backward(dout)
    return tuple(t.detach().cpu() for t in (out, lse, q.grad, k.grad, v.grad))


def check_sp(rank_pool, case: Case, names=("out", "lse", "dq", "dk", "dv")) -> None:
    results = rank_pool(case.world).run(_run, case)
    q, k, v, dout = (t.double().requires_grad_() for t in _full(case))
    if case.cu_seqlens is None:
        ref_out, ref_lse = reference_attention(q, k, v, causal=case.causal)
    else:
        ref_out, ref_lse = reference_attention_packed(q, k, v, case.cu_seqlens, causal=case.causal)
    ref_out.backward(dout)
    expected = dict(zip(("out", "lse", "dq", "dk", "dv"), (ref_out, ref_lse, q.grad, k.grad, v.grad)))
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        if name not in names:
            continue
        exp = expected[name]
        dim = 2 if name == "lse" else 1
        got = torch.empty(exp.shape, dtype=results[0][i].dtype)
        for r, res in enumerate(results):
            idx = layout_indices(case.layout, r, case.world, case.seqlen, case.ulysses, case.cu_seqlens)
            got.index_copy_(dim, idx, res[i])
        err = rel_err(got, exp)
        assert err < TOLERANCE[case.dtype], f"{case}: {name} rel err {err:.2e}"


# sp_mode="ring" (U=1) hands the call to ring_attention unchanged; tests/test_ring.py covers the
# ring itself (every layout, causal or not, GQA, packed, 1-4 ranks), so U=1 runs once per test
# here, as the dispatch check, and the Ulysses and hybrid modes take every combination.
MODES = [(u, causal, kv) for u in (4, 2) for causal in (False, True) for kv in (4, 2, 1)] + [(1, True, 1)]


@pytest.mark.parametrize(("ulysses", "causal", "kv_heads"), MODES)
def test_ulysses_and_hybrid_match_full_attention(rank_pool, ulysses, causal, kv_heads):
    check_sp(rank_pool, Case(4, ulysses, causal, kv_heads))


@pytest.mark.parametrize(("ulysses", "layout"), [(4, "zigzag"), (4, "stripe"), (2, "zigzag"), (2, "stripe"),
                                                 (1, "zigzag")])  # fmt: skip
def test_packed_documents_in_every_mode(rank_pool, ulysses, layout):
    """Documents of 8, 24 and 16 tokens over 4 ranks as ring (U=1), hybrid 2x2 and Ulysses 4x1."""
    check_sp(rank_pool, Case(4, ulysses, True, 2, layout, seqlen=48, cu_seqlens=(0, 8, 32, 48)))


def _all_to_alls(ulysses: int, return_lse: bool):
    """(all-to-alls in the forward, out, dq) of one call on 4 ranks."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 8, 4, 16, generator=g).to(worker_device()).requires_grad_() for _ in range(3))
    real, shapes = ulysses_engine.all_to_all_async, []
    counting = lambda out, x, group, u: shapes.append(x.shape) or real(out, x, group, u)  # noqa: E731
    mode = "ulysses" if ulysses == 4 else "hybrid"
    with mock.patch.object(ulysses_engine, "all_to_all_async", side_effect=counting):
        res = ringflash.sp_attn_func(
            q, k, v, causal=True, sp_mode=mode, ulysses_size=ulysses, return_lse=return_lse
        )
    out = res[0] if return_lse else res
    out.sum().backward()
    return len(shapes), out.detach().cpu(), q.grad.cpu()


@pytest.mark.parametrize("ulysses", [4, 2])
def test_lse_crosses_back_only_when_returned(rank_pool, ulysses):
    """The LSE's all-to-all runs only for a caller that asks for the LSE (or passes sinks, which
    are applied to it); the results do not change."""
    without = rank_pool(4).run(_all_to_alls, ulysses, False)
    with_lse = rank_pool(4).run(_all_to_alls, ulysses, True)
    for (n0, out0, dq0), (n1, out1, dq1) in zip(without, with_lse):
        assert (n0, n1) == (2, 3)  # q/k/v there and out back; the LSE back
        assert torch.equal(out0, out1) and torch.equal(dq0, dq1)


def _bad_calls():
    q = torch.randn(1, 8, 3, 16, device=worker_device())
    kv = torch.randn(1, 8, 3, 16, device=worker_device())
    q4 = torch.randn(1, 8, 4, 16, device=worker_device())
    return errors_of(
        {
            "heads": lambda: ringflash.sp_attn_func(q, kv, kv, sp_mode="ulysses"),
            "mode": lambda: ringflash.sp_attn_func(q, kv, kv, sp_mode="star"),
            "size": lambda: ringflash.sp_attn_func(q, kv, kv, sp_mode="hybrid", ulysses_size=3),
            "missing": lambda: ringflash.sp_attn_func(q, kv, kv, sp_mode="hybrid"),
            # a ulysses_size that contradicts sp_mode (shards cut for another U) is not ignored
            "ring_size": lambda: ringflash.sp_attn_func(q4, q4, q4, sp_mode="ring", ulysses_size=2),
            "ulysses_size": lambda: ringflash.sp_attn_func(q4, q4, q4, sp_mode="ulysses", ulysses_size=1),
            "v_shape": lambda: ringflash.sp_attn_func(q4, q4, q4[..., :8], sp_mode="ulysses"),
            "k_length": lambda: ringflash.sp_attn_func(q4, q4[:, :4], q4[:, :4], sp_mode="ulysses"),
            "head_dim": lambda: ringflash.sp_attn_func(q4, q4[..., :8], q4[..., :8], sp_mode="ulysses"),
        }
    )


def test_sp_attn_bad_inputs(rank_pool):
    errors = rank_pool(2).run(_bad_calls)[0]
    assert "q heads (3) divisible by the Ulysses group size (2)" in errors["heads"]
    assert "sp_mode must be one of" in errors["mode"]
    assert "ulysses_size 3 must divide" in errors["size"]
    assert "needs ulysses_size" in errors["missing"]
    assert 'ulysses_size=2 contradicts sp_mode="ring"' in errors["ring_size"]
    assert 'ulysses_size=1 contradicts sp_mode="ulysses"' in errors["ulysses_size"]
    for name in ("v_shape", "k_length"):
        assert "same batch and local length, and k and v of one shape" in errors[name], errors[name]
    assert "head_dim" in errors["head_dim"], errors["head_dim"]


def test_hybrid_layout_indices_cover_sequence():
    for layout in ringflash.LAYOUTS:
        for u in (1, 2, 4):
            idx = torch.cat([layout_indices(layout, r, 4, 32, u) for r in range(4)])
            assert torch.equal(idx.sort().values, torch.arange(32)), (layout, u)
    with pytest.raises(ValueError, match="multiple of 8"):
        layout_indices("zigzag", 0, 4, 6, 4)  # one ring shard of 6 tokens over 4 Ulysses ranks


@pytest.mark.multigpu
@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_ulysses_bf16_real_size_on_gpus(rank_pool, kv_heads):
    case = Case(2, 2, True, kv_heads, heads=8, seqlen=4096, head_dim=128, dtype=torch.bfloat16)
    check_sp(rank_pool, case, names=("out", "dq", "dk", "dv"))


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_hybrid_bf16_real_size_on_four_gpus(rank_pool, kv_heads, layout):
    """The 2x2 hybrid (Ulysses pairs, a ring of two across) on the GPUs' kernels and NCCL: two
    K/V heads leave one per Ulysses rank. Skips with fewer than 4 GPUs."""
    case = Case(4, 2, True, kv_heads, layout, heads=8, seqlen=4096, head_dim=128, dtype=torch.bfloat16)
    check_sp(rank_pool, case)
