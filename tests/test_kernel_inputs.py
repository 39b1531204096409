"""Bad input raises ValueError/TypeError naming the argument, before anything reaches Triton."""

import pytest
import torch

import ringflash


def _qkv(device, b=1, s=8, h=2, hk=2, d=16, dtype=torch.float32):
    return (torch.randn(b, s, n, d, device=device, dtype=dtype) for n in (h, hk, hk))


def test_bad_tensors(device):
    q, k, v = _qkv(device)
    f = ringflash.flash_attn_func
    with pytest.raises(ValueError, match="q must be 4-D"):
        f(q[0], k, v)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        f(q.tolist(), k, v)
    with pytest.raises(TypeError, match="must share a dtype"):
        f(q.half(), k, v)
    with pytest.raises(TypeError, match="k must be float16, bfloat16 or float32"):
        f(q, k.int(), v)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        f(q, k, v[:, :4])
    with pytest.raises(ValueError, match="k head_dim 24 differs from q head_dim 16"):
        q2, k2, v2 = _qkv(device, d=24)
        f(q, k2, v2)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        f(*_qkv(device, d=12))
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8 in \\[8, 256\\]"):
        f(*_qkv(device, d=264))
    with pytest.raises(ValueError, match="q heads \\(3\\) must be divisible by k/v heads \\(2\\)"):
        f(*_qkv(device, h=3))
    with pytest.raises(ValueError, match="contiguous last"):
        f(q.transpose(1, 3).contiguous().transpose(1, 3), k, v)
    with pytest.raises(ValueError, match="q batch 2 differs from k/v batch 1"):
        f(torch.cat([q, q]), k, v)


def test_bad_mask_and_scale_arguments(device):
    q, k, v = _qkv(device)
    f = ringflash.flash_attn_func
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        f(q, k, v, window_size=4)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        f(q, k, v, window_size=(1.5, 0))
    with pytest.raises(ValueError, match="window_size entries must be >= -1"):
        f(q, k, v, window_size=(-2, 0))
    with pytest.raises(TypeError, match="causal must be a bool"):
        f(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite float"):
        f(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite float"):
        f(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="softmax_scale must be a float or None"):
        f(q, k, v, softmax_scale="0.1")


def test_bad_varlen_arguments(device):
    q, k, v = (t[0] for t in _qkv(device, s=10))
    f = ringflash.flash_attn_varlen_func
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D torch.int32 tensor"):
        f(q, k, v, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0, never decrease and end at 10"):
        f(q, k, v, cu, torch.tensor([0, 6, 4, 10], dtype=torch.int32, device=device), 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        f(q, k, v, torch.tensor([1, 4, 10], dtype=torch.int32, device=device), cu, 6, 6)
    with pytest.raises(ValueError, match="end at 10"):
        f(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32, device=device), cu, 6, 6)
    with pytest.raises(ValueError, match="same number of sequences"):
        f(q, k, v, cu, torch.tensor([0, 10], dtype=torch.int32, device=device), 6, 10)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= the longest sequence \\(6\\)"):
        f(q, k, v, cu, cu, 5, 6)
    with pytest.raises(ValueError, match="must be 3-D"):
        f(q[None], k, v, cu, cu, 6, 6)
