"""Softcap and ALiBi in the Triton kernels against the float64 reference: out, LSE, dq, dk, dv.

Through ``build_problem`` + ``attention_forward`` / ``attention_delta`` / ``attention_backward``,
as the ring engine calls them. Magnitudes make each feature matter: scaled scores of about 5-20
against softcaps of 2-5, ALiBi slopes of 0.1-1 over distances of tens of tokens; every check
also asserts that the reference without the feature differs from the one with it by far more
than the tolerance, so a kernel that dropped the feature would fail. CPU shapes are small
(16-row interpreter tiles at these lengths, ``configs``); real sizes and bf16 run in the GPU-marked tests.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from reference import TOLERANCE, reference_attention, rel_err, visibility
from test_kernels import _cu, _inputs, _positions, _randn, assert_close

from ringflash.kernels import (
    TokenPositions,
    attention_backward,
    attention_delta,
    attention_forward,
    build_problem,
)
from ringflash.kernels.configs import forward_config
from ringflash.kernels.scores import tanh
from ringflash.kernels.tiling import tile_grid

# Under the interpreter an int32 overflow in a kernel raises here (tests/interpreter_patching.py).
pytestmark = pytest.mark.overflow_checks

FULL = (-1, -1)
BITES = 0.03  # the least relative change in out that each feature must make


def _slopes(shape, seed):
    """ALiBi slopes in [0.1, 1], float32."""
    g = torch.Generator().manual_seed(seed)
    return 0.1 + 0.9 * torch.rand(shape, generator=g)


def _reference(q, k, v, dout, *, grads=True, **kw):
    """reference_attention on float64 CPU copies; (out, lse, (dq, dk, dv) or None)."""
    qd, kd, vd = (t.detach().to("cpu", torch.float64).requires_grad_(grads) for t in (q, k, v))
    out, lse = reference_attention(qd, kd, vd, **kw)
    if not grads:
        return out, lse, None
    return out, lse, torch.autograd.grad(out, (qd, kd, vd), dout.detach().to("cpu", torch.float64))


def _assert_features_bite(q, k, v, ref_out, kw):
    """Dropping each feature that is on changes the reference's out by more than BITES."""
    on = dict(softcap=bool(kw.get("softcap")), alibi_slopes=kw.get("alibi_slopes") is not None)
    for name, off in (("softcap", 0.0), ("alibi_slopes", None)):
        if not on[name]:
            continue
        without, _, _ = _reference(q, k, v, None, grads=False, **{**kw, name: off})
        assert rel_err(without, ref_out) > BITES, f"{name} hardly changes this case: pick larger magnitudes"


def _run_kernels(q, k, v, dout, prob):
    out, lse = attention_forward(q, k, v, prob)
    grads = attention_backward(dout, q, k, v, lse, attention_delta(out, dout, prob), prob)
    return out, lse, grads


def check_features(q, k, v, dout, *, causal=False, window=FULL, scale=None, softcap=0.0, alibi=None,
                   q_pos=None, k_pos=None):  # fmt: skip
    """The kernels with softcap/ALiBi on a dense call (explicit positions optional) against the
    reference; also the exact zeros of rows that see no key and keys that no query sees."""
    prob = build_problem(q, k, v, scale, causal, window, q_positions=q_pos, k_positions=k_pos,
                         softcap=softcap, alibi_slopes=alibi)  # fmt: skip
    out, lse, grads = _run_kernels(q, k, v, dout, prob)
    sq, sk = q.shape[1], k.shape[1]
    qp = _positions(q_pos, sq) if q_pos is not None else torch.arange(sq) + (sk - sq)
    kp = _positions(k_pos, sk) if k_pos is not None else torch.arange(sk)
    kw = dict(causal=causal, window_size=window, softmax_scale=scale, q_pos=qp, k_pos=kp, softcap=softcap,
              alibi_slopes=alibi)  # fmt: skip
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, **kw)
    _assert_features_bite(q, k, v, ref_out, kw)
    tol = TOLERANCE[q.dtype]
    for name, got, exp in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)
    ):
        assert got.shape == exp.shape, name
        assert_close(name, got, exp, tol)
    vis = visibility(qp, kp, causal, window)
    blind_q, unseen_k = ~vis.any(1), ~vis.any(0)
    assert (out[:, blind_q] == 0).all() and torch.isneginf(lse[:, :, blind_q]).all()
    assert (grads[0][:, blind_q] == 0).all()
    assert (grads[1][:, unseen_k] == 0).all() and (grads[2][:, unseen_k] == 0).all()
    assert not any(torch.isnan(t).any() for t in (out, lse, *grads))
    return out, lse, grads


