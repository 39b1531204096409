"""The ring entry points are ring-flash-attn's: names, positional order, defaults, shard layouts,
varlen cu_seqlens meaning and return conventions; ringflash's extras are keyword-only."""

from __future__ import annotations

import inspect

import pytest
import torch
from distributed import errors_of, worker_device
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err

import ringflash


def required(*names: str) -> list[tuple[str, None]]:
    return [(n, None) for n in names]


# ring-flash-attn's positional parameters and defaults (ring_flash_attn/*.py, adapters/hf_adapter.py)
# for every name its __init__ exports, and for ringflash's own fronts of the same signature.
OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False),
           ("group", None)]  # fmt: skip
QKV, Q_KV, Q_K_V = required("qkv"), required("q", "kv"), required("q", "k", "v")
VARLEN_ARGS = required("cu_seqlens", "max_seqlen")
LLAMA3_ARGS = required(
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "heads_k_stride", "local_k_slice"
)
DENSE, VARLEN = Q_K_V + OPTIONS, Q_K_V + VARLEN_ARGS + OPTIONS
EXTRAS = {"softcap", "sinks", "return_lse", "cu_seqlens", "layout", "block_mask"}
RING_ENTRY_POINTS = {
    "ring_flash_attn_func": DENSE,
    "zigzag_ring_flash_attn_func": DENSE,
    "stripe_flash_attn_func": DENSE,
    "ring_flash_attn_varlen_func": VARLEN,
    "zigzag_ring_flash_attn_varlen_func": VARLEN,
    "stripe_flash_attn_varlen_func": VARLEN,
    "ring_flash_attn_qkvpacked_func": QKV + OPTIONS,
    "ring_flash_attn_kvpacked_func": Q_KV + OPTIONS,
    "zigzag_ring_flash_attn_qkvpacked_func": QKV + OPTIONS,
    "zigzag_ring_flash_attn_kvpacked_func": Q_KV + OPTIONS,
    "stripe_flash_attn_qkvpacked_func": QKV + OPTIONS,
    "stripe_flash_attn_kvpacked_func": Q_KV + OPTIONS,
    "ring_flash_attn_varlen_qkvpacked_func": QKV + VARLEN_ARGS + OPTIONS,
    "ring_flash_attn_varlen_kvpacked_func": Q_KV + VARLEN_ARGS + OPTIONS,
    "zigzag_ring_flash_attn_varlen_qkvpacked_func": QKV + VARLEN_ARGS + OPTIONS,
    "zigzag_ring_flash_attn_varlen_kvpacked_func": Q_KV + VARLEN_ARGS + OPTIONS,
    "sp_attn_func": DENSE,
    "ulysses_attn_func": DENSE,
}
RINGFLASH_ONLY = {"stripe_flash_attn_varlen_func", "sp_attn_func", "ulysses_attn_func"}
LLAMA3_ENTRY_POINTS = {
    "llama3_flash_attn_varlen_func": Q_K_V + LLAMA3_ARGS + OPTIONS,
    "llama3_flash_attn_varlen_kvpacked_func": Q_KV + LLAMA3_ARGS + OPTIONS,
    "llama3_flash_attn_varlen_qkvpacked_func": QKV + LLAMA3_ARGS + OPTIONS,
}
HELPERS = {
    "llama3_flash_attn_prepare_cu_seqlens": required("cu_seqlens", "causal", "rank", "world_size"),
    "substitute_hf_flash_attn": required("process_group", "heads_k_stride"),
    "update_ring_flash_attn_params": required("cu_seqlens", "process_group"),
}
# ring_flash_attn/__init__.py's 21 names
RING_FLASH_ATTN_EXPORTS = (set(RING_ENTRY_POINTS) - RINGFLASH_ONLY) | set(LLAMA3_ENTRY_POINTS) | set(HELPERS)


def test_every_ring_flash_attn_name_is_exported():
    assert len(RING_FLASH_ATTN_EXPORTS) == 21
    missing = sorted(n for n in RING_FLASH_ATTN_EXPORTS if not hasattr(ringflash, n))
    assert not missing, f"ringflash lacks ring-flash-attn's {missing}"
    assert RING_FLASH_ATTN_EXPORTS <= set(ringflash.__all__)


