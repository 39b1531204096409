"""``flash_attn_with_kvcache``: attention of new queries over a KV cache, flash-attn 2.x's
signature and semantics (appends in place, rotary, paged caches, bottom-right causal masks),
on the split-KV kernel (``decode.py``). Inference only: nothing here is differentiable.

What flash-attn leaves undefined (a cache too small for the appended tokens, page-table
entries out of range, positions past the rotary tables) raises ValueError here: one read of
the small index tensors on the host per call (``check_bounds=True``, ringflash's keyword), or
none with ``check_bounds=False`` and inside a CUDA graph's capture, where no read is possible.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from .cache_append import plan_append
from .decode import SplitKVPlan, default_splits, plan_split_kv, run_split_kv
from .merge import check_sinks, merge_sinks
from .ops import use_ops
from .problem import (
    MAX_HEAD_DIM,
    _check_tensor,
    check_alibi_slopes,
    check_softcap,
    check_window,
    resolve_scale,
)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    check_bounds: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over a KV cache, after appending k/v to it in place; flash-attn 2.x's
    ``flash_attn_with_kvcache`` with the same arguments in the same order (inference: no
    gradients).

    Sequence b's keys are the cache's first ``cache_seqlens[b]`` rows, then the appended k/v:
    seqlen_k = cache_seqlens[b] + seqlen_new. With causal=True the mask is aligned to the
    bottom-right corner (query t of seqlen_q sits at position seqlen_k - seqlen_q + t, as in
    ``flash_attn_func``), so a decode step (seqlen_q = 1) sees every key and a chunk of new
    tokens sees the cache and the chunk's earlier tokens.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16/bfloat16/float32 (float16/float32 on
            the CPU interpreter); head_dim in [1, 256].
        k_cache, v_cache: (cache_rows, capacity, heads_k, head_dim) in q's dtype (cache_rows >=
            batch, or the rows ``cache_batch_idx`` names), or with ``block_table`` (pages,
            page_size, heads_k, head_dim) (any page_size); heads_q % heads_k == 0; unit stride in
            head_dim. Written in place where k/v are appended.
        k, v: None, or (batch, seqlen_new, heads_k, head_dim) new keys/values written into the
            cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2) in q's dtype, rotary_dim <=
            head_dim even: rotary embedding of the new k at their positions and of q (at
            positions cache_seqlens[b] + t when causal or windowed, else all at cache_seqlens[b]);
            needs k and v.
        cache_seqlens: int or (batch,) int32: keys already in each sequence's cache (default 0).
        cache_batch_idx: None, or (batch,) int32: the cache row of each sequence (dense caches).
        cache_leftpad: None, or (batch,) int32: sequence b's keys start at that row of its cache
            (the rows before are padding, never attended); positions, masks and rotary stay the
            cache's rows, as in flash-attn (which refuses it with block_table; here it works
            with pages too).
        block_table: None, or (batch, pages_per_sequence) int32: page of each sequence's keys
            j * page_size .. (j + 1) * page_size - 1.
        softmax_scale: scale of q k^T; defaults to 1/sqrt(head_dim).
        causal, window_size: as in ``flash_attn_func`` (bottom-right aligned).
        softcap: > 0: scores -> softcap * tanh(scores / softcap); 0 = off.
        rotary_interleaved: True: rotate dims (0, 1), (2, 3), ... (GPT-J); False: dims i and
            i + rotary_dim / 2 (GPT-NeoX).
        alibi_slopes: float32 (heads_q,) or (batch, heads_q): bias -slope * |position_q - j|.
        num_splits: key splits per sequence (each split's partial merged exactly); 0 chooses
            enough to fill the GPU (``decode.default_splits``).
        return_softmax_lse: also return the LSE.
        sinks: (heads_q,) float: one extra logit per query head in every row's softmax
            denominator, with no value (gpt-oss); ringflash's keyword.
        check_bounds: read cache_seqlens / cache_batch_idx / block_table on the host (one device
            sync) to raise ValueError on entries out of range; False (or inside a CUDA graph's
            capture) skips it, and such entries are then undefined behaviour, as in flash-attn.

    Returns:
        out (batch, seqlen_q, heads_q, head_dim) in q's dtype; with ``return_softmax_lse``
        (out, lse), lse float32 (batch, heads_q, seqlen_q), natural log (with sinks: over them
        too); a row that sees no key gets out 0 and lse -inf (with sinks: the sink).
    """
    if not isinstance(return_softmax_lse, bool):
        raise TypeError(f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}")
    if isinstance(q, torch.Tensor) and use_ops(q):  # torch.compile: one opaque op writing the caches
        causal, window = check_window(causal, window_size)
        if not isinstance(cache_seqlens, torch.Tensor):
            cache_seqlens = _cache_seqlens(cache_seqlens, q.shape[0], q.device)
        out, lse = _kvcache_op(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window[0], window[1], softcap, rotary_interleaved,
            alibi_slopes, num_splits, sinks, check_bounds,
        )  # fmt: skip
        return (out, lse) if return_softmax_lse else out
    out, lse = kvcache_attention(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
        num_splits, sinks=sinks, check_bounds=check_bounds,
    )  # fmt: skip
    return (out, lse) if return_softmax_lse else out


