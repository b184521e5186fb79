"""Peer authentication of the KV port: an unauthenticated client cannot read or write a byte, learn anything about
the agent, or disturb a transfer in flight; a wrong secret fails clearly; authenticated peers' malformed frames are
dropped without harm."""

import asyncio
import logging
import os
import secrets
import threading
import time

import msgpack
import numpy as np
import pytest

from pdserve.kv import KVTransferError, PeerAuthenticationError
from pdserve.kv.wire import (
    PREAMBLE_CTRL,
    PREAMBLE_DATA,
    REQ,
    pack_ctrl_len,
    pack_handshake,
)
from tests.kv.attack_helpers import RecordingProxy, raw, read_all
from tests.kv.kv_helpers import BB, GRANTS, NB, local_agent


def frames_of(data: bytes) -> list[dict]:
    """The handshake frames (u16 length + msgpack) in what a server sent."""
    out, i = [], 0
    while i + 2 <= len(data):
        n = int.from_bytes(data[i:i + 2], "little")
        out.append(msgpack.unpackb(data[i + 2:i + 2 + n], raw=False))
        i += 2 + n
    assert i == len(data), "trailing bytes that are not a frame"
    return out


@pytest.mark.timeout(60)
def test_wrong_secret_fails_clearly_and_no_side_learns_the_other():
    async def main():
        b, _, _ = local_agent(name="victim-b", **GRANTS)
        await b.start()
        a, _, _ = local_agent(name="intruder", secret=secrets.token_bytes(32), open_access=False)
        with pytest.raises(PeerAuthenticationError, match="KV peer authentication failed .*rejected our proof"):
            await a.connect(b.address)
        assert b.peers == {} and a.peers == {}
        c, _, _ = local_agent(name="open-c", insecure=True)  # an agent without a secret is refused the same way
        with pytest.raises(PeerAuthenticationError, match="KV peer authentication failed"):
            await c.connect(b.address)
        await c.start()  # ... and a secure agent will not talk to an open one either
        with pytest.raises(PeerAuthenticationError, match="KV peer authentication failed"):
            await b.connect(c.address)
        assert b.peers == {} and c.peers == {}
        assert b.port_stats()["per_peer"] == {}
        for x in (a, b, c):
            await x.close()

    asyncio.run(main())


def _probe(address: str) -> list[tuple[str, bytes, bool]]:
    """What unauthenticated clients get back for their best tries."""
    out = []
    # a valid-looking hello, then a proof without the secret, claiming a plausible name
    s = raw(address)
    s.sendall(PREAMBLE_CTRL + pack_handshake({"t": "hello", "v": 2, "role": "ctrl", "ni": os.urandom(32)}))
    first = s.recv(4096)
    s.sendall(pack_handshake({"t": "proof", "name": "prefill-0", "mac": os.urandom(32)}))
    rest, closed = read_all(s)
    out.append(("proof without the secret", first + rest, closed))
    # the previous protocol's hello, which used to be answered with the name, pid and region table
    s = raw(address)
    s.sendall(b"PDKVCTL1" + len(body := msgpack.packb({"t": "hello", "name": "x", "address": "1.2.3.4:5"})).to_bytes(
        4, "little") + body)
    out.append(("old hello", *read_all(s)))
    # the previous protocol's data connection: preamble, name, then a WRITE header
    s = raw(address)
    s.sendall(b"PDKVDAT1\x01\x00x" + REQ.pack(b"PDKV", 1, 0, 0, 1, 0, 1, 0, 1, 8))
    out.append(("old data request", *read_all(s)))
    # a data request without any handshake
    s = raw(address)
    s.sendall(PREAMBLE_DATA + REQ.pack(b"PDKV", 1, 0, 0, 1, 0, 1, 0, 1, 8) + bytes(32))
    out.append(("data request without a handshake", *read_all(s)))
    # a forged notification frame on a control connection
    s = raw(address)
    body = msgpack.packb({"t": "notif", "x": 1, "op": "write", "p": b"x", "k": "r1"}, use_bin_type=True)
    s.sendall(PREAMBLE_CTRL + pack_ctrl_len(len(body)) + body + os.urandom(32))
    out.append(("forged notification", *read_all(s)))
    # garbage
    s = raw(address)
    s.sendall(os.urandom(4096))
    out.append(("garbage", *read_all(s)))
    return out


