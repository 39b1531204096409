"""Ring attention demo: shard a random long sequence, run ring attention forward and backward,
and check out, dq, dk, dv against float64 attention computed in plain torch on the full sequence.

    torchrun --nproc_per_node 2 launch/demo.py            # GPUs (NCCL) if there are enough, else CPU
    torchrun --nproc_per_node 4 launch/demo.py --seqlen 65536 --layout stripe

On a machine without enough GPUs it runs on the CPU (gloo, Triton interpreter) at a small size.
A failure prints one line per rank and exits with status 1 (``--traceback`` shows the traceback).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
ON_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing ringflash


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of softmax(q kᵀ / sqrt(d)) v in float64, written out in plain torch.

    q, dout: (batch, seqlen, heads_q, head_dim); k, v: (batch, seqlen, heads_k, head_dim).
    Query rows go in chunks so that the score matrix of 32K tokens fits in memory.
    """
    group = q.shape[2] // k.shape[2]
    q, dout = (t.double().transpose(1, 2) for t in (q, dout))  # (batch, heads, seqlen, head_dim)
    k, v = (t.double().repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    seqlen, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    rows = max(1, 2**27 // (seqlen * q.shape[0] * q.shape[1]))
    for lo in range(0, seqlen, rows):
        qi, doi = q[:, :, lo : lo + rows], dout[:, :, lo : lo + rows]
        s = qi @ k.transpose(-1, -2) * scale
        if causal:
            query = torch.arange(lo, lo + qi.shape[2], device=q.device)[:, None]
            s.masked_fill_(torch.arange(seqlen, device=q.device)[None, :] > query, float("-inf"))
        p = torch.softmax(s, dim=-1)
        oi = p @ v
        dp = doi @ v.transpose(-1, -2)
        ds = p * (dp - (doi * oi).sum(-1, keepdim=True))
        out[:, :, lo : lo + rows] = oi
        dq[:, :, lo : lo + rows] = ds @ k * scale
        dk += ds.transpose(-1, -2) @ qi * scale
        dv += p.transpose(-1, -2) @ doi
    b, h, s_, d = dk.shape
    dk, dv = (t.view(b, h // group, group, s_, d).sum(2) for t in (dk, dv))  # GQA: sum over the group
    return tuple(t.transpose(1, 2) for t in (out, dq, dk, dv))


def say(*lines: str) -> None:
    if RANK == 0:
        print("\n".join(lines), flush=True)


def run(args: argparse.Namespace) -> None:
    if ON_GPU:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, dtype, backend = torch.device("cuda", local_rank), torch.bfloat16, "nccl"
        where = f"{torch.cuda.get_device_name()} GPUs (NCCL), bf16"
    else:
        device, dtype, backend = torch.device("cpu"), torch.float16, "gloo"
        where = "the CPU (gloo; the Triton kernels run in Triton's interpreter), fp16"
    causal = not args.no_causal
    kv_heads = args.kv_heads or args.heads
    say(
        f"ringflash demo: ring attention on {WORLD} ranks on {where}, layout={args.layout}, causal={causal}",
        f"  sequence {args.seqlen} tokens, {args.heads} q heads / {kv_heads} kv heads, "
        f"head_dim {args.head_dim}",
        "  ring forward+backward"
        + (" (twice: the first compiles the kernels)" if ON_GPU else " (the interpreter: tens of seconds)")
        + ", then float64 attention in plain torch to check it against ...",
    )
    import ringflash  # here, so that a broken install is reported like any other failure

    ringflash.use_high_priority_comm()
    dist.init_process_group(backend, device_id=device if ON_GPU else None)

    # The same full sequence on every rank (same seed), then each rank keeps its shard.
    g = torch.Generator(device=device).manual_seed(0)
    full = [
        torch.randn(1, args.seqlen, h, args.head_dim, device=device, dtype=dtype, generator=g)
        for h in (args.heads, kv_heads, kv_heads, args.heads)
    ]
    q, k, v, dout = (ringflash.shard_sequence(t, layout=args.layout) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def ring_step() -> torch.Tensor:
        out = ringflash.ring_flash_attn_func(q, k, v, causal=causal, layout=args.layout)
        out.backward(dout)
        return out

    for _ in range(2 if ON_GPU else 1):  # on a GPU, a warm-up compiles the kernels first
        for t in (q, k, v):
            t.grad = None
        if ON_GPU:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        out = ring_step()
        if ON_GPU:
            torch.cuda.synchronize()
    elapsed = torch.tensor(time.perf_counter() - t0, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)

    expected = reference_attention(*full, causal=causal)
    errors = {}
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), expected):
        exp_shard = ringflash.shard_sequence(exp, layout=args.layout)
        errors[name] = ((got.double() - exp_shard).norm() / exp_shard.norm()).item()
    worst = torch.tensor(max(errors.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    say("  relative error vs float64 attention: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    if ON_GPU:
        flops = 4 * args.seqlen**2 * args.heads * args.head_dim * (0.5 if causal else 1.0) * 3.5
        tflops = flops / elapsed.item() / WORLD / 1e12
        say(f"  ring fwd+bwd: {elapsed.item() * 1e3:.1f} ms, {tflops:.0f} TFLOP/s per GPU")
    else:
        say(f"  ring fwd+bwd: {elapsed.item():.1f} s (the interpreter; no speed to read here)")
    dist.destroy_process_group()
    if not worst.item() < tol:  # NaN fails too
        raise RuntimeError(
            f"the ring differs from float64 attention: worst relative error {worst.item():.1e} >= {tol:.0e}"
        )
    say(f"  OK: every rank's shard matches (relative error < {tol:.0e})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=32768 if ON_GPU else 256, help="full sequence length")
    p.add_argument("--heads", type=int, default=16 if ON_GPU else 4)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer K/V heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128 if ON_GPU else 32)
    p.add_argument("--layout", default="zigzag", help="zigzag, stripe or contiguous")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--traceback", action="store_true", help="on failure, show the traceback")
    args = p.parse_args()
    try:
        run(args)
    except Exception as e:  # one line per rank, not every rank's traceback interleaved
        if args.traceback:
            raise
        print(f"ringflash demo, rank {RANK}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
