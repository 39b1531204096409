"""The Triton kernels against float64 attention: out, LSE, dq, dk, dv on fresh random inputs.

On the CPU the kernels run under the Triton interpreter with 16x16 tiles at these lengths
(``configs.interpreter_tile_rows``), so short lengths (1, 15, 16, 17, 33) already cross tile
boundaries and exercise the masked and mask-free tile paths. Half precision is float16 here: the
interpreter's bf16 ``tl.dot`` is not trustworthy, so bfloat16 runs only in the GPU-marked tests.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import triton
import triton.language as tl
from reference import TOLERANCE, reference_attention, rel_err, visibility

import ringflash
from ringflash.kernels import (
    TokenPositions,
    attention_backward,
    attention_delta,
    attention_forward,
    build_problem,
)
from ringflash.kernels.configs import MAX_TILE_ROWS, interpreter_tile_rows
from ringflash.kernels.tiling import visible_tiles

# Under the interpreter an int32 overflow in a kernel raises here (tests/interpreter_patching.py).
pytestmark = pytest.mark.overflow_checks

HALF_AND_FULL = [torch.float32, torch.float16]
FULL = (-1, -1)


# --------------------------------------------------------------------------------------------
# helpers


def _randn(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype)


def _inputs(b, sq, sk, h, hk, d, dtype, device, seed=0):
    """Fresh random q, k, v, dout in (batch, seqlen, heads, head_dim)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(_randn(g, (b, s, n, d), dtype, device) for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)))


def _positions(p: TokenPositions, n: int) -> torch.Tensor:
    p = p.resolved(n)
    return p.start + p.stride * torch.arange(n)


def assert_close(name, got, expected, tol):
    """Relative error under tol; where the exact answer is all ~0 (e.g. dq when every query sees
    at most one key) the relative error is meaningless and an absolute bound is used instead."""
    e = expected.detach().double().cpu()
    finite = torch.isfinite(e)
    if e[finite].norm() <= 1e-8:
        a = got.detach().double().cpu()
        assert torch.equal(torch.isfinite(a), finite), f"{name}: non-finite entries differ"
        assert torch.equal(a[~finite], e[~finite]), f"{name}: -inf entries differ"
        worst = a[finite].abs().max().item() if finite.any() else 0.0
        assert worst < tol, f"{name}: expected ~0, got max |x| {worst:.2e}"
        return
    err = rel_err(got, expected)
    assert err < tol, f"{name}: rel err {err:.2e} >= {tol:.0e}"


