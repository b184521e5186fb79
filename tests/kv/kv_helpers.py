"""Shared helpers of the KV transfer tests: peers in spawned processes, agents in the test process."""

import multiprocessing as mp
import secrets

from pdserve.bench.transfer import Remote
from pdserve.bench.transfer_worker import Pool
from pdserve.kv import AgentConfig, KVAgent, XferList

BB = 4096 + 48  # block bytes: not a power of two on purpose
NB = 96  # blocks per pool
CTX = mp.get_context("spawn")
SECRET = secrets.token_bytes(32)  # this test session's deployment secret
# transfer mechanics: authenticated peers, no grants (the grant checks have their own tests)
OPEN = {"secret": SECRET, "open_access": True}
GRANTS = {"secret": SECRET, "open_access": False}  # the serving configuration: authentication and grants


def with_security(kw: dict) -> dict:
    """Agent keywords with this session's secret and open access unless `kw` says otherwise."""
    out = {**OPEN, **kw}
    if out.get("insecure"):
        out.pop("secret")
    return out


def spawn_peer(name: str, **agent_kw) -> Remote:
    spec = {"num_blocks": NB, "block_bytes": BB, "backend": "numpy", "device": "cpu",
            "agent": {"transport": "tcp", "name": name, "io_timeout_s": 3.0, "tcp_stripe_min_bytes": 64 << 10,
                      **with_security(agent_kw)}}
    return Remote(CTX, name, spec, timeout=30)


def local_agent(unit: int = 0, **kw) -> tuple[KVAgent, Pool, int]:
    pool = Pool(NB, BB, "numpy", "cpu")
    agent = KVAgent(AgentConfig(**{"transport": "tcp", "io_timeout_s": 3.0, "tcp_stripe_min_bytes": 64 << 10,
                                   **with_security(kw)}))
    return agent, pool, agent.register(pool.data, name="kv", unit_bytes=unit)


BIG = 48 << 20  # bytes of a mid-transfer write: far more than socket buffers hold


def big_peer(name: str, **agent_kw) -> Remote:
    spec = {"num_blocks": 1, "block_bytes": BIG, "backend": "numpy", "device": "cpu",
            "agent": {"transport": "tcp", "name": name, **OPEN, **agent_kw}}
    return Remote(CTX, name, spec, timeout=30)


def xfer(lr: int, rr: int, n: int) -> XferList:
    """One run of n bytes from offset 0 of local region lr to offset 0 of remote region rr."""
    return XferList.build(lr, 0, rr, 0, n)

