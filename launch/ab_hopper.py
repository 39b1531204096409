"""The Hopper kernels of this tree against another checkout's, interleaved in one process.

    git archive <rev> | tar -x -C /tmp/base
    python launch/ab_hopper.py --base /tmp/base --rounds 5
    python launch/ab_hopper.py --base /tmp/base /tmp/other --rep 400   # two bases, longer timings

Between processes the same kernel reads a few percent apart on these machines (clocks, the
other runs on the host), more than a tile change moves it. Here each base checkout's
``kernels/hopper`` package is loaded beside this tree's (its modules import each other from the
base, the rest of ``kernels`` from this tree), and every round times each workload with the bases'
modules and this tree's (in reverse order every other round), then SDPA cuDNN where it has
the shape, each through the public ``flash_attn_func`` /
``flash_attn_varlen_func``; the backward is timed on its own, over one recorded forward. bf16,
16 heads, --tokens tokens per workload; TFLOP/s as launch/bench_attention.py counts them (fwd /
bwd / fwd+bwd, medians over rounds of ``triton.testing.do_bench`` medians).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from bench_masks import make_runner  # launch/ is on the path: run as a script
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash
from ringflash.kernels import backward as kernel_backward
from ringflash.kernels import forward as kernel_forward
from ringflash.kernels.hopper import dispatch

MODULES = ("forward", "backward", "dq", "tma")  # what the dispatch asks for (dispatch.hopper_module)
DEFAULT_WORKLOADS = ["dense:4096", "causal:4096", "dense:65536", "causal:65536", "docs:2048"]


def load_base_modules(base: Path, tag: str) -> dict:
    """The base checkout's whole ``kernels/hopper`` package, loaded as
    ringflash.kernels.hopper_<tag>: its modules import each other from the base, and the rest of
    the kernels (``..problem``, ``..positions``) from this tree. Returns name -> module."""
    root = base / "kernels" / "hopper"
    package = f"ringflash.kernels.hopper_{tag}"
    spec = importlib.util.spec_from_file_location(
        package, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    return {name: importlib.import_module(f"{package}.{name}") for name in MODULES}


_DISPATCH = dispatch.hopper_module


def use_modules(modules: dict) -> None:
    """Route the dispatch of the forward and backward to ``modules`` (name -> module; the others,
    and every name when empty, to this tree's)."""

    def hopper_module(name: str):
        return modules.get(name) or _DISPATCH(name)

    dispatch.hopper_module = kernel_forward.hopper_module = kernel_backward.hopper_module = hopper_module


def workload(name: str, d: int, tokens: int, heads: int):
    """(ringflash fn, its leaves, cuDNN fn or None, its leaves, forward FLOPs) of a named
    workload. cuDNN gets its own inputs in SDPA's (batch, heads, seqlen, head_dim) layout, as in
    launch/bench_attention.py; equal-length documents go to it as a dense batch."""

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    kind, _, arg = name.partition(":")
    n = int(arg)
    if kind == "window":
        q, k, v = (randn(1, tokens, heads, d) for _ in range(3))
        pairs = sum(min(i + 1, n + 1) for i in range(tokens))

        def ours():
            return ringflash.flash_attn_func(q, k, v, causal=True, window_size=(n, 0))

        return ours, (q, k, v), None, (), 4 * heads * d * pairs
    if kind in ("random", "mixed"):  # bench_masks' packings, as it runs them
        ours, leaves, flops = make_runner("ringflash", f"docs-{kind}", tokens, heads, d, window=0)
        return ours, leaves, None, (), flops
    if kind not in ("dense", "causal", "docs"):
        raise ValueError(
            f"workload: expected dense:S, causal:S, docs:N, random:0, mixed:0 or window:W, got {name!r}"
        )
    b = max(1, tokens // n)
    causal = kind != "dense"
    flops = 4 * b * heads * n * n * d / (2 if causal else 1)
    qs, ks, vs = (randn(b, heads, n, d) for _ in range(3))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

    if kind == "docs":
        q, k, v = (randn(b * n, heads, d) for _ in range(3))
        cu = torch.arange(0, b * n + 1, n, device="cuda", dtype=torch.int32)

        def ours():
            return ringflash.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)

    else:
        q, k, v = (randn(b, n, heads, d) for _ in range(3))

        def ours():
            return ringflash.flash_attn_func(q, k, v, causal=causal)

    return ours, (q, k, v), cudnn, (qs, ks, vs), flops


def times(fn, leaves, rep: int) -> tuple[float, float]:
    """Median ms of the forward and of the backward, the latter timed on its own over one
    recorded forward (a difference of two timings would carry the spread of both)."""
    out = fn()
    dout = torch.randn_like(out)
    with torch.no_grad():
        fwd = triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    bwd = triton.testing.do_bench(
        lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
        warmup=25, rep=rep, return_mode="median",
    )  # fmt: skip
    return fwd, bwd


def rates(samples: list[tuple[float, float]], flops: float) -> tuple[float, float, float] | None:
    """TFLOP/s fwd, bwd, fwd+bwd from the medians of (fwd ms, bwd ms) samples."""
    if not samples:
        return None
    fwd = statistics.median(s[0] for s in samples)
    bwd = statistics.median(s[1] for s in samples)
    return flops / fwd / 1e9, 2.5 * flops / bwd / 1e9, 3.5 * flops / (fwd + bwd) / 1e9


def cell(r) -> str:
    return "n/a" if r is None else " / ".join(f"{v:.0f}" for v in r)


def ratio(a, b) -> str:
    return "n/a" if a is None or b is None else f"{a[2] / b[2]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, nargs="+", required=True, help="checkouts of base revisions")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64])
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep", type=int, default=100, help="ms of repeats per timing (do_bench)")
    args = parser.parse_args()
    variants = {f"base{i}": load_base_modules(path, f"base{i}") for i, path in enumerate(args.base)}
    variants["new"] = {}
    names = list(variants)
    print(f"{torch.cuda.get_device_name()} {datetime.date.today()} rounds={args.rounds} rep={args.rep} ms")
    print(f"bases: {', '.join(f'base{i} = {path}' for i, path in enumerate(args.base))}")
    header = names + ["cuDNN"] + [f"new / {n}" for n in names[:-1]] + ["base0 / cuDNN", "new / cuDNN"]
    print("| workload | D | " + " | ".join(header) + " |")
    print("|---|---|" + "---|" * len(header))
    for d in args.head_dims:
        for name in args.workloads:
            ours, leaves, cudnn, cudnn_leaves, flops = workload(name, d, args.tokens, args.heads)
            runs = {key: [] for key in names + ["cudnn"]}
            for r in range(args.rounds):
                # Reverse the order every other round: a later run can find the GPU warmer.
                for variant in names[:: 1 if r % 2 == 0 else -1]:
                    use_modules(variants[variant])
                    runs[variant].append(times(ours, leaves, args.rep))
                if cudnn is not None:
                    runs["cudnn"].append(times(cudnn, cudnn_leaves, args.rep))
            use_modules({})
            got = {key: rates(samples, flops) for key, samples in runs.items()}
            cells = [cell(got[n]) for n in names] + [cell(got["cudnn"])]
            cells += [ratio(got["new"], got[n]) for n in names[:-1]]
            cells += [ratio(got["base0"], got["cudnn"]), ratio(got["new"], got["cudnn"])]
            print(f"| {name} | {d} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