def _reference_grads(q, k, v, dout, **kw):
    """reference_attention on float64 CPU leaf copies; returns out, lse, (dq, dk, dv)."""
    qd, kd, vd = (t.detach().to("cpu", torch.float64).requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(qd, kd, vd, **kw)
    out.backward(dout.detach().to("cpu", torch.float64))
    return out, lse, (qd.grad, kd.grad, vd.grad)


def _device_reference(q, k, v, causal=False, window_size=FULL, softmax_scale=None):
    """reference_attention's math in float64 on q's device, for GPU sizes (differentiable)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kd = k.double().repeat_interleave(h // hk, dim=2)
    vd = v.double().repeat_interleave(h // hk, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kd) * scale
    vis = visibility(torch.arange(sq) + (sk - sq), torch.arange(sk), causal, window_size).to(q.device)
    scores = scores.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float64).min))
    return torch.einsum("bhqk,bkhd->bqhd", probs, vd), lse


def check_against_reference(q, k, v, dout, causal=False, window=FULL, scale=None, tol=None, on_device=False):
    """flash_attn_func's out, LSE and gradients against the float64 reference.

    Also checks the exact zeros the kernels promise: rows that see no key give out 0, LSE -inf
    and dq 0; keys that no query sees get dk = dv = 0. Returns (out, lse, (dq, dk, dv)).
    """
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # detach keeps the strides
    out, lse = ringflash.flash_attn_func(
        q, k, v, softmax_scale=scale, causal=causal, window_size=window, return_lse=True
    )
    b, sq, h, d = q.shape
    sk = k.shape[1]
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if on_device:
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = _device_reference(qd, kd, vd, causal, window, scale)
        ref_out.backward(dout.double())
        ref_grads = (qd.grad, kd.grad, vd.grad)
    else:
        ref_out, ref_lse, ref_grads = _reference_grads(
            q, k, v, dout, causal=causal, window_size=window, softmax_scale=scale
        )
    tol = tol or TOLERANCE[q.dtype]
    for name, got, exp in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)
    ):
        assert got.shape == exp.shape, name
        assert_close(name, got, exp, tol)
    vis = visibility(torch.arange(sq) + (sk - sq), torch.arange(sk), causal, window)
    blind_q, unseen_k = ~vis.any(1), ~vis.any(0)
    if blind_q.any():
        assert (out[:, blind_q] == 0).all() and torch.isneginf(lse[:, :, blind_q]).all()
        assert (grads[0][:, blind_q] == 0).all()
    if unseen_k.any():
        assert (grads[1][:, unseen_k] == 0).all() and (grads[2][:, unseen_k] == 0).all()
    assert torch.isfinite(lse[:, :, ~blind_q]).all()
    assert all(torch.isfinite(g).all() for g in grads)
    return out, lse, grads


# --------------------------------------------------------------------------------------------
# flash_attn_func against the reference

CASES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window, softmax_scale)
    (2, 17, 17, 2, 2, 16, False, FULL, None),  # one past a 16-row tile, batch 2
    (1, 16, 32, 2, 2, 16, False, FULL, None),  # exactly one and two tiles
    (1, 1, 1, 1, 1, 8, False, FULL, None),  # a single token
    (1, 1, 33, 2, 1, 8, True, FULL, None),  # one query sees every key (bottom-right causal)
    (1, 33, 1, 2, 2, 16, True, FULL, None),  # one key: only the last query sees it
    (1, 15, 15, 3, 1, 24, True, FULL, None),  # MQA, one short of a tile
    (2, 33, 33, 4, 2, 24, True, FULL, None),  # GQA, head_dim not a power of two
    (1, 15, 40, 4, 1, 40, True, FULL, None),  # MQA, seqlen_q < seqlen_k
    (1, 40, 15, 2, 2, 32, True, FULL, None),  # seqlen_q > seqlen_k: the first 25 rows see no key
    (1, 48, 48, 2, 2, 16, False, (5, 3), None),  # sliding window, both sides
    (1, 33, 33, 2, 2, 16, False, (8, 4), None),
    (1, 33, 33, 4, 2, 16, True, (8, 4), None),  # causal clamps the right side to 0
    (1, 50, 50, 2, 1, 16, True, (7, -1), None),  # causal sliding window
    (1, 33, 33, 2, 2, 16, False, (3, 0), None),
    (1, 33, 17, 2, 2, 16, True, (3, 0), None),  # causal window, seqlen_q > seqlen_k
    (1, 20, 37, 2, 2, 16, False, (3, 0), None),  # window, seqlen_q < seqlen_k: early keys unseen
    (1, 37, 20, 2, 1, 16, False, (8, 4), None),  # window, seqlen_q > seqlen_k: early rows blind
    (1, 17, 33, 2, 2, 16, False, (-1, 0), None),  # right bound only: causal by another name
    (1, 33, 17, 2, 2, 16, False, (0, -1), None),  # left bound 0: keys at or after the query
    (2, 17, 33, 4, 2, 40, True, FULL, 0.5),  # softmax_scale given
    (1, 33, 33, 2, 2, 24, False, (6, 2), 1.7),  # large scale with a window
]


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_attention_matches_reference(device, case, dtype):
    b, sq, sk, h, hk, d, causal, window, scale = case
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, dtype, device, seed=sq * 100 + sk)
    check_against_reference(q, k, v, dout, causal, window, scale)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
@pytest.mark.parametrize("head_dim", [8, 24, 40, 64, 80, 128, 256])
def test_head_dims(device, head_dim, dtype):
    causal = head_dim in (8, 40, 80, 256)
    q, k, v, dout = _inputs(1, 17, 20, 2, 1, head_dim, dtype, device, seed=head_dim)
    check_against_reference(q, k, v, dout, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 15, 16, 17, 33])
def test_lengths_around_tiles(device, seqlen_q, causal):
    for seqlen_k in (1, 15, 16, 17, 33):
        q, k, v, dout = _inputs(1, seqlen_q, seqlen_k, 1, 1, 16, torch.float32, device, seed=seqlen_k)
        check_against_reference(q, k, v, dout, causal=causal)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
@pytest.mark.parametrize(
    ("sq", "sk", "causal", "window", "blind"),
    [
        (24, 8, True, FULL, 16),
        (40, 7, True, FULL, 33),
        (30, 12, False, (2, 0), 18),
        (20, 20, False, (-1, -1), 0),
    ],
)
def test_fully_masked_rows(device, dtype, sq, sk, causal, window, blind):
    """Rows that see no key: out exactly 0, LSE -inf, dq 0, no NaN anywhere (also in the grads)."""
    q, k, v, dout = _inputs(2, sq, sk, 2, 1, 16, dtype, device, seed=sq + sk)
    out, lse, (dq, dk, dv) = check_against_reference(q, k, v, dout, causal, window)
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()
    assert (out[:, :blind] == 0).all() and (dq[:, :blind] == 0).all()
    assert (out[:, blind:].abs().amax(-1) > 0).all()
    assert not any(torch.isnan(t).any() for t in (out, lse, dq, dk, dv))


@pytest.mark.parametrize(("sq", "sk"), [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(device, sq, sk):
    q, k, v, dout = _inputs(2, sq, sk, 2, 1, 16, torch.float32, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 2, sq)
    assert (out == 0).all() and torch.isneginf(lse).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all((g == 0).all() for g in (dq, dk, dv))


def test_single_visible_key_copies_value(device):
    """window (0, 0): each query sees only its own key, so out = v, LSE = its score, dq = dk = 0."""
    q, k, v, dout = _inputs(1, 20, 20, 2, 2, 16, torch.float32, device, seed=5)
    _, _, (ref_dq, ref_dk, ref_dv) = _reference_grads(q, k, v, dout, window_size=(0, 0))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringflash.flash_attn_func(q, k, v, window_size=(0, 0), return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.allclose(out, v, atol=1e-6)
    assert torch.allclose(lse, (q * k).sum(-1).transpose(1, 2) / 4.0, atol=1e-5)
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5
    assert torch.allclose(dv, dout, atol=1e-6)
    assert ref_dq.abs().max() < 1e-12 and rel_err(dv, ref_dv) < 1e-6


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
def test_large_scores_stay_finite(device, dtype):
    """Scores in the hundreds: the running max keeps exp from overflowing."""
    q, k, v, dout = _inputs(1, 33, 40, 2, 1, 32, dtype, device, seed=9)
    q = q * 8.0
    out, lse, _ = check_against_reference(q, k, v, dout, causal=True, scale=1.0)
    assert lse.abs().max() > 100


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
def test_noncontiguous_inputs(device, dtype):
    """q, k, v as slices of one packed qkv tensor (GQA), dout a slice of a wider tensor."""
    g = torch.Generator().manual_seed(7)
    h, hk, d = 4, 2, 32
    qkv = _randn(g, (2, 21, h + 2 * hk, d), dtype, device)
    q, k, v = qkv.split([h, hk, hk], dim=2)
    dout = _randn(g, (2, 21, h, 2 * d), dtype, device)[..., :d]
    assert not any(t.is_contiguous() for t in (q, k, v, dout))
    check_against_reference(q, k, v, dout, causal=True, scale=0.3)


def test_dout_with_strided_last_dim(device):
    q, k, v, _ = _inputs(1, 17, 17, 2, 2, 16, torch.float32, device, seed=4)
    dout = _inputs(1, 17, 17, 2, 2, 16, torch.float32, device, seed=44)[0]
    dout_t = dout.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride(-1) != 1
    assert dout_t.stride(-1) != 1
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ringflash.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout_t)
    _, _, ref_grads = _reference_grads(q, k, v, dout, causal=True)
    for name, got, exp in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, got, exp, 1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_offsets_past_2_to_the_31_elements(device, causal):
    """Every tensor a view whose rows lie past 2^31 elements from its start (the largest token
    stride check_token_stride allows, 192 tokens: rows 129-191 lie past it, and the interpreter's
    32-row tile at 160 starts past it): 32-bit offsets would wrap and read or write the wrong rows.
    One shared, mostly untouched storage (6.4 GB of fp16, virtual on the CPU) holds the eight
    tensors side by side in each token's row."""
    s, h, hk, d = 192, 2, 1, 64
    stride = (2**31 - 1 - d) // MAX_TILE_ROWS
    assert (s - 1) * stride > 2**31
    if device == "cpu":  # the interpreter's last tile starts past 2^31 elements, too
        assert (s - interpreter_tile_rows(s)) * stride > 2**31
    storage = torch.empty(s * stride, dtype=torch.float16, device=device)
    col = 0

    def view(heads):
        nonlocal col
        t = storage.as_strided((1, s, heads, d), (s * stride, stride, d, 1), col)
        col += heads * d
        return t

    names = ("q", "k", "v", "dout", "out", "dq", "dk", "dv")
    views = dict(zip(names, (view(n) for n in (h, hk, hk, h, h, h, hk, hk))))
    q, k, v, dout = _inputs(1, s, s, h, hk, d, torch.float16, device, seed=31)
    for name, t in zip(names, (q, k, v, dout)):
        views[name].copy_(t)
    prob = build_problem(views["q"], views["k"], views["v"], None, causal, FULL)
    out, lse = attention_forward(views["q"], views["k"], views["v"], prob, out=views["out"])
    delta = attention_delta(out, views["dout"], prob)
    grads = attention_backward(
        views["dout"], views["q"], views["k"], views["v"], lse, delta, prob,
        dq=views["dq"], dk=views["dk"], dv=views["dv"],
    )  # fmt: skip
    assert out.data_ptr() == views["out"].data_ptr() and grads[1].data_ptr() == views["dk"].data_ptr()
    ref_out, ref_lse, ref_grads = _reference_grads(q, k, v, dout, causal=causal)
    expected = (ref_out, ref_lse, *ref_grads)
    for name, got, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected):
        assert_close(name, got, exp, TOLERANCE[torch.float16])


