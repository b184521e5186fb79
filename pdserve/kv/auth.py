"""Peer authentication of the KV port: a mutual challenge-response over the deployment secret, then per-connection
keys that authenticate every later frame. Pure computation (no I/O): pdserve.kv.handshake drives it over sockets.

Every connection, control or data, starts with the same five messages (initiator I, responder R):

    M1 I->R  hello      {v, role, ni}                       role: "ctrl" | "data"; ni: 32 fresh random bytes
    M2 R->I  challenge  {nr}                                nr: 32 fresh random bytes; nothing about R
    M3 I->R  proof      {name_i, mac_i}                     mac_i = HMAC(K, "init" | role, ni, nr, name_i)
    M4 R->I  accept     {name_r, mac_r}   or  reject {why}  mac_r = HMAC(K, "resp" | role, ni, nr, name_i, name_r)
    M5 I->R  finish     {mac_f}                             mac_f = HMAC(K, "fin"  | role, ni, nr, name_i, name_r)

K = HKDF(secret, "handshake"). R checks mac_i before it reveals anything (its name comes in M4, after I proved the
secret); I checks mac_r before it trusts R; M5 extends I's proof to R's name. Both nonces are fresh per connection,
so a recorded handshake replayed to R (or to I) fails its MAC check; the labels keep each side's MACs from being
used as the other's, and the role keeps a control handshake from opening a data connection.

Session keys: HKDF(secret, salt = ni | nr, info = role, name_i, name_r) gives one 32-byte key per direction.
Every later message carries HMAC-SHA256(key of its direction, label | sequence number | bytes), the sequence number
counting that direction's messages from 0, so a frame cannot be forged, altered, replayed, reordered or moved to
another connection.

Without a secret (AgentConfig.insecure) the same protocol runs with a fixed public key: it authenticates nothing
but keeps one code path, and a secure agent refuses such peers.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv.errors import PeerAuthenticationError

VERSION = 2
ROLES = ("ctrl", "data")
NONCE_BYTES = 32
TAG_BYTES = 32
MAX_NAME_BYTES = 255
INSECURE_SECRET = b"pdserve-kv-insecure-no-secret-configured"
_SALT = b"pdserve-kv-v2"
_U64 = struct.Struct("<Q")


def hkdf(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF-SHA256 (RFC 5869)."""
    prk = hmac.digest(salt or bytes(32), ikm, "sha256")
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.digest(prk, block + info + bytes([i]), "sha256")
        out += block
        i += 1
    return out[:length]


def _lp(b: bytes) -> bytes:
    """Length-prefixed, so concatenated fields cannot be re-split differently."""
    return struct.pack("<H", len(b)) + b


def _transcript(role: str, ni: bytes, nr: bytes, name_i: str, name_r: str | None) -> bytes:
    t = b"pdkv2" + _lp(role.encode()) + ni + nr + _lp(name_i.encode())
    return t if name_r is None else t + _lp(name_r.encode())


def _mac(key: bytes, label: bytes, data: bytes) -> bytes:
    return hmac.digest(key, label + data, "sha256")


def _field(msg: Any, name: str, kind: type, what: str) -> Any:
    if not isinstance(msg, dict) or not isinstance(msg.get(name), kind):
        raise PeerAuthenticationError(f"KV peer authentication failed: malformed {what} message")
    return msg[name]


def _nonce(msg: Any, name: str, what: str) -> bytes:
    n = _field(msg, name, bytes, what)
    if len(n) != NONCE_BYTES:
        raise PeerAuthenticationError(f"KV peer authentication failed: malformed {what} message")
    return n


def _name(msg: Any, key: str, what: str) -> str:
    n = _field(msg, key, str, what)
    if not n or len(n.encode()) > MAX_NAME_BYTES:
        raise PeerAuthenticationError(f"KV peer authentication failed: malformed {what} message (agent name)")
    return n


@dataclass
class Session:
    """The authenticated state of one connection: who the peer is, and the MAC keys and counters of both
    directions. Not thread-safe: one connection is used by one thread or task at a time."""

    role: str
    peer: str
    send_key: bytes = field(repr=False)
    recv_key: bytes = field(repr=False)
    send_seq: int = 0
    recv_seq: int = 0

    def seal(self, label: bytes, *parts: bytes | memoryview) -> bytes:
        """Tag of the next outgoing message (parts concatenated), and advance the sending counter."""
        h = hmac.new(self.send_key, label + _U64.pack(self.send_seq), "sha256")
        for p in parts:
            h.update(p)
        self.send_seq += 1
        return h.digest()

    def open(self, tag: bytes, label: bytes, *parts: bytes | memoryview) -> bool:
        """Whether `tag` authenticates the next incoming message; the counter advances either way (a connection
        whose MAC failed is closed: the stream cannot be trusted any more)."""
        h = hmac.new(self.recv_key, label + _U64.pack(self.recv_seq), "sha256")
        for p in parts:
            h.update(p)
        self.recv_seq += 1
        return hmac.compare_digest(h.digest(), tag)

    def stream_mac(self, sending: bool) -> Any:
        """An incremental MAC for payload bytes of the next message in one direction (tcp with mac_payload)."""
        key, seq = (self.send_key, self.send_seq) if sending else (self.recv_key, self.recv_seq)
        if sending:
            self.send_seq += 1
        else:
            self.recv_seq += 1
        return hmac.new(key, b"data" + _U64.pack(seq), "sha256")


