"""FLOP formulas (kernels/flop_counts.py, ringflash/flop_counts.py): under ``FlopCounterMode``
each attention entry counts what torch's own formulas give SDPA for the same attention (dense;
packed documents each on its own), and the sequence-parallel ranks' counts add up to it."""

from __future__ import annotations

import pytest
import torch
from distributed import worker_device
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import ringflash
from ringflash.kernels import TileMask, flash_attn_with_kvcache
from ringflash.kernels.flop_counts import document_pairs


class _Names:
    """The ops' names, which key the counts (names cross process boundaries; op packets don't)."""

    def __getattr__(self, name: str) -> str:
        return str(getattr(torch.ops.ringflash, name))


ops = _Names()


def _counts(fn) -> dict:
    """{op name: FLOPs} of ``fn()`` and, if it returns a tensor, a backward through it."""
    with FlopCounterMode(display=False) as counter:
        out = fn()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.backward(torch.ones_like(out))
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def _sdpa(batch, heads_q, seqlen_q, seqlen_k, head_dim, head_dim_v=None) -> tuple[int, int]:
    """torch's (forward, backward) FLOPs of SDPA on these shapes ((batch, heads, seqlen, dim)).
    K/V as broadcast to the query heads: torch 2.11's formulas refuse GQA shapes, later ones count
    GQA as its broadcast."""
    dv = head_dim_v or head_dim
    shapes = ((batch, heads_q, seqlen_q, head_dim), (batch, heads_q, seqlen_k, head_dim),
              (batch, heads_q, seqlen_k, dv))  # fmt: skip
    return sdpa_flop_count(*shapes), sdpa_backward_flop_count((batch, heads_q, seqlen_q, dv), *shapes)


def _leaves(*shapes, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device).requires_grad_() for s in shapes]


@pytest.mark.parametrize("causal", [False, True])
def test_dense_call_counts_as_sdpa(device, causal):
    q, k, v = _leaves((2, 80, 4, 32), (2, 96, 2, 32), (2, 96, 2, 32), device=device)
    counts = _counts(lambda: ringflash.flash_attn_func(q, k, v, causal=causal))
    fwd, bwd = _sdpa(2, 4, 80, 96, 32)
    assert counts == {ops.flash_attn_forward: fwd, ops.flash_attn_backward: bwd}


def test_packed_documents_count_each_on_its_own(device):
    lengths_q, lengths_k = [17, 40, 3], [25, 40, 9]
    q, k, v = _leaves(
        (sum(lengths_q), 4, 16), (sum(lengths_k), 2, 16), (sum(lengths_k), 2, 16), device=device
    )
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lengths_q, lengths_k))  # fmt: skip
    counts = _counts(lambda: ringflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, causal=True))
    want = [sum(x) for x in zip(*(_sdpa(1, 4, a, b, 16) for a, b in zip(lengths_q, lengths_k)))]
    assert counts == {ops.flash_attn_forward: want[0], ops.flash_attn_backward: want[1]}


def test_unreadable_documents_count_their_bound():
    with FakeTensorMode():
        cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert document_pairs(cu, cu, 7, 7) == 2 * 7 * 7
    real = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert document_pairs(real, real, 7, 7) == 3 * 3 + 7 * 7


def test_inductor_estimates_from_fake_tensors():
    """Inductor's scheduler counts an op's FLOPs by running it on fake tensors under
    FlopCounterMode (``count_flops_fx``): the formulas give their bounds there (documents × max
    lengths; every sequence its whole cache) instead of failing on unreadable values."""
    from torch._inductor.fx_utils import count_flops_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = (torch.randn(64, 4, 16) for _ in range(3))
    cu = torch.tensor([0, 10, 64], dtype=torch.int32)
    q1, caches, seqlens = (
        torch.randn(2, 1, 4, 16),
        [torch.randn(2, 32, 2, 16) for _ in range(2)],
        torch.tensor([3, 9], dtype=torch.int32),
    )

    def calls(q, k, v, cu, q1, k_cache, v_cache, seqlens):
        out = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 54, 54, causal=True)
        return out, flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens, check_bounds=False)

    graph = make_fx(calls, tracing_mode="fake")(q, k, v, cu, q1, *caches, seqlens)
    counted = {str(n.target.overloadpacket): count_flops_fx(n) for n in graph.graph.nodes
               if "ringflash" in str(n.target)}  # fmt: skip
    assert counted == {
        ops.flash_attn_forward: _sdpa(2, 4, 54, 54, 16)[0],  # 2 documents of at most 54 tokens
        ops.kvcache_attention: _sdpa(2, 4, 1, 32, 16)[0],  # 2 sequences of the whole cache
    }


