"""Training step of the reference decoder: sequence-parallel loss and gradients equal the
single-process full-sequence run (fp32), with D x S process groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import errors_of, worker_device
from reference import reference_attention, rel_err

from ringflash.batch import shard_batch
from ringflash.groups import reduce_gradients, sequence_parallel_groups
from ringflash.kernels import flash_attn_func
from ringflash.layouts import ChunkLayout
from ringflash.loss import sequence_parallel_cross_entropy
from ringflash.modules import ReferenceDecoder, SequenceParallelAttention

VOCAB, DIM, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 32


def _model(kv_heads: int, attention=None) -> ReferenceDecoder:
    torch.manual_seed(0)
    return ReferenceDecoder(VOCAB, DIM, LAYERS, HEADS, kv_heads, attention)


def _batch(replica: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + replica)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=g)}


def _sp_step(sp_size: int, layout: str, kv_heads: int, sp_mode: str):
    groups = sequence_parallel_groups(sp_size)
    ulysses = sp_size if sp_mode == "ulysses" else 1
    attn = SequenceParallelAttention(group=groups.sp_group, layout=layout, sp_mode=sp_mode)
    model = _model(kv_heads, attn).to(worker_device())
    batch = {k: v.to(worker_device()) for k, v in _batch(groups.dp_rank).items()}
    shard = shard_batch(batch, groups.sp_group, layout=layout, ulysses_size=ulysses)
    logits = model(shard["input_ids"], shard["position_ids"])
    loss = sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    loss.backward()
    reduce_gradients(model, groups)
    dist.barrier()
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("world", "sp_size", "layout", "kv_heads", "sp_mode"),
    [
        (2, 2, "zigzag", 2, "ring"),
        (4, 4, "stripe", 4, "ring"),
        (4, 2, "zigzag", 1, "ring"),
        (2, 2, "zigzag", 2, "ulysses"),
        (2, 2, "zigzag", 2, "auto"),  # here the all-gather mode
    ],
)
def test_sequence_parallel_step_matches_single_process(
    rank_pool, device, world, sp_size, layout, kv_heads, sp_mode
):
    results = rank_pool(world).run(_sp_step, sp_size, layout, kv_heads, sp_mode)
    dp_size = world // sp_size
    ref_grads: dict[str, torch.Tensor] = {}
    for replica in range(dp_size):
        model = _model(kv_heads).to(device)  # no process group: single-device attention
        ids = _batch(replica)["input_ids"].to(device)
        logits = model(ids, torch.arange(SEQ, device=device).expand_as(ids))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        for rank in range(replica * sp_size, (replica + 1) * sp_size):
            assert abs(results[rank][0] - loss.item()) < 1e-5 * max(1.0, loss.item()), (
                rank,
                results[rank][0],
            )
        for n, p in model.named_parameters():
            ref_grads[n] = ref_grads.get(n, 0) + p.grad.cpu() / dp_size
    for rank, (_, grads) in enumerate(results):
        for n, g in grads.items():
            err = ((g - ref_grads[n]).norm() / ref_grads[n].norm()).item()
            assert err < 1e-4, f"rank {rank} {n}: rel err {err:.2e}"


DOCS = [(10, 22), (13, 19)]  # packed rows: documents' lengths (each row sums to SEQ)


def _packed_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    return {"input_ids": torch.randint(0, VOCAB, (len(DOCS), SEQ), generator=g), "position_ids": positions}


def _sp_step_packed(layout: str, sp_mode: str):
    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    ulysses = groups.sp_size if sp_mode == "ulysses" else 1
    attn = SequenceParallelAttention(group=groups.sp_group, layout=layout, sp_mode=sp_mode)
    model = _model(2, attn).to(worker_device())
    batch = {k: v.to(worker_device()) for k, v in _packed_batch().items()}
    shard = shard_batch(batch, groups.sp_group, layout=layout, ulysses_size=ulysses)
    logits = model(shard["input_ids"], shard["position_ids"], shard["cu_seqlens"])
    loss = sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    loss.backward()
    reduce_gradients(model, groups)
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()}


# Two ranks each: packed documents on 3 and 4 ranks are covered per layer in test_ring.py.
@pytest.mark.parametrize(("world", "layout", "sp_mode"), [(2, "zigzag", "ring"), (2, "stripe", "ring"),
                                                          (2, "zigzag", "ulysses")])  # fmt: skip
def test_packed_sequences_match_separate_documents(rank_pool, device, world, layout, sp_mode):
    """Packed rows (position_ids restarting) train exactly like each document on its own."""
    results = rank_pool(world).run(_sp_step_packed, layout, sp_mode)
    model = _model(2).to(device)
    batch = {k: v.to(device) for k, v in _packed_batch().items()}
    total, count = 0.0, 0
    for row, lens in enumerate(DOCS):
        for ids in batch["input_ids"][row].split(list(lens)):
            logits = model(ids[None], torch.arange(len(ids), device=device)[None])[0]
            total = total + F.cross_entropy(logits[:-1], ids[1:], reduction="sum")
            count += len(ids) - 1
    loss = total / count
    loss.backward()
    for rank, (sp_loss, grads) in enumerate(results):
        assert abs(sp_loss - loss.item()) < 1e-5 * loss.item(), (rank, sp_loss, loss.item())
        for n, p in model.named_parameters():
            err = ((grads[n] - p.grad.cpu()).norm() / p.grad.norm()).item()
            assert err < 1e-4, f"rank {rank} {n}: rel err {err:.2e}"


def test_single_device_packed_attention(device):
    """Without a process group, cu_seqlens keeps attention inside each document (any lengths)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 23, h, 16, generator=g).to(device) for h in (4, 2, 2))
    got = SequenceParallelAttention()(q, k, v, cu_seqlens=torch.tensor([0, 5, 6, 23], dtype=torch.int32))
    want = torch.cat(
        [flash_attn_func(*(t[:, a:b] for t in (q, k, v)), causal=True) for a, b in ((0, 5), (5, 6), (6, 23))],
        1,
    )
    assert torch.allclose(got, want, atol=1e-6)
    whole = SequenceParallelAttention()(q, k, v)
    assert not torch.allclose(got[:, 5:], whole[:, 5:], atol=1e-3)  # the documents do matter


