"""The ring's, the all-gather mode's and Ulysses' calls replayed from the graphs ringflash captures itself
(``graph_replay.py``, on by default for dense setups): when they replay, that the replay equals an
eager call on the same inputs, that layers sharing a setup (and so its graphs) get their own
results, and that no graph holds an NCCL operation (a group is destroyed with the graphs alive)."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
import weakref
from unittest import mock

import pytest
import torch
from dispatch_modes import PassThrough
from distributed import worker_device

import ringflash
from ringflash import allgather, graph_replay, ring, ulysses
from ringflash.graph_replay import MAX_REPLAY_BYTES, GraphReplay, ReplayCache, Replays, replay_wanted
from ringflash.kernels.tile_mask import TileMask
from ringflash.mesh import ulysses_ring_mesh

ON = {"RINGFLASH_RING_GRAPHS": "1"}
OFF = {"RINGFLASH_RING_GRAPHS": "0"}


def test_replay_by_default_for_dense_setups_on_gpu_tensors_of_bounded_size():
    cpu = torch.zeros(4)
    with mock.patch.dict(os.environ, ON):
        assert not replay_wanted(cpu)  # off the GPU
    with (
        mock.patch.dict(os.environ, {"RINGFLASH_RING_GRAPHS": "yes"}),
        pytest.raises(ValueError, match="0, 1"),
    ):
        replay_wanted(cpu)
    if torch.cuda.is_available():
        small, big = (
            torch.zeros(4, device="cuda"),
            torch.empty(MAX_REPLAY_BYTES + 4, dtype=torch.uint8, device="cuda"),
        )
        with mock.patch.dict(os.environ):
            os.environ.pop("RINGFLASH_RING_GRAPHS", None)
            assert replay_wanted(small)  # the default: dense setups replay
            assert not replay_wanted(small, dense=False)  # packed documents, block masks: opt in
        with mock.patch.dict(os.environ, OFF):
            assert not replay_wanted(small)
        with mock.patch.dict(os.environ, ON):
            assert replay_wanted(small) and replay_wanted(small, dense=False)
            assert not replay_wanted(big)
            assert replay_wanted(torch.zeros(4, 2, device="cuda").t())  # any strides: copied in


def test_no_replay_for_tensors_off_the_current_device():
    """A capture records the current device's stream only: tensors on another GPU run eagerly
    (their kernels would run once during the capture and never replay)."""
    on_gpu1 = mock.Mock(is_cuda=True, device=torch.device("cuda", 1), element_size=lambda: 2)
    on_gpu1.is_contiguous.return_value, on_gpu1.numel.return_value = True, 16
    capturing = mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=False)
    with mock.patch.dict(os.environ, ON), capturing:
        with mock.patch.object(torch.cuda, "current_device", return_value=1):
            assert replay_wanted(on_gpu1)
        with mock.patch.object(torch.cuda, "current_device", return_value=0):
            assert not replay_wanted(on_gpu1)


class _FakeGraph:
    """A CUDAGraph stand-in that logs captures into ``log`` (an empty capture warns as torch's)."""

    def __init__(self, log):
        self.log = log

    def capture_begin(self, pool, capture_error_mode):
        self.log.append("begin")
        self.start = len(self.log)

    def capture_end(self):
        work = [e for e in self.log[self.start :] if e.startswith("kernel")]
        self.log.append("end")
        if not work:
            warnings.warn("The CUDA Graph is empty. This usually means ...", UserWarning, stacklevel=1)
        self.work = work

    def replay(self):
        self.log.append(f"replay {self.work}")


def _fake_cuda(log):
    """torch.cuda's graph capture replaced by ``_FakeGraph``s logging into ``log`` (no GPU)."""
    return mock.patch.multiple(
        torch.cuda, CUDAGraph=lambda: _FakeGraph(log), graph_pool_handle=lambda: None,
        synchronize=lambda: None, Stream=lambda: None, stream=lambda s: mock.MagicMock(),
        memory_snapshot=lambda: [],
    )  # fmt: skip


def test_transfers_stay_out_of_the_graphs_and_run_at_their_place_in_each_replay():
    """Inside a capture ``host_call`` runs nothing: the graph ends, the transfer is recorded and the
    next graph begins; a replay runs graphs and transfers in the capture's order, each transfer
    once, and a graph that captured no work is left out."""
    log = []

    class Pending:
        def __init__(self, n):
            self.n = n

        def wait(self):
            log.append(f"wait {self.n}")

    def fn(x):
        pending = graph_replay.host_call(lambda: log.append("send 1") or Pending(1))  # before any kernel
        log.append("kernel a")
        pending.wait()
        log.append("kernel b")
        pending = graph_replay.host_call(lambda: log.append("send 2") or Pending(2))
        pending.wait()  # two host steps in a row: the graph between them is empty
        log.append("kernel c")
        return (x,)

    with _fake_cuda(log):
        recording, outputs = graph_replay.capture(fn, ["x"])
    assert outputs == ("x",)
    assert "send 1" not in log and "send 2" not in log  # nothing transferred during the capture
    assert getattr(graph_replay._ACTIVE, "capture", None) is None
    log.clear()
    for _ in range(2):
        for step in recording.steps:
            step()
    once = ["send 1", "replay ['kernel a']", "wait 1", "replay ['kernel b']", "send 2", "wait 2",
            "replay ['kernel c']"]  # fmt: skip
    assert log == once + once
    assert len(recording.graphs) == 5  # the empty ones kept: their pool must outlive the capture


def test_a_capture_is_freed_when_dropped_and_collects_no_garbage_inside():
    """A capture's host steps do not keep it alive in a reference cycle (its graphs would wait for
    Python's cyclic collector, which may run inside a later capture and destroy them there), and
    no cyclic collection runs during a capture."""
    import gc

    log, collecting = [], []

    def fn(x):
        collecting.append(gc.isenabled())
        graph_replay.host_call(lambda: None).wait()
        log.append("kernel")
        return (x,)

    with _fake_cuda(log):
        recording, _ = graph_replay.capture(fn, ["x"])
    assert collecting == [False] and gc.isenabled()
    alive = weakref.ref(recording)
    gc.disable()
    try:
        del recording
        assert alive() is None  # freed by its reference count, no collector needed
    finally:
        gc.enable()


def test_a_failed_capture_ends_the_capture_and_raises_the_first_error():
    log = []

    def fn(x):
        graph_replay.host_call(lambda: None)
        raise RuntimeError("inside the capture")

    with _fake_cuda(log), pytest.raises(RuntimeError, match="inside the capture"):
        graph_replay.capture(fn, ["x"])
    assert log[-1] == "end" and log.count("begin") == log.count("end")
    assert getattr(graph_replay._ACTIVE, "capture", None) is None


def test_a_call_that_cannot_be_captured_raises_naming_the_switch():
    """A capture that fails (here: the function raises only while captured, as a host sync
    would) raises a RuntimeError that says how to run eagerly, from the original error, having
    issued no transfer. Not eagerly instead: a failed capture leaves torch's CUDA generators in
    capture mode (on an H200 the next ``torch.randn`` on the device raised)."""
    log = []

    def fn(x):
        if getattr(graph_replay._ACTIVE, "capture", None) is not None:
            graph_replay.host_call(lambda: log.append("sent during the capture"))
            raise ValueError("operation not permitted when stream is capturing")
        return (x + 1,)

    replay = GraphReplay(fn)
    x = torch.zeros(3)
    with _fake_cuda(log):
        torch.testing.assert_close(replay(x)[0], x + 1)  # the first call: eager
        with pytest.raises(RuntimeError, match="RINGFLASH_RING_GRAPHS=0") as caught:
            replay(x)
    assert isinstance(caught.value.__cause__, ValueError)
    assert "sent during the capture" not in log
    assert replay.captured is None and replay not in graph_replay._CAPTURED


def test_host_call_outside_a_capture_runs_at_once():
    assert graph_replay.host_call(lambda: 7) == 7


@pytest.mark.gpu
def test_graph_replay_runs_captures_then_replays_fresh_outputs():
    calls = []

    def fn(x, y):
        calls.append(1)
        return x @ y, x + 1

    replay = GraphReplay(fn)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for _ in range(4):
        x, y = (torch.randn(64, 64, device="cuda", generator=g) for _ in range(2))
        results.append(((x, y), replay(x, y)))
    assert len(calls) == 2  # the eager call, then the capture; the last two replayed
    assert replay.captured is not None
    for (x, y), (prod, inc) in results:  # every result its own: later replays overwrote nothing
        torch.testing.assert_close(prod, x @ y)
        torch.testing.assert_close(inc, x + 1)


@pytest.mark.gpu
def test_no_capture_while_the_caller_allocates_to_a_pool_of_its_own():
    """Where the caller's thread allocates to a private pool (``torch.cuda.use_mem_pool``, as
    torch.compile's cudagraph trees do while they warm up), calls run eagerly: a capture would
    leave its buffers in a pool that hands them to other tensors. Outside it the next call
    captures."""
    replay = GraphReplay(lambda x: (x * 2,))
    pool = torch.cuda.MemPool()
    x = torch.randn(4096, device="cuda")
    assert not graph_replay.allocations_routed(x.device)
    with torch.cuda.use_mem_pool(pool):
        assert graph_replay.allocations_routed(x.device)
        for _ in range(3):
            (y,) = replay(x)
            torch.testing.assert_close(y, x * 2)
        assert replay.captured is None
        del y
    for _ in range(2):
        (y,) = replay(x)
        torch.testing.assert_close(y, x * 2)
    assert replay.captured is not None
    replay.release()


def test_an_allocator_without_snapshots_routes_nothing():
    """cudaMallocAsync's allocator refuses snapshots, and has no private pools to route to."""
    refuse = mock.Mock(side_effect=RuntimeError("snapshot is not supported by cudaMallocAsync"))
    with mock.patch.object(torch.cuda, "memory_snapshot", refuse):
        assert graph_replay.allocations_routed(torch.device("cpu")) is False
    refuse.assert_called_once()


def test_calls_stay_eager_while_allocations_are_routed():
    calls = []
    replay = GraphReplay(lambda x: calls.append(x) or (x,))
    with _fake_cuda([]), mock.patch.object(graph_replay, "allocations_routed", return_value=True):
        for _ in range(3):
            replay(torch.zeros(2))
    assert len(calls) == 3 and replay.captured is None


@pytest.mark.gpu
def test_a_replay_copies_out_only_the_outputs_taken():
    replay = GraphReplay(lambda x: (x + 1, x * 2, x - 3))
    # The eager call returns every output, whatever is taken; the capturing call then replays.
    assert all(t is not None for t in replay(torch.randn(8, device="cuda"), take=(2,)))
    for _ in range(2):
        y = torch.randn(8, device="cuda")
        first, second, third = replay(y, take=(0, 2))
        assert second is None
        torch.testing.assert_close(first, y + 1)
        torch.testing.assert_close(third, y - 3)
    assert replay.captured is not None


@pytest.mark.gpu
def test_graph_captured_under_inference_mode_replays_outside_it():
    """Evaluation first (inference mode), training after: the static inputs stay plain tensors."""
    replay = GraphReplay(lambda x: (x + 1,))
    with torch.inference_mode():
        for _ in range(2):  # eager, then captured
            replay(torch.randn(8, device="cuda"))
    y = torch.randn(8, device="cuda")
    (out,) = replay(y)
    torch.testing.assert_close(out, y + 1)


@pytest.mark.gpu
def test_released_graph_runs_eagerly_then_captures_again():
    calls = []

    def fn(x):
        calls.append(1)
        return (x * 2,)

    replay = GraphReplay(fn)
    for _ in range(3):
        replay(torch.randn(8, device="cuda"))
    assert replay.captured is not None and replay in graph_replay._CAPTURED and len(calls) == 2
    ringflash.release_graphs()
    assert replay.captured is None and replay not in graph_replay._CAPTURED
    for _ in range(3):  # eager, captured, replayed
        x = torch.randn(8, device="cuda")
        (out,) = replay(x)
        torch.testing.assert_close(out, x * 2)
    assert len(calls) == 4 and replay.captured is not None
    replay.release()


def test_release_without_graphs_touches_nothing():
    """``release_graphs`` runs at every interpreter exit: with nothing captured it must not
    initialize CUDA (a CPU-only process, or one whose device is gone)."""
    nothing = mock.patch.object(graph_replay, "_CAPTURED", weakref.WeakSet())
    touched = mock.patch.object(torch.cuda, "synchronize", side_effect=AssertionError("touched CUDA"))
    with nothing, touched:
        ringflash.release_graphs()


def _prefix_window(b, h, q, kv):
    """A block mask that is neither causal nor a window: a 128-token prefix seen by all, else a
    causal window of 300 keys."""
    return (kv < 128) | ((kv <= q) & (kv > q - 300))


def _variant_call(variant: str, total: int, dev: torch.device):
    """One ring call of ``variant`` over a full sequence of ``total`` tokens: the layouts, the
    options that change the plan's kernel calls (window, softcap, ALiBi, packed documents, a
    block mask) and sinks (whose LSE gradient sends the backward down the eager path)."""
    heads = 8
    if variant.endswith("_views"):  # q/k/v as the Hugging Face integration passes them: transposed views
        inner = _variant_call(variant.removesuffix("_views"), total, dev)
        views = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
        return lambda q, k, v: inner(views(q), views(k), views(v))
    if variant == "zigzag":
        return lambda q, k, v: ringflash.zigzag_ring_flash_attn_func(q, k, v, causal=True)
    if variant == "contiguous":
        return lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, causal=True)
    if variant == "stripe":
        return lambda q, k, v: ringflash.stripe_flash_attn_func(q, k, v, causal=True)
    if variant == "window_softcap":
        return lambda q, k, v: ringflash.zigzag_ring_flash_attn_func(
            q, k, v, causal=True, window_size=(200, 0), softcap=20.0
        )
    if variant == "alibi":
        slopes = torch.linspace(0.01, 0.3, heads, device=dev)
        return lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, alibi_slopes=slopes)
    if variant == "packed":
        cu = [0, total // 4, total]  # each document a multiple of 2 * world tokens
        return lambda q, k, v: ringflash.zigzag_ring_flash_attn_func(q, k, v, causal=True, cu_seqlens=cu)
    if variant == "sinks":
        sinks = torch.linspace(-1.0, 2.0, heads, device=dev)
        return lambda q, k, v: ringflash.zigzag_ring_flash_attn_func(q, k, v, causal=True, sinks=sinks)
    if variant == "block_mask":
        mask = TileMask.from_mask_mod(_prefix_window, 1, 1, total, total, device=dev)
        return lambda q, k, v: ringflash.zigzag_ring_flash_attn_func(q, k, v, block_mask=mask)
    gather = dict(sp_mode="allgather", causal=True)
    if variant == "allgather_zigzag":
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, **gather)
    if variant == "allgather_contiguous":
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, layout="contiguous", **gather)
    if variant == "allgather_strides":  # two K/V head strides: the double-buffered gathers
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, heads_k_stride=1, **gather)
    if variant == "allgather_packed":
        cu = [0, total // 4, total]
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, cu_seqlens=cu, **gather)
    if variant == "allgather_sinks":
        sinks = torch.linspace(-1.0, 2.0, heads, device=dev)
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, sinks=sinks, **gather)
    if variant == "ulysses_zigzag":
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="ulysses")
    if variant == "ulysses_contiguous":  # DeepSpeed-Ulysses' own entry
        return lambda q, k, v: ringflash.ulysses_attn_func(q, k, v, causal=True)
    if variant == "ulysses_alibi":
        slopes = torch.linspace(0.01, 0.3, heads, device=dev)
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, alibi_slopes=slopes, sp_mode="ulysses")
    if variant == "ulysses_packed":
        cu = [0, total // 4, total]
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="ulysses", cu_seqlens=cu)
    if variant == "ulysses_block_mask":
        mask = TileMask.from_mask_mod(_prefix_window, 1, 1, total, total, device=dev)
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, block_mask=mask, sp_mode="ulysses")
    if variant == "ulysses_sinks":
        sinks = torch.linspace(-1.0, 2.0, heads, device=dev)
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, causal=True, sinks=sinks, sp_mode="ulysses")
    if variant == "hybrid_ring":  # Ulysses groups of one: the ring inside the Ulysses engine
        return lambda q, k, v: ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="hybrid", ulysses_size=1)
    raise AssertionError(variant)


