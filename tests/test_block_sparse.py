"""Block-sparse attention (``flash_attn_func(..., block_mask=)``, kernels/block_sparse.py) against
the float64 reference with the same mask as a dense boolean tensor: out, LSE, dq, dk, dv.

Masks are chosen so that every path runs: blocks no query sees (never loaded: their K/V rows
hold NaN in ``test_invisible_blocks_are_never_read``), full blocks (no element mask), partial
blocks (bit masks) including blocks cut by the sequences' ends, rows that see nothing (out 0,
LSE -inf) and keys that nothing sees (dk = dv = 0); per-head masks under GQA (the dK/dV
program walks each query head's list). CPU shapes are 1-3 blocks of 128 per side; bf16 and real
sizes run in the GPU-marked tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE
from reference import TOLERANCE, reference_attention, rel_err
from test_kernels import _inputs, assert_close

import ringflash
from ringflash.kernels.tile_mask import TileMask

# Under the interpreter an int32 overflow in a kernel raises here (tests/interpreter_patching.py).
pytestmark = pytest.mark.overflow_checks


def dense_mask(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) bool of ``mask_mod`` by a plain loop-free broadcast,
    independent of ``TileMask``'s vmap evaluation."""
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    q = torch.arange(seqlen_q)[None, None, :, None]
    kv = torch.arange(seqlen_k)[None, None, None, :]
    return mask_mod(b, h, q, kv).expand(batch, heads, seqlen_q, seqlen_k)


def striped(b, h, q, kv):
    """Invisible, full and partial blocks, per sequence and head: key block 1 hidden from query
    block 0 and causal within a sliding band elsewhere, heads offset; sequence 1's query rows
    0-9 see nothing."""
    band = (kv <= q + 40 * h) & (kv >= q - 300 + 30 * b)
    hidden = (q < 128) & (kv >= 128) & (kv < 256)
    blind = (b == 1) & (q < 10)
    return band & ~hidden & ~blind | (kv < 64) & (q >= 128) & ~blind


def _run(q, k, v, dout, block_mask, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = ringflash.flash_attn_func(*leaves, block_mask=block_mask, return_lse=True, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    return out, lse, grads


def _reference(q, k, v, dout, mask, **kw):
    qd, kd, vd = (t.detach().to("cpu", torch.float64).requires_grad_() for t in (q, k, v))
    out, lse = reference_attention(qd, kd, vd, mask=mask, **kw)
    return out, lse, torch.autograd.grad(out, (qd, kd, vd), dout.detach().to("cpu", torch.float64))


def check(q, k, v, dout, block_mask, mask, **kw):
    """The block-sparse call against the reference, plus the exact zeros of blind rows and
    unseen keys, and no NaN."""
    got = _run(q, k, v, dout, block_mask, **kw)
    ref_kw = {n: kw[n] for n in ("softmax_scale", "softcap", "alibi_slopes", "sinks") if n in kw}
    expected = _reference(q, k, v, dout, mask, **ref_kw)
    tol = TOLERANCE[q.dtype]
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = got, expected
    for name, a, e in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)
    ):
        assert a.shape == e.shape, name
        assert not torch.isnan(a).any(), name
        assert_close(name, a, e, tol)
    full = mask.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    blind = ~full.any(-1)  # (b, h, sq)
    if "sinks" not in kw:
        assert (out.transpose(1, 2).cpu()[blind] == 0).all() and torch.isneginf(lse.cpu()[blind]).all()
    group = q.shape[2] // k.shape[2]
    unseen = ~full.unflatten(1, (k.shape[2], group)).any(2).any(-2)  # (b, hk, sk)
    assert (grads[1].transpose(1, 2).cpu()[unseen] == 0).all() and (
        grads[2].transpose(1, 2).cpu()[unseen] == 0
    ).all()
    return got


def _kinds(m: TileMask) -> set[str]:
    partial, full = m.kv_count.unbind(-1)
    found = {"partial"} if partial.any() else set()
    found |= {"full"} if full.any() else set()
    return found | ({"invisible"} if (partial + full < m.kv_index.shape[-1]).any() else set())


def test_mask_mod_per_sequence_and_head_under_gqa(device):
    """float32 (fp16 on the CPU: the ranges test; bf16/fp16 at real sizes: the GPU tests)."""
    b, s, h, hk, d = 2, 256, 2, 1, 16  # GQA groups of 2, each head its own mask (unaligned ends: others)
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.float32, device, seed=1)
    m = TileMask.from_mask_mod(striped, b, h, s, s, device=device)
    assert _kinds(m) == {"full", "partial", "invisible"}
    check(q, k, v, dout, m, dense_mask(striped, b, h, s, s))


