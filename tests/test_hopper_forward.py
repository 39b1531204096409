"""The warp-specialized Hopper forward (kernels/hopper/forward.py) on an sm_90 GPU, against float64.

Each case first asserts that ``uses_fused_forward`` picks the Hopper kernel, so a test cannot
pass on the Triton kernel by accident. Its sm_90 build on the CPU is checked in test_compile.py.
"""

from __future__ import annotations

import pytest
import torch
from reference import TOLERANCE, reference_attention, rel_err
from sm90 import ALIBI_CASES, SM90, alibi_inputs, cuda_randn

from ringflash.kernels import TokenPositions, attention_forward, build_problem, uses_fused_forward

pytestmark = [pytest.mark.gpu, SM90]

D = 128


def _check(out, lse, q, k, v, causal, dtype):
    exp_out, exp_lse = reference_attention(*(t.double().cpu() for t in (q, k, v)), causal=causal)
    assert rel_err(out.double().cpu(), exp_out) < TOLERANCE[dtype], "out"
    assert rel_err(lse.double().cpu(), exp_lse) < 1e-4, "lse"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal"),
    [
        (2, 384, 384, 4, 4, False),
        (2, 384, 384, 4, 4, True),
        (1, 1024, 1024, 8, 2, True),
        (1, 256, 640, 4, 1, False),
        (2, 512, 128, 6, 3, False),
        (1, 128, 128, 2, 2, True),
    ],
)
def test_fused_forward_matches_float64(dtype, batch, seqlen_q, seqlen_k, heads, kv_heads, causal):
    from ringflash.kernels.hopper.forward import fused_forward

    q = cuda_randn(batch, seqlen_q, heads, D, dtype=dtype, seed=1)
    k = cuda_randn(batch, seqlen_k, kv_heads, D, dtype=dtype, seed=2)
    v = cuda_randn(batch, seqlen_k, kv_heads, D, dtype=dtype, seed=3)
    problem = build_problem(q, k, v, None, causal, (-1, -1))
    assert uses_fused_forward(problem, q, k, v)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen_q, device="cuda", dtype=torch.float32)
    fused_forward(q, k, v, problem, out, lse)
    assert out.dtype == dtype
    _check(out, lse, q, k, v, causal, dtype)


def test_fused_forward_through_flash_attn_func_equals_triton(monkeypatch):
    """The public entry point takes the Hopper path, and agrees with the Triton kernel."""
    import ringflash

    q, k, v = (cuda_randn(2, 2048, 8, D, seed=s) for s in range(3))
    problem = build_problem(q, k, v, None, True, (-1, -1))
    assert uses_fused_forward(problem, q, k, v)
    out, lse = ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    monkeypatch.setenv("RINGFLASH_FUSED_FORWARD", "0")
    assert not uses_fused_forward(problem, q, k, v)
    ref_out, ref_lse = ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert rel_err(out.float(), ref_out.float()) < 1e-2
    assert rel_err(lse, ref_lse) < 1e-5


def test_fused_forward_writes_into_float32_slices():
    """The ring's call: query/key slices of larger shards, out and LSE written into slices of
    float32 buffers, with the rows outside them untouched."""
    big_q, big_k, big_v = (cuda_randn(2, 640, h, D, seed=s) for s, h in ((5, 4), (6, 2), (7, 2)))
    qs, ks = slice(128, 384), slice(256, 640)
    q, k, v = big_q[:, qs], big_k[:, ks], big_v[:, ks]
    problem = build_problem(q, k, v, None, False, (-1, -1))
    assert uses_fused_forward(problem, q, k, v)
    out_buf = cuda_randn(2, 640, 4, D, dtype=torch.float32, seed=8)
    lse_buf = cuda_randn(2, 4, 640, dtype=torch.float32, seed=9)
    before = out_buf.clone(), lse_buf.clone()
    out, lse = attention_forward(q, k, v, problem, out=out_buf[:, qs], lse=lse_buf[:, :, qs])
    assert out.data_ptr() == out_buf[:, qs].data_ptr()
    _check(out, lse, q, k, v, False, torch.bfloat16)
    outside = torch.ones(640, dtype=torch.bool)
    outside[qs] = False
    assert torch.equal(out_buf[:, outside], before[0][:, outside])
    assert torch.equal(lse_buf[:, :, outside], before[1][:, :, outside])


