"""The attention kernels compile for Hopper (sm_90) on any machine, with the integer arguments
that Triton specializes at launch (a value of 1 becomes a compile-time constant).

The CPU tests run the kernels under the Triton interpreter, which never specializes, so a kernel
that is correct there can still fail to compile on a GPU (e.g. reassigning an argument that
arrived as the constant 1). Compiling for a GPU target needs no GPU: Triton ships ptxas. The
check runs in a subprocess because the test session imports the kernels in interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import itertools
import triton
from triton.backends.compiler import GPUTarget
from ringflash.kernels.backward import _dkdv_kernel, _dq_kernel
from ringflash.kernels.forward import _fwd_kernel

# Integer arguments that can arrive as 1 (positions of a stripe, a one-token sequence).
ONES = ("q_start0", "q_stride", "k_start0", "k_stride", "q_per_len", "k_per_len", "seqlen_q", "seqlen_k")
FP32_ARGS = {"qk_scale", "softmax_scale", "LSE", "DELTA"}


def compile_kernel(kernel, ones, **constexprs):
    sig, consts = {}, {}
    for name, param in zip(kernel.arg_names, kernel.params):
        if param.is_constexpr:
            consts[name] = constexprs[name]
        elif name in ones:  # what the launcher does with an int argument equal to 1
            sig[name], consts[name] = "constexpr", 1
        elif name.startswith("CU_"):
            sig[name] = "*i32"
        elif name[0].isupper():
            sig[name] = "*fp32" if name in FP32_ARGS else "*bf16"
        else:
            sig[name] = "fp32" if name in FP32_ARGS else "i32"
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})


# Dense unmasked, and varlen with window bounds and 64-bit tile offsets: each with and without
# the specializations.
KERNELS = (_fwd_kernel, _dkdv_kernel, _dq_kernel)
for kernel, ones, varlen in itertools.product(KERNELS, ((), ONES), (False, True)):
    window = varlen
    compile_kernel(
        kernel, ones, GROUP=2, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, IS_VARLEN=varlen,
        HAS_LEFT=window, HAS_RIGHT=window, DOT_PRECISION="tf32", ACCUMULATE=varlen,
        WIDE=varlen,
    )
print("compiled")
"""


def test_kernels_compile_for_sm90_with_specialized_arguments(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip("this Triton install has no ptxas")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("compiled")
