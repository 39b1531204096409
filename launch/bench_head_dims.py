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
from bench_attention import measure
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash

HEADS = 16
TOKENS = 65536


def _rand(shape):
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)


def row(d: int, build: int, n: int, causal: bool) -> str:
    b = TOKENS // n
    flops = 4 * b * HEADS * n * n * d * (0.5 if causal else 1)
    q, k, v = (_rand((b, n, HEADS, d)) for _ in range(3))
    res = {"in-place": measure(lambda: ringflash.flash_attn_func(q, k, v, causal=causal), (q, k, v), flops)}

    def copies():
        qp, kp, vp = (F.pad(t, (0, build - d)) for t in (q, k, v))
        return ringflash.flash_attn_func(qp, kp, vp, softmax_scale=d**-0.5, causal=causal)[..., :d]

    res["copies"] = measure(copies, (q, k, v), flops)
    qc, kc, vc = (_rand((b, HEADS, n, d)) for _ in range(3))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)

    res["cudnn"] = measure(cudnn, (qc, kc, vc), flops)
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
