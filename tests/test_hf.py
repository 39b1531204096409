"""transformers models with attn_implementation="ringflash": a sequence-parallel training step
equals the same model's single-process step with transformers' own eager attention (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import worker_device
from reference import reference_attention, rel_err

from ringflash import reduce_gradients, sequence_parallel_cross_entropy, sequence_parallel_groups, shard_batch

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 48


def _model(model_type: str, attn_implementation: str, feature: bool = True):
    """A tiny model; ``feature=False`` drops Gemma-2's softcap / gpt-oss's sinks (to check that the
    weights make them matter: initializer_range 0.2 and sink logits near the rows' LSE)."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0,
    )  # fmt: skip
    if model_type == "mistral":
        config = transformers.MistralConfig(sliding_window=8, **common)
    elif model_type == "gemma2":  # softcap 1.0 on scores of a few units; local layers windowed
        config = transformers.Gemma2Config(
            head_dim=16, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=None,
            attn_logit_softcapping=1.0 if feature else None, initializer_range=0.2, **common,
        )  # fmt: skip
    elif model_type == "gpt_oss":  # attention sinks, one learned logit per head; MoE of 2 experts
        config = transformers.GptOssConfig(
            head_dim=16, num_local_experts=2, num_experts_per_tok=2, sliding_window=8, initializer_range=0.2,
            **common,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    ).float()
    if model_type == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(4) + 2.0 if feature else torch.full((4,), -1e4))
    return model


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))[:batch]


def _hf_step(model_type: str, layout: str, batch: int):
    import ringflash.integrations.hf as rf_hf

    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    model = _model(model_type, rf_hf.enable(group=groups.sp_group, layout=layout)).to(worker_device())
    shard = shard_batch({"input_ids": _ids(batch).to(worker_device())}, groups.sp_group, layout=layout)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
    loss = sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    loss.backward()
    reduce_gradients(model, groups)
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


def _eager_step(model_type: str, batch: int, feature: bool = True):
    model = _model(model_type, "eager", feature)
    ids = _ids(batch)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    return model, loss


# 2 ranks each: the integration's path does not depend on the group's size (the ring's behaviour
# over 3 and 4 ranks is tests/test_ring.py's; HF Llama on 2 x 2 ranks is tests/test_deepspeed.py's).
@pytest.mark.parametrize(
    ("model_type", "layout", "world"),
    [("llama", "zigzag", 2), ("mistral", "stripe", 2), ("gemma2", "zigzag", 2), ("gpt_oss", "contiguous", 2)],
)  # fmt: skip
def test_hf_model_sequence_parallel_step(rank_pool, model_type, layout, world):
    """Gemma-2 (softcap) and gpt-oss (sinks, whose gradients are compared too) included."""
    batch = 1 if model_type in ("gemma2", "gpt_oss") else 2  # batch 1: the interpreter is slow
    results = rank_pool(world).run(_hf_step, model_type, layout, batch)
    model, loss = _eager_step(model_type, batch)
    if model_type in ("gemma2", "gpt_oss"):  # the feature matters: without it the test would fail
        _, without = _eager_step(model_type, batch, feature=False)
        assert abs(without.item() - loss.item()) > 100 * 1e-5 * loss.item()
    for rank, (sp_loss, grads) in enumerate(results):
        assert abs(sp_loss - loss.item()) < 1e-5 * loss.item(), (rank, sp_loss, loss.item())
        assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
        for n, p in model.named_parameters():
            err = ((grads[n] - p.grad).norm() / p.grad.norm()).item()
            assert err < 1e-4, f"rank {rank} {n}: rel err {err:.2e}"


DOCS = (11, 23, 14)  # one packed row of SEQ tokens


def _hf_packed_step(sp_mode: str):
    import ringflash.integrations.hf as rf_hf

    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    model = _model("llama", rf_hf.enable(group=groups.sp_group, sp_mode=sp_mode)).to(worker_device())
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


@pytest.mark.parametrize("sp_mode", ["ring", "allgather", "auto"])
def test_hf_packed_sequences(rank_pool, sp_mode):
    """A packed row through a Llama model equals eager attention on each document alone."""
    results = rank_pool(2).run(_hf_packed_step, sp_mode)
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


