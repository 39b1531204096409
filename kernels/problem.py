"""Validated description of one attention call, shared by the forward and backward launchers.

Checking happens here, once, so that bad input raises a ValueError/TypeError naming the
argument instead of failing deep inside Triton.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .configs import INTERPRET, MAX_TILE_ROWS
from .positions import MaskBounds, TokenPositions

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535  # CUDA's limit on grid dims y and z, where the kernels put heads and sequences


@dataclass(frozen=True)
class AttentionProblem:
    batch: int  # sequences (varlen: len(cu_seqlens) - 1)
    heads_q: int
    heads_k: int
    head_dim: int
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    bounds: MaskBounds
    q_positions: TokenPositions
    k_positions: TokenPositions
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    # scores -> softcap * tanh(scores / softcap) before the mask (Gemma-2); 0 = off.
    softcap: float = 0.0
    # ALiBi: float32 (batch, heads_q), score bias -slope * |pq - pk| in global token positions.
    alibi_slopes: torch.Tensor | None = None
    # Only kernels that sum in a fixed order (the caller asked for reproducible gradients).
    deterministic: bool = False
    # What the launchers derive from the problem alone (which kernels can run it, their grids
    # and constexprs), filled on first use: a problem built once per call signature
    # (plans.cached_problem, the ring's setups) then decides nothing twice. Not compared.
    derived: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def max_seqlens(self) -> tuple[int, int]:
        return self.max_seqlen_q, self.max_seqlen_k

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_k

    def position_args(self) -> tuple[int, int, int, int, int, int]:
        """(q start, q stride, k start, k stride, q per_len, k per_len) as the kernels take them."""
        qp, kp = self.q_positions, self.k_positions
        return qp.start, qp.stride, kp.start, kp.stride, qp.per_len, kp.per_len

    def derive(self, key: object, compute) -> object:
        """``compute()`` (never None), remembered under ``key`` (which must name everything
        besides the problem that the value depends on) for this problem's later calls."""
        found = self.derived.get(key)
        if found is None:
            found = self.derived[key] = compute()
        return found

    def lse_shape(self, total_q: int) -> tuple[int, ...]:
        if self.varlen:
            return (self.heads_q, total_q)
        return (self.batch, self.heads_q, self.max_seqlen_q)


def _check_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        layout = "(batch, seqlen, heads, head_dim)" if ndim == 4 else "(total_tokens, heads, head_dim)"
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last (head_dim) dimension, got strides {t.stride()}")
    if INTERPRET and t.dtype == torch.bfloat16:
        raise TypeError(
            f"{name} is bfloat16, which the Triton interpreter (TRITON_INTERPRET=1) computes wrongly; "
            "use float16 or float32 on the CPU, bfloat16 on a GPU"
        )
    if t.device.type == "cpu" and not INTERPRET:
        raise ValueError(
            f"{name} is on the CPU: the Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 "
            "set before ringflash is imported to run them (slowly) on the CPU"
        )
    return t


def check_token_stride(**tensors: torch.Tensor | None) -> None:
    """Rows inside a tile are addressed with 32-bit offsets from the tile's first row (whose own
    offset is 64-bit where a sequence needs it, see ``wide_offsets``), so a token stride times
    the largest tile (``MAX_TILE_ROWS``) must stay below 2^31 elements: below 16M elements per
    token, far beyond any (heads x head_dim)."""
    for name, t in tensors.items():
        if t is not None and MAX_TILE_ROWS * t.stride(-3) + t.shape[-1] > 2**31 - 1:
            raise ValueError(
                f"{name}: a token stride of {t.stride(-3)} elements is too large for the kernels' "
                f"32-bit offsets inside a tile (at most {(2**31 - 1 - t.shape[-1]) // MAX_TILE_ROWS}); "
                "pass a contiguous tensor"
            )


def wide_offsets(seqlen: int, *tensors: torch.Tensor | None) -> bool:
    """Whether a sequence's last row lies 2^31 or more elements past its first in one of the
    tensors (None ones are skipped), e.g. past 524288 tokens of 32 heads x 128 in the (batch,
    seqlen, heads, head_dim) layout. The kernels then compile a variant with 64-bit tile offsets
    (``tiling.row_pointers``)."""
    return seqlen > 0 and any(
        (seqlen - 1) * t.stride(-3) + t.shape[-1] > 2**31 - 1 for t in tensors if t is not None
    )


