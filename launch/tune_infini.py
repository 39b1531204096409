"""Sweep the Infini-attention memory kernels' tiles on one GPU; prints the fastest per kernel.

    python launch/tune_infini.py                          # 1M tokens, segment 2048, 8 heads of 128
    python launch/tune_infini.py --seqlen 262144 --segment 4096 --kernels retrieval updates

Each kernel runs through its wrapper with (rows per block, warps, pipeline stages) set through
``kernels/infini/memory.py``'s TUNED_HEAD_DIM_128 (head_dim 128 only: the table applies there),
timed with ``triton.testing.do_bench`` (ms, median) beside the defaults. The winners go into that
table by hand, with the numbers in docs/experiments.md, so launches stay free of autotuning.
Configurations that do not build (shared memory, registers) are reported as failed.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from ringflash.kernels.infini import memory, retrieval

CONFIGS = [*itertools.product([32, 64, 128], [4, 8], [2, 3]), (32, 8, 1), (64, 8, 1), (16, 4, 2), (16, 4, 3)]


def kernel_calls(seqlen: int, heads: int, segment: int) -> dict:
    """name in TUNED_HEAD_DIM_128 -> a call of the wrapper that launches that kernel (bf16,
    head_dim 128, batch 1, heads = kv heads)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, local, dout = (
        torch.randn(1, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(5)
    )
    gate = torch.rand(heads, device="cuda", generator=g)
    dm, dz = memory.memory_updates(k, v, segment)
    m_before = memory.memory_scan(dm, None, torch.bfloat16)[0]
    z_before = memory.memory_scan(dz, None, torch.float32)[0]
    grad_dm, grad_dz = torch.randn_like(dm).bfloat16(), torch.randn_like(dz)
    s_grad = torch.randn_like(dm) * 1e-3
    local_delta = torch.empty(heads, seqlen, device="cuda")
    return {
        "updates": lambda: memory.memory_updates(k, v, segment),
        "gram": lambda: memory.memory_gram(k, z_before, segment),
        "updates_backward": lambda: memory.memory_updates_backward(k, v, segment, grad_dm, grad_dz),
        "gram_backward": lambda: memory.memory_updates_backward(
            k, v, segment, grad_dm, grad_dz, (s_grad, z_before)
        ),
        "gram_den": lambda: memory.memory_gram_den_backward(k, segment, s_grad, z_before),
        "retrieval": lambda: retrieval.memory_retrieval(q, local, gate, m_before, z_before, segment),
        "retrieval_backward": lambda: retrieval.memory_retrieval_backward(
            q, local, gate, m_before, z_before, segment, dout, local_delta, torch.float32
        ),
    }


def sweep(name: str, call, configs) -> list[tuple[float, tuple | None]]:
    """(ms, config) for the default (config None) and each configuration, fastest first."""
    table = memory.TUNED_HEAD_DIM_128
    saved = table.pop(name, None)
    rows = []
    try:
        for config in [None, *configs]:
            if config is not None:
                table[name] = config
            try:
                rows.append((triton.testing.do_bench(call, warmup=5, rep=30), config))
            except Exception as e:  # a configuration that does not build or launch
                print(f"  {name} {config}: failed ({type(e).__name__})")
    finally:
        table.pop(name, None)
        if saved is not None:
            table[name] = saved
    return sorted(rows, key=lambda r: r[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=1 << 20)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--segment", type=int, default=2048)
    p.add_argument("--kernels", nargs="+", default=None, help="names in TUNED_HEAD_DIM_128 (default: all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_infini.py times the kernels on a CUDA GPU; none is visible")
    calls = kernel_calls(args.seqlen, args.heads, args.segment)
    print(f"{torch.cuda.get_device_name()}, {args.seqlen} tokens, segment {args.segment}, {args.heads} heads")
    for name in args.kernels or calls:
        rows = sweep(name, calls[name], CONFIGS)
        default = next(ms for ms, config in rows if config is None)
        best = ", ".join(f"{ms:.3f} ms {config}" for ms, config in rows[:3])
        current = memory.TUNED_HEAD_DIM_128.get(name)
        print(f"{name:20s} untuned {default:.3f} ms, table {current} | fastest (rows, warps, stages): {best}")


if __name__ == "__main__":
    main()
