"""The fused Hopper backward (kernels/hopper/backward.py) on an sm_90 GPU, against float64.

Each case first asserts that ``uses_fused_backward`` picks the fused kernel, so a test cannot
pass on the Triton kernels by accident. Its sm_90 build on the CPU is checked in test_compile.py.
Head_dim 256 (64 x 64 tiles for dK/dV, P^T/dS^T through shared memory, dQ by hopper/dq.py) runs every kind
of case that 128 does: dtypes, odd lengths, packed documents, windows, ring positions, GQA,
softcap, ALiBi.
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
    uses_fused_backward,
)

pytestmark = [pytest.mark.gpu, SM90]

D = 128
HEAD_DIMS = [64, 128, 256]  # the fused kernel's (hopper/backward.py TILES)


def _reference_grads(q, k, v, dout, causal, **kw):
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(qd, kd, vd, causal=causal, **kw)
    out.backward(dout.double().cpu())
    return qd.grad, kd.grad, vd.grad


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids="d{}".format)
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
def test_fused_backward_matches_float64(head_dim, dtype, batch, seqlen_q, seqlen_k, heads, kv_heads, causal):
    q = cuda_randn(batch, seqlen_q, heads, head_dim, dtype=dtype, seed=1).requires_grad_()
    k = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=2).requires_grad_()
    v = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=3).requires_grad_()
    dout = cuda_randn(batch, seqlen_q, heads, head_dim, dtype=dtype, seed=4)
    problem = build_problem(q, k, v, None, causal, (-1, -1))
    assert uses_fused_backward(problem, q, k, v)
    ringflash.flash_attn_func(q, k, v, causal=causal).backward(dout)
    for name, got, exp in zip(
        ("dq", "dk", "dv"), (q.grad, k.grad, v.grad), _reference_grads(q, k, v, dout, causal)
    ):
        assert got.dtype == dtype, name
        err = rel_err(got, exp)
        assert err < TOLERANCE[dtype], f"{name}: rel err {err:.2e}"


def test_head_dim_256_dq_without_unit_stride():
    """attention_backward at the 256 build adding into a dq whose head_dim stride is not 1 (a
    transposed view of a float32 buffer): the dQ kernel, which stores rows with unit stride,
    writes a copy that is added in."""
    q, k, v, dout = (cuda_randn(1, 300, 2, 256, seed=s) for s in (81, 82, 83, 84))
    problem = build_problem(q, k, v, None, True, (-1, -1))
    assert uses_fused_backward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    delta = attention_delta(out, dout, problem)
    dq = cuda_randn(1, 300, 256, 2, dtype=torch.float32, seed=85).transpose(2, 3)
    assert dq.stride(-1) != 1
    before = dq.clone()
    dk, dv = (torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in (k, v))
    attention_backward(dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate=True)
    expected = _reference_docs(q, k, v, dout, True, (-1, -1), problem.q_positions, problem.k_positions)
    _check((dq, dk, dv), expected, torch.bfloat16, bases=(before, 0, 0))


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids="d{}".format)
def test_fused_backward_on_slices_adds_into_float32_buffers(head_dim):
    """The ring's call: query/key slices of larger shards, dQ/dK/dV added to float32 buffers."""
    big_q, big_k, big_v, big_do = (
        cuda_randn(2, 640, h, head_dim, seed=s) for s, h in ((5, 4), (6, 2), (7, 2), (8, 4))
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


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids="d{}".format)
def test_fused_backward_on_a_diagonal_block_with_offsets(head_dim):
    """A ring shard's own causal block sits at the same global positions on both sides."""
    q, k, v, dout = (cuda_randn(1, 256, 2, head_dim, seed=s) for s in range(10, 14))
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
    assert fused(window=(64, 0))
    assert fused(q=q[:, :100])  # causal, seqlen_q != seqlen_k: bottom-right aligned
    assert fused(q_positions=TokenPositions(128), k_positions=TokenPositions(0))
    assert fused(q_positions=TokenPositions(0, 2), k_positions=TokenPositions(1, 2))  # stripe
    assert fused(q=q[:, :193], k=k[:, :193], v=v[:, :193])
    assert fused(*(t[..., :64].contiguous() for t in (q, k, v)))
    assert fused(*(torch.cat([t, t], -1) for t in (q, k, v)))  # head_dim 256
    assert fused(*(t[..., :96].contiguous() for t in (q, k, v)))  # the 128 build, zero-filled by TMA
    assert not fused(*(t[..., :32].contiguous() for t in (q, k, v)))  # below every build: Triton
    assert not fused(*(t.float() for t in (q, k, v)))
    assert not fused(q=cuda_randn(1, 256, 4, D)[:, :, ::2])  # heads not packed in the token's row
    assert not fused(window=(2**29, 0))  # int32 position sums in the kernel
    monkeypatch.setenv("RINGFLASH_FUSED_BACKWARD", "0")
    assert not fused()
    monkeypatch.delenv("RINGFLASH_FUSED_BACKWARD")
    torch.use_deterministic_algorithms(True)
    try:
        assert not fused()
        assert fused(*(torch.cat([t, t], -1) for t in (q, k, v)))  # 256: deterministic, stays
    finally:
        torch.use_deterministic_algorithms(False)
    assert fused()
    assert not fused(deterministic=True)