def check_window(causal: object, window_size: object) -> tuple[bool, tuple[int, int]]:
    """(causal, (left, right)) checked as flash-attn takes them: causal a bool, window_size a
    pair of ints >= -1 (-1: unbounded on that side).

    Raises:
        TypeError: causal is not a bool, or window_size is not a pair of ints.
        ValueError: an entry of window_size is below -1.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if any(w < -1 for w in window_size):
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}")
    return causal, (int(window_size[0]), int(window_size[1]))


def check_head_dim(head_dim: int) -> None:
    """The head dimensions the kernels take: multiples of 8 (16-byte rows) up to MAX_HEAD_DIM."""
    if head_dim % 8 != 0 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")


def resolve_scale(softmax_scale: object, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale}")
    return float(softmax_scale)


def check_softcap(softcap: object) -> float:
    """flash-attn's ``softcap``: 0 (off) or a positive finite float."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0 = off), got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be 0.0 (off) or a positive finite float, got {softcap}")
    return float(softcap)


def check_alibi_slopes(
    alibi_slopes: object, batch: int, heads_q: int, device: torch.device
) -> torch.Tensor | None:
    """flash-attn's ``alibi_slopes``: None, or float32 (heads_q,) or (batch, heads_q) on q's
    device; returned as a contiguous float32 (batch, heads_q) tensor."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32 (as in flash-attn), got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(
            f"alibi_slopes must have shape ({heads_q},) or ({batch}, {heads_q}) (heads_q or batch x "
            f"heads_q), got {tuple(alibi_slopes.shape)}"
        )
    return alibi_slopes.expand(batch, heads_q).contiguous()


def _check_cu_seqlens(
    name: str, cu: object, device: torch.device, total: int
) -> tuple[torch.Tensor, tuple[int, ...]]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        raise TypeError(f"{name} must be a 1-D torch.int32 tensor of cumulative lengths")
    if cu.numel() < 2:
        raise ValueError(f"{name} needs at least 2 entries (0 and the total length)")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    host = cu_seqlens_host(cu)
    if host[0] != 0 or any(b < a for a, b in zip(host, host[1:])) or host[-1] != total:
        raise ValueError(f"{name} must start at 0, never decrease and end at {total}, got {list(host)}")
    return cu.contiguous(), host


# cu_seqlens tensor id -> (weak reference, version counter, values on the host).
_HOST_COPIES: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}


def _remember(cu: torch.Tensor, values: tuple[int, ...]) -> None:
    if cu.is_inference():  # no version counter to tell an in-place write: read on every call
        return
    key = id(cu)

    def forget(ref: weakref.ref) -> None:
        if _HOST_COPIES.get(key, (None,))[0] is ref:
            del _HOST_COPIES[key]

    _HOST_COPIES[key] = (weakref.ref(cu, forget), cu._version, values)


def cu_seqlens_host(cu: torch.Tensor) -> tuple[int, ...]:
    """The values of ``cu`` (1-D int tensor) on the host, read back once per tensor and version.

    A packed batch's cu_seqlens is one tensor that every layer's attention receives; a
    device-to-host read per call makes the host wait for the device each time, so the launches
    behind it no longer hide behind queued kernels (docs/experiments.md §27: 32 documents of 2K
    tokens at head_dim 64 ran their forward at 0.69x the same problem as a dense batch, the
    kernels' own times equal). The values only validate the call (the kernels read the tensor
    itself). An in-place write through torch bumps the version counter and reads them again; a
    write that bypasses torch (a raw-pointer kernel) is not seen. Inference tensors (made under
    ``torch.inference_mode``) have no version counter and are read on every call."""
    hit = None if cu.is_inference() else _HOST_COPIES.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == cu._version:
        return hit[2]
    values = tuple(cu.tolist())
    _remember(cu, values)
    return values


def cu_seqlens_tensor(bounds: Sequence[int], device: torch.device | str | None) -> torch.Tensor:
    """int32 cu_seqlens on ``device`` (None: torch's default) from the host's ``bounds`` (0, l0,
    l0 + l1, ..., total), remembered so that validating it reads nothing back
    (``cu_seqlens_host``). A GPU's copy goes from pinned memory: from pageable memory it would
    wait for every kernel queued before it (Infini-attention's forward builds its segments'
    cu_seqlens after its memories' kernels)."""
    values = tuple(int(b) for b in bounds)
    if device is not None and torch.device(device).type == "cuda":
        host = torch.tensor(values, dtype=torch.int32, device="cpu", pin_memory=True)
        cu = host.to(device, non_blocking=True)
    else:
        cu = torch.tensor(values, dtype=torch.int32, device=device)
    _remember(cu, values)
    return cu


def build_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    q_positions: TokenPositions | None = None,
    k_positions: TokenPositions | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
) -> AttentionProblem:
    """Validate q/k/v and the mask arguments; resolve defaults (scale, bottom-right alignment).

    softcap, alibi_slopes: as in flash-attn (see ``check_softcap``/``check_alibi_slopes``);
    deterministic: only kernels with a fixed summation order."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    ndim = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, ndim)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k head_dim {k.shape[-1]} differs from q head_dim {head_dim}")
    check_head_dim(head_dim)
    heads_q, heads_k = q.shape[-2], k.shape[-2]
    if heads_k < 1:
        raise ValueError(f"k and v need at least one head, got shape {tuple(k.shape)}")
    if heads_q % heads_k != 0:
        raise ValueError(f"q heads ({heads_q}) must be divisible by k/v heads ({heads_k}) for GQA/MQA")
    causal, window_size = check_window(causal, window_size)
    scale = resolve_scale(softmax_scale, head_dim)
    softcap = check_softcap(softcap)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")

    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("varlen attention needs both cu_seqlens_q and cu_seqlens_k")
        cu_q, bounds_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device, q.shape[0])
        cu_k, bounds_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, k.shape[0])
        if cu_q.numel() != cu_k.numel():
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                f"got {cu_q.numel() - 1} and {cu_k.numel() - 1}"
            )
        lens_q = [b - a for a, b in zip(bounds_q, bounds_q[1:])]
        lens_k = [b - a for a, b in zip(bounds_k, bounds_k[1:])]
        for name, given, actual in (
            ("max_seqlen_q", max_seqlen_q, lens_q),
            ("max_seqlen_k", max_seqlen_k, lens_k),
        ):
            if not isinstance(given, int) or given < max(actual):
                raise ValueError(
                    f"{name} must be an int >= the longest sequence ({max(actual)}), got {given!r}"
                )
        batch, seqlen_q, seqlen_k = cu_q.numel() - 1, max_seqlen_q, max_seqlen_k
        # Each sequence's queries align to the end of its keys (flash-attn's convention): both
        # sides count back from their own sequence's length.
        q_positions = q_positions or TokenPositions(0, 1, per_len=-1)
        k_positions = k_positions or TokenPositions(0, 1, per_len=-1)
    else:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"q batch {q.shape[0]} differs from k/v batch {k.shape[0]}")
        cu_q = cu_k = None
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        q_positions = q_positions or TokenPositions(seqlen_k - seqlen_q, 1)
    k_positions = k_positions or TokenPositions(0, 1)
    if batch > MAX_GRID_YZ or heads_q > MAX_GRID_YZ:
        raise ValueError(
            f"at most {MAX_GRID_YZ} sequences and {MAX_GRID_YZ} query heads per call (the kernels "
            f"launch one program per sequence and head in CUDA grid dims y/z), got {batch} sequences "
            f"and {heads_q} heads; split the batch"
        )
    check_token_stride(q=q, k=k, v=v)
    alibi = check_alibi_slopes(alibi_slopes, batch, heads_q, q.device)
    return AttentionProblem(
        batch=batch,
        heads_q=heads_q,
        heads_k=heads_k,
        head_dim=head_dim,
        max_seqlen_q=seqlen_q,
        max_seqlen_k=seqlen_k,
        softmax_scale=scale,
        bounds=MaskBounds.from_args(causal, window_size),
        q_positions=q_positions,
        k_positions=k_positions,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        softcap=softcap,
        alibi_slopes=alibi,
        deterministic=deterministic,
    )
