"""Signed internal HTTP between the processes of one deployment, with the deployment secret (pdserve.secret).

The router's `pd` orders and aborts to instances and a decode instance's prefill orders and aborts to a prefill
instance carry three headers from `sign_request` (timestamp, nonce, HMAC-SHA256 over method, path, timestamp, nonce
and the body's SHA-256); `verify_request` checks freshness, the MAC (constant time) and that the nonce was not seen
before (a bounded replay cache), and raises 401 with an OpenAI-shaped body otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

from pdserve.protocol import error_body

TIMESTAMP_HEADER = "X-PD-Timestamp"
NONCE_HEADER = "X-PD-Nonce"
SIGNATURE_HEADER = "X-PD-Signature"
SIGNATURE_HEADERS = (TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)
FRESHNESS_S = 30.0  # a signed request older (or further in the future) than this is refused
NONCE_CACHE_ENTRIES = 1 << 18  # nonces remembered for replay checks; each expires after the freshness window


def http_error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> web.HTTPException:
    body = error_body(message, "invalid_request_error" if status < 500 else "server_error", None, code)
    cls = {401: web.HTTPUnauthorized, 503: web.HTTPServiceUnavailable}[status]
    return cls(text=json.dumps(body), content_type="application/json", headers=headers)


def _mac(secret: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    msg = "\n".join((method.upper(), path, timestamp, nonce, hashlib.sha256(body).hexdigest())).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign_request(secret: bytes, method: str, path: str, body: bytes) -> dict[str, str]:
    """Headers that authenticate one request (`path` as the server will see it, query string included)."""
    timestamp = str(int(time.time()))
    nonce = secrets.token_hex(16)
    return {TIMESTAMP_HEADER: timestamp, NONCE_HEADER: nonce,
            SIGNATURE_HEADER: _mac(secret, method, path, timestamp, nonce, body)}


class NonceCache:
    """Nonces seen within the freshness window. Bounded: when full of unexpired nonces, new signed requests are
    refused (503) rather than forgetting a nonce early, which would reopen it to replay."""

    def __init__(self, max_entries: int = NONCE_CACHE_ENTRIES, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> expiry (monotonic), oldest first

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, nonce: str, ttl_s: float) -> bool:
        """Remember `nonce`; False if it was already seen. Raises 503 when full."""
        now = self.clock()
        while self._seen:
            oldest, expiry = next(iter(self._seen.items()))
            if expiry > now:
                break
            del self._seen[oldest]
        if nonce in self._seen:
            return False
        if len(self._seen) >= self.max_entries:
            raise http_error(503, "too many signed requests within the freshness window; retry shortly",
                         "replay_cache_full", {"Retry-After": "1"})
        self._seen[nonce] = now + ttl_s
        return True


_DEFAULT_CACHE = NonceCache()


def is_signed(request: web.Request) -> bool:
    return any(h in request.headers for h in SIGNATURE_HEADERS)


def verify_request(secret: bytes | None, request: web.Request, body: bytes, *, window_s: float = FRESHNESS_S,
                   cache: NonceCache | None = None) -> None:
    """Raise 401 (OpenAI-shaped JSON) unless `request` carries a fresh, valid, unreplayed signature over `body`
    made with `secret`. With no secret configured nothing can be verified, so everything is refused."""
    if secret is None:
        raise http_error(401, "this instance has no deployment secret (PDSERVE_DEPLOYMENT_SECRET or "
                          "--deployment-secret-file), so it accepts no internal requests", "no_deployment_secret")
    timestamp = request.headers.get(TIMESTAMP_HEADER, "")
    nonce = request.headers.get(NONCE_HEADER, "")
    signature = request.headers.get(SIGNATURE_HEADER, "")
    if not (timestamp and nonce and signature):
        raise http_error(401, "this request must be signed with the deployment secret", "missing_signature")
    try:
        age = time.time() - int(timestamp)
    except ValueError:
        raise http_error(401, "the request signature's timestamp is not an integer", "invalid_signature") from None
    if abs(age) > window_s:
        raise http_error(401, f"the request signature is {age:.0f} s old (the window is {window_s:g} s); "
                          "check the clocks of the deployment's hosts", "stale_signature")
    if len(nonce) > 64:
        raise http_error(401, "the request signature's nonce is too long", "invalid_signature")
    expected = _mac(secret, request.method, request.raw_path, timestamp, nonce, body)
    if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
        raise http_error(401, "the request signature does not match (wrong deployment secret, or the request was "
                          "altered)", "invalid_signature")
    if not (cache if cache is not None else _DEFAULT_CACHE).add(nonce, 2 * window_s):
        raise http_error(401, "this signed request was already received (replay)", "replayed_signature")


def check_pd_field(secret: bytes | None, request: web.Request, body: bytes, pd: object) -> None:
    """The rule for the `pd` field of a generate request: honoured only in a request signed with the deployment
    secret (the router signs what it sends with `pd`). Unsigned (or with no secret configured): 401, never a
    silent drop, so a misconfigured deployment fails visibly instead of quietly prefilling locally."""
    if pd is not None:
        verify_request(secret, request, body)