def test_return_lse_false_and_determinism(device):
    q, k, v, dout = _inputs(2, 33, 20, 2, 1, 24, torch.float32, device, seed=21)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ringflash.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    out2, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, out2) and lse.requires_grad  # the LSE is differentiable
    g1 = torch.autograd.grad(out, (q, k, v), dout)
    g2 = torch.autograd.grad(out2, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2)), "backward must be deterministic"
    assert all(g.abs().max() > 0 for g in g1)


def test_device_reference_matches_reference():
    """The on-device float64 reference used by the GPU tests is the CPU reference."""
    q, k, v, dout = _inputs(2, 19, 23, 4, 2, 16, torch.float64, "cpu", seed=8)
    for causal, window in ((False, FULL), (True, FULL), (False, (3, 2)), (True, (5, -1))):
        qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = _device_reference(qd, kd, vd, causal, window, 0.4)
        out.backward(dout)
        ref_out, ref_lse, ref_grads = _reference_grads(q, k, v, dout, causal=causal, window_size=window,
                                                       softmax_scale=0.4)  # fmt: skip
        for got, exp in zip((out, lse, qd.grad, kd.grad, vd.grad), (ref_out, ref_lse, *ref_grads)):
            assert rel_err(got, exp) < 1e-12


# --------------------------------------------------------------------------------------------
# varlen


