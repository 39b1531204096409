"""kernels/few_queries.py: ``flash_attn_func`` without gradients for a few query rows, over
keys whose number changes call by call (a growing cache, as transformers' ``DynamicCache``
hands attention during generation): against float64 at every length, one plan for all of
them, every mask and score feature of the dense path, and the same errors as the general path."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE
from reference import reference_attention, rel_err

import ringflash
from ringflash.kernels import decode, few_queries, launcher, plans

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(DEVICE, dtype)


def _growing_cache(batch, capacity, heads_k, head_dim, dtype, seed):
    """Keys and values as a model's cache holds them, (batch, heads_k, capacity, head_dim); a
    call takes the first n as (batch, n, heads_k, head_dim) views (batch and head strides that
    follow n only for a cache made per step; here the capacity's)."""
    k = _randn(batch, heads_k, capacity, head_dim, dtype=dtype, seed=seed, scale=2.0)
    v = _randn(batch, heads_k, capacity, head_dim, dtype=dtype, seed=seed + 1)
    return k, v


def _check(out, lse, expected, dtype):
    exp_out, exp_lse = expected
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, exp_out) < TOL[dtype], "out"
    seen = exp_lse > -math.inf
    assert (lse.cpu()[~seen] == -math.inf).all(), "rows that see no key: lse -inf"
    assert (out.cpu().double()[~seen.transpose(1, 2)] == 0).all(), "rows that see no key: out 0"
    assert rel_err(lse.cpu()[seen], exp_lse[seen]) < 1e-4, "lse"


@pytest.fixture
def splits_on_cpu(monkeypatch):
    """The interpreter's device has no SMs to fill, so default_splits gives one split; count
    64 so that long enough keys split and the merge runs on the CPU too."""
    if DEVICE == "cpu":
        monkeypatch.setattr(decode, "_sm_count", lambda index: 64)


FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window_size": (40, -1)},
    "window_both_sides": {"window_size": (37, 5)},
    "softcap_alibi": {"causal": True, "softcap": 5.0, "alibi": True},
    "sinks_scale": {"causal": True, "sinks": True, "softmax_scale": 0.3},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("features", list(FEATURES), ids=str)
@pytest.mark.parametrize(
    ("seqlen_q", "heads", "heads_k", "head_dim"), [(1, 4, 2, 64), (3, 2, 2, 40), (2, 8, 1, 128)]
)
def test_growing_keys_match_float64(dtype, features, seqlen_q, heads, heads_k, head_dim, splits_on_cpu):
    """Keys 1, 2, 17, 300, 600 (fewer than the queries, one tile, several splits) through one
    plan; each call against float64 over the same keys."""
    kw = dict(FEATURES[features])
    batch = 2
    alibi = kw.pop("alibi", False)
    sinks = kw.pop("sinks", False)
    if alibi:
        kw["alibi_slopes"] = _randn(heads, dtype=torch.float32, seed=7).abs() * 0.2
    if sinks:
        kw["sinks"] = _randn(heads, dtype=torch.float32, seed=8)
    q = _randn(batch, heads, seqlen_q, head_dim, dtype=dtype, seed=1).transpose(1, 2)  # as a model's view
    keys, values = _growing_cache(batch, 600, heads_k, head_dim, dtype, seed=2)
    before = few_queries.plans_made()[0]
    with torch.no_grad():
        for n in (1, 2, 17, 300, 600):
            k, v = keys[:, :, :n].transpose(1, 2), values[:, :, :n].transpose(1, 2)
            out, lse = ringflash.flash_attn_func(q, k, v, return_lse=True, **kw)
            if head_dim % 8 == 0:  # q's strides, as the general path and the op's fake give it (a
                assert out.stride() == torch.empty_like(q).stride()  # compiled graph trusts the fake's)
            ref = dict(kw)
            ref.pop("alibi_slopes", None), ref.pop("sinks", None)
            expected = reference_attention(
                q, k, v, alibi_slopes=kw.get("alibi_slopes"), sinks=kw.get("sinks"), **ref
            )
            _check(out, lse, expected, dtype)
    assert few_queries.plans_made()[0] == before + 1, "one plan for every length"


