"""The pieces behind the per-peer transport choice, in process: which transports two instances may hand KV over
(checked before a prompt is computed), when pushes go layer by layer, what a pair's notification may name as its
transport, and how the per-transport counts reach the instance's and the router's /metrics."""

from __future__ import annotations

import time

import msgpack
import pytest

from pdserve.config import KVTransferConfig
from pdserve.disagg.agent import transfer_counts, transport_spec
from pdserve.disagg.driver import handover_phases, prefill_order
from pdserve.disagg.rank_kv import layerwise_for, parse_notification
from pdserve.disagg.routes import order_mismatch, parse_order
from pdserve.engine.messages import KVAdmitted, KVDestination, KVLayout, KVRankDest, KVReserved, KVTransportSpec
from pdserve.kv.notify import Notification
from pdserve.router.metrics import RouterMetrics
from pdserve.sampling_params import SamplingParams
from pdserve.server.metrics import ServerMetrics

LAYOUT = KVLayout("float32", 16, 18, 2, 256)
RANKS = (KVRankDest("127.0.0.1:7000", 0, 1), KVRankDest("127.0.0.1:7001", 1, 2))


def spec(transport: str, protocol: str = "rdma") -> KVTransportSpec:
    return transport_spec(KVTransferConfig(role="decode", transport=transport, protocol=protocol))


@pytest.mark.parametrize("a,b", [("tcp", "tcp"), ("auto", "tcp"), ("cuda_ipc", "auto"), ("auto", "nixl"),
                                 ("nccl", "nccl"), ("mooncake", "mooncake")])
def test_agreeing_transports(a, b):
    assert spec(a).mismatch(spec(b)) is None and spec(b).mismatch(spec(a)) is None


@pytest.mark.parametrize("a,b", [("nccl", "tcp"), ("nccl", "auto"), ("mooncake", "auto"), ("mooncake", "nccl"),
                                 ("tcp", "cuda_ipc")])
def test_mismatched_transports_name_both(a, b):
    why = spec(a).mismatch(spec(b))
    assert why is not None and "KV transport mismatch" in why and a in why and b in why


def test_mooncake_protocols_must_agree_and_count_only_for_mooncake():
    assert "protocol" in spec("mooncake", "tcp").mismatch(spec("mooncake", "rdma"))
    assert spec("nccl", "tcp") == spec("nccl", "rdma")  # nccl has no protocol: the flag is not compared


def test_the_order_carries_the_decode_transport_and_the_prefill_side_refuses_a_mismatch():
    dest = KVDestination("d-1", (3, 4), RANKS, 0, LAYOUT, spec("nccl"))
    ev = KVReserved("d-1", dest, 0, 0.0, 0.0)
    raw = msgpack.unpackb(msgpack.packb(prefill_order("d-1", [1, 2, 3], SamplingParams(max_tokens=4), ev)))
    _, _, _, parsed = parse_order(raw)
    assert parsed == dest
    ours = {"layout": LAYOUT.__dict__, "transport": {"transport": "mooncake", "protocol": "tcp"}}
    assert "mooncake" in order_mismatch(ours, parsed) and "nccl" in order_mismatch(ours, parsed)
    assert order_mismatch({**ours, "transport": {"transport": "nccl", "protocol": None}}, parsed) is None
    other = KVLayout("float32", 32, 18, 2, 256)
    assert "block_size" in order_mismatch({**ours, "layout": other.__dict__}, parsed)
    # an order of an instance that names no transport is taken (the agents then say what serves, per peer)
    raw["dest"]["transport"] = None
    assert parse_order(raw)[3].transport is None
    for bad in ({"transport": "carrier-pigeon"}, {"transport": "mooncake", "protocol": "udp"}, "nccl"):
        raw["dest"]["transport"] = bad
        with pytest.raises((ValueError, TypeError)):
            parse_order(raw)


@pytest.mark.parametrize("mode,transport,want", [("auto", "tcp", True), ("auto", "nccl", False),
                                                 ("auto", "mooncake", False), ("auto", "cuda_ipc", False),
                                                 ("on", "nccl", True), ("on", "mooncake", True), ("off", "tcp", False)])
def test_layerwise_is_decided_per_transport(mode, transport, want):
    assert layerwise_for(mode, transport) is want


