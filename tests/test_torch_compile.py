"""torch.compile over ringflash's custom ops: no graph breaks, Inductor keeps the ops opaque,
outputs and gradients equal to eager, and a dynamic sequence length compiles once.

The CPU tests use the aot_eager backend (AOT autograd traces forward and backward through the
ops' fake implementations, no C++ build) except one Inductor test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention, rel_err

import ringflash
from ringflash import flash_attn_func, flash_attn_varlen_func

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # as tests/conftest.py

torch._dynamo.config.cache_size_limit = 64


class AttentionBlock(torch.nn.Module):
    """A pre-norm attention block with GQA (2 query heads, 1 K/V head) over ``attention``:
    a function (q, k, v) -> out, e.g. ``flash_attn_func`` or a sequence-parallel one."""

    def __init__(self, attention=None, dim: int = 32) -> None:
        super().__init__()
        self.attention = attention or (lambda q, k, v: flash_attn_func(q, k, v, causal=True))
        self.norm = torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 4, dim // 2).split([2, 1, 1], dim=2)
        return x + self.out(self.attention(q, k, v.contiguous()).reshape(b, n, dim))


def block_loss_and_grads(model, x, run=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients (x first, then every parameter) of ``model``, its forward run by
    ``run`` (e.g. compiled, where the sequence length is marked dynamic)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch._dynamo.mark_dynamic(x, 1)
    loss = (model if run is None else run)(x).square().mean()
    loss.backward()
    return loss.detach(), [x.grad, *(p.grad for p in model.parameters())]


def test_compiled_block_matches_eager_without_breaks_or_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = AttentionBlock().to(DEVICE)
    explain = torch._dynamo.explain(model)(torch.randn(1, 16, 32, device=DEVICE))
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    torch._dynamo.reset()  # explain's static-shape frame must not serve the compiled model
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for seqlen in (16, 24):  # the second length reuses the graph compiled for a dynamic one
        x = torch.randn(1, seqlen, 32, generator=torch.Generator().manual_seed(seqlen)).to(DEVICE)
        want_loss, want = block_loss_and_grads(model, x)
        got_loss, got = block_loss_and_grads(model, x, compiled)
        assert torch.allclose(got_loss, want_loss, rtol=1e-6, atol=0), (got_loss, want_loss)
        for i, (a, e) in enumerate(zip(got, want)):
            assert rel_err(a, e) < 1e-5, i
    assert counter.frame_count == 1


def test_inductor_keeps_the_ops_opaque():
    """The default backend: Inductor would fail re-compiling the Triton kernels if it looked
    inside the ops; the generated code calls them instead, forward and backward."""
    from torch._inductor.utils import run_and_get_code

    q, k, v = (torch.randn(1, 16, h, 16, device=DEVICE, requires_grad=True) for h in (4, 2, 2))
    weight = torch.randn(64, 64, device=DEVICE)

    def block(q, k, v):
        out = flash_attn_func(q, k, v, causal=True)
        return (out.reshape(1, 16, 64) @ weight).square().mean()

    compiled = torch.compile(block, fullgraph=True)
    loss, codes = run_and_get_code(lambda: compiled(q, k, v).backward())
    code = "\n".join(codes)
    assert "ringflash.flash_attn_forward" in code and "ringflash.flash_attn_backward" in code
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    block(q, k, v).backward()
    for g, t in zip(got, (q, k, v)):
        assert rel_err(g, t.grad) < 1e-5


def _lse_and_out_loss(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor):
    return (out * dout).sum() + (lse * dlse).sum()


@pytest.mark.parametrize("path", ["eager", "op", "compiled"])
def test_lse_gradient_matches_reference(path):
    """A loss on the LSE as well as the output (delta_i -= dlse_i), through the eager Function, the
    op called directly and the compiled op, against float64; the window keeps one row keyless
    (LSE -inf, gradient 0)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (3 * torch.randn(2, n, h, 16, generator=g).to(DEVICE) for n, h in ((12, 4), (8, 2), (8, 2)))
    dout, dlse = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((2, 12, 4, 16), (2, 4, 12)))
    window = (2, 0)  # bottom-right aligned: queries at positions -4 and -3 see no key

    def attention(q, k, v):
        if path == "op":
            op = torch.ops.ringflash.flash_attn_forward
            return op(q, k, v, None, None, 0, 0, None, False, *window, 0.0, None, False)
        return flash_attn_func(q, k, v, window_size=window, return_lse=True)

    if path == "compiled":
        attention = torch.compile(attention, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves)
    dlse_finite = torch.where(torch.isfinite(lse.detach()), dlse, 0.0)
    _lse_and_out_loss(out, torch.where(torch.isfinite(lse), lse, 0.0), dout, dlse_finite).backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_leaves, window_size=window)
    assert torch.isinf(ref_lse).any()  # the case is exercised
    finite = torch.isfinite(ref_lse)
    _lse_and_out_loss(
        ref_out, torch.where(finite, ref_lse, 0.0), dout.cpu().double(), dlse_finite.cpu().double()
    ).backward()
    assert rel_err(out, ref_out) < 1e-4 and rel_err(lse, ref_lse) < 1e-4
    for name, a, e in zip("qkv", leaves, ref_leaves):
        assert rel_err(a.grad, e.grad) < 1e-4, name