@pytest.mark.timeout(60)
def test_unauthenticated_clients_get_a_nonce_at_most_and_are_disconnected():
    async def main():
        b, pool, _ = local_agent(name="victim-zeta", **GRANTS)
        await b.start()
        b.grant("r1", "kv", [(0, NB * BB)], "w", time.time() + 60)  # a live grant: only authentication stands in the way
        notes = []
        b.on_notification(notes.append)
        res = await asyncio.get_running_loop().run_in_executor(None, _probe, b.address)
        for what, data, closed in res:
            assert closed, what
            assert b"victim-zeta" not in data and b.host_id.encode() not in data, what
            if what == "proof without the secret":
                challenge, reject = frames_of(data)
                assert set(challenge) == {"t", "nr"} and challenge["t"] == "challenge" and len(challenge["nr"]) == 32
                assert reject == {"t": "reject", "why": "authentication failed"}
            else:
                assert data == b"", what  # nothing at all
        assert not pool.data.any() and notes == [] and b.peers == {}
        await asyncio.sleep(0.1)
        assert b.port_stats()["connections"] == 0
        await b.close()

    asyncio.run(main())


def _attack(address: str, stop: threading.Event, counts: list[int]) -> None:
    """Garbage, forged frames and handshake-less requests, over and over, until told to stop."""
    rng = np.random.default_rng(0)
    while not stop.is_set():
        for payload in (rng.bytes(int(rng.integers(1, 2048))),
                        PREAMBLE_DATA + REQ.pack(b"PDKV", 1, 1, 0, 1, 0, 1, 3, 7, BB) + rng.bytes(64),
                        PREAMBLE_CTRL + pack_handshake({"t": "hello", "v": 2, "role": "data", "ni": rng.bytes(32)})
                        + pack_handshake({"t": "proof", "name": "prefill", "mac": rng.bytes(32)})):
            try:
                s = raw(address, timeout=2)
                s.sendall(payload)
                read_all(s, timeout=2)
                s.close()
                counts[0] += 1
            except OSError:
                counts[1] += 1


