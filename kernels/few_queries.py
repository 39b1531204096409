"""A few query rows over any number of keys, without autograd: ``flash_attn_func``'s forward
on the split-KV kernel (``decode.py``), planned once for every key count.

Generating from a model whose cache grows by a token a step (transformers' ``DynamicCache``)
calls attention with q (batch, 1, heads_q, head_dim) and keys one longer at every call. The
general path keys its problem, its checks and its bound launches on every shape, so each step
built and validated a new problem and launched unbound: 169 µs of host time per call against 58
at a fixed length (1×H200, experiments §73). And one query tile per (sequence, head) leaves
most of a GPU idle over a long cache, which the split-KV kernel fills by splitting the keys.

Here the plan's key leaves out what follows the number of keys (k/v's length and their batch
and head strides); the first call of a key validates everything through ``build_problem``,
later calls check that k and v still agree and launch with the length-dependent ints keyed by
their Triton specialization class (``launcher.SizedLaunch``). Used where no gradient is asked
for (the kernel has no backward) and the rows fit one query tile (``MAX_ROWS`` query rows per KV
head: the tokens x the query heads sharing it); the ops' forward uses it too (its backward
needs only out and the LSE, which are the same).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from .configs import environment_value
from .decode import MAX_SPLITS, MIN_KEYS_PER_SPLIT, SIZED_INTS, SplitKVPlan, default_splits, plan_split_kv
from .decode import block_n as split_block_n
from .launcher import SizedLaunch
from .problem import MAX_GRID_YZ, build_problem

# Query rows per KV head (seqlen_q x heads_q / heads_k) up to one tile of the split kernel;
# more rows re-read the keys once per tile, where the general kernels tile the queries instead.
MAX_ROWS = 64
SWITCH = "RINGFLASH_SPLIT_KV_QUERIES"  # "0": every call takes the general path


class _Splits(NamedTuple):
    plan: SplitKVPlan  # the merge and the output's layout, as planned for this many splits
    launch: SizedLaunch  # the split kernel, its length-dependent ints passed per call


class _Route(NamedTuple):
    shape: tuple[int, ...]  # q's (batch, seqlen_q, heads_q, head_dim)
    q_stride: tuple[int, ...]
    out_stride: tuple[int, ...]  # torch.empty_like(q)'s
    plan_args: dict  # plan_split_kv's options for this key
    fitting: int  # programs that fit one wave, over the (sequence, KV head) pairs
    tile: int  # keys per tile
    lse_size: int  # batch x heads_q x seqlen_q
    by_splits: dict[int, _Splits]


_MAX_ROUTES = 256
_ROUTES: OrderedDict[tuple, _Route | None] = OrderedDict()  # None: this key takes the general path
_PLANNED = [0, 0]  # keys planned, and launches planned for a split count (tests count them)


def plans_made() -> tuple[int, int]:
    """(keys planned, split counts planned) so far: a new length of a known key adds neither
    unless it changes the split count."""
    return _PLANNED[0], _PLANNED[1]


def fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether 4-D q and k have K/V heads and at most ``MAX_ROWS`` query rows per K/V head."""
    return bool(k.shape[2]) and q.shape[1] * (q.shape[2] // k.shape[2]) <= MAX_ROWS


def _key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: tuple) -> tuple:
    """Everything but the keys' number and what follows it (k/v's batch and head strides);
    devices by ``get_device`` (an int: hashing a torch.device costs more) with their type."""
    ks, vs = k.stride(), v.stride()
    return (
        q.shape, q.stride(), q.dtype, q.is_cuda, q.get_device(), k.shape[0], k.shape[2:], ks[1], ks[3],
        k.dtype, k.is_cuda, k.get_device(), v.shape[0], v.shape[2:], vs[1], vs[3], v.dtype, v.is_cuda,
        v.get_device(), options,
    )  # fmt: skip


_MISSING = object()


