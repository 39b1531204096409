"""Replaying a function of fixed-shape CUDA tensors from CUDA graphs the library captures itself.

An eager sequence-parallel call issues tens of kernel launches and NCCL calls from Python: about
2 ms of host time per forward+backward on two ranks, which the device outruns below ~8K tokens
per rank (docs/experiments.md §69, §70). A cached setup runs the same kernels and transfers on
every call, so its forward and its backward can each be captured once and replayed: a call
copies its inputs into static buffers, replays, and copies the outputs out. The copies are what
makes it safe for layers that share a setup (and so its graphs): nothing a later replay
overwrites is handed to the caller. ``ReplayCache`` holds them by setup: the ring's
(``ring.REPLAYS``), the all-gather mode's (``allgather.REPLAYS``) and Ulysses' and the hybrid's
(``ulysses.REPLAYS``). The eager autograd Functions and the custom ops (what torch.compile and
dispatch modes such as selective checkpointing run) replay the same graphs.

``GraphReplay(fn)`` runs ``fn`` eagerly on its first call (which compiles the kernels and sets up
NCCL's communicator), captures it on its second and replays it from then on.

**No NCCL operation is captured.** A graph that holds one keeps its communicator from being
destroyed: ``destroy_process_group()`` waits for it forever (PyTorch issue #115388; measured
with whole-call graphs, docs/experiments.md §71). So the transfers go through ``host_call``:
inside a capture it ends the graph being captured, records the transfer, and starts the next
graph; a replay runs the graphs and, between them, the transfers from the host, in the order the
capture met them. The transfers of a captured call are issued only by its replay (none during the
capture), so every rank issues exactly one set of transfers per call whether it runs eagerly,
captures or replays: NCCL pairs point-to-point operations and collectives by their order, and
ranks in different states (one replaying, one eager after a cache miss) still pair.

On by default for dense setups (no packed documents, no block mask), which recur call after
call; ``RINGFLASH_RING_GRAPHS=1`` also replays packed documents and block masks (whose setups
change with every new ``cu_seqlens`` or mask), ``=0`` never replays. Not used while the caller
itself captures a graph (its capture records the eager call), for tensors off the current GPU,
or above ``MAX_REPLAY_BYTES`` per input (there the host is hidden behind the kernels and the
copies would cost more than they save). While the caller's allocations go to a private pool
(``allocations_routed``: torch.compile's cudagraph trees warming up) calls run eagerly, and a
later call captures. ``release_graphs()`` frees every graph's memory.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Larger inputs run eagerly: at 8K tokens per rank and above the host keeps ahead of the device.
MAX_REPLAY_BYTES = 32 << 20

_VARIABLE = "RINGFLASH_RING_GRAPHS"


def replay_mode() -> str:
    """``RINGFLASH_RING_GRAPHS``: "auto" (unset: dense setups), "1" (every setup) or "0" (none)."""
    value = os.environ.get(_VARIABLE, "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{_VARIABLE} must be 0, 1 or auto (unset), got {value!r}")
    return value


def replay_wanted(*tensors: torch.Tensor, dense: bool = True) -> bool:
    """Whether a call on ``tensors`` should go through ``GraphReplay``: replays on (``dense``: a
    setup without packed documents or a block mask, which "auto" replays), on the current GPU,
    not inside the caller's own capture, small enough. Any strides: a replay copies its inputs
    into contiguous static buffers (a model's q/k/v are often views, e.g. transposed from
    (batch, heads, seqlen, head_dim) by the Hugging Face integration)."""
    mode = replay_mode()
    if mode == "0" or (mode == "auto" and not dense):
        return False
    if not all(t.is_cuda for t in tensors):
        return False
    # A capture records the current device's stream: kernels for tensors on another device
    # would run once during the capture and never replay (stale outputs after).
    current = torch.cuda.current_device()
    if any(t.device.index != current for t in tensors):
        return False
    if max(t.numel() * t.element_size() for t in tensors) > MAX_REPLAY_BYTES:
        return False
    return not torch.cuda.is_current_stream_capturing()


_ACTIVE = threading.local()  # .capture: the _Capture running on this thread, if any


def host_call(fn: Callable[[], object]) -> object:
    """``fn()``: host work that no graph may capture (an NCCL operation). Inside a
    ``GraphReplay``'s capture ``fn`` does not run then: it runs at its place in every replay, and
    what this returns is a ``Deferred`` whose ``wait()`` (the one method a caller may use on it)
    takes its own place in the replays."""
    capture = getattr(_ACTIVE, "capture", None)
    return fn() if capture is None else capture.host_call(fn)


class Deferred:
    """What ``host_call`` returns inside a capture: the value ``fn()`` will have in a replay."""

    def __init__(self, capture: _Capture) -> None:
        # Weak: the capture's steps hold this, and a cycle would leave the capture's graphs to
        # Python's cyclic collector, which could destroy them in the middle of a later capture.
        self._capture = weakref.ref(capture)
        self.value: object = None

    def wait(self) -> None:
        self._capture().host_step(lambda: self.value.wait())


class _Capture:
    """A function captured as a sequence of graphs (sharing one memory pool) and host steps
    between them; ``steps`` replays it."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: list[Callable[[], object]] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread queries earlier work's events during the capture.
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        graph, self._graph = self._graph, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph.capture_end()
        empty = False
        for w in caught:  # a graph with no work (allocations only, or two host steps in a row)
            if "CUDA Graph is empty" in str(w.message):
                empty = True
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.graphs.append(graph)  # kept even empty: the pool lives only while its graphs do
        if not empty:
            self.steps.append(graph.replay)

    def host_step(self, step: Callable[[], object]) -> None:
        self.end()
        self.steps.append(step)
        self.begin()

    def host_call(self, fn: Callable[[], object]) -> Deferred:
        deferred = Deferred(self)

        def step() -> None:
            deferred.value = fn()

        self.host_step(step)
        return deferred


