"""Long-context causal-LM training with DeepSpeed (ZeRO 0-3) or FSDP2, and sequence parallelism.

    torchrun --nproc_per_node 2 launch/train.py --model 1b --seq-len 131072 --sp-size 2 \\
        --config launch/ds_configs/zero2.json --activation-checkpointing --steps 20
    deepspeed --num_gpus 2 launch/train.py ...          # DeepSpeed's launcher works too
    torchrun --nproc_per_node 2 launch/train.py         # no GPUs: tiny model on the CPU
    torchrun --nproc_per_node 8 launch/train.py --engine fsdp2 --compile --sp-size 4 ...

--engine fsdp2 shards parameters over all D x S ranks with torch's fully_shard (each decoder
layer a unit; ringflash.integrations.fsdp sets the gradient scale) instead of DeepSpeed; it
takes the optimizer settings and gradient_clipping/gradient_accumulation_steps from the same
config, and saves no checkpoints. --compile compiles each decoder layer (torch.compile; the
attention runs as ringflash's opaque custom ops), with Inductor on GPUs and aot_eager on the CPU.

World = D x S ranks: sequence-parallel groups of --sp-size consecutive ranks, each training on
one sequence sharded over its ranks; D data-parallel replicas. --sp-impl ringflash runs the
model's attention through ringflash (--sp-mode auto | ring | ulysses | hybrid | allgather); --sp-impl
deepspeed-ulysses runs the same model, data and loss with DeepSpeed's own Ulysses
(UlyssesSPAttentionHF over PyTorch SDPA, contiguous shards) for comparison. --attention
infini replaces every attention layer with Infini-attention (segments of --segment-len tokens
plus a compressive memory, a new gate parameter per layer; contiguous shards of whole
segments). The loss is computed from the last hidden state in chunks (no full logits). Random
init and data follow --seed, so runs with different --sp-size start from the same model and
see the same sequences. --activation-checkpointing recomputes each decoder layer in the
backward; --activation-checkpointing keep-attention recomputes all but attention, whose outputs
torch's selective checkpointing keeps (ringflash.attention_checkpoint_context; SDPA's ops with
--sp-impl deepspeed-ulysses).

Prints a progress line per step (loss, recall loss/accuracy on the synthetic task, tokens/s,
peak memory) and, last, one JSON line {"summary": "train", ...} with tokens/s/GPU, MFU and peak
memory. --json writes the summary with the per-step history, --plot a loss curve (matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist

T_START = time.perf_counter()  # --time-limit counts from here
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
ON_GPU = torch.cuda.is_available() and torch.cuda.device_count() >= int(
    os.environ.get("LOCAL_WORLD_SIZE", WORLD)
)
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede importing ringflash

from train_data import make_dataset, sample_index  # noqa: E402
from train_fsdp import FSDP2Engine  # noqa: E402
from train_model import PRESETS, CausalLMLoss, build_model, flops_per_token, matmul_params  # noqa: E402

import ringflash  # noqa: E402
import ringflash.integrations.deepspeed as rf_ds  # noqa: E402
import ringflash.integrations.hf as rf_hf  # noqa: E402
import ringflash.integrations.hf_infini as rf_infini  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="deepspeed", choices=["deepspeed", "fsdp2"])
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument(
        "--compile-backend", default="inductor" if ON_GPU else "aot_eager", help="torch.compile backend"
    )
    p.add_argument("--config", default=os.path.join(HERE, "ds_configs", "zero2.json"), help="DeepSpeed JSON")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seq-len", type=int, default=65536 if ON_GPU else 256, help="tokens per sequence")
    p.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    p.add_argument("--sp-impl", default="ringflash", choices=["ringflash", "deepspeed-ulysses"])
    p.add_argument("--sp-mode", default="auto", choices=ringflash.SP_MODES)
    p.add_argument("--ulysses-size", type=int, default=None, help="Ulysses group size for --sp-mode hybrid")
    p.add_argument("--layout", default=None, choices=ringflash.LAYOUTS, help="default: zigzag")
    p.add_argument(
        "--attention", default="exact", choices=["exact", "infini"],
        help="exact attention, or Infini-attention (contiguous shards; --segment-len, --infini-update)",
    )  # fmt: skip
    p.add_argument("--segment-len", type=int, default=2048 if ON_GPU else 16, help="Infini-attention segment")
    p.add_argument("--infini-update", default="linear", choices=["linear", "delta"], help="memory update")
    p.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3], help="overrides the config")
    p.add_argument(
        "--activation-checkpointing", nargs="?", const="full", default=None,
        choices=["full", "keep-attention"],
        help="recompute each decoder layer in the backward; keep-attention: all but attention, whose outputs "
        "are kept (torch's selective checkpointing: ringflash.attention_checkpoint_context, or SDPA's ops "
        "with --sp-impl deepspeed-ulysses)",
    )  # fmt: skip
    p.add_argument("--dtype", default="bf16" if ON_GPU else "fp32", choices=["bf16", "fp32"])
    p.add_argument(
        "--steps", type=_steps, default=(False, 10),
        help="total optimizer steps (a resumed run continues), or +N: N more after the resumed step",
    )  # fmt: skip
    p.add_argument(
        "--time-limit", type=_seconds, default=None, metavar="SECONDS",
        help="stop after the step that passes SECONDS since the start; checkpoint and JSON as at --steps",
    )  # fmt: skip
    p.add_argument("--grad-accum", type=int, default=None, help="sequences per step and replica (config)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=0, help="linear LR warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "sgd"],
        help="sgd (no momentum): updates show grad scale",
    )
    p.add_argument("--grad-clip", type=float, default=None, help="overrides the config's gradient_clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="synthetic-recall", help="synthetic-recall, or a .npy/.bin token file")
    p.add_argument("--data-dtype", default="uint32", help="dtype of a .bin token file")
    p.add_argument("--keys", type=int, default=1, help="synthetic recall: keys planted per sequence")
    p.add_argument("--key-vocab", type=int, default=64, help="synthetic recall: distinct values of a key")
    p.add_argument(
        "--loss-on", default="all", choices=["all", "answer"], help="train on every token or the answers"
    )
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per lm_head + loss chunk")
    p.add_argument("--save-dir", default=None, help="save a DeepSpeed checkpoint here at the end")
    p.add_argument("--save-every", type=int, default=0, help="also every N steps")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from (its 'latest')")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU peak for MFU (H100/H200 bf16)")
    p.add_argument("--json", default=None, help="write summary + per-step history here")
    p.add_argument("--plot", default=None, help="write a loss-curve PNG here (needs matplotlib)")
    p.add_argument(
        "--profile", action="store_true",
        help="profile one extra step after the last (not timed) and print its top GPU kernels",
    )  # fmt: skip
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p.parse_args(argv)


def _steps(text: str) -> tuple[bool, int]:
    """--steps: (relative to the resumed step, count)."""
    n = int(text)  # "+150" parses as 150
    if n < 1:
        raise argparse.ArgumentTypeError(f"--steps must be a positive count or +N, got {text!r}")
    return text.startswith("+"), n


def _seconds(text: str) -> float:
    """--time-limit: seconds >= 0 (0: stop after the first step)."""
    t = float(text)
    if not t >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"--time-limit must be a number of seconds >= 0, got {text!r}")
    return t


def setup_distributed(engine: str) -> torch.device:
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)  # plain `python launch/train.py` is a world of one
    os.environ.setdefault("MASTER_PORT", "29512")
    if ON_GPU:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        ringflash.use_high_priority_comm()
        dist.init_process_group("nccl", device_id=device)
    else:
        # DeepSpeed's CPU backend would JIT-compile a shared-memory all-reduce used only for
        # inference. (The module, not `import deepspeed.comm.torch`: that name is torch itself.)
        if engine == "deepspeed":
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if ON_GPU else "gloo")
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return device


def load_config(args: argparse.Namespace) -> dict:
    with open(args.config) as f:
        config = json.load(f)
    config["train_micro_batch_size_per_gpu"] = 1  # one long sequence per sequence-parallel group
    config.pop("train_batch_size", None)  # DeepSpeed derives it from micro batch x accumulation x D
    config["zero_allow_untested_optimizer"] = True  # torch.optim.AdamW, no JIT-compiled DeepSpeed op
    config["bf16"] = {**config.get("bf16", {}), "enabled": args.dtype == "bf16"}
    config.setdefault("steps_per_print", 10**9)
    if args.grad_clip is not None:
        config["gradient_clipping"] = args.grad_clip
    if args.grad_accum is not None:
        config["gradient_accumulation_steps"] = args.grad_accum
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    return config


def kept_attention(args: argparse.Namespace):
    """The ``context_fn`` of --activation-checkpointing keep-attention: torch's selective
    checkpointing that keeps the attention ops' outputs (ringflash's, or SDPA's with
    --sp-impl deepspeed-ulysses, whose all-to-alls stay outside them and are recomputed)."""
    if args.attention == "infini":
        raise ValueError(
            "--activation-checkpointing keep-attention is for exact attention: use full with infini"
        )
    if args.sp_impl == "ringflash":
        return ringflash.attention_checkpoint_context
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    aten = torch.ops.aten
    sdpa = [
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
    ]
    return functools.partial(create_selective_checkpoint_contexts, sdpa)


def build(args: argparse.Namespace, device: torch.device, config: dict):
    """The engine, the sequence-parallel group, the data layout and the parameter counts."""
    sp = args.sp_size or dist.get_world_size()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.attention == "infini":
        ringflash_defaults = args.sp_impl == "ringflash" and args.sp_mode in ("auto", "ring")
        if not ringflash_defaults or args.layout not in (None, "contiguous"):
            raise ValueError(
                "--attention infini shards contiguously with ringflash: leave --sp-impl, --sp-mode and "
                "--layout at their defaults (or --layout contiguous)"
            )
        if args.seq_len % (sp * args.segment_len):
            raise ValueError(
                f"--attention infini needs each rank's {args.seq_len} / {sp} tokens to be whole segments: "
                f"make --seq-len a multiple of --sp-size x --segment-len = {sp * args.segment_len}"
            )
        mpu = rf_ds.sequence_parallel_mpu(sp)
        sp_group, layout, ulysses = mpu.groups.sp_group, "contiguous", 1
        attn = rf_infini.enable(args.segment_len, group=sp_group, update=args.infini_update)
        lm = build_model(args.model, args.seq_len, attn, dtype, device, args.seed)
        rf_infini.add_gates(lm)
    elif args.sp_impl == "ringflash":
        mpu = rf_ds.sequence_parallel_mpu(sp)
        sp_group, layout = mpu.groups.sp_group, args.layout or "zigzag"
        # Ulysses group size: 1 for auto, ring and allgather
        ulysses = {"ulysses": sp, "hybrid": args.ulysses_size or 1}.get(args.sp_mode, 1)
        attn = rf_hf.enable(
            group=sp_group, layout=layout, sp_mode=args.sp_mode, ulysses_size=args.ulysses_size
        )
        lm = build_model(args.model, args.seq_len, attn, dtype, device, args.seed)
    else:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        if args.engine != "deepspeed":
            raise ValueError("--sp-impl deepspeed-ulysses needs --engine deepspeed")
        if sp < 2:
            raise ValueError("--sp-impl deepspeed-ulysses needs --sp-size >= 2")
        lm = build_model(args.model, args.seq_len, "sdpa", dtype, device, args.seed)
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=lm, core_attn_implementation="sdpa", sequence_parallel_size=sp,
            micro_batch_size=1, seq_length_is_variable=True,
        )  # fmt: skip
        sp_group, layout, ulysses = mpu.get_sequence_parallel_group(), "contiguous", 1
    if args.activation_checkpointing:
        # Non-reentrant: each parameter then gets one gradient accumulation per backward, as ZeRO expects.
        kwargs = {"use_reentrant": False}
        if args.activation_checkpointing == "keep-attention":
            kwargs["context_fn"] = kept_attention(args)
        if hasattr(lm, "activation_checkpointing_enable"):  # newer transformers; the old name is deprecated
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    counts = {"params": sum(p.numel() for p in lm.parameters()), "matmul_params": matmul_params(lm)}
    flops = flops_per_token(lm, args.seq_len, args.segment_len if args.attention == "infini" else None)
    layers = lm.get_decoder().layers
    if args.compile:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend=args.compile_backend)
    model = CausalLMLoss(lm, sp_group, args.loss_chunk)

    def make_optimizer(params):
        if args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=args.lr, weight_decay=args.weight_decay)
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    warm = max(args.warmup, 1)
    make_scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))  # noqa: E731
    if args.engine == "fsdp2":
        engine = FSDP2Engine(
            model, layers, ringflash.sequence_parallel_groups(sp), make_optimizer, make_scheduler,
            accumulation=int(config.get("gradient_accumulation_steps", 1)),
            grad_clip=float(config.get("gradient_clipping", 0.0)),
        )  # fmt: skip
        return engine, sp_group, sp, layout, ulysses, counts, flops
    import deepspeed

    opt = make_optimizer(model.parameters())
    sched = make_scheduler(opt)
    if args.sp_impl == "ringflash":
        engine, *_ = rf_ds.initialize(model, config, sp, optimizer=opt, lr_scheduler=sched)
    else:
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=opt, config=config, mpu=mpu, lr_scheduler=sched
        )
    return engine, sp_group, sp, layout, ulysses, counts, flops


def train(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Run (or resume) training; returns the summary and the per-step history (all steps)."""
    if args.engine == "fsdp2" and (args.save_dir or args.resume):
        raise ValueError("--engine fsdp2 saves and resumes no checkpoints: drop --save-dir/--resume")
    device = setup_distributed(args.engine)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = load_config(args)
    engine, sp_group, sp, layout, ulysses, counts, flops = build(args, device, config)
    dp_size, dp_rank, accum = world // sp, rank // sp, engine.gradient_accumulation_steps()
    vocab = engine.module.lm.config.vocab_size
    data = make_dataset(args.data, args.seq_len, vocab, args.seed, args.data_dtype, args.keys, args.key_vocab)
    start, history = 0, []
    if args.resume:
        path, client = engine.load_checkpoint(args.resume)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in {args.resume}")
        start, history = client["step"], client["history"]
    relative, steps = args.steps
    args.steps = start + steps if relative else steps
    say = print if rank == 0 else (lambda *a, **k: None)
    infini = args.attention == "infini"
    infini_txt = f"infini/{args.infini_update} segment {args.segment_len}, " if infini else ""
    say(
        f"train: {args.model} ({counts['params'] / 1e6:.1f}M params), {world} ranks = {dp_size} DP x {sp} SP "
        f"({args.sp_impl}{'/' + args.sp_mode if args.sp_impl == 'ringflash' else ''}), seq {args.seq_len}, "
        f"{infini_txt}"
        f"{'FSDP2' if args.engine == 'fsdp2' else f'ZeRO-{engine.zero_optimization_stage()}'}"
        f"{' compiled' if args.compile else ''}, AC {args.activation_checkpointing or 'off'}, "
        f"{args.dtype}, {'GPU' if ON_GPU else 'CPU'}, steps {start}->{args.steps}",
        flush=True,
    )
    tokens_per_step = args.seq_len * dp_size * accum
    profiler = None
    for step in range(start, args.steps + int(args.profile)):
        if step == args.steps:  # the extra --profile step: not saved, not in the throughput
            profiler = torch.profiler.profile(activities=profile_activities())
            profiler.start()
        if ON_GPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = torch.zeros(4, device=device)  # loss, recall loss sum, recall correct, recall count
        for micro in range(accum):
            sample = data.sample(sample_index(step, micro, accum, dp_rank, dp_size))
            shard = ringflash.shard_batch(
                {"input_ids": sample.input_ids.to(device)}, sp_group, layout=layout, ulysses_size=ulysses
            )
            mask = ringflash.shard_sequence(
                sample.answer_mask.to(device), sp_group, dim=1, layout=layout, ulysses_size=ulysses
            )
            targets = (
                shard["target_ids"].masked_fill(~mask, -100)
                if args.loss_on == "answer"
                else shard["target_ids"]
            )
            loss, recall = engine(shard["input_ids"], shard["position_ids"], targets, mask)
            if args.engine == "fsdp2":
                engine.backward(loss)
            else:
                rf_ds.backward(engine, loss)
            engine.step()
            stats[0] += loss.detach().float() / accum
            stats[1:] += recall
        dist.all_reduce(stats)  # sums the loss over all ranks, recall counts over every shard
        if ON_GPU:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        # Peak memory and "out of time" by one MAX reduction: every rank stops after the same step.
        over = args.time_limit is not None and time.perf_counter() - T_START > args.time_limit
        peak_over = torch.tensor(
            [torch.cuda.max_memory_allocated() / 2**30 if ON_GPU else 0.0, float(over)], device=device
        )
        dist.all_reduce(peak_over, op=dist.ReduceOp.MAX)
        peak, out_of_time = peak_over.tolist()
        rec = {
            "step": step + 1, "seq_len": args.seq_len, "loss": stats[0].item() / world,
            "time_s": elapsed, "peak_gib": peak,
            "recall_loss": stats[1].item() / stats[3].item() if stats[3] > 0 else None,
            "recall_acc": stats[2].item() / stats[3].item() if stats[3] > 0 else None,
            "grad_norm": _float_or_none(engine.get_global_grad_norm()),
        }  # fmt: skip
        if profiler is not None:
            profiler.stop()
            say(kernel_table(profiler, elapsed), flush=True)
            break
        history.append(rec)
        tps = tokens_per_step / elapsed
        recall_txt = (
            f" | recall loss {rec['recall_loss']:.3f} acc {rec['recall_acc']:.2f}" if stats[3] > 0 else ""
        )
        say(
            f"step {step + 1}/{args.steps} | loss {rec['loss']:.4f}{recall_txt} | "
            f"{tps / 1e3:.1f}K tok/s ({tps / world / 1e3:.1f}K/GPU) | "
            f"{elapsed:.2f} s | peak {rec['peak_gib']:.1f} GiB",
            flush=True,
        )
        done = step + 1
        last = done == args.steps or out_of_time
        if args.save_dir and (last or (args.save_every and done % args.save_every == 0)):
            engine.save_checkpoint(
                args.save_dir, tag=f"step{done}", client_state={"step": done, "history": history}
            )
        if out_of_time and done < args.steps:
            say(f"train: --time-limit {args.time_limit:g} s reached after step {done}", flush=True)
            break
    return summarize(
        args, engine, world, sp, tokens_per_step, counts, flops, history[start:], history
    ), history


