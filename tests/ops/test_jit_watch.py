"""The watcher of kernels compiled while serving (pdserve.ops.jit_watch), driven through Triton's hook calls."""

from __future__ import annotations

import logging

import pytest

from pdserve.ops.jit_watch import JitWatch

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def restore_hooks():
    rt = knobs.runtime
    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    yield
    rt.jit_cache_hook, rt.jit_post_compile_hook = saved


def _call(hook, key):
    return hook(key=key, repr=f"kernel[{key}]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)


def test_compiles_after_arming_are_counted_and_logged(restore_hooks, caplog):
    w = JitWatch()
    assert w.install()
    rt = knobs.runtime
    _call(rt.jit_cache_hook, "warm-up")  # during the warm-up: expected, not counted
    _call(rt.jit_post_compile_hook, "warm-up")
    w.arm()
    with caplog.at_level(logging.WARNING, logger="pdserve.ops.jit_watch"):
        assert _call(rt.jit_cache_hook, "served") is None  # None: Triton goes on and compiles
        _call(rt.jit_post_compile_hook, "served")
    assert w.stats()["kernels_compiled_after_warmup"] == 1
    assert "kernel[served]" in caplog.text and "kernel[warm-up]" not in caplog.text


def test_hooks_installed_before_are_still_called(restore_hooks):
    rt = knobs.runtime
    seen = []
    rt.jit_cache_hook = lambda **kw: seen.append(("miss", kw["key"])) or True  # True: the earlier hook skips compiles
    rt.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    w = JitWatch()
    w.install()
    w.arm()
    assert _call(rt.jit_cache_hook, "k") is True  # its answer is passed on unchanged
    _call(rt.jit_post_compile_hook, "k")
    assert seen == [("miss", "k"), ("post", "k")]
    assert w.install() and rt.jit_cache_hook == w.on_miss  # installing twice chains once