def test_head_dim_256_backward_is_deterministic():
    """At the 256 build dQ is written once per row (dq.py) and dK/dV once per program: under
    torch.use_deterministic_algorithms(True) the Hopper backward still runs, and two backward
    passes (GQA, causal, a length that is not a multiple of the tiles) agree bit for bit."""
    q, dout = (cuda_randn(2, 700, 4, 256, seed=s) for s in (71, 72))
    k, v = (cuda_randn(2, 700, 2, 256, seed=s) for s in (73, 74))
    torch.use_deterministic_algorithms(True)
    try:
        assert uses_fused_backward(build_problem(q, k, v, None, True, (-1, -1)), q, k, v)
        grads = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ringflash.flash_attn_func(*leaves, causal=True).backward(dout)
            grads.append([t.grad for t in leaves])
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


@pytest.mark.parametrize("head_dim", [128, 256], ids="d{}".format)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("softcap, q_scale", [(5.0, 4.0), (30.0, 16.0)])
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal"),
    [(2, 384, 384, 4, 4, False), (1, 512, 512, 8, 2, True), (1, 256, 512, 4, 1, False)],
)
def test_fused_backward_with_softcap_matches_float64(
    head_dim, dtype, softcap, q_scale, batch, seqlen_q, seqlen_k, heads, kv_heads, causal
):
    """Scores large enough that the cap bites (see test_hopper_forward.SOFTCAPS); gradients
    compared with float64 and with the uncapped float64 gradients (which they must not match)."""
    q = (cuda_randn(batch, seqlen_q, heads, head_dim, dtype=torch.float32, seed=31) * q_scale).to(dtype)
    k = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=32)
    v = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=33)
    dout = cuda_randn(batch, seqlen_q, heads, head_dim, dtype=dtype, seed=34)
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


@pytest.mark.parametrize("head_dim", [128, 256], ids="d{}".format)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal", "softcap", "positions"), ALIBI_CASES
)
def test_fused_backward_with_alibi_matches_float64(
    head_dim, dtype, batch, seqlen_q, seqlen_k, heads, kv_heads, causal, softcap, positions
):
    q, k, v, slopes, kw, ref_kw = alibi_inputs(
        batch, seqlen_q, seqlen_k, heads, kv_heads, causal, softcap, positions, dtype, seed=50,
        head_dim=head_dim,
    )  # fmt: skip
    dout = cuda_randn(batch, seqlen_q, heads, head_dim, dtype=dtype, seed=55)
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


# The kernel's masked variants (any lengths, packed documents, windows, positions, every head_dim),
# called directly: the gate (hopper/dispatch.py hopper_path_ok) decides separately which problems reach
# it through attention_backward. LSE and delta come from the library's forward and
# attention_delta, as in a training step.


def _positions(tp: TokenPositions, n: int) -> torch.Tensor:
    r = tp.resolved(n)
    return r.start + r.stride * torch.arange(n)


