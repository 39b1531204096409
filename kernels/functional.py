"""Autograd-aware single-device attention with flash-attn 2.x's call signatures.

Every public function takes flash-attn's arguments in flash-attn's positional order, so code
written for flash-attn runs after changing only the import; ringflash's additions (``sinks``,
``return_lse``) are keyword-only. All six share ``_attention``, which runs
``ops.flash_attention`` (custom operators when traced by torch.compile).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .block_sparse import BlockSparseAttention, check_mask_fits, check_tile_mask
from .block_sparse_ops import block_sparse_op
from .merge import check_sinks, merge_sinks
from .ops import check_scalar_args, flash_attention, flash_attention_probs, use_ops
from .plans import cached_problem
from .problem import MAX_HEAD_DIM, cu_seqlens_host
from .tile_mask import TileMask, as_tile_mask, documents_view


def padded_head_dim(head_dim: int) -> int:
    """The head_dim the kernels run at: ``head_dim`` rounded up to a multiple of 8 (16-byte rows).

    Raises:
        ValueError: head_dim outside [1, MAX_HEAD_DIM] (256, as in flash-attn).
    """
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    return -(-head_dim // 8) * 8


def pad_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v with their last (head_dim) dimension zero-padded to ``padded_head_dim`` (unchanged
    when it is a multiple of 8 already). Zero columns change no score and give zero output
    columns, so slicing ``out[..., :head_dim]`` afterwards is exact, and autograd slices the
    gradients back. Pass ``softmax_scale`` from the original head_dim. Inputs that are not
    tensors of one head_dim come back as they are, for ``build_problem`` to name what is wrong.

    Raises:
        ValueError: head_dim outside [1, 256].
    """
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not (tensors and q.dim() and k.dim() and v.dim()):  # no all(generator): every call pays this
        return q, k, v
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        return q, k, v
    pad = padded_head_dim(head_dim) - head_dim
    if pad == 0:
        return q, k, v
    return tuple(F.pad(t, (0, pad)) for t in (q, k, v))


def _check_unsupported(dropout_p: object, block_table: object = None) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise ValueError(
            f"dropout_p={dropout_p}: attention dropout is not implemented in ringflash; pass dropout_p=0.0"
        )
    if block_table is not None:
        raise ValueError("block_table (a paged KV cache) is not supported; pass block_table=None")