def test_a_cache_made_per_step_builds_nothing_per_step(splits_on_cpu):
    """A cache concatenated anew at every step (its batch and head strides change with its
    length, as transformers' DynamicCache makes it): no problem built, one route planned, two
    split counts, across 40 steps; the answers equal the general path's."""
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    q = _randn(1, 4, 1, 64, dtype=dtype, seed=3).transpose(1, 2)
    keys = _randn(1, 2, 240, 64, dtype=dtype, seed=4)
    values = _randn(1, 2, 240, 64, dtype=dtype, seed=5)
    step_k = _randn(1, 2, 40, 64, dtype=dtype, seed=6)
    with torch.no_grad():
        ringflash.flash_attn_func(q, keys.transpose(1, 2), values.transpose(1, 2), causal=True)  # plans
        routes, split_counts = few_queries.plans_made()
        builds = plans.problem_builds()
        outs = []
        for step in range(40):
            keys = torch.cat([keys, step_k[:, :, step : step + 1]], dim=2)
            values = torch.cat([values, step_k[:, :, step : step + 1] * 0.5], dim=2)
            out = ringflash.flash_attn_func(q, keys.transpose(1, 2), values.transpose(1, 2), causal=True)
            outs.append((out, keys, values))
        assert plans.problem_builds() == builds, "no problem built for a new length"
        assert few_queries.plans_made()[0] == routes
        assert few_queries.plans_made()[1] <= split_counts + (1 if DEVICE == "cpu" else 2)
        for out, k, v in outs[::13]:
            expected = reference_attention(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)
            assert rel_err(out, expected[0]) < TOL[dtype]


def test_a_compiled_decode_loop_equals_eager(splits_on_cpu):
    """Under torch.compile (a dynamic key length) the ``ringflash::flash_attn_forward`` op runs
    the same path: every step equals the eager call."""
    q = _randn(1, 4, 1, 32, dtype=torch.float32, seed=1).transpose(1, 2)
    keys, values = _growing_cache(1, 400, 2, 32, torch.float32, seed=2)

    def step(q, k, v):
        return ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    routes = few_queries.plans_made()[0]
    with torch.no_grad():
        calls = []
        for n in (30, 31, 290, 400):
            k, v = keys[:, :, :n].transpose(1, 2), values[:, :, :n].transpose(1, 2)
            for t in (k, v):  # the keys' number only (a symbolic head_dim would make the scale symbolic)
                torch._dynamo.mark_dynamic(t, 1)
            calls.append((k, v, compiled(q, k, v)))
        assert few_queries.plans_made()[0] == routes + 1, "the op took this path"
        for k, v, got in calls:
            for a, b in zip(got, step(q, k, v)):
                assert torch.equal(a, b)


