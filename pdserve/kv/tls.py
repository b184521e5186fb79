"""Optional TLS for control connections (across hosts): confidentiality of region tables and notifications on the
wire. Peer identity is proven by the secret handshake inside the TLS channel either way; with `tls_ca` set the
server's certificate is verified too, which also stops an active relay from reading control frames.

Data connections are not wrapped: their headers are authenticated (and, with `mac_payload`, their bytes), not
encrypted. Encrypt the network itself (IPsec, WireGuard, a private fabric) where KV bytes must stay confidential.
"""

from __future__ import annotations

import ssl

from pdserve.kv.config import AgentConfig


def server_context(cfg: AgentConfig) -> ssl.SSLContext | None:
    if not cfg.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return ctx


def client_context(cfg: AgentConfig) -> ssl.SSLContext | None:
    if not cfg.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cfg.tls_ca:
        ctx.load_verify_locations(cfg.tls_ca)
        ctx.check_hostname = cfg.tls_check_hostname
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
