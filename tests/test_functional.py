"""The public single-device functions as a flash-attn user calls them: positional order, packed
variants, any head_dim, refusals, attention probabilities, a differentiable LSE, attention sinks,
softcap and ALiBi, all against the float64 reference (``reference_attention``)."""

from __future__ import annotations

import inspect

import pytest
import torch
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err

import ringflash
import ringflash.kernels.functional as functional
import ringflash.kernels.ops as kernel_ops
from ringflash.kernels import merge_sinks

TOL = TOLERANCE[torch.float32]


def _randn(gen, shape, device, scale=1.0, dtype=torch.float32):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(device, dtype)


def _inputs(b, sq, sk, h, hk, d, device, seed=0, scale=1.0, dtype=torch.float32):
    """Fresh random q, k, v, dout (batch, seqlen, heads, head_dim) and dlse (batch, heads, seqlen_q);
    ``scale`` multiplies q and k, so that the scores reach where softcap and sinks matter."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        _randn(g, (b, s, n, d), device, sc, dtype)
        for s, n, sc in ((sq, h, scale), (sk, hk, scale), (sk, hk, 1.0), (sq, h, 1.0))
    )
    return q, k, v, dout, _randn(g, (b, h, sq), device)


def _sinks(h, device, seed=1):
    """Sink logits near the rows' LSE (about 2-3 here), so that they take a real share of each row."""
    g = torch.Generator().manual_seed(seed)
    return (2.5 + torch.randn(h, generator=g, dtype=torch.float64)).to(device, torch.float32)


def _close(name, got, expected, tol=TOL):
    assert got.shape == expected.shape, (name, tuple(got.shape), tuple(expected.shape))
    err = rel_err(got, expected)
    assert err < tol, f"{name}: rel err {err:.2e} >= {tol:.0e}"


def _check(run, ref, tensors, dout, dlse, names, tol=TOL):
    """``run(*leaves) -> (out, lse)`` against ``ref(*float64 leaves) -> (out, lse)``: out, lse and
    the gradients of every tensor in ``tensors`` under the loss <out, dout> + <lse, dlse>, which
    must all be finite. Returns (out, lse) of ``run``."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = run(*leaves)
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    ref_leaves = [t.detach().to("cpu", torch.float64).requires_grad_() for t in tensors]
    ref_out, ref_lse = ref(*ref_leaves)
    ref_grads = torch.autograd.grad(
        (ref_out, ref_lse), ref_leaves, (dout.to("cpu", torch.float64), dlse.to("cpu", torch.float64))
    )
    for name, got, exp in zip(("out", "lse", *names), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        _close(name, got, exp, tol)
        assert torch.isfinite(got).all() or name == "lse", name
    return out.detach(), lse.detach()


# --------------------------------------------------------------------------------------------
# flash-attn's signatures

# flash-attn 2.x's parameters, in order, with defaults (flash_attn/flash_attn_interface.py).
_COMMON = [
    ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
    ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False),
]  # fmt: skip
_REQUIRED = {
    "flash_attn_func": ["q", "k", "v"],
    "flash_attn_qkvpacked_func": ["qkv"],
    "flash_attn_kvpacked_func": ["q", "kv"],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"],
    "flash_attn_varlen_kvpacked_func": [
        "q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_REQUIRED))
def test_signature_is_flash_attns(name):
    """Same positional names, order and defaults as flash-attn; ringflash's extras keyword-only."""
    params = list(inspect.signature(getattr(ringflash, name)).parameters.values())
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    expected = [(n, inspect.Parameter.empty) for n in _REQUIRED[name]] + _COMMON
    if name == "flash_attn_varlen_func":
        expected.append(("block_table", None))
    assert [(p.name, p.default) for p in positional] == expected
    extras = [("sinks", None), ("return_lse", False)]
    if name in ("flash_attn_func", "flash_attn_varlen_func"):
        extras.append(("block_mask", None))
    assert [(p.name, p.default) for p in params if p.kind is p.KEYWORD_ONLY] == extras


