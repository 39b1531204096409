"""Registers, spills and shared memory of the attention kernels on Hopper, with no GPU needed.

    python launch/kernel_report.py                          # the configs table, head_dim 64/128/256
    python launch/kernel_report.py --head-dims 128 --kernels dkdv --tiles 64,128,8,3 64,64,8,2
    python launch/kernel_report.py --softcap --alibi          # the same with both score features

Compiles each kernel for sm_90 as a launch would (bf16, causal, or fp32 with --fp32) and runs
ptxas -v on it. Use it before a GPU session to drop tile shapes that do not fit in shared
memory; spill counts alone do not rank tiles (docs/performance.md), so speed still needs the GPU
(launch/tune_attention.py). Run it without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    kernels = ["forward", "dkdv", "dq"]
    p.add_argument("--kernels", nargs="+", default=kernels, choices=kernels)
    p.add_argument("--causal", choices=["yes", "no"], default="yes")
    p.add_argument("--fp32", action="store_true", help="float32 inputs (slow to compile: FMA code)")
    p.add_argument("--gqa-group", type=int, default=1, help="query heads per KV head")
    p.add_argument("--softcap", action="store_true", help="kernels built with logit softcapping")
    p.add_argument("--alibi", action="store_true", help="kernels built with ALiBi biases")
    p.add_argument(
        "--tiles", nargs="+", default=None, metavar="M,N,WARPS,STAGES",
        help="tile configs to report instead of the table's (block_m,block_n,num_warps,num_stages)",
    )  # fmt: skip
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_report compiles for a GPU: unset TRITON_INTERPRET")
    from ringflash.kernels import offline_compile as oc
    from ringflash.kernels.configs import TileConfig
    from ringflash.kernels.problem import check_head_dim

    for head_dim in args.head_dims:
        try:
            check_head_dim(head_dim)
        except ValueError as e:
            p.error(f"--head-dims: {e}")
    if args.gqa_group < 1:
        p.error(f"--gqa-group must be >= 1, got {args.gqa_group}")
    try:
        tiles = [TileConfig.parse(t) for t in args.tiles] if args.tiles else None
    except ValueError as e:
        p.error(f"--tiles: {e}")
    limit = oc.SHARED_MEMORY_LIMIT[90]
    features = "".join((", softcap" if args.softcap else "", ", ALiBi" if args.alibi else ""))
    dtype = "fp32" if args.fp32 else "bf16"
    print(f"sm_90, {dtype}, causal={args.causal}, GQA group {args.gqa_group}{features}")
    print("| kernel | head_dim | block_m, block_n, warps, stages | registers | spill bytes | shared KiB |")
    print("|---|---|---|---|---|---|")
    for name in args.kernels:
        for head_dim in args.head_dims:
            kernel, constexprs, table_cfg = oc.table_launch(
                name, head_dim, args.causal == "yes", args.fp32, args.gqa_group, args.softcap, args.alibi
            )
            for cfg in tiles or [table_cfg]:
                constexprs.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
                compiled = oc.compile_kernel(
                    kernel, constexprs, dtype="fp32" if args.fp32 else "bf16",
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                )  # fmt: skip
                use = oc.resource_usage(compiled)
                fits = "" if use.shared_bytes <= limit else f" (over the {limit // 1024} KiB limit)"
                tile = f"{cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages}"
                print(
                    f"| {name} | {head_dim} | {tile} | {use.registers} | {use.spill_bytes} | "
                    f"{use.shared_bytes / 1024:.0f}{fits} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
