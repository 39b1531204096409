"""Infini-attention against a float64 loop over segments: single device (both update rules, GQA,
a last segment shorter than the others, fp32/fp16), streaming, sequence parallel on 2-3 gloo
ranks, the prefix-sum collective's gradient, and bad arguments."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import errors_of, worker_device
from reference import TOLERANCE, rel_err

import ringflash
from ringflash import comm, infini
from ringflash.kernels.infini import delta as infini_delta
from ringflash.kernels.infini import memory as infini_memory


def infini_reference(q, k, v, beta, segment_len, update, memory=None):
    """Infini-attention in float64, one segment after another. Returns (out, (matrix, normalizer))."""
    q, k, v, beta = (t.to("cpu", torch.float64) for t in (q, k, v, beta))
    b, s, h, d = q.shape
    kv_heads = k.shape[2]
    rep = h // kv_heads
    if memory is None:
        matrix = torch.zeros(b, kv_heads, d, d, dtype=torch.float64)
        norm = torch.zeros(b, kv_heads, d, dtype=torch.float64)
    else:
        matrix, norm = (t.to("cpu", torch.float64) for t in memory)
    gate = torch.sigmoid(beta)[None, None, :, None]
    outs = []
    for start in range(0, s, segment_len):
        qs, ks, vs = (t[:, start : start + segment_len] for t in (q, k, v))
        n = qs.shape[1]
        scores = torch.einsum("bqhd,bkhd->bhqk", qs, ks.repeat_interleave(rep, 2)) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        local = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vs.repeat_interleave(rep, 2))
        empty = (norm == 0).all(-1)  # (b, kv_heads): nothing stored yet
        sq, sk = F.elu(qs) + 1, F.elu(ks) + 1
        num = torch.einsum("bqhd,bhde->bqhe", sq, matrix.repeat_interleave(rep, 1))
        den = torch.einsum("bqhd,bhd->bqh", sq, norm.repeat_interleave(rep, 1))
        empty_q = empty.repeat_interleave(rep, 1)[:, None, :, None]
        a_mem = torch.where(empty_q, 0.0, num / (den[..., None] + empty_q))
        outs.append(gate * a_mem + (1 - gate) * local)
        if update == "delta":
            stored = torch.einsum("bkhd,bhde->bkhe", sk, matrix) / (
                torch.einsum("bkhd,bhd->bkh", sk, norm)[..., None] + empty[:, None, :, None]
            )
            values = vs - torch.where(empty[:, None, :, None], 0.0, stored)
        else:
            values = vs
        matrix = matrix + torch.einsum("bkhd,bkhe->bhde", sk, values)
        norm = norm + sk.sum(1)
    return torch.cat(outs, 1), (matrix, norm)


def _inputs(batch, seqlen, heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, head_dim, generator=g)
    k = torch.randn(batch, seqlen, kv_heads, head_dim, generator=g)
    v = torch.randn(batch, seqlen, kv_heads, head_dim, generator=g)
    beta = torch.randn(heads, generator=g)  # gates 0.2-0.8: both parts matter
    dout = torch.randn(batch, seqlen, heads, head_dim, generator=g)
    return [t.to(dtype) for t in (q, k, v)] + [beta, dout.to(dtype)]


def _check(name, got, want, tol):
    err = rel_err(got, want)
    assert err < tol, f"{name}: rel err {err:.2e} >= {tol:.0e}"


# Cases stay at 2-6 segments x heads: the interpreter runs each (segment, head) program in turn.
@pytest.mark.parametrize(
    ("update", "batch", "seqlen", "segment_len", "heads", "kv_heads", "dtype"),
    [
        ("linear", 1, 20, 8, 2, 1, torch.float32),  # GQA; last segment 4 tokens
        ("delta", 1, 20, 8, 2, 1, torch.float32),
        ("linear", 2, 13, 8, 2, 2, torch.float16),  # batch rows folded into the varlen call
        ("delta", 2, 13, 8, 2, 1, torch.float16),
        ("delta", 1, 6, 8, 2, 2, torch.float32),  # one segment: the memory stays empty
        ("linear", 1, 150, 70, 2, 1, torch.float32),  # segments of two 64-row kernel blocks
    ],
)
def test_matches_float64_loop_over_segments(
    monkeypatch, device, update, batch, seqlen, segment_len, heads, kv_heads, dtype
):
    q, k, v, beta, dout = _inputs(batch, seqlen, heads, kv_heads, 16, dtype, seed=seqlen + heads)
    q, k, v, beta, dout = (t.to(device).requires_grad_(t is not dout) for t in (q, k, v, beta, dout))
    out, memory = ringflash.infini_attention(q, k, v, beta, segment_len, update=update, return_memory=True)
    assert out.dtype == dtype and memory.matrix.dtype == torch.float32
    out.backward(dout)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, beta)]
    ref_out, ref_memory = infini_reference(*ref, segment_len, update)
    ref_out.backward(dout.double().cpu())
    tol = TOLERANCE[dtype]
    _check("out", out, ref_out, tol)
    _check("memory matrix", memory.matrix, ref_memory[0], tol)
    _check("memory normalizer", memory.normalizer, ref_memory[1], tol)
    for name, got, want in zip(("dq", "dk", "dv", "dbeta"), (q, k, v, beta), ref):
        _check(name, got.grad, want.grad, tol)


@pytest.mark.parametrize("update", ["linear", "delta"])
def test_programs_over_whole_segments_of_several_row_blocks(monkeypatch, device, update):
    """Few (segment, head) programs split segments into one row block per program; many take
    whole segments and loop over their row blocks (here 3 of 64 rows, the last one partial)."""
    monkeypatch.setattr(infini_memory, "CHUNK_PROGRAMS", 1)
    q, k, v, beta, dout = _inputs(1, 300, 2, 1, 16, torch.float32, seed=11)
    q, k, v, beta, dout = (t.to(device).requires_grad_(t is not dout) for t in (q, k, v, beta, dout))
    out = ringflash.infini_attention(q, k, v, beta, 140, update=update)
    out.backward(dout)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, beta)]
    ref_out, _ = infini_reference(*ref, 140, update)
    ref_out.backward(dout.double().cpu())
    _check("out", out, ref_out, TOLERANCE[torch.float32])
    for name, got, want in zip(("dq", "dk", "dv", "dbeta"), (q, k, v, beta), ref):
        _check(name, got.grad, want.grad, TOLERANCE[torch.float32])


@pytest.mark.parametrize("head_dim", [16, 12])  # 12: the local attention outside _GatedMemory
def test_saturated_gates(device, head_dim):
    """beta 40 is a gate of exactly 1 in float32: the local attention's backward, run on dout
    with its LSE shifted by -log(1 - gate) = +inf, must give zero gradients, not NaN; beta -40
    leaves the local attention alone."""
    q, k, v, _, dout = _inputs(1, 40, 2, 1, head_dim, torch.float32, seed=3)
    beta = torch.tensor([40.0, -40.0])
    assert torch.sigmoid(beta)[0] == 1.0
    q, k, v, beta, dout = (t.to(device).requires_grad_(t is not dout) for t in (q, k, v, beta, dout))
    out = ringflash.infini_attention(q, k, v, beta, 16)
    out.backward(dout)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, beta)]
    ref_out, _ = infini_reference(*ref, 16, "linear")
    ref_out.backward(dout.double().cpu())
    _check("out", out, ref_out, TOLERANCE[torch.float32])
    for name, got, want in zip(("dq", "dk", "dv"), (q, k, v), ref):
        _check(name, got.grad, want.grad, TOLERANCE[torch.float32])
    assert torch.isfinite(beta.grad).all()


# Shares of q, k, v and out (float32, 2 query heads, 1 kv head of 16, segments of 16) for
# 40 tokens (3 segments: M 3 KiB against 15 KiB) and 60 (4 segments: 4 KiB against 22.5 KiB):
# 0.15 keeps the memories before segments 0 and 2 in both (2 KiB), 1.0 all, 0.0 none.
KEPT_BY_SHARE = {0.0: 0, 0.15: 2, 1.0: 1}


@pytest.mark.parametrize("seqlen", [40, 60])
@pytest.mark.parametrize("share", sorted(KEPT_BY_SHARE))
@pytest.mark.parametrize("rule", ["linear", "delta"])
def test_memories_kept_or_rebuilt(monkeypatch, device, rule, share, seqlen):
    """The forward keeps the memories before each segment when they are at most
    KEPT_MEMORIES_SHARE of q, k, v and out, else those before every other segment if they are,
    else none; with all kept the backward makes no second update pass (the linear rule's
    forward makes its update pass here, the delta rule's in its own module; the delta rule's
    backward rebuilds with its Gram matrices in the same pass), with every other one it makes
    that pass and steps once from each kept memory (an odd number of segments and an even
    one). From a given memory, with a gradient on the final one: the entering memory's
    gradient too."""
    monkeypatch.setattr(infini, "KEPT_MEMORIES_SHARE", share)
    calls = []
    for name in ("memory_updates", "memory_updates_and_gram", "delta_scan", "expand_kept_memories"):
        passes = getattr(infini, name)
        monkeypatch.setattr(
            infini, name, lambda *a, name=name, passes=passes, **kw: calls.append(name) or passes(*a, **kw)
        )
    q, k, v, beta, dout = _inputs(1, seqlen, 2, 1, 16, torch.float32, seed=13)
    g = torch.Generator().manual_seed(14)
    memory = (torch.randn(1, 1, 16, 16, generator=g) * 0.1, torch.rand(1, 1, 16, generator=g) * 10)
    grad_final = torch.randn(1, 1, 16, 16, generator=g)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v, beta, *memory)]
    out, final = ringflash.infini_attention(
        *leaves[:4], 16, update=rule, memory=tuple(leaves[4:]), return_memory=True
    )
    ((out * dout.to(device)).sum() + (final.matrix * grad_final.to(device)).sum()).backward()
    kept = KEPT_BY_SHARE[share]
    update_passes = [c for c in calls if c.startswith("memory_updates")]
    assert len(update_passes) == (rule == "linear") + (kept != 1)
    assert calls.count("expand_kept_memories") == (kept == 2)
    # the delta rule's backward runs its recurrence reversed, and forward too where nothing is kept
    assert calls.count("delta_scan") == (rule == "delta") * (1 + (kept == 0))
    ref = [t.detach().double().requires_grad_() for t in leaves]
    ref_out, ref_memory = infini_reference(*ref[:4], 16, rule, memory=ref[4:])
    ((ref_out * dout.double()).sum() + (ref_memory[0] * grad_final.double()).sum()).backward()
    names = ("dq", "dk", "dv", "dbeta", "d memory matrix", "d memory normalizer")
    for name, got, want in zip(names, leaves, ref):
        _check(name, got.grad, want.grad, TOLERANCE[torch.float32])
    n_seg = -(-seqlen // 16)
    z_bytes = 4 * n_seg * 16  # float32 z before each segment, one kv head
    matrices = {0: 0, 1: n_seg, 2: -(-n_seg // 2)}[kept]
    state = infini.infini_memory_bytes(1, 1, 16, seqlen, 16, heads=2, dtype=torch.float32)
    assert state == z_bytes + matrices * 16 * 16 * 4


@pytest.mark.parametrize("head_dim", [32, 96])
def test_normalizer_updates_match_float64(device, head_dim):
    """The sum of sigma(K) per segment by the delta rule's pass over k alone (its B_s comes later
    with A_s where one pass makes both), against float64: a shorter last segment, a head_dim
    that is not a power of two, k a strided view (every other head of a wider tensor)."""
    g = torch.Generator().manual_seed(31)
    wide = torch.randn(2, 230, 4, head_dim, generator=g).to(device)
    k = wide[:, :, ::2]
    dz = infini_memory.normalizer_updates(k, 64)
    sk = F.pad(F.elu(k.double()) + 1, (0, 0, 0, 0, 0, 4 * 64 - 230))
    want = sk.unflatten(1, (4, 64)).sum(2)  # padding: rows of 0
    assert dz.shape == want.shape and dz.dtype == torch.float32
    _check("dz", dz, want, TOLERANCE[torch.float32])
    _check("dz (memory_updates)", dz, infini_memory.memory_updates(k, k, 64)[1], TOLERANCE[torch.float32])


def test_expand_kept_memories_rejects_a_mismatched_count():
    """The step from the kept memories takes those before the even segments (ceil(n / 2) of
    them), the even segments' updates of the same shape and every segment's A_s: anything else
    is a clear error, not a launch."""
    updates = torch.zeros(1, 2, 1, 16, 16)
    for kept in (torch.zeros(1, 3, 1, 16, 16), torch.zeros(2, 2, 1, 16, 16)):
        with pytest.raises(ValueError, match="the even ones of 3 segments"):
            infini_delta.expand_kept_memories(kept, updates, None, 3, torch.float32)
    with pytest.raises(ValueError, match="A_s of all 3 segments"):
        infini_delta.expand_kept_memories(updates, updates, torch.zeros(1, 2, 1, 16, 16), 3, torch.float32)


@pytest.mark.parametrize("state", ["registers", "global"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_delta_rule_over_several_column_and_row_blocks(monkeypatch, device, dtype, state):
    """The delta recurrence in blocks of 16 columns (head_dim 32: two programs per head), with
    the state in registers or through global memory in tiles of 16 rows (two row tiles per
    product, as head_dim 256 runs), over 3 segments of several token blocks (the last one
    partial), from a given memory, with gradients flowing in through the final memory's matrix
    and normalizer; the backward twice gives the same bits (no atomics)."""
    monkeypatch.setattr(infini_delta, "DELTA_COLUMNS", 16)
    if state == "global":
        monkeypatch.setattr(infini_delta, "DELTA_REGISTER_ROWS", 16)
        monkeypatch.setattr(infini_delta, "DELTA_ROWS", 16)
    q, k, v, beta, dout = _inputs(2, 230, 2, 1, 32, dtype, seed=21)
    g = torch.Generator().manual_seed(22)
    memory = (torch.randn(2, 1, 32, 32, generator=g) * 0.1, torch.rand(2, 1, 32, generator=g) * 10)
    memory_grad = (torch.randn(2, 1, 32, 32, generator=g), torch.randn(2, 1, 32, generator=g))
    leaves = [t.to(device).requires_grad_() for t in (q, k, v, beta, *memory)]

    def loss(out, final, grads):
        return sum((a * b).sum() for a, b in zip((out, *final), grads))

    grads = tuple(t.to(device) for t in (dout, *memory_grad))

    out, final = ringflash.infini_attention(
        *leaves[:4], 100, update="delta", memory=tuple(leaves[4:]), return_memory=True
    )
    first = torch.autograd.grad(loss(out, final, grads), leaves, retain_graph=True)
    again = torch.autograd.grad(loss(out, final, grads), leaves)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    ref_out, ref_memory = infini_reference(*ref[:4], 100, "delta", memory=ref[4:])
    loss(ref_out, ref_memory, tuple(t.double() for t in (dout, *memory_grad))).backward()
    tol = TOLERANCE[dtype]
    _check("out", out, ref_out, tol)
    _check("memory matrix", final.matrix, ref_memory[0], tol)
    _check("memory normalizer", final.normalizer, ref_memory[1], tol)
    names = ("dq", "dk", "dv", "dbeta", "dmatrix", "dnormalizer")
    for name, got, repeat, want in zip(names, first, again, ref):
        _check(name, got, want.grad, tol)
        assert torch.equal(got, repeat), f"{name} differs between two backward passes"


# Every Infini-attention kernel built for sm_90 (no GPU needed: Triton ships ptxas) as a launch
# builds it: the tiles and options the wrappers pass, bf16, head_dim 64/128/256, pointers, strides
# and lengths with the divisible-by-16 hint a launch gives them (which lets Triton pipeline the
# row loops: without it, head_dim 256's retrieval needs 48 KB of shared memory, with it and 3
# stages 304 KB, a launch failure). They fit shared memory; up to head_dim 128 they spill at most
# 512 B (the tuned head_dim-128 retrieval backward, which also sums the memory's gradient,
# spills 372 B and ran fastest; docs/experiments.md 26, 30).
_INFINI_SM90 = r"""
import torch, triton
from ringflash.kernels.infini import delta, memory, retrieval
from ringflash.kernels.offline_compile import SHARED_MEMORY_LIMIT, compile_kernel, resource_usage

