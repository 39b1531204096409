"""ringflash.comm pieces that need no process group (exchanges are exercised by test_ring)."""

import os

import ringflash


def test_use_high_priority_comm_sets_torch_nccl_high_priority(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_HIGH_PRIORITY", raising=False)
    ringflash.use_high_priority_comm()
    assert os.environ["TORCH_NCCL_HIGH_PRIORITY"] == "1"


def test_use_high_priority_comm_keeps_an_explicit_choice(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_HIGH_PRIORITY", "0")
    ringflash.use_high_priority_comm()
    assert os.environ["TORCH_NCCL_HIGH_PRIORITY"] == "0"
