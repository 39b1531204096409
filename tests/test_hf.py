"""transformers models with attn_implementation="ringflash": a sequence-parallel training step
equals the same model's single-process step with transformers' own eager attention (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import worker_device

from ringflash import reduce_gradients, sequence_parallel_cross_entropy, sequence_parallel_groups, shard_batch

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 48


def _model(model_type: str, attn_implementation: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0,
    )  # fmt: skip
    if model_type == "mistral":
        config = transformers.MistralConfig(sliding_window=8, **common)
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    ).float()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _hf_step(model_type: str, layout: str):
    import ringflash.integrations.hf as rf_hf

    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    model = _model(model_type, rf_hf.enable(group=groups.sp_group, layout=layout)).to(worker_device())
    shard = shard_batch({"input_ids": _ids().to(worker_device())}, groups.sp_group, layout=layout)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
    loss = sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    loss.backward()
    reduce_gradients(model, groups)
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("model_type", "layout", "world"),
    [("llama", "zigzag", 2), ("mistral", "stripe", 2), ("llama", "zigzag", 4)],
)
def test_hf_model_sequence_parallel_step(rank_pool, model_type, layout, world):
    results = rank_pool(world).run(_hf_step, model_type, layout)
    model = _model(model_type, "eager")
    ids = _ids()
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    for rank, (sp_loss, grads) in enumerate(results):
        assert abs(sp_loss - loss.item()) < 1e-5 * loss.item(), (rank, sp_loss, loss.item())
        assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
        for n, p in model.named_parameters():
            err = ((grads[n] - p.grad).norm() / p.grad.norm()).item()
            assert err < 1e-4, f"rank {rank} {n}: rel err {err:.2e}"


DOCS = (11, 23, 14)  # one packed row of SEQ tokens


def _hf_packed_step():
    import ringflash.integrations.hf as rf_hf

    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    model = _model("llama", rf_hf.enable(group=groups.sp_group)).to(worker_device())
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    batch = {"input_ids": _ids()[:1], "position_ids": positions}
    shard = shard_batch({k: v.to(worker_device()) for k, v in batch.items()}, groups.sp_group)
    logits = model(
        input_ids=shard["input_ids"], position_ids=shard["position_ids"], cu_seq_lens_q=shard["cu_seqlens"],
        use_cache=False,
    ).logits  # fmt: skip
    loss = sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    loss.backward()
    reduce_gradients(model, groups)
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


def test_hf_packed_sequences(rank_pool):
    """A packed row through a Llama model equals eager attention on each document alone."""
    results = rank_pool(2).run(_hf_packed_step)
    model = _model("llama", "eager")
    total = 0.0
    for ids in _ids()[0].split(list(DOCS)):
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits[:-1], ids[1:], reduction="sum")
    loss = total / (SEQ - len(DOCS))
    loss.backward()
    for rank, (sp_loss, grads) in enumerate(results):
        assert abs(sp_loss - loss.item()) < 1e-5 * loss.item(), (rank, sp_loss, loss.item())
        for n, p in model.named_parameters():
            err = ((grads[n] - p.grad).norm() / p.grad.norm()).item()
            assert err < 1e-4, f"rank {rank} {n}: rel err {err:.2e}"


def test_hf_rejects_unsupported_features(device):
    import ringflash.integrations.hf as rf_hf

    model = _model("llama", rf_hf.enable()).to(device)  # no process group: single-device ringflash
    ids = _ids().to(device)
    ours = model(input_ids=ids, use_cache=False).logits
    ref = _model("llama", "eager").to(device)(input_ids=ids, use_cache=False).logits
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    with pytest.raises(ValueError, match="attention weights"):
        model(input_ids=ids, use_cache=False, output_attentions=True)
