"""Ring attention over several gloo ranks against float64 attention over the full sequence."""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from distributed import errors_of, forced_fused_backward, recorded_transfers, worker_device
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err
from sm90 import SM90

import ringflash
from ringflash import ring
from ringflash.layouts import layout_indices


@dataclass(frozen=True)
class Case:
    world: int
    layout: str | ringflash.ChunkLayout
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    batch: int = 1
    seqlen: int = 48
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    seed: int = 0
    docs: tuple[int, ...] | None = None  # packed documents' lengths (batch 1, seqlen = their sum)
    fused: bool = False  # ring_backward's fused schedule, with the Triton kernels doing both parts

    @property
    def cu_seqlens(self) -> list[int] | None:
        return None if self.docs is None else [0, *itertools.accumulate(self.docs)]


def packed(world: int, layout: str, docs: tuple[int, ...], **kw) -> Case:
    return Case(world, layout, seqlen=sum(docs), docs=docs, **kw)


def _full_inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    shape_q = (case.batch, case.seqlen, case.heads, case.head_dim)
    shape_kv = (case.batch, case.seqlen, case.kv_heads, case.head_dim)
    q = torch.randn(shape_q, generator=g).to(case.dtype)
    k = torch.randn(shape_kv, generator=g).to(case.dtype)
    v = torch.randn(shape_kv, generator=g).to(case.dtype)
    dout = torch.randn(shape_q, generator=g).to(case.dtype)
    return q, k, v, dout


