"""kernels/launcher.py: launches that skip Triton's per-call binding key the compiled kernel on
everything Triton specializes on, so a call that Triton would compile differently (a pointer
not 16-byte aligned, another int) never runs a kernel compiled for another."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
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


def test_empty_launch_hooks_are_not_called():
    """Triton 3.6's hooks are chains that are never None: an empty chain is passed as None (no
    metadata, no call), a chain with a hook or a plain callable as itself."""
    chain = getattr(triton.knobs, "HookChain", None)
    if chain is not None:
        empty, hooked = chain(), chain()
        hooked.add(print)
        assert launcher._hook(empty) is None and launcher._hook(hooked) is hooked
    assert launcher._hook(None) is None and launcher._hook(print) is print


def test_expand_puts_each_descriptors_launcher_arguments_in_its_place(monkeypatch):
    monkeypatch.setattr(launcher, "_make_tensordesc_arg", lambda arg, meta: [f"map({arg})", meta, 7])
    got = launcher._expand(("a", "D1", "b", "c", "D2"), ((1, "m1"), (4, "m2")))
    assert got == ["a", "map(D1)", "m1", 7, "b", "c", "map(D2)", "m2", 7]


def _fake_compiled(inner, scratch=0):
    CudaLauncher = type("CudaLauncher", (), {})  # the class name is what _direct_launcher checks
    run = CudaLauncher()
    run.launch, run.global_scratch_size, run.profile_scratch_size = inner, scratch, 0
    run.launch_cooperative_grid, run.launch_pdl = False, True
    return SimpleNamespace(run=run)


def test_direct_launcher_reads_tritons_descriptor_wrapper(monkeypatch):
    """The closure of the installed Triton's wrapper holds what _direct_launcher reads (a
    release that renamed it would get None, i.e. the compiled kernel's run)."""
    if not triton.__version__.startswith(launcher.DIRECT_RELEASES):
        pytest.skip(f"Triton {triton.__version__}: no direct launches")
    from triton.backends.nvidia.driver import wrap_handle_tensordesc

    def raw(*args):
        return args

    desc = "tensordesc<bf16[64, 64]>"
    signature = {"x": "i32", "desc": desc, "y": "*fp32", "d2": desc}
    meta = [{"swizzle": 3}, {"swizzle": 2}]
    compiled = _fake_compiled(wrap_handle_tensordesc(raw, signature, meta))
    assert launcher._direct_launcher(compiled, 4) == (raw, False, True, ((1, meta[0]), (3, meta[1])))
    assert launcher._direct_launcher(compiled, 2) is None  # a descriptor past the positional ones
    assert launcher._direct_launcher(_fake_compiled(raw), 4) == (raw, False, True, ())
    assert launcher._direct_launcher(_fake_compiled(raw, scratch=64), 4) is None  # needs scratch
    monkeypatch.setattr(launcher.triton, "__version__", "9.9.0")
    assert launcher._direct_launcher(compiled, 4) is None


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
    for binding in ("0", "1", "run", "0"):
        monkeypatch.setenv("RINGFLASH_TRITON_BINDING", binding)
        out = ringflash.flash_attn_func(q, k, v, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for other in results[1:]:
        (out, dq, dk, dv), (out2, dq2, dk2, dv2) = results[0], other
        assert torch.equal(out, out2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)
        assert rel_err(dq2, dq) < 1e-3  # the Hopper backward adds dQ tiles in a varying order


@pytest.mark.gpu
@GPU
def test_registered_launch_hooks_see_every_launch():
    """A hook added to Triton's launch chains after the kernels were compiled and launched is
    called for each later launch (profilers such as Proton register so), and no more once removed."""
    q, k, v = _qkv(torch.bfloat16, seed=9)
    ringflash.flash_attn_func(q, k, v, causal=True)
    names: list[str] = []
    enter = triton.knobs.runtime.launch_enter_hook
    hook = lambda metadata: names.append(metadata.get()["name"])  # noqa: E731
    enter.add(hook)
    try:
        ringflash.flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
    finally:
        enter.remove(hook)
    assert names, "the enter hook saw no launch"
    seen = len(names)
    ringflash.flash_attn_func(q, k, v, causal=True)
    assert len(names) == seen