def test_softcap_alibi_sinks_and_fewer_queries(device):
    """sq < sk: the mask in indices, ALiBi's distances bottom-right aligned as flash_attn_func's."""
    b, sq, sk, h, hk, d = 1, 200, 390, 2, 1, 40
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, torch.float32, device, seed=2)
    q = q * 3

    def mod(b, h, q, kv):
        return (kv <= q + 190) & ((kv // 100) % 2 == 0) | (kv >= 384)

    g = torch.Generator().manual_seed(3)
    slopes = (0.05 + 0.3 * torch.rand(h, generator=g)).to(device)
    sinks = torch.randn(h, generator=g).to(device)
    m = TileMask.from_mask_mod(mod, 1, 1, sq, sk, device=device)
    check(q, k, v, dout, m, dense_mask(mod, 1, 1, sq, sk), softcap=4.0, alibi_slopes=slopes, sinks=sinks)


def test_flex_block_mask_is_taken_as_it_is(device):
    """A FlexAttention BlockMask (its own full/partial lists, sequences not multiples of the block)
    gives the same result as its mask_mod evaluated everywhere; the conversion is kept per object."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    b, s, h, hk, d = 1, 333, 2, 2, 16
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.float32, device, seed=4)

    def mod(b, h, q, kv):
        return (q >= kv) & ((q - kv < 260) | (kv < 20 + h))

    block_mask = flex.create_block_mask(mod, 1, h, s, s, device=device, BLOCK_SIZE=128)
    assert block_mask.full_kv_num_blocks is not None and int(block_mask.full_kv_num_blocks.sum()) > 0
    check(q, k, v, dout, block_mask, dense_mask(mod, 1, h, s, s))
    from ringflash.kernels.tile_mask import as_tile_mask

    assert as_tile_mask(block_mask) is as_tile_mask(block_mask)


def test_flex_full_blocks_cut_by_the_end_are_masked(device):
    """A BlockMask that lists every block full (``BlockMask.from_kv_blocks``), sequences not
    multiples of 128: the last blocks reach past the keys, so they run masked (partial)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    s, h, d = 200, 1, 16
    q, k, v, dout = _inputs(1, s, s, h, h, d, torch.float32, device, seed=12)
    n = 2
    none = torch.zeros(1, 1, n, dtype=torch.int32, device=device)
    every = torch.arange(n, dtype=torch.int32, device=device).expand(1, 1, n, n).contiguous()
    full = torch.full((1, 1, n), n, dtype=torch.int32, device=device)
    block_mask = flex.BlockMask.from_kv_blocks(
        none, every, full, every, BLOCK_SIZE=128, mask_mod=lambda b, h, q, kv: q >= 0, seq_lengths=(s, s)
    )
    check(q, k, v, dout, block_mask, torch.ones(1, 1, s, s, dtype=torch.bool))


def test_each_call_takes_its_own_mask(device):
    """Calls of one shape (one cached problem) with different masks, a BlockMask's conversion
    kept per object: the second and third calls follow their own masks, and a new BlockMask
    (its predecessor gone, so its id may come back) is converted anew."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    s, h, d = 200, 1, 16
    q, k, v, _ = _inputs(1, s, s, h, h, d, torch.float32, device, seed=13)
    mods = (lambda b, h, q, kv: q >= kv, lambda b, h, q, kv: kv >= q, lambda b, h, q, kv: (q - kv).abs() < 70)
    for mod in mods:
        block_mask = flex.create_block_mask(mod, 1, 1, s, s, device=device, BLOCK_SIZE=128)
        got = ringflash.flash_attn_func(q, k, v, block_mask=block_mask)
        expected, _ = reference_attention(q, k, v, mask=dense_mask(mod, 1, 1, s, s))
        assert_close("out", got, expected, TOLERANCE[torch.float32])
        del block_mask


def test_ranges_full_and_causal(device):
    """MagiAttention-style slices: a causal prefix, a later query range seeing it fully and
    itself causally (bottom-right: k - k_end <= q - q_end), one more full rectangle."""
    s, h, d = 300, 2, 16
    q, k, v, dout = _inputs(1, s, s, h, h, d, torch.float16, device, seed=5)
    ranges = [(0, 120, 0, 120, "causal"), (120, 300, 0, 120, "full"), (120, 300, 120, 250, "causal"),
              (250, 300, 260, 300, "full")]  # fmt: skip
    expected = torch.zeros(s, s, dtype=torch.bool)
    for qs, qe, ks, ke, kind in ranges:
        qi, ki = torch.arange(qs, qe)[:, None], torch.arange(ks, ke)[None, :]
        expected[qs:qe, ks:ke] |= (
            torch.ones(qe - qs, ke - ks, dtype=torch.bool) if kind == "full" else (ki - ke <= qi - qe)
        )
    m = TileMask.from_ranges(ranges, s, s, device=device)
    check(q, k, v, dout, m, expected[None, None])


def test_dense_bool_mask_and_odd_head_dim(device):
    """A random block pattern with random elements in its partial blocks, one mask for both
    sequences of the batch; head_dim 36 runs zero-padded to 40 as in flash_attn_func."""
    s, h, d = 256, 2, 36
    q, k, v, dout = _inputs(2, s, s, h, h, d, torch.float32, device, seed=6)
    g = torch.Generator().manual_seed(7)
    blocks = torch.tensor([[1, 0], [2, 1]])  # 0 invisible, 1 full, 2 random elements
    mask = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
    mask = (mask == 1) | ((mask == 2) & (torch.rand(s, s, generator=g) < 0.3))
    mask = mask[None, None].to(device)
    m = TileMask.from_dense(mask)
    assert _kinds(m) == {"full", "partial", "invisible"}
    check(q, k, v, dout, m, mask.cpu())


def test_invisible_blocks_are_never_read(device):
    """Keys in blocks that no query sees hold NaN: nothing reads them (a kernel that loaded and
    then masked them would still multiply NaN values by zero probabilities)."""
    s, h, d = 384, 2, 16
    q, k, v, dout = _inputs(1, s, s, h, h, d, torch.float32, device, seed=8)

    def mod(b, h, q, kv):
        return (kv < 128) | (kv >= 256) & (q >= kv - 256)

    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[:, 128:256], poisoned_v[:, 128:256] = float("nan"), float("nan")
    m = TileMask.from_mask_mod(mod, 1, 1, s, s, device=device)
    out, lse, grads = _run(q, poisoned_k, poisoned_v, dout, m)
    ref_out, ref_lse, _ = _reference(q, k, v, dout, dense_mask(mod, 1, 1, s, s))
    assert not any(torch.isnan(t).any() for t in (out, lse, grads[0]))
    assert_close("out", out, ref_out, TOLERANCE[torch.float32])
    assert_close("lse", lse, ref_lse, TOLERANCE[torch.float32])


def test_lists_follow_the_grid(device):
    """The block lists of a known pattern both ways (partial blocks first, then full ones), and
    the bits of a partial block."""
    s = 256
    m = TileMask.from_mask_mod(lambda b, h, q, kv: q >= kv, 1, 1, s, s, device=device)
    # Blocks (0, 0) and (1, 1) causal (partial), (1, 0) full, (0, 1) invisible.
    assert m.kv_count.tolist() == [[[[1, 0], [1, 1]]]] and m.q_count.tolist() == [[[[1, 1], [1, 0]]]]
    assert m.kv_index[0, 0, 1].tolist() == [1, 0] and m.q_index[0, 0, 0].tolist() == [0, 1]
    assert m.kv_kind[0, 0, 1, 1] == -1 and m.q_kind[0, 0, 0, 1] == -1
    assert m.bits.shape == (2, 128, 4)
    row5 = m.bits[m.kv_kind[0, 0, 0, 0], 5].to(torch.int64) & 0xFFFFFFFF
    assert row5.tolist() == [0b111111, 0, 0, 0]  # query 5 sees keys 0-5
    assert m.density() == pytest.approx(0.75)
    assert m.visible_pairs() == s * (s + 1) // 2


def test_key_blocks_longest_list_first(device):
    """q_order, the order the dK/dV walks take the key blocks in (kv_order the same of the query
    blocks): by visible blocks summed over the batch and heads, most first, ties in order, then
    the number of long ones (more than 4x the mean): a global key block leads wherever it lies."""
    s = 1280  # ten blocks of 128
    glob = lambda b, h, q, kv: ((kv >= 768) & (kv < 896)) | (q // 128 == kv // 128)  # noqa: E731
    mask = TileMask.from_mask_mod(glob, 1, 1, s, s, device=device)
    assert mask.q_order.tolist() == [6, 0, 1, 2, 3, 4, 5, 7, 8, 9, 1]  # 10 blocks against 4 x 1.9
    assert mask.q_order.dtype == torch.int32 and mask.q_order.device == mask.device
    assert mask.kv_order.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 6, 0]  # two key blocks each, 6 one
    # The query side: a global query block (its list every key block).
    transposed = TileMask.from_mask_mod(lambda b, h, q, kv: glob(b, h, kv, q), 1, 1, s, s, device=device)
    assert transposed.kv_order.tolist() == mask.q_order.tolist()
    # Causal: key block n is seen by 10 - n query blocks, none long.
    causal = TileMask.from_mask_mod(lambda b, h, q, kv: q >= kv, 1, 1, s, s, device=device)
    assert causal.q_order.tolist() == [*range(10), 0]
    # Summed over the heads: head 1 sees only key block 9, from every query block (10 + 1).
    heads = lambda b, h, q, kv: torch.where(h == 0, q >= kv, kv >= 1152)  # noqa: E731
    mask = TileMask.from_mask_mod(heads, 1, 2, s, s, device=device)
    assert mask.q_order.tolist() == [9, *range(9), 0]
    assert mask.select_heads(0, 1).q_order.tolist() == causal.q_order.tolist()
    # Given (the custom ops rebuild a mask from all its tensors per call): kept, not derived again;
    # checked like the lists.
    from ringflash.kernels.block_sparse_ops import _MASK_TENSORS

    sizes = (mask.seqlen_q, mask.seqlen_k, mask.block_q, mask.block_k)
    rebuilt = TileMask(*sizes, *(getattr(mask, n) for n in _MASK_TENSORS))
    assert rebuilt.q_order is mask.q_order and rebuilt.kv_order is mask.kv_order
    tensors = {n: getattr(mask, n) for n in _MASK_TENSORS}
    for wrong in (mask.q_order[:-1], mask.q_order.long()):
        with pytest.raises(ValueError, match="TileMask.q_order must be"):
            TileMask(*sizes, **{**tensors, "q_order": wrong})


def test_local_masks_keep_their_blocks_in_order(device):
    """A local mask (lists spanning at most a quarter of the blocks on average: Llama-4's chunks,
    a band) is walked in block order, the long blocks still first, so that the programs at work
    together share their neighbours' blocks in L2; a mask whose lists span the sequence (random
    blocks) keeps the descending order."""
    s = 2560  # twenty blocks of 128, chunks of five
    chunks = TileMask.from_ranges([(i, i + 640, i, i + 640, "causal") for i in range(0, s, 640)], s, s,
                                  device=device)  # fmt: skip
    assert chunks.q_order.tolist() == [*range(20), 0]  # descending: 0, 5, 10, 15, 1, 6, ...
    assert chunks.kv_order.tolist() == [*range(20), 0]
    # A band with a global key block 13 (long: 20 blocks against 4 x 3.8): first, then in order.
    band = lambda b, h, q, kv: ((q // 128 - kv // 128).abs() <= 1) | (kv // 128 == 13)  # noqa: E731
    banded = TileMask.from_mask_mod(band, 1, 1, s, s, device=device)
    assert banded.q_order.tolist() == [13, *range(13), *range(14, 20), 1]
    # Lists of random blocks span the sequence: by descending length, ties in order.
    g = torch.Generator().manual_seed(0)
    blocks = (torch.rand(20, 20, generator=g) < 0.3).to(device)
    rand = TileMask.from_mask_mod(lambda b, h, q, kv: blocks[q // 128, kv // 128], 1, 1, s, s, device=device)
    work = rand.q_count.sum((0, 1, 3)).cpu()
    assert rand.q_order[:-1].tolist() == torch.sort(work, descending=True, stable=True).indices.tolist()
    assert rand.q_order[:-1].tolist() != list(range(20))


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)], ids=str
)
def test_long_lists_walked_first_for_every_head(device, dtype, monkeypatch):
    """A global key block (every query block sees it: a long list, q_order) and, transposed, a
    global query block (kv_order), each beside a causal block: the programs take the long block
    for every head first, then each head's other blocks; every tile is walked once, for its own
    head (blocks no one sees included: their dk/dv must be stored as zeros), a ragged end.
    float32: the Triton kernels (64-row tiles under the interpreter: two heads, for its time);
    bf16 on an sm_90 GPU: the Hopper backward's walk (counted), GQA."""
    b, s = 1, 600
    h, hk, d = (2, 2, 16) if dtype == torch.float32 else (4, 2, 64)
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from ringflash.kernels.hopper import backward as hopper_backward

    def key(b, h, q, kv):
        return ((kv >= 256) & (kv < 384)) | ((q < 128) & (q >= kv + h))

    def query(b, h, q, kv):
        return key(b, h, kv, q)

    q, k, v, dout = _inputs(b, s, s, h, hk, d, dtype, device, seed=4)
    launches = _count_walks(monkeypatch, hopper_backward, "fused_backward")
    for mod, side in ((key, "q_order"), (query, "kv_order")):
        m = TileMask.from_mask_mod(mod, 1, h, s, s, device=device)
        assert getattr(m, side).tolist()[0] == 2 and getattr(m, side).tolist()[-1] == 1  # one long block
        check(q, k, v, dout, m, dense_mask(mod, 1, h, s, s))
    assert launches == ([True, True] if dtype == torch.bfloat16 else [])


def test_mask_mod_in_chunks_of_query_blocks(device, monkeypatch):
    """from_mask_mod evaluated a query block at a time (partials numbered on across chunks, a
    ragged end, per-sequence masks, a mask_mod that ignores the batch) equals one evaluation,
    and both the dense mask."""
    from test_block_masks import decoded

    import ringflash.kernels.tile_mask as tile_mask
    from ringflash.kernels.block_sparse_ops import _MASK_TENSORS as fields  # every tensor, the orders too

    lists = ("kv_count", "kv_index", "q_count", "q_index")  # partials may be numbered otherwise
    ids = torch.randint(0, 3, (2, 300), generator=torch.Generator().manual_seed(3))

    def make(ids):
        return [lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) | (kv <= q - 50), lambda b, h, q, kv: kv <= q]

    for mod, cpu_mod, batch in zip(make(ids.to(device)), make(ids), (2, 1)):
        whole = TileMask.from_mask_mod(mod, batch, 1, 300, 260, device=device)
        for name in ("_CHUNK_PAIRS", "_CHUNK_PAIRS_GPU"):
            monkeypatch.setattr(tile_mask, name, 1)  # one query block per chunk
        chunked = TileMask.from_mask_mod(mod, batch, 1, 300, 260, device=device)
        monkeypatch.undo()
        assert all(torch.equal(getattr(chunked, f), getattr(whole, f)) for f in lists)
        for m in (whole, chunked):
            on_cpu = dataclasses.replace(m, **{f: getattr(m, f).cpu() for f in fields})
            assert torch.equal(decoded(on_cpu)[..., :300, :260], dense_mask(cpu_mod, batch, 1, 300, 260))


