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


def test_cpu_install_without_triton_imports_and_serves_the_model_path():
    """`pip install -e .` on a CPU machine has no Triton (it is a test extra there): the modules on the model's import
    path, and F.linear through `linear`, must work without it. Run in a fresh interpreter with Triton hidden."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton hidden for this test")
        sys.meta_path.insert(0, Hide())
        import torch
        import pdserve.model.parallel, pdserve.model.layers, pdserve.ops.norm, pdserve.ops.rotary
        import pdserve.ops.activation, pdserve.disagg.routes
        from pdserve.ops.dispatch import HAS_TRITON
        from pdserve.ops.linear import linear
        assert not HAS_TRITON
        x, w = torch.randn(2, 8), torch.randn(4, 8)
        assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
        print("ok")
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
