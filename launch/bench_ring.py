"""Ring attention benchmark, side by side with PyTorch's context_parallel in the same run.

    torchrun --nproc_per_node 4 launch/bench_ring.py
    torchrun --nproc_per_node 2 launch/bench_ring.py --seqlens 32768 131072 --kv-heads 8 --plot ring.png

Per total sequence length it prints per-GPU TFLOP/s (forward, forward+backward; attention FLOPs
fwd = 4*B*H*S^2*D, half when causal, fwd+bwd = 3.5x fwd), the ring efficiency (ring per-GPU
fwd+bwd throughput over this kernel's single-GPU fwd+bwd throughput at min(S, 64K) tokens;
"eff (rank)": over its throughput at S / world tokens, the length each rank holds; one document),
the share of time left to exposed communication (1 - time of the same ring schedule with the
transfers removed / ring time) and peak memory per GPU; then the same for
torch.distributed.tensor.experimental.context_parallel with SDPA's cuDNN and flash backends.
Times are medians over --iters runs, max over ranks. bf16, B=1, causal unless --no-causal.
--modes adds Ulysses and hybrid (sp_attn_func) columns to the same run. --docs N packs N equal
documents into each sequence (attention stays inside each; FLOPs count only that work, and the
efficiency baseline is the single-GPU varlen kernel on documents of the same length); PyTorch's
context_parallel has no packed mode, so its columns are skipped then.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringflash
from ringflash.comm import PendingExchange, RingComm
from ringflash.kernels import build_problem
from ringflash.layouts import shard_multiple
from ringflash.ring import ring_backward, ring_forward, ring_plan


class _NoTransferComm(RingComm):
    """Same schedule, no transfers: isolates compute (+ merge) time to measure exposed comm."""

    def exchange(self, send, recv, offset=1):
        return PendingExchange([])


def timed(fn: Callable[[], object], iters: int) -> float:
    """Median seconds per call over ``iters`` calls, max over ranks."""
    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    t = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def peak_gib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    m = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device="cuda")
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return m.item()


def doc_lengths(args, S: int) -> list[int]:
    """--docs equal documents, or (--random-docs) --docs random lengths, multiples of what the
    layout needs (seeded: every rank and every mode gets the same)."""
    if not args.random_docs:
        return [S // args.docs] * args.docs
    m = shard_multiple(args.layout, dist.get_world_size())
    g = torch.Generator().manual_seed(S)
    cuts = sorted(torch.randperm(S // m - 1, generator=g)[: args.docs - 1].add(1).mul(m).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, S])]


def cu_seqlens(args, S: int) -> list[int] | None:
    """Cumulative lengths of the --docs documents (``doc_lengths``), or None for one sequence."""
    return None if args.docs == 1 else [0, *itertools.accumulate(doc_lengths(args, S))]


def bench_ringflash(args, S: int, flops: float) -> dict:
    world = dist.get_world_size()
    n = S // world
    mk = lambda h: torch.randn(1, n, h, args.head_dim, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(causal=not args.no_causal, layout=args.layout, cu_seqlens=cu_seqlens(args, S))

    def fwd():
        with torch.no_grad():
            ringflash.ring_flash_attn_func(q, k, v, **kw)

    def fwd_bwd():
        out = ringflash.ring_flash_attn_func(*leaves, **kw)
        torch.autograd.grad(out, leaves, dout)

    base = build_problem(q, k, v, None, kw["causal"], (-1, -1))
    local = _NoTransferComm()
    plan = ring_plan(base, args.layout, local, tuple(doc_lengths(args, S)), args.docs > 1, q.device)

    def compute_only():
        out, lse = ring_forward(q, k, v, plan, local)
        ring_backward(dout, q, k, v, out, lse, base, plan, local)

    r = {"fwd": flops / world / timed(fwd, args.iters) / 1e12}
    t_ring = timed(fwd_bwd, args.iters)
    r["fwd_bwd"] = 3.5 * flops / world / t_ring / 1e12
    r["exposed_comm"] = max(0.0, 1.0 - timed(compute_only, args.iters) / t_ring)
    r["peak_gib"] = peak_gib(fwd_bwd)
    return r


def bench_sp_mode(args, S: int, flops: float, mode: str) -> dict:
    """Ulysses ("ulysses"), hybrid ("hybrid:U") or all-gather ("allgather", "allgather:heads_k_stride")
    through sp_attn_func, on the same shapes."""
    world = dist.get_world_size()
    sp_mode, _, u = mode.partition(":")
    if sp_mode == "llama3":
        return bench_llama3(args, S, flops, int(u) if u else args.kv_heads)
    size = (
        dict(heads_k_stride=int(u) if u else None)
        if sp_mode == "allgather"
        else dict(ulysses_size=int(u) if u else None)
    )
    kw = dict(
        causal=not args.no_causal, layout=args.layout, sp_mode=sp_mode, cu_seqlens=cu_seqlens(args, S), **size
    )
    mk = lambda h: torch.randn(1, S // world, h, args.head_dim, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            ringflash.sp_attn_func(q, k, v, **kw)

    def fwd_bwd():
        torch.autograd.grad(ringflash.sp_attn_func(*leaves, **kw), leaves, dout)

    r = {"fwd": flops / world / timed(fwd, args.iters) / 1e12}
    r["fwd_bwd"] = 3.5 * flops / world / timed(fwd_bwd, args.iters) / 1e12
    r["peak_gib"] = peak_gib(fwd_bwd)
    return r


def bench_llama3(args, S: int, flops: float, heads_k_stride: int) -> dict:
    """ring-flash-attn's llama3 forms on the same documents: contiguous shards of the packed row."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = S // world
    cu = torch.tensor(cu_seqlens(args, S) or [0, S], dtype=torch.int32, device="cuda")
    params = ringflash.llama3_flash_attn_prepare_cu_seqlens(cu, not args.no_causal, rank, world)
    mk = lambda h: torch.randn(n, h, args.head_dim, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, dout = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    call = (
        lambda q, k, v: ringflash.llama3_flash_attn_varlen_func(  # noqa: E731
            q, k, v, *params[:4], heads_k_stride, params[4], causal=not args.no_causal
        )
    )

    def fwd():
        with torch.no_grad():
            call(q, k, v)

    def fwd_bwd():
        torch.autograd.grad(call(*leaves), leaves, dout)

    r = {"fwd": flops / world / timed(fwd, args.iters) / 1e12}
    r["fwd_bwd"] = 3.5 * flops / world / timed(fwd_bwd, args.iters) / 1e12
    r["peak_gib"] = peak_gib(fwd_bwd)
    return r


def single_gpu_fwd_bwd_tflops(args, S: int) -> float:
    """This kernel on one GPU: min(S, 64K) tokens, or (--docs) as many whole documents as fit
    in 64K tokens through the varlen kernel."""
    length = min(S, 65536) if args.docs == 1 else S // args.docs
    s = length * max(1, 65536 // length) if args.docs > 1 else length
    mk = lambda h: torch.randn(s, h, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads)
    dout = torch.randn_like(q)
    causal = not args.no_causal
    cu = torch.arange(0, s + 1, length, device="cuda", dtype=torch.int32)

    def fwd_bwd():
        if args.docs == 1:
            out = ringflash.flash_attn_func(q[None], k[None], v[None], causal=causal)[0]
        else:
            out = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, length, length, causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)

    flops = 4 * s * length * args.heads * args.head_dim * (0.5 if causal else 1.0)
    return 3.5 * flops / timed(fwd_bwd, args.iters) / 1e12


def bench_context_parallel(args, S: int, flops: float, backend: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    set_rotate_method(args.cp_rotate)
    sdpa_backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    # context_parallel shards these full (B, H, S, D) buffers in place on entry.
    mk = lambda h: torch.randn(1, h, S, args.head_dim, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads)
    dout = mk(args.heads)
    causal = not args.no_causal
    gqa = args.kv_heads != args.heads
    with (
        sdpa_kernel(sdpa_backend),
        context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]),
    ):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        def fwd_bwd():
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
            torch.autograd.grad(out, leaves, dout)

        r = {"fwd": flops / world / timed(fwd, args.iters) / 1e12}
        r["fwd_bwd"] = 3.5 * flops / world / timed(fwd_bwd, args.iters) / 1e12
        r["peak_gib"] = peak_gib(fwd_bwd)
    return r


