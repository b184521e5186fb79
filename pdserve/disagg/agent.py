"""The KV agent of a prefill or decode instance: configured from the instance's KVTransferConfig, with the engine's
whole KV pool registered once as region "kv"."""

from __future__ import annotations

from pdserve.config import KVTransferConfig
from pdserve.engine.kv_connector import KVPool
from pdserve.engine.messages import POOL_REGION
from pdserve.kv import AgentConfig, ThreadedAgent


def agent_config(config: KVTransferConfig) -> AgentConfig:
    return AgentConfig(host=config.host, port=config.port, transport=config.transport)


def start_agent(config: KVTransferConfig, pool: KVPool, agent: ThreadedAgent | None = None) -> tuple[ThreadedAgent, int]:
    """A listening agent (or the one given) with the pool registered; returns it and the pool's region id."""
    agent = agent if agent is not None else ThreadedAgent(agent_config(config))
    try:
        region = agent.register(pool.tensor, name=POOL_REGION)
    except BaseException:
        agent.close()
        raise
    return agent, region
