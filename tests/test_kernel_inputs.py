"""Bad input raises ValueError/TypeError naming the argument, before anything reaches Triton."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import ringflash
from ringflash.kernels import (
    attention_backward,
    attention_delta,
    attention_forward,
    build_problem,
    configs,
    cu_seqlens_tensor,
)
from ringflash.kernels.configs import MAX_TILE_ROWS

# Under the interpreter an int32 overflow in a kernel raises here (tests/interpreter_patching.py).
pytestmark = pytest.mark.overflow_checks


def _qkv(device, b=1, s=8, h=2, hk=2, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, s, n, d, generator=g).to(device, dtype) for n in (h, hk, hk))


def _no_last_dim_stride(t):
    """Same values, stride(-1) != 1."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# Each case: function of (q, k, v) -> kwargs overriding flash_attn_func's, exception, match.
def _case(case_id, make, exc, match):
    return pytest.param(make, exc, match, id=case_id)


def _same_dim(n):
    """q, k, v cut or tiled to head_dim n."""
    return lambda q, k, v: {name: t.repeat(1, 1, 1, 17)[..., :n] for name, t in zip("qkv", (q, k, v))}


# Each case: function of (q, k, v) -> kwargs overriding flash_attn_func's, exception, match.
DENSE_CASES = [
    _case(
        "q-rank",
        lambda q, k, v: dict(q=q[0]),
        ValueError,
        r"q must be 4-D \(batch, seqlen, heads, head_dim\)",
    ),
    _case("k-rank", lambda q, k, v: dict(k=k[..., None]), ValueError, r"k must be 4-D"),
    _case("v-rank", lambda q, k, v: dict(v=v[0]), ValueError, r"v must be 4-D"),
    _case(
        "q-not-tensor", lambda q, k, v: dict(q=q.tolist()), TypeError, r"q must be a torch.Tensor, got list"
    ),
    _case("v-not-tensor", lambda q, k, v: dict(v=None), TypeError, r"v must be a torch.Tensor, got NoneType"),
    _case("dtype-mismatch", lambda q, k, v: dict(q=q.half()), TypeError, r"q, k, v must share a dtype"),
    _case("dtype-mismatch-v", lambda q, k, v: dict(v=v.half()), TypeError, r"q, k, v must share a dtype"),
    _case("int-q", lambda q, k, v: dict(q=q.int()), TypeError, r"q must be float16, bfloat16 or float32"),
    _case("int-k", lambda q, k, v: dict(k=k.long()), TypeError, r"k must be float16, bfloat16 or float32"),
    _case(
        "float64-v", lambda q, k, v: dict(v=v.double()), TypeError, r"v must be float16, bfloat16 or float32"
    ),
    _case("bool-q", lambda q, k, v: dict(q=q > 0), TypeError, r"q must be float16, bfloat16 or float32"),
    _case("kv-seqlen", lambda q, k, v: dict(v=v[:, :4]), ValueError, r"k and v must have the same shape"),
    _case("kv-heads", lambda q, k, v: dict(k=k[:, :, :1]), ValueError, r"k and v must have the same shape"),
    _case(
        "head-dim-mismatch",
        lambda q, k, v: dict(k=torch.cat([k, k], -1), v=torch.cat([v, v], -1)),
        ValueError,
        r"k head_dim 32 differs from q head_dim 16",
    ),
    _case("head-dim-264", _same_dim(264), ValueError, r"head_dim must be in \[1, 256\], got 264"),
    _case("head-dim-260", _same_dim(260), ValueError, r"head_dim must be in \[1, 256\], got 260"),
    _case("head-dim-0", _same_dim(0), ValueError, r"head_dim must be in \[1, 256\], got 0"),
    _case(
        "kv-heads-0",  # was a ZeroDivisionError
        lambda q, k, v: dict(k=k[:, :, :0], v=v[:, :, :0]),
        ValueError,
        r"k and v need at least one head, got shape \(1, 8, 0, 16\)",
    ),
    _case(
        "batch-over-grid",  # was a CUDA launch error on the GPU
        lambda q, k, v: {name: t[:, :1].repeat(65536, 1, 1, 1) for name, t in zip("qkv", (q, k, v))},
        ValueError,
        r"at most 65535 sequences and 65535 query heads per call",
    ),
    _case(
        "heads-not-divisible",
        lambda q, k, v: dict(q=torch.cat([q, q[:, :, :1]], 2)),
        ValueError,
        r"q heads \(3\) must be divisible by k/v heads \(2\)",
    ),
    _case(
        "q-last-dim-strided",
        lambda q, k, v: dict(q=_no_last_dim_stride(q)),
        ValueError,
        r"q must have a contiguous last \(head_dim\) dimension",
    ),
    _case(
        "v-last-dim-strided",
        lambda q, k, v: dict(v=_no_last_dim_stride(v)),
        ValueError,
        r"v must have a contiguous last \(head_dim\) dimension",
    ),
    _case(
        "k-every-other-element",
        lambda q, k, v: dict(k=torch.cat([k, k], -1)[..., ::2]),
        ValueError,
        r"k must have a contiguous last",
    ),
    _case(
        "batch-mismatch",
        lambda q, k, v: dict(q=torch.cat([q, q])),
        ValueError,
        r"q batch 2 differs from k/v batch 1",
    ),
    _case(
        "window-int", lambda q, k, v: dict(window_size=4), TypeError, r"window_size must be a pair of ints"
    ),
    _case(
        "window-float",
        lambda q, k, v: dict(window_size=(1.5, 0)),
        TypeError,
        r"window_size must be a pair of ints",
    ),
    _case(
        "window-triple", lambda q, k, v: dict(window_size=(1, 0, 0)), TypeError, r"window_size must be a pair"
    ),
    _case(
        "window-bool",
        lambda q, k, v: dict(window_size=(True, 0)),
        TypeError,
        r"window_size must be a pair of int",
    ),
    _case(
        "window-none",
        lambda q, k, v: dict(window_size=None),
        TypeError,
        r"window_size must be a pair of ints",
    ),
    _case(
        "window-left",
        lambda q, k, v: dict(window_size=(-2, 0)),
        ValueError,
        r"window_size entries must be >= -1",
    ),
    _case(
        "window-right",
        lambda q, k, v: dict(window_size=(3, -5)),
        ValueError,
        r"window_size entries must be >= -1",
    ),
    _case("causal-str", lambda q, k, v: dict(causal="yes"), TypeError, r"causal must be a bool, got str"),
    _case("causal-int", lambda q, k, v: dict(causal=1), TypeError, r"causal must be a bool, got int"),
    _case(
        "scale-negative",
        lambda q, k, v: dict(softmax_scale=-1.0),
        ValueError,
        r"softmax_scale must be a positive",
    ),
    _case(
        "scale-zero", lambda q, k, v: dict(softmax_scale=0.0), ValueError, r"softmax_scale must be a positive"
    ),
    _case(
        "scale-nan",
        lambda q, k, v: dict(softmax_scale=math.nan),
        ValueError,
        r"softmax_scale must be a positive",
    ),
    _case(
        "scale-inf",
        lambda q, k, v: dict(softmax_scale=math.inf),
        ValueError,
        r"softmax_scale must be a positive",
    ),
    _case(
        "scale-str",
        lambda q, k, v: dict(softmax_scale="0.1"),
        TypeError,
        r"softmax_scale must be a float or None",
    ),
    _case(
        "scale-bool",
        lambda q, k, v: dict(softmax_scale=True),
        TypeError,
        r"softmax_scale must be a float or None",
    ),
    _case(
        "scale-tensor",
        lambda q, k, v: dict(softmax_scale=torch.tensor(0.1)),
        TypeError,
        r"softmax_scale must be",
    ),
]


