"""ringflash/sp_kvcache.py on 2-3 gloo ranks: decoding over a KV cache sharded by position
ranges equals ``flash_attn_with_kvcache`` over the whole cache on one process (itself checked
against float64 in test_kvcache.py), appends land in the shard that holds their positions, and
a rank whose arguments differ makes every rank raise."""

from __future__ import annotations

import pytest
import torch
from distributed import errors_of, worker_device
from reference import rel_err

import ringflash

CAPACITY, HEADS, HEADS_K, HEAD_DIM = 24, 4, 2, 16


def _tensors(world: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = [torch.randn(2, CAPACITY * world, HEADS_K, HEAD_DIM, generator=g) for _ in range(2)]
    slopes = torch.rand(2, HEADS, generator=g)
    sinks = torch.randn(HEADS, generator=g) + 1
    return cache, slopes, sinks


def _steps(world: int):
    """(lengths before the call, seqlen_new, seqlen_q, options): a chunked prefill across the
    first shard boundary, decode steps up to and across the next, with masks and features."""
    full = CAPACITY * world
    return [
        ([5, CAPACITY - 3], 6, 6, dict(causal=True)),  # rank 0 -> 1 for the second sequence
        ([11, CAPACITY + 3], 1, 1, dict(causal=True, window_size=(9, 0))),
        ([12, CAPACITY + 4], 1, 1, dict(alibi=True, causal=True)),
        ([13, full - 2], 2, 2, dict(sinks=True, causal=True, softcap=1.5)),  # fills the last shard
    ]


def _paged(k_shard: torch.Tensor, v_shard: torch.Tensor, page_size: int, seed: int):
    """A shard's K/V (2 sequences, slots, heads_k, head_dim) laid out as shuffled pages of
    ``page_size``, the two sequences' interleaved: (block_table, k_pages, v_pages)."""
    pages = k_shard.shape[1] // page_size
    order = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(seed))
    table = order.view(2, pages).to(k_shard.device, torch.int32)
    paged = [torch.empty(2 * pages, page_size, *k_shard.shape[2:], device=k_shard.device) for _ in "kv"]
    for b in range(2):
        for j in range(pages):
            for dst, src in zip(paged, (k_shard, v_shard)):
                dst[table[b, j]] = src[b, j * page_size : (j + 1) * page_size]
    return table, *paged


