"""Session-wide test set-up.

Without CUDA, Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before any kernel module is
imported), so every kernel is also checked against its torch reference on CPU-only machines and in CI. GPU runs
compile them for real (tests marked `gpu`).
"""

from __future__ import annotations

import os

import torch

# The deployment secret every prefill/decode instance the tests start proves to its KV peers (tests of the
# refusal without one remove it from their child's environment).
os.environ.setdefault("PDSERVE_DEPLOYMENT_SECRET", "pdserve-test-suite-kv-secret-not-for-production")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.runtime.interpreter as _interp
    except ImportError:  # no Triton: kernel tests skip themselves (pytest.importorskip)
        _interp = None
    if _interp is not None and hasattr(_interp, "_patch_lang_tensor"):
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            # Triton 3.6's interpreter turns a loaded scalar into a Python int with int(array), which numpy >= 2
            # refuses for the 1-element arrays it holds; index through the first element instead.
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
