"""--nvtx: one engine flag turns on the engine's step ranges and its KV agents' transfer ranges."""

import argparse

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.disagg.agent import agent_config
from pdserve.server.main import add_arguments, build_config, config_argv


def test_nvtx_flag_reaches_the_engine_config_and_the_agent():
    def parse(*argv):
        return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))

    config = build_config(parse("--nvtx"))
    assert config.engine.nvtx is True and "--nvtx" in config_argv(config)  # the launcher passes it on
    assert build_config(parse()).engine.nvtx is EngineConfig().nvtx is False
    kvt = KVTransferConfig(role="decode", secret=b"s" * 32)
    assert agent_config(kvt, nvtx=True).nvtx is True and agent_config(kvt).nvtx is False
