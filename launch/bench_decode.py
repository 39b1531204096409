"""Decode attention over a KV cache: K/V bytes read per second and host time per call, beside
SDPA (cuDNN, flash), FlexAttention and the device's copy bandwidth, same run.

    python launch/bench_decode.py                                  # GQA 32/8, head_dim 128, bf16
    python launch/bench_decode.py --batch 1 8 --cache-lens 4096 131072 --page-size 64

Per (batch, cached tokens): one query token per sequence over a full cache, ``--iters`` calls
back to back between two CUDA events (device time per call, the host running ahead), then the
same calls without events as wall time (host-bound where it exceeds the device time), and
``--graph`` replays of a CUDA graph of one call. Bandwidth = K and V bytes of the cache / device
time; the anchor is a copy of the same bytes (read + write, so 2x the bytes moved). ringflash
runs ``flash_attn_with_kvcache(..., check_bounds=False)`` (no host read), dense and, with
``--page-size``, paged (a page table in order, and a shuffled one: pages scattered over the
whole pool, the worst case for address translation); the baselines attend the same K/V with
``enable_gqa=True``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash


def back_to_back_us(f: Callable, iters: int) -> float:
    """Median over 5 rounds of device time per call, ``iters`` calls between two events."""
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            f()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def _wall_us(f: Callable, iters: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / iters


def graphed(f: Callable) -> Callable:
    """The replay of a CUDA graph of one call of f (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f()
    return graph.replay


def cases(args, batch: int, length: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (call, context to time it in): SDPA's backend is chosen around the timing, not
    inside the call (``sdpa_kernel`` itself costs host time that a model pays once)."""
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(batch, 1, args.heads, args.head_dim, device=dev, dtype=dt)
    k_cache = torch.randn(batch, length, args.kv_heads, args.head_dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.full((batch,), length, dtype=torch.int32, device=dev)
    found: dict[str, tuple[Callable, Callable]] = {
        "ringflash": (
            lambda: ringflash.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=lengths, check_bounds=False
            ),
            contextlib.nullcontext,
        ),
    }
    if args.page_size:
        pages = length // args.page_size
        page_shape = (batch * pages, args.page_size, args.kv_heads, args.head_dim)
        for order_name, order in (
            ("in order", torch.arange(batch * pages, device=dev)),
            ("shuffled", torch.randperm(batch * pages, device=dev)),
        ):
            table = order.view(batch, pages).to(torch.int32)
            k_pages = torch.empty(page_shape, device=dev, dtype=dt)
            v_pages = torch.empty_like(k_pages)
            k_pages[order] = k_cache.reshape(page_shape)
            v_pages[order] = v_cache.reshape(page_shape)

            def paged(k_pages=k_pages, v_pages=v_pages, table=table):
                return ringflash.flash_attn_with_kvcache(
                    q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, check_bounds=False
                )

            found[f"ringflash paged {args.page_size}, {order_name}"] = (paged, contextlib.nullcontext)
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    backends = (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION))
    for name, backend in backends:
        found[name] = (
            lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
            lambda backend=backend: sdpa_kernel(backend),
        )
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        found["flex"] = (lambda: flex(qt, kt, vt, enable_gqa=True), contextlib.nullcontext)
    except ImportError:
        pass
    copy_src = torch.empty(2 * k_cache.numel(), device=dev, dtype=dt)
    copy_dst = torch.empty_like(copy_src)
    found["copy (anchor)"] = (lambda: copy_dst.copy_(copy_src), contextlib.nullcontext)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--cache-lens", type=int, nargs="+", default=[4096, 16384, 131072, 1048576])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=0, help="also a paged cache of these pages")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--graph", action="store_true", help="also time CUDA-graph replays of one call")
    p.add_argument(
        "--max-gib", type=float, default=20.0,
        help="skip caches whose K/V exceed this (the run holds about five copies: dense, paged twice, copy)",
    )  # fmt: skip
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, bf16, one query token per sequence")  # fmt: skip
    print("| batch | cached tokens | entry | device us | TB/s of K/V | wall us per call | graph us |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        for length in args.cache_lens:
            nbytes = 2 * batch * length * args.kv_heads * args.head_dim * 2
            if nbytes / 2**30 > args.max_gib:
                continue
            for name, (f, context) in cases(args, batch, length).items():
                try:
                    with context():
                        f()
                        device = back_to_back_us(f, args.iters)
                        wall = _wall_us(f, args.iters)
                        graph = back_to_back_us(graphed(f), args.iters) if args.graph else float("nan")
                except Exception as e:  # a baseline that cannot run this shape
                    print(f"| {batch} | {length} | {name} | n/a ({type(e).__name__}) | | | |")
                    continue
                moved = 2 * nbytes if name.startswith("copy") else nbytes
                print(f"| {batch} | {length} | {name} | {device:.1f} | {moved / device / 1e6:.2f} | "
                      f"{wall:.1f} | {graph:.1f} |", flush=True)  # fmt: skip
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