def _fused_grads(q, k, v, dout, problem, accumulate_into=None):
    """dq, dk, dv from hopper/backward.py fused_backward alone (asserting that it takes the problem),
    and at the 256 build hopper/dq.py's dQ kernel beside it; with ``accumulate_into`` = (dq, dk,
    dv) float32 buffers, added into them."""
    from ringflash.kernels.hopper import backward as hopper_backward
    from ringflash.kernels.hopper import dq as hopper_dq

    assert hopper_backward.backward_supports(problem)
    out, lse = attention_forward(q, k, v, problem)
    delta = attention_delta(out, dout, problem)
    if accumulate_into is None:
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))  # all written
    else:
        dq, dk, dv = accumulate_into
    accumulate = accumulate_into is not None
    if hopper_backward.computes_dq(problem):
        hopper_backward.fused_backward(dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate)
    else:
        hopper_backward.fused_backward(dout, q, k, v, lse, delta, problem, None, dk, dv, accumulate)
        hopper_dq.fused_dq(dout, q, k, v, lse, delta, problem, dq, accumulate)
    return dq, dk, dv


def _reference_docs(q, k, v, dout, causal, window, q_positions, k_positions, cu_q=None, cu_k=None, **kw):
    """float64 dq, dk, dv, each sequence (batch entry, or packed document between cu_seqlens) on
    its own with its positions resolved for its own length."""
    if cu_q is None:
        spans = [((b, slice(None)), (b, slice(None))) for b in range(q.shape[0])]
        seqs = [(q[b], k[b], v[b], dout[b]) for b in range(q.shape[0])]
    else:
        cq, ck = cu_q.tolist(), cu_k.tolist()
        spans = [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]
        seqs = [(q[sq], k[sk], v[sk], dout[sq]) for sq, sk in spans]
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for (sq, sk), (qs, ks, vs, dos) in zip(spans, seqs):
        if qs.shape[0] == 0 or ks.shape[0] == 0:
            continue
        qd, kd, vd = (t.detach().double().cpu()[None].requires_grad_() for t in (qs, ks, vs))
        out, _ = reference_attention(
            qd, kd, vd, causal=causal, window_size=window, q_pos=_positions(q_positions, qs.shape[0]),
            k_pos=_positions(k_positions, ks.shape[0]), **kw,
        )  # fmt: skip
        out.backward(dos.double().cpu()[None])
        for g, t, s in zip(grads, (qd, kd, vd), (sq, sk, sk)):
            g[s] = t.grad[0]
    return grads


def _check(got, expected, dtype, bases=(0, 0, 0)):
    for name, g, e, base in zip(("dq", "dk", "dv"), got, expected, bases):
        err = rel_err(g.float() - base, e)
        assert err < TOLERANCE[dtype], f"{name}: rel err {err:.2e}"


# (batch, seqlen_q, seqlen_k, heads, kv_heads, causal, window): tails of every kind, seqlen_q !=
# seqlen_k (bottom-right aligned), GQA 4:1 and MQA, windows. Every case has queries that see
# several keys (with one key each, dq and dk are 0 and a relative error means nothing).
DENSE_CASES = [
    (2, 1, 129, 4, 1, True, (-1, -1)),  # one query, bottom-right: it sees every key
    (2, 127, 127, 4, 4, True, (-1, -1)),
    (1, 129, 129, 8, 2, False, (-1, -1)),
    (1, 1000, 1000, 8, 2, True, (-1, -1)),
    (2, 127, 1000, 4, 1, True, (-1, -1)),
    (1, 1000, 129, 4, 4, False, (-1, -1)),
    (1, 1000, 1000, 4, 1, True, (200, -1)),
    (2, 300, 517, 8, 2, False, (64, 32)),
    (1, 384, 384, 4, 4, False, (1, 1)),  # three keys per query, all near the diagonal
]


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids="d{}".format)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal", "window"), DENSE_CASES
)
def test_fused_kernel_any_lengths_and_windows(
    head_dim, dtype, batch, seqlen_q, seqlen_k, heads, kv_heads, causal, window
):
    q = cuda_randn(batch, seqlen_q, heads, head_dim, dtype=dtype, seed=61)
    k = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=62)
    v = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=63)
    dout = cuda_randn(batch, seqlen_q, heads, head_dim, dtype=dtype, seed=64)
    problem = build_problem(q, k, v, None, causal, window)
    got = _fused_grads(q, k, v, dout, problem)
    assert got[1].dtype == dtype
    expected = _reference_docs(q, k, v, dout, causal, window, problem.q_positions, problem.k_positions)
    _check(got, expected, dtype)


