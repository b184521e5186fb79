"""Handing a descriptor to the authenticated local peer (the CUDA VMM pool's handle, here an ordinary memfd): only the
holder of a live one-time token gets it; a stranger at the socket gets nothing, and the struct layouts the VMM
allocator passes to the CUDA driver have the driver's sizes."""

import asyncio
import ctypes
import os
import socket
import time

import pytest

from pdserve.kv.fd_share import FdServer, fetch_fd


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("pdserve-test")
    os.write(fd, content)
    return fd


@pytest.mark.timeout(30)
def test_only_a_live_token_gets_the_descriptor_once():
    async def main():
        loop = asyncio.get_running_loop()
        src = _memfd(b"kv pool handle")
        server = FdServer(ttl_s=0.5, io_timeout_s=0.5)
        name, tok = server.offer("decode-0", lambda: os.dup(src), header=b"hdr")
        fd, hdr = await loop.run_in_executor(None, fetch_fd, name, tok, 2.0)
        assert hdr == b"hdr" and os.pread(fd, 64, 0) == b"kv pool handle"
        os.close(fd)
        with pytest.raises(ConnectionError, match="refused the token"):  # used once already
            await loop.run_in_executor(None, fetch_fd, name, tok, 2.0)
        with pytest.raises(ConnectionError, match="refused the token"):  # never offered
            await loop.run_in_executor(None, fetch_fd, name, os.urandom(32), 2.0)
        _, late = server.offer("decode-0", lambda: os.dup(src))
        await asyncio.sleep(0.6)
        with pytest.raises(ConnectionError, match="refused the token"):  # expired
            await loop.run_in_executor(None, fetch_fd, name, late, 2.0)
        # a stranger that connects and sends nothing is closed after the io timeout, having received nothing
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        await loop.sock_connect(s, name)
        t0 = time.monotonic()
        assert await asyncio.wait_for(loop.sock_recv(s, 64), 3.0) == b""
        assert time.monotonic() - t0 < 2.0
        s.close()
        assert (server.served, server.refused) == (1, 4)
        _, again = server.offer("decode-0", lambda: os.dup(src))  # the server still serves
        fd, _ = await loop.run_in_executor(None, fetch_fd, name, again, 2.0)
        os.close(fd)
        server.close()
        os.close(src)

    asyncio.run(main())


def test_driver_struct_layouts():
    from pdserve.kv.vmm import AccessDesc, AllocationProp

    assert ctypes.sizeof(AllocationProp) == 32  # CUmemAllocationProp on 64-bit Linux
    assert AllocationProp.allocFlags.offset == 24 and AllocationProp.win32HandleMetaData.offset == 16
    assert ctypes.sizeof(AccessDesc) == 12  # CUmemAccessDesc