def test_under_torch_compile_without_a_graph_break(device):
    """Traced by torch.compile with fullgraph=True (a graph break would raise) through the custom
    ops ``ringflash::block_sparse_forward/backward``: out, LSE (used through a loss) and every
    gradient equal eager's. A BlockMask is converted in a graph break (fullgraph=False)."""
    s, h, d = 128, 2, 16
    q, k, v, dout = _inputs(1, s, s, h, h, d, torch.float32, device, seed=11)
    m = TileMask.from_mask_mod(lambda b, h, q, kv: (q >= kv) & (kv > 5) | (kv < 2), 1, 1, s, s, device=device)

    def step(q, k, v, mask):
        out, lse = ringflash.flash_attn_func(q, k, v, block_mask=mask, return_lse=True)
        return out, (out * dout).sum() + lse.square().sum()

    results = []
    for run in (torch.compile(step, backend="aot_eager", fullgraph=True), step):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, loss = run(*leaves, m)
        results.append((out, *torch.autograd.grad(loss, leaves)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    block_mask = flex.create_block_mask(causal, 1, 1, s, s, device=device, BLOCK_SIZE=128)
    got = torch.compile(step, backend="aot_eager")(q, k, v, block_mask)[0]
    torch.testing.assert_close(got, step(q, k, v, block_mask)[0])


def test_refusals(device):
    s, h, d = 256, 2, 16
    q, k, v, _ = _inputs(1, s, s, h, h, d, torch.float32, device)
    m = TileMask.from_mask_mod(lambda b, h, q, kv: q >= kv, 1, 1, s, s, device=device)
    with pytest.raises(ValueError, match="replaces causal"):
        ringflash.flash_attn_func(q, k, v, causal=True, block_mask=m)
    with pytest.raises(ValueError, match="replaces causal"):
        ringflash.flash_attn_func(q, k, v, window_size=(8, 0), block_mask=m)
    with pytest.raises(ValueError, match="seqlen_q, seqlen_k = 256, 256"):
        ringflash.flash_attn_func(q[:, :200], k, v, block_mask=m)
    with pytest.raises(ValueError, match="return_attn_probs"):
        ringflash.flash_attn_func(q, k, v, return_attn_probs=True, block_mask=m)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        ringflash.flash_attn_func(q, k, v, deterministic=1, block_mask=m)
    with pytest.raises(TypeError, match="block_mask must be"):
        ringflash.flash_attn_func(q, k, v, block_mask=torch.ones(s, s, dtype=torch.bool))
    per_head = TileMask.from_mask_mod(lambda b, h, q, kv: q >= kv, 1, 3, s, s, device=device)
    with pytest.raises(ValueError, match="heads 3"):
        ringflash.flash_attn_func(q, k, v, block_mask=per_head)
    with pytest.raises(ValueError, match="multiples of 128"):
        TileMask.from_mask_mod(lambda b, h, q, kv: q >= kv, 1, 1, s, s, block_size=64)
    with pytest.raises(ValueError, match="a range must be"):
        TileMask.from_ranges([(0, 10, 0, 10, "diagonal")], s, s)
    with pytest.raises(ValueError, match="must satisfy"):
        TileMask.from_ranges([(0, 300, 0, 10, "full")], s, s)
    with pytest.raises(TypeError, match="bool"):
        TileMask.from_mask_mod(lambda b, h, q, kv: q - kv, 1, 1, s, s)
    with pytest.raises(ValueError, match="TileMask.kv_index must be"):  # a hand-made layout
        dataclasses.replace(m, kv_index=m.kv_index.long())
    # The Hopper backward's walk order means nothing without the lists it orders: refused first,
    # before anything needs a GPU.
    from ringflash.kernels import build_problem
    from ringflash.kernels.hopper import backward as hopper_backward

    problem = build_problem(q, k, v, None, False, (-1, -1))
    with pytest.raises(ValueError, match="mask_order orders mask_lists"):
        hopper_backward.fused_backward(q, q, k, v, None, None, problem, None, k, v, False,
                                       mask_order=m.q_order)  # fmt: skip


def _documents(lens: list[int], total: int) -> torch.Tensor:
    """The document of each of ``total`` packed positions (-1 past the last)."""
    doc = torch.full((total,), -1)
    start = 0
    for i, n in enumerate(lens):
        doc[start : start + n] = i
        start += n
    return doc


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize(
    ("lens_q", "lens_k", "heads", "flex"),
    [
        ([60, 0, 150, 90], None, 2, False),  # an empty document, a block across three documents
        ([200, 56], [100, 200], 1, False),  # own key lengths; query and key blocks cut differently
        ([128, 100], None, 1, True),  # a FlexAttention BlockMask; a boundary on a block edge
    ],
)
def test_varlen_mask_is_cut_by_the_documents(device, lens_q, lens_k, heads, flex):
    """``flash_attn_varlen_func(block_mask=)``: a mask over the packed tokens, each query seeing
    what it allows within its own document only; float64 over the packed tokens with the mask
    and the documents as one dense mask (out, LSE, dq, dk, dv); per-head masks under GQA; the
    cut made once per mask and cu_seqlens."""
    lens_k = lens_k or lens_q
    tq, tk, h, d = sum(lens_q), sum(lens_k), 2, 16
    q, k, v, dout = (t[0] for t in _inputs(1, tq, tk, h, 1, d, torch.float32, device, seed=7))
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)

    def mod(b, hh, qi, kv):  # a band, heads offset; key positions % 5 == 0 hidden in head 1
        return (kv <= qi + 60 + 20 * hh) & (kv >= qi - 250) & ~((hh % 2 == 1) & (kv % 5 == 0))

    if flex:
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(mod, 1, heads, tq, tk, device=device)
    else:
        block_mask = TileMask.from_mask_mod(mod, 1, heads, tq, tk, device=device)
    same = _documents(lens_q, tq)[:, None] == _documents(lens_k, tk)[None, :]
    mask = dense_mask(mod, 1, heads, tq, tk) & same & (_documents(lens_q, tq) >= 0)[:, None]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = ringflash.flash_attn_varlen_func(
        *leaves, cu_q, cu_k, max(lens_q), max(lens_k), block_mask=block_mask, return_lse=True
    )
    grads = torch.autograd.grad(out, leaves, dout)
    ref_out, ref_lse, ref_grads = _reference(*(t[None] for t in (q, k, v, dout)), mask)
    assert out.shape == q.shape and lse.shape == (h, tq)
    expected = (ref_out, ref_lse, *ref_grads)
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected):
        assert not torch.isnan(a).any(), name
        assert_close(name, a, e[0], TOLERANCE[torch.float32])
    tile_mask = ringflash.kernels.tile_mask.as_tile_mask(block_mask)
    views = ringflash.kernels.tile_mask._DOCUMENT_VIEWS[tile_mask]
    ringflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), block_mask=block_mask)
    assert len(views) == 1  # the second call found its cut
    (view,) = views.values()
    assert view.density() < tile_mask.density()  # blocks across documents only were dropped


