"""Block-sparse attention on one GPU: ringflash's ``block_mask`` beside FlexAttention with the same
``BlockMask``, and the dense kernel (every pair) for the ideal, same run.

    python launch/bench_block_sparse.py
    python launch/bench_block_sparse.py --tokens 65536 --workloads random10 llama4-8k

bf16, --heads query heads (--kv-heads key/value heads: GQA), --tokens tokens in one sequence. Each
workload is a FlexAttention ``mask_mod``; ``create_block_mask`` makes the BlockMask that both
backends take (ringflash converts it once, outside the timing: ``TileMask.from_block_mask``).
TFLOP/s count the visible pairs (forward 4·H·D·pairs, fwd+bwd 3.5×); cells read fwd / bwd /
fwd+bwd. "of ideal": the default dense kernels' fwd+bwd time (every pair, no mask: Gluon on
Hopper) × the fraction of visible blocks, over ringflash's time (1.0: time follows the visible
blocks exactly). Each workload first checks ringflash's output against FlexAttention's (rel. error
< 2e-2, else FAIL).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.attention.flex_attention as flex_attention
import triton
from bench_attention import _compiled_flex, measure_rounds  # launch/ is on the path: run as a script

import ringflash
from ringflash import TileMask

WORKLOADS = ("random5", "random10", "random25", "random50", "bigbird", "llama4-8k", "prefix-lm")


def mask_mod_of(workload: str, tokens: int, block: int = 128):
    """The workload's mask_mod (on the GPU): random{p}: p% of the 128-blocks (the diagonal always);
    bigbird: a band of +-256, the first 128 keys, 5% random blocks; llama4-8k: causal within
    chunks of 8192; prefix-lm: the first quarter bidirectional, causal after."""
    n = -(-tokens // block)
    g = torch.Generator().manual_seed(0)
    if workload.startswith("random") or workload == "bigbird":
        p = 0.05 if workload == "bigbird" else int(workload.removeprefix("random")) / 100
        blocks = (torch.rand(n, n, generator=g) < p) | torch.eye(n, dtype=torch.bool)
        blocks = blocks.cuda()
        if workload == "bigbird":
            return lambda b, h, q, kv: ((q - kv).abs() <= 256) | (kv < 128) | blocks[q // block, kv // block]
        return lambda b, h, q, kv: blocks[q // block, kv // block]
    if workload == "llama4-8k":
        return lambda b, h, q, kv: (q // 8192 == kv // 8192) & (q >= kv)
    prefix = tokens // 4
    return lambda b, h, q, kv: (kv < prefix) | (q >= kv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA; default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per workload (medians)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_block_sparse.py needs a CUDA GPU")
    s, h, d = args.tokens, args.heads, args.head_dim
    hk = args.kv_heads or h
    if h % hk:
        sys.exit(f"--kv-heads {hk} must divide --heads {h}")

    def randn(shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = randn((1, s, h, d)), randn((1, s, hk, d)), randn((1, s, hk, d))
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    flex = _compiled_flex()
    # Uncompiled, create_block_mask evaluates the mask_mod over every (query, key) pair at once:
    # 64 GiB at 256K tokens (out of memory on an H200). Compiled, it reduces block by block.
    make_block_mask = flex_attention.create_block_mask
    if s > 65536:
        make_block_mask = torch.compile(make_block_mask)
    # Every pair, by the default kernels (Gluon on Hopper) and by the portable Triton ones. The
    # ideal is the default's dense time x density: what a user gets without a block mask.
    full = (lambda: ringflash.flash_attn_func(q, k, v), (q, k, v))
    dense = measure_rounds({"ringflash": full, "ringflash-triton": full}, 4 * h * d * s * s, args.rounds)
    dense_ms = 3.5 * 4 * h * d * s * s / dense["ringflash"]["fwd_bwd"] / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}, bf16, {h} heads ({hk} key/value), head_dim {d}, {s} tokens; TFLOP/s of "
          f"visible pairs fwd / bwd / fwd+bwd; every pair: {dense['ringflash']['fwd_bwd']:.0f} (default "
          f"kernels, the ideal's), {dense['ringflash-triton']['fwd_bwd']:.0f} (Triton kernels) "
          "TFLOP/s fwd+bwd")  # fmt: skip
    print("| workload | visible blocks | ringflash | FlexAttention | ringflash / Flex (fwd+bwd) | of ideal "
          "| check |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        print(f"[{datetime.datetime.now():%H:%M:%S}] {workload}", file=sys.stderr)
        mask_mod = mask_mod_of(workload, s)
        block_mask = make_block_mask(mask_mod, None, None, s, s, device="cuda")
        tile_mask = TileMask.from_block_mask(block_mask)
        flops = 4 * h * d * tile_mask.visible_pairs()
        ours = lambda m=tile_mask: ringflash.flash_attn_func(q, k, v, block_mask=m)  # noqa: E731
        theirs = lambda m=block_mask: flex(qt, kt, vt, block_mask=m, enable_gqa=hk != h)  # noqa: E731
        with torch.no_grad():
            got, ref = ours().float(), theirs().transpose(1, 2).float()
            err = ((got - ref).norm() / ref.norm()).item()
        runners = {"ringflash": (ours, (q, k, v)), "flex": (theirs, (qt, kt, vt))}
        r = measure_rounds(runners, flops, args.rounds)
        density = tile_mask.density()

        def cell(x):
            return "n/a" if x is None else f"{x['fwd']:.0f} / {x['bwd']:.0f} / {x['fwd_bwd']:.0f}"

        a, f = r["ringflash"], r["flex"]
        vs = "n/a" if not a or not f else f"{a['fwd_bwd'] / f['fwd_bwd']:.2f}"
        ideal = "n/a" if not a else f"{dense_ms * density / (3.5 * flops / a['fwd_bwd'] / 1e9):.2f}"
        print(f"| {workload} | {density:.1%} | {cell(a)} | {cell(f)} | {vs} | {ideal} | "
              f"{'ok' if err < 2e-2 else 'FAIL'} {err:.1e} |", flush=True)  # fmt: skip
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