def test_block_mask_and_probabilities_count_dense(device):
    q, k, v = _leaves((1, 128, 2, 16), (1, 128, 2, 16), (1, 128, 2, 16), device=device)
    mask = TileMask.from_mask_mod(lambda b, h, i, j: j <= i, 1, 1, 128, 128, device=device)
    fwd, bwd = _sdpa(1, 2, 128, 128, 16)
    counts = _counts(lambda: ringflash.flash_attn_func(q, k, v, block_mask=mask))
    assert counts == {ops.block_sparse_forward: fwd, ops.block_sparse_backward: bwd}
    counts = _counts(lambda: ringflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[2])
    assert counts == {ops.flash_attn_forward: fwd, ops.attention_probs: fwd // 2}  # S = QKᵀ only


def test_kv_cache_counts_each_sequences_keys(device):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 16, generator=g).to(device)
    k_cache, v_cache = (torch.randn(2, 32, 2, 16, generator=g).to(device) for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 16, generator=g).to(device) for _ in range(2))
    seqlens = torch.tensor([5, 20], dtype=torch.int32, device=device)
    leftpad = torch.tensor([0, 4], dtype=torch.int32, device=device)
    counts = _counts(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                    cache_leftpad=leftpad, causal=True))  # fmt: skip
    keys = (5 + 1) + (20 - 4 + 1)
    assert counts == {ops.kvcache_attention: _sdpa(1, 4, 1, keys, 16)[0]}
    seqlens += 1  # the next step, lengths changed in place: the host copy of the values is renewed
    counts = _counts(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                    cache_leftpad=leftpad, causal=True))  # fmt: skip
    assert counts == {ops.kvcache_attention: _sdpa(1, 4, 1, keys + 2, 16)[0]}


def _sp_counts(name: str):
    """This rank's counts of one sequence-parallel call (fwd+bwd) over 96 tokens."""
    dev, world = worker_device(), torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(1, 96, h, 16, generator=g) for h in (4, 2, 2)]
    if name in ("ring", "ulysses", "allgather"):
        q, k, v = (ringflash.shard_sequence(t, layout="zigzag").to(dev).requires_grad_() for t in full)
        return _counts(lambda: ringflash.sp_attn_func(q, k, v, causal=True, layout="zigzag", sp_mode=name))
    if name == "ring, documents":
        cu = torch.tensor([0, 32, 96], dtype=torch.int32)
        q, k, v = (ringflash.shard_sequence(t, layout="zigzag", cu_seqlens=cu).to(dev).requires_grad_()
                   for t in full)  # fmt: skip
        return _counts(lambda: ringflash.zigzag_ring_flash_attn_func(q, k, v, causal=True, cu_seqlens=cu))
    n = 96 // world  # each rank a contiguous piece of each document of 32 and 64 tokens
    pieces = [torch.cat([t[0, a + rank * (b - a) // world: a + (rank + 1) * (b - a) // world]
                         for a, b in ((0, 32), (32, 96))]) for t in full]  # fmt: skip
    q, k, v = (t.to(dev).requires_grad_() for t in pieces)
    if name == "ring, varlen":
        local = torch.tensor([0, 32 // world, n], dtype=torch.int32, device=dev)
        return _counts(
            lambda: ringflash.ring_flash_attn_varlen_func(q, k, v, local, 64 // world, causal=True)
        )
    cu = torch.tensor([0, 32, 96], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, ks = ringflash.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
    q, k, v = (t[0, rank * n : (rank + 1) * n].to(dev).requires_grad_() for t in full)
    cu_q, cu_k = cu_q.to(dev), cu_k.to(dev)
    counts = _counts(
        lambda: ringflash.llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 1, ks, causal=True)
    )
    return counts, document_pairs(cu_q.cpu(), cu_k.cpu(), max_q, max_k)


SP_OPS = {
    "ring": (ops.ring_attn_forward, ops.ring_attn_backward),
    "ring, documents": (ops.ring_attn_forward, ops.ring_attn_backward),
    "ulysses": (ops.ulysses_attn_forward, ops.ulysses_attn_backward),
    "allgather": (ops.allgather_attn_forward, ops.allgather_attn_backward),
    "ring, varlen": (ops.ring_varlen_attn_forward, ops.ring_varlen_attn_backward),
}


@pytest.mark.parametrize("name", sorted(SP_OPS))
def test_sequence_parallel_ranks_add_up_to_the_whole(rank_pool, name):
    per_rank = rank_pool(2).run(_sp_counts, name)
    if name in ("ring", "ulysses", "allgather"):
        want = _sdpa(1, 4, 96, 96, 16)
    else:  # documents of 32 and 64 tokens
        want = [a + b for a, b in zip(_sdpa(1, 4, 32, 32, 16), _sdpa(1, 4, 64, 64, 16))]
    forward, backward = SP_OPS[name]
    for counts in per_rank:
        assert set(counts) == {forward, backward}, counts
    assert sum(c[forward] for c in per_rank) == want[0]
    assert sum(c[backward] for c in per_rank) == want[1]
    assert per_rank[0] == per_rank[1]  # an even split


def test_llama3_form_counts_its_own_varlen_call(rank_pool):
    for counts, pairs in rank_pool(2).run(_sp_counts, "llama3"):
        assert counts == {
            ops.allgather_attn_forward: 2 * pairs * 4 * (16 + 16),
            ops.allgather_attn_backward: 2 * pairs * 4 * (3 * 16 + 2 * 16),
        }
