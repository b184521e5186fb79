"""cuda_ipc: GPU to GPU within one host. The peer's registered CUDA memory is mapped into this process once (CUDA
IPC, through torch's own tensor-sharing path, the one torch.multiprocessing uses), and a transfer is one batched
copy on a dedicated stream, followed by an event wait; only then is the peer notified.

Why torch's `_share_cuda_` / `_new_shared_cuda`: it handles IPC handles of caching-allocator blocks (offsets inside
a larger cudaMalloc segment), caches opened handles per process, and keeps the producer's memory alive while a
consumer maps it; the sharing information is plain bytes and ints, so it travels in the msgpack handshake (no
pickle). Devices are matched by UUID, so processes with different CUDA_VISIBLE_DEVICES still agree.

Legacy IPC needs the peer's GPU to be visible here. A pool allocated with pdserve.kv.vmm (CUDA VMM, POSIX
file-descriptor handle) is shared another way, whatever each process sees: the importer asks on the control
connection ("vmm_get"), the exporter answers with a one-time token for its Unix socket ("vmm_offer"), the descriptor
comes over SCM_RIGHTS (pdserve.kv.fd_share), and the importer maps it with access for its own device. A peer whose
GPU is invisible and whose pool is not a VMM allocation cannot be served: the agent then says so in one log line per
peer and reports it (KVAgent.peer_transport), never falls back silently.

Ordering: the copy stream waits on `wait_event` if given, else on the device's default stream. The sender learns
the copy finished by polling the event from the event loop (cheap for small transfers: no thread hop), falling
back to a blocking wait in a helper thread for long copies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.kv.descs import XferList, distinct
from pdserve.kv.errors import TransferTimeoutError, TransportUnavailableError
from pdserve.kv.transports.base import Transport

if TYPE_CHECKING:
    from pdserve.kv.context import TransportContext
    from pdserve.kv.peer import Peer
    from pdserve.kv.regions import MemoryRegion, RemoteRegion

log = logging.getLogger(__name__)
_SPIN_S = 0.02  # poll the completion event this long (yielding to the loop) before handing the wait to a thread


def _uuid_map() -> dict[str, int]:
    import torch

    out = {}
    for i in range(torch.cuda.device_count()):
        u = str(getattr(torch.cuda.get_device_properties(i), "uuid", ""))
        if u:
            out[u] = i
    return out


def _bases(ids: np.ndarray, ptr_of: Any) -> np.ndarray:
    """Base address of each entry's region (one lookup per distinct region)."""
    u = distinct(ids)
    if len(u) == 1:
        return np.int64(ptr_of(u[0]))
    u, inv = np.unique(ids, return_inverse=True)
    return np.array([ptr_of(int(r)) for r in u.tolist()], dtype=np.int64)[inv]


