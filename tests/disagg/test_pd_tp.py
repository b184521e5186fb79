"""PD between instances of different tensor-parallel sizes, in process (CPU, gloo, one worker process for the TP=2
side; real tcp KV agents, one per rank): prefill TP=1 -> decode TP=2 and prefill TP=2 -> decode TP=1 give the
colocated TP=1 engine's tokens, with whole-block and layer-by-layer pushes and prefix hits on the decode side, for
split KV heads (Llama: 2 KV heads) and replicated ones (Gemma 3: 1 KV head on every rank). An abort mid-handover
and a rank whose write is refused leave every rank's pool and grants whole. (TP=2 -> TP=2 needs two TP engines,
one per process: tests/disagg/test_pd_tp_live.py.) The opt-in transports carry a TP handover too: prefill TP=2 ->
decode TP=1 over nccl (Gloo) and Mooncake (its TCP), every (prefill rank, decode rank) pair over its own link, named
on every push and counted per peer on both sides."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.messages import ExportFinished, KVAdmitted, KVFallback
from pdserve.sampling_params import SamplingParams
from tests.disagg.test_pd_sides import PROMPT, Node, colocated, handover, until
from tests.engine.tiny_models import write_tiny_model
from tests.kv.test_kv_optin import MOONCAKE

pytestmark = pytest.mark.timeout(300)

SECRET = b"pdserve-tests-tp-secret-0123456789abcdef"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)


OTHER = [7 + (i * 53) % 230 for i in range(22)]  # 22 tokens: 6 blocks, none shared with PROMPT
ABORTED = [9 + (i * 71) % 220 for i in range(21)]  # the abort test's (its fallback caches it on the decode side)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd_tp")
    return {arch: write_tiny_model(arch, root / arch) for arch in ("llama", "gemma3")}


def engine(path, role: str, tp: int, transport: str = "tcp") -> EngineCore:
    kv = KVTransferConfig(role=role, transport=transport, layerwise="on", secret=SECRET,
                          protocol="tcp" if transport == "mooncake" else "rdma")
    return EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", num_gpu_blocks=48, block_size=4,
                                   tensor_parallel_size=tp, kv_transfer=kv))


def close(*nodes: Node) -> None:
    for n in nodes:
        if n.core.connector is not None:
            n.core.connector.close()
        n.core.close()


class Pairs:
    """One prefill/decode pair (and a colocated TP=1 engine) at a time, reused by consecutive tests asking for the
    same one: a process holds one tensor-parallel engine at a time, and starting one costs seconds."""

    def __init__(self, dirs: dict):
        self.dirs = dirs
        self.key = None
        self.nodes: tuple[Node, Node, Node] | None = None

    def get(self, arch: str, p_tp: int, d_tp: int, transport: str = "tcp") -> tuple[Node, Node, Node]:
        if self.key != (arch, p_tp, d_tp, transport):
            self.close()
            path = self.dirs[arch]
            colo = Node(EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", num_gpu_blocks=48,
                                                block_size=4)))
            self.nodes = (Node(engine(path, "prefill", p_tp, transport)), Node(engine(path, "decode", d_tp, transport)),
                          colo)
            self.key = (arch, p_tp, d_tp, transport)
        return self.nodes

    def close(self) -> None:
        if self.nodes is not None:
            close(*self.nodes)
        self.key = self.nodes = None


@pytest.fixture(scope="module")
def pairs(model_dirs):
    ps = Pairs(model_dirs)
    yield ps
    ps.close()


def grants(worker, rid: str) -> int:
    """Live grants of `rid` on this rank's KV agent."""
    return len(worker.extras["kv"].agent.agent.grants.live(rid))


def revoke(worker, rid: str, rank: int) -> None:
    if worker.rank == rank:
        worker.extras["kv"].revoke(rid)


def whole(*nodes: Node, rids=()) -> None:
    for n in nodes:
        assert not n.core.scheduler.requests and not n.core.kv.quarantine
        n.core.check_whole()  # the block manager is rank 0's and shared: every rank's pool
        if n.core.connector is not None and n.core.connector.role == "decode":
            for rid in rids:
                assert n.core.executor.collective_rpc(grants, rid) == [0] * n.core.executor.size


