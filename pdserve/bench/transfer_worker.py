"""One side of `pdserve bench transfer`: a process that owns a KV-shaped pool and an agent, and runs commands sent
by the orchestrating parent over a multiprocessing pipe (fill, checksum, timed transfers, raw-socket and peer-copy
ceilings). Also used by the tests as "a peer in another process"."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from pdserve.kv.agent import KVAgent
from pdserve.kv.config import AgentConfig
from pdserve.kv.descs import block_xfers
from pdserve.kv.errors import TransportUnavailableError
from pdserve.kv.notify import Notification
from pdserve.kv.transports.tcp import split_address, tune_socket
from pdserve.kv.wire import recv_into_exact
from pdserve.stats import median, percentile


class Pool:
    """A block-major pool [num_blocks, block_bytes] of bytes: numpy on CPU (tests), torch on CPU or CUDA (bench)."""

    def __init__(self, num_blocks: int, block_bytes: int, backend: str, device: str, alloc: str = "torch") -> None:
        self.num_blocks, self.block_bytes, self.backend, self.device = num_blocks, block_bytes, backend, device
        if backend == "numpy":
            self.data: Any = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        elif alloc == "vmm":  # CUDA VMM memory (pdserve.kv.vmm): shareable with processes that do not see this GPU
            import torch

            from pdserve.kv.vmm import vmm_zeros

            self.data = vmm_zeros((num_blocks, block_bytes), torch.uint8, device)
        else:
            import torch

            pin = device == "pinned"
            dev = "cpu" if device in ("cpu", "pinned") else device
            self.data = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, device=dev, pin_memory=pin)

    def fill(self, seed: int) -> None:
        if self.backend == "numpy":
            self.data[:] = np.random.default_rng(seed).integers(0, 256, self.data.shape, dtype=np.uint8)
            return
        import torch

        g = torch.Generator(device=self.data.device).manual_seed(seed)
        for i in range(0, self.num_blocks, 64):
            blk = self.data[i:i + 64]
            blk.copy_(torch.randint(0, 256, blk.shape, dtype=torch.uint8, device=self.data.device, generator=g))
        self.sync()

    def sync(self) -> None:
        if self.backend == "torch" and self.data.is_cuda:
            import torch

            torch.cuda.synchronize(self.data.device)

    def checksums(self, ids: list[int]) -> list[str]:
        """Per-block digests, identical for identical bytes whatever the device (exact integer sums on torch)."""
        if self.backend == "numpy":
            return [hashlib.blake2b(self.data[i].tobytes(), digest_size=16).hexdigest() for i in ids]
        import torch

        out: list[str] = []
        bb = self.block_bytes - self.block_bytes % 4
        w = (torch.arange(bb // 4, device=self.data.device, dtype=torch.int64) % 251) + 1
        for i in range(0, len(ids), 32):
            idx = torch.tensor(ids[i:i + 32], device=self.data.device)
            x = self.data[idx][:, :bb].contiguous().view(torch.int32).to(torch.int64)
            s1 = x.sum(1).tolist()
            s2 = (x * w).sum(1).tolist()
            tail = self.data[idx][:, bb:].to(torch.int64).sum(1).tolist()
            out += [f"{a}:{b}:{c}" for a, b, c in zip(s1, s2, tail)]
        return out


class MemSampler:
    """Peak memory of this process while it runs, sampled in a thread: for a CUDA pool the device's memory in use
    (cudaMemGetInfo: NCCL's and the transports' own buffers included) and torch's allocations, for host pools the
    resident set size."""

    def __init__(self, pool: Pool, interval_s: float) -> None:
        self.pool, self.interval_s = pool, interval_s
        self.cuda = pool.backend == "torch" and pool.data.is_cuda
        if self.cuda:
            import torch

            self.dev = pool.data.device
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
        self.baseline = {"used": self._used(), "allocated": self._allocated()}
        self.peak = self.baseline["used"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-bench-mem", daemon=True)
        self._thread.start()

    def _used(self) -> int:
        if self.cuda:
            import torch

            free, total = torch.cuda.mem_get_info(self.dev)
            return int(total - free)
        import psutil

        return int(psutil.Process().memory_info().rss)

    def _allocated(self) -> int:
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated(self.dev))
        return 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._used())

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, self._used())
        return {"kind": "cuda device memory in use" if self.cuda else "resident set size",
                "before_used": self.baseline["used"], "peak_used": self.peak, "grew_bytes": self.peak - self.baseline["used"],
                "before_torch_allocated": self.baseline["allocated"], "peak_torch_allocated": self._allocated(),
                "pool_bytes": int(self.pool.data.nbytes)}


def summarize(seconds: list[float], nbytes: int) -> dict[str, float]:
    med = median(seconds)
    return {"median_ms": med * 1e3, "p99_ms": percentile(seconds, 99.0) * 1e3, "min_ms": min(seconds) * 1e3,
            "GBps": nbytes / med / 1e9 if med > 0 else float("nan"), "iters": len(seconds)}


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        dev = spec.get("device", "cpu")
        if dev.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(dev))
        self.pool = Pool(spec["num_blocks"], spec["block_bytes"], spec.get("backend", "torch"), dev,
                         spec.get("alloc", "torch"))
        self.skipped: dict[str, str] = {}  # opt-in transports that could not start here, and why
        self.agent = self._agent(dict(spec.get("agent", {})), spec.get("optional_extras", False))
        src = self.pool.data
        self.region = self.agent.register(src, name="kv")
        self.latencies_ns: list[int] = []
        self.agent.on_notification(self._on_notif)
        self._raw_sets: dict[int, list[socket.socket]] = {}
        self._raw_socks: list[socket.socket] = []

    def _agent(self, cfg: dict[str, Any], optional: bool) -> KVAgent:
        """The agent; with `optional`, an opt-in transport (extra_transports) that cannot start here is left out
        and its reason kept (the benchmark's `--transport all` reports it), instead of failing the worker."""
        while True:
            try:
                return KVAgent(AgentConfig(**cfg))
            except TransportUnavailableError as e:
                extras = list(cfg.get("extra_transports", ()))
                bad = next((t for t in extras if f"transport {t}" in str(e)), None)
                if not optional or bad is None:
                    raise
                self.skipped[bad] = str(e)
                cfg["extra_transports"] = [t for t in extras if t != bad]

    def _on_notif(self, n: Notification) -> None:
        try:
            t0 = int(n.unpack()["t0"])
        except Exception:
            return
        self.latencies_ns.append(n.recv_ns - t0)

    async def run(self, conn: Any) -> None:
        loop = asyncio.get_running_loop()
        await self.agent.start()
        while True:
            cmd, kw = await loop.run_in_executor(None, conn.recv)
            if cmd == "exit":
                await self.agent.close()
                conn.send(("ok", None))
                return
            if cmd == "kill":
                os._exit(17)
            try:
                res = await getattr(self, "cmd_" + cmd)(**kw)
                conn.send(("ok", res))
            except Exception as e:  # reported to the parent, which decides
                conn.send(("error", f"{type(e).__name__}: {e}"))

    async def cmd_info(self) -> dict[str, Any]:
        return {"address": self.agent.address, "name": self.agent.name, "region": self.region,
                "transports": sorted(self.agent.transports), "pid": os.getpid(), "skipped": self.skipped}

    async def cmd_connect(self, address: str) -> str:
        return await self.agent.connect(address)

    async def cmd_grant(self, key: str, ids: list[int], seconds: float, peer: str | None = None,
                        mode: str = "w") -> None:
        """Grant our blocks `ids` to `peer` under `key` (tests: this process as the receiving engine)."""
        self.agent.grant_blocks(key, self.region, ids, self.pool.block_bytes, mode, time.time() + seconds, peer)

    async def cmd_fill(self, seed: int) -> None:
        self.pool.fill(seed)

    async def cmd_checksums(self, ids: list[int]) -> list[str]:
        return self.pool.checksums(ids)

    async def cmd_latencies(self) -> list[int]:
        out, self.latencies_ns = self.latencies_ns, []
        return out

    async def cmd_xfer(self, op: str, peer: str, local_ids: list[int], remote_ids: list[int], iters: int, warmup: int,
                       transport: str | None = None, timeout: float = 60.0, key: str | None = None) -> dict[str, Any]:
        """Timed transfers, each from the call (descriptor building included) to completion at this side."""
        bb = self.pool.block_bytes
        rr = self.agent.peer(peer).region_id("kv")
        times = []
        res = None
        self.pool.sync()
        for i in range(warmup + iters):
            t0 = time.perf_counter_ns()
            xl = block_xfers(local_ids, remote_ids, bb, self.region, rr, coalesce=False)  # the agent coalesces
            notif = {"i": i, "t0": t0}
            if op == "write":
                res = await self.agent.write(peer, xl, notif, transport=transport, timeout=timeout, key=key)
            else:
                res = await self.agent.read(peer, xl, notif, transport=transport, timeout=timeout, key=key)
            if i >= warmup:
                times.append((time.perf_counter_ns() - t0) / 1e9)
        assert res is not None
        if not times:  # warm-up only
            return {"transport": res.transport, "bytes": res.nbytes}
        out = summarize(times, res.nbytes)
        out.update({"transport": res.transport, "bytes": res.nbytes, "descs_in": res.descs_in,
                    "descs_out": res.descs_out, "times_ms": [t * 1e3 for t in times]})
        tr = self.agent.transports.get(res.transport)
        if tr is not None and getattr(tr, "_copier", None) is not None:
            out["copy_method"] = tr._copier.name
        return out

    async def cmd_xfer_many(self, op: str, peer: str, local_ids: list[int], remote_ids: list[int], count: int,
                            transport: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
        """`count` transfers of the same blocks started at once (the memory check: as many handovers in flight as
        a loaded server has); returns the wall time and the transport used."""
        bb = self.pool.block_bytes
        rr = self.agent.peer(peer).region_id("kv")
        self.pool.sync()
        t0 = time.perf_counter()
        fn = self.agent.write if op == "write" else self.agent.read
        res = await asyncio.gather(*(fn(peer, block_xfers(local_ids, remote_ids, bb, self.region, rr, coalesce=False),
                                        {"i": i}, transport=transport, timeout=timeout) for i in range(count)))
        return {"seconds": time.perf_counter() - t0, "transport": res[0].transport, "count": count,
                "bytes": sum(r.nbytes for r in res)}

    async def cmd_mem_start(self, interval_s: float = 0.001) -> dict[str, Any]:
        """Start sampling this process's memory (the pool's GPU: device memory in use and torch's allocations;
        host pools: resident set size) until mem_stop."""
        self._mem = MemSampler(self.pool, interval_s)
        return self._mem.baseline

    async def cmd_mem_stop(self) -> dict[str, Any]:
        return self._mem.stop()

    async def cmd_peer_transport(self, peer: str) -> dict[str, Any]:
        return self.agent.peer_transport(peer)

    async def cmd_copy_method(self) -> str | None:
        tr = self.agent.transports.get("cuda_ipc")
        return tr.copier.name if tr is not None else None

    # ---- ceilings ----------------------------------------------------------------------------------------------
    def _host_view(self, nbytes: int, scratch: bool) -> memoryview:
        """Host bytes for the raw-socket ceiling: the pool itself when sending from host memory (the transfer reads
        it too), a separate buffer when receiving (the pool's contents are checked after the transfers)."""
        reg = self.agent.region(self.region)
        if not scratch and reg.host_view is not None and reg.size >= nbytes:
            return reg.host_view[:nbytes]
        if getattr(self, "_raw_buf", None) is None or self._raw_buf.nbytes < nbytes:
            self._raw_buf = memoryview(np.ones(nbytes, dtype=np.uint8))  # touched: no page faults while timed
        return self._raw_buf[:nbytes]

    async def cmd_raw_sink(self, nbytes: int, conns: int) -> int:
        """Listen for `conns` raw TCP streams; each iteration receives its share of nbytes and acks one byte."""
        view = self._host_view(nbytes, scratch=True)
        ls = socket.socket()
        ls.bind((self.agent.config.host, 0))
        ls.listen(conns)
        port = ls.getsockname()[1]

        def serve_one(s: socket.socket, part: memoryview) -> None:
            tune_socket(s, self.agent.config.tcp_socket_buffer)
            try:
                while True:
                    recv_into_exact(s, part)
                    s.sendall(b"k")
            except (OSError, ConnectionError):
                s.close()

        def accept() -> None:
            for i in range(conns):
                s, _ = ls.accept()
                lo, hi = nbytes * i // conns, nbytes * (i + 1) // conns
                threading.Thread(target=serve_one, args=(s, view[lo:hi]), daemon=True).start()
            ls.close()

        threading.Thread(target=accept, daemon=True).start()
        return port

    async def cmd_raw_open(self, address: str, conns: int) -> None:
        host, port = split_address(address)
        socks = []
        for _ in range(conns):
            s = socket.create_connection((host, port), timeout=30)
            tune_socket(s, self.agent.config.tcp_socket_buffer)
            socks.append(s)
        self._raw_sets[conns] = self._raw_socks = socks

    async def cmd_raw_use(self, conns: int) -> None:
        self._raw_socks = self._raw_sets[conns]

    async def cmd_raw_send(self, nbytes: int, iters: int, warmup: int) -> dict[str, Any]:
        """The tcp ceiling: plain sendall of one contiguous buffer over the raw sockets to the sink, same processes."""
        socks = self._raw_socks
        conns = len(socks)
        view = self._host_view(nbytes, scratch=False)
        ack = [memoryview(bytearray(1)) for _ in socks]

        def one(i: int) -> None:
            lo, hi = nbytes * i // conns, nbytes * (i + 1) // conns
            socks[i].sendall(view[lo:hi])
            recv_into_exact(socks[i], ack[i])

        loop = asyncio.get_running_loop()
        times = []
        for it in range(warmup + iters):
            t0 = time.perf_counter()
            if conns == 1:
                await loop.run_in_executor(None, one, 0)
            else:
                await asyncio.gather(*(loop.run_in_executor(None, one, i) for i in range(conns)))
            if it >= warmup:
                times.append(time.perf_counter() - t0)
        if not times:
            return {"connections": conns}
        out = summarize(times, nbytes)
        out.update({"connections": conns, "times_ms": [t * 1e3 for t in times]})
        return out

    async def cmd_raw_close(self) -> None:
        for socks in self._raw_sets.values():
            for s in socks:
                s.close()
        self._raw_sets, self._raw_socks = {}, []

    async def cmd_peer_copy(self, peer: str, nbytes: int, iters: int, warmup: int, pull: bool = False) -> dict[str, Any]:
        """The cuda_ipc ceiling: one large copy between our pool and the peer's IPC-mapped pool (torch copy_, a
        cudaMemcpyAsync on the copy engines): pushed into the peer (write direction) or pulled from it (read)."""
        import torch

        tr = self.agent.transports["cuda_ipc"]
        p = self.agent.peer(peer)
        remote = tr.mapped(p, p.region_id("kv"))[:nbytes]
        local = self.pool.data.view(-1)[:nbytes]
        src, dst = (remote, local) if pull else (local, remote)
        stream = torch.cuda.Stream()
        times = []
        for it in range(warmup + iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            if it >= warmup:
                times.append(time.perf_counter() - t0)
        return summarize(times, nbytes)


def worker_main(conn: Any, spec: dict[str, Any]) -> None:
    if spec.get("visible_devices") is not None:  # before CUDA initializes in this process: it reads this once
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec["visible_devices"])
    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    try:
        w = Worker(spec)
    except Exception as e:
        conn.send(("error", f"worker start failed: {type(e).__name__}: {e}"))
        return
    conn.send(("ok", "ready"))
    asyncio.run(w.run(conn))
