"""A block mask over the sequence-parallel ring: each layout's balance and speed, same run.

    torchrun --nproc_per_node 2 launch/bench_sp_block_mask.py     # the ring over NCCL, W GPUs
    python launch/bench_sp_block_mask.py --world 2                 # one GPU: every rank's steps in turn

bf16, one sequence of --tokens, --heads heads of --head-dim; workloads are bench_block_sparse.py's
``mask_mod``s. Layouts: contiguous, zigzag, and ``balanced_layout(mask, W)``. Columns:

- balance: the slowest rank's visible blocks over the mean (``layout_work``; 1.00 is even);
- steps: the sum over ring steps of the slowest rank's kernel time (fwd+bwd of its step view
  of the mask), each rank's step kernels timed on this GPU in turn (CUDA events, median of
  --reps): the ring's compute time if transfers hid behind it;
- ideal: one GPU's fwd+bwd over the whole mask / W, over "steps" (1.00: W GPUs split the work
  with nothing lost to imbalance or to smaller kernels);
- ring (torchrun only): ``sp_attn_func(..., sp_mode="ring", block_mask=)`` fwd+bwd wall time,
  the slowest rank's median over --reps, and per-GPU TFLOP/s counting visible pairs
  (3.5 x 4 x H x D x pairs / W).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as flex_attention
import triton
from bench_block_sparse import WORKLOADS, mask_mod_of  # launch/ is on the path: run as a script

import ringflash
from ringflash import TileMask
from ringflash.block_masks import ring_step_masks
from ringflash.kernels import attention_delta, build_problem
from ringflash.kernels.block_sparse import sparse_forward, sparse_gradients


def _median_ms(fn, reps: int) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _kernels_ms(q, k, v, dout, mask: TileMask, reps: int) -> float:
    """fwd+bwd of the block-sparse kernels of q over k/v under ``mask``."""
    problem = build_problem(q, k, v, None, False, (-1, -1))

    def run():
        out, lse = sparse_forward(q, k, v, mask, problem)
        sparse_gradients(dout, q, k, v, lse, attention_delta(out, dout, problem), mask, problem)

    return _median_ms(run, reps)


def _randn(shape):
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["llama4-8k", "prefix-lm", "bigbird", "random10"],
                   choices=WORKLOADS)  # fmt: skip
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--world", type=int, default=2, help="ranks to simulate on one GPU (without torchrun)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sp_block_mask.py needs a CUDA GPU")
    ring = "RANK" in os.environ
    if ring:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = args.world, 0
    s, h, d = args.tokens, args.heads, args.head_dim
    n = s // world
    torch.manual_seed(0)
    shard = [_randn((1, n, h, d)) for _ in range(4)]  # a rank's q, k, v, dout (timing only)
    full = [_randn((1, s, h, d)) for _ in range(4)]
    if rank == 0:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{datetime.date.today()}, bf16, {h} heads, head_dim {d}, {s} tokens over {world} ranks "
              f"({'the ring over NCCL' if ring else 'simulated on one GPU'})")  # fmt: skip
        print(
            "| workload | layout | visible blocks | balance | steps ms | ideal | ring ms | TFLOP/s per GPU |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        mask_mod = mask_mod_of(workload, s)
        tile_mask = TileMask.from_block_mask(
            flex_attention.create_block_mask(mask_mod, None, None, s, s, device="cuda")
        )
        flops = 3.5 * 4 * h * d * tile_mask.visible_pairs()
        one_gpu_ms = _kernels_ms(*full[:3], full[3], tile_mask, args.reps)
        layouts = {
            "contiguous": "contiguous",
            "zigzag": "zigzag",
            "balanced": ringflash.balanced_layout(tile_mask, world),
        }
        for name, layout in layouts.items():
            work = ringflash.layout_work(tile_mask, layout, world).sum(1).double()
            balance = (work.max() / work.mean()).item()
            step_ms = [[0.0] * world for _ in range(world)]
            for r in range(world):
                for i, view in enumerate(ring_step_masks(tile_mask, layout, r, world)):
                    if view is not None:
                        step_ms[r][i] = _kernels_ms(*shard[:3], shard[3], view, args.reps)
            steps = sum(max(step_ms[r][i] for r in range(world)) for i in range(world))
            ring_cell = "-"
            if ring:
                q, k, v, dout = (ringflash.shard_sequence(t, layout=layout) for t in full)
                q, k, v = (t.requires_grad_() for t in (q, k, v))

                def call(q=q, k=k, v=v, dout=dout, layout=layout, mask=tile_mask):
                    out = ringflash.sp_attn_func(q, k, v, layout=layout, sp_mode="ring", block_mask=mask)
                    torch.autograd.grad(out, (q, k, v), dout)

                dist.barrier()
                ms = torch.tensor(_median_ms(call, args.reps), device="cuda")
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                ring_cell = f"{ms.item():.2f} | {flops / world / ms.item() / 1e9:.0f}"
            if rank == 0:
                ring_cell = ring_cell if ring else "- | -"
                print(f"| {workload} | {name} | {tile_mask.density():.1%} | {balance:.2f} | {steps:.2f} | "
                      f"{one_gpu_ms / world / steps:.2f} | {ring_cell} |", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    if ring:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
