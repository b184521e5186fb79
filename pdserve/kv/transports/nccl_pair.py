"""One connected pair's 2-rank communicator (torch.distributed NCCL, or Gloo for host memory) and the order its
operations are issued in.

NCCL matches sends and receives between two ranks by their order, and runs a communicator's operations one after
the other on one stream: both sides must issue the same operations in the same order, or they wait for each other
for ever. So every transfer of a pair gets a sequence number from rank 0 (the agent whose name sorts first), and each
side issues its operations strictly in sequence order from one thread (`plan`, `skip`: a refused transfer's number is
skipped on both sides). Operations on a sequence number are the transfer's runs, sent from or received straight into
views of the registered pool: no temporary buffer, so memory does not grow with the number of transfers in flight.

Sequence number 0 is the probe: each rank sends the other a MAC over a fresh nonce (from the control connection)
under the deployment secret, so the data path is proven to reach the agent that authenticated on the control
connection, not whoever raced it to the communicator's sockets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import hmac
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.kv.errors import KVTransferError
from pdserve.kv.transports.pair_store import make_store

log = logging.getLogger(__name__)
PROBE_BYTES = 32


@dataclass
class Op:
    """One send or receive of a contiguous run of bytes (a flat uint8 tensor view of a registered region)."""

    kind: str  # send | recv
    tensor: Any


def fail_future(fut: asyncio.Future, err: BaseException) -> None:
    """Fail `fut` and mark its exception retrieved: the futures of a failed pair are not all awaited, and an
    unretrieved one is logged with a traceback whenever the garbage collector meets it (in Python 3.11, formatting
    that traceback inside another ast.parse breaks it: "AST constructor recursion depth mismatch")."""
    if not fut.done():
        fut.set_exception(err)
        fut.exception()


def probe_tag(key: bytes, gen: int, nonce: bytes, rank: int, names: tuple[str, str]) -> bytes:
    msg = b"pdkv nccl probe" + gen.to_bytes(8, "little") + nonce + bytes([rank]) + "\0".join(names).encode()
    return hmac.digest(key, msg, "sha256")


class Pair:
    def __init__(self, peer: str, gen: int, rank: int, backend: str, device: int, timeout_s: float,
                 op_timeout_s: float) -> None:
        self.peer, self.gen, self.rank, self.backend, self.device = peer, gen, rank, backend, device
        self.timeout_s = timeout_s  # set-up (store calls, communicator creation, probe)
        # the process group's own timeout: past every transfer deadline, so our abort always comes first (torch's
        # NCCL watchdog tears the whole process down when an operation outlives it)
        self.op_timeout_s = op_timeout_s
        self.pg: Any = None
        self.store: Any = None  # the process group's rendezvous store (pair_store.make_store)
        self.broken: str | None = None
        self.setup_failed = False  # the communicator could not be made or failed its probe: not retried for this peer
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kv-nccl-{gen}")
        self._next_seq = 1  # allocation (rank 0 only)
        self._next_issue = 1
        self._plans: dict[int, tuple[list[Op], asyncio.Future, Any, float] | None] = {}
        self._futs: set[asyncio.Future] = set()
        self._side: Any = None
        self._lock = threading.Lock()

    # ---- set-up ------------------------------------------------------------------------------------------------
    def build(self, call: Callable[[str, list, float], Any], host: str | None) -> None:
        """Create the process group over the pair's store (blocking: run in the pair's thread)."""
        import torch.distributed as dist

        # held as long as the process group: torch keeps only the C++ side of a Python store alive, and NCCL uses it
        # lazily (at the first send); with the Python object collected its calls fail ("Not implemented.")
        store = self.store = make_store(call, self.timeout_s)
        timeout = datetime.timedelta(seconds=self.op_timeout_s)
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host else
                             dist.ProcessGroupGloo.create_default_device()]
            opts._timeout = timeout
            self.pg = dist.ProcessGroupGloo(store, self.rank, 2, opts)
        else:
            import torch

            if not dist.is_nccl_available():
                raise KVTransferError("this torch has no NCCL (torch.distributed.is_nccl_available() is False)")
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, self.rank, 2, opts)
            self._side = torch.cuda.Stream(device=self.device)

    def probe(self, mine: bytes, theirs: bytes) -> None:
        """Send our tag, receive the peer's, and compare (blocking; sequence number 0)."""
        import torch

        dev = "cpu" if self.backend == "gloo" else f"cuda:{self.device}"
        out = torch.tensor(list(mine), dtype=torch.uint8, device=dev)
        got = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=dev)
        ops = [Op("send", out), Op("recv", got)] if self.rank == 0 else [Op("recv", got), Op("send", out)]
        self.run(ops, None, self.timeout_s)
        if not hmac.compare_digest(bytes(got.cpu().tolist()), theirs):
            raise KVTransferError(f"the {self.backend} communicator with {self.peer} failed its probe: whoever answered "
                                  "on its data path does not hold the deployment secret")

    def begin(self, call: Callable[[str, list, float], Any], host: str | None, mine: bytes, theirs: bytes) -> None:
        """Queue the build and the probe on the pair's thread now (so operations planned from here on run after
        them) and resolve `ready` when they finished, failed, or the set-up timeout passed."""
        loop = asyncio.get_running_loop()

        def work() -> None:
            self.build(call, host)
            self.probe(mine, theirs)

        cf = self._thread.submit(work)
        self._watch = loop.create_task(self._watch_setup(asyncio.wrap_future(cf)))

    async def _watch_setup(self, fut: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except Exception as e:
            why = "timed out" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
            self.setup_failed = True
            self.fail(f"setting up the {self.backend} communicator with {self.peer} failed: {why}")
            return
        if not self.ready.done():
            self.ready.set_result(self)

    # ---- ordering ----------------------------------------------------------------------------------------------
    def alloc(self) -> int:
        """The next sequence number (rank 0 hands them out for both sides' transfers)."""
        s = self._next_seq
        self._next_seq += 1
        return s

    def plan(self, seq: int, ops: list[Op], wait_event: Any, timeout_s: float) -> asyncio.Future:
        """Issue `ops` as transfer `seq` once every earlier number is issued or skipped; the future resolves when
        they completed here (raises if they failed)."""
        fut = asyncio.get_running_loop().create_future()
        if self.broken is not None:
            fail_future(fut, KVTransferError(self.broken))
            return fut
        if seq < self._next_issue or seq in self._plans:
            fail_future(fut, KVTransferError(f"transfer number {seq} of the pair with {self.peer} was used twice"))
            return fut
        self._plans[seq] = (ops, fut, wait_event, timeout_s)
        self._futs.add(fut)
        fut.add_done_callback(self._futs.discard)
        self._pump()
        return fut

    def skip(self, seq: int) -> None:
        if seq >= self._next_issue and seq not in self._plans:
            self._plans[seq] = None
            self._pump()

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while self._next_issue in self._plans:
            seq = self._next_issue
            p = self._plans.pop(seq)
            self._next_issue += 1
            if p is None:
                continue
            ops, fut, ev, timeout = p
            cf = self._thread.submit(self.run, ops, ev, timeout)
            cf.add_done_callback(lambda c, fut=fut: loop.call_soon_threadsafe(_settle, fut, c))

    # ---- the operations ------------------------------------------------------------------------------------------
    def run(self, ops: list[Op], wait_event: Any, timeout_s: float) -> None:
        """Issue `ops` in order and wait until they completed here (the pair's thread)."""
        if self.broken is not None:
            raise KVTransferError(self.broken)
        peer = 1 - self.rank
        if self.backend == "gloo":
            works = [(self.pg.send if o.kind == "send" else self.pg.recv)([o.tensor], peer, 0) for o in ops]
            for w in works:
                w.wait(datetime.timedelta(seconds=max(0.001, timeout_s)))
            return
        import torch

        dev = torch.device("cuda", self.device)
        with torch.cuda.device(dev), torch.cuda.stream(self._side):
            if wait_event is not None:
                self._side.wait_event(wait_event)
            elif any(o.kind == "send" for o in ops):  # sends read what the producer queued on the default stream
                self._side.wait_stream(torch.cuda.default_stream(dev))
            works = self._issue_nccl(ops, peer, dev)
            for w in works:
                w.wait()  # the side stream waits for NCCL's stream (no host wait)
            done = torch.cuda.Event()
            done.record(self._side)
        done.synchronize()  # the host waits; abort() releases a communicator stuck on a dead peer
        if self.broken is not None:
            raise KVTransferError(self.broken)

    def _issue_nccl(self, ops: list[Op], peer: int, dev: Any) -> list[Any]:
        pg = self.pg
        if len(ops) > 1 and pg.supports_coalescing:
            # one NCCL group: every run of the transfer in one launch. Only where the group takes the device (a
            # ProcessGroup); on a bare backend object (torch 2.11's ProcessGroupNCCL) _start_coalescing() opens no
            # NCCL group (ncclGroupEnd then fails), so the runs go one by one there, in order.
            try:
                pg._start_coalescing(dev)
            except TypeError:
                return [(pg.send if o.kind == "send" else pg.recv)([o.tensor], peer, 0) for o in ops]
            try:
                for o in ops:
                    (pg.send if o.kind == "send" else pg.recv)([o.tensor], peer, 0)
            finally:
                work = pg._end_coalescing(dev)
            return [work]
        return [(pg.send if o.kind == "send" else pg.recv)([o.tensor], peer, 0) for o in ops]

    # ---- failure -------------------------------------------------------------------------------------------------
    def fail(self, why: str) -> None:
        """Mark the pair unusable, fail everything pending on it, and abort the communicator (in a helper thread:
        ncclCommAbort also releases a kernel stuck on a peer that died)."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = why
        err = KVTransferError(why)
        if not self.ready.done():
            fail_future(self.ready, err)
        for p in self._plans.values():
            if p is not None:
                fail_future(p[1], err)
        self._plans.clear()
        for fut in list(self._futs):
            if not fut.done():
                fail_future(fut, err)
        # the process group (with its store) is aborted and released in a helper thread, so its destructor runs
        # there at a known time, not in whatever thread a garbage collection happens to hit it
        holder = [self.pg, self.store]
        self.pg = self.store = None
        threading.Thread(target=_abort, args=(holder, self.peer, self._thread), name="kv-nccl-abort",
                         daemon=True).start()
        self._thread.shutdown(wait=False, cancel_futures=True)


def _abort(holder: list, peer: str, pair_thread: concurrent.futures.ThreadPoolExecutor) -> None:
    pg, store = holder
    holder.clear()
    if pg is not None:
        try:
            pg.abort()
        except Exception as e:  # best effort: the communicator may be half made or already gone
            log.debug("aborting the communicator with %s: %s", peer, e)
    pair_thread.shutdown(wait=True)  # the pair's thread may still hold an operation: let it end first
    del pg, store


def _settle(fut: asyncio.Future, c: concurrent.futures.Future) -> None:
    if fut.done():
        return
    if c.cancelled():
        fail_future(fut, KVTransferError("the pair's communicator was shut down"))
    elif c.exception() is not None:
        e = c.exception()
        fail_future(fut, e if isinstance(e, KVTransferError) else KVTransferError(f"{type(e).__name__}: {e}"))
    else:
        fut.set_result(None)
