"""Sweep tile configurations of the attention kernels on one GPU; prints the fastest per case.

    python launch/tune_attention.py                 # head_dim 64 and 128, causal and not, S=16K
    python launch/tune_attention.py --head-dims 256 --seqlen 8192

The winners go into kernels/configs.py by hand (with the numbers in docs/performance.md), so
that launches stay deterministic and free of autotuning passes.
"""

from __future__ import annotations

import argparse
import sys

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
       (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3)]  # fmt: skip
BWD_KV = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (32, 128, 8, 2), (64, 64, 4, 3),
          (128, 128, 8, 2), (32, 64, 4, 3), (64, 128, 4, 2)]  # fmt: skip
BWD_Q = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
         (64, 128, 4, 2), (64, 32, 4, 3)]  # fmt: skip


def bench(fn) -> float:
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # e.g. out of shared memory for a big tile
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
        return float("inf")


def sweep_case(d: int, causal: bool, seqlen: int, heads: int) -> dict:
    b = max(1, 65536 // seqlen)
    q, k, v, do = (torch.randn(b, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    prob = build_problem(q, k, v, None, causal, (-1, -1))
    flops = 4 * b * heads * seqlen**2 * d * (0.5 if causal else 1.0)
    out, lse = attention_forward(q, k, v, prob)
    delta = attention_delta(out, do, prob)

    def fwd():
        attention_forward(q, k, v, prob)

    def bwd():
        attention_backward(do, q, k, v, lse, delta, prob)

    results = {}
    for name, module, attr, cands, fn, mult in (
        ("fwd", forward, "forward_config", FWD, fwd, 1.0),
        ("bwd_kv", backward, "backward_kv_config", BWD_KV, bwd, 2.5),
        ("bwd_q", backward, "backward_q_config", BWD_Q, bwd, 2.5),
    ):
        original = getattr(module, attr)
        timings = []
        for c in cands:
            setattr(module, attr, lambda _d, _causal=False, _fp32=False, c=c: TileConfig(*c))
            timings.append((bench(fn), c))
        setattr(module, attr, original)
        ms, best = min(timings)
        results[name] = best
        top = ", ".join(f"{c}:{flops * mult / t / 1e9:.0f}" for t, c in sorted(timings)[:4])
        print(f"D={d} causal={causal} {name}: best {best} {flops * mult / ms / 1e9:.0f} TFLOP/s | {top}")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}")
    for d in args.head_dims:
        for causal in (False, True):
            print(f"RESULT D={d} causal={causal} {sweep_case(d, causal, args.seqlen, args.heads)}")


if __name__ == "__main__":
    main()