def _clear_replays() -> None:
    """The pool's ranks outlive a test: only this test's setups."""
    for mode in (ring, allgather, ulysses):
        mode.REPLAYS.clear()


def _replays() -> list[Replays]:
    return [r for mode in (ring, allgather, ulysses) for r in mode.REPLAYS.entries.values()]


def _layers_on_rank(seed: int, lengths: tuple[int, ...], variant: str = "zigzag", route: str = "function"):
    """Two layers of one setup, forward A, forward B, backward through both, over a few steps
    (new values each step, the shard's length taking ``lengths`` in turn), with the graphs and
    eagerly; returns the largest difference and which graphs exist per setup. ``route``: "op"
    runs the steps under a dispatch mode, so through the custom ops instead of the autograd
    Functions."""
    _clear_replays()
    dev = worker_device()
    world = torch.distributed.get_world_size()
    g = torch.Generator(device=dev).manual_seed(seed + 10 * torch.distributed.get_rank())
    calls = {n: _variant_call(variant, n * world, dev) for n in set(lengths)}

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16  # the interpreter's bf16 is wrong

    def mk(n, h):
        return torch.randn(1, n, h, 64, device=dev, dtype=dtype, generator=g)

    def step(n, xs):
        with PassThrough() if route == "op" else contextlib.nullcontext():
            return plain_step(n, xs)

    def plain_step(n, xs):
        leaves = [t.clone().requires_grad_() for t in xs[:6]]
        qa, ka, va, qb, kb, vb = leaves
        out_a = calls[n](qa, ka, va)
        out_b = calls[n](qb, kb, vb)
        torch.autograd.backward([out_a, out_b], [xs[6], xs[7]])
        return [out_a.detach(), out_b.detach()] + [t.grad for t in leaves]

    worst = 0.0
    for i in range(4 * len(lengths)):
        n = lengths[i % len(lengths)]
        xs = [mk(n, 8), mk(n, 2), mk(n, 2), mk(n, 8), mk(n, 2), mk(n, 2), mk(n, 8), mk(n, 8)]
        with mock.patch.dict(os.environ, ON):
            replayed = step(n, xs)
        with mock.patch.dict(os.environ, OFF):
            eager = step(n, xs)
        for a, b in zip(replayed, eager):
            assert torch.isfinite(a).all()
            worst = max(worst, ((a.float() - b.float()).abs().max() / b.float().abs().max()).item())
    graphs = [(r.forward.captured is not None, r.backward.captured is not None) for r in _replays()]
    return worst, graphs


