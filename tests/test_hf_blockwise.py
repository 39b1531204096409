"""transformers' blockwise overlays sequence parallel (integrations/hf_blockwise.py): the blocks
numbered again over the whole sequence from each rank's shard, and Gemma-3's image blocks and
PaliGemma's prefix in a sequence-parallel training step, equal to eager attention on one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import errors_of, worker_device

from ringflash import reduce_gradients, sequence_parallel_cross_entropy, sequence_parallel_groups, shard_batch
from ringflash.layouts import ChunkLayout, layout_indices

transformers = pytest.importorskip("transformers")
from ringflash.integrations.hf_blockwise import global_block_ids  # noqa: E402 (after the skip)


def _gemma3_ids(token_types: torch.Tensor) -> torch.Tensor:
    """Gemma-3's block ids of token types (1: image): each run of image tokens one block."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    return get_block_sequence_ids_for_mask(token_types)


def _prefix_ids(token_types: torch.Tensor) -> torch.Tensor:
    """PaliGemma's block ids (0: the prefix, one block; 1: the suffix, causal)."""
    return torch.where(token_types == 0, 0, -1)


@pytest.mark.parametrize(
    ("layout", "world", "ulysses"),
    [("zigzag", 2, 1), ("contiguous", 3, 1), ("zigzag", 4, 2), ("stripe", 2, 1)],
)
def test_global_block_ids_are_the_whole_sequences(layout, world, ulysses):
    """Each rank's ids computed by the model on its shard alone, numbered again over the whole
    sequence, equal the model's ids of the whole sequence: Gemma-3's images (random runs,
    some across shards and across zigzag's two chunks of a rank) and PaliGemma's prefix."""
    total = 96 * world
    g = torch.Generator().manual_seed(world)
    where = [layout_indices(layout, r, world, total, ulysses) for r in range(world)]
    for trial in range(20):
        # runs of image tokens and text of random lengths: many boundaries fall on shard edges
        lengths = torch.randint(1, 12, (2, total), generator=g)
        kinds = torch.stack([torch.arange(total) % 2 for _ in range(2)])  # alternate text / image runs
        types = torch.stack([kinds[b].repeat_interleave(lengths[b])[:total] for b in range(2)])
        types[:, 0] = trial % 2  # sequences that start with an image, or with text
        for model_ids in (_gemma3_ids, _prefix_ids):
            prefix = types.clone()
            if model_ids is _prefix_ids:  # a prefix of random length, then the suffix
                cut = torch.randint(1, total, (2,), generator=g)
                prefix = (torch.arange(total)[None] >= cut[:, None]).long()
            parts = [model_ids(prefix[:, w]) for w in where]
            assert torch.equal(global_block_ids(parts, where), model_ids(prefix)), (trial, model_ids)


def test_global_block_ids_refuse_blocks_shards_cannot_recover():
    """One id on two runs of a rank's tokens (a prefix-LM of packed examples), or two ids that
    touch inside a run of consecutive positions: ValueError naming the rank."""
    where = [torch.arange(8), torch.arange(8, 16)]
    two_runs = torch.tensor([[0, 0, -1, 0, -1, -1, -1, -1]])
    touching = torch.tensor([[0, 0, 1, 1, -1, -1, -1, -1]])
    fine = torch.full((1, 8), -1)
    with pytest.raises(ValueError, match="rank 0's sequence 0 has a block id on two runs"):
        global_block_ids([two_runs, fine], where)
    with pytest.raises(ValueError, match="rank 1's ids 0 and 1 touch at position 10"):
        global_block_ids([fine, touching], where)
    # the same ids across a rank's two chunks (zigzag: not neighbours in the sequence) are two blocks
    zigzag = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]
    ids = global_block_ids([torch.tensor([[-1, 0, 0, -1]]), torch.full((1, 4), -1)], zigzag)
    assert ids.tolist() == [[-1, 0, -1, -1, -1, -1, 1, -1]]


