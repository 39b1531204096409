"""kernels/hopper/padding.py: head dims between the Hopper kernels' builds (96, 192, ...).

On the CPU the padding wrappers run around a torch stand-in for the kernel (same signature and
contract), against the stand-in called at the real head_dim: the padding must be exact, the
buffers' accumulate/overwrite contract kept, and the kernel must see only built head dims. On an
sm_90 GPU the real kernels run at 96 and 192 against float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err

import ringflash
from ringflash.kernels import build_problem, pad_head_dim
from ringflash.kernels.hopper.padding import padded_backward, padded_forward, run_head_dim

BUILT = (64, 128, 256)


def test_head_dims_between_builds_run_the_next_larger_build():
    assert [run_head_dim(d, BUILT) for d in (64, 128, 256)] == [64, 128, 256]
    assert [run_head_dim(d, BUILT) for d in (72, 80, 96, 120)] == [128] * 4
    assert [run_head_dim(d, BUILT) for d in (136, 160, 192, 248)] == [256] * 4
    assert [run_head_dim(d, BUILT) for d in (8, 32, 56)] == [None] * 3  # below the smallest build
    assert run_head_dim(100, BUILT) is None  # not a multiple of 8
    assert run_head_dim(512, BUILT) is None
    assert run_head_dim(96, (64, 128)) == 128 and run_head_dim(192, (64, 128)) is None


def _attention(q, k, v, scale):
    """Full (unmasked) attention over every token of (..., S, H, D) tensors, float64."""
    s = torch.einsum("...qhd,...khd->...hqk", q.double(), k.double()) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("...hqk,...khd->...qhd", torch.exp(s - lse[..., None]), v.double()), lse


def _stand_in_forward(seen):
    def kernel(q, k, v, problem, out, lse):
        seen.append(problem.head_dim)
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == out.shape[-1] == problem.head_dim
        o, l = _attention(q, k, v, problem.softmax_scale)
        out.copy_(o)
        lse.copy_(l)

    return kernel


def _stand_in_backward(seen):
    def kernel(dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate):
        seen.append(problem.head_dim)
        assert dq.dtype == torch.float32 and q.shape[-1] == dk.shape[-1] == problem.head_dim
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        _attention(qd, kd, vd, problem.softmax_scale)[0].backward(dout.double())
        dq.add_(qd.grad)
        for buf, g in ((dk, kd.grad), (dv, vd.grad)):
            buf.add_(g) if accumulate else buf.copy_(g)

    return kernel


@pytest.mark.parametrize("shape", [(2, 24, 4), (37, 4)], ids=["batched", "packed"])  # (batch,) seqlen, heads
@pytest.mark.parametrize("head_dim", [96, 192])
def test_padded_forward_is_exact_and_writes_the_callers_buffers(shape, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(*shape, head_dim, generator=g) for _ in range(3))
    problem = build_problem(q[None] if len(shape) == 2 else q, k[None] if len(shape) == 2 else k,
                            v[None] if len(shape) == 2 else v, None, False, (-1, -1))  # fmt: skip
    lse_shape = (*shape[:-2], shape[-1], shape[-2])
    wide, seen = run_head_dim(head_dim, BUILT), []
    out = torch.full_like(q, math.nan)
    lse = torch.full(lse_shape, math.nan)
    padded_forward(_stand_in_forward(seen), q, k, v, problem, out, lse, wide)
    assert seen == [wide] and problem.head_dim == head_dim  # the caller's problem is unchanged
    exp_out, exp_lse = _attention(q, k, v, 1 / math.sqrt(head_dim))
    assert rel_err(out, exp_out) < 1e-6 and rel_err(lse, exp_lse) < 1e-6


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("head_dim", [96, 192])
def test_padded_backward_is_exact_and_keeps_the_buffer_contract(head_dim, accumulate):
    g = torch.Generator().manual_seed(head_dim + accumulate)
    q, k, v, dout = (torch.randn(2, 20, 2, head_dim, generator=g) for _ in range(4))
    problem = build_problem(q, k, v, 0.3, False, (-1, -1))
    # The ring's buffers: float32 slices of larger shards, which must be added to (dq always).
    big = [torch.randn(2, 30, 2, head_dim, generator=g) for _ in range(3)]
    before = [b.clone() for b in big]
    dq, dk, dv = (b[:, 5:25] for b in big)
    seen = []
    lse, delta = torch.zeros(2, 2, 20), torch.zeros(2, 2, 20)
    args = (dout, q, k, v, lse, delta, problem, dq, dk, dv, accumulate)
    padded_backward(_stand_in_backward(seen), *args, run_head_dim(head_dim, BUILT))
    assert seen == [run_head_dim(head_dim, BUILT)]
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    _attention(qd, kd, vd, 0.3)[0].backward(dout.double())
    for name, buf, base, exp in zip(("dq", "dk", "dv"), big, before, (qd.grad, kd.grad, vd.grad)):
        got = buf[:, 5:25] - base[:, 5:25] if name == "dq" or accumulate else buf[:, 5:25]
        assert rel_err(got, exp) < 1e-5, name
        assert torch.equal(buf[:, :5], base[:, :5]) and torch.equal(buf[:, 25:], base[:, 25:]), name


# On an sm_90 GPU: the real kernels at head dims between their builds.
SM90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)


# flash-attn's test head dims between the builds (111 is first padded to 112 by flash_attn_func,
# then to 128 here), each in bf16, and 96 / 192 in fp16 too.
BETWEEN = [(d, torch.bfloat16) for d in (80, 96, 111, 160, 192, 224)]
BETWEEN += [(96, torch.float16), (192, torch.float16)]


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize(("head_dim", "dtype"), BETWEEN, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_kernels_between_builds_match_float64(head_dim, dtype, causal):
    from sm90 import cuda_randn

    from ringflash.kernels import uses_fused_backward, uses_fused_forward

    q = cuda_randn(2, 1000, 8, head_dim, dtype=dtype, seed=1).requires_grad_()
    k, v = (cuda_randn(2, 1000, 2, head_dim, dtype=dtype, seed=s).requires_grad_() for s in (2, 3))
    dout = cuda_randn(2, 1000, 8, head_dim, dtype=dtype, seed=4)
    padded = pad_head_dim(q, k, v)  # what flash_attn_func hands the kernels
    problem = build_problem(*padded, 1 / head_dim**0.5, causal, (-1, -1))
    assert uses_fused_forward(problem, *padded) and uses_fused_backward(problem, *padded)
    out, lse = ringflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    exp_out, exp_lse = reference_attention(qd, kd, vd, causal=causal)
    exp_out.backward(dout.double().cpu())
    assert rel_err(out, exp_out) < TOLERANCE[dtype] and rel_err(lse, exp_lse) < 1e-4
    for name, got, exp in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        assert got.shape[-1] == head_dim and rel_err(got, exp) < TOLERANCE[dtype], name


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("head_dim", [96, 192])
def test_hopper_kernels_between_builds_on_packed_documents(head_dim):
    from sm90 import cuda_randn

    lens = [1, 127, 129, 300]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = (cuda_randn(sum(lens), 4, head_dim, seed=s) for s in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    out = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    out.backward(dout)
    qd, kd, vd = (t.detach().double().cpu()[None].requires_grad_() for t in (q, k, v))
    exp_out, _ = reference_attention_packed(qd, kd, vd, cu.tolist(), causal=True)
    exp_out.backward(dout.double().cpu()[None])
    assert rel_err(out, exp_out[0]) < TOLERANCE[torch.bfloat16]
    for name, got, exp in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        assert rel_err(got, exp[0]) < TOLERANCE[torch.bfloat16], name