def _dense_of(m: TileMask) -> torch.Tensor:
    """The (Bm, Hm, seqlen_q, seqlen_k) bool that a TileMask's grid and bits describe."""
    from ringflash.kernels.tile_mask import _unpack_bits

    grid = m.grid().cpu()
    bits = _unpack_bits(m.bits.cpu())[grid.clamp(min=0).long()]  # (Bm, Hm, nq, nk, bq, bk)
    blocks = torch.where((grid >= 0)[..., None, None], bits, (grid == -1)[..., None, None])
    dense = blocks.permute(0, 1, 2, 4, 3, 5).flatten(4, 5).flatten(2, 3)
    return dense[:, :, : m.seqlen_q, : m.seqlen_k]


def test_within_documents_is_the_mask_and_the_documents():
    """Pairs of one document only, positions past the last bound seeing nothing; blocks inside
    one document keep their kind (a full block stays full)."""
    mod = lambda b, h, q, kv: (kv <= q + 130) | (kv < 20)  # noqa: E731
    m = TileMask.from_mask_mod(mod, 1, 2, 400, 300)
    bounds_q, bounds_k = [0, 130, 130, 390], [0, 140, 200, 300]
    view = m.within_documents(bounds_q, bounds_k)
    same = _documents([130, 0, 260], 400)[:, None] == _documents([140, 60, 100], 300)[None, :]
    expected = dense_mask(mod, 1, 1, 400, 300) & same & (_documents([130, 0, 260], 400) >= 0)[:, None]
    assert torch.equal(_dense_of(view), expected.expand(1, 2, 400, 300))
    assert view.grid()[0, 0, 0, 0] == -1  # queries and keys 0-127: one document, all visible
    assert view.visible_pairs() == int(expected.sum()) * 2


