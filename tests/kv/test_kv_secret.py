"""The deployment secret (sources, checks), the refusal to listen without one, and the handshake's cryptography on
its own: mutual proofs, session keys per direction, and what tampering, replay and reflection run into."""

import logging
import os

import pytest

from pdserve.kv import AgentConfig, KVAgent, KVConfigError, PeerAuthenticationError, generate_secret, load_secret
from pdserve.kv.auth import Initiator, Responder, hkdf


def test_secret_sources_in_order(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("PDSERVE_DEPLOYMENT_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_DEPLOYMENT_SECRET_FILE", raising=False)
    assert load_secret() is None
    f = tmp_path / "kv.secret"
    f.write_text("from-the-file-0123456789\n")
    f.chmod(0o600)
    monkeypatch.setenv("PDSERVE_DEPLOYMENT_SECRET_FILE", str(f))
    assert load_secret() == b"from-the-file-0123456789"
    monkeypatch.setenv("PDSERVE_DEPLOYMENT_SECRET", "from-the-environment-01")
    assert load_secret() == b"from-the-environment-01"
    g = tmp_path / "flag.secret"
    g.write_bytes(os.urandom(24))
    g.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert load_secret(file=str(g)) == g.read_bytes().strip()
    assert "readable by other users" in caplog.text
    assert load_secret("from-the-flag-0123456") == b"from-the-flag-0123456"
    with pytest.raises(ValueError, match="at least 16"):
        load_secret("short")
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(file=str(tmp_path / "missing"))
    s = generate_secret()
    assert len(s) >= 40 and load_secret(s) == s.encode() and generate_secret() != s


def test_no_secret_no_listening():
    with pytest.raises(KVConfigError, match="has no secret"):
        KVAgent(AgentConfig())
    with pytest.raises(ValueError, match="contradicts"):
        AgentConfig(secret=b"x" * 16, insecure=True)
    with pytest.raises(ValueError, match="at least 16"):
        AgentConfig(secret=b"x" * 15)
    with pytest.raises(ValueError, match="must be bytes"):
        AgentConfig(secret="x" * 16)
    assert "secret" not in repr(AgentConfig(secret=b"do-not-print-me-0123"))
    KVAgent(AgentConfig(insecure=True))  # explicit: allowed


def _run(i: Initiator, r: Responder):
    m2 = r.on_hello(i.hello())
    m4 = r.on_proof(i.on_challenge(m2))
    return i.on_accept(m4), r


def test_handshake_proves_both_sides_and_keys_each_direction():
    secret = os.urandom(32)
    i, r = Initiator(secret, "ctrl", "prefill-0"), Responder(secret, "decode-0")
    fin, r = _run(i, r)
    rs = r.on_finish(fin)
    assert (i.session.peer, rs.peer) == ("decode-0", "prefill-0")
    assert i.session.send_key == rs.recv_key and i.session.recv_key == rs.send_key
    assert i.session.send_key != i.session.recv_key
    tag = i.session.seal(b"ctl", b"frame one")
    assert rs.open(tag, b"ctl", b"frame one")
    assert not rs.open(tag, b"ctl", b"frame one")  # the same bytes again (a replay): the counter moved on
    t2 = i.session.seal(b"ctl", b"frame three")
    assert not rs.open(t2, b"ctl", b"frame thr3e")
    # a new connection between the same agents has other keys
    i2, r2 = Initiator(secret, "ctrl", "prefill-0"), Responder(secret, "decode-0")
    fin2, r2 = _run(i2, r2)
    assert r2.on_finish(fin2).recv_key != rs.recv_key


def test_handshake_refuses_wrong_secrets_replays_reflection_and_role_swaps():
    secret = os.urandom(32)
    # wrong secret on either side
    with pytest.raises(PeerAuthenticationError, match="wrong proof"):
        _run(Initiator(os.urandom(32), "ctrl", "p"), Responder(secret, "d"))
    i, r = Initiator(secret, "ctrl", "p"), Responder(os.urandom(32), "d")
    m3 = i.on_challenge(r.on_hello(i.hello()))
    forged = {"t": "accept", "name": "d", "mac": os.urandom(32)}
    with pytest.raises(PeerAuthenticationError, match="did not prove the deployment secret"):
        i.on_accept(forged)
    # a recorded hello and proof replayed to a fresh responder: its nonce differs, the old proof fails
    i, r = Initiator(secret, "ctrl", "p"), Responder(secret, "d")
    m1 = i.hello()
    m3 = i.on_challenge(r.on_hello(m1))
    r_new = Responder(secret, "d")
    r_new.on_hello(m1)
    with pytest.raises(PeerAuthenticationError):
        r_new.on_proof(m3)
    # the responder's own proof handed back as an initiator's proof (reflection) does not verify
    i, r = Initiator(secret, "data", "d"), Responder(secret, "d2")
    m2 = r.on_hello(i.hello())
    m4 = r.on_proof(i.on_challenge(m2))
    r_b = Responder(secret, "x")
    r_b.on_hello({"t": "hello", "v": 2, "role": "data", "ni": os.urandom(32)})
    with pytest.raises(PeerAuthenticationError):
        r_b.on_proof({"t": "proof", "name": "d2", "mac": m4["mac"]})
    # a control handshake's proof does not open a data connection
    i, r = Initiator(secret, "ctrl", "p"), Responder(secret, "d")
    m1 = i.hello()
    r.on_hello({**m1, "role": "data"})
    with pytest.raises(PeerAuthenticationError):
        r.on_proof(i.on_challenge(r.on_hello({**m1, "role": "data"})))
    for bad in ({"t": "hello", "v": 1, "role": "ctrl", "ni": os.urandom(32)},
                {"t": "hello", "v": 2, "role": "admin", "ni": os.urandom(32)},
                {"t": "hello", "v": 2, "role": "ctrl", "ni": b"short"}, ["not", "a", "map"]):
        with pytest.raises(PeerAuthenticationError):
            Responder(secret, "d").on_hello(bad)


def test_hkdf_matches_rfc5869_test_case_1():
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = hkdf(ikm, salt, info, 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")