FLOAT32 = {"U", "A", "INIT", "OUT", "FINAL", "Z", "DM", "DZ", "GDZ", "GZ_PART", "X", "MEMORY"}
FLOAT32 |= {"GATE", "INV", "GDEN", "GGATE", "DELTA", "GM", "GZ"}


def build(kernel, launch, float32=FLOAT32, **constexprs):
    constexprs = dict(launch, **constexprs)
    options = {"num_warps": constexprs.pop("num_warps"), "num_stages": constexprs.pop("num_stages", 3)}
    lengths = ("seqlen", "segment_len", "chunk")
    aligned = [n for n in kernel.arg_names if n[0].isupper() or n.startswith("stride") or n in lengths]
    compiled = compile_kernel(kernel, constexprs, float32=float32, aligned=aligned, **options)
    use = resource_usage(compiled)
    where = (kernel.fn.__name__, constexprs, options, use)
    assert use.shared_bytes <= SHARED_MEMORY_LIMIT[90], where
    assert constexprs["HEAD_DIM"] > 128 or use.spill_bytes <= 512, where
    print(kernel.fn.__name__, constexprs["HEAD_DIM"], options, use)


for d in (64, 128, 256):
    rows = memory.row_tile(d)
    for columns in (64, 128) if d <= 128 else (64,):  # _launch_updates: 128 with enough programs
        for gram in (False, True):
            t = memory.tiles(d, torch.bfloat16, columns, rows, "gram" if gram else "updates")
            build(memory._update_kernel, t, GRAM=gram)
    for gram, den_only, name in ((False, False, "updates_backward"), (True, False, "gram_backward"),
                                 (True, True, "gram_den")):  # fmt: skip
        t = memory.tiles(d, torch.bfloat16, memory.column_tile(d), memory.GRAM_ROWS if gram else rows, name)
        build(memory._update_backward_kernel, t, GRAM=gram, DEN_ONLY=den_only)
    build(memory._scan_kernel, dict(HEAD_DIM=d, num_warps=4), HAS_INIT=True, REVERSE=True,
          SEGMENTS=memory.SCAN_SEGMENTS, BLOCK=memory.SCAN_BLOCK)  # fmt: skip
    t = memory.tiles(d, torch.bfloat16, memory.column_tile(d), rows, "retrieval")
    build(retrieval._retrieval_kernel, t, GROUP=2)
    t = memory.tiles(d, torch.bfloat16, memory.column_tile(d), 32, "retrieval_backward")
    one_pass = t["BLOCK_N"] == t["BLOCK_D"]  # the memory's gradient in the same pass
    build(retrieval._retrieval_backward_kernel, t, GROUP=2, LOCAL_DELTA=True, STATE=one_pass)
    if not one_pass:
        build(retrieval._retrieval_state_backward_kernel, t, GROUP=2)
    for transpose in (False, True):
        t = delta.scan_tiles(d, torch.bfloat16)  # A in bf16, and OUT where the state stays in registers
        bf16 = {"A", "OUT"} if t["BLOCK_R"] == t["BLOCK_D"] else {"A"}
        build(delta._delta_scan_kernel, t, FLOAT32 - bf16, HAS_INIT=True, TRANSPOSE=transpose)
    t = delta.gram_gradient_tiles(d, torch.bfloat16)
    build(delta._gram_gradient_kernel, t, FLOAT32 - {"X", "MEMORY", "OUT"})  # all three bf16