def _attention(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    return_attn_probs, sinks, return_lse, block_mask=None, **varlen,
):  # fmt: skip
    """The one implementation behind the six public functions; ``varlen`` holds cu_seqlens_q/k,
    max_seqlen_q/k and block_table for the varlen forms."""
    _check_unsupported(dropout_p, varlen.pop("block_table", None))
    head_dim = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() > 0 else None
    if softmax_scale is None and head_dim:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    qp, kp, vp = pad_head_dim(q, k, v)
    if not isinstance(return_attn_probs, bool) or not isinstance(return_lse, bool):
        raise TypeError("return_attn_probs and return_lse must be bools")
    if sinks is not None and head_dim:  # before the kernels (q itself is checked with the problem)
        check_sinks(sinks, q.shape[-2], q.device)
    kw = dict(softcap=softcap, alibi_slopes=alibi_slopes)
    if block_mask is not None:
        if return_attn_probs:
            raise ValueError("return_attn_probs cannot be combined with block_mask")
        sparse = packed_block_sparse_attention if varlen else block_sparse_attention
        out, lse = sparse(
            qp, kp, vp, block_mask, softmax_scale, causal, window_size, **kw, deterministic=deterministic,
            **varlen,
        )  # fmt: skip
    else:
        out, lse = flash_attention(
            qp, kp, vp, softmax_scale, causal, window_size, **varlen, **kw, deterministic=deterministic
        )
    if qp is not q:
        out = out[..., :head_dim]
    if sinks is not None:
        out, lse = merge_sinks(out, lse, sinks)
    if return_attn_probs:  # from the padded q, k: zero columns change no score
        probs = flash_attention_probs(qp, kp, lse, softmax_scale, causal, window_size, **varlen, **kw)
        return out, lse, probs
    return (out, lse) if return_lse else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    block_mask: TileMask | object | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Exact attention without materializing the score matrix, differentiable; flash-attn 2.x's
    ``flash_attn_func`` with the same arguments in the same order.

    Grouped-query attention (GQA/MQA): query head h uses key/value head h // (heads_q // heads_k).
    With causal=True the mask is aligned to the bottom-right corner of the score matrix, as in
    flash-attn; for seqlen_q = 2 and seqlen_k = 5 (1 = keep):
        1 1 1 1 0
        1 1 1 1 1
    and for seqlen_q = 5, seqlen_k = 2 the first three rows see no key (out 0, LSE -inf):
        0 0
        0 0
        0 0
        1 0
        1 1
    A window lets query i see keys [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right].

    A call that asks for no gradients with at most 64 query rows per K/V head (seqlen_q x
    heads_q / heads_k: a decode step over a cache the model keeps) runs the split-KV decoding
    kernel, planned once for every seqlen_k (``kernels/few_queries.py``; its rounding differs
    from the training path's in the last bits; ``RINGFLASH_SPLIT_KV_QUERIES=0`` turns it off).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16/bfloat16/float32, CUDA (or CPU with
            TRITON_INTERPRET=1 set before import; float16/float32 there).
        k, v: (batch, seqlen_k, heads_k, head_dim), same dtype and device; heads_q % heads_k == 0.
            head_dim: any in [1, 256]; one that is not a multiple of 8 is zero-padded internally
            (a copy of q, k, v), the output and gradients are sliced back.
        dropout_p: must be 0.0 (attention dropout is not implemented).
        softmax_scale: scale of q k^T; defaults to 1/sqrt(head_dim) (the caller's head_dim).
        causal: mask keys after the query (bottom-right aligned, see above).
        window_size: (left, right) sliding window, -1 = unbounded.
        softcap: > 0: scores -> softcap * tanh(scores / softcap) before the mask (Gemma-2); 0 = off.
        alibi_slopes: float32 (heads_q,) or (batch, heads_q): bias -slope * |i + seqlen_k -
            seqlen_q - j| added to the score of query i and key j (after the softcap).
        deterministic: use only kernels that sum gradients in a fixed order (bitwise
            reproducible backward); the forward is always deterministic.
        return_attn_probs: also return the LSE and the attention probabilities, as flash-attn's
            (out, softmax_lse, S_dmask); the probabilities are recomputed in torch from q, k and
            the LSE (float32, O(seqlen_q * seqlen_k) memory: for tests, not training) and are
            exact, masked pairs 0.
        sinks: (heads_q,) any float dtype, learned: one extra logit per query head in every
            row's softmax denominator, with no value (gpt-oss's ``s_aux``); differentiable.
        return_lse: also return the LSE (ringflash's; flash-attn returns it only with
            return_attn_probs).
        block_mask: ringflash's: any mask, block-sparse (``TileMask``, or FlexAttention's
            ``BlockMask`` from ``create_block_mask``, converted once per BlockMask object) over
            (batch or 1, heads_q or 1, seqlen_q, seqlen_k): only its visible blocks are computed.
            It replaces causal/window_size (which must stay at their defaults); ALiBi distances
            stay bottom-right aligned as above. Under torch.compile it runs eagerly (a graph
            break).

    Returns:
        out (batch, seqlen_q, heads_q, head_dim) in q's dtype; with ``return_lse`` (out, lse);
        with ``return_attn_probs`` (out, lse, probs). lse: float32 (batch, heads_q, seqlen_q),
        the natural-log logsumexp of each row's scaled scores (sinks included), differentiable;
        -inf (with sinks: the sink) where a row sees no key, whose out is 0. probs: float32
        (batch, heads_q, seqlen_q, seqlen_k), not differentiable.

    Raises:
        TypeError: a tensor of the wrong type or dtype, or a non-bool flag.
        ValueError: shapes, devices, window, scale, softcap, alibi_slopes or sinks that do not
            fit (the message names the argument); dropout_p != 0; head_dim > 256.
    """
    return _attention(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, sinks, return_lse, block_mask,
    )  # fmt: skip


# A FlexAttention BlockMask is converted outside a trace (a graph break where it is not a TileMask yet).
_converted = torch.compiler.disable(as_tile_mask)


def _mask_scalars(
    softmax_scale: object, causal: object, window_size: object, softcap: object, deterministic: object
) -> tuple[float | None, float]:
    """(scale, softcap) of a block-sparse call, checked; causal and window_size must stay at
    their defaults (the mask replaces them)."""
    scale, causal, (left, right), softcap, _ = check_scalar_args(
        softmax_scale, causal, window_size, softcap, deterministic
    )
    if causal or (left, right) != (-1, -1):
        raise ValueError(
            "block_mask replaces causal and window_size: fold them into the mask (e.g. a mask_mod "
            f"q_idx >= kv_idx) and pass causal=False, window_size=(-1, -1); got causal={causal}, "
            f"window_size={(left, right)}"
        )
    return scale, softcap


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: object,
    softmax_scale: float | None,
    causal: object = False,
    window_size: object = (-1, -1),
    *,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``flash_attn_func``'s arguments under ``block_mask`` (a TileMask or a
    FlexAttention BlockMask), both differentiable; q/k/v with head_dim a multiple of 8. The
    backward is deterministic whatever ``deterministic`` says (no atomics: block_sparse.py).
    Traced by torch.compile, the custom op ``ringflash::block_sparse_forward`` (a TileMask
    needs no graph break; a BlockMask is converted in one)."""
    scale, softcap = _mask_scalars(softmax_scale, causal, window_size, softcap, deterministic)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    mask = block_mask if isinstance(block_mask, TileMask) else _converted(block_mask)
    if use_ops(q):  # the shapes checked here, in the trace; the rest by the op when it runs
        check_mask_fits(mask, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device)
        return block_sparse_op(q, k, v, mask, scale, softcap, alibi_slopes)
    problem = cached_problem(q, k, v, None, None, 0, 0, scale, False, -1, -1, softcap, alibi_slopes, False)
    return BlockSparseAttention.apply(q, k, v, check_tile_mask(mask, problem, q.device), problem)