def test_positional_order_is_flash_attns(device, monkeypatch):
    """flash_attn_func(q, k, v, 0.0, None, True) is causal attention, (..., 0.0, 0.3) scales by
    0.3, and deterministic (10th) reaches the kernels, as in flash-attn; varlen likewise."""
    q, k, v, _, _ = _inputs(1, 12, 12, 2, 1, 16, device)
    q.requires_grad_()  # the general path (without gradients, 12 rows take kernels/few_queries.py)
    problems = []
    forward = kernel_ops.attention_forward  # the launcher behind flash_attn_func
    monkeypatch.setattr(kernel_ops, "attention_forward", lambda *a: problems.append(a[3]) or forward(*a))
    ref_out, ref_lse = reference_attention(q, k, v, causal=True)
    out, lse, _ = ringflash.flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, True, True)
    _close("out", out, ref_out)
    _close("lse", lse, ref_lse)
    assert problems[-1].deterministic and problems[-1].bounds.right == 0
    _close(
        "scaled",
        ringflash.flash_attn_func(q, k, v, 0.0, 0.3),
        reference_attention(q, k, v, softmax_scale=0.3)[0],
    )
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    out = ringflash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 7, 7, 0.0, None, True)
    _close("varlen", out, reference_attention_packed(q, k, v, [0, 5, 12], causal=True)[0][0])


@pytest.mark.parametrize("variant", ["qkvpacked", "kvpacked", "varlen_qkvpacked", "varlen_kvpacked"])
def test_packed_variants_equal_unpacked(device, variant):
    """Each packed form gives the unpacked function's out and LSE, and its gradient is the
    unpacked q/k/v gradients stacked the same way (kv-packed with GQA, causal, window)."""
    hk = 2 if "qkv" in variant else 1  # kv-packed: GQA
    q, k, v, dout, _ = _inputs(1, 13, 13, 2, hk, 16, device, seed=3)
    kw = dict(causal=True, window_size=(6, -1), return_lse=True)
    varlen = variant.startswith("varlen")
    cu = torch.tensor([0, 4, 13], dtype=torch.int32, device=device)
    if varlen:
        q, k, v, dout = (t[0] for t in (q, k, v, dout))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if varlen:
        out, lse = ringflash.flash_attn_varlen_func(*leaves, cu, cu, 9, 9, **kw)
    else:
        out, lse = ringflash.flash_attn_func(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    stack = -3
    if "qkv" in variant:
        packed = torch.stack([q, k, v], stack).requires_grad_()
        args = (packed, cu, 9) if varlen else (packed,)
        expected_grad = torch.stack(grads, stack)
    else:
        packed = torch.stack([k, v], stack).requires_grad_()
        args = (q, packed, cu, cu, 9, 9) if varlen else (q, packed)
        expected_grad = torch.stack(grads[1:], stack)
    p_out, p_lse = getattr(ringflash, f"flash_attn_{variant}_func")(*args, **kw)
    (p_grad,) = torch.autograd.grad(p_out, packed, dout)
    assert torch.equal(p_out, out) and torch.equal(p_lse, lse)
    assert torch.equal(p_grad, expected_grad)


@pytest.mark.parametrize("head_dim", [59, 111])
def test_head_dims_not_multiples_of_8(device, head_dim):
    """Zero-padded internally: out, LSE and gradients of the caller's head_dim equal the float64
    reference, with the default scale 1/sqrt(head_dim); GQA, causal."""
    q, k, v, dout, dlse = _inputs(1, 11, 11, 2, 1, head_dim, device, seed=head_dim)

    def run(q, k, v):
        return ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)

    def ref(q, k, v):
        return reference_attention(q, k, v, causal=True)

    out, _ = _check(run, ref, (q, k, v), dout, dlse, ("dq", "dk", "dv"))
    assert out.shape[-1] == head_dim