def test_hf_refuses_keywords_it_cannot_honour(device):
    """An attention keyword that is neither used nor known to be irrelevant is refused, not
    swallowed; None values and the known plumbing keywords pass."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import ringflash.integrations.hf as rf_hf

    attention = ALL_ATTENTION_FUNCTIONS[rf_hf.enable()]
    module = torch.nn.Module()
    q = torch.randn(1, 2, 8, 16, device=device)  # (batch, heads, seqlen, head_dim)
    out, weights = attention(module, q, q, q, None, position_ids=torch.arange(8)[None], use_cache=False,
                             head_mask=None)  # fmt: skip
    assert out.shape == (1, 8, 2, 16) and weights is None
    with pytest.raises(ValueError, match=r"cannot honour the keyword argument\(s\) \['alibi', 'head_mask'\]"):
        attention(module, q, q, q, None, alibi=torch.zeros(2), head_mask=torch.ones(2))
    with pytest.raises(ValueError, match="dropout"):
        attention(module, q, q, q, None, dropout=0.1)


def _packed_positions(docs: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in docs])[None]


def test_hf_packed_position_ids_one_device(device):
    """Packed rows given only by restarting position_ids (no cu_seq_lens_q), as
    DataCollatorWithFlattening makes them: each document's logits equal eager attention on that
    document alone (two layers, so a leak in the first would show in the second's input too).
    Both rows are packed, so the rows are flattened into one packed row."""
    import ringflash.integrations.hf as rf_hf

    rows = (DOCS, (30, 18))
    model = _model("llama", rf_hf.enable()).to(device)  # no process group: single-device ringflash
    ref = _model("llama", "eager").to(device)
    ids = _ids().to(device)
    positions = torch.cat([_packed_positions(docs) for docs in rows]).to(device)
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        for row, docs in enumerate(rows):
            for doc, (start, n) in enumerate(zip([0, *torch.tensor(docs).cumsum(0).tolist()], docs)):
                alone = ref(input_ids=ids[row : row + 1, start : start + n], use_cache=False).logits[0]
                err = ((ours[row, start : start + n] - alone).norm() / alone.norm()).item()
                assert err < 1e-4, f"row {row} document {doc}: rel err {err:.2e}"


def _hf_packed_without_cu_seqlens(layout: str, docs: tuple[int, ...], through_shard_batch: bool):
    """Every rank's error for a packed row whose cu_seqlens the caller forgot."""
    from distributed import errors_of

    import ringflash.integrations.hf as rf_hf
    from ringflash import shard_sequence

    group = sequence_parallel_groups(torch.distributed.get_world_size()).sp_group
    model = _model("llama", rf_hf.enable(group=group, layout=layout)).to(worker_device())
    batch = {"input_ids": _ids()[:1], "position_ids": _packed_positions(docs)}
    batch = {k: v.to(worker_device()) for k, v in batch.items()}
    if through_shard_batch:
        shard = shard_batch(batch, group, layout=layout)
    else:  # as a hand-written loader would shard it
        shard = {k: shard_sequence(v, group, 1, layout=layout) for k, v in batch.items()}
    forward = lambda: model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False)  # noqa: E731
    return errors_of({"forward": forward})["forward"]


@pytest.mark.parametrize(
    ("layout", "docs", "through_shard_batch"),
    [("zigzag", DOCS, True), ("contiguous", (24, 24), False), ("contiguous", (12, 36), False)],
)  # fmt: skip
def test_hf_packed_position_ids_sequence_parallel_refused(rank_pool, layout, docs, through_shard_batch):
    """Restarting position_ids without cu_seq_lens_q raise ValueError on every rank. Contiguous
    shards of 2 ranks: with documents (24, 24) each rank's positions (0..23) look like an unpacked
    shard at a constant offset, so only the ranks' exchange reveals the restart; with (12, 36) rank
    0 sees its restart but rank 1 does not, and must raise too instead of waiting in the ring."""
    errors = rank_pool(2).run(_hf_packed_without_cu_seqlens, layout, docs, through_shard_batch, timeout=120)
    for rank, error in enumerate(errors):
        assert error is not None and error.startswith("ValueError: position_ids restart"), (rank, error)
        assert 'cu_seq_lens_q=shard["cu_seqlens"]' in error, (rank, error)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: sliding-window masks as well
