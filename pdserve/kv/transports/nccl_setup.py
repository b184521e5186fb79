"""The pairs of the nccl transport: for each connected peer, one 2-rank communicator made after our authenticated
handshake, and how it is remade after a failure.

Rank 0 is the agent whose name sorts first. It makes each generation of the pair's communicator: a "setup" message
(generation, a fresh nonce, the backend) on the authenticated control connection, then both sides build a process
group over the pair's store (pair_store: rank 0 holds the map, rank 1 reaches it by "st" messages on the control
connection; no TCPStore, nothing new listens for the rendezvous) and exchange the MAC probe (nccl_pair). A transfer
that fails or passes its deadline breaks the generation on both sides ("reset"); rank 0 then makes the next one.
Every field of every message is checked here; a malformed message is dropped and logged with its peer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.kv.auth import INSECURE_SECRET, hkdf
from pdserve.kv.errors import KVTransferError, TransferTimeoutError, TransportUnavailableError
from pdserve.kv.transports.base import Transport
from pdserve.kv.transports.nccl_pair import Pair, fail_future, probe_tag
from pdserve.kv.transports.pair_store import LocalMap, StoreError

if TYPE_CHECKING:
    from pdserve.kv.context import TransportContext
    from pdserve.kv.peer import Peer

log = logging.getLogger(__name__)
MAX_STORE_CALLS = 64  # store calls of one peer in flight on rank 0


class MessageError(ValueError):
    """A nccl message with a missing or malformed field (dropped and logged)."""


def field_of(m: dict[str, Any], k: str, kind: type | tuple[type, ...], limit: int | None = None) -> Any:
    v = m.get(k)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is int:
        raise MessageError(f"field {k!r} of a nccl message is missing or malformed")
    if limit is not None and isinstance(v, (bytes, str, list)) and len(v) > limit:
        raise MessageError(f"field {k!r} of a nccl message is too long")
    return v


@dataclass
class PeerState:
    rank: int
    pair: Pair | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    store: LocalMap | None = None  # rank 0: the current pair's rendezvous map
    store_calls: int = 0
    setting_up: bool = False


class PairSetup(Transport):
    """Pair management of the nccl transport (NcclTransport adds the transfers)."""

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        try:
            import torch.distributed as dist
        except ImportError as e:
            raise TransportUnavailableError(f"transport nccl needs torch with torch.distributed: {e}") from e
        if not dist.is_available():
            raise TransportUnavailableError("transport nccl needs torch built with torch.distributed")
        self._peers: dict[str, PeerState] = {}
        self._gens = itertools.count(1)
        self._ids = itertools.count(1)
        self._rpcs: dict[int, tuple[str, asyncio.Future]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._store_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-nccl-store")
        secret = ctx.secret or INSECURE_SECRET
        self._probe_key = hkdf(secret, b"pdserve-kv-nccl", b"pdkv nccl probe key", 32)

    def _timeouts(self) -> tuple[float, float]:
        cfg = self.ctx.config
        return cfg.nccl_setup_timeout_s, max(cfg.nccl_setup_timeout_s, cfg.transfer_timeout_s) + 60.0

    def _state(self, peer: Peer) -> PeerState:
        st = self._peers.get(peer.name)
        if st is None:
            st = self._peers[peer.name] = PeerState(rank=0 if self.ctx.name < peer.name else 1)
        return st

    def _lose_pair(self, peer: Peer, err: Exception) -> None:
        """The peer is gone: fail its store calls and its pair (aborting the communicator)."""
        st = self._peers.pop(peer.name, None)
        for name, fut in list(self._rpcs.values()):
            if name == peer.name and not fut.done():
                fail_future(fut, StoreError(str(err)))
        if st is not None and st.pair is not None:
            st.pair.fail(str(err))
            st.changed.set()

    def _close_pairs(self) -> None:
        for st in self._peers.values():
            if st.pair is not None:
                st.pair.fail("the local agent closed")
        for t in list(self._tasks):
            t.cancel()
        self._store_pool.shutdown(wait=False, cancel_futures=True)

    def backend(self) -> str:
        cfg = self.ctx.config.nccl_backend
        if cfg != "auto":
            return cfg
        return "nccl" if any(r.kind == "cuda" for r in self.ctx.regions.all()) else "gloo"

    def _device(self) -> int:
        devs = {r.device for r in self.ctx.regions.all() if r.kind == "cuda"}
        return min(devs) if devs else -1

    def hello_extra(self) -> dict[str, Any]:
        return {"nccl": {"b": self.backend()}}

    def _peer_backend(self, peer: Peer) -> str | None:
        info = peer.hello.get("nccl")
        b = info.get("b") if isinstance(info, dict) else None
        return b if b in ("nccl", "gloo") else None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def on_peer(self, peer: Peer) -> None:
        if self._peer_backend(peer) != self.backend() or not self.ctx.regions.all():
            return
        st = self._state(peer)
        if st.rank == 0 and st.pair is None:
            self._start_setup(peer, st)

    def _start_setup(self, peer: Peer, st: PeerState) -> None:
        if not st.setting_up:
            st.setting_up = True  # now, not when the task runs: one set-up at a time
            self._spawn(self._setup(peer, st))

    def _host(self) -> str | None:
        cfg = self.ctx.config
        h = cfg.advertise_host or cfg.host
        return None if h in ("0.0.0.0", "::", "") else h

    def _tags(self, peer: str, gen: int, nonce: bytes, rank: int) -> tuple[bytes, bytes]:
        names = (self.ctx.name, peer) if rank == 0 else (peer, self.ctx.name)
        return (probe_tag(self._probe_key, gen, nonce, rank, names),
                probe_tag(self._probe_key, gen, nonce, 1 - rank, names))

    async def _setup(self, peer: Peer, st: PeerState) -> None:
        """Rank 0: a new communicator for the pair (generation `gen`): tell the peer, build ours."""
        try:
            gen, nonce, backend = next(self._gens), secrets.token_bytes(32), self.backend()
            pair = Pair(peer.name, gen, 0, backend, self._device(), *self._timeouts())
            self._install(st, pair)
            st.store = local = LocalMap()
            await self.send_message(peer, {"op": "setup", "g": gen, "n": nonce, "b": backend})
            mine, theirs = self._tags(peer.name, gen, nonce, 0)
            pair.begin(local.call, self._host(), mine, theirs)
            await asyncio.wait({pair.ready})
        except KVTransferError as e:
            if st.pair is not None:
                st.pair.fail(f"setting up the nccl pair with {peer.describe()} failed: {e}")
        finally:
            st.setting_up = False
        if st.pair is not None and st.pair.broken is None:
            log.info("nccl: %s communicator with %s ready (generation %d)", st.pair.backend, peer.describe(),
                     st.pair.gen)

    def _install(self, st: PeerState, pair: Pair) -> None:
        old, st.pair = st.pair, pair
        if old is not None:
            old.fail(f"the nccl pair with {old.peer} was replaced (generation {pair.gen})")
        st.changed.set()
        st.changed = asyncio.Event()

    async def _on_setup(self, peer: Peer, st: PeerState, m: dict[str, Any]) -> None:
        """Rank 1: rank 0 made a new communicator; build our side, its store reached through rank 0."""
        gen, nonce, backend = field_of(m, "g", int), field_of(m, "n", bytes, 32), field_of(m, "b", str, 8)
        if st.rank != 1 or (st.pair is not None and gen <= st.pair.gen) or len(nonce) != 32:
            raise MessageError("an out-of-turn nccl set-up")
        if backend != self.backend():
            raise MessageError(f"nccl set-up for backend {backend!r}, this side uses {self.backend()}")
        pair = Pair(peer.name, gen, 1, backend, self._device(), *self._timeouts())
        self._install(st, pair)
        loop = asyncio.get_running_loop()

        def call(fn: str, args: list, timeout: float) -> Any:  # a pair thread: ask rank 0, wait for its answer
            fut = asyncio.run_coroutine_threadsafe(self._rpc(peer, gen, fn, args, timeout), loop)
            return fut.result(timeout + 5.0)

        mine, theirs = self._tags(peer.name, gen, nonce, 1)
        pair.begin(call, self._host(), mine, theirs)

    async def _rpc(self, peer: Peer, gen: int, fn: str, args: list, timeout: float) -> Any:
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._rpcs[i] = (peer.name, fut)
        try:
            await self.send_message(peer, {"op": "st", "g": gen, "i": i, "f": fn, "a": args, "to": timeout})
            return await asyncio.wait_for(fut, timeout + 2.0)
        except asyncio.TimeoutError:
            raise StoreError(f"store {fn} on {peer.describe()} got no answer within {timeout:g} s") from None
        finally:
            self._rpcs.pop(i, None)

    async def _on_store_call(self, peer: Peer, st: PeerState, m: dict[str, Any]) -> None:
        """Rank 0: one store operation of rank 1, run on the current pair's map (blocking ones in a thread)."""
        gen, i, fn, args = field_of(m, "g", int), field_of(m, "i", int), field_of(m, "f", str, 32), field_of(m, "a", list, 8)
        timeout = min(float(field_of(m, "to", (int, float))), self.ctx.config.nccl_setup_timeout_s)
        local = st.store
        if st.rank != 0 or st.pair is None or st.pair.gen != gen or local is None:
            await self.send_message(peer, {"op": "st_r", "i": i, "e": "no such pair generation"})
            return
        if st.store_calls >= MAX_STORE_CALLS:
            await self.send_message(peer, {"op": "st_r", "i": i, "e": "too many store calls in flight"})
            return
        st.store_calls += 1
        try:
            v = await asyncio.get_running_loop().run_in_executor(self._store_pool, local.call, fn, args, max(0.0, timeout))
            reply = {"op": "st_r", "i": i, "v": v, "e": None}
        except (StoreError, ValueError, TypeError, IndexError) as e:
            reply = {"op": "st_r", "i": i, "e": str(e)[:500]}
        finally:
            st.store_calls -= 1
        await self.send_message(peer, reply)

    def _on_store_reply(self, peer: Peer, m: dict[str, Any]) -> None:
        i = field_of(m, "i", int)
        entry = self._rpcs.get(i)
        if entry is None or entry[0] != peer.name or entry[1].done():
            return
        err = m.get("e")
        if err is not None:
            fail_future(entry[1], StoreError(f"the peer's store refused: {str(err)[:500]}"))
        else:
            entry[1].set_result(m.get("v"))

    async def _pair(self, peer: Peer, deadline: float) -> Pair:
        """The pair's ready communicator, waiting (within `deadline`) for one being made; a pair that failed its
        set-up raises at once (its reason names what failed)."""
        st = self._peers.get(peer.name)
        if st is None:
            await self.on_peer(peer)
            st = self._peers.get(peer.name)
            if st is None:
                raise TransportUnavailableError(f"nccl cannot serve {peer.describe()}: its pool and ours are not "
                                                "both CUDA or both host memory")
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(f"the nccl communicator with {peer.describe()} was not ready in time")
            pair = st.pair
            if pair is not None and pair.setup_failed:
                raise TransportUnavailableError(f"nccl cannot serve {peer.describe()}: {pair.broken}")
            if pair is None or (pair.broken is not None and pair.ready.done()):
                if st.rank == 0:
                    self._start_setup(peer, st)  # rank 1 waits for rank 0's next generation (a reset asked for it)
                changed = st.changed
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    continue
                continue
            try:
                return await asyncio.wait_for(asyncio.shield(pair.ready), remaining)
            except (asyncio.TimeoutError, KVTransferError):
                continue

    def _break(self, peer: Peer, pair: Pair, why: str) -> None:
        pair.fail(why)
        if peer.alive:
            self._spawn(self._send_reset(peer, pair.gen, why))

    async def _send_reset(self, peer: Peer, gen: int, why: str) -> None:
        try:
            await self.send_message(peer, {"op": "reset", "g": gen, "why": why[:300]})
        except KVTransferError:
            return
        st = self._peers.get(peer.name)
        if st is not None and st.rank == 0 and (st.pair is None or st.pair.gen == gen):
            self._start_setup(peer, st)