@pytest.mark.multigpu
def test_ring_replays_equal_eager_calls_on_gpus(rank_pool):
    """Two ranks over NCCL: the zigzag ring's forward and backward, captured at the second call of
    their setup, give what eager calls give on the same inputs, for two layers that share the
    graphs (the dQ kernels add with atomics: not bit for bit)."""
    for worst, graphs in rank_pool(2).run(_layers_on_rank, 0, (512,)):
        assert worst < 2e-2
        assert graphs == [(True, True)]


@pytest.mark.multigpu
@pytest.mark.parametrize("variant", ["zigzag", "allgather_zigzag", "ulysses_zigzag"])
def test_replays_follow_alternating_shapes(rank_pool, variant):
    """Two shard lengths in turn: each its own setup and graphs, every call equal to eager."""
    for worst, graphs in rank_pool(2).run(_layers_on_rank, 1, (512, 768), variant):
        assert worst < 2e-2
        assert graphs == [(True, True), (True, True)]


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "variant",
    ["contiguous", "stripe", "window_softcap", "alibi", "packed", "block_mask", "sinks", "allgather_zigzag",
     "allgather_contiguous", "allgather_strides", "allgather_packed", "allgather_sinks", "ulysses_zigzag",
     "ulysses_contiguous", "ulysses_alibi", "ulysses_packed", "ulysses_block_mask", "ulysses_sinks",
     "hybrid_ring", "zigzag_views", "allgather_zigzag_views", "ulysses_zigzag_views"],
)  # fmt: skip
def test_replays_equal_eager_calls_in_every_variant(rank_pool, variant):
    """Each layout and each option that shapes the plan replays as its eager call runs, in the
    ring, the all-gather mode and Ulysses; with sinks the LSE's gradient takes the eager
    backward, so only the forward is captured."""
    for worst, graphs in rank_pool(2).run(_layers_on_rank, 2, (512,), variant):
        assert worst < 2e-2
        assert graphs == [(True, not variant.endswith("sinks"))]