def test_single_device_layer_features(device):
    """SequenceParallelAttention with softcap, ALiBi (a buffer) and sinks (forward's argument)
    equals float64 attention, sinks' gradient included; bad values are refused, not ignored."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (2 * torch.randn(1, 12, 2, 16, generator=g) for _ in range(3))
    slopes, sinks = torch.tensor([0.5, 0.25]), torch.randn(2, generator=g) + 2
    layer = SequenceParallelAttention(softcap=1.0, alibi_slopes=slopes.to(device))
    sinks_d = sinks.to(device).requires_grad_()
    got = layer(q.to(device), k.to(device), v.to(device), sinks=sinks_d)
    got.sum().backward()
    sinks64 = sinks.detach().double().requires_grad_()
    want = reference_attention(q, k, v, causal=True, softcap=1.0, alibi_slopes=slopes, sinks=sinks64)[0]
    want.sum().backward()
    assert rel_err(got, want) < 1e-4 and rel_err(sinks_d.grad, sinks64.grad) < 1e-4
    errors = errors_of({
        "softcap": lambda: SequenceParallelAttention(softcap=-1.0)(q.to(device), k.to(device), v.to(device)),
        "sinks": lambda: layer(q.to(device), k.to(device), v.to(device), sinks=torch.zeros(3, device=device)),
        "alibi": lambda: SequenceParallelAttention(alibi_slopes=slopes.double())(q, k, v),
    })  # fmt: skip
    assert "softcap must be 0.0 (off) or a positive" in errors["softcap"]
    assert "sinks must have shape (heads_q,) = (2,)" in errors["sinks"]
    assert "alibi_slopes must be float32" in errors["alibi"]


def test_single_device_layer_checks_the_sp_configuration(device):
    """On one device the layer refuses what sp_attn_func would refuse on any group (before: it
    ran, and the configuration failed only once the model ran sequence parallel); a hybrid
    configuration, valid on a larger group, still runs on one device."""
    q, k, v = (torch.randn(1, 8, 2, 16, device=device) for _ in range(3))
    errors = errors_of({
        "ring": lambda: SequenceParallelAttention(sp_mode="ring", ulysses_size=2)(q, k, v),
        "hybrid": lambda: SequenceParallelAttention(sp_mode="hybrid")(q, k, v),
        "type": lambda: SequenceParallelAttention(sp_mode="hybrid", ulysses_size="2")(q, k, v),
    })  # fmt: skip
    assert 'ulysses_size=2 contradicts sp_mode="ring"' in errors["ring"]
    assert 'sp_mode="hybrid" needs ulysses_size' in errors["hybrid"]
    assert "ulysses_size must be a positive int, got '2'" in errors["type"]
    hybrid = SequenceParallelAttention(sp_mode="hybrid", ulysses_size=4)(q, k, v)
    assert torch.allclose(hybrid, SequenceParallelAttention()(q, k, v))


def test_layer_keeps_float32_alibi_slopes_through_casts(device):
    """model.half() / .to(bfloat16) casts every float buffer: the slopes stay float32 (a cast
    would round 1/3 and then fail the float32 check, or bias long distances by the rounding)."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 12, 2, 16, generator=g).to(device, torch.float16) for _ in range(3))
    slopes = torch.tensor([1 / 3, 0.25], device=device)
    layer = SequenceParallelAttention(alibi_slopes=slopes).half()
    assert layer.alibi_slopes.dtype == torch.float32 and torch.equal(layer.alibi_slopes, slopes)
    assert layer.to(torch.bfloat16).alibi_slopes.dtype == torch.float32
    want = reference_attention(q.cpu(), k.cpu(), v.cpu(), causal=True, alibi_slopes=slopes.cpu())[0]
    assert rel_err(layer(q, k, v), want) < 5e-3