print("infini ok")
"""


def test_infini_kernels_compile_for_sm90(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    run = subprocess.run(
        [sys.executable, "-c", _INFINI_SM90], env=env, capture_output=True, text=True, timeout=900
    )
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("this Triton install has no ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("infini ok")


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [0, 1, 2])  # the memories before no, every, every other segment
@pytest.mark.parametrize("whole_segments", [False, True])
@pytest.mark.parametrize("update", ["linear", "delta"])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_bf16_tensor_core_memory_matches_float64(monkeypatch, device, update, whole_segments, head_dim, kept):
    """bf16 inputs take the memory kernels' tensor-core path (bf16 operands, float32
    accumulation), which the interpreter cannot run: head_dim 128 and 256 (the delta
    recurrence's state in registers, or through global memory), segments of several token
    blocks (one program per row block, or with ``whole_segments`` per segment), GQA and a
    shorter last segment, the memories before each segment kept in bf16 for the backward,
    those before every other one (the backward steps from each), or none (it rebuilds them),
    against the float64 loop."""
    if whole_segments:
        monkeypatch.setattr(infini_memory, "CHUNK_PROGRAMS", 1)
    monkeypatch.setattr(infini, "_kept_stride", lambda *shape: kept)
    q, k, v, beta, dout = _inputs(2, 700, 4, 2, head_dim, torch.bfloat16, seed=7)
    q, k, v, beta, dout = (t.to(device).requires_grad_(t is not dout) for t in (q, k, v, beta, dout))
    out, memory = ringflash.infini_attention(q, k, v, beta, 256, update=update, return_memory=True)
    out.backward(dout)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, beta)]
    ref_out, ref_memory = infini_reference(*ref, 256, update)
    ref_out.backward(dout.double().cpu())
    tol = TOLERANCE[torch.bfloat16]
    _check("out", out, ref_out, tol)
    _check("memory matrix", memory.matrix, ref_memory[0], tol)
    for name, got, want in zip(("dq", "dk", "dv", "dbeta"), (q, k, v, beta), ref):
        _check(name, got.grad, want.grad, tol)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors: the interpreter")
@pytest.mark.parametrize(
    "shapes, dtype, match",
    [
        (((1, 3, 1, 128, 128), (1, 3, 1, 128)), torch.float16, "one state per segment"),  # 3 for 2 segments
        (((1, 2, 1, 128, 128), (1, 2, 1, 64)), torch.float16, "one state per segment"),  # gdz's head_dim
        (((1, 2, 1, 128, 128), (1, 2, 1, 128)), torch.float32, "in q's dtype"),
        (((1, 2, 1, 128, 128), (1, 2, 1, 128), (1, 2, 1, 64, 128)), torch.float16, "S must match"),
    ],
)
def test_fused_backward_rejects_mismatched_updates_grads(shapes, dtype, match):
    """The fused Hopper backward checks the memory updates' gradients it is given against the
    problem's segments and kv heads before it launches (a mismatch would read other segments'
    states)."""
    from ringflash.kernels import build_problem, cu_seqlens_tensor
    from ringflash.kernels.hopper.dispatch import hopper_module

    backward = hopper_module("backward")
    if backward is None:
        pytest.skip("no Gluon in this Triton")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(256, 2, 128, generator=g).half()
    k, v = (torch.randn(256, 1, 128, generator=g).half() for _ in range(2))
    cu = cu_seqlens_tensor([0, 128, 256], None)
    problem = build_problem(q, k, v, None, True, (-1, -1), cu_seqlens_q=cu, cu_seqlens_k=cu,
                            max_seqlen_q=128, max_seqlen_k=128)  # fmt: skip
    lse, delta = (torch.randn(problem.lse_shape(256), generator=g) for _ in range(2))
    grads = (torch.randn(shapes[0], generator=g).to(dtype), torch.randn(shapes[1], generator=g))
    if len(shapes) == 3:  # the delta rule's S and z
        grads += (torch.randn(shapes[2], generator=g).to(dtype), torch.randn(shapes[1], generator=g))
    dq, dk, dv = torch.randn(q.shape, generator=g), torch.empty_like(k), torch.empty_like(v)
    with pytest.raises(ValueError, match=match):
        backward.fused_backward(q, q, k, v, lse, delta, problem, dq, dk, dv, False, grads)


@pytest.mark.gpu
@pytest.mark.parametrize("update", ["linear", "delta"])
@pytest.mark.parametrize(
    ("batch", "seqlen", "heads", "kv_heads", "segment_len"),
    [
        (2, 1000, 4, 2, 256),  # GQA; a shorter last segment: a key tile past its segment's end
        (1, 4096, 2, 2, 2048),  # whole 128-key tiles
    ],
)
def test_hopper_updates_backward_fused_into_local(
    monkeypatch, batch, seqlen, heads, kv_heads, segment_len, update
):  # fmt: skip
    """The memory updates' backward (the delta rule's with its Gram terms) added into the local
    attention's dK and dV inside the fused Hopper backward (backward.py's MEMORY epilogue,
    ``infini.local.local_backward``) gives the separate kernels' gradients and float64's."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90")
    from ringflash.kernels.hopper import backward as hopper_backward

    calls = []
    fused_backward = hopper_backward.fused_backward

    def counted(*args):  # how many of the updates' gradients each launch carried
        calls.append(len(args[11]) if len(args) > 11 and args[11] is not None else 0)
        return fused_backward(*args)

    monkeypatch.setattr(hopper_backward, "fused_backward", counted)
    q, k, v, beta, dout = _inputs(batch, seqlen, heads, kv_heads, 128, torch.bfloat16, seed=5)
    grads = []
    for flag in ("1", "0"):
        monkeypatch.setenv("RINGFLASH_HOPPER_INFINI", flag)
        leaves = [t.cuda().requires_grad_() for t in (q, k, v, beta)]
        ringflash.infini_attention(*leaves, segment_len, update=update).backward(dout.cuda())
        grads.append([t.grad for t in leaves])
    # fused (gdM, gdz[, S, z]), then the updates' own kernel and a plain backward
    assert calls == [2 if update == "linear" else 4, 0]
    ref = [t.double().requires_grad_() for t in (q, k, v, beta)]
    infini_reference(*ref, segment_len, update)[0].backward(dout.double())
    for name, fused, separate, want in zip(("dq", "dk", "dv", "dbeta"), *grads, ref):
        assert torch.isfinite(fused).all(), name
        _check(name, fused, want.grad, TOLERANCE[torch.bfloat16])
        _check(name + " (separate kernels)", fused, separate, 1e-2)


