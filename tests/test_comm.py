"""ringflash.use_high_priority_comm (the ring exchanges are exercised by test_ring)."""

import os

import pytest
import torch.distributed as dist

import ringflash


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
