"""launch/train.py's FSDP2 engine: the few DeepSpeed-engine methods the training loop calls, over
``torch.distributed.fsdp.fully_shard`` (``ringflash.integrations.fsdp``), so one loop drives both."""

from __future__ import annotations

import math

import torch
from torch import nn

import ringflash.integrations.fsdp as rf_fsdp
from ringflash.groups import ParallelGroups


class FSDP2Engine:
    """model (a CausalLMLoss) sharded over all ranks of ``groups.mesh``, each decoder layer its own
    unit; the loss of a micro step is divided by ``accumulation`` (as DeepSpeed does) and the
    optimizer steps after the last micro step, gradients clipped to ``grad_clip`` (0: off)."""

    def __init__(
        self,
        model: nn.Module,
        layers: nn.ModuleList,
        groups: ParallelGroups,
        make_optimizer,
        make_scheduler,
        accumulation: int,
        grad_clip: float,
    ) -> None:
        self.module = rf_fsdp.fully_shard(model, groups, blocks=list(layers))
        self.optimizer = make_optimizer(self.module.parameters())
        self.scheduler = make_scheduler(self.optimizer)
        self._accumulation, self._grad_clip, self._micro = accumulation, grad_clip, 0
        self._grad_norm: float | None = None

    def __call__(self, *args):
        return self.module(*args)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self._accumulation).backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro % self._accumulation:
            return
        max_norm = self._grad_clip if self._grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        self._grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm

    def zero_optimization_stage(self) -> int:
        return 3  # parameters, gradients and optimizer state sharded over all ranks, as ZeRO-3