# --------------------------------------------------------------------------------------------
# dense calls, default (bottom-right) positions

DENSE_CASES = [  # (b, sq, sk, h, hk, causal, window, scale, softcap, slopes shape or None, dtype)
    (1, 33, 33, 2, 1, True, FULL, 2.0, 3.0, None, torch.float32),  # softcap, causal
    (1, 33, 33, 2, 1, True, FULL, 2.0, 3.0, None, torch.float16),
    (1, 40, 40, 2, 1, False, FULL, None, 0.0, "h", torch.float32),  # ALiBi (H,), mask-free tiles only
    (2, 17, 33, 2, 1, True, FULL, None, 0.0, "bh", torch.float32),  # ALiBi (B, H), GQA, sq < sk
    (1, 40, 23, 2, 2, False, (8, 4), 1.5, 5.0, "bh", torch.float32),  # both, window, sq > sk: blind rows
    (1, 40, 23, 2, 2, False, (8, 4), 1.5, 5.0, "bh", torch.float16),
    (1, 50, 50, 2, 1, True, (10, -1), 1.2, 2.0, "h", torch.float32),  # both, MQA, causal window
    (1, 45, 30, 2, 1, True, FULL, 1.0, 4.0, "h", torch.float16),  # both, causal, sq > sk: blind rows
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_dense_matches_reference(device, case):
    b, sq, sk, h, hk, causal, window, scale, softcap, slopes, dtype = case
    q, k, v, dout = _inputs(b, sq, sk, h, hk, 16, dtype, device, seed=sq * 100 + sk)
    alibi = None if slopes is None else _slopes((h,) if slopes == "h" else (b, h), seed=h).to(device)
    check_features(q, k, v, dout, causal=causal, window=window, scale=scale, softcap=softcap, alibi=alibi)


def test_softcap_bounds_huge_scores(device):
    """Scores of thousands: the capped scores stay in [-softcap, softcap], tanh never overflows."""
    q, k, v, dout = _inputs(1, 20, 33, 2, 1, 32, torch.float32, device, seed=3)
    out, lse, _ = check_features(q * 30.0, k, v, dout, causal=True, scale=1.0, softcap=5.0)
    assert torch.isfinite(lse).all() and lse.max() <= 5.0 + torch.log(torch.tensor(33.0))


# --------------------------------------------------------------------------------------------
# explicit positions: ring steps

POSITION_CASES = [  # (q positions, k positions, causal, window, softcap, dtype)
    (TokenPositions(2, 3), TokenPositions(0, 3), True, FULL, 3.0, torch.float32),  # stripe step
    (TokenPositions(0, 3), TokenPositions(1, 3), True, (40, -1), 0.0, torch.float16),  # later rank
    (TokenPositions(100, 1), TokenPositions(30, 1), True, FULL, 4.0, torch.float32),  # fully visible block
    (TokenPositions(-10, 1), TokenPositions(0, 2), False, (9, 20), 2.5, torch.float32),  # strides differ
]


@pytest.mark.parametrize(("q_pos", "k_pos", "causal", "window", "softcap", "dtype"), POSITION_CASES)
def test_positions_match_reference(device, q_pos, k_pos, causal, window, softcap, dtype):
    """ALiBi distances in global positions (stride and offset included), as a ring step sees them;
    in the fully visible block every tile is mask-free and still gets its bias."""
    q, k, v, dout = _inputs(1, 23, 29, 4, 2, 16, dtype, device, seed=abs(q_pos.start) + 7 * k_pos.start)
    alibi = _slopes((4,), seed=1).to(device) * 0.3
    check_features(q, k, v, dout, causal=causal, window=window, scale=1.5, softcap=softcap, alibi=alibi,
                   q_pos=q_pos, k_pos=k_pos)  # fmt: skip


# --------------------------------------------------------------------------------------------
# varlen

VARLEN_CASES = [  # (lens_q, lens_k, causal, window, q positions, k positions, dtype)
    ([1, 7, 33, 0, 16, 5], [1, 7, 33, 3, 16, 0], True, FULL, None, None, torch.float32),
    ([7, 33, 1, 19], [9, 20, 4, 19], False, (6, 3), None, None, torch.float16),  # sq != sk per sequence
    (  # chunk 2 of every document's queries against chunk 1 of its keys (a ring step over packed documents)
        [7, 33, 1, 19], [7, 33, 1, 19], True, FULL,
        TokenPositions(0, 1, per_len=2), TokenPositions(0, 1, per_len=1), torch.float32,
    ),
    # One long document among 21 short ones: one program per tile of the packed batch, each
    # finding its document by a binary search over cu_seqlens (tiling.tile_grid, packed_tile).
    ([70, *[1, 3, 0, 5] * 5, 2], [70, *[1, 3, 0, 5] * 5, 2], True, (20, 0), None, None, torch.float32),
]  # fmt: skip


@pytest.mark.parametrize(("lens_q", "lens_k", "causal", "window", "q_pos", "k_pos", "dtype"), VARLEN_CASES)
def test_varlen_matches_per_sequence_reference(device, lens_q, lens_k, causal, window, q_pos, k_pos, dtype):
    """Documents of odd lengths, empty ones on either side; each sequence its own slopes row."""
    g = torch.Generator().manual_seed(sum(lens_q))
    h, hk = 2, 1
    q, dout = (_randn(g, (sum(lens_q), h, 16), dtype, device) for _ in range(2))
    k, v = (_randn(g, (sum(lens_k), hk, 16), dtype, device) for _ in range(2))
    alibi = _slopes((len(lens_q), h), seed=5).to(device)
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    prob = build_problem(q, k, v, 1.5, causal, window, q_positions=q_pos, k_positions=k_pos,
                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                         max_seqlen_k=max(lens_k), softcap=3.0, alibi_slopes=alibi)  # fmt: skip
    if device == "cpu" and len(lens_q) > 20:  # the interpreter's 16-row tiles take the packed grid
        block = forward_config(16, dtype == torch.float32, (max(lens_q), max(lens_k))).block_m
        assert tile_grid(max(lens_q), h, len(lens_q), block, sum(lens_q))[1] == len(lens_q)
    out, lse, grads = _run_kernels(q, k, v, dout, prob)
    assert not any(torch.isnan(t).any() for t in (out, lse, *grads))
    tol = TOLERANCE[dtype]
    bites = False
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = slice(cu_q[i].item(), cu_q[i + 1].item()), slice(cu_k[i].item(), cu_k[i + 1].item())
        if lq == 0:
            assert (grads[1][ks] == 0).all() and (grads[2][ks] == 0).all()
            continue
        if lk == 0:
            assert (out[qs] == 0).all() and torch.isneginf(lse[:, qs]).all() and (grads[0][qs] == 0).all()
            continue
        qp = _positions(q_pos, lq) if q_pos is not None else torch.arange(lq) + (lk - lq)
        kp = _positions(k_pos, lk) if k_pos is not None else torch.arange(lk)
        kw = dict(causal=causal, window_size=window, softmax_scale=1.5, q_pos=qp, k_pos=kp, softcap=3.0,
                  alibi_slopes=alibi[i])  # fmt: skip
        args = [t[None] for t in (q[qs], k[ks], v[ks], dout[qs])]
        ref_out, ref_lse, ref_grads = _reference(*args, **kw)
        got = (out[qs][None], lse[:, qs][None], grads[0][qs][None], grads[1][ks][None], grads[2][ks][None])
        for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, (ref_out, ref_lse, *ref_grads)):
            assert_close(f"seq {i} (len {lq}/{lk}) {name}", a, e, tol)
        if lq > 10:
            _assert_features_bite(*args[:3], ref_out, kw)
            bites = True
    assert bites


