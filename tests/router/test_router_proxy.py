"""Router end to end against fake instances: PD planning, pass-through formats, overload, failures, aborts."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.router.router_harness import Deployment, metric_value, run, wait_until

LONG = "The quick brown fox jumps over the lazy dog. " * 12  # ~540 chars, ~135 estimated tokens


def test_pd_request_carries_prefill_candidates_and_hides_timings():
    async def main():
        async with Deployment(prefill=2, decode=1, local_prefill_max_tokens=0) as d:
            status, _, body = await d.post("/v1/completions", {"prompt": LONG, "max_tokens": 3})
            assert status == 200, body
            assert body["choices"][0]["text"] == " t0 t1 t2"
            assert "pd_timings" not in body
            sent = d.decode[0].requests[0]
            assert sent["pd"]["request_id"].startswith("rt-")
            assert sorted(sent["pd"]["prefill_urls"]) == sorted(p.url for p in d.prefill)
            text = await d.metrics()
            assert metric_value(text, "pdserve:router_phase_seconds_count", 'mode="pd",phase="handover"') == 1
            assert metric_value(text, "pdserve:router_requests_total", 'mode="pd",outcome="ok"') == 1

    run(main())


def test_stream_drops_usage_unless_asked_and_always_strips_timings():
    async def main():
        async with Deployment(prefill=1, decode=1, local_prefill_max_tokens=0) as d:
            events = await d.stream("/v1/completions", {"prompt": LONG, "max_tokens": 4})
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert "".join(c["choices"][0]["text"] for c in chunks) == " t0 t1 t2 t3"
            assert all("usage" not in c and "pd_timings" not in c for c in chunks)
            upstream = d.decode[0].requests[0]
            assert upstream["stream_options"] == {"include_usage": True}

            events = await d.stream("/v1/completions", {"prompt": LONG, "max_tokens": 2,
                                                        "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]"
            usage_chunk = events[-2]
            assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2
            assert "pd_timings" not in usage_chunk
            text = await d.metrics()
            assert metric_value(text, "pdserve:router_phase_seconds_count", 'mode="pd",phase="prefill"') == 2
            assert metric_value(text, "pdserve:router_time_to_first_token_seconds_count") == 2

    run(main())


def test_chat_stream_passes_through():
    async def main():
        async with Deployment(prefill=1, decode=1, local_prefill_max_tokens=0) as d:
            events = await d.stream("/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": LONG}], "max_tokens": 3})
            assert events[-1] == "[DONE]"
            assert "".join(c["choices"][0]["delta"]["content"] for c in events[:-1]) == " t0 t1 t2"
            assert d.decode[0].paths == ["/v1/chat/completions"]
            assert "pd" in d.decode[0].requests[0]

    run(main())


def test_conditional_disaggregation_short_prompt_and_decode_prefix_hit():
    async def main():
        async with Deployment(prefill=1, decode=1, local_prefill_max_tokens=16) as d:
            await d.post("/v1/completions", {"prompt": "short", "max_tokens": 1})
            assert "pd" not in d.decode[0].requests[-1]  # short: prefilled on decode
            await d.post("/v1/completions", {"prompt": LONG, "max_tokens": 1})
            assert "pd" in d.decode[-1].requests[-1]  # long and new: disaggregated
            await d.post("/v1/completions", {"prompt": LONG + " and more", "max_tokens": 1})
            assert "pd" not in d.decode[0].requests[-1]  # the decode instance has the prefix: local
            text = await d.metrics()
            assert metric_value(text, "pdserve:router_local_prefill_total", 'reason="short"') == 2

    run(main())


def test_busy_or_missing_prefill_pool_means_local_prefill():
    async def main():
        async with Deployment(prefill=1, decode=1, local_prefill_max_tokens=0,
                              prefill_max_waiting_tokens=1000) as d:
            d.prefill[0].behavior.load = {"waiting_tokens": 5000}
            await asyncio.sleep(0.2)  # a few polls
            await d.post("/v1/completions", {"prompt": LONG, "max_tokens": 1})
            assert "pd" not in d.decode[0].requests[-1]
            assert metric_value(await d.metrics(), "pdserve:router_local_prefill_total",
                                'reason="prefill_busy"') == 1
        async with Deployment(prefill=0, decode=1, local_prefill_max_tokens=0) as d:
            status, _, _ = await d.post("/v1/completions", {"prompt": LONG, "max_tokens": 1})
            assert status == 200 and "pd" not in d.decode[0].requests[-1]

    run(main())


def test_deep_prefill_queue_still_disaggregates_by_default():
    """The shipped default has no waiting-token limit: a prefill instance with a deep queue still takes long
    prompts (prefilling them on the decode instance would stall the streams it is decoding)."""
    async def main():
        async with Deployment(prefill=1, decode=1, local_prefill_max_tokens=0) as d:
            d.prefill[0].behavior.load = {"waiting_tokens": 10**9}
            await asyncio.sleep(0.2)  # a few polls
            await d.post("/v1/completions", {"prompt": LONG, "max_tokens": 1})
            assert d.decode[0].requests[-1]["pd"]["prefill_urls"] == [d.prefill[0].url]
            assert metric_value(await d.metrics(), "pdserve:router_local_prefill_total", 'reason="prefill_busy"') == 0

    run(main())


def test_both_pool_is_colocated_round_robin():
    async def main():
        async with Deployment(decode=0, both=2, both_policy="round_robin") as d:
            for _ in range(4):
                status, _, _ = await d.post("/v1/completions", {"prompt": LONG, "max_tokens": 1})
                assert status == 200
            assert [len(f.requests) for f in d.both] == [2, 2]
            assert all("pd" not in r for f in d.both for r in f.requests)

    run(main())


def test_overload_answers_503_with_retry_after():
    async def main():
        async with Deployment(decode=1, max_inflight_per_instance=1, max_queue=0, retry_after_s=2) as d:
            d.decode[0].behavior.first_delay_s = 0.5
            first = asyncio.create_task(d.post("/v1/completions", {"prompt": "x", "max_tokens": 1}))
            await wait_until(lambda: d.decode[0].active == 1)
            status, headers, body = await d.post("/v1/completions", {"prompt": "y", "max_tokens": 1})
            assert status == 503 and headers["Retry-After"] == "2"
            assert body["error"]["code"] == 503 and body["error"]["message"]
            assert (await first)[0] == 200
            assert metric_value(await d.metrics(), "pdserve:router_rejected_total", 'reason="queue_full"') == 1

    run(main())


def test_queue_holds_requests_until_capacity_frees_and_times_out():
    async def main():
        async with Deployment(decode=1, max_inflight_per_instance=1, max_queue=8, queue_timeout_s=5) as d:
            d.decode[0].behavior.first_delay_s = 0.1
            results = await asyncio.gather(*(d.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
                                             for _ in range(4)))
            assert [r[0] for r in results] == [200] * 4
            assert d.decode[0].completed == 4
        async with Deployment(decode=1, max_inflight_per_instance=1, max_queue=8, queue_timeout_s=0.3) as d:
            d.decode[0].behavior.first_delay_s = 1.0
            first = asyncio.create_task(d.post("/v1/completions", {"prompt": "x", "max_tokens": 1}))
            await wait_until(lambda: d.decode[0].active == 1)
            t0 = time.monotonic()
            status, headers, _ = await d.post("/v1/completions", {"prompt": "y", "max_tokens": 1})
            assert status == 503 and "Retry-After" in headers
            assert 0.25 < time.monotonic() - t0 < 0.9
            assert (await first)[0] == 200

    run(main())


def test_decode_killed_mid_stream_errors_promptly_and_survivors_take_over():
    async def main():
        async with Deployment(decode=2, decode_policy="round_robin") as d:
            victim = d.decode[0]
            victim.behavior.token_delay_s = 0.2
            body = {"prompt": "x", "max_tokens": 50, "stream": True}
            async with d.client.post(d.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readuntil(b"\n\n")
                assert b" t0" in first
                await victim.kill()
                t0 = time.monotonic()
                rest = (await resp.read()).decode()
                elapsed = time.monotonic() - t0
            assert elapsed < 1.0
            assert '"type": "upstream_error"' in rest and rest.endswith("data: [DONE]\n\n")
            for _ in range(4):
                status, _, _ = await d.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
                assert status == 200
            assert len(d.decode[1].requests) == 4
            state = {i.url: i.breaker.state.value for i in d.router.pools}
            assert state[victim.url] == "open"

    run(main())


def test_decode_unreachable_before_response_is_retried_elsewhere():
    async def main():
        # slow polling, so the request (not the poller) discovers the dead instance
        async with Deployment(decode=2, decode_policy="round_robin", health_interval_s=30) as d:
            await d.decode[0].kill()
            for _ in range(3):
                status, _, body = await d.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert status == 200 and body["choices"][0]["text"] == " t0 t1"
            assert len(d.decode[1].requests) == 3
            assert metric_value(await d.metrics(), "pdserve:router_decode_retries_total") == 1

    run(main())


def test_decode_killed_during_nonstream_request_is_retried():
    async def main():
        async with Deployment(decode=2, decode_policy="round_robin", health_interval_s=30) as d:
            d.decode[0].behavior.first_delay_s = 5
            task = asyncio.create_task(d.post("/v1/completions", {"prompt": "x", "max_tokens": 2}))
            await wait_until(lambda: d.decode[0].active == 1)
            await d.decode[0].kill()
            status, _, body = await task
            assert status == 200 and body["choices"][0]["text"] == " t0 t1"

    run(main())


def test_all_decode_down_gives_503_not_silence():
    async def main():
        async with Deployment(decode=1) as d:
            await d.decode[0].kill()
            await wait_until(lambda: not d.router.admission.targets())
            status, headers, body = await d.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert status == 503 and "Retry-After" in headers and body["error"]["message"]
            async with d.client.get(d.url + "/health") as resp:
                assert resp.status == 503

    run(main())


def test_upstream_client_errors_pass_through():
    async def main():
        async with Deployment(decode=1) as d:
            d.decode[0].behavior.fail_status = 400
            status, _, body = await d.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert status == 400 and body["error"]["message"] == "fake failure"
            status, _, body = await d.post("/v1/chat/completions", {"messages": "nope"})
            assert status == 400 and body["error"]["type"] == "invalid_request_error"

    run(main())


def test_client_disconnect_closes_upstream_and_sends_aborts():
    async def main():
        async with Deployment(prefill=1, decode=1, local_prefill_max_tokens=0) as d:
            dec = d.decode[0]
            dec.behavior.token_delay_s = 0.1
            resp = await d.client.post(d.url + "/v1/completions",
                                       json={"prompt": LONG, "max_tokens": 100, "stream": True})
            await resp.content.readuntil(b"\n\n")
            resp.close()  # the client goes away mid-stream
            await wait_until(lambda: dec.disconnects == 1 and dec.active == 0)
            rid = dec.requests[0]["pd"]["request_id"]
            await wait_until(lambda: rid in dec.aborts and rid in d.prefill[0].aborts)
            await wait_until(lambda: all(i.inflight == 0 for i in d.router.pools))
            # non-streaming, disconnect while the instance is still working on it
            dec.behavior.first_delay_s = 5
            try:
                await d.client.post(d.url + "/v1/completions", json={"prompt": LONG, "max_tokens": 1},
                                    timeout=aiohttp.ClientTimeout(total=0.3))
            except asyncio.TimeoutError:
                pass
            await wait_until(lambda: dec.disconnects == 2 and dec.active == 0)
            text = await d.metrics()
            assert metric_value(text, "pdserve:router_requests_total", 'mode="pd",outcome="client_abort"') == 2

    run(main())


def test_health_polls_open_and_close_the_breaker():
    async def main():
        async with Deployment(decode=2, breaker_failures=2, breaker_cooldown_s=0.3) as d:
            sick = d.decode[1]
            sick.behavior.load_status = 500
            inst = d.router.pools.by_url[sick.url]
            await wait_until(lambda: inst.breaker.state.value == "open")
            for _ in range(3):
                await d.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert len(sick.requests) == 0
            healthy = metric_value(await d.metrics(), "pdserve:router_instance_healthy",
                                   f'role="decode",url="{sick.url}"')
            assert healthy == 0.0 and f'url="{sick.url}"' in await d.metrics()
            sick.behavior.load_status = 200
            await wait_until(lambda: inst.breaker.state.value == "closed", timeout=3)

    run(main())


def test_models_are_aggregated():
    async def main():
        async with Deployment(prefill=1, decode=2) as d:
            d.decode[1].model = "other-model"
            async with d.client.get(d.url + "/v1/models") as resp:
                data = await resp.json()
            assert sorted(m["id"] for m in data["data"]) == ["fake-model", "other-model"]
            async with d.client.get(d.url + "/health") as resp:
                assert resp.status == 200

    run(main())


def test_instance_whose_engine_died_is_taken_out_at_once():
    async def main():
        async with Deployment(decode=2, breaker_failures=100) as d:
            d.decode[1].behavior.load = {"engine_alive": False}
            inst = d.router.pools.by_url[d.decode[1].url]
            await wait_until(lambda: inst.breaker.state.value == "open")
            for _ in range(3):
                assert (await d.post("/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200
            assert len(d.decode[1].requests) == 0

    run(main())


def test_instances_answering_503_are_tried_in_turn_then_503_reaches_the_client():
    async def main():
        async with Deployment(decode=2, decode_policy="round_robin", max_decode_retries=1) as d:
            for fake in d.decode:
                fake.behavior.fail_status = 503
            status, headers, body = await d.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert status == 503 and "Retry-After" in headers and body["error"]["type"] == "overloaded"
            assert [len(f.requests) for f in d.decode] == [1, 1]  # each tried once
            d.decode[1].behavior.fail_status = None
            for _ in range(3):
                status, _, _ = await d.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
                assert status == 200  # d0 still full: retried on d1
            assert d.decode[1].completed == 3

    run(main())


def test_decode_dying_before_its_first_event_is_retried_unseen():
    async def main():
        async with Deployment(prefill=1, decode=2, decode_policy="round_robin", local_prefill_max_tokens=0) as d:
            d.decode[0].behavior.die_after_tokens = 0  # headers sent, then gone (e.g. died mid-handover)
            events = await d.stream("/v1/completions", {"prompt": LONG, "max_tokens": 3})
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " t0 t1 t2"
            assert len(d.decode[0].requests) == 1 and d.decode[1].completed == 1
            rid = d.decode[0].requests[0]["pd"]["request_id"]
            await wait_until(lambda: rid in d.prefill[0].aborts)  # the prefill side is told to drop it
            assert d.decode[1].requests[0]["pd"]["request_id"] != rid  # and that abort cannot hit the retry
            assert metric_value(await d.metrics(), "pdserve:router_decode_retries_total") == 1

    run(main())
