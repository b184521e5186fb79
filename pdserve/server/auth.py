"""API keys for clients (the deployment's own processes sign their internal requests instead: pdserve.signing).

API keys (`--api-key`, PDSERVE_API_KEY) guard every /v1/* route and /tokenize, /detokenize, as vLLM guards /v1:
a request without `Authorization: Bearer <key>` gets 401 in OpenAI's error shape. /health, /metrics, /version and
/load stay open (load balancers and Prometheus poll them). Keys are compared as SHA-256 digests with
hmac.compare_digest against every configured key, so neither the comparison nor the key count leaks timing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable

from aiohttp import web

from pdserve.signing import http_error

log = logging.getLogger("pdserve.server")

OPEN_PATHS = ("/health", "/metrics", "/version", "/load")


# ----------------------------------------------------------------------------------------------------------------
# API keys


def is_protected(path: str) -> bool:
    """The paths an API key guards: /v1/* (as vLLM), /tokenize and /detokenize."""
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize")


class APIKeys:
    """Constant-time check of a bearer token against the configured keys."""

    def __init__(self, keys: Iterable[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def verify(self, authorization: str | None) -> bool:
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).digest()
        ok = False
        for d in self._digests:  # every key is compared: no early exit
            ok |= hmac.compare_digest(digest, d)
        return ok


def api_key_middleware(keys: Iterable[str], protected: Callable[[str], bool] = is_protected):
    """aiohttp middleware answering 401 (OpenAI's shape, WWW-Authenticate: Bearer) to protected paths without a
    valid `Authorization: Bearer <key>`. OPTIONS passes (CORS preflight), as in vLLM."""
    checker = APIKeys(keys)

    @web.middleware
    async def middleware(request: web.Request, handler):
        if checker and request.method != "OPTIONS" and protected(request.path):
            if not checker.verify(request.headers.get("Authorization")):
                raise http_error(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                             "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
