"""Ranks that call a sequence-parallel function with different arguments all get a ValueError
naming what differs, instead of a gloo abort, an NCCL hang or garbage; no order of calls hangs."""

from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import errors_of, worker_device

import ringflash
from ringflash import comm
from ringflash.comm import host_values_agree


def _qkv(seqlen: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, seqlen, 2, 16, generator=g).to(worker_device()) for _ in range(3)]


def _disagreeing_calls():
    rank = dist.get_rank()
    agreed = _qkv(8)
    mine = _qkv(8 if rank == 0 else 12)
    errors = errors_of({
        # different local lengths (gloo aborted with "Received data size doesn't match")
        "seqlen": lambda: ringflash.ring_flash_attn_func(*mine, causal=True),
        # the agreed call works, and is then repeated by one rank while the other changes an
        # option: with a per-signature cache rank 0 would skip the check and hang in the ring
        "agreed": lambda: ringflash.ring_flash_attn_func(*agreed, causal=True),
        "causal": lambda: ringflash.ring_flash_attn_func(*agreed, causal=rank == 0),
        "ulysses window": lambda: ringflash.sp_attn_func(
            *agreed, causal=True, window_size=(3 + rank, 0), sp_mode="ulysses", layout="contiguous"
        ),
        "sinks on one rank": lambda: ringflash.zigzag_ring_flash_attn_func(
            *agreed, causal=True, sinks=torch.zeros(2, device=worker_device()) if rank else None
        ),
        "bad layout on one rank": lambda: ringflash.ring_flash_attn_func(
            *agreed, layout="zigzag" if rank == 0 else "spiral"
        ),
        "dropout on one rank": lambda: ringflash.ring_flash_attn_func(*agreed, 0.1 if rank else 0.0),
        "packed": lambda: ringflash.ring_flash_attn_func(
            *(t[:, :8] for t in agreed), cu_seqlens=[0, 4, 16] if rank == 0 else [0, 8, 16]
        ),
        "q not a tensor on one rank": lambda: ringflash.ring_flash_attn_func(
            None if rank else agreed[0], *agreed[1:], causal=True
        ),
        "agreed again": lambda: ringflash.ring_flash_attn_func(*agreed, causal=True),
    })  # fmt: skip
    return errors


def test_disagreeing_ranks_raise_on_every_rank(rank_pool):
    for errors in rank_pool(2).run(_disagreeing_calls, timeout=300):
        assert errors["agreed"] is None and errors["agreed again"] is None
        shapes = "q: rank 0: ('tensor', (1, 8, 2, 16), 'float32'), rank 1: ('tensor', (1, 12, 2, 16)"
        assert shapes in errors["seqlen"]
        assert "causal: rank 0: True, rank 1: False" in errors["causal"]
        assert "window_size: rank 0: (3, 0), rank 1: (4, 0)" in errors["ulysses window"]
        assert "sinks: rank 0: None, rank 1: ('tensor', (2,), 'float32')" in errors["sinks on one rank"]
        assert "layout: rank 0: 'zigzag', rank 1: 'spiral'" in errors["bad layout on one rank"]
        assert "layout must be one of" in errors["bad layout on one rank"]  # rank 1's own error, shown to all
        assert "cu_seqlens: rank 0: (0, 4, 16), rank 1: (0, 8, 16)" in errors["packed"]
        assert (
            "q: rank 0: ('tensor', (1, 8, 2, 16), 'float32'), rank 1: None"
            in errors["q not a tensor on one rank"]
        )
        assert "error: rank 0: None, rank 1: 'ValueError: dropout_p=0.1" in errors["dropout on one rank"]


def _disagreeing_gathers():
    rank = dist.get_rank()
    x = torch.randn(1, 4, 2, device=worker_device())
    return errors_of({
        "agreed": lambda: ringflash.gather_sequence(x, layout="zigzag"),
        # before: rank 0 hung in the all-gather while rank 1 raised
        "length": lambda: ringflash.gather_sequence(x[:, : 4 - 2 * rank], layout="contiguous"),
        # before: a wrong sequence on every rank, without an error
        "layout": lambda: ringflash.gather_sequence(x, layout="stripe" if rank else "contiguous"),
        "bad dim on one rank": lambda: ringflash.gather_sequence(x, dim=1 + 5 * rank, layout="stripe"),
        "agreed again": lambda: ringflash.gather_sequence(x, layout="stripe"),
    })  # fmt: skip