def note(payload: dict | bytes, error: str | None = None) -> Notification:
    raw = payload if isinstance(payload, bytes) else msgpack.packb(payload)
    return Notification("prefill-agent", 1, "write", raw, 0, error, "req-1")


def test_notifications_carry_the_transport_the_pair_names():
    base = {"first_token": 7, "t_prefill_done": 1.5, "logprob": None, "src": 0, "src_tp": 2}
    a = parse_notification(note({**base, "transport": "nccl"}), 0, 100, "127.0.0.1:9")
    assert (a.transport, a.peer, a.first_token, a.src_tp) == ("nccl", "127.0.0.1:9", 7, 2)
    assert parse_notification(note(base), 0, 100).transport is None
    with pytest.raises(ValueError, match="transport"):
        parse_notification(note({**base, "transport": "carrier-pigeon"}), 0, 100)
    # a failure is taken whatever its payload names (the request must not wait out its lease)
    failed = parse_notification(note({"transport": 5, "src": 1, "src_tp": 2}, error="receiver refused"), 1, 100, "p")
    assert failed.error == "receiver refused" and failed.transport is None and failed.peer == "p"


def test_instance_metrics_count_transfers_per_transport_and_peer():
    m = ServerMetrics("m")
    counts = transfer_counts({("nccl", "10.0.0.2:7000", "ok"): 3, ("nccl", "10.0.0.2:7000", "failed"): 1})
    text = m.render({"pd": {"transfers": counts}}).decode()
    assert 'pdserve:kv_transfers_total{model_name="m",outcome="ok",peer="10.0.0.2:7000",transport="nccl"} 3.0' in text
    assert 'outcome="failed",peer="10.0.0.2:7000",transport="nccl"} 1.0' in text
    assert "pdserve:kv_transfers" not in m.render({}).decode()  # a colocated instance has none


def test_router_counts_the_transport_of_pd_timings():
    m = RouterMetrics()
    m.observe_timings({"transport": "mooncake", "prefill_s": 0.1}, "pd")
    m.observe_timings({"transport": "mooncake"}, "pd")
    m.observe_timings({"transport": "x" * 40}, "pd")  # not a transport: not a label
    m.observe_timings({"transport": "tcp"}, "local")  # no handover without pd
    text = m.render([]).decode()
    assert 'pdserve:router_kv_transfers_total{transport="mooncake"} 2.0' in text
    assert 'transport="tcp"' not in text and "xxxx" not in text


def test_notifications_carry_when_the_push_began_and_when_they_were_taken():
    base = {"first_token": 7, "t_prefill_done": 1.5, "logprob": None, "src": 0, "src_tp": 1}
    t0 = time.time()
    a = parse_notification(note({**base, "t_push": 1.75}), 0, 100)
    assert a.t_push == 1.75 and t0 <= a.t_notified <= time.time()
    assert parse_notification(note(base), 0, 100).t_push is None  # an older peer: served, no phases
    for bad in (float("nan"), "soon", True):
        with pytest.raises(ValueError, match="t_push"):
            parse_notification(note({**base, "t_push": bad}), 0, 100)


def test_the_handover_splits_into_three_phases():
    ev = KVAdmitted("r", t_prefill_done=10.0, t_admitted=10.0055, handover_s=0.0055, t_push=10.0005,
                    t_notified=10.0045)
    got = handover_phases(ev)
    assert got.keys() == {"push_start_s", "push_landed_s", "admit_s"}
    assert got["push_start_s"] == pytest.approx(0.0005) and got["push_landed_s"] == pytest.approx(0.004)
    assert got["admit_s"] == pytest.approx(0.001)
    assert sum(got.values()) == pytest.approx(ev.handover_s)
    assert handover_phases(KVAdmitted("r", 10.0, 10.005, 0.005)) == {}  # the peer said no push time


def test_router_histograms_take_the_handover_phases_in_pd_mode_only():
    m = RouterMetrics()
    m.observe_timings({"handover_s": 0.004, "push_start_s": 0.0001, "push_landed_s": 0.003, "admit_s": 0.0002}, "pd")
    m.observe_timings({"push_landed_s": 0.003}, "local")
    text = m.render([]).decode()
    for phase in ("handover", "push_start", "push_landed", "admit"):
        assert f'pdserve:router_phase_seconds_count{{mode="pd",phase="{phase}"}} 1.0' in text
    assert 'mode="local",phase="push_landed"' not in text
