"""--tensor-parallel-size / -tp: vLLM's names, the config's default, validated; PD roles take it too (one KV agent
per rank)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.server.main import add_arguments, build_config, config_argv


def _parse(*argv: str):
    return build_config(add_arguments(argparse.ArgumentParser()).parse_args(list(argv)))


def test_flag_and_default():
    assert _parse().engine.tensor_parallel_size == EngineConfig().tensor_parallel_size == 1
    assert _parse("-tp", "2").engine.tensor_parallel_size == 2
    cfg = _parse("--tensor-parallel-size", "4")
    assert config_argv(cfg) == ["--tensor-parallel-size", "4"] and _parse(*config_argv(cfg)) == cfg


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        _parse("-tp", "0")
    for role in ("prefill", "decode"):
        assert EngineConfig(tensor_parallel_size=2, kv_transfer=KVTransferConfig(role=role)).role == role


def test_tp_all_reduce_flag():
    assert _parse().engine.tp_all_reduce == EngineConfig().tp_all_reduce == "nccl"
    cfg = _parse("-tp", "2", "--tp-all-reduce", "symm_mem")
    assert cfg.engine.tp_all_reduce == "symm_mem" and _parse(*config_argv(cfg)) == cfg
    with pytest.raises(ValueError, match="tp_all_reduce"):
        EngineConfig(tp_all_reduce="custom")


def test_symm_mem_sums_on_cpu_fail_the_start_with_a_clear_error(tiny_model_dirs):
    from pdserve.engine.engine_core import EngineCore

    cfg = dict(model=str(tiny_model_dirs["qwen3"]), device="cpu", dtype="float32", num_gpu_blocks=16, block_size=4,
               tensor_parallel_size=2)
    with pytest.raises(Exception, match="symm_mem needs CUDA"):
        EngineCore(EngineConfig(**cfg, tp_all_reduce="symm_mem"))
    core = EngineCore(EngineConfig(**cfg))  # the failed start left no process group behind
    core.close()