class CudaIpcTransport(Transport):
    name = "cuda_ipc"

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._copier: Any = None
        self._streams: dict[tuple[int, int], Any] = {}
        self._peer_ok: set[tuple[int, int]] = set()
        self._uuids: dict[str, int] | None = None
        self._sync = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-cuda-sync")
        self._fds: Any = None  # pdserve.kv.fd_share.FdServer, made when a peer first asks for a VMM pool
        self._offers: dict[tuple[str, int], asyncio.Future] = {}

    @classmethod
    def available(cls) -> bool:
        try:
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())

    @property
    def copier(self) -> Any:
        if self._copier is None:
            from pdserve.kv.transports.cuda_copy import make_copier

            self._copier = make_copier(self.ctx.config.cuda_copy)
            log.info("cuda_ipc copy engine: %s", self._copier.name)
        return self._copier

    # ---- sharing -----------------------------------------------------------------------------------------------
    def export_region(self, region: MemoryRegion) -> dict[str, Any] | None:
        if region.kind != "cuda":
            return None
        from pdserve.kv.vmm import find_allocation

        found = find_allocation(region.ptr)
        if found is not None:  # a VMM pool: shared by file descriptor on request (any visibility)
            alloc, off = found
            return {"vmm": {"size": alloc.size, "off": off}}
        storage = region.obj.untyped_storage()
        dev, handle, size, soff, rch, rco, evh, evs = storage._share_cuda_()
        return {"dev": int(dev), "h": bytes(handle), "sz": int(size), "so": int(soff), "rh": bytes(rch), "ro": int(rco),
                "eh": bytes(evh) if evh is not None else None, "es": bool(evs), "to": region.ptr - storage.data_ptr()}

    def _local_index(self, remote: RemoteRegion) -> int:
        if self._uuids is None:
            self._uuids = _uuid_map()
        if remote.device_uuid and remote.device_uuid in self._uuids:
            return self._uuids[remote.device_uuid]
        if remote.device_uuid:
            raise RuntimeError(f"the peer's GPU ({remote.device_uuid}) is not visible in this process "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}) and its pool is not a "
                               "VMM allocation (pdserve.kv.vmm.vmm_zeros shares across visibility)")
        return int(remote.export["cuda_ipc"]["dev"])

    def _map(self, remote: RemoteRegion) -> Any:
        import torch

        e = remote.export["cuda_ipc"]
        dev = self._local_index(remote)
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(dev, e["h"], e["sz"], e["so"], e["rh"], e["ro"], e["eh"], e["es"])
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
        return torch._utils._rebuild_tensor(typed, int(e["to"]), (remote.size,), (1,))

    def _enable_peer(self, a: int, b: int) -> None:
        """Turn on peer access both ways (torch enables it on its first cross-device copy)."""
        import torch

        if a == b or (a, b) in self._peer_ok:
            return
        x, y = torch.zeros(1, device=f"cuda:{a}"), torch.zeros(1, device=f"cuda:{b}")
        y.copy_(x)
        x.copy_(y)
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        self._peer_ok.update({(a, b), (b, a)})

    async def on_peer(self, peer: Peer) -> None:
        if peer.host_id != self.ctx.host_id:
            return
        mapped: dict[int, Any] = peer.extra.setdefault(self.name, {})
        pending: dict[int, asyncio.Future] = peer.extra.setdefault("cuda_ipc_pending", {})
        local_devs = sorted({r.device for r in self.ctx.regions.all() if r.kind == "cuda"})
        for rid, remote in peer.regions.items():
            if rid in mapped or rid in pending or remote.kind != "cuda" or "cuda_ipc" not in remote.export:
                continue
            if "vmm" in remote.export["cuda_ipc"]:
                if local_devs:  # needs a round trip on the control connection: done in the background
                    task = asyncio.get_running_loop().create_task(self._import_vmm(peer, rid, remote, local_devs[0]))
                    pending[rid] = task
                continue
            t = self._map(remote)
            for d in local_devs:
                self._enable_peer(d, t.device.index)
            mapped[rid] = t
        for rid in [r for r in mapped if r not in peer.regions]:
            del mapped[rid]

    async def _import_vmm(self, peer: Peer, rid: int, remote: RemoteRegion, dev: int) -> None:
        """Map the peer's VMM pool: ask for it, fetch the descriptor with the one-time token, import and map it with
        access for our device `dev`."""
        from pdserve.kv.fd_share import fetch_fd
        from pdserve.kv.vmm import Imported

        loop = asyncio.get_running_loop()
        e = remote.export["cuda_ipc"]["vmm"]
        size, off = e.get("size"), e.get("off")
        timeout = self.ctx.config.connect_timeout_s
        try:
            if type(size) is not int or type(off) is not int or size <= 0 or off < 0 or remote.size > size - off:
                raise RuntimeError("malformed VMM export")
            fut = self._offers[(peer.name, rid)] = loop.create_future()
            await self.send_message(peer, {"op": "vmm_get", "r": rid})
            offer = await asyncio.wait_for(fut, timeout)
            fd, _ = await loop.run_in_executor(self._sync, fetch_fd, offer["name"], offer["tok"], timeout)
            try:
                imp = await loop.run_in_executor(self._sync, Imported, fd, size, dev)
            finally:
                os.close(fd)
            peer.extra.setdefault("cuda_ipc_vmm", {})[rid] = imp
            peer.extra[self.name][rid] = imp.tensor(off, remote.size)
            log.info("cuda_ipc: mapped the VMM pool of %s (region %d, %d bytes) for cuda:%d", peer.describe(), rid,
                     remote.size, dev)
        except Exception as err:
            why = f"cannot map the peer's VMM pool: {type(err).__name__}: {err}"
            peer.extra.setdefault("why_not", {})[self.name] = why
            log.warning("KV %s: cuda_ipc %s; its transfers use another transport", peer.describe(), why)
        finally:
            self._offers.pop((peer.name, rid), None)
            peer.extra.get("cuda_ipc_pending", {}).pop(rid, None)

    async def on_message(self, peer: Peer, msg: dict[str, Any]) -> None:
        op = msg["op"]
        rid = msg.get("r")
        if type(rid) is not int:
            return
        if op == "vmm_get":  # the peer wants our VMM pool: a one-time token for our descriptor socket
            from pdserve.kv.fd_share import FdServer
            from pdserve.kv.vmm import find_allocation

            try:
                reg = self.ctx.regions.get(rid)
            except KeyError:
                return
            found = find_allocation(reg.ptr) if reg.kind == "cuda" else None
            if peer.host_id != self.ctx.host_id or found is None:
                log.warning("cuda_ipc: refused a VMM request of %s for region %d", peer.describe(), rid)
                return
            if self._fds is None:
                self._fds = FdServer(io_timeout_s=self.ctx.config.handshake_timeout_s)
            name, tok = self._fds.offer(peer.name, found[0].export_fd)
            await self.send_message(peer, {"op": "vmm_offer", "r": rid, "name": name, "tok": tok})
        elif op == "vmm_offer":
            fut = self._offers.get((peer.name, rid))
            name, tok = msg.get("name"), msg.get("tok")
            if fut is not None and not fut.done() and isinstance(name, str) and len(name) < 108 and \
                    isinstance(tok, bytes) and len(tok) == 32:
                fut.set_result({"name": name, "tok": tok})

    def on_peer_lost(self, peer: Peer) -> None:
        peer.extra.pop(self.name, None)
        for task in peer.extra.pop("cuda_ipc_pending", {}).values():
            task.cancel()
        imported = peer.extra.pop("cuda_ipc_vmm", {})
        if imported:  # unmap once our copies into it finished (the dead peer's memory is freed with the last map)
            streams = list(self._streams.values())
            self._sync.submit(_unmap_after, streams, list(imported.values()))

    def mapped(self, peer: Peer, remote_region: int) -> Any:
        """The peer's region as a tensor in this process (used by the benchmark's peer-copy ceiling)."""
        return peer.extra[self.name][remote_region]

    def applies(self, local: list[MemoryRegion], remote: list[RemoteRegion]) -> bool:
        return all(r.kind == "cuda" for r in local) and all(r.kind == "cuda" for r in remote)

    def supports(self, peer: Peer, local: list[MemoryRegion], remote: list[RemoteRegion]) -> str | None:
        if peer.host_id != self.ctx.host_id:
            return "peer is on another host"
        if any(r.kind != "cuda" for r in local):
            return "a local region is not CUDA memory"
        mapped = peer.extra.get(self.name, {})
        pending = peer.extra.get("cuda_ipc_pending", {})
        missing = [r.region_id for r in remote if r.region_id not in mapped and r.region_id not in pending]
        if missing:
            return f"remote region(s) {missing} are not CUDA memory mapped by IPC"
        return None

    def _stream(self, dev: int, k: int = 0) -> Any:
        import torch

        s = self._streams.get((dev, k))
        if s is None:
            s = self._streams[(dev, k)] = torch.cuda.Stream(device=dev)
        return s

    def _split(self, x: XferList) -> list[XferList]:
        """Big batched transfers go out on several streams (each a cuMemcpyBatchAsync), so the copy engines share
        the work; small ones stay on one stream, where a second launch would only add latency."""
        n = min(self.ctx.config.cuda_streams, len(x))
        if n <= 1 or self.copier.name != "batch" or int(x.length.sum()) < (64 << 20):
            return [x]
        return [x.take(np.arange(k, len(x), n)) for k in range(n)]

    # ---- moving bytes ------------------------------------------------------------------------------------------
    async def transfer(self, op: str, peer: Peer, xfers: XferList, notif: bytes | None, xfer_id: int,
                       deadline: float, wait_event: Any = None, key: str | None = None) -> bool:
        # one-sided: the peer's memory is mapped here, so the receiver cannot check this copy against its grants;
        # authentication gated the mapping, and the receiver still checks the notification against the key's grant
        import torch

        pending = peer.extra.get("cuda_ipc_pending", {})
        for rid in distinct(xfers.remote_region):
            task = pending.get(rid)
            if task is not None:  # the VMM mapping is still being made: wait for it (bounded), never go slow silently
                await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
        mapped = peer.extra.get(self.name, {})
        missing = [r for r in distinct(xfers.remote_region) if r not in mapped]
        if missing:
            why = peer.extra.get("why_not", {}).get(self.name, "its mapping was not ready before the deadline")
            raise TransportUnavailableError(f"cuda_ipc cannot reach region(s) {missing} of {peer.describe()}: {why}")
        regions = self.ctx.regions
        events = []
        devs = {r: regions.get(r).device for r in distinct(xfers.local_region)}
        for dev in sorted(set(devs.values())):
            x = xfers if len(devs) == 1 else xfers.take(np.isin(xfers.local_region, [r for r, d in devs.items() if d == dev]))
            parts = self._split(x)
            with torch.cuda.device(dev):
                for k, part in enumerate(parts):
                    stream = self._stream(dev, k)
                    if wait_event is not None:
                        stream.wait_event(wait_event)
                    else:
                        stream.wait_stream(torch.cuda.default_stream(dev))
                    self._enqueue_with_fallback(op, part, mapped, dev, stream)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events.append(ev)
        for ev in events:
            await self._wait(ev, deadline, peer, xfer_id, op)
        return False

    def _enqueue_with_fallback(self, op: str, x: XferList, mapped: dict[int, Any], dev: int, stream: Any) -> None:
        """In 'auto' mode an engine that fails at its first real use (old driver, bindings mismatch) is replaced by
        the next one (batch -> kernel -> percopy) and the copy retried; a forced engine's failure is an error.
        Engines fail at enqueue time, before any byte moved, so retrying is safe."""
        from pdserve.kv.transports.cuda_copy import METHODS, make_copier

        while True:
            try:
                self._enqueue(op, x, mapped, dev, stream)
                return
            except Exception as e:
                name = self.copier.name
                if self.ctx.config.cuda_copy != "auto" or name == METHODS[-1]:
                    raise
                self._copier = make_copier("auto", after=name)
                log.warning("cuda copy engine %s failed (%s: %s); switched to %s", name, type(e).__name__, e,
                            self._copier.name)

    def _enqueue(self, op: str, x: XferList, mapped: dict[int, Any], dev: int, stream: Any) -> None:
        regions = self.ctx.regions
        copier = self.copier
        if copier.name == "batch":
            lp = _bases(x.local_region, lambda r: regions.get(r).ptr) + x.local_offset
            rp = _bases(x.remote_region, lambda r: mapped[r].data_ptr()) + x.remote_offset
            rdev = mapped[int(x.remote_region[0])].device.index
            if op == "write":
                copier.copy(lp, rp, x.length, dev, rdev, stream)
            else:
                copier.copy(rp, lp, x.length, rdev, dev, stream)
            return
        pairs = np.stack([x.local_region, x.remote_region], 1)
        for lr, rr in np.unique(pairs, axis=0).tolist():
            sel = (x.local_region == lr) & (x.remote_region == rr)
            lt, rt = regions.get(lr).tensor, mapped[rr]
            lo, ro, n = x.local_offset[sel], x.remote_offset[sel], x.length[sel]
            if op == "write":
                copier.copy_tensors(lt, rt, lo, ro, n, stream)
            else:
                copier.copy_tensors(rt, lt, ro, lo, n, stream)

    async def _wait(self, ev: Any, deadline: float, peer: Peer, xfer_id: int, op: str) -> None:
        spin_until = time.monotonic() + _SPIN_S
        while time.monotonic() < spin_until:
            if ev.query():
                return
            await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self._sync, ev.synchronize),
                                   max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"cuda_ipc {op} {xfer_id} with {peer.describe()} did not complete before "
                                       "its deadline (GPU busy or hung?)") from None

    async def close(self) -> None:
        if self._fds is not None:
            self._fds.close()
        self._sync.shutdown(wait=False, cancel_futures=True)


def _unmap_after(streams: list[Any], imported: list[Any]) -> None:
    for s in streams:
        s.synchronize()
    for imp in imported:
        try:
            imp.close()
        except Exception as e:  # best effort: the process releases it at exit
            log.warning("cuda_ipc: unmapping a lost peer's pool failed: %s", e)
