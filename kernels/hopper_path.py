"""When the Hopper Gluon kernels (hopper_forward.py, hopper_backward.py) run instead of Triton's.

Both serve the ring's common blocks at head_dim 128 on an H100/H200: whole sequences or
slices of them, unmasked or causal on a shard's own diagonal. Everything else, and every
machine without Gluon or an sm_90 GPU (the interpreter included), runs the Triton kernels.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch
import triton

from .configs import INTERPRET
from .problem import AttentionProblem

HEAD_DIM = 128  # the only head_dim both kernels are built for
TILE = 128  # both kernels' lengths must be multiples of this
# ALiBi's position differences go through float32 (in the forward via the exponent bits of
# 1.5 * 2^23): exact while |pq - pk| and every position stay below this.
ALIBI_POSITION_LIMIT = 2**22
# The Triton release the Gluon kernels are built and measured with: Gluon is experimental and
# changes between releases (under 3.8 the fused backward's build spills more), so any other
# release runs the Triton kernels.
GLUON_TRITON = "3.6."


@functools.cache
def hopper_module(name: str) -> ModuleType | None:
    """``ringflash.kernels.<name>`` imported on first use, or None where this Triton is not
    ``GLUON_TRITON`` or lacks the Gluon features it uses (Gluon cannot run under the interpreter
    anyway)."""
    if not triton.__version__.startswith(GLUON_TRITON):
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except (ImportError, AttributeError):
        return None


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def enabled(variable: str) -> bool:
    """False where the environment sets ``variable`` to 0 (the user's opt-out)."""
    return os.environ.get(variable, "1") != "0"


def hopper_path_ok(problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the problem is one the Hopper kernels compute: an sm_90 GPU, bf16/fp16, head_dim
    128, no varlen, no sliding window, causal only between blocks whose positions coincide (a
    shard's own diagonal block), both lengths non-zero multiples of 128, a softcap or none, ALiBi
    with positions and their differences below ``ALIBI_POSITION_LIMIT``, and q (batch, seqlen_q,
    heads_q, head_dim), k, v with heads packed in each token's row (``hopper_tma.tma_layout_ok``)."""
    if (
        INTERPRET
        or not q.is_cuda
        or problem.max_seqlen_q == 0
        or problem.max_seqlen_k == 0
        or q.dtype not in (torch.bfloat16, torch.float16)
        or problem.head_dim != HEAD_DIM
        or problem.varlen
        or problem.bounds.left is not None
        or problem.max_seqlen_q % TILE
        or problem.max_seqlen_k % TILE
    ):
        return False
    n = problem.max_seqlen_q
    qp, kp = problem.q_positions.resolved(n), problem.k_positions.resolved(problem.max_seqlen_k)
    if problem.bounds.right is not None:
        if problem.bounds.right != 0 or problem.max_seqlen_k != n or qp != kp or qp.stride != 1:
            return False
    if problem.alibi_slopes is not None:
        q_lo, q_hi = qp.start, qp.at(n - 1)
        k_lo, k_hi = kp.start, kp.at(problem.max_seqlen_k - 1)
        spans = (q_hi - k_lo, k_hi - q_lo, -q_lo, q_hi, -k_lo, k_hi)
        if max(abs(x) for x in spans) >= ALIBI_POSITION_LIMIT:
            return False
    if not _is_sm90(q.device):
        return False
    tma = hopper_module("hopper_tma")
    return tma is not None and all(tma.tma_layout_ok(t) for t in (q, k, v))
