"""Sweep tile configurations of the attention kernels on one GPU; prints the fastest per case.

    python launch/tune_attention.py                 # head_dim 64 and 128, causal and not, S=16K
    python launch/tune_attention.py --head-dims 256 --seqlen 8192
    python launch/tune_attention.py --head-dims 64 --heads 16 --kv-heads 4 --causal yes --kernels bwd_kv
    python launch/tune_attention.py --head-dims 256 --kernels bwd_kv --tiles 32,64,4,1 64,64,8,2

The winners go into kernels/configs.py by hand (with the numbers in docs/experiments.md), so
that launches stay deterministic and free of autotuning passes. Sweep the shapes you train
(GQA, long sequences) as well as the default: a dK/dV tile picked at 16K tokens with 16 MHA
heads ran 2-6x slower with GQA at 64K (docs/experiments.md, 2026-11-23). Candidates that
overflow shared memory can be dropped without a GPU (launch/kernel_report.py); its register and
spill counts do not predict speed on their own.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import astuple

import torch
import triton

from ringflash.kernels import (
    attention_backward,
    attention_delta,
    attention_forward,
    backward,
    build_problem,
    forward,
)
from ringflash.kernels.configs import TileConfig

FWD = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4),
       (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3), (128, 32, 8, 2)]  # fmt: skip
BWD_KV = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (32, 128, 8, 2), (64, 64, 4, 3),
          (128, 128, 8, 2), (32, 64, 4, 3), (64, 128, 4, 2), (32, 32, 4, 1), (64, 64, 8, 2)]  # fmt: skip
BWD_Q = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
         (64, 128, 4, 2), (64, 32, 4, 3)]  # fmt: skip


def bench(fn) -> float:
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # e.g. out of shared memory for a big tile
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
        return float("inf")


def sweep_case(
    d: int,
    causal: bool,
    seqlen: int,
    heads: int,
    kv_heads: int,
    kernels: list[str],
    tiles: list[TileConfig] | None,
) -> dict:
    b = max(1, 65536 // seqlen)
    q, do = (torch.randn(b, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, seqlen, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    prob = build_problem(q, k, v, None, causal, (-1, -1))
    flops = 4 * b * heads * seqlen**2 * d * (0.5 if causal else 1.0)
    out, lse = attention_forward(q, k, v, prob)
    delta = attention_delta(out, do, prob)

    def fwd():
        attention_forward(q, k, v, prob)

    # Each backward kernel alone; TFLOP/s count the matrix products it runs (dK/dV: 4 per tile
    # pair, dQ: 3, the forward's 2 being 1.0x), so the three columns compare kernel speeds.
    def bwd_kv():
        attention_backward(do, q, k, v, lse, delta, prob, compute_dq=False)

    def bwd_q():
        attention_backward(do, q, k, v, lse, delta, prob, compute_dkdv=False)

    results = {}
    for name, module, attr, cands, fn, mult in (
        ("fwd", forward, "forward_config", FWD, fwd, 1.0),
        ("bwd_kv", backward, "backward_kv_config", BWD_KV, bwd_kv, 2.0),
        ("bwd_q", backward, "backward_q_config", BWD_Q, bwd_q, 1.5),
    ):
        if name not in kernels:
            continue
        original = getattr(module, attr)
        timings = []
        for c in tiles or [TileConfig(*c) for c in cands]:
            setattr(module, attr, lambda _d, _fp32=False, c=c: c)
            timings.append((bench(fn), astuple(c)))
        setattr(module, attr, original)
        ms, best = min(timings)
        results[name] = best
        top = ", ".join(f"{c}:{flops * mult / t / 1e9:.0f}" for t, c in sorted(timings)[:4])
        print(
            f"D={d} causal={causal} heads {heads}/{kv_heads} {name}: "
            f"best {best} {flops * mult / ms / 1e9:.0f} TFLOP/s | {top}"
        )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA/MQA: key/value heads (default: --heads)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument(
        "--kernels", nargs="+", default=["fwd", "bwd_kv", "bwd_q"], choices=["fwd", "bwd_kv", "bwd_q"]
    )
    p.add_argument(
        "--tiles", nargs="+", default=None, metavar="M,N,WARPS,STAGES",
        help="candidates to time instead of the built-in lists, for every kernel in --kernels",
    )  # fmt: skip
    args = p.parse_args()
    try:
        tiles = [TileConfig.parse(t) for t in args.tiles] if args.tiles else None
    except ValueError as e:
        p.error(f"--tiles: {e}")
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv_heads})")
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}")
    for d in args.head_dims:
        for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
            best = sweep_case(d, causal, args.seqlen, args.heads, kv_heads, args.kernels, tiles)
            print(f"RESULT D={d} causal={causal} heads {args.heads}/{kv_heads} {best}")


if __name__ == "__main__":
    main()
