"""One streaming request against the scripted server: what is timed, what is counted, and failures as failures."""

import asyncio

import aiohttp
import pytest

from pdserve.bench.client import CHAT_ENDPOINT, EndpointConfig, RequestResult, send_request
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.loadgen import LoadConfig
from pdserve.bench.runner import Bench, WorkloadConfig
from pdserve.bench.tokenizer import load_tokenizer

from .fake_server import FakeServer, Script, prompt_tokens


def _send(url, req, endpoint="/v1/completions", tok=None, timeout=30.0, **cfg_kw):
    async def go():
        cfg = EndpointConfig(base_url=url, endpoint=endpoint, model="m", ignore_eos=True, request_timeout_s=timeout,
                             **cfg_kw)
        async with aiohttp.ClientSession() as s:
            return await send_request(s, cfg, req, RequestResult(index=0, request_id="req-0"), tok)

    return asyncio.run(go())


REQ = BenchRequest(prompt="t1 t2 t3", prompt_len=3, output_len=6)


def test_every_chunk_with_choices_is_timed_and_e2el_ends_at_the_last_token():
    """The first chunk has empty text (it still starts TTFT) and the usage chunk comes 200 ms after the last token
    (it does not end E2EL); the measured times follow the server's send times."""
    script = Script(ttft_s=0.05, itl_s=0.02, usage=True, usage_delay_s=0.2, empty_chunks=(0, 2))
    with FakeServer(script) as srv:
        r = _send(srv.url, REQ)
        (rec,) = srv.records
    assert r.success, r.error
    assert rec.body["stream"] is True and rec.body["stream_options"] == {"include_usage": True}
    assert rec.body["max_tokens"] == 6 and rec.body["ignore_eos"] is True and rec.body["prompt"] == REQ.prompt
    assert "temperature" not in rec.body and rec.request_id == "req-0"
    assert r.num_chunks == 6 and len(r.itl) == 5
    sent = [t - r.start for t in rec.chunk_times]
    assert r.ttft == pytest.approx(sent[0], abs=0.01)  # the empty first chunk
    assert r.latency == pytest.approx(sent[-1], abs=0.01) and r.latency < rec.usage_time - r.start - 0.15
    assert r.latency == pytest.approx(r.ttft + sum(r.itl), abs=1e-9)
    assert r.output_tokens == 6 == r.server_completion_tokens  # usage counts the empty-text tokens too
    assert r.server_prompt_tokens == prompt_tokens(3) == r.input_tokens
    assert r.generated_text == " t1 t3 t4 t5"


def test_chat_body_sampling_headers_and_multi_token_chunks():
    with FakeServer(Script(tokens_per_chunk=3)) as srv:
        r = _send(srv.url, REQ, endpoint=CHAT_ENDPOINT, sampling={"temperature": 0.0, "top_k": 5},
                  headers={"x-tenant": "a"}, api_key="sk-1")
        (rec,) = srv.records
    assert rec.body["messages"] == [{"role": "user", "content": REQ.prompt}]
    assert rec.body["max_completion_tokens"] == 6 and "max_tokens" not in rec.body
    assert rec.body["temperature"] == 0.0 and rec.body["top_k"] == 5
    assert rec.headers["x-tenant"] == "a" and rec.headers["Authorization"] == "Bearer sk-1"
    assert r.success and r.num_chunks == 2 and r.output_tokens == 6 and len(r.itl) == 1


def test_output_tokens_without_usage_come_from_the_tokenizer(word_tokenizer_dir):
    tok = load_tokenizer(str(word_tokenizer_dir))
    with FakeServer(Script(usage=False, tokens_per_chunk=2, empty_chunks=(1,))) as srv:
        r = _send(srv.url, REQ, tok=tok)
        r2 = _send(srv.url, REQ)
    # chunks " t0 t1", "", " t4 t5": the tokenizer counts 4 tokens of text (vLLM's rule without usage)
    assert r.success and r.server_completion_tokens is None and r.output_tokens == 4
    assert r.input_tokens == REQ.prompt_len  # no usage: the dataset's prompt length
    assert r2.success and r2.output_tokens == r2.num_chunks == 3  # no usage, no tokenizer: timed chunks