def _cu(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def check_varlen(q, k, v, dout, lens_q, lens_k, causal, window, max_q=None, max_k=None):
    """flash_attn_varlen_func against the reference run on each sequence separately."""
    device = q.device
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = ringflash.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q or max(lens_q), max_k or max(lens_k), causal=causal, window_size=window,
        return_lse=True,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    tol = TOLERANCE[q.dtype]
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs = slice(cu_q[i].item(), cu_q[i + 1].item())
        ks = slice(cu_k[i].item(), cu_k[i + 1].item())
        if lq == 0:  # keys nobody queries: zero gradient
            assert (dk[ks] == 0).all() and (dv[ks] == 0).all()
            continue
        if lk == 0:  # queries with nothing to attend to
            assert (out[qs] == 0).all() and torch.isneginf(lse[:, qs]).all() and (dq[qs] == 0).all()
            continue
        ref_out, ref_lse, ref_grads = _reference_grads(
            q[qs][None], k[ks][None], v[ks][None], dout[qs][None], causal=causal, window_size=window
        )
        got = (out[qs][None], lse[:, qs][None], dq[qs][None], dk[ks][None], dv[ks][None])
        for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, (ref_out, ref_lse, *ref_grads)):
            assert_close(f"seq {i} {name}", g, e, tol)
    assert all(torch.isfinite(g).all() for g in (out, dq, dk, dv))


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
@pytest.mark.parametrize(
    ("causal", "window"), [(False, FULL), (True, FULL), (True, (6, -1)), (False, (3, 1))], ids=str
)
def test_varlen_matches_per_sequence_reference(device, dtype, causal, window):
    # A length-0 query side (keys unused), a length-0 key side (blind queries), a length-1
    # sequence, seqlen_q > seqlen_k and < seqlen_k, and lengths on and just past a tile.
    lens_q = [5, 17, 0, 1, 33, 3, 16, 9]
    lens_k = [5, 20, 3, 2, 30, 0, 16, 1]
    g = torch.Generator().manual_seed(3)
    h, hk, d = 2, 1, 24
    q, dout = (_randn(g, (sum(lens_q), h, d), dtype, device) for _ in range(2))
    k, v = (_randn(g, (sum(lens_k), hk, d), dtype, device) for _ in range(2))
    check_varlen(q, k, v, dout, lens_q, lens_k, causal, window)


def test_varlen_noncontiguous_and_loose_max_seqlen(device):
    """Slices of a packed qkv; max_seqlen larger than the longest sequence is allowed."""
    lens = [7, 0, 18, 1]
    g = torch.Generator().manual_seed(12)
    qkv = _randn(g, (sum(lens), 3 * 2, 16), torch.float32, device)
    q, k, v = qkv.split([2, 2, 2], dim=1)
    dout = _randn(g, (sum(lens), 2, 32), torch.float32, device)[..., ::2]  # strided last dim too
    check_varlen(q, k, v, dout, lens, lens, True, FULL, max_q=40, max_k=25)


def test_varlen_single_sequence_equals_dense(device):
    q, k, v, dout = _inputs(1, 29, 35, 4, 1, 16, torch.float32, device, seed=13)
    out_d, lse_d = ringflash.flash_attn_func(q, k, v, causal=True, window_size=(9, -1), return_lse=True)
    out_v, lse_v = ringflash.flash_attn_varlen_func(
        q[0], k[0], v[0], _cu([29], device), _cu([35], device), 29, 35, causal=True, window_size=(9, -1),
        return_lse=True,
    )  # fmt: skip
    assert torch.allclose(out_v, out_d[0], atol=1e-6) and torch.allclose(lse_v, lse_d[0], atol=1e-6)


# --------------------------------------------------------------------------------------------
# low-level calls with explicit token positions


def _low_level_reference(q, k, v, dout, q_pos, k_pos, causal, window, scale=None):
    qp, kp = _positions(q_pos, q.shape[1]), _positions(k_pos, k.shape[1])
    return _reference_grads(
        q, k, v, dout, causal=causal, window_size=window, softmax_scale=scale, q_pos=qp, k_pos=kp
    )


def check_positions(q, k, v, dout, q_pos, k_pos, causal, window, scale=None):
    """attention_forward/_delta/_backward with explicit positions against the reference."""
    prob = build_problem(q, k, v, scale, causal, window, q_positions=q_pos, k_positions=k_pos)
    out, lse = attention_forward(q, k, v, prob)
    delta = attention_delta(out, dout, prob)
    grads = attention_backward(dout, q, k, v, lse, delta, prob)
    ref_out, ref_lse, ref_grads = _low_level_reference(q, k, v, dout, q_pos, k_pos, causal, window, scale)
    tol = TOLERANCE[q.dtype]
    for name, got, exp in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)
    ):
        assert_close(name, got, exp, tol)
    vis = visibility(_positions(q_pos, q.shape[1]), _positions(k_pos, k.shape[1]), causal, window)
    assert (out[:, ~vis.any(1)] == 0).all() and torch.isneginf(lse[:, :, ~vis.any(1)]).all()
    assert (grads[1][:, ~vis.any(0)] == 0).all() and (grads[2][:, ~vis.any(0)] == 0).all()
    return out, lse, grads


POSITION_CASES = [  # (q positions, k positions, causal, window)
    (TokenPositions(2, 3), TokenPositions(0, 3), True, FULL),  # stripe layout: keys from an earlier rank
    (TokenPositions(0, 3), TokenPositions(1, 3), True, FULL),  # keys from a later rank: strictly below
    (TokenPositions(1, 3), TokenPositions(1, 3), True, FULL),  # the diagonal step
    (TokenPositions(2, 3), TokenPositions(0, 3), False, FULL),
    (TokenPositions(1, 3), TokenPositions(2, 3), True, (7, -1)),  # stripe with a causal window
    (TokenPositions(0, 3), TokenPositions(2, 3), False, (4, 4)),
    (TokenPositions(40, 1), TokenPositions(16, 1), False, (20, 0)),  # window reaching back
    (TokenPositions(100, 1), TokenPositions(30, 1), True, FULL),  # zigzag: a fully visible block
    (TokenPositions(30, 1), TokenPositions(100, 1), True, FULL),  # a block nobody sees
    (TokenPositions(5, 2), TokenPositions(0, 1), False, (4, 4)),  # strides differ, late rows blind
    (TokenPositions(-10, 1), TokenPositions(0, 2), True, (9, -1)),  # negative positions
]


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
@pytest.mark.parametrize(("q_pos", "k_pos", "causal", "window"), POSITION_CASES)
def test_positions_match_reference(device, dtype, q_pos, k_pos, causal, window):
    q, k, v, dout = _inputs(1, 23, 29, 4, 2, 16, dtype, device, seed=abs(q_pos.start + 7 * k_pos.start))
    check_positions(q, k, v, dout, q_pos, k_pos, causal, window)


