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
from ringflash.kernels import ops as kernel_ops

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


class _Desc:
    """A stand-in TMA descriptor: what ``_arg_key`` and ``BoundLaunch.record`` read of one."""

    def __init__(self, base):
        self.base, self.block_shape, self.layout, self.padding = base, [8, 8], "layout", "zero"
        self.shape, self.strides = [4, 8], [8, 1]


def _bind(monkeypatch, args, slots, descriptors=()):
    """A BoundLaunch of a fake kernel over ``args`` whose C launcher records its arguments
    (calls of it append to the returned list), its descriptors encoded as ("map", address)."""
    calls = []
    monkeypatch.setattr(launcher, "_binding", lambda: "0")
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_current_stream", lambda device: "stream")
    monkeypatch.setattr(launcher, "launch", lambda *a, **kw: None)
    encoder = (lambda ptr: ("map", ptr), (4, 8, 8, 1))
    monkeypatch.setattr(launcher, "_descriptor_encoder", lambda d, meta: encoder)
    kernel, compiled = object(), SimpleNamespace(function="fn", packed_metadata="meta")
    key = (kernel, 0, launcher._args_key(args), (("X", 1),))
    direct = (lambda *a: calls.append(a), False, False, descriptors)
    monkeypatch.setitem(launcher._COMPILED, key, (compiled, ("tail",), direct))
    return launcher.BoundLaunch.record(kernel, (3,), args, {"X": 1}, slots), calls


def test_a_bound_launch_fills_its_slots_and_keeps_the_rest(monkeypatch):
    """Slots are found by identity wherever they occur (a stand-in passed twice fills both
    places); descriptors are encoded from the new tensor's address; the rest stays as recorded."""
    buf = torch.zeros(256)
    q, out, fixed = buf[:16], buf[32:48], buf[64:80]
    qd = _Desc(q)
    args = (qd, out, 7, fixed, out, qd, 2.5)
    bound, calls = _bind(monkeypatch, args, (qd, out), descriptors=((0, {}), (5, {})))
    q2, out2 = buf[128:144], buf[160:176]
    assert bound(q2, out2)
    (sent,) = calls
    assert sent[:7] == (3, 1, 1, "stream", "fn", False, False) and sent[9] == "meta"
    body = sent[13:]
    assert body[0] == ("map", q2.data_ptr()) and body[1:5] == (4, 8, 8, 1)
    assert body[5] == body[8] == out2.data_ptr() and body[6] == 7 and body[7] == fixed.data_ptr()
    assert body[9] == ("map", q2.data_ptr()) and body[14] == 2.5 and body[15] == "tail"


