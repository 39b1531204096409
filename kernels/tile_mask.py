"""Block-sparse attention masks: which (query block, key block) pairs a mask leaves visible.

A ``TileMask`` describes a mask over (batch, heads, seqlen_q, seqlen_k) at the granularity of
blocks of ``block_q`` x ``block_k`` positions (multiples of 128, as FlexAttention's
``BlockMask``): each block is invisible (never loaded), full (every pair visible: no element
mask) or partial (visible pairs given by a bit mask). The kernels (``block_sparse.py``) walk
only the visible blocks, so time follows their number. It is built once per mask, from:

- ``TileMask.from_mask_mod(mask_mod, ...)``: a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``,
  evaluated over every pair once (in chunks of query blocks);
- ``TileMask.from_block_mask(block_mask)``: a FlexAttention ``BlockMask`` (its block lists are
  taken as they are; ``mask_mod`` is evaluated over its partial blocks only);
- ``TileMask.from_ranges(ranges, ...)``: (q_start, q_end, k_start, k_end, "full" | "causal")
  rectangles, MagiAttention's slices;
- ``TileMask.from_dense(mask)``: a boolean (batch or 1, heads or 1, seqlen_q, seqlen_k) tensor.

Layout (every tensor int32 on the mask's device; ``Bm``/``Hm`` are 1 for a mask shared by the
batch / the heads): ``kv_count`` (Bm, Hm, NQ, 2) and ``kv_index``/``kv_kind`` (Bm, Hm, NQ, NK):
query block m sees key blocks kv_index[..., m, :P + F] (P, F = kv_count[..., m, :]), first P
partial ones (kind: the partial block of ``bits``), then F full ones (kind -1), each group in
order (the kernels walk each group in one loop); ``q_count``/``q_index``/``q_kind`` the same
seen from each key block (the backward's dK/dV walk); ``bits`` (partials, block_q, block_k // 32): bit c % 32
of word c // 32 of row r set where query r and key c of the block are visible; ``kv_order``
(NQ + 1,) and ``q_order`` (NK + 1,), derived from the counts: the order in which the walks take
the query and key blocks. A full block lies inside the sequences (a block cut by seqlen_q or
seqlen_k is partial), so the kernels need no bounds check on it.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

MASK_BLOCK = 128  # block sizes must be multiples of this: every kernel tile (<= 128 rows) divides them
_CHUNK_PAIRS = 1 << 26  # query/key pairs evaluated at once by ``from_mask_mod``
# On a GPU each chunk costs about 1 ms beyond its pairs (vmap's calls, two host reads): 2^28 pairs
# (256 MiB per bool temporary, about 1 GiB at the peak) built a 65536-token mask in 80 ms against
# 127 at 2^26 (H200, docs/experiments.md §64).
_CHUNK_PAIRS_GPU = 1 << 28
# A block whose list holds more than this many times the mean is long (``TileMask.q_order``).
LONG_LIST = 4
# A mask is local when its lists span (first to last listed block) at most this fraction of the
# blocks on average: its walks then keep the blocks in order (``_walk_order``).
LOCAL_SPAN = 0.25
_INVISIBLE, _FULL = -2, -1  # kinds in the (Bm, Hm, NQ, NK) grid; partials are numbered from 0


@dataclass(frozen=True, eq=False)
class TileMask:
    """A block-sparse mask over (batch, heads, seqlen_q, seqlen_k) in blocks of block_q x
    block_k; build it with one of the ``from_*`` constructors (module docstring)."""

    seqlen_q: int
    seqlen_k: int
    block_q: int
    block_k: int
    kv_count: torch.Tensor
    kv_index: torch.Tensor
    kv_kind: torch.Tensor
    q_count: torch.Tensor
    q_index: torch.Tensor
    q_kind: torch.Tensor
    bits: torch.Tensor
    # The order in which the walks take the blocks: derived from the counts (``__post_init__``)
    # unless given (the custom ops rebuild a mask per call from all its tensors).
    kv_order: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]
    q_order: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        """The layout the kernels read without checks (the ``from_*`` constructors make it):
        shapes, int32, contiguous, one device. Values are not read back (a device sync).
        ``q_order`` (NK + 1,): the key blocks in descending order of their visible blocks summed
        over the batch and heads (ties in order), then how many of them are long (more than
        ``LONG_LIST`` times the mean: a global key's list). The dK/dV walks' programs take the
        long ones first, every KV head's, then each head's of the others in this order: a long
        list started late would run on alone after the rest, while one head's programs at work
        together share its queries in L2. ``kv_order`` (NQ + 1,): the same of the query blocks
        (a global query's list is long), for the Triton forward's and dQ walks."""
        block_q, block_k = _block_sizes((self.block_q, self.block_k))
        nq, nk = -(-self.seqlen_q // block_q), -(-self.seqlen_k // block_k)
        lead = tuple(self.kv_count.shape[:2])
        shapes = {
            "kv_count": (*lead, nq, 2), "kv_index": (*lead, nq, nk), "kv_kind": (*lead, nq, nk),
            "q_count": (*lead, nk, 2), "q_index": (*lead, nk, nq), "q_kind": (*lead, nk, nq),
            "kv_order": (nq + 1,), "q_order": (nk + 1,),
        }  # fmt: skip
        # Derived from lists checked before they are read.
        derived = {"kv_order": (self.kv_count, self.kv_index), "q_order": (self.q_count, self.q_index)}
        for name, shape in shapes.items():
            if getattr(self, name) is None and name in derived:
                object.__setattr__(self, name, _walk_order(*derived[name]))
            t = getattr(self, name)
            ok = isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == torch.int32
            if not ok or not t.is_contiguous() or t.device != self.kv_count.device:
                raise ValueError(
                    f"TileMask.{name} must be a contiguous int32 {shape} tensor on the others' device: "
                    "build masks with the TileMask.from_* constructors"
                )
        bits_ok = self.bits.dim() == 3 and tuple(self.bits.shape[1:]) == (block_q, block_k // 32)
        if not bits_ok or self.bits.dtype != torch.int32 or not self.bits.is_contiguous():
            raise ValueError(f"TileMask.bits must be a contiguous int32 (P, {block_q}, {block_k // 32})")

    @property
    def batch(self) -> int:
        """1 for a mask shared by every sequence of the batch."""
        return self.kv_count.shape[0]

    @property
    def heads(self) -> int:
        """1 for a mask shared by every query head."""
        return self.kv_count.shape[1]

    @property
    def device(self) -> torch.device:
        return self.kv_count.device

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch or 1, heads or 1, seqlen_q, seqlen_k), as FlexAttention's ``BlockMask.shape``."""
        return (self.batch, self.heads, self.seqlen_q, self.seqlen_k)

    # With ``shape``: code that takes 4-D masks (transformers' mask preparation) sees one.
    ndim = 4

    def density(self) -> float:
        """The fraction of blocks that are visible (full or partial)."""
        return float(self.kv_count.sum()) / max(1, self.kv_index.numel())

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs summed over the mask's batch and heads (1 each where shared)."""
        full = int(self.kv_count[..., 1].sum()) * self.block_q * self.block_k
        partial_ids = torch.arange(self.kv_index.shape[-1], device=self.device) < self.kv_count[..., :1]
        used = self.kv_kind[partial_ids].long()
        bits = (self.bits[used, :, :, None] >> torch.arange(32, device=self.device)) & 1
        return full + int(bits.sum())

    def grid(self) -> torch.Tensor:
        """The (Bm, Hm, NQ, NK) int32 kinds of every block: -2 invisible, -1 full, else its
        partial block's index into ``bits``."""
        grid = torch.empty_like(self.kv_index)
        return grid.scatter_(3, self.kv_index.long(), self.kv_kind)  # each row's list is a permutation

    def take(self, q_blocks: torch.Tensor, k_blocks: torch.Tensor) -> TileMask:
        """The mask of the queries of blocks ``q_blocks`` over the keys of blocks ``k_blocks``
        (1-D int tensors, in the order the sub-problem holds them): a sequence-parallel rank's
        view of the global mask. The blocks must be whole (not cut by the sequences' ends)."""
        nq, nk = self.kv_index.shape[2:]
        sides = (("q_blocks", q_blocks, nq, self.block_q, self.seqlen_q),
                 ("k_blocks", k_blocks, nk, self.block_k, self.seqlen_k))  # fmt: skip
        for name, blocks, n, block, seqlen in sides:
            if seqlen % block and bool((blocks == n - 1).any()):
                raise ValueError(f"{name} takes the last block, which the sequence's end cuts ({seqlen} "
                                 f"positions in blocks of {block})")  # fmt: skip
        rows = q_blocks.to(self.device)
        index = self.kv_index[:, :, rows]  # the grid of the taken rows only (each a permutation)
        grid = torch.empty_like(index).scatter_(3, index.long(), self.kv_kind[:, :, rows])
        grid = grid[:, :, :, k_blocks.to(self.device)]
        partial = grid >= 0
        used = grid[partial].long()
        grid[partial] = torch.arange(used.numel(), dtype=torch.int32, device=self.device)
        bits = self.bits[used] if used.numel() else torch.zeros_like(self.bits[:1])
        return _from_lists(grid, bits, len(q_blocks) * self.block_q, len(k_blocks) * self.block_k,
                           self.block_q, self.block_k)  # fmt: skip

    def select_heads(self, start: int, stop: int) -> TileMask:
        """The mask of query heads [start, stop) (itself where the heads share one mask): a
        Ulysses rank's heads."""
        if self.heads == 1:
            return self
        if not 0 <= start < stop <= self.heads:
            raise ValueError(f"heads [{start}, {stop}) are not among the mask's {self.heads}")
        pick = lambda t: t[:, start:stop].contiguous()  # noqa: E731
        names = ("kv_count", "kv_index", "kv_kind", "q_count", "q_index", "q_kind")
        lists = [pick(getattr(self, n)) for n in names]
        return TileMask(self.seqlen_q, self.seqlen_k, self.block_q, self.block_k, *lists, self.bits)

    def within_documents(self, bounds_q: Sequence[int], bounds_k: Sequence[int]) -> TileMask:
        """The mask with only the pairs of one document left: a packed batch's mask over its
        tokens in packed positions (FlexAttention's and MagiAttention's convention), cut by its
        documents. ``bounds_q``/``bounds_k``: the cumulative lengths (0, ..., <= seqlen) on the
        host, document d being queries [bounds_q[d], bounds_q[d + 1]) and keys [bounds_k[d],
        bounds_k[d + 1]); positions past the last bound see nothing. Only the blocks that mix
        documents (or cross the last bound) are evaluated again; the rest keep their kind."""
        nq, nk = self.kv_index.shape[2:]
        doc_q = _document_ids(bounds_q, nq * self.block_q, -1, self.device)
        doc_k = _document_ids(bounds_k, nk * self.block_k, -2, self.device)
        q_lo, q_hi, q_one = _block_documents(doc_q, self.block_q)
        k_lo, k_hi, k_one = _block_documents(doc_k, self.block_k)
        overlap = (q_lo[:, None] <= k_hi[None, :]) & (k_lo[None, :] <= q_hi[:, None])
        same = q_one[:, None] & k_one[None, :] & (q_lo[:, None] == k_lo[None, :])
        grid = self.grid()
        visible = grid != _INVISIBLE
        mixed = visible & overlap & ~same
        grid = torch.where(visible & ~overlap, _INVISIBLE, grid).to(torch.int32)
        b, h, m, n = mixed.nonzero().unbind(1)
        old = grid[b, h, m, n]
        parts = torch.ones(old.numel(), self.block_q, self.block_k, dtype=torch.bool, device=self.device)
        was_partial = old >= 0
        parts[was_partial] = _unpack_bits(self.bits[old[was_partial].long()])
        rows = m[:, None] * self.block_q + torch.arange(self.block_q, device=self.device)
        cols = n[:, None] * self.block_k + torch.arange(self.block_k, device=self.device)
        parts &= doc_q[rows][:, :, None] == doc_k[cols][:, None, :]
        seen = parts.flatten(1).any(1)
        # Kept partial blocks first (their bits as they were), then the re-evaluated ones.
        kept = (grid >= 0) & ~mixed
        kept_old = grid[kept].long()
        grid[kept] = torch.arange(kept_old.numel(), dtype=torch.int32, device=self.device)
        grid[b, h, m, n] = torch.where(
            seen, kept_old.numel() + torch.cumsum(seen, 0, dtype=torch.int32) - 1, _INVISIBLE
        ).to(torch.int32)
        bits = torch.cat([self.bits[kept_old], _pack_bits(parts[seen])[: int(seen.sum())]])
        return _from_lists(grid, bits if bits.shape[0] else self.bits[:1], self.seqlen_q, self.seqlen_k,
                           self.block_q, self.block_k)  # fmt: skip

    def digest(self) -> str:
        """A hash of the whole mask (reads it back to the host once per mask: a device sync),
        so that ranks can check they were given the same mask."""
        hit = _DIGESTS.get(self)
        if hit is None:
            h = hashlib.blake2b(digest_size=8)
            h.update(repr((self.seqlen_q, self.seqlen_k, self.block_q, self.block_k)).encode())
            for t in (self.kv_count, self.kv_index, self.kv_kind, self.bits):
                h.update(repr(tuple(t.shape)).encode())
                h.update(t.cpu().numpy().tobytes())
            hit = _DIGESTS[self] = h.hexdigest()
        return hit

    @classmethod
    def from_dense(cls, mask: torch.Tensor, *, block_size: int | tuple[int, int] = MASK_BLOCK) -> TileMask:
        """From a boolean (batch or 1, heads or 1, seqlen_q, seqlen_k) tensor (True = visible)."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
            raise TypeError("mask must be a 4-D bool tensor (batch or 1, heads or 1, seqlen_q, seqlen_k)")
        batch, heads, seqlen_q, seqlen_k = mask.shape
        return cls.from_mask_mod(
            lambda b, h, q, kv: mask[b, h, q, kv], batch, heads, seqlen_q, seqlen_k,
            block_size=block_size, device=mask.device,
        )  # fmt: skip

    @classmethod
    def from_mask_mod(
        cls,
        mask_mod: Callable,
        batch: int,
        heads: int,
        seqlen_q: int,
        seqlen_k: int,
        *,
        block_size: int | tuple[int, int] = MASK_BLOCK,
        device: torch.device | str | None = None,
    ) -> TileMask:
        """From a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (called through
        ``torch.vmap`` on index tensors, as FlexAttention's ``create_mask`` calls it), evaluated
        once over every (query, key) pair of ``batch`` x ``heads`` (1 where the mask does not
        depend on them), query blocks at a time. Cost: seqlen_q x seqlen_k evaluations per
        (batch, head), like FlexAttention's ``create_block_mask``."""
        block_q, block_k = _block_sizes(block_size)
        for name, n in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got {mask_mod!r}")
        device = torch.device(device if device is not None else "cpu")
        nq, nk = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
        evaluate = torch.vmap(
            torch.vmap(torch.vmap(torch.vmap(mask_mod, (None, None, None, 0)), (None, None, 0, None)),
                       (None, 0, None, None)), (0, None, None, None),
        )  # fmt: skip
        b_idx, h_idx = (torch.arange(n, device=device) for n in (batch, heads))
        kv_idx = torch.arange(nk * block_k, device=device).clamp_(max=seqlen_k - 1)
        kv_in = torch.arange(nk * block_k, device=device) < seqlen_k
        ragged = bool(seqlen_q % block_q or seqlen_k % block_k)
        pairs = _CHUNK_PAIRS if device.type == "cpu" else _CHUNK_PAIRS_GPU
        rows = max(1, pairs // (batch * heads * block_q * nk * block_k)) * block_q
        grid = torch.empty(batch, heads, nq, nk, dtype=torch.int32, device=device)
        partials = []
        for r0 in range(0, nq * block_q, rows):
            q_pos = torch.arange(r0, min(r0 + rows, nq * block_q), device=device)
            visible = evaluate(b_idx, h_idx, q_pos.clamp(max=seqlen_q - 1), kv_idx)
            if visible.dtype != torch.bool:
                raise TypeError(f"mask_mod must return a bool tensor, got {visible.dtype}")
            if ragged:  # pairs past the ends hidden
                visible = visible & (q_pos < seqlen_q)[:, None] & kv_in[None, :]
            shape = (batch, heads, q_pos.shape[0], nk * block_k)
            if visible.shape != shape or not visible.is_contiguous():  # vmap may broadcast
                visible = visible.expand(shape).contiguous()
            blocks = visible.view(batch, heads, -1, block_q, nk, block_k)
            kinds, parts = _classify(blocks, seqlen_q, seqlen_k, r0 // block_q, block_q, block_k)
            grid[:, :, r0 // block_q : r0 // block_q + kinds.shape[2]] = kinds + torch.where(
                kinds >= 0, sum(p.shape[0] for p in partials), 0
            ).to(torch.int32)
            partials.append(parts)
        return cls._from_grid(grid, torch.cat(partials), seqlen_q, seqlen_k, block_q, block_k)

    @classmethod
    def from_ranges(
        cls,
        ranges: Sequence[tuple[int, int, int, int, str]],
        seqlen_q: int,
        seqlen_k: int,
        *,
        block_size: int | tuple[int, int] = MASK_BLOCK,
        device: torch.device | str | None = None,
    ) -> TileMask:
        """From (q_start, q_end, k_start, k_end, kind) rectangles, kind "full" (every pair
        visible) or "causal" (key k visible to query q where k - k_end <= q - q_end: flash-attn's
        bottom-right alignment), ends exclusive; a pair is visible where any range makes it so.
        The same for every sequence and head."""
        if isinstance(ranges, (str, bytes)) or not isinstance(ranges, Sequence) or not ranges:
            raise TypeError("ranges must be a non-empty sequence of (q_start, q_end, k_start, k_end, kind)")
        bounds, causal = [], []
        for r in ranges:
            ok = isinstance(r, (tuple, list)) and len(r) == 5
            ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in r[:4])
            if not ok or r[4] not in ("full", "causal"):
                raise ValueError(
                    f"a range must be (q_start, q_end, k_start, k_end, 'full' | 'causal'), got {r!r}"
                )
            qs, qe, ks, ke = r[:4]
            if not (0 <= qs < qe <= seqlen_q and 0 <= ks < ke <= seqlen_k):
                raise ValueError(
                    f"range {r!r} must satisfy 0 <= q_start < q_end <= seqlen_q ({seqlen_q}) and "
                    f"0 <= k_start < k_end <= seqlen_k ({seqlen_k})"
                )
            bounds.append((qs, qe, ks, ke))
            causal.append(r[4] == "causal")
        dev = torch.device(device if device is not None else "cpu")
        qs, qe, ks, ke = torch.tensor(bounds, device=dev).unbind(1)
        is_causal = torch.tensor(causal, device=dev)

        def mask_mod(b, h, q, kv):
            inside = (q >= qs) & (q < qe) & (kv >= ks) & (kv < ke)
            return (inside & (~is_causal | (kv - ke <= q - qe))).any()

        return cls.from_mask_mod(mask_mod, 1, 1, seqlen_q, seqlen_k, block_size=block_size, device=dev)

    @classmethod
    def from_block_mask(cls, block_mask: object) -> TileMask:
        """From FlexAttention's ``BlockMask`` (``create_block_mask``): its full and partial block
        lists as they are, its ``mask_mod`` evaluated over the partial blocks (and the full ones
        that the sequences' ends cut) only. Its block sizes must be multiples of 128."""
        try:
            from torch.nn.attention.flex_attention import BlockMask
        except ImportError as e:  # pragma: no cover - torch without FlexAttention
            raise TypeError("block_mask needs torch.nn.attention.flex_attention") from e
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a FlexAttention BlockMask, got {type(block_mask).__name__}")
        seqlen_q, seqlen_k = (int(n) for n in block_mask.seq_lengths)
        block_q, block_k = _block_sizes(tuple(block_mask.BLOCK_SIZE))
        nq, nk = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
        counts, indices = block_mask.kv_num_blocks, block_mask.kv_indices
        batch, heads = counts.shape[:2]
        device = counts.device
        grid = torch.full((batch, heads, nq, nk), _INVISIBLE, dtype=torch.int32, device=device)
        slots = torch.arange(indices.shape[-1], device=device)
        lists = [(counts, indices, 0)]  # partial blocks, marked 0 then numbered
        if block_mask.full_kv_num_blocks is not None:
            lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, _FULL))
        for count, index, kind in lists:
            listed = slots[: index.shape[-1]] < count[..., :nq, None]
            index = index[..., :nq, :].long().clamp(0, nk - 1)  # unlisted slots may hold anything
            kinds = torch.where(listed, kind, _INVISIBLE).to(torch.int32)
            grid.scatter_reduce_(3, index, kinds, reduce="amax")  # a block is in one list at most
        cut = torch.zeros(nq, nk, dtype=torch.bool, device=device)  # blocks the sequences' ends cut
        cut[-1, :] |= seqlen_q % block_q != 0
        cut[:, -1] |= seqlen_k % block_k != 0
        grid = torch.where((grid == _FULL) & cut, 0, grid)
        where = (grid >= 0).nonzero()
        b, h, qb, kb = where.unbind(1)
        grid[b, h, qb, kb] = torch.arange(where.shape[0], dtype=torch.int32, device=device)
        q_pos = qb[:, None] * block_q + torch.arange(block_q, device=device)
        kv_pos = kb[:, None] * block_k + torch.arange(block_k, device=device)
        evaluate = torch.vmap(
            torch.vmap(torch.vmap(block_mask.mask_mod, (None, None, None, 0)), (None, None, 0, None)),
            (0, 0, 0, 0),
        )  # fmt: skip
        parts = torch.empty(where.shape[0], block_q, block_k, dtype=torch.bool, device=device)
        step = max(1, _CHUNK_PAIRS // (block_q * block_k))
        for i in range(0, where.shape[0], step):
            sl = slice(i, i + step)
            qp, kp = q_pos[sl], kv_pos[sl]
            visible = evaluate(b[sl], h[sl], qp.clamp(max=seqlen_q - 1), kp.clamp(max=seqlen_k - 1))
            parts[sl] = visible & (qp < seqlen_q)[:, :, None] & (kp < seqlen_k)[:, None, :]
        return cls._from_grid(grid, parts, seqlen_q, seqlen_k, block_q, block_k)

    @classmethod
    def _from_grid(
        cls, grid: torch.Tensor, parts: torch.Tensor, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int
    ) -> TileMask:
        """From the (Bm, Hm, NQ, NK) grid of kinds (invisible -2, full -1, partial i >= 0) and
        the partial blocks' (P, block_q, block_k) bool masks."""
        return _from_lists(grid, _pack_bits(parts), seqlen_q, seqlen_k, block_q, block_k)


def _from_lists(
    grid: torch.Tensor, bits: torch.Tensor, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int
) -> TileMask:
    """The TileMask of a grid of kinds whose partial blocks index the packed ``bits``."""
    kv_count, kv_index, kv_kind = _block_lists(grid)
    q_count, q_index, q_kind = _block_lists(grid.transpose(2, 3))
    return TileMask(seqlen_q, seqlen_k, block_q, block_k, kv_count, kv_index, kv_kind, q_count, q_index,
                    q_kind, bits.contiguous())  # fmt: skip


def _walk_order(count: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(N + 1,) int32 of (Bm, Hm, N, 2) counts and (Bm, Hm, N, M) lists: the order in which a
    walk takes the N blocks, then how many of them are long (more than ``LONG_LIST`` times the
    mean, listed first, most visible blocks first). The others follow by descending number of
    listed blocks summed over the batch and heads (ties in order: a short list last cannot run on
    alone at the end), unless the mask is local (its lists span at most ``LOCAL_SPAN`` of the M
    blocks on average): then in order, so that the programs at work together read neighbouring
    blocks from L2. Descending, Llama-4's 8K chunks at 128K tokens interleaved all 16 chunks'
    queries and ran the Hopper backward 5% slower (docs/experiments.md §71). Computed on the
    device: nothing is read back."""
    work = count.sum((0, 1, 3))
    n, m = work.numel(), index.shape[-1]
    long = work * n > LONG_LIST * work.sum()
    descending = torch.sort(work, descending=True, stable=True).indices
    if n == 0 or m == 0:
        return torch.cat([descending.to(torch.int32), long.sum(dtype=torch.int32).reshape(1)])
    # Each list's first and last block: its partial blocks and its full ones are each in order,
    # so the ends of the two runs hold them (four gathers, not a pass over the lists).
    partial, full = count[..., :1].long(), count[..., 1:].long()

    def listed(pos: torch.Tensor, present: torch.Tensor, absent: int) -> torch.Tensor:
        return torch.where(present, index.gather(-1, pos.clamp(0, m - 1)), absent)

    first = torch.minimum(listed(partial * 0, partial > 0, m), listed(partial, full > 0, m))
    last = torch.maximum(listed(partial - 1, partial > 0, -1), listed(partial + full - 1, full > 0, -1))
    rows = (count.sum(-1) > 0).sum()
    local = (last - first + 1).clamp(min=0).sum() <= LOCAL_SPAN * m * rows.clamp(min=1)
    # In order: the long blocks first (most first), then the rest by number.
    blocks = torch.arange(n, device=work.device)
    rank = torch.empty_like(descending)
    rank[descending] = blocks
    in_order = torch.sort(torch.where(long, rank - n, blocks), stable=True).indices
    order = torch.where(local, in_order, descending).to(torch.int32)
    return torch.cat([order, long.sum(dtype=torch.int32).reshape(1)])


def _block_sizes(block_size: object) -> tuple[int, int]:
    sizes = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    ok = len(sizes) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in sizes)
    if not ok or not all(x > 0 and x % MASK_BLOCK == 0 for x in sizes):
        raise ValueError(
            f"block_size must be an int or a pair of ints, multiples of {MASK_BLOCK}, got {block_size!r}"
        )
    return int(sizes[0]), int(sizes[1])


def _classify(
    blocks: torch.Tensor, seqlen_q: int, seqlen_k: int, first_q: int, block_q: int, block_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks: (B, H, nq, block_q, nk, block_k) bool of query blocks first_q.. (a view of the
    pairs' rows) -> (kinds (B, H, nq, nk) int32 with partials numbered from 0 in order, their
    (P, block_q, block_k) masks). A block cut by the sequences' ends is partial even when every
    pair in it is visible."""
    seen = blocks.sum(-1, dtype=torch.int32).sum(3)  # one pass over the pairs, no copy
    anything, everything = seen > 0, seen == block_q * block_k
    nq, nk = blocks.shape[2], blocks.shape[4]
    inside = torch.ones(nq, nk, dtype=torch.bool, device=blocks.device)
    if seqlen_q % block_q:
        inside[(first_q + torch.arange(nq, device=blocks.device)) * block_q + block_q > seqlen_q] = False
    if seqlen_k % block_k:
        inside[:, -1] = False
    full = everything & inside
    partial = anything & ~full
    kinds = torch.full(anything.shape, _INVISIBLE, dtype=torch.int32, device=blocks.device)
    kinds[full] = _FULL
    kinds[partial] = torch.arange(int(partial.sum()), dtype=torch.int32, device=blocks.device)
    return kinds, blocks.transpose(3, 4)[partial]


def _block_lists(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, index, kind) of each row of grid's last dim: its partial blocks, then its full
    ones, each in order (count[..., 0] and [..., 1] of them), then the invisible ones."""
    rank = torch.where(grid >= 0, 0, torch.where(grid == _FULL, 1, 2)).to(torch.int8)
    order = torch.sort(rank, dim=-1, stable=True).indices
    count = torch.stack([(rank == r).sum(-1, dtype=torch.int32) for r in (0, 1)], -1).contiguous()
    kind = grid.gather(-1, order).to(torch.int32).contiguous()
    return count, order.to(torch.int32).contiguous(), kind


def _document_ids(bounds: Sequence[int], length: int, outside: int, device: torch.device) -> torch.Tensor:
    """The document of each of ``length`` positions under cumulative lengths ``bounds`` (empty
    documents hold none), ``outside`` past the last bound."""
    ends = torch.tensor(list(bounds[1:]), dtype=torch.int64, device=device)
    pos = torch.arange(length, device=device)
    doc = torch.searchsorted(ends, pos, right=True)
    return torch.where(pos < bounds[-1], doc, outside)


def _block_documents(doc: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of positions: the lowest and highest document among its positions inside a
    document (lo > hi where none is), and whether all its positions lie in one document."""
    doc = doc.view(-1, block)
    inside = doc >= 0
    big = torch.iinfo(doc.dtype).max
    lo = torch.where(inside, doc, big).amin(1)
    hi = torch.where(inside, doc, -1).amax(1)
    return lo, hi, inside.all(1) & (lo == hi)


def _unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """``_pack_bits``'s inverse: (P, rows, cols // 32) int32 words -> (P, rows, cols) bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & 1).bool().flatten(-2)


def _pack_bits(parts: torch.Tensor) -> torch.Tensor:
    """(P, rows, cols) bool -> (P, rows, cols // 32) int32 words, col c at bit c % 32 of word c // 32."""
    p, rows, cols = parts.shape
    weights = torch.ones(32, dtype=torch.int64, device=parts.device) << torch.arange(32, device=parts.device)
    words = (parts.view(p, rows, cols // 32, 32).to(torch.int64) * weights).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement in int32
    if p == 0:  # the kernels take a pointer even when no block reads it
        return torch.zeros(1, rows, cols // 32, dtype=torch.int32, device=parts.device)
    return words.to(torch.int32).contiguous()


_CONVERTED: dict[int, tuple[weakref.ref, TileMask]] = {}
# TileMask.within_documents' results per mask and document bounds: a packed batch's layers share
# one mask and one cu_seqlens; the last few batches' views are kept while the mask lives.
_DOCUMENT_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_DOCUMENT_VIEWS = 8


def documents_view(mask: TileMask, bounds_q: Sequence[int], bounds_k: Sequence[int]) -> TileMask:
    """``mask.within_documents(bounds_q, bounds_k)``, built once per mask and bounds."""
    views = _DOCUMENT_VIEWS.setdefault(mask, {})
    key = (tuple(bounds_q), tuple(bounds_k))
    hit = views.get(key)
    if hit is None:
        if len(views) >= _MAX_DOCUMENT_VIEWS:
            views.clear()
        hit = views[key] = mask.within_documents(bounds_q, bounds_k)
    return hit


_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TileMask.digest's, per mask


def as_tile_mask(mask: object) -> TileMask:
    """``mask`` itself if it is a TileMask; a FlexAttention ``BlockMask`` converted once
    (``TileMask.from_block_mask``) and remembered while it lives, so that every layer and step
    that passes the same BlockMask reuses the conversion."""
    if isinstance(mask, TileMask):
        return mask
    hit = _CONVERTED.get(id(mask))
    if hit is not None and hit[0]() is mask:
        return hit[1]
    tile_mask = TileMask.from_block_mask(mask)
    for key in [key for key, (ref, _) in _CONVERTED.items() if ref() is None]:
        del _CONVERTED[key]
    _CONVERTED[id(mask)] = (weakref.ref(mask), tile_mask)
    return tile_mask