@torch.compiler.disable  # reads the documents' bounds on the host: a graph break under torch.compile
def _packed_mask(block_mask, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, softcap,
                 deterministic) -> TileMask:  # fmt: skip
    """The TileMask that ``packed_block_sparse_attention`` runs on (1, total_q, total_k): the
    checked call's ``block_mask`` cut by its documents, once per mask and bounds."""
    problem = cached_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, False,
                             -1, -1, softcap, None, deterministic)  # fmt: skip
    mask = as_tile_mask(block_mask)
    if mask.batch != 1:
        raise ValueError(
            f"block_mask with cu_seqlens describes the packed tokens (batch 1), got batch {mask.batch}"
        )
    check_mask_fits(mask, 1, q.shape[1], q.shape[0], k.shape[0], q.device)
    bounds = (cu_seqlens_host(problem.cu_seqlens_q), cu_seqlens_host(problem.cu_seqlens_k))
    return documents_view(mask, *bounds)


def packed_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: object,
    softmax_scale: float | None,
    causal: object = False,
    window_size: object = (-1, -1),
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``flash_attn_varlen_func``'s arguments under ``block_mask``, a TileMask or
    BlockMask over the packed tokens ((1, heads_q or 1, total_q, total_k) in packed positions,
    as FlexAttention and MagiAttention describe packed batches) that is cut by the documents:
    a query sees the keys its mask allows within its own document only
    (``TileMask.within_documents``, once per mask and cu_seqlens). q: (total_q, heads_q,
    head_dim), lse float32 (heads_q, total_q). ALiBi is refused (its distances would run across
    the packed tokens); under torch.compile the mask's cut runs in a graph break."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise TypeError(f"{name} must be a (total, heads, head_dim) torch.Tensor with cu_seqlens")
    if alibi_slopes is not None:
        raise ValueError(
            "alibi_slopes cannot be combined with block_mask and cu_seqlens: ALiBi's distances would run "
            "across the packed tokens; pass alibi_slopes=None"
        )
    scale, softcap = _mask_scalars(softmax_scale, causal, window_size, softcap, deterministic)
    mask = _packed_mask(block_mask, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                        softcap, deterministic)  # fmt: skip
    out, lse = block_sparse_attention(
        q[None], k[None], v[None], mask, softmax_scale, causal, window_size, softcap=softcap,
        deterministic=deterministic,
    )  # fmt: skip
    return out[0], lse[0]


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    block_mask: TileMask | object | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Attention over packed variable-length sequences, never across a sequence boundary;
    flash-attn 2.x's ``flash_attn_varlen_func`` with the same arguments in the same order.

    Args:
        q: (total_q, heads_q, head_dim); k, v: (total_k, heads_k, head_dim).
        cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) cumulative lengths starting at 0, on
            q's device.
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence on each side.
        block_table: must be None (a paged KV cache is not supported).
        block_mask: ringflash's: any mask (``TileMask``, or FlexAttention's ``BlockMask``) over
            the packed tokens, (1, heads_q or 1, total_q, total_k) in packed positions, as
            FlexAttention and MagiAttention describe a packed batch; each query sees what the
            mask allows within its own sequence only (the cut by cu_seqlens is made once per
            mask and cu_seqlens). It replaces causal/window_size and cannot be combined with
            ALiBi.
        Other arguments as in ``flash_attn_func``; masks and ALiBi distances align each
        sequence's queries to the end of its keys.

    Returns:
        out (total_q, heads_q, head_dim); with ``return_lse`` (out, lse), lse float32
        (heads_q, total_q); with ``return_attn_probs`` (out, lse, probs), probs float32
        (num_seqs, heads_q, max_seqlen_q, max_seqlen_k), sequence i in [i, :, :len_q, :len_k].

    Raises:
        As ``flash_attn_func``; also ValueError for cu_seqlens/max_seqlen that do not fit and
        for a block_table.
    """
    return _attention(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, sinks, return_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_table=block_table, block_mask=block_mask,
    )  # fmt: skip


def unstack_packed(name: str, packed: object, parts: int, varlen: bool) -> tuple[torch.Tensor, ...]:
    """Views of the ``parts`` tensors stacked in dim -3 of a packed qkv/kv tensor; autograd
    gathers their gradients back into the packed tensor's gradient."""
    ndim = 4 if varlen else 5
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != ndim or packed.shape[-3] != parts:
        layout = "total_tokens" if varlen else "batch, seqlen"
        raise ValueError(
            f"{name} must be {ndim}-D ({layout}, {parts}, heads, head_dim), got shape {tuple(packed.shape)}"
        )
    return packed.unbind(-3)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``flash_attn_func`` on q, k, v stacked in one tensor, flash-attn's signature.

    Args:
        qkv: (batch, seqlen, 3, heads, head_dim); its gradient is (q, k, v)'s stacked the same way.
        Other arguments as in ``flash_attn_func``.

    Returns and Raises:
        As ``flash_attn_func``.
    """
    q, k, v = unstack_packed("qkv", qkv, 3, varlen=False)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, sinks=sinks, return_lse=return_lse,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``flash_attn_func`` with k and v stacked in one tensor, flash-attn's signature.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim).
        kv: (batch, seqlen_k, 2, heads_k, head_dim), heads_q % heads_k == 0.
        Other arguments as in ``flash_attn_func``.

    Returns and Raises:
        As ``flash_attn_func``.
    """
    k, v = unstack_packed("kv", kv, 2, varlen=False)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, sinks=sinks, return_lse=return_lse,
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``flash_attn_varlen_func`` on packed q, k, v stacked in one tensor, flash-attn's signature.

    Args:
        qkv: (total_tokens, 3, heads, head_dim).
        cu_seqlens: int32 (num_seqs + 1,) cumulative lengths, for queries and keys alike.
        max_seqlen: int >= the longest sequence.
        Other arguments as in ``flash_attn_func``.

    Returns and Raises:
        As ``flash_attn_varlen_func``.
    """
    q, k, v = unstack_packed("qkv", qkv, 3, varlen=True)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        sinks=sinks, return_lse=return_lse,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``flash_attn_varlen_func`` with k and v stacked in one tensor, flash-attn's signature.

    Args:
        q: (total_q, heads_q, head_dim); kv: (total_k, 2, heads_k, head_dim).
        Other arguments as in ``flash_attn_varlen_func``.

    Returns and Raises:
        As ``flash_attn_varlen_func``.
    """
    k, v = unstack_packed("kv", kv, 2, varlen=True)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        sinks=sinks, return_lse=return_lse,
    )  # fmt: skip
