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