def _signature(name: str):
    """(positional (name, default) pairs, keyword-only parameters); no *args / **kwargs."""
    params = list(inspect.signature(getattr(ringflash, name)).parameters.values())
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in positional]
    keyword = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(params) == len(positional) + len(keyword)
    assert all(p.default is not inspect.Parameter.empty for p in keyword)  # callers never pass them
    return got, {p.name for p in keyword}


@pytest.mark.parametrize("name", sorted(RING_ENTRY_POINTS))
def test_signature_matches_ring_flash_attn(name):
    positional, extras = _signature(name)
    assert positional == RING_ENTRY_POINTS[name]
    allowed = EXTRAS | ({"sp_mode", "ulysses_size", "heads_k_stride"} if name == "sp_attn_func" else set())
    assert extras <= allowed and {"softcap", "sinks", "return_lse"} <= extras


@pytest.mark.parametrize("name", sorted(LLAMA3_ENTRY_POINTS))
def test_llama3_signature_matches_ring_flash_attn(name):
    positional, extras = _signature(name)
    assert positional == LLAMA3_ENTRY_POINTS[name]
    assert extras <= {"softcap", "sinks", "return_lse"}


@pytest.mark.parametrize("name", sorted(HELPERS))
def test_helper_signature_matches_ring_flash_attn(name):
    positional, extras = _signature(name)
    assert positional == HELPERS[name] and not extras


def test_ring_default_layout_is_contiguous():
    assert inspect.signature(ringflash.ring_flash_attn_func).parameters["layout"].default == "contiguous"


def _full(seqlen: int, batch: int = 1):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(batch, seqlen, h, 16, generator=g) for h in (2, 1, 1, 2)]  # q, k, v, dout


def _dense_positional(layout: str):
    """Positional calls, as code written for ring-flash-attn makes them, on its shard layouts."""
    fn = {"contiguous": ringflash.ring_flash_attn_func, "zigzag": ringflash.zigzag_ring_flash_attn_func,
          "stripe": ringflash.stripe_flash_attn_func}[layout]  # fmt: skip
    q, k, v, dout = (ringflash.shard_sequence(t.to(worker_device()), layout=layout) for t in _full(16, 2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, probs = fn(q, k, v, 0.0, None, True, (-1, -1), None, False, True)
    out.backward(dout)
    plain = fn(q, k, v, 0.0, None, True)
    errors = errors_of({"dropout": lambda: fn(q, k, v, 0.1)})
    results = [t.detach().cpu() for t in (out, lse, q.grad, k.grad, v.grad)]
    return probs, torch.equal(plain, out), errors, results


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
def test_dense_positional_calls(rank_pool, layout):
    results = rank_pool(2).run(_dense_positional, layout)
    q, k, v, dout = (t.double().requires_grad_() for t in _full(16, 2))
    ref_out, ref_lse = reference_attention(q, k, v, causal=True)
    ref_out.backward(dout)
    for probs, same, errors, _ in results:
        assert probs is None and same
        assert "dropout_p=0.1" in errors["dropout"]
    expected = (ref_out, ref_lse, q.grad, k.grad, v.grad)
    for i, (name, exp) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), expected)):
        dim = 2 if name == "lse" else 1
        got = torch.empty(exp.shape, dtype=torch.float32)
        for r, res in enumerate(results):
            got.index_copy_(dim, ringflash.layout_indices(layout, r, 2, 16), res[3][i])
        assert rel_err(got, exp) < TOLERANCE[torch.float32], name


DOCS = [0, 8, 24]  # full documents; each rank holds 4 and 8 tokens of them