def _random_position_cases(n, seed=1234):
    rng = random.Random(seed)
    windows = [FULL, (0, 0), (3, 0), (8, 4), (2, 5), (-1, 6), (10, -1)]
    cases = []
    for _ in range(n):
        stride = rng.randint(1, 3)
        q_pos = TokenPositions(rng.randint(-20, 50), stride)
        k_pos = TokenPositions(rng.randint(-20, 50), stride if rng.random() < 0.7 else rng.randint(1, 3))
        cases.append(
            (q_pos, k_pos, rng.randint(1, 40), rng.randint(1, 40), rng.random() < 0.5, rng.choice(windows))
        )
    return cases


@pytest.mark.parametrize(("q_pos", "k_pos", "sq", "sk", "causal", "window"), _random_position_cases(24))
def test_random_positions_match_reference(device, q_pos, k_pos, sq, sk, causal, window):
    q, k, v, dout = _inputs(1, sq, sk, 2, 1, 16, torch.float32, device, seed=sq * 41 + sk)
    check_positions(q, k, v, dout, q_pos, k_pos, causal, window, scale=0.35)


# Packed documents in a ring: every document contributes chunk a of its queries and chunk b of
# its keys, so each sequence's offsets scale with its own length (per_len).
PER_LEN_CASES = [  # (q positions, k positions, causal, window)
    (TokenPositions(0, 1, per_len=3), TokenPositions(0, 1, per_len=3), True, FULL),  # diagonal chunk
    (TokenPositions(0, 1, per_len=5), TokenPositions(0, 1, per_len=2), True, FULL),  # earlier chunk
    (TokenPositions(0, 1, per_len=1), TokenPositions(0, 1, per_len=0), True, (6, -1)),  # window reaching back
    (TokenPositions(2, 4), TokenPositions(1, 4), True, FULL),  # stripe: no per-sequence shift
    (TokenPositions(0, 1, per_len=-1), TokenPositions(0, 1, per_len=-1), True, (3, 2)),  # bottom-right
]


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
@pytest.mark.parametrize(("q_pos", "k_pos", "causal", "window"), PER_LEN_CASES)
def test_varlen_per_sequence_positions(device, dtype, q_pos, k_pos, causal, window):
    """Explicit positions in a varlen call are relative to each sequence, and per_len scales
    with that sequence's length: each sequence equals its own reference at resolved positions."""
    lens = [8, 19, 1, 32, 5]
    g = torch.Generator().manual_seed(41)
    q, k, v, dout = (_randn(g, (sum(lens), h, 16), dtype, device) for h in (4, 2, 2, 4))
    cu = _cu(lens, device)
    prob = build_problem(q, k, v, None, causal, window, q_positions=q_pos, k_positions=k_pos,
                         cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=32, max_seqlen_k=32)  # fmt: skip
    out, lse = attention_forward(q, k, v, prob)
    grads = attention_backward(dout, q, k, v, lse, attention_delta(out, dout, prob), prob)
    for i, n in enumerate(lens):
        s = slice(cu[i].item(), cu[i + 1].item())
        args = [t[s][None] for t in (q, k, v, dout)]
        ref_out, ref_lse, ref_grads = _low_level_reference(*args, q_pos, k_pos, causal, window)
        got = (out[s][None], lse[:, s][None], *(t[s][None] for t in grads))
        for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, (ref_out, ref_lse, *ref_grads)):
            assert_close(f"seq {i} (len {n}) {name}", a, e, TOLERANCE[dtype])


def test_per_len_equals_resolved_start(device):
    """Dense calls: per_len is the block's length times a factor, folded into start."""
    q, k, v, dout = _inputs(2, 21, 21, 2, 1, 16, torch.float32, device, seed=43)
    results = []
    for q_pos, k_pos in (
        (TokenPositions(0, 1, per_len=2), TokenPositions(5, 1, per_len=1)),
        (TokenPositions(42, 1), TokenPositions(26, 1)),
    ):
        prob = build_problem(q, k, v, None, True, (30, -1), q_positions=q_pos, k_positions=k_pos)
        out, lse = attention_forward(q, k, v, prob)
        results.append(
            (out, lse, *attention_backward(dout, q, k, v, lse, attention_delta(out, dout, prob), prob))
        )
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
def test_out_and_lse_buffers(device, dtype):
    """out= as a float32 view into a wider accumulator (the ring's layout) and lse= given."""
    q, k, v, dout = _inputs(1, 23, 29, 4, 2, 16, dtype, device, seed=17)
    q_pos, k_pos = TokenPositions(2, 3), TokenPositions(0, 3)
    prob = build_problem(q, k, v, None, True, FULL, q_positions=q_pos, k_positions=k_pos)
    acc = torch.full((1, 23, 4, 48), 7.0, device=device)
    out_buf = acc[..., 16:32]
    lse_buf = torch.full((1, 4, 23), 3.0, device=device)
    out, lse = attention_forward(q, k, v, prob, out=out_buf, lse=lse_buf)
    assert out.data_ptr() == out_buf.data_ptr() and lse.data_ptr() == lse_buf.data_ptr()
    assert out.dtype == torch.float32
    assert (acc[..., :16] == 7).all() and (acc[..., 32:] == 7).all(), "wrote outside the out view"
    ref_out, ref_lse, _ = _low_level_reference(q, k, v, dout, q_pos, k_pos, True, FULL)
    assert_close("out", out, ref_out, TOLERANCE[dtype])
    assert_close("lse", lse, ref_lse, TOLERANCE[dtype])
    out_native, _ = attention_forward(q, k, v, prob)
    assert out_native.dtype == dtype
    assert torch.allclose(out_native.float(), out, atol=2e-3 if dtype == torch.float16 else 1e-6)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
