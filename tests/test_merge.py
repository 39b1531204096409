"""The merge rule: partials over disjoint key blocks combine into exact attention."""

import pytest
import torch
from reference import reference_attention, rel_err

from ringflash import merge_partial


@pytest.mark.parametrize("head_dim", [16, 40, 256])
def test_merging_key_halves_equals_full_attention(device, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(2, 21, 3, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    full_out, full_lse = reference_attention(q, k, v)
    # Key halves, with a causal-style mask on the second so some rows see none of it (-inf).
    qp, kp = torch.arange(21), torch.arange(21)
    out_a, lse_a = reference_attention(q, k[:, :9], v[:, :9], q_pos=qp + 9, k_pos=kp[:9])
    out_b, lse_b = reference_attention(q, k[:, 9:], v[:, 9:], q_pos=qp + 9, k_pos=kp[9:])
    out, lse = out_a.float().to(device), lse_a.float().to(device)
    merge_partial(out, lse, out_b.half().to(device), lse_b.float().to(device))
    assert rel_err(out, full_out) < 1e-3  # block_out given in fp16
    assert rel_err(lse, full_lse) < 1e-6


def test_merging_empty_rows_stays_empty_without_nan(device):
    out = torch.zeros(1, 4, 2, 16, device=device)
    lse = torch.full((1, 2, 4), float("-inf"), device=device)
    blk = torch.randn(1, 4, 2, 16, device=device)
    blk_lse = torch.randn(1, 2, 4, device=device)
    blk_lse[0, 0, :2] = float("-inf")
    blk[0, :2, 0] = 0.0
    merge_partial(out, lse, blk, blk_lse)
    assert not out.isnan().any()
    assert torch.isneginf(lse[0, 0, :2]).all() and (out[0, :2, 0] == 0).all()
    assert torch.allclose(out[0, 2:, 0], blk[0, 2:, 0]) and torch.equal(lse[0, 0, 2:], blk_lse[0, 0, 2:])


def test_merge_rejects_mismatched_inputs(device):
    out = torch.zeros(1, 4, 2, 16, device=device)
    lse = torch.zeros(1, 2, 4, device=device)
    with pytest.raises(ValueError, match="merge shapes disagree"):
        merge_partial(out, lse, out[:, :3], lse)
    with pytest.raises(TypeError, match="float32"):
        merge_partial(out, lse.double(), out, lse)


@pytest.mark.parametrize(
    ("case", "exc", "match"),
    [
        # before: "not enough values to unpack", an AttributeError in Triton's launcher, or a
        # copy out of a meta tensor
        (
            "3-D out",
            ValueError,
            r"out must be 4-D \(batch, seqlen, heads, head_dim\), got shape \(4, 2",
        ),
        ("int out", TypeError, r"out must be float16, bfloat16 or float32, got torch.int32"),
        (
            "float64 block_out",
            TypeError,
            r"block_out must be float16, .* got torch.float64",
        ),
        ("list block_out", TypeError, r"block_out must be a torch.Tensor, got list"),
        ("meta block_lse", ValueError, r"block_lse is on meta but out is on"),
    ],
)
def test_merge_names_the_bad_argument(device, case, exc, match):
    args = dict(
        out=torch.zeros(1, 4, 2, 16, device=device),
        lse=torch.zeros(1, 2, 4, device=device),
        block_out=torch.zeros(1, 4, 2, 16, device=device),
        block_lse=torch.zeros(1, 2, 4, device=device),
    )
    if case == "3-D out":
        args["out"] = args["out"][0]
    elif case == "int out":
        args["out"] = args["out"].int()
    elif case == "float64 block_out":
        args["block_out"] = args["block_out"].double()
    elif case == "list block_out":
        args["block_out"] = args["block_out"].tolist()
    else:
        args["block_lse"] = args["block_lse"].to("meta")
    with pytest.raises(exc, match=match):
        merge_partial(**args)
