"""Transport registry: which transports this process can offer, built lazily so missing optional libraries
(CUDA, NIXL, Mooncake) never break import on a CPU-only machine."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdserve.kv.errors import TransportUnavailableError
from pdserve.kv.transports.base import Transport
from pdserve.kv.transports.tcp import TcpTransport

if TYPE_CHECKING:
    from pdserve.kv.context import TransportContext

log = logging.getLogger(__name__)


def build_transports(ctx: TransportContext) -> dict[str, Transport]:
    """tcp always; cuda_ipc when CUDA is usable; nixl when importable and allowed by the configuration; mooncake and
    nccl only when named (forced, or in extra_transports).

    A transport forced by configuration but unavailable is an error here, at construction, not at first transfer.
    """
    cfg = ctx.config
    want = cfg.transport
    out: dict[str, Transport] = {"tcp": TcpTransport(ctx)}
    if cfg.wants("cuda_ipc"):
        from pdserve.kv.transports.cuda_ipc import CudaIpcTransport

        if CudaIpcTransport.available():
            out["cuda_ipc"] = CudaIpcTransport(ctx)
        elif want == "cuda_ipc":
            raise TransportUnavailableError("transport cuda_ipc needs torch with CUDA and a visible GPU")
    if cfg.wants("nixl"):
        from pdserve.kv.transports.nixl import NixlTransport

        if NixlTransport.available():
            try:
                out["nixl"] = NixlTransport(ctx)
            except Exception as e:
                if want == "nixl":
                    raise TransportUnavailableError(f"cannot start a NIXL agent: {e}") from e
                log.warning("NIXL is importable but its agent failed to start: %s", e)
        elif want == "nixl":
            raise TransportUnavailableError("transport nixl needs the nixl (or nixl_cu13 / nixl_cu12) package")
    for name in ("mooncake", "nccl"):
        if cfg.wants(name):
            out[name] = _opt_in(name, ctx)
    return out


def _opt_in(name: str, ctx: TransportContext) -> Transport:
    """An opt-in transport, or TransportUnavailableError naming what to install or configure."""
    if name == "mooncake":
        from pdserve.kv.transports.mooncake import MooncakeTransport

        return MooncakeTransport(ctx)
    from pdserve.kv.transports.nccl import NcclTransport

    return NcclTransport(ctx)
