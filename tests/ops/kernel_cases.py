"""Shared set-up of the fused-kernel tests: where they run and how close a kernel must be to its reference.

On CPU the kernels run in Triton's interpreter (float32 and float16 only: its bfloat16 math is not faithful);
the `gpu` cases compile them for CUDA in float32, bfloat16 and float16.
"""

from __future__ import annotations

import pytest
import torch

CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEVICE_DTYPES = [pytest.param("cpu", dt, id=f"cpu-{str(dt)[6:]}") for dt in CPU_DTYPES] + [
    pytest.param("cuda", dt, id=f"cuda-{str(dt)[6:]}", marks=[pytest.mark.gpu, _needs_cuda]) for dt in GPU_DTYPES
]

# the kernels round once from float32; the references round intermediate results to the model dtype as Hugging
# Face does, so the two differ by up to a couple of units in the last place of the low-precision dtypes
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=4e-3, atol=4e-3),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, g: torch.Generator, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(actual.float(), expected.float(), msg=msg or None, **TOL[expected.dtype])


class GridSpy:
    """Stands in for a Triton kernel (monkeypatch it over the module's name): records each launch's grid and
    keyword arguments (its constexprs), then launches the kernel it wraps."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.kwargs = kernel, [], []

    def __getitem__(self, grid):
        self.grids.append(grid)
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.kwargs.append(kwargs)
            return launch(*args, **kwargs)
        return run
