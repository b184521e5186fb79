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
    assert len(caplog.records) == 1 and "compiled a kernel while serving" in caplog.text  # the warm-up's: not logged


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


def _hook_args(name, sig, consts=None, attrs=None, stages=3):
    """Keyword arguments as Triton 3.6's _call_hook passes them (key is a string there)."""
    compile = {"signature": sig, "constants": consts or {}, "configs": [attrs or {}], "num_warps": 4,
               "num_stages": stages}
    return dict(key=f"{name}{sig}{consts}{attrs}{stages}", repr=f"{name}[...]", fn=None, compile=compile,
                is_manual_warmup=False, already_compiled=False)


def test_a_compile_after_arming_names_what_the_warm_up_did_not_have(restore_hooks, caplog):
    w = JitWatch()
    w.install()
    rt = knobs.runtime
    sig = {"Q": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    warm = _hook_args("_k", sig, {(2,): 64}, {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    rt.jit_cache_hook(**warm)
    rt.jit_post_compile_hook(**warm)
    w.arm()
    served = _hook_args("_k", sig, {(2,): 64}, {(0,): [["tt.divisibility", 16]]})  # n no longer a multiple of 16
    other = _hook_args("_other", {"X": "*fp32"})
    with caplog.at_level(logging.WARNING, logger="pdserve.ops.jit_watch"):
        for args in (served, other):
            rt.jit_cache_hook(**args)
            rt.jit_post_compile_hook(**args)
    assert w.stats()["kernels_compiled_after_warmup"] == 2
    assert "_k (n: i32/tt.divisibility=16 -> i32)" in caplog.text
    assert "_other (first of its kernel)" in caplog.text
