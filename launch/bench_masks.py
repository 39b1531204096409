"""Packed documents and sliding windows on one GPU: ringflash beside FlexAttention (document or
window mask) and, for equal-length documents, SDPA's cuDNN backend on the same documents laid
out as a dense batch, in the same run on the same shapes.

    python launch/bench_masks.py
    python launch/bench_masks.py --head-dims 64 128 --workloads docs8x8k window4k

bf16, causal, 16 heads, --tokens tokens (default 64K) in one packed sequence. TFLOP/s count the
visible pairs only: a causal document of n tokens is 4*H*D*n^2/2 forward FLOPs (as a dense causal
row counts), a causal window of W keys 4*H*D*(pairs it sees); fwd+bwd = 3.5x fwd. Cells read fwd /
bwd / fwd+bwd; the backends take turns over --rounds rounds, medians over rounds of
triton.testing.do_bench medians (bench_attention.measure_rounds). Each workload first
checks ringflash's output against FlexAttention's (rel. error < 2e-2, else the row says FAIL).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import random
import sys

import torch
import torch.nn.attention.flex_attention as flex_attention
import torch.nn.functional as F
import triton
from bench_attention import _compiled_flex, measure_rounds
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash
from ringflash.kernels import cu_seqlens_tensor

WORKLOADS = ("docs8x8k", "docs32x2k", "docs-random", "docs-mixed", "window4k")
BACKENDS = ("ringflash", "flex", "cudnn")


def document_lengths(workload: str, tokens: int) -> list[int]:
    """The packed documents of a workload: equal lengths, (docs-random) 12 lengths drawn with a
    fixed seed that sum to ``tokens``, or (docs-mixed) one document of half the tokens among
    documents of 256."""
    if workload == "docs8x8k":
        return [tokens // 8] * 8
    if workload == "docs32x2k":
        return [tokens // 32] * 32
    if workload == "docs-mixed":
        return [tokens // 2] + [256] * (tokens // 2 // 256)
    rng = random.Random(0)
    cuts = sorted(rng.sample(range(1, tokens), 11))
    return [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]


def make_runner(name: str, workload: str, tokens: int, h: int, d: int, window: int):
    """(run, leaves, flops) for backend ``name`` on the workload, or None where it has no form."""
    lengths = None if workload == "window4k" else document_lengths(workload, tokens)
    if name == "cudnn" and (lengths is None or len(set(lengths)) != 1):
        return None
    flat = name == "ringflash"

    def randn(shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    if lengths is not None:
        flops = sum(4 * h * d * n * n * 0.5 for n in lengths)
    else:
        seen = torch.arange(tokens).clamp(max=window) + 1  # keys each causal query sees
        flops = 4 * h * d * seen.sum().item()
    if name == "cudnn":
        b, n = len(lengths), lengths[0]
        q, k, v = (randn((b, h, n, d)) for _ in range(3))

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return run, (q, k, v), flops
    if flat:
        q, k, v = (randn((tokens, h, d)) for _ in range(3))
        if lengths is None:
            run = lambda: ringflash.flash_attn_func(  # noqa: E731
                *(t.unsqueeze(0) for t in (q, k, v)), causal=True, window_size=(window, 0)
            )
            return run, (q, k, v), flops
        cu = cu_seqlens_tensor([0, *itertools.accumulate(lengths)], "cuda")
        n = max(lengths)
        run = lambda: ringflash.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)  # noqa: E731
        return run, (q, k, v), flops
    q, k, v = (randn((1, h, tokens, d)) for _ in range(3))
    if lengths is None:

        def mask_mod(b, h_, i, j):
            return (i >= j) & (i - j <= window)
    else:
        counts = torch.tensor(lengths, device="cuda")
        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), counts)

        def mask_mod(b, h_, i, j):
            return (doc[i] == doc[j]) & (i >= j)

    mask = flex_attention.create_block_mask(mask_mod, None, None, tokens, tokens)
    flex = _compiled_flex()
    return (lambda: flex(q, k, v, block_mask=mask)), (q, k, v), flops


def check(workload: str, tokens: int, h: int, d: int, window: int) -> float:
    """Relative error of ringflash's output against FlexAttention's on the same inputs."""
    ours, leaves, _ = make_runner("ringflash", workload, tokens, h, d, window)
    flex, flex_leaves, _ = make_runner("flex", workload, tokens, h, d, window)
    with torch.no_grad():
        for a, b in zip(flex_leaves, leaves):
            a.copy_(b.reshape(tokens, h, d).transpose(0, 1).unsqueeze(0))
        out = ours().reshape(tokens, h, d).float()
        ref = flex()[0].transpose(0, 1).float()
    return ((out - ref).norm() / ref.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--window", type=int, default=4095, help="keys before each query (window4k)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per workload (medians)")
    p.add_argument("--json", help="write raw results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_masks.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    rows = []
    for d in args.head_dims:
        for workload in args.workloads:
            err = check(workload, args.tokens, args.heads, d, args.window)
            row = {"workload": workload, "D": d, "err": err}
            print(f"[{datetime.datetime.now():%H:%M:%S}] D={d} {workload}", file=sys.stderr)
            runners, flops = {}, None
            for name in args.backends:
                runner = make_runner(name, workload, args.tokens, args.heads, d, args.window)
                if runner is None:
                    row[name] = None
                else:
                    runners[name], flops = runner[:2], runner[2]
            row.update(measure_rounds(runners, flops, args.rounds))
            del runners
            torch.cuda.empty_cache()
            rows.append(row)

    def cell(r):
        return "n/a" if r is None else f"{r['fwd']:.0f} / {r['bwd']:.0f} / {r['fwd_bwd']:.0f}"

    def ratio(row, other):
        a, o = row.get("ringflash"), row.get(other)
        return "n/a" if not a or not o else f"{a['fwd_bwd'] / o['fwd_bwd']:.2f}"

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}, bf16, causal, {args.heads} heads, {args.tokens} tokens; "
          "TFLOP/s fwd / bwd / fwd+bwd")  # fmt: skip
    cols = ["workload", "D", *args.backends, "vs flex", "vs cuDNN", "peak GiB ours / flex", "check"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        peaks = [row.get(n) for n in ("ringflash", "flex")]
        cells = [row["workload"], row["D"], *(cell(row.get(n)) for n in args.backends)]
        cells += [ratio(row, "flex"), ratio(row, "cudnn")]
        cells += [" / ".join("n/a" if r is None else f"{r['peak_gib']:.2f}" for r in peaks)]
        cells += [f"{'ok' if row['err'] < 2e-2 else 'FAIL'} {row['err']:.1e}"]
        print("| " + " | ".join(map(str, cells)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
