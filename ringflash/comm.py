"""All communication of the sequence-parallel layer goes through this module."""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import socket
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import numpy as np
import torch
import torch.distributed as dist

from .graph_replay import Deferred, host_call

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


GroupLike = Union[dist.ProcessGroup, "DeviceMesh", tuple["DeviceMesh", str], None]


def resolve_group(group: GroupLike) -> dist.ProcessGroup:
    """The process group of a ``group=`` argument: a ProcessGroup, a 1-D DeviceMesh, a
    (DeviceMesh, dim name) pair, or None for the default (world) group. Errors clearly when
    torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ringflash's sequence-parallel functions need torch.distributed: call "
            "torch.distributed.init_process_group (e.g. launch with torchrun) first"
        )
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group is a {group.ndim}-D DeviceMesh {group.mesh_dim_names}: pass a 1-D mesh "
                "(mesh[dim_name]) or a (mesh, dim_name) pair"
            )
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        if dim not in (mesh.mesh_dim_names or ()):
            raise ValueError(
                f"group: {dim!r} is not a dimension of the mesh, whose are {mesh.mesh_dim_names}"
            )
        return mesh.get_group(dim)
    raise TypeError(
        "group must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, dim_name) "
        f"pair or None, got {type(group).__name__}"
    )


def resolve_group_or_raise(group: GroupLike, error: Exception | None) -> dist.ProcessGroup:
    """``resolve_group(group)`` after argument checks deferred so that every rank joins the rank
    check: where torch.distributed is not set up, the argument error found first (if any) is
    raised instead of resolve_group's RuntimeError, as it says more."""
    try:
        return resolve_group(group)
    except RuntimeError:
        if error is not None:
            raise error from None
        raise


def group_name(group: GroupLike) -> str:
    """The registered name of a group (``resolve_group``'s forms), by which custom ops take it."""
    return resolve_group(group).group_name


def group_from_name(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name`` (inverse of ``group_name``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


_HOST_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group over the ranks of ``group`` whose collectives run on CPU tensors without touching a
    device stream: ``group`` itself when its backend has gloo (``gloo``, ``cpu:gloo,cuda:nccl``),
    else a gloo group over the same ranks, created by the first call (which every rank of
    ``group`` makes, as it does every call here) and cached."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _HOST_GROUPS:
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _HOST_GROUPS[ranks]


def host_values_agree(value: int, group: dist.ProcessGroup) -> bool:
    """Whether every rank of ``group`` passed the same ``value`` (any int; outside [0, 2^56) a
    56-bit hash of it is compared). Ranks on one host
    compare through a shared-memory mailbox (``HostMailbox``: microseconds); a group spanning
    hosts by one all-reduce (MAX of value and -value) of 16 bytes over gloo (0.5-2 ms per call,
    docs/experiments.md §54). Every rank of the group must call this at the same point, as for a
    collective."""
    if dist.get_world_size(group) == 1:
        return True
    if not 0 <= value <= _MASK56:  # a 56-bit stand-in, the same on every rank
        value = int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "big")
    mailbox = host_mailbox(group)
    if mailbox is not None:
        return mailbox.agree(value)
    pair = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=host_group(group))
    return int(pair[0]) == -int(pair[1])  # max == min


_MASK56 = (1 << 56) - 1
_SHIFT, _LOW = np.uint64(56), np.uint64(_MASK56)  # numpy 1.x turns uint64 op Python int into float64
_WAIT_LIMIT = 1800.0  # seconds, torch's default collective timeout