def _retrieval_backward_inputs(batch, seqlen, heads, kv_heads, segment_len, seed):
    """q, local, dout (batch, seqlen, heads, 128) bf16 on the GPU, the memories before each
    segment of random keys and values (M in bf16, z float32) and gates in (0.1, 0.9) that bite."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, local, dout = (
        torch.randn(batch, seqlen, heads, 128, device="cuda", generator=g).bfloat16() for _ in range(3)
    )
    k, v = (
        torch.randn(batch, seqlen, kv_heads, 128, device="cuda", generator=g).bfloat16() for _ in range(2)
    )
    dm, dz = infini_memory.memory_updates(k, v, segment_len)
    m_before = infini_memory.memory_scan(dm, None, torch.bfloat16)[0]
    z_before = infini_memory.memory_scan(dz, None, torch.float32)[0]
    gate = torch.rand(heads, device="cuda", generator=g) * 0.8 + 0.1
    return q, local, dout, m_before, z_before, gate


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batch", "seqlen", "heads", "kv_heads", "segment_len", "whole_segments"),
    [
        (2, 1000, 4, 2, 300, False),  # GQA; segments and chunks that are not whole 128-row steps
        (1, 4096, 8, 8, 2048, True),  # whole segments of 16 steps per program
        (2, 700, 4, 1, 256, True),  # MQA, a shorter last segment ending inside a 64-row block
    ],
)
def test_hopper_retrieval_backward_matches_triton(monkeypatch, batch, seqlen, heads, kv_heads, segment_len,
                                                  whole_segments):  # fmt: skip
    """The retrieval's backward on the Hopper kernel (kernels/hopper/infini_retrieval.py) gives
    the Triton kernel's dq, gate, memory and delta gradients, from memories of random keys and
    values, a random output gradient and gates that bite."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90")
    from ringflash.kernels.hopper import infini_retrieval
    from ringflash.kernels.infini import retrieval

    if whole_segments:
        monkeypatch.setattr(infini_memory, "CHUNK_PROGRAMS", 1)
    q, local, dout, m_before, z_before, gate = _retrieval_backward_inputs(
        batch, seqlen, heads, kv_heads, segment_len, seed=31
    )
    calls = []
    launch = infini_retrieval.launch_retrieval_backward

    def counted(*args):
        calls.append(1)
        return launch(*args)

    monkeypatch.setattr(infini_retrieval, "launch_retrieval_backward", counted)
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("RINGFLASH_HOPPER_INFINI", flag)
        delta = torch.full((heads, batch * seqlen), float("nan"), device="cuda")
        dq, dlocal, *grads = retrieval.memory_retrieval_backward(
            q, local, gate, m_before, z_before, segment_len, dout, delta, torch.float32
        )
        assert dlocal is None
        results.append((dq, *grads, delta))
    assert calls == [1]  # the first run took the Hopper kernel, the second Triton's
    for name, got, want in zip(("dq", "dgate", "d memory", "d normalizer", "delta"), *results):
        assert torch.isfinite(got).all(), name
        _check(name, got, want, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batch", "seqlen", "heads", "kv_heads", "runs"),
    [
        (2, 32768, 8, 4, 8),  # 128 programs of 32 steps, two query heads per program (GQA)
        (1, 4096, 8, 8, 300),  # 16 programs of 16 steps: a race in the first step shows here
    ],
)
def test_hopper_retrieval_backward_is_deterministic(monkeypatch, batch, seqlen, heads, kv_heads, runs):
    """The Hopper retrieval backward's warpgroups hand each step's tiles over by named barriers,
    reuse the z operand's buffer every other step and the local tile's every step
    (kernels/hopper/infini_retrieval.py): a hand-over out of order reads a tile being rewritten.
    Repeated runs over whole 2048-token segments give the same bits (the kernel has no atomics).
    Without the proxy fence before the local tile's release, 1-3 runs of 300 of the second case
    differed in a few rows of the first step."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90")
    from ringflash.kernels.hopper import infini_retrieval
    from ringflash.kernels.infini import retrieval

    calls, launch = [], infini_retrieval.launch_retrieval_backward
    counted = lambda *args: calls.append(args[-1]) or launch(*args)  # noqa: E731
    monkeypatch.setattr(infini_retrieval, "launch_retrieval_backward", counted)
    monkeypatch.setattr(infini_memory, "CHUNK_PROGRAMS", 1)  # whole segments, one program each
    segment_len = 2048
    q, local, dout, m_before, z_before, gate = _retrieval_backward_inputs(
        batch, seqlen, heads, kv_heads, segment_len, seed=41
    )

    def run():
        delta = torch.empty(heads, batch * seqlen, device="cuda")
        dq, _, *grads = retrieval.memory_retrieval_backward(
            q, local, gate, m_before, z_before, segment_len, dout, delta, torch.float32
        )
        return dq, *grads, delta

    first = run()
    differing = dict.fromkeys(("dq", "dgate", "d memory", "d normalizer", "delta"), 0)
    for _ in range(runs - 1):
        for name, want, got in zip(differing, first, run()):
            differing[name] += not torch.equal(want, got)
    assert calls == [segment_len] * runs  # the Hopper kernel, whole segments
    for name, result in zip(differing, first):
        assert torch.isfinite(result).all(), name
    assert not any(differing.values()), f"runs differing from the first: {differing}"


# The Hopper updates kernel's cases (the updates, their backward, the Gram matrices).
def _hopper_keys_values(batch, seqlen, kv_heads, packed, seed):
    """(k, v, the generator that drew them, for the test's further inputs): bf16 (batch, seqlen,
    kv_heads, 128) on the GPU, with ``packed`` strided views of one (batch, seqlen, 2 * kv_heads,
    128) tensor, else contiguous copies."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(batch, seqlen, 2 * kv_heads, 128, device="cuda", generator=g).bfloat16()
    k, v = kv[:, :, :kv_heads], kv[:, :, kv_heads:]
    return (k, v, g) if packed else (k.contiguous(), v.contiguous(), g)