@torch.library.custom_op("ringflash::kvcache_attention", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: torch.Tensor | None,
    num_splits: int,
    sinks: torch.Tensor | None,
    check_bounds: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_with_kvcache``'s (out, lse) as a ``torch.library`` op for torch.compile: the
    appends mutate k_cache/v_cache (declared), the rest is opaque to the compiler."""
    out, lse = kvcache_attention(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved,
        alibi_slopes, num_splits, sinks=sinks, check_bounds=check_bounds,
    )  # fmt: skip
    return out, lse


@_kvcache_op.register_fake
def _kvcache_fake(q, *_):
    batch, seqlen_q, heads_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def kvcache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_seqlens: int | torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: torch.Tensor | None,
    num_splits: int,
    *,
    sinks: torch.Tensor | None,
    check_bounds: bool,
    key_offset: int = 0,
    held: int | None = None,
    last_shard: bool = True,
    out_dtype: torch.dtype | None = None,
    into: torch.Tensor | None = None,
    spread: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_with_kvcache``'s (out, lse) (its arguments, checked here). For sequence
    parallelism (``ringflash.sp_kvcache``) this cache may be one shard of the sequences' caches,
    holding positions ``key_offset`` .. ``key_offset`` + ``held`` - 1 (held: default its
    capacity): cache_seqlens are the whole sequences' lengths, appended tokens land in the shard
    that holds their positions, and the result is this shard's partial (merge the shards' with
    the LSE rule, then the sinks: pass sinks=None). Only the ``last_shard`` checks that the
    appended tokens fit (the others hold earlier positions). out_dtype: the output's (default
    q's). into: None, or a contiguous float32 (q.numel() + q.numel() / head_dim,) tensor (with
    out_dtype float32, no sinks): out is written to its start and lse after it, as views of it
    (a buffer that a collective sends as it is). spread: None, or (spread_from, rank, world):
    the positions from spread_from on are dealt out round-robin to ``world`` shards (position p
    to rank (p - spread_from) % world), this shard ``rank`` keeping its in the slots after its
    ``held`` positions (up to its capacity), which then checks that they fit.

    What the checks and the launches' arguments derive from the arguments' shapes, strides,
    dtypes, devices and options is planned once per such key (``_plan``); a call with a known
    key skips to reading values (``check_bounds``) and launching."""
    try:
        key = (
            _meta(q), _meta(k_cache), _meta(v_cache), _meta(k), _meta(v), _meta(rotary_cos),
            _meta(rotary_sin), _seqlens_meta(cache_seqlens), _meta(cache_batch_idx), _meta(cache_leftpad),
            _meta(block_table), type(softmax_scale), softmax_scale, type(causal), causal, type(window_size),
            _typed_pair(window_size), type(softcap), softcap, type(rotary_interleaved), rotary_interleaved,
            _meta(alibi_slopes), type(num_splits), num_splits, _meta(sinks), type(check_bounds), check_bounds,
            key_offset, held, last_shard, out_dtype, spread,
        )  # fmt: skip
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # an argument of a kind no key is made of: checked below
        key = plan = None
    if plan is None:
        plan = _plan(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
            num_splits, sinks, check_bounds, key_offset, held, last_shard, out_dtype, spread,
        )  # fmt: skip
        if key is not None:
            _PLANS[key] = plan
            if len(_PLANS) > _MAX_PLANS:
                _PLANS.popitem(last=False)
    batch, seqlen_q, heads_q = plan.batch, plan.seqlen_q, plan.heads_q
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = cache_seqlens.contiguous()
    else:
        seqlens = _cache_seqlens(cache_seqlens, batch, q.device)
    batch_idx = None if cache_batch_idx is None else cache_batch_idx.contiguous()
    leftpad = None if cache_leftpad is None else cache_leftpad.contiguous()
    table = None if block_table is None else block_table.contiguous()
    seqlen_new = plan.seqlen_new
    if check_bounds and batch and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        limit = key_offset + plan.held if last_shard and spread is None else None
        rotary = None if rotary_cos is None else (rotary_cos, rotary_sin)
        _check_values(
            seqlens, seqlen_new, limit, key_offset, plan.held, batch_idx, plan.cache_rows, table,
            plan.page_size, rotary, max(seqlen_new, plan.q_rotary_span), leftpad, spread, plan.slots,
        )  # fmt: skip
    if rotary_cos is not None:
        positions = seqlens[:, None].long() + torch.arange(seqlen_new, device=q.device)
        k = apply_rotary(k, rotary_cos[positions], rotary_sin[positions], rotary_interleaved)
        q_positions = seqlens[:, None].long() + torch.arange(plan.q_rotary_span, device=q.device)
        q = apply_rotary(q, rotary_cos[q_positions], rotary_sin[q_positions], rotary_interleaved)
    if plan.append is not None:
        grid, append = plan.append
        append(grid, k, v, k_cache, v_cache, seqlens, batch_idx, table)
    out = lse = None
    if into is not None:
        out, lse = into[: q.numel()].view(q.shape), into[q.numel() :].view(batch, heads_q, seqlen_q)
    if plan.split is None:  # nothing to attend (the appends above still happen)
        if out is None:
            out = torch.empty(q.shape, device=q.device, dtype=out_dtype or q.dtype)
            lse = torch.empty((batch, heads_q, seqlen_q), device=q.device)
        out.zero_()
        lse.fill_(float("-inf"))
    else:
        slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
        out, lse = run_split_kv(
            plan.split, q, k_cache, v_cache, seqlens, batch_idx, table, slopes, leftpad, out, lse
        )
    return _with_sinks(out, lse, sinks)


class _Plan(NamedTuple):
    batch: int
    seqlen_q: int
    heads_q: int
    seqlen_new: int
    held: int  # positions this cache holds (from key_offset on)
    slots: int  # its capacity: held, then the positions dealt to it with ``spread``
    cache_rows: int  # rows of a dense cache, pages of a paged one
    page_size: int  # k_cache.shape[1]
    q_rotary_span: int  # positions of q's rotary: seqlen_q when causal or windowed, else 1
    append: tuple | None  # the append's (grid, launch); None: nothing to append
    split: SplitKVPlan | None  # None: nothing to attend


_MAX_PLANS = 1024
_PLANS: OrderedDict[tuple, _Plan] = OrderedDict()


def _meta(t: object) -> object:
    """A tensor argument's part of a plan key (anything else: its type and value)."""
    if isinstance(t, torch.Tensor):
        return (t.shape, t.stride(), t.dtype, t.device)
    return (type(t), t)


def _seqlens_meta(cache_seqlens: object) -> object:
    """cache_seqlens' part of a plan key: a tensor's description, else only its type (an int's
    value is checked at every call: a decode loop's growing lengths share one plan)."""
    return _meta(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens)


def _typed_pair(pair: object) -> tuple:
    """window_size's part of a key: its entries with their types (True == 1, but only the int
    is a valid entry)."""
    return tuple((type(w), w) for w in pair) if type(pair) is tuple else (pair,)


def _plan(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
    sinks, check_bounds, key_offset, held, last_shard, out_dtype, spread,
) -> _Plan:  # fmt: skip
    """Every check of ``kvcache_attention``'s arguments that needs no tensor's values, and the
    launch plan they lead to."""
    q = _check_tensor("q", q, 4)
    batch, seqlen_q, heads_q, head_dim = q.shape
    paged = block_table is not None
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, 4)
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}"
            )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    cache_rows, capacity, heads_k, cache_dim = k_cache.shape
    if cache_dim != head_dim or not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"k_cache's head_dim must be q's ({head_dim}, at most {MAX_HEAD_DIM}), got {cache_dim}"
        )
    if heads_k == 0 or heads_q % heads_k:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of the cache's heads_k ({heads_k})")
    causal, window = check_window(causal, window_size)
    softcap = check_softcap(softcap)
    scale = resolve_scale(softmax_scale, head_dim)
    slopes = check_alibi_slopes(alibi_slopes, batch, heads_q, q.device)
    check_sinks(sinks, heads_q, q.device)
    for name, flag in (("rotary_interleaved", rotary_interleaved), ("check_bounds", check_bounds)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = chosen), got {num_splits!r}")
    seqlen_new = _check_new_kv(k, v, batch, heads_k, head_dim, q)
    _cache_seqlens(cache_seqlens, batch, q.device)
    batch_idx = _index_tensor("cache_batch_idx", cache_batch_idx, (batch,), q.device)
    leftpad = _index_tensor("cache_leftpad", cache_leftpad, (batch,), q.device)
    table = _index_tensor("block_table", block_table, None, q.device)
    if paged:
        if table.dim() != 2 or table.shape[0] != batch:
            raise ValueError(
                f"block_table must be (batch, pages per sequence) = ({batch}, n), got {tuple(table.shape)}"
            )
        if batch_idx is not None:
            raise ValueError(
                "cache_batch_idx indexes dense caches; with block_table the table names the pages"
            )
        capacity *= table.shape[1]
    elif batch_idx is None and cache_rows < batch:
        raise ValueError(
            f"k_cache has {cache_rows} rows for a batch of {batch}: pass cache_batch_idx or a larger cache"
        )
    held = capacity if held is None else held
    if not 0 <= held <= capacity or key_offset < 0:
        raise ValueError(
            f"a cache shard holds positions from key_offset >= 0 ({key_offset}), at most its capacity "
            f"({capacity}) of them, got {held}"
        )
    spread_plan = None
    if spread is not None:
        spread_from, rank, world = spread
        if not 0 <= rank < world or key_offset + held > spread_from:
            raise ValueError(
                f"a shard's positions ({key_offset} .. {key_offset + held - 1}) must lie before spread_from "
                f"({spread_from}), its rank in [0, {world}), got {rank}"
            )
        spread_plan = (spread_from, rank, world, capacity)
    rotary = _check_rotary(rotary_cos, rotary_sin, head_dim, seqlen_new, q) is not None
    # Rotary positions: the new keys at cache_seqlens + i, q at cache_seqlens + t when causal or
    # windowed, else all at cache_seqlens.
    q_rotary_span = seqlen_q if causal or window != (-1, -1) else 1
    # Rotary makes new, contiguous q and k (``apply_rotary``): the launches take their strides.
    q_stride = _contiguous_strides(q.shape) if rotary else q.stride()
    k_stride = _contiguous_strides(k.shape) if rotary else k.stride() if seqlen_new else None
    split = None
    if batch and seqlen_q:
        left = window[0] if window[0] >= 0 else None
        right = 0 if causal else window[1] if window[1] >= 0 else None
        rows = seqlen_q * (heads_q // heads_k)
        slots = held if spread is None else capacity
        splits = num_splits or default_splits(batch, heads_k, rows, max(slots, 1), q.device, paged)
        split = plan_split_kv(
            tuple(q.shape), q_stride, q.dtype, tuple(k_cache.shape), k_cache.stride(), v_cache.stride(),
            seqlen_new, softmax_scale=scale, window=(left, right), softcap=softcap,
            alibi_batch_stride=None if slopes is None else 0 if alibi_slopes.dim() == 1 else heads_q,
            batch_idx=batch_idx is not None, table_stride=None if table is None else table.shape[1],
            leftpad=leftpad is not None, num_splits=splits, key_offset=key_offset, held=held,
            out_dtype=out_dtype or q.dtype, spread=spread_plan,
        )  # fmt: skip
    append = None
    if seqlen_new:
        append = plan_append(
            tuple(k.shape), k_stride, v.stride(), tuple(k_cache.shape), k_cache.stride(), v_cache.stride(),
            table_stride=None if table is None else table.shape[1], batch_idx=batch_idx is not None,
            key_offset=key_offset, held=held, spread=spread_plan,
        )  # fmt: skip
    page_size = k_cache.shape[1]
    return _Plan(
        batch, seqlen_q, heads_q, seqlen_new, held, capacity, cache_rows, page_size, q_rotary_span, append,
        split,
    )  # fmt: skip


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None):
    return (out, lse) if sinks is None else merge_sinks(out, lse, sinks)