def test_compiled_varlen_matches_eager():
    """cu_seqlens are checked on the host inside the op at run time, never on the trace's fake tensors."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(20, h, 16, generator=g).to(DEVICE).requires_grad_() for h in (2, 1, 1))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=DEVICE)

    def attention(q, k, v, cu):
        return flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True)

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v, cu)
    got.square().sum().backward()
    got_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = attention(q, k, v, cu)
    want.square().sum().backward()
    assert torch.equal(got, want)
    for a, t in zip(got_grads, (q, k, v)):
        assert torch.equal(a, t.grad)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        compiled(q, k, v, torch.tensor([0, 7, 21], dtype=torch.int32, device=DEVICE))


def test_public_api_still_checks_arguments():
    q = torch.randn(1, 8, 2, 16, device=DEVICE)
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(q, q, q, window_size=(1,))
    with pytest.raises(ValueError, match="max_seqlen_q must be an int"):
        cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
        flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, None, 8)
    with pytest.raises(ValueError, match="divisible by k/v heads"):
        kv = torch.randn(1, 8, 3, 16, device=DEVICE)
        torch.ops.ringflash.flash_attn_forward(
            q, kv, kv, None, None, 0, 0, None, False, -1, -1, 0.0, None, False
        )
    assert ringflash.flash_attn_func is flash_attn_func


def _sp_compiled_matches_eager(sp_mode: str, ulysses_size: int | None) -> tuple[int, int]:
    """On every rank: an AttentionBlock over ``sp_attn_func`` on a 1-D DeviceMesh, compiled
    (aot_eager, full graph, sequence length dynamic) against eager at two lengths; returns the
    frames compiled and graph breaks."""
    from distributed import worker_device
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.device_mesh import init_device_mesh

    dev = worker_device()  # the ranks' GPUs over NCCL where there are enough, else CPUs over gloo
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("sp",))

    def attention(q, k, v):
        return ringflash.sp_attn_func(
            q, k, v, causal=True, group=mesh, sp_mode=sp_mode, ulysses_size=ulysses_size
        )

    torch.manual_seed(0)
    model = AttentionBlock(attention).to(dev)
    layout_u = {"ring": 1, "auto": 1, "ulysses": dist.get_world_size(), "hybrid": ulysses_size}[sp_mode]
    shard = lambda x: ringflash.shard_sequence(x.to(dev), mesh, layout="zigzag", ulysses_size=layout_u)  # noqa: E731
    breaks = torch._dynamo.explain(model)(shard(torch.randn(1, 16, 32))).graph_break_count
    torch._dynamo.reset()  # explain's static-shape frame must not serve the compiled model
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for seqlen in (16, 24):
        x = shard(torch.randn(1, seqlen, 32, generator=torch.Generator().manual_seed(seqlen)))
        want_loss, want = block_loss_and_grads(model, x)
        got_loss, got = block_loss_and_grads(model, x, compiled)
        assert torch.allclose(got_loss, want_loss, rtol=1e-6, atol=0), (got_loss, want_loss)
        for i, (a, e) in enumerate(zip(got, want)):
            assert rel_err(a, e) < 1e-5, (i, rel_err(a, e))
    return counter.frame_count, breaks


@pytest.mark.parametrize(
    "sp_mode, ulysses_size", [("ring", None), ("ulysses", None), ("hybrid", 1), ("auto", None)]
)
def test_compiled_sequence_parallel_block_matches_eager(rank_pool, sp_mode, ulysses_size):
    """Ring, Ulysses (K/V heads replicated for the 2 ranks), a hybrid whose inner attention is
    the ring and "auto" (here the all-gather mode), on 2 ranks: no graph break, one compiled
    frame for two lengths, eager's numbers."""
    assert rank_pool(2).run(_sp_compiled_matches_eager, sp_mode, ulysses_size) == [(1, 0), (1, 0)]