class HostMailbox:
    """A word per rank and call parity in a shared-memory mapping of the ranks of one host.

    At its c-th check a rank stores one aligned 64-bit word, ``tag(c) << 56 | value`` (``tag``
    in 1..255, never 0 like a fresh mapping's words), in its slot of parity c % 2, then waits
    until every rank's slot of that parity carries tag(c) and compares the values. One store
    per word is atomic on x86-64 and AArch64, so a reader never sees a tag with another call's
    value. Two parities suffice: a rank can be at most one check ahead of any other (passing
    check c needs every rank to have stored its word of c), so the word of c - 1 it overwrites
    at c + 1 has been read by all. Why it cannot deadlock: every rank of the group makes every
    check, in the same order (the same rule as the collectives that follow); a rank only waits
    for the others to reach the check it is at, and one that never comes (a crashed rank) ends
    the wait with a RuntimeError after ``timeout`` seconds, naming it."""

    def __init__(self, words, rank: int, timeout: float) -> None:
        self._words, self._rank, self._timeout = words, rank, timeout
        self._checks = 0

    def agree(self, value: int) -> bool:
        """Whether every rank passed ``value`` (0 <= value < 2^56) to this check."""
        tag = self._checks % 255 + 1
        parity = self._checks % 2
        self._checks += 1
        self._words[self._rank, parity] = np.uint64((tag << 56) | value)
        column = self._words[:, parity]
        spins, deadline = 0, None
        while not ((column >> _SHIFT) == np.uint64(tag)).all():
            spins += 1
            if spins < 64:  # the others usually arrive within microseconds
                continue
            if spins < 2048:  # yield: on a busy machine the rank waited for may need this core
                _yield_core()
                continue
            if deadline is None:  # waiting on another rank's host: stop burning a core
                deadline = time.monotonic() + self._timeout
            if time.monotonic() > deadline:
                late = [r for r, w in enumerate(column.tolist()) if w >> 56 != tag]
                raise RuntimeError(
                    f"ranks {late} did not reach ringflash's argument check in {self._timeout:.0f} s"
                )
            time.sleep(5e-5)
        return bool(((column & _LOW) == np.uint64(value)).all())


# os.sched_yield gives the core away and returns within a microsecond; time.sleep(0) sleeps a
# timer slack on Linux (57-79 us measured), which a rank that is only a little ahead then pays.
_yield_core = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))

_MAILBOXES: dict[tuple[int, ...], HostMailbox | None] = {}


