"""DeepSpeed with ringflash's sequence-parallel mpu: one training step (ZeRO 0-3, D x S ranks)
moves every parameter by exactly the gradient of the single-process full-sequence loss,
averaged over data-parallel replicas.

The optimizer is SGD with lr=1 and no momentum, and DeepSpeed's gradient clipping (on by
default, at 1.0) is off, so the update *is* the reduced gradient: a wrong reduction scale cannot
hide behind clipping or Adam's normalisation.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import errors_of, worker_device

from ringflash import sequence_parallel_cross_entropy, shard_batch
from ringflash.loss import sequence_parallel_chunked_cross_entropy

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 32


def _model(attn_implementation: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    ).float()


def _ids(replica: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(100 + replica))


class _ChunkedLoss(torch.nn.Module):
    """What launch/train.py runs: decoder -> hidden state -> chunked lm_head + loss, all inside
    the engine's forward (so ZeRO-3 gathers lm_head's weight for every chunk)."""

    def __init__(self, lm: torch.nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.lm, self.group = lm, group

    def forward(self, input_ids, position_ids, target_ids):
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)[0]
        return sequence_parallel_chunked_cross_entropy(hidden, self.lm.lm_head, target_ids, self.group, 5)


def _ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed's default (1.0) would rescale the update
        "steps_per_print": 10**9,
    }


def _setup_deepspeed_worker() -> None:
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # DeepSpeed requires it; pool rank r uses device r
    # On the CPU, DeepSpeed JIT-compiles a shared-memory all-reduce (~1 min on 2 cores) that only
    # its inference path uses. (`import deepspeed.comm.torch as m` would bind torch itself.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _full_params(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)  # ZeRO's fp32 master copy; None without ZeRO
        out[name.removeprefix("lm.")] = (p.detach() if full is None else full).float().cpu().clone()
    return out


def _ds_step(sp_size: int, stage: int, chunked: bool, scaled: bool):
    _setup_deepspeed_worker()
    import ringflash.integrations.deepspeed as rf_ds
    import ringflash.integrations.hf as rf_hf

    groups = rf_ds.sequence_parallel_mpu(sp_size).groups
    lm = _model(rf_hf.enable(group=groups.sp_group)).to(worker_device())
    model = _ChunkedLoss(lm, groups.sp_group) if chunked else lm
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = rf_ds.initialize(model, _ds_config(stage), sp_size, optimizer=sgd)
    assert engine.mpu.groups is groups
    assert (engine.sequence_parallel_size, engine.seq_dp_world_size) == (sp_size, dist.get_world_size())
    before = _full_params(engine)
    shard = shard_batch({"input_ids": _ids(groups.dp_rank).to(worker_device())}, groups.sp_group)
    if chunked:
        loss = engine(shard["input_ids"], shard["position_ids"], shard["target_ids"])
    else:
        logits = engine(
            input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False
        ).logits
        loss = sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    rf_ds.backward(engine, loss) if scaled else engine.backward(loss)
    engine.step()
    after = _full_params(engine)
    return groups.dp_rank, loss.item(), {n: before[n] - after[n] for n in before}


def _reference(dp_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, full sequences, transformers' eager attention: per-replica losses and the
    replica-averaged gradients."""
    losses, grads = [], {}
    for replica in range(dp_size):
        model, ids = _model("eager"), _ids(replica)
        loss = F.cross_entropy(model(input_ids=ids, use_cache=False).logits[0, :-1], ids[0, 1:])
        loss.backward()
        losses.append(loss.item())
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / dp_size
    return losses, grads


def _check(results, ref_losses, ref_grads, expected_scale: float = 1.0) -> None:
    for rank, (replica, loss, update) in enumerate(results):
        assert abs(loss - ref_losses[replica]) < 1e-5 * ref_losses[replica], (rank, loss, ref_losses[replica])
        assert update.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            err = ((update[n] - expected_scale * g).norm() / (expected_scale * g).norm()).item()
            assert err < 2e-4, f"rank {rank} {n}: update vs {expected_scale} x gradient, rel err {err:.2e}"


@pytest.mark.parametrize(
    ("world", "sp_size", "stage", "chunked"),
    [(2, 2, 0, False), (2, 2, 1, True), (2, 2, 2, False), (2, 2, 3, True), (4, 2, 2, True), (4, 2, 3, True)],
)
def test_deepspeed_step_matches_single_process(rank_pool, world, sp_size, stage, chunked):
    results = rank_pool(world).run(_ds_step, sp_size, stage, chunked, True)
    _check(results, *_reference(world // sp_size))


def test_zero3_reduce_scatter_averages_over_sequence_parallel_ranks(rank_pool):
    """Why ``backward`` scales the loss under ZeRO-3: DeepSpeed 0.19.8's stage-3 reduce-scatter
    divides by D x S, so a plain ``engine.backward`` updates by gradient / S. If a DeepSpeed
    release fixes that, this test fails and ``backward_scale`` must go back to 1."""
    results = rank_pool(2).run(_ds_step, 2, 3, False, False)
    _check(results, *_reference(1), expected_scale=0.5)


def _bad_inputs():
    _setup_deepspeed_worker()
    import ringflash.integrations.deepspeed as rf_ds

    model = torch.nn.Linear(2, 2)
    stage3_no_rs = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "reduce_scatter": False},
    }
    return errors_of(
        {
            "sp_size": lambda: rf_ds.sequence_parallel_mpu(3),
            "sp_type": lambda: rf_ds.sequence_parallel_mpu(2.0),
            "config": lambda: rf_ds.initialize(model, 42, 2),
            "mpu": lambda: rf_ds.initialize(model, {}, 2, mpu=object()),
            "model": lambda: rf_ds.initialize("model", {}, 2),
            "stage3": lambda: rf_ds.initialize(model, stage3_no_rs, 2),
            "size": lambda: rf_ds.sequence_parallel_mpu(2).initialize_sequence_parallel(4),
            "groups": lambda: rf_ds.SequenceParallelMPU(None),
            "loss": lambda: rf_ds.backward(None, torch.ones(2)),
            # settings DeepSpeed would ignore beside the config and mpu given: refused
            "config_sp": lambda: rf_ds.initialize(model, {"sequence_parallel_size": 1}, 2),
            "config_params": lambda: rf_ds.initialize(model, {}, 2, config_params={}),
            "mesh_param": lambda: rf_ds.initialize(model, {}, 2, mesh_param=(1, 2)),
        }
    )


def test_bad_inputs(rank_pool):
    errors = rank_pool(2).run(_bad_inputs)[0]
    assert "sp_size must be a positive int dividing the world size 2, got 3" in errors["sp_size"]
    assert errors["sp_type"].startswith("ValueError: sp_size must be a positive int")
    assert errors["config"] == "TypeError: config must be a dict or a path to a JSON file, got int"
    assert "do not pass mpu" in errors["mpu"]
    assert errors["model"] == "TypeError: model must be a torch.nn.Module, got str"
    assert "reduce_scatter=true" in errors["stage3"]
    assert "built for sp_size=2, not 4" in errors["size"]
    assert errors["groups"].startswith("TypeError: groups must be ringflash.ParallelGroups")
    assert errors["loss"] == "TypeError: loss must be a scalar tensor"
    assert "sequence_parallel_size=1 contradicts sp_size=2" in errors["config_sp"]
    assert "do not pass config_params" in errors["config_params"]
    assert "do not pass mesh_param" in errors["mesh_param"]
