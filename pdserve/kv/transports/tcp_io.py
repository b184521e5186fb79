"""Moving bytes between a blocking socket and a registered region: straight from/to host memory, GPU memory through
two pinned staging buffers per thread. Every receive is bounded by a deadline as well as the socket's timeout, so a
peer trickling bytes cannot hold a thread for longer than its request's budget.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from pdserve.kv.errors import TransferTimeoutError

if TYPE_CHECKING:
    from pdserve.kv.regions import MemoryRegion


def tune_socket(sock: socket.socket, bufsize: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, bufsize)
        except OSError:
            pass


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def recv_into_by(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view` before `deadline` (time.monotonic); ConnectionError on EOF, TransferTimeoutError past it."""
    got, n = 0, view.nbytes
    while got < n:
        if time.monotonic() > deadline:
            raise TransferTimeoutError(f"receive passed its deadline after {got} of {n} bytes")
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError(f"connection closed by peer after {got} of {n} bytes")
        got += k


def drain(sock: socket.socket, n: int, deadline: float) -> None:
    """Read and discard n bytes (a refused WRITE's data), so the connection stays in step."""
    buf = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n > 0:
        k = min(n, buf.nbytes)
        recv_into_by(sock, buf[:k], deadline)
        n -= k


class _Staging(threading.local):
    """Per-thread pinned buffers for GPU memory (allocated on first use, reused for every chunk)."""

    buf: Any = None
    views: Any = None
    stream: Any = None
    events: Any = None
    device: int = -1


class RegionIO:
    """Socket <-> region copies; `mac` (an hmac object or None) is fed every byte that passes."""

    def __init__(self, staging_bytes: int) -> None:
        self.staging_bytes = staging_bytes
        self._staging = _Staging()

    def _stage(self, device: int) -> tuple[list[Any], list[memoryview], Any, list[Any]]:
        """This thread's two pinned half-buffers, their byte views, a copy stream on `device` and two events.

        Two buffers so the GPU copy of one chunk overlaps the socket transfer of the other."""
        st = self._staging
        if st.buf is None or st.device != device:
            import torch

            half = max(1 << 20, self.staging_bytes // 2)
            st.buf = [torch.empty(half, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            st.views = [memoryview(b.numpy()) for b in st.buf]
            st.stream = torch.cuda.Stream(device=device)
            st.events = [torch.cuda.Event(), torch.cuda.Event()]
            st.device = device
        return st.buf, st.views, st.stream, st.events

    def send(self, s: socket.socket, reg: MemoryRegion, off: int, n: int, mac: Any = None) -> None:
        if reg.host_view is not None:
            view = reg.host_view[off:off + n]
            if mac is not None:
                mac.update(view)
            s.sendall(view)
            return
        import torch

        bufs, views, stream, events = self._stage(reg.device)
        step = bufs[0].numel()
        chunks = [(p, min(step, n - p)) for p in range(0, n, step)]
        src = reg.tensor
        with torch.cuda.device(reg.device), torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.default_stream(reg.device))  # after the producer's queued work

            def fetch(k: int) -> None:
                p, c = chunks[k]
                bufs[k % 2][:c].copy_(src[off + p:off + p + c], non_blocking=True)  # device -> pinned
                events[k % 2].record(stream)

            fetch(0)
            for k, (_, c) in enumerate(chunks):
                if k + 1 < len(chunks):
                    fetch(k + 1)  # its buffer was sent (synchronously) in the previous iteration
                events[k % 2].synchronize()
                if mac is not None:
                    mac.update(views[k % 2][:c])
                s.sendall(views[k % 2][:c])

    def recv(self, s: socket.socket, reg: MemoryRegion, off: int, n: int, deadline: float, mac: Any = None) -> None:
        if reg.host_view is not None:
            view = reg.host_view[off:off + n]
            recv_into_by(s, view, deadline)
            if mac is not None:
                mac.update(view)
            return
        import torch

        bufs, views, stream, events = self._stage(reg.device)
        step = bufs[0].numel()
        dst = reg.tensor
        with torch.cuda.device(reg.device), torch.cuda.stream(stream):
            for k, p in enumerate(range(0, n, step)):
                c = min(step, n - p)
                if k >= 2:
                    events[k % 2].synchronize()  # the copy that last read this buffer is done
                recv_into_by(s, views[k % 2][:c], deadline)
                if mac is not None:
                    mac.update(views[k % 2][:c])
                dst[off + p:off + p + c].copy_(bufs[k % 2][:c], non_blocking=True)  # pinned -> device
                events[k % 2].record(stream)
            stream.synchronize()  # landed before the response (and the notification) goes out