def _gram_weights(k, segment_len, g):
    """(z before each segment, float64 sigma(K) per segment (batch, segments, segment_len, kv_heads,
    128; zero rows past the sequence), the Gram weights w = 1 / (sigma(K) z), 0 where z = 0): z
    grows with the tokens before the segment (a sum of sigma(K) > 0), 0 before the first, with a
    spread across entries so that w differs from token to token."""
    batch, seqlen, kv_heads = k.shape[:3]
    n_seg = -(-seqlen // segment_len)
    z_before = torch.rand(batch, n_seg, kv_heads, 128, device="cuda", generator=g) * 2 * segment_len
    z_before *= torch.arange(n_seg, device="cuda")[None, :, None, None]
    pad = n_seg * segment_len - seqlen
    sk_s = F.pad(F.elu(k.double()) + 1, (0, 0, 0, 0, 0, pad)).unflatten(1, (n_seg, -1))
    den = torch.einsum("bstkd,bskd->bstk", sk_s, z_before.double())
    return z_before, sk_s, torch.where(den > 0, 1 / den.clamp_min(1e-300), 0.0)


UPDATE_SHAPES = pytest.mark.parametrize(
    "batch, seqlen, kv_heads, segment_len, packed",
    [
        (2, 1000, 3, 200, False),  # segments of partial 64-token blocks, a shorter last one
        (1, 40000, 8, 256, False),  # more (segment, head) items than SMs: programs walk several
        (2, 4096, 2, 2048, True),  # k (and v) strided views of one (batch, seqlen, 2 * heads, 128)
    ],
)


@pytest.mark.gpu
@UPDATE_SHAPES
def test_hopper_updates_match_float64(monkeypatch, batch, seqlen, kv_heads, segment_len, packed):
    """The per-segment memory updates and their backward on the Hopper kernels
    (kernels/hopper/infini_updates.py) against float64 sums over each segment, and against the
    Triton kernels, from random keys, values and gradients."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90")
    from ringflash.kernels.hopper import infini_updates

    k, v, g = _hopper_keys_values(batch, seqlen, kv_heads, packed, seed=7)
    n_seg = -(-seqlen // segment_len)
    grad_dm = (torch.randn(batch, n_seg, kv_heads, 128, 128, device="cuda", generator=g) / 100).bfloat16()
    grad_dz = torch.randn(batch, n_seg, kv_heads, 128, device="cuda", generator=g) / 100
    kd, vd = k.double().requires_grad_(), v.double().requires_grad_()
    pad = n_seg * segment_len - seqlen
    sk_s, v_s = (F.pad(t, (0, 0, 0, 0, 0, pad)).unflatten(1, (n_seg, -1)) for t in (F.elu(kd) + 1, vd))
    want = (torch.einsum("bstkd,bstke->bskde", sk_s, v_s), sk_s.sum(2))  # padding: sigma rows of 0
    want_grads = torch.autograd.grad(want, (kd, vd), (grad_dm.double(), grad_dz.double()))
    calls = []
    launches = {name: getattr(infini_updates, name) for name in ("launch_updates", "launch_updates_backward")}

    def poisoned(name):  # every output must be written
        def launch(*args):
            calls.append(name)
            outputs = args[3:5] if name == "launch_updates" else args[4:6]
            for t in outputs:
                t.fill_(float("nan"))
            return launches[name](*args)

        return launch

    for name in launches:
        monkeypatch.setattr(infini_updates, name, poisoned(name))
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("RINGFLASH_HOPPER_INFINI", flag)
        results.append(
            infini_memory.memory_updates(k, v, segment_len)
            + infini_memory.memory_updates_backward(k, v, segment_len, grad_dm, grad_dz)
        )
    assert calls == list(launches)  # the first run took the Hopper kernels, the second Triton's
    _check("dz (normalizer pass)", infini_memory.normalizer_updates(k, segment_len), want[1], 1e-4)
    for name, hopper, triton_, ref in zip(("dM", "dz", "dk", "dv"), *results, want + want_grads):
        assert torch.isfinite(hopper).all(), name
        _check(name, hopper, ref, 1e-2)  # bf16 operands
        _check(name + " (Triton)", hopper, triton_, 1e-2 if name == "dk" else 1e-3)


@pytest.mark.gpu
@UPDATE_SHAPES
def test_hopper_gram_matches_float64(monkeypatch, batch, seqlen, kv_heads, segment_len, packed):
    """The delta rule's weighted Gram matrices A_s = sigma(K)^T diag(w) sigma(K), w = 1 /
    (sigma(K) z_s), on the Hopper updates kernel (kernels/hopper/infini_updates.py, GRAM) against
    float64 and against the Triton kernel; the first segment's z is 0 (w = 0, A_s = 0). The pass
    that builds them beside the updates (the backward's rebuild) gives the same bits as each
    pass alone, and so does the one that makes the even segments' updates alone (a second
    launch for the odd segments' A_s: every segment's written)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90")
    from ringflash.kernels.hopper import infini_updates

    k, v, g = _hopper_keys_values(batch, seqlen, kv_heads, packed, seed=11)
    z_before, sk_s, w = _gram_weights(k, segment_len, g)
    want = torch.einsum("bstkd,bstk,bstke->bskde", sk_s, w, sk_s)
    calls = []
    launch = infini_updates.launch_updates

    def poisoned(*args):  # every output must be written
        k_, v_, segment_len_, dm, dz, z, gram, even = args
        calls.append((dm is not None, z is not None, even))
        for t in (dm, dz, gram):
            if t is not None:
                t.fill_(float("nan"))
        return launch(*args)

    monkeypatch.setattr(infini_updates, "launch_updates", poisoned)
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("RINGFLASH_HOPPER_INFINI", flag)
        results.append(infini_memory.memory_gram(k, z_before, segment_len))
    monkeypatch.setenv("RINGFLASH_HOPPER_INFINI", "1")
    dm, dz, gram = infini_memory.memory_updates_and_gram(k, v, z_before, segment_len)
    updates = infini_memory.memory_updates(k, v, segment_len)
    even_dm, even_dz, even_gram = infini_memory.memory_updates_and_gram(k, v, z_before, segment_len, True)
    even_updates = infini_memory.memory_updates(k, v, segment_len, even_updates=True)
    # the Hopper kernel: A alone, then A and the updates, then the updates alone, each for every
    # segment and then the even segments' updates (Triton's run, second, makes no launch)
    assert calls == [(False, True, False), (True, True, False), (True, False, False), (True, True, True),
                     (True, False, True)]  # fmt: skip
    hopper, triton_ = results
    assert hopper.dtype == torch.bfloat16 and torch.isfinite(hopper).all()
    assert (hopper[:, 0] == 0).all()  # z = 0: nothing to retrieve, nothing subtracted
    _check("A", hopper, want, 1e-2)  # bf16 operands
    _check("A (Triton)", hopper, triton_, 4e-3)  # bf16(w sigma) on the other side of the product
    assert torch.equal(gram, hopper) and torch.equal(dm, updates[0]) and torch.equal(dz, updates[1])
    assert torch.equal(even_gram, hopper)
    for got, every in ((even_dm, dm), (even_dz, dz), *zip(even_updates, updates)):
        assert got.shape[1] == -(-every.shape[1] // 2) and torch.equal(got, every[:, ::2])


@pytest.mark.gpu
@UPDATE_SHAPES
def test_hopper_gram_den_matches_float64(monkeypatch, batch, seqlen, kv_heads, segment_len, packed):
    """The delta rule's gradient of z before each segment through the Gram weights w = 1 /
    (sigma(K) z_s), given S = dA + dA^T (kernels/hopper/infini_gram_den.py): gz_s = sum over the
    segment's tokens of -w^2 (sigma(k) S sigma(k)) / 2 sigma(k), against float64 and the Triton
    pass; the first segment's z is 0 (w = 0: no gradient)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90")
    from ringflash.kernels.hopper import infini_gram_den

    k, _, g = _hopper_keys_values(batch, seqlen, kv_heads, packed, seed=12)
    z_before, sk_s, w = _gram_weights(k, segment_len, g)
    s_grad = torch.randn(*z_before.shape, 128, device="cuda", generator=g)
    s_grad = s_grad + s_grad.transpose(-1, -2)  # S is symmetric, of either sign
    quad = torch.einsum("bstkd,bskde,bstke->bstk", sk_s, s_grad.double(), sk_s)
    want = torch.einsum("bstk,bstkd->bskd", -0.5 * w * w * quad, sk_s)
    calls = []
    launch = infini_gram_den.launch_gram_den

    def counted(*args):
        calls.append(args[3])
        return launch(*args)

    monkeypatch.setattr(infini_gram_den, "launch_gram_den", counted)
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("RINGFLASH_HOPPER_INFINI", flag)
        results.append(infini_memory.memory_gram_den_backward(k, segment_len, s_grad, z_before))
    assert calls == [segment_len]  # the first run took the Hopper kernel, the second Triton's
    hopper, triton_ = results
    assert torch.isfinite(hopper).all()
    assert (hopper[:, 0] == 0).all()  # z = 0 before the first segment
    _check("gz", hopper, want, 1e-2)  # bf16 operands of P = sigma(K) S
    _check("gz (Triton)", hopper, triton_, 1e-3)


def _random_memories(batch, n_seg, heads, kv_heads, generator):
    """(M (batch, n_seg, kv_heads, 128, 128) bf16 of random matrices, z of the same states,
    float32, 0 before the first segment (an empty memory), gates (heads,) that bite) on the GPU."""
    m = torch.randn(batch, n_seg, kv_heads, 128, 128, device="cuda", generator=generator).bfloat16()
    z = torch.rand(batch, n_seg, kv_heads, 128, device="cuda", generator=generator) * 10
    z[:, 0] = 0
    gate = torch.rand(heads, device="cuda", generator=generator) * 0.8 + 0.1
    return m, z, gate


def _retrieval_float64(q, local, m, z, gate, segment_len):
    """gate * sigma(q) M / (sigma(q) z) + (1 - gate) * local per segment in float64 (an empty
    memory retrieves 0): q, local (batch, seqlen, heads, head_dim), M, z before each segment."""
    batch, seqlen, heads, _ = q.shape
    n_seg, kv_heads = m.shape[1], m.shape[2]
    pad = n_seg * segment_len - seqlen
    sq = F.pad(F.elu(q.double()) + 1, (0, 0, 0, 0, 0, pad)).unflatten(1, (n_seg, segment_len))
    m_h, z_h = (x.double().repeat_interleave(heads // kv_heads, 2) for x in (m, z))  # per query head
    den = torch.einsum("bnthd,bnhd->bnth", sq, z_h)
    inv = torch.where(den > 0, 1 / den, 0.0)
    a_mem = (torch.einsum("bnthd,bnhde->bnthe", sq, m_h) * inv[..., None]).flatten(1, 2)[:, :seqlen]
    return gate.double()[:, None] * a_mem + (1 - gate.double())[:, None] * local.double()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch, seqlen, heads, kv_heads, segment_len, packed_qkv",
    [
        (2, 1000, 3, 3, 200, False),  # segments of partial 64-token blocks, a shorter last one
        (1, 40000, 8, 2, 256, False),  # GQA, more (segment, head) items than SMs
        (2, 4096, 4, 1, 2048, True),  # MQA; q a view of a longer (batch, seqlen + 64, 3 * heads, 128)
    ],
)
def test_hopper_retrieval_matches_float64(monkeypatch, batch, seqlen, heads, kv_heads, segment_len,
                                          packed_qkv):  # fmt: skip
    """The retrieval on the Hopper kernel (kernels/hopper/infini_retrieval.py) against float64
    and against the Triton kernel: memories of random matrices, normalizers that are 0 before
    the first segment (an empty memory retrieves 0), gates that bite."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90")
    from ringflash.kernels.hopper import infini_retrieval
    from ringflash.kernels.infini import retrieval

    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(batch, seqlen + 64, 3 * heads, 128, device="cuda", generator=g).bfloat16()[:, :seqlen]
    q = qkv[:, :, :heads] if packed_qkv else qkv[:, :, :heads].contiguous()  # view: rows and batches apart
    local = qkv[:, :, heads : 2 * heads].contiguous()
    n_seg = -(-seqlen // segment_len)
    m, z, gate = _random_memories(batch, n_seg, heads, kv_heads, g)
    want = _retrieval_float64(q, local, m, z, gate, segment_len)
    calls = []
    launch = infini_retrieval.launch_retrieval

    def poisoned(q, local, out, *args):  # every output row must be written
        calls.append(1)
        out.fill_(float("nan"))
        return launch(q, local, out, *args)

    monkeypatch.setattr(infini_retrieval, "launch_retrieval", poisoned)
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("RINGFLASH_HOPPER_INFINI", flag)
        results.append(retrieval.memory_retrieval(q, local, gate, m, z, segment_len))
    assert calls == [1]  # the first run took the Hopper kernel, the second Triton's
    assert torch.isfinite(results[0]).all()
    _check("out", results[0], want, 1e-2)  # bf16 operands and output
    _check("out (Triton)", results[0], results[1], 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch, seqlen, heads, kv_heads, segment_len",
    [
        (2, 1000, 4, 2, 256),  # GQA; a shorter last segment: a query tile's second half past its end
        (1, 4096, 8, 2, 2048),  # whole 128-row query tiles, several items per (segment, kv head)
        (3, 300, 2, 1, 100),  # MQA; segments shorter than a query tile
    ],
)
def test_hopper_retrieval_fused_into_local_forward(monkeypatch, batch, seqlen, heads, kv_heads, segment_len):
    """The retrieval in the fused Hopper forward's epilogue (forward.py's MEMORY,
    ``infini.local.local_forward``) against float64 from the attention output it writes, and that
    output and its LSE against the plain forward's: memories of random matrices, normalizers
    that are 0 before the first segment (an empty memory retrieves 0), gates that bite."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm_90")
    from ringflash.kernels import attention_forward
    from ringflash.kernels.hopper import forward as hopper_forward
    from ringflash.kernels.infini.local import local_forward

    q, k, v, _, _ = (t.cuda() for t in _inputs(batch, seqlen, heads, kv_heads, 128, torch.bfloat16, seed=3))
    g = torch.Generator(device="cuda").manual_seed(12)
    n_seg = -(-seqlen // segment_len)
    m, z, gate = _random_memories(batch, n_seg, heads, kv_heads, g)
    calls = []
    fused_forward = hopper_forward.fused_forward

    def poisoned(q, k, v, problem, out, lse, retrieval=None):  # every output row must be written
        calls.append(retrieval is not None)
        for t in (out, *(retrieval or ())[:1]):
            t.fill_(float("nan"))
        return fused_forward(q, k, v, problem, out, lse, retrieval)

    monkeypatch.setattr(hopper_forward, "fused_forward", poisoned)
    flat, problem = infini._local_problem(q, k, v, segment_len, 1 / math.sqrt(128))
    local, lse, out = local_forward(*flat, problem, (gate, m, z))
    plain, plain_lse = attention_forward(*flat, problem)
    assert calls == [True, False]
    assert out is not None and torch.isfinite(out).all() and torch.isfinite(local).all()
    assert torch.equal(local, plain) and torch.equal(lse, plain_lse)
    local, out = local.view(q.shape), out.view(q.shape)
    want = _retrieval_float64(q, local, m, z, gate, segment_len)
    _check("out", out, want, 1e-2)  # bf16 operands and output
    first = min(segment_len, seqlen)  # an empty memory: the attention alone
    alone = (1 - gate.double())[:, None] * local[:, :first].double()
    _check("out of the first segment", out[:, :first], alone, 1e-2)


# A process's first backward, where the linear rule's first launch is the Hopper updates kernel.
_FIRST_BACKWARD = """
import torch, ringflash
q, k, v, dout = (torch.randn(1, 1024, 2, 128, device="cuda").bfloat16() for _ in range(4))
leaves = [t.requires_grad_() for t in (q, k, v, torch.zeros(2, device="cuda"))]
ringflash.infini_attention(*leaves, 256).backward(dout)
assert all(torch.isfinite(t.grad).all() for t in leaves)
print("backward ok")
"""


@pytest.mark.gpu
def test_hopper_kernel_first_in_a_backward():
    """Autograd runs the backward on a thread of its own, where no CUDA context was current
    before its first launch; the Hopper kernels' TMA descriptors need one (this failed with
    "invalid device context" before ``tma.make_context_current``)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90")
    run = subprocess.run([sys.executable, "-c", _FIRST_BACKWARD], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "backward ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("update", ["linear", "delta"])
def test_two_calls_carrying_the_memory_equal_one_call(device, update):
    q, k, v, beta, dout = (t.to(device) for t in _inputs(1, 20, 2, 1, 16, torch.float32, seed=5))
    grads = []
    for split in (None, 16):  # 2 segments of 8, the rest in the second call
        leaves = [t.clone().requires_grad_() for t in (q, k, v, beta)]
        qq, kk, vv, bb = leaves
        if split is None:
            out, memory = ringflash.infini_attention(qq, kk, vv, bb, 8, update=update, return_memory=True)
        else:
            first, memory = ringflash.infini_attention(
                qq[:, :split], kk[:, :split], vv[:, :split], bb, 8, update=update, return_memory=True
            )
            second, memory = ringflash.infini_attention(
                qq[:, split:], kk[:, split:], vv[:, split:], bb, 8, update=update, memory=memory,
                return_memory=True,
            )  # fmt: skip
            out = torch.cat([first, second], 1)
        (out * dout).sum().backward()
        grads.append([out, *memory, *(t.grad for t in leaves)])
    for name, one, two in zip(("out", "matrix", "normalizer", "dq", "dk", "dv", "dbeta"), *grads):
        _check(name, two, one, 1e-5)


def _sequence_parallel(update, case):
    world, dtype, seed, head_dim = case
    rank = dist.get_rank()
    q, k, v, beta, dout = _inputs(1, 8 * 2 * world, 2, 1, head_dim, dtype, seed)
    shard = slice(rank * 16, (rank + 1) * 16)  # contiguous: two segments of 8 per rank
    leaves = [t[:, shard].to(worker_device()).requires_grad_() for t in (q, k, v)]
    beta = beta.to(worker_device()).requires_grad_()
    initial, memory_grad = _memory_and_gradient(seed, head_dim)
    initial = [t.to(worker_device()).requires_grad_() for t in initial]
    out, memory = ringflash.infini_attention(
        *leaves, beta, 8, group=dist.group.WORLD, update=update, memory=tuple(initial), return_memory=True
    )
    loss = (out * dout[:, shard].to(worker_device())).sum()
    if rank == 0:  # the final memory enters the loss once
        loss = loss + sum((m * g.to(worker_device())).sum() for m, g in zip(memory, memory_grad))
    loss.backward()
    grads = (*(t.grad for t in leaves), beta.grad, *(t.grad for t in initial))
    return [t.detach().cpu() for t in (out, *memory, *grads)]


def _memory_and_gradient(seed, head_dim):
    """An initial memory (matrix, normalizer) for 1 batch row, 1 kv head of head_dim, and
    gradients for the final one."""
    g = torch.Generator().manual_seed(seed + 1)
    d = head_dim
    initial = (torch.randn(1, 1, d, d, generator=g) * 0.1, torch.rand(1, 1, d, generator=g) * 10)
    return initial, (torch.randn(1, 1, d, d, generator=g), torch.randn(1, 1, d, generator=g))


# 2 ranks: first and last only; 3 ranks add a middle one that both receives and sends (the
# relay) or sits inside the prefix sum. A fourth rank would only repeat the middle. Head dim 12:
# the local attention outside the memory path's autograd Function (not a multiple of 8).
@pytest.mark.parametrize(
    ("world", "update", "head_dim"),
    [
        (2, "linear", 16),
        (3, "linear", 16),
        (2, "delta", 16),
        (3, "delta", 16),
        (3, "linear", 12),
        (3, "delta", 12),
    ],
)
def test_sequence_parallel_equals_single_device(rank_pool, world, update, head_dim):
    seed = 10 + world
    results = rank_pool(world).run(_sequence_parallel, update, (world, torch.float32, seed, head_dim))
    q, k, v, beta, dout = _inputs(1, 16 * world, 2, 1, head_dim, torch.float32, seed)
    initial, memory_grad = _memory_and_gradient(seed, head_dim)
    ref = [t.double().requires_grad_() for t in (q, k, v, beta, *initial)]
    ref_out, (matrix, norm) = infini_reference(*ref[:4], 8, update, memory=ref[4:])
    loss = (ref_out * dout.double()).sum()
    (loss + (matrix * memory_grad[0].double()).sum() + (norm * memory_grad[1].double()).sum()).backward()
    tol = TOLERANCE[torch.float32]
    for i, (name, want) in enumerate(zip(("out", "", "", "dq", "dk", "dv"), (ref_out, 0, 0, *ref[:3]))):
        if name:
            _check(name, torch.cat([r[i] for r in results], 1), want.grad if name[0] == "d" else want, tol)
    for r in results:  # every rank returns the memory after the whole sequence
        _check("memory matrix", r[1], matrix, tol)
        _check("memory normalizer", r[2], norm, tol)
    _check("dbeta (sum over ranks)", sum(r[6] for r in results), ref[3].grad, tol)
    _check("dmatrix (sum over ranks)", sum(r[7] for r in results), ref[4].grad, tol)
    _check("dnormalizer (sum over ranks)", sum(r[8] for r in results), ref[5].grad, tol)


def _sequence_parallel_on_gpus(update, world):
    """One rank of a real-size run (bf16, head_dim 128, GQA: the Hopper kernels on an sm_90 GPU,
    NCCL between ranks): the sharded call against the whole sequence on the rank's own GPU;
    returns the relative errors of its shard of out, dq, dk, dv and of beta's gradient summed
    over the ranks."""
    rank = dist.get_rank()
    segment_len = 1000  # segments end inside 64- and 128-row tiles
    per_rank = 2 * segment_len  # whole segments per rank (the sharded call's condition)
    inputs = _inputs(2, per_rank * world, 8, 2, 128, torch.bfloat16, 21)
    q, k, v, beta, dout = (t.to(worker_device()) for t in inputs)
    whole = [t.clone().requires_grad_() for t in (q, k, v, beta)]
    out = ringflash.infini_attention(*whole, segment_len, update=update)
    out.backward(dout)
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    parts = [t[:, shard].contiguous().requires_grad_() for t in (q, k, v)]
    gate = beta.clone().requires_grad_()
    out_sp = ringflash.infini_attention(*parts, gate, segment_len, group=dist.group.WORLD, update=update)
    out_sp.backward(dout[:, shard])
    dist.all_reduce(gate.grad)
    errs = {"out": rel_err(out_sp, out.detach()[:, shard])}
    for name, part, full in zip(("dq", "dk", "dv"), parts, whole[:3]):
        errs[name] = rel_err(part.grad, full.grad[:, shard])
    errs["dbeta"] = rel_err(gate.grad, whole[3].grad)
    return errs


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("update", ["linear", "delta"])
def test_sequence_parallel_on_gpus_equals_single_device(rank_pool, world, update):
    """Real sizes over NCCL: each rank's shard of the sharded call against the single-device call
    on the same GPU (prefix sum or relay of the memory between ranks; the kernels as one device
    runs them)."""
    for rank, errs in enumerate(rank_pool(world).run(_sequence_parallel_on_gpus, update, world)):
        print(update, world, rank, {name: f"{err:.1e}" for name, err in errs.items()})
        for name, err in errs.items():
            assert err < TOLERANCE[torch.bfloat16], (rank, name, err)


def _prefix_sum_and_gradient():
    rank = dist.get_rank()
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    prefix, total = comm.exclusive_prefix_sum(x, dist.group.WORLD).wait()
    ((prefix * (10.0**rank)).sum() + total.sum() * (rank + 1)).backward()
    return prefix.detach(), total.detach(), x.grad


def test_exclusive_prefix_sum_and_its_gradient(rank_pool):
    results = rank_pool(3).run(_prefix_sum_and_gradient)
    for rank, (prefix, total, grad) in enumerate(results):
        assert torch.equal(prefix, torch.full((3,), float(sum(range(1, rank + 1)))))
        assert torch.equal(total, torch.full((3,), 6.0))
        # d x_j = sum over later ranks r of 10^r (their prefixes) + sum over all ranks of (r + 1).
        later = sum(10.0**r for r in range(rank + 1, 3))
        assert torch.equal(grad, torch.full((3,), later + 6.0)), (rank, grad)


def _bad_shard():
    q = torch.randn(1, 12, 2, 16)
    return errors_of(
        {"shard": lambda: ringflash.infini_attention(q, q, q, torch.zeros(2), 8, group=dist.group.WORLD)}
    )


def test_bad_arguments(rank_pool):
    q = torch.randn(1, 16, 4, 16)
    kv = torch.randn(1, 16, 2, 16)
    beta = torch.zeros(4)

    def call(**kw):
        args = {"q": q, "k": kv, "v": kv, "beta": beta, "segment_len": 8, **kw}
        return ringflash.infini_attention(
            args.pop("q"), args.pop("k"), args.pop("v"), args.pop("beta"), args.pop("segment_len"), **args
        )

    cases = {
        "segment_len": [dict(segment_len=n) for n in (0, -4, True, 8.0)],
        "beta": [dict(beta=b) for b in (torch.zeros(2), torch.zeros(4, 1), torch.zeros(4).long())],
        "update": [dict(update="gated")],
        "memory": [
            dict(memory=(torch.zeros(1, 2, 16, 16), torch.zeros(1, 4, 16))),
            dict(memory=(torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16))),
            dict(memory=torch.zeros(1, 2, 16, 16)),
        ],
        "kv_heads": [
            dict(k=torch.randn(1, 16, 3, 16), v=torch.randn(1, 16, 3, 16)),
            dict(k=torch.randn(1, 16, 0, 16), v=torch.randn(1, 16, 0, 16)),  # was a ZeroDivisionError
            dict(q=torch.randn(1, 16, 0, 16), beta=torch.zeros(0)),  # was a ZeroDivisionError
        ],
        "k and v": [dict(v=torch.randn(1, 16, 2, 8))],
        # was "cu_seqlens_q needs at least 2 entries", from inside the local attention
        "at least one token": [dict(q=q[:, :0], k=kv[:, :0], v=kv[:, :0])],
    }  # fmt: skip
    for word, kwargs_list in cases.items():
        for kwargs in kwargs_list:
            with pytest.raises((ValueError, TypeError), match=word):
                call(**kwargs)
    module = ringflash.InfiniAttention(4, 8, update="delta")
    assert [tuple(p.shape) for p in module.parameters()] == [(4,)]
    with pytest.raises(ValueError, match="cu_seqlens"):
        module(q, kv, kv, cu_seqlens=torch.tensor([0, 16], dtype=torch.int32))
    for kwargs, word in ((dict(segment_len=0), "segment_len"), (dict(update="gated"), "update")):
        with pytest.raises(ValueError, match=word):
            ringflash.InfiniAttention(4, **{"segment_len": 8, **kwargs})
    for rank_errors in rank_pool(2).run(_bad_shard):
        assert "whole number of segments" in rank_errors["shard"]


def _tiny_llama_config(transformers):
    """One layer, 2 query heads and 1 KV head of 16: a model small enough for the CPU tests."""
    return transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, attention_dropout=0.0,
    )  # fmt: skip


