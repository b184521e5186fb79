"""Where peers find each other. Default: nothing (peers dial "host:port" and the handshake says the rest).
Optional: etcd, through its v3 JSON/HTTP gateway (aiohttp, no etcd client library), for multi-host deployments
where agents are known by name.

Each agent publishes `{address, host_id}` under `<prefix><name>` attached to a lease it keeps alive, so an agent
that dies disappears from etcd after the TTL instead of leaving a stale address behind.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Any

from pdserve.kv.config import AgentConfig
from pdserve.kv.errors import KVTransferError

log = logging.getLogger(__name__)


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def prefix_end(prefix: str) -> bytes:
    """etcd's range_end for "every key starting with prefix": the prefix with its last byte incremented."""
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"  # all 0xff: etcd reads "\0" as "to the end of the keyspace"


def lease_grant_request(ttl: int) -> dict[str, Any]:
    return {"TTL": int(ttl)}


def put_request(key: str, value: dict[str, Any], lease: str | int | None) -> dict[str, Any]:
    req: dict[str, Any] = {"key": _b64(key), "value": _b64(json.dumps(value, sort_keys=True))}
    if lease is not None:
        req["lease"] = str(lease)
    return req


def range_request(key: str, prefix: bool = False) -> dict[str, Any]:
    req = {"key": _b64(key)}
    if prefix:
        req["range_end"] = _b64(prefix_end(key))
    return req


def decode_range(resp: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for kv in resp.get("kvs") or []:
        out[base64.b64decode(kv["key"]).decode()] = json.loads(base64.b64decode(kv.get("value", "")) or b"{}")
    return out


class EtcdMetadata:
    def __init__(self, url: str, prefix: str, ttl_s: int) -> None:
        self.url = url.rstrip("/")
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._session: Any = None
        self._lease: str | None = None
        self._keepalive: asyncio.Task | None = None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            async with self._session.post(self.url + path, json=body) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise KVTransferError(f"etcd at {self.url}{path} answered {r.status}: {data}")
                return data or {}
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise KVTransferError(f"etcd at {self.url} unreachable ({path}): {e!r}") from e

    async def publish(self, name: str, info: dict[str, Any]) -> None:
        lease = await self._post("/v3/lease/grant", lease_grant_request(self.ttl_s))
        self._lease = str(lease["ID"])
        await self._post("/v3/kv/put", put_request(self.prefix + name, info, self._lease))
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.ttl_s / 3))
            try:
                await self._post("/v3/lease/keepalive", {"ID": self._lease})
            except KVTransferError as e:
                log.warning("etcd lease keepalive failed: %s", e)

    async def lookup(self, name: str) -> dict[str, Any] | None:
        found = decode_range(await self._post("/v3/kv/range", range_request(self.prefix + name)))
        return found.get(self.prefix + name)

    async def list(self) -> dict[str, dict[str, Any]]:
        found = decode_range(await self._post("/v3/kv/range", range_request(self.prefix, prefix=True)))
        return {k[len(self.prefix):]: v for k, v in found.items()}

    async def close(self, name: str) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        try:
            await self._post("/v3/kv/deleterange", range_request(self.prefix + name))
            if self._lease is not None:
                await self._post("/v3/lease/revoke", {"ID": self._lease})
        except KVTransferError as e:
            log.warning("could not unpublish %s from etcd: %s", name, e)
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None


def make_metadata(config: AgentConfig) -> EtcdMetadata | None:
    if config.metadata == "etcd":
        return EtcdMetadata(config.etcd_url, config.etcd_prefix, config.etcd_ttl_s)
    return None