def test_unsupported_arguments_are_refused(device):
    """Dropout and paged KV are refused with a clear error, as are ill-shaped packed tensors and
    sinks; head_dim above 256 names the limit."""
    q, k, v, _, _ = _inputs(1, 8, 8, 2, 2, 8, device)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"dropout_p=0.1: attention dropout is not implemented"):
        ringflash.flash_attn_func(q, k, v, 0.1)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        ringflash.flash_attn_func(q, k, v, "0.1")
    with pytest.raises(ValueError, match=r"block_table \(a paged KV cache\) is not supported"):
        ringflash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, block_table=cu)
    with pytest.raises(ValueError, match=r"qkv must be 5-D \(batch, seqlen, 3, heads, head_dim\)"):
        ringflash.flash_attn_qkvpacked_func(torch.stack([q, k], 2))
    with pytest.raises(ValueError, match=r"kv must be 4-D \(total_tokens, 2, heads, head_dim\)"):
        ringflash.flash_attn_varlen_kvpacked_func(q[0], k[0], cu, cu, 8, 8)
    with pytest.raises(ValueError, match=r"sinks must have shape \(heads_q,\) = \(2,\)"):
        ringflash.flash_attn_func(q, k, v, sinks=torch.zeros(3, device=device))
    with pytest.raises(TypeError, match="return_attn_probs and return_lse must be bools"):
        ringflash.flash_attn_func(q, k, v, return_lse=1)
    big = torch.zeros(1, 4, 1, 257, device=device)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\], got 257"):
        ringflash.flash_attn_func(big, big, big)


def test_bad_sinks_are_refused_before_any_kernel(device, monkeypatch):
    """sinks of the wrong shape, dtype or kind raise before the kernels run, not after a forward."""

    def kernels_run(*args, **kwargs):
        raise AssertionError("the kernels ran before sinks were checked")

    monkeypatch.setattr(functional, "flash_attention", kernels_run)
    q, k, v, _, _ = _inputs(1, 8, 8, 2, 2, 8, device)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    bad = {
        "shape": (torch.zeros(3, device=device), ValueError, r"sinks must have shape \(heads_q,\) = \(2,\)"),
        "dtype": (torch.zeros(2, dtype=torch.int32, device=device), TypeError, "floating-point"),
        "kind": ([0.0, 0.0], TypeError, "sinks must be a torch.Tensor"),
    }
    for sinks, exc, match in bad.values():
        with pytest.raises(exc, match=match):
            ringflash.flash_attn_func(q, k, v, sinks=sinks)
        with pytest.raises(exc, match=match):
            ringflash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, sinks=sinks)


def _reference_probs(q, k, cu=None, **kw):
    """Float64 attention probabilities (B, H, Sq, Sk): the reference's output for one-hot values."""
    sk = k.shape[1]
    eye = torch.eye(sk, dtype=torch.float64)[None, :, None, :].expand(k.shape[0], sk, k.shape[2], sk)
    if cu is None:
        return reference_attention(q, k, eye, **kw)[0].permute(0, 2, 1, 3)
    return reference_attention_packed(q, k, eye, cu, **kw)[0].permute(0, 2, 1, 3)


def test_return_attn_probs_are_the_real_probabilities(device):
    """(out, lse, probs) as flash-attn returns them, with every value right: probabilities of a
    causal, windowed GQA call with sinks (rows then sum to below 1), and of a varlen call, whose
    sequence i fills [i, :, :len_q, :len_k]."""
    q, k, v, _, _ = _inputs(2, 13, 13, 4, 2, 16, device, seed=5)
    sinks = _sinks(4, device)
    kw = dict(causal=True, window_size=(7, -1))
    out, lse, probs = ringflash.flash_attn_func(q, k, v, 0.0, None, return_attn_probs=True, sinks=sinks, **kw)
    ref_out, ref_lse = reference_attention(q, k, v, sinks=sinks, **kw)
    _close("out", out, ref_out)
    _close("lse", lse, ref_lse)
    assert probs.dtype == torch.float32 and probs.shape == (2, 4, 13, 13)
    _close("probs", probs, _reference_probs(q, k, sinks=sinks, **kw))
    assert (probs.sum(-1) < 0.95).all()  # the sinks take the rest of each row
    qv, kv_, vv = (t[:1] for t in (q, k, v))
    cu = torch.tensor([0, 4, 13], dtype=torch.int32, device=device)
    out, lse, probs = ringflash.flash_attn_varlen_func(
        qv[0], kv_[0], vv[0], cu, cu, 10, 9, return_attn_probs=True
    )
    ref_probs = _reference_probs(qv, kv_, [0, 4, 13])[0]
    assert probs.shape == (2, 4, 10, 9)
    _close("varlen probs 0", probs[0, :, :4, :4], ref_probs[:, :4, :4])
    _close("varlen probs 1", probs[1, :, :9, :9], ref_probs[:, 4:, 4:])
    assert (probs[0, :, 4:] == 0).all() and (probs[0, :, :, 4:] == 0).all() and (probs[1, :, 9:] == 0).all()


