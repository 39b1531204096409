"""Tile sizes and launch parameters for the attention kernels.

Chosen by head dimension from ``launch/tune_attention.py`` sweeps on an H200
(docs/experiments.md) rather than ``triton.autotune``: the backward kernels accumulate into
caller buffers, which an autotuner's repeated launches would corrupt, and a fixed table keeps
launches deterministic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .releases import check_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET:  # every kernel module imports this one: a release pair the interpreter cannot run
    check_interpreter()  # is named at import, not deep inside Triton at the first launch
MAX_TILE_ROWS = 128  # no block_m/block_n below is larger (problem.check_token_stride relies on it)

try:  # os.environ's own dict (bytes on POSIX): a lookup there is 0.1 us, os.environ.get 1 us
    _ENVIRON, _ENCODE, _DECODE = os.environ._data, os.environ.encodekey, os.environ.decodevalue
except AttributeError:
    _ENVIRON = None
_ENCODED: dict[str, object] = {}


def environment_value(variable: str) -> str | None:
    """``os.environ.get(variable)`` at a tenth of its cost, for switches read on every launch or
    call (tests and benchmarks set them at run time)."""
    if _ENVIRON is None:
        return os.environ.get(variable)
    key = _ENCODED.get(variable)
    if key is None:
        key = _ENCODED[variable] = _ENCODE(variable)
    value = _ENVIRON.get(key)
    return None if value is None else _DECODE(value)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int

    @classmethod
    def parse(cls, text: str) -> TileConfig:
        """``"64,128,8,3"`` (block_m, block_n, num_warps, num_stages), the launch scripts' form.
        Raises ValueError unless the blocks are powers of two >= 16 (``tl.dot``'s minimum), the
        warps a power of two and the stages >= 1."""
        try:
            values = [int(f) for f in text.split(",")]
        except ValueError:
            values = []
        if len(values) != 4:
            raise ValueError(f"expected M,N,WARPS,STAGES (four integers), got {text!r}")
        cfg = cls(*values)
        pow2 = all(x > 0 and x & (x - 1) == 0 for x in (cfg.block_m, cfg.block_n, cfg.num_warps))
        if not (pow2 and min(cfg.block_m, cfg.block_n) >= 16 and cfg.num_stages >= 1):
            raise ValueError(
                f"blocks must be powers of two >= 16, warps a power of two, stages >= 1; got {text!r}"
            )
        return cfg


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): ``triton.next_power_of_2``'s value without
    its constexpr-function wrapper, which costs microseconds per call on the host."""
    return 1 << max(n - 1, 0).bit_length()


def block_d(head_dim: int) -> int:
    """Tile width over head_dim: next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(head_dim))


def interpreter_tile_rows(seqlen: int) -> int:
    """Rows of a tile over a sequence of ``seqlen`` under the interpreter: an eighth of it (its
    next power of two), 16 to 64. The interpreter runs every tile op as numpy calls of about one
    fixed cost, so the time goes with the number of tiles: short sequences (the kernel tests')
    still span several 16-row tiles, so boundary and masking paths run, and long ones (the
    model-level tests', 512 tokens and up) take 8 or more 64-row tiles, not 32 or more 16-row
    ones (a Gemma-3 sequence-parallel step on gloo: 82 s against 18 s, 2026-11-30)."""
    return min(64, max(16, next_power_of_2(seqlen) // 8))


# Each table below takes (head_dim, fp32, seqlens): seqlens, the problem's (max_seqlen_q,
# max_seqlen_k), sizes the tiles under the interpreter only.
def _interpret_config(seqlens: tuple[int, int]) -> TileConfig:
    return TileConfig(interpreter_tile_rows(seqlens[0]), interpreter_tile_rows(seqlens[1]), 4, 1)


def _shrink_for_fp32(cfg: TileConfig, head_dim: int) -> TileConfig:
    """float32 tiles take twice the shared memory of the bf16-tuned ones: halve and stage less.
    fp32 runs are for exactness (CPU tests, references), not speed."""
    if head_dim > 128:
        return TileConfig(32, 32, 4, 1)
    return TileConfig(min(cfg.block_m, 64), min(cfg.block_n, 64), 4, 2)


def forward_config(head_dim: int, fp32: bool = False, seqlens: tuple[int, int] = (0, 0)) -> TileConfig:
    if INTERPRET:
        return _interpret_config(seqlens)
    if head_dim <= 64:
        cfg = TileConfig(128, 64, 8, 3)
    elif head_dim <= 128:
        cfg = TileConfig(128, 128, 8, 3)
    else:
        cfg = TileConfig(64, 64, 4, 3)  # 410-412 -> 429-469 TFLOP/s over (64, 32, 4, 2) on 2026-11-23
    return _shrink_for_fp32(cfg, head_dim) if fp32 else cfg


def backward_kv_config(head_dim: int, fp32: bool = False, seqlens: tuple[int, int] = (0, 0)) -> TileConfig:
    """dK/dV kernel: block_n keys stay resident, block_m query rows stream past."""
    if INTERPRET:
        return _interpret_config(seqlens)
    if head_dim <= 64:
        # Not (64, 128, 4, 2), an earlier sweep's causal pick: four warps holding two 128x64
        # float32 accumulators spill registers; it ran at 70-120 TFLOP/s in every shape probed
        # on 2026-11-23 (MHA and GQA, 16K-64K tokens), this one at 461-496 (docs/experiments.md).
        cfg = TileConfig(64, 64, 4, 3)
    elif head_dim <= 128:
        cfg = TileConfig(64, 128, 8, 3)
    else:
        # Not (32, 64, 4, 1): four warps spill 8 KB of registers per thread and ran at 76-81
        # TFLOP/s; eight warps on a 64x64 tile ran at 276-295 (H200, 2026-11-23).
        cfg = TileConfig(64, 64, 8, 2)
    return _shrink_for_fp32(cfg, head_dim) if fp32 else cfg


def backward_q_config(head_dim: int, fp32: bool = False, seqlens: tuple[int, int] = (0, 0)) -> TileConfig:
    """dQ kernel: block_m queries stay resident, block_n key rows stream past."""
    if INTERPRET:
        return _interpret_config(seqlens)
    cfg = TileConfig(128, 64, 8, 3) if head_dim <= 128 else TileConfig(64, 32, 4, 3)
    return _shrink_for_fp32(cfg, head_dim) if fp32 else cfg


# The block-sparse dQ and dK/dV kernels (block_sparse.py) walk listed blocks, where the dense picks
# above ran 13-26% slower than these (H200, bf16, 65536 tokens, 16 heads, BigBird and full masks,
# 2026-11-28: docs/experiments.md §61); float32 and the interpreter take the dense ones.
def sparse_forward_config(head_dim: int, fp32: bool = False, seqlens: tuple[int, int] = (0, 0)) -> TileConfig:
    """The block-sparse forward's tiles. At head_dim <= 64 smaller tiles and deeper pipelines win
    (H200, 65536 tokens, 16 heads, 2026-11-29: (64, 64, 4, 5) against the dense pick (128, 64, 8,
    3), 5.10 / 12.57 / 26.54 ms against 6.16 / 16.89 / 35.24 on BigBird / 25% random blocks /
    prefix-LM): the listed walk's block-number load takes one of the pipeline's stages
    (docs/experiments.md §63). At 128 no candidate gained more than 3%."""
    if INTERPRET or fp32 or head_dim > 64:
        return forward_config(head_dim, fp32, seqlens)
    return TileConfig(64, 64, 4, 5)


def sparse_dq_config(head_dim: int, fp32: bool = False, seqlens: tuple[int, int] = (0, 0)) -> TileConfig:
    if INTERPRET or fp32:
        return backward_q_config(head_dim, fp32, seqlens)
    return TileConfig(64, 64, 4, 3) if head_dim <= 128 else TileConfig(64, 64, 4, 2)


def sparse_kv_config(head_dim: int, fp32: bool = False, seqlens: tuple[int, int] = (0, 0)) -> TileConfig:
    if INTERPRET or fp32:
        return backward_kv_config(head_dim, fp32, seqlens)
    if head_dim <= 64:  # 5 stages: 11.97 / 32.31 / 66.99 ms backward against 3's 12.54 / 34.45 / 73.33 (§63)
        return TileConfig(64, 64, 4, 5)
    return TileConfig(64, 64, 4, 3) if head_dim <= 128 else TileConfig(64, 32, 4, 3)