def test_fused_forward_on_a_diagonal_block_with_offsets():
    """A ring shard's own causal block sits at the same global positions on both sides."""
    q, k, v = (cuda_randn(1, 256, 2, D, seed=s) for s in range(10, 13))
    pos = TokenPositions(1024)
    problem = build_problem(q, k, v, None, True, (-1, -1), q_positions=pos, k_positions=pos)
    assert uses_fused_forward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    _check(out, lse, q, k, v, True, torch.bfloat16)


def test_fused_forward_is_chosen_only_where_it_applies(monkeypatch):
    q, k, v = (cuda_randn(1, 256, 2, D, seed=s) for s in range(3))

    def fused(q=q, k=k, v=v, causal=True, window=(-1, -1), **kw):
        return uses_fused_forward(build_problem(q, k, v, None, causal, window, **kw), q, k, v)

    assert fused()
    assert fused(window=(64, 0))
    assert fused(q=q[:, :100])  # causal, seqlen_q != seqlen_k: bottom-right aligned
    assert fused(q_positions=TokenPositions(0, 2), k_positions=TokenPositions(1, 2))  # stripe
    assert fused(q=q[:, :193], k=k[:, :193], v=v[:, :193])
    assert fused(*(t[..., :64].contiguous() for t in (q, k, v)))
    assert fused(*(t[..., :96].contiguous() for t in (q, k, v)))  # the 128 build, zero-padded
    assert not fused(*(t[..., :32].contiguous() for t in (q, k, v)))  # below every build: Triton
    assert not fused(*(t.float() for t in (q, k, v)))
    assert not fused(window=(2**29, 0))  # int32 position sums in the kernel
    monkeypatch.setenv("RINGFLASH_FUSED_FORWARD", "0")
    assert not fused()
    monkeypatch.delenv("RINGFLASH_FUSED_FORWARD")
    torch.use_deterministic_algorithms(True)  # the forward is deterministic: still chosen
    try:
        assert fused()
    finally:
        torch.use_deterministic_algorithms(False)


# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window, positions): flash-attn's
# odd lengths, tails of 1 and 127 past a tile, seqlen_q != seqlen_k both ways (bottom-right
# aligned), GQA and MQA, windows, and a ring step's strided / offset blocks (positions ((q
# start, stride), (k start, stride))).
GENERAL_CASES = [
    (2, 1, 1, 2, 2, 128, False, (-1, -1), None),
    (1, 127, 127, 4, 1, 128, True, (-1, -1), None),
    (2, 129, 129, 4, 4, 64, True, (-1, -1), None),
    (1, 1000, 1000, 4, 2, 128, False, (-1, -1), None),
    (2, 113, 203, 4, 4, 128, True, (-1, -1), None),
    (1, 339, 108, 2, 2, 256, True, (-1, -1), None),
    (1, 1023, 1024, 8, 2, 256, False, (-1, -1), None),
    (1, 1000, 1000, 4, 4, 64, True, (256, 0), None),
    (2, 777, 777, 4, 2, 128, False, (100, 50), None),
    (1, 512, 512, 2, 2, 256, True, (200, -1), None),
    (1, 300, 500, 4, 4, 128, True, (-1, -1), ((1001, 2), (0, 2))),
    (1, 384, 384, 4, 2, 64, True, (-1, -1), ((3, 4), (1, 4))),
    (1, 256, 384, 4, 4, 128, False, (64, 64), ((5000, 1), (4900, 1))),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim", "causal", "window", "positions"),
    GENERAL_CASES,
)
def test_fused_forward_any_lengths_windows_positions(
    dtype, batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window, positions
):
    q = cuda_randn(batch, seqlen_q, heads, head_dim, dtype=dtype, seed=31)
    k = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=32)
    v = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=33)
    kw, ref_kw = {}, {}
    if positions is not None:
        (qs, qd), (ks, kd) = positions
        kw = dict(q_positions=TokenPositions(qs, qd), k_positions=TokenPositions(ks, kd))
        ref_kw = dict(q_pos=qs + qd * torch.arange(seqlen_q), k_pos=ks + kd * torch.arange(seqlen_k))
    problem = build_problem(q, k, v, None, causal, window, **kw)
    assert uses_fused_forward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    exp_out, exp_lse = reference_attention(
        *(t.double().cpu() for t in (q, k, v)), causal=causal, window_size=window, **ref_kw
    )
    err = rel_err(out.double().cpu(), exp_out)
    assert err < TOLERANCE[dtype], f"out: rel err {err:.2e}"
    assert rel_err(lse.double().cpu(), exp_lse) < 1e-4, "lse"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "head_dim", "causal", "window", "softcap", "alibi"),
    [
        ([1, 127, 129, 1000, 64, 300], 4, 2, 128, True, (-1, -1), 0.0, False),
        ([129, 1, 511, 256, 127], 4, 4, 64, False, (-1, -1), 0.0, False),
        ([700, 90, 1300], 2, 1, 128, True, (200, 0), 0.0, False),
        ([300, 257, 128], 2, 2, 256, True, (-1, -1), 0.0, False),
        ([450, 1, 333], 4, 2, 128, True, (-1, -1), 20.0, True),
        # One long document among many short ones: one program per tile of the packed batch
        # (tiling.tile_grid), found by a binary search over 32 documents; equal lengths: one
        # per (tile, document).
        ([3000, *[1, 127, 129] * 10, 5], 2, 1, 128, True, (-1, -1), 0.0, False),
        ([3000, *[1, 127, 129] * 10, 5], 2, 2, 64, False, (300, 0), 0.0, False),
        ([256, 256, 256], 4, 2, 128, True, (-1, -1), 0.0, False),
    ],
)
def test_fused_forward_packed_documents(
    dtype, lengths, heads, kv_heads, head_dim, causal, window, softcap, alibi
):
    """Packed documents read in place (no padding copies): each document against its own float64
    attention; windows that would reach across a document's start stop there."""
    total = sum(lengths)
    q = cuda_randn(total, heads, head_dim, dtype=dtype, seed=51)
    k = cuda_randn(total, kv_heads, head_dim, dtype=dtype, seed=52)
    v = cuda_randn(total, kv_heads, head_dim, dtype=dtype, seed=53)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    slopes = 0.02 + 0.2 * torch.rand(len(lengths), heads, device="cuda") if alibi else None
    problem = build_problem(
        q, k, v, None, causal, window, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths), softcap=softcap, alibi_slopes=slopes,
    )  # fmt: skip
    assert uses_fused_forward(problem, q, k, v)
    from ringflash.kernels.hopper.query_tiles import BLOCK_M
    from ringflash.kernels.tiling import tile_grid

    _, packed_docs = tile_grid(max(lengths), heads, len(lengths), BLOCK_M, packed_total=total)
    assert packed_docs == (len(lengths) if len(set(lengths)) > 1 else 0)
    out, lse = attention_forward(q, k, v, problem)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        doc = [t[a:b].unsqueeze(0).double().cpu() for t in (q, k, v)]
        extra = dict(alibi_slopes=slopes[i].cpu()) if alibi else {}
        exp_out, exp_lse = reference_attention(
            *doc, causal=causal, window_size=window, softcap=softcap, **extra
        )
        err = rel_err(out[a:b].unsqueeze(0).double().cpu(), exp_out)
        assert err < TOLERANCE[dtype], f"document {i}: out rel err {err:.2e}"
        assert rel_err(lse[:, a:b].unsqueeze(0).double().cpu(), exp_lse) < 1e-4, f"document {i}: lse"