# --------------------------------------------------------------------------------------------
# differentiable LSE and attention sinks


def test_lse_gradient_matches_float64(device):
    """Backpropagating through the returned LSE (as well as out) gives the exact gradients, also
    for rows that see no key (causal with seqlen_q > seqlen_k), with GQA; and through the LSE alone."""
    q, k, v, dout, dlse = _inputs(1, 17, 9, 4, 2, 16, device)

    def run(q, k, v):
        return ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)

    def ref(q, k, v):
        return reference_attention(q, k, v, causal=True)

    _, lse = _check(run, ref, (q, k, v), dout, dlse, ("dq", "dk", "dv"))
    assert torch.isneginf(lse).any()  # some rows see no key
    # The LSE alone (out unused: its gradient is None in the backward).
    leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
    dq, dk = torch.autograd.grad(run(*leaves, v)[1], leaves, dlse)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k)]
    ref_dq, ref_dk = torch.autograd.grad(ref(*ref_leaves, v)[1], ref_leaves, dlse.double().cpu())
    _close("dq (lse only)", dq, ref_dq)
    _close("dk (lse only)", dk, ref_dk)


@pytest.mark.parametrize(
    ("sq", "sk", "causal", "window", "varlen"),
    [
        (16, 16, True, (-1, -1), False),
        (13, 6, True, (-1, -1), False),
        (12, 12, False, (5, 2), False),
        (13, 13, True, (6, -1), True),
    ],
    ids=["causal", "causal-empty-rows", "window", "varlen"],
)
def test_sinks_match_float64(device, sq, sk, causal, window, varlen):
    """sinks= through the public functions: out, LSE, dq, dk, dv and dsinks against the float64
    reference with GQA; the sinks are large enough to change the answer."""
    q, k, v, dout, dlse = _inputs(1, sq, sk, 4, 2, 16, device, seed=sq)
    sinks = _sinks(4, device)
    kw = dict(causal=causal, window_size=window)
    cu_list = [0, 5, 13]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)

    def run(q, k, v, sinks):
        if varlen:
            out, lse = ringflash.flash_attn_varlen_func(
                q[0], k[0], v[0], cu, cu, 8, 8, sinks=sinks, return_lse=True, **kw
            )
            return out[None], lse[None]
        return ringflash.flash_attn_func(q, k, v, sinks=sinks, return_lse=True, **kw)

    def ref(q, k, v, sinks):
        if varlen:
            return reference_attention_packed(q, k, v, cu_list, sinks=sinks, **kw)
        return reference_attention(q, k, v, sinks=sinks, **kw)

    out, lse = _check(run, ref, (q, k, v, sinks), dout, dlse, ("dq", "dk", "dv", "dsinks"))
    assert rel_err(out, ref(q, k, v, None)[0]) > 0.1  # the sinks matter
    empty = torch.isneginf(ref(q, k, v, None)[1])
    assert torch.equal(lse[empty], sinks[None, :, None].expand_as(lse)[empty])
    assert (out.transpose(1, 2)[empty] == 0).all()


