"""kernels/launcher.py: launches that skip Triton's per-call binding key the compiled kernel on
everything Triton specializes on, so a call that Triton would compile differently (a pointer
not 16-byte aligned, another int) never runs a kernel compiled for another."""

from __future__ import annotations

import pytest
import torch
from reference import reference_attention, rel_err

import ringflash
from ringflash.kernels import launcher

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_key_separates_what_triton_specializes_on():
    buf = torch.zeros(64)
    aligned, misaligned = buf[:16], buf[1:17]
    assert launcher._arg_key(aligned) != launcher._arg_key(misaligned)  # 16-byte alignment
    assert launcher._arg_key(aligned) != launcher._arg_key(aligned.half())  # dtype
    assert launcher._arg_key(buf[16:32]) == launcher._arg_key(aligned)  # only data differ
    keys = [launcher._arg_key(x) for x in (1.0, True, None, 2.5)]
    assert len(set(keys)) == 4 and launcher._arg_key(1.0) != launcher._arg_key(True)  # 1.0 == True in Python
    with pytest.raises(TypeError):  # anything else goes through Triton's binding
        launcher._arg_key(object())


def test_interpreter_keeps_tritons_binding():
    assert launcher.bypass_enabled() == (not launcher.INTERPRET)


def _qkv(dtype, offset=0, s=200, h=2, d=64, seed=0):
    """q, k, v on the GPU starting ``offset`` elements into their storage (offset 1 in float32:
    4 bytes past 16-byte alignment)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(3):
        storage = torch.randn(s * h * d + offset, device="cuda", generator=g).to(dtype)
        out.append(storage[offset:].view(1, s, h, d))
    return out


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steady_state_calls_add_no_compiled_kernel(dtype):
    q, k, v = (t.requires_grad_() for t in _qkv(dtype))
    for _ in range(2):
        ringflash.flash_attn_func(q, k, v, causal=True).sum().backward()
    keys = launcher.compiled_launches()
    for seed in (1, 2):
        q, k, v = (t.requires_grad_() for t in _qkv(dtype, seed=seed))
        ringflash.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert launcher.compiled_launches() == keys


@pytest.mark.gpu
@GPU
def test_misaligned_inputs_after_aligned_ones_are_exact():
    """The Triton kernels (float32) first compiled for 16-byte aligned q/k/v, then called on q/k/v
    4 bytes off: a launch reusing the aligned build would read with wrong vector widths."""
    aligned = _qkv(torch.float32)
    ringflash.flash_attn_func(*aligned, causal=True)
    q, k, v = (t.requires_grad_() for t in _qkv(torch.float32, offset=1, seed=5))
    assert q.data_ptr() % 16 != 0
    out = ringflash.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*ref_in, causal=True)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double().cpu())
    assert rel_err(out, ref) < 1e-4
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-4


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_results_as_tritons_binding(dtype, monkeypatch):
    q, k, v = (t.requires_grad_() for t in _qkv(dtype, seed=7))
    dout = torch.randn_like(q)
    results = []
    for binding in ("0", "1", "0"):
        monkeypatch.setenv("RINGFLASH_TRITON_BINDING", binding)
        out = ringflash.flash_attn_func(q, k, v, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for other in results[1:]:
        (out, dq, dk, dv), (out2, dq2, dk2, dv2) = results[0], other
        assert torch.equal(out, out2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)
        assert rel_err(dq2, dq) < 1e-3  # the Hopper backward adds dQ tiles in a varying order
