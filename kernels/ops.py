"""Single-device attention as ``torch.library`` custom operators (namespace ``ringflash``).

``torch.compile`` traces a model that calls them without a graph break and treats them as
opaque: Inductor neither inlines nor re-compiles the Triton kernels behind them. Each op takes
only schema types (tensors, floats, ints, bools), builds its ``AttentionProblem`` inside, where
the tensors are real: ``build_problem`` validates there (once per call signature,
``plans.cached_problem``), including the host-side check of ``cu_seqlens`` that cannot run on
the fake tensors of a trace. The fake implementations give the
output shapes, with symbolic sequence lengths under ``mark_dynamic``.

    flash_attn_forward(q, k, v, ...) -> (out, lse)
    flash_attn_backward(dout, q, k, v, out, lse, dlse, ...) -> (dq, dk, dv)
    attention_probs(q, k, lse, ...) -> probs   (``return_attn_probs``; not differentiable)

The LSE output is differentiable: a gradient on it enters the backward as delta_i -= dlse_i,
since d lse_i / d s_ij = p_ij.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .backward import attention_gradients
from .few_queries import few_query_attention, fits
from .forward import attention_forward
from .plans import cached_problem, call_key, checked_call, options_typed, remember_call
from .problem import AttentionProblem, check_softcap, check_window, resolve_scale
from .probs import attention_probs


@torch.library.custom_op("ringflash::flash_attn_forward", mutates_args=())
def _forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
            window_right, softcap, alibi_slopes, deterministic)  # fmt: skip
    # Its backward needs only out and the LSE, which the few-query path gives as the general one.
    routed = few_query_attention(q, k, v, *args)
    if routed is not None:
        return routed
    return attention_forward(q, k, v, cached_problem(q, k, v, *args))


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *_):
    if cu_seqlens_q is not None:  # (total_q, heads_q, head_dim) -> LSE (heads_q, total_q)
        lse_shape = (q.shape[1], q.shape[0])
    else:  # (batch, seqlen_q, heads_q, head_dim) -> LSE (batch, heads_q, seqlen_q)
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("ringflash::flash_attn_backward", mutates_args=())
def _backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    problem = cached_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                       causal, window_left, window_right, softcap, alibi_slopes, deterministic)  # fmt: skip
    return attention_gradients(dout, q, k, v, out, lse, problem, dlse)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, *_):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, *scalars, alibi_slopes, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes)
    ctx.scalars = (*scalars, deterministic)
    ctx.set_materialize_grads(False)  # no LSE gradient stays None: no delta update


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    max_q, max_k, scale, causal, left, right, softcap, deterministic = ctx.scalars
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, scale, causal,
                              left, right, softcap, alibi_slopes, deterministic)  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _FlashAttention(torch.autograd.Function):
    """(out, lse) of attention, both differentiable: the ops' eager twin for plain tensors, the
    same kernels and backward without the dispatcher's per-call cost.

    A gradient on the LSE only changes delta: d lse_i / d S_ij = P_ij and dS = P * (dP - delta),
    so backpropagating dlse as well is delta_i -= dlse_i; calls that ignore the LSE skip it.
    """

    @staticmethod
    def forward(ctx, q, k, v, problem: AttentionProblem):
        out, lse = attention_forward(q, k, v, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        # dq may stay float32: autograd's engine casts it to q's dtype (validate_outputs).
        return (*attention_gradients(dout, q, k, v, out, lse, ctx.problem, dlse, float32_dq=True), None)


def check_scalar_args(
    softmax_scale: object, causal: object, window_size: object, softcap: object, deterministic: object
) -> tuple[float | None, bool, tuple[int, int], float, bool]:
    """The non-tensor arguments checked and normalized to the op schema's types, before the op
    is called (a wrong type would otherwise fail in the dispatcher with a schema message)."""
    causal, window = check_window(causal, window_size)
    if softmax_scale is not None:
        softmax_scale = resolve_scale(softmax_scale, 1)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    return softmax_scale, causal, window, check_softcap(softcap), deterministic


_OPTIONS: dict[tuple, tuple] = {}  # check_scalar_args' results by the options as passed


def _checked_options(
    softmax_scale: object, causal: object, window_size: object, softcap: object, deterministic: object
) -> tuple | None:
    """(scale or None, causal, window_left, window_right, softcap, deterministic): what
    ``check_scalar_args`` makes of these options, kept by them as passed; None where one is of a
    type its check does not accept (``plans.options_typed``: the caller runs the checks, which say
    what is wrong). Raises what the checks raise for a bad value."""
    if not options_typed(softmax_scale, causal, window_size, softcap, deterministic):
        return None
    key = (softmax_scale, causal, window_size, softcap, deterministic)
    found = _OPTIONS.get(key)
    if found is None:
        scale, causal, (left, right), softcap, deterministic = check_scalar_args(*key)
        if len(_OPTIONS) >= 256:  # options made per call: start over rather than grow
            _OPTIONS.clear()
        found = _OPTIONS[key] = (scale, causal, left, right, softcap, deterministic)
    return found


def _call_args(
    q, k, v, softmax_scale, causal, window_size, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    softcap, alibi_slopes, deterministic,
) -> tuple:  # fmt: skip
    """The arguments after the tensors of ``flash_attn_forward`` (and of ``attention_probs``,
    less the last), checked and in the schema's types."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    scale, causal, (left, right), softcap, deterministic = check_scalar_args(
        softmax_scale, causal, window_size, softcap, deterministic
    )
    if cu_seqlens_q is None and cu_seqlens_k is None:
        max_seqlen_q = max_seqlen_k = 0  # unused: the dense lengths come from the shapes
    else:
        for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(n, bool) or not isinstance(n, int):
                raise ValueError(f"{name} must be an int >= the longest sequence, got {n!r}")
    return (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, left, right, softcap,
            alibi_slopes, deterministic)  # fmt: skip


