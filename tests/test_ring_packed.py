"""ring-flash-attn's qkv/kv-packed ring entry points (ringflash/ring_packed.py): each equals its
unpacked form on views of the packed tensor (outputs, LSE, the packed gradient), in ring-flash-
attn's shard layouts and stacking order, called positionally as code written for it calls them;
a packed tensor of the wrong shape on one rank makes every rank raise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import errors_of, worker_device
from reference import TOLERANCE, reference_attention, reference_attention_packed, rel_err

import ringflash

WORLD = 2
SEQ = 16  # dense (batch 1): each rank holds 8 tokens
DOCS = [0, 8, 20]  # varlen: full documents of 8 and 12 tokens; local pieces of 4 and 6
LOCAL_CU = [b // WORLD for b in DOCS]
PACKED = [
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func",
    "stripe_flash_attn_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
]


def _form(name: str) -> tuple[str, bool, bool]:
    """(layout, varlen, qkv-packed) of a packed entry point."""
    layout = next((p for p in ("zigzag", "stripe") if name.startswith(p)), "contiguous")
    return layout, "varlen" in name, "qkvpacked" in name


def _indices(layout: str, rank: int, docs: list[int]) -> torch.Tensor:
    """ring-flash-attn's shards of each document [a, b) (the whole sequence for the dense forms),
    written out here: contiguous piece r / zigzag chunks r and 2W-1-r / stripe tokens r, r+W, ..."""
    parts = []
    for a, b in zip(docs, docs[1:]):
        n = b - a
        if layout == "contiguous":
            parts.append(torch.arange(a + rank * n // WORLD, a + (rank + 1) * n // WORLD))
        elif layout == "zigzag":
            c = n // (2 * WORLD)
            parts += [torch.arange(a + rank * c, a + (rank + 1) * c),
                      torch.arange(a + (2 * WORLD - 1 - rank) * c, a + (2 * WORLD - rank) * c)]  # fmt: skip
        else:
            parts.append(a + rank + WORLD * torch.arange(n // WORLD))
    return torch.cat(parts)


def _full(name: str) -> list[torch.Tensor]:
    """Full-sequence q, k, v, dout (batch, seqlen, heads, 16): 1 head each for the qkv-packed
    forms, GQA (q 2 heads, k/v 1) for the kv-packed ones."""
    g = torch.Generator().manual_seed(11)
    heads_q = _heads_q(name)
    return [torch.randn(1, _tokens(name) * WORLD, h, 16, generator=g) for h in (heads_q, 1, 1, heads_q)]


def _heads_q(name: str) -> int:
    return 1 if _form(name)[2] else 2


def _tokens(name: str) -> int:
    """Tokens on each rank."""
    return (DOCS[-1] if _form(name)[1] else SEQ) // WORLD


def _local(name: str) -> list[torch.Tensor]:
    """This rank's shards of ``_full``, in ring-flash-attn's local layout (varlen: 3-D)."""
    layout, varlen, _ = _form(name)
    idx = _indices(layout, dist.get_rank(), DOCS if varlen else [0, SEQ])
    return [(t[0, idx] if varlen else t[:, idx]).to(worker_device()) for t in _full(name)]


def _unpacked(name: str):
    return getattr(ringflash, name.replace("_qkvpacked", "").replace("_kvpacked", ""))


def _packed_vs_unpacked(name: str, causal: bool):
    """The packed form called positionally, as ring-flash-attn code calls it, and the unpacked
    form on the same data: (same out/LSE/gradients, returned shapes, packed results)."""
    _, varlen, qkv = _form(name)
    fn = getattr(ringflash, name)
    q, k, v, dout = _local(name)
    packed = torch.stack([q, k, v] if qkv else [k, v], dim=-3).requires_grad_()
    lead = (packed,) if qkv else (q.requires_grad_(), packed)
    cu = (torch.tensor(LOCAL_CU, dtype=torch.int32, device=worker_device()), 6) if varlen else ()
    out, lse, probs = fn(*lead, *cu, 0.0, None, causal, (-1, -1), None, False, True, dist.group.WORLD)
    out.backward(dout)

    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out2, lse2, _ = _unpacked(name)(q2, k2, v2, *cu, causal=causal, return_attn_probs=True)
    out2.backward(dout)
    grads = [q2.grad, k2.grad, v2.grad]
    expected_grad = torch.stack(grads if qkv else grads[1:], dim=-3)
    same = {
        "out": torch.equal(out, out2),
        "lse": torch.equal(lse, lse2),
        "packed grad": torch.equal(packed.grad, expected_grad),
        "q grad": qkv or torch.equal(q.grad, q2.grad),
    }
    shapes = (tuple(out.shape), tuple(lse.shape), lse.dtype, probs, tuple(packed.grad.shape))
    dq = packed.grad[..., 0, :, :] if qkv else q.grad
    dk, dv = packed.grad.unbind(-3)[-2:]
    return same, shapes, [t.detach().cpu() for t in (out, lse, dq, dk, dv)]


@pytest.mark.parametrize("name", PACKED)
def test_packed_equals_unpacked_and_reference(rank_pool, name):
    layout, varlen, qkv = _form(name)
    pool = rank_pool(WORLD)
    for causal in (False, True):
        results = pool.run(_packed_vs_unpacked, name, causal)
        tokens, heads = _tokens(name), _heads_q(name)
        for same, (out_shape, lse_shape, lse_dtype, probs, grad_shape), _ in results:
            assert all(same.values()), same
            assert probs is None and lse_dtype == torch.float32
            batch = () if varlen else (1,)  # the varlen LSE: flash-attn 2.x's (heads_q, local tokens)
            assert out_shape == (*batch, tokens, heads, 16) and lse_shape == (*batch, heads, tokens)
            assert grad_shape == (*batch, tokens, 3 if qkv else 2, 1, 16)

        # Against float64 attention over the full sequences: catches a wrong stacking order or
        # shard layout that the packed and unpacked forms would share.
        q, k, v, dout = (t.double().requires_grad_() for t in _full(name))
        if varlen:
            ref_out, ref_lse = reference_attention_packed(q, k, v, DOCS, causal=causal)
        else:
            ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
        ref_out.backward(dout)
        expected = (ref_out, ref_lse, q.grad, k.grad, v.grad)
        for i, what in enumerate(("out", "lse", "dq", "dk", "dv")):
            exp = expected[i][0] if varlen else expected[i]
            dim = (1 if what == "lse" else 0) if varlen else (2 if what == "lse" else 1)
            got = torch.empty(exp.shape, dtype=torch.float32)
            for r, (_, _, res) in enumerate(results):
                got.index_copy_(dim, _indices(layout, r, DOCS if varlen else [0, SEQ]), res[i])
            assert rel_err(got, exp) < TOLERANCE[torch.float32], (what, causal)


def _wrong_shape_on_rank_1():
    """qkv with 2 instead of 3 in its stacking dim / a 3-D kv, on rank 1 only; the wrong shape on
    every rank; a non-tensor."""
    rank = dist.get_rank()
    q, k, v, _ = _local("ring_flash_attn_qkvpacked_func")
    qkv = torch.stack([q, k, v], dim=2)
    qv, kv_, vv, _ = _local("zigzag_ring_flash_attn_varlen_kvpacked_func")
    kv = torch.stack([kv_, vv], dim=1)
    cu = torch.tensor(LOCAL_CU, dtype=torch.int32)
    f_dense = ringflash.zigzag_ring_flash_attn_qkvpacked_func
    f_varlen = ringflash.zigzag_ring_flash_attn_varlen_kvpacked_func
    errors = errors_of({
        "dense, rank 1": lambda: f_dense(qkv[:, :, :2] if rank == 1 else qkv, causal=True),
        "varlen, rank 1": lambda: f_varlen(qv, kv[:, 0] if rank == 1 else kv, cu, 6, causal=True),
        "dense, all": lambda: f_dense(qkv[:, :, :2], 0.0, None, True),
        "not a tensor": lambda: f_dense([q, k, v]),
        "kv not a tensor": lambda: f_varlen(qv, (kv_, vv), cu, 6),
    })  # fmt: skip
    # then good calls (the ranks are still in step), the defaults returning out alone
    f_ring = ringflash.ring_flash_attn_varlen_kvpacked_func
    same = [
        torch.equal(f_dense(qkv, causal=True), ringflash.zigzag_ring_flash_attn_func(q, k, v, causal=True)),
        torch.equal(f_ring(qv, kv, cu, 6), ringflash.ring_flash_attn_varlen_func(qv, kv_, vv, cu, 6)),
    ]
    return errors, same


def test_wrong_packed_shape_on_one_rank_raises_on_every_rank(rank_pool):
    for errors, same in rank_pool(WORLD).run(_wrong_shape_on_rank_1, timeout=300):
        assert all(same)
        for case in ("dense, rank 1", "varlen, rank 1"):  # every rank: the check names the culprit
            assert errors[case].startswith("ValueError: the ranks of the sequence-parallel group"), errors
        wrong_qkv = "qkv must be 5-D (batch, seqlen, 3, heads, head_dim), got shape (1, 8, 2, 1, 16)"
        assert wrong_qkv in errors["dense, rank 1"] and errors["dense, all"] == f"ValueError: {wrong_qkv}"
        wrong_kv = "kv must be 4-D (total_tokens, 2, heads, head_dim), got shape (10, 1, 16)"
        assert wrong_kv in errors["varlen, rank 1"]
        assert errors["not a tensor"] == "TypeError: qkv must be a torch.Tensor, got list"
        assert errors["kv not a tensor"] == "TypeError: kv must be a torch.Tensor, got tuple"


def test_packed_errors_before_the_missing_process_group(device):
    """No torch.distributed here: a wrong packed tensor is named first, as the unpacked entry
    points name their wrong arguments."""
    qkv = torch.randn(1, 8, 3, 2, 16, device=device)
    errors = errors_of({
        "shape": lambda: ringflash.ring_flash_attn_qkvpacked_func(qkv[:, :, :2]),
        "varlen shape": lambda: ringflash.ring_flash_attn_varlen_qkvpacked_func(qkv[0, :, :2], [0, 8], 8),
        "dropout": lambda: ringflash.stripe_flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], 0.1),
    })  # fmt: skip
    assert "qkv must be 5-D" in errors["shape"] and "qkv must be 4-D" in errors["varlen shape"]
    assert "dropout_p=0.1" in errors["dropout"]
    with pytest.raises(RuntimeError, match="init_process_group"):
        ringflash.ring_flash_attn_qkvpacked_func(qkv)