def _int32(*values: int, device=DEVICE) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _is_float(a: object) -> bool:
    return torch.is_tensor(a) and a.is_floating_point()


def _compiled_and_eager(fn, args: tuple, fullgraph: bool, **kwargs) -> list[tuple[list, list]]:
    """[compiled, eager] results of ``fn(*args, causal=True, **kwargs)``, each (outputs, gradients
    of the float tensors in args): ``torch.compile`` (Inductor) under ring-flash-attn's compile
    setting, ``capture_scalar_outputs=True``, called first on fresh tensors, forward and backward
    (a loss on out and, where returned, the LSE)."""
    results = []
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for run in (torch.compile(fn, fullgraph=fullgraph), fn):
            leaves = [a.clone().requires_grad_() if _is_float(a) else a for a in args]
            got = run(*leaves, causal=True, **kwargs)
            got = list(got) if isinstance(got, tuple) else [got]
            loss = got[0].square().sum() + (got[1].sum() if len(got) > 1 else 0)
            loss.backward()
            grads = [a.grad for a in leaves if torch.is_tensor(a) and a.requires_grad]
            results.append((got, grads))
    return results


def _assert_same(compiled: tuple[list, list], eager: tuple[list, list]) -> None:
    for i, (a, e) in enumerate(zip(compiled[0] + compiled[1], eager[0] + eager[1], strict=True)):
        if e is None:  # ring-flash-attn's probabilities slot
            assert a is None, i
        else:
            assert a.shape == e.shape and rel_err(a, e) < 1e-6, (i, a.shape, e.shape)


def _single_device_args(name: str, r) -> tuple:
    """The arguments of entry ``name`` (tiny; head_dim 12: the padded path; varlen: 2 sequences),
    ``r(*shape)`` making a random tensor."""
    cu_q, cu_k = _int32(0, 4, 9), _int32(0, 5, 12)
    return {
        "flash_attn_func": (r(2, 8, 2, 12), r(2, 8, 1, 12), r(2, 8, 1, 12)),
        "flash_attn_qkvpacked_func": (r(2, 8, 3, 2, 16),),
        "flash_attn_kvpacked_func": (r(2, 6, 2, 16), r(2, 8, 2, 1, 16)),
        "flash_attn_varlen_func": (r(9, 2, 12), r(12, 1, 12), r(12, 1, 12), cu_q, cu_k, 5, 7),
        "flash_attn_varlen_qkvpacked_func": (r(12, 3, 2, 16), cu_k, 7),
        "flash_attn_varlen_kvpacked_func": (r(12, 2, 16), r(12, 2, 1, 16), cu_k, cu_k, 7, 7),
    }[name]


_SINGLE_DEVICE = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]


