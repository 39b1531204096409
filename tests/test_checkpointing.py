"""Activation checkpointing that keeps attention's outputs (ringflash/checkpointing.py): under
torch's selective checkpointing with ``attention_checkpoint_context`` every attention forward runs
once per step instead of twice, on one device and in each sequence-parallel mode, with the
gradients of the plain step; and calls that no op takes still run under a dispatch mode."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from dispatch_modes import PassThrough
from distributed import worker_device
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import ringflash
from ringflash import allgather_ops
from ringflash import ops as sp_ops
from ringflash.kernels import TileMask
from ringflash.kernels import ops as kernel_ops

# Recompute everything: the plain selective checkpoint a keeping policy is measured against.
_RECOMPUTE = functools.partial(
    create_selective_checkpoint_contexts, lambda *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE
)


def _step(attention, inputs, weight, context_fn):
    """Gradients of a block (a projection, attention, a nonlinearity) in q, k, v and the weight:
    without checkpointing (``context_fn`` None) or checkpointed with ``context_fn``."""
    leaves = [t.detach().clone().requires_grad_() for t in (*inputs, weight)]

    def block(q, k, v, w):
        return attention(q @ w, k, v).sin()

    if context_fn is None:
        out = block(*leaves)
    else:
        out = checkpoint(block, *leaves, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()
    return [t.grad for t in leaves]


def _forward_counts(attention, inputs, weight, module, name: str):
    """{setting: (forward calls, gradients)} for no checkpointing, selective checkpointing that
    keeps attention, and selective checkpointing that recomputes everything."""
    counts = {}
    for setting, context_fn in (("plain", None), ("kept", ringflash.attention_checkpoint_context),
                                ("recomputed", _RECOMPUTE)):  # fmt: skip
        with mock.patch.object(module, name, wraps=getattr(module, name)) as counted:
            grads = _step(attention, inputs, weight, context_fn)
        counts[setting] = (counted.call_count, grads)
    return counts


def _assert_kept(counts) -> None:
    # Forward calls through the op (the plain step's eager engine may not pass there).
    assert [counts[s][0] for s in ("kept", "recomputed")] == [1, 2]
    plain = counts["plain"][1]
    for setting in ("kept", "recomputed"):
        for name, got, want in zip(("dq", "dk", "dv", "dw"), counts[setting][1], plain):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (setting, name)


@pytest.mark.parametrize("varlen", [False, True])
def test_one_device_attention_runs_once_per_step(device, varlen):
    g = torch.Generator().manual_seed(0)
    # 96 query rows per K/V head: above the few-query kernel's limit, as a training call is.
    q, k, v = (torch.randn(2, 96, 2, 16, generator=g).to(device) for _ in range(3))
    weight = torch.randn(16, 16, generator=g).to(device)
    if varlen:
        cu = torch.tensor([0, 40, 192], dtype=torch.int32, device=device)

        def attention(q, k, v):
            flat = [t.reshape(192, 2, 16) for t in (q, k, v)]
            out = ringflash.flash_attn_varlen_func(*flat, cu, cu, 152, 152, causal=True)
            return out.reshape(2, 96, 2, 16)
    else:
        attention = functools.partial(ringflash.flash_attn_func, causal=True)
    _assert_kept(_forward_counts(attention, (q, k, v), weight, kernel_ops, "attention_forward"))


def test_compiled_block_keeps_attention(device):
    """torchtitan's arrangement: a checkpointed block under torch.compile, the policy applied to
    the traced graph (the ops are in it anyway)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 96, 2, 16, generator=g).to(device) for _ in range(3))
    weight = torch.randn(16, 16, generator=g).to(device)
    attention = functools.partial(ringflash.flash_attn_func, causal=True)
    calls = {}
    for setting, context_fn in (("kept", ringflash.attention_checkpoint_context), ("recomputed", _RECOMPUTE)):
        torch._dynamo.reset()
        compiled = torch.compile(_step, backend="aot_eager")
        forward = kernel_ops.attention_forward
        with mock.patch.object(kernel_ops, "attention_forward", wraps=forward) as counted:
            compiled(attention, (q, k, v), weight, context_fn)
        calls[setting] = counted.call_count
    assert calls == {"kept": 1, "recomputed": 2}


def test_save_takes_op_overloads_only():
    with pytest.raises(TypeError, match="save must hold OpOverloads"):
        ringflash.attention_checkpoint_context(save=[torch.mm])
    kept, _ = ringflash.attention_checkpoint_context(save=[torch.ops.aten.mm.default])
    assert kept is not None


# (sp_mode, the function the op calls once per forward, eager or replayed from graphs)
_ENGINES = {"ring": (sp_ops, "replayed_ring_forward"), "ulysses": (sp_ops, "replayed_ulysses_forward"),
            "allgather": (allgather_ops, "replayed_gather_forward")}  # fmt: skip


def _sp_counts(sp_mode: str):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 48, 2, 16, generator=g) for _ in range(3))
    weight = torch.randn(16, 16, generator=g)
    shard = lambda t: ringflash.shard_sequence(t, layout="zigzag").to(worker_device())  # noqa: E731
    attention = functools.partial(ringflash.sp_attn_func, causal=True, layout="zigzag", sp_mode=sp_mode)
    counts = _forward_counts(attention, [shard(t) for t in (q, k, v)], weight.to(worker_device()),
                             *_ENGINES[sp_mode])  # fmt: skip
    return {s: (n, [t.cpu() for t in grads]) for s, (n, grads) in counts.items()}


@pytest.mark.parametrize("sp_mode", ["ring", "ulysses", "allgather"])
def test_sequence_parallel_attention_runs_once_per_step(rank_pool, sp_mode):
    for counts in rank_pool(2).run(_sp_counts, sp_mode):
        _assert_kept(counts)


def _under_a_mode():
    """Calls that no op takes, under a dispatch mode and without: the same outputs, no error."""
    dev = worker_device()
    g = torch.Generator().manual_seed(9)
    full = [torch.randn(1, 256, 2, 16, generator=g) for _ in range(3)]
    causal = TileMask.from_mask_mod(lambda b, h, q, kv: kv <= q, 1, 1, 256, 256, device=dev)
    chunks = ringflash.ChunkLayout(((1, 3), (0, 2)))
    slopes = torch.tensor([0.5, 0.25], device=dev)
    calls = {
        "block mask, ring": ("contiguous", dict(sp_mode="ring", block_mask=causal)),
        "block mask, ulysses": ("contiguous", dict(sp_mode="ulysses", block_mask=causal)),
        "ChunkLayout, ring": (chunks, dict(sp_mode="ring", causal=True)),
        "ALiBi, ulysses": ("zigzag", dict(sp_mode="ulysses", causal=True, alibi_slopes=slopes)),
    }
    mismatched = []
    for name, (layout, options) in calls.items():
        q, k, v = (ringflash.shard_sequence(t, layout=layout).to(dev) for t in full)
        want = ringflash.sp_attn_func(q, k, v, layout=layout, **options)
        with PassThrough():
            got = ringflash.sp_attn_func(q, k, v, layout=layout, **options)
        if not torch.equal(got, want):
            mismatched.append(name)
    return mismatched


def test_calls_no_op_takes_run_under_a_dispatch_mode(rank_pool):
    assert rank_pool(2).run(_under_a_mode) == [[], []]
