"""Access control and hostile bodies against the instance app (scripted engine): API keys, request signatures,
strict JSON, encodings, size and time limits, and OpenAI-shaped errors for every status."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket

import pytest
from aiohttp import web

from pdserve.server.auth import APIKeys
from pdserve.signing import NonceCache, sign_request, verify_request
from tests.server.test_server_app import expect_error, serve

pytestmark = pytest.mark.timeout(60)

KEY = "sk-test-key"


def test_api_key_guards_v1_and_tokenizer_routes_only():
    async def t(s, url, llm):
        for method, path, body in [("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                                   ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "x"}),
                                   ("POST", "/detokenize", {"tokens": [97]}), ("POST", "/v1/nothing", {})]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                async with s.request(method, url + path, json=body, headers=headers) as r:
                    err = await expect_error(r, 401)
                    assert err["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
        ok = {"Authorization": f"Bearer {KEY}"}
        async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=ok) as r:
            assert r.status == 200
        async with s.post(url + "/tokenize", json={"prompt": "x"}, headers={"Authorization": "bearer other"}) as r:
            assert r.status == 200  # any of the configured keys; the scheme is case-insensitive
        for path in ("/health", "/metrics", "/version", "/load"):
            async with s.get(url + path) as r:
                assert r.status == 200, path
        async with s.get(url + "/nothing") as r:  # not a guarded path: an ordinary 404
            await expect_error(r, 404)

    serve(t, api_keys=[KEY, "other"])


def test_api_key_comparison():
    keys = APIKeys(["a", "bb"])
    assert keys.verify("Bearer a") and keys.verify("bearer bb") and keys.verify("Bearer  a ")
    assert not keys.verify("Bearer ab") and not keys.verify("Bearer") and not keys.verify(None)
    assert not keys.verify("Token a") and not keys.verify("Bearer \ud800")
    assert not APIKeys([])


class FakeRequest:
    def __init__(self, headers: dict, method: str = "POST", raw_path: str = "/x"):
        self.headers, self.method, self.raw_path = headers, method, raw_path


def test_signature_freshness_replay_and_tampering(monkeypatch):
    secret = b"0123456789abcdef0123"
    body = b'{"a": 1}'
    cache = NonceCache(max_entries=2)
    headers = sign_request(secret, "POST", "/x", body)
    verify_request(secret, FakeRequest(headers), body, cache=cache)

    def code(req, data=body, key=secret):
        with pytest.raises(web.HTTPException) as info:
            verify_request(key, req, data, cache=cache)
        return info.value.status, json.loads(info.value.text)["error"]["code"]

    assert code(FakeRequest(headers)) == (401, "replayed_signature")
    fresh = sign_request(secret, "POST", "/x", body)
    assert code(FakeRequest(fresh), b'{"a": 2}') == (401, "invalid_signature")
    assert code(FakeRequest(fresh, raw_path="/y")) == (401, "invalid_signature")
    assert code(FakeRequest(fresh, method="PUT")) == (401, "invalid_signature")
    assert code(FakeRequest(fresh), key=b"another secret of 16+") == (401, "invalid_signature")
    assert code(FakeRequest({})) == (401, "missing_signature")
    assert code(FakeRequest(fresh), key=None) == (401, "no_deployment_secret")
    old = dict(fresh, **{"X-PD-Timestamp": str(int(fresh["X-PD-Timestamp"]) - 31)})
    assert code(FakeRequest(old)) == (401, "stale_signature")
    verify_request(secret, FakeRequest(sign_request(secret, "POST", "/x", body)), body, cache=cache)
    assert code(FakeRequest(sign_request(secret, "POST", "/x", body))) == (503, "replay_cache_full")


def test_strict_json_bodies():
    async def t(s, url, llm):
        post = url + "/v1/completions"
        cases = {
            b'{"prompt": "x", "temperature": NaN}': "NaN",
            b'{"prompt": "x", "temperature": Infinity}': "Infinity",
            b'{"prompt": "x", "temperature": 1e999}': "out of range",
            b'{"prompt": "\\ud800x"}': "surrogate",
            b'{"prompt": "x", "stop": ["\\udfff"]}': "surrogate",
            b'{"\\ud83d": 1, "prompt": "x"}': "surrogate",
            b"[" * 5000 + b"]" * 5000: "nests deeper",
            b'{"prompt": "x", "a": ' + b"[" * 65 + b"]" * 65 + b"}": "nests deeper",
            b'{"prompt": "\xff"}': "UTF-8",
            b"\xef\xbb\xbf{}": "not valid JSON",
            b'{"prompt": "x"': "not valid JSON",
            b"   ": "empty",
        }
        for raw, words in cases.items():
            async with s.post(post, data=raw, headers={"Content-Type": "application/json"}) as r:
                assert words in (await expect_error(r, 400))["message"], raw[:40]
        ok = json.dumps({"prompt": "\U0001f600 ok", "max_tokens": 1, "a": [[[[1]]]]}).encode()  # a valid pair
        async with s.post(post, data=ok) as r:
            assert r.status == 200

    serve(t)


def test_encodings_sizes_and_methods():
    async def t(s, url, llm):
        post = url + "/v1/completions"
        body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        async with s.post(post, data=gzip.compress(body), headers={"Content-Encoding": "gzip"}) as r:
            assert r.status == 200
        for enc in ("bogus", "br, gzip", "zstd", "br", "gzip, gzip"):
            async with s.post(post, data=body, headers={"Content-Encoding": enc}) as r:
                assert (await expect_error(r, 415))["code"] == "unsupported_content_encoding"
        async with s.post(post, data=body, headers={"Content-Encoding": "gzip"}) as r:  # not actually gzip
            assert "could not be read" in (await expect_error(r, 400))["message"]
        big = json.dumps({"prompt": "x" * 5000}).encode()
        async with s.post(post, data=big) as r:
            assert (await expect_error(r, 413))["code"] == "request_too_large"
        async with s.post(post, data=gzip.compress(big), headers={"Content-Encoding": "gzip"}) as r:  # decoded size
            assert (await expect_error(r, 413))["code"] == "request_too_large"
        for method in ("GET", "PUT", "DELETE"):
            async with s.request(method, post) as r:
                await expect_error(r, 405)
                assert "POST" in r.headers["Allow"]
        async with s.post(url + "/v2/completions", data=body) as r:
            await expect_error(r, 404)

    serve(t, max_request_bytes=4096)


def test_slow_body_gets_408_and_connection_close():
    async def t(s, url, llm):
        host, port = url.removeprefix("http://").split(":")
        loop = asyncio.get_running_loop()
        sock = socket.create_connection((host, int(port)))
        sock.setblocking(False)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\":")
        await loop.sock_sendall(sock, head)
        data = b""
        while not data.endswith(b"}}"):  # the server answers at once (it closes the socket after lingering)
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            assert chunk, data
            data += chunk
        sock.close()
        status_line, _, rest = data.partition(b"\r\n")
        assert b" 408 " in status_line, data[:200]
        assert b"Connection: close" in rest and b'"request_timeout"' in rest

    serve(t, body_read_timeout_s=0.5)


def test_prompt_longer_than_the_context_can_hold_is_refused_untokenized():
    async def t(s, url, llm):
        llm.tokenizer.delay_s = 30.0  # any tokenization would hang the test past its timeout
        limit = llm.max_model_len * llm.tokenizer.max_token_chars
        for path, body in [("/v1/completions", {"prompt": "x" * (limit + 1)}),
                           ("/v1/completions", {"prompt": ["ok", "y" * (limit + 1)]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * (limit + 1)}]}),
                           ("/tokenize", {"prompt": "w" * (limit + 1)})]:
            async with s.post(url + path, json=body) as r:
                err = await expect_error(r, 400)
            assert err["code"] == "context_length_exceeded" and str(limit + 1) in err["message"], path

    serve(t)


def test_tokenization_that_does_not_finish_in_time_gets_503():
    async def t(s, url, llm):
        llm.tokenizer.delay_s = 1.0  # past the 0.3 s timeout (the run then waits for it, as asyncio.run ends)
        async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
            assert (await expect_error(r, 503))["code"] == "timeout"
            assert r.headers["Retry-After"] == "1"
        assert not llm.open

    serve(t, timeout_s=0.3)
