"""Decode-shaped calls of ``flash_attn_func`` beside SDPA: host time per call with a fixed and a
growing key length, then device time per call over long caches.

    python launch/bench_few_queries.py
    python launch/bench_few_queries.py --batches 1 8 --lengths 4096 32768 131072

q (B, 1, 32, 128) and k/v (B, L, 8, 128) as transformers hands them to attention during
``generate`` (views of (B, heads, L, head_dim) tensors), bf16, no gradients. Entries:
``ours`` (``flash_attn_func``: the few-query path, kernels/few_queries.py), ``ours_general``
(the same with ``RINGFLASH_SPLIT_KV_QUERIES=0``), SDPA with ``enable_gqa=True`` on the (B, H, L,
D) tensors: ``sdpa_default`` (no backend context), ``sdpa_cudnn``, ``sdpa_flash``.

Host time: ``--calls`` calls back to back, L fixed at ``--host-length`` or growing by one per
call (a cache that grows a token a step), wall µs per call (the GPU keeps up), median and min
over ``--rounds`` rounds, the entries taking turns. Device time: 100 calls back to back between
two CUDA events after one call, µs per call, best of 3, at each batch and length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash
from ringflash.kernels import few_queries

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _tensors(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def entries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """name -> f(n): attention of q over the first n keys."""
    qv = q.transpose(1, 2)

    def ours(n):
        return ringflash.flash_attn_func(
            qv, k[:, :, :n].transpose(1, 2), v[:, :, :n].transpose(1, 2), causal=True
        )

    def general(n):
        os.environ[few_queries.SWITCH] = "0"
        try:
            return ours(n)
        finally:
            del os.environ[few_queries.SWITCH]

    def sdpa(n):
        return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)

    def cudnn(n):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(n)

    def flash(n):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(n)

    return dict(ours=ours, ours_general=general, sdpa_default=sdpa, sdpa_cudnn=cudnn, sdpa_flash=flash)


def host_us(f, length: int, grow: bool, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        f(length + (i if grow else 0))
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def device_us(f, length: int, calls: int = 100) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    f(length)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(calls):
        f(length)
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host-length", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    with torch.no_grad():
        q, k, v = _tensors(1, args.host_length + args.calls + 8)
        found = entries(q, k, v)
        for f in found.values():  # warm-up: compiles, plans
            for i in range(3):
                f(args.host_length + 500 + i)
        times: dict[tuple[str, bool], list[float]] = {}
        for _ in range(args.rounds):
            for name, f in found.items():
                for grow in (False, True):
                    times.setdefault((name, grow), []).append(host_us(f, args.host_length, grow, args.calls))
        print(f"## host µs per call, B=1, L={args.host_length} (growing: +1 per call), {args.calls} calls, "
              f"median (min) of {args.rounds}")  # fmt: skip
        for (name, grow), t in times.items():
            kind = "L grows" if grow else "L fixed"
            print(f"{name:14s} {kind:8s} {statistics.median(t):7.1f} ({min(t):6.1f})")
        n = args.host_length + 123
        want = found["sdpa_default"](n).transpose(1, 2).float()
        for name in ("ours", "ours_general"):
            print(f"max |{name} - sdpa|: {(found[name](n).float() - want).abs().max().item():.3g}")
        print("## device µs per call, 100 calls back to back, best of 3")
        for batch in args.batches:
            for length in args.lengths:
                found = entries(*_tensors(batch, length))
                row = {name: min(device_us(f, length) for _ in range(3)) for name, f in found.items()}
                print(
                    f"B={batch} L={length:7d} " + "  ".join(f"{k} {v:8.1f}" for k, v in row.items()),
                    flush=True,
                )


if __name__ == "__main__":
    main()