def fmt(r: dict | None, key: str, spec: str = ".0f") -> str:
    return "n/a" if r is None or key not in r else format(r[key], spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072, 262144])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="zigzag", choices=ringflash.LAYOUTS)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--baselines", nargs="*", default=["cudnn", "flash"], choices=["cudnn", "flash"])
    p.add_argument(
        "--modes",
        nargs="*",
        default=[],
        help='extra ringflash modes: "ulysses", "hybrid:U", "allgather[:heads_k_stride]", "llama3[:stride]"',
    )
    p.add_argument("--cp-rotate", default="allgather", choices=["allgather", "alltoall"])
    p.add_argument("--docs", type=int, default=1, help="pack this many equal documents per sequence")
    p.add_argument("--random-docs", action="store_true", help="--docs documents of random lengths")
    p.add_argument(
        "--comm-priority", default="high", choices=["high", "default"],
        help="NCCL stream priority (high: ringflash.use_high_priority_comm; applies to the baselines too)",
    )  # fmt: skip
    p.add_argument("--json", help="write raw results here")
    p.add_argument("--plot", help="write a PNG of per-GPU fwd+bwd TFLOP/s against sequence length")
    args = p.parse_args()
    args.kv_heads = args.kv_heads or args.heads
    if args.docs > 1:
        args.baselines = []  # context_parallel cannot keep attention inside packed documents
    if not torch.cuda.is_available():
        sys.exit("bench_ring.py needs CUDA GPUs (one per rank); try launch/demo.py on a CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if args.comm_priority == "high":
        ringflash.use_high_priority_comm()
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)

    rows = []
    for S in args.seqlens:
        # Attention FLOPs inside each document: docs x 4 * L^2 * H * D (half when causal).
        lens = doc_lengths(args, S)
        flops = 4 * sum(n * n for n in lens) * args.heads * args.head_dim * (1.0 if args.no_causal else 0.5)
        row: dict = {"S": S}
        runs = [("ringflash", lambda S=S, f=flops: bench_ringflash(args, S, f))]
        for m in args.modes:
            runs.append((m, lambda S=S, f=flops, m=m: bench_sp_mode(args, S, f, m)))
        for b in args.baselines:
            runs.append((f"cp_{b}", lambda S=S, f=flops, b=b: bench_context_parallel(args, S, f, b)))
        for name, fn in runs:
            log(f"[{datetime.datetime.now():%H:%M:%S}] S={S} {name} ...")
            try:
                row[name] = fn()
            except Exception as e:  # a baseline that cannot run this shape shows n/a
                log(f"  {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                row[name] = None
            torch.cuda.empty_cache()
        if row["ringflash"] is not None and not args.random_docs:  # the baseline: equal documents
            single = single_gpu_fwd_bwd_tflops(args, S)
            row["single_gpu_fwd_bwd"] = single
            row["ringflash"]["efficiency"] = row["ringflash"]["fwd_bwd"] / single
            if args.docs == 1:  # the kernel at the length one rank holds
                row["single_gpu_fwd_bwd_rank"] = single = single_gpu_fwd_bwd_tflops(args, S // world)
                row["ringflash"]["efficiency_rank"] = row["ringflash"]["fwd_bwd"] / single
        rows.append(row)

    if rank == 0:
        kind = "random-length " if args.random_docs else ""
        print(
            f"\n{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, {datetime.date.today()}, "
            f"B=1, {args.docs} {kind}document(s), heads {args.heads}/{args.kv_heads}, "
            f"head_dim {args.head_dim}, "
            f"layout {args.layout}, NCCL priority {args.comm_priority} "
            f"(TORCH_NCCL_HIGH_PRIORITY={os.environ.get('TORCH_NCCL_HIGH_PRIORITY', 'unset')}), "
            f"causal={not args.no_causal}, bf16; per-GPU TFLOP/s fwd / fwd+bwd, median of {args.iters}"
        )
        cols = ["S", "ringflash", "eff", "eff (rank)", "exposed comm", "peak GiB"]
        for m in args.modes:
            cols += [m, f"peak GiB ({m})"]
        for b in args.baselines:
            cols += [f"CP {b}", f"peak GiB ({b})"]
        cols += ["ringflash/CP cudnn (fwd+bwd)"] if "cudnn" in args.baselines else []
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for row in rows:
            rf = row["ringflash"]
            cells = [str(row["S"]), f"{fmt(rf, 'fwd')} / {fmt(rf, 'fwd_bwd')}", fmt(rf, "efficiency", ".0%"),
                     fmt(rf, "efficiency_rank", ".0%"), fmt(rf, "exposed_comm", ".1%"),
                     fmt(rf, "peak_gib", ".1f")]  # fmt: skip
            for m in args.modes:
                cells += [f"{fmt(row[m], 'fwd')} / {fmt(row[m], 'fwd_bwd')}", fmt(row[m], "peak_gib", ".1f")]
            for b in args.baselines:
                cp = row[f"cp_{b}"]
                cells += [f"{fmt(cp, 'fwd')} / {fmt(cp, 'fwd_bwd')}", fmt(cp, "peak_gib", ".1f")]
            if "cudnn" in args.baselines:
                cp = row["cp_cudnn"]
                ok = rf is not None and cp is not None
                cells.append(f"{rf['fwd_bwd'] / cp['fwd_bwd']:.2f}x" if ok else "n/a")
            print("| " + " | ".join(cells) + " |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1
                )
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 4))
            for name in ["ringflash", *args.modes] + [f"cp_{b}" for b in args.baselines]:
                pts = [(r["S"], r[name]["fwd_bwd"]) for r in rows if r.get(name)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("total sequence length")
            ax.set_ylabel("fwd+bwd TFLOP/s per GPU")
            ax.set_title(
                f"{world}x {torch.cuda.get_device_name()}, causal, heads {args.heads}/{args.kv_heads}"
            )
            ax.legend()
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
