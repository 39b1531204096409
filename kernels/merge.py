"""The online-softmax merge of two attention partials, as one fused pass over memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import block_d


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
    (batch, heads, seqlen) float32 with a contiguous last dim.
    """
    b, n, h, d = out.shape
    if block_out.shape != out.shape or lse.shape != (b, h, n) or block_lse.shape != (b, h, n):
        raise ValueError(
            f"merge shapes disagree: out {tuple(out.shape)}, block_out {tuple(block_out.shape)}, "
            f"lse {tuple(lse.shape)}, block_lse {tuple(block_lse.shape)}"
        )
    if lse.dtype != torch.float32 or block_lse.dtype != torch.float32:
        raise TypeError("lse and block_lse must be float32")
    for name, t in (("out", out), ("block_out", block_out), ("lse", lse), ("block_lse", block_lse)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if n == 0:
        return
    block_r = 16 if d > 128 else 32
    grid = (triton.cdiv(n, block_r), b * h)
    _merge_kernel[grid](
        out, lse, block_out, block_lse, n, h,
        *out.stride()[:3], *block_out.stride()[:3],
        lse.stride(0), lse.stride(1), block_lse.stride(0), block_lse.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_R=block_r,
    )  # fmt: skip
