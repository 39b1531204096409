"""A block-sparse mask across the sequence-parallel group (ringflash/block_masks.py): each rank's
views of one global mask (``TileMask.take``, ``select_heads``), and ring, Ulysses and hybrid
attention under it on gloo ranks against float64 attention over the whole sequence with the same
mask as a dense tensor: out, LSE, dq, dk, dv.

The mask has, per head and sequence, blocks nobody sees, full and partial blocks, rows that see
nothing, and (on two ranks) a whole ring step with nothing visible, which the plan drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from distributed import errors_of, forced_fused_backward, recorded_transfers, worker_device
from reference import TOLERANCE, reference_attention, rel_err
from sm90 import SM90

import ringflash
from ringflash.block_masks import ring_step_masks
from ringflash.kernels.tile_mask import TileMask
from ringflash.layouts import layout_indices
from ringflash.ring import SETUPS

SEQLEN = 512  # 4 blocks of 128: zigzag over 2 ring ranks gives each rank two whole blocks


def banded(b, h, q, kv):
    """Per head and sequence: a causal band of 200 + 60 h keys, key block 3 hidden from query
    block 2 (partial blocks, invisible ones), every query sees keys 0-31 (partial), sequence 1's
    queries 0-4 see nothing."""
    band = (kv <= q) & (kv > q - 200 - 60 * h)
    hidden = (q >= 256) & (q < 384) & (kv >= 384)
    blind = (b == 1) & (q < 5)
    return (band & ~hidden | (kv < 32)) & ~blind


def upper_half_only(b, h, q, kv):
    """Queries see keys of their own half of 512: with contiguous shards of 128 on three ranks
    (384 tokens), rank 0 needs rank 1's keys and not rank 2's, so its ring step 1 is empty."""
    return (q < 256) == (kv < 256)


def prefix_lm(b, h, q, kv):
    """A prefix of 200 tokens seen by every query, causal after it: contiguous shards leave the
    last rank with most of the work."""
    return (kv <= q) | (kv < 200)


def dense(mask_mod, batch: int, heads: int, seqlen: int = SEQLEN) -> torch.Tensor:
    idx = [torch.arange(n) for n in (batch, heads, seqlen, seqlen)]
    b, h, q, kv = torch.meshgrid(*idx, indexing="ij")
    return mask_mod(b, h, q, kv)


def decoded(mask: TileMask) -> torch.Tensor:
    """(Bm, Hm, seqlen_q, seqlen_k) bool of what ``mask`` leaves visible, from its grid and bits."""
    grid = mask.grid()
    bm, hm, nq, nk = grid.shape
    out = torch.zeros(bm, hm, nq * mask.block_q, nk * mask.block_k, dtype=torch.bool)
    bits = (mask.bits[..., None] >> torch.arange(32)) & 1  # (P, bq, words, 32)
    bits = bits.flatten(-2).bool()
    for b, h, i, j in (grid > -2).nonzero().tolist():
        kind = int(grid[b, h, i, j])
        block = torch.ones(mask.block_q, mask.block_k, dtype=torch.bool) if kind == -1 else bits[kind]
        out[b, h, i * mask.block_q : (i + 1) * mask.block_q, j * mask.block_k : (j + 1) * mask.block_k] = (
            block
        )
    return out[..., : mask.seqlen_q, : mask.seqlen_k]


def test_take_and_select_heads_are_the_dense_mask_sliced():
    full = dense(banded, 2, 3)
    mask = TileMask.from_dense(full)
    q_blocks, k_blocks = torch.tensor([3, 0]), torch.tensor([2, 3, 1])
    rows = torch.cat([torch.arange(128 * i, 128 * i + 128) for i in q_blocks.tolist()])
    cols = torch.cat([torch.arange(128 * j, 128 * j + 128) for j in k_blocks.tolist()])
    view = mask.take(q_blocks, k_blocks)
    assert (view.seqlen_q, view.seqlen_k) == (256, 384)
    assert torch.equal(decoded(view), full[:, :, rows][:, :, :, cols])
    heads = mask.select_heads(1, 3)
    assert torch.equal(decoded(heads), full[:, 1:3])
    assert decoded(mask.take(torch.tensor([2]), torch.tensor([3]))).sum() == 0  # the hidden block
    shared = TileMask.from_dense(full[:1, :1])
    assert shared.select_heads(0, 1) is shared


def test_step_views_follow_the_layout():
    mask = TileMask.from_dense(dense(upper_half_only, 1, 1))
    steps = ring_step_masks(mask, "contiguous", 0, 2)
    assert len(steps) == 1 and steps[0] is not None  # neither rank needs the other's keys: no step 1
    zig = ring_step_masks(mask, "zigzag", 1, 2)  # rank 1 holds blocks 1 and 2: both steps see something
    assert all(s is not None for s in zig)
    assert torch.equal(decoded(zig[0])[0, 0], dense(upper_half_only, 1, 1)[0, 0][128:384, 128:384])
    with pytest.raises(ValueError, match="whole blocks of the mask"):
        ring_step_masks(mask, "stripe", 0, 2)


def chunked(b, h, q, kv):
    """Causal attention inside chunks of 256 tokens (Llama 4's chunked layers): on two
    contiguous ranks no query sees the other rank's keys."""
    return (q // 256 == kv // 256) & (kv <= q)


def window(b, h, q, kv):
    """A causal window of 100 keys: on three contiguous ranks of 128 a rank needs only the keys
    of the rank before it, at ring step 1; step 2 leaves nothing visible on any rank."""
    return (kv <= q) & (kv > q - 100)


def _work_by_hand(full: torch.Tensor, layout: str, world: int) -> torch.Tensor:
    """layout_work's matrix counted from the dense mask's 128 x 128 blocks."""
    nb = full.shape[-1] // 128
    visible = full.view(*full.shape[:2], nb, 128, nb, 128).any(5).any(3).sum((0, 1))
    blocks = [layout_indices(layout, r, world, full.shape[-1])[::128] // 128 for r in range(world)]
    work = torch.zeros(world, world, dtype=torch.int64)
    for r in range(world):
        for i in range(world):
            work[r, i] = visible[blocks[r]][:, blocks[(r - i) % world]].sum()
    return work


def test_ring_stops_after_the_last_step_any_rank_needs():
    mask = TileMask.from_dense(dense(chunked, 1, 2))
    assert [len(ring_step_masks(mask, "contiguous", r, 2)) for r in (0, 1)] == [1, 1]  # no transfer at all
    assert [len(ring_step_masks(mask, "zigzag", r, 2)) for r in (0, 1)] == [2, 2]  # block 3 needs block 2
    full = dense(window, 2, 1, 384)
    mask = TileMask.from_dense(full)
    work = ringflash.layout_work(mask, "contiguous", 3)
    assert torch.equal(work, _work_by_hand(full, "contiguous", 3))
    assert work[1:, 1].all() and not work[:, 2].any()
    steps = [ring_step_masks(mask, "contiguous", r, 3) for r in range(3)]
    assert [len(s) for s in steps] == [2, 2, 2]
    assert steps[0][1] is None and steps[1][1] is not None  # rank 0's step 1 brings rank 2's keys
    full = dense(banded, 2, 3)
    work = ringflash.layout_work(TileMask.from_dense(full), "zigzag", 2)
    assert torch.equal(work, _work_by_hand(full, "zigzag", 2))


def test_balanced_layout_evens_out_the_work():
    mask = TileMask.from_mask_mod(prefix_lm, 1, 1, 2048, 2048)
    for world in (2, 4):
        layout = ringflash.balanced_layout(mask, world)
        assert sorted(c for r in layout.chunks for c in r) == list(range(16))
        assert all(list(r) == sorted(r) for r in layout.chunks)
        spread = {}
        for name, lay in (("contiguous", "contiguous"), ("zigzag", "zigzag"), ("balanced", layout)):
            work = ringflash.layout_work(mask, lay, world)
            assert int(work.sum()) == int(mask.kv_count.sum())  # every visible block once
            spread[name] = float(work.sum(1).max() / work.sum(1).float().mean())
        assert spread["balanced"] <= min(spread["zigzag"], 1.05) < spread["contiguous"], spread
    with pytest.raises(ValueError, match="multiple of world_size 3"):
        ringflash.balanced_layout(mask, 3)


@dataclass(frozen=True)
class Case:
    world: int
    ulysses: int  # 1: the ring; world: Ulysses; between: hybrid
    layout: str | ringflash.ChunkLayout
    mask_mod: object = banded
    seqlen: int = SEQLEN
    batch: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 16
    sinks: bool = False
    mode: str | None = None  # None: from ulysses
    heads_k_stride: int | None = None  # allgather
    dtype: torch.dtype = torch.float32


def _inputs(case: Case):
    g = torch.Generator().manual_seed(3)
    mk = lambda h: torch.randn(case.batch, case.seqlen, h, case.head_dim, generator=g).to(case.dtype)  # noqa: E731
    sinks = torch.randn(case.heads, generator=g) if case.sinks else None
    return mk(case.heads), mk(case.kv_heads), mk(case.kv_heads), mk(case.heads), sinks


def _run(case: Case):
    q, k, v, dout, sinks = _inputs(case)
    dev = worker_device()
    mask = TileMask.from_dense(dense(case.mask_mod, case.batch, case.heads, case.seqlen).to(dev))
    shard = lambda t: ringflash.shard_sequence(t.to(dev), layout=case.layout, ulysses_size=case.ulysses)  # noqa: E731
    if isinstance(case.layout, ringflash.ChunkLayout):  # its shards come back whole
        assert torch.equal(ringflash.gather_sequence(shard(q), layout=case.layout), q.to(dev))
    q, k, v, dout = (shard(t) for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mode = case.mode or {1: "ring", case.world: "ulysses"}.get(case.ulysses, "hybrid")
    out, lse = ringflash.sp_attn_func(
        q, k, v, layout=case.layout, sp_mode=mode, ulysses_size=case.ulysses, return_lse=True,
        sinks=None if sinks is None else sinks.to(dev), block_mask=mask, heads_k_stride=case.heads_k_stride,
    )  # fmt: skip
    out.backward(dout)
    if case.world == 3:  # the same mask again: the ring's plan (its step views) is not rebuilt
        builds = SETUPS.builds
        with torch.no_grad():
            ringflash.sp_attn_func(q, k, v, layout=case.layout, sp_mode=mode, block_mask=mask)
        assert SETUPS.builds == builds
        entries = len(SETUPS._entries)
        del mask  # the cache does not keep a mask (and its plan's views) alive
        assert len(SETUPS._entries) == entries - 1
    return tuple(t.detach().cpu() for t in (out, lse, q.grad, k.grad, v.grad))


# The prefix-LM mask's query blocks dealt out by balanced_layout: ChunkLayout(((1, 3), (0, 2))), chunks
# out of order, run here under the banded mask (string zigzag runs in the hybrid and all-gather cases).
BALANCED = ringflash.balanced_layout(TileMask.from_dense(dense(prefix_lm, 1, 1)), 2)


@pytest.mark.parametrize(
    "case",
    [
        Case(3, 1, "contiguous", upper_half_only, 384, batch=1, heads=1),
        Case(4, 2, "zigzag", batch=1),
        Case(2, 2, "contiguous", batch=1, sinks=True),
        Case(2, 1, BALANCED),
        Case(2, 1, "zigzag", batch=1, kv_heads=2, mode="allgather", heads_k_stride=1),
    ],  # fmt: skip
    ids=[
        "ring-contiguous-empty-step",
        "hybrid",
        "ulysses-sinks",
        "ring-balanced",
        "allgather",
    ],
)
def test_sequence_parallel_block_mask_matches_whole_sequence(rank_pool, case):
    _check(case, rank_pool(case.world).run(_run, case))


def _check(case: Case, results: list[tuple[torch.Tensor, ...]]) -> None:
    """Every rank's (out, lse, dq, dk, dv) put in place against float64 over the whole sequence."""
    q, k, v, dout, sinks = _inputs(case)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    full = dense(case.mask_mod, case.batch, case.heads, case.seqlen)
    ref_out, ref_lse = reference_attention(q, k, v, mask=full, sinks=sinks)
    ref_out.backward(dout.double())
    expected = dict(out=ref_out, lse=ref_lse, dq=q.grad, dk=k.grad, dv=v.grad)
    got = {}
    for i, (name, exp) in enumerate(expected.items()):
        dim = 2 if name == "lse" else 1
        got[name] = torch.empty(exp.shape, dtype=results[0][i].dtype)
        for r, res in enumerate(results):
            got[name].index_copy_(
                dim, layout_indices(case.layout, r, case.world, case.seqlen, case.ulysses), res[i]
            )
        assert not got[name].isnan().any(), f"{case}: {name} has NaN"
        err = rel_err(got[name], exp)
        assert err < (1e-4 if name == "lse" else TOLERANCE[case.dtype]), f"{case}: {name} rel err {err:.2e}"
    if case.mask_mod is banded and case.batch == 2 and not case.sinks:  # sequence 1's queries 0-4 see nothing
        assert got["out"][1, :5].abs().max() == 0 and got["lse"][1, :, :5].eq(float("-inf")).all()


def _run_counting_transfers(case: Case):
    """``_run``, and how many ring transfers (``RingComm.exchange``) it issued."""
    with recorded_transfers() as trips:
        return _run(case), len(trips)


@pytest.mark.parametrize("layout, transfers", [("contiguous", 0), ("zigzag", 3)])
def test_ring_transfers_only_what_a_rank_needs(rank_pool, layout, transfers):
    """Chunked attention whose chunks each rank holds whole (contiguous) runs on every rank
    without a transfer, and exactly; zigzag splits a chunk across the ranks: the one step's K/V
    forward, then K/V and the dK/dV accumulator backward."""
    case = Case(2, 1, layout, chunked, batch=1, heads=2, kv_heads=1)
    runs = rank_pool(2).run(_run_counting_transfers, case)
    assert [n for _, n in runs] == [transfers] * 2
    _check(case, [r for r, _ in runs])


def _run_fused_schedule(case: Case):
    """``_run`` with the ring backward's fused schedule (sm_90's), the Triton kernels doing both
    parts: on two ranks the visiting shard's dK/dV travels home in the inputs' dtype."""
    with forced_fused_backward():
        return _run(case)


def test_ring_fused_schedule_under_a_block_mask(rank_pool):
    case = Case(2, 1, "zigzag", heads=2, kv_heads=1, dtype=torch.float16)
    _check(case, rank_pool(2).run(_run_fused_schedule, case))


def _run_in_turn(cases: list[Case]):
    """``_run_counting_transfers`` of each case in turn on the same ranks: each call's mask a new
    object, so the ring's setup cache (keyed by the mask) must plan each anew."""
    return [_run_counting_transfers(case) for case in cases]


def test_ring_plans_each_mask_anew(rank_pool):
    """Chunked (no transfer), then banded (every step), then chunked again (a new mask object,
    maybe at the freed one's address): each call runs its own mask's steps and equals float64."""
    cases = [Case(2, 1, "contiguous", mask_mod, batch=1) for mask_mod in (chunked, banded, chunked)]
    runs = rank_pool(2).run(_run_in_turn, cases)
    for i, case in enumerate(cases):
        assert [r[i][1] for r in runs] == [0 if case.mask_mod is chunked else 3] * 2, i
        _check(case, [r[i][0] for r in runs])


def _run_counting_walks(case: Case):
    """``_run``, and whether each Hopper backward launch walked a block mask's lists."""
    from ringflash.kernels.hopper import backward as hopper_backward

    walks, real = [], hopper_backward.fused_backward

    def counted(*args, **kwargs):
        walks.append(kwargs.get("mask_lists") is not None)
        return real(*args, **kwargs)

    hopper_backward.fused_backward = counted
    try:
        return _run(case), walks
    finally:
        hopper_backward.fused_backward = real


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_fused_backward_takes_the_block_mask_on_one_gpu(rank_pool, layout):
    """One rank on an H100/H200, bf16, head_dim 128, GQA with per-head masks: the ring's fused
    backward schedule runs every call (zigzag: three on two chunks) as the Hopper backward's
    listed walk over the call's view of the mask, and out, LSE and every gradient equal float64
    attention; the schedule's transfers are covered over gloo and by the multi-GPU tests."""
    case = Case(1, 1, layout, heads=4, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    results, walks = rank_pool(1).run(_run_counting_walks, case)[0]
    assert walks and all(walks), walks
    _check(case, [results])


def _bad_calls():
    dev = worker_device()
    q = torch.randn(1, SEQLEN // 2, 2, 16, device=dev)
    mask = TileMask.from_dense(dense(banded, 1, 1).to(dev))
    other = TileMask.from_dense(dense(upper_half_only, 1, 1).to(dev))
    rank = torch.distributed.get_rank()
    short = TileMask.from_dense(dense(banded, 1, 1)[..., :256, :256].to(dev))
    sp = ringflash.sp_attn_func
    slopes = torch.ones(2, device=dev)
    return errors_of(
        {
            "causal": lambda: sp(q, q, q, causal=True, sp_mode="ring", block_mask=mask),
            "stripe": lambda: sp(q, q, q, layout="stripe", sp_mode="ring", block_mask=mask),
            "alibi": lambda: sp(q, q, q, sp_mode="allgather", alibi_slopes=slopes, block_mask=mask),
            "length": lambda: sp(q, q, q, sp_mode="ulysses", block_mask=short),
            "differ": lambda: sp(q, q, q, sp_mode="ring", block_mask=mask if rank else other),
            "packed": lambda: ringflash.ring_flash_attn_func(
                q, q, q, cu_seqlens=[0, SEQLEN], block_mask=mask
            ),
            "type": lambda: ringflash.zigzag_ring_flash_attn_func(q, q, q, block_mask="causal"),
        }
    )


def test_block_mask_bad_inputs(rank_pool):
    errors = rank_pool(2).run(_bad_calls)
    for e in errors:
        assert "block_mask replaces causal" in e["causal"]
        assert "whole blocks of the mask" in e["stripe"]
        assert "block_mask with alibi_slopes is not supported" in e["alibi"]
        assert "must cover the full sequence (512 tokens" in e["length"]
        assert "block_mask: rank 0: ('TileMask'" in e["differ"]
        assert "cannot take cu_seqlens" in e["packed"]
        assert "TileMask or a FlexAttention BlockMask" in e["type"] or "BlockMask" in e["type"]
