"""ring-flash-attn's Hugging Face adapter (substitute_hf_flash_attn / update_ring_flash_attn_params):
a model loaded with attn_implementation="flash_attention_2" runs the llama3 all-gather attention on
each rank's contiguous shard of one packed row; its logits and gradients equal transformers' eager
attention run on each document alone (fp32, 2 gloo ranks)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from distributed import errors_of, worker_device
from reference import rel_err

transformers = pytest.importorskip("transformers")

VOCAB = 64
DOCS = (5, 14, 13)  # 32 tokens: on 2 ranks the second document spans both shards


def _model(model_type: str, attn_implementation: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0,
    )  # fmt: skip
    if model_type == "mistral":  # windows of 6 keys, crossing the shards' boundary
        config = transformers.MistralConfig(sliding_window=6, **common)
    elif model_type == "gemma2":  # softcap 1.0 on scores of a few units; local layers windowed
        config = transformers.Gemma2Config(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=6, final_logit_softcapping=None,
            attn_logit_softcapping=1.0, initializer_range=0.2, **common,
        )  # fmt: skip
    elif model_type == "gpt_oss":  # attention sinks (one learned logit per head), windows; MoE of 2
        config = transformers.GptOssConfig(
            head_dim=16, num_local_experts=2, num_experts_per_tok=2, sliding_window=6, initializer_range=0.2,
            **common,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    if model_type == "gpt_oss":  # sink logits near the rows' LSE, so that they matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(4) + 2.0)
    return model.float()


def _batch(docs=DOCS):
    """One packed row: input_ids and position_ids (1, T) restarting per document, cu_seqlens, and
    a fixed (T, VOCAB) weight for the loss."""
    total = sum(docs)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, total), generator=gen)
    positions = torch.cat([torch.arange(n) for n in docs])[None]
    cu_seqlens = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    return ids, positions, cu_seqlens, torch.randn(total, VOCAB, generator=gen)


def _substitute(heads_k_stride: int):
    import ringflash.integrations.hf as rf_hf
    from ringflash import substitute_hf_flash_attn

    rf_hf.DATA_PARAMS.clear()
    rf_hf._PACKED.clear()
    substitute_hf_flash_attn(dist.group.WORLD, heads_k_stride)
    rf_hf.use_ring_attn(True)
    return rf_hf


def _ring_step(model_type: str, heads_k_stride: int):
    """One forward + backward of this rank's shard, as ring-flash-attn's README runs it."""
    from ringflash import update_ring_flash_attn_params

    rf_hf = _substitute(heads_k_stride)
    try:
        device, group = worker_device(), dist.group.WORLD
        model = _model(model_type, "flash_attention_2").to(device)
        assert model.config._attn_implementation == "flash_attention_2"
        ids, positions, cu_seqlens, weight = _batch()
        update_ring_flash_attn_params(cu_seqlens.to(device), group)
        n = ids.shape[1] // dist.get_world_size(group)
        shard = slice(dist.get_rank(group) * n, (dist.get_rank(group) + 1) * n)
        logits = model(input_ids=ids[:, shard].to(device), position_ids=positions[:, shard].to(device)).logits
        (logits[0] * weight[shard].to(device)).sum().backward()
        return logits[0].detach().cpu(), {k: p.grad.cpu() for k, p in model.named_parameters()}
    finally:
        rf_hf.use_ring_attn(False)  # leave the pool's ranks with transformers' own "flash_attention_2"


@pytest.mark.parametrize(
    ("model_type", "heads_k_stride"), [("llama", 1), ("mistral", 2), ("gemma2", 1), ("gpt_oss", 2)]
)
def test_substituted_flash_attention_2_equals_eager_per_document(rank_pool, model_type, heads_k_stride):
    """On 2 ranks: Llama (GQA, K/V gathered one head at a time), Mistral (sliding window), Gemma-2
    (softcap) and gpt-oss (attention sinks, whose gradients are compared too)."""
    results = rank_pool(2).run(_ring_step, model_type, heads_k_stride)
    model = _model(model_type, "eager")
    ids, _, _, weight = _batch()
    logits = torch.cat([model(input_ids=doc, use_cache=False).logits[0] for doc in ids.split(DOCS, dim=1)])
    (logits * weight).sum().backward()
    assert rel_err(torch.cat([out for out, _ in results]), logits) < 1e-4
    for name, p in model.named_parameters():  # replicated: the ranks' contributions sum to the gradient
        err = rel_err(sum(grads[name] for _, grads in results), p.grad)
        assert err < 1e-4, f"{name}: rel err {err:.2e}"


def _refusals():
    """Every rank's errors for what the adapter cannot honour."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ringflash import substitute_hf_flash_attn, update_ring_flash_attn_params

    rf_hf = _substitute(1)
    try:
        device, group = worker_device(), dist.group.WORLD
        rank = dist.get_rank(group)
        model = _model("llama", "flash_attention_2").to(device)
        ids, positions, cu_seqlens, _ = _batch()
        shard = slice(rank * 16, (rank + 1) * 16)
        ids, positions = ids[:, shard].to(device), positions[:, shard].to(device)

        def forward(input_ids=ids, position_ids=positions, **kw):
            return model(input_ids=input_ids, position_ids=position_ids, **kw)

        def update(docs):
            update_ring_flash_attn_params(_batch(docs)[2].to(device), group)

        attention = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
        q = torch.randn(1, 4, 16, 16, device=device)
        padded = torch.ones_like(ids)
        padded[0, 2] = 0
        errors = errors_of({
            "no_update": forward,
            "stride": lambda: substitute_hf_flash_attn(group, 0),
            "batch_2": lambda: (update(DOCS), forward(input_ids=ids.expand(2, -1), position_ids=None)),
            "stale": lambda: (update((20, 28)), forward()),  # 48 tokens prepared, 16 per rank given
            # restarts at 5 and 19 (rank 1's token 3), documents at 5 only: rank 1 sees it, both raise
            "positions": lambda: (update((5, 27)), forward()),
            "padding": lambda: (update(DOCS), forward(attention_mask=padded)),
            "non_causal": lambda: attention(torch.nn.Module(), q, q, q, None, is_causal=False),
            "dropout": lambda: attention(torch.nn.Module(), q, q, q, None, dropout=0.1),
        })  # fmt: skip
        rf_hf.use_ring_attn(False)  # transformers' own check again: it needs the flash-attn package
        if importlib.util.find_spec("flash_attn") is None:
            try:
                _model("llama", "flash_attention_2")
                errors["unsubstituted"] = None
            except ImportError as e:
                errors["unsubstituted"] = f"ImportError: {e}"
        return errors
    finally:
        rf_hf.use_ring_attn(False)


def test_substituted_flash_attention_2_refusals(rank_pool):
    for rank, errors in enumerate(rank_pool(2).run(_refusals)):
        expected = {
            "no_update": "call ringflash.update_ring_flash_attn_params",
            "stride": "heads_k_stride must be a positive int",
            "batch_2": "takes batch 1",
            "stale": "prepared a packed row of 48 tokens (24 per rank)",
            "positions": "restart at this rank's tokens [3]" if rank else "another rank of the group refused",
            "padding": "attention_mask with padding",
            "non_causal": "causal only",
            "dropout": "dropout",
        }
        if "unsubstituted" in errors:
            expected["unsubstituted"] = "FlashAttention2"
        assert errors.keys() == expected.keys()
        for case, message in expected.items():
            assert errors[case] is not None and message in errors[case], (rank, case, errors[case])