def test_hf_refuses_padding_attention_mask(device, model_type):
    """A 2D attention_mask with padding (zeros) raises ValueError: transformers builds no mask
    for an implementation without a mask function, so the padding would otherwise never reach
    the attention and padded keys would be attended to. An all-ones mask changes nothing."""
    import ringflash.integrations.hf as rf_hf

    model = _model(model_type, rf_hf.enable()).to(device)  # no process group: one device
    ids = _ids().to(device)
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        ones = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        assert torch.equal(plain, ones)
        for padded in ([0] * 3 + [1] * (SEQ - 3), [1] * (SEQ - 3) + [0] * 3):  # left, right
            mask = torch.tensor([[1] * SEQ, padded], device=device)
            with pytest.raises(ValueError, match="attention_mask with padding"):
                model(input_ids=ids, attention_mask=mask, use_cache=False)


def _hf_padding_mask_sequence_parallel():
    """Every rank's error when only the last rank's shard of the attention_mask has padding."""
    from distributed import errors_of

    import ringflash.integrations.hf as rf_hf

    group = sequence_parallel_groups(torch.distributed.get_world_size()).sp_group
    model = _model("llama", rf_hf.enable(group=group)).to(worker_device())
    shard = shard_batch({"input_ids": _ids(1).to(worker_device())}, group)
    mask = torch.ones_like(shard["input_ids"])
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        mask[:, -2:] = 0

    def forward(m: torch.Tensor):
        ids, positions = shard["input_ids"], shard["position_ids"]
        return lambda: model(input_ids=ids, position_ids=positions, attention_mask=m, use_cache=False)

    return errors_of({"padded": forward(mask), "ones": forward(torch.ones_like(mask))})


def test_hf_padding_mask_sequence_parallel_refused(rank_pool):
    """Padding in one rank's shard raises ValueError on every rank (none is left waiting in the
    ring); all-ones masks pass."""
    for rank, errors in enumerate(rank_pool(2).run(_hf_padding_mask_sequence_parallel, timeout=120)):
        assert errors["ones"] is None, (rank, errors)
        padded = errors["padded"]
        assert padded is not None and "attention_mask with padding" in padded, (rank, errors)