@pytest.mark.parametrize(
    "mode,kind",
    [("http_error", "http_500"), ("malformed", "malformed_sse"), ("no_done", "incomplete_stream"),
     ("error_event", "stream_error")],
)
def test_malformed_responses_and_errors_are_failures(mode, kind):
    with FakeServer(Script(mode=mode)) as srv:
        r = _send(srv.url, REQ)
    assert not r.success and r.error_kind == kind and r.error


def test_connection_refused_and_timeout_are_failures():
    with FakeServer() as srv:
        url = srv.url
    r = _send(url, REQ)  # the server is gone
    assert not r.success and r.error_kind == "connection"
    with FakeServer(Script(ttft_s=2.0)) as srv:
        r = _send(srv.url, REQ, timeout=0.3)
    assert not r.success and r.error_kind == "timeout"


def test_run_counts_server_errors_by_reason(word_tokenizer_dir):
    """Every 4th request answers 503: the run completes and reports them, with the message, as failures."""

    async def go(url):
        cfg = EndpointConfig(base_url=url, model="m")
        async with Bench(cfg, load_tokenizer(str(word_tokenizer_dir)), capacity_duration_s=0,
                         initial_test=False, num_warmups=2) as b:
            w = WorkloadConfig(num_prompts=20, random_input_len=8, random_output_len=4)
            return await b.run(w, LoadConfig(request_rate=200.0, progress=False, request_id_prefix="r-"))

    with FakeServer(Script(fail_every=4, fail_status=503)) as srv:
        run = asyncio.run(go(srv.url))
        records = srv.records
    m = run["metrics"]
    assert m["completed"] == 15 and m["failed"] == 5
    assert m["failure_reasons"]["http_503"]["count"] == 5 and "boom" in m["failure_reasons"]["http_503"]["example"]
    failed = [s for s in run["requests"] if not s["success"]]
    assert len(failed) == 5 and all(s["error_kind"] == "http_503" and s["index"] % 4 == 3 for s in failed)
    assert [r.request_id for r in records[:2]] == [None, None]  # the two warm-ups, before the run
    assert sorted(r.request_id for r in records[2:]) == sorted(f"r-{i}" for i in range(20))


def test_initial_test_failure_stops_with_the_reason(word_tokenizer_dir):
    from pdserve.bench.runner import BenchError

    async def go(url):
        async with Bench(EndpointConfig(base_url=url, model="m"), load_tokenizer(str(word_tokenizer_dir)),
                         capacity_duration_s=0) as b:
            await b.run(WorkloadConfig(num_prompts=3, random_input_len=4, random_output_len=2),
                        LoadConfig(progress=False))

    with FakeServer(Script(mode="http_error")) as srv, pytest.raises(BenchError, match="HTTP 500"):
        asyncio.run(go(srv.url))


def test_ready_check_retries_the_test_request_while_the_server_starts(word_tokenizer_dir):
    """vLLM's --ready-check-timeout-sec: the probe is repeated until it succeeds; without it the first failure stops."""
    from pdserve.bench.runner import BenchError

    async def go(url, timeout):
        async with Bench(EndpointConfig(base_url=url, model="m"), load_tokenizer(str(word_tokenizer_dir)),
                         capacity_duration_s=0, ready_check_timeout_s=timeout, ready_check_interval_s=0.05) as b:
            run = await b.run(WorkloadConfig(num_prompts=2, random_input_len=4, random_output_len=2),
                              LoadConfig(progress=False))
            return run["metrics"]["completed"]

    with FakeServer(Script(fail_first=3)) as srv:
        assert asyncio.run(go(srv.url, 5.0)) == 2
        assert [r.status for r in srv.records] == [503, 503, 503, 200, 200, 200]
    with FakeServer(Script(fail_first=3)) as srv, pytest.raises(BenchError, match="HTTP 503"):
        asyncio.run(go(srv.url, 0.0))


def test_model_name_and_root_from_v1_models():
    async def go(url):
        async with Bench(EndpointConfig(base_url=url), None, capacity_duration_s=0) as b:
            return b.endpoint.model, b.model_root

    with FakeServer() as srv:
        assert asyncio.run(go(srv.url)) == ("fake-model", "fake-root")
