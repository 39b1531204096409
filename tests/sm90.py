"""What the tests of the Hopper (sm_90) kernels share: their skip mark, seeded CUDA inputs and the
ALiBi cases."""

from __future__ import annotations

import pytest
import torch

from ringflash.kernels import TokenPositions

SM90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)


def cuda_randn(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=dtype, generator=g)


# (batch, seqlen_q, seqlen_k, heads, kv_heads, causal, softcap, positions): positions None =
# bottom-right aligned, else ((q start, stride), (k start, stride)) as in a ring step's block.
ALIBI_CASES = [
    (2, 384, 384, 4, 4, False, 0.0, None),
    (1, 512, 512, 8, 2, True, 0.0, None),
    (1, 256, 640, 4, 1, False, 20.0, None),
    (2, 256, 384, 4, 2, False, 0.0, ((1000, 2), (0, 3))),
    (1, 256, 256, 4, 4, True, 5.0, ((4096, 1), (4096, 1))),
]


def alibi_inputs(
    batch, seqlen_q, seqlen_k, heads, kv_heads, causal, softcap, positions, dtype, seed, head_dim=128
):
    """q, k, v, slopes ((batch, heads) float32, 0.02-0.3: biases of several units over these
    lengths), build_problem's and reference_attention's keyword arguments."""
    q = cuda_randn(batch, seqlen_q, heads, head_dim, dtype=dtype, seed=seed)
    k = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=seed + 1)
    v = cuda_randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype, seed=seed + 2)
    g = torch.Generator(device="cuda").manual_seed(seed)
    slopes = 0.02 + 0.28 * torch.rand(batch, heads, device="cuda", generator=g)
    kw, ref_kw = dict(softcap=softcap, alibi_slopes=slopes), dict(causal=causal, softcap=softcap)
    if positions is not None:
        (qs, qd), (ks, kd) = positions
        kw.update(q_positions=TokenPositions(qs, qd), k_positions=TokenPositions(ks, kd))
        ref_kw.update(q_pos=qs + qd * torch.arange(seqlen_q), k_pos=ks + kd * torch.arange(seqlen_k))
    return q, k, v, slopes, kw, ref_kw
