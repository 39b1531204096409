"""A pool of N ranks, started once (forked from a forkserver) and reused by every multi-process test.

With at least N GPUs the ranks use NCCL, one GPU each; otherwise gloo on the CPU, where the
kernels run under the Triton interpreter (a GPU machine without enough GPUs skips the test).
Test functions place their tensors on ``worker_device()``.

``RankPool(n).run(fn, *args)`` runs the module-level function ``fn`` on every rank at once and
returns the per-rank results in rank order. A rank that raises, or a run that outlives its
timeout (e.g. a collective that some rank never joined), fails the test with every rank's
traceback and tears the pool down, so a bug shows as an error, never as a hung suite.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DEVICE = torch.device("cpu")


def worker_device() -> torch.device:
    """The device of the current rank (inside a function run by ``RankPool.run``)."""
    return _DEVICE


def pool_backend(world_size: int) -> str | None:
    """ "nccl" with a GPU per rank, "gloo" under the Triton interpreter, else None (cannot run)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo" if os.environ.get("TRITON_INTERPRET") == "1" else None


def _worker(rank: int, world_size: int, port: int, backend: str, tasks: Any, results: Any) -> None:
    global _DEVICE
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # N ranks share a 2-core machine
    if backend == "nccl":
        _DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(_DEVICE)
        dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=_DEVICE)
    else:  # gloo: the kernels run under the interpreter (pool_backend)
        import interpreter_patching

        interpreter_patching.configure()
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report everything, including assertion errors, to the parent
            results.put((rank, False, traceback.format_exc()))
    replays = sys.modules.get("ringflash.graph_replay")
    if replays is not None:  # NCCL's shutdown waits for graphs that captured its operations
        replays.release_graphs()
    dist.destroy_process_group()
    # The parent has every result: skip the interpreter's teardown, about a second of CPU per
    # rank (10-18 s at the end of a loaded -n 2 run, for each worker's pools of 1-4 ranks).
    os._exit(0)


def errors_of(calls: dict[str, Callable[[], Any]]) -> dict[str, str | None]:
    """Run each call (on a rank); map its name to "ErrorType: message", or None if it did not
    raise ValueError/TypeError, so bad-input tests can assert on every rank's messages."""
    errors: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


@contextlib.contextmanager
def recorded_transfers() -> Iterator[list[tuple[int, tuple[str, ...]]]]:
    """Within it, every ring transfer (``RingComm.exchange``) this rank issues, recorded as
    (offset, dtypes of the tensors it sends) in a list it yields."""
    from ringflash.comm import RingComm

    trips, real = [], RingComm.exchange

    def recorded(self, send, recv, offset=1):
        trips.append((offset, tuple(str(t.dtype).removeprefix("torch.") for t in send)))
        return real(self, send, recv, offset)

    with mock.patch.object(RingComm, "exchange", recorded):
        yield trips


@contextlib.contextmanager
def forced_fused_backward() -> Iterator[None]:
    """Within it, ``ring_backward`` takes the fused schedule (sm_90's) on any device, the Triton
    kernels doing both parts; on leaving, asserts the ring asked for it exactly once."""
    from ringflash import ring

    with mock.patch.object(ring, "backward_is_fused", return_value=True) as fused:
        yield
    assert fused.call_count == 1


class RankPool:
    def __init__(self, world_size: int, backend: str) -> None:
        # Ranks fork from a server that has imported torch (what spawn would import in each, ~3 s
        # of CPU per rank: a worker's pools of 1-4 ranks started in 6 s instead of 15-29). The
        # server imports nothing that touches CUDA, so NCCL ranks still set up their own GPU.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "distributed"])
        self.world_size = world_size
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, backend, q, self._results), daemon=True)
            for r, q in enumerate(self._tasks)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results ordered by rank."""
        for q in self._tasks:
            q.put((fn, args))
        got: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(self.world_size):
                rank, ok, value = self._results.get(timeout=timeout)
                if ok:
                    got[rank] = value
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
        except queue.Empty:
            self.close(force=True)
            missing = sorted(set(range(self.world_size)) - set(got))
            raise TimeoutError(
                f"ranks {missing} did not finish {fn.__name__} within {timeout}s\n" + "\n".join(errors)
            ) from None
        if errors:
            # Ranks that raised may have left the others waiting in a collective: restart.
            self.close(force=True)
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [got[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()


class RankPools:
    """Session-wide cache: one live pool per world size, replaced if it was torn down."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        backend = pool_backend(world_size)
        if backend is None:
            pytest.skip(f"{world_size} ranks need {world_size} GPUs or the Triton interpreter")
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size, backend)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