def test_varlen_mask_follows_new_boundaries(device):
    """The cut is kept per mask and bounds: a call with a new cu_seqlens tensor, then the first
    tensor written in place, each attend by their own documents (float64 over the packed tokens),
    and the views of every bounds seen are kept apart."""
    h, d, total = 1, 16, 256
    q, k, v, dout = (t[0] for t in _inputs(1, total, total, h, h, d, torch.float32, device, seed=9))
    mod = lambda b, hh, qi, kv: kv <= qi  # noqa: E731
    mask = TileMask.from_mask_mod(mod, 1, 1, total, total, device=device)
    cu = _cu([100, 156], device)
    for lens, cu_now in (([100, 156], cu), ([30, 200, 26], _cu([30, 200, 26], device)), ([180, 76], cu)):
        if cu_now is cu and lens != [100, 156]:
            cu.copy_(_cu(lens, device))  # written in place: its version changes
        out = ringflash.flash_attn_varlen_func(q, k, v, cu_now, cu_now, max(lens), max(lens), block_mask=mask)
        same = _documents(lens, total)[:, None] == _documents(lens, total)[None, :]
        visible = dense_mask(mod, 1, 1, total, total) & same
        ref_out, _, _ = _reference(*(t[None] for t in (q, k, v, dout)), visible)
        assert_close("out", out, ref_out[0], TOLERANCE[torch.float32])
    assert len(ringflash.kernels.tile_mask._DOCUMENT_VIEWS[mask]) == 3