@pytest.mark.multigpu
@pytest.mark.parametrize("variant", ["zigzag", "allgather_zigzag", "ulysses_zigzag", "hybrid_ring"])
def test_the_custom_ops_replay_the_same_graphs(rank_pool, variant):
    """Through the custom ops (what torch.compile and selective checkpointing run) the forward
    and the backward replay, each op finding its setup's graphs, and equal eager calls."""
    for worst, graphs in rank_pool(2).run(_layers_on_rank, 4, (512,), variant, "op"):
        assert worst < 2e-2
        assert graphs == [(True, True)]


def _captures_on_rank(variant: str, route: str):
    """Two steps on CPU ranks, with CUDA's graphs replaced by stand-ins (``_fake_cuda``) and
    replays wanted for CPU tensors: which of the setup's graphs were captured. The stand-ins
    compute nothing when replayed, and a capture defers its transfers, so the values are not
    looked at: this is the wiring, the GPU tests above are the values."""
    _clear_replays()
    world = torch.distributed.get_world_size()
    call = _variant_call(variant, 64 * world, torch.device("cpu"))
    wanted = lambda *tensors, dense=True: True  # noqa: E731
    patches = [mock.patch.object(m, "replay_wanted", wanted) for m in (ring, allgather, ulysses)]
    patches.append(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False))
    with _fake_cuda([]), contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        for _ in range(2):
            q, k, v, dout = (torch.randn(1, 64, 2, 16) for _ in range(4))
            q.requires_grad_()
            with PassThrough() if route == "op" else contextlib.nullcontext():
                out = call(q, k, v)
                out.backward(dout)
    return [(r.forward.captured is not None, r.backward.captured is not None) for r in _replays()]