@pytest.mark.parametrize(("make", "exc", "match"), DENSE_CASES)
def test_bad_dense_inputs(device, make, exc, match):
    q, k, v = _qkv(device)
    kwargs = dict(q=q, k=k, v=v)
    kwargs.update(make(q, k, v))
    with pytest.raises(exc, match=match):
        ringflash.flash_attn_func(**kwargs)


@pytest.mark.skipif(not configs.INTERPRET, reason="bfloat16 is supported on a GPU")
@pytest.mark.parametrize("entry", ["flash_attn_func", "build_problem"])
def test_bfloat16_under_the_interpreter_names_the_dtypes_that_work(entry):
    """The interpreter's bf16 matmul gives garbage (errors of 1e8), so bf16 is refused there."""
    q, k, v = (t.bfloat16() for t in _qkv("cpu"))
    with pytest.raises(TypeError, match=r"q is bfloat16.*interpreter.*use float16 or float32"):
        if entry == "flash_attn_func":
            ringflash.flash_attn_func(q, k, v, causal=True)
        else:
            build_problem(q, k, v, None, True, (-1, -1))


def test_bad_inputs_rejected_by_build_problem_too(device):
    """The low-level entry validates the same way (the ring engine calls it directly)."""
    q, k, v = _qkv(device)
    with pytest.raises(TypeError, match="q, k, v must share a dtype"):
        build_problem(q, k.half(), v, None, False, (-1, -1))
    with pytest.raises(ValueError, match="window_size entries must be >= -1"):
        build_problem(q, k, v, None, True, (0, -3))
    with pytest.raises(ValueError, match="varlen attention needs both cu_seqlens_q and cu_seqlens_k"):
        cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
        build_problem(
            q[0], k[0], v[0], None, False, (-1, -1), cu_seqlens_q=cu, max_seqlen_q=8, max_seqlen_k=8
        )


