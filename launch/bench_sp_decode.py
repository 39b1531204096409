"""Sequence-parallel decoding over a KV cache sharded across the GPUs of a group, beside one GPU
holding the whole cache, and the prefill that fills the shards (the ring's causal forward over
contiguous shards) beside one GPU's ``flash_attn_func``, same run.

    torchrun --nproc_per_node 2 launch/bench_sp_decode.py --cache-lens 131072 1048576

Per cached length L (batch 1 unless ``--batch``): a decode step (one query token, one new
key/value appended at position L - 1, causal, ``check_bounds=False``) timed on one GPU over
the whole cache (rank 0, while the others wait) and with ``sp_flash_attn_with_kvcache`` over L
/ world positions per rank; per call, ``--iters`` calls back to back between two CUDA events
(the host running ahead) and single calls each between two events after a synchronize (a
layer's latency). The slowest rank's time is reported. Prefill: L tokens of causal attention,
forward only, one GPU against the ring over contiguous shards (each rank keeps its K/V: the
shard a sharded decode then reads); single calls (two, after one to warm up: a 1M-token
prefill takes seconds), the slowest rank's time.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from bench_decode import back_to_back_us, graphed  # launch/ is on the path: run as a script

import ringflash


def _single_call_us(f: Callable, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _slowest(value: float, device: torch.device) -> float:
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(
    make: Callable[[], Callable], iters: int, device: torch.device, alone: bool, single_only: bool = False
) -> tuple[float, float]:
    """(back-to-back us, single-call us) of the call ``make()`` returns (made only where it
    runs): on rank 0 only when ``alone`` (the others wait), else on every rank, the slowest
    reported; ``single_only``: single calls only (nan first)."""
    rank = dist.get_rank()
    pair = (float("nan"), float("nan"))
    if not alone or rank == 0:
        f = make()
        f()
        torch.cuda.synchronize()
        if not alone:
            dist.barrier()
        together = float("nan") if single_only else back_to_back_us(f, iters)
        pair = (together, _single_call_us(f, iters))
    dist.barrier()
    return tuple(_slowest(x if not alone or rank == 0 else 0.0, device) for x in pair)


def _decode_row(args, length: int, device: torch.device) -> None:
    rank, world, dt = dist.get_rank(), dist.get_world_size(), torch.bfloat16
    b, h, hk, d = args.batch, args.heads, args.kv_heads, args.head_dim
    shared = torch.Generator(device=device).manual_seed(0)  # the same queries and new tokens everywhere
    q = torch.randn(b, 1, h, d, device=device, dtype=dt, generator=shared)
    k_new, v_new = (torch.randn(b, 1, hk, d, device=device, dtype=dt, generator=shared) for _ in range(2))
    g = torch.Generator(device=device).manual_seed(1 + rank)
    seqlens = torch.full((b,), length - 1, dtype=torch.int32, device=device)
    whole_step = None
    if rank == 0:
        k_whole = torch.randn(b, length, hk, d, device=device, dtype=dt, generator=g)
        v_whole = torch.randn_like(k_whole)
        whole_step = functools.partial(
            ringflash.flash_attn_with_kvcache, q, k_whole, v_whole, k_new, v_new, cache_seqlens=seqlens,
            causal=True, check_bounds=False,
        )  # fmt: skip
    k_shard = torch.randn(b, length // world, hk, d, device=device, dtype=dt, generator=g)
    sharded_step = functools.partial(
        ringflash.sp_flash_attn_with_kvcache, q, k_shard, torch.randn_like(k_shard), k_new, v_new,
        cache_seqlens=seqlens, causal=True, check_bounds=False,
    )  # fmt: skip
    for what, wrap in (("decode step", lambda f: f), ("decode step, CUDA graph", graphed)):
        one = _timed(functools.partial(wrap, whole_step), args.iters, device, alone=True)
        many = _timed(functools.partial(wrap, sharded_step), args.iters, device, alone=False)
        if rank == 0:
            print(f"| {length} | {what} | {one[0]:.1f} | {one[1]:.1f} | {many[0]:.1f} | {many[1]:.1f} | "
                  f"{many[1] / one[1]:.2f} |", flush=True)  # fmt: skip


def _prefill_row(args, length: int, device: torch.device) -> None:
    rank, world, dt = dist.get_rank(), dist.get_world_size(), torch.bfloat16
    b, h, hk, d = args.batch, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device=device).manual_seed(rank)

    def prefill(attention: Callable, tokens: int) -> Callable:
        qkv = [torch.randn(b, tokens, n, d, device=device, dtype=dt, generator=g) for n in (h, hk, hk)]

        def run():
            with torch.no_grad():
                return attention(*qkv, causal=True)

        return run

    one = _timed(lambda: prefill(ringflash.flash_attn_func, length), 2, device, True, True)
    torch.cuda.empty_cache()
    many = _timed(lambda: prefill(ringflash.ring_flash_attn_func, length // world), 2, device, False, True)
    torch.cuda.empty_cache()
    if rank == 0:
        print(f"| {length} | prefill (ring, contiguous shards) | | {one[1]:.0f} | | {many[1]:.0f} | "
              f"{many[1] / one[1]:.2f} |", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-lens", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-prefill", action="store_true", help="time the decode steps only")
    args = p.parse_args()
    if not torch.cuda.is_available() or "WORLD_SIZE" not in os.environ:
        sys.exit("bench_sp_decode.py runs under torchrun on CUDA GPUs")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    device, world = torch.device("cuda", local), dist.get_world_size()
    b, h, hk, d = args.batch, args.heads, args.kv_heads, args.head_dim
    if dist.get_rank() == 0:
        print(f"# {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, batch {b}, heads "
              f"{h}/{hk}, head_dim {d}, bf16; us per call, the slowest rank's")  # fmt: skip
        print("| cached tokens | what | one GPU, back to back | one GPU, single call | "
              f"{world} GPUs, back to back | {world} GPUs, single call | single-call ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
    for length in args.cache_lens:
        _decode_row(args, length, device)
        if not args.no_prefill:
            _prefill_row(args, length, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