@pytest.mark.parametrize("varlen", [False, True])
def test_sinks_on_the_merge_boundaries_match_float64(device, varlen):
    """Sinks that put the merge exactly on a boundary, through the public functions, the loss
    reading out and LSE: -inf and -1e4 (the sink's term is 0, so a row's denominator is exactly
    its keys' 1), one equal to a row's LSE (a tie in the row max), and rows that see no key
    (causal, more queries than keys: the sink's 1 alone). A merge whose gradient rests on what
    an operator passes at a boundary or tie (clamp_min(1.0) did until torch 2.15 stopped) fails
    here on some torch release: out, LSE, dq, dk, dv and dsinks against float64."""
    q, k, v, dout, dlse = _inputs(1, 13, 6, 4, 2, 16, device, seed=5)
    cu_q, cu_k = [0, 7, 13], [0, 3, 6]

    def run(q, k, v, sinks):
        if varlen:
            cq, ck = (torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k))
            out, lse = ringflash.flash_attn_varlen_func(
                q[0], k[0], v[0], cq, ck, 7, 3, causal=True, sinks=sinks, return_lse=True
            )
            return out[None], lse[None]
        return ringflash.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_lse=True)

    def ref(q, k, v, sinks):
        if not varlen:
            return reference_attention(q, k, v, causal=True, sinks=sinks)
        parts = [
            reference_attention(q[:, a:b], k[:, c:d], v[:, c:d], causal=True, sinks=sinks)
            for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])
        ]
        return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 2)

    lse = run(q.detach().requires_grad_(), k, v, None)[1].detach()  # the kernels of the calls below
    assert torch.isneginf(lse).any()  # rows that see no key
    tie = lse[0, 2][torch.isfinite(lse[0, 2])][-1].item()
    sinks = torch.tensor([float("-inf"), -1e4, tie, 2.5], device=device)
    _, lse_s = _check(run, ref, (q, k, v, sinks), dout, dlse, ("dq", "dk", "dv", "dsinks"))
    seen = torch.isfinite(lse[:, :2])  # rows with keys: a sink of -inf or -1e4 adds exactly nothing
    assert torch.equal(lse_s[:, :2][seen], lse[:, :2][seen])


def test_merge_sinks_edge_cases(device):
    """A row with no key and a -inf sink stays out 0, lse -inf with finite gradients; half-precision
    sinks get a gradient of their own dtype; bad sinks are refused by name."""
    out = torch.randn(1, 3, 2, 8, device=device)
    lse = torch.tensor([[[0.5, float("-inf"), float("-inf")], [1.0, 2.0, float("-inf")]]], device=device)
    out[0, 1:, 0] = 0
    out[0, 2, 1] = 0
    out, lse = (t.requires_grad_() for t in (out, lse))
    sinks = torch.tensor([float("-inf"), 0.25], device=device, dtype=torch.float16, requires_grad=True)
    out_s, lse_s = merge_sinks(out, lse, sinks)
    assert torch.isneginf(lse_s[0, 0, 1:]).all() and (out_s[0, 1:, 0] == 0).all()
    assert torch.equal(out_s[0, :, 0], out[0, :, 0].detach())  # a -inf sink changes nothing
    assert lse_s[0, 1, 2].item() == 0.25
    (out_s.sum() + lse_s[torch.isfinite(lse_s)].sum()).backward()
    assert sinks.grad.dtype == torch.float16
    assert all(torch.isfinite(t.grad).all() for t in (out, sinks))
    assert not lse.grad.isnan().any()
    with pytest.raises(ValueError, match=r"sinks must have shape \(heads_q,\) = \(2,\)"):
        merge_sinks(out, lse, sinks[:1])
    with pytest.raises(TypeError, match="sinks must be a floating-point tensor"):
        merge_sinks(out, lse, torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="merge_sinks needs out"):
        merge_sinks(out, lse.transpose(1, 2), sinks)


# --------------------------------------------------------------------------------------------
# softcap and ALiBi through the public functions