def test_accumulate_into_float32_buffers(device, dtype):
    q, k, v, dout = _inputs(1, 23, 29, 4, 2, 16, dtype, device, seed=11)
    q_pos, k_pos = TokenPositions(2, 3), TokenPositions(0, 3)
    prob = build_problem(q, k, v, None, True, (20, -1), q_positions=q_pos, k_positions=k_pos)
    out, lse = attention_forward(q, k, v, prob)
    delta = attention_delta(out, dout, prob)
    g = torch.Generator().manual_seed(0)
    fills = [_randn(g, t.shape, torch.float32, device) for t in (q, k, v)]
    bufs = [f.clone() for f in fills]
    ret = attention_backward(dout, q, k, v, lse, delta, prob, *bufs, accumulate=True)
    assert all(r.data_ptr() == b.data_ptr() for r, b in zip(ret, bufs))
    _, _, ref_grads = _low_level_reference(q, k, v, dout, q_pos, k_pos, True, (20, -1))
    for name, got, fill, exp in zip(("dq", "dk", "dv"), bufs, fills, ref_grads):
        assert_close(name, got - fill, exp, TOLERANCE[dtype])
    # Accumulating twice adds twice; accumulate=False overwrites.
    attention_backward(dout, q, k, v, lse, delta, prob, *bufs, accumulate=True)
    for name, got, fill, exp in zip(("dq", "dk", "dv"), bufs, fills, ref_grads):
        assert_close(name, (got - fill) / 2, exp, TOLERANCE[dtype])
    attention_backward(dout, q, k, v, lse, delta, prob, *bufs, accumulate=False)
    for name, got, exp in zip(("dq", "dk", "dv"), bufs, ref_grads):
        assert_close(name, got, exp, TOLERANCE[dtype])


def test_compute_dq_and_dkdv_separately(device):
    q, k, v, dout = _inputs(1, 33, 20, 4, 1, 16, torch.float32, device, seed=31)
    prob = build_problem(q, k, v, None, True, FULL)
    out, lse = attention_forward(q, k, v, prob)
    delta = attention_delta(out, dout, prob)
    bufs = [torch.full_like(t, 5.0) for t in (q, k, v)]
    attention_backward(dout, q, k, v, lse, delta, prob, *bufs, compute_dq=False)
    assert (bufs[0] == 5).all()
    attention_backward(dout, q, k, v, lse, delta, prob, *bufs, compute_dkdv=False)
    _, _, ref_grads = _reference_grads(q, k, v, dout, causal=True)
    for name, got, exp in zip(("dq", "dk", "dv"), bufs, ref_grads):
        assert_close(name, got, exp, 1e-4)


def test_one_kernel_launch_needs_only_its_buffers(device):
    q, k, v, dout = _inputs(1, 33, 20, 4, 2, 16, torch.float32, device, seed=32)
    prob = build_problem(q, k, v, None, True, FULL)
    out, lse = attention_forward(q, k, v, prob)
    delta = attention_delta(out, dout, prob)
    _, _, (ref_dq, ref_dk, ref_dv) = _reference_grads(q, k, v, dout, causal=True)
    dq = torch.ones_like(q)
    got = attention_backward(dout, q, k, v, lse, delta, prob, dq=dq, accumulate=True, compute_dkdv=False)
    assert got[0] is dq and got[1] is None and got[2] is None
    assert_close("dq", dq - 1, ref_dq, 1e-4)
    dk, dv = torch.ones_like(k), torch.ones_like(v)
    got = attention_backward(dout, q, k, v, lse, delta, prob, dk=dk, dv=dv, accumulate=True, compute_dq=False)
    assert got[0] is None and got[1] is dk and got[2] is dv
    assert_close("dk", dk - 1, ref_dk, 1e-4)
    assert_close("dv", dv - 1, ref_dv, 1e-4)
    # Without buffers, only the launched kernel's come back, freshly written.
    got = attention_backward(dout, q, k, v, lse, delta, prob, compute_dq=False)
    assert got[0] is None
    assert_close("dk", got[1], ref_dk, 1e-4)
    assert_close("dv", got[2], ref_dv, 1e-4)


