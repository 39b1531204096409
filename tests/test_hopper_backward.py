"""The fused Hopper backward (kernels/hopper_backward.py) on an sm_90 GPU, against float64.

Each case first asserts that ``uses_fused_backward`` picks the fused kernel, so a test cannot
pass on the Triton kernels by accident. Its sm_90 build on the CPU is checked in test_compile.py.
"""

from __future__ import annotations

import pytest
import torch
from reference import TOLERANCE, reference_attention, rel_err
from sm90 import ALIBI_CASES, SM90, alibi_inputs, cuda_randn

import ringflash
from ringflash.kernels import (
    TokenPositions,
    attention_backward,
    attention_delta,
    attention_forward,
    build_problem,
)
from ringflash.kernels.backward import uses_fused_backward

pytestmark = [pytest.mark.gpu, SM90]

D = 128


def _reference_grads(q, k, v, dout, causal, **kw):
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(qd, kd, vd, causal=causal, **kw)
    out.backward(dout.double().cpu())
    return qd.grad, kd.grad, vd.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal"),
    [
        (2, 384, 384, 4, 4, False),
        (2, 384, 384, 4, 4, True),
        (1, 512, 512, 8, 2, True),
        (1, 256, 512, 4, 1, False),
        (2, 512, 128, 6, 3, False),
    ],
)
def test_fused_backward_matches_float64(dtype, batch, seqlen_q, seqlen_k, heads, kv_heads, causal):
    q = cuda_randn(batch, seqlen_q, heads, D, dtype=dtype, seed=1).requires_grad_()
    k = cuda_randn(batch, seqlen_k, kv_heads, D, dtype=dtype, seed=2).requires_grad_()
    v = cuda_randn(batch, seqlen_k, kv_heads, D, dtype=dtype, seed=3).requires_grad_()
    dout = cuda_randn(batch, seqlen_q, heads, D, dtype=dtype, seed=4)
    problem = build_problem(q, k, v, None, causal, (-1, -1))
    assert uses_fused_backward(problem, q, k, v)
    ringflash.flash_attn_func(q, k, v, causal=causal).backward(dout)
    for name, got, exp in zip(
        ("dq", "dk", "dv"), (q.grad, k.grad, v.grad), _reference_grads(q, k, v, dout, causal)
    ):
        assert got.dtype == dtype, name
        err = rel_err(got, exp)
        assert err < TOLERANCE[dtype], f"{name}: rel err {err:.2e}"


def test_fused_backward_on_slices_adds_into_float32_buffers():
    """The ring's call: query/key slices of larger shards, dQ/dK/dV added to float32 buffers."""
    big_q, big_k, big_v, big_do = (
        cuda_randn(2, 640, h, D, seed=s) for s, h in ((5, 4), (6, 2), (7, 2), (8, 4))
    )
    qs, ks = slice(128, 384), slice(256, 640)
    q, k, v, dout = big_q[:, qs], big_k[:, ks], big_v[:, ks], big_do[:, qs]
    problem = build_problem(q, k, v, None, False, (-1, -1))
    assert uses_fused_backward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    delta = attention_delta(out, dout, problem)
    bufs = [
        cuda_randn(*t.shape, dtype=torch.float32, seed=9 + i) for i, t in enumerate((big_q, big_k, big_v))
    ]
    before = [b.clone() for b in bufs]
    dq, dk, dv = attention_backward(
        dout,
        q,
        k,
        v,
        lse,
        delta,
        problem,
        dq=bufs[0][:, qs],
        dk=bufs[1][:, ks],
        dv=bufs[2][:, ks],
        accumulate=True,
    )
    assert dq.data_ptr() == bufs[0][:, qs].data_ptr()
    for name, got, base, exp in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), before, _reference_grads(q, k, v, dout, False)
    ):
        sl = qs if name == "dq" else ks
        assert rel_err(got - base[:, sl], exp) < TOLERANCE[torch.bfloat16], name
    for buf, base, sl in zip(bufs, before, (qs, ks, ks)):  # rows outside the slices untouched
        outside = torch.ones(buf.shape[1], dtype=torch.bool)
        outside[sl] = False
        assert torch.equal(buf[:, outside], base[:, outside])


def test_fused_backward_on_a_diagonal_block_with_offsets():
    """A ring shard's own causal block sits at the same global positions on both sides."""
    q, k, v, dout = (cuda_randn(1, 256, 2, D, seed=s) for s in range(10, 14))
    pos = TokenPositions(1024)
    problem = build_problem(q, k, v, None, True, (-1, -1), q_positions=pos, k_positions=pos)
    assert uses_fused_backward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    grads = attention_backward(dout, q, k, v, lse, attention_delta(out, dout, problem), problem)
    for name, got, exp in zip(("dq", "dk", "dv"), grads, _reference_grads(q, k, v, dout, True)):
        assert rel_err(got, exp) < TOLERANCE[torch.bfloat16], name