def profile_activities() -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    return acts + [torch.profiler.ProfilerActivity.CUDA] if ON_GPU else acts


def kernel_table(profiler, step_s: float, rows: int = 14) -> str:
    """This rank's device time per kernel over the profiled step, largest first, as text.
    Kernel names are cut to 70 characters; the share is of the step's wall time."""
    events = [e for e in profiler.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / 1e3
    lines = [f"profile: step {step_s * 1e3:.0f} ms wall, {total:.0f} ms device time in kernels (rank 0)"]
    for e in events[:rows]:
        ms = e.self_device_time_total / 1e3
        lines.append(f"  {ms:9.1f} ms {100 * ms / (step_s * 1e3):5.1f}%  x{e.count:<6d} {e.key[:70]}")
    return "\n".join(lines)


def _float_or_none(x) -> float | None:
    return None if x is None else float(x)


def summarize(args, engine, world, sp, tokens_per_step, counts, flops, run, history) -> dict:
    """The final summary; throughput over this run's steps after its first (compilation, warm-up)."""
    timed = run[1:] or run
    step_s = sum(r["time_s"] for r in timed) / max(len(timed), 1)
    tps = tokens_per_step / step_s if step_s else 0.0
    last = history[-1] if history else {}
    return {
        "summary": "train", "model": args.model, **counts, "seq_len": args.seq_len, "world": world,
        "sp_size": sp, "dp_size": world // sp, "sp_impl": args.sp_impl, "attention": args.attention,
        "segment_len": args.segment_len if args.attention == "infini" else None,
        "sp_mode": args.sp_mode if args.sp_impl == "ringflash" else "ulysses",
        "engine": args.engine, "compile": args.compile, "zero_stage": engine.zero_optimization_stage(),
        "activation_checkpointing": args.activation_checkpointing,
        "dtype": args.dtype, "device": torch.cuda.get_device_name() if ON_GPU else "cpu",
        "steps_run": len(run), "step_time_s": round(step_s, 4), "tokens_per_s": round(tps, 1),
        "tokens_per_s_per_gpu": round(tps / world, 1),
        "tflops_per_gpu": round(flops * tps / world / 1e12, 2),
        "mfu": round(flops * tps / world / (args.peak_tflops * 1e12), 4),
        "peak_mem_gib": round(max((r["peak_gib"] for r in run), default=0.0), 2),
        "first_loss": run[0]["loss"] if run else None, "final_loss": last.get("loss"),
        "final_recall_loss": last.get("recall_loss"), "final_recall_acc": last.get("recall_acc"),
    }  # fmt: skip


def plot(history: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path} (the --json history has the curve)", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["loss"] for r in history], label="loss (all trained tokens)")
    if any(r["recall_loss"] is not None for r in history):
        ax.plot(steps, [r["recall_loss"] for r in history], label="recall loss (answer tokens)")
        acc = [r["recall_acc"] for r in history]
        smooth = [sum(acc[max(0, i - 9) : i + 1]) / len(acc[max(0, i - 9) : i + 1]) for i in range(len(acc))]
        ax2 = ax.twinx()
        ax2.plot(steps, smooth, color="gray", label="recall accuracy (10-step mean)")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("recall accuracy (gray, 10-step mean)")
    for prev, r in zip(history, history[1:]):
        if r.get("seq_len") != prev.get("seq_len"):  # a resumed run at another length
            ax.axvline(r["step"], color="k", linestyle="--", alpha=0.4)
            ax.text(r["step"], ax.get_ylim()[1], f" seq {r['seq_len']}", va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(title)
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    summary, history = train(args)
    if dist.get_rank() == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**summary, "args": vars(args), "history": history}, f, indent=1)
        if args.plot:
            plot(
                history,
                args.plot,
                f"{args.model}, seq {args.seq_len}, SP {summary['sp_size']} ({summary['sp_impl']})",
            )
        print(json.dumps(summary), flush=True)
    gloo = dist.get_backend() == "gloo"
    dist.destroy_process_group()
    if gloo:
        # Gloo's worker threads (kept alive by DeepSpeed's references to its groups) may still be
        # releasing their last work, whose tensors Python owns: that takes the GIL, and a thread
        # that asks for it while the interpreter finalizes aborts the process ("terminate called
        # without an active exception"; pytorch/pytorch#190489; 2 in 14 loaded CPU runs of
        # tests/test_train.py, docs/experiments.md §84). Hand them the GIL before exiting.
        time.sleep(0.2)


if __name__ == "__main__":
    main()