def test_hf_keyword_edge_cases(device):
    """Bidirectional attention with a sliding window is refused: transformers itself gives it two
    widths (FlashAttention: w - 1 keys each side; eager: w each side), and a one-sided window
    would attend to every later key. Loss and output plumbing keywords that reach the attention
    function (Trainer's num_items_in_batch, output_hidden_states) pass: they cannot change it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import ringflash.integrations.hf as rf_hf

    attention = ALL_ATTENTION_FUNCTIONS[rf_hf.enable()]
    module = torch.nn.Module()
    q = torch.randn(1, 2, 8, 16, device=device)  # (batch, heads, seqlen, head_dim)
    with pytest.raises(ValueError, match="sliding_window"):
        attention(module, q, q, q, None, sliding_window=4, is_causal=False)
    module.is_causal = False  # an encoder's attention layer
    with pytest.raises(ValueError, match="sliding_window"):
        attention(module, q, q, q, None, sliding_window=4)
    out, _ = attention(module, q, q, q, None, num_items_in_batch=torch.tensor(7), output_hidden_states=True)
    assert out.shape == (1, 8, 2, 16)


def test_hf_mask_patterns(device):
    """The attention pattern transformers builds into a mask function is read: causal, causal
    sliding windows (the window reaches the attention as ``sliding_window``), packed documents
    and chunks that hold the whole sequence need no mask; shorter chunks (Llama-4) become
    ``AttentionChunks``; on one device any other pattern (Gemma-3's bidirectional image blocks,
    bidirectional windows) becomes a TileMask of exactly the pattern (sequence parallel:
    test_hf_blockwise.py; chunks: test_llama4_chunks_sequence_parallel_step_equals_eager)."""
    from test_block_masks import decoded
    from transformers import masking_utils as mu

    import ringflash.integrations.hf as rf_hf
    from ringflash import TileMask

    mask = mu.ALL_MASK_ATTENTION_FUNCTIONS[rf_hf.enable()]
    packed = mu.packed_sequence_mask_function(torch.zeros(1, 8, dtype=torch.long))
    window, one_chunk = mu.sliding_window_causal_mask_function(4), mu.chunked_causal_mask_function(8, None)
    passing = [mu.causal_mask_function, mu.bidirectional_mask_function, window, one_chunk, packed]
    if hasattr(mu, "remap_positions_for_packed_sequence"):  # transformers >= 5.23
        remapped = mu.remap_positions_for_packed_sequence(mu.causal_mask_function, torch.arange(8)[None])
        passing.append(mu.and_masks(remapped, packed))
    for ok in passing:
        assert mask(batch_size=1, q_length=8, kv_length=8, mask_function=ok) is None
    # One device: chunks that split the keys go to the attention as AttentionChunks.
    chunked = mu.chunked_causal_mask_function(4, None)
    found = mask(batch_size=1, q_length=8, kv_length=8, mask_function=chunked)
    assert found == rf_hf.AttentionChunks(4, 0, 0)
    # Any other pattern, on one device: a block-sparse TileMask of exactly the pattern.
    images = torch.tensor([[-1, 0, 0, 0, -1, -1, 1, 1]])  # Gemma-3's image blocks, bidirectional inside
    others = [mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(images)),
              mu.sliding_window_bidirectional_mask_function(4)]  # fmt: skip
    for fn in others:
        tiles = mask(batch_size=1, q_length=8, kv_length=8, mask_function=fn)
        assert isinstance(tiles, TileMask)
        idx, zero = torch.arange(8), torch.tensor(0)
        expected = fn(zero, zero, idx[:, None], idx[None, :]).expand(8, 8)
        assert torch.equal(decoded(tiles)[0, 0], expected)
        assert mask(batch_size=1, q_length=3, q_offset=5, kv_length=8, mask_function=fn).seqlen_q == 3
    # transformers 4.53-4.5x call it with cache_position instead of q_length/q_offset.
    old_call = dict(batch_size=2, cache_position=torch.arange(8), kv_length=8, kv_offset=0)
    assert mask(**old_call, mask_function=mu.causal_mask_function, attention_mask=torch.ones(2, 8)) is None
    with pytest.raises(ValueError, match="attention_mask with padding"):
        mask(**old_call, mask_function=mu.causal_mask_function, attention_mask=torch.ones(2, 8).tril())


def test_gemma3_bidirectional_text_model_step_equals_eager(device, monkeypatch):
    """Gemma-3 with ``use_bidirectional_attention`` (EmbeddingGemma): bidirectional attention on
    the full layers, a bidirectional sliding window on the local ones, both patterns that the
    model writes itself; on one device they run as block-sparse masks, and a training step's
    logits and gradients equal eager attention's."""
    import ringflash.integrations.hf as rf_hf

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention=True,
        initializer_range=0.2,
    )  # fmt: skip
    ids = _ids(2)[:, :20].to(device)
    built = []  # the patterns made into block masks: one per layer type (full and sliding)
    make = rf_hf.pattern_tile_mask
    monkeypatch.setattr(rf_hf, "pattern_tile_mask", lambda *a: built.append(1) or make(*a))
    results = []
    for implementation in (rf_hf.enable(), "eager"):
        torch.manual_seed(0)
        model = transformers.Gemma3TextModel(config).float().to(device)
        model.config._attn_implementation = implementation
        hidden = model(input_ids=ids).last_hidden_state
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).to(device)
        (hidden * weights).sum().backward()  # (the norm makes hidden.square().mean() flat)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        results.append((hidden.detach(), grads))
    (ours, ours_grads), (eager, eager_grads) = results
    assert len(built) == 2
    assert rel_err(ours, eager) < 1e-5
    assert len(ours_grads) == len(eager_grads)
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(ours_grads, eager_grads))