def _plain_eager(q: object, k: object, v: object) -> bool:
    """Plain tensors outside a trace, a dispatch mode (both take the ops: ``use_ops``) and the
    torch.func transforms (refused): the calls whose checks ``flash_attention`` may keep."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return False
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or _transformed())


def _decode_shaped(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Dense q, k, v of few query rows per K/V head: what kernels/few_queries.py may take."""
    return q.dim() == k.dim() == v.dim() == 4 and fits(q, k)


def _recorded(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether autograd records the call: an input that asks for gradients, or forward-mode AD
    (inside ``forward_ad.dual_level``), for which the Function raises that it has no formula;
    run without it, the inputs' tangents would be dropped unsaid."""
    return (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)) or (
        forward_ad._current_level >= 0
    )


def _transformed() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) is active: its wrapped tensors have
    no storage for the kernels, and the Function defines no vmap or setup_context rule."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of single-device attention through the ``ringflash::flash_attn_forward`` op,
    both differentiable. Dense: q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k,
    heads_k, head_dim), LSE float32 (batch, heads_q, seqlen_q); varlen (``cu_seqlens_q/k`` int32
    (num_seqs + 1,), ``max_seqlen_q/k`` ints): q (total_q, heads_q, head_dim), LSE (heads_q,
    total_q). Arguments as in ``flash_attn_func``/``flash_attn_varlen_func``."""
    key = None
    if _plain_eager(q, k, v):
        grad = _recorded(q, k, v)
        if not grad and cu_seqlens_q is None and cu_seqlens_k is None and _decode_shaped(q, k, v):
            # A decode step: kernels/few_queries.py plans it once for every number of keys, which
            # grows by one a step (a key with it would never be seen twice); only the options'
            # checks are kept here.
            options = _checked_options(softmax_scale, causal, window_size, softcap, deterministic)
            if options is not None:
                scale, causal_, left, right, softcap_, deterministic_ = options
                routed = few_query_attention(q, k, v, None, None, 0, 0, scale, causal_, left, right, softcap_,
                                             alibi_slopes, deterministic_)  # fmt: skip
                if routed is not None:
                    return routed
        else:
            key = call_key(q, k, v, softmax_scale, causal, window_size, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, softcap, alibi_slopes, deterministic)  # fmt: skip
    if key is not None:
        # Without autograd only calls the few-query path never takes come here (varlen, or too
        # many query rows): RINGFLASH_SPLIT_KV_QUERIES cannot change their path.
        key = (key, grad)
        problem = checked_call(key)
        if problem is not None:  # a call like this one passed every check below
            return _FlashAttention.apply(q, k, v, problem) if grad else attention_forward(q, k, v, problem)
    args = _call_args(q, k, v, softmax_scale, causal, window_size, cu_seqlens_q, cu_seqlens_k,
                      max_seqlen_q, max_seqlen_k, softcap, alibi_slopes, deterministic)  # fmt: skip
    if use_ops(q):
        return _forward_op(q, k, v, *args)
    if _transformed():
        raise NotImplementedError(
            "ringflash's attention does not run under torch.func transforms (vmap, grad, jvp, jacrev): "
            "call it on the whole batch (its first dimension) and use torch.autograd for gradients"
        )
    grad = _recorded(q, k, v)
    if not grad:
        routed = few_query_attention(q, k, v, *args)  # no backward: plans every length at once
        if routed is not None:
            return routed
    problem = cached_problem(q, k, v, *args)
    if key is not None:
        remember_call(key, problem, (cu_seqlens_q, cu_seqlens_k, alibi_slopes))
    # Without autograd the Function's own bookkeeping (~10 µs of host time) buys nothing.
    return _FlashAttention.apply(q, k, v, problem) if grad else attention_forward(q, k, v, problem)


@torch.library.custom_op("ringflash::attention_probs", mutates_args=())
def _probs_op(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Tensor | None,
) -> Tensor:
    # k stands in for v, which the probabilities do not read (the problem only checks its shape).
    problem = cached_problem(q, k, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                       causal, window_left, window_right, softcap, alibi_slopes, False)  # fmt: skip
    return attention_probs(q, k, lse, problem)


@_probs_op.register_fake
def _probs_fake(q, k, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_):
    if cu_seqlens_q is not None:  # one (max_seqlen_q, max_seqlen_k) block per sequence
        shape = (cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, max_seqlen_k)
    else:
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    return q.new_empty(shape, dtype=torch.float32)


def flash_attention_probs(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """``probs.attention_probs`` of a ``flash_attention`` call (``lse`` its LSE, sinks merged
    in or not) through the ``ringflash::attention_probs`` op, not differentiable: float32
    (batch or num_seqs, heads_q, max_seqlen_q, max_seqlen_k). Under torch.compile the op is
    opaque: the varlen sequences are sliced on the host by the real cu_seqlens, never by
    data-dependent sizes in the graph (with ``capture_scalar_outputs`` those are unbacked symbols
    that Inductor cannot lower)."""
    *args, _ = _call_args(q, k, k, softmax_scale, causal, window_size, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, softcap, alibi_slopes, False)  # fmt: skip
    q, k, lse = q.detach(), k.detach(), lse.detach()
    if use_ops(q):
        return _probs_op(q, k, lse, *args)
    return attention_probs(q, k, lse, cached_problem(q, k, k, *args, False))


def traced(x: Tensor) -> bool:
    """Whether only the custom ops can take the call: under ``torch.compile``/export, or for
    tensor subclasses such as fake or functional tensors, whose dispatch needs them."""
    return torch.compiler.is_compiling() or type(x) is not Tensor


def use_ops(x: Tensor, op_takes_it: bool = True) -> bool:
    """Whether to call the custom ops or their eager twin: when ``traced``, and in eager mode
    under a ``TorchDispatchMode`` (selective activation checkpointing, ``FlopCounterMode``,
    ``make_fx``), which sees dispatcher ops only: there the op route makes the attention one op
    that the mode can save or count, where the eager twin's kernels would pass unseen. Callers
    whose arguments no op takes (a block mask, a ``ChunkLayout``) pass ``op_takes_it=False``:
    such a call then runs eagerly under a mode, and still takes the op route (which refuses it
    or breaks the graph) when traced."""
    if traced(x):
        return True
    return op_takes_it and torch._C._len_torch_dispatch_stack() > 0