def test_varlen_low_level_accumulate(device):
    lens_q, lens_k = [9, 0, 20], [12, 4, 17]
    g = torch.Generator().manual_seed(2)
    q, dout = (_randn(g, (sum(lens_q), 2, 16), torch.float32, device) for _ in range(2))
    k, v = (_randn(g, (sum(lens_k), 2, 16), torch.float32, device) for _ in range(2))
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    prob = build_problem(q, k, v, None, True, FULL, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=20, max_seqlen_k=17)  # fmt: skip
    out, lse = attention_forward(q, k, v, prob, lse=torch.empty(2, sum(lens_q), device=device))
    delta = attention_delta(out, dout, prob)
    bufs = [torch.ones_like(t) for t in (q, k, v)]
    attention_backward(dout, q, k, v, lse, delta, prob, *bufs, accumulate=True)
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
    ref_out = ringflash.flash_attn_varlen_func(qd, kd, vd, cu_q, cu_k, 20, 17, causal=True)
    ref = torch.autograd.grad(ref_out, (qd, kd, vd), dout)
    assert torch.allclose(out, ref_out, atol=1e-6)
    for got, exp in zip(bufs, ref):
        assert torch.allclose(got - 1, exp, atol=1e-5)
    assert (bufs[1][12:16] == 1).all(), "keys of an empty query sequence must get nothing added"


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_delta_zeroes_the_dq_accumulator(device, varlen):
    """``zero_dq``: the delta launch also fills a float32 buffer like out with zeros (every row,
    every head, columns up to head_dim 40 of a 64-wide block), delta unchanged; a buffer it cannot
    fill is refused. ``lse=`` (delta allocated like it) changes nothing, a non-contiguous one
    neither (delta stays contiguous); an LSE of another shape or dtype is refused."""
    g = torch.Generator().manual_seed(40)
    lens = [9, 0, 20]
    shape = (sum(lens), 3, 40) if varlen else (2, 29, 3, 40)
    q, k, v, dout = (_randn(g, shape, torch.float32, device) for _ in range(4))
    cu = dict(cu_seqlens_q=_cu(lens, device), cu_seqlens_k=_cu(lens, device), max_seqlen_q=20,
              max_seqlen_k=20) if varlen else {}  # fmt: skip
    prob = build_problem(q, k, v, None, True, FULL, **cu)
    out, lse = attention_forward(q, k, v, prob)
    plain = attention_delta(out, dout, prob)
    dq32 = torch.full(shape, float("nan"), device=device)
    assert torch.equal(attention_delta(out, dout, prob, zero_dq=dq32), plain)
    assert (dq32 == 0).all()
    strided = torch.empty(lse.shape[::-1], device=device).transpose(0, -1)  # same shape, last stride not 1
    for like in (lse, strided):
        delta = attention_delta(out, dout, prob, lse=like)
        assert torch.equal(delta, plain) and delta.is_contiguous()
    for bad in (lse.double(), lse[..., :-1]):
        with pytest.raises(ValueError, match="lse must be float32 of shape"):
            attention_delta(out, dout, prob, lse=bad)
    for bad in (dq32.double(), dq32[..., :-1], dq32.transpose(-1, -2).contiguous().transpose(-1, -2)):
        with pytest.raises(ValueError, match="zero_dq"):
            attention_delta(out, dout, prob, zero_dq=bad)


def test_attention_gradients_equal_the_low_level_calls(device):
    """``attention_gradients`` (autograd's backward) equals delta then ``attention_backward``, with
    a gradient on the LSE too, and returns new buffers in q's, k's and v's dtype and shape."""
    q, k, v, dout = _inputs(2, 33, 20, 4, 2, 16, torch.float16, device, seed=41)
    prob = build_problem(q, k, v, None, True, FULL)
    out, lse = attention_forward(q, k, v, prob)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(42)).to(device)
    got = ringflash.kernels.attention_gradients(dout, q, k, v, out, lse, prob, dlse)
    expected = attention_backward(dout, q, k, v, lse, attention_delta(out, dout, prob, dlse), prob)
    for g, e, t in zip(got, expected, (q, k, v)):
        assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, e)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=str)
def test_ring_style_merge_of_stripes(device, dtype):
    """Split the keys into 3 stripes (stride 3, as ranks of a stripe ring hold them), run each
    as its own block with global positions, merge out/LSE, then run the backward per block with
    the merged LSE accumulating into float32 buffers (strided views): equals full attention."""
    q, k, v, dout = _inputs(1, 37, 37, 4, 2, 24, dtype, device, seed=23)
    outs, lses = [], []
    qp = TokenPositions(0, 1)
    for r in range(3):
        kr, vr = k[:, r::3], v[:, r::3]
        prob = build_problem(
            q, kr, vr, None, True, (11, -1), q_positions=qp, k_positions=TokenPositions(r, 3)
        )
        o, l = attention_forward(q, kr, vr, prob, out=torch.empty(q.shape, device=device))
        outs.append(o)
        lses.append(l)
    lse = torch.logsumexp(torch.stack(lses), 0)
    weights = [torch.where(torch.isneginf(l), 0.0, torch.exp(l - lse)) for l in lses]
    out = sum(w.transpose(1, 2)[..., None] * o for w, o in zip(weights, outs))
    ref_out, ref_lse, ref_grads = _reference_grads(q, k, v, dout, causal=True, window_size=(11, -1))
    tol = TOLERANCE[dtype]
    assert_close("out", out, ref_out, tol)
    assert_close("lse", lse, ref_lse, tol)
    dq, dk, dv = (torch.zeros(t.shape, device=device) for t in (q, k, v))
    for r in range(3):
        kr, vr = k[:, r::3], v[:, r::3]
        prob = build_problem(
            q, kr, vr, None, True, (11, -1), q_positions=qp, k_positions=TokenPositions(r, 3)
        )
        delta = attention_delta(out.to(dtype), dout, prob)
        attention_backward(dout, q, kr, vr, lse, delta, prob, dq, dk[:, r::3], dv[:, r::3], accumulate=True)
    for name, got, exp in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(name, got, exp, tol)


# --------------------------------------------------------------------------------------------
# the tile-span helper against brute force