def few_query_attention(
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
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) of dense attention (the ops' arguments, scalars already checked) for q of a
    few rows, as ``attention_forward`` would give them; None where this path does not apply (the
    caller then takes the general one, which also raises on bad input): varlen, tensor
    subclasses, rows over ``MAX_ROWS``, no keys, too many (sequence, KV head) pairs for the
    grid, or ``RINGFLASH_SPLIT_KV_QUERIES=0``."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None or environment_value(SWITCH) == "0":
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    if not fits(q, k):  # no key needed to say
        return None
    alibi = None
    if alibi_slopes is not None:
        if type(alibi_slopes) is not torch.Tensor:
            return None
        alibi = (type(alibi_slopes), alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                 alibi_slopes.device)  # fmt: skip
    key = _key(q, k, v, (softmax_scale, causal, window_left, window_right, softcap, deterministic, alibi))
    route = _ROUTES.get(key, _MISSING)
    if route is _MISSING:
        route = _ROUTES[key] = _plan(q, k, v, softmax_scale, causal, (window_left, window_right), softcap,
                                     alibi_slopes, deterministic)  # fmt: skip
        if len(_ROUTES) > _MAX_ROUTES:
            _ROUTES.popitem(last=False)
    if route is None:
        return None
    keys = k.shape[1]
    if keys != v.shape[1] or keys == 0:  # the general path raises on the first, fills the second
        return None
    splits = max(1, min(route.fitting, -(-keys // MIN_KEYS_PER_SPLIT), MAX_SPLITS))
    planned = route.by_splits.get(splits)
    if planned is None:
        planned = route.by_splits[splits] = _plan_splits(route, splits, k, v)
    plan = planned.plan
    out = torch.empty_like(q)  # q's strides, as the general path's and the op's fake give it
    if plan.parts:  # the splits' partials, then the LSE (16-byte aligned): one allocation, both small
        start = -(-plan.parts // 4) * 4
        work = torch.empty(start + route.lse_size, device=q.device, dtype=torch.float32)
        lse = work[start:].view(plan.lse_shape)
    else:
        work, lse = None, torch.empty(plan.lse_shape, device=q.device, dtype=torch.float32)
    tile = route.tile
    per_split = -(-keys // (splits * tile)) * tile
    ks, vs = k.stride(), v.stride()
    planned.launch(
        plan.grid, q, k, v, out if work is None else work, lse if work is None else work, None, None, None,
        alibi_slopes, None, keys, keys, per_split, keys, keys, ks[0], ks[2], vs[0], vs[2],
    )  # fmt: skip
    if work is not None:
        grid, merge = plan.merge
        merge(grid, work, work, out, lse)
    return out, lse


def _plan(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, deterministic) -> _Route | None:
    """The route of a new key, its arguments validated by ``build_problem`` (which raises as the
    general path would); None where the key takes the general path."""
    _PLANNED[0] += 1
    problem = build_problem(
        q, k, v, softmax_scale, causal, window, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic,
    )  # fmt: skip
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    rows = seqlen_q * (heads_q // heads_k)
    if batch * heads_k == 0 or seqlen_q == 0 or rows > MAX_ROWS or batch * heads_k > MAX_GRID_YZ:
        return None
    alibi_batch_stride = None  # the caller's slopes are read as they are: (heads_q,) or (batch, heads_q)
    if alibi_slopes is not None:
        if alibi_slopes.stride(-1) != 1:
            return None
        alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    plan_args = dict(
        softmax_scale=problem.softmax_scale, window=(problem.bounds.left, problem.bounds.right),
        softcap=problem.softcap, alibi_batch_stride=alibi_batch_stride,
        batch_idx=False, table_stride=None, leftpad=False, key_offset=0, out_dtype=q.dtype, seqlens=False,
    )  # fmt: skip
    # default_splits' count for a cache long enough never to limit it: the programs that fit.
    fitting = default_splits(batch, heads_k, rows, MAX_SPLITS * MIN_KEYS_PER_SPLIT, q.device)
    tile = split_block_n(head_dim, q.element_size())
    out_stride, lse_size = torch.empty_like(q).stride(), batch * heads_q * seqlen_q
    return _Route(tuple(q.shape), q.stride(), out_stride, plan_args, fitting, tile, lse_size, {})


def _plan_splits(route: _Route, splits: int, k: torch.Tensor, v: torch.Tensor) -> _Splits:
    """The launches for ``splits`` splits, planned with this call's length (whose ints the
    launch then takes per call)."""
    _PLANNED[1] += 1
    plan = plan_split_kv(
        route.shape, route.q_stride, k.dtype, tuple(k.shape), k.stride(), v.stride(), k.shape[1],
        num_splits=splits, held=k.shape[1], out_stride=route.out_stride, **route.plan_args,
    )  # fmt: skip
    split = plan.split
    return _Splits(plan, SizedLaunch(split.kernel, split.tail[SIZED_INTS:], split.kwargs))
