"""Several choices per request (n > 1, batch prompts) against a scripted engine: one engine request per choice,
indexes in OpenAI's order, vLLM's child seeds, summed usage, one stream, every child cleaned up; the tokenizer
routes; admission by latency budget."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pdserve.engine.messages import ImportParams
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import QueueFull
from pdserve.server.admission import Admission
from pdserve.signing import sign_request
from tests.server.scripted_engine import ScriptedLLM
from tests.server.test_server_app import SECRET, expect_error, serve, sse_events, wait_until

pytestmark = pytest.mark.timeout(60)


def letter(seed: int | None, num_prompt_tokens: int) -> str:
    """What ChoiceLLM generates: a letter that names the seed and the prompt length the choice was run with."""
    return chr(ord("a") + ((seed or 0) + num_prompt_tokens) % 26)


class ChoiceLLM(ScriptedLLM):
    """Each engine request repeats letter(seed, prompt length) max_tokens times; calls are recorded."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls: list[tuple[str, int | None, int, dict | None]] = []
        self.refuse_after: int | None = None  # QueueFull for every request after this many

    async def generate(self, request_id, prompt_token_ids, sampling_params, kv=None):
        self.calls.append((request_id, sampling_params.seed, len(prompt_token_ids), kv))
        if self.refuse_after is not None and len(self.calls) > self.refuse_after:
            raise QueueFull(10, 10, retry_after_s=3)
        self.open.add(request_id)
        ch = letter(sampling_params.seed, len(prompt_token_ids))
        try:
            n = sampling_params.max_tokens
            for i in range(n):
                await asyncio.sleep(self.step_s)
                last = i == n - 1
                if last:
                    self.open.discard(request_id)
                yield RequestOutput(request_id, [ord(ch)], ch, finished=last, finish_reason="length" if last else None,
                                    num_prompt_tokens=len(prompt_token_ids), num_output_tokens=i + 1)
        finally:
            if request_id in self.open:
                self.open.discard(request_id)
                self.aborted.append(request_id)


def test_n_with_a_seed_gives_one_choice_per_child_seed():
    async def t(s, url, llm):
        body = {"prompt": "abc", "max_tokens": 2, "n": 3, "seed": 5}
        async with s.post(url + "/v1/completions", json=body) as r:
            out = await r.json()
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert [c["text"] for c in out["choices"]] == [letter(5 + i, 3) * 2 for i in range(3)]
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                "prompt_tokens_details": {"cached_tokens": 0}}
        rid = out["id"]
        assert [c[0] for c in llm.calls] == [f"{rid}-{k}" for k in range(3)]
        assert [c[1] for c in llm.calls] == [5, 6, 7]
        assert not llm.open

    serve(t, ChoiceLLM())


def test_batch_prompts_times_n_in_openai_order_with_echo():
    async def t(s, url, llm):
        body = {"prompt": ["ab", "abcd"], "max_tokens": 1, "n": 2, "seed": 0, "echo": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            out = await r.json()
        texts = [c["text"] for c in out["choices"]]
        assert texts == ["ab" + letter(0, 2), "ab" + letter(1, 2), "abcd" + letter(0, 4), "abcd" + letter(1, 4)]
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        assert out["usage"]["prompt_tokens"] == 6 and out["usage"]["completion_tokens"] == 4
        body = {"prompt": [[97, 98], [99]], "max_tokens": 1}
        async with s.post(url + "/v1/completions", json=body) as r:
            out = await r.json()
        assert [c["text"] for c in out["choices"]] == [letter(None, 2), letter(None, 1)]

    serve(t, ChoiceLLM())


def test_streamed_choices_are_interleaved_with_indexes_and_summed_usage():
    async def t(s, url, llm):
        body = {"prompt": ["ab", "abc"], "max_tokens": 3, "n": 2, "seed": 1, "stream": True,
                "stream_options": {"include_usage": True}}
        async with s.post(url + "/v1/completions", json=body) as r:
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        *chunks, usage = events[:-1]
        text: dict[int, str] = {}
        finishes: dict[int, int] = {}
        for c in chunks:
            (choice,) = c["choices"]
            text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
        assert text == {0: letter(1, 2) * 3, 1: letter(2, 2) * 3, 2: letter(1, 3) * 3, 3: letter(2, 3) * 3}
        assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}
        assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 5
        assert usage["usage"]["completion_tokens"] == 12
        msgs = [{"role": "user", "content": "hi"}]
        async with s.post(url + "/v1/chat/completions", json={"messages": msgs, "n": 2, "max_tokens": 1,
                                                               "stream": True}) as r:
            events = await sse_events(r)
        roles = [c["choices"][0]["index"] for c in events[:-1] if c["choices"][0]["delta"].get("role")]
        assert roles == [0, 1]
        async with s.post(url + "/v1/chat/completions", json={"messages": msgs, "n": 2, "max_tokens": 2}) as r:
            out = await r.json()
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert all(c["message"]["role"] == "assistant" and len(c["message"]["content"]) == 2 for c in out["choices"])

    serve(t, ChoiceLLM())


