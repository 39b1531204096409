"""The merge rule of attention partials: two partials over disjoint key blocks (one fused pass
over memory), and attention sinks (one extra logit per head, with no value, merged last)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import block_d
from .launcher import launch


@triton.jit
def _merge_kernel(
    OUT, LSE, BLK, BLK_LSE, n_rows, heads,
    stride_ob, stride_os, stride_oh, stride_bb, stride_bs, stride_bh,
    stride_lb, stride_lh, stride_kb, stride_kh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    lse_ptrs = LSE + b * stride_lb + h * stride_lh + rows
    lse_a = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(BLK_LSE + b * stride_kb + h * stride_kh + rows, mask=row_ok, other=float("-inf"))
    hi = tl.maximum(lse_a, lse_b)
    ref = tl.where(hi == float("-inf"), 0.0, hi)  # both -inf: keep out 0, lse -inf, no NaN
    w_a = tl.exp(lse_a - ref)
    w_b = tl.exp(lse_b - ref)
    total = w_a + w_b
    safe = tl.maximum(total, 1e-30)  # total is 1 or more unless both rows are empty
    new_lse = tl.where(total > 0.0, ref + tl.log(safe), float("-inf"))
    inv = tl.where(total > 0.0, 1.0 / safe, 0.0)
    o_ptrs = OUT + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_os + offs_d[None, :]
    k_ptrs = BLK + b * stride_bb + h * stride_bh + rows[:, None].to(tl.int64) * stride_bs + offs_d[None, :]
    out_a = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_b = tl.load(k_ptrs, mask=mask, other=0.0).to(tl.float32)
    merged = out_a * (w_a * inv)[:, None] + out_b * (w_b * inv)[:, None]
    tl.store(o_ptrs, merged.to(OUT.dtype.element_ty), mask=mask)
    tl.store(lse_ptrs, new_lse, mask=row_ok)


def merge_attention_partial(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold a partial (block_out, block_lse) into the running (out, lse), in place.

    With lse' = logaddexp(lse, block_lse):
        out <- out * exp(lse - lse') + block_out * exp(block_lse - lse');   lse <- lse'
    which is exact attention over the union of the two key sets. Rows where both are -inf
    (no key seen yet) stay out = 0, lse = -inf, without NaN. One read and one write of each.

    out: (batch, seqlen, heads, head_dim) accumulator, float32 recommended (may be a view with
    a contiguous last dim); block_out: same shape, any float dtype; lse, block_lse:
    (batch, heads, seqlen) float32 with a contiguous last dim; all on one device.

    Raises:
        TypeError / ValueError naming the argument: a non-tensor, a dtype, shape, device or
        last-dim stride that does not fit.
    """
    tensors = (("out", out), ("lse", lse), ("block_out", block_out), ("block_lse", block_lse))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != out.device:
            raise ValueError(f"{name} is on {t.device} but out is on {out.device}")
    for name, t in (("out", out), ("block_out", block_out)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if out.dim() != 4:
        raise ValueError(f"out must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(out.shape)}")
    b, n, h, d = out.shape
    if block_out.shape != out.shape or lse.shape != (b, h, n) or block_lse.shape != (b, h, n):
        raise ValueError(
            f"merge shapes disagree: out {tuple(out.shape)}, block_out {tuple(block_out.shape)}, "
            f"lse {tuple(lse.shape)}, block_lse {tuple(block_lse.shape)}"
        )
    if lse.dtype != torch.float32 or block_lse.dtype != torch.float32:
        raise TypeError("lse and block_lse must be float32")
    for name, t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    launch_merge(out, lse, block_out, block_lse)


def launch_merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """``merge_attention_partial`` without its checks, for callers whose buffers are their own
    and fit by construction (the ring engine): the merge's per-call host cost is then the
    launch alone."""
    b, n, h, d = out.shape
    if n == 0:
        return
    block_r = 16 if d > 128 else 32
    grid = (triton.cdiv(n, block_r), b * h)
    launch(
        _merge_kernel, grid,
        out, lse, block_out, block_lse, n, h,
        *out.stride()[:3], *block_out.stride()[:3],
        lse.stride(0), lse.stride(1), block_lse.stride(0), block_lse.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_R=block_r,
    )  # fmt: skip


def check_sinks(sinks: object, heads: int, device: torch.device) -> torch.Tensor | None:
    """gpt-oss's attention sinks: None, or a floating-point tensor (heads,) on ``device``, one
    logit per query head; anything else raises TypeError / ValueError naming what is wrong.
    Every entry point calls this before running a kernel."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor (heads_q,) or None, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"sinks must have shape (heads_q,) = ({heads},) (one logit per query head), "
            f"got {tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}")
    return sinks


def merge_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one sink logit per head to every row's softmax denominator (gpt-oss's ``s_aux``).

    A sink is a key that every query sees, with score ``sinks[h]`` and value 0, so with
    lse' = logaddexp(lse, sink):
        out' = out * exp(lse - lse');   lse' as the new LSE
    Rows that saw no key (lse = -inf) give out' = 0, lse' = sink, without NaN forward or backward.

    Plain differentiable torch ops: with a differentiable ``lse`` (``flash_attn_func``'s is) the
    sinks' gradient comes out right, -sum over rows of exp(sink - lse') * rowsum(dout' * out').
    Apply it once, to the attention over all keys (after any ``merge_attention_partial``).

    out: (batch, seqlen, heads, head_dim) or varlen (total, heads, head_dim), any float dtype;
    lse: float32 (batch, heads, seqlen) or (heads, total); sinks: (heads,), any float dtype.
    Returns (out' in out's dtype, lse' float32), new tensors; the inputs are not modified.
    """
    if out.dim() not in (3, 4) or lse.shape != out.shape[:-3] + (out.shape[-2], out.shape[-3]):
        raise ValueError(
            f"merge_sinks needs out (batch, seqlen, heads, head_dim) with lse (batch, heads, seqlen), or "
            f"out (total, heads, head_dim) with lse (heads, total); got out {tuple(out.shape)}, "
            f"lse {tuple(lse.shape)}"
        )
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    if sinks is None:
        raise TypeError("sinks must be a torch.Tensor (heads_q,), got None")
    sink = check_sinks(sinks, lse.shape[-2], lse.device).float()[:, None]
    # logaddexp by hand around the detached row max (the gradient does not depend on it), so
    # that a row with lse = sink = -inf gives lse' = -inf, out' = 0 and zero gradients, not NaN.
    top = torch.maximum(lse, sink).detach()
    empty = torch.isneginf(top)
    top = top.masked_fill(empty, 0.0)
    keys = torch.exp(lse - top)
    # One of the two terms is exp(0) = 1 unless the row is empty (both 0): adding 1 there alone
    # keeps the log finite. Not clamp_min(1.0): a row that sees no key sits exactly on that
    # bound, and the gradient an operator passes at its boundary changes between torch releases
    # (torch 2.15's clamp_min passes none there, which dropped those rows' sink gradient).
    total = keys + torch.exp(sink - top) + empty.to(keys.dtype)
    lse_new = (top + torch.log(total)).masked_fill(empty, float("-inf"))
    scale = (keys / total).transpose(-1, -2)[..., None]
    return (out.float() * scale).to(out.dtype), lse_new