def _shard_packed():
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    return shard_batch({"input_ids": torch.arange(12)[None], "position_ids": positions}, pad_token_id=99)


def test_shard_batch_packs_documents(rank_pool):
    """Documents of 5 and 7 tokens, zigzag over 2 ranks: each padded to 8 and cut into 4 chunks of
    2; rank 0 holds chunks 0 and 3 of each document, rank 1 chunks 1 and 2."""
    shards = rank_pool(2).run(_shard_packed)
    assert all(s["cu_seqlens"].tolist() == [0, 8, 16] for s in shards)
    assert shards[0]["input_ids"].tolist() == [[0, 1, 5, 6, 99, 99, 11, 99]]
    assert shards[0]["target_ids"].tolist() == [[1, 2, 6, 7, -100, -100, -100, -100]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 0, 1, 6, 7, 6, 7]]
    assert shards[1]["input_ids"].tolist() == [[2, 3, 7, 8, 4, 99, 9, 10]]
    assert shards[1]["target_ids"].tolist() == [[3, 4, 8, 9, -100, -100, 10, 11]]
    assert shards[1]["position_ids"].tolist() == [[2, 3, 2, 3, 4, 5, 4, 5]]


def _shard_one():
    types = (torch.arange(16).view(1, 16) // 3) % 2
    embeds = (torch.arange(16.0)[None, :, None] * torch.tensor([1.0, -1.0])).requires_grad_()
    batch = {"input_ids": torch.arange(16).view(1, 16), "token_type_ids": types, "inputs_embeds": embeds}
    shards = shard_batch(batch, layout="zigzag")
    (shards["inputs_embeds"] * 2).sum().backward()  # the gradient reaches this rank's rows of the whole
    return shards | {"inputs_embeds": shards["inputs_embeds"].detach(), "embeds_grad": embeds.grad[0, :, 0]}


def test_shard_batch_shifts_labels_before_sharding(rank_pool):
    shards = rank_pool(2).run(_shard_one)
    # zigzag over 2 ranks: rank 0 holds tokens 0-3 and 12-15, rank 1 tokens 4-11; each token's
    # target is the next token, including across shard boundaries (3 -> 4, 11 -> 12).
    assert shards[0]["target_ids"].tolist() == [[1, 2, 3, 4, 13, 14, 15, -100]]
    assert shards[1]["target_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    # token types (Gemma-3's images, PaliGemma's prefix) follow their tokens
    assert shards[0]["token_type_ids"].tolist() == [[0, 0, 0, 1, 0, 0, 0, 1]]
    assert shards[1]["token_type_ids"].tolist() == [[1, 1, 0, 0, 0, 1, 1, 1]]
    # so do whole-sequence embeddings (images merged in), differentiably
    for rank, held in enumerate(([0, 1, 2, 3, 12, 13, 14, 15], list(range(4, 12)))):
        assert shards[rank]["inputs_embeds"][0, :, 0].tolist() == held
        assert shards[rank]["inputs_embeds"][0, :, 1].tolist() == [-t for t in held]
        assert shards[rank]["embeds_grad"].tolist() == [2.0 if t in held else 0.0 for t in range(16)]


def _shard_dealt():
    """16 tokens in 4 chunks dealt out of order (what ``balanced_layout`` returns), and 2
    documents of 8 cut the same way inside each."""
    layout = ChunkLayout(((1, 3), (0, 2)))
    ids = torch.arange(16).view(1, 16)
    whole = shard_batch({"input_ids": ids}, layout=layout)
    positions = torch.arange(8).repeat(2).view(1, 16)
    packed = shard_batch({"input_ids": ids, "position_ids": positions}, layout=layout)
    return whole, packed


def test_shard_batch_takes_a_chunk_layout(rank_pool):
    (whole0, packed0), (whole1, packed1) = rank_pool(2).run(_shard_dealt)
    assert whole0["input_ids"].tolist() == [[4, 5, 6, 7, 12, 13, 14, 15]]  # chunks 1 and 3
    assert whole0["target_ids"].tolist() == [[5, 6, 7, 8, 13, 14, 15, -100]]
    assert whole1["input_ids"].tolist() == [[0, 1, 2, 3, 8, 9, 10, 11]]
    assert whole1["target_ids"].tolist() == [[1, 2, 3, 4, 9, 10, 11, 12]]
    assert packed0["cu_seqlens"].tolist() == [0, 8, 16]
    # chunk by chunk, every document's: chunk 1 of both documents, then chunk 3 of both
    assert packed0["input_ids"].tolist() == [[2, 3, 10, 11, 6, 7, 14, 15]]
    assert packed0["target_ids"].tolist() == [[3, 4, 11, 12, 7, -100, 15, -100]]
    assert packed1["input_ids"].tolist() == [[0, 1, 8, 9, 4, 5, 12, 13]]


def _bad_batches():
    ones = torch.ones(1, 8, dtype=torch.long)
    return errors_of(
        {
            "pad": lambda: shard_batch({"input_ids": ones, "attention_mask": torch.tensor([[1] * 7 + [0]])}),
            "packed_ulysses": lambda: shard_batch(
                {"input_ids": ones, "position_ids": torch.tensor([[0, 1, 2, 3] * 2])}, ulysses_size=3
            ),
            "rank": lambda: shard_batch({"input_ids": torch.ones(8, dtype=torch.long)}),
            "odd": lambda: shard_batch({"input_ids": torch.ones(1, 6, dtype=torch.long)}),
            "unknown": lambda: shard_batch({"input_ids": ones, "pixel_values": torch.ones(1, 3, 4, 4)}),
            "types_shape": lambda: shard_batch({"input_ids": ones, "token_type_ids": ones[:, :4]}),
            "packed_types": lambda: shard_batch(
                {"input_ids": ones, "position_ids": torch.tensor([[0, 1, 2, 3] * 2]), "token_type_ids": ones}
            ),
            "embeds_shape": lambda: shard_batch({"input_ids": ones, "inputs_embeds": torch.ones(1, 4, 3)}),
            "embeds_type": lambda: shard_batch({"input_ids": ones, "inputs_embeds": [[0.0] * 8]}),
            "packed_embeds": lambda: shard_batch(
                {
                    "input_ids": ones,
                    "position_ids": torch.tensor([[0, 1, 2, 3] * 2]),
                    "inputs_embeds": torch.ones(1, 8, 3),
                }
            ),
            "groups": lambda: sequence_parallel_groups(3),
        }
    )


def test_bad_batches_and_groups(rank_pool):
    errors = rank_pool(2).run(_bad_batches)[0]
    assert "padding is not supported" in errors["pad"]
    assert "ulysses_size 3 must divide the sequence-parallel group size 2" in errors["packed_ulysses"]
    assert "(batch, seqlen)" in errors["rank"]
    assert "multiple of 4" in errors["odd"]
    assert "got also pixel_values" in errors["unknown"]  # never dropped silently
    assert "token_type_ids must have the shape of input_ids" in errors["types_shape"]
    assert "token_type_ids with packed documents" in errors["packed_types"]
    assert "inputs_embeds must be (batch, seqlen, hidden)" in errors["embeds_shape"]
    assert "inputs_embeds with packed documents" in errors["packed_embeds"]
    assert "batch['inputs_embeds'] must be a torch.Tensor, got list" in errors["embeds_type"]
    assert "sp_size must be a positive int dividing the world size 2" in errors["groups"]