VOCAB = 64
# Gemma-3 runs zigzag on 2 ranks (chunks of 128 tokens, whole mask blocks: 512 in all), PaliGemma
# Ulysses (contiguous halves of 128: 256), the interpreter's time in mind.
TOKENS = {"gemma3": 512, "paligemma": 256}


IMAGE_TOKEN = VOCAB - 1  # Gemma-3's image token id, inside the tiny vocabulary


def _multimodal(family: str, attn_implementation: str) -> torch.nn.Module:
    """A tiny Gemma-3 (a sliding layer of 100 keys, a full one) or PaliGemma (Gemma-1) model with
    a vision tower the tests leave unused: the token types alone make the blocks."""
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1, image_size=16,
        patch_size=4,
    )  # fmt: skip
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
    )  # fmt: skip
    if family == "gemma3":
        text = transformers.Gemma3TextConfig(
            sliding_window=100, layer_types=["sliding_attention", "full_attention"], **common
        )
        config = transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN
        )
        cls = transformers.Gemma3ForConditionalGeneration
    else:
        text = transformers.GemmaConfig(**common)
        config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, projection_dim=32)
        cls = transformers.PaliGemmaForConditionalGeneration
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attn_implementation).float()
    for name, p in model.named_parameters():
        if name.endswith("mm_input_projection_weight"):  # zeros as made: no image would reach the text
            torch.nn.init.normal_(p, std=0.2)
    return model


def _batch(family: str) -> dict[str, torch.Tensor]:
    """Two sequences: Gemma-3, images of 150 tokens across the shards' edges (sequence 0: 100..249,
    over position 128; sequence 1: 200..349 and 380..511, over 256 and 384) and of 3 tokens
    (inside one mask block); PaliGemma, prefixes of 200 (over the halves' edge) and 60 tokens."""
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, VOCAB, (2, TOKENS[family]), generator=g)
    if family == "gemma3":
        types = torch.zeros_like(ids)
        types[0, 100:250] = types[0, 20:23] = types[1, 200:350] = types[1, 380:] = 1
    else:
        types = torch.ones_like(ids)
        types[0, :200] = types[1, :60] = 0
    return {"input_ids": ids, "token_type_ids": types}


def _sharded_step(family: str, sp_mode: str, layout: str | ChunkLayout):
    import ringflash.integrations.hf as rf_hf

    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    name = rf_hf.enable(group=groups.sp_group, sp_mode=sp_mode, layout=layout)
    model = _multimodal(family, name).to(worker_device())
    batch = {k: v.to(worker_device()) for k, v in _batch(family).items()}
    ulysses = groups.sp_size if sp_mode == "ulysses" else 1
    shard = shard_batch(batch, groups.sp_group, layout=layout, ulysses_size=ulysses)
    return _step_on_shard(model, shard, ("input_ids", "position_ids", "token_type_ids"), groups)


def _step_on_shard(model: torch.nn.Module, shard: dict, names: tuple[str, ...], groups) -> tuple[float, dict]:
    """A training step of ``model`` on this rank's ``shard`` (its entries ``names`` the model's
    inputs): the group's loss and the gradients reduced over the group, on the CPU."""
    logits = model(**{k: shard[k] for k in names}, use_cache=False).logits
    loss = sequence_parallel_cross_entropy(logits, shard["target_ids"], groups.sp_group)
    loss.backward()
    reduce_gradients(model, groups)
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


# Gemma-3's 512 tokens in 4 chunks of 128 (whole mask blocks) dealt out of order, as
# balanced_layout deals them.
DEALT = ChunkLayout(((1, 2), (0, 3)))


@pytest.mark.parametrize(
    ("family", "sp_mode", "layout"), [("gemma3", "auto", DEALT), ("paligemma", "ulysses", "zigzag")]
)
def test_multimodal_blocks_sequence_parallel_step_equals_eager(rank_pool, family, sp_mode, layout):
    """Sequence parallel (2 ranks): a training step of Gemma-3 with image blocks ("auto", here
    the all-gather mode, over a ``ChunkLayout`` given to ``enable`` and ``shard_batch``; the
    ring over one: test_block_masks) and of PaliGemma with prefixes (Ulysses, zigzag) has eager
    attention's loss and gradients on one process; the blocks matter (the same step without
    token types gives another loss)."""
    results = rank_pool(2).run(_sharded_step, family, sp_mode, layout, timeout=600)
    batch = _batch(family)
    without_types = {"input_ids": batch["input_ids"]}
    _assert_eager_step_where_pattern_matters(
        results, (_multimodal(family, "eager"), batch), (_multimodal(family, "eager"), without_types)
    )