def test_varlen_mask_refusals(device):
    lens, h, d = [100, 156], 2, 16
    q, k, v, _ = (t[0] for t in _inputs(1, 256, 256, h, h, d, torch.float32, device))
    cu = _cu(lens, device)
    m = TileMask.from_mask_mod(lambda b, hh, qi, kv: qi >= kv, 1, 1, 256, 256, device=device)
    with pytest.raises(ValueError, match="batch 1"):
        two = TileMask.from_mask_mod(lambda b, hh, qi, kv: qi >= kv, 2, 1, 256, 256, device=device)
        ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 156, 156, block_mask=two)
    with pytest.raises(ValueError, match="alibi_slopes cannot be combined"):
        ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 156, 156, block_mask=m, alibi_slopes=torch.ones(h))
    with pytest.raises(ValueError, match="replaces causal"):
        ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 156, 156, causal=True, block_mask=m)
    with pytest.raises(ValueError, match="seqlen_q, seqlen_k = 256, 256"):
        ringflash.flash_attn_varlen_func(q[:200], k, v, _cu([100, 100], device), cu, 156, 156, block_mask=m)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest"):
        ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 100, 156, block_mask=m)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        ringflash.flash_attn_varlen_func(q, k, v, cu, _cu([100, 100], device), 156, 156, block_mask=m)


def test_hopper_forward_takes_the_masks_its_tiles_fit():
    """The warp-specialized forward walks a mask's lists only where its key tiles are the mask's
    blocks: 128-position blocks at the 64 and 128 builds (96 runs at 128); not 256-position
    blocks, not the 256 build (64-key tiles), not a problem with a window (the Triton kernel and
    the refusals upstream take those)."""
    from ringflash.kernels import build_problem

    try:  # a Triton whose Gluon lacks what the kernels use runs the Triton kernels (dispatch.py)
        from ringflash.kernels.hopper.forward import sparse_supports
    except (ImportError, AttributeError) as e:
        pytest.skip(f"the Hopper kernels do not import with this Triton: {e}")

    def problem(d, window=(-1, -1)):
        t = torch.zeros(1, 256, 2, d, dtype=torch.float16, device=DEVICE)
        return build_problem(t, t, t, None, False, window)

    def mask(block):
        causal = lambda b, h, q, kv: kv <= q  # noqa: E731
        return TileMask.from_mask_mod(causal, 1, 1, 256, 256, block_size=block, device=DEVICE)

    assert [sparse_supports(problem(d), mask(128)) for d in (64, 96, 128, 256)] == [True, True, True, False]
    assert not sparse_supports(problem(128), mask(256))
    assert not sparse_supports(problem(128, (16, -1)), mask(128))
    # The backward's program is one 128-key tile; a query block is whole 64-row query tiles.
    from ringflash.kernels.hopper.backward import sparse_supports as backward_supports

    assert [backward_supports(problem(d), mask(128)) for d in (64, 96, 128, 256)] == [True, True, True, False]
    assert backward_supports(problem(128), mask((256, 128)))
    assert not backward_supports(problem(128), mask(256))
    assert not backward_supports(problem(64), mask((128, 256)))
    assert not backward_supports(problem(128, (16, -1)), mask(128))


