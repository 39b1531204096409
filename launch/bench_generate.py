"""Greedy generation with transformers on one GPU: ringflash attention beside SDPA, same model,
same prompt, same run. Decoding a small model is bound by the host's time per step, so this
is where attention's fixed cost per call shows.

    python launch/bench_generate.py                               # 1B-shaped Llama, 2K prompt
    python launch/bench_generate.py --prompt 32768 --new-tokens 64

Model: a randomly initialised LlamaForCausalLM of Llama-3.2-1B's shape (16 layers, 32 query and
8 K/V heads of 128; ``launch/train_model.py``'s "1b" preset), bf16, transformers' default
``DynamicCache`` (its keys grow by one token a step, so attention sees a new key length at
every call). Each implementation generates ``--new-tokens`` tokens after a ``--prompt``-token
prompt and, separately, one token: (the first's time - the second's) / (new tokens - 1) is a
decode step, the second's time the prefill. Medians over ``--repeats``. Implementations:
``sdpa`` (transformers' SDPA), ``ringflash`` (``ringflash.integrations.hf.enable()``), and
``ringflash-general`` (the same with ``RINGFLASH_SPLIT_KV_QUERIES=0``: decode steps on the
general path). Prints a row per implementation: how many leading greedy tokens equal the first
implementation's (random weights give near-uniform logits, where bf16 rounding flips an argmax)
and the largest logit difference over the steps whose inputs still agree, relative to the
largest logit. ``--profile ROWS`` adds torch.profiler's table of a 9-token generation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_model import build_model  # noqa: E402

from ringflash.integrations import hf  # noqa: E402
from ringflash.kernels import few_queries  # noqa: E402


def timed_generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, use_cache=True, pad_token_id=0,
    )  # fmt: skip
    torch.cuda.synchronize()
    return time.perf_counter() - start, out[0, ids.shape[1] :]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--prompt", type=int, nargs="+", default=[2048])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impls", nargs="+", default=["sdpa", "ringflash", "ringflash-general"])
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="also print the torch.profiler table (ROWS rows by CPU time) of 8 decode steps",
    )
    args = parser.parse_args()
    ringflash_name = hf.enable()
    names = {"sdpa": "sdpa", "ringflash": ringflash_name, "ringflash-general": ringflash_name}
    max_len = max(args.prompt) + args.new_tokens
    model = build_model(args.preset, max_len, "sdpa", torch.bfloat16, torch.device("cuda"), seed=0).eval()
    model.generation_config.use_cache = True
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, preset {args.preset}, "
          f"{args.new_tokens} new tokens", flush=True)  # fmt: skip
    for prompt in args.prompt:
        ids = torch.randint(0, model.config.vocab_size, (1, prompt), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(prompt))  # fmt: skip
        results, tokens, logits = {}, {}, {}
        for impl in args.impls:
            model.set_attn_implementation(names[impl])
            if impl == "ringflash-general":
                os.environ[few_queries.SWITCH] = "0"
            try:
                with torch.no_grad():
                    timed_generate(model, ids, 4)  # warm-up: compiles, plans
                    steps, prefills = [], []
                    for _ in range(args.repeats):
                        whole, generated = timed_generate(model, ids, args.new_tokens)
                        first, _ = timed_generate(model, ids, 1)
                        steps.append((whole - first) / (args.new_tokens - 1) * 1e3)
                        prefills.append(first * 1e3)
                    logits[impl] = model.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, min_new_tokens=9,
                        do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                    ).logits  # fmt: skip
                    if args.profile:
                        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                            timed_generate(model, ids, 9)
                        print(f"## {impl}, prompt {prompt}: generate 9 tokens (prefill, 8 decode steps)")
                        print(
                            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile)
                        )
            finally:
                os.environ.pop(few_queries.SWITCH, None)
            tokens[impl] = generated
            results[impl] = dict(step_ms=statistics.median(steps), prefill_ms=statistics.median(prefills))
        base = args.impls[0]
        for impl, r in results.items():
            agree = int((tokens[impl] == tokens[base]).cumprod(0).sum())
            # Logits of the steps whose inputs agree so far (the first decode step's always do).
            same = [logits[impl][i] - logits[base][i] for i in range(min(agree + 1, 9))]
            r["logit_diff"] = max(d.abs().max().item() for d in same) / logits[base][0].abs().max().item()
            speedup = results[base]["step_ms"] / r["step_ms"]
            print(f"prompt {prompt:7d}  {impl:18s} decode step {r['step_ms']:7.2f} ms  "
                  f"({1e3 / r['step_ms']:6.1f} tokens/s, {base}'s step / this {speedup:.3f})  prefill "
                  f"{r['prefill_ms']:8.1f} ms  leading tokens as {base}'s: {agree}/{args.new_tokens}, "
                  f"max |logit difference| / max |logit| over {len(same)} steps: {r['logit_diff']:.2e}",
                  flush=True)  # fmt: skip
        print(json.dumps({"prompt": prompt, "new_tokens": args.new_tokens, **results}), flush=True)


if __name__ == "__main__":
    main()
