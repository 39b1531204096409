"""launch/gluon_fused_backward.py on a GPU: the experimental Gluon backward against float64.

The CPU side (it builds for sm_90) is in test_compile.py; this needs a Hopper GPU and Gluon.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)
def test_gluon_backward_matches_float64():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "launch"))
    from gluon_fused_backward import check

    assert check()
