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

    if _interp is not None and hasattr(_interp, "_patch_lang") and hasattr(_interp, "GridExecutor"):
        # The interpreter re-patches triton.language at every call of a @triton.jit helper (inspect.getmembers
        # over the whole package, ~a quarter of a kernel test's time), although the launch already patched it.
        # Patch each language module once per launch instead: what a helper sees is the same (stock Triton's
        # nested patches are never undone either; the launch's own scope is restored as before).
        import inspect as _inspect

        import triton.language as _tl

        _orig_patch_lang = _interp._patch_lang
        _orig_grid_call = _interp.GridExecutor.__call__
        _launch: list[set[int]] = []  # ids of the language modules patched by the launch in progress
        # per helper: the ids of the language modules its globals hold (a scan of its module's globals, which was
        # ~4 % of a sampling-kernel test's time when made at every call)
        _fn_langs: dict = {}

        def _patch_lang(fn):
            if not _launch:
                return _orig_patch_lang(fn)
            langs = _fn_langs.get(fn)
            if langs is None:
                langs = _fn_langs[fn] = frozenset(
                    id(v) for v in fn.__globals__.values() if _inspect.ismodule(v) and v in (_tl, _tl.core))
            if langs and langs <= _launch[-1]:
                return _interp._LangPatchScope()
            scope = _orig_patch_lang(fn)
            _launch[-1] |= langs
            return scope

        def _grid_call(self, *args, **kwargs):
            _launch.append(set())
            try:
                return _orig_grid_call(self, *args, **kwargs)
            finally:
                _launch.pop()

        _interp._patch_lang = _patch_lang
        _interp.GridExecutor.__call__ = _grid_call

    if _interp is not None and hasattr(_interp, "_get_np_dtype"):
        # The interpreter's numpy dtype of a Triton type builds its table of 19 types at every call (several times
        # an operation; ~5 % of a sampling-kernel test's time): look each scalar type up once. The same answers: a
        # block's element type decides, pointers are uint64, and a type the table lacks still raises.
        import triton.language as _tl

        _orig_np_dtype = _interp._get_np_dtype
        _np_dtypes: dict = {}

        def _get_np_dtype(tt_dtype):
            if isinstance(tt_dtype, _tl.block_type):
                tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, _tl.pointer_type):
                return _orig_np_dtype(tt_dtype)
            np_dtype = _np_dtypes.get(tt_dtype)
            if np_dtype is None:
                np_dtype = _np_dtypes[tt_dtype] = _orig_np_dtype(tt_dtype)
            return np_dtype

        _interp._get_np_dtype = _get_np_dtype