def _scores(scores: str, heads: int) -> dict:
    """flash_attn_func's score keywords of a parametrization: none, or a softcap with ALiBi."""
    if scores == "plain":
        return {}
    return dict(softcap=8.0, alibi_slopes=torch.rand(heads, device=DEVICE) * 0.05)


def _count_walks(monkeypatch, module: object, launch: str) -> list[bool]:
    """Whether each call of a Hopper kernel's launch (``module.launch``) walked a block mask's
    lists (it got ``mask_lists``), in order, from now on."""
    walks, real = [], getattr(module, launch)

    def counted(*args, **kwargs):
        walks.append(kwargs.get("mask_lists") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, launch, counted)
    return walks


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64, 96])
@pytest.mark.parametrize("scores", ["plain", "softcap_alibi"])
def test_gpu_hopper_forward_walks_the_lists(d, scores, monkeypatch):
    """On an sm_90 GPU the block-sparse forward of 128-position blocks runs the warp-specialized
    kernel (its SPARSE walk, counted), at head_dim 128, 64 and 96 (run at the 128 build): out and
    LSE against float64 and against the Triton kernel (``RINGFLASH_FUSED_FORWARD=0``), bf16,
    masks per sequence and head with all three kinds of block and blind rows, GQA, a sequence
    end inside a block (1100 tokens), a softcap with ALiBi."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from ringflash.kernels.hopper import forward as hopper_forward

    b, s, h, hk = 2, 1100, 4, 2
    q, k, v, _ = _inputs(b, s, s, h, hk, d, torch.bfloat16, DEVICE, seed=11)
    m = TileMask.from_mask_mod(striped, b, h, s, s, device=DEVICE)
    assert _kinds(m) == {"partial", "full", "invisible"}
    kw = _scores(scores, h)
    launches = _count_walks(monkeypatch, hopper_forward, "fused_forward")
    with torch.no_grad():
        out, lse = ringflash.flash_attn_func(q, k, v, block_mask=m, return_lse=True, **kw)
        assert launches == [True]
        monkeypatch.setenv("RINGFLASH_FUSED_FORWARD", "0")
        triton_out, triton_lse = ringflash.flash_attn_func(q, k, v, block_mask=m, return_lse=True, **kw)
    assert launches == [True]
    qd, kd, vd = (t.to("cpu", torch.float64) for t in (q, k, v))
    ref_out, ref_lse = reference_attention(qd, kd, vd, mask=dense_mask(striped, b, h, s, s), **kw)
    tol = TOLERANCE[torch.bfloat16]
    for name, a, e in (("out", out, ref_out), ("lse", lse, ref_lse), ("triton out", triton_out, ref_out),
                       ("triton lse", triton_lse, ref_lse)):  # fmt: skip
        assert not torch.isnan(a).any(), name
        assert_close(name, a, e, tol)
    assert rel_err(out, triton_out) < 1e-2 and rel_err(lse, triton_lse) < 1e-4
    blind = ~dense_mask(striped, b, h, s, s).any(-1)  # (b, h, s)
    assert (out.transpose(1, 2).cpu()[blind] == 0).all() and torch.isneginf(lse.cpu()[blind]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64, 96])
@pytest.mark.parametrize("hk", [4, 2])
@pytest.mark.parametrize("scores", ["plain", "softcap_alibi"])
def test_gpu_hopper_backward_walks_the_lists(d, hk, scores, monkeypatch):
    """On an sm_90 GPU the block-sparse backward of 128-key blocks runs the warp-specialized
    kernel (its SPARSE walk, counted): dq, dk, dv against float64 and against the Triton kernels
    (``RINGFLASH_FUSED_BACKWARD=0``), bf16, head_dim 128, 64 and 96 (the 128 build), MHA and
    GQA (each head's own list), masks per sequence and head with all three kinds of block, blind
    rows and unseen keys, 1100 tokens (the ends inside blocks), a softcap with ALiBi; also
    256-row query blocks (four query tiles per listed block) and fewer queries than keys with
    sinks."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from ringflash.kernels.hopper import backward as hopper_backward

    b, s, h = 2, 1100, 4
    q, k, v, dout = _inputs(b, s, s, h, hk, d, torch.bfloat16, DEVICE, seed=12)
    kw = _scores(scores, h)
    launches = _count_walks(monkeypatch, hopper_backward, "fused_backward")
    expected = dense_mask(striped, b, h, s, s)
    m = TileMask.from_mask_mod(striped, b, h, s, s, device=DEVICE)
    assert _kinds(m) == {"partial", "full", "invisible"}
    got = check(q, k, v, dout, m, expected, **kw)
    assert launches == [True]
    tall = TileMask.from_mask_mod(striped, b, h, s, s, block_size=(256, 128), device=DEVICE)
    check(q, k, v, dout, tall, expected, **kw)
    assert launches == [True, True]
    monkeypatch.setenv("RINGFLASH_FUSED_BACKWARD", "0")
    triton = _run(q, k, v, dout, m, **kw)
    assert launches == [True, True]
    for name, a, e in zip(("dq", "dk", "dv"), got[2], triton[2]):
        assert rel_err(a, e) < 1e-2, name
    monkeypatch.delenv("RINGFLASH_FUSED_BACKWARD")
    sq = 700  # fewer queries than keys: the mask in indices, ALiBi bottom-right, sinks

    def mod(b, h, q, kv):
        return striped(b, h, q, kv) | (kv >= 1000)

    sinks = torch.randn(h, device=DEVICE)
    m = TileMask.from_mask_mod(mod, b, h, sq, s, device=DEVICE)
    check(q[:, :sq], k, v, dout[:, :sq], m, dense_mask(mod, b, h, sq, s), sinks=sinks, **kw)
    assert launches == [True, True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("s", "h", "hk", "d"), [(2048, 4, 2, 128), (1536, 2, 1, 64), (1100, 2, 2, 256)])
def test_gpu_real_sizes(dtype, s, h, hk, d):
    """Real tiles (128 x 64/128) inside 128- and 256-position blocks, bf16/fp16, a BigBird-like
    mask (local band, global first keys, random blocks) per head."""
    q, k, v, dout = _inputs(1, s, s, h, hk, d, dtype, DEVICE, seed=9)
    g = torch.Generator().manual_seed(10)
    random_blocks = torch.rand(h, -(-s // 256), -(-s // 256), generator=g) < 0.2

    def bigbird(blocks):
        def mod(b, h, q, kv):
            return ((q - kv).abs() < 300) | (kv < 64) | blocks[h, q // 256, kv // 256]

        return mod

    expected = dense_mask(bigbird(random_blocks), 1, h, s, s)
    for block in (128, 256):
        m = TileMask.from_mask_mod(
            bigbird(random_blocks.to(DEVICE)), 1, h, s, s, block_size=block, device=DEVICE
        )
        check(q, k, v, dout, m, expected)


def test_ring_step_form_writes_views_and_accumulates(device):
    """The form a ring step calls (``sparse_forward`` into views of larger buffers,
    ``sparse_gradients`` adding dQ and dK/dV into float32 accumulators, one kernel at a time)
    gives what the plain calls give. CPU: float32, 256 tokens; GPU: bf16, 2048 tokens, d128."""
    from ringflash.kernels import attention_delta, build_problem
    from ringflash.kernels.block_sparse import sparse_forward, sparse_gradients

    on_gpu = device != "cpu"
    s, d, dtype = (2048, 128, torch.bfloat16) if on_gpu else (256, 16, torch.float32)
    q, k, v, dout = _inputs(1, s, s, 2, 1, d, dtype, device, seed=12)
    m = TileMask.from_mask_mod(striped, 1, 2, s, s, device=device)
    problem = build_problem(q, k, v, None, False, (-1, -1))
    out, lse = sparse_forward(q, k, v, m, problem)
    out_buf = torch.zeros(1, s, 3, d, device=device, dtype=torch.float32)  # float32, as the ring's
    lse_buf = torch.zeros(1, 2, s + 7, device=device)
    sparse_forward(q, k, v, m, problem, out=out_buf[:, :, 1:], lse=lse_buf[:, :, 3 : 3 + s])
    torch.testing.assert_close(out_buf[:, :, 1:].to(dtype), out, atol=0, rtol=0)
    torch.testing.assert_close(lse_buf[:, :, 3 : 3 + s], lse, atol=0, rtol=0)
    assert out_buf[:, :, 0].eq(0).all() and lse_buf[:, :, :3].eq(0).all()
    delta = attention_delta(out, dout, problem)
    grads = sparse_gradients(dout, q, k, v, lse, delta, m, problem)
    g = torch.Generator().manual_seed(13)
    start = [torch.randn(t.shape, generator=g).to(device) for t in (q, k, v)]
    acc = [t.clone() for t in start]
    sparse_gradients(dout, q, k, v, lse, delta, m, problem, dk=acc[1], dv=acc[2], accumulate=True,
                     compute_dq=False)  # fmt: skip
    assert torch.equal(acc[0], start[0])  # dQ's kernel did not run
    sparse_gradients(dout, q, k, v, lse, delta, m, problem, dq=acc[0], accumulate=True, compute_dkdv=False)
    tol = 1e-2 if on_gpu else 1e-5
    for a, s0, grad in zip(acc, start, grads):
        torch.testing.assert_close(a - s0, grad.float(), atol=tol, rtol=tol)
    # The ring's fused schedule: both at once, dQ into a float32 view, dK/dV into k's dtype (on an
    # sm_90 GPU one launch of the Hopper backward's listed walk).
    from ringflash.kernels.block_sparse import uses_fused_sparse_backward

    fused = uses_fused_sparse_backward(problem, m, q, k, v)
    assert fused == (on_gpu and torch.cuda.get_device_capability() == (9, 0))
    dq_buf = start[0].repeat(1, 1, 2, 1)[:, :, 1:3]  # a view with a wider token stride
    dq_start, scratch = dq_buf.clone(), [torch.zeros_like(k), torch.zeros_like(v)]
    sparse_gradients(dout, q, k, v, lse, delta, m, problem, dq=dq_buf, dk=scratch[0], dv=scratch[1],
                     accumulate=True)  # fmt: skip
    for a, s0, grad in zip((dq_buf, *scratch), (dq_start, 0, 0), grads):
        torch.testing.assert_close(a.float() - s0, grad.float(), atol=tol, rtol=tol)
