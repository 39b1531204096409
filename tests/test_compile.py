"""The attention kernels compile for Hopper (sm_90) on any machine, with the integer arguments
that Triton specializes at launch (a value of 1 becomes a compile-time constant).

The CPU tests run the kernels under the Triton interpreter, which never specializes, so a kernel
that is correct there can still fail to compile on a GPU (e.g. reassigning an argument that
arrived as the constant 1). Compiling for a GPU target needs no GPU: Triton ships ptxas. The
check runs in a subprocess because the test process imports the kernels in interpreter mode.
The same build also gives each tile config's shared memory, checked against the chip's limit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import triton

from ringflash.kernels.hopper_path import GLUON_TRITON

# Run once per kernel (argv[1]: a KERNELS key), so that pytest -n spreads the builds.
_SPECIALIZED = r"""
import itertools, sys
from ringflash.kernels.offline_compile import KERNELS, compile_kernel

# Integer arguments that can arrive as 1 (positions of a stripe, a one-token sequence).
ONES = ("q_start0", "q_stride", "k_start0", "k_stride", "q_per_len", "k_per_len", "seqlen_q", "seqlen_k")
OFF = dict(softcap_log2=None, ALIBI=None)

# Dense unmasked without softcap and ALiBi (whose arguments a launch then passes as None),
# and varlen with window bounds, 64-bit tile offsets, softcap and ALiBi: each with and without
# the specializations.
kernel = KERNELS[sys.argv[1]]
for ones, varlen in itertools.product(((), ONES), (False, True)):
    window = features = varlen
    compile_kernel(
        kernel,
        dict(GROUP=2, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, IS_VARLEN=varlen,
             HAS_LEFT=window, HAS_RIGHT=window, DOT_PRECISION="tf32", ACCUMULATE=varlen, WIDE=varlen,
             HAS_SOFTCAP=features, HAS_ALIBI=features, **({} if features else OFF)),
        ones,
    )
print("compiled")
"""

# Every bf16/fp16 GPU tile config of the table, as launched, must fit in an H100/H200's shared
# memory: otherwise only a GPU launch would tell. (The fp32 tiles compile to FMA code, up to 76 s
# each here; all 9 fit, 145 KiB at most, checked on 2026-11-23 with table_launch(fp32=True).)
_TABLE = r"""
import sys
from ringflash.kernels.offline_compile import (
    SHARED_MEMORY_LIMIT, compile_kernel, resource_usage, table_launch,
)

