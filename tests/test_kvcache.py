"""kernels/kvcache.py and kernels/decode.py: ``flash_attn_with_kvcache`` against a float64
reference built from the cache's own contents, with flash-attn's test parametrization (cache
lengths 1, 127, 129 mixed per batch row, new tokens 0-3, queries 1-3, GQA, paged caches with
shuffled page tables, every split count)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE
from reference import reference_attention, rel_err

import ringflash
from ringflash.kernels import kvcache

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.float16, torch.bfloat16]


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(DEVICE, dtype)


def _setup(batch, capacity, heads_k, head_dim, dtype, lengths, seqlen_new, seed=0):
    k_cache = _randn(batch, capacity, heads_k, head_dim, dtype=dtype, seed=seed)
    v_cache = _randn(batch, capacity, heads_k, head_dim, dtype=dtype, seed=seed + 1)
    k = _randn(batch, seqlen_new, heads_k, head_dim, dtype=dtype, seed=seed + 2) if seqlen_new else None
    v = _randn(batch, seqlen_new, heads_k, head_dim, dtype=dtype, seed=seed + 3) if seqlen_new else None
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, k, v, seqlens


def _expected(q, keys, values, lengths, **kw):
    """Per sequence: float64 attention over its first lengths[b] keys (bottom-right aligned)."""
    outs, lses = [], []
    for b, n in enumerate(lengths):
        o, lse = reference_attention(q[b : b + 1], keys[b : b + 1, :n], values[b : b + 1, :n], **kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _assert_close(out, lse, exp_out, exp_lse, dtype):
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out.double().cpu(), exp_out) < TOL[dtype], "out"
    seen = exp_lse > -math.inf
    assert (lse.cpu()[~seen] == -math.inf).all()
    assert rel_err(lse.double().cpu()[seen], exp_lse[seen]) < 1e-4, "lse"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("seqlen_q", "seqlen_new", "heads", "heads_k", "head_dim", "num_splits"),
    [
        (1, 1, 4, 2, 64, 0), (1, 0, 4, 1, 36, 3), (3, 3, 4, 2, 64, 2), (2, 1, 2, 2, 128, 1),
        (1, 1, 8, 2, 256, 0),
    ],  # fmt: skip
)
def test_matches_float64_over_the_appended_cache(
    dtype, causal, seqlen_q, seqlen_new, heads, heads_k, head_dim, num_splits
):
    lengths = [1, 127, 129]
    capacity = 136
    k_cache, v_cache, k, v, seqlens = _setup(
        3, capacity, heads_k, head_dim, dtype, lengths, seqlen_new, seed=1
    )
    before = k_cache.clone(), v_cache.clone()
    q = _randn(3, seqlen_q, heads, head_dim, dtype=dtype, seed=9)
    out, lse = ringflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=causal, num_splits=num_splits,
        return_softmax_lse=True,
    )  # fmt: skip
    keys, values = before
    if seqlen_new:  # where flash-attn appends: rows lengths[b] .. lengths[b] + seqlen_new - 1
        for b, n in enumerate(lengths):
            keys[b, n : n + seqlen_new], values[b, n : n + seqlen_new] = k[b], v[b]
    assert torch.equal(k_cache, keys) and torch.equal(v_cache, values)  # nothing else written
    total = [n + seqlen_new for n in lengths]
    exp_out, exp_lse = _expected(q, keys, values, total, causal=causal)
    _assert_close(out, lse, exp_out, exp_lse, dtype)


def test_every_split_count_gives_the_same_answer():
    dtype = torch.float32
    k_cache, v_cache, _, _, seqlens = _setup(2, 200, 2, 32, dtype, [197, 64], 0, seed=3)
    q = _randn(2, 1, 4, 32, dtype=dtype, seed=4)
    exp_out, exp_lse = _expected(q, k_cache, v_cache, [197, 64])
    first = None
    for splits in range(1, 17):
        out, lse = ringflash.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits, return_softmax_lse=True
        )
        _assert_close(out, lse, exp_out, exp_lse, dtype)
        first = first if first is not None else out
        assert (out - first).abs().max() < 1e-5, splits


@pytest.mark.parametrize("page_size", [8, 16, 24, 48, 64, 128])
def test_paged_cache_equals_dense(page_size):
    """A paged cache with a shuffled page table (pages of other sequences between) gives the
    dense answer, and its appends land on the pages the table names."""
    dtype, batch, heads_k, head_dim, pages_per_seq = torch.float32, 2, 2, 32, 4
    lengths, seqlen_new = [page_size * 2 + 5, 3], 2
    capacity = page_size * pages_per_seq
    k_dense, v_dense, k, v, seqlens = _setup(
        batch, capacity, heads_k, head_dim, dtype, lengths, seqlen_new, seed=5
    )
    order = torch.randperm(batch * pages_per_seq, generator=torch.Generator().manual_seed(0))
    table = order.view(batch, pages_per_seq).to(DEVICE, torch.int32)
    k_paged = torch.zeros(batch * pages_per_seq, page_size, heads_k, head_dim, dtype=dtype, device=DEVICE)
    v_paged = torch.zeros_like(k_paged)
    for b in range(batch):
        for j in range(pages_per_seq):
            k_paged[table[b, j]] = k_dense[b, j * page_size : (j + 1) * page_size]
            v_paged[table[b, j]] = v_dense[b, j * page_size : (j + 1) * page_size]
    q = _randn(batch, 2, 4, head_dim, dtype=dtype, seed=6)
    kw = dict(cache_seqlens=seqlens, causal=True, return_softmax_lse=True)
    dense = ringflash.flash_attn_with_kvcache(q, k_dense, v_dense, k, v, **kw)
    paged = ringflash.flash_attn_with_kvcache(q, k_paged, v_paged, k, v, block_table=table, **kw)
    for a, b in zip(dense, paged):
        assert (a - b).abs().max() < 1e-5
    for b in range(batch):
        for j in range(pages_per_seq):
            assert torch.equal(k_paged[table[b, j]], k_dense[b, j * page_size : (j + 1) * page_size])


def test_cache_batch_idx_picks_the_rows():
    dtype = torch.float32
    k_cache, v_cache, k, v, _ = _setup(4, 40, 1, 16, dtype, [0] * 4, 1, seed=7)
    k, v = k[:2], v[:2]
    rows = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([10, 20], dtype=torch.int32, device=DEVICE)
    before = k_cache.clone()
    q = _randn(2, 1, 2, 16, dtype=dtype, seed=8)
    out, lse = ringflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=rows, return_softmax_lse=True
    )
    before[3, 10], before[1, 20] = k[0, 0], k[1, 0]
    assert torch.equal(k_cache, before)
    exp_out, exp_lse = _expected(q, k_cache[rows.long()], v_cache[rows.long()], [11, 21])
    _assert_close(out, lse, exp_out, exp_lse, dtype)


def _rotate64(x, cos, sin, interleaved):
    """Rotary in float64 as complex multiplication: pairs (2i, 2i+1) or (i, i + half)."""
    half = cos.shape[-1]
    x = x.double()
    if interleaved:
        pairs = torch.complex(x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2])
    else:
        pairs = torch.complex(x[..., :half], x[..., half : 2 * half])
    rotated = pairs * torch.complex(cos.double(), sin.double())[:, :, None]
    parts = (rotated.real, rotated.imag)
    head = torch.stack(parts, -1).flatten(-2) if interleaved else torch.cat(parts, -1)
    return torch.cat((head, x[..., 2 * half :]), -1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_on_q_and_the_appended_keys(interleaved, causal):
    """flash-attn's positions: the new keys at cache_seqlens + i; q at cache_seqlens + t when
    causal, else all at cache_seqlens."""
    dtype, head_dim, rotary_dim, seqlen_new = torch.float32, 32, 16, 2
    lengths = [5, 30]
    k_cache, v_cache, k, v, seqlens = _setup(2, 40, 1, head_dim, dtype, lengths, seqlen_new, seed=10)
    angles = torch.arange(64, dtype=torch.float64)[:, None] * (0.3 + torch.arange(rotary_dim // 2) / 10)
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    # q and k strided (every other head of a larger tensor): rotary makes contiguous copies
    q = _randn(2, seqlen_new, 4, head_dim, dtype=dtype, seed=11)[:, :, ::2]
    k = k.repeat(1, 1, 2, 1)[:, :, :1]
    keys, values = k_cache.clone().double().cpu(), v_cache.clone().double().cpu()
    out, lse = ringflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=seqlens, causal=causal,
        rotary_interleaved=interleaved, return_softmax_lse=True,
    )  # fmt: skip
    rq = []
    for b, n in enumerate(lengths):
        pos = torch.arange(n, n + seqlen_new)
        keys[b, pos] = _rotate64(k[b : b + 1].cpu(), cos.cpu()[pos][None], sin.cpu()[pos][None], interleaved)[
            0
        ]
        values[b, pos] = v[b].double().cpu()
        qpos = pos if causal else torch.full((seqlen_new,), n)
        rq.append(_rotate64(q[b : b + 1].cpu(), cos.cpu()[qpos][None], sin.cpu()[qpos][None], interleaved))
    assert rel_err(k_cache.double().cpu(), keys) < 1e-6  # the cache holds the rotated keys
    exp_out, exp_lse = _expected(
        torch.cat(rq), keys, values, [n + seqlen_new for n in lengths], causal=causal
    )
    _assert_close(out, lse, exp_out, exp_lse, dtype)


@pytest.mark.parametrize(
    "features",
    [
        dict(window_size=(5, 0)),
        dict(window_size=(3, 2)),
        dict(causal=True, window_size=(4, -1)),
        dict(softcap=2.0),
        dict(alibi=True, causal=True),
        dict(alibi="shared", causal=True),  # slopes (heads,): one per head for every sequence
        dict(sinks=True),
        dict(softmax_scale=0.3, softcap=1.5, alibi=True, sinks=True, causal=True),
    ],
    ids=lambda f: "-".join(f),
)
def test_masks_and_score_features(features):
    features = dict(features)
    dtype, heads, heads_k, head_dim = torch.float32, 4, 2, 32
    lengths, seqlen_new = [9, 70], 3
    k_cache, v_cache, k, v, seqlens = _setup(2, 80, heads_k, head_dim, dtype, lengths, seqlen_new, seed=12)
    q = _randn(2, 3, heads, head_dim, dtype=dtype, seed=13, scale=2.0)
    alibi = features.pop("alibi", None)
    slopes = torch.rand(2, heads, generator=torch.Generator().manual_seed(1)).to(DEVICE) if alibi else None
    given = slopes[0] if alibi == "shared" else slopes
    if alibi == "shared":
        slopes = slopes[:1].expand(2, heads)
    sinks = (
        (torch.randn(heads, generator=torch.Generator().manual_seed(2)) + 1).to(DEVICE)
        if features.pop("sinks", 0)
        else None
    )
    keys, values = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        keys[b, n : n + seqlen_new], values[b, n : n + seqlen_new] = k[b], v[b]
    out, lse = ringflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, alibi_slopes=given, sinks=sinks, num_splits=2,
        return_softmax_lse=True, **features,
    )  # fmt: skip
    exp_out, exp_lse = _expected_with_features(q, keys, values, lengths, seqlen_new, slopes, sinks, features)
    _assert_close(out, lse, exp_out, exp_lse, dtype)


def _expected_with_features(q, keys, values, lengths, seqlen_new, slopes, sinks, features):
    outs, lses = [], []
    for b, n in enumerate(lengths):
        total = n + seqlen_new
        o, lse = reference_attention(
            q[b : b + 1], keys[b : b + 1, :total], values[b : b + 1, :total],
            alibi_slopes=None if slopes is None else slopes[b].cpu(),
            sinks=sinks, **features,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("paged", [False, True])
def test_cache_leftpad_skips_the_padding_rows(paged):
    """flash-attn's cache_leftpad: sequence b's keys are rows leftpad[b] .. cache_seqlens[b] +
    seqlen_new - 1; positions (masks, ALiBi, rotary) stay the rows, so the result equals
    attention over those rows with the queries at the last positions."""
    dtype, head_dim, seqlen_new, seqlen_q = torch.float32, 32, 2, 3
    lengths, pads = [40, 9], [13, 0]
    k_cache, v_cache, k, v, seqlens = _setup(2, 64, 2, head_dim, dtype, lengths, seqlen_new, seed=50)
    leftpad = torch.tensor(pads, dtype=torch.int32, device=DEVICE)
    q = _randn(2, seqlen_q, 4, head_dim, dtype=dtype, seed=51)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    keys, values = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        keys[b, n : n + seqlen_new], values[b, n : n + seqlen_new] = k[b], v[b]
    caches, table = (k_cache, v_cache), None
    if paged:  # pages of 16 rows, sequence 1's first
        table = torch.tensor([[4, 5, 6, 7], [0, 1, 2, 3]], dtype=torch.int32, device=DEVICE)
        caches = tuple(c.view(8, 16, 2, head_dim)[[4, 5, 6, 7, 0, 1, 2, 3]].contiguous() for c in caches)
    options = dict(causal=True, window_size=(35, 0), alibi_slopes=slopes)  # the window reaches the padding
    out, lse = ringflash.flash_attn_with_kvcache(
        q, *caches, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad, block_table=table, num_splits=3,
        return_softmax_lse=True, **options,
    )  # fmt: skip
    outs, lses = [], []
    for b, (n, pad) in enumerate(zip(lengths, pads)):
        total = n + seqlen_new
        o, lse_b = reference_attention(
            q[b : b + 1], keys[b : b + 1, pad:total], values[b : b + 1, pad:total], causal=True,
            window_size=(35, 0), alibi_slopes=slopes[b].cpu(), q_pos=torch.arange(total - seqlen_q, total),
            k_pos=torch.arange(pad, total),
        )  # fmt: skip
        outs.append(o)
        lses.append(lse_b)
    _assert_close(out, lse, torch.cat(outs), torch.cat(lses), dtype)


def test_prefill_then_decode_equals_causal_attention_over_the_sequence():
    """A prompt appended in one call, then tokens one at a time: each step's output equals
    causal attention over the whole sequence so far (flash_attn_func on it)."""
    dtype, heads, heads_k, head_dim, prompt, steps = torch.float32, 4, 2, 32, 37, 5
    total = prompt + steps
    q_all = _randn(1, total, heads, head_dim, dtype=dtype, seed=20)
    k_all = _randn(1, total, heads_k, head_dim, dtype=dtype, seed=21)
    v_all = _randn(1, total, heads_k, head_dim, dtype=dtype, seed=22)
    k_cache = torch.zeros(1, 64, heads_k, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    whole = ringflash.flash_attn_func(q_all, k_all, v_all, causal=True)
    out = ringflash.flash_attn_with_kvcache(
        q_all[:, :prompt],
        k_cache,
        v_cache,
        k_all[:, :prompt],
        v_all[:, :prompt],
        cache_seqlens=0,
        causal=True,
    )
    pieces = [out]
    for i in range(prompt, total):
        s = slice(i, i + 1)
        pieces.append(ringflash.flash_attn_with_kvcache(
            q_all[:, s], k_cache, v_cache, k_all[:, s], v_all[:, s], cache_seqlens=i, causal=True
        ))  # fmt: skip
    assert rel_err(torch.cat(pieces, 1), whole) < 1e-5


def test_bad_input_raises_clear_errors():
    dtype = torch.float32
    k_cache, v_cache, k, v, _ = _setup(2, 16, 2, 16, dtype, [0, 0], 2, seed=30)
    q = _randn(2, 1, 4, 16, dtype=dtype, seed=31)
    seq = lambda *n: torch.tensor(n, dtype=torch.int32, device=DEVICE)  # noqa: E731
    table = torch.tensor([[0, 1], [2, 5]], dtype=torch.int32, device=DEVICE)
    pages = torch.zeros(4, 8, 2, 16, dtype=dtype, device=DEVICE)
    cases = {
        "cache holds 16": lambda: kvcache.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seq(3, 15)
        ),
        "cache_seqlens must be >= 0": lambda: kvcache.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seq(-1, 2)
        ),
        "block_table entries": lambda: kvcache.flash_attn_with_kvcache(
            q, pages, pages, cache_seqlens=seq(3, 9), block_table=table
        ),
        "cache_batch_idx entries": lambda: kvcache.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=1, cache_batch_idx=seq(0, 2)
        ),
        "q's dtype": lambda: kvcache.flash_attn_with_kvcache(q.half(), k_cache, v_cache),
        "multiple of the cache's heads_k": lambda: kvcache.flash_attn_with_kvcache(
            q[:, :, :3], k_cache, v_cache
        ),
        "head_dim": lambda: kvcache.flash_attn_with_kvcache(q[..., :8], k_cache, v_cache),
        "pass both or neither": lambda: kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k),
        "pass k and v too": lambda: kvcache.flash_attn_with_kvcache(
            q, k_cache, v_cache, rotary_cos=k_cache[0, :, 0, :4], rotary_sin=k_cache[0, :, 0, :4]
        ),
        "positions": lambda: kvcache.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, k_cache[0, :4, 0, :4], k_cache[0, :4, 0, :4], cache_seqlens=3
        ),
        "queries reach position 5": lambda: kvcache.flash_attn_with_kvcache(  # 3 causal queries, 1 new key
            q.expand(2, 3, 4, 16), k_cache, v_cache, k[:, :1], v[:, :1], k_cache[0, :4, 0, :4],
            k_cache[0, :4, 0, :4], cache_seqlens=3, causal=True,
        ),
        "cache_leftpad entries": lambda: kvcache.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seq(3, 2), cache_leftpad=seq(0, 3)
        ),
        "num_splits": lambda: kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=-1),
        "int32": lambda: kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seq(1, 1).long()),
    }
    for match, call in cases.items():
        before = k_cache.clone()
        with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
            call()
        assert torch.equal(k_cache, before), f"{match}: the cache was written before the error"


def test_a_planned_call_lets_no_bad_argument_through():
    """Calls are planned once per key of shapes, strides, dtypes and options: after a good call,
    the same call with an argument of the wrong kind still raises (True == 1, but only a bool
    is a valid causal and only ints a valid window)."""
    k_cache, v_cache, _, _, _ = _setup(2, 16, 2, 16, torch.float32, [0, 0], 0, seed=33)
    q = _randn(2, 1, 4, 16, seed=34)
    good = dict(cache_seqlens=3, causal=True, window_size=(2, 0), num_splits=2)
    kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, **good)
    bad = [
        (TypeError, dict(good, causal=1)),
        (TypeError, dict(good, window_size=(2, False))),
        (ValueError, dict(good, num_splits=True)),
        (TypeError, dict(good, cache_seqlens=True)),
        (TypeError, dict(good, block_table=[[0]])),
    ]
    for error, options in bad:
        with pytest.raises(error):
            kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, **options)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        kvcache.flash_attn_with_kvcache(q.tolist(), k_cache, v_cache, **good)


def test_signature_is_flash_attns():
    import inspect

    names = list(inspect.signature(ringflash.flash_attn_with_kvcache).parameters)
    assert names[:19] == [
        "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
        "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size", "softcap",
        "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse",
    ]  # fmt: skip
    kinds = inspect.signature(ringflash.flash_attn_with_kvcache).parameters
    assert all(kinds[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names[19:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_step_captures_in_a_cuda_graph():
    """A decode step (append one token, attend, 4 splits) with check_bounds=False captured in a
    CUDA graph replays like eager calls on the same static cache, step after step."""
    dtype, batch, heads, heads_k, head_dim, capacity = torch.float16, 2, 8, 2, 64, 512
    k_cache, v_cache, _, _, _ = _setup(batch, capacity, heads_k, head_dim, dtype, [0] * batch, 0, seed=40)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor([100, 300], dtype=torch.int32, device=DEVICE)
    heads_of = (heads, heads_k, heads_k)
    q, k, v = (_randn(batch, 1, h, head_dim, dtype=dtype, seed=41 + i) for i, h in enumerate(heads_of))

    def step(kc, vc):
        return kvcache.flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=seqlens, causal=True, num_splits=4, check_bounds=False,
            return_softmax_lse=True,
        )  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (compiles, caches)
        step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step(k_cache, v_cache)
    for _ in range(3):
        graph.replay()
        expected = step(eager_k, eager_v)
        torch.cuda.synchronize()
        assert torch.equal(static[0], expected[0]) and torch.equal(static[1], expected[1])
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
        seqlens += 1  # the next step appends after this one (the graph reads the tensor)
        q.normal_()


def test_a_compiled_decode_step_equals_eager():
    """Under torch.compile a decode step (append, attend, causal, int cache_seqlens) is one
    opaque op that writes the caches: no graph break, the same output, LSE and caches as eager."""
    dtype, batch, heads, heads_k, head_dim, capacity = torch.float32, 2, 4, 2, 32, 64
    k_cache, v_cache, k, v, _ = _setup(batch, capacity, heads_k, head_dim, dtype, [0, 0], 1, seed=50)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    q = _randn(batch, 1, heads, head_dim, dtype=dtype, seed=51)

    def step(kc, vc, length):
        return ringflash.flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=length, causal=True, return_softmax_lse=True, num_splits=2
        )

    explain = torch._dynamo.explain(step)(k_cache.clone(), v_cache.clone(), 20)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for length in (20, 21):
        got, expected = compiled(k_cache, v_cache, length), step(eager_k, eager_v, length)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
    assert torch.equal(k_cache[:, 20], k[:, 0]) and torch.equal(k_cache[:, 21], k[:, 0])  # both appended


def test_a_decode_loop_with_int_lengths_shares_one_plan():
    """cache_seqlens as a growing int (as a generate loop passes it) does not make a plan per
    length; a negative one still raises."""
    k_cache, v_cache, k, v, _ = _setup(1, 32, 1, 16, torch.float32, [0], 1, seed=60)
    q = _randn(1, 1, 2, 16, seed=61)
    kvcache._PLANS.clear()
    for length in range(5, 9):
        kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=length, causal=True)
    assert len(kvcache._PLANS) == 1
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=-1, causal=True)


def test_split_kv_attention_is_its_plan_and_run():
    """decode.split_kv_attention (the kernel module's unchecked entry: plan_split_kv then
    run_split_kv) gives flash_attn_with_kvcache's result over the same cache."""
    from ringflash.kernels import decode

    k_cache, v_cache, _, _, seqlens = _setup(2, 48, 2, 32, torch.float32, [17, 40], 0, seed=70)
    q = _randn(2, 2, 4, 32, seed=71)
    expected = ringflash.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, num_splits=3, return_softmax_lse=True
    )
    got = decode.split_kv_attention(
        q, k_cache, v_cache, seqlens, 0, softmax_scale=32**-0.5, window=(None, 0), softcap=0.0,
        alibi_slopes=None, batch_idx=None, block_table=None, num_splits=3, key_offset=0, held=48,
    )  # fmt: skip
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