def _unpaged(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The rows (2 sequences, slots, ...) that ``_paged`` laid out as ``pages``."""
    return torch.stack([torch.cat([pages[table[b, j]] for j in range(table.shape[1])]) for b in range(2)])


def _step_equals_whole(step: tuple, g: torch.Generator, whole, shard, slopes, sinks, **sharded) -> None:
    """One call of ``step`` = (lengths before, new tokens, queries, options) over the whole
    cache on this process and over this rank's shard (``sharded``: the sharded call's own
    arguments): the same (out, lse). Queries and new tokens come from ``g``, alike everywhere."""
    lengths, new, seqlen_q, options = step
    device = whole[0].device
    options = dict(options)
    extra = dict(
        alibi_slopes=slopes if options.pop("alibi", False) else None,
        sinks=sinks if options.pop("sinks", False) else None,
    )
    q = torch.randn(2, seqlen_q, HEADS, HEAD_DIM, generator=g).to(device)
    k, v = (torch.randn(2, new, HEADS_K, HEAD_DIM, generator=g).to(device) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    expected = ringflash.flash_attn_with_kvcache(
        q, *whole, k, v, cache_seqlens=seqlens, return_softmax_lse=True, **options, **extra
    )
    got = ringflash.sp_flash_attn_with_kvcache(
        q, *shard, k, v, cache_seqlens=seqlens, num_splits=2, return_softmax_lse=True, **sharded, **options,
        **extra,
    )  # fmt: skip
    errors = rel_err(got[0], expected[0]), rel_err(got[1], expected[1])
    assert max(errors) < 1e-5, (lengths, options, errors)


def _sharded_equals_whole(paged: bool):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = worker_device()
    (k_whole, v_whole), slopes, sinks = _tensors(world)
    k_whole, v_whole, slopes, sinks = (t.to(device) for t in (k_whole, v_whole, slopes, sinks))
    own = slice(rank * CAPACITY, (rank + 1) * CAPACITY)
    shard, table = (k_whole[:, own].clone(), v_whole[:, own].clone()), None
    if paged:  # this rank's pages of 8 positions, shuffled, the two sequences' interleaved
        table, *shard = _paged(*shard, 8, rank)
    g = torch.Generator().manual_seed(1)  # the same new tokens and queries on every rank
    for step in _steps(world):
        _step_equals_whole(step, g, (k_whole, v_whole), shard, slopes, sinks, block_table=table)
    k_shard = _unpaged(shard[0], table) if paged else shard[0]
    return torch.equal(k_shard, k_whole[:, own])  # this rank's positions, appends included


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_sharded_cache_equals_the_whole_cache(rank_pool, world, paged):
    assert rank_pool(world).run(_sharded_equals_whole, paged) == [True] * world


def _disagreeing_call():
    rank = torch.distributed.get_rank()
    device = worker_device()
    capacity = CAPACITY + 8 * rank  # rank 1's cache is larger: the shards' positions would not tile
    k_cache = torch.zeros(1, capacity, HEADS_K, HEAD_DIM, device=device)
    q = torch.zeros(1, 1, HEADS, HEAD_DIM, device=device)
    return ringflash.sp_flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=3)


def _failing_rank():
    rank = torch.distributed.get_rank()
    device = worker_device()
    k_cache = torch.zeros(1, CAPACITY, HEADS_K, HEAD_DIM, device=device)
    q = torch.zeros(1, 1, HEADS if rank == 0 else 3, HEAD_DIM, device=device)  # rank 1: bad heads
    return ringflash.sp_flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=3)


@pytest.mark.parametrize("call", [_disagreeing_call, _failing_rank])
def test_ranks_that_disagree_all_raise(rank_pool, call):
    errors = rank_pool(2).run(errors_of, {"call": call})
    assert all(e["call"] and "ValueError" in e["call"] for e in errors), errors


def _ring_prefill_then_decode():
    """A prompt of P tokens per rank through the ring (contiguous shards, causal), each rank's
    K/V copied into its cache, then decode steps appended to the last rank's range: every step
    equals causal attention over the whole sequence so far (one process's flash_attn_func)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device, prompt_per_rank, steps = worker_device(), 10, 4
    total = prompt_per_rank * world + steps
    g = torch.Generator().manual_seed(5)
    q_all, k_all, v_all = (
        torch.randn(2, total, h, HEAD_DIM, generator=g).to(device) for h in (HEADS, HEADS_K, HEADS_K)
    )
    prompt = slice(rank * prompt_per_rank, (rank + 1) * prompt_per_rank)
    last = rank == world - 1
    held = prompt_per_rank + (steps if last else 0)
    k_cache = torch.zeros(2, held, HEADS_K, HEAD_DIM, device=device)  # the ranks' capacities differ
    v_cache = torch.zeros_like(k_cache)
    # The prompt's K/V written into the caches, and the ring run on those views (strided: no copy).
    k_cache[:, :prompt_per_rank], v_cache[:, :prompt_per_rank] = k_all[:, prompt], v_all[:, prompt]
    k_view, v_view = k_cache[:, :prompt_per_rank], v_cache[:, :prompt_per_rank]
    out = ringflash.ring_flash_attn_func(q_all[:, prompt], k_view, v_view, causal=True)
    whole = ringflash.flash_attn_func(q_all, k_all, v_all, causal=True)
    ok = rel_err(out, whole[:, prompt]) < 1e-5 and k_view.is_contiguous() != last  # the last's is strided
    for i in range(prompt_per_rank * world, total):
        s = slice(i, i + 1)
        step = ringflash.sp_flash_attn_with_kvcache(
            q_all[:, s], k_cache, v_cache, k_all[:, s], v_all[:, s], cache_seqlens=i, causal=True,
            shard_range=(rank * prompt_per_rank, held),
        )  # fmt: skip
        ok &= rel_err(step, whole[:, s]) < 1e-5
    untouched = torch.equal(k_cache[:, prompt_per_rank:], torch.zeros_like(k_cache[:, prompt_per_rank:]))
    return bool(ok) and (untouched != last)  # only the last rank's range took the new tokens


def test_ring_prefill_then_sharded_decode(rank_pool):
    assert rank_pool(2).run(_ring_prefill_then_decode) == [True, True]


def _past_the_last_range():
    rank = torch.distributed.get_rank()
    device = worker_device()
    k_cache = torch.zeros(1, 8, HEADS_K, HEAD_DIM, device=device)
    q = torch.zeros(1, 1, HEADS, HEAD_DIM, device=device)
    k = torch.zeros(1, 1, HEADS_K, HEAD_DIM, device=device)
    return ringflash.sp_flash_attn_with_kvcache(
        q, k_cache, k_cache.clone(), k, k.clone(), cache_seqlens=12, shard_range=(rank * 6, 6)
    )  # the ranges end at 12: position 12 fits nowhere


def test_an_append_past_the_last_range_raises_everywhere(rank_pool):
    errors = rank_pool(2).run(errors_of, {"call": _past_the_last_range})
    assert all(e["call"] and "ends at position 12" in e["call"] for e in errors), errors


def _captured_sharded_decode():
    """A sharded decode step (append one token on the last rank, attend, all-gather, merge)
    captured in a CUDA graph over NCCL replays like eager steps on a copy of the caches."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device, capacity = worker_device(), 256
    g = torch.Generator().manual_seed(3)  # the same queries and new tokens on every rank
    q, k, v = (torch.randn(1, 1, h, HEAD_DIM, generator=g).to(device, torch.float16) for h in (8, 2, 2))
    cache = torch.Generator().manual_seed(10 + rank)
    k_cache, v_cache = (
        torch.randn(1, capacity, 2, HEAD_DIM, generator=cache).to(device, torch.float16) for _ in "kv"
    )
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    seqlens = torch.tensor([capacity * world - 8], dtype=torch.int32, device=device)

    def step(kc, vc):
        return ringflash.sp_flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=seqlens, causal=True, check_bounds=False, return_softmax_lse=True
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (compiles, caches, the rank-check mailbox)
        step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step(k_cache, v_cache)
    same = True
    for _ in range(3):
        graph.replay()
        expected = step(eager_k, eager_v)
        torch.cuda.synchronize()
        same &= torch.equal(static[0], expected[0]) and torch.equal(static[1], expected[1])
        same &= torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
        seqlens += 1  # the next step appends after this one (the graph reads the tensor)
        q.copy_(torch.randn(q.shape, generator=g))
    return bool(same)


@pytest.mark.multigpu
def test_sharded_decode_step_captures_in_a_cuda_graph(rank_pool):
    assert rank_pool(2).run(_captured_sharded_decode) == [True, True]


PROMPT, ROOM = 12, 10  # positions per rank before spread_from; slots for the dealt ones


def _spread_equals_whole(paged: bool):
    """Tokens past spread_from dealt out round-robin: each step equals the whole cache on one
    process (a chunk from the prompt into the dealt positions, windows reaching across ranks,
    ALiBi, sinks with softcap, three causal queries), and each rank's slots hold its positions."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device, spread_from, slots = worker_device(), PROMPT * world, PROMPT + ROOM
    g = torch.Generator().manual_seed(7)  # the same whole cache on every rank
    capacity = spread_from + ROOM * world
    k_whole, v_whole = (torch.randn(2, capacity, HEADS_K, HEAD_DIM, generator=g) for _ in "kv")
    slopes, sinks = torch.rand(2, HEADS, generator=g), torch.randn(HEADS, generator=g) + 1
    k_whole, v_whole, slopes, sinks = (t.to(device) for t in (k_whole, v_whole, slopes, sinks))
    mine = slice(rank * PROMPT, (rank + 1) * PROMPT)
    k_shard, v_shard = (torch.zeros(2, slots, HEADS_K, HEAD_DIM, device=device) for _ in "kv")
    k_shard[:, :PROMPT], v_shard[:, :PROMPT] = k_whole[:, mine], v_whole[:, mine]
    table, shard = None, (k_shard, v_shard)
    if paged:  # pages of 2 slots, shuffled
        table, *shard = _paged(k_shard, v_shard, 2, rank)
    steps = [  # (lengths before, new tokens, queries, options)
        ([spread_from - 3, spread_from - 1], 5, 5, dict(causal=True)),  # from the last range into the dealt
        ([spread_from + 2, spread_from + 4], 1, 1, dict(causal=True, window_size=(2 * world + 1, 0))),
        ([spread_from + 3, spread_from + 5], 1, 1, dict(alibi=True)),
        ([spread_from + 4, spread_from + 6], 3, 3, dict(sinks=True, causal=True, softcap=1.5)),
    ]
    g = torch.Generator().manual_seed(8)
    for step in steps:
        _step_equals_whole(
            step, g, (k_whole, v_whole), shard, slopes, sinks, block_table=table, spread_from=spread_from
        )
    if paged:
        k_shard = _unpaged(shard[0], table)
    same = True
    for b, end in enumerate((spread_from + 7, spread_from + 9)):  # the sequences' final lengths
        dealt = torch.arange(spread_from + rank, end, world)  # the positions dealt to this rank
        expected = torch.cat((k_whole[b, mine], k_whole[b, dealt]))
        same &= torch.equal(k_shard[b, : len(expected)], expected)
    return bool(same)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_tokens_dealt_past_spread_from_equal_the_whole_cache(rank_pool, world, paged):
    assert rank_pool(world).run(_spread_equals_whole, paged) == [True] * world


def _spread_overflow():
    k_cache = torch.zeros(1, 6, HEADS_K, HEAD_DIM, device=worker_device())
    q = torch.zeros(1, 1, HEADS, HEAD_DIM, device=worker_device())
    k = torch.zeros(1, 3, HEADS_K, HEAD_DIM, device=worker_device())
    # 4 slots of prompt per rank, 2 for dealt tokens; positions 8..13 deal 3 to each rank.
    return ringflash.sp_flash_attn_with_kvcache(
        q, k_cache, k_cache.clone(), k, k.clone(), cache_seqlens=11, spread_from=8,
    )


def test_dealt_tokens_past_a_shards_capacity_raise_everywhere(rank_pool):
    errors = rank_pool(2).run(errors_of, {"call": _spread_overflow})
    assert all(e["call"] and "6 slots" in e["call"] for e in errors), errors