def test_backward_buffer_checks(device):
    q, k, v = _qkv(device)
    prob = build_problem(q, k, v, None, True, (-1, -1))
    out, lse = attention_forward(q, k, v, prob)
    delta = attention_delta(out, q, prob)
    needs = "accumulate=True needs the buffers to add into"
    with pytest.raises(ValueError, match=needs):
        attention_backward(q, q, k, v, lse, delta, prob, accumulate=True)
    with pytest.raises(ValueError, match=needs):  # dK/dV alone still needs both of its buffers
        attention_backward(
            q, q, k, v, lse, delta, prob, dk=torch.zeros_like(k), accumulate=True, compute_dq=False
        )
    with pytest.raises(ValueError, match=needs):
        attention_backward(q, q, k, v, lse, delta, prob, dk=torch.zeros_like(k), dv=torch.zeros_like(v),
                           accumulate=True, compute_dkdv=False)  # fmt: skip
    with pytest.raises(ValueError, match="lse and delta must share strides"):
        attention_backward(q, q, k, v, lse, delta.transpose(1, 2).contiguous().transpose(1, 2), prob)


def test_token_strides_past_the_tile_limit_are_rejected():
    """Meta tensors: shapes and strides without memory. Long sequences are fine (tiles start at
    64-bit offsets; tests/test_kernels.py runs one past 2^31 elements); a token stride at which
    the rows inside one tile pass 2^31 elements is refused, naming the tensor."""
    q = torch.empty(1, 1 << 20, 32, 128, device="meta", dtype=torch.float16)
    kv = torch.empty(1, 1 << 20, 8, 128, device="meta", dtype=torch.float16)
    build_problem(q, kv, kv, None, True, (-1, -1))
    limit = (2**31 - 1 - 128) // MAX_TILE_ROWS

    def strided(token_stride):
        flat = torch.empty(4 * token_stride, device="meta", dtype=torch.float16)
        return flat.as_strided((1, 4, 1, 128), (4 * token_stride, token_stride, 128, 1))

    build_problem(q[:, :4, :1], strided(limit), strided(limit), None, True, (-1, -1))
    with pytest.raises(ValueError, match=rf"k: a token stride of {limit + 1} elements is too large"):
        build_problem(q[:, :4, :1], strided(limit + 1), strided(limit), None, True, (-1, -1))


def test_no_tile_exceeds_max_tile_rows(monkeypatch):
    """check_token_stride's bound holds only if no GPU tile config has more rows than this."""
    monkeypatch.setattr(configs, "INTERPRET", False)  # the GPU table, not the interpreter's tile
    tables = (configs.forward_config, configs.backward_kv_config, configs.backward_q_config,
              configs.sparse_forward_config, configs.sparse_dq_config, configs.sparse_kv_config)  # fmt: skip
    for fn in tables:
        for head_dim in (8, 64, 65, 128, 129, 256):
            for fp32 in (False, True):
                cfg = fn(head_dim, fp32)
                assert max(cfg.block_m, cfg.block_n) <= MAX_TILE_ROWS, (fn.__name__, head_dim, cfg)