@pytest.mark.timeout(120)
def test_attacks_during_a_transfer_change_nothing():
    async def main():
        b, pb, rb = local_agent(name="decode", **GRANTS)
        a, pa, ra = local_agent(name="prefill", tcp_connections=2, **GRANTS)
        pa.fill(1)
        await b.start()
        peer = await a.connect(b.address)
        notes = []
        b.on_notification(notes.append)
        stop, counts = threading.Event(), [0, 0]
        attacker = threading.Thread(target=_attack, args=(b.address, stop, counts), daemon=True)
        attacker.start()
        try:
            for i in range(6):
                dst = list(range(8 * i, 8 * i + 8))
                b.grant_blocks(f"r{i}", "kv", dst, BB, "w", time.time() + 30, peer="prefill")
                await a.write_blocks(peer, list(range(40 + 8 * i, 48 + 8 * i)), dst, BB, ra, "kv",
                                     notif={"request_id": f"r{i}"}, key=f"r{i}")
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.get_running_loop().run_in_executor(None, attacker.join, 10)
        assert counts[0] > 20  # the attacks did run
        assert np.array_equal(pb.data[:48], pa.data[40:88])
        assert not pb.data[48:].any()
        assert [(n.peer, n.key, n.error, n.payload_dict()) for n in notes] == [
            ("prefill", f"r{i}", None, {"request_id": f"r{i}"}) for i in range(6)]
        assert list(b.peers) == ["prefill"]
        await a.close()
        await b.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_recorded_session_replayed_moves_nothing_and_delivers_nothing():
    async def main():
        b, pb, rb = local_agent(name="decode", **GRANTS)
        a, pa, ra = local_agent(name="prefill", tcp_connections=1, **GRANTS)
        pa.fill(2)
        await b.start()
        proxy = RecordingProxy(b.address)
        await proxy.start()
        peer = await a.connect(proxy.address)  # the control connection goes through the recorder ...
        a.peer(peer).address = proxy.address  # ... and so will the data connections
        notes = []
        b.on_notification(notes.append)
        dst = [10, 11, 12]
        b.grant_blocks("req-1", "kv", dst, BB, "w", time.time() + 60, peer="prefill")
        await a.write_blocks(peer, [1, 2, 3], dst, BB, ra, "kv", notif={"request_id": "req-1"}, key="req-1")
        await a.notify(peer, {"request_id": "req-1", "note": "extra"}, key="req-1")
        await asyncio.sleep(0.2)
        assert np.array_equal(pb.data[dst], pa.data[[1, 2, 3]]) and len(notes) == 2
        recorded = [bytes(r) for r in proxy.sessions]
        assert len(recorded) == 2 and all(len(r) > 100 for r in recorded)  # one control, one data connection
        assert any(len(r) > 3 * BB for r in recorded)  # the data connection carried the blocks
        pb.data[:] = 0
        notes.clear()
        original = b.peers["prefill"]

        def replay() -> list[tuple[bytes, bool]]:
            out = []
            for rec in recorded:
                s = raw(b.address)
                try:
                    s.sendall(rec)
                except OSError:
                    pass  # the server may close before taking everything
                out.append(read_all(s, timeout=3))
            return out

        for data, closed in await asyncio.get_running_loop().run_in_executor(None, replay):
            assert closed and b"decode" not in data
            assert [f["t"] for f in frames_of(data)] == ["challenge", "reject"]  # a fresh nonce, then the door
        await asyncio.sleep(0.2)
        assert not pb.data.any()  # the grant was live: only the replay protection kept the bytes out
        assert notes == []
        assert b.peers["prefill"] is original and original.alive  # the real peer was not displaced
        await a.close()
        await b.close()
        await proxy.close()

    asyncio.run(main())


