"""kernels/plans.py: a call signature seen before builds no problem; anything that changes the
problem (shapes, strides, options, an in-place write to cu_seqlens) builds and validates anew."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from reference import reference_attention_packed, rel_err

import ringflash
from ringflash.kernels import cu_seqlens_tensor
from ringflash.kernels.plans import problem_builds


def _qkv(s=24, h=3, d=24, seed=0):  # shapes no other test uses: the counts start clean
    """Inputs that ask for gradients, as in training: without them, calls of this few rows go
    to kernels/few_queries.py, which plans on its own (tests/test_few_queries.py)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, h, d, generator=g).to(DEVICE).requires_grad_() for _ in range(3)]


def test_same_signature_builds_once():
    q, k, v = _qkv()
    ringflash.flash_attn_func(q, k, v, causal=True)
    built = problem_builds()
    for seed in (1, 2):  # fresh tensors of the same shapes, as every step of a training loop
        q2, k2, v2 = _qkv(seed=seed)
        ringflash.flash_attn_func(q2, k2, v2, causal=True)
    assert problem_builds() == built
    ringflash.flash_attn_func(q, k, v, causal=False)  # another option
    ringflash.flash_attn_func(q[:, :16], k[:, :16], v[:, :16], causal=True)  # another shape
    ringflash.flash_attn_func(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, causal=True)  # strides
    assert problem_builds() == built + 3


def test_cached_problem_gives_the_same_results():
    q, k, v = _qkv()
    first = ringflash.flash_attn_func(q, k, v, causal=True)
    q2, k2, v2 = _qkv(seed=3)
    second = ringflash.flash_attn_func(q2, k2, v2, causal=True)
    third = ringflash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(first, third)
    assert not torch.equal(first, second)


def test_bad_input_raises_on_every_call():
    q, k, v = _qkv()
    for _ in range(2):  # nothing is cached for a call that fails
        with pytest.raises(ValueError, match=r"q heads \(3\) must be divisible by k/v heads \(2\)"):
            ringflash.flash_attn_func(q, k[:, :, :2].contiguous(), v[:, :, :2].contiguous())


def test_written_cu_seqlens_is_read_and_validated_again():
    q, k, v = (t[0] for t in _qkv(s=24))
    cu = cu_seqlens_tensor([0, 10, 24], DEVICE)
    out = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, causal=True)
    built = problem_builds()
    cu[1] = 16  # in place: a different packing of the same tokens
    moved = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, causal=True)
    assert problem_builds() == built + 1
    expected, _ = reference_attention_packed(q[None], k[None], v[None], [0, 16, 24], causal=True)
    assert rel_err(moved[None], expected) < 1e-4
    assert not torch.equal(out, moved)
    cu[1] = 30  # now out of order: validated again, not taken from the cache
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0, never decrease"):
        ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True)


def test_problem_remembers_what_is_derived_from_it():
    """AttentionProblem.derive: computed once per problem and key; a problem made from it by
    dataclasses.replace (the ring's per-step problems) starts empty; equality ignores it."""
    from dataclasses import replace

    from ringflash.kernels import build_problem

    q, k, v = _qkv()
    problem = build_problem(q, k, v, None, True, (-1, -1))
    calls = []
    assert problem.derive("x", lambda: calls.append(1) or ("value", 1)) == ("value", 1)
    assert problem.derive("x", lambda: calls.append(1) or "other") == ("value", 1)
    assert problem.derive(("x", 2), lambda: False) is False and calls == [1]
    other = replace(problem, max_seqlen_q=problem.max_seqlen_q)
    assert other.derived == {} and other == problem


