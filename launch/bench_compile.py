"""Training-step time of a decoder compiled with torch.compile against the same model in eager
mode, on one GPU, in the same run: ringflash attention runs as opaque custom ops inside the
compiled blocks, and Inductor fuses the rest (norms, rotary, SwiGLU, residuals).

    python launch/bench_compile.py                       # 1B-shaped model, 16K tokens, bf16
    python launch/bench_compile.py --layers 4 --tokens 4096

Model: ringflash.ReferenceDecoder with Llama-3.2-1B's shape (dim 2048, 16 layers, 32 query and 8
K/V heads of 128, SwiGLU 8192, vocabulary 128256), random init, no downloads. A step is
zero_grad + forward + float32 cross-entropy + backward (no optimizer); each decoder block is
compiled on its own with fullgraph=True, as torchtitan does. Prints one row per mode (median
step ms over --iters after --warmup, peak memory, tokens/s) and a JSON line with both and their
ratio; the first losses of the two modes are checked to agree (bf16: rel. difference < 2e-2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from ringflash import ReferenceDecoder

SHAPE_1B = dict(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8)


def build(args: argparse.Namespace) -> ReferenceDecoder:
    torch.manual_seed(0)
    shape = {**SHAPE_1B, "layers": args.layers}
    with torch.device("cuda"):
        return ReferenceDecoder(**shape).to(torch.bfloat16)


def compile_blocks(model: ReferenceDecoder, mode: str | None) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True, mode=mode)


def time_steps(model: ReferenceDecoder, ids: torch.Tensor, warmup: int, iters: int) -> dict:
    """Median step time (ms), peak memory (GiB) and the first step's loss."""
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    times, first_loss = [], None
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        logits = model(ids, positions)
        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
        torch.cuda.synchronize()
        if first_loss is None:
            first_loss = loss.item()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return {
        "step_ms": statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_loss": first_loss,
    }


def run(args: argparse.Namespace) -> dict:
    """Eager then compiled (a fresh model with the same init each), on the same tokens."""
    ids = torch.randint(0, SHAPE_1B["vocab"], (1, args.tokens), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))  # fmt: skip
    results = {}
    for mode in ("eager", "compiled"):
        model = build(args)
        if mode == "compiled":
            compile_blocks(model, args.compile_mode)
        results[mode] = time_steps(model, ids, args.warmup, args.iters)
        del model
        torch.cuda.empty_cache()
    e, c = results["eager"]["first_loss"], results["compiled"]["first_loss"]
    if abs(e - c) > 2e-2 * abs(e):
        raise AssertionError(f"compiled loss {c} differs from eager {e}")
    return {
        "summary": "bench_compile", "device": torch.cuda.get_device_name(), "tokens": args.tokens,
        "layers": args.layers, "compile_mode": args.compile_mode, **{m: results[m] for m in results},
        "compiled_over_eager": results["compiled"]["step_ms"] / results["eager"]["step_ms"],
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="sequence length (batch 1)")
    p.add_argument("--layers", type=int, default=SHAPE_1B["layers"])
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the first compiles)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    summary = run(args)
    for mode in ("eager", "compiled"):
        r = summary[mode]
        print(f"{mode:9s} step {r['step_ms']:8.1f} ms | {args.tokens / r['step_ms'] * 1e3:9.0f} tok/s | "
              f"peak {r['peak_gib']:5.1f} GiB | first loss {r['first_loss']:.4f}")  # fmt: skip
    print(f"compiled / eager step time: {summary['compiled_over_eager']:.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
