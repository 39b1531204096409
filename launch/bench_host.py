"""Host time per attention call: what a call costs when its kernels are too small to hide it.

    python launch/bench_host.py                                   # one GPU: single-device entries
    torchrun --nproc-per-node 2 launch/bench_host.py              # also ring, zigzag, Ulysses, all-gather
    python launch/bench_host.py --profile 200 --out /tmp/prof     # + a cProfile of each entry

A tiny problem (default B=1, S=128 per rank, H=1, D=64, causal, bf16) whose kernels take a few
microseconds: ``--calls`` calls run back to back with no synchronization, then one
synchronize; wall microseconds per call is then the host's cost per call (the GPU keeps up).
fwd: inputs without gradients; fwd+bwd: ``torch.autograd.backward(out, dout)`` per call.
Every entry runs beside SDPA's cuDNN backend on the same shapes (``F.scaled_dot_product_attention``
on (B, H, S, D) tensors; under torchrun SDPA runs on the local shard, the work of one rank's step).
Each entry takes the same values in its own layout, made once outside the timed calls (SDPA's
(B, H, S, D), the varlen entry's (B*S, H, D)): until 2026-11-29 SDPA and the varlen entry paid
four views per call (and four more autograd nodes per fwd+bwd) that ``flash_attn_func`` did not.
``--sync-check`` also counts the host synchronizations of one steady-state call of each entry
(``torch.cuda.set_sync_debug_mode``).

The entries take turns, one timing each per round (``--rounds``, medians over rounds); the
ratios to the first entry (SDPA cuDNN) are medians of ratios within a round.
``--ab-binding`` adds the single-device entries under ``RINGFLASH_TRITON_BINDING=1`` (Triton's
per-call binding) and ``=run`` (ringflash's launch key, the compiled kernel's ``run``), same run.
``--ab-backward`` adds them with autograd's backward as it was before ``attention_gradients``
(``attention_delta`` then ``attention_backward``: the general path, a dQ fill of its own).
``--ab-comm`` adds the sequence-parallel entries with the ring's exchange through
``dist.batch_isend_irecv`` instead of the process group's own send/recv (``comm.group_p2p``), and
without the ranks' argument check (``RINGFLASH_CHECK_RANKS=0``). The ring, all-gather and Ulysses
entries replay from the graphs ringflash captures itself (the default, ``graph_replay.py``);
``--ab-graphs`` adds them run eagerly (``RINGFLASH_RING_GRAPHS=0``). ``--ab-views`` adds
``flash_attn_func`` and the sequence-parallel entries on q/k/v that are transposed views of
(B, H, S, D) tensors, as the Hugging Face integration passes them.

``--floor`` adds ``replay_floor`` (``host_floor.py``): the single-device kernels replayed from graphs as
a sequence-parallel call replays them, the least host time any replayed sequence-parallel fwd+bwd
of these shapes can take; under torchrun also ``replay_floor[check]``, the same joining the ranks'
host check every call. The benchmark first checks that the floor gives ``flash_attn_func``'s
output bit for bit and its gradients to bf16's rounding.

``--event-pairs N`` times instead one call at a time between two CUDA events, the device idle
before it (synchronize, event, call, event, synchronize; median of N), as a layer's attention
runs when the host does not run ahead of the device: there the host time before the first
kernel adds to the device time. For realistic shapes, e.g.
``--event-pairs 50 --batch 16 --seqlen 4096 --heads 16 --head-dim 128``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import time
import warnings
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from host_floor import ReplayFloor, check_exact  # launch/, beside this script
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash
from ringflash import comm as ring_comm
from ringflash.kernels import attention_backward, attention_delta
from ringflash.kernels import ops as kernel_ops


def _sdpa(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def entries(args, group, sequence_parallel: bool) -> dict[str, tuple[Callable, Callable | None]]:
    """name -> (f(q, k, v) -> out, the layout f takes its tensors in: a map from contiguous
    (B, S, H, D) tensors, or None for those themselves); the sequence-parallel entries where
    ``sequence_parallel``. Each entry gets the same values in its
    own layout, made once outside the timed calls, as a model hands SDPA (B, H, S, D) and a packed batch's
    attention (total, H, D) without a view per call."""
    c = args.causal
    b, s = args.batch, args.seqlen
    found: dict[str, tuple[Callable, Callable | None]] = {
        "sdpa_cudnn": (lambda q, k, v: _sdpa(q, k, v, c), lambda t: t.transpose(1, 2).contiguous()),
        "flash_attn_func": (lambda q, k, v: ringflash.flash_attn_func(q, k, v, causal=c), None),
    }

    def varlen(q, k, v):
        cu = _cu_seqlens(b, s, q.device)
        return ringflash.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=c)

    found["flash_attn_varlen_func"] = (varlen, lambda t: t.reshape(b * s, *t.shape[2:]).contiguous())
    if args.floor:
        found["replay_floor"] = (ReplayFloor(c), None)
        if group is not None:
            found["replay_floor[check]"] = (ReplayFloor(c, group), None)
    if sequence_parallel:
        found["ring_flash_attn_func"] = (
            lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, causal=c, group=group), None
        )
        found["zigzag_ring_flash_attn_func"] = (
            lambda q, k, v: ringflash.zigzag_ring_flash_attn_func(q, k, v, causal=c, group=group), None
        )
        for mode in ("ulysses", "allgather"):
            found[f"sp_attn_func[{mode}]"] = (
                lambda q, k, v, m=mode: ringflash.sp_attn_func(q, k, v, causal=c, group=group, sp_mode=m),
                None,
            )
    return {n: f for n, f in found.items() if not args.entries or n in args.entries}


def _hf_views(t: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) as a view of a (B, H, S, D) tensor: what the Hugging Face integration hands the
    entry points (a model's q/k/v transposed back from its attention layout)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


_CU: dict = {}


def _cu_seqlens(batch: int, seqlen: int, device) -> torch.Tensor:
    """One cu_seqlens tensor per shape, made once, as a packed batch's is shared by every layer."""
    key = (batch, seqlen, device)
    if key not in _CU:
        _CU[key] = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    return _CU[key]