def capture(fn: Callable[..., tuple], inputs: list[torch.Tensor]) -> tuple[_Capture, tuple]:
    """(the capture of ``fn(*inputs)``, its outputs): nothing has run yet; replaying the capture's
    steps computes the outputs."""
    torch.cuda.synchronize()  # nothing of earlier calls in flight while the capture starts
    recording = _Capture()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), contextlib.ExitStack() as restore:
        # No cyclic garbage collection inside the capture: garbage holding another capture's graphs
        # would destroy them there (suspected in a capture that failed, docs/experiments.md §76).
        if gc.isenabled():
            gc.disable()
            restore.callback(gc.enable)
        recording.begin()
        _ACTIVE.capture = recording
        try:
            outputs = tuple(fn(*inputs))
        except BaseException:
            # The capture is invalid already: the first error is the one to see.
            with contextlib.suppress(Exception):
                recording.end()
            raise
        finally:
            _ACTIVE.capture = None
        recording.end()
    return recording, outputs


def allocations_routed(device: torch.device) -> bool:
    """Whether this thread's allocations on ``device`` go to a private memory pool: while
    torch.compile's cudagraph trees warm up (``mode="reduce-overhead"``) or under
    ``torch.cuda.use_mem_pool``. A capture there would leave its static buffers in that pool,
    which hands memory back to its owner's tensors while the graphs still use it; it waits for a
    call outside. Read from the allocator's snapshot, once per attempted capture."""
    probe = torch.empty(1, device=device)
    address = probe.data_ptr()
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:  # an allocator without snapshots (cudaMallocAsync) has no pools to route to
        return False
    for segment in segments:
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    return False


# Every GraphReplay holding a capture (autograd's saved contexts may hold one too).
_CAPTURED: weakref.WeakSet[GraphReplay] = weakref.WeakSet()


def release_graphs() -> None:
    """Destroys every graph the library captured and frees its buffers; a later call of the same
    setup runs eagerly, then captures again. The graphs hold no NCCL operation, so
    ``torch.distributed.destroy_process_group()`` does not need this first."""
    if not _CAPTURED:
        return
    torch.cuda.synchronize()  # no replay in flight when its graph goes
    for replay in list(_CAPTURED):
        replay.release()
    torch.cuda.synchronize()


atexit.register(release_graphs)


