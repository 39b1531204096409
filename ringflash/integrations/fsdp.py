"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters sharded over every rank of a
data-parallel x sequence-parallel mesh, as DeepSpeed ZeRO-3 shards them, attention on "sp".

    import ringflash, ringflash.integrations.fsdp as rf_fsdp
    groups = ringflash.sequence_parallel_groups(sp_size)        # groups.mesh: ("dp", "sp")
    model = ReferenceDecoder(..., attention=SequenceParallelAttention(group=groups.mesh["sp"]))
    rf_fsdp.fully_shard(model, groups, blocks=model.blocks)      # optionally after compiling blocks
    shard = ringflash.shard_batch(batch, groups.mesh["sp"])
    loss = ringflash.sequence_parallel_cross_entropy(model(shard["input_ids"], shard["position_ids"]),
                                                     shard["target_ids"], groups.mesh["sp"])
    loss.backward()                                              # no reduce_gradients: FSDP2 reduces
    optimizer.step()

Gradient scale: each rank's loss is its shard's token-loss sum over the token count of its whole
sequence-parallel group, so the S ranks of a group hold partial gradients that *sum* to the
gradient of the full-sequence loss, and the D groups' sums are to be *averaged*. FSDP2
reduce-scatters over all D x S ranks and divides by D x S, which would be S times too small;
``fully_shard`` sets every FSDP module's gradient divide factor to D instead (the sum over all
ranks / D). tests/test_fsdp.py checks a step against a single-process run.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as _fully_shard

from ..groups import ParallelGroups


def fully_shard(
    model: nn.Module, groups: ParallelGroups, blocks: Iterable[nn.Module] = (), **kwargs
) -> nn.Module:
    """Shard ``model`` with FSDP2 over all ranks of ``groups.mesh`` (the (dp, sp) mesh from
    ``sequence_parallel_groups``, flattened), each of ``blocks`` (e.g. the decoder layers, compiled
    or not) as its own unit, and set the gradient scale for sequence-parallel losses (module
    docstring). kwargs go to ``torch.distributed.fsdp.fully_shard`` (``mp_policy``,
    ``reshard_after_forward``, ...). Returns ``model``, now an FSDPModule; call it on every rank."""
    if not isinstance(groups, ParallelGroups) or groups.mesh is None:
        raise TypeError(
            "groups must be ringflash.sequence_parallel_groups(...)'s ParallelGroups, with a mesh"
        )
    if "mesh" in kwargs:
        raise TypeError("fully_shard shards over groups.mesh flattened; do not pass mesh")
    flat = groups.mesh._flatten("dp_sp")
    for block in blocks:
        _fully_shard(block, mesh=flat, **kwargs)
    _fully_shard(model, mesh=flat, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(groups.dp_size))
            if groups.mesh.device_type == "cpu":  # gloo has no pre-multiplied sum: divide after a plain sum
                module.set_force_sum_reduction_for_comms(True)
    return model


__all__ = ["fully_shard"]
