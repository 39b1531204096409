"""Block-sparse attention as ``torch.library`` custom operators, so that ``torch.compile`` traces
a model calling ``flash_attn_func(..., block_mask=TileMask)`` without a graph break.

A ``TileMask`` is not a schema type: the ops take its nine int32 tensors and four ints and
rebuild it inside (its layout checks: shapes only, no device read). The problem is built inside
too, where the tensors are real (``plans.cached_problem``), as in ``ops.py``.

    block_sparse_forward(q, k, v, <mask>, softmax_scale, softcap, alibi_slopes) -> (out, lse)
    block_sparse_backward(dout, q, k, v, out, lse, dlse, <mask>, ...) -> (dq, dk, dv)

Both outputs are differentiable (a gradient on the LSE enters as delta -= dlse).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .block_sparse import check_tile_mask, sparse_backward, sparse_forward
from .plans import cached_problem
from .tile_mask import TileMask

# Every tensor of a TileMask, its walk orders too, so that the mask rebuilt per call derives nothing.
_MASK_TENSORS = (
    "kv_count", "kv_index", "kv_kind", "q_count", "q_index", "q_kind", "bits", "kv_order", "q_order",
)  # fmt: skip


def _mask_and_problem(q, k, v, tensors, sizes, softmax_scale, softcap, alibi_slopes):
    mask = TileMask(*sizes, *tensors)
    problem = cached_problem(
        q, k, v, None, None, 0, 0, softmax_scale, False, -1, -1, softcap, alibi_slopes, False
    )
    return check_tile_mask(mask, problem, q.device), problem


@torch.library.custom_op("ringflash::block_sparse_forward", mutates_args=())
def _forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_count: Tensor,
    kv_index: Tensor,
    kv_kind: Tensor,
    q_count: Tensor,
    q_index: Tensor,
    q_kind: Tensor,
    bits: Tensor,
    kv_order: Tensor,
    q_order: Tensor,
    sizes: list[int],
    softmax_scale: float,
    softcap: float,
    alibi_slopes: Tensor | None,
) -> tuple[Tensor, Tensor]:
    tensors = (kv_count, kv_index, kv_kind, q_count, q_index, q_kind, bits, kv_order, q_order)
    mask, problem = _mask_and_problem(q, k, v, tensors, sizes, softmax_scale, softcap, alibi_slopes)
    return sparse_forward(q, k, v, mask, problem)


@_forward_op.register_fake
def _forward_fake(q, *_):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("ringflash::block_sparse_backward", mutates_args=())
def _backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    kv_count: Tensor,
    kv_index: Tensor,
    kv_kind: Tensor,
    q_count: Tensor,
    q_index: Tensor,
    q_kind: Tensor,
    bits: Tensor,
    kv_order: Tensor,
    q_order: Tensor,
    sizes: list[int],
    softmax_scale: float,
    softcap: float,
    alibi_slopes: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    tensors = (kv_count, kv_index, kv_kind, q_count, q_index, q_kind, bits, kv_order, q_order)
    mask, problem = _mask_and_problem(q, k, v, tensors, sizes, softmax_scale, softcap, alibi_slopes)
    return sparse_backward(dout, q, k, v, out, lse, dlse, mask, problem)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, *_):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *tensors, sizes, softmax_scale, softcap, alibi_slopes = inputs
    ctx.save_for_backward(q, k, v, *output, *tensors, alibi_slopes)
    ctx.scalars = (sizes, softmax_scale, softcap)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *tensors, alibi_slopes = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    grads = _backward_op(dout, q, k, v, out, lse, dlse, *tensors, *ctx.scalars, alibi_slopes)
    return (*grads, *([None] * (len(_MASK_TENSORS) + 4)))


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def block_sparse_op(
    q: Tensor, k: Tensor, v: Tensor, mask: TileMask, softmax_scale: float, softcap: float,
    alibi_slopes: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, lse) of the block-sparse kernels through the custom op (what a trace records)."""
    sizes = [mask.seqlen_q, mask.seqlen_k, mask.block_q, mask.block_k]
    tensors = [getattr(mask, name) for name in _MASK_TENSORS]
    return _forward_op(q, k, v, *tensors, sizes, softmax_scale, softcap, alibi_slopes)
