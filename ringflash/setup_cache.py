"""Sequence-parallel setups (validated base problem, plan, comm) built once per call signature.

A ring or all-gather call checks its shards, resolves its group, reads the document lengths and
plans every step's kernel calls: hundreds of microseconds of Python per call, the same for every
layer and step of a model. The setup depends only on q/k/v's shapes, strides, dtypes and devices,
the group and the options, tensors among them (ALiBi slopes, cu_seqlens) by identity and version,
a block mask by identity:
a call whose key was seen takes what was built then. The ranks' agreement check is not part of
it and runs on every call (``consistency``): a rank that finds its setup cached still joins it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist

from .comm import resolve_group
from .kernels.plans import identity_key, layout_key
from .kernels.tile_mask import TileMask
from .layouts import ChunkLayout

_SCALARS = (bool, int, float, str, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)


def _option_key(value: object) -> object:
    if type(value) in _SCALAR_TYPES:  # most options: first, a call pays this for every option
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return identity_key(value)
    if isinstance(value, TileMask):  # immutable: its identity stands for it (held weakly: ``put``)
        return (TileMask, id(value))
    if isinstance(value, ChunkLayout):  # frozen, compared by value
        return value
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_option_key(x) for x in value))
    if isinstance(value, _SCALARS):
        return (type(value), value)
    raise TypeError  # a value the key cannot stand for: never cached


class SetupCache:
    """Setups by call signature, the least recently used dropped past ``size``."""

    def __init__(self, size: int = 64) -> None:
        self._entries: OrderedDict[tuple, tuple[object, weakref.ref, tuple, tuple]] = OrderedDict()
        self._size = size
        self.builds = 0  # setups stored (tests count them)

    def key(self, q: object, k: object, v: object, group: object, **options: object) -> tuple | None:
        """The call's key, or None where it cannot be cached (tensor subclasses, inference
        tensors among the options, values of other types)."""
        try:
            # The options in the caller's order: a call site passes them in one order (another
            # order only misses the cache).
            options_key = tuple(map(_option_key, options.values()))
            return (layout_key(q), layout_key(k), layout_key(v), id(group), tuple(options), options_key)
        except TypeError:
            return None

    def get(self, key: tuple | None, group: object) -> object | None:
        """The setup stored under ``key`` for this ``group`` (the key holds its id; a group that
        died and whose id was reused is not the one stored), or None."""
        if key is None:
            return None
        hit = self._entries.get(key)
        if hit is None or hit[1]() is not group or any(ref() is None for ref in hit[3]):
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def lookup(
        self, q: object, k: object, v: object, group: object, error: Exception | None, **options: object
    ) -> tuple[tuple | None, dist.ProcessGroup | None, object | None]:
        """(key, the group ``group=`` names, the setup stored for them or None) of a call; a call
        with an argument error, or whose group names none, gets no key (it is never cached, and
        its setup raises in its usual order)."""
        resolved = _resolved_or_none(group)
        if error is not None or resolved is None:
            return None, resolved, None
        key = self.key(q, k, v, resolved, **options)
        return key, resolved, self.get(key, resolved)

    def put(self, key: tuple | None, setup: object, group: object, *pinned: object, weak: tuple = ()) -> None:
        """Store ``setup`` for ``group``, held weakly: a cache that kept a process group alive past
        ``destroy_process_group`` would destroy it at interpreter exit, when gloo's threads can no
        longer be joined cleanly ("terminate called without an active exception"). ``pinned``: the
        tensors whose ids are in the key, held so that the ids cannot be reused while the entry
        lives. ``weak``: objects in the key by id that the entry must not keep alive (block masks:
        a model that builds one per batch would otherwise keep 64 of them and their plans' views
        on the GPU); the entry is dropped when one of them dies."""
        self.builds += 1
        if key is None:
            return
        drop = lambda _ref, key=key: self._entries.pop(key, None)  # noqa: E731
        self._entries[key] = (setup, weakref.ref(group), pinned, tuple(weakref.ref(w, drop) for w in weak))
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)


def _resolved_or_none(group: object) -> dist.ProcessGroup | None:
    """The process group a ``group=`` argument names (``comm.resolve_group``), or None where it
    names none: such a call is not cached, and its setup raises the error in its usual order."""
    try:
        return resolve_group(group)
    except (RuntimeError, TypeError, ValueError):
        return None