def test_abort_mid_handover_and_a_refused_rank_leave_every_pool_whole(pairs):
    p, d, colo = pairs.get("llama", 1, 2)
    want = colocated(colo, "c", ABORTED, GREEDY)
    # aborted after the reservation, before the push: every rank's grant goes, the push is refused everywhere
    handover(p, d, "a", ABORTED, GREEDY)
    assert d.core.executor.collective_rpc(grants, "a") == [1, 1]
    assert d.core.abort_request("a")
    assert d.core.executor.collective_rpc(grants, "a") == [0, 0]
    assert d.core.stats()["pd"]["quarantine_blocks"] == 6
    until(lambda: p.event(ExportFinished, "p-a") is not None, p, d)
    assert "AccessDenied" in p.event(ExportFinished, "p-a").error
    d.core.remote_prefill_done("a")  # what the decode driver does when the prefill instance answers
    whole(p, d, rids=["a"])

    # rank 1 refuses its share: the handover fails, the prompt is recomputed here, nothing leaks
    handover(p, d, "b", ABORTED, GREEDY)
    d.core.executor.collective_rpc(revoke, "b", 1)
    until(lambda: p.event(ExportFinished, "p-b") is not None, p, d)
    err = p.event(ExportFinished, "p-b").error
    assert "AccessDenied" in err
    d.step()
    assert "b" not in d.finished and d.event(KVAdmitted, "b") is None  # rank 0's KV alone admits nothing
    d.core.remote_prefill_failed("b", err, peer_done=True)  # the driver, on the prefill instance's answer
    until(lambda: "b" in d.finished, d)
    assert d.event(KVFallback, "b") is not None and d.tokens["b"] == want
    whole(p, d, rids=["b"])


@pytest.mark.parametrize("arch,p_tp,d_tp", [("llama", 1, 2), ("llama", 2, 1), ("gemma3", 2, 1), ("gemma3", 1, 2)])
def test_tp_handover_gives_the_colocated_tokens(pairs, arch, p_tp, d_tp):
    p, d, colo = pairs.get(arch, p_tp, d_tp)
    want = {(k, tuple(pr)): colocated(colo, f"c-{k}-{len(pr)}", pr, params)
            for k, params in (("greedy", GREEDY), ("seeded", SEEDED)) for pr in (PROMPT, OTHER)}
    dest = None
    # the first push goes whole (its connections are made meanwhile); then prefix hits and a fresh prompt, both ways
    for i, (kind, prompt, layerwise) in enumerate([("greedy", PROMPT, False), ("seeded", PROMPT, True),
                                                   ("greedy", PROMPT, False), ("seeded", OTHER, True)]):
        p.core.connector.layerwise = "on" if layerwise else "off"
        rid = f"{arch}-{p_tp}{d_tp}-{i}"
        ev = handover(p, d, rid, prompt, GREEDY if kind == "greedy" else SEEDED)
        dest = ev.dest
        until(lambda rid=rid: rid in d.finished and p.event(ExportFinished, "p-" + rid) is not None, p, d)
        assert d.tokens[rid] == want[kind, tuple(prompt)], (rid, kind, layerwise)
        done = p.event(ExportFinished, "p-" + rid)
        assert done.error is None and done.first_token == want[kind, tuple(prompt)][0]
        assert done.layerwise == layerwise and done.transport == "tcp", done.transport
        assert d.event(KVAdmitted, rid) is not None
        if prompt is PROMPT and i > 0:  # the decode side holds the prompt's 5 full blocks: only the last travels
            assert ev.num_cached_tokens == 20 and ev.dest.start_block == 5 and len(ev.dest.block_ids) == 1
        else:
            assert ev.num_cached_tokens == 0 and len(ev.dest.block_ids) == 6
            # every decode rank receives its own heads of the 6 blocks, once
            assert done.nbytes == 6 * d.core.block_bytes * d_tp
    heads = d.core.hf_config.num_key_value_heads
    assert [(r.head_start, r.head_stop) for r in dest.ranks] == (
        [(0, heads)] if d_tp == 1 else [(0, 1), (1, 2)] if heads == 2 else [(0, 1), (0, 1)])
    assert dest.layout.num_kv_heads == heads  # global, whatever the size
    assert p.core.stats()["pd"]["layerwise_exports"] == 2
    whole(p, d, rids=[f"{arch}-{p_tp}{d_tp}-{i}" for i in range(4)])


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_tp_push_ahead_gives_the_colocated_tokens(pairs, p_tp, d_tp):
    """A 29-token prompt prefilled in 8-token chunks: every prefill rank pushes its heads of the blocks each chunk
    completed while the next chunk computes (the decode ranks get their heads of all 8 blocks, once), and the
    decode side answers as the colocated engine."""
    p, d, colo = pairs.get("llama", p_tp, d_tp)
    prompt = [11 + (i * 41) % 225 for i in range(29)]  # none of its blocks is cached on the decode side yet
    want = colocated(colo, f"c-ahead-{p_tp}{d_tp}", prompt, SEEDED)
    p.core.connector.layerwise = "off"
    budget, p.core.scheduler.max_num_batched_tokens = p.core.scheduler.max_num_batched_tokens, 8
    rid = f"ahead-{p_tp}{d_tp}"
    try:
        before = p.core.stats()["pd"]["ahead_exports"]
        ev = handover(p, d, rid, prompt, SEEDED)
        until(lambda: rid in d.finished and p.event(ExportFinished, "p-" + rid) is not None, p, d)
    finally:
        p.core.scheduler.max_num_batched_tokens = budget
    assert d.tokens[rid] == want
    done = p.event(ExportFinished, "p-" + rid)
    assert done.error is None and len(ev.dest.block_ids) == 8 and done.nbytes == 8 * d.core.block_bytes * d_tp
    assert p.core.stats()["pd"]["ahead_exports"] == before + 1
    whole(p, d, rids=[rid])


