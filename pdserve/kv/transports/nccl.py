"""nccl: torch.distributed point-to-point between the two agents of a pair (NCCL for CUDA pools, Gloo for host memory).

Per connected pair, one 2-rank communicator, made after our authenticated handshake: its rendezvous store travels on
the pair's control connection (pair_store: no TCPStore, nothing new listens for it) and a MAC probe over the new data
path proves it reaches the authenticated peer (nccl_pair). No global init_process_group: the process groups are
built straight on that store, so an engine's own tensor-parallel groups are untouched.

Two-sided, so the receiver fences every byte. A transfer is a request on the control connection (descriptors of the
peer's memory, the request key, the notification); the peer checks every run against its regions and the live grant
of the key *before posting its receives* and answers with the transfer's sequence number (or a refusal, which fails
that transfer alone). Both sides then issue the runs (coalesced block runs, one NCCL group) straight from and into
views of the registered pools: no temporary buffer, so memory does not grow with the number of handovers in flight
(the seeds' NCCL connector received into temporary buffers and ran out of GPU memory under load). For a WRITE the
receiver delivers the notification itself once its receives completed, then tells the sender ("fin"); only then does
the sender's call return.

Failure: a peer that dies closes the control connection; pending transfers fail at once and the communicator is
aborted (ncclCommAbort releases kernels stuck on the dead peer). A transfer past its deadline aborts the pair's
communicator too (before torch's own watchdog timeout, which would end the process); rank 0 then makes a new one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.kv.descs import XferList, distinct, validate_side
from pdserve.kv.errors import (
    AccessDeniedError,
    InvalidDescriptorError,
    KVTransferError,
    LimitExceededError,
    PeerDisconnectedError,
    RegionError,
    TransferTimeoutError,
)
from pdserve.kv.grants import check_key
from pdserve.kv.transports.nccl_pair import Op, Pair, fail_future
from pdserve.kv.transports.nccl_setup import MessageError, PairSetup, PeerState, field_of
from pdserve.kv.wire import MAX_KEY_BYTES, pack_descs, unpack_descs

if TYPE_CHECKING:
    from pdserve.kv.context import TransportContext
    from pdserve.kv.peer import Peer
    from pdserve.kv.regions import MemoryRegion, RemoteRegion

log = logging.getLogger(__name__)
_REFUSED = {"denied": AccessDeniedError, "limit": LimitExceededError, "unready": KVTransferError}


class NcclTransport(PairSetup):
    name = "nccl"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._waiting: dict[tuple[str, int], dict[str, asyncio.Future]] = {}
        self._tensors: dict[int, Any] = {}

    def supports(self, peer: Peer, local: list[MemoryRegion], remote: list[RemoteRegion]) -> str | None:
        backend = self.backend()
        theirs = self._peer_backend(peer)
        if theirs is None:
            return "peer runs no nccl transport"
        if theirs != backend:
            return f"this side uses {backend}, the peer {theirs} (both pools must be CUDA, or both host memory)"
        want_cuda = backend == "nccl"
        if any((r.kind == "cuda") != want_cuda for r in local) or any((r.kind == "cuda") != want_cuda for r in remote):
            return f"{backend} moves {'CUDA' if want_cuda else 'host'} memory only"
        if want_cuda and len({r.device for r in local}) > 1:
            return "local regions on more than one GPU"
        st = self._peers.get(peer.name)
        if st is not None and st.pair is not None and st.pair.setup_failed:
            return st.pair.broken
        return None

    async def on_message(self, peer: Peer, msg: dict[str, Any]) -> None:
        op = msg["op"]
        st = self._state(peer)
        try:
            if op == "setup":
                await self._on_setup(peer, st, msg)
            elif op == "st":
                self._spawn(self._on_store_call(peer, st, msg))
            elif op == "st_r":
                self._on_store_reply(peer, msg)
            elif op == "req":
                await self._on_request(peer, st, msg)
            elif op in ("resp", "fin"):
                self._on_answer(peer, op, msg)
            elif op == "reset":
                g = field_of(msg, "g", int)
                if st.pair is not None and st.pair.gen == g:
                    st.pair.fail(f"{peer.describe()} reset the nccl pair: {str(msg.get('why'))[:300]}")
                    if st.rank == 0:
                        self._start_setup(peer, st)
            else:
                log.debug("nccl: ignored a message of unknown type %r from %s", op[:32], peer.describe())
        except MessageError as e:
            log.warning("nccl: dropped a malformed %r message from %s: %s", op[:32], peer.describe(), e)

    def _on_answer(self, peer: Peer, op: str, m: dict[str, Any]) -> None:
        w = self._waiting.get((peer.name, field_of(m, "x", int)))
        if w is not None and op in w and not w[op].done():
            w[op].set_result(m)

    def _tensor(self, region: MemoryRegion) -> Any:
        """A flat uint8 torch tensor over the whole region (made once per region)."""
        t = self._tensors.get(region.region_id)
        if t is None:
            import torch

            t = region.tensor if region.tensor is not None else torch.frombuffer(region.host_view, dtype=torch.uint8)
            self._tensors[region.region_id] = t
        return t

    def _ops(self, kind: str, region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> list[Op]:
        """Views of the registered pool, one per run, in descriptor order (both sides use the same order)."""
        ops = []
        for r, o, n in zip(region.tolist(), offset.tolist(), length.tolist()):
            reg = self.ctx.regions.get(r)
            base = self._tensor(reg)
            view = base[o:o + n]
            assert view.is_contiguous() and view.data_ptr() == base.data_ptr() + o, "a run must be one contiguous view"
            ops.append(Op(kind, view))
        return ops

    def on_deregister(self, region: MemoryRegion) -> None:
        self._tensors.pop(region.region_id, None)

    async def _on_request(self, peer: Peer, st: PeerState, m: dict[str, Any]) -> None:
        """The receiving side of a transfer: check, then post our operations, answer, and (WRITE) deliver the
        notification and tell the sender once our receives completed."""
        cfg = self.ctx.config
        xid, op, seq = field_of(m, "x", int), field_of(m, "o", str, 8), field_of(m, "s", int)
        key = m.get("k") or None
        notif = m.get("n")
        if op not in ("write", "read") or (key is not None and (not isinstance(key, str) or len(key.encode()) > MAX_KEY_BYTES)):
            raise MessageError("a nccl request with a bad op or key")
        if notif is not None and (not isinstance(notif, bytes) or len(notif) > cfg.max_notif_bytes):
            raise MessageError("a nccl request with a bad notification")
        pair = st.pair
        mine_seq = seq if st.rank == 1 else None
        status, why = "ok", ""
        try:
            if pair is None or pair.broken is not None:  # operations planned before the probe finished wait for it
                status, why = "unready", "no working nccl communicator for this pair on the receiving side"
                raise KVTransferError(why)
            d = field_of(m, "d", bytes, cfg.max_descs_per_transfer * 24)
            region, offset, length = unpack_descs(d)
            if len(region) > cfg.max_descs_per_transfer:
                status, why = "limit", f"{len(region)} descriptors exceed max_descs_per_transfer"
                raise LimitExceededError(why)
            validate_side(region, offset, length, self.ctx.regions.sizes(),
                          side="destination" if op == "write" else "source", check_overlap=op == "write")
            regs = [self.ctx.regions.get(r) for r in distinct(region)]
            why_not = self.supports(peer, regs, list(peer.regions.values()))
            if why_not:
                raise InvalidDescriptorError(why_not)
            if cfg.access_control:
                v = self.ctx.grants.check(key, peer.name, op, region, offset, length)
                if not v.ok:
                    status, why = "denied", v.why
                    raise AccessDeniedError(why)
            if (st.rank == 1) != (seq > 0):
                raise MessageError("a nccl request numbered by the wrong side")
        except (KVTransferError, RegionError) as e:
            if status == "ok":
                status, why = "invalid", str(e)
            if mine_seq is not None and pair is not None and pair.gen == field_of(m, "g", int):
                pair.skip(mine_seq)
            await self.send_message(peer, {"op": "resp", "x": xid, "ok": False, "st": status, "why": why[:2000]})
            log.warning("nccl: refused %s %d from %s (key %r): %s", op, xid, peer.describe(), key, why)
            if key is not None:  # the agent delivers it only if the key's grant admits this peer
                self.ctx.deliver(peer.name, xid, op, notif or b"", key, why)
            return
        if pair.gen != field_of(m, "g", int):
            await self.send_message(peer, {"op": "resp", "x": xid, "ok": False, "st": "invalid",
                                           "why": "the request names another communicator generation"})
            return
        if seq <= 0:
            seq = pair.alloc()
        ops = self._ops("recv" if op == "write" else "send", region, offset, length)
        if key is not None:
            self.ctx.grants.begin(key)
        done = pair.plan(seq, ops, None, cfg.transfer_timeout_s)
        await self.send_message(peer, {"op": "resp", "x": xid, "ok": True, "s": seq})
        self._spawn(self._finish_incoming(peer, pair, op, xid, key, notif, done))

    async def _finish_incoming(self, peer: Peer, pair: Pair, op: str, xid: int, key: str | None,
                               notif: bytes | None, done: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(done, self.ctx.config.transfer_timeout_s)
            ok, why = True, ""
        except (KVTransferError, asyncio.TimeoutError) as e:
            ok, why = False, f"the receiver's operations failed: {type(e).__name__}: {e}"
            self._break(peer, pair, why)
        finally:
            if key is not None:
                self.ctx.grants.end(key)
        if op != "write":
            return
        if key is not None or notif is not None:
            if ok and notif is not None:
                self.ctx.deliver(peer.name, xid, "write", notif, key, None)
            elif not ok and key is not None:
                self.ctx.deliver(peer.name, xid, "write", notif or b"", key, why)
        if peer.alive:
            try:
                await self.send_message(peer, {"op": "fin", "x": xid, "ok": ok, "why": why[:2000]})
            except KVTransferError:
                pass

    async def transfer(self, op: str, peer: Peer, xfers: XferList, notif: bytes | None, xfer_id: int,
                       deadline: float, wait_event: Any = None, key: str | None = None) -> bool:
        if key is not None:
            check_key(key)
        pair = await self._pair(peer, deadline)
        st = self._peers[peer.name]
        w = self._waiting[(peer.name, xfer_id)] = {"resp": asyncio.get_running_loop().create_future()}
        if op == "write":
            w["fin"] = asyncio.get_running_loop().create_future()
        descs = pack_descs(xfers.remote_region, xfers.remote_offset, xfers.length)
        seq = pair.alloc() if st.rank == 0 else 0
        try:
            try:  # numbered and sent without an await in between: requests leave in the order of their numbers
                await self.send_message(peer, {"op": "req", "x": xfer_id, "o": op, "s": seq, "g": pair.gen,
                                               "k": key or "", "d": descs, "n": notif if op == "write" else None})
                resp = await self._answer(w["resp"], peer, op, xfer_id, deadline)
            except KVTransferError as e:
                # the two sides may now disagree on which numbers were used: this generation cannot go on
                self._break(peer, pair, f"nccl {op} {xfer_id}: {e}")
                raise
            if not resp.get("ok"):
                if seq:
                    pair.skip(seq)
                cls = _REFUSED.get(resp.get("st"), InvalidDescriptorError)
                raise cls(f"{op} {xfer_id} rejected by {peer.describe()}: {str(resp.get('why'))[:2000]}")
            if not seq:
                seq = field_of(resp, "s", int)
            local = self._ops("send" if op == "write" else "recv", xfers.local_region, xfers.local_offset, xfers.length)
            done = pair.plan(seq, local, wait_event, max(0.001, deadline - time.monotonic()))
            try:
                await asyncio.wait_for(asyncio.shield(done), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                why = f"nccl {op} {xfer_id} with {peer.describe()} did not complete before its deadline"
                self._break(peer, pair, why)
                raise TransferTimeoutError(why) from None
            except KVTransferError as e:
                self._break(peer, pair, str(e))
                if not peer.alive:
                    raise PeerDisconnectedError(f"{op} {xfer_id}: {peer.describe()} disconnected: "
                                                f"{peer.lost_reason}") from None
                raise KVTransferError(f"nccl {op} {xfer_id} with {peer.describe()} failed: {e}") from None
            if op == "write":
                fin = await self._answer(w["fin"], peer, op, xfer_id, deadline)
                if not fin.get("ok"):
                    raise KVTransferError(f"nccl write {xfer_id} to {peer.describe()} failed at the receiver: "
                                          f"{str(fin.get('why'))[:2000]}")
                return notif is not None  # the receiver delivered it after its receives completed
            return False
        finally:
            self._waiting.pop((peer.name, xfer_id), None)

    async def _answer(self, fut: asyncio.Future, peer: Peer, op: str, xfer_id: int, deadline: float) -> dict:
        try:
            return await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"nccl {op} {xfer_id}: no answer from {peer.describe()} before the "
                                       "deadline") from None

    def on_peer_lost(self, peer: Peer) -> None:
        err = PeerDisconnectedError(f"{peer.describe()} disconnected: {peer.lost_reason or 'connection closed'}")
        for (name, _), w in list(self._waiting.items()):
            if name == peer.name:
                for fut in w.values():
                    if not fut.done():
                        fail_future(fut, err)
        self._lose_pair(peer, err)

    async def close(self) -> None:
        self._close_pairs()