def test_transformers_model_with_infini_attention_matches_the_reference(device):
    transformers = pytest.importorskip("transformers")
    import ringflash.integrations.hf_infini as rf_infini

    def reference_attention(module, query, key, value, attention_mask, scaling=None, **kw):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = infini_reference(q, k, v, getattr(module, rf_infini.GATE), 8, "delta")[0]
        return out.to(query.device, query.dtype), None

    transformers.AttentionInterface.register("infini_float64_reference", reference_attention)
    config = _tiny_llama_config(transformers)
    ids = torch.randint(0, 32, (1, 20), generator=torch.Generator().manual_seed(3)).to(device)
    results = []
    for implementation in (rf_infini.enable(8, update="delta"), "infini_float64_reference"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
        model = model.float().to(device)
        assert rf_infini.add_gates(model) == 1
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(rf_infini.GATE):
                    p.copy_(torch.tensor([-1.0, 1.5]))  # memory and local attention both matter
        logits = model(
            input_ids=ids, position_ids=torch.arange(20, device=device)[None], use_cache=False
        ).logits
        F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        results.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (got, got_grads), (want, want_grads) = results
    _check("logits", got, want, 1e-4)
    assert any(n.endswith(rf_infini.GATE) for n in got_grads)
    for name, grad in want_grads.items():
        _check(f"d{name}", got_grads[name], grad, 1e-4)


def test_transformers_infini_refuses_packed_position_ids(device):
    """The memory would carry one document into the next: restarting position_ids are refused."""
    transformers = pytest.importorskip("transformers")
    import ringflash.integrations.hf_infini as rf_infini

    model = transformers.AutoModelForCausalLM.from_config(
        _tiny_llama_config(transformers), attn_implementation=rf_infini.enable(8)
    )
    rf_infini.add_gates(model)
    ids = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(8), torch.arange(8)])[None]
    with pytest.raises(ValueError, match=r"position_ids restart \(packed documents\)"):
        model.float().to(device)(input_ids=ids.to(device), position_ids=positions.to(device), use_cache=False)


