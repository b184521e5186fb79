"""Each side of the KV handover in process, a prefill engine and a decode engine joined by a fake agent fabric:
reserve -> push -> notify -> admit gives the colocated engine's tokens; lease expiry quarantines and falls back;
an abort during a push frees nothing early; malformed notifications are dropped without failing a step."""

from __future__ import annotations

import dataclasses
import time

import msgpack
import pytest

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.messages import (
    ExportFinished,
    ExportParams,
    ImportParams,
    KVAdmitted,
    KVDestination,
    KVFallback,
    KVRankDest,
    KVReserved,
)
from pdserve.sampling_params import SamplingParams
from tests.disagg.fake_agent import Fabric
from tests.engine.tiny_models import write_tiny_model

PROMPT = [5 + (i * 37) % 240 for i in range(23)]  # 23 tokens: 5 full blocks of 4 and a partial one
IMPORT = ImportParams(("http://prefill.invalid",), "rt-1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("pd_sides") / "llama")


class Node:
    """An engine core driven by hand, with everything it emitted."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}
        self.events: list = []

    def step(self) -> None:
        for o in self.core.step():
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finished[o.request_id] = o
        self.events += self.core.take_events()

    def event(self, kind: type, rid: str):
        return next((e for e in self.events if isinstance(e, kind) and e.request_id == rid), None)


def until(cond, *nodes: Node, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        for n in nodes:
            n.step()
        time.sleep(0.002)


@pytest.fixture
def cluster(model_dir):
    made: list = []

    def make(lease_s: float = 30.0, fallback: str = "recompute", decode_block_size: int = 4,
             decode_transport: str = "auto", prefill_budget: int = 8192,
             push_ahead: bool = True) -> tuple[Node, Node, Node, Fabric]:
        fabric = Fabric()

        def cfg(role: str, block_size: int = 4, transport: str = "auto", budget: int = 8192) -> EngineConfig:
            kv = KVTransferConfig(role=role, layerwise="off", lease_s=lease_s, fallback=fallback, transport=transport,
                                  push_ahead=push_ahead)
            return EngineConfig(model=str(model_dir), device="cpu", num_gpu_blocks=48, block_size=block_size,
                                max_num_batched_tokens=budget, kv_transfer=kv)

        p = Node(EngineCore(cfg("prefill", budget=prefill_budget), kv_agent=fabric.agent("prefill")))
        d = Node(EngineCore(cfg("decode", decode_block_size, decode_transport), kv_agent=fabric.agent("decode")))
        colo = Node(EngineCore(cfg("both")))
        made.append(fabric)
        return p, d, colo, fabric

    yield make
    for f in made:
        f.close()


def handover(p: Node, d: Node, rid: str, prompt: list[int], params: SamplingParams) -> KVReserved:
    """What a decode instance's driver does: wait for the reservation, order the prefill with its destination."""
    d.core.add_request(rid, prompt, params, IMPORT)
    until(lambda: d.event(KVReserved, rid) is not None, d)
    ev = d.event(KVReserved, rid)
    p.core.add_request("p-" + rid, prompt, dataclasses.replace(params, max_tokens=1), ExportParams(ev.dest))
    return ev


def colocated(colo: Node, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    colo.core.add_request(rid, prompt, params)
    until(lambda: rid in colo.finished, colo)
    return colo.tokens[rid]


def whole(*nodes: Node) -> None:
    for n in nodes:
        assert not n.core.scheduler.requests and not n.core.kv.quarantine
        n.core.check_whole()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_handover_gives_the_colocated_tokens(cluster, params):
    p, d, colo, fabric = cluster()
    want = colocated(colo, "c", PROMPT, params)
    ev = handover(p, d, "r", PROMPT, params)
    assert ev.dest.start_block == 0 and len(ev.dest.block_ids) == 6 and ev.num_cached_tokens == 0
    until(lambda: "r" in d.finished and p.event(ExportFinished, "p-r") is not None, p, d)
    assert d.tokens["r"] == want
    done = p.event(ExportFinished, "p-r")
    assert done.error is None and done.first_token == want[0] and done.nbytes == 6 * p.core.block_bytes
    adm = d.event(KVAdmitted, "r")
    assert adm is not None and adm.handover_s >= 0
    # the same prompt again: the decode side holds its full blocks now, only the last one travels
    ev2 = handover(p, d, "r2", PROMPT, params)
    assert ev2.num_cached_tokens == 20 and ev2.dest.start_block == 5 and len(ev2.dest.block_ids) == 1
    until(lambda: "r2" in d.finished and p.event(ExportFinished, "p-r2") is not None, p, d)
    assert d.tokens["r2"] == want
    assert fabric.pushes == 2
    whole(p, d)
    assert d.core.stats()["pd"]["imports"] == 2 and p.core.stats()["pd"]["exports"] == 2


def test_lease_expiry_quarantines_and_falls_back_to_a_local_prefill(cluster):
    p, d, colo, fabric = cluster(lease_s=0.3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = colocated(colo, "c", PROMPT, params)
    d.core.add_request("r", PROMPT, params, IMPORT)
    until(lambda: d.event(KVReserved, "r") is not None, d)  # reserved; no prefill peer ever answers
    until(lambda: d.event(KVFallback, "r") is not None, d)
    assert "lease" in d.event(KVFallback, "r").reason
    assert d.core.stats()["pd"]["quarantine_blocks"] == 6  # a peer might still write: out of circulation
    until(lambda: "r" in d.finished, d)
    assert d.tokens["r"] == want  # recomputed here
    until(lambda: not d.core.kv.quarantine, d)  # ... until its own lease ends
    whole(p, d)


def test_lease_expiry_fails_the_request_when_configured(cluster):
    p, d, colo, fabric = cluster(lease_s=0.2, fallback="fail")
    d.core.add_request("r", PROMPT, SamplingParams(max_tokens=4), IMPORT)
    until(lambda: "r" in d.finished, d)
    out = d.finished["r"]
    assert out.finish_reason == "error" and "lease" in out.stop_reason and d.tokens["r"] == []
    until(lambda: not d.core.kv.quarantine, d)
    whole(d)


def test_abort_during_a_push_frees_blocks_only_after_the_copy(cluster):
    p, d, colo, fabric = cluster()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fabric.hold()
    handover(p, d, "r", PROMPT, params)
    until(lambda: p.core.scheduler.exporting, p)  # prefilled; its push waits in the fabric
    held = p.core.kv.pool.num_free
    assert p.core.abort_request("p-r") and d.core.abort_request("r")
    p.step()
    d.step()
    assert p.core.kv.pool.num_free == held  # the copy may still read these blocks
    assert d.core.stats()["pd"]["quarantine_blocks"] == 6  # ... and write those
    fabric.release()
    until(lambda: p.event(ExportFinished, "p-r") is not None, p, d)
    assert "AccessDenied" in p.event(ExportFinished, "p-r").error  # the abort withdrew the grant: nothing written
    assert fabric.agents["fake-decode:1"].refused == 1
    assert d.core.kv.quarantine  # until the prefill instance's answer says it is done
    d.core.remote_prefill_done("r")  # what the decode driver does when that answer arrives
    whole(p, d)


def test_abort_before_the_push_reports_the_export_finished(cluster):
    p, d, colo, fabric = cluster()
    ev = handover(p, d, "r", PROMPT, SamplingParams(max_tokens=3))
    assert ev is not None
    assert p.core.abort_request("p-r")  # still waiting: no push will happen
    done = p.event(ExportFinished, "p-r") or p.core.take_events()[0]
    assert isinstance(done, ExportFinished) and "aborted" in done.error
    d.core.abort_request("r")
    d.core.remote_prefill_done("r")  # the prefill instance answered: nothing writes into the reservation
    whole(p, d)


def test_malformed_notifications_are_dropped_and_fail_nothing(cluster):
    p, d, colo, fabric = cluster()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = colocated(colo, "c", PROMPT, params)
    fabric.hold()
    handover(p, d, "r", PROMPT, params)
    dec_agent = fabric.agents["fake-decode:1"]
    ok = {"request_id": "r", "src": 0, "src_tp": 1, "t_prefill_done": 1.0}
    junk = [b"\xc1not msgpack", msgpack.packb([1, 2, 3]), msgpack.packb({"request_id": 5}),
            msgpack.packb({**ok, "first_token": 10**9}),
            msgpack.packb({**ok, "first_token": 3, "t_prefill_done": float("nan")}),
            msgpack.packb({**ok, "first_token": True}),
            msgpack.packb({**ok, "first_token": 3, "logprob": [0.0, [[-1, 0]]]}),
            msgpack.packb({**ok, "first_token": 3, "src": 1}),  # rank 1 of a 1-rank instance
            msgpack.packb({**ok, "first_token": 3, "src_tp": 0}),
            msgpack.packb(ok),  # the pair (0 -> 0) without the first token
            msgpack.packb({**ok, "first_token": "3"})]
    for payload in junk:
        dec_agent.inject(payload, key="r")
    dec_agent.inject(msgpack.packb({"first_token": 3, "t_prefill_done": 1.0}))  # no key: names no request
    d.step()
    assert d.core.stats()["pd"]["dropped_notifications"] == len(junk) + 1
    assert d.core.scheduler.requests["r"].t_reserved is not None  # still waiting for the real KV
    fabric.release()
    until(lambda: "r" in d.finished, p, d)
    assert d.tokens["r"] == want
    until(lambda: p.event(ExportFinished, "p-r") is not None, p)
    whole(p, d)


def test_a_failed_push_is_never_decoded_on(cluster):
    p, d, colo, fabric = cluster()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = colocated(colo, "c", PROMPT, params)
    d.core.add_request("r", PROMPT, params, IMPORT)
    until(lambda: d.event(KVReserved, "r") is not None, d)
    fabric.agents["fake-decode:1"].inject(msgpack.packb({"request_id": "r", "src": 0, "src_tp": 1}),
                                          error="link down", sender="fake-prefill:1", key="r")
    until(lambda: "r" in d.finished, d)
    assert "link down" in d.event(KVFallback, "r").reason and d.tokens["r"] == want
    whole(d)


def test_requests_a_role_cannot_take_are_refused(cluster):
    p, d, colo, fabric = cluster()
    export = ExportParams(KVDestination("r", (1, 2), (KVRankDest("fake-decode:1", 0, 2),)))
    with pytest.raises(ValueError, match="role decode"):
        d.core.add_request("x", PROMPT, SamplingParams(), export)
    with pytest.raises(ValueError, match="role prefill"):
        p.core.add_request("y", PROMPT, SamplingParams(), IMPORT)
    with pytest.raises(ValueError, match="role both"):
        colo.core.add_request("z", PROMPT, SamplingParams(), IMPORT)
    whole(p, d, colo)


def test_a_peer_with_another_kv_layout_is_refused_clearly(cluster):
    p, d, colo, fabric = cluster(decode_block_size=8)
    d.core.add_request("r", PROMPT, SamplingParams(max_tokens=2), IMPORT)
    until(lambda: d.event(KVReserved, "r") is not None, d)
    dest = d.event(KVReserved, "r").dest
    assert dest.layout.block_size == 8 and dest.layout.dtype == "float32"
    with pytest.raises(ValueError, match=r"KV layout mismatch .*block_size: 8 vs 4 here"):
        p.core.add_request("p-r", PROMPT, SamplingParams(max_tokens=1), ExportParams(dest))
    assert fabric.pushes == 0
    d.core.abort_request("r")
    d.core.remote_prefill_done("r")
    whole(p, d)


def test_a_peer_with_another_kv_transport_is_refused_clearly(cluster):
    p, d, colo, fabric = cluster(decode_transport="nccl")
    d.core.add_request("r", PROMPT, SamplingParams(max_tokens=2), IMPORT)
    until(lambda: d.event(KVReserved, "r") is not None, d)
    dest = d.event(KVReserved, "r").dest
    assert (dest.transport.transport, dest.transport.protocol) == ("nccl", None)
    with pytest.raises(ValueError, match=r"KV transport mismatch .*nccl vs auto here"):
        p.core.add_request("p-r", PROMPT, SamplingParams(max_tokens=1), ExportParams(dest))
    assert fabric.pushes == 0 and p.core.num_steps == 0
    d.core.abort_request("r")
    d.core.remote_prefill_done("r")
    whole(p, d)


def test_a_decode_peer_lost_since_is_dialled_again(cluster):
    """The prefill side's link to a decode agent goes when that peer is lost; the next order dials it again (and
    fixes its transport again) instead of pushing to a peer that is gone."""
    p, d, colo, fabric = cluster()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = colocated(colo, "c", PROMPT, params)
    agent = fabric.agents["fake-prefill:1"]
    rank = p.core.executor.driver.extras["kv"]
    for i in range(3):
        if i == 2:
            agent.lose("fake-decode:1")
            until(lambda: not rank._peers, p)
            assert rank._connected("fake-decode:1") is None  # no layer-by-layer write to a peer that is gone
        handover(p, d, f"r{i}", PROMPT, params)
        until(lambda i=i: f"r{i}" in d.finished and p.event(ExportFinished, f"p-r{i}") is not None, p, d)
        assert d.tokens[f"r{i}"] == want and p.event(ExportFinished, f"p-r{i}").error is None
    assert agent.connects == 2  # once at first, once after the loss
    assert [(t["transport"], t["outcome"], t["count"]) for t in p.core.stats()["pd"]["transfers"]] == [("tcp", "ok", 3)]
    whole(p, d)


def dialled(p: Node) -> None:
    """Wait for the prefill rank's dial of the decode agent (started when the export request was added), so the
    first chunk's blocks can already go ahead."""
    rank = p.core.executor.driver.extras["kv"]
    for f in list(rank._connects.values()):
        f.result(5)


@pytest.mark.parametrize("push_ahead", [True, False], ids=["ahead", "after"])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_chunked_prompt_pushes_its_blocks_ahead_and_gives_the_colocated_tokens(cluster, params, push_ahead):
    """A 23-token prompt prefilled in chunks of 8, 8 and 7 tokens: blocks 0-1 go out after the first chunk and
    2-3 after the second, while the next chunk computes; only blocks 4-5 move after the prefill."""
    p, d, colo, fabric = cluster(prefill_budget=8, push_ahead=push_ahead)
    want = colocated(colo, "c", PROMPT, params)
    d.core.add_request("r", PROMPT, params, IMPORT)
    until(lambda: d.event(KVReserved, "r") is not None, d)
    p.core.add_request("p-r", PROMPT, dataclasses.replace(params, max_tokens=1),
                       ExportParams(d.event(KVReserved, "r").dest))
    dialled(p)
    until(lambda: "r" in d.finished and p.event(ExportFinished, "p-r") is not None, p, d)
    assert d.tokens["r"] == want
    done = p.event(ExportFinished, "p-r")
    assert done.error is None and done.nbytes == 6 * p.core.block_bytes  # every block once, ahead or after
    assert fabric.pushes == (3 if push_ahead else 1)
    whole(p, d)


def test_an_abort_mid_prefill_frees_blocks_only_after_the_writes_pushed_ahead(cluster):
    """Aborted after its first chunk's blocks went ahead (their write still in flight): the prefill side holds
    the blocks and reports the export's end only once that write ended; the decode side hears of it then."""
    p, d, colo, fabric = cluster(prefill_budget=8)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    d.core.add_request("r", PROMPT, params, IMPORT)
    until(lambda: d.event(KVReserved, "r") is not None, d)
    p.core.add_request("p-r", PROMPT, dataclasses.replace(params, max_tokens=1),
                       ExportParams(d.event(KVReserved, "r").dest))
    dialled(p)
    fabric.hold()
    p.step()  # the first chunk: its two full blocks go ahead, and wait in the fabric
    req = p.core.scheduler.requests["p-r"]
    assert req.kv_pushed_blocks == 2
    held = p.core.kv.pool.num_free
    assert p.core.abort_request("p-r") and d.core.abort_request("r")
    for _ in range(3):
        p.step()
        d.step()
    assert p.core.kv.pool.num_free == held  # the write may still read these blocks
    assert p.event(ExportFinished, "p-r") is None  # ... so the decode side is not told yet
    assert p.core.scheduler.exporting["p-r"].export_aborted
    fabric.release()
    until(lambda: p.event(ExportFinished, "p-r") is not None, p, d)
    assert "ended before its KV push" in p.event(ExportFinished, "p-r").error
    assert fabric.agents["fake-decode:1"].refused == 1  # the abort withdrew the grant: nothing written
    d.core.remote_prefill_done("r")  # what the decode driver does when the prefill instance answers
    whole(p, d)