@pytest.mark.parametrize(
    ("feature", "varlen"),
    [("softcap", False), ("alibi", False), ("alibi-batch", False), ("all", True)],
    ids=["softcap", "alibi", "alibi-batch", "varlen-softcap-alibi-sinks"],
)
def test_softcap_and_alibi_match_float64(device, feature, varlen):
    """softcap= and alibi_slopes= as in flash-attn: out, LSE and every gradient against float64,
    with GQA and causal (plus a window or packed sequences); scores large enough for the cap to
    bite and slopes large enough to matter. The probabilities of return_attn_probs too."""
    b = 2 if feature == "alibi-batch" else 1
    q, k, v, dout, dlse = _inputs(b, 13, 13, 4, 2, 16, device, seed=7, scale=2.5)
    kw = dict(causal=True, window_size=(8, -1) if feature == "alibi-batch" else (-1, -1))
    if feature in ("softcap", "all"):
        kw["softcap"] = 1.5
    if feature in ("alibi", "all"):
        kw["alibi_slopes"] = torch.tensor([0.9, 0.5, 0.25, 0.125], device=device)
    if feature == "alibi-batch":
        kw["alibi_slopes"] = torch.tensor([[0.9, 0.5, 0.3, 0.1], [0.05, 0.2, 0.4, 0.7]], device=device)
    sinks = _sinks(4, device) if varlen else None
    cu_list = [0, 6, 13]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)

    def run(q, k, v):
        if varlen:
            out, lse = ringflash.flash_attn_varlen_func(
                q[0], k[0], v[0], cu, cu, 7, 7, sinks=sinks, return_lse=True, **kw
            )
            return out[None], lse[None]
        return ringflash.flash_attn_func(q, k, v, return_lse=True, **kw)

    def ref(q, k, v, **extra):
        ref_kw = {**kw, "sinks": sinks, **extra}
        if varlen:
            return reference_attention_packed(q, k, v, cu_list, **ref_kw)
        return reference_attention(q, k, v, **ref_kw)

    out, _ = _check(run, ref, (q, k, v), dout, dlse, ("dq", "dk", "dv"))
    plain = ref(q, k, v, softcap=0.0, alibi_slopes=None)[0]
    assert rel_err(out, plain) > 0.1  # the features change the answer
    if varlen:
        probs = ringflash.flash_attn_varlen_func(
            q[0], k[0], v[0], cu, cu, 7, 7, return_attn_probs=True, sinks=sinks, **kw
        )[2]
        ref_probs = _reference_probs(q, k, cu_list, sinks=sinks, **kw)[0]
        _close("probs 0", probs[0, :, :6, :6], ref_probs[:, :6, :6])
        _close("probs 1", probs[1], ref_probs[:, 6:, 6:])
    else:
        probs = ringflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)[2]
        _close("probs", probs, _reference_probs(q, k, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_everything_at_once_in_half_precision_on_gpu(dtype):
    """bf16/fp16 at a real size: head_dim 111 (padded), GQA, causal with a window, softcap, ALiBi
    and sinks through flash_attn_func, and the same sequences packed through the varlen form."""
    q, k, v, dout, dlse = _inputs(2, 1000, 1000, 8, 2, 111, "cuda", seed=11, scale=2.0, dtype=dtype)
    slopes = torch.linspace(0.01, 0.2, 8, device="cuda")
    sinks = _sinks(8, "cuda")
    kw = dict(causal=True, window_size=(300, -1), softcap=5.0, alibi_slopes=slopes)

    def run(q, k, v, sinks):
        return ringflash.flash_attn_func(q, k, v, sinks=sinks, return_lse=True, **kw)

    def ref(q, k, v, sinks):
        return reference_attention(q, k, v, sinks=sinks, **kw)

    names = ("dq", "dk", "dv", "dsinks")
    out, lse = _check(run, ref, (q, k, v, sinks), dout, dlse, names, tol=TOLERANCE[dtype])
    cu = torch.tensor([0, 1000, 2000], dtype=torch.int32, device="cuda")
    packed = [t.reshape(2000, *t.shape[2:]) for t in (q, k, v)]
    out_v, lse_v = ringflash.flash_attn_varlen_func(
        *packed, cu, cu, 1000, 1000, sinks=sinks, return_lse=True, **kw
    )
    _close("varlen out", out_v, out.reshape(2000, 8, 111), TOLERANCE[dtype])
    _close("varlen lse", lse_v, lse.transpose(0, 1).reshape(8, 2000), TOLERANCE[dtype])