def test_interpreter_tiles_are_an_eighth_of_the_sequence(monkeypatch):
    """Under the interpreter tiles are 16 to 64 rows, an eighth of each side's sequence: short
    sequences still cross several tiles, long ones run fewer numpy ops."""
    rows = [configs.interpreter_tile_rows(n) for n in (0, 1, 100, 128, 129, 256, 300, 512, 4096)]
    assert rows == [16, 16, 16, 16, 32, 32, 64, 64, 64]
    monkeypatch.setattr(configs, "INTERPRET", True)
    for fn in (configs.forward_config, configs.backward_q_config, configs.sparse_kv_config):
        assert fn(64, False, (100, 600)) == configs.TileConfig(16, 64, 4, 1), fn.__name__


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window_size=[3, 0]),
        dict(window_size=(0, 0)),
        dict(softmax_scale=1),
        dict(causal=True, window_size=(-1, 5)),
    ],
    ids=str,
)
def test_good_edge_arguments_accepted(device, kwargs):
    """Lists as windows, int scales and the boundary head dims 8 and 256 are accepted."""
    for d in (8, 256):
        q, k, v = _qkv(device, d=d)
        out = ringflash.flash_attn_func(q, k, v, **kwargs)
        assert out.shape == q.shape and torch.isfinite(out).all()


def _cu(values, device, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=device)


# Each case: function of (q, k, v, cu) -> kwargs overriding flash_attn_varlen_func's, exception, match;
# q, k, v are (10, 2, 16) packed tokens, cu = [0, 4, 10] (sequences of 4 and 6).
VARLEN_CASES = [
    _case(
        "q-4d",
        lambda q, k, v, cu: dict(q=q[None]),
        ValueError,
        r"q must be 3-D \(total_tokens, heads, head_dim\)",
    ),
    _case("k-2d", lambda q, k, v, cu: dict(k=k[0]), ValueError, r"k must be 3-D"),
    _case(
        "cu-q-int64",
        lambda q, k, v, cu: dict(cu_seqlens_q=cu.long()),
        TypeError,
        r"cu_seqlens_q must be a 1-D torch.int32",
    ),
    _case(
        "cu-k-float",
        lambda q, k, v, cu: dict(cu_seqlens_k=cu.float()),
        TypeError,
        r"cu_seqlens_k must be a 1-D torch.int32",
    ),
    _case(
        "cu-k-2d",
        lambda q, k, v, cu: dict(cu_seqlens_k=cu[None]),
        TypeError,
        r"cu_seqlens_k must be a 1-D torch.int32",
    ),
    _case(
        "cu-q-list",
        lambda q, k, v, cu: dict(cu_seqlens_q=[0, 4, 10]),
        TypeError,
        r"cu_seqlens_q must be a 1-D torch.int32",
    ),
    _case(
        "cu-q-one-entry",
        lambda q, k, v, cu: dict(cu_seqlens_q=cu[:1]),
        ValueError,
        r"cu_seqlens_q needs at least 2 entries",
    ),
    _case(
        "cu-q-not-from-0",
        lambda q, k, v, cu: dict(cu_seqlens_q=_cu([1, 4, 10], q.device)),
        ValueError,
        r"cu_seqlens_q must start at 0, never decrease and end at 10, got \[1, 4, 10\]",
    ),
    _case(
        "cu-k-decreasing",
        lambda q, k, v, cu: dict(cu_seqlens_k=_cu([0, 6, 4, 10], q.device)),
        ValueError,
        r"cu_seqlens_k must start at 0, never decrease and end at 10, got \[0, 6, 4, 10\]",
    ),
    _case(
        "cu-q-wrong-total",
        lambda q, k, v, cu: dict(cu_seqlens_q=_cu([0, 4, 9], q.device)),
        ValueError,
        r"cu_seqlens_q must start at 0, never decrease and end at 10, got \[0, 4, 9\]",
    ),
    _case(
        "cu-k-past-total",
        lambda q, k, v, cu: dict(cu_seqlens_k=_cu([0, 4, 11], q.device)),
        ValueError,
        r"cu_seqlens_k must start at 0, never decrease and end at 10",
    ),
    _case(
        "cu-counts-differ",
        lambda q, k, v, cu: dict(cu_seqlens_k=_cu([0, 10], q.device), max_seqlen_k=10),
        ValueError,
        r"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got 2 and 1",
    ),
    _case(
        "max-q-too-small",
        lambda q, k, v, cu: dict(max_seqlen_q=5),
        ValueError,
        r"max_seqlen_q must be an int >= the longest sequence \(6\), got 5",
    ),
    _case(
        "max-k-too-small",
        lambda q, k, v, cu: dict(max_seqlen_k=0),
        ValueError,
        r"max_seqlen_k must be an int >= the longest sequence \(6\), got 0",
    ),
    _case(
        "max-k-float", lambda q, k, v, cu: dict(max_seqlen_k=6.0), ValueError, r"max_seqlen_k must be an int"
    ),
    _case(
        "max-q-none", lambda q, k, v, cu: dict(max_seqlen_q=None), ValueError, r"max_seqlen_q must be an int"
    ),
    _case("dtype-mismatch", lambda q, k, v, cu: dict(k=k.half()), TypeError, r"q, k, v must share a dtype"),
    _case(
        "head-dim",
        lambda q, k, v, cu: dict(q=q[..., :8]),
        ValueError,
        r"k head_dim 16 differs from q head_dim 8",
    ),
    _case(
        "heads",
        lambda q, k, v, cu: dict(q=q[:, :1], k=torch.cat([k, k], 1), v=torch.cat([v, v], 1)),
        ValueError,
        r"q heads \(1\) must be divisible by k/v heads \(4\)",
    ),
    _case(
        "window",
        lambda q, k, v, cu: dict(window_size=(0, -2)),
        ValueError,
        r"window_size entries must be >= -1",
    ),
    _case("causal", lambda q, k, v, cu: dict(causal=None), TypeError, r"causal must be a bool"),
    _case(
        "scale", lambda q, k, v, cu: dict(softmax_scale=-0.5), ValueError, r"softmax_scale must be a positive"
    ),
]


