"""When the Hopper Gluon kernels (forward.py, backward.py; infini_retrieval.py and
infini_updates.py for Infini-attention's retrieval, its backward and the memory updates) run
instead of Triton's.

On an H100/H200 both take every mask the library accepts (any lengths, packed documents,
windows, a ring step's positions): the forward and the fused backward at head_dim 64, 128
and 256, and every multiple of 8 between those at the next larger build (``run_head_dim``).
Everything else, fp32, and every machine without Gluon or an sm_90 GPU
(the interpreter included), runs the Triton kernels. ``hopper_path_ok`` holds what every
Hopper kernel needs, each kernel's module what it adds.

A head_dim between two builds (Phi-3-mini's 96, Phi-2's 80, or 192) runs the next larger one on
the tensors as they are: TMA reads their tiles through (rows, heads, head_dim) descriptors the
build's width wide, filling the columns past head_dim with zeros (``tma.rows_descriptor``). A
zero column adds nothing to a score and gives zero columns of the output and of every gradient,
which the kernels do not store. The Triton kernels round head_dim up to the next power of two
inside their tiles (``configs.block_d``: the same 128 or 256), so the Hopper build does the same
arithmetic at its higher rate. Below the smallest build the Triton kernels run: 32 run at 64
would double the matrix work.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from types import ModuleType

import torch
import triton

from ..configs import INTERPRET, environment_value
from ..positions import TokenPositions
from ..problem import AttentionProblem

# Positions and window bounds go through int32 in the kernels: every sum of two stays in range
# (the backward's _visible_t adds up to four).
POSITION_LIMIT = 2**29
# ALiBi's position differences go through float32 (in the forward via the exponent bits of
# 1.5 * 2^23): exact while |pq - pk| and every position stay below this.
ALIBI_POSITION_LIMIT = 2**22
# The Triton releases whose builds of the Gluon kernels have run on an H100/H200 (the GPU tests
# and benchmarks, docs/performance.md). Gluon is experimental and changes between releases, so
# under any other release the Triton kernels run, even where the Gluon sources build (the CI
# builds them offline for sm_90 under the newest Triton too: tests/test_compile.py).
GLUON_VALIDATED = ("3.6.",)
# Set to 1 to run the Hopper kernels under a Triton release not in GLUON_VALIDATED: for the GPU
# run that validates a new release (`pytest -m gpu` and the benchmarks), not for production.
GLUON_UNVALIDATED_VARIABLE = "RINGFLASH_GLUON_UNVALIDATED"


def gluon_validated(version: str | None = None) -> bool:
    """Whether the Hopper (Gluon) kernels may run under Triton ``version`` (default: the
    installed one): a release in ``GLUON_VALIDATED``, or any with RINGFLASH_GLUON_UNVALIDATED=1."""
    version = triton.__version__ if version is None else version
    if environment_value(GLUON_UNVALIDATED_VARIABLE) == "1":
        return True
    return version.startswith(GLUON_VALIDATED)


@functools.cache
def hopper_module(name: str) -> ModuleType | None:
    """``ringflash.kernels.<name>`` imported on first use, or None where this Triton's Gluon
    builds have not been validated on a GPU (``gluon_validated``) or it lacks the Gluon features
    they use (Gluon cannot run under the interpreter anyway)."""
    if not gluon_validated():
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except (ImportError, AttributeError):
        return None


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def run_head_dim(head_dim: int, built: Iterable[int]) -> int | None:
    """The built head_dim a problem of ``head_dim`` runs at: itself where it is built, else the
    smallest build above it, when head_dim is above the smallest build and a multiple of 8
    (16-byte rows, as TMA needs). None: the Triton kernels run it."""
    built = sorted(built)
    if head_dim in built:
        return head_dim
    if head_dim % 8 or head_dim < built[0]:
        return None
    return next((d for d in built if d > head_dim), None)


def enabled(variable: str) -> bool:
    """False where the environment sets ``variable`` to 0 (the user's opt-out)."""
    return environment_value(variable) != "0"


def _position_extent(positions: TokenPositions, max_len: int) -> int:
    """A bound on |position| over blocks of up to ``max_len`` tokens."""
    return abs(positions.start) + (abs(positions.per_len) + positions.stride) * max_len


_HALVES = (torch.bfloat16, torch.float16)


def _positions_ok(problem: AttentionProblem) -> bool:
    """The problem's part of ``hopper_path_ok``: non-empty, positions and window bounds within
    ``POSITION_LIMIT`` (and ``ALIBI_POSITION_LIMIT`` with ALiBi)."""
    if problem.max_seqlen_q == 0 or problem.max_seqlen_k == 0:
        return False
    extents = (
        _position_extent(problem.q_positions, problem.max_seqlen_q),
        _position_extent(problem.k_positions, problem.max_seqlen_k),
        problem.bounds.left or 0,
        problem.bounds.right or 0,
    )
    if max(abs(x) for x in extents) >= POSITION_LIMIT:
        return False
    return problem.alibi_slopes is None or extents[0] + extents[1] < ALIBI_POSITION_LIMIT


def hopper_path_ok(problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the problem is one the Hopper kernels can take at all: an sm_90 GPU, bf16/fp16,
    non-empty, positions and window bounds below ``POSITION_LIMIT``, ALiBi with positions and
    their differences below ``ALIBI_POSITION_LIMIT``, and q/k/v (batch, seqlen, heads, head_dim)
    or packed (total, heads, head_dim) with heads packed in each token's row
    (``tma.tma_layout_ok``). Each kernel adds its own conditions (head dims, masks):
    ``forward.forward_supports``, ``backward.backward_supports``. The problem's part is decided
    once per problem (``AttentionProblem.derive``), the tensors' on every call."""
    if INTERPRET or not q.is_cuda or q.dtype not in _HALVES:
        return False
    if not problem.derive("hopper_positions", lambda: _positions_ok(problem)) or not _is_sm90(q.device):
        return False
    tma = hopper_module("tma")
    return tma is not None and tma.tma_layout_ok(q) and tma.tma_layout_ok(k) and tma.tma_layout_ok(v)


def uses_fused_forward(problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``attention_forward`` runs the warp-specialized Hopper kernel (forward.py)
    on these q (batch, seqlen_q, heads_q, head_dim) or packed (total, heads_q, head_dim) and k/v
    tensors: where ``dispatch.hopper_path_ok`` holds (sm_90, bf16/fp16, TMA-readable layouts),
    the head_dim is one it runs (64, 128, 256, and multiples of 8 between them at the next
    build; ``forward.forward_supports``) and
    ``RINGFLASH_FUSED_FORWARD`` is not 0 in the environment. Its results equal the Triton
    kernel's up to float rounding."""
    if not (enabled("RINGFLASH_FUSED_FORWARD") and hopper_path_ok(problem, q, k, v)):
        return False
    module = hopper_module("forward")
    return module is not None and problem.derive("forward_supports", lambda: module.forward_supports(problem))


def uses_fused_backward(problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``attention_backward`` computing dQ and dK/dV together runs the fused Hopper kernel
    (backward.py; at the 256 build with dq.py's dQ kernel beside it) on these q (batch, seqlen_q,
    heads_q, head_dim) and k/v tensors.

    It does where ``dispatch.hopper_path_ok`` holds (sm_90, bf16/fp16, TMA-readable layouts)
    and the kernel's own ``backward_supports`` (head_dim 64, 128 or 256, or a multiple of 8
    between them at the next build; any lengths, masks and packed documents), but not with
    ``RINGFLASH_FUSED_BACKWARD=0`` in the environment, nor, up to the 128 build, under
    ``torch.use_deterministic_algorithms(True)`` or ``deterministic=True`` (its dQ sums in a
    varying order; at 256 dQ is written once per row and dK/dV per program, deterministic)."""
    if not enabled("RINGFLASH_FUSED_BACKWARD") or not hopper_path_ok(problem, q, k, v):
        return False
    module = hopper_module("backward")
    if module is None or not problem.derive("backward_supports", lambda: module.backward_supports(problem)):
        return False
    if module.computes_dq(problem):
        return not (torch.are_deterministic_algorithms_enabled() or problem.deterministic)
    return hopper_module("dq") is not None


def uses_fused_updates_backward(
    problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: torch.Tensor
) -> bool:
    """Whether Infini-attention's local attention backward (``infini.local.local_backward``)
    adds the memory updates' backward (the delta rule's with its Gram terms) into its dK/dV
    inside the fused Hopper kernel
    (backward.py's MEMORY epilogue) instead of running ``memory_updates_backward`` first: the
    fused kernel runs (``uses_fused_backward``) at head_dim 128 over packed segments, dq a
    float32 buffer TMA writes, and ``RINGFLASH_HOPPER_INFINI`` is not 0 in the environment."""
    if not (problem.varlen and problem.head_dim == 128 and dq.dtype == torch.float32):
        return False
    if not enabled("RINGFLASH_HOPPER_INFINI") or not uses_fused_backward(problem, q, k, v):
        return False
    tma = hopper_module("tma")
    dq_ok = tma is not None and tma.tma_layout_ok(dq)
    return dq_ok and hopper_module("infini_updates") is not None


def uses_fused_retrieval_forward(
    problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:  # fmt: skip
    """Whether Infini-attention's local attention forward (``infini.local.local_forward``) runs
    the memory retrieval in the fused Hopper forward's epilogue (forward.py's MEMORY): the
    fused forward runs (``uses_fused_forward``) on packed segments of bf16 q, k, v at head_dim
    128, and ``RINGFLASH_HOPPER_INFINI`` is not 0 in the environment."""
    if not (problem.varlen and problem.head_dim == 128 and q.dtype == torch.bfloat16):
        return False
    if not enabled("RINGFLASH_HOPPER_INFINI") or not uses_fused_forward(problem, q, k, v):
        return False
    return hopper_module("infini_retrieval") is not None


def _infini_ok(*tensors: torch.Tensor) -> bool:
    """What the Infini-attention Hopper kernels need: an sm_90 GPU, bf16 (batch, seqlen, heads,
    128) tensors, and ``RINGFLASH_HOPPER_INFINI`` not 0 in the environment."""
    t0 = tensors[0]
    if INTERPRET or not t0.is_cuda or not enabled("RINGFLASH_HOPPER_INFINI"):
        return False
    shapes_ok = all(t.dtype == torch.bfloat16 and t.dim() == 4 and t.shape[-1] == 128 for t in tensors)
    return shapes_ok and _is_sm90(t0.device)


def uses_infini_retrieval_backward(q: torch.Tensor, dout: torch.Tensor) -> bool:
    """Whether Infini-attention's retrieval backward (``infini.retrieval.memory_retrieval_backward``
    with a local delta and float32 dq) runs the Hopper kernel (infini_retrieval.py): q and dout
    contiguous, of one shape, besides ``_infini_ok``. Deterministic, as the Triton kernel."""
    if not _infini_ok(q, dout) or dout.shape != q.shape:
        return False
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, dout)):
        return False
    return hopper_module("infini_retrieval") is not None


def uses_infini_retrieval(q: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether Infini-attention's retrieval (``infini.retrieval.memory_retrieval``) runs the
    Hopper kernel (infini_retrieval.py): q and local of one shape, in layouts TMA reads
    (``tma.tma_layout_ok``), besides ``_infini_ok``."""
    if not _infini_ok(q, local) or local.shape != q.shape:
        return False
    tma = hopper_module("tma")
    if tma is None or not (tma.tma_layout_ok(q) and tma.tma_layout_ok(local)):
        return False
    return hopper_module("infini_retrieval") is not None


def uses_infini_updates(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether Infini-attention's per-segment memory updates (``infini.memory.memory_updates``)
    run the Hopper kernel (infini_updates.py): k and v in layouts TMA reads
    (``tma.tma_layout_ok``), besides ``_infini_ok``. Deterministic, as the Triton kernel."""
    if not _infini_ok(k, v):
        return False
    tma = hopper_module("tma")
    if tma is None or not (tma.tma_layout_ok(k) and tma.tma_layout_ok(v)):
        return False
    return hopper_module("infini_updates") is not None
