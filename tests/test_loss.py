"""The chunked sequence-parallel loss equals the loss over materialized logits, value and
gradients, whatever the chunk size (including chunks that straddle rows and a ragged last one)."""

from __future__ import annotations

import pytest
import torch
from distributed import errors_of, worker_device

from ringflash import sequence_parallel_cross_entropy, shard_batch
from ringflash.loss import sequence_parallel_chunked_cross_entropy

VOCAB, DIM, SEQ = 48, 16, 24


def _chunked_vs_full(chunk_size: int):
    dev = worker_device()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 5:9] = -100  # ignored targets count in neither the sum nor the token count
    shard = shard_batch({"input_ids": ids.to(dev), "labels": labels.to(dev)})
    torch.manual_seed(0)
    head = torch.nn.Linear(DIM, VOCAB, bias=False).to(dev)
    embed = torch.nn.Embedding(VOCAB, DIM).to(dev)
    results = []
    for chunked in (False, True):
        head.zero_grad(), embed.zero_grad()
        hidden = embed(shard["input_ids"])
        if chunked:
            loss = sequence_parallel_chunked_cross_entropy(
                hidden, head, shard["target_ids"], chunk_size=chunk_size
            )
        else:
            loss = sequence_parallel_cross_entropy(head(hidden), shard["target_ids"])
        loss.backward()
        results.append((loss.item(), head.weight.grad.clone(), embed.weight.grad.clone()))
    return results


@pytest.mark.parametrize("chunk_size", [1, 5, 12, 4096])
def test_chunked_loss_matches_full_logits(rank_pool, chunk_size):
    for (full_loss, *full_grads), (loss, *grads) in rank_pool(2).run(_chunked_vs_full, chunk_size):
        assert abs(loss - full_loss) < 1e-6 * full_loss
        for got, want in zip(grads, full_grads):
            assert ((got - want).norm() / want.norm()).item() < 1e-6


def _bad_chunks():
    h, t = torch.zeros(1, 4, 8), torch.zeros(1, 4, dtype=torch.long)
    head = torch.nn.Linear(8, 3)
    return errors_of(
        {
            "chunk": lambda: sequence_parallel_chunked_cross_entropy(h, head, t, chunk_size=0),
            "shape": lambda: sequence_parallel_chunked_cross_entropy(h[0], head, t),
            "targets": lambda: sequence_parallel_chunked_cross_entropy(h, head, t[:, :3]),
        }
    )


def test_chunked_loss_bad_inputs(rank_pool):
    errors = rank_pool(2).run(_bad_chunks)[0]
    assert errors["chunk"] == "ValueError: chunk_size must be a positive int, got 0"
    assert "hidden must be (batch, seqlen, dim)" in errors["shape"]
    assert "got (1, 4, 8) and (1, 3)" in errors["targets"]


def _loss_targets():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 5, generator=g).to(worker_device())
    targets = torch.randint(0, 5, (2, 3), generator=g).to(worker_device())
    hidden, head = logits[..., :4], torch.nn.Linear(4, 5).to(worker_device())
    int64 = sequence_parallel_cross_entropy(logits, targets)
    int32 = sequence_parallel_cross_entropy(logits, targets.int())
    chunked = [sequence_parallel_chunked_cross_entropy(hidden, head, t) for t in (targets, targets.int())]
    errors = errors_of({
        # before: the (3, 2) targets paired with other tokens' logits, a wrong loss without an error
        "transposed": lambda: sequence_parallel_cross_entropy(logits, targets.T.contiguous()),
        "flattened": lambda: sequence_parallel_cross_entropy(logits, targets.flatten()),
        "float": lambda: sequence_parallel_cross_entropy(logits, targets.float()),
        "chunked float": lambda: sequence_parallel_chunked_cross_entropy(hidden, head, targets.float()),
        "list": lambda: sequence_parallel_cross_entropy(logits, targets.tolist()),
    })  # fmt: skip
    return int64.item(), int32.item(), [c.item() for c in chunked], errors


def test_loss_target_shapes_and_dtypes(rank_pool):
    """Any integer target dtype gives the int64 loss; targets that do not match the logits'
    (batch, seqlen) exactly, or are not integers, raise on every rank."""
    for int64, int32, chunked, errors in rank_pool(2).run(_loss_targets):
        assert int32 == int64 and chunked[0] == chunked[1]
        shapes = "logits must be (batch, seqlen, vocab) and target_ids (batch, seqlen), got (2, 3, 5) and"
        assert errors["transposed"] == f"ValueError: {shapes} (3, 2)"
        assert errors["flattened"] == f"ValueError: {shapes} (6,)"
        for name in ("float", "chunked float"):
            assert errors[name] == (
                "TypeError: target_ids must be an integer tensor of class ids, got torch.float32"
            )
        assert errors["list"] == "TypeError: target_ids must be a torch.Tensor of class ids, got list"