def test_image_blocks_and_prefix_lm_through_the_attention_function(device):
    """Gemma-3's image blocks (``or_masks(causal, blockwise_overlay(groups))``: sequence 0 holds an
    image) and a PaliGemma-like prefix (sequence 1's first 140 positions one bidirectional block)
    through the registered mask and attention functions: out and gradients against float64
    attention under the same dense mask, with sinks and GQA; blocks of 128 with 200 keys."""
    from transformers import AttentionInterface
    from transformers import masking_utils as mu

    import ringflash.integrations.hf as rf_hf

    name = rf_hf.enable()
    mask_fn, attention = mu.ALL_MASK_ATTENTION_FUNCTIONS[name], AttentionInterface()[name]
    s = 200
    groups = torch.full((2, s), -1)
    groups[0, 20:150], groups[1, :140] = 0, 1  # an image; a prefix
    fn = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(groups.to(device)))
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(2, h, s, 16, generator=g) for h in (2, 1, 1, 2))  # (batch, heads, ...)
    sinks = torch.randn(2, generator=g)
    tiles = mask_fn(batch_size=2, q_length=s, kv_length=s, mask_function=fn, device=device)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out, _ = attention(torch.nn.Module(), *leaves, tiles, s_aux=sinks.to(device))
    grads = torch.autograd.grad(out, leaves, dout.transpose(1, 2).to(device))
    idx = torch.arange(s, device=device)
    dense = fn(torch.arange(2, device=device)[:, None, None], 0, idx[None, :, None], idx[None, None, :])
    ref = [t.double().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref, sinks=sinks, mask=dense.cpu()[:, None])
    ref_grads = torch.autograd.grad(ref_out, ref, dout.double().transpose(1, 2))
    assert rel_err(out, ref_out) < 1e-4
    for a, e in zip(grads, ref_grads):
        assert rel_err(a.transpose(1, 2), e) < 1e-4


def _llama4(attn_implementation: str, chunk: int = 4, positions: int = 64) -> torch.nn.Module:
    """A tiny Llama-4 text model: chunks of ``chunk`` positions on its first layer (rope,
    chunked), full causal attention on its second (no rope)."""
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=1,
        attention_chunk_size=chunk, max_position_embeddings=positions, no_rope_layers=[1, 0],
        interleave_moe_layer_step=2, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.float()


LLAMA4_TOKENS, LLAMA4_CHUNK = 512, 192  # zigzag on 2 ranks: halves of 128 tokens, whole mask blocks


def _llama4_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, LLAMA4_TOKENS), generator=torch.Generator().manual_seed(8))


def _llama4_sharded_step():
    import ringflash.integrations.hf as rf_hf

    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    model = _llama4(rf_hf.enable(group=groups.sp_group), LLAMA4_CHUNK, LLAMA4_TOKENS).to(worker_device())
    shard = shard_batch({"input_ids": _llama4_ids().to(worker_device())}, groups.sp_group)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
    loss = sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    loss.backward()
    reduce_gradients(model, groups)
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


