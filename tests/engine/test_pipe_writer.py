"""The writer thread between the server's event loop and the engine process (pdserve.engine.pipe_writer)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time

import pytest

from pdserve.engine.messages import AddRequest
from pdserve.engine.pipe_writer import PipeWriter
from pdserve.sampling_params import SamplingParams


def _request(i: int) -> AddRequest:
    return AddRequest(f"r{i}", list(range(i, i + 1024)), SamplingParams(max_tokens=8), None)


def test_put_never_waits_for_a_reader_and_keeps_the_order():
    """A burst of requests much larger than the pipe's buffer is queued at once while nobody reads (the engine
    is in a long step); the engine then reads every one, in order, as Connection.recv gets them."""
    ours, engines = mp.Pipe(duplex=True)
    errors = []
    w = PipeWriter(ours, errors.append)
    msgs = [_request(i) for i in range(300)]  # ~1.5 MB: the pipe holds 64 KiB
    t = time.monotonic()
    for m in msgs:
        w.put(m)
    assert time.monotonic() - t < 1.0
    time.sleep(0.2)  # the writer is blocked on the full pipe now; the caller was not
    got = [engines.recv() for _ in msgs]
    assert [(g.request_id, g.prompt_token_ids) for g in got] == [(m.request_id, m.prompt_token_ids) for m in msgs]
    assert w.close(5.0) and not errors and not w.failed


def test_a_message_that_cannot_be_pickled_raises_to_its_caller():
    ours, engines = mp.Pipe(duplex=True)
    w = PipeWriter(ours, lambda e: None)
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        w.put(threading.Lock())
    w.put(_request(1))  # the next message still goes
    assert engines.recv().request_id == "r1"
    assert w.close(5.0)


def test_a_broken_pipe_is_reported_once_and_what_follows_is_dropped():
    ours, engines = mp.Pipe(duplex=True)
    errors = []
    reported = threading.Event()
    w = PipeWriter(ours, lambda e: (errors.append(e), reported.set()))
    engines.close()  # the engine process is gone
    for i in range(3):
        w.put(_request(i))
    assert reported.wait(5.0)
    assert w.close(5.0)
    assert len(errors) == 1 and isinstance(errors[0], OSError) and w.failed


def test_close_gives_up_after_its_timeout_when_nobody_reads():
    ours, engines = mp.Pipe(duplex=True)
    w = PipeWriter(ours, lambda e: None)
    for i in range(100):  # more than the pipe holds: the thread blocks in the write
        w.put(_request(i))
    t = time.monotonic()
    assert w.close(0.3) is False
    assert time.monotonic() - t < 2.0
    engines.close()  # the blocked write fails now; the daemon thread ends


def test_the_engine_client_queues_requests_without_touching_the_pipe():
    """AsyncLLM._send goes through its writer: a burst of adds returns at once though the engine reads nothing."""
    from pdserve.config import EngineConfig
    from pdserve.engine.async_llm import AsyncLLM

    llm = AsyncLLM(EngineConfig(model="qwen3-0.6b", device="cpu"))
    ours, engines = mp.Pipe(duplex=True)
    llm._writer = PipeWriter(ours, lambda e: None)
    t = time.monotonic()
    for i in range(300):
        llm._send(_request(i))
    assert time.monotonic() - t < 1.0
    assert [engines.recv().request_id for _ in range(300)] == [f"r{i}" for i in range(300)]
    assert llm._writer.close(5.0)
