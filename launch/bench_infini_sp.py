"""Sequence-parallel Infini-attention on several GPUs: per-GPU throughput of the sharded call
against the same tokens per GPU on one GPU alone, in the same run.

    torchrun --nproc_per_node 4 launch/bench_infini_sp.py
    torchrun --nproc_per_node 2 launch/bench_infini_sp.py --tokens-per-gpu 262144 --segments 4096

Each rank holds --tokens-per-gpu consecutive tokens (whole segments, ``layout="contiguous"``) of
one sequence of world x that length and runs ``infini_attention(..., group=WORLD)`` fwd+bwd; the
baseline is the same call without a group on each GPU's own tokens (no prefix sum, no relay: what
a GPU does alone), and the local attention over the same segments (the floor Infini-attention
adds its memory to). The linear rule's memory entering each rank is an exclusive prefix sum over
the group, overlapped with the local attention; the delta rule relays the memory rank to rank,
so its recurrences run one after another. Columns: ms (median of --iters, max over ranks),
Mtok/s per GPU, the sharded call's per-GPU throughput over the one-GPU call's, and over the local
attention's. bf16, batch 1, 8/8 heads of 128 by default.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os

import torch
import torch.distributed as dist
from bench_ring import peak_gib, timed

import ringflash
from ringflash.infini import segment_local_attention


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-gpu", type=int, default=1 << 20)
    p.add_argument("--segments", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--updates", nargs="+", default=["linear", "delta"], choices=["linear", "delta"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows here (rank 0)")
    return p.parse_args()


def infini_step(inputs, seg: int, update: str, group) -> None:
    q, k, v, beta, dout = inputs
    for t in (q, k, v, beta):
        t.grad = None  # a fresh gradient, as a training step's (no accumulate kernels)
    ringflash.infini_attention(q, k, v, beta, seg, group=group, update=update).backward(dout)


def local_step(inputs, seg: int) -> None:
    q, k, v, _, dout = inputs
    for t in (q, k, v):
        t.grad = None
    segment_local_attention(q, k, v, seg, None).backward(dout)


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    n, d = args.tokens_per_gpu, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(rank)  # this rank's tokens of the sequence
    shapes = [(1, n, h, d) for h in (args.heads, args.kv_heads, args.kv_heads)]
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g) for s in shapes)
    dout = torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16, generator=g)
    beta = torch.zeros(args.heads, device="cuda")
    inputs = (*(t.requires_grad_() for t in (q, k, v, beta)), dout)
    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"Infini-attention sequence parallel, {world} x {name}, {n} tokens per GPU, "
              f"{args.heads}/{args.kv_heads} heads x {d}, bf16, {datetime.date.today()}")  # fmt: skip
        print("| update | segment | sharded ms | one GPU ms | local ms | Mtok/s per GPU | vs one GPU "
              "| vs local | peak GiB |\n|---|---|---|---|---|---|---|---|---|", flush=True)  # fmt: skip
    rows = []
    for seg in args.segments:
        local_ms = 1e3 * timed(functools.partial(local_step, inputs, seg), args.iters)
        for update in args.updates:
            sharded = functools.partial(infini_step, inputs, seg, update, dist.group.WORLD)
            row = dict(
                update=update, segment=seg, sharded_ms=1e3 * timed(sharded, args.iters),
                one_gpu_ms=1e3 * timed(functools.partial(infini_step, inputs, seg, update, None), args.iters),
                local_ms=local_ms, peak_gib=peak_gib(sharded),
            )  # fmt: skip
            rows.append(row)
            if rank == 0:
                ms, alone = row["sharded_ms"], row["one_gpu_ms"]
                cells = [update, seg, f"{ms:.1f}", f"{alone:.1f}", f"{local_ms:.1f}", f"{n / ms / 1e3:.2f}",
                         f"{alone / ms:.2f}", f"{local_ms / ms:.2f}", f"{row['peak_gib']:.2f}"]  # fmt: skip
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {**vars(args), "world": world}, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
