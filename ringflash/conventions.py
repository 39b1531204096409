"""flash-attn's and ring-flash-attn's argument and return conventions, shared by every
sequence-parallel entry point."""

from __future__ import annotations

import torch


def check_dropout(dropout_p: object) -> None:
    """ringflash attention has no dropout: only 0.0 is accepted (flash-attn's 4th argument)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p}: ringflash attention has no dropout; pass 0.0")


def attention_returns(
    out: torch.Tensor, lse: torch.Tensor, return_attn_probs: bool, return_lse: bool
) -> torch.Tensor | tuple:
    """ring-flash-attn's return convention: out, or (out, lse, None) with ``return_attn_probs``
    (it never returns probabilities either: the third slot is None); ours: (out, lse) with
    ``return_lse``."""
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out
