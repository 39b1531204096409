"""Validated problems built once per call signature.

``build_problem`` checks every argument and resolves the mask (tens of microseconds of Python);
a model calls attention with the same shapes and options in every layer and every step. The
problem depends only on q/k/v's shapes, strides, dtypes and devices, the options, and the
identity and version of the tensors among them (cu_seqlens, ALiBi slopes): equal keys give an
equal problem, so a call whose key was seen takes the problem built then. The cache holds those
few small tensors so that their ids cannot be reused while an entry lives; an in-place write to
one bumps its version and builds anew (as ``problem.cu_seqlens_host`` reads it anew).

In front of that, ``call_key``/``checked_call``/``remember_call`` keep a call of
``ops.flash_attention`` by its arguments as the caller passed them, before they are checked and
put in the ops' schema types: a call seen before skips the checks as well as the problem's key
(docs/experiments.md §82).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .problem import AttentionProblem, build_problem

_MAX_PLANS = 256
_PLANS: OrderedDict[tuple, tuple[AttentionProblem, tuple]] = OrderedDict()
_BUILDS = [0]
_CALLS: OrderedDict[tuple, tuple[AttentionProblem, tuple]] = OrderedDict()
_NUMBERS = (float, int)  # the types the checks take for softmax_scale and softcap (bool is neither)
_LENGTHS = (int, type(None))


def _refresh(cache: OrderedDict, key: tuple) -> None:
    """Marks ``key`` as just used; another thread (``nn.DataParallel`` runs a module's replicas
    in threads) may have evicted it since it was read, which only means it need not be."""
    try:
        cache.move_to_end(key)
    except KeyError:
        pass


def layout_key(t: object) -> tuple:
    """A plain tensor's shape, strides, dtype and device; TypeError for anything else (tensor
    subclasses, non-tensors: never cached)."""
    if type(t) is not torch.Tensor:
        raise TypeError
    return (t.shape, t.stride(), t.dtype, t.device)


def identity_key(t: object) -> object:
    """None, or a plain tensor's id and version (a cache entry must hold the tensor, so that the
    id is not reused while it lives); TypeError for anything else and for inference tensors,
    which have no version counter to see a write."""
    if t is None:
        return None
    if type(t) is not torch.Tensor or t.is_inference():
        raise TypeError
    return (id(t), t._version)


def cached_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
) -> AttentionProblem:
    """``build_problem`` for the ops' arguments (``kernels/ops.py``: scalars already checked and
    in the schema's types), built on the first call of a key and looked up after."""
    scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
               deterministic)  # fmt: skip
    try:
        key = (layout_key(q), layout_key(k), layout_key(v), identity_key(cu_seqlens_q),
               identity_key(cu_seqlens_k), identity_key(alibi_slopes), scalars)  # fmt: skip
        hit = _PLANS.get(key)
    except TypeError:
        key = hit = None
    if hit is not None:
        _refresh(_PLANS, key)
        return hit[0]
    varlen = {}
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)  # fmt: skip
    problem = build_problem(
        q, k, v, softmax_scale, causal, (window_left, window_right), **varlen,
        softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
    )  # fmt: skip
    _BUILDS[0] += 1
    if key is not None:
        _PLANS[key] = (problem, (cu_seqlens_q, cu_seqlens_k, alibi_slopes))  # pins the ids in the key
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    return problem


def problem_builds() -> int:
    """How many problems ``cached_problem`` has built (tests count them)."""
    return _BUILDS[0]


def options_typed(
    softmax_scale: object, causal: object, window_size: object, softcap: object, deterministic: object
) -> bool:
    """Whether each option is of a type its check accepts, exactly: equal options of such types
    are checked and normalized alike (True == 1 == 1.0, but causal=1, window_size=(-1.0, -1) or
    softcap=False must still reach the checks, which refuse them)."""
    if type(causal) is not bool or type(deterministic) is not bool or type(window_size) is not tuple:
        return False
    if len(window_size) != 2 or type(window_size[0]) is not int or type(window_size[1]) is not int:
        return False
    return type(softcap) in _NUMBERS and (softmax_scale is None or type(softmax_scale) in _NUMBERS)


def call_key(
    q: object,
    k: object,
    v: object,
    softmax_scale: object,
    causal: object,
    window_size: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    softcap: object,
    alibi_slopes: object,
    deterministic: object,
) -> tuple | None:
    """The key of a call of ``ops.flash_attention`` with these arguments as passed, or None for
    one that only the checks may take: tensors that are not plain tensors, or an option of a type
    other than those its check accepts (``options_typed``). A key that ``remember_call`` kept
    stands for a call that passed the checks."""
    if not options_typed(softmax_scale, causal, window_size, softcap, deterministic):
        return None
    if type(max_seqlen_q) not in _LENGTHS or type(max_seqlen_k) not in _LENGTHS:
        return None
    try:
        return (layout_key(q), layout_key(k), layout_key(v), identity_key(cu_seqlens_q),
                identity_key(cu_seqlens_k), identity_key(alibi_slopes), max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_size, softcap, deterministic)  # fmt: skip
    except TypeError:
        return None


def checked_call(key: tuple) -> AttentionProblem | None:
    """The problem that ``remember_call`` kept under ``key``, or None."""
    hit = _CALLS.get(key)
    if hit is None:
        return None
    _refresh(_CALLS, key)
    return hit[0]


def remember_call(key: tuple, problem: AttentionProblem, pinned: tuple) -> None:
    """Keeps ``problem`` under ``key`` (from ``call_key``, plus what else picked the call's path)
    for a call that passed the checks; ``pinned``: the tensors whose ids are in the key."""
    _CALLS[key] = (problem, pinned)
    if len(_CALLS) > _MAX_PLANS:
        _CALLS.popitem(last=False)