def test_not_taken_where_gradients_flow_or_rows_are_many():
    """With gradients asked for, the autograd path runs (its backward is right); over
    ``MAX_ROWS`` query rows per KV head, and varlen calls, the general path."""
    dtype = torch.float32
    q = _randn(1, 2, 4, 32, dtype=dtype, seed=1).requires_grad_()
    k = _randn(1, 9, 2, 32, dtype=dtype, seed=2).requires_grad_()
    v = _randn(1, 9, 2, 32, dtype=dtype, seed=3).requires_grad_()
    routes = few_queries.plans_made()[0]
    out = ringflash.flash_attn_func(q, k, v, causal=True)
    assert out.grad_fn is not None and few_queries.plans_made()[0] == routes
    out.sum().backward()
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference_attention(qr, kr, vr, causal=True)[0].sum().backward()
    for t, r in ((q, qr), (k, kr), (v, vr)):
        assert rel_err(t.grad, r.grad) < 1e-4
    many = _randn(1, few_queries.MAX_ROWS // 2 + 1, 4, 32, dtype=dtype, seed=4)
    with torch.no_grad():
        ringflash.flash_attn_func(many, k, v, causal=True)
        cu = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
        ringflash.flash_attn_varlen_func(q[0].detach(), k[0].detach(), v[0].detach(), cu, cu_k, 2, 9)
    assert few_queries.plans_made()[0] == routes  # turned away before a key is made


def test_the_switch_turns_it_off(monkeypatch):
    q = _randn(1, 1, 4, 32, dtype=torch.float32, seed=1)
    k = _randn(1, 20, 2, 32, dtype=torch.float32, seed=2)
    with torch.no_grad():
        routed = ringflash.flash_attn_func(q, k, k, causal=True)
        monkeypatch.setenv(few_queries.SWITCH, "0")
        routes = few_queries.plans_made()
        general = ringflash.flash_attn_func(q, k * 1, k * 1, causal=True)
    assert few_queries.plans_made() == routes
    assert rel_err(routed, general) < 1e-5


def test_bad_input_raises_as_the_general_path_does():
    """The first call of a key is validated in full; a later call whose keys and values differ
    in length (the one thing not in the key) raises the general path's ValueError."""
    q = _randn(1, 1, 4, 32, dtype=torch.float32, seed=1)
    k = _randn(1, 20, 2, 32, dtype=torch.float32, seed=2)
    with torch.no_grad():
        ringflash.flash_attn_func(q, k, k)
        with pytest.raises(ValueError, match="same shape"):
            ringflash.flash_attn_func(q, k, k[:, :19])
        with pytest.raises(ValueError, match="divisible"):
            ringflash.flash_attn_func(_randn(1, 1, 3, 32, dtype=torch.float32, seed=1), k, k)
        with pytest.raises(TypeError, match="share a dtype"):
            ringflash.flash_attn_func(q, k.half(), k.half())
        with pytest.raises(ValueError, match="alibi_slopes"):
            ringflash.flash_attn_func(q, k, k, alibi_slopes=torch.ones(3, device=DEVICE))
        empty = ringflash.flash_attn_func(q, k[:, :0], k[:, :0], return_lse=True)  # no keys: general path
    assert (empty[0] == 0).all() and (empty[1] == -math.inf).all()


def test_int_classes_are_tritons():
    """The launch key of a ``SizedLaunch`` takes ints by their class (``classes_key``): it must
    tell apart every two ints that Triton compiles differently, or a kernel would run with
    another's assumptions (a length taken for divisible by 16)."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    specialize = getattr(libtriton, "native_specialize_impl", None)
    if specialize is None:
        pytest.skip("this Triton release specializes in Python")
    from triton.backends.compiler import BaseBackend

    values = [0, 1, 2, 15, 16, 17, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**40 + 3, 2**63 - 1, 2**63, -1, -16,
              -(2**31), -(2**31) - 1]  # fmt: skip
    for a in values:
        for b in values:
            if launcher.classes_key((a,)) == launcher.classes_key((b,)):
                assert specialize(BaseBackend, a, False, True, True) == specialize(
                    BaseBackend, b, False, True, True
                ), (a, b)


@pytest.mark.gpu
def test_decode_steps_on_a_gpu_compile_once_and_match_the_general_path():
    """bf16, GQA 32/8, head_dim 128, one query over 1K-9K keys of a cache made per step: two
    compiled split launches at most, after which new lengths compile nothing; each equals float64
    and the general path (``RINGFLASH_SPLIT_KV_QUERIES=0``)."""
    import os

    q = _randn(2, 32, 1, 128, dtype=torch.bfloat16, seed=1).transpose(1, 2)
    keys = _randn(2, 8, 9000, 128, dtype=torch.bfloat16, seed=2)
    values = _randn(2, 8, 9000, 128, dtype=torch.bfloat16, seed=3)
    with torch.no_grad():
        # Both classes of a length (divisible by 16 or not) at both split counts (4 below 2K keys, 8 above).
        for n in (1000, 1001, 2048, 2049):
            k = keys[:, :, :n].contiguous().transpose(1, 2)
            ringflash.flash_attn_func(q, k, values[:, :, :n].contiguous().transpose(1, 2), causal=True)
        for n in (1003, 2064, 4097, 8999):
            k = keys[:, :, :n].contiguous().transpose(1, 2)
            v = values[:, :, :n].contiguous().transpose(1, 2)
            compiled = launcher.compiled_launches()
            out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
            assert launcher.compiled_launches() == compiled, "a new length compiled or keyed anew"
            _check(out, lse, reference_attention(q, k, v, causal=True), torch.bfloat16)
            os.environ[few_queries.SWITCH] = "0"
            try:
                general, general_lse = ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
            finally:
                del os.environ[few_queries.SWITCH]
            assert rel_err(out, general) < 1e-2 and rel_err(lse, general_lse) < 1e-4