def test_chunk_block_mask_is_kept_per_size_and_length():
    """hf.chunk_block_mask: causal within chunks counted from 0, one mask per (size, length)."""
    from test_block_masks import decoded

    import ringflash.integrations.hf as rf_hf

    seen = {}
    for size, tokens in ((192, 512), (192, 384), (100, 384), (192, 512)):
        mask = rf_hf.chunk_block_mask(size, tokens, "cpu")
        q, kv = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
        assert torch.equal(decoded(mask)[0, 0], (q // size == kv // size) & (kv <= q)), (size, tokens)
        assert seen.setdefault((size, tokens), mask) is mask  # the same length again: the kept mask
    assert len({id(m) for m in seen.values()}) == 3


def test_llama4_chunks_sequence_parallel_step_equals_eager(rank_pool):
    """Sequence parallel (2 ranks, zigzag), Llama-4's chunks (192 positions, not a multiple of the
    mask's 128-blocks) run as a block mask over the whole sequence: the loss and every gradient
    equal eager attention's on one process; the chunks matter (chunks past the sequence, plain
    causal attention, give another loss)."""
    results = rank_pool(2).run(_llama4_sharded_step, timeout=600)
    losses = []
    for chunk in (LLAMA4_CHUNK, 4 * LLAMA4_TOKENS):
        model = _llama4("eager", chunk, LLAMA4_TOKENS)
        ids = _llama4_ids()
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        losses.append(loss)
        if chunk == LLAMA4_CHUNK:
            loss.backward()
            eager = model
    assert abs(losses[0].item() - losses[1].item()) > 1e-3 * losses[0].item()
    for rank, (sp_loss, grads) in enumerate(results):
        assert abs(sp_loss - losses[0].item()) < 1e-5 * losses[0].item(), (rank, sp_loss, losses[0].item())
        for n, p in eager.named_parameters():
            if p.grad is not None:
                err = ((grads[n] - p.grad).norm() / p.grad.norm()).item()
                assert err < 1e-4, f"rank {rank} {n}: rel err {err:.2e}"


def test_compiled_patterns_equal_eager(device):
    """Under torch.compile the pattern is still read from the mask function (a graph break), not
    skipped: Gemma-3's image blocks (the mask built inside the compiled function, as
    transformers' model forward does) and Llama-4's chunks give eager's outputs, not plain causal
    attention's; ``fullgraph=True`` refuses the break instead of running the wrong mask."""
    from transformers import AttentionInterface
    from transformers import masking_utils as mu

    import ringflash.integrations.hf as rf_hf

    name = rf_hf.enable()
    mask_fn, attention = mu.ALL_MASK_ATTENTION_FUNCTIONS[name], AttentionInterface()[name]
    s = 40
    groups = torch.full((1, s), -1, device=device)
    groups[0, 5:30] = 0  # one image: bidirectional inside

    def image_blocks(q, k, v, groups):
        fn = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(groups))
        tiles = mask_fn(batch_size=1, q_length=s, kv_length=s, mask_function=fn, device=q.device)
        return attention(torch.nn.Module(), q, k, v, tiles)[0]

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, s, 16, generator=g).to(device) for _ in range(3))
    eager = image_blocks(q, k, v, groups)
    causal = attention(torch.nn.Module(), q, k, v, None)[0]
    torch._dynamo.reset()
    compiled = torch.compile(image_blocks, backend="aot_eager")(q, k, v, groups)
    assert rel_err(compiled, eager) < 1e-6 and rel_err(eager, causal) > 1e-2
    torch._dynamo.reset()
    with pytest.raises(Exception, match="attention pattern"):
        torch.compile(image_blocks, backend="aot_eager", fullgraph=True)(q, k, v, groups)

    torch._dynamo.reset()
    ids = _ids(1)[:, :14].to(device)
    model = _llama4(name).to(device)
    eager_logits = model(input_ids=ids, use_cache=False).logits
    compiled_logits = torch.compile(model, backend="aot_eager")(input_ids=ids, use_cache=False).logits
    model.config.attention_chunk_size = 64  # chunks past the sequence: plain causal attention
    causal_logits = model(input_ids=ids, use_cache=False).logits
    assert rel_err(compiled_logits, eager_logits) < 1e-5 and rel_err(eager_logits, causal_logits) > 1e-2
    torch._dynamo.reset()


