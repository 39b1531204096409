"""Single-GPU attention benchmark: ringflash's Triton kernel beside torch SDPA (flash, cuDNN) and
FlexAttention, in the same run on the same inputs.

    python launch/bench_attention.py
    python launch/bench_attention.py --head-dims 128 --seqlens 16384 65536 --causal yes --json bench.json
    python launch/bench_attention.py --backends ringflash flash cudnn --tokens 32768 --heads 32
    python launch/bench_attention.py --quick          # one small config, a smoke test

Default sweep: head_dim 64, 128 x causal no, yes x S 4096..65536, batch = max(1, 65536 // S), 16
heads, bf16, layout (B, S, H, D); SDPA and Flex get (B, H, S, D) copies made outside timing.
TFLOP/s from attention FLOPs: fwd = 4*B*H*S^2*D (half when causal), fwd+bwd = 3.5x fwd; times are
medians of triton.testing.do_bench(warmup=25, rep=100). Peak memory is one fwd+bwd's peak allocation
above the inputs (q, k, v, dout). Each config first checks ringflash's output against SDPA's flash
backend (relative error < 2e-2, else the row says FAIL). A backend that fails on a shape (cuDNN
unavailable, OOM, compile error) shows n/a. Progress goes to stderr, the markdown table to stdout;
on Ctrl-C or SIGTERM (e.g. `timeout`) the table of the configs done so far is still printed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import math
import signal
import sys
from collections.abc import Callable

import torch
import torch.nn.attention.flex_attention as flex
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash

BACKENDS = ("ringflash", "flash", "cudnn", "flex")
SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
TOLERANCE = 2e-2


@functools.cache
def compiled_flex() -> Callable:
    """One compiled flex_attention for all shapes. Every shape (and grad mode) is a recompile, so
    lift dynamo's recompile limit: past it, flex_attention silently runs an unfused, memory-hungry
    eager path."""
    cfg = torch._dynamo.config
    setattr(cfg, "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit", 256)
    return torch.compile(flex.flex_attention, dynamic=False)


def make_runner(name: str, qkv: tuple[torch.Tensor, ...], causal: bool):
    """(run, leaves): ``run()`` computes attention with backend ``name``; ``leaves`` are the input
    tensors to differentiate with respect to. ``qkv`` is (B, S, H, D) without grad."""
    if name == "ringflash":
        q, k, v = (t.detach().requires_grad_() for t in qkv)
        return (lambda: ringflash.flash_attn_func(q, k, v, causal=causal)), (q, k, v)
    q, k, v = (t.transpose(1, 2).contiguous().requires_grad_() for t in qkv)  # (B, H, S, D), untimed
    if name in SDPA:
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), (q, k, v)
    s = q.shape[2]
    causal_mask = lambda b, h, i, j: i >= j
    mask = flex.create_block_mask(causal_mask, None, None, s, s, device="cuda") if causal else None
    fn = compiled_flex()
    return (lambda: fn(q, k, v, block_mask=mask)), (q, k, v)


def bench_one(name: str, qkv: tuple[torch.Tensor, ...], causal: bool) -> dict:
    b, s, h, d = qkv[0].shape
    with sdpa_kernel(SDPA[name]) if name in SDPA else contextlib.nullcontext():
        fn, leaves = make_runner(name, qkv, causal)
        dout = torch.randn_like(fn().detach())
        fwd_bwd = lambda: torch.autograd.grad(fn(), leaves, dout)
        with torch.no_grad():
            fwd_ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        fwd_bwd_ms = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()  # inputs, their copies, dout
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    return {
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_tflops": flops / fwd_ms / 1e9,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_ms / 1e9,
        "peak_gib": peak_gib,
    }


def check_against_sdpa(qkv: tuple[torch.Tensor, ...], causal: bool) -> float | None:
    """Relative L2 error of ringflash's output against SDPA's flash backend; None if either errors or
    the error is not finite (NaN/inf in the output)."""
    try:
        with torch.no_grad():
            ours = ringflash.flash_attn_func(*qkv, causal=causal).float()
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in qkv), is_causal=causal)
            ref = ref.transpose(1, 2).float()
            err = ((ours - ref).norm() / ref.norm()).item()
            return err if math.isfinite(err) else None
    except Exception as e:
        print(f"  check against SDPA flash: {describe(e)}", file=sys.stderr)
        return None


def describe(e: BaseException) -> str:
    """Exception type and the first line of its message, shortened."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160] if lines else ''}"


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_config(args: argparse.Namespace, s: int, d: int, causal: bool) -> dict:
    b = max(1, args.tokens // s)
    row: dict = {"S": s, "B": b, "H": args.heads, "D": d, "causal": causal, "errors": {}}
    qkv = tuple(torch.randn(b, s, args.heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    row["rel_err"] = check_against_sdpa(qkv, causal)
    row["check"] = "ok" if row["rel_err"] is not None and row["rel_err"] < TOLERANCE else "FAIL"
    for name in args.backends:
        tag = f"[{datetime.datetime.now():%H:%M:%S}] S={s} B={b} D={d} causal={causal} {name}"
        try:
            r = bench_one(name, qkv, causal)
            msg = f"{r['fwd_tflops']:.0f} / {r['fwd_bwd_tflops']:.0f} TFLOP/s, {r['peak_gib']:.2f} GiB"
        except torch.cuda.OutOfMemoryError:
            r, msg = None, "n/a (out of memory)"
        except Exception as e:  # e.g. no cuDNN kernel for this shape, a Flex compile error
            r, msg = None, f"n/a ({describe(e)})"
        row[name] = r
        if r is None:
            row["errors"][name] = msg
        print(f"{tag}: {msg}", file=sys.stderr)
        free_memory()
    del qkv
    free_memory()
    return row


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    def get(row: dict, name: str, key: str) -> float | None:
        return row[name][key] if row.get(name) else None

    def fmt(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    def pair(row: dict, a: str, key_a: str, b: str, key_b: str, spec: str) -> str:
        return f"{fmt(get(row, a, key_a), spec)} / {fmt(get(row, b, key_b), spec)}"

    def ratio(row: dict, other: str) -> str:
        a, o = get(row, "ringflash", "fwd_bwd_tflops"), get(row, other, "fwd_bwd_tflops")
        return "n/a" if a is None or o is None else f"{a / o:.2f}"

    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{datetime.datetime.now():%Y-%m-%d %H:%M} | bf16, {args.heads} heads | "
          "TFLOP/s fwd / fwd+bwd (median); ratios and peaks are ringflash's, fwd+bwd\n")  # fmt: skip
    cols = ["S", "B", "D", "causal", *args.backends, "ringflash/flash", "ringflash/cuDNN"]
    cols += ["peak GiB ringflash / flash", "check (rel err)"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        cells = [row["S"], row["B"], row["D"], "yes" if row["causal"] else "no"]
        cells += [pair(row, n, "fwd_tflops", n, "fwd_bwd_tflops", ".0f") for n in args.backends]
        cells += [ratio(row, "flash"), ratio(row, "cudnn")]
        cells.append(pair(row, "ringflash", "peak_gib", "flash", "peak_gib", ".2f"))
        cells.append(f"{row['check']} ({fmt(row['rel_err'], '.1e')})")
        print("| " + " | ".join(map(str, cells)) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--tokens", type=int, default=65536, help="batch = max(1, tokens // seqlen)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--quick", action="store_true", help="one small config (D=128, causal, S=4096, B=4)")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention.py: no CUDA GPU visible (torch.cuda.is_available() is False); "
              "run it on a machine with an NVIDIA GPU.", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    if args.quick:
        args.head_dims, args.seqlens, args.causal, args.tokens = [128], [4096], "yes", 16384
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` -> KeyboardInterrupt
    rows: list[dict] = []
    try:
        for d in args.head_dims:
            for causal in causals:
                for s in args.seqlens:
                    rows.append(run_config(args, s, d, causal))
    except KeyboardInterrupt:
        print(f"interrupted: {len(rows)} configs done, printing those", file=sys.stderr)
    print_table(rows, args)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        meta |= {"triton": triton.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds")}
        with open(args.json, "w") as f:
            json.dump({**meta, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
