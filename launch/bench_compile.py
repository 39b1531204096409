"""Training-step time of a decoder run eagerly, compiled with torch.compile, and captured whole in
a CUDA graph, in the same run: ringflash attention runs as opaque custom ops inside the compiled
blocks (Inductor fuses the rest: norms, rotary, SwiGLU, residuals) and as its eager kernels (and,
sequence parallel, its NCCL transfers) inside the captured graph.

    python launch/bench_compile.py                       # 1B-shaped model, 16K tokens, bf16
    python launch/bench_compile.py --layers 4 --tokens 4096
    python launch/bench_compile.py --tokens 2048 --modes eager graphed reduce-overhead
    torchrun --nproc_per_node 2 launch/bench_compile.py --tokens 8192 --modes eager graphed

Model: ringflash.ReferenceDecoder with Llama-3.2-1B's shape (dim 2048, 16 layers, 32 query and 8
K/V heads of 128, SwiGLU 8192, vocabulary 128256), random init, no downloads. A step is
zero_grad + forward + float32 cross-entropy + backward (no optimizer; sequence parallel, no
all-reduce of the gradients either: the same for every mode). Modes:

- ``eager``: the model as it is;
- ``compiled``: each decoder block compiled on its own with fullgraph=True, as torchtitan does,
  in ``--compile-mode`` (default: Inductor's default);
- ``reduce-overhead``: the same in mode="reduce-overhead" (Inductor's CUDA graphs per block),
  ``torch.compiler.cudagraph_mark_step_begin()`` before every step;
- ``graphed``: the eager model's whole step captured once with ``torch.cuda.graph`` (after
  warm-up steps on a side stream, PyTorch's recipe) and replayed; the gradients are rewritten by
  every replay.

Under torchrun with several processes the tokens are sharded with ``shard_batch`` (zigzag) and
every layer's attention is sequence parallel over the world (``--sp-mode``). Prints one row per
mode (median step ms over --iters after --warmup, peak memory, tokens/s per GPU) and a JSON line
with every mode and its step time over the first mode's. Every mode's first loss and the
gradients' norms after that step (all, and the first block's) must agree with the first mode's
(bf16: rel. difference < 2e-2).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringflash import ReferenceDecoder, SequenceParallelAttention, shard_batch

SHAPE_1B = dict(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8)
MODES = ("eager", "compiled", "reduce-overhead", "graphed")


def build(args: argparse.Namespace) -> ReferenceDecoder:
    torch.manual_seed(0)
    shape = {**SHAPE_1B, "layers": args.layers}
    attention = SequenceParallelAttention(sp_mode=args.sp_mode)
    with torch.device("cuda"):
        return ReferenceDecoder(**shape, attention=attention).to(torch.bfloat16)


def compile_blocks(model: ReferenceDecoder, mode: str | None) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True, mode=mode)


def batch(tokens: int) -> dict[str, torch.Tensor]:
    """This rank's input ids, positions and labels (the next token; the last has none)."""
    ids = torch.randint(0, SHAPE_1B["vocab"], (1, tokens), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))  # fmt: skip
    if dist.is_initialized():
        return shard_batch({"input_ids": ids})
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return {"input_ids": ids, "position_ids": torch.arange(tokens, device="cuda")[None], "target_ids": labels}


def step_fn(model: ReferenceDecoder, data: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        logits = model(data["input_ids"], data["position_ids"])
        loss = F.cross_entropy(logits[0].float(), data["target_ids"][0], ignore_index=-100)
        loss.backward()
        return loss.detach()

    return step


def captured(model: ReferenceDecoder, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The step captured in one CUDA graph: warm-up steps on a side stream, then the capture with
    the gradients unset, so that the graph allocates them and every replay rewrites them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()

    def replay() -> torch.Tensor:  # holds the graph (and its pool) while the mode runs
        graph.replay()
        return loss

    return replay


def _grad_norm(params) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params])).item()