def _composed(dout, q, k, v, out, lse, problem, dlse=None):
    """Autograd's backward as it was before ``attention_gradients`` (``--ab-backward``)."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    return attention_backward(dout, q, k, v, lse, attention_delta(out, dout, problem, dlse), problem)


def _step(f, q, k, v, dout, backward: bool):
    out = f(q, k, v)
    if backward:
        torch.autograd.backward(out, dout)


def host_us(f, q, k, v, dout, backward: bool, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of wall µs per call over ``calls`` unsynchronized calls."""
    for _ in range(20):
        _step(f, q, k, v, dout, backward)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            _step(f, q, k, v, dout, backward)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def event_pair_us(f, q, k, v, dout, backward: bool, pairs: int) -> float:
    """Median µs between two CUDA events around one call, the device idle before each call."""
    for _ in range(5):
        _step(f, q, k, v, dout, backward)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(pairs):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start.record()
        _step(f, q, k, v, dout, backward)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def sync_count(f, q, k, v, dout, backward: bool) -> int:
    """Host synchronizations that torch sees in one steady-state call (after warm-up)."""
    _step(f, q, k, v, dout, backward)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(f, q, k, v, dout, backward)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def profile(f, q, k, v, dout, backward: bool, calls: int, lines: int) -> str:
    for _ in range(5):
        _step(f, q, k, v, dout, backward)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        _step(f, q, k, v, dout, backward)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