def _assert_eager_step_where_pattern_matters(results: list, pattern: tuple, plain: tuple) -> None:
    """Every rank's step equals eager's of ``pattern`` (model, inputs), whose loss differs from
    ``plain``'s (the same model without the pattern's non-causal parts): the parts matter."""
    losses = []
    for model, inputs in (pattern, plain):
        ids = inputs["input_ids"]
        logits = model(**inputs, use_cache=False).logits
        losses.append(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)))
    assert abs(losses[0].item() - losses[1].item()) > 1e-3 * losses[0].item()
    losses[0].backward()
    _assert_steps_equal(results, losses[0].item(), pattern[0])


def _assert_steps_equal(results: list, loss: float, model: torch.nn.Module, floor: float = 0.0) -> None:
    """Every rank's (loss, gradients) of a sequence-parallel step against the one-process step's
    ``loss`` and ``model``'s gradients, relative to max(norm, ``floor``)."""
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for rank, (sp_loss, grads) in enumerate(results):
        assert abs(sp_loss - loss) < 1e-5 * loss, (rank, sp_loss, loss)
        assert grads.keys() == expected.keys()
        for n, g in expected.items():
            err = ((grads[n] - g).norm() / max(g.norm().item(), floor)).item()
            assert err < 1e-4, f"rank {rank} {n}: rel err {err:.2e}"


@pytest.mark.parametrize("family", ["gemma3", "paligemma"])
def test_multimodal_blocks_one_device_step_equals_eager(device, family):
    """One device, the same models: the pattern as one block mask (PaliGemma hands the mask it
    made to its text model, which takes it as made) gives eager attention's loss and gradients."""
    import ringflash.integrations.hf as rf_hf

    row = 0 if family == "gemma3" else 1  # an image over a block's edge; a 60-token prefix
    batch = {k: v[row : row + 1, :160].to(device) for k, v in _batch(family).items()}
    results = []
    for implementation in (rf_hf.enable(), "eager"):
        model = _multimodal(family, implementation).to(device)
        logits = model(**batch, use_cache=False).logits
        ids = batch["input_ids"]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ours, ours_grads), (eager, eager_grads) = results
    assert abs(ours - eager) < 1e-5 * eager
    assert ours_grads.keys() == eager_grads.keys()
    for n, g in eager_grads.items():
        assert ((ours_grads[n] - g).norm() / g.norm()).item() < 1e-4, n


def _image_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, token_type_ids, pixel_values): a sequence of 512 tokens with three images of 4
    tokens (16 x 16 pixels, pooled to 4 tokens), two across the zigzag shards' edges (positions
    126-129 over 128, 382-385 over 384)."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, IMAGE_TOKEN, (1, 512), generator=g)
    types = torch.zeros_like(ids)
    for start in (126, 300, 382):
        ids[0, start : start + 4] = IMAGE_TOKEN
        types[0, start : start + 4] = 1
    return ids, types, torch.randn(3, 3, 16, 16, generator=g)


