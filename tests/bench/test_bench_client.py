"""Streaming requests against a controllable endpoint: timings, usage, and every failure mode as a failure."""

import asyncio

import aiohttp
import pytest

from pdserve.bench.client import CHAT_ENDPOINT, EndpointConfig, RequestResult, send_request
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.loadgen import LoadConfig
from pdserve.bench.runner import Bench, WorkloadConfig
from pdserve.bench.tokenizer import load_tokenizer

from .fake_server import Behaviour, FakeServer


def _send(url, req, endpoint="/v1/completions", tok=None, timeout=30.0):
    async def go():
        cfg = EndpointConfig(base_url=url, endpoint=endpoint, model="m", ignore_eos=True, request_timeout_s=timeout)
        async with aiohttp.ClientSession() as s:
            return await send_request(s, cfg, req, RequestResult(index=0), tok)

    return asyncio.run(go())


REQ = BenchRequest(prompt="t1 t2 t3", prompt_len=3, output_len=6)


def test_stream_timings_and_usage():
    with FakeServer(Behaviour(ttft_s=0.05, tpot_s=0.01)) as srv:
        r = _send(srv.url, REQ)
        body = srv.behaviour.bodies[0]
    assert r.success, r.error
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 6 and body["ignore_eos"] is True and body["prompt"] == REQ.prompt
    assert r.ttft >= 0.05 and len(r.itl) == 5 and sum(r.itl) >= 0.04  # 5 gaps of >= 10 ms, first may shrink
    assert r.output_tokens == 6 and r.server_completion_tokens == 6 and r.server_prompt_tokens == 3
    assert r.latency == pytest.approx(r.ttft + sum(r.itl), abs=0.02)
    assert r.generated_text == "".join(f" t{i}" for i in range(6))


def test_chat_endpoint_and_multi_token_chunks():
    with FakeServer(Behaviour(tokens_per_chunk=3)) as srv:
        r = _send(srv.url, REQ, endpoint=CHAT_ENDPOINT)
        body = srv.behaviour.bodies[0]
    assert body["messages"] == [{"role": "user", "content": REQ.prompt}]
    assert r.success and r.num_chunks == 2 and r.output_tokens == 6 and len(r.itl) == 1


def test_output_tokens_fall_back_to_the_tokenizer(word_tokenizer_dir):
    tok = load_tokenizer(str(word_tokenizer_dir))
    with FakeServer(Behaviour(report_usage=False, tokens_per_chunk=2)) as srv:
        r = _send(srv.url, REQ, tok=tok)
        r2 = _send(srv.url, REQ)
    assert r.success and r.server_completion_tokens is None and r.output_tokens == 6
    assert r2.success and r2.output_tokens == r2.num_chunks == 3  # no usage, no tokenizer: count chunks


@pytest.mark.parametrize(
    "mode,kind",
    [("http_500", "http_500"), ("malformed", "malformed_sse"), ("no_done", "incomplete_stream"),
     ("error_event", "stream_error")],
)
def test_malformed_responses_and_errors_are_failures(mode, kind):
    with FakeServer(Behaviour(mode=mode)) as srv:
        r = _send(srv.url, REQ)
    assert not r.success and r.error_kind == kind and r.error


def test_connection_refused_and_timeout_are_failures():
    with FakeServer() as srv:
        url = srv.url
    r = _send(url, REQ)  # the server is gone
    assert not r.success and r.error_kind == "connection"
    with FakeServer(Behaviour(ttft_s=2.0)) as srv:
        r = _send(srv.url, REQ, timeout=0.3)
    assert not r.success and r.error_kind == "timeout"


def test_run_counts_server_errors_by_reason(word_tokenizer_dir):
    """Every 4th request answers 503: the run completes and reports them, with the message, as failures."""

    async def go(url):
        cfg = EndpointConfig(base_url=url, model="m")
        async with Bench(cfg, load_tokenizer(str(word_tokenizer_dir)), capacity_duration_s=0,
                         initial_test=False) as b:
            w = WorkloadConfig(num_prompts=20, random_input_len=8, random_output_len=4)
            return await b.run(w, LoadConfig(request_rate=200.0, progress=False))

    with FakeServer(Behaviour(mode="fail_every", fail_every=4)) as srv:
        run = asyncio.run(go(srv.url))
    m = run["metrics"]
    assert m["completed"] == 15 and m["failed"] == 5
    assert m["failure_reasons"]["http_503"]["count"] == 5 and "boom" in m["failure_reasons"]["http_503"]["example"]
    failed = [s for s in run["requests"] if not s["success"]]
    assert len(failed) == 5 and all(s["error_kind"] == "http_503" for s in failed)


def test_initial_test_failure_stops_with_the_reason(word_tokenizer_dir):
    from pdserve.bench.runner import BenchError

    async def go(url):
        async with Bench(EndpointConfig(base_url=url, model="m"), load_tokenizer(str(word_tokenizer_dir)),
                         capacity_duration_s=0) as b:
            await b.run(WorkloadConfig(num_prompts=3, random_input_len=4, random_output_len=2),
                        LoadConfig(progress=False))

    with FakeServer(Behaviour(mode="http_500")) as srv, pytest.raises(BenchError, match="HTTP 500"):
        asyncio.run(go(srv.url))


def test_model_name_from_v1_models(word_tokenizer_dir):
    async def go(url):
        async with Bench(EndpointConfig(base_url=url), None, capacity_duration_s=0) as b:
            return b.endpoint.model

    with FakeServer() as srv:
        assert asyncio.run(go(srv.url)) == "fake-model"