def test_transformers_infini_refuses_what_it_cannot_honour(device):
    """Keywords Infini-attention has no use for (Gemma-2's softcap, gpt-oss's sinks, bidirectional
    attention, head masks...) and padding masks raise ValueError instead of being ignored."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import ringflash.integrations.hf_infini as rf_infini

    attention = ALL_ATTENTION_FUNCTIONS[rf_infini.enable(8)]
    module = torch.nn.Module()
    setattr(module, rf_infini.GATE, torch.nn.Parameter(torch.zeros(2, device=device)))
    q = torch.randn(1, 2, 16, 8, device=device)  # (batch, heads, seqlen, head_dim)
    out, _ = attention(module, q, q, q, None, position_ids=torch.arange(16, device=device)[None],
                       use_cache=False, softcap=None, s_aux=None, is_causal=True)  # fmt: skip
    assert out.shape == (1, 16, 2, 8)
    for name, value in [("softcap", 1.0), ("s_aux", torch.zeros(2)), ("head_mask", torch.ones(2)),
                        ("cu_seq_lens_k", torch.tensor([0, 16]))]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            attention(module, q, q, q, None, **{name: value})
    with pytest.raises(ValueError, match="is_causal"):
        attention(module, q, q, q, None, is_causal=False)
    module.is_causal = False  # an encoder's attention layer
    with pytest.raises(ValueError, match="is_causal"):
        attention(module, q, q, q, None)

    model = transformers.AutoModelForCausalLM.from_config(
        _tiny_llama_config(transformers), attn_implementation=rf_infini.enable(8)
    )
    rf_infini.add_gates(model)
    model = model.float().to(device)
    ids = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(3)).to(device)
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    with pytest.raises(ValueError, match="attention_mask with padding"):
        padded = torch.tensor([[0] * 2 + [1] * 14], device=device)
        model(input_ids=ids, attention_mask=padded, use_cache=False)


def _disagreeing_ranks():
    """Each call differs between the ranks in one argument the memory exchange depends on."""
    rank = dist.get_rank()
    world = dist.group.WORLD

    def call(batch=1, segment_len=8, update="linear"):
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(batch, 16, n, 16, generator=g) for n in (2, 1, 1))
        return ringflash.infini_attention(q, k, v, torch.zeros(2), segment_len, group=world, update=update)

    return errors_of({
        "agreed": lambda: call(),
        # before: gloo aborted (linear) or a wrong answer without an error (delta relay)
        "batch": lambda: call(batch=1 + rank),
        "batch delta": lambda: call(batch=1 + rank, update="delta"),
        "segment_len": lambda: call(segment_len=8 * (1 + rank)),  # before: a wrong answer, no error
        "update": lambda: call(update="delta" if rank else "linear"),  # before: a hang
        "bad on one rank": lambda: call(segment_len=0 if rank else 8),  # before: rank 0 hung
        "agreed again": lambda: call(update="delta"),
    })  # fmt: skip


def test_disagreeing_ranks_raise_on_every_rank(rank_pool):
    for errors in rank_pool(2).run(_disagreeing_ranks, timeout=300):
        assert errors["agreed"] is None and errors["agreed again"] is None
        shapes = "q: rank 0: ('tensor', (1, 0, 2, 16), 'float32'), rank 1: ('tensor', (2, 0, 2, 16)"
        assert shapes in errors["batch"]
        assert "q: rank 0" in errors["batch delta"]
        assert "segment_len: rank 0: 8, rank 1: 16" in errors["segment_len"]
        assert "update: rank 0: 'linear', rank 1: 'delta'" in errors["update"]
        assert (
            "error: rank 0: None, rank 1: 'ValueError: segment_len must be a positive int"
            in errors["bad on one rank"]
        )