def _whole_sequence_embeds(model: torch.nn.Module, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """The README's recipe: the whole sequence's embeddings with the image features put in place of
    the image tokens, as Gemma-3's forward merges them (a shard's model cannot: it counts images)."""
    embeds = model.get_input_embeddings()(ids)
    features = model.get_image_features(pixels)
    features = getattr(features, "pooler_output", features)  # an output object in newer transformers
    where = (ids == model.config.image_token_id)[..., None].expand_as(embeds)
    return embeds.masked_scatter(where, features.to(embeds.dtype))


def _image_sharded_step():
    import ringflash.integrations.hf as rf_hf

    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    model = _multimodal("gemma3", rf_hf.enable(group=groups.sp_group)).to(worker_device())
    ids, types, pixels = (t.to(worker_device()) for t in _image_batch())
    embeds = _whole_sequence_embeds(model, ids, pixels)  # on every rank, the whole sequence
    batch = {"input_ids": ids, "token_type_ids": types, "inputs_embeds": embeds}
    shard = shard_batch(batch, groups.sp_group)
    return _step_on_shard(model, shard, ("inputs_embeds", "position_ids", "token_type_ids"), groups)


def test_images_sequence_parallel_through_whole_sequence_embeddings(rank_pool):
    """Gemma-3 with real images sequence parallel (2 ranks, zigzag): the whole sequence's
    embeddings with the image features merged in, sharded by ``shard_batch`` with the token types,
    give a training step the loss and gradients (the vision tower's too) of the model given
    input_ids and pixel_values on one process with eager attention."""
    results = rank_pool(2).run(_image_sharded_step, timeout=600)
    model = _multimodal("gemma3", "eager")
    ids, types, pixels = _image_batch()
    logits = model(input_ids=ids, pixel_values=pixels, token_type_ids=types, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    assert any(n.startswith("model.vision_tower") and p.grad is not None for n, p in model.named_parameters())
    # The vision tower's key bias: its gradient is 0 up to rounding (a query's scores shift alike).
    _assert_steps_equal(results, loss.item(), model, floor=1e-4)


def _embedding_gemma(attn_implementation: str, bidirectional: bool = True) -> torch.nn.Module:
    """A tiny Gemma-3 text model with ``use_bidirectional_attention`` (EmbeddingGemma's): full
    layers bidirectional, sliding layers |q - kv| < 100, both patterns the model writes itself."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
        sliding_window=100, layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=bidirectional,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM._from_config(
        config, attn_implementation=attn_implementation
    ).float()


def _embedding_gemma_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (1, 512), generator=torch.Generator().manual_seed(9))


def _bidirectional_sharded_step():
    import ringflash.integrations.hf as rf_hf

    groups = sequence_parallel_groups(torch.distributed.get_world_size())
    model = _embedding_gemma(rf_hf.enable(group=groups.sp_group, sp_mode="auto")).to(worker_device())
    shard = shard_batch({"input_ids": _embedding_gemma_ids().to(worker_device())}, groups.sp_group)
    return _step_on_shard(model, shard, ("input_ids", "position_ids"), groups)


def test_embedding_gemma_bidirectional_sequence_parallel_step_equals_eager(rank_pool):
    """EmbeddingGemma's patterns (its own functions: a constant True beside causal on the full
    layers, |q - kv| < 100 on the sliding ones) over 2 ranks' zigzag shards (512 tokens, windows
    across the shards' edges; the other layouts take the same rebuilt pattern, as the multimodal
    test's Ulysses case shows): a training step has eager attention's loss and gradients on one
    process; the bidirectional parts matter (causal gives another loss)."""
    results = rank_pool(2).run(_bidirectional_sharded_step, timeout=600)
    inputs = {"input_ids": _embedding_gemma_ids()}
    _assert_eager_step_where_pattern_matters(
        results, (_embedding_gemma("eager"), inputs), (_embedding_gemma("eager", bidirectional=False), inputs)
    )


def test_model_parts_taken_only_while_they_close_over_numbers():
    """EmbeddingGemma's window part is taken as positions-only as long as it closes over numbers;
    the same names closing over a tensor (which a shard could own) are refused, named."""
    import transformers.masking_utils as mu
    from transformers.models.gemma3 import modeling_gemma3

    from ringflash.integrations.hf_blockwise import block_ids_in

    assert (
        block_ids_in(mu.or_masks(mu.causal_mask_function, modeling_gemma3._bidirectional_window_overlay(4)))
        == []
    )
    offset = torch.tensor(3)

    def inner_mask(b, h, q, kv):
        return (q - kv + offset).abs() < 4

    inner_mask.__module__, inner_mask.__qualname__ = (
        modeling_gemma3.__name__,
        "_bidirectional_window_overlay.<locals>.inner_mask",
    )
    with pytest.raises(ValueError, match="_bidirectional_window_overlay"):
        block_ids_in(mu.or_masks(mu.causal_mask_function, inner_mask))


def _positions_pattern_on_zigzag():
    """A pattern of positions alone, as transformers composes it for a zigzag shard (its positions
    jump, so it remaps them and keeps the two chunks apart), through the registered mask function;
    returns the decoded whole-sequence mask."""
    import transformers.masking_utils as mu
    from test_block_masks import decoded

    import ringflash.integrations.hf as rf_hf
    from ringflash.layouts import layout_indices

    group = sequence_parallel_groups(torch.distributed.get_world_size()).sp_group
    rank, world, total = torch.distributed.get_rank(), torch.distributed.get_world_size(), 512
    mask = mu.ALL_MASK_ATTENTION_FUNCTIONS[rf_hf.enable(group=group)]
    positions = layout_indices("zigzag", rank, world, total)[None]
    pattern = mu.or_masks(mu.causal_mask_function, mu.sliding_window_bidirectional_overlay(4))
    fn = mu.and_masks(
        mu.remap_positions_for_packed_sequence(pattern, positions),
        mu.packed_sequence_mask_function(mu.find_packed_sequence_indices(positions)),
    )
    tiles = mask(batch_size=1, q_length=total // world, kv_length=total // world, mask_function=fn)
    return decoded(tiles)[0, 0]


def test_positions_pattern_over_the_whole_sequence(rank_pool):
    """Over zigzag shards a pattern of positions alone (causal or within 4 positions both ways)
    becomes the whole sequence's mask: the parts transformers adds where a shard's positions jump
    are left out, not evaluated on the shard's own tensors."""
    q, kv = torch.arange(512)[:, None], torch.arange(512)[None, :]
    for rank, got in enumerate(rank_pool(2).run(_positions_pattern_on_zigzag)):
        assert torch.equal(got, (kv <= q) | ((q - kv).abs() <= 4)), rank


def _refused_patterns():
    """Every rank raises, none waits: a model's own pattern part beside an overlay, padding on
    one rank only, block ids that are not runs on one rank only."""
    import transformers.masking_utils as mu

    import ringflash.integrations.hf as rf_hf

    group = sequence_parallel_groups(torch.distributed.get_world_size()).sp_group
    rank = torch.distributed.get_rank()
    mask = mu.ALL_MASK_ATTENTION_FUNCTIONS[rf_hf.enable(group=group)]
    ids = torch.full((1, 8), -1)
    own = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids), lambda b, h, q, kv: q == kv)
    runs = ids.clone()
    if rank == 1:
        runs[0, :2] = runs[0, 4:6] = 0  # one id, two runs
    padded = torch.ones(1, 8)
    padded[0, 0] = 1 - rank
    call = dict(batch_size=1, q_length=8, kv_length=8)
    overlay, not_runs = (mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(t)) for t in (ids, runs))
    return errors_of({
        "own": lambda: mask(**call, mask_function=own),
        "padded": lambda: mask(**call, mask_function=overlay, attention_mask=padded),
        "runs": lambda: mask(**call, mask_function=not_runs),
        "cached": lambda: mask(**call | {"q_offset": 8, "kv_length": 16}, mask_function=overlay),
    })  # fmt: skip


def test_refusals_reach_every_rank(rank_pool):
    for rank, errors in enumerate(rank_pool(2).run(_refused_patterns)):
        assert "cannot honour the model's attention pattern" in errors["own"], (rank, errors)
        assert "lambda" in errors["own"], (rank, errors)
        # the rank that found padding names it; the other names the disagreement
        assert ("padding" if rank == 0 else "different arguments") in errors["padded"], (rank, errors)
        assert "rank 1's sequence 0 has a block id on two runs" in errors["runs"], (rank, errors)
        assert "whole sequences from position 0" in errors["cached"], (rank, errors)
