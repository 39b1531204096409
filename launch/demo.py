"""Ring attention demo: shard a random long sequence, run ring attention forward and backward,
check it against single-device attention over the full sequence, print error and speed.

    torchrun --nproc_per_node 2 launch/demo.py            # GPUs (NCCL) if there are enough, else CPU
    torchrun --nproc_per_node 4 launch/demo.py --seqlen 65536 --layout stripe

On a machine without enough GPUs it runs on the CPU (gloo, Triton interpreter) at a small size.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
ON_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing ringflash

import ringflash  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=32768 if ON_GPU else 256, help="full sequence length")
    p.add_argument("--heads", type=int, default=16 if ON_GPU else 4)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer K/V heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128 if ON_GPU else 32)
    p.add_argument("--layout", default="zigzag", choices=ringflash.LAYOUTS)
    p.add_argument("--no-causal", action="store_true")
    args = p.parse_args()

    if ON_GPU:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, dtype, backend = torch.device("cuda", local_rank), torch.bfloat16, "nccl"
    else:
        device, dtype, backend = torch.device("cpu"), torch.float16, "gloo"
    ringflash.use_high_priority_comm()
    dist.init_process_group(backend, device_id=device if ON_GPU else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    causal = not args.no_causal
    kv_heads = args.kv_heads or args.heads

    # The same full sequence on every rank (same seed), then each rank keeps its shard.
    g = torch.Generator(device=device).manual_seed(0)
    full = [
        torch.randn(1, args.seqlen, h, args.head_dim, device=device, dtype=dtype, generator=g)
        for h in (args.heads, kv_heads, kv_heads, args.heads)
    ]
    q, k, v, dout = (ringflash.shard_sequence(t, layout=args.layout) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def ring_step():
        out = ringflash.ring_flash_attn_func(q, k, v, causal=causal, layout=args.layout)
        out.backward(dout)
        return out

    ring_step()  # warm-up (compiles the kernels)
    for t in (q, k, v):
        t.grad = None
    if ON_GPU:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    out = ring_step()
    if ON_GPU:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    # Single-device reference on the full sequence, with the same kernel.
    fq, fk, fv = (t.clone().requires_grad_() for t in full[:3])
    ref = ringflash.flash_attn_func(fq, fk, fv, causal=causal)
    ref.backward(full[3])
    errors = {}
    for name, got, exp in (
        ("out", out, ref),
        ("dq", q.grad, fq.grad),
        ("dk", k.grad, fk.grad),
        ("dv", v.grad, fv.grad),
    ):
        exp_shard = ringflash.shard_sequence(exp.detach(), layout=args.layout).float()
        errors[name] = ((got.float() - exp_shard).norm() / exp_shard.norm()).item()
    worst = torch.tensor(max(errors.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        flops = 4 * args.seqlen**2 * args.heads * args.head_dim * (0.5 if causal else 1.0) * 3.5
        where = torch.cuda.get_device_name() if ON_GPU else "CPU (Triton interpreter, gloo)"
        print(f"ringflash demo: {world} ranks on {where}, layout={args.layout}, causal={causal}")
        print(
            f"  sequence {args.seqlen} tokens, {args.heads} q heads / {kv_heads} kv heads, "
            f"head_dim {args.head_dim}"
        )
        print(
            "  relative error vs single-device attention: "
            + ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
        )
        print(
            f"  ring fwd+bwd: {elapsed * 1e3:.1f} ms, {flops / elapsed / world / 1e12:.2f} TFLOP/s per rank"
        )
        tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
        print("  OK: matches single-device attention" if worst.item() < tol else "  MISMATCH")
    dist.destroy_process_group()
    if worst.item() >= (2e-2 if dtype == torch.bfloat16 else 5e-3):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
