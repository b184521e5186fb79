"""pdserve.ops.pdl's switch: the modes, and that CPU tensors (Triton's interpreter) never get a PDL launch."""

from __future__ import annotations

import pytest
import torch

from pdserve.ops.pdl import MODES, pdl_args, set_pdl


def test_modes_and_cpu_launches():
    x = torch.zeros(2)
    prev = set_pdl("late")
    try:
        assert pdl_args(x) == {"PDL": 0}  # CPU: the kernels are exactly what they were
        assert set_pdl(False) == "late"
        assert set_pdl(True) == "off"
        assert set_pdl("early") == "early"
        with pytest.raises(ValueError):
            set_pdl("sometimes")
    finally:
        set_pdl(prev)
    assert MODES == {"off": 0, "early": 1, "late": 2}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_launches_follow_the_mode():
    x = torch.zeros(2, device="cuda")
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    prev = set_pdl("early")
    try:
        assert pdl_args(x) == ({"PDL": 1, "launch_pdl": True} if sm90 else {"PDL": 0})
        set_pdl("off")
        assert pdl_args(x) == {"PDL": 0}
    finally:
        set_pdl(prev)