def test_disagreeing_gathers_raise_on_every_rank(rank_pool):
    for errors in rank_pool(2).run(_disagreeing_gathers, timeout=120):
        assert errors["agreed"] is None and errors["agreed again"] is None
        assert "x: rank 0: ('tensor', (1, 4, 2), 'float32'), rank 1: ('tensor', (1, 2, 2)" in errors["length"]
        assert "layout: rank 0: 'contiguous', rank 1: 'stripe'" in errors["layout"]
        assert "rank 1: 'ValueError: dim must be an int in [-3, 3), got 6'" in errors["bad dim on one rank"]


def _check_cost(calls: int, across_hosts: bool) -> float:
    with _as_if_across_hosts(across_hosts):
        host_values_agree(1, dist.group.WORLD)
        start = time.perf_counter()
        for i in range(calls):
            assert host_values_agree(i, dist.group.WORLD)
        return (time.perf_counter() - start) / calls


def _as_if_across_hosts(on: bool):
    """Ranks that report different hosts check over gloo (a fresh setup, the mailbox cache
    restored after)."""
    if not on:
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(mock.patch.dict(comm._MAILBOXES, clear=True))
    stack.enter_context(mock.patch.object(comm, "_host_identity", lambda: (f"host{dist.get_rank()}", "")))
    return stack


@pytest.mark.parametrize("across_hosts", [False, True], ids=["shared-memory", "gloo"])
def test_agreement_check_cost(rank_pool, across_hosts):
    """The per-call check on one host (a shared-memory mailbox) and across hosts (a 16-byte
    gloo all-reduce); print their cost (2 CPU ranks)."""
    per_call = max(rank_pool(2).run(_check_cost, 200, across_hosts))
    print(
        f"agreement check ({'gloo' if across_hosts else 'shared memory'}): {per_call * 1e6:.0f} us per call"
    )
    assert per_call < 0.05  # loose: the CI machine is shared; see consistency.py for the measurement


def _values_agree(across_hosts: bool) -> list[bool]:
    rank = dist.get_rank()
    seen = []
    with _as_if_across_hosts(across_hosts):
        for i in range(600):  # past the mailbox's 255 tags, twice
            if i == 300 and rank == 1:
                time.sleep(0.3)  # a late rank: the other waits for it, then both compare
            value = i if i % 7 else (i if rank == 0 else -i - 1)  # every 7th call: ranks disagree
            seen.append(host_values_agree(value, dist.group.WORLD))
        seen.append(
            host_values_agree(2**70 + rank, dist.group.WORLD)
        )  # beyond 56 bits: hashed, still told apart
        seen.append(host_values_agree(-5, dist.group.WORLD))
    return seen


@pytest.mark.parametrize("across_hosts", [False, True], ids=["shared-memory", "gloo"])
def test_values_agree_exactly_when_equal(rank_pool, across_hosts):
    expected = [bool(i % 7) for i in range(600)] + [False, True]
    for seen in rank_pool(2).run(_values_agree, across_hosts, timeout=120):
        assert seen == expected


def _disagree_across_hosts():
    with _as_if_across_hosts(True):
        return _disagreeing_calls()


def test_disagreeing_ranks_raise_across_hosts(rank_pool):
    for errors in rank_pool(2).run(_disagree_across_hosts, timeout=300):
        assert errors["agreed"] is None and errors["agreed again"] is None
        assert "causal: rank 0: True, rank 1: False" in errors["causal"]
        assert "cu_seqlens: rank 0: (0, 4, 16), rank 1: (0, 8, 16)" in errors["packed"]


def test_mailbox_names_a_rank_that_never_comes():
    words = np.zeros((3, 2), dtype=np.uint64)
    mailbox = comm.HostMailbox(words, rank=0, timeout=0.2)
    words[2, 0] = np.uint64((1 << 56) | 7)  # rank 2 reached the first check; rank 1 never does
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not reach ringflash's argument check"):
        mailbox.agree(7)
    assert time.monotonic() - start < 5
