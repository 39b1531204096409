"""Head dims between the Hopper builds (96 under 128, 192 under 256) on one GPU: ringflash on the
tensors in place (the next build's tiles read zero-filled by TMA), the same kernels on
zero-padded copies (what a caller does by hand to reach a built head_dim, and what ringflash
did before 2026-11-25), and SDPA's cuDNN backend, in the same run on the same shapes.

    python launch/bench_head_dims.py

bf16, 16 heads, batch * seqlen = 64K tokens; TFLOP/s count the real head_dim (fwd = 4*B*H*S^2*D,
half when causal; fwd+bwd = 3.5x fwd), medians of triton.testing.do_bench
(bench_attention.measure). Prints markdown rows: S | D | causal | in place | copies | cuDNN (each
fwd / bwd / fwd+bwd) | in place / cuDNN | in place / copies | peak GiB (in place / copies / cuDNN).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from bench_attention import make_runner, measure

import ringflash

HEADS = 16
TOKENS = 65536


def row(d: int, build: int, n: int, causal: bool) -> str:
    b = TOKENS // n
    flops = 4 * b * HEADS * n * n * d * (0.5 if causal else 1)
    in_place, (q, k, v) = make_runner("ringflash", b, n, HEADS, d, causal, HEADS)
    res = {"in-place": measure(in_place, (q, k, v), flops)}

    def copies():
        qp, kp, vp = (F.pad(t, (0, build - d)) for t in (q, k, v))
        return ringflash.flash_attn_func(qp, kp, vp, softmax_scale=d**-0.5, causal=causal)[..., :d]

    res["copies"] = measure(copies, (q, k, v), flops)
    res["cudnn"] = measure(*make_runner("cudnn", b, n, HEADS, d, causal, HEADS), flops)
    cells = " | ".join(f"{r['fwd']:.0f} / {r['bwd']:.0f} / {r['fwd_bwd']:.0f}" for r in res.values())
    ours, pad, ref = res["in-place"], res["copies"], res["cudnn"]
    return (
        f"| {n} | {d} | {'yes' if causal else 'no'} | {cells} | {ours['fwd_bwd'] / ref['fwd_bwd']:.2f} | "
        f"{ours['fwd_bwd'] / pad['fwd_bwd']:.2f} | "
        f"{ours['peak_gib']:.2f} / {pad['peak_gib']:.2f} / {ref['peak_gib']:.2f} |"
    )


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_head_dims.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    for d, build in ((96, 128), (192, 256)):
        for n in (4096, 65536):
            for causal in (False, True):
                print(row(d, build, n, causal), flush=True)


if __name__ == "__main__":
    main()
