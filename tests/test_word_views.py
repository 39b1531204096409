"""ringflash.word_views: 8-byte views of head_dim rows, and where they fall back."""

from __future__ import annotations

import pytest
import torch

from ringflash.word_views import WORD, as_words


def test_rows_become_words_of_the_same_storage():
    q = torch.randn(2, 8, 4, 128).to(torch.float16)
    k = q.transpose(1, 2)  # a model's (B, H, S, D) seen as (B, S, H, D): head_dim still contiguous
    words = as_words([q, k])
    assert [w.dtype for w in words] == [WORD] * 2 and words[0].shape == (2, 8, 4, 32)
    assert words[1].data_ptr() == k.data_ptr() and torch.equal(words[1].view(torch.float16), k)
    # a permuting copy of the words is the permuting copy of the values
    moved = words[0].permute(2, 0, 1, 3).contiguous().view(torch.float16)
    assert torch.equal(moved, q.permute(2, 0, 1, 3))


def test_layouts_that_cannot_be_words_pass_unchanged():
    lse = torch.randn(2, 8, 4, 1)  # the LSE's rows: 4 bytes
    assert as_words([lse])[0] is lse
    q = torch.randn(2, 8, 4, 128).to(torch.bfloat16)
    odd = [q, q[..., 1:]]  # one of them 254 bytes a row: neither becomes words
    assert all(a is b for a, b in zip(as_words(odd), odd))
    with pytest.raises(TypeError, match="one dtype"):
        as_words([q, q.float()])