def test_llama4_chunked_attention_step_and_generate_equal_eager(device):
    """Llama-4's chunked attention on one device: a training step's loss and gradients and a
    greedy generate (a sliding cache layer hands the chunked layer only its last keys) equal
    eager attention's; the chunks matter (plain causal attention gives other logits)."""
    import ringflash.integrations.hf as rf_hf

    ids = _ids(2)[:, :14].to(device)
    results = []
    for implementation in (rf_hf.enable(), "eager", "causal"):
        model = _llama4("eager" if implementation == "causal" else implementation).to(device)
        if implementation == "causal":  # the chunk size past the sequence: chunks that change nothing
            model.config.attention_chunk_size = 64
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        with torch.no_grad():
            tokens = model.generate(
                ids[:, :6], attention_mask=torch.ones_like(ids[:, :6]), max_new_tokens=9, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        results.append((logits.detach(), loss.detach(), grads, tokens))
    (ours, eager, causal) = results
    assert rel_err(ours[0], eager[0]) < 1e-5 and rel_err(ours[0], causal[0]) > 1e-2
    assert abs(ours[1] - eager[1]) < 1e-5
    assert len(ours[2]) == len(eager[2]) and all(rel_err(a, b) < 1e-4 for a, b in zip(ours[2], eager[2]))
    assert ours[3].shape == (2, 15) and torch.equal(ours[3], eager[3])


def test_hf_refuses_keys_that_do_not_end_at_the_last_query(device):
    """The attention aligns the last query with the last key (flash-attn's bottom-right
    alignment). A StaticCache hands it all max_cache_len slots, unfilled ones last: without an
    attention_mask that used to attend to the empty slots silently (logits ~50% off); now
    ValueError. A DynamicCache's decode step (keys = past + queries) still equals eager, and
    bidirectional attention (e.g. over encoder states) may have more keys than queries."""
    from transformers import DynamicCache, StaticCache
    from transformers import masking_utils as mu

    import ringflash.integrations.hf as rf_hf

    model = _model("llama", rf_hf.enable()).to(device)  # no process group: one device
    ids = _ids(1)[:, :12].to(device)
    with torch.no_grad(), pytest.raises(ValueError, match="StaticCache"):
        model(
            input_ids=ids, past_key_values=StaticCache(config=model.config, max_cache_len=16), use_cache=True
        )
    ref = _model("llama", "eager").to(device)
    with torch.no_grad():
        logits = []
        for m in (model, ref):
            cache = DynamicCache(config=m.config)
            m(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
            logits.append(m(input_ids=ids[:, 8:], past_key_values=cache, use_cache=True).logits)
    assert ((logits[0] - logits[1]).norm() / logits[1].norm()).item() < 1e-4

    mask = mu.ALL_MASK_ATTENTION_FUNCTIONS[rf_hf.NAME]
    causal = dict(batch_size=1, mask_function=mu.causal_mask_function)
    assert mask(**causal, q_length=4, q_offset=8, kv_length=12, kv_offset=0) is None  # decode
    assert mask(**causal, q_length=4, q_offset=8, kv_length=7, kv_offset=5) is None  # sliding cache
    for kw in (
        dict(q_length=8, q_offset=torch.tensor(0), kv_length=16),  # StaticCache (a tensor offset)
        dict(cache_position=torch.arange(8), kv_length=16, kv_offset=0),  # transformers 4.5x's call
        dict(q_length=8, q_offset=0, kv_length=12, attention_mask=torch.ones(1, 12)),  # a prefix
    ):
        with pytest.raises(ValueError, match="last query"):
            mask(**causal, **kw)
    assert mask(batch_size=1, mask_function=mu.bidirectional_mask_function, q_length=8, kv_length=16) is None


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gpt_oss"])
def test_generate_gives_eagers_tokens(device, model_type):
    """Greedy ``generate`` with a KV cache (prefill, then one query against the cached keys per
    step: bottom-right causal) gives the tokens of the same weights under eager attention."""
    import ringflash.integrations.hf as rf_hf

    prompt = _ids(2)[:, :12].to(device)
    tokens = {}
    for implementation in (rf_hf.enable(), "eager"):
        model = _model(model_type, implementation).to(device).eval()
        with torch.no_grad():
            tokens[implementation] = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
    ours, eager = tokens.values()
    assert ours.shape == (2, 22) and torch.equal(ours, eager)


def _sharded_generate(capacity: int, spread_from: int | None = None):
    """Greedy generate with the KV cache sharded over the ranks (ShardedKVCache) against eager
    attention's generate in one process, on every rank (and the sharded decode was handed
    ``spread_from``, and no device read of the bounds)."""
    import ringflash.integrations.hf as rf_hf

    group = sequence_parallel_groups(torch.distributed.get_world_size()).sp_group
    prompt = _ids(2)[:, :12].to(worker_device())
    tokens, seen = [], set()

    def recording(*args, **kwargs):  # what the attention hands the sharded decode
        seen.add((kwargs.get("spread_from"), kwargs.get("check_bounds")))
        return sharded_decode(*args, **kwargs)

    sharded_decode, rf_hf.sp_flash_attn_with_kvcache = rf_hf.sp_flash_attn_with_kvcache, recording
    try:
        tokens = _generate_both(rf_hf, group, prompt, capacity, spread_from)
    finally:
        rf_hf.sp_flash_attn_with_kvcache = sharded_decode
    # Default ranges: the layer checks the room on the host, the attention reads nothing back.
    return tokens[0].shape == (2, 20) and torch.equal(tokens[0], tokens[1]) and seen == {(spread_from, False)}


def _generate_both(rf_hf, group, prompt, capacity: int, spread_from: int | None) -> list:
    from ringflash.integrations.hf_sharded_cache import ShardedKVCache

    tokens = []
    for implementation in (rf_hf.enable(group=group), "eager"):
        model = _model("llama", implementation).to(worker_device()).eval()
        sharded = implementation != "eager"
        layers = model.config.num_hidden_layers
        cache = ShardedKVCache(layers, capacity, group, spread_from=spread_from) if sharded else None
        with torch.no_grad():
            tokens.append(model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                pad_token_id=0, past_key_values=cache,
            ))  # fmt: skip
    return tokens


@pytest.mark.skipif(
    not hasattr(transformers, "cache_utils") or not hasattr(transformers.cache_utils, "CacheLayerMixin"),
    reason="ShardedKVCache needs transformers' CacheLayerMixin (5.x)",
)
def test_generate_over_a_sharded_cache_gives_eagers_tokens(rank_pool):
    """Capacity 11 per rank: the 12-token prompt already spans both ranks, the generated tokens
    land on rank 1."""
    assert rank_pool(2).run(_sharded_generate, 11, timeout=180) == [True, True]


@pytest.mark.skipif(
    not hasattr(transformers, "cache_utils") or not hasattr(transformers.cache_utils, "CacheLayerMixin"),
    reason="ShardedKVCache needs transformers' CacheLayerMixin (5.x)",
)
def test_generate_with_tokens_dealt_past_the_prompt_gives_eagers_tokens(rank_pool):
    """spread_from=8: 4 prompt positions per rank, the last 4 prompt tokens and the 8 generated
    ones dealt out round-robin (6 per rank: capacity 10)."""
    assert rank_pool(2).run(_sharded_generate, 10, 8, timeout=180) == [True, True]


def _llama4_sharded_generate():
    from distributed import errors_of

    import ringflash.integrations.hf as rf_hf
    from ringflash.integrations.hf_sharded_cache import ShardedKVCache

    group = sequence_parallel_groups(torch.distributed.get_world_size()).sp_group
    model = _llama4(rf_hf.enable(group=group)).to(worker_device()).eval()
    prompt = _ids(1)[:, :12].to(worker_device())

    def generate():
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                           pad_token_id=0, past_key_values=ShardedKVCache(2, 16, group))  # fmt: skip

    return errors_of({"generate": generate})["generate"]