# (softcap, query magnitude): scaled scores of std ~4 against a cap of 5, and of std ~16 against
# Gemma-2's 30 (tanh(16/30) = 0.49): the cap changes the answer in both (asserted).
SOFTCAPS = [(5.0, 4.0), (30.0, 16.0)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("softcap, q_scale", SOFTCAPS)
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal"),
    [(2, 384, 384, 4, 4, False), (1, 512, 512, 8, 2, True), (1, 256, 640, 4, 1, False)],
)
def test_fused_forward_with_softcap_matches_float64(
    dtype, softcap, q_scale, batch, seqlen_q, seqlen_k, heads, kv_heads, causal
):
    q = (cuda_randn(batch, seqlen_q, heads, D, dtype=torch.float32, seed=21) * q_scale).to(dtype)
    k = cuda_randn(batch, seqlen_k, kv_heads, D, dtype=dtype, seed=22)
    v = cuda_randn(batch, seqlen_k, kv_heads, D, dtype=dtype, seed=23)
    problem = build_problem(q, k, v, None, causal, (-1, -1), softcap=softcap)
    assert uses_fused_forward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    qd, kd, vd = (t.double().cpu() for t in (q, k, v))
    exp_out, exp_lse = reference_attention(qd, kd, vd, causal=causal, softcap=softcap)
    uncapped, _ = reference_attention(qd, kd, vd, causal=causal)
    assert rel_err(uncapped, exp_out) > 0.1  # the cap bites
    err = rel_err(out.double().cpu(), exp_out)
    assert err < TOLERANCE[dtype], f"out: rel err {err:.2e}"
    assert rel_err(lse.double().cpu(), exp_lse) < 1e-4, "lse"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "causal", "softcap", "positions"), ALIBI_CASES
)
def test_fused_forward_with_alibi_matches_float64(
    dtype, batch, seqlen_q, seqlen_k, heads, kv_heads, causal, softcap, positions
):
    q, k, v, slopes, kw, ref_kw = alibi_inputs(
        batch, seqlen_q, seqlen_k, heads, kv_heads, causal, softcap, positions, dtype, seed=40
    )
    problem = build_problem(q, k, v, None, causal, (-1, -1), **kw)
    assert uses_fused_forward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    qd, kd, vd = (t.double().cpu() for t in (q, k, v))
    exp_out, exp_lse = reference_attention(qd, kd, vd, alibi_slopes=slopes.cpu(), **ref_kw)
    without, _ = reference_attention(qd, kd, vd, **ref_kw)
    assert rel_err(without, exp_out) > 0.1  # the bias changes the answer
    err = rel_err(out.double().cpu(), exp_out)
    assert err < TOLERANCE[dtype], f"out: rel err {err:.2e}"
    assert rel_err(lse.double().cpu(), exp_lse) < 1e-4, "lse"


def test_fused_forward_gate_with_softcap_and_alibi():
    q, k, v = (cuda_randn(1, 256, 2, D, seed=s) for s in range(3))
    slopes = torch.full((2,), 0.25, device="cuda")

    def fused(**kw):
        return uses_fused_forward(build_problem(q, k, v, None, False, (-1, -1), **kw), q, k, v)

    assert fused(softcap=20.0)
    assert fused(alibi_slopes=slopes, softcap=20.0)
    far = TokenPositions(2**22)  # positions past float32's exact range for the bias
    assert fused(alibi_slopes=slopes, q_positions=TokenPositions(2**21), k_positions=TokenPositions(0))
    assert not fused(alibi_slopes=slopes, q_positions=far, k_positions=TokenPositions(0))
    assert fused(q_positions=far, k_positions=TokenPositions(0))  # without ALiBi positions do not matter