def _run_ring(case: Case):
    """On every rank: shard the full inputs, ring forward + backward, return local results."""
    full = [t.to(worker_device()) for t in _full_inputs(case)]
    cu = case.cu_seqlens
    q, k, v, dout = (ringflash.shard_sequence(t, layout=case.layout, cu_seqlens=cu) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringflash.ring_flash_attn_func(
        q, k, v, causal=case.causal, window_size=case.window, layout=case.layout, return_lse=True,
        cu_seqlens=cu,
    )  # fmt: skip
    with forced_fused_backward() if case.fused else nullcontext():
        out.backward(dout)
    return tuple(t.detach().cpu() for t in (out, lse, q.grad, k.grad, v.grad))


def _assemble(parts, case: Case, dim: int):
    shape = list(parts[0].shape)
    shape[dim] = case.seqlen
    full = torch.empty(shape, dtype=parts[0].dtype)
    for r, p in enumerate(parts):
        full.index_copy_(dim, layout_indices(case.layout, r, case.world, case.seqlen, 1, case.cu_seqlens), p)
    return full


def _reference(case: Case, q, k, v):
    """Float64 attention over the full sequence, or over each packed document on its own."""
    if case.docs is None:
        return reference_attention(q, k, v, causal=case.causal, window_size=case.window)
    return reference_attention_packed(q, k, v, case.cu_seqlens, causal=case.causal, window_size=case.window)


def _run_ring_fused(case: Case):
    """``_run_ring`` where every rank must pick the fused backward on its own (sm_90 GPUs)."""
    picked = []

    def spy(*args):
        picked.append(real(*args))
        return picked[-1]

    real = ring.backward_is_fused
    with mock.patch.object(ring, "backward_is_fused", spy):
        results = _run_ring(case)
    assert picked == [True], picked
    return results


def _run_ring_single(case: Case):
    """``_run_ring`` where forward and backward must each take the plan's one call in place."""
    found = []

    def spy(*args):
        call = real(*args)
        found.append(call is not None)
        return call

    real = ring._single_call
    with mock.patch.object(ring, "_single_call", spy):
        results = _run_ring(case)
    assert found == [True, True], found
    return results


def check_ring(rank_pool, case: Case, run=_run_ring) -> None:
    check_results(case, rank_pool(case.world).run(run, case))


def check_results(case: Case, results: list[tuple[torch.Tensor, ...]]) -> None:
    """Every rank's (out, lse, dq, dk, dv) put in place against float64 over the whole sequence."""
    q, k, v, dout = (t.double().requires_grad_() for t in _full_inputs(case))
    ref_out, ref_lse = _reference(case, q, k, v)
    ref_out.backward(dout)
    names = ("out", "lse", "dq", "dk", "dv")
    expected = (ref_out, ref_lse, q.grad, k.grad, v.grad)
    tol = TOLERANCE[case.dtype]
    for i, (name, exp) in enumerate(zip(names, expected)):
        dim = 2 if name == "lse" else 1
        got = _assemble([r[i] for r in results], case, dim)
        assert got.dtype == (torch.float32 if name == "lse" else case.dtype), name
        err = rel_err(got, exp)
        assert err < tol, f"{case}: {name} rel err {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_matches_full_attention(rank_pool, world, layout, causal):
    check_ring(rank_pool, Case(world, layout, causal))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize(("causal", "window"), [(True, (5, -1)), (False, (7, 3)), (True, (20, 0))])
def test_ring_sliding_window(rank_pool, layout, causal, window):
    check_ring(rank_pool, Case(4, layout, causal, window))


# Chunks dealt out of order (what balanced_layout makes): 6 chunks of 8 over 3 ranks, a window
# and packed documents (each document cut into 6 chunks on its own).
SHUFFLED = ringflash.ChunkLayout(((4, 0), (2, 5), (1, 3)))


@pytest.mark.parametrize(
    "case",
    [Case(3, SHUFFLED, True), Case(3, SHUFFLED, True, (9, 2)), packed(3, SHUFFLED, (12, 30, 6), causal=True)],
    ids=["causal", "window", "packed"],
)
def test_ring_chunk_layout(rank_pool, case):
    check_ring(rank_pool, case)


def test_first_step_is_one_causal_call_where_the_shard_keeps_global_order():
    """Causal attention within a shard whose chunks keep their global order is causal attention
    in local positions: zigzag's first step is one call over the whole shard, not three. A
    window or ALiBi (distances), packed documents, or chunks out of order keep their tasks (the
    ring tests above check both kinds against float64)."""
    from ringflash.kernels import MaskBounds
    from ringflash.schedule import ring_schedule

    causal = MaskBounds(None, 0)
    for world in (1, 2, 3, 4):
        for rank in range(world):
            (task,) = ring_schedule("zigzag", rank, world, (48,), causal, False).steps[0]
            n = 48 // world
            assert (task.q_start, task.q_len, task.k_start, task.k_len, task.masked) == (0, n, 0, n, True)
    kept = {
        "window": ring_schedule("zigzag", 0, 2, (48,), MaskBounds(5, 0), False),
        "alibi": ring_schedule("zigzag", 0, 2, (48,), causal, False, True),
        "packed": ring_schedule("zigzag", 0, 2, (24, 24), causal, True),
        "out of order": ring_schedule(SHUFFLED, 0, 3, (48,), causal, False),
    }
    for name, schedule in kept.items():
        assert len(schedule.steps[0]) > 1, name
    assert len(ring_schedule(SHUFFLED, 1, 3, (48,), causal, False).steps[0]) == 1  # chunks 2, 5


def test_chunk_layout_checks():
    """Zigzag as a ChunkLayout gives zigzag's indices (also per Ulysses piece and per packed
    document); malformed chunk lists, and a ChunkLayout where a compiled op needs a name, raise."""
    from ringflash.layouts import layout_name

    zigzag = ringflash.ChunkLayout(((0, 3), (1, 2)))
    for r in range(2):
        assert torch.equal(layout_indices(zigzag, r, 2, 16), layout_indices("zigzag", r, 2, 16))
        assert torch.equal(layout_indices(zigzag, r, 2, 16, 1, [0, 8, 16]),
                           layout_indices("zigzag", r, 2, 16, 1, [0, 8, 16]))  # fmt: skip
    assert torch.equal(layout_indices(zigzag, 3, 4, 32, 2), layout_indices("zigzag", 3, 4, 32, 2))
    for bad in (((0, 1), (1, 2)), ((0,), (1, 2)), [(0,), (1,)], ((0, True),)):
        with pytest.raises(ValueError, match="ChunkLayout.chunks"):
            ringflash.ChunkLayout(bad)
    with pytest.raises(ValueError, match="for 2 ring ranks, the ring has 3"):
        layout_indices(zigzag, 0, 3, 24)
    with pytest.raises(NotImplementedError, match="under torch.compile"):
        layout_name(zigzag)


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
def test_ring_gqa_batch_fp16(rank_pool, kv_heads, layout):
    check_ring(
        rank_pool, Case(2, layout, True, batch=2, heads=4, kv_heads=kv_heads, dtype=torch.float16, seed=3)
    )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_fused_backward_schedule(rank_pool, world, layout, causal):
    """The schedule that fused kernels get (on sm_90), run here with the Triton kernels: dK/dV
    into scratch, added to the arriving accumulator (on two ranks the scratch travels home
    itself); the owner's part kept to the end (on GPUs: test_ring_fused_backward_on_gpus)."""
    check_ring(rank_pool, Case(world, layout, causal, fused=True, seed=world))


def _run_ring_recording_trips(case: Case):
    """``_run_ring`` (``case.fused``), and each transfer's (offset, dtypes of what it sends)."""
    with recorded_transfers() as trips:
        return _run_ring(case), trips


@pytest.mark.parametrize(
    "world, window", [(2, (-1, -1)), (3, (10, 0))], ids=["two-ranks", "three-ranks-window-needs-one-step"]
)
def test_fused_ring_of_two_steps_sends_its_scratch_home(rank_pool, world, window):
    """A fused backward over two ring steps (two ranks; three whose window of 10 reaches only
    the rank before, so the plan stops after step 1) sends the visiting shard's dK/dV home in
    the inputs' dtype, fp16, not as a float32 accumulator; the gradients equal float64's."""
    case = Case(world, "contiguous", window=window, seqlen=48, dtype=torch.float16, fused=True, seed=7)
    runs = rank_pool(world).run(_run_ring_recording_trips, case)
    for _, trips in runs:  # forward K/V, backward K/V, then the scratch home
        assert trips == [(1, ("float16", "float16"))] * 2 + [(-1, ("float16", "float16"))], trips
    check_results(case, [r for r, _ in runs])


def test_ring_fused_backward_schedule_gqa_fp16(rank_pool):
    check_ring(
        rank_pool, Case(4, "zigzag", True, batch=2, heads=4, kv_heads=1, dtype=torch.float16, fused=True)
    )


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_packed_documents(rank_pool, world, layout, causal):
    """Packed documents: attention stays inside each one; lengths vary from 1 to 4 chunks."""
    m = 2 * world if layout == "zigzag" else world
    check_ring(rank_pool, packed(world, layout, (3 * m, m, 4 * m, 2 * m), causal=causal, seed=world))


# Each layout once, each window kind at least once (the interpreter makes these the slowest cases).
@pytest.mark.parametrize(
    ("layout", "causal", "window"),
    [("zigzag", True, (5, -1)), ("stripe", True, (5, -1)), ("contiguous", False, (6, 2))],
)
def test_ring_packed_sliding_window_gqa_fp16(rank_pool, layout, causal, window):
    case = packed(4, layout, (16, 8, 40), causal=causal, window=window, heads=4, kv_heads=2,
                  dtype=torch.float16, seed=9)  # fmt: skip
    check_ring(rank_pool, case)


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["zigzag", "stripe", "contiguous"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_bf16_real_size_on_gpus(rank_pool, layout, world):
    case = Case(world, layout, True, seqlen=4096, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    check_ring(rank_pool, case)


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_of_one_rank_writes_in_place_on_one_gpu(rank_pool, layout, causal):
    """One rank on an H100/H200: the ring never moves, so its one call writes out, LSE and the
    gradients in place (``ring._single_call``), no float32 accumulators, and they equal float64."""
    case = Case(1, layout, causal, seqlen=1024, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    check_ring(rank_pool, case, run=_run_ring_single)


@pytest.mark.multigpu
@SM90
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_fused_backward_on_gpus(rank_pool, layout, causal):
    """Two ranks on H100/H200s: the fused kernels on the ring's slices (zigzag's own step is
    three calls on two chunks), dK/dV through the owner's pair and the travelling accumulator."""
    case = Case(2, layout, causal, seqlen=2048, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    check_ring(rank_pool, case, run=_run_ring_fused)


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
def test_ring_packed_bf16_real_size_on_gpus(rank_pool, layout):
    case = packed(2, layout, (1024, 2048, 512, 512), heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    check_ring(rank_pool, case)


def test_ring_head_dim_not_power_of_two(rank_pool):
    check_ring(rank_pool, Case(3, "zigzag", True, seqlen=36, head_dim=40, seed=5))


def _round_trip(layout: str, total: int):
    x = torch.arange(2 * total * 3, dtype=torch.float32, device=worker_device()).reshape(2, total, 3)
    shard = ringflash.shard_sequence(x, layout=layout)
    back = ringflash.gather_sequence(shard, layout=layout)
    return shard.cpu(), torch.equal(back, x)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
def test_shard_gather_round_trip(rank_pool, layout):
    results = rank_pool(4).run(_round_trip, layout, 16)
    assert all(ok for _, ok in results)
    shards = [s for s, _ in results]
    assert all(s.shape == (2, 4, 3) for s in shards)
    seen = torch.cat([s[0, :, 0] for s in shards]).sort().values
    assert torch.equal(seen, torch.arange(0, 48, 3, dtype=torch.float32))  # each token exactly once


def test_zigzag_indices_balance():
    idx = [ringflash.zigzag_indices(r, 4, 16) for r in range(4)]
    assert idx[0].tolist() == [0, 1, 14, 15]
    assert idx[3].tolist() == [6, 7, 8, 9]
    # Causal work (keys at or before each query) is the same on every rank.
    work = [int((i + 1).sum()) for i in idx]
    assert len(set(work)) == 1


@pytest.mark.parametrize("layout", ringflash.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_first_step_writes_the_accumulator_where_it_reaches_every_row(layout, causal):
    """ring_forward skips the accumulator's fill where the first step's calls reach every query
    row, the first call over some rows writing them and later ones merging: true of every
    layout's plan, so the ring tests above run that path. A first step that misses rows or
    half-overlaps earlier calls takes the fill."""
    q = torch.zeros(1, 16, 2, 8, device=worker_device())
    base = ringflash.kernels.build_problem(q, q, q, None, causal, (-1, -1))
    for rank in range(4):
        plan = ring.ring_plan(base, layout, ring.RingComm.known(None, rank, 4), (64,), False, q.device)
        first = ring._first_writes(plan[0], 16)
        assert first is not None and first[0], (layout, rank)
    call = plan[0][0]
    rows = lambda a, b: ring.replace(call, q_slice=slice(a, b))  # noqa: E731
    assert ring._first_writes((rows(0, 8), rows(8, 16), rows(8, 16)), 16) == (True, True, False)
    assert ring._first_writes((rows(0, 8),), 16) is None  # rows 8-15 missed
    assert ring._first_writes((rows(0, 8), rows(4, 16)), 16) is None  # half over rows 0-7


def _bad_calls():
    q = torch.randn(1, 6, 2, 16, device=worker_device())
    errors = errors_of(
        {
            "layout": lambda: ringflash.ring_flash_attn_func(q, q, q, layout="spiral"),
            "odd": lambda: ringflash.ring_flash_attn_func(q[:, :5], q[:, :5], q[:, :5], layout="zigzag"),
            "lengths": lambda: ringflash.ring_flash_attn_func(q, q[:, :4], q[:, :4]),
            "shard": lambda: ringflash.shard_sequence(torch.randn(1, 10, 2), layout="zigzag"),
            "group": lambda: ringflash.ring_flash_attn_func(q, q, q, group="world"),
        }
    )
    dist.barrier()
    return errors


def test_ring_bad_inputs(rank_pool):
    errors = rank_pool(2).run(_bad_calls)[0]
    assert "layout must be one of" in errors["layout"]
    assert "multiple of 4 (pad to 12)" in errors["odd"]
    assert "same local length" in errors["lengths"]
    assert "multiple of 4 (pad to 12)" in errors["shard"]
    assert errors["group"].startswith("TypeError: group must be")


def test_ring_without_process_group_says_so(device):
    q = torch.randn(1, 4, 2, 16, device=device)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ringflash.ring_flash_attn_func(q, q, q)
