"""Replaying a function of fixed-shape CUDA tensors from a CUDA graph the library captures itself.

An eager ring call issues tens of kernel launches and NCCL calls from Python: about 2 ms of host
time per forward+backward on two ranks, which the device outruns below ~8K tokens per rank
(docs/experiments.md §69, §70). A cached ring setup runs the same kernels and transfers on every
call, so its forward and its backward can each be captured once and replayed: a call copies its
inputs into the graph's static buffers, replays, and copies the outputs out. The copies are what
makes it safe for layers that share a setup (and so a graph): nothing a later replay overwrites
is handed to the caller.

``GraphReplay(fn)`` runs ``fn`` eagerly on its first call (which compiles the kernels and sets up
NCCL's communicator), captures it on its second and replays it from then on. Every rank of a ring
makes the same calls of the same setups (the ranks' check enforces the arguments), so every rank
captures at the same call (a rank that replays while its peer runs eagerly should still match,
since NCCL pairs point-to-point operations by their order; not tested).

Before ``torch.distributed.destroy_process_group()``, call ``release_graphs()``: NCCL waits, in
the communicator's shutdown, for every graph that captured its operations to be destroyed, so a
process still holding them hangs there (PyTorch issue #115388; measured with this module's graphs,
docs/experiments.md §71). ``release_graphs`` also runs at interpreter exit.

Opt-in while it is measured: ``RINGFLASH_RING_GRAPHS=1``. Not used while the caller itself
captures a graph (its capture records the eager call), for tensors off the GPU, or above
``MAX_REPLAY_BYTES`` per input (there the host is hidden behind the kernels and the copies would
cost more than they save).
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable

import torch

# Larger inputs run eagerly: at 8K tokens per rank and above the host keeps ahead of the device.
MAX_REPLAY_BYTES = 32 << 20


def replay_wanted(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` should go through ``GraphReplay``: opted in, on the current
    GPU, not inside the caller's own capture, dense and small enough."""
    if os.environ.get("RINGFLASH_RING_GRAPHS", "0") != "1":
        return False
    if not all(t.is_cuda and t.is_contiguous() for t in tensors):
        return False
    # A capture records the current device's stream: kernels for tensors on another device
    # would run once during the capture and never replay (stale outputs after).
    current = torch.cuda.current_device()
    if any(t.device.index != current for t in tensors):
        return False
    if max(t.numel() * t.element_size() for t in tensors) > MAX_REPLAY_BYTES:
        return False
    return not torch.cuda.is_current_stream_capturing()


# Every GraphReplay holding a captured graph (autograd's saved contexts may hold one too).
_CAPTURED: weakref.WeakSet[GraphReplay] = weakref.WeakSet()


def release_graphs() -> None:
    """Destroys every graph the library captured (``RINGFLASH_RING_GRAPHS=1``) and frees its
    buffers; a later call of the same setup runs eagerly, then captures again. Call it before
    ``torch.distributed.destroy_process_group()``, which otherwise waits forever for NCCL's
    captured operations to be released."""
    if not _CAPTURED:
        return
    torch.cuda.synchronize()  # no replay in flight when its graph goes
    for replay in list(_CAPTURED):
        replay.release()
    torch.cuda.synchronize()


atexit.register(release_graphs)


class GraphReplay:
    """``fn(*tensors) -> tuple of tensors`` on fixed shapes: eager on the first call, captured on
    the second, replayed after. The outputs are always fresh tensors."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        self._fn = fn
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._inputs: list[torch.Tensor] = []
        self._outputs: tuple[torch.Tensor, ...] = ()

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls += 1
        if self.calls == 1:
            return self._fn(*inputs)
        if self.graph is None:
            # Plain tensors even when captured under inference mode: later calls outside it copy
            # into the static inputs, which an inference tensor would refuse.
            with torch.inference_mode(False):
                self._inputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]
                for static, t in zip(self._inputs, inputs):
                    static.copy_(t)
                graph = torch.cuda.CUDAGraph()
                # thread_local: NCCL's watchdog thread queries earlier work's events during capture.
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self._outputs = tuple(self._fn(*self._inputs))
            self.graph = graph
            _CAPTURED.add(self)
        else:
            for static, t in zip(self._inputs, inputs):
                static.copy_(t)
        self.graph.replay()
        return tuple(t.clone() for t in self._outputs)

    def release(self) -> None:
        """Drops the graph and its static buffers: the next call runs eagerly, the one after
        captures again."""
        self.graph = None
        self._inputs, self._outputs = [], ()
        self.calls = 0
        _CAPTURED.discard(self)
