"""A ring's kernel calls on one H100/H200: every rank's steps of a W-rank ring take the Hopper
kernels (the fused backward's schedule too) and run through the Hopper forward, with the K/V
shards of the other ranks handed over by a stand-in for the ring's communication; the merged
result equals float64 attention over the full sequence. The transfers themselves are tested over
gloo (test_ring.py) and on several GPUs (``multigpu``)."""

from __future__ import annotations

import pytest
import torch
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err
from sm90 import SM90, cuda_randn

from ringflash import ring
from ringflash.kernels import build_problem, uses_fused_forward
from ringflash.layouts import document_lengths, layout_indices

pytestmark = [pytest.mark.gpu, SM90]


class _Delivered:
    def wait(self) -> None:
        pass


class SimulatedRing:
    """``RingComm`` for rank ``rank`` of a ring whose shards are all here: the n-th exchange
    delivers the K/V shard of rank - n."""

    def __init__(self, rank: int, shards: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.rank, self.world_size, self.shards, self.exchanges = rank, len(shards), shards, 0

    def exchange(self, send, recv, offset: int = 1):
        self.exchanges += 1
        for buf, shard in zip(recv, self.shards[(self.rank - self.exchanges) % self.world_size]):
            buf.copy_(shard)
        return _Delivered()


@pytest.mark.parametrize(
    ("layout", "causal", "window", "docs"),
    [
        ("stripe", True, (-1, -1), None),
        ("zigzag", True, (-1, -1), None),
        ("contiguous", True, (700, 0), None),
        ("zigzag", True, (-1, -1), (1024, 512, 2560)),
        ("stripe", True, (300, 0), (2048, 1024, 1024)),
    ],
)
def test_ring_steps_take_the_hopper_forward(monkeypatch, layout, causal, window, docs):
    world, heads, kv_heads, dim, total = 4, 4, 2, 128, 4096
    q, k, v = (cuda_randn(1, total, h, dim, seed=s) for s, h in ((1, heads), (2, kv_heads), (3, kv_heads)))
    cu = None if docs is None else [0, *torch.tensor(docs).cumsum(0).tolist()]
    doc_lens = (total,) if docs is None else document_lengths(cu, total, layout, world)
    index = [layout_indices(layout, r, world, total, cu_seqlens=cu).cuda() for r in range(world)]
    shards = [(k[:, i], v[:, i]) for i in index]
    from ringflash.kernels.hopper import forward as hopper_forward

    launched, fused_forward = [], hopper_forward.fused_forward
    monkeypatch.setattr(hopper_forward, "fused_forward", lambda *a: launched.append(1) or fused_forward(*a))
    out = torch.empty_like(q)
    lse = torch.empty(1, heads, total, device="cuda")
    for rank in range(world):
        comm = SimulatedRing(rank, shards)
        qr, (kr, vr) = q[:, index[rank]], shards[rank]
        base = build_problem(qr, kr, vr, None, causal, window)
        plan = ring.ring_plan(base, layout, comm, doc_lens, docs is not None, q.device)
        calls = [c for step in plan for c in step]
        assert all(uses_fused_forward(c.problem, qr[c.q_index], kr[c.k_index], vr[c.k_index]) for c in calls)
        assert ring.backward_is_fused(plan, qr, kr, vr)  # the ring's fused backward schedule
        before = len(launched)
        out[:, index[rank]], lse[:, :, index[rank]] = ring.ring_forward(qr, kr, vr, plan, comm)
        assert len(launched) - before == len(calls)
    full = [t.double().cpu() for t in (q, k, v)]
    if cu is None:
        exp_out, exp_lse = reference_attention(*full, causal=causal, window_size=window)
    else:
        exp_out, exp_lse = reference_attention_packed(*full, cu, causal=causal, window_size=window)
    assert rel_err(out.cpu(), exp_out) < TOLERANCE[torch.bfloat16], "out"
    assert rel_err(lse.cpu(), exp_lse) < 1e-4, "lse"
