"""ring-flash-attn's llama3 forms: packed documents of lengths not divisible by anything, cut into
contiguous shards, on 2 and 4 gloo ranks against float64 attention per document (out, LSE,
dq/dk/dv); the packed forms against the plain one; ``prepare`` against hand-worked values."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from distributed import errors_of, worker_device
from reference import TOLERANCE, reference_attention_packed, rel_err

import ringflash


@dataclass(frozen=True)
class Case:
    world: int
    cu_seqlens: tuple[int, ...]
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    heads: int = 4
    kv_heads: int = 2
    heads_k_stride: int = 1
    form: str = "plain"  # "plain", "qkvpacked" or "kvpacked"
    sinks: bool = False


def _inputs(case: Case):
    g = torch.Generator().manual_seed(3)
    total = case.cu_seqlens[-1]
    mk = lambda h, s=1.0: s * torch.randn(total, h, 16, generator=g)  # noqa: E731
    q, k, v, dout = mk(case.heads, 2.0), mk(case.kv_heads, 2.0), mk(case.kv_heads), mk(case.heads)
    if case.form == "qkvpacked":  # one set of heads for all three
        k, v = mk(case.heads, 2.0), mk(case.heads)
    sinks = torch.randn(case.heads, generator=g) + 2.0
    return q, k, v, dout, sinks


def _run(case: Case):
    rank = torch.distributed.get_rank()
    q, k, v, dout, sinks = (t.to(worker_device()) for t in _inputs(case))
    n = q.shape[0] // case.world
    q, k, v, dout = (t[rank * n : (rank + 1) * n] for t in (q, k, v, dout))
    cu = torch.tensor(case.cu_seqlens, dtype=torch.int32, device=worker_device())
    params = ringflash.llama3_flash_attn_prepare_cu_seqlens(cu, case.causal, rank, case.world)
    extras = dict(sinks=sinks.requires_grad_()) if case.sinks else {}
    opts = dict(causal=case.causal, window_size=case.window, return_attn_probs=True, **extras)
    if case.form == "qkvpacked":
        qkv = torch.stack([q, k, v], dim=1).requires_grad_()
        fn = ringflash.llama3_flash_attn_varlen_qkvpacked_func
        out, lse, none = fn(qkv, *params[:4], case.heads_k_stride, params[4], **opts)
        leaves = qkv
    elif case.form == "kvpacked":
        q, kv = q.requires_grad_(), torch.stack([k, v], dim=1).requires_grad_()
        fn = ringflash.llama3_flash_attn_varlen_kvpacked_func
        out, lse, none = fn(q, kv, *params[:4], case.heads_k_stride, params[4], **opts)
        leaves = (q, kv)
    else:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        # Positional, as code written for ring-flash-attn calls it.
        out, lse, none = ringflash.llama3_flash_attn_varlen_func(
            q, k, v, *params[:4], case.heads_k_stride, params[4], 0.0, None, case.causal, case.window, None,
            False, True, **extras,
        )  # fmt: skip
        leaves = (q, k, v)
    assert none is None
    out.backward(dout)
    if case.form == "qkvpacked":
        grads = tuple(leaves.grad.unbind(1))
    elif case.form == "kvpacked":
        grads = (leaves[0].grad, *leaves[1].grad.unbind(1))
    else:
        grads = tuple(t.grad for t in leaves)
    dsinks = sinks.grad.cpu() if case.sinks else None
    return out.detach().cpu(), lse.detach().cpu(), *(g.cpu() for g in grads), dsinks


def check(rank_pool, case: Case) -> None:
    results = rank_pool(case.world).run(_run, case)
    q, k, v, dout, sinks = _inputs(case)
    q, k, v, sinks = (t.double()[None].requires_grad_() for t in (q, k, v, sinks))
    extras = dict(sinks=sinks[0]) if case.sinks else {}
    ref_out, ref_lse = reference_attention_packed(q, k, v, list(case.cu_seqlens), causal=case.causal,
                                                  window_size=case.window, **extras)  # fmt: skip
    ref_out.backward(dout.double()[None])
    expected = (ref_out[0], ref_lse[0], q.grad[0], k.grad[0], v.grad[0])
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        got = torch.cat([res[i] for res in results], dim=1 if name == "lse" else 0)
        assert not got.isnan().any(), f"{case}: {name} has NaN"
        err = rel_err(got, expected[i])
        assert err < TOLERANCE[torch.float32], f"{case}: {name} rel err {err:.2e}"
    if case.sinks:
        err = rel_err(sum(res[5] for res in results), sinks.grad[0])
        assert err < TOLERANCE[torch.float32], f"{case}: dsinks rel err {err:.2e}"


# Documents crossing shards, one shorter than a shard, one spanning several (lengths 5, 14, 3, 10).
UNEVEN = (0, 5, 19, 22, 32)
CASES = {
    "causal-2": Case(2, UNEVEN),
    "full-2": Case(2, UNEVEN, causal=False, heads_k_stride=2),
    "causal-window-4": Case(4, UNEVEN, window=(3, 0)),
    "one-document-4-mqa": Case(4, (0, 32), kv_heads=1),
    "qkvpacked-2": Case(2, UNEVEN, form="qkvpacked", heads=2, kv_heads=2),
    "kvpacked-sinks-2": Case(2, UNEVEN, form="kvpacked", sinks=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_llama3_matches_float64(rank_pool, name):
    check(rank_pool, CASES[name])


def test_prepare_cu_seqlens():
    """Hand-worked: documents [0, 7), [7, 14), [14, 16) over 8 ranks of 2 tokens, causal."""
    cu = torch.tensor([0, 7, 14, 16], dtype=torch.int32)
    got = [ringflash.llama3_flash_attn_prepare_cu_seqlens(cu, True, r, 8) for r in range(8)]
    # rank 3 holds tokens 6, 7: the end of document 0 (keys 0..6) and the start of document 1.
    cu_q, cu_k, max_q, max_k, ks = got[3]
    assert cu_q.tolist() == [0, 1, 2] and cu_k.tolist() == [0, 7, 8] and (max_q, max_k) == (1, 7)
    assert ks == slice(0, 8)
    # rank 6: tokens 12, 13, the end of document 1 (keys from 7).
    assert got[6][1].tolist() == [0, 7] and got[6][4] == slice(7, 14)
    assert all(g[0].dtype == torch.int32 for g in got)
    # Not causal: keys run to the end of each document.
    cu_q, cu_k, _, max_k, ks = ringflash.llama3_flash_attn_prepare_cu_seqlens(cu, False, 3, 8)
    assert cu_k.tolist() == [0, 7, 14] and ks == slice(0, 14) and max_k == 7


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([0, 5, 9], True, 0, 2), ValueError, "multiple of world_size 2"),
        (([0, 6, 4, 8], True, 0, 2), ValueError, "never decrease"),
        (([0, 8], True, 2, 2), ValueError, "0 <= rank < world_size"),
        (([0, 8], 1, 0, 2), TypeError, "causal must be a bool"),
        ((torch.tensor([0.0, 8.0]), True, 0, 2), TypeError, "cu_seqlens must be a 1-D int32/int64"),
    ],
)
def test_prepare_refuses(args, error, match):
    with pytest.raises(error, match=match):
        ringflash.llama3_flash_attn_prepare_cu_seqlens(*args)


def _calls():
    rank = torch.distributed.get_rank()
    dev = worker_device()
    x = torch.randn(8, 2, 16, device=dev)
    params = ringflash.llama3_flash_attn_prepare_cu_seqlens([0, 16], True, rank, 2)
    params = (params[0].to(dev), params[1].to(dev), *params[2:])
    call = (
        lambda **kw: ringflash.llama3_flash_attn_varlen_func(  # noqa: E731
            *kw.pop("qkv", (x, x, x)),
            *params[:4],
            kw.pop("stride", 1),
            kw.pop("ks", params[4]),
            causal=True,
            **kw,
        )
    )
    qkv_bad = torch.randn(8, 2 + rank, 2, 16, device=dev)  # wrong on rank 1 only
    return {
        "stride": lambda: call(stride=3),
        "slice": lambda: call(ks=slice(0, 40)),
        "dropout": lambda: call(dropout_p=0.1),
        "stride_one_rank": lambda: call(stride=1 + rank),
        "qkv_one_rank": lambda: ringflash.llama3_flash_attn_varlen_qkvpacked_func(
            qkv_bad, *params[:4], 1, params[4], causal=True
        ),
    }


def _errors():
    return errors_of(_calls())


def test_bad_arguments_raise_on_every_rank(rank_pool):
    errors = rank_pool(2).run(_errors)
    for e in errors:
        assert "heads_k_stride must be a positive divisor" in e["stride"]
        assert "local_k_slice must lie in the gathered sequence" in e["slice"]
        assert "dropout" in e["dropout"]
        assert e["stride_one_rank"] and "ValueError" in e["stride_one_rank"]
        assert e["qkv_one_rank"] and "ValueError" in e["qkv_one_rank"]


def _compiled_vs_eager():
    """llama3 and sp_mode="allgather" under torch.compile (ring-flash-attn's compile pass:
    capture_scalar_outputs), in one graph (the all-gather ops): the same out and gradients as eager."""
    rank, dev = torch.distributed.get_rank(), worker_device()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(32, 2, 16, generator=g).to(dev) for _ in range(3))
    local = [t[rank * 16 : (rank + 1) * 16] for t in (q, k, v)]
    params = ringflash.llama3_flash_attn_prepare_cu_seqlens([0, 5, 19, 32], True, rank, 2)
    params = (params[0].to(dev), params[1].to(dev), *params[2:])
    llama3 = (
        lambda q, k, v: ringflash.llama3_flash_attn_varlen_func(  # noqa: E731
            q, k, v, *params[:4], 1, params[4], causal=True
        )
    )
    allgather = lambda q, k, v: ringflash.sp_attn_func(  # noqa: E731
        q[None], k[None], v[None], causal=True, layout="contiguous", sp_mode="allgather"
    )[0]
    diffs = []
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for fn in (llama3, allgather):
            results = []
            for f in (fn, torch.compile(fn, fullgraph=True)):
                leaves = [t.clone().requires_grad_() for t in local]
                out = f(*leaves)
                out.square().sum().backward()
                results.append([out.detach(), *(t.grad for t in leaves)])
            diffs.append(max((a - b).abs().max().item() for a, b in zip(*results)))
    torch._dynamo.reset()
    return diffs


def test_compiled_equals_eager(rank_pool):
    for diffs in rank_pool(2).run(_compiled_vs_eager):
        assert diffs == [0.0, 0.0], diffs