# Packed documents (cu_seqlens): lengths 1, 127, 129, not multiples of 128, a document with no
# keys or no queries; causal, windows crossing document starts (a window longer than the
# document before it), bidirectional windows.
VARLEN_CASES = [
    ([1, 127, 129, 300, 64], None, 4, 4, True, (-1, -1)),
    ([129, 1, 127, 1000], None, 8, 2, False, (-1, -1)),
    ([200, 127, 129, 50], None, 4, 1, True, (150, -1)),
    ([127, 300, 1, 129], None, 8, 2, False, (100, 17)),
    ([64, 127, 300, 5], [200, 1, 129, 300], 4, 1, True, (-1, -1)),  # own key lengths, bottom-right
    ([64, 0, 129, 7], [130, 33, 0, 129], 8, 2, False, (40, 40)),
    # One long document among many short ones (one program per key tile of the packed batch,
    # tiling.tile_grid, over 26 documents), and equal lengths (one per key tile and document).
    ([2000, *[1, 129, 64] * 8, 5], None, 2, 1, True, (-1, -1)),
    ([256, 256, 256], None, 4, 2, True, (-1, -1)),
]


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids="d{}".format)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("lens_q", "lens_k", "heads", "kv_heads", "causal", "window"), VARLEN_CASES)
def test_fused_kernel_packed_documents(head_dim, dtype, heads, kv_heads, lens_q, lens_k, causal, window):
    lens_k = lens_q if lens_k is None else lens_k
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = cuda_randn(sum(lens_q), heads, head_dim, dtype=dtype, seed=71)
    k = cuda_randn(sum(lens_k), kv_heads, head_dim, dtype=dtype, seed=72)
    v = cuda_randn(sum(lens_k), kv_heads, head_dim, dtype=dtype, seed=73)
    dout = cuda_randn(sum(lens_q), heads, head_dim, dtype=dtype, seed=74)
    problem = build_problem(
        q, k, v, None, causal, window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
        max_seqlen_k=max(lens_k),
    )  # fmt: skip
    from ringflash.kernels.hopper.backward import TILES
    from ringflash.kernels.tiling import tile_grid

    n = TILES[head_dim][1]
    _, packed_docs = tile_grid(max(lens_k), kv_heads, len(lens_k), n, packed_total=sum(lens_k))
    assert packed_docs == (len(lens_k) if len(set(lens_k)) > 1 else 0)
    got = _fused_grads(q, k, v, dout, problem)
    expected = _reference_docs(
        q, k, v, dout, causal, window, problem.q_positions, problem.k_positions, cu_q.cpu(), cu_k.cpu()
    )
    _check(got, expected, dtype)


