"""The online-softmax merge rule for attention partials computed over disjoint key blocks."""

from __future__ import annotations

import torch


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold a partial (block_out, block_lse) into the running (out, lse), in place.

    With lse' = logaddexp(lse, block_lse):
        out <- out * exp(lse - lse') + block_out * exp(block_lse - lse');   lse <- lse'
    which is exact attention over the union of the two key sets. Rows where both are -inf
    (no key seen yet) stay out = 0, lse = -inf, without NaN.

    out: (batch, seqlen, heads, head_dim) float32 accumulator (may be a view); block_out the
    same shape, any float dtype; lse, block_lse: (batch, heads, seqlen) float32.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isneginf(new_lse), 0.0, new_lse)  # avoids (-inf) - (-inf)
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out * w_new)
    lse.copy_(new_lse)