@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_few_persistent_programs_walk_every_item(monkeypatch, programs, head_dim):
    """Programs that walk many work items each (here forced to 1 or 3): Q stages, K/V rings and
    claimed items carried across items of uneven work, causal rows of packed documents with a
    window, GQA, and slots of the packed grid that hold no rows (the documents of length 1)."""
    from ringflash.kernels.hopper import forward as hopper_forward

    monkeypatch.setattr(hopper_forward, "persistent_programs", lambda grid, device: programs)
    lengths = [1, 127, 129, 1000, 1, 64, 300]
    total = sum(lengths)
    q = cuda_randn(total, 4, head_dim, seed=61)
    k = cuda_randn(total, 2, head_dim, seed=62)
    v = cuda_randn(total, 2, head_dim, seed=63)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    problem = build_problem(
        q, k, v, None, True, (200, 0), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths),
    )  # fmt: skip
    assert uses_fused_forward(problem, q, k, v)
    out, lse = attention_forward(q, k, v, problem)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        doc = [t[a:b].unsqueeze(0).double().cpu() for t in (q, k, v)]
        exp_out, exp_lse = reference_attention(*doc, causal=True, window_size=(200, 0))
        err = rel_err(out[a:b].unsqueeze(0).double().cpu(), exp_out)
        assert err < TOLERANCE[torch.bfloat16], f"document {i}: out rel err {err:.2e}"
        assert rel_err(lse[:, a:b].unsqueeze(0).double().cpu(), exp_lse) < 1e-4, f"document {i}: lse"
    # Dense: query tiles that see no key (positions before every key's, causal) between others.
    q, k, v = (cuda_randn(2, 640, 4, head_dim, seed=s) for s in (64, 65, 66))
    positions = dict(q_positions=TokenPositions(0, 1), k_positions=TokenPositions(300, 1))
    problem = build_problem(q, k, v, None, True, (-1, -1), **positions)
    out, lse = attention_forward(q, k, v, problem)
    exp_out, exp_lse = reference_attention(
        *(t.double().cpu() for t in (q, k, v)),
        causal=True,
        q_pos=torch.arange(640),
        k_pos=300 + torch.arange(640),
    )
    assert rel_err(out.double().cpu(), exp_out) < TOLERANCE[torch.bfloat16], "dense out"
    seen = exp_lse > -float("inf")
    assert (lse.cpu()[~seen] == -float("inf")).all() and (out[:, :300] == 0).all()
    assert rel_err(lse.double().cpu()[seen], exp_lse[seen]) < 1e-4, "dense lse"


def test_tile_counter_is_zero_after_every_launch_on_every_stream():
    """The persistent forward's per-stream tile counter, never refilled, is set back to 0 by the
    launch that takes its last claim: launches of different item counts back to back (more items
    than SMs, so programs claim), on the default stream and on a side stream, each equal float64.
    A counter left at the last launch's count would end the next launch's programs after their
    first item, leaving rows unwritten."""
    from ringflash.kernels.hopper import forward as hopper_forward

    def run(batch: int, seqlen: int, seed: int) -> None:
        q, k, v = (cuda_randn(batch, seqlen, 8, D, seed=seed + s) for s in range(3))
        problem = build_problem(q, k, v, None, True, (-1, -1))
        assert uses_fused_forward(problem, q, k, v)
        out, lse = attention_forward(q, k, v, problem)
        _check(out, lse, q, k, v, True, torch.bfloat16)

    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            for batch, seqlen, seed in ((2, 2048, 70), (1, 1024, 80), (3, 1536, 90)):
                run(batch, seqlen, seed)
        stream.synchronize()
    counters = hopper_forward._TILE_COUNTERS
    for stream in (torch.cuda.current_stream(), side):
        assert counters[(torch.cuda.current_device(), stream.cuda_stream)].item() == 0