def _rfa_indices(layout: str, rank: int, world: int) -> torch.Tensor:
    """ring-flash-attn's varlen shards, written out independently of ringflash.layouts: per
    document, contiguous piece r / zigzag chunks r and 2W-1-r / stripe tokens r, r+W, ..."""
    parts = []
    for a, b in zip(DOCS, DOCS[1:]):
        n = b - a
        if layout == "contiguous":
            parts.append(torch.arange(a + rank * n // world, a + (rank + 1) * n // world))
        elif layout == "zigzag":
            c = n // (2 * world)
            parts += [torch.arange(a + rank * c, a + (rank + 1) * c),
                      torch.arange(a + (2 * world - 1 - rank) * c, a + (2 * world - rank) * c)]  # fmt: skip
        else:
            parts.append(a + rank + world * torch.arange(n // world))
    return torch.cat(parts)


def _varlen(layout: str):
    fn = {"contiguous": ringflash.ring_flash_attn_varlen_func,
          "zigzag": ringflash.zigzag_ring_flash_attn_varlen_func,
          "stripe": ringflash.stripe_flash_attn_varlen_func}[layout]  # fmt: skip
    idx = _rfa_indices(layout, torch.distributed.get_rank(), 2)
    q, k, v, dout = (t[0, idx].to(worker_device()) for t in _full(24))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    local_cu = torch.tensor([0, 4, 12], dtype=torch.int32)  # this rank's pieces: 4 and 8 tokens
    out, lse, probs = fn(q, k, v, local_cu, 8, 0.0, None, True, (-1, -1), None, False, True)
    out.backward(dout)
    errors = errors_of({
        "global cu_seqlens": lambda: fn(q, k, v, torch.tensor(DOCS, dtype=torch.int32), 16, causal=True),
        "max_seqlen": lambda: fn(q, k, v, local_cu, 4, causal=True),
    })  # fmt: skip
    flash_attn_layout = probs is None and lse.shape == (2, 12) and lse.dtype == torch.float32
    return flash_attn_layout, errors, [t.detach().cpu() for t in (out, lse, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
def test_varlen_takes_local_cu_seqlens(rank_pool, layout):
    results = rank_pool(2).run(_varlen, layout)
    q, k, v, dout = (t.double().requires_grad_() for t in _full(24))
    ref_out, ref_lse = reference_attention_packed(q, k, v, DOCS, causal=True)
    ref_out.backward(dout)
    expected = [t[0] for t in (ref_out, ref_lse, q.grad, k.grad, v.grad)]
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        dim = 1 if name == "lse" else 0
        got = torch.empty(expected[i].shape, dtype=torch.float32)
        for r, res in enumerate(results):
            got.index_copy_(dim, _rfa_indices(layout, r, 2), res[2][i])
        assert rel_err(got, expected[i]) < TOLERANCE[torch.float32], name
    for flash_attn_layout, errors, _ in results:
        assert flash_attn_layout  # flash-attn 2.x's varlen LSE: (heads, local tokens), in q's order
        assert "local token count 12" in errors["global cu_seqlens"]
        assert "max_seqlen must be an int >= the longest local piece (8)" in errors["max_seqlen"]


def test_argument_errors_come_before_the_missing_process_group(device):
    """No torch.distributed here: an argument that is wrong on its own is named first."""
    q = torch.randn(1, 8, 2, 16, device=device)
    calls = {
        "layout": lambda: ringflash.ring_flash_attn_func(q, q, q, layout="foo"),
        "dropout": lambda: ringflash.zigzag_ring_flash_attn_func(q, q, q, 0.5),
        "sp_mode": lambda: ringflash.sp_attn_func(q, q, q, sp_mode="star"),
        "sinks": lambda: ringflash.sp_attn_func(
            q, q, q, sp_mode="ulysses", sinks=torch.zeros(3, device=device)
        ),
        "varlen": lambda: ringflash.ring_flash_attn_varlen_func(q[0], q[0], q[0], [0, 9], 9),
    }
    errors = errors_of(calls)
    assert "layout must be one of" in errors["layout"]
    assert "dropout_p=0.5" in errors["dropout"]
    assert "sp_mode must be one of" in errors["sp_mode"]
    assert "sinks must have shape" in errors["sinks"]
    assert "local token count 8" in errors["varlen"]
    with pytest.raises(RuntimeError, match="init_process_group"):
        ringflash.ring_flash_attn_func(q, q, q)