@pytest.mark.parametrize("route", ["function", "op"])
@pytest.mark.parametrize("variant", ["zigzag", "allgather_zigzag", "ulysses_zigzag"])
def test_the_backward_finds_the_forwards_graphs_on_either_route(rank_pool, variant, route):
    """The backward of a call, through the autograd Function or the custom ops, uses the graphs of
    its forward's setup: by the second step both are captured. Without the ops' lookup of the
    forward's plan the backward op would never capture (Ulysses: a new plan per call)."""
    assert rank_pool(2).run(_captures_on_rank, variant, route) == [[(True, True)]] * 2


def _inference_on_rank(variant: str):
    """Ulysses without gradients (no_grad, and inputs that need none): replayed calls, which copy
    out only the output (and the LSE with sinks), against eager ones; the largest difference."""
    _clear_replays()
    dev = worker_device()
    world = torch.distributed.get_world_size()
    g = torch.Generator(device=dev).manual_seed(5 + torch.distributed.get_rank())
    call = _variant_call(variant, 512 * world, dev)
    worst = 0.0
    for i in range(4):
        q, k, v = (torch.randn(1, 512, h, 64, device=dev, generator=g).bfloat16() for h in (8, 2, 2))
        if i % 2:
            q.requires_grad_()
        with torch.no_grad():
            with mock.patch.dict(os.environ, ON):
                replayed = call(q, k, v)
            with mock.patch.dict(os.environ, OFF):
                eager = call(q, k, v)
        assert torch.isfinite(replayed).all()
        err = (replayed.float() - eager.float()).abs().max() / eager.float().abs().max()
        worst = max(worst, err.item())
    return worst, [r.forward.captured is not None for r in _replays()]


