"""The mooncake transport's start-up errors (a missing library, RDMA without a device, a device that does not exist:
one clear error each, never Mooncake's silent fall-back to TCP) and what its unauthenticated port can reach, exactly
as pdserve/kv/README.md says: the bytes of the registered pool and nothing outside it."""

import asyncio
import hashlib
import os
import socket
import struct
import sys

import psutil
import pytest

from pdserve.kv import AgentConfig, KVAgent
from pdserve.kv.errors import TransportUnavailableError
from tests.kv.kv_helpers import BB, NB, OPEN, local_agent, spawn_peer
from tests.kv.test_kv_optin import MOONCAKE


def test_missing_library_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)  # import mooncake.engine now fails like a missing package
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransportUnavailableError, match=r"pip install 'pdserve\[mooncake\]'"):
        KVAgent(AgentConfig(transport="mooncake", **OPEN))
    # asking for it is what fails: agents that do not name it start as before
    KVAgent(AgentConfig(transport="tcp", **OPEN))


@MOONCAKE
@pytest.mark.skipif(bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")),
                    reason="this machine has RDMA devices")
def test_rdma_without_a_device_is_an_error_not_tcp():
    with pytest.raises(TransportUnavailableError, match="no RDMA device found.*--kv-protocol tcp"):
        KVAgent(AgentConfig(transport="mooncake", protocol="rdma", **OPEN))
    with pytest.raises(TransportUnavailableError, match="RDMA device.*mlx5_97 not found"):
        KVAgent(AgentConfig(transport="mooncake", protocol="rdma", devices="mlx5_97", **OPEN))


def test_devices_and_protocol_are_configuration():
    cfg = AgentConfig(transport="mooncake", devices=" mlx5_0, mlx5_1 ", protocol="tcp", **OPEN)
    assert cfg.device_list == ["mlx5_0", "mlx5_1"]
    with pytest.raises(ValueError, match="protocol must be one of rdma, tcp"):
        AgentConfig(protocol="udp", **OPEN)


@MOONCAKE
@pytest.mark.timeout(90)
def test_what_an_unauthenticated_process_reaches_through_mooncakes_port():
    """Mooncake's TCP data port takes a bare header (size, address, opcode) from anyone: a stranger writes into the
    registered pool (the README says so: use Mooncake only where every process that can reach it is trusted), but
    not one byte outside it (Mooncake checks addresses against its registered buffers)."""
    dec = spawn_peer("zdec", transport="mooncake", protocol="tcp")
    try:
        async def main():
            a, pa, ra = local_agent(name="apre", transport="mooncake", protocol="tcp")
            loop = asyncio.get_running_loop()
            call = lambda *x, **k: loop.run_in_executor(None, lambda: dec.call(*x, **k))  # noqa: E731
            info = await call("info")
            peer = await a.connect(info["address"])
            base = a.peer(peer).regions[a.peer(peer).region_id("kv")].export["mooncake"]["addr"]
            rpc = int(a.peer(peer).hello["mooncake"]["seg"].rpartition(":")[2])
            agent_port = int(info["address"].rpartition(":")[2])
            ports = {c.laddr.port for c in psutil.Process(info["pid"]).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN} - {agent_port, rpc}
            assert len(ports) == 1, ports
            data_port = ports.pop()

            def stranger_write(addr: int, payload: bytes) -> int:
                s = socket.create_connection(("127.0.0.1", data_port), timeout=5)
                try:  # Mooncake's session header: u64 size, u64 address, u8 opcode (WRITE=1, v2 framing: 0x80)
                    s.sendall(struct.pack("<QQB7x", len(payload), addr, 0x81) + payload)
                    return struct.unpack("<Q", s.recv(8).ljust(8, b"\0"))[0] & 0xFFFFFFFF
                except OSError:
                    return -1
                finally:
                    s.close()

            await call("fill", seed=1)
            payload = (bytes(range(256)) * (BB // 256 + 1))[:BB]
            status = await loop.run_in_executor(None, stranger_write, base + 3 * BB, payload)
            assert status == 0  # accepted: no authentication on Mooncake's port
            assert await call("checksums", ids=[3]) == [hashlib.blake2b(payload, digest_size=16).hexdigest()]
            before = await call("checksums", ids=list(range(NB)))
            status = await loop.run_in_executor(None, stranger_write, base + NB * BB - 16, payload[:64])
            assert status != 0  # past the end of the registered pool: refused
            assert await call("checksums", ids=list(range(NB))) == before
            await a.close()

        asyncio.run(main())
    finally:
        dec.close()


def test_hca_list_from_mooncakes_topology():
    from pdserve.kv.transports.mooncake import hcas

    topo = '{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:0": [["mlx5_0"], []]}'
    assert hcas(topo) == {"mlx5_0", "mlx5_1"}
    assert hcas('{"cpu:0": [[], []]}') == set() and hcas("not json") == set()
