"""ringflash.comm: the ring's exchange over the group's own send/recv, and
use_high_priority_comm (the ring's use of the exchange is exercised by test_ring)."""

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from distributed import worker_device

import ringflash
from ringflash import comm


def test_use_high_priority_comm_sets_torch_nccl_high_priority(monkeypatch):
    # A copy of the environment without the variable, so the setting does not outlive the test.
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_HIGH_PRIORITY"}
    monkeypatch.setattr(os, "environ", env)
    ringflash.use_high_priority_comm()
    assert os.environ["TORCH_NCCL_HIGH_PRIORITY"] == "1"


def test_use_high_priority_comm_keeps_an_explicit_choice(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_HIGH_PRIORITY", "0")
    ringflash.use_high_priority_comm()
    assert os.environ["TORCH_NCCL_HIGH_PRIORITY"] == "0"


def test_use_high_priority_comm_after_init_warns(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_NCCL_HIGH_PRIORITY", "0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.warns(UserWarning, match="after init_process_group"):
            ringflash.use_high_priority_comm()
    finally:
        dist.destroy_process_group()


class _RecordingGroup:
    """A process group whose backend coalesces (as NCCL's does), recording its calls."""

    def __init__(self) -> None:
        self.calls = []

    def _get_backend(self, device):
        return mock.Mock(supports_coalescing=True)

    def _start_coalescing(self, device):
        self.calls.append(("start", device.type))

    def send(self, tensors, rank, tag):
        self.calls.append(("send", tensors[0].tolist(), rank))

    def recv(self, tensors, rank, tag):
        self.calls.append(("recv", tensors[0].tolist(), rank))

    def _end_coalescing(self, device):
        self.calls.append(("end", device.type))
        return "work"


def test_group_p2p_sends_one_coalesced_batch_where_the_backend_coalesces():
    group = _RecordingGroup()
    send, recv = [torch.tensor([1.0]), torch.tensor([2.0])], [torch.tensor([0.0]), torch.tensor([-1.0])]
    works = comm.group_p2p(group, send, recv, to_rank=3, from_rank=1)
    assert works == ["work"]
    assert group.calls == [
        ("start", "cpu"), ("send", [1.0], 3), ("send", [2.0], 3), ("recv", [0.0], 1), ("recv", [-1.0], 1),
        ("end", "cpu"),
    ]  # fmt: skip


def _exchanges(group_p2p: bool):
    """On 3 ranks: RingComm.exchange over the world with offsets 1, -1 and 2, and over the
    subgroup of global ranks 0 and 2 (group ranks 0 and 1: a send names the group rank), two
    tensors each way; returns what each rank received."""
    rank, device = dist.get_rank(), worker_device()
    sub = dist.new_group([0, 2])  # every rank creates it, only 0 and 2 use it
    got = []
    with mock.patch.object(comm, "_GROUP_P2P", group_p2p):
        ring = comm.RingComm()
        for offset in (1, -1, 2):
            send = [torch.full((3,), 10.0 * rank + i, device=device) for i in range(2)]
            recv = [torch.empty(3, device=device) for _ in range(2)]
            ring.exchange(send, recv, offset).wait()
            got.append([r[0].item() for r in recv])
        if rank != 1:
            send = [torch.full((2,), 100.0 + rank, device=device)]
            recv = [torch.empty(2, device=device)]
            comm.RingComm(sub).exchange(send, recv).wait()
            got.append(recv[0].tolist())
    return got


@pytest.mark.parametrize("group_p2p", [True, False], ids=["group_send_recv", "batch_isend_irecv"])
def test_ring_exchange_moves_each_tensor_to_its_peer(rank_pool, group_p2p):
    results = rank_pool(3).run(_exchanges, group_p2p)
    for rank, got in enumerate(results):
        expected = [[10.0 * ((rank - o) % 3) + i for i in range(2)] for o in (1, -1, 2)]
        assert got[:3] == expected
    assert results[0][3] == [102.0, 102.0] and results[2][3] == [100.0, 100.0]
    assert len(results[1]) == 3


def _collectives():
    """On 3 ranks: two tensors of different sizes gathered by one call, then their transposes
    summed back by one call, over the world and over the subgroup of global ranks 0 and
    2; returns (gathered, reduced) per group."""
    rank, device = dist.get_rank(), worker_device()
    sub = dist.new_group([0, 2])
    got = []
    for group in (dist.group.WORLD, sub) if rank != 1 else (dist.group.WORLD,):
        w = dist.get_world_size(group)
        xs = [torch.full((3,), 10.0 * rank, device=device), torch.full((2, 2), 1.0 + rank, device=device)]
        outs = [torch.empty(w, *x.shape, device=device) for x in xs]
        comm.all_gather_async(outs, xs, group, w).wait()
        sums = [torch.empty(x.shape, device=device) for x in xs]
        # rank r's slot j holds (r + 1) * (j + 1): the owner of slot j gets (j + 1) * sum(r + 1)
        slots = (rank + 1.0) * torch.arange(1.0, w + 1, device=device)
        parts = [slots.view(w, *[1] * x.dim()).expand(w, *x.shape).contiguous() for x in xs]
        comm.reduce_scatter_async(sums, parts, group, w).wait()
        got.append(([o.flatten().tolist() for o in outs], [s.flatten().tolist() for s in sums]))
    return got


def test_all_gather_and_reduce_scatter_of_several_tensors(rank_pool):
    results = rank_pool(3).run(_collectives)
    for rank, got in enumerate(results):
        for (gathered, summed), members in zip(got, ([0, 1, 2], [0, 2])):
            assert gathered[0] == [10.0 * r for r in members for _ in range(3)]
            assert gathered[1] == [1.0 + r for r in members for _ in range(4)]
            j = members.index(rank)
            assert summed[0] == [(j + 1.0) * sum(r + 1 for r in members)] * 3
            assert summed[1] == [(j + 1.0) * sum(r + 1 for r in members)] * 4
    assert len(results[1]) == 1