def _routes_on_rank(transposed: bool):
    """Four steps of a 4-block model whose attention is Ulysses over a group of one (which
    replays as any Ulysses setup does; ``transposed``: q/k/v are views, as a Hugging Face
    model hands them over), eagerly, compiled (the ops), compiled with
    reduce-overhead and under selective checkpointing (the ops under a dispatch mode), with the
    replays on, against eager steps with them off: {route: (largest relative difference of the
    losses and gradients, which graphs were captured)}."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(256, 256, bias=False) for _ in range(4))

        def forward(self, x):
            q, k, v = (f(x).view(1, -1, 4, 64) for f in (self.q, self.k, self.v))
            if transposed:  # made in (batch, heads, seqlen, head_dim), as a Hugging Face model's
                q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
            return x + self.o(ringflash.sp_attn_func(q, k, v, causal=True, sp_mode="ulysses").flatten(2))

    torch.manual_seed(0)
    model0 = nn.Sequential(*[Block() for _ in range(4)]).cuda().bfloat16()
    xs = [torch.randn(1, 1024, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def steps(route):
        _clear_replays()
        graph_replay.release_graphs()
        model = copy.deepcopy(model0)
        blocks = list(model)
        if route.startswith("compiled"):
            blocks = [
                torch.compile(b, mode="reduce-overhead" if route.endswith("overhead") else None)
                for b in blocks
            ]
        results = []
        for x in xs:
            if route.endswith("overhead"):
                torch.compiler.cudagraph_mark_step_begin()
            for b in blocks:
                if route == "checkpointed":
                    x = torch.utils.checkpoint.checkpoint(
                        b, x, use_reentrant=False, context_fn=ringflash.attention_checkpoint_context
                    )
                else:
                    x = b(x)
            loss = x.float().pow(2).mean()
            loss.backward()
            results.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        graphs = [(r.forward.captured is not None, r.backward.captured is not None) for r in _replays()]
        return results, graphs

    with mock.patch.dict(os.environ, OFF):
        want, _ = steps("eager")
    found = {}
    with mock.patch.dict(os.environ, ON):
        for route in ("eager", "compiled", "compiled, reduce-overhead", "checkpointed"):
            got, graphs = steps(route)
            worst = 0.0
            for a, b in ((a, b) for ga, gb in zip(got, want) for a, b in zip(ga, gb)):
                assert torch.isfinite(a).all()
                worst = max(worst, ((a.float() - b.float()).abs().max() / b.float().abs().max()).item())
            found[route] = (worst, graphs)
    torch._dynamo.reset()  # reduce-overhead's graphs: none may outlive the group (PyTorch #115388)
    _clear_replays()
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_replays_in_compiled_and_checkpointed_steps(rank_pool, transposed):
    """The ops replay where the Functions do: compiled (default mode) and under selective
    checkpointing both capture the forward and the backward, whose results are those of steps
    without replays; under reduce-overhead nothing is captured (its warm-up routes allocations to
    its pool, then it captures the step itself)."""
    (found,) = rank_pool(1).run(_routes_on_rank, transposed, timeout=300)
    graphs = {route: g for route, (_, g) in found.items()}
    assert graphs == {"eager": [(True, True)], "compiled": [(True, True)], "checkpointed": [(True, True)],
                      "compiled, reduce-overhead": [(False, False)]}  # fmt: skip
    # The dQ kernels add with atomics: equal up to the order of those additions (0 in the runs
    # seen), and Inductor's fusions round differently.
    assert all(worst < 2e-2 for worst, _ in found.values())


@pytest.mark.multigpu
@pytest.mark.parametrize("variant", ["ulysses_zigzag", "ulysses_sinks"])
def test_ulysses_inference_replays_equal_eager_calls(rank_pool, variant):
    for worst, captured in rank_pool(2).run(_inference_on_rank, variant):
        assert worst < 2e-2
        assert captured == [True]


def _destroy_with_graphs_alive_on_rank():
    """The ring, the all-gather mode and Ulysses replayed over a group of their own, then the group
    destroyed with the graphs still held: NCCL's shutdown would wait forever for a graph that
    captured one of its operations (PyTorch #115388, what whole-call graphs did), so this also
    shows that none did."""
    dev = worker_device()
    group = torch.distributed.new_group([0, 1])
    q, k, v = (torch.randn(1, 512, 2, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):  # eager, captured, replayed: the default
        ringflash.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)
    for _ in range(3):
        ringflash.sp_attn_func(q, k, v, causal=True, group=group, sp_mode="allgather")
    for _ in range(3):
        ringflash.sp_attn_func(q, k, v, causal=True, group=group, sp_mode="ulysses")
    # Ulysses' all-to-alls run over the Ulysses group of the group's mesh (the same ranks).
    mesh = ulysses_ring_mesh(group, 2)
    groups = {id(g): g for g in (group, mesh.ulysses_group, mesh.ring_group)}
    captured = [any(id(r.group) in groups and r.forward.captured is not None for r in c.entries.values())
                for c in (ring.REPLAYS, allgather.REPLAYS, ulysses.REPLAYS)]  # fmt: skip
    for g in groups.values():
        torch.distributed.destroy_process_group(g)
    _clear_replays()  # no entry keeps the destroyed groups
    return captured


@pytest.mark.multigpu
def test_group_destroyed_with_the_graphs_alive(rank_pool):
    assert rank_pool(2).run(_destroy_with_graphs_alive_on_rank, timeout=120) == [[True, True, True]] * 2


def _mixed_states_on_rank(seed: int, mode: str):
    """Rank 0 never replays, rank 1 replays: each issues one set of transfers per call either way,
    so the two pair, and both get what eager calls give."""
    _clear_replays()
    dev = worker_device()
    rank = torch.distributed.get_rank()
    g = torch.Generator(device=dev).manual_seed(seed + rank)
    worst = 0.0
    for _ in range(4):
        q, k, v, dout = (
            torch.randn(1, 512, h, 64, device=dev, dtype=torch.bfloat16, generator=g) for h in (8, 2, 2, 8)
        )
        results = []
        for env in (ON if rank == 1 else OFF, OFF):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with mock.patch.dict(os.environ, env):
                out = ringflash.sp_attn_func(*leaves, causal=True, sp_mode=mode)
                out.backward(dout)
            results.append([out.detach()] + [t.grad for t in leaves])
        for a, b in zip(*results):
            assert torch.isfinite(a).all()
            worst = max(worst, ((a.float() - b.float()).abs().max() / b.float().abs().max()).item())
    return worst, any(r.forward.captured is not None for r in _replays())


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses"])
def test_a_replaying_rank_pairs_with_an_eager_one(rank_pool, mode):
    (worst0, captured0), (worst1, captured1) = rank_pool(2).run(_mixed_states_on_rank, 3, mode)
    assert worst0 < 2e-2 and worst1 < 2e-2
    assert not captured0 and captured1


def test_replay_cache_hits_by_setup_and_group():
    """The same (setup, group) finds its entry without making new functions; another setup or
    group gets its own."""
    cache = ReplayCache()
    made = []

    def make():
        made.append(1)
        return (lambda: (), lambda: ())

    setup, other, group = object(), object(), object()
    first = cache.get(setup, group, make)
    assert cache.get(setup, group, make) is first and len(made) == 1
    assert cache.get(other, group, make) is not first
    assert cache.get(setup, object(), make) is not first
    assert len(made) == 3 and isinstance(first.forward, GraphReplay)


def test_setups_called_once_do_not_evict_captured_graphs():
    """Entries past the limit go least recently used first, but those that never captured (a
    setup planned anew on every call) before any that did; the entry just made always stays."""
    cache = ReplayCache(limit=4)
    group = object()
    setups = [object() for _ in range(10)]

    def make():
        return (lambda: (), lambda: ())

    def entries():
        return [setups.index(r.setup) for r in cache.entries.values()]

    for i in range(3):
        cache.get(setups[i], group, make).forward.captured = object()
    for i in range(3, 9):  # six setups called once, one after another
        cache.get(setups[i], group, make)
        assert entries() == [0, 1, 2, i]  # each pushes out the one before it, no graph
    cache.limit = 3
    cache.entries.popitem()  # setup 8's
    cache.get(setups[9], group, make)  # only captured ones left behind the new entry: LRU goes
    assert entries() == [1, 2, 9]


def test_only_dense_plans_replay_by_default(device):
    """What ``RINGFLASH_RING_GRAPHS`` unset replays: plans without packed documents or a block
    mask (those are rebuilt, and would be captured, whenever the documents or the mask change)."""
    from ringflash.block_masks import dense_calls, ring_step_masks

    q = torch.zeros(1, 256, 2, 16, device=device)
    base = ringflash.kernels.build_problem(q, q, q, None, True, (-1, -1))
    comm = ring.RingComm.known(None, 0, 2)
    dense = ring.ring_plan(base, "zigzag", comm, (512,), False, q.device)
    packed = ring.ring_plan(base, "zigzag", comm, (128, 384), True, q.device)
    mask = TileMask.from_mask_mod(_prefix_window, 1, 1, 512, 512, device=device)
    masked = ring.block_sparse_ring_plan(base, ring_step_masks(mask, "zigzag", 0, 2))
    assert dense_calls(dense)
    assert not dense_calls(packed) and not dense_calls(masked)
    gathered = [
        allgather.gather_plan(allgather.layout_calls(base, "zigzag", 0, 2, lens, varlen, q.device), 2, 2, 256,
                              allgather.natural_order("zigzag", 2, 512, bounds, q.device))
        for lens, varlen, bounds in (((512,), False, None), ((128, 384), True, (0, 128, 512)))
    ]  # fmt: skip
    assert dense_calls(gathered[0].steps) and not dense_calls(gathered[1].steps)


def test_backward_replays_only_without_an_lse_gradient_and_outside_a_capture():
    """The autograd Functions' backward: the forward's replays unless the LSE has a gradient
    (sinks: the graph holds the backward without one) or the caller itself is capturing."""
    replays = Replays(None, None, GraphReplay(lambda: ()), GraphReplay(lambda: ()))
    assert graph_replay.backward_replay(None, None) is None
    assert graph_replay.backward_replay(replays, torch.zeros(1)) is None
    for capturing in (False, True):
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=capturing):
            assert graph_replay.backward_replay(replays, None) is (None if capturing else replays.backward)