def _check_new_kv(k, v, batch: int, heads_k: int, head_dim: int, q: torch.Tensor) -> int:
    """seqlen_new of the appended k/v (0 without), after checking their shapes and dtypes."""
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    if k is None:
        return 0
    for name, t in (("k", k), ("v", v)):
        _check_tensor(name, t, 4)
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}"
            )
        if t.shape[0] != batch or t.shape[2:] != (heads_k, head_dim):
            raise ValueError(
                f"{name} must be (batch, seqlen_new, heads_k, head_dim) = ({batch}, n, {heads_k}, "
                f"{head_dim}), got {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    return k.shape[1]


def _cache_seqlens(cache_seqlens: object, batch: int, device: torch.device) -> torch.Tensor:
    """cache_seqlens as an int32 (batch,) tensor on the device (an int is each sequence's)."""
    if cache_seqlens is None:
        cache_seqlens = 0
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    t = _index_tensor("cache_seqlens", cache_seqlens, (batch,), device)
    return t


def _index_tensor(name: str, t: object, shape: tuple | None, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be a torch.int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t.contiguous()


def _check_rotary(cos, sin, head_dim: int, seqlen_new: int, q: torch.Tensor):
    """(cos, sin) checked, or None without rotary."""
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin go together: pass both or neither")
    if seqlen_new == 0:
        raise ValueError(
            "rotary_cos/rotary_sin rotate the appended keys: pass k and v too (as flash-attn requires)"
        )
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must be a 2-D (seqlen_ro, rotary_dim / 2) tensor in q's dtype on q's device"
            )
    if cos.shape != sin.shape or not 1 <= 2 * cos.shape[1] <= head_dim:
        raise ValueError(
            f"rotary_cos/sin must share a shape (seqlen_ro, rotary_dim / 2), rotary_dim <= head_dim "
            f"({head_dim}); got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    return cos, sin


def _check_values(
    seqlens, seqlen_new: int, limit: int | None, key_offset: int, held: int, batch_idx, cache_rows: int,
    table, page_size: int, rotary, rotary_span: int, leftpad, spread=None, slots: int = 0,
) -> None:
    """Index values in range, read on the host in one copy. limit: the first position past
    every cache (None: not this shard's to check); key_offset, held: this cache's positions;
    cache_rows: its rows (or pages of page_size, with a table); spread, slots: the positions
    dealt to this shard from spread_from on, and its capacity for them after ``held``."""
    ends = seqlens + seqlen_new
    local = (ends - key_offset).clamp(0, held)  # slots in use per sequence
    if spread is not None:
        spread_from, rank, world = spread
        local = local + ((ends - spread_from - rank).clamp(min=0) + world - 1) // world
    parts = [seqlens.min()[None], ends.max()[None], local.max()[None]]
    if leftpad is not None:
        parts += [leftpad.min()[None], (leftpad - seqlens).max()[None]]
    if batch_idx is not None:
        parts += [batch_idx.min()[None], batch_idx.max()[None]]
    if table is not None and table.numel():
        # The pages this cache's keys use: the first ceil(local keys / page_size) entries.
        used = torch.arange(table.shape[1], device=table.device)[None] * page_size < local[:, None]
        parts += [torch.where(used, table, 0).min()[None], torch.where(used, table, 0).max()[None]]
    values = torch.cat([p.to(torch.int64) for p in parts]).tolist()
    low, high, used_slots = values[:3]
    if low < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {low}")
    if spread is not None and used_slots > slots:
        raise ValueError(
            f"rank {spread[1]}'s cache has {slots} slots: its {held} positions, then those dealt to it from "
            f"position {spread[0]} on, which reach {used_slots} slots at cache_seqlens + seqlen_new = {high}"
        )
    if limit is not None and high > limit:
        where = f"the last shard ends at position {limit}" if key_offset else f"the cache holds {limit} keys"
        raise ValueError(f"{where} per sequence, but cache_seqlens + seqlen_new reaches {high}")
    rotary_end = values[1] - seqlen_new + rotary_span  # the largest cache_seqlens + the span
    if rotary is not None and rotary_end > rotary[0].shape[0]:
        raise ValueError(
            f"rotary_cos/sin have {rotary[0].shape[0]} positions, but the new keys and queries reach "
            f"position {rotary_end - 1}"
        )
    rest = values[3:]
    if leftpad is not None:
        if rest[0] < 0 or rest[1] > 0:
            raise ValueError(
                "cache_leftpad entries must be in [0, cache_seqlens[b]] (the padding before each cache)"
            )
        rest = rest[2:]
    if batch_idx is not None:
        if rest[0] < 0 or rest[1] >= cache_rows:
            raise ValueError(
                f"cache_batch_idx entries must be in [0, {cache_rows}), got {rest[0]}..{rest[1]}"
            )
        rest = rest[2:]
    if rest and (rest[0] < 0 or rest[1] >= cache_rows):
        raise ValueError(
            f"block_table entries in use must be pages in [0, {cache_rows}), got {rest[0]}..{rest[1]}"
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, head_dim) with its first rotary_dim = 2 * cos.shape[-1] dims
    rotated by cos/sin (batch, seqlen or 1, rotary_dim / 2) per position; the rest unchanged."""
    half = cos.shape[-1]
    cos, sin = cos[:, :, None].float(), sin[:, :, None].float()
    rot, rest = x[..., : 2 * half].float(), x[..., 2 * half :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rotated = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)