def _session_keys(secret: bytes, role: str, ni: bytes, nr: bytes, name_i: str, name_r: str) -> tuple[bytes, bytes]:
    k = hkdf(secret, ni + nr, b"pdkv2 session" + _transcript(role, b"", b"", name_i, name_r), 64)
    return k[:32], k[32:]


def handshake_key(secret: bytes | None) -> bytes:
    return hkdf(secret or INSECURE_SECRET, _SALT, b"pdkv2 handshake", 32)


class Initiator:
    """The dialling side of the handshake. Call hello(), then on_challenge(M2) -> M3, then on_accept(M4) -> M5;
    `session` is set once on_accept succeeded."""

    def __init__(self, secret: bytes | None, role: str, name: str, address: str = "") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self._secret = secret or INSECURE_SECRET
        self._key = handshake_key(secret)
        self.role, self.name, self.address = role, name, address
        self._ni = secrets.token_bytes(NONCE_BYTES)
        self._nr = b""
        self.session: Session | None = None

    def hello(self) -> dict[str, Any]:
        return {"t": "hello", "v": VERSION, "role": self.role, "ni": self._ni}

    def on_challenge(self, msg: Any) -> dict[str, Any]:
        self._nr = _nonce(msg, "nr", "challenge")
        mac = _mac(self._key, b"init", _transcript(self.role, self._ni, self._nr, self.name, None))
        return {"t": "proof", "name": self.name, "mac": mac}

    def on_accept(self, msg: Any) -> dict[str, Any]:
        where = f" (agent at {self.address})" if self.address else ""
        if isinstance(msg, dict) and msg.get("t") == "reject":
            why = msg.get("why") if isinstance(msg.get("why"), str) else "no reason given"
            raise PeerAuthenticationError(f"KV peer authentication failed{where}: the peer rejected our proof: "
                                          f"{why[:200]}")
        if not isinstance(msg, dict) or msg.get("t") != "accept":
            raise PeerAuthenticationError(f"KV peer authentication failed{where}: unexpected handshake reply")
        name_r = _name(msg, "name", "accept")
        mac = _field(msg, "mac", bytes, "accept")
        t = _transcript(self.role, self._ni, self._nr, self.name, name_r)
        if not hmac.compare_digest(mac, _mac(self._key, b"resp", t)):
            raise PeerAuthenticationError(f"KV peer authentication failed{where}: the peer did not prove the "
                                          "deployment secret")
        send, recv = _session_keys(self._secret, self.role, self._ni, self._nr, self.name, name_r)
        self.session = Session(self.role, name_r, send_key=send, recv_key=recv)
        return {"t": "finish", "mac": _mac(self._key, b"fin", t)}


class Responder:
    """The listening side. on_hello(M1) -> M2, on_proof(M3) -> M4 (raises after a failed proof: send
    `reject()` then close), on_finish(M5) sets `session`."""

    def __init__(self, secret: bytes | None, name: str) -> None:
        self._secret = secret or INSECURE_SECRET
        self._key = handshake_key(secret)
        self.name = name
        self._nr = secrets.token_bytes(NONCE_BYTES)
        self._ni = b""
        self.role = ""
        self.peer = ""
        self.session: Session | None = None

    def on_hello(self, msg: Any) -> dict[str, Any]:
        if not isinstance(msg, dict) or msg.get("t") != "hello" or msg.get("v") != VERSION:
            raise PeerAuthenticationError("KV peer authentication failed: not a pdserve KV hello of version "
                                          f"{VERSION}")
        role = msg.get("role")
        if role not in ROLES:
            raise PeerAuthenticationError("KV peer authentication failed: unknown connection role")
        self.role = role
        self._ni = _nonce(msg, "ni", "hello")
        return {"t": "challenge", "nr": self._nr}

    def on_proof(self, msg: Any) -> dict[str, Any]:
        if not isinstance(msg, dict) or msg.get("t") != "proof":
            raise PeerAuthenticationError("KV peer authentication failed: expected a proof")
        name_i = _name(msg, "name", "proof")
        mac = _field(msg, "mac", bytes, "proof")
        if not hmac.compare_digest(mac, _mac(self._key, b"init", _transcript(self.role, self._ni, self._nr,
                                                                               name_i, None))):
            raise PeerAuthenticationError(f"KV peer authentication failed: wrong proof from a peer calling itself "
                                          f"{name_i[:64]!r} (different secret?)")
        self.peer = name_i
        t = _transcript(self.role, self._ni, self._nr, name_i, self.name)
        return {"t": "accept", "name": self.name, "mac": _mac(self._key, b"resp", t)}

    def on_finish(self, msg: Any) -> Session:
        mac = _field(msg, "mac", bytes, "finish")
        t = _transcript(self.role, self._ni, self._nr, self.peer, self.name)
        if not hmac.compare_digest(mac, _mac(self._key, b"fin", t)):
            raise PeerAuthenticationError(f"KV peer authentication failed: bad finish from {self.peer[:64]!r}")
        recv, send = _session_keys(self._secret, self.role, self._ni, self._nr, self.peer, self.name)
        self.session = Session(self.role, self.peer, send_key=send, recv_key=recv)
        return self.session

    @staticmethod
    def reject(why: str = "authentication failed") -> dict[str, Any]:
        """The only thing an unauthenticated peer ever learns beyond a random nonce."""
        return {"t": "reject", "why": why}
