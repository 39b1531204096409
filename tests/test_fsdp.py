"""FSDP2 (fully_shard over the flattened dp x sp mesh) with ring attention on "sp": one SGD step
on 4 gloo ranks (2 data-parallel x 2 sequence-parallel) equals the single-process step; of the
two decoder blocks, each its own FSDP unit, the first is compiled and the second runs eagerly.

SGD with lr=1 and no momentum: the update is the reduced gradient, so a wrong scale cannot hide.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import rel_err

import ringflash
import ringflash.integrations.fsdp as rf_fsdp
from ringflash import ReferenceDecoder, SequenceParallelAttention, flash_attn_func

VOCAB, SEQ, SP = 64, 16, 2


class _LocalAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return flash_attn_func(q, k, v, causal=True)


def _decoder(attention: torch.nn.Module) -> ReferenceDecoder:
    torch.manual_seed(0)
    return ReferenceDecoder(vocab=VOCAB, dim=32, layers=2, heads=2, kv_heads=1, attention=attention)


def _ids(replica: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(100 + replica))


def _single_process_step(dp_size: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Loss (mean over the replicas' sequences), gradients and SGD(lr=1)-updated parameters."""
    model = _decoder(_LocalAttention())
    losses = []
    for replica in range(dp_size):
        ids = _ids(replica)
        logits = model(ids, torch.arange(SEQ)[None])
        losses.append(F.cross_entropy(logits[0, :-1], ids[0, 1:]))
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, [(p - g).detach() for p, g in zip(model.parameters(), grads)]


def _fsdp_step_matches_single_process() -> tuple[float, float, float]:
    groups = ringflash.sequence_parallel_groups(SP)
    sp = groups.mesh["sp"]
    want_loss, want_grads, want_params = _single_process_step(groups.dp_size)
    model = _decoder(SequenceParallelAttention(group=sp))
    assert len(model.blocks) == 2
    model.blocks[0] = torch.compile(model.blocks[0], backend="aot_eager", fullgraph=True)
    rf_fsdp.fully_shard(model, groups, blocks=model.blocks)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    shard = ringflash.shard_batch({"input_ids": _ids(groups.dp_rank)}, sp)
    logits = model(shard["input_ids"], shard["position_ids"])
    loss = ringflash.sequence_parallel_cross_entropy(logits, shard["target_ids"], sp)
    loss.backward()
    opt.step()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=groups.dp_group)
    mean_loss /= groups.dp_size
    # full_tensor() all-gathers the shards: every rank, in the same order.
    grads = [p.grad.full_tensor() for p in model.parameters()]
    params = [p.detach().full_tensor() for p in model.parameters()]
    assert len(grads) == len(want_grads)
    return (
        abs(mean_loss.item() - want_loss.item()) / want_loss.item(),
        max(rel_err(g, w) for g, w in zip(grads, want_grads)),
        max(rel_err(p, w) for p, w in zip(params, want_params)),
    )


def test_fsdp2_sequence_parallel_step_with_compiled_and_eager_blocks_matches_single_process(rank_pool):
    for loss_err, grad_err, param_err in rank_pool(4).run(_fsdp_step_matches_single_process):
        assert loss_err < 1e-6 and grad_err < 1e-5 and param_err < 1e-6, (loss_err, grad_err, param_err)


def _fsdp_rejects(groups_size: int) -> str:
    groups = ringflash.sequence_parallel_groups(groups_size)
    again = ringflash.sequence_parallel_groups(mesh=groups.mesh)  # groups taken from a given mesh
    rank = dist.get_rank()
    assert (again.sp_size, again.dp_size, again.sp_rank, again.dp_rank) == (SP, 2, rank % SP, rank // SP)
    assert dist.get_process_group_ranks(again.sp_group) == dist.get_process_group_ranks(groups.sp_group)
    with pytest.raises(ValueError, match="mesh_dim_names"):
        ringflash.sequence_parallel_groups(mesh=groups.mesh["sp"])
    with pytest.raises(TypeError, match="do not pass mesh"):
        rf_fsdp.fully_shard(_decoder(_LocalAttention()), groups, mesh=groups.mesh)
    with pytest.raises(ValueError, match="not a dimension of the mesh"):
        ringflash.shard_sequence(torch.zeros(1, SEQ), (groups.mesh, "tp"), layout="zigzag")
    with pytest.raises(ValueError, match="2-D DeviceMesh"):
        ringflash.sp_attn_func(*(torch.zeros(1, 4, 2, 16),) * 3, group=groups.mesh)
    return "ok"


def test_fsdp2_and_mesh_arguments_are_checked(rank_pool):
    assert rank_pool(4).run(_fsdp_rejects, SP) == ["ok"] * 4
