"""The public single-device functions as a flash-attn user calls them: positional order, packed
variants, any head_dim, refusals, attention probabilities, a differentiable LSE and attention
sinks, all against the float64 reference (``reference_attention``)."""

from __future__ import annotations

import pytest
import torch
from reference import TOLERANCE, reference_attention, rel_err

import ringflash
from ringflash.kernels import merge_sinks


def _randn(gen, shape, dtype, device, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(device, dtype)


def _inputs(b, sq, sk, h, hk, d, device, dtype=torch.float32, seed=0, scale=1.0):
    """Fresh random q, k, v, dout (batch, seqlen, heads, head_dim) and dlse (batch, heads, seqlen_q)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        _randn(g, (b, s, n, d), dtype, device, sc)
        for s, n, sc in ((sq, h, scale), (sk, hk, scale), (sk, hk, 1.0), (sq, h, 1.0))
    )
    return q, k, v, dout, _randn(g, (b, h, sq), torch.float32, device)


def _sinks(h, lse, seed=1):
    """Sink logits spread around the rows' LSE, so that they take a sizeable share of each row."""
    g = torch.Generator().manual_seed(seed)
    finite = lse.detach()[torch.isfinite(lse)]
    return (finite.mean().cpu() + torch.randn(h, generator=g, dtype=torch.float64)).float()


def _leaves(*tensors):
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _ref_leaves(*tensors):
    return tuple(t.detach().to("cpu", torch.float64).requires_grad_() for t in tensors)


def _close(name, got, expected, tol):
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    err = rel_err(got, expected)
    assert err < tol, f"{name}: rel err {err:.2e} >= {tol:.0e}"


def test_lse_gradient_matches_float64(device):
    """Backpropagating through the returned LSE (as well as out) gives the exact gradients, also
    for rows that see no key (causal with seqlen_q > seqlen_k) and with GQA."""
    q, k, v, dout, dlse = _inputs(1, 17, 9, 4, 2, 16, device)
    q, k, v = _leaves(q, k, v)
    out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse), retain_graph=True)
    qd, kd, vd = _ref_leaves(q, k, v)
    ref_out, ref_lse = reference_attention(qd, kd, vd, causal=True)
    ref_grads = torch.autograd.grad(
        (ref_out, ref_lse), (qd, kd, vd), (dout.double().cpu(), dlse.double().cpu()), retain_graph=True
    )
    assert torch.isneginf(lse).any()  # some rows see no key
    for name, got, exp in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)
    ):
        _close(name, got, exp, TOLERANCE[torch.float32])
    # The LSE's own gradient alone (out unused), not hidden behind out's.
    grads_lse = torch.autograd.grad(lse, (q, k), dlse)
    ref_lse_grads = torch.autograd.grad(ref_lse, (qd, kd), dlse.double().cpu())
    for name, got, exp in zip(("dq", "dk"), grads_lse, ref_lse_grads):
        _close(name + " (lse only)", got, exp, TOLERANCE[torch.float32])
        assert exp.norm() > 0.1


@pytest.mark.parametrize(
    ("sq", "sk", "causal", "window"),
    [(17, 17, True, (-1, -1)), (13, 6, True, (-1, -1)), (12, 12, False, (5, 2))],
    ids=["causal", "causal-empty-rows", "window"],
)
def test_merge_sinks_matches_float64(device, sq, sk, causal, window):
    """merge_sinks on flash_attn_func's (out, LSE): out, LSE, dq, dk, dv and dsinks against the
    float64 reference with sinks, with GQA; sinks large enough to take a real share of each row."""
    q, k, v, dout, dlse = _inputs(1, sq, sk, 4, 2, 16, device, seed=sq)
    kw = dict(causal=causal, window_size=window)
    q, k, v = _leaves(q, k, v)
    out, lse = ringflash.flash_attn_func(q, k, v, return_lse=True, **kw)
    sinks = _sinks(4, lse).to(device).requires_grad_()
    out_s, lse_s = merge_sinks(out, lse, sinks)
    grads = torch.autograd.grad((out_s, lse_s), (q, k, v, sinks), (dout, dlse))
    qd, kd, vd, sd = _ref_leaves(q, k, v, sinks)
    ref_out, ref_lse = reference_attention(qd, kd, vd, sinks=sd, **kw)
    ref_grads = torch.autograd.grad(
        (ref_out, ref_lse), (qd, kd, vd, sd), (dout.double().cpu(), dlse.double().cpu())
    )
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, got, exp in zip(names, (out_s, lse_s, *grads), (ref_out, ref_lse, *ref_grads)):
        _close(name, got, exp, TOLERANCE[torch.float32])
    assert rel_err(out, ref_out) > 0.05  # the sinks change the answer
    empty = torch.isneginf(lse)
    assert torch.equal(lse_s[empty], sinks.detach()[None, :, None].expand_as(lse)[empty])
    assert (out_s.transpose(1, 2)[empty] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_merge_sinks_edge_cases(device):
    """A row with no key and a -inf sink stays out 0, lse -inf with finite gradients; half-precision
    sinks get a gradient of their own dtype; bad sinks are refused by name."""
    out = torch.randn(1, 3, 2, 8, device=device)
    lse = torch.tensor([[[0.5, float("-inf"), float("-inf")], [1.0, 2.0, float("-inf")]]], device=device)
    out[0, 1:, 0] = 0
    out[0, 2, 1] = 0
    out, lse = _leaves(out, lse)
    sinks = torch.tensor([float("-inf"), 0.25], device=device, dtype=torch.float16, requires_grad=True)
    out_s, lse_s = merge_sinks(out, lse, sinks)
    assert torch.isneginf(lse_s[0, 0, 1:]).all() and (out_s[0, 1:, 0] == 0).all()
    assert torch.equal(out_s[0, :, 0], out[0, :, 0].detach())  # a -inf sink changes nothing
    assert lse_s[0, 1, 2].item() == 0.25
    (out_s.sum() + lse_s[torch.isfinite(lse_s)].sum()).backward()
    assert sinks.grad.dtype == torch.float16
    assert all(torch.isfinite(t.grad).all() for t in (out, sinks))
    assert not lse.grad.isnan().any()
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\)"):
        merge_sinks(out, lse, sinks[:1])
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        merge_sinks(out, lse, torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="merge_sinks needs out"):
        merge_sinks(out, lse.transpose(1, 2), sinks)
