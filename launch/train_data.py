"""Training data for launch/train.py: a synthetic long-range recall task, or a file of token ids.

Every sample is a pure function of (seed, sample index), so SP=1 and SP=2 runs with one
``--seed`` see the same data, the ranks of a sequence-parallel group build the same full
sequence before sharding it, and a resumed run continues where the saved one stopped.

Synthetic recall (``--data synthetic-recall``): uniformly random filler tokens, with ``keys``
key tokens planted at random positions in the first half; the sequence ends with (query marker
j, key j) for each key j. Key j is one of ``key_vocab`` ids of its own that filler never uses,
so the answer after query marker j is predictable only by attending back to where key j was
planted, tens of thousands of tokens earlier and often on another rank (zigzag over 2 ranks:
rank 0 holds the first and last quarters, so keys in the second quarter sit on rank 1). The
answers' loss and accuracy are reported separately ("recall"). Learnability, checked on a CPU
with a 2-layer model (hidden 128) at 256 tokens trained on the answers only (``--loss-on
answer``): keys=1, key_vocab=64 goes from chance to 100% accuracy between steps 250 and 300 at
8 sequences per step; it did not learn at 1 sequence per step in 600 steps, nor with loss on
all tokens in 400; keys=8 (key_vocab 32) did not learn in 2000 single-sequence steps. Gradient
clipping at 1.0 (the DeepSpeed configs' setting) kept the ``small`` model at chance for 300-600
steps (CPU and GPU); pass ``--grad-clip 0``. Even then the ``small`` model learns slowly at 256
tokens and how fast depends on the seed (one H200, 1200 steps, 2026-11-23): accuracy per 100 steps
reached 0.58 with ``--seed 1`` and 0.15-0.17 with seed 0 (bf16, and fp32 over 1146 steps).
With seed 1, 1100 steps at 256 tokens, 150 at 2K and 40 at 64K (SP=2, 2x H200,
``launch/gpu_train.sh e``) the last 20 steps at 64K answered 36% correctly (chance 1/64).

Token file (``--data PATH``): a flat array of token ids, either ``.npy`` (any integer dtype,
``numpy.save``) or raw little-endian ``.bin`` (dtype given by ``--data-dtype``, default
uint32; e.g. ``np.asarray(ids, np.uint32).tofile(path)``). Each sample is a window of
``seq_len`` consecutive tokens at a seeded random offset; documents are not separated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FIRST_TOKEN = 4  # ids below are never used


@dataclass
class Sample:
    """One sequence. input_ids: (1, seq_len) int64; answer_mask: (1, seq_len) bool, True at the
    positions whose *target* (the next token) is an answer token, aligned like ``target_ids``."""

    input_ids: torch.Tensor
    answer_mask: torch.Tensor


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class SyntheticRecall:
    """Long-range recall samples. Token ids: FIRST_TOKEN + j is the query marker of key j; key j
    is one of its own ``key_vocab`` ids after the markers; filler uses the ids above those."""

    def __init__(
        self, seq_len: int, vocab: int, seed: int, keys: int = 1, key_vocab: int = 64, key_region: float = 0.5
    ) -> None:
        self.filler_start = FIRST_TOKEN + keys + keys * key_vocab
        if vocab <= self.filler_start:
            raise ValueError(f"{keys} keys of {key_vocab} ids need a vocabulary above {self.filler_start}")
        if keys < 1 or key_vocab < 2 or seq_len < 8 * keys:
            raise ValueError(
                f"seq_len {seq_len} cannot hold {keys} keys (need keys >= 1, seq_len >= 8 x keys)"
            )
        self.seq_len, self.vocab, self.seed, self.keys, self.key_vocab = seq_len, vocab, seed, keys, key_vocab
        self.region = max(keys, int(seq_len * key_region))  # keys are planted in [0, region)

    def sample(self, index: int) -> Sample:
        g, n, k = _generator(self.seed, index), self.seq_len, self.keys
        ids = torch.randint(self.filler_start, self.vocab, (n,), generator=g)
        groups = FIRST_TOKEN + k + torch.arange(k) * self.key_vocab
        key = groups + torch.randint(0, self.key_vocab, (k,), generator=g)
        ids[torch.randperm(self.region, generator=g)[:k]] = key
        tail = n - 2 * k  # the sequence ends with (query marker j, key j) for every key j
        ids[tail::2] = FIRST_TOKEN + torch.arange(k)
        ids[tail + 1 :: 2] = key
        mask = torch.zeros(n, dtype=torch.bool)
        mask[tail::2] = True  # each query marker's target is its key
        return Sample(ids[None], mask[None])


class TokenFile:
    """Random windows of ``seq_len`` tokens from a flat .npy or .bin file of token ids."""

    def __init__(self, path: str, seq_len: int, vocab: int, seed: int, dtype: str = "uint32") -> None:
        if path.endswith(".npy"):
            self.tokens = np.load(path, mmap_mode="r")
        elif path.endswith(".bin"):
            self.tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        else:
            raise ValueError(f"token file must end in .npy or .bin, got {path!r}")
        if self.tokens.ndim != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise ValueError(
                f"{path}: need a flat integer array, got {self.tokens.dtype} {self.tokens.shape}"
            )
        if len(self.tokens) < seq_len:
            raise ValueError(f"{path} holds {len(self.tokens)} tokens, fewer than seq_len {seq_len}")
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed

    def sample(self, index: int) -> Sample:
        g = _generator(self.seed, index)
        start = int(torch.randint(0, len(self.tokens) - self.seq_len + 1, (1,), generator=g))
        ids = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len]).astype(np.int64))
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
            raise ValueError(f"token ids must lie in [0, {self.vocab}) (the model's vocabulary)")
        return Sample(ids[None], torch.zeros(1, self.seq_len, dtype=torch.bool))


def make_dataset(
    spec: str,
    seq_len: int,
    vocab: int,
    seed: int,
    dtype: str = "uint32",
    keys: int = 1,
    key_vocab: int = 64,
) -> SyntheticRecall | TokenFile:
    """``spec``: "synthetic-recall" or a path to a token file (see the module docstring)."""
    if spec == "synthetic-recall":
        return SyntheticRecall(seq_len, vocab, seed, keys, key_vocab)
    return TokenFile(spec, seq_len, vocab, seed, dtype)


def sample_index(step: int, micro: int, accumulation: int, dp_rank: int, dp_size: int) -> int:
    """Global index of the sample a data-parallel replica trains on at (step, micro-step)."""
    return (step * accumulation + micro) * dp_size + dp_rank