# --------------------------------------------------------------------------------------------
# the ring engine's backward calls: accumulate, dQ and dK/dV launched apart


def test_accumulate_and_split_backward(device):
    q, k, v, dout = _inputs(1, 23, 29, 4, 2, 16, torch.float32, device, seed=19)
    q_pos, k_pos = TokenPositions(2, 3), TokenPositions(0, 3)
    alibi = _slopes((1, 4), seed=2).to(device) * 0.3
    prob = build_problem(q, k, v, 1.5, True, (30, -1), q_positions=q_pos, k_positions=k_pos, softcap=3.0,
                         alibi_slopes=alibi)  # fmt: skip
    out, lse = attention_forward(q, k, v, prob)
    delta = attention_delta(out, dout, prob)
    g = torch.Generator().manual_seed(0)
    fills = [_randn(g, t.shape, torch.float32, device) for t in (q, k, v)]
    bufs = [f.clone() for f in fills]
    attention_backward(dout, q, k, v, lse, delta, prob, dq=bufs[0], accumulate=True, compute_dkdv=False)
    assert torch.equal(bufs[1], fills[1]) and torch.equal(bufs[2], fills[2])
    attention_backward(dout, q, k, v, lse, delta, prob, dk=bufs[1], dv=bufs[2], accumulate=True,
                       compute_dq=False)  # fmt: skip
    _, _, ref_grads = _reference(q, k, v, dout, causal=True, window_size=(30, -1), softmax_scale=1.5,
                                 q_pos=_positions(q_pos, 23), k_pos=_positions(k_pos, 29), softcap=3.0,
                                 alibi_slopes=alibi)  # fmt: skip
    for name, got, fill, exp in zip(("dq", "dk", "dv"), bufs, fills, ref_grads):
        assert_close(name, got - fill, exp, TOLERANCE[torch.float32])