def test_each_choice_gets_its_own_signed_pd_order():
    async def t(s, url, llm):
        body = json.dumps({"prompt": "ab", "max_tokens": 1, "n": 2, "pd": {"prefill_urls": ["http://p:1"],
                                                                             "request_id": "rt-1"}}).encode()
        async with s.post(url + "/v1/completions", data=body,
                          headers=sign_request(SECRET.encode(), "POST", "/v1/completions", body)) as r:
            assert r.status == 200
        assert [c[3] for c in llm.calls] == [ImportParams(("http://p:1",), "rt-1-0"),
                                            ImportParams(("http://p:1",), "rt-1-1")]

    serve(t, ChoiceLLM(), secret=SECRET)


def test_a_refused_child_refuses_the_request_and_frees_the_others():
    async def t(s, url, llm):
        llm.refuse_after = 2
        async with s.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 50, "n": 4}) as r:
            assert (await expect_error(r, 503))["code"] == "queue_full"
            assert r.headers["Retry-After"] == "3"
        await wait_until(lambda: not llm.open)
        assert len(llm.aborted) == 2

    serve(t, ChoiceLLM(step_s=0.01))


def test_client_disconnect_aborts_every_choice():
    async def t(s, url, llm):
        r = await s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 120, "n": 3, "stream": True})
        await r.content.readuntil(b"\n\n")
        assert len(llm.open) == 3
        r.close()
        await wait_until(lambda: not llm.open)
        assert len(llm.aborted) == 3

    serve(t, ChoiceLLM(step_s=0.01))


def test_tokenize_and_detokenize():
    async def t(s, url, llm):
        async with s.post(url + "/tokenize", json={"prompt": "héllo", "model": "scripted", "extra": 1}) as r:
            out = await r.json()
        ids = list("héllo".encode())
        assert out == {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids, "token_strs": None}
        msgs = [{"role": "user", "content": "hi"}]
        async with s.post(url + "/tokenize", json={"messages": msgs}) as r:
            assert (await r.json())["tokens"] == llm.tokenizer.encode_chat(msgs)
        async with s.post(url + "/detokenize", json={"tokens": ids}) as r:
            assert await r.json() == {"prompt": "héllo"}
        async with s.post(url + "/detokenize", json={"tokens": [1, 256]}) as r:
            assert (await expect_error(r, 400))["param"] == "tokens"
        async with s.post(url + "/tokenize", json={"prompt": "x", "model": "other"}) as r:
            await expect_error(r, 404)

    serve(t)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_admission_estimates_the_wait_from_the_queue_and_its_drain_rate():
    clock = Clock()
    queue = [0]
    a = Admission(budget_s=10.0, clock=clock, waiting=lambda: queue[0])
    a.check(1000)  # nothing queued in the engine: everything joins the next step
    assert a.start_deadline_s(100) == 20.0  # no prefill measured yet: the budget again for its own prefill
    for i in range(8):
        a.admitted(f"r{i}")
    for i in range(4):  # free slots: four start together, which says nothing about a queue's drain rate
        a.started(f"r{i}", 100, SimpleNamespace(first_scheduled_time=1000.0, first_token_time=1000.5))
    assert a.start_rate() is None and a.typical_prefill_s() == pytest.approx(0.5)
    queue[0] = 4
    a.admitted("q")
    for i in range(4, 8):  # a full batch: one leaves the queue every 2 s
        clock.t += 2.0
        a.started(f"r{i}", 100)
    assert a.start_rate() == pytest.approx(0.5)
    queue[0] = 4
    assert a.estimate_wait() == pytest.approx(10.0)  # behind 4 queued, leaving at 0.5 per second
    a.check(1)
    with pytest.raises(Exception) as info:
        a.check(2)  # 12 s
    assert info.value.status == 503 and info.value.headers["Retry-After"] == "2"
    assert a.start_deadline_s(400) == pytest.approx(10.0 + 2 * 0.5 * 4)  # budget + twice a 4x longer prefill
    queue[0] = 0
    assert a.estimate_wait() < 10.0
    a.done("q")


def test_admission_refuses_when_the_oldest_waiter_is_over_budget():
    clock = Clock()
    a = Admission(budget_s=5.0, clock=clock)
    a.admitted("stuck")
    clock.t += 4.0
    a.check()
    clock.t += 2.0
    with pytest.raises(Exception) as info:
        a.check()
    assert info.value.code == "over_budget"
    a.done("stuck")
    a.check()
    Admission(budget_s=0, waiting=lambda: 10**6).check(10**6)  # off


def test_a_request_that_cannot_start_in_time_gets_503_and_is_freed():
    async def t(s, url, llm):
        llm.mode = "stall"
        async with s.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            err = await expect_error(r, 503)
            assert err["code"] == "queue_timeout"
            assert "within 0.40 s (the server's 0.2 s budget plus 0.20 s for its own prefill)" in err["message"], err
            assert int(r.headers["Retry-After"]) >= 1
        assert not llm.open
        async with s.get(url + "/load") as r:
            load = await r.json()
        assert load["num_pending"] == 0 and load["max_queue_wait_s"] == 0.2

    serve(t, max_queue_wait_s=0.2)  # nothing measured yet: it may wait 0.2 s plus 0.2 s for its own prefill