@pytest.mark.skipif(
    not hasattr(transformers, "cache_utils") or not hasattr(transformers.cache_utils, "CacheLayerMixin"),
    reason="ShardedKVCache needs transformers' CacheLayerMixin (5.x)",
)
def test_llama4_chunks_over_a_sharded_cache_are_refused(rank_pool):
    """Sequence-parallel decoding does not apply Llama-4's chunks: refused on every rank, not run
    as attention over the whole cache."""
    errors = rank_pool(2).run(_llama4_sharded_generate, timeout=180)
    assert all(e and "attention chunks (Llama-4) over a ShardedKVCache" in e for e in errors), errors


def _too_small_a_sharded_cache(spread_from: int | None):
    from distributed import errors_of

    return errors_of({"generate": lambda: _sharded_generate(9, spread_from)})["generate"]


@pytest.mark.skipif(
    not hasattr(transformers, "cache_utils") or not hasattr(transformers.cache_utils, "CacheLayerMixin"),
    reason="ShardedKVCache needs transformers' CacheLayerMixin (5.x)",
)
@pytest.mark.parametrize("spread_from", [None, 8])
def test_a_sharded_cache_too_small_raises_on_every_rank(rank_pool, spread_from):
    """19 positions on 2 ranks of 9: the layers find it on the host, every rank alike."""
    errors = rank_pool(2).run(_too_small_a_sharded_cache, spread_from, timeout=180)
    assert all(e and "make the cache's capacity larger" in e for e in errors), errors


def _eager_with_a_sharded_cache():
    from distributed import errors_of

    from ringflash.integrations.hf_sharded_cache import ShardedKVCache

    model = _model("llama", "eager").to(worker_device()).eval()
    cache = ShardedKVCache(model.config.num_hidden_layers, 32)
    prompt = _ids(1)[:, :6].to(worker_device())

    def generate():
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                           pad_token_id=0, past_key_values=cache)  # fmt: skip

    error = errors_of({"generate": generate})["generate"]
    # What that step left behind (the other layers' handed-over keys) reaches no later call.
    return error, _sharded_generate(11)


@pytest.mark.skipif(
    not hasattr(transformers, "cache_utils") or not hasattr(transformers.cache_utils, "CacheLayerMixin"),
    reason="ShardedKVCache needs transformers' CacheLayerMixin (5.x)",
)
def test_sharded_cache_refuses_an_attention_that_is_not_ringflash(rank_pool):
    """Eager attention would attend only the new tokens that ShardedKVCache hands it: the second
    step raises instead of generating from the last token alone; a sharded generate after it in
    the same processes is unaffected."""
    for error, later_ok in rank_pool(2).run(_eager_with_a_sharded_cache):
        assert error is not None and "not attended by ringflash" in error, error
        assert later_ok
