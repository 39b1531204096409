"""``ShardedKVCache``: transformers' ``generate`` over a KV cache sharded across a process group.

Every rank runs the same ``generate`` call on the same tokens (the model's weights and
activations replicated); the cache is what is split: each rank's layers hold positions
``shard_range`` = (start, length) of every sequence (default rank r: r * C .. (r + 1) * C - 1),
or with ``spread_from`` a range of the prompt and every world-th token generated after it.
A layer's ``update`` keeps no keys itself: it hands the new tokens' K/V to the attention call
that receives the key tensor it returned (``take_pending``, by that tensor's identity, so
nothing left over from an interrupted step reaches another call), which runs
``sp_flash_attn_with_kvcache`` on this rank's shard (``integrations.hf.enable``'s attention
does). Needs transformers >= 5 (its ``CacheLayerMixin``) and a model whose attention is
ringflash's (``enable()``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.cache_utils import Cache, CacheLayerMixin

from ..comm import resolve_group

# id(key tensor update returned) -> (that tensor, layer, new keys, new values, tokens before
# them): what a layer's update handed to the attention call that follows it. The entry holds the
# tensor, so its id is not reused while the entry exists.
_PENDING: dict[int, tuple] = {}


class ShardedKVLayer(CacheLayerMixin):
    """One layer's shard: keys/values (batch, capacity, heads_k, head_dim) in ringflash's layout."""

    is_compileable = False
    is_sliding = False

    def __init__(
        self, layer_idx: int, capacity: int, shard_range: tuple[int, int] | None, group,
        spread_from: int | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.layer_idx, self.capacity, self.shard_range, self.group = layer_idx, capacity, shard_range, group
        self.spread_from = spread_from
        # Ranges that every rank can compute for every rank (the defaults): the appends are then
        # checked here, on values every rank holds alike, and the attention reads nothing back.
        self.ranges_known = shard_range is None or shard_range == (dist.get_rank(group) * capacity, capacity)
        self.length = 0  # tokens of each sequence so far, on every rank alike
        self.pending_id: int | None = None  # this layer's entry in _PENDING, until attended

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads_k, _, head_dim = key_states.shape
        self.keys = key_states.new_zeros(batch, self.capacity, heads_k, head_dim)
        self.values = value_states.new_zeros(batch, self.capacity, heads_k, head_dim)
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hand the new tokens' K/V (batch, heads_k, new, head_dim) to this layer's attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if _PENDING.pop(self.pending_id, None) is not None:  # the last step's never reached ringflash
            self.pending_id = None
            raise ValueError(
                f"ShardedKVCache layer {self.layer_idx}: the previous step's keys were not attended by "
                "ringflash's attention; load the model with attn_implementation=integrations.hf.enable(...)"
            )
        if self.ranges_known:
            self._check_room(self.length + key_states.shape[2])
        new_k, new_v = key_states.transpose(1, 2), value_states.transpose(1, 2)
        _PENDING[id(key_states)] = (key_states, self, new_k, new_v, self.length)
        self.pending_id = id(key_states)
        self.length += key_states.shape[2]
        return key_states, value_states

    def _check_room(self, end: int) -> None:
        """ValueError unless positions 0 .. end - 1 fit the ranks' caches (default ranges: the
        same answer on every rank, so all raise together)."""
        world = dist.get_world_size(self.group)
        if self.spread_from is None:
            room, needed = world * self.capacity, end
        else:  # rank 0 takes the most dealt positions: its prompt share, then every world-th
            share = self.spread_from // world
            room, needed = self.capacity, share + max(0, -(-(end - self.spread_from) // world))
        if needed > room:
            raise ValueError(
                f"ShardedKVCache layer {self.layer_idx}: {end} tokens per sequence need {needed} positions "
                f"of a rank's cache, which holds {room}; make the cache's capacity larger"
            )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class ShardedKVCache(Cache):
    """A ``past_key_values`` for ``model.generate`` whose keys stay sharded across ``group``.

    Args:
        num_layers: the model's attention layers (``config.num_hidden_layers``).
        capacity: positions each rank's layers can hold (per sequence).
        group: the process group (default: the world); every rank calls ``generate`` alike.
        shard_range: (start, length) of the positions this rank holds (default (rank * capacity,
            capacity)), as in ``sp_flash_attn_with_kvcache``.
        spread_from: None, or a position T (e.g. the prompt's length, a multiple of the group's
            size): the tokens from T on are dealt out round-robin over the ranks, which keeps
            the shards balanced however many are generated (``sp_flash_attn_with_kvcache``'s
            keyword; each rank then holds T / world positions before T, unless ``shard_range``
            says otherwise, and capacity - T / world of the dealt ones).
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        group: dist.ProcessGroup | None = None,
        shard_range: tuple[int, int] | None = None,
        spread_from: int | None = None,
    ) -> None:
        group = resolve_group(group)
        if shard_range is None and spread_from is None:
            shard_range = (dist.get_rank(group) * capacity, capacity)
        layers = [ShardedKVLayer(i, capacity, shard_range, group, spread_from) for i in range(num_layers)]
        super().__init__(layers=layers)


def take_pending(key: object) -> tuple | None:
    """(layer, new keys, new values, tokens before them) that a ``ShardedKVLayer`` handed to the
    attention call receiving ``key`` (the tensor its update returned), once; else None."""
    entry = _PENDING.pop(id(key), None)
    if entry is None:
        return None
    entry[1].pending_id = None
    return entry[1:]