@pytest.mark.parametrize(("make", "exc", "match"), VARLEN_CASES)
def test_bad_varlen_inputs(device, make, exc, match):
    q, k, v = (t[0] for t in _qkv(device, s=10))
    cu = _cu([0, 4, 10], device)
    kwargs = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    kwargs.update(make(q, k, v, cu))
    with pytest.raises(exc, match=match):
        ringflash.flash_attn_varlen_func(**kwargs)


def test_cu_seqlens_read_back_once_per_tensor_and_version(device, monkeypatch):
    """Every layer gets the same cu_seqlens: its values are read to the host once, not per call;
    an in-place write reads them again, so a tensor made invalid after a good call is rejected."""
    q, k, v = (t[0] for t in _qkv(device, s=10))
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))

    def problem(cu):
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
        return build_problem(q, k, v, None, True, (-1, -1), **kw)

    cu = _cu([0, 4, 10], device)
    for _ in range(3):
        problem(cu)
    assert len(reads) == 1
    cu[1] = 11
    with pytest.raises(ValueError, match=r"cu_seqlens_q must .* end at 10, got \[0, 11, 10\]"):
        problem(cu)
    assert len(reads) == 2
    problem(_cu([0, 4, 10], device))  # equal values, another tensor: read on its own
    assert len(reads) == 3
    problem(cu_seqlens_tensor([0, 4, 10], device))  # made from host values: nothing to read
    assert len(reads) == 3


def test_cu_seqlens_made_under_inference_mode(device):
    """Inference tensors have no version counter: validated on every call, not remembered."""
    q, k, v = (t[0] for t in _qkv(device, s=10))
    with torch.inference_mode():
        for cu in (_cu([0, 4, 10], device), cu_seqlens_tensor([0, 4, 10], device)):
            for _ in range(2):
                kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
                assert build_problem(q, k, v, None, True, (-1, -1), **kw).batch == 2
            cu[2] = 9
            with pytest.raises(ValueError, match=r"must start at 0, never decrease and end at 10"):
                build_problem(q, k, v, None, True, (-1, -1), **kw)