@triton.jit
def _tiles_probe(
    P, OUT, n, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    # ROWS 1: one parameter set per program, scalars as the kernels call visible_tiles. Otherwise
    # ROWS sets per program as vectors: visible_tiles is elementwise, so each set gets the same
    # operations, and the interpreter, which runs programs one at a time (~23 ms each here), runs
    # the whole batch in one.
    if ROWS == 1:
        i = tl.program_id(0)
    else:
        i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = i < n
    start, full_start, full_end, end = visible_tiles(
        tl.load(P + i * 7, mask=ok), tl.load(P + i * 7 + 1, mask=ok), tl.load(P + i * 7 + 2, mask=ok),
        tl.load(P + i * 7 + 3, mask=ok, other=1), tl.load(P + i * 7 + 4, mask=ok),
        tl.load(P + i * 7 + 5, mask=ok), tl.load(P + i * 7 + 6, mask=ok), HAS_LO, HAS_HI, BLOCK,
    )  # fmt: skip
    tl.store(OUT + i * 4, start, mask=ok)
    tl.store(OUT + i * 4 + 1, full_start, mask=ok)
    tl.store(OUT + i * 4 + 2, full_end, mask=ok)
    tl.store(OUT + i * 4 + 3, end, mask=ok)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize(("has_lo", "has_hi"), [(False, False), (True, False), (False, True), (True, True)])
def test_visible_tiles_brute_force(device, has_lo, has_hi, block):
    """Spans [start, full_start) masked, [full_start, full_end) mask-free, [full_end, end) masked:
    every visible column inside [start, end) and the span tight; every mask-free column is in
    range and visible to every row; the mask-free span holds every whole aligned tile it can."""
    rng = random.Random(block + 2 * has_lo + has_hi)
    params = []
    for _ in range(300):
        row_lo = rng.randint(-30, 60)
        params.append([row_lo, row_lo + rng.randint(0, 40), rng.randint(-30, 60), rng.randint(1, 3),
                       rng.randint(0, 70), rng.randint(0, 20), rng.randint(0, 20)])  # fmt: skip
    p = torch.tensor(params, dtype=torch.int32, device=device)
    out = torch.full((len(params), 4), -99, dtype=torch.int32, device=device)
    _tiles_probe[(1,)](p, out, len(params), HAS_LO=has_lo, HAS_HI=has_hi, BLOCK=block, ROWS=512)
    # The kernels' scalar form on a few of them gives the same spans.
    scalar = torch.full((8, 4), -99, dtype=torch.int32, device=device)
    _tiles_probe[(8,)](p, scalar, 8, HAS_LO=has_lo, HAS_HI=has_hi, BLOCK=block, ROWS=1)
    assert torch.equal(scalar, out[:8]), (scalar, out[:8])
    for (row_lo, row_hi, base, stride, n, lo_off, hi_off), spans in zip(params, out.tolist()):
        start, full_start, full_end, end = spans
        rows = range(row_lo, row_hi + 1)
        cols = [base + stride * j for j in range(n)]
        sees = [
            [(not has_lo or c >= r - lo_off) and (not has_hi or c <= r + hi_off) for c in cols] for r in rows
        ]
        visible = [j for j in range(n) if any(row[j] for row in sees)]
        full = {j for j in range(n) if all(row[j] for row in sees)}
        ctx = f"params {(row_lo, row_hi, base, stride, n, lo_off, hi_off)} -> {spans}"
        assert start % block == 0 and full_start % block == 0 and full_end % block == 0, ctx
        assert 0 <= start <= full_start <= full_end <= end <= n, ctx
        if not visible:
            assert end <= start, ctx
            continue
        assert start == visible[0] // block * block and end == visible[-1] + 1, ctx
        assert all(j in full for j in range(full_start, full_end)), ctx
        whole = [t for t in range(0, n, block) if all(j in full for j in range(t, t + block))]
        assert full_end - full_start == block * len(whole), ctx


# --------------------------------------------------------------------------------------------
# GPU: real sizes, bf16 included, float64 reference on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("b", "s", "h", "hk", "d", "causal", "window"),
    [(2, 2048, 16, 4, 128, True, FULL), (2, 2048, 16, 4, 128, False, FULL),
     (1, 3001, 8, 2, 64, True, FULL), (1, 2048, 8, 8, 64, False, FULL),
     (1, 2048, 4, 4, 256, True, FULL), (1, 1500, 4, 1, 256, False, FULL),
     (1, 2048, 8, 1, 80, False, (300, 17)), (1, 2048, 8, 2, 128, True, (500, -1))],
)  # fmt: skip
def test_gpu_real_sizes(b, s, h, hk, d, causal, window, dtype):
    q, k, v, dout = _inputs(b, s, s, h, hk, d, dtype, "cuda", seed=s + d)
    check_against_reference(q, k, v, dout, causal, window, on_device=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_seqlen_q_differs(dtype):
    for sq, sk in ((700, 2100), (2100, 700)):
        q, k, v, dout = _inputs(2, sq, sk, 8, 2, 128, dtype, "cuda", seed=sq)
        check_against_reference(q, k, v, dout, causal=True, on_device=True)


@pytest.mark.gpu
def test_gpu_float32():
    q, k, v, dout = _inputs(1, 1030, 1030, 4, 2, 64, torch.float32, "cuda", seed=1)
    check_against_reference(q, k, v, dout, causal=True, on_device=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("causal", "window"), [(True, FULL), (False, FULL), (True, (256, -1))], ids=str)
def test_gpu_varlen(dtype, causal, window):
    lens_q = [1000, 1, 0, 513, 2048, 77]
    lens_k = [1000, 300, 5, 1024, 2048, 0]
    g = torch.Generator().manual_seed(5)
    q, dout = (_randn(g, (sum(lens_q), 8, 128), dtype, "cuda") for _ in range(2))
    k, v = (_randn(g, (sum(lens_k), 2, 128), dtype, "cuda") for _ in range(2))
    check_varlen(q, k, v, dout, lens_q, lens_k, causal, window)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_stripe_positions(dtype):
    q, k, v, dout = _inputs(1, 1024, 1024, 8, 2, 128, dtype, "cuda", seed=3)
    for q_start, k_start in ((1, 3), (3, 1)):
        check_positions(q, k, v, dout, TokenPositions(q_start, 4), TokenPositions(k_start, 4), True, FULL)