@pytest.fixture
def fresh_dynamo():
    """Compiled frames of the entry points from other tests (other dynamo settings) must not serve
    this one; nor its frames the next test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("return_attn_probs", [False, True])
@pytest.mark.parametrize("name", _SINGLE_DEVICE)
def test_entries_compile_with_captured_scalar_outputs(fresh_dynamo, name, return_attn_probs):
    """Every single-device entry under ring-flash-attn's compile pass (Inductor,
    ``capture_scalar_outputs=True``) in one graph, with eager's out, LSE, probabilities and
    gradients. The varlen probabilities slice sequences by cu_seqlens on the host: traced, those
    lengths were unbacked symbols that Inductor could not lower (the ``attention_probs`` op keeps
    them out of the graph)."""
    g = torch.Generator().manual_seed(len(name))
    args = _single_device_args(name, lambda *shape: torch.randn(*shape, generator=g).to(DEVICE))
    compiled, eager = _compiled_and_eager(
        getattr(ringflash, name), args, fullgraph=True, return_attn_probs=return_attn_probs
    )
    _assert_same(compiled, eager)
    if return_attn_probs:
        probs = compiled[0][2]
        assert probs.dtype == torch.float32 and not probs.requires_grad
        if "varlen" in name:  # sequence 0 fills [0, :, :len_q, :len_k], zeros around it
            assert probs.shape[0] == 2 and probs[0, :, :, 5:].abs().sum() == 0


def _ring_entries_compiled_match_eager() -> None:
    """On every rank: ring-flash-attn entries compiled as its tests compile them (Inductor,
    ``capture_scalar_outputs=True``) against eager, with and without ``return_attn_probs``."""
    from distributed import worker_device

    device = worker_device()
    g = torch.Generator().manual_seed(dist.get_rank())
    r = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    cu = _int32(0, 4, 10, device=device)  # this rank's pieces of 2 documents
    dense = tuple(r(1, 8, h, 16) for h in (2, 1, 1))
    varlen = (*(r(10, h, 16) for h in (2, 1, 1)), cu, 6)
    cases = [  # (entry, arguments, return_attn_probs), each in one graph
        (ringflash.zigzag_ring_flash_attn_func, dense, False),
        (ringflash.zigzag_ring_flash_attn_func, dense, True),
        # The varlen entries read cu_seqlens inside their op (zigzag: and take its token order).
        (ringflash.ring_flash_attn_varlen_func, varlen, True),
        (ringflash.zigzag_ring_flash_attn_varlen_func, varlen, False),
    ]
    for fn, args, return_attn_probs in cases:
        torch._dynamo.reset()
        compiled, eager = _compiled_and_eager(fn, args, True, return_attn_probs=return_attn_probs)
        _assert_same(compiled, eager)
        assert len(compiled[0]) == (3 if return_attn_probs else 1)
    torch._dynamo.reset()


def test_ring_entries_compile_with_captured_scalar_outputs(rank_pool):
    """A dense (zigzag) and two varlen ring-flash-attn entries on 2 gloo ranks, in one graph each."""
    rank_pool(2).run(_ring_entries_compiled_match_eager)


def _bench_compile():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))
    import bench_compile

    return bench_compile


@pytest.mark.parametrize(
    "argv",
    [["--modes", "eager", "eager"], ["--modes", "jit"], ["--iters", "0"],
     ["--modes", "eager", "graphed", "--compile-mode", "max-autotune"], ["--sp-mode", "ring"]],
)  # fmt: skip
def test_bench_compile_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        _bench_compile().parse_args(argv)
    assert "--" in capsys.readouterr().err


@pytest.mark.gpu
def test_compiled_and_graphed_training_steps_match_eager_on_gpu():
    """launch/bench_compile.py at a small size (2 layers of the 1B shape, 4K tokens) on the real
    kernels, in every mode (compiled, compiled with reduce-overhead, the whole step captured in
    a CUDA graph): each mode's first loss and gradient norms agree with eager's (the benchmark
    raises if not). Its speed is the benchmark's business (docs/performance.md), not a test's."""
    bench_compile = _bench_compile()
    args = ["--layers", "2", "--tokens", "4096", "--warmup", "1", "--iters", "2"]
    args += ["--modes", *bench_compile.MODES]
    summary = bench_compile.run(bench_compile.parse_args(args))
    for mode in bench_compile.MODES:
        assert math.isfinite(summary[mode]["first_block_grad_norm"]), summary
        assert summary[mode]["first_block_grad_norm"] > 0, summary