def time_steps(run: Callable[[], torch.Tensor], zero_grad: Callable[[], None] | None, model: torch.nn.Module,
               warmup: int, iters: int) -> dict:  # fmt: skip
    """Median step time (ms), peak memory (GiB), and the first step's loss and gradient norm."""
    times, first = [], None
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if zero_grad is not None:
            zero_grad()
        loss = run()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        if first is None:
            first = {
                "first_loss": loss.item(),
                "first_grad_norm": _grad_norm(model.parameters()),
                # the first block's alone: attention's gradients weigh more in it than in the whole
                "first_block_grad_norm": _grad_norm(model.blocks[0].parameters()),
            }
    return {
        "step_ms": statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        **first,
    }


def run_mode(mode: str, args: argparse.Namespace, data: dict[str, torch.Tensor]) -> dict:
    model = build(args)
    if mode in ("compiled", "reduce-overhead"):
        compile_blocks(model, "reduce-overhead" if mode == "reduce-overhead" else args.compile_mode)
    step = step_fn(model, data)
    torch.cuda.reset_peak_memory_stats()
    if mode == "graphed":
        return time_steps(captured(model, step), None, model, args.warmup, args.iters)
    marks_steps = mode == "reduce-overhead"  # Inductor's graphs: a new step may overwrite their outputs

    def zero_grad() -> None:
        if marks_steps:
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)

    return time_steps(step, zero_grad, model, args.warmup, args.iters)


def run(args: argparse.Namespace) -> dict:
    """Every mode in turn, each on a fresh model with the same init, on the same tokens."""
    data = batch(args.tokens)
    results = {}
    for mode in args.modes:
        results[mode] = run_mode(mode, args, data)
        torch.cuda.empty_cache()
    base = results[args.modes[0]]
    for mode, r in results.items():
        for key in ("first_loss", "first_grad_norm", "first_block_grad_norm"):  # bf16: < 2e-2
            if not abs(r[key] - base[key]) <= 2e-2 * abs(base[key]):
                raise AssertionError(f"{mode}'s {key} {r[key]} differs from {args.modes[0]}'s {base[key]}")
        r["over_first"] = r["step_ms"] / base["step_ms"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {
        "summary": "bench_compile", "device": torch.cuda.get_device_name(), "world": world,
        "sp_mode": args.sp_mode if world > 1 else None, "tokens": args.tokens, "layers": args.layers,
        "compile_mode": args.compile_mode, **results,
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="sequence length over all ranks (batch 1)")
    p.add_argument("--layers", type=int, default=SHAPE_1B["layers"])
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the first compiles or captures)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--modes", nargs="+", choices=MODES, default=["eager", "compiled"],
                   help="the first is the baseline of the ratios")  # fmt: skip
    p.add_argument("--compile-mode", default=None, help="mode of 'compiled', e.g. max-autotune-no-cudagraphs")
    p.add_argument("--sp-mode", default=None, help="SequenceParallelAttention's sp_mode (torchrun; auto)")
    args = p.parse_args(argv)
    if len(set(args.modes)) != len(args.modes):
        p.error("--modes: each mode at most once")
    if args.tokens < 2 or args.layers < 1 or args.warmup < 0 or args.iters < 1:
        p.error("--tokens must be >= 2, --layers and --iters >= 1, --warmup >= 0")
    if args.compile_mode is not None and "compiled" not in args.modes:
        p.error("--compile-mode sets the 'compiled' mode's torch.compile mode: add compiled to --modes")
    if args.sp_mode is not None and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        p.error("--sp-mode needs several processes (torchrun --nproc_per_node N)")
    args.sp_mode = args.sp_mode or "auto"
    return args


def main() -> None:
    args = parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    summary = run(args)
    per_gpu = args.tokens / summary["world"]
    if not dist.is_initialized() or dist.get_rank() == 0:
        for mode in args.modes:
            r = summary[mode]
            print(f"{mode:15s} step {r['step_ms']:8.1f} ms | {per_gpu / r['step_ms'] * 1e3:9.0f} tok/s/GPU | "
                  f"peak {r['peak_gib']:5.1f} GiB | first loss {r['first_loss']:.4f} | "
                  f"{r['over_first']:.3f} of {args.modes[0]}")  # fmt: skip
        print(json.dumps(summary))
    if dist.is_initialized():
        # A CUDA graph that holds NCCL work blocks destroy_process_group (PyTorch #115388):
        # free Inductor's (reduce-overhead's cudagraph trees) and any other left first.
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.synchronize()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
