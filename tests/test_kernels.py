"""The Triton kernels against float64 attention: out, LSE, dq, dk, dv on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from reference import TOLERANCE, reference_attention, rel_err

import ringflash
from ringflash.kernels import (
    TokenPositions,
    attention_backward,
    attention_delta,
    attention_forward,
    build_problem,
)


def _inputs(b, sq, sk, h, hk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda s, n: torch.randn(b, s, n, d, generator=g).to(device, dtype)  # noqa: E731
    return mk(sq, h), mk(sk, hk), mk(sk, hk), mk(sq, h)


def check_against_reference(q, k, v, dout, causal=False, window=(-1, -1), scale=None, tol=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ringflash.flash_attn_func(q, k, v, scale, causal, window, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    out.backward(dout)
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(qd, kd, vd, causal, window, scale)
    ref_out.backward(dout.double().cpu())
    tol = tol or TOLERANCE[q.dtype]
    for name, got, exp in (
        ("out", out, ref_out),
        ("lse", lse, ref_lse),
        ("dq", q.grad, qd.grad),
        ("dk", k.grad, kd.grad),
        ("dv", v.grad, vd.grad),
    ):
        err = rel_err(got, exp)
        assert err < tol, f"{name}: rel err {err:.2e} >= {tol:.0e}"


CASES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window)
    (2, 17, 17, 2, 2, 16, False, (-1, -1)),  # one past a 16-row tile
    (1, 1, 3, 1, 1, 8, False, (-1, -1)),  # a single query, smallest head_dim
    (1, 33, 33, 4, 2, 24, True, (-1, -1)),  # GQA, head_dim not a power of two
    (1, 15, 40, 4, 1, 40, True, (-1, -1)),  # MQA, seqlen_q < seqlen_k (bottom-right causal)
    (1, 40, 15, 2, 2, 32, True, (-1, -1)),  # seqlen_q > seqlen_k: the first rows see no key
    (1, 48, 48, 2, 2, 16, False, (5, 3)),  # sliding window, both sides
    (1, 50, 50, 2, 1, 16, True, (7, -1)),  # causal sliding window
    (1, 33, 33, 2, 2, 16, False, (1, 0)),  # the diagonal and one key back
    (1, 20, 37, 2, 2, 16, False, (3, 0)),  # window with seqlen_q != seqlen_k
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_matches_reference(device, case, dtype):
    b, sq, sk, h, hk, d, causal, window = case
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, dtype, device, seed=sq * sk)
    check_against_reference(q, k, v, dout, causal, window)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_head_dims(device, head_dim):
    q, k, v, dout = _inputs(1, 19, 19, 2, 1, head_dim, torch.float32, device, seed=head_dim)
    check_against_reference(q, k, v, dout, causal=True)


def test_softmax_scale_and_noncontiguous_inputs(device):
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 21, 3, 2, 32, generator=g).to(device)  # packed: slices are strided
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    dout = torch.randn(2, 21, 2, 32, generator=g).to(device)
    check_against_reference(q, k, v, dout, causal=True, scale=0.3)


def test_fully_masked_rows_give_zero_and_neg_inf(device):
    q, k, v, dout = _inputs(1, 24, 8, 2, 2, 16, torch.float32, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    out.backward(dout)
    assert torch.isneginf(lse[:, :, :16]).all() and torch.isfinite(lse[:, :, 16:]).all()
    assert (out[:, :16] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (q.grad[:, :16] == 0).all()


def test_varlen_matches_per_sequence_reference(device):
    lens_q, lens_k = [5, 17, 0, 1, 33], [5, 20, 3, 2, 30]
    g = torch.Generator().manual_seed(3)
    h, hk, d = 4, 2, 24
    q = torch.randn(sum(lens_q), h, d, generator=g).to(device).requires_grad_()
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(device).requires_grad_()
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(device).requires_grad_()
    dout = torch.randn(sum(lens_q), h, d, generator=g).to(device)
    cu = lambda lens: torch.tensor(
        [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    out, lse = ringflash.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, window_size=(6, -1), return_lse=True
    )
    assert lse.shape == (h, sum(lens_q))
    out.backward(dout)
    for i in range(len(lens_q)):
        qs = slice(cu_q[i].item(), cu_q[i + 1].item())
        ks = slice(cu_k[i].item(), cu_k[i + 1].item())
        if lens_q[i] == 0:
            continue
        qd, kd, vd = (
            t[s].detach().double().cpu()[None].requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks))
        )
        ref_out, ref_lse = reference_attention(qd, kd, vd, causal=True, window_size=(6, -1))
        ref_out.backward(dout[qs].double().cpu()[None])
        assert rel_err(out[qs][None], ref_out) < 1e-4
        assert rel_err(lse[:, qs][None], ref_lse) < 1e-4
        assert rel_err(q.grad[qs][None], qd.grad) < 1e-4
        assert rel_err(k.grad[ks][None], kd.grad) < 1e-4
        assert rel_err(v.grad[ks][None], vd.grad) < 1e-4


@pytest.mark.parametrize(("q_pos", "k_pos", "causal", "window"), [
    (TokenPositions(2, 3), TokenPositions(0, 3), True, (-1, -1)),  # a stripe-layout step
    (TokenPositions(0, 3), TokenPositions(1, 3), True, (-1, -1)),  # keys one stripe later
    (TokenPositions(40, 1), TokenPositions(16, 1), False, (20, 0)),  # window reaching back
    (TokenPositions(5, 2), TokenPositions(0, 1), False, (4, 4)),
])  # fmt: skip
def test_low_level_positions_and_accumulation(device, q_pos, k_pos, causal, window):
    q, k, v, dout = _inputs(1, 23, 29, 2, 2, 16, torch.float32, device, seed=11)
    prob = build_problem(q, k, v, None, causal, window, q_positions=q_pos, k_positions=k_pos)
    out = torch.empty(q.shape, device=device, dtype=torch.float32)
    out, lse = attention_forward(q, k, v, prob, out=out)
    qp = q_pos.start + q_pos.stride * torch.arange(23)
    kp = k_pos.start + k_pos.stride * torch.arange(29)
    qd, kd, vd = (t.double().cpu().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference_attention(qd, kd, vd, causal, window, q_pos=qp, k_pos=kp)
    assert rel_err(out, ref_out) < 1e-4 and rel_err(lse, ref_lse) < 1e-4
    ref_out.backward(dout.double().cpu())
    # accumulate=True adds into pre-filled float32 buffers.
    fills = [torch.randn(t.shape, device=device) for t in (q, k, v)]
    grads = [f.clone() for f in fills]
    delta = attention_delta(out.to(q.dtype), dout, prob)
    attention_backward(dout, q, k, v, lse, delta, prob, *grads, accumulate=True)
    for name, got, fill, exp in zip(("dq", "dk", "dv"), grads, fills, (qd.grad, kd.grad, vd.grad)):
        assert rel_err(got - fill, exp) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("b", "s", "h", "hk", "d", "causal", "window"),
    [(2, 2048, 16, 4, 128, True, (-1, -1)), (2, 2048, 8, 8, 128, False, (-1, -1)),
     (1, 3001, 8, 2, 64, True, (-1, -1)), (1, 2048, 4, 4, 256, True, (-1, -1)),
     (1, 2048, 8, 1, 80, False, (300, 17))],
)  # fmt: skip
def test_gpu_real_sizes(b, s, h, hk, d, causal, window, dtype):
    q, k, v, dout = _inputs(b, s, s, h, hk, d, dtype, "cuda", seed=s + d)
    check_against_reference(q, k, v, dout, causal, window)


def test_single_visible_key_copies_value_and_has_zero_dq(device):
    # Diagonal-only window: out = v of the same position; dq is exactly 0 (softmax of one key).
    q, k, v, dout = _inputs(1, 20, 20, 2, 2, 16, torch.float32, device, seed=5)
    q.requires_grad_()
    out, lse = ringflash.flash_attn_func(q, k, v, window_size=(0, 0), return_lse=True)
    out.backward(dout)
    assert torch.allclose(out, v, atol=1e-6)
    assert torch.allclose(lse, (q * k).sum(-1).transpose(1, 2) / 4.0, atol=1e-5)
    assert q.grad.abs().max() < 1e-5