name = sys.argv[1]  # run once per kernel
for head_dim in (64, 128, 256):
    kernel, constexprs, cfg = table_launch(name, head_dim, causal=True)
    k = compile_kernel(kernel, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert k.metadata.shared <= SHARED_MEMORY_LIMIT[90], (name, head_dim, cfg, k.metadata.shared)
    if (name, head_dim) == ("forward", 64):
        use = resource_usage(k)  # ptxas -v, read back
        assert 0 < use.registers <= 255 and use.spill_bytes >= 0, use
    print(name, head_dim, cfg, k.metadata.shared)
print("fits")
"""


# The fused Hopper backward (kernels/hopper_backward.py) must keep building for sm_90: its TMA
# reduce-add comes from Triton's IR builder, not a public API. Compute warps at 240 registers and
# the two 1-warp workers at 24, one TMA reduce-add group per dQ tile, one tile loop (5 x 8 wgmma
# per warpgroup, causal or not) whose wgmma ptxas did not serialize, and at most an address or
# two reloaded from local memory per tile (GQA's per-head loop spills a few more at head changes).
# The softcap + ALiBi build spills at most 8 registers per tile (0-12 over the 16 variants on
# 2026-11-24; the worst before its logits were reordered: 37, at a 30% loss of backward speed).
_FUSED = r"""
import re
from ringflash.kernels.offline_compile import (
    SHARED_MEMORY_LIMIT, compile_fused_backward, disassemble, loop_spills, serialized_wgmma,
)

for causal, group, accumulate, softcap in (
    (False, 1, False, False), (True, 1, True, False), (True, 4, True, False), (False, 1, False, True)
):
    k = compile_fused_backward(causal, group, accumulate, softcap, alibi=softcap)
    ptx = k.asm["ptx"]
    regs = sorted(set(int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    assert regs == [24, 240], regs
    assert ptx.count("cp.async.bulk.commit_group") == 1, ptx.count("cp.async.bulk.commit_group")
    assert ptx.count("wgmma.mma_async") == 32, ptx.count("wgmma.mma_async")
    assert ("tanh.approx.f32" in ptx) == softcap
    sass = disassemble(k)
    assert not serialized_wgmma(sass), (causal, group, softcap)
    stores, loads = loop_spills(sass)
    most = 8 if softcap else 2 if group == 1 else 6
    assert stores <= most and loads <= most, (group, softcap, stores, loads)
    assert k.metadata.shared <= SHARED_MEMORY_LIMIT[90], k.metadata.shared
print("fused ok")
"""

# The warp-specialized Hopper forward (kernels/hopper_forward.py): both compute warpgroups at 240
# registers and the loader at 24, the products of both warpgroups' code paths (S and P V in the
# loop, S before it, P V after it: 4 x 8 wgmma per warpgroup), no spills inside the key-tile loop
# (at most one with softcap and ALiBi).
_FORWARD = r"""
import re
from ringflash.kernels.offline_compile import (
    SHARED_MEMORY_LIMIT, compile_fused_forward, disassemble, loop_spills, serialized_wgmma,
)

for causal, group, out_dtype, softcap in (
    (False, 1, "bf16", False), (True, 4, "fp32", False), (True, 4, "fp32", True)
):
    k = compile_fused_forward(causal, group, out_dtype, softcap, alibi=softcap)
    ptx = k.asm["ptx"]
    assert ("tanh.approx.f32" in ptx) == softcap
    regs = set(int(r) for r in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx))
    assert {24, 240} <= regs, regs
    assert ptx.count("wgmma.mma_async") == 64, ptx.count("wgmma.mma_async")
    sass = disassemble(k)
    assert not serialized_wgmma(sass), causal
    stores, loads = loop_spills(sass)
    assert stores <= softcap and loads <= softcap, (softcap, stores, loads)
    assert k.metadata.shared <= SHARED_MEMORY_LIMIT[90], k.metadata.shared
print("forward ok")
"""


def _compile_in_subprocess(script: str, tmp_path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    run = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=900
    )
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("this Triton install has no ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


KERNEL_NAMES = ["forward", "dkdv", "dq"]  # offline_compile.KERNELS, each built in its own test


def test_kernel_names_are_every_kernel():
    from ringflash.kernels.offline_compile import KERNELS

    assert sorted(KERNELS) == sorted(KERNEL_NAMES)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_kernels_compile_for_sm90_with_specialized_arguments(tmp_path, kernel):
    assert _compile_in_subprocess(_SPECIALIZED, tmp_path, kernel).strip().endswith("compiled")


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_table_configs_fit_sm90_shared_memory(tmp_path, kernel):
    out = _compile_in_subprocess(_TABLE, tmp_path, kernel)
    assert out.strip().endswith("fits")
    assert len(out.strip().splitlines()) == 3 + 1  # every head_dim ran


GLUON = pytest.mark.skipif(
    not triton.__version__.startswith(GLUON_TRITON),
    reason=f"the Gluon kernels are built with Triton {GLUON_TRITON}x only (kernels/hopper_path.py)",
)


@GLUON
def test_fused_backward_compiles_for_sm90(tmp_path):
    assert _compile_in_subprocess(_FUSED, tmp_path).strip().endswith("fused ok")


@GLUON
def test_fused_forward_compiles_for_sm90(tmp_path):
    assert _compile_in_subprocess(_FORWARD, tmp_path).strip().endswith("forward ok")


def test_tile_config_parse():
    from ringflash.kernels.configs import TileConfig

    assert TileConfig.parse("64,128,8,3") == TileConfig(64, 128, 8, 3)
    for bad in ("64,64,8", "64,64,8,2,3", "a,64,8,2", "48,64,8,2", "64,8,4,2", "64,64,6,2", "64,64,8,0"):
        with pytest.raises(ValueError):
            TileConfig.parse(bad)