@pytest.mark.parametrize("transport", [pytest.param("nccl", id="nccl-gloo"),
                                       pytest.param("mooncake", id="mooncake-tcp", marks=MOONCAKE)])
def test_tp_handover_over_the_opt_in_transports(pairs, transport):
    """Prefill TP=2 -> decode TP=1 (Llama: each prefill rank holds one of the 2 KV heads and sends it to decode rank
    0): the colocated tokens, whole pushes under --kv-layerwise auto and layer by layer under on; each prefill rank's
    agent names the transport on its pushes, and both sides count them per peer."""
    p, d, colo = pairs.get("llama", 2, 1, transport)
    cases = [("auto", PROMPT, GREEDY), ("auto", OTHER, SEEDED), ("on", OTHER, GREEDY)]
    want = {(tuple(pr), params.seed): colocated(colo, f"c-{transport}-{i}", pr, params)
            for i, (_, pr, params) in enumerate(cases)}
    rids = []
    for i, (mode, prompt, params) in enumerate(cases):
        p.core.connector.layerwise = mode
        rid = f"{transport}-{i}"
        rids.append(rid)
        handover(p, d, rid, prompt, params)
        until(lambda rid=rid: rid in d.finished and p.event(ExportFinished, "p-" + rid) is not None, p, d)
        assert d.tokens[rid] == want[tuple(prompt), params.seed], (rid, mode)
        done = p.event(ExportFinished, "p-" + rid)
        assert done.error is None and done.transport == transport and done.layerwise == (mode == "on"), done
    # two pairs per push (prefill rank 0 and 1 -> decode rank 0), counted per decode agent and per prefill agent
    decode_agent = d.core.connector.dest_ranks[0].agent
    pushed = p.core.stats()["pd"]["transfers"]
    assert pushed == [{"transport": transport, "peer": decode_agent, "outcome": "ok", "count": 2 * len(cases)}]
    landed = d.core.stats()["pd"]["transfers"]
    assert {t["peer"] for t in landed} == set(p.core.connector.agents), landed
    assert all(t["transport"] == transport and t["outcome"] == "ok" and t["count"] == len(cases) for t in landed)
    assert p.core.connector.describe()["transport"]["transport"] == transport
    whole(p, d, rids=rids)