def _data_handshake_bytes(name: str) -> int:
    """Bytes an initiator sends on a data connection before its first request (fixed by the message shapes)."""
    n32 = bytes(32)
    return len(PREAMBLE_DATA) + sum(len(pack_handshake(m)) for m in (
        {"t": "hello", "v": 2, "role": "data", "ni": n32}, {"t": "proof", "name": name, "mac": n32},
        {"t": "finish", "mac": n32}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_byte_altered_in_transit_fails_that_transfer_only(where):
    """Headers are always authenticated; payload bytes when mac_payload is on (both sides here, for 'payload')."""
    async def main():
        kw = {"mac_payload": where == "payload"}
        b, pb, rb = local_agent(name="decode", **GRANTS, **kw)
        a, pa, ra = local_agent(name="prefill", tcp_connections=1, **GRANTS, **kw)
        pa.fill(3)
        await b.start()
        proxy = RecordingProxy(b.address)
        await proxy.start()
        peer = await a.connect(b.address)
        a.peer(peer).address = proxy.address  # data connections go through the proxy, which alters one byte
        notes = []
        b.on_notification(notes.append)
        b.grant_blocks("r", "kv", [5, 6], BB, "w", time.time() + 60, peer="prefill")
        start = _data_handshake_bytes("prefill")
        # header: its descriptor count (bytes 12..15 of REQ); payload: well inside the first block's bytes
        proxy.corrupt = (0, start + 12 if where == "header" else start + REQ.size + 32 + 24 + 1 + 32 + 100)
        with pytest.raises(KVTransferError, match="rejected by|failed over tcp|authentication"):
            await a.write_blocks(peer, [1, 2], [5, 6], BB, ra, "kv", notif={"request_id": "r"}, key="r")
        await asyncio.sleep(0.2)
        if where == "header":
            assert not pb.data.any()  # refused before a byte moved
        assert [n.error is not None for n in notes] == [True] and notes[0].key == "r"  # told once, as failed
        proxy.corrupt = None
        await a.write_blocks(peer, [1, 2], [5, 6], BB, ra, "kv", notif={"request_id": "r"}, key="r")
        assert np.array_equal(pb.data[[5, 6]], pa.data[[1, 2]])
        await asyncio.sleep(0.1)
        assert [n.error is None for n in notes] == [False, True]
        await a.close()
        await b.close()
        await proxy.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_malformed_frames_from_an_authenticated_peer_are_dropped(caplog):
    async def main():
        b, pb, rb = local_agent(name="decode", **GRANTS)
        a, pa, ra = local_agent(name="prefill", **GRANTS)
        pa.fill(4)
        await b.start()
        peer = await a.connect(b.address)
        seen = []

        def engine_callback(n):  # what the engine does with a notification: must never raise from peer input
            d = n.payload_dict()
            seen.append((n.key, n.xfer_id, d, n.error))

        b.on_notification(engine_callback)
        b.grant("legit", "kv", [], "w", time.time() + 60, peer="prefill")  # notifications only
        p = a.peer(peer)
        regions_before = dict(b.peers["prefill"].regions)
        for bad in ({"t": "notif", "x": "abc", "op": "write", "p": b"", "k": "legit"},
                    {"t": "notif", "x": 1, "op": "write", "p": "not bytes", "k": "legit"},
                    {"t": "notif", "x": 1, "op": "evil", "p": b"", "k": "legit"},
                    {"t": "notif", "x": -5, "op": "notify", "p": b"", "k": "legit"},
                    {"t": "notif", "x": 1, "op": "notify", "p": b"", "k": 7},
                    {"t": "notif", "x": 2, "op": "notify", "p": b"", "k": "no-such-grant"},
                    {"t": "notif", "x": 2, "op": "notify", "p": b""},  # no key at all
                    {"t": "failed", "x": 3, "op": "write", "p": b"", "k": "someone-else", "why": "x"},
                    {"t": "regions", "regions": [{"id": "x"}]},
                    {"t": "regions", "regions": "nope"},
                    {"t": "whatever", "blob": b"\x00" * 100},
                    {"t": "notif", "x": 9, "op": "notify", "p": b"\xc1\xff not msgpack", "k": "legit"}):
            await p.send(bad)
        await asyncio.sleep(0.3)
        assert seen == [("legit", 9, None, None)]  # only the well-formed, granted one; its payload is just bytes
        assert b.peers["prefill"].regions == regions_before and b.peers["prefill"].alive
        assert "dropped a malformed 'notif' frame from peer prefill" in caplog.text
        assert "no live grant of key 'no-such-grant' admits it" in caplog.text
        # a frame whose MAC does not verify ends the control connection (its stream cannot be trusted)
        body = msgpack.packb({"t": "notif", "x": 10, "op": "notify", "p": b"", "k": "legit"}, use_bin_type=True)
        p.writer.write(pack_ctrl_len(len(body)) + body + bytes(32))
        for _ in range(100):
            if "prefill" not in b.peers:
                break
            await asyncio.sleep(0.02)
        assert "prefill" not in b.peers and len(seen) == 1
        assert "failed its authentication check" in caplog.text
        # the agent itself is unharmed: the peer reconnects and transfers
        for _ in range(100):
            if not a.peers:
                break
            await asyncio.sleep(0.02)
        peer = await a.connect(b.address)
        b.grant_blocks("r2", "kv", [7], BB, "w", time.time() + 60)
        await a.write_blocks(peer, [3], [7], BB, ra, "kv", notif={"request_id": "r2"}, key="r2")
        await asyncio.sleep(0.1)
        assert np.array_equal(pb.data[7], pa.data[3])
        assert (seen[-1][0], seen[-1][2], seen[-1][3]) == ("r2", {"request_id": "r2"}, None)
        await a.close()
        await b.close()

    caplog.set_level(logging.INFO)
    asyncio.run(main())
