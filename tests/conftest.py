"""Session-wide test set-up.

Without CUDA, Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before any kernel module is
imported), so every kernel is also checked against its torch reference on CPU-only machines and in CI. GPU runs
compile them for real (tests marked `gpu`).
"""

from __future__ import annotations

import os

# One compute thread per process (the test process and every process it starts inherit this): the suite runs
# several torch processes at once (servers, tensor-parallel workers, pytest-xdist workers) on few cores, and
# OpenMP's per-op thread teams oversubscribed there spin and wait on descheduled threads (tiny-model tests ran 50-100x
# slower on a busy 2-core machine: 0.4 s -> 34 s). Parallelism comes from the processes instead.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch before this file

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

        def _patch_lang(fn):
            if not _launch:
                return _orig_patch_lang(fn)
            langs = {id(v) for v in fn.__globals__.values() if _inspect.ismodule(v) and v in (_tl, _tl.core)}
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


# Under pytest-xdist (`-n 2 --dist loadgroup`, the README's test command): the tests that start model-serving
# processes, or that hold wall-clock bounds (timeouts, latencies, simulated service times), run one after another on
# one worker, as they were written to (each assumes the machine's two cores are its own processes'); the rest (kernels
# in the interpreter, in-process engines, pure logic) share the other worker and fill its idle time.
SERIAL_DIRS = ("tests/bench/", "tests/disagg/", "tests/router/", "tests/server/")
SERIAL_FILES = (
    "tests/engine/test_engine_proc_exit.py",
    "tests/engine/test_engine_proc_start.py",
    "tests/kv/test_kv_bounds.py",
    "tests/kv/test_kv_failures.py",
    "tests/kv/test_kv_nccl.py",
    "tests/parallel/test_tp_failure.py",
    "tests/test_cli.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        serial = path.startswith(SERIAL_DIRS) or path in SERIAL_FILES
        # a file's tests stay together otherwise too, so its module-scoped fixtures are made once
        item.add_marker(pytest.mark.xdist_group("serial" if serial else path))
