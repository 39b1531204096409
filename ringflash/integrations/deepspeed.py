"""DeepSpeed: data-parallel x sequence-parallel training with ringflash attention.

    import ringflash, ringflash.integrations.deepspeed as rf_ds
    groups = ringflash.sequence_parallel_groups(4)          # D x 4 ranks; cached, initialize reuses it
    model = ...                                             # attention on groups.sp_group (hf.enable)
    engine, optimizer, _, scheduler = rf_ds.initialize(model, "ds_config.json", sp_size=4, optimizer=opt)
    shard = ringflash.shard_batch(batch, groups.sp_group)   # the same batch on the 4 ranks of a group
    logits = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    loss = ringflash.sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    rf_ds.backward(engine, loss)                            # not engine.backward: see below
    engine.step()

How DeepSpeed (0.19.8) reduces gradients when given a sequence-parallel ``mpu``: ZeRO stages 0, 1
and 2 all-reduce every gradient over the sequence-data-parallel group (all D x S ranks) and
divide by D. Each rank's loss is its shard's token-loss sum over the token count of its whole
sequence-parallel group (``sequence_parallel_cross_entropy``), so that gives the gradient of the
full-sequence loss, averaged over data-parallel replicas. ZeRO-3's reduce-scatter divides by
D x S instead (``reduce_scatter_coalesced`` pre-divides by the group size and stage 3 never
multiplies back by S), so its gradients come out S times too small; ``backward`` multiplies the
loss by S there. tests/test_deepspeed.py checks all of this against a single-process run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from ..groups import ParallelGroups, sequence_parallel_groups


class SequenceParallelMPU:
    """The "mpu" (parallel-state object) DeepSpeed takes for sequence parallelism, over
    ringflash's groups: sequence-parallel groups of ``sp_size`` consecutive ranks, and one
    sequence-data-parallel group of all ranks, over which ZeRO partitions and reduces.

    It mirrors ``deepspeed.runtime.sequence_parallel.parallel_state_sp``. Two details matter:
    DeepSpeed recognises a sequence-parallel mpu by its ``initialize_sequence_parallel``
    attribute (without it, the model-parallel getters would be taken for tensor parallelism), and
    it has no ``get_data_parallel_group``: given one, ZeRO-3 would partition parameters over the
    D data-parallel ranks while reducing gradients over all D x S. Use ``groups.dp_group`` for
    your own data-parallel needs (e.g. a sampler).
    """

    def __init__(self, groups: ParallelGroups) -> None:
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups must be ringflash.ParallelGroups, got {type(groups).__name__}")
        self.groups = groups

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        """Marker DeepSpeed looks for; the groups exist already, so this only checks the size."""
        if sequence_parallel_size != self.groups.sp_size:
            raise ValueError(
                f"this mpu was built for sp_size={self.groups.sp_size}, not {sequence_parallel_size}"
            )

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.sp_rank

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        # Sequence-parallel groups tile the world, so "every rank of every D x S group" is the world.
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank()

    # Aliases DeepSpeed's own sequence-parallel mpu has (used for checkpoint names and norms).
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


def sequence_parallel_mpu(sp_size: int) -> SequenceParallelMPU:
    """DeepSpeed ``mpu`` for data-parallel x sequence-parallel training (D = world / sp_size).

    Collective the first time for a given ``sp_size``: every rank must call it (it builds the
    groups with ``ringflash.sequence_parallel_groups``, which raises ValueError unless sp_size is a
    positive int dividing the world size). torch.distributed must be initialized.
    """
    return SequenceParallelMPU(sequence_parallel_groups(sp_size))


def _load_config(config: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")


def initialize(
    model: torch.nn.Module,
    config: str | os.PathLike | dict[str, Any],
    sp_size: int,
    optimizer: Any = None,
    **kwargs: Any,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with ringflash's sequence-parallel groups as the ``mpu``.

    model: the module whose attention layers run on ``engine.mpu.groups.sp_group`` (e.g. a
    transformers model with ``attn_implementation=ringflash.integrations.hf.enable(group=...)``).
    config: a DeepSpeed config dict or JSON path; batch sizes count per data-parallel replica
    (train_batch_size = micro batch x accumulation x D). optimizer: a torch optimizer or None
    (then the config's); a config ``sequence_parallel_size`` other than sp_size is refused.
    kwargs: passed on (``lr_scheduler``, ``model_parameters``, ...); ``mpu``, ``mesh_param`` and
    ``config_params`` are refused (they would contradict, or be ignored beside, what is passed).
    Returns DeepSpeed's (engine, optimizer, dataloader, lr_scheduler); ``engine.mpu`` is the
    ``SequenceParallelMPU``. Call ``backward(engine, loss)`` instead of ``engine.backward(loss)``.
    """
    import deepspeed

    if "mpu" in kwargs:
        raise TypeError("initialize builds the mpu itself from sp_size; do not pass mpu")
    # DeepSpeed would ignore these beside the config and mpu passed here.
    if "config_params" in kwargs:
        raise TypeError("initialize passes config to DeepSpeed; do not pass config_params as well")
    if "mesh_param" in kwargs:
        raise TypeError("initialize builds the sequence-parallel groups from sp_size; do not pass mesh_param")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _load_config(config)
    if config.get("sequence_parallel_size", sp_size) != sp_size:
        raise ValueError(
            f"the config's sequence_parallel_size={config['sequence_parallel_size']} contradicts "
            f"sp_size={sp_size} (DeepSpeed would follow the mpu built from sp_size and ignore it)"
        )
    mpu = sequence_parallel_mpu(sp_size)
    zero = config.get("zero_optimization") or {}
    if sp_size > 1 and int(zero.get("stage", 0)) == 3 and not zero.get("reduce_scatter", True):
        # Stage 3 without reduce-scatter divides by D for buckets up to reduce_bucket_size and by
        # D x S beyond: no single loss scale fixes both.
        raise ValueError("ZeRO-3 with sequence parallelism needs zero_optimization.reduce_scatter=true")
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu, **kwargs)


def backward_scale(engine: Any) -> float:
    """The factor ``backward`` multiplies the loss by so that DeepSpeed's gradient reduction
    yields the full-sequence gradient: S under ZeRO-3 (its reduce-scatter averages over all
    D x S ranks), else 1.0. Works for any sequence-parallel mpu, DeepSpeed's own included."""
    sp = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    if sp == 1 or engine.zero_optimization_stage() != 3:
        return 1.0
    if not engine.zero_reduce_scatter():
        raise ValueError("ZeRO-3 with sequence parallelism needs zero_optimization.reduce_scatter=true")
    return float(sp)


def backward(engine: Any, loss: torch.Tensor, **kwargs: Any) -> None:
    """``engine.backward`` for a sequence-parallel loss (a float scalar from
    ``sequence_parallel_cross_entropy`` or ``sequence_parallel_chunked_cross_entropy``), scaled by
    ``backward_scale(engine)``; kwargs go to ``engine.backward``. Report the unscaled loss."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError("loss must be a scalar tensor")
    scale = backward_scale(engine)
    engine.backward(loss * scale if scale != 1.0 else loss, **kwargs)


__all__ = ["SequenceParallelMPU", "backward", "backward_scale", "initialize", "sequence_parallel_mpu"]
