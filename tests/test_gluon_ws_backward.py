"""launch/gluon_ws_backward.py on a GPU: the warp-specialized Gluon backward against float64.

The CPU side (it builds for sm_90 with its register split) is in test_compile.py.
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
def test_warp_specialized_backward_matches_float64():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "launch"))
    from gluon_ws_backward import check

    assert check()