def test_a_bound_launch_steps_aside_where_a_key_would_differ(monkeypatch):
    """An alignment that Triton would compile differently, an unaligned descriptor base, another
    current device, or RINGFLASH_TRITON_BINDING: False, nothing launched."""
    buf = torch.zeros(256)
    t, qd = buf[:16], _Desc(buf[32:48])
    bound, calls = _bind(monkeypatch, (qd, t), (qd, t), descriptors=((0, {}),))
    assert not bound(buf[32:48], buf[1:17])  # the tensor slot 4 bytes off 16-byte alignment
    assert not bound(buf[33:49], buf[:16])  # a descriptor base 4 bytes off
    monkeypatch.setattr(launcher, "_current_device", lambda: 1)
    assert not bound(buf[32:48], buf[:16])
    monkeypatch.setattr(launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_binding", lambda: "run")
    assert not bound(buf[32:48], buf[:16])
    assert calls == []


def test_a_descriptor_outside_the_slots_is_not_bound(monkeypatch):
    """Its encoding would keep a recorded address that a later call may have freed."""
    buf = torch.zeros(64)
    bound, _ = _bind(monkeypatch, (_Desc(buf[:16]), buf[16:32]), (buf[16:32],), descriptors=((0, {}),))
    assert bound is None


def test_launch_or_bind_binds_at_a_keys_second_call(monkeypatch):
    """A key's first call launches and remembers it; the second binds (when binding is on and no
    hook listens); plans built per call never bind."""
    launched, recorded = [], []
    monkeypatch.setattr(launcher, "launch", lambda kernel, grid, *a, **kw: launched.append(a))
    monkeypatch.setattr(launcher.BoundLaunch, "record", lambda *a: recorded.append(a) or "bound")
    monkeypatch.setattr(launcher, "_binding", lambda: "0")
    plans: dict = {}
    launcher.launch_or_bind(plans, "key", "kernel", (1,), (1,), {}, ())
    assert plans == {"key": launcher.SEEN_ONCE} and len(launched) == 1 and not recorded
    monkeypatch.setattr(launcher, "_binding", lambda: "1")  # binding off: launch, bind later
    launcher.launch_or_bind(plans, "key", "kernel", (1,), (1,), {}, ())
    assert plans["key"] is launcher.SEEN_ONCE and len(launched) == 2
    monkeypatch.setattr(launcher, "_binding", lambda: "0")
    launcher.launch_or_bind(plans, "key", "kernel", (1,), (1,), {}, ())
    assert plans["key"] == "bound" and len(recorded) == 1 and len(launched) == 2
    for _ in range(3):  # a problem built per call: a fresh plans dict each time
        launcher.launch_or_bind({}, "key", "kernel", (1,), (1,), {}, ())
    assert len(recorded) == 1


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


def _count_bound(monkeypatch) -> list:
    """The bound launches that ran (BoundLaunch calls that returned True)."""
    ran, call = [], launcher.BoundLaunch.__call__

    def counted(self, *values):
        done = call(self, *values)
        ran.extend([self] if done else [])
        return done

    monkeypatch.setattr(launcher.BoundLaunch, "__call__", counted)
    return ran


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("varlen", [False, True])
def test_steady_state_runs_bound_launches_equal_to_the_general_path(varlen, monkeypatch):
    """From a layout's third call on, the Hopper forward, the delta and the Hopper backward run
    bound launches (three per fwd+bwd) on new tensors at new addresses; from the fourth, the
    backward finds the delta's bound launch under its own key. Their results equal the general
    path's (RINGFLASH_TRITON_BINDING=run) and float64's, and the gradients come in q/k/v's dtype
    (the backward hands autograd dQ in float32, which the engine casts)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the bound launches are the Hopper kernels' (and the delta's)")
    s, h, d = 300, 4, 64
    cu = torch.tensor([0, 120, 300], device="cuda", dtype=torch.int32)

    def call(seed, binding):
        monkeypatch.setenv("RINGFLASH_TRITON_BINDING", binding)
        g = torch.Generator(device="cuda").manual_seed(seed)
        shape = (s, h, d) if varlen else (1, s, h, d)
        q, k, v, dout = (torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        if varlen:
            out = ringflash.flash_attn_varlen_func(*leaves, cu, cu, 180, 180, causal=True)
        else:
            out = ringflash.flash_attn_func(*leaves, causal=True)
        return leaves, dout, out, torch.autograd.grad(out, leaves, dout)

    for seed in (0, 1, 2):
        call(seed, "0")
    ran = _count_bound(monkeypatch)
    leaves, dout, out, grads = call(3, "0")
    assert len(ran) == 3
    assert all(g.dtype == torch.bfloat16 for g in grads)
    _, _, out_general, grads_general = call(3, "run")
    assert len(ran) == 3  # the general path binds nothing
    assert torch.equal(out, out_general)
    assert torch.equal(grads[1], grads_general[1]) and torch.equal(grads[2], grads_general[2])
    assert rel_err(grads[0], grads_general[0]) < 1e-3  # dQ tiles are added in a varying order
    for rows in [slice(0, 120), slice(120, 300)] if varlen else [None]:

        def piece(t, rows=rows):  # a sequence of the packed batch as (1, seqlen, heads, head_dim)
            return t if rows is None else t[rows][None]

        ref_in = [piece(t.detach()).double().cpu().requires_grad_() for t in leaves]
        ref, _ = reference_attention(*ref_in, causal=True)
        ref_grads = torch.autograd.grad(ref, ref_in, piece(dout).double().cpu())
        assert rel_err(piece(out), ref) < 2e-2
        for got, r in zip(grads, ref_grads):
            assert rel_err(piece(got), r) < 2e-2


@pytest.mark.gpu
@GPU
def test_steady_state_backward_with_an_lse_gradient_is_exact(monkeypatch):
    """A loss on out and on the LSE, four calls of one layout: the last runs the bound delta
    launch, then subtracts the LSE's gradient, then the bound backward. Out, LSE and every
    gradient against float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the bound launches are the Hopper kernels' (and the delta's)")
    b, s, h, d = 2, 256, 4, 64
    for seed in range(4):
        ran = _count_bound(monkeypatch) if seed == 3 else []
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", generator=g).bfloat16() for _ in range(4))
        dlse = torch.randn(b, h, s, device="cuda", generator=g)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out, lse = kernel_ops.flash_attention(*leaves, causal=True)
        grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    assert len(ran) == 3
    ref_in = [t.detach().double().cpu().requires_grad_() for t in leaves]
    ref, ref_lse = reference_attention(*ref_in, causal=True)
    ref_grads = torch.autograd.grad((ref, ref_lse), ref_in, (dout.double().cpu(), dlse.double().cpu()))
    assert rel_err(out, ref) < 2e-2 and rel_err(lse, ref_lse) < 1e-4
    for got, r in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16 and rel_err(got, r) < 2e-2