# --------------------------------------------------------------------------------------------
# the tanh helper


@triton.jit
def _tanh_probe(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tanh(tl.load(X + offs)))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
def test_tanh_is_finite_and_exact(device):
    """No overflow or NaN for huge or infinite arguments; float32-exact elsewhere."""
    special = [float("inf"), float("-inf"), 3e38, -3e38, 1e6, -1e6, 89.0, -89.0, 0.0, -0.0, 1e-30, -1e-30]
    x = torch.cat([torch.tensor(special), torch.linspace(-12, 12, 64 - len(special))]).to(device)
    y = torch.empty_like(x)
    _tanh_probe[(1,)](x, y, N=64)
    expected = torch.tanh(x.double())
    assert not torch.isnan(y).any()
    assert (y - expected).abs().max() < 2e-7


# --------------------------------------------------------------------------------------------
# GPU: real sizes, bf16, head dims up to 256


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("b", "s", "h", "hk", "d", "causal", "window", "softcap", "slopes"),
    [(1, 1024, 8, 2, 128, True, FULL, 5.0, None), (1, 1024, 8, 2, 128, False, FULL, 0.0, "bh"),
     (2, 777, 4, 4, 64, True, FULL, 3.0, "h"), (1, 1024, 4, 1, 256, True, (200, -1), 4.0, "h"),
     (1, 900, 4, 2, 64, False, (100, 50), 2.0, "bh")],
)  # fmt: skip
def test_gpu_real_sizes(b, s, h, hk, d, causal, window, softcap, slopes, dtype):
    q, k, v, dout = _inputs(b, s, s, h, hk, d, dtype, "cuda", seed=s + d)
    q = q * 3.0  # scores of about 5-20 against the softcap
    alibi = None if slopes is None else _slopes((h,) if slopes == "h" else (b, h), seed=h).cuda() * 0.1
    check_features(q, k, v, dout, causal=causal, window=window, softcap=softcap, alibi=alibi)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_stripe_positions_and_varlen(dtype):
    q, k, v, dout = _inputs(1, 1024, 1024, 8, 2, 128, dtype, "cuda", seed=3)
    alibi = _slopes((8,), seed=3).cuda() * 0.05
    check_features(q * 3.0, k, v, dout, causal=True, softcap=4.0, alibi=alibi, q_pos=TokenPositions(1, 4),
                   k_pos=TokenPositions(3, 4))  # fmt: skip
    lens = [1000, 1, 513, 77]
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (_randn(g, (sum(lens), 4, 64), dtype, "cuda") for _ in range(4))
    q = q * 3.0
    cu = _cu(lens, "cuda")
    alibi = _slopes((len(lens), 4), seed=4).cuda() * 0.05
    prob = build_problem(q, k, v, None, True, FULL, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1000,
                         max_seqlen_k=1000, softcap=4.0, alibi_slopes=alibi)  # fmt: skip
    out, lse, grads = _run_kernels(q, k, v, dout, prob)
    for i in range(len(lens)):
        s = slice(cu[i].item(), cu[i + 1].item())
        args = [t[s][None] for t in (q, k, v, dout)]
        ref_out, ref_lse, ref_grads = _reference(*args, causal=True, softcap=4.0, alibi_slopes=alibi[i])
        got = (out[s][None], lse[:, s][None], *(t[s][None] for t in grads))
        for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, (ref_out, ref_lse, *ref_grads)):
            assert_close(f"seq {i} {name}", a, e, TOLERANCE[dtype])
