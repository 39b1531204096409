"""Infini-attention on one GPU: tokens/s and peak memory of a forward+backward from 64K to 4M
tokens, beside the local attention alone (the varlen kernel over the same segments, the floor
Infini-attention adds its memory to) and exact causal attention (``flash_attn_func``) at the
lengths where it fits and finishes, in the same run on the same inputs.

    python launch/bench_infini.py --json infini.json
    python launch/bench_infini.py --lengths 262144 1048576 --segments 4096 --update delta
    python launch/bench_infini.py --lengths 1048576 --segments 4096 --profile 1048576  # + kernels
    python launch/bench_infini.py --smoke          # CPU, Triton interpreter, tiny shapes

Batch 1, bf16, 8 query / 8 key-value heads of 128 by default (at 4M tokens q, k, v, the
output gradient and the gradients take 56 GiB: chosen to fit one 141 GB H200). Each cell is the
median of --reps timed fwd+bwd runs (``out.backward(dout)`` with a random bf16 dout) after one
warm-up; peak memory is the fwd+bwd's peak allocation above the inputs and dout. Columns: tok/s,
ns/token (linear scaling keeps it flat), its ratio to the first length at or above 256K, the
local attention's throughput over Infini-attention's (the target is >= 0.8) and the float32
memory state that the forward keeps for the backward against the q/k/v/out activations. A run
that does not fit is reported as OOM and the benchmark goes on. Exact attention is skipped above
--exact-max-len (its time grows as S^2). A summary against the targets ends the output.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing ringflash

import torch  # noqa: E402

import ringflash  # noqa: E402
from ringflash.infini import infini_memory_bytes, segment_local_attention  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1 << 16, 1 << 18, 1 << 20, 1 << 21, 1 << 22])
    p.add_argument("--segments", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--update", default="linear", choices=["linear", "delta"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--exact-max-len", type=int, default=1 << 20, help="longest exact-attention run")
    p.add_argument(
        "--tf32", action="store_true", help="TF32 in torch float32 matmuls (not in the memory kernels)"
    )
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument(
        "--profile", type=int, default=None, metavar="TOKENS",
        help="then profile one Infini-attention fwd+bwd at TOKENS (first --segments) and print its kernels",
    )  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="CPU smoke test at tiny shapes (Triton interpreter)")
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths, args.segments, args.heads, args.kv_heads = [32, 64], [16], 2, 1
        args.head_dim, args.dtype, args.reps, args.exact_max_len = 16, "fp32", 1, 64
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(run, leaves, dout: torch.Tensor, device: torch.device, reps: int) -> dict:
    """Median seconds of fwd+bwd and its peak memory above what was allocated before."""
    for t in leaves:
        t.grad = None
    run().backward(dout)  # warm-up (compilation)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    for _ in range(reps):
        for t in leaves:
            t.grad = None
        _sync(device)
        t0 = time.perf_counter()
        run().backward(dout)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else 0.0
    return {"time_s": statistics.median(times), "peak_gib": peak}


def bench(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    rows = []
    for s in args.lengths:
        rows += bench_length(args, s, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _derive(rows)
    return rows


def bench_length(args: argparse.Namespace, s: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The rows of one sequence length: Infini-attention and the local attention per segment
    length, then exact attention."""
    g = torch.Generator(device=device).manual_seed(s)
    shapes = [(1, s, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    try:
        q, k, v = (torch.randn(sh, device=device, dtype=dtype, generator=g).requires_grad_() for sh in shapes)
        dout = torch.randn(shapes[0], device=device, dtype=dtype, generator=g)
    except torch.OutOfMemoryError:
        return [{"seqlen": s, "method": "inputs", "segment_len": None, "error": "OOM"}]
    beta = torch.zeros(args.heads, device=device, requires_grad=True)
    activations = (2 * q.numel() + 2 * k.numel()) * q.element_size()  # q, k, v, out

    def infini(seg):
        return ringflash.infini_attention(q, k, v, beta, seg, update=args.update)

    runs = []
    for seg in (seg for seg in args.segments if seg <= s):
        runs.append(("infini", seg, infini, (q, k, v, beta)))
        runs.append(("local", seg, lambda seg: segment_local_attention(q, k, v, seg, None), (q, k, v)))
    if s <= args.exact_max_len:
        runs.append(("exact", None, lambda _: ringflash.flash_attn_func(q, k, v, causal=True), (q, k, v)))
    rows = []
    for method, seg, run, leaves in runs:
        row = {"seqlen": s, "method": method, "segment_len": seg}
        try:
            row.update(measure(functools.partial(run, seg), leaves, dout, device, args.reps))
            row["tokens_per_s"] = s / row["time_s"]
            row["ns_per_token"] = 1e9 * row["time_s"] / s
        except torch.OutOfMemoryError:
            row["error"] = "OOM"
        if method == "infini":
            kept = infini_memory_bytes(1, args.kv_heads, args.head_dim, s, seg, heads=args.heads, dtype=dtype)
            row["memory_state_share"] = kept / activations
        for t in leaves:
            t.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(_format(row), flush=True)
        rows.append(row)
    return rows


def _derive(rows: list[dict]) -> None:
    """Per-token time relative to the first length >= 256K, and the memory path's time share."""
    timed = {(r["seqlen"], r["method"], r["segment_len"]): r for r in rows if "time_s" in r}
    for r in rows:
        if r["method"] != "infini" or "time_s" not in r:
            continue
        local = timed.get((r["seqlen"], "local", r["segment_len"]))
        if local:
            r["local_throughput_ratio"] = local["time_s"] / r["time_s"]
        base = [
            x
            for (s, m, seg), x in sorted(timed.items())
            if m == "infini" and seg == r["segment_len"] and s >= 1 << 18
        ]
        if base:
            r["ns_per_token_vs_256k"] = r["ns_per_token"] / base[0]["ns_per_token"]


def _format(r: dict) -> str:
    seg = f"seg {r['segment_len']:>5}" if r.get("segment_len") else " " * 9
    if "error" in r:
        return f"{r['seqlen']:>9} {r['method']:>7} {seg}  {r['error']}"
    return (
        f"{r['seqlen']:>9} {r['method']:>7} {seg}  {r['time_s'] * 1e3:10.1f} ms  "
        f"{r['tokens_per_s'] / 1e6:8.3f} Mtok/s  {r['ns_per_token']:8.2f} ns/tok  "
        f"peak {r['peak_gib']:6.2f} GiB"
    )


def table(rows: list[dict]) -> str:
    lines = [
        f"{'seqlen':>9} {'method':>7} {'segment':>7} {'ms':>10} {'Mtok/s':>8} {'ns/tok':>8} "
        f"{'vs256K':>6} {'peakGiB':>7} {'local/inf':>9} {'state%':>6}"
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"{r['seqlen']:>9} {r['method']:>7} {r.get('segment_len') or '':>7} {r['error']:>10}"
            )
            continue
        vs = r.get("ns_per_token_vs_256k")
        ratio = r.get("local_throughput_ratio")
        state = r.get("memory_state_share")
        lines.append(
            f"{r['seqlen']:>9} {r['method']:>7} {r.get('segment_len') or '':>7} {r['time_s'] * 1e3:10.1f} "
            f"{r['tokens_per_s'] / 1e6:8.3f} {r['ns_per_token']:8.2f} "
            f"{'' if vs is None else f'{vs:6.2f}':>6} "
            f"{r['peak_gib']:7.2f} {'' if ratio is None else f'{ratio:9.2f}':>9} "
            f"{'' if state is None else f'{100 * state:6.2f}':>6}"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Infini-attention against the targets, per segment length: throughput over the local
    attention's (>= 0.8), ns/token from 256K to the longest length that ran (<= +10%), the memory
    state kept for the backward against the activations (< 1%), and the longest length that fit."""
    lines = []
    for seg in sorted({r["segment_len"] for r in rows if r["method"] == "infini"}):
        ran = [r for r in rows if r["method"] == "infini" and r["segment_len"] == seg and "time_s" in r]
        if not ran:
            lines.append(f"segment {seg}: no run fit")
            continue
        ratios = [r["local_throughput_ratio"] for r in ran if "local_throughput_ratio" in r]
        growth = [r["ns_per_token_vs_256k"] for r in ran if "ns_per_token_vs_256k" in r]
        longest = max(ran, key=lambda r: r["seqlen"])
        parts = [
            f"segment {seg}: longest that ran {longest['seqlen']} tokens (peak {longest['peak_gib']:.1f} GiB)"
        ]
        if ratios:
            parts.append(
                f"throughput / local attention's {min(ratios):.2f}-{max(ratios):.2f} (target >= 0.8)"
            )
        if len(growth) > 1:
            parts.append(
                f"ns/token {100 * (growth[-1] - 1):+.1f}% from 256K to {longest['seqlen']}, "
                f"worst {100 * (max(growth) - 1):+.1f}% (target <= +10%)"
            )
        share = max(r["memory_state_share"] for r in ran)
        parts.append(f"memory state kept {100 * share:.3f}% of activations (target < 1%)")
        lines.append("; ".join(parts))
    return "\n".join(lines)


def profile(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> str:
    """GPU time per kernel of one Infini-attention fwd+bwd (after a warm-up): which pass of the
    memory path, the local attention or autograd's gradient sums takes the time."""
    seqlen, seg = args.profile, args.segments[0]
    shapes = [(1, seqlen, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    q, k, v = (torch.randn(sh, device=device, dtype=dtype).requires_grad_() for sh in shapes)
    beta = torch.zeros(args.heads, device=device, requires_grad=True)
    dout = torch.randn_like(q)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    ringflash.infini_attention(q, k, v, beta, seg, update=args.update).backward(dout)
    for t in (q, k, v, beta):  # as in the timed runs: no accumulation into .grad in the profile
        t.grad = None
    _sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        ringflash.infini_attention(q, k, v, beta, seg, update=args.update).backward(dout)
        _sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    title = f"profile: {seqlen} tokens, segment {seg}, one fwd+bwd"
    return title + "\n" + prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60)


def main() -> None:
    args = parse_args()
    device = "cpu (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(
        f"Infini-attention fwd+bwd ({args.update}), {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
        f"{args.dtype}, TF32 {'on' if args.tf32 else 'off'}, {device}",
        flush=True,
    )
    rows = bench(args)
    print(table(rows))
    print(summary(rows))
    if args.profile:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        target = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        print(profile(args, target, dtype))
    if args.json:
        meta = {
            "device": device,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            **vars(args),
        }
        with open(args.json, "w") as f:
            json.dump({"config": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
