"""Single-GPU attention benchmark: ringflash's kernels beside torch SDPA (flash, cuDNN) and
FlexAttention, in the same run on the same inputs. ``ringflash-triton`` is ringflash with its
Hopper kernels switched off (RINGFLASH_FUSED_FORWARD=0, RINGFLASH_FUSED_BACKWARD=0): the Triton
forward, dK/dV and dQ kernels.

    python launch/bench_attention.py
    python launch/bench_attention.py --head-dims 128 --seqlens 16384 65536 --backends ringflash cudnn

bf16, B*S kept near --tokens (default 64K), 16 heads. TFLOP/s from attention FLOPs: fwd =
4*B*H*S^2*D (half when causal), fwd+bwd = 3.5x fwd; the backends take turns over --rounds rounds
(default 3) and each reports the median over rounds of triton.testing.do_bench medians. Peak
memory is one fwd+bwd's peak allocation above the inputs. Cells read fwd / bwd / fwd+bwd, where
bwd is 2.5x fwd FLOPs over (fwd+bwd time - fwd time). Each config first checks ringflash's
output against SDPA's flash backend (rel. error < 2e-2, else the row says FAIL).

``--softcaps 0 30`` adds rows with a logit softcap (Gemma-2's scores -> softcap * tanh(scores /
softcap)), ``--alibi both`` rows with ALiBi (the usual slopes 2^(-8 (h + 1) / heads)), for
ringflash and FlexAttention (a score_mod); SDPA has neither (n/a), so such a row compares with
the plain row of the same shape. Their check is against float32 eager attention on the first 1024
queries of the first sequence.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import statistics
import sys
from unittest import mock

import torch
import torch.nn.attention.flex_attention as _flex
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringflash

BACKENDS = ("ringflash", "ringflash-triton", "flash", "cudnn", "flex")


def alibi_slopes(h: int) -> torch.Tensor:
    return torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda", dtype=torch.float32)


def make_runner(
    name: str,
    b: int,
    s: int,
    h: int,
    d: int,
    causal: bool,
    hk: int,
    softcap: float = 0.0,
    alibi: bool = False,
):
    """(run, leaves): ``run()`` computes attention with backend ``name`` on fresh random
    inputs (h query heads, hk key/value heads, logits capped at ``softcap`` if non-zero, ALiBi
    with ``alibi``); ``leaves`` are the tensors to differentiate with respect to."""
    ours = name.startswith("ringflash")

    def randn(heads):  # SDPA/Flex take (B, H, S, D)
        shape = (b, s, heads, d) if ours else (b, heads, s, d)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = randn(h), randn(hk), randn(hk)
    gqa = hk != h
    slopes = alibi_slopes(h) if alibi else None
    if ours:
        run = lambda: ringflash.flash_attn_func(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes)  # noqa: E731
        return run, (q, k, v)
    if name in ("flash", "cudnn"):
        if softcap or alibi:
            raise ValueError("SDPA has no softcap or ALiBi")
        backend = SDPBackend.FLASH_ATTENTION if name == "flash" else SDPBackend.CUDNN_ATTENTION

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return run, (q, k, v)
    mask = _flex.create_block_mask(lambda b_, h_, i, j: i >= j, None, None, s, s) if causal else None
    score_mod = None
    if softcap or alibi:

        def score_mod(score, b_, h_, i, j):
            if softcap:
                score = softcap * torch.tanh(score / softcap)
            if alibi:
                score = score - slopes[h_] * (i - j).abs()
            return score

    flex = _compiled_flex()
    return (lambda: flex(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=gqa)), (q, k, v)


@functools.cache
def _compiled_flex():
    # One compiled function for all shapes; each shape is a recompile, so lift dynamo's limit
    # (past it, flex_attention silently falls back to an unfused, memory-hungry path).
    torch._dynamo.config.cache_size_limit = 256
    return torch.compile(_flex.flex_attention, dynamic=False)


def backend_env(name: str) -> dict[str, str]:
    """Environment a backend runs under: ``ringflash-triton`` switches the Hopper kernels off."""
    if name == "ringflash-triton":
        return {"RINGFLASH_FUSED_FORWARD": "0", "RINGFLASH_FUSED_BACKWARD": "0"}
    return {}


def _times(fn, leaves: tuple[torch.Tensor, ...], dout: torch.Tensor) -> tuple[float, float]:
    """Median ms of the forward and of forward + backward (triton.testing.do_bench)."""
    with torch.no_grad():
        t_fwd = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    t_all = triton.testing.do_bench(
        lambda: torch.autograd.grad(fn(), leaves, dout), warmup=25, rep=100, return_mode="median"
    )
    return t_fwd, t_all


def _peak_gib(fn, leaves: tuple[torch.Tensor, ...], dout: torch.Tensor) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(fn(), leaves, dout)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def measure_rounds(runners: dict, flops: float, rounds: int = 3) -> dict[str, dict | None]:
    """TFLOP/s and peak memory of each backend, ``runners`` mapping a name to (fn, leaves): fn()
    the forward, differentiated with respect to leaves, given the forward's FLOPs (backward =
    2.5x). The backends take turns, one timing each per round over ``rounds`` rounds, and the
    medians over rounds are reported: a slow stretch of the machine (clocks, the host) then
    touches every backend alike instead of the one that ran in it. A backend that raises is
    None (the shape is not one it runs)."""
    douts, samples = {}, {name: [] for name in runners}
    for _ in range(rounds):
        for name, (fn, leaves) in runners.items():
            if samples[name] is None:
                continue
            try:
                with mock.patch.dict(os.environ, backend_env(name)):
                    if name not in douts:
                        douts[name] = torch.randn_like(fn())
                    samples[name].append(_times(fn, leaves, douts[name]))
            except Exception as e:  # a backend that cannot run a shape shows n/a
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
                samples[name] = None
    results = {}
    for name, (fn, leaves) in runners.items():
        if samples[name] is None:
            results[name] = None
            continue
        t_fwd = statistics.median(t[0] for t in samples[name])
        t_all = statistics.median(t[1] for t in samples[name])
        with mock.patch.dict(os.environ, backend_env(name)):
            peak = _peak_gib(fn, leaves, douts[name])
        results[name] = {
            "fwd": flops / t_fwd / 1e9,
            "bwd": 2.5 * flops / (t_all - t_fwd) / 1e9,
            "fwd_bwd": 3.5 * flops / t_all / 1e9,
            "peak_gib": peak,
        }
    return results


def measure(fn, leaves: tuple[torch.Tensor, ...], flops: float) -> dict:
    """``measure_rounds`` of one function, one round."""
    return measure_rounds({"fn": (fn, leaves)}, flops, rounds=1)["fn"]


def check_scores(s: int, h: int, d: int, causal: bool, hk: int, softcap: float, alibi: bool) -> float:
    """Relative error of ringflash's output with a softcap and/or ALiBi against float32 eager
    attention, on the first 1024 queries of one sequence (scores scaled up so that a cap bites)."""
    q = torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) * (4 if softcap else 1)
    k, v = (torch.randn(1, s, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slopes = alibi_slopes(h) if alibi else None
    with torch.no_grad():
        ours = ringflash.flash_attn_func(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes)
        n = min(s, 1024)
        qf = q[0, :n].float().transpose(0, 1)
        kf, vf = (t[0].float().repeat_interleave(h // hk, dim=1).transpose(0, 1) for t in (k, v))
        scores = qf @ kf.transpose(1, 2) / d**0.5
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi:
            dist = (torch.arange(n, device="cuda")[:, None] - torch.arange(s, device="cuda")[None, :]).abs()
            scores = scores - slopes[:, None, None] * dist
        if causal:
            scores = scores.masked_fill(torch.ones(n, s, device="cuda", dtype=torch.bool).triu(1), -torch.inf)
        ref = (scores.softmax(-1) @ vf).transpose(0, 1)
    return ((ours[0, :n].float() - ref).norm() / ref.norm()).item()


def check_against_sdpa(
    b: int, s: int, h: int, d: int, causal: bool, hk: int, softcap: float = 0.0, alibi: bool = False
) -> float:
    if softcap or alibi:
        return check_scores(s, h, d, causal, hk, softcap, alibi)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        ours = ringflash.flash_attn_func(q, k, v, causal=causal).float()
        kr, vr = (t.repeat_interleave(h // hk, dim=2) for t in (k, v))  # GQA as repeated heads
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, kr, vr)), is_causal=causal)
    ref = ref.transpose(1, 2).float()
    return ((ours - ref).norm() / ref.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--tokens", type=int, default=65536, help="batch = max(1, tokens // seqlen)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA); default: --heads")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--softcaps", type=float, nargs="+", default=[0.0], help="logit softcaps, 0 = none")
    p.add_argument("--alibi", choices=["both", "yes", "no"], default="no", help="rows with ALiBi")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per config (medians)")
    p.add_argument("--quick", action="store_true", help="one small config, for a smoke test")
    p.add_argument("--json", help="write raw results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    if args.quick:
        args.head_dims, args.seqlens, args.causal = [128], [4096], "yes"
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    hk = args.kv_heads or args.heads
    rows = []
    alibis = {"both": [False, True], "yes": [True], "no": [False]}[args.alibi]
    configs = itertools.product(args.head_dims, causals, args.seqlens, args.softcaps, alibis)
    for d, causal, s, softcap, alibi in configs:
        b = max(1, args.tokens // s)
        row = {
            "S": s,
            "B": b,
            "D": d,
            "causal": causal,
            "softcap": softcap,
            "alibi": alibi,
            "err": check_against_sdpa(b, s, args.heads, d, causal, hk, softcap, alibi),
        }
        print(
            f"[{datetime.datetime.now():%H:%M:%S}] D={d} causal={causal} S={s} softcap={softcap} "
            f"alibi={alibi}",
            file=sys.stderr,
        )
        runners = {}
        for name in args.backends:
            try:
                runners[name] = make_runner(name, b, s, args.heads, d, causal, hk, softcap, alibi)
            except Exception as e:  # a backend without this shape's features shows n/a
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
                row[name] = None
        flops = 4 * b * args.heads * s * s * d * (0.5 if causal else 1.0)
        row.update(measure_rounds(runners, flops, args.rounds))
        del runners
        torch.cuda.empty_cache()
        rows.append(row)

    def cell(r):
        return "n/a" if r is None else f"{r['fwd']:.0f} / {r['bwd']:.0f} / {r['fwd_bwd']:.0f}"

    def peak(r):
        return "n/a" if r is None else f"{r['peak_gib']:.2f}"

    def ratio(row, other):
        a, o = row.get("ringflash"), row.get(other)
        return "n/a" if not a or not o else f"{a['fwd_bwd'] / o['fwd_bwd']:.2f}"

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}, bf16, {args.heads}/{hk} heads; TFLOP/s fwd / bwd / fwd+bwd")  # fmt: skip
    cols = ["S", "B", "D", "causal", "softcap", "ALiBi", *args.backends]
    cols += ["vs flash", "vs cuDNN", "peak GiB ours / flash", "check"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        cells = [row["S"], row["B"], row["D"], "yes" if row["causal"] else "no", f"{row['softcap']:g}"]
        cells += ["yes" if row["alibi"] else "no"]
        cells += [cell(row.get(n)) for n in args.backends]
        cells += [
            ratio(row, "flash"),
            ratio(row, "cudnn"),
            f"{peak(row.get('ringflash'))} / {peak(row.get('flash'))}",
        ]
        cells += [f"{'ok' if row['err'] < 2e-2 else 'FAIL'} {row['err']:.1e}"]
        print("| " + " | ".join(map(str, cells)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