def test_varlen_empty_sequences_accepted(device):
    """Equal consecutive cu_seqlens entries are empty sequences, on either side."""
    q, k, v = (t[0] for t in _qkv(device, s=10))
    cu_q = _cu([0, 0, 4, 4, 10, 10], device)
    cu_k = _cu([0, 3, 3, 7, 10, 10], device)
    out, lse = ringflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 4, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 10)
    assert torch.isfinite(out).all()
    assert torch.isneginf(lse[:, :4]).all() and torch.isfinite(lse[:, 4:]).all()  # 2nd sequence has no keys


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(softcap=True), TypeError, r"softcap must be a float \(0.0 = off\), got bool"),
        (dict(softcap="5"), TypeError, r"softcap must be a float \(0.0 = off\), got str"),
        (dict(softcap=None), TypeError, r"softcap must be a float \(0.0 = off\), got NoneType"),
        (dict(softcap=-1.0), ValueError, r"softcap must be 0.0 \(off\) or a positive finite float, got -1.0"),
        (dict(softcap=math.inf), ValueError, r"softcap must be 0.0 \(off\) or a positive finite float"),
        (dict(softcap=math.nan), ValueError, r"softcap must be 0.0 \(off\) or a positive finite float"),
        (dict(alibi_slopes=[0.5, 0.25]), TypeError, r"alibi_slopes must be a torch.Tensor or None, got list"),
        (dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, r"alibi_slopes must be float32"),
        (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError, r"alibi_slopes must be float32"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(2,\) or \(1, 2\)"),
        (dict(alibi_slopes=torch.ones(2, 2)), ValueError, r"shape \(2,\) or \(1, 2\) .* got \(2, 2\)"),
        (dict(alibi_slopes=torch.ones(1, 2, 1)), ValueError, r"alibi_slopes must have shape"),
        (dict(alibi_slopes=torch.ones(2, device="meta")), ValueError, r"alibi_slopes is on meta but q is on"),
        (dict(deterministic=1), TypeError, r"deterministic must be a bool, got int"),
    ],
    ids=str,
)
def test_bad_softcap_and_alibi(device, kwargs, exc, match):
    q, k, v = _qkv(device)
    # CPU slopes go to q's device: each case tests its own fault, not a device mismatch
    kwargs = {
        n: a.to(device) if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a
        for n, a in kwargs.items()
    }
    with pytest.raises(exc, match=match):
        build_problem(q, k, v, None, True, (-1, -1), **kwargs)


def test_alibi_slopes_accepted_shapes(device):
    """(heads,) and (batch, heads) slopes, any strides: the problem holds them as a contiguous
    float32 (batch, heads_q) tensor (varlen: one row per sequence)."""
    q, k, v = _qkv(device, b=3, h=4, hk=2)
    per_head = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)
    prob = build_problem(q, k, v, None, True, (-1, -1), alibi_slopes=per_head)
    assert prob.alibi_slopes.shape == (3, 4) and prob.alibi_slopes.is_contiguous()
    assert (prob.alibi_slopes == per_head).all()
    strided = torch.rand(4, 3, device=device).t()
    prob = build_problem(q, k, v, None, True, (-1, -1), alibi_slopes=strided, softcap=30)
    assert prob.alibi_slopes.is_contiguous() and torch.equal(prob.alibi_slopes, strided)
    assert prob.softcap == 30.0 and isinstance(prob.softcap, float)
    cu = _cu([0, 2, 8], device)
    prob = build_problem(q[0], k[0], v[0], None, False, (-1, -1), cu_seqlens_q=cu, cu_seqlens_k=cu,
                         max_seqlen_q=6, max_seqlen_k=6, alibi_slopes=per_head)  # fmt: skip
    assert prob.alibi_slopes.shape == (2, 4)


def test_launch_refuses_slopes_of_another_batch(device):
    """A problem rebuilt with dataclasses.replace (as a ring step's varlen call is) whose slopes
    no longer have a row per sequence: a ValueError, not a read past the slopes."""
    q, k, v = _qkv(device, b=2)
    prob = build_problem(q, k, v, None, True, (-1, -1), alibi_slopes=torch.ones(2, device=device))
    cu = _cu([0, 3, 5, 8, 16], device)
    varlen = replace(prob, batch=4, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)
    qv, kv, vv = (t.flatten(0, 1) for t in (q, k, v))
    with pytest.raises(ValueError, match=r"alibi_slopes must be a contiguous \(batch, heads_q\) = \(4, 2\)"):
        attention_forward(qv, kv, vv, varlen)
    _, lse = attention_forward(q, k, v, prob)
    lse_v = lse.transpose(0, 1).flatten(1)  # (heads, tokens), as a varlen call's
    for compute_dq in (True, False):
        with pytest.raises(ValueError, match=r"alibi_slopes must be a contiguous"):
            attention_backward(qv, qv, kv, vv, lse_v, lse_v, varlen, compute_dq=compute_dq)