@pytest.mark.gpu
@GPU
def test_bound_launches_step_aside_for_misaligned_tensors_and_follow_the_stream(monkeypatch):
    """After the bound launches of a layout: q/k/v 8 bytes off 16-byte alignment run the
    general path (the Triton kernels: TMA needs aligned rows) exactly; a call on another stream
    uses that stream (and its own tile counter)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the bound launches are the Hopper kernels'")
    for seed in (0, 1, 2):
        q, k, v = _qkv(torch.bfloat16, seed=seed)
        ringflash.flash_attn_func(q, k, v, causal=True)
    ran = _count_bound(monkeypatch)
    q, k, v = _qkv(torch.bfloat16, offset=4, seed=3)
    assert q.data_ptr() % 16 == 8
    out = ringflash.flash_attn_func(q, k, v, causal=True)
    assert not ran
    ref, _ = reference_attention(*(t.double().cpu() for t in (q, k, v)), causal=True)
    assert rel_err(out, ref) < 2e-2
    q, k, v = _qkv(torch.bfloat16, seed=4)
    expected = ringflash.flash_attn_func(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            got = ringflash.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    assert len(ran) == 4 and torch.equal(got, expected)


@pytest.mark.gpu
@GPU
def test_bound_varlen_launches_follow_new_document_boundaries(monkeypatch):
    """After a packed layout's launches are bound: boundaries in a new cu_seqlens tensor, and the
    same tensor written in place, are what the next calls attend by (each a new problem, so a new
    binding), forward and backward, against float64 per document."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the bound launches are the Hopper kernels' (and the delta's)")
    s, h, d = 300, 4, 64

    def call(cu, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v, dout = (torch.randn(s, h, d, device="cuda", generator=g).bfloat16() for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        longest = int((cu[1:] - cu[:-1]).max())
        out = ringflash.flash_attn_varlen_func(*leaves, cu, cu, longest, longest, causal=True)
        return leaves, dout, out, torch.autograd.grad(out, leaves, dout)

    def check(cu, seed):
        leaves, dout, out, grads = call(cu, seed)
        bounds = cu.tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            ref_in = [t.detach()[lo:hi][None].double().cpu().requires_grad_() for t in leaves]
            ref, _ = reference_attention(*ref_in, causal=True)
            ref_grads = torch.autograd.grad(ref, ref_in, dout[lo:hi][None].double().cpu())
            assert rel_err(out[lo:hi][None], ref) < 2e-2
            for got, r in zip(grads, ref_grads):
                assert rel_err(got[lo:hi][None], r) < 2e-2

    cu = torch.tensor([0, 120, 300], device="cuda", dtype=torch.int32)
    for seed in range(3):
        call(cu, seed)
    ran = _count_bound(monkeypatch)
    check(cu, 3)
    assert len(ran) == 3  # the bound forward, delta and backward ran
    check(torch.tensor([0, 200, 250, 300], device="cuda", dtype=torch.int32), 4)
    cu.copy_(torch.tensor([0, 40, 300], dtype=torch.int32))  # written in place
    check(cu, 5)
    assert len(ran) == 3  # new boundaries, new problems: general launches