def device_trace(f, q, k, v, dout, backward: bool, calls: int) -> str:
    """torch.profiler's table of ``calls`` calls: each kernel's device time beside the host's."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(5):
        _step(f, q, k, v, dout, backward)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            _step(f, q, k, v, dout, backward)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60)


def extras(args, name: str, f, plain: tuple, grads: tuple, line: str, lead: bool) -> None:
    """Print an entry's line with its sync counts (``--sync-check``), then its ``--trace`` table
    and ``--profile`` output."""
    q, k, v = plain
    qg, kg, vg, dout = grads
    if args.sync_check:
        with torch.no_grad():
            sf = sync_count(f, q, k, v, None, False)
        line += f" {sf:4d} / {sync_count(f, qg, kg, vg, dout, True)}"
    if lead:
        print(line, flush=True)
    if args.trace and lead:
        with torch.no_grad():
            print(device_trace(f, q, k, v, None, False, args.trace))
    if args.profile:
        with torch.no_grad():
            text_fwd = profile(f, q, k, v, None, False, args.profile, 30)
        text = profile(f, qg, kg, vg, dout, True, args.profile, 45)
        if lead and args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "profiles.txt"), "a") as fh:
                fh.write(f"\n######## {name} ({args.profile} fwd calls)\n{text_fwd}")
                fh.write(f"\n######## {name} ({args.profile} fwd+bwd calls)\n{text}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=128, help="tokens per rank")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--entries", nargs="*", help="only these (names as printed)")
    p.add_argument("--sync-check", action="store_true")
    p.add_argument("--event-pairs", type=int, default=0, help="time this many single calls between events")
    p.add_argument("--profile", type=int, default=0, help="cProfile this many fwd, fwd+bwd calls per entry")
    p.add_argument(
        "--ab-binding", action="store_true",
        help="also run the single-device entries with RINGFLASH_TRITON_BINDING=1 and =run",
    )  # fmt: skip
    p.add_argument(
        "--ab-backward", action="store_true",
        help="also run the single-device entries with the backward as attention_delta + attention_backward",
    )  # fmt: skip
    p.add_argument(
        "--ab-comm", action="store_true",
        help="also run the sequence-parallel entries with the ring's exchange through batch_isend_irecv "
        "([batch_isend_irecv]) and without the ranks' check ([no check], RINGFLASH_CHECK_RANKS=0)",
    )  # fmt: skip
    p.add_argument(
        "--ab-graphs", action="store_true",
        help="also run the ring, all-gather and Ulysses entries eagerly, without ringflash's own graphs "
        "([eager], RINGFLASH_RING_GRAPHS=0)",
    )  # fmt: skip
    p.add_argument(
        "--ab-views", action="store_true",
        help="also run flash_attn_func and the sequence-parallel entries on q/k/v that are transposed views "
        "of (B, H, S, D) tensors, as the Hugging Face integration passes them ([views])",
    )  # fmt: skip
    p.add_argument(
        "--floor", action="store_true",
        help="also run replay_floor (and under torchrun replay_floor[check]): the host time under which no "
        "replayed sequence-parallel call can go (host_floor.py)",
    )  # fmt: skip
    p.add_argument("--out", help="folder for the profiles (appended to profiles.txt)")
    p.add_argument(
        "--trace", type=int, default=0, help="torch.profiler table of this many fwd calls per entry"
    )
    args = p.parse_args()

    group, shared_gpu = None, False
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        # Fewer GPUs than ranks: the ranks share GPU 0 over gloo, for the single-device entries and
        # the floor's check (what the ranks' hosts cost each other); no sequence-parallel entry.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        shared_gpu = torch.cuda.device_count() < local_world
        dist.init_process_group("gloo" if shared_gpu else "nccl")
        torch.cuda.set_device(0 if shared_gpu else int(os.environ["LOCAL_RANK"]))
        group = dist.group.WORLD
    lead = not dist.is_initialized() or dist.get_rank() == 0
    torch.manual_seed(0)
    b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    hk = args.kv_heads or h
    if group is not None and h % dist.get_world_size() == 0 and hk % dist.get_world_size() != 0:
        hk = h  # Ulysses needs the k/v heads to split too
    kw = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(b, s, n, d, **kw) for n in (h, hk, hk))
    dout = torch.randn_like(q)
    if lead:
        world = dist.get_world_size() if group is not None else 1
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, world {world}")
        shape = f"B={b} S={s}/rank H={h}/{hk} D={d} causal={args.causal} bf16"
        print(f"# {shape}, {args.calls} calls x {args.rounds}")
        if shared_gpu:
            print("# the ranks share one GPU over gloo: no sequence-parallel entry")
        print(
            f"{'entry':40s} {'fwd us':>8s} {'fwd+bwd us':>11s}"
            + (" syncs fwd/fwd+bwd" if args.sync_check else "")
        )
    if lead and args.event_pairs:
        print(f"# one call between two CUDA events, device idle before it: median µs of {args.event_pairs}")
    listed = entries(args, group, group is not None and not shared_gpu)
    found = {name: (f, contextlib.nullcontext, layout) for name, (f, layout) in listed.items()}
    composed = lambda: mock.patch.object(kernel_ops, "attention_gradients", _composed)  # noqa: E731
    for name in [n for n in ("flash_attn_func", "flash_attn_varlen_func") if n in found]:
        f, _, layout = found[name]
        if args.ab_binding:  # again under Triton's binding and compiled.run
            for mode in ("1", "run"):
                env = {"RINGFLASH_TRITON_BINDING": mode}
                context = lambda env=env: mock.patch.dict(os.environ, env)  # noqa: E731
                found[f"{name}[binding={mode}]"] = (f, context, layout)
        if args.ab_backward:
            found[f"{name}[delta+backward]"] = (f, composed, layout)
    if args.ab_comm:  # every rank runs the same entries in the same order: the check's setting agrees
        batch_p2p = lambda: mock.patch.object(ring_comm, "_GROUP_P2P", False)  # noqa: E731
        no_check = lambda: mock.patch.dict(os.environ, {"RINGFLASH_CHECK_RANKS": "0"})  # noqa: E731
        for name in [n for n in found if n.startswith(("ring_", "zigzag_", "sp_attn_func"))]:
            f, _, layout = found[name]
            if not name.startswith("sp_attn_func"):  # Ulysses and the all-gather make no ring exchange
                found[f"{name}[batch_isend_irecv]"] = (f, batch_p2p, layout)
            found[f"{name}[no check]"] = (f, no_check, layout)
    if args.ab_views:
        for name in [n for n in found if n.startswith(("flash_attn_func", "ring_", "zigzag_", "sp_attn_func"))
                     and "[" not in n]:  # fmt: skip
            found[f"{name}[views]"] = (found[name][0], contextlib.nullcontext, _hf_views)
    if args.ab_graphs:
        eager = lambda: mock.patch.dict(os.environ, {"RINGFLASH_RING_GRAPHS": "0"})  # noqa: E731
        sp = ("sp_attn_func[allgather]", "sp_attn_func[ulysses]")
        replaying = [n for n in found if n.startswith(("ring_", "zigzag_")) and "[" not in n or n in sp]
        for name in replaying:
            f, _, layout = found[name]
            found[f"{name}[eager]"] = (f, eager, layout)
    for name in [n for n in found if n.startswith("replay_floor")]:
        check_exact(found[name][0], q, k, v, dout)
    inputs = {}  # each entry's (q, k, v) and (q, k, v, dout) with gradients, in its layout
    for name, (_, _, layout) in found.items():
        native = (lambda t: t) if layout is None else layout
        inputs[name] = (
            tuple(native(t) for t in (q, k, v)),
            (*(native(t).detach().requires_grad_() for t in (q, k, v)), native(dout)),
        )
    # Rounds interleave the entries (each entry one timing per round, medians over rounds): a
    # slow stretch of the machine then touches every entry alike.
    samples = {name: [] for name in found}
    for _ in range(1 if args.event_pairs else args.rounds):
        for name, (f, context, _) in found.items():
            (pq, pk, pv), (gq, gk, gv, gdout) = inputs[name]
            with context():
                if args.event_pairs:
                    with torch.no_grad():
                        fwd = event_pair_us(f, pq, pk, pv, None, False, args.event_pairs)
                    both = event_pair_us(f, gq, gk, gv, gdout, True, args.event_pairs)
                else:
                    with torch.no_grad():
                        fwd = host_us(f, pq, pk, pv, None, False, args.calls, 1)
                    both = host_us(f, gq, gk, gv, gdout, True, args.calls, 1)
            samples[name].append((fwd, both))
    base = next(iter(found), None)  # SDPA cuDNN comes first unless --entries leaves it out
    for name, (f, context, _) in found.items():
        fwd = statistics.median(t[0] for t in samples[name])
        both = statistics.median(t[1] for t in samples[name])
        line = f"{name:40s} {fwd:8.1f} {both:11.1f}"
        # Ratios paired by round, their medians: a slow stretch of the host slows an entry and
        # the one it is compared with alike (the medians of each alone drift apart by 10-20%).
        paired = [(t[0] / b[0], t[1] / b[1]) for t, b in zip(samples[name], samples[base])]
        ratio_fwd, ratio_both = (statistics.median(r[i] for r in paired) for i in (0, 1))
        line += f"   {ratio_fwd:5.2f}x / {ratio_both:5.2f}x of {base}"
        with context():
            extras(args, name, f, *inputs[name], line, lead)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