class GraphReplay:
    """``fn(*tensors) -> tuple of tensors`` on fixed shapes: eager on the first call, captured on
    the second, replayed after. The outputs are always fresh tensors (or None, not taken)."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        self._fn = fn
        self.calls = 0
        self.captured: _Capture | None = None
        self._inputs: list[torch.Tensor] = []
        self._outputs: tuple[torch.Tensor, ...] = ()

    def __call__(self, *inputs: torch.Tensor, take: tuple[int, ...] | None = None) -> tuple:
        """``fn(*inputs)``'s outputs, fresh tensors; ``take``: the indices of the outputs the caller
        uses (default all), the others None (not copied out) from the capturing call on."""
        self.calls += 1
        if self.calls == 1:
            return self._fn(*inputs)
        if self.captured is None:
            if allocations_routed(inputs[0].device):
                self.calls = 1  # eagerly again; a later call captures
                return self._fn(*inputs)
            try:
                self._capture(inputs)
            except Exception as error:
                # Not eagerly instead: a failed capture leaves torch's CUDA generators in capture
                # mode (the next torch.randn on the device raises), seen on an H200.
                self._inputs = []
                raise RuntimeError(
                    f"ringflash could not capture a sequence-parallel call in CUDA graphs "
                    f"({type(error).__name__}: {error}); set RINGFLASH_RING_GRAPHS=0 on every rank to run "
                    "it eagerly"
                ) from error
            _CAPTURED.add(self)
        else:  # one foreach call: a copy_ per tensor costs ~8 µs of host each (2×H200, §77)
            torch._foreach_copy_(self._inputs, inputs)
        for step in self.captured.steps:
            step()
        static = self._outputs if take is None else [self._outputs[i] for i in take]
        copies = [torch.empty_like(t) for t in static]
        torch._foreach_copy_(copies, static)  # fresh tensors: ~half of a clone's host time each
        if take is None:
            return tuple(copies)
        outputs: list = [None] * len(self._outputs)
        for i, t in zip(take, copies):
            outputs[i] = t
        return tuple(outputs)

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> None:
        # Plain tensors even when captured under inference mode: later calls outside it copy
        # into the static inputs, which an inference tensor would refuse.
        with torch.inference_mode(False):
            self._inputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]
            for static, t in zip(self._inputs, inputs):
                static.copy_(t)
            self.captured, self._outputs = capture(self._fn, self._inputs)

    def release(self) -> None:
        """Drops the graphs and their static buffers: the next call runs eagerly, the one after
        captures again."""
        self.captured = None
        self._inputs, self._outputs = [], ()
        self.calls = 0
        _CAPTURED.discard(self)


@dataclass(eq=False)
class Replays:
    """A setup's forward and backward as ``GraphReplay``s, shared by the calls (layers) that share
    the setup; ``setup`` and ``group`` are held so that their ids stay theirs."""

    setup: object
    group: object
    forward: GraphReplay
    backward: GraphReplay


def backward_replay(replays: Replays | None, dlse: torch.Tensor | None) -> GraphReplay | None:
    """The backward replay of an autograd Function whose forward took ``replays``, where it
    applies: not with an LSE gradient (sinks: the graph holds the backward without one), nor
    inside the caller's own capture (which records the eager backward)."""
    if replays is None or dlse is not None or torch.cuda.is_current_stream_capturing():
        return None
    return replays.backward


class ReplayCache:
    """``Replays`` by (setup, process group), the least recently used beyond ``limit`` dropped.
    Each entry holds static copies of its inputs and its graphs' memory pools (about half a GiB at
    4K tokens per rank, 32/8 heads, head_dim 128, for the ring); a model has one or a few
    attention shapes."""

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self.entries: OrderedDict[tuple[int, int], Replays] = OrderedDict()

    def get(self, setup: object, group: object, make: Callable[[], tuple[Callable, Callable]]) -> Replays:
        """The entry of (setup, group); a new one holds ``make()``'s (forward, backward)."""
        key = (id(setup), id(group))
        hit = self.entries.get(key)
        if hit is not None and hit.setup is setup and hit.group is group:
            self.entries.move_to_end(key)
            return hit
        forward, backward = make()
        hit = Replays(setup, group, GraphReplay(forward), GraphReplay(backward))
        self.entries[key] = hit
        self.entries.move_to_end(key)
        self.evict()
        return hit

    def evict(self) -> None:
        """Drops entries past ``limit``, the newest kept: the least recently used of those that
        never captured first. A setup that a setup cache cannot hold plans anew on every call, so
        its entries are never called twice; they must not push out the graphs of the setups that
        are."""
        while len(self.entries) > self.limit:
            older = list(self.entries.items())[:-1]
            idle = [k for k, r in older if r.forward.captured is None and r.backward.captured is None]
            if idle:
                del self.entries[idle[0]]
            else:
                self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()