# A ring step's blocks: stripe positions (stride 2, the other rank's offset), an off-diagonal block
# whose keys precede the queries, per_len offsets, and a window over stripes.
POSITION_CASES = [
    (256, 256, TokenPositions(1, 2), TokenPositions(0, 2), True, (-1, -1)),
    (200, 300, TokenPositions(0, 2), TokenPositions(1, 2), True, (-1, -1)),
    (384, 256, TokenPositions(4096), TokenPositions(3900), True, (-1, -1)),
    (300, 300, TokenPositions(8192, 2), TokenPositions(8192 - 301, 2), False, (150, 0)),
    (129, 257, TokenPositions(0, 1, per_len=1), TokenPositions(0, 1), True, (64, -1)),
]


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids="d{}".format)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "q_pos", "k_pos", "causal", "window"), POSITION_CASES)
def test_fused_kernel_ring_step_positions(head_dim, dtype, seqlen_q, seqlen_k, q_pos, k_pos, causal, window):
    q = cuda_randn(2, seqlen_q, 8, head_dim, dtype=dtype, seed=81)
    k = cuda_randn(2, seqlen_k, 2, head_dim, dtype=dtype, seed=82)
    v = cuda_randn(2, seqlen_k, 2, head_dim, dtype=dtype, seed=83)
    dout = cuda_randn(2, seqlen_q, 8, head_dim, dtype=dtype, seed=84)
    problem = build_problem(q, k, v, None, causal, window, q_positions=q_pos, k_positions=k_pos)
    # The ring's accumulators: float32 buffers with earlier steps' sums in them.
    bufs = [cuda_randn(*t.shape, dtype=torch.float32, seed=85 + i) for i, t in enumerate((q, k, v))]
    before = [b.clone() for b in bufs]
    got = _fused_grads(q, k, v, dout, problem, accumulate_into=bufs)
    expected = _reference_docs(q, k, v, dout, causal, window, q_pos, k_pos)
    _check(got, expected, dtype, bases=before)


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids="d{}".format)
def test_fused_kernel_masked_with_softcap_and_alibi(head_dim):
    """Packed documents, a causal window, a softcap that bites and ALiBi, in the MASKED variant."""
    lens = [129, 1, 300, 127]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = (cuda_randn(sum(lens), 8, head_dim, dtype=torch.float32, seed=91) * 4).bfloat16()
    k, v = (cuda_randn(sum(lens), 2, head_dim, seed=s) for s in (92, 93))
    dout = cuda_randn(sum(lens), 8, head_dim, seed=94)
    g = torch.Generator(device="cuda").manual_seed(95)
    slopes = 0.02 + 0.28 * torch.rand(len(lens), 8, device="cuda", generator=g)
    kw = dict(softcap=5.0, alibi_slopes=slopes)
    problem = build_problem(
        q, k, v, None, True, (100, -1), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300, max_seqlen_k=300,
        **kw,
    )  # fmt: skip
    got = _fused_grads(q, k, v, dout, problem)
    pos = problem.q_positions
    cu_cpu = cu.cpu().tolist()
    expected = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for i, (a, b) in enumerate(zip(cu_cpu, cu_cpu[1:])):
        qd, kd, vd = (t[a:b].detach().double().cpu()[None].requires_grad_() for t in (q, k, v))
        out, _ = reference_attention(
            qd, kd, vd, causal=True, window_size=(100, -1), q_pos=_positions(pos, b - a),
            k_pos=_positions(pos, b - a), softcap=5.0, alibi_slopes=slopes[i].cpu(),
        )  # fmt: skip
        out.backward(dout[a:b].double().cpu()[None])
        for e, t in zip(expected, (qd, kd, vd)):
            e[a:b] = t.grad[0]
    _check(got, expected, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [128, 256], ids="d{}".format)
def test_fused_kernel_adds_zeros_outside_its_rows(head_dim):
    """Tiles that run past a slice's end reduce-add exact zeros into the rows after it (the first
    sequence's, inside the tensor) and past the tensor's end (the second's, clipped by TMA), or
    at head_dim 256 (dq.py's kernel) store only the slice's rows: a float32 dQ buffer's other rows
    keep their bits, and dK/dV rows outside the slice are not written."""
    big_q, big_k, big_v, big_do = (
        cuda_randn(2, 1200, h, head_dim, seed=s) for s, h in ((101, 4), (102, 2), (103, 2), (104, 4))
    )
    qs, ks = slice(100, 1099), slice(1051, 1200)  # 999 queries; 149 keys, the last at the end
    q, k, v, dout = big_q[:, qs], big_k[:, ks], big_v[:, ks], big_do[:, qs]
    problem = build_problem(q, k, v, None, False, (-1, -1))
    bufs = [
        cuda_randn(*t.shape, dtype=torch.float32, seed=105 + i) for i, t in enumerate((big_q, big_k, big_v))
    ]
    before = [b.clone() for b in bufs]
    got = _fused_grads(q, k, v, dout, problem, accumulate_into=[b[:, s] for b, s in zip(bufs, (qs, ks, ks))])
    expected = _reference_docs(q, k, v, dout, False, (-1, -1), problem.q_positions, problem.k_positions)
    _check(got, expected, torch.bfloat16, bases=[b[:, s] for b, s in zip(before, (qs, ks, ks))])
    for buf, base, sl in zip(bufs, before, (qs, ks, ks)):
        outside = torch.ones(buf.shape[1], dtype=torch.bool)
        outside[sl] = False
        assert torch.equal(buf[:, outside], base[:, outside])