def _counting(monkeypatch, module, name) -> list:
    """Counts the calls of ``module.name`` (wrapped in place) in the returned list."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("grad", [True, False])
def test_a_call_seen_before_skips_the_checks(monkeypatch, grad):
    """A call whose arguments, as passed, match a call that passed the checks skips them and the
    problem's own key (plans.checked_call), with and without autograd, and gives what the
    checked route gives."""
    from ringflash.kernels import ops

    checks = _counting(monkeypatch, ops, "_call_args")
    # 80 query rows per K/V head: without gradients too many for kernels/few_queries.py.
    q, k, v = (t.detach().requires_grad_(grad) for t in _qkv(s=80, h=2, d=16, seed=4))
    first = ringflash.flash_attn_func(q, k, v, 0.0, 0.3, True, (7, 0), 0.0)
    assert len(checks) == 1
    second = ringflash.flash_attn_func(q, k, v, 0.0, 0.3, True, (7, 0), 0.0)
    assert len(checks) == 1 and torch.equal(first, second)
    assert second.requires_grad == grad
    if grad:
        second.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()
    ringflash.flash_attn_func(q, k, v, 0.0, 0.3, True, (8, 0), 0.0)  # another window: checked
    assert len(checks) == 2


def test_options_of_another_type_are_checked_on_every_call():
    """After a call with causal=True, window_size=(-1, -1), softcap=0.0 and softmax_scale=1.0
    passed the checks, equal values of a type the checks refuse (True == 1 == 1.0) still raise,
    and a list for window_size (which they take) gives the same output."""
    q, k, v = _qkv(seed=5)
    out = ringflash.flash_attn_func(q, k, v, 0.0, 1.0, True, (-1, -1), 0.0)
    ringflash.flash_attn_func(q, k, v, 0.0, 1.0, True, (-1, -1), 0.0)  # now remembered
    refused = [
        (dict(causal=1), "causal must be a bool"),
        (dict(window_size=(-1.0, -1)), "window_size must be a pair of ints"),
        (dict(window_size=(True, -1)), "window_size must be a pair of ints"),
        (dict(softcap=False), "softcap must be a float"),
        (dict(softmax_scale=True), "softmax_scale must be a float or None"),
    ]
    for change, message in refused:
        options = dict(softmax_scale=1.0, causal=True, window_size=(-1, -1), softcap=0.0) | change
        with pytest.raises(TypeError, match=message):
            ringflash.flash_attn_func(q, k, v, **options)
    listed = ringflash.flash_attn_func(q, k, v, 0.0, 1.0, True, [-1, -1], 0.0)
    assert torch.equal(listed, out)


def test_new_batches_of_documents_are_checked_and_exact(monkeypatch):
    """A packed batch per step, as a training loop makes them: each step's cu_seqlens is a new
    tensor (the previous one dropped) with other boundaries, and fresh values; the second and
    third steps, of the same shapes as the first, are checked again (their cu_seqlens are not
    the remembered one) and match float64 attention over their own documents, out and dq."""
    from ringflash.kernels import ops

    checks = _counting(monkeypatch, ops, "_call_args")
    for step, bounds in enumerate(([0, 10, 24], [0, 3, 17, 24], [0, 24])):
        q, k, v = (t[0].detach().requires_grad_() for t in _qkv(s=24, seed=20 + step))
        cu = cu_seqlens_tensor(bounds, DEVICE)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        out = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)
        out.backward(torch.ones_like(out))
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        expected, _ = reference_attention_packed(*(t[None] for t in ref), bounds, causal=True)
        expected.backward(torch.ones_like(expected))
        assert rel_err(out[None], expected) < 1e-4
        assert rel_err(q.grad, ref[0].grad) < 1e-4
        assert len(checks) == step + 1
        del cu


def test_the_few_query_switch_is_read_on_every_call(monkeypatch):
    """Without autograd a call of few query rows takes kernels/few_queries.py unless
    RINGFLASH_SPLIT_KV_QUERIES=0: calls made while it was 0 took the general path (the forward
    engine), and the same call takes the split-KV path again once it is unset."""
    from ringflash.kernels import ops
    from ringflash.kernels.few_queries import SWITCH

    general = _counting(monkeypatch, ops, "attention_forward")
    q, k, v = (t.detach() for t in _qkv(s=20, h=2, d=16, seed=6))
    monkeypatch.setenv(SWITCH, "0")
    outs = [ringflash.flash_attn_func(q, k, v, causal=True) for _ in range(2)]
    assert len(general) == 2
    monkeypatch.delenv(SWITCH)
    split = ringflash.flash_attn_func(q, k, v, causal=True)
    assert len(general) == 2
    assert rel_err(split, outs[1]) < 1e-3


def test_a_growing_cache_skips_the_checks_after_its_first_step(monkeypatch):
    """Decode steps without autograd whose keys grow by one a step (views of (batch, heads, L,
    head_dim) tensors, as transformers' caches hand them over) go to kernels/few_queries.py,
    which plans once for every number of keys, with only their options' checks kept: after the
    first step nothing is checked again, and each step matches the general path."""
    from ringflash.kernels import ops
    from ringflash.kernels.few_queries import SWITCH

    checks = _counting(monkeypatch, ops, "check_scalar_args")
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 1, 4, 16, generator=g).to(DEVICE)
    cache = torch.randn(2, 2, 2, 40, 16, generator=g).to(DEVICE)  # (k/v, batch, heads_k, L, head_dim)
    for length in range(30, 34):
        k, v = (t[:, :, :length].contiguous().transpose(1, 2) for t in cache)  # a new tensor per step
        before = len(checks)
        out = ringflash.flash_attn_func(q, k, v, 0.0, 0.25, True, (11, 0))
        assert len(checks) == before + (length == 30)
        monkeypatch.setenv(SWITCH, "0")  # the general path, checked, beside it
        general = ringflash.flash_attn_func(q, k, v, 0.0, 0.25, True, (11, 0))
        monkeypatch.delenv(SWITCH)
        assert rel_err(out, general) < 1e-3


def test_forward_mode_ad_is_refused_not_dropped():
    """Forward-mode AD goes through the autograd Function, which has no forward-mode formula and
    says so, on every path (the few-query one and a remembered call included): run eagerly, the
    inputs' tangents would be dropped unsaid."""
    import torch.autograd.forward_ad as fwAD

    for s in (20, 80):  # few query rows per K/V head, and more
        q, k, v = (t.detach() for t in _qkv(s=s, h=2, d=16, seed=7))
        ringflash.flash_attn_func(q, k, v, causal=True)
        ringflash.flash_attn_func(q, k, v, causal=True)  # remembered
        with fwAD.dual_level():
            dual = fwAD.make_dual(q, torch.ones_like(q))
            with pytest.raises(NotImplementedError, match="jvp"):
                ringflash.flash_attn_func(dual, k, v, causal=True)


def test_torch_func_transforms_are_refused_by_name():
    """Under vmap (or any torch.func transform) a call, remembered or not, raises an error that
    names the transforms, instead of failing inside the kernels on tensors without storage."""
    q, k, v = (t.detach() for t in _qkv(s=80, h=2, d=16, seed=9))
    ringflash.flash_attn_func(q, k, v, causal=True)
    ringflash.flash_attn_func(q, k, v, causal=True)  # remembered: the same shape as each vmapped call
    stacked = torch.stack([q, q])
    for s in (80, 20):  # the general path, and few query rows (kernels/few_queries.py)
        batch = stacked[:, :, :s]
        with pytest.raises(NotImplementedError, match="torch.func transforms"):
            torch.vmap(lambda x: ringflash.flash_attn_func(x, x, x, causal=True))(batch)


def test_dispatch_modes_still_see_the_op_after_a_remembered_call():
    """A remembered call under a dispatch mode (selective checkpointing, FlopCounterMode) still
    takes the custom op, which the mode sees."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv(seed=8)
    for _ in range(2):
        ringflash.flash_attn_func(q, k, v, causal=True)
    with Recording():
        ringflash.flash_attn_func(q, k, v, causal=True)
    assert any("ringflash.flash_attn_forward" in name for name in seen), seen
