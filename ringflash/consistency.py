"""Every rank of a group must call a sequence-parallel function with the same arguments.

When they do not (different sequence lengths, dtypes, masks, layouts, packed documents...), the
transfers that follow do not match: gloo aborts the process ("Received data size doesn't match
expected size") and NCCL hangs or computes garbage. ``check_ranks_agree`` turns that into a
ValueError on every rank, naming what differs and each rank's value.

Why a check on every call rather than once per call signature: a cache cannot be made safe.
A rank that finds its signature cached skips the exchange while a rank that does not (or that
finds a *different* cached signature, e.g. after warm-up on two sequence lengths) joins it, so
the first sits in the ring's transfers while the second waits in the check: the very hang this
module exists to prevent. So every call makes one fixed-size exchange of a 56-bit digest of the
signature on the host (``comm.host_values_agree``), which needs no device synchronization and
adds no kernel to the device stream. Only when the digests differ is the full signature gathered
to say what differs. A call that found its setup cached takes the digest from the setup's memo
(``join_rank_check``'s ``digests``) instead of describing and hashing every argument again: the
memo saves that work, never the exchange.

Cost: it waits on the host, never on the device stream. Ranks of one host compare through a
shared-memory mailbox (``comm.HostMailbox``: 8-14 us per call between 2 CPU ranks of the CI
machine, docs/experiments.md §54); a group spanning hosts uses a 16-byte all-reduce over gloo
(0.8 ms there, 1.9 ms between 2 ranks of an H200 node), which the host hides only where it runs
ahead of the device. ``RINGFLASH_CHECK_RANKS=0`` (set the same on every rank) skips the exchange,
for a setup known to be consistent; disagreeing ranks then fail as they would without this
module.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from .comm import host_all_gather_object, host_values_agree
from .kernels.merge import check_sinks
from .kernels.problem import cu_seqlens_host
from .kernels.tile_mask import TileMask
from .layouts import ChunkLayout


def describe(x: object) -> object:
    """A picklable, comparable summary of an argument: tensors by shape (values are not
    compared: that would read device memory back), ints/floats/strings/tuples as they are, a
    block mask by its digest."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype).removeprefix("torch."))
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return tuple(describe(i) for i in x)
    if isinstance(x, ChunkLayout):
        return ("ChunkLayout", x.chunks)
    if isinstance(x, TileMask):  # by content, hashed once per mask (a device sync the first time)
        return ("TileMask", x.batch, x.heads, x.seqlen_q, x.seqlen_k, x.block_q, x.block_k, x.digest())
    return type(x).__name__


def cu_seqlens_values(cu_seqlens: object) -> object:
    """The boundaries of ``cu_seqlens`` as a tuple of ints (a device tensor is read back once
    per tensor and version, ``cu_seqlens_host``, as ``document_lengths`` reads it), or a summary
    of an argument that is not one."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and not cu_seqlens.is_floating_point():
        return cu_seqlens_host(cu_seqlens)
    return describe(cu_seqlens)


def _grad_flows(q: object, k: object, v: object) -> bool:
    """Whether gradients will flow through this call (its backward communicates too)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))


def call_signature(q: object, k: object, v: object, **options: object) -> dict[str, object]:
    """What every rank of a group must agree on: q/k/v shapes and dtypes, whether gradients will
    flow (the backward communicates too), every option; cu_seqlens by value."""
    signature = {name: describe(t) for name, t in (("q", q), ("k", k), ("v", v))}
    signature["grad"] = _grad_flows(q, k, v)
    for name, value in options.items():
        signature[name] = cu_seqlens_values(value) if name == "cu_seqlens" else describe(value)
    return signature


def _digest(signature: dict[str, object]) -> int:
    text = repr(sorted(signature.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


def _checks_off() -> bool:
    return os.environ.get("RINGFLASH_CHECK_RANKS", "1") == "0"


def _agree_or_raise(group: dist.ProcessGroup, digest: int, signature_of: Callable[[], dict]) -> None:
    """Compare ``digest`` across ``group``; where ranks differ, gather every rank's full
    signature (``signature_of()``) and raise ValueError naming what differs."""
    if not host_values_agree(digest, group):
        every = host_all_gather_object(signature_of(), group)
        names = sorted({n for s in every for n in s if len({repr(s.get(n)) for s in every}) > 1})
        lines = [
            f"  {n}: " + ", ".join(f"rank {r}: {s.get(n)!r}" for r, s in enumerate(every)) for n in names
        ]
        raise ValueError(
            "the ranks of the sequence-parallel group called with different arguments (every rank "
            "must pass the same shapes, dtype and options):\n" + "\n".join(lines)
        )


def check_ranks_agree(
    group: dist.ProcessGroup, signature: dict[str, object], error: Exception | None = None
) -> None:
    """Raise ValueError on every rank of ``group`` unless every rank passed the same
    ``signature`` (argument name -> ``describe``d value); then re-raise ``error``, the
    argument error this rank found before the check (a rank whose arguments fail locally must
    still join the check, or the others would wait for it forever; its error message is part
    of its signature). Every rank of ``group`` must call this once per call."""
    if _checks_off():
        if error is not None:
            raise error
        return
    if error is not None:
        signature = {**signature, "error": f"{type(error).__name__}: {error}"}
    _agree_or_raise(group, _digest(signature), lambda: signature)
    if error is not None:
        raise error


def join_rank_check(
    group: dist.ProcessGroup, check_ranks: bool, error: Exception | None, q: object, k: object, v: object,
    *, digests: dict | None = None, **options: object,
) -> None:  # fmt: skip
    """A setup's ranks' check: ``check_ranks_agree`` on ``call_signature(q, k, v, **options)``,
    or (a caller that checked a larger group already) just ``error``, raised if there is one.

    ``digests``: the memo of the cached setup this call found (or is building). Its key
    stands for q/k/v's layouts, the group and every option but ``sinks`` (by type and value,
    tensors by identity and version), so within it the signature can differ only in whether
    gradients flow and in ``sinks``: the digest is looked up by those two and computed once,
    instead of describing and hashing every argument on every call (32 µs on an H200 host).
    The exchange still runs on every call."""
    if not check_ranks or _checks_off():
        if error is not None:
            raise error
        return
    if digests is None or error is not None:
        check_ranks_agree(group, call_signature(q, k, v, **options), error)
        return
    memo = (_grad_flows(q, k, v), describe(options.get("sinks")))
    digest = digests.get(memo)
    if digest is None:
        digest = digests[memo] = _digest(call_signature(q, k, v, **options))
    _agree_or_raise(group, digest, lambda: call_signature(q, k, v, **options))


def join_cached_rank_check(
    group: dist.ProcessGroup, check_ranks: bool, q: object, k: object, v: object, *, heads_q: int,
    digests: dict, sinks: object, **options: object,
) -> torch.Tensor | None:  # fmt: skip
    """The ranks' check of a call that found its setup cached (``join_rank_check`` from the
    setup's ``digests``), after checking ``sinks`` (heads_q,), the one argument outside a setup's
    key (a parameter that changes every step); returns the checked sinks. A sinks error is
    raised after the check, which this rank still joins."""
    error = None
    try:
        sinks = check_sinks(sinks, heads_q, q.device)
    except (ValueError, TypeError) as e:
        error = e
    join_rank_check(group, check_ranks, error, q, k, v, digests=digests, sinks=sinks, **options)
    return sinks
