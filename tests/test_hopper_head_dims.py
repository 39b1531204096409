"""Head dims between the Hopper kernels' builds (96, 192, ...): which build runs them
(``dispatch.run_head_dim``), the TMA descriptors that read their tiles zero-filled to the
build's width (``tma.rows_descriptor``; their sm_90 builds are in test_compile.py), and on an
sm_90 GPU the real kernels against float64.
"""

from __future__ import annotations

import pytest
import torch
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err

import ringflash
from ringflash.kernels import build_problem, pad_head_dim
from ringflash.kernels.hopper.dispatch import run_head_dim

BUILT = (64, 128, 256)


def test_head_dims_between_builds_run_the_next_larger_build():
    assert [run_head_dim(d, BUILT) for d in (64, 128, 256)] == [64, 128, 256]
    assert [run_head_dim(d, BUILT) for d in (72, 80, 96, 120)] == [128] * 4
    assert [run_head_dim(d, BUILT) for d in (136, 160, 192, 248)] == [256] * 4
    assert [run_head_dim(d, BUILT) for d in (8, 32, 56)] == [None] * 3  # below the smallest build
    assert run_head_dim(100, BUILT) is None  # not a multiple of 8
    assert run_head_dim(512, BUILT) is None
    assert run_head_dim(96, (64, 128)) == 128 and run_head_dim(192, (64, 128)) is None


@pytest.mark.parametrize(("head_dim", "build"), [(96, 128), (192, 256), (128, 128)])
def test_descriptors_read_the_tensors_in_place_at_the_builds_width(head_dim, build):
    """Between builds: a (rows, heads, head_dim) view of the tensor itself (a slice of a larger
    batch included), blocks the build's width (TMA zero-fills past head_dim); at a build: the
    (rows, heads * head_dim) view."""
    pytest.importorskip("triton.experimental.gluon")
    from ringflash.kernels.hopper.tma import rows_descriptor

    t = torch.zeros(3, 50, 4, head_dim, dtype=torch.bfloat16)[:, 10:40]
    desc, batch_rows = rows_descriptor(t, 64, build)
    assert batch_rows == 50 and desc.base.data_ptr() == t.data_ptr()
    if head_dim == build:
        assert desc.shape == [130, 4 * head_dim] and desc.strides == [4 * head_dim, 1]
        assert desc.block_shape == [64, head_dim]
    else:
        assert desc.shape == [130, 4, head_dim] and desc.strides == [4 * head_dim, head_dim, 1]
        assert desc.block_shape == [64, 1, build]


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
