"""Tables from launch/train.py --json files: one row per run, and step-by-step comparisons.

python launch/train_report.py out/*.json                      # one row per run
python launch/train_report.py --compare out/c_sp1.json out/c_sp2.json
"""

from __future__ import annotations

import argparse
import json
import os


def _ac(value: object) -> str:
    """The summary's activation checkpointing: "full"/"keep-attention"/None, or a bool from
    runs before keep-attention existed."""
    return {True: "full", False: "off", None: "off"}.get(value, str(value))


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


COLUMNS = ["run", "impl", "seq", "SP", "ZeRO", "AC", "steps", "tok/s/GPU", "TFLOP/s/GPU", "MFU", "peak GiB"]


def table(paths: list[str]) -> None:
    """A markdown table of the runs' summaries (files that are not train.py JSON are skipped)."""
    print(_row([*COLUMNS, "loss first -> last", "recall acc"]))
    print(_row(["---"] * (len(COLUMNS) + 2)))
    for path in paths:
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError):
            continue
        if r.get("summary") != "train":
            continue
        print(
            _row(
                [
                    os.path.basename(path).removesuffix(".json"), f"{r['sp_impl']}/{r['sp_mode']}",
                    r["seq_len"], r["sp_size"], r["zero_stage"],
                    _ac(r["activation_checkpointing"]), r["steps_run"],
                    f"{r['tokens_per_s_per_gpu']:.0f}", f"{r['tflops_per_gpu']:.1f}",
                    f"{100 * r['mfu']:.1f}%", f"{r['peak_mem_gib']:.1f}",
                    f"{_fmt(r['first_loss'], '.4f')} -> {_fmt(r['final_loss'], '.4f')}",
                    _fmt(r["final_recall_acc"], ".2f"),
                ]
            )
        )  # fmt: skip


def compare(a_path: str, b_path: str) -> None:
    """Per-step loss and gradient norm of two runs (e.g. SP=1 vs SP=2, same seed), with the
    relative differences; the first step's loss depends only on init and data, later steps on the
    gradients the previous steps applied."""
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    sa, sb = f"SP={a['sp_size']}", f"SP={b['sp_size']}"
    print(
        _row(
            ["step", f"loss {sa}", f"loss {sb}", "rel diff", f"grad norm {sa}", f"grad norm {sb}", "rel diff"]
        )
    )
    print(_row(["---"] * 7))
    for ra, rb in zip(a["history"], b["history"]):
        ga, gb = ra.get("grad_norm"), rb.get("grad_norm")
        print(
            _row(
                [
                    ra["step"], f"{ra['loss']:.5f}", f"{rb['loss']:.5f}",
                    f"{abs(ra['loss'] - rb['loss']) / abs(ra['loss']):.1e}", _fmt(ga, ".5g"), _fmt(gb, ".5g"),
                    _fmt(abs(ga - gb) / abs(ga) if ga and gb else None, ".1e"),
                ]
            )
        )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", help="train.py --json files")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two runs to compare step by step")
    args = p.parse_args()
    if args.paths:
        table(args.paths)
    if args.compare:
        compare(*args.compare)


if __name__ == "__main__":
    main()