def _host_identity() -> tuple[str, str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def host_mailbox(group: dist.ProcessGroup) -> HostMailbox | None:
    """The group's ``HostMailbox``, set up by the first call (which every rank makes, as it
    makes every check), or None where the ranks are not on one host or cannot share a mapping
    (no /dev/shm, separate /dev/shm namespaces): they then check over gloo. Set up with three
    gloo gathers: where each rank runs, the name of the file rank 0 creates in /dev/shm and a
    nonce it writes there, and whether each rank mapped it and read the nonce back; rank 0
    removes the file once all have mapped it (the mappings stay)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks in _MAILBOXES:
        return _MAILBOXES[ranks]
    mailbox = None
    world, rank = len(ranks), dist.get_rank(group)
    if world > 1 and len(set(host_all_gather_object(_host_identity(), group))) == 1:
        path = nonce = None
        if rank == 0:
            nonce = secrets.randbits(63)
            path = f"/dev/shm/ringflash-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                with open(path, "wb") as f:
                    f.write(nonce.to_bytes(8, "little") + bytes(16 * world))
            except OSError:
                path = None
        path, nonce = host_all_gather_object((path, nonce), group)[0]
        words = None
        if path is not None:
            try:
                with open(path, "r+b") as f:
                    mapping = mmap.mmap(f.fileno(), 8 + 16 * world)
                if int.from_bytes(mapping[:8], "little") == nonce:
                    words = np.frombuffer(mapping, dtype=np.uint64, offset=8).reshape(world, 2)
            except OSError:
                words = None
        mapped = host_all_gather_object(words is not None, group)
        if rank == 0 and path is not None:
            os.unlink(path)
        if all(mapped):
            mailbox = HostMailbox(words, rank, _WAIT_LIMIT)
    _MAILBOXES[ranks] = mailbox
    return mailbox


def host_all_gather_object(obj: object, group: dist.ProcessGroup) -> list:
    """Every rank's picklable ``obj``, in group-rank order, gathered on the host."""
    objs: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(objs, obj, group=host_group(group))
    return objs


def use_high_priority_comm() -> None:
    """Give the NCCL process groups created after this call high-priority CUDA streams.

    Call it before ``init_process_group`` / ``new_group``; it sets ``TORCH_NCCL_HIGH_PRIORITY=1``
    unless the environment already sets it. Why: a ring transfer issued beside a running
    attention kernel otherwise gets SMs only once that kernel has dispatched all of its
    blocks, so the transfer runs after the kernel instead of under it (on 2 H200s at 32K
    tokens: backward exposed communication 1.4 -> 0.6 ms; docs/performance.md).
    """
    if dist.is_available() and dist.is_initialized():
        warnings.warn(
            "use_high_priority_comm() was called after init_process_group: process groups created "
            "before it keep normal-priority NCCL streams; call it first",
            stacklevel=2,
        )
    os.environ.setdefault("TORCH_NCCL_HIGH_PRIORITY", "1")


class PendingExchange:
    """Handle of an exchange in flight; ``wait`` orders later work after it (no host block on NCCL)."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


class RingComm:
    """Point-to-point exchange between neighbours of a ring over a process group."""

    def __init__(self, group: GroupLike = None) -> None:
        self.group = resolve_group(group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    @classmethod
    def known(cls, group: dist.ProcessGroup, rank: int, world_size: int) -> RingComm:
        """A RingComm over ``group`` whose rank and size the caller read before (a cached
        setup): asking torch.distributed again costs tens of microseconds per call."""
        comm = cls.__new__(cls)
        comm.group, comm.rank, comm.world_size = group, rank, world_size
        return comm

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank % self.world_size)

    def exchange(
        self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], offset: int = 1
    ) -> PendingExchange | Deferred:
        """Send ``send`` to rank + offset and receive into ``recv`` from rank - offset, asynchronously.

        Every rank of the group must call this with the same offset and matching shapes. Issue
        it *before* the compute it should overlap: NCCL orders a new exchange after the work
        already queued on the current stream. Inside a ``GraphReplay``'s capture the transfer is
        left out of the graphs and issued by each replay (``graph_replay.host_call``): the
        handle is then a ``Deferred``, whose ``wait`` is all the caller may use.
        """
        if self.world_size == 1 or offset % self.world_size == 0:
            for r, s in zip(recv, send):
                r.copy_(s)
            return PendingExchange([])
        to_rank, from_rank = (self.rank + offset) % self.world_size, (self.rank - offset) % self.world_size
        send, recv = tuple(send), tuple(recv)  # as they are now, for a replay's transfer
        if not _GROUP_P2P:
            ops = [dist.P2POp(dist.isend, s, self._global(to_rank), self.group) for s in send]
            ops += [dist.P2POp(dist.irecv, r, self._global(from_rank), self.group) for r in recv]
            return host_call(lambda: PendingExchange(dist.batch_isend_irecv(ops)))
        # Never inside a CUDA graph that ringflash captures (graph_replay: its replays issue it).
        return host_call(lambda: PendingExchange(group_p2p(self.group, send, recv, to_rank, from_rank)))

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on all ranks), in group-rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


# The process group's own send/recv, which dist.batch_isend_irecv calls after a Python layer of
# checks and rank conversions per op (2 ranks of an H200 host, tiny problem: the ring's fwd+bwd
# 2726 -> 2499 µs of host time, docs/experiments.md §69). Private methods of ProcessGroup
# (torch 2.11-2.15 have them); without them the exchange takes batch_isend_irecv.
_GROUP_P2P = all(
    hasattr(dist.ProcessGroup, name) for name in ("_start_coalescing", "_end_coalescing", "_get_backend")
)


def group_p2p(
    group: dist.ProcessGroup, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], to_rank: int,
    from_rank: int,
) -> list:  # fmt: skip
    """Send ``send`` to group rank ``to_rank`` and receive ``recv`` from group rank
    ``from_rank``, as ``dist.batch_isend_irecv`` does with the same ops in this order: one
    coalesced batch where the backend coalesces (NCCL: one launch, one Work), else one Work per
    op (gloo). Returns the Works to wait on."""
    device = (send or recv)[0].device
    if getattr(group._get_backend(device), "supports_coalescing", False):
        group._start_coalescing(device)
        for s in send:
            group.send([s], to_rank, 0)
        for r in recv:
            group.recv([r], from_rank, 0)
        return [group._end_coalescing(device)]
    return [group.send([s], to_rank, 0) for s in send] + [group.recv([r], from_rank, 0) for r in recv]


def all_gather_async(
    outs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], group: dist.ProcessGroup, world_size: int
) -> PendingExchange | Deferred:
    """Start gathering every rank's ``xs[i]`` into ``outs[i]`` (world_size, *xs[i].shape),
    contiguous, in group-rank order, one collective per tensor (coalesced ones measured no faster
    on two H200s, docs/experiments.md §75). Issue it before the compute it should overlap;
    ``wait`` before reading. Inside a ``GraphReplay``'s capture, issued by each replay instead
    (as ``RingComm.exchange``)."""
    xs = [x.contiguous() for x in xs]
    if world_size == 1:
        for out, x in zip(outs, xs):
            out[0].copy_(x)
        return PendingExchange([])
    flat_outs, flat_xs = [out.view(-1) for out in outs], [x.view(-1) for x in xs]
    return host_call(lambda: PendingExchange(
        [_all_gather_single(out, x, group=group, async_op=True) for out, x in zip(flat_outs, flat_xs)]
    ))  # fmt: skip


def reduce_scatter_async(
    outs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], group: dist.ProcessGroup, world_size: int
) -> PendingExchange | Deferred:
    """Start summing each ``xs[i]`` (world_size, *outs[i].shape), contiguous, over the ranks, rank
    r receiving slot r in ``outs[i]``: the transpose of ``all_gather_async``. ``wait`` before
    reading ``outs`` or writing ``xs``."""
    if world_size == 1:
        for out, x in zip(outs, xs):
            out.copy_(x[0])
        return PendingExchange([])
    flat_outs, flat_xs = [out.view(-1) for out in outs], [x.reshape(-1) for x in xs]
    return host_call(lambda: PendingExchange(
        [_reduce_scatter_single(out, x, group=group, async_op=True) for out, x in zip(flat_outs, flat_xs)]
    ))  # fmt: skip


def all_to_all_async(
    out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup, world_size: int
) -> PendingExchange | Deferred:
    """Start the all-to-all over dim 0 of ``x`` (world_size, ...), contiguous, with equal chunks:
    chunk i goes to group rank i, and chunk j of ``out`` (like ``x``) comes from rank j. ``wait``
    before reading ``out`` or writing ``x``. Inside a ``GraphReplay``'s capture, issued by each
    replay instead (as ``RingComm.exchange``)."""
    if world_size == 1:
        out.copy_(x)
        return PendingExchange([])
    return host_call(lambda: PendingExchange([_start_all_to_all(out, x, group)]))


# The process group's own all-to-all, which dist.all_to_all_single calls after a Python layer of
# checks: 24-28 against 35-66 µs of host time per call (2×H200, tiny tensors, docs/experiments.md
# §77). A method of ProcessGroup in torch 2.11-2.15; without it, all_to_all_single.
_GROUP_ALL_TO_ALL = hasattr(dist.ProcessGroup, "alltoall_base")


def _start_all_to_all(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup):
    if _GROUP_ALL_TO_ALL:
        return group.alltoall_base(out, x, [], [], dist.AllToAllOptions())
    return dist.all_to_all_single(out, x, group=group, async_op=True)


class PendingPrefix:
    """Handle of ``exclusive_prefix_sum`` in flight; ``wait`` returns (prefix, total)."""

    def __init__(self, gathered: torch.Tensor, work, rank: int) -> None:
        self._gathered, self._work, self._rank = gathered, work, rank

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        # Differentiable sums over the gathered deltas: the gradient of rank j's delta becomes the
        # sum of the gradients of every later rank's prefix and of every rank's total.
        return self._gathered[: self._rank].sum(0), self._gathered.sum(0)


def exclusive_prefix_sum(x: torch.Tensor, group: dist.ProcessGroup) -> PendingPrefix:
    """Start an exclusive prefix sum of ``x`` over the group's ranks, asynchronously, differentiable.

    ``wait()`` gives (sum of ``x`` over the ranks before this one (zeros on rank 0), sum over all
    ranks). Every rank calls it with the same shape. One all-gather: each rank receives
    world_size x ``x.numel()`` elements (independent of sequence length); the backward is one
    all-reduce of as many. Issue it before the compute it should overlap, ``wait`` after.
    """
    holder: list = []
    gathered = _AllGatherAsync.apply(x, group, holder)
    return PendingPrefix(gathered, holder[0] if holder else None, dist.get_rank(group))


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (now deprecated) to
# all_gather_single and reduce_scatter_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGatherAsync(torch.autograd.Function):
    """All-gather into (world_size, *x.shape) whose result is valid after the work in ``holder``
    completes; backward: each rank gets the sum over ranks of the gradient of its own slot."""

    @staticmethod
    def forward(ctx, x, group, holder):
        ctx.group = group
        x = x.contiguous()
        world = dist.get_world_size(group)
        if world == 1:
            return x[None].clone()
        gathered = x.new_empty((world, *x.shape))  # returned whole: a view would trip autograd's checks
        holder.append(_all_gather_single(gathered.view(-1), x.view(-1), group=group, async_op=True))
        return gathered

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_world_size(ctx.group) > 1:
            grad = grad.clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None, None


def relay_receive(
    like: torch.Tensor, group: dist.ProcessGroup, backward: bool = False
) -> torch.Tensor | None:
    """The state handed along the ranks: rank r receives, blocking, what rank r - 1 passes to
    ``relay_send`` (from rank r + 1 with ``backward``, as a gradient goes back), in a tensor of
    ``like``'s shape and dtype; None on the first rank (the last with ``backward``)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peer = rank + 1 if backward else rank - 1
    if not 0 <= peer < world:
        return None
    received = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    _transfer(dist.irecv, received, peer, group)
    return received


def relay_send(state: torch.Tensor, group: dist.ProcessGroup, backward: bool = False) -> None:
    """Send ``state`` to rank r + 1 (to r - 1 with ``backward``); nothing on the last rank (the
    first with ``backward``). Pair with one ``relay_receive`` on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peer = rank - 1 if backward else rank + 1
    if 0 <= peer < world:
        _transfer(dist.isend, state.contiguous(), peer, group)


def broadcast_from_last(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The last rank's ``t`` on every rank (a copy)."""
    t = t.contiguous().clone()
    dist.broadcast(t, dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return t


def sum_over_ranks(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``t`` over the group's ranks (a copy)."""
    t = t.contiguous().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _transfer(op, t: torch.Tensor, peer: int, group: dist.ProcessGroup) -> None:
    """Send (``op`` = dist.isend) or receive (dist.irecv) ``t`` to or from group rank ``peer``
    as a batched P2P call, and wait: NCCL runs unbatched sends and receives as collectives,
    serialized with every other operation of the group (and warns of it). A batch that is a
    group's first operation must include every rank; the relay's callers run the ranks'
    agreement check (a collective) first."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, t, dist.get_global_rank(group, peer), group)]):
        work.wait()
