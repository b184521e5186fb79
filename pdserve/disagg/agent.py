"""The KV agent of a prefill or decode instance: configured from the instance's KVTransferConfig, with the engine's
whole KV pool registered once as region "kv"."""

from __future__ import annotations

from pdserve.config import KVTransferConfig
from pdserve.engine.kv_connector import KVPool
from pdserve.engine.messages import POOL_REGION, KVTransportSpec
from pdserve.kv import AgentConfig, ThreadedAgent
from pdserve.kv.errors import KVConfigError
from pdserve.secret import HELP


def agent_config(config: KVTransferConfig, nvtx: bool = False) -> AgentConfig:
    if config.secret is None:
        raise KVConfigError(
            f"a {config.role} instance needs the deployment secret, the same on every instance: {HELP}")
    return AgentConfig(host=config.host, port=config.port, transport=config.transport, secret=config.secret,
                       protocol=config.protocol, devices=config.devices, nvtx=nvtx)


def transport_spec(config: KVTransferConfig) -> KVTransportSpec:
    """How this instance's agents move KV, as peers check it before a handover (protocol: mooncake's only)."""
    return KVTransportSpec(config.transport, config.protocol if config.transport == "mooncake" else None)


def start_agent(config: KVTransferConfig, pool: KVPool, agent: ThreadedAgent | None = None,
                nvtx: bool = False) -> tuple[ThreadedAgent, int]:
    """A listening agent (or the one given) with the pool registered; returns it and the pool's region id."""
    agent = agent if agent is not None else ThreadedAgent(agent_config(config, nvtx))  # nvtx: EngineConfig.nvtx
    try:
        # one (head, layer) run of a block is the unit every push is made of (NIXL prepares its lists in these units)
        region = agent.register(pool.tensor, name=POOL_REGION, unit_bytes=pool.run_bytes)
    except BaseException:
        agent.close()
        raise
    return agent, region


def transfer_counts(counts: dict[tuple[str, str, str], int]) -> list[dict]:
    """Per (transport, peer, outcome) counts as /load and /metrics show them."""
    return [{"transport": t, "peer": p, "outcome": o, "count": n} for (t, p, o), n in sorted(counts.items())]