def test_fused_backward_is_chosen_only_where_it_applies(monkeypatch):
    q, k, v = (cuda_randn(1, 256, 2, D, seed=s) for s in range(3))

    def fused(q=q, k=k, v=v, causal=True, window=(-1, -1), **kw):
        return uses_fused_backward(build_problem(q, k, v, None, causal, window, **kw), q, k, v)

    assert fused()
    assert not fused(window=(64, 0))
    assert not fused(q=q[:, :128])  # causal, seqlen_q != seqlen_k: bottom-right aligned
    assert not fused(q_positions=TokenPositions(128), k_positions=TokenPositions(0))
    assert not fused(q_positions=TokenPositions(0, 2), k_positions=TokenPositions(0, 2))  # stripe
    assert not fused(q=q[:, :192], k=k[:, :192], v=v[:, :192])  # not a multiple of 128
    assert not fused(*(t[..., :64].contiguous() for t in (q, k, v)))  # head_dim 64: a tie, not used
    assert not fused(*(t.float() for t in (q, k, v)))
    assert not fused(q=cuda_randn(1, 256, 4, D)[:, :, ::2])  # heads not packed in the token's row
    monkeypatch.setenv("RINGFLASH_FUSED_BACKWARD", "0")
    assert not fused()
    monkeypatch.delenv("RINGFLASH_FUSED_BACKWARD")
    torch.use_deterministic_algorithms(True)
    try:
        assert not fused()
    finally:
        torch.use_deterministic_algorithms(False)
    assert fused()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("softcap, q_scale", [(5.0, 4.0), (30.0, 16.0)])
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal"),
    [(2, 384, 384, 4, 4, False), (1, 512, 512, 8, 2, True), (1, 256, 512, 4, 1, False)],
)
def test_fused_backward_with_softcap_matches_float64(
    dtype, softcap, q_scale, batch, seqlen_q, seqlen_k, heads, kv_heads, causal
):
    """Scores large enough that the cap bites (see test_hopper_forward.SOFTCAPS); gradients
    compared with float64 and with the uncapped float64 gradients (which they must not match)."""
    q = (cuda_randn(batch, seqlen_q, heads, D, dtype=torch.float32, seed=31) * q_scale).to(dtype)
    k = cuda_randn(batch, seqlen_k, kv_heads, D, dtype=dtype, seed=32)
    v = cuda_randn(batch, seqlen_k, kv_heads, D, dtype=dtype, seed=33)
    dout = cuda_randn(batch, seqlen_q, heads, D, dtype=dtype, seed=34)
    problem = build_problem(q, k, v, None, causal, (-1, -1), softcap=softcap)
    assert uses_fused_backward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    grads = attention_backward(dout, q, k, v, lse, attention_delta(out, dout, problem), problem)
    expected = _reference_grads(q, k, v, dout, causal, softcap=softcap)
    uncapped = _reference_grads(q, k, v, dout, causal)
    for name, got, exp, unc in zip(("dq", "dk", "dv"), grads, expected, uncapped):
        assert got.dtype == dtype, name
        assert rel_err(unc, exp) > 0.1, name  # the cap changes this gradient
        err = rel_err(got, exp)
        assert err < TOLERANCE[dtype], f"{name}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal", "softcap", "positions"), ALIBI_CASES
)
def test_fused_backward_with_alibi_matches_float64(
    dtype, batch, seqlen_q, seqlen_k, heads, kv_heads, causal, softcap, positions
):
    q, k, v, slopes, kw, ref_kw = alibi_inputs(
        batch, seqlen_q, seqlen_k, heads, kv_heads, causal, softcap, positions, dtype, seed=50
    )
    dout = cuda_randn(batch, seqlen_q, heads, D, dtype=dtype, seed=55)
    problem = build_problem(q, k, v, None, causal, (-1, -1), **kw)
    assert uses_fused_backward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    grads = attention_backward(dout, q, k, v, lse, attention_delta(out, dout, problem), problem)
    ref_kw.pop("causal")
    expected = _reference_grads(q, k, v, dout, causal, alibi_slopes=slopes.cpu(), **ref_kw)
    without = _reference_grads(q, k, v, dout, causal, **ref_kw)
    for name, got, exp, wo in zip(("dq", "dk", "dv"), grads, expected, without):
        assert got.dtype == dtype, name
        assert rel_err(wo, exp) > 0.1, name  # the bias changes this gradient
        err = rel_err(got, exp)
        assert err < TOLERANCE[dtype], f"{name}: rel err {err:.2e}"
