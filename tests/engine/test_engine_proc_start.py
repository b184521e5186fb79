"""The engine process's start handshake (pdserve/engine/engine_proc.py): the server's tokenizer ids come first, while
the engine builds its model; anything else, or nothing within the limit, fails the start with a clear error."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from pdserve.engine import engine_proc
from pdserve.engine.messages import Shutdown, TokenizerIds


def test_the_tokenizer_ids_are_taken_from_the_first_message():
    a, b = mp.Pipe(duplex=True)
    a.send(TokenizerIds(frozenset({1, 106})))
    assert engine_proc._await_tokenizer_ids(b) == frozenset({1, 106})


def test_another_first_message_or_none_fails_the_start(monkeypatch):
    a, b = mp.Pipe(duplex=True)
    a.send(Shutdown())
    with pytest.raises(RuntimeError, match="tokenizer's ids first"):
        engine_proc._await_tokenizer_ids(b)
    monkeypatch.setattr(engine_proc, "TOKENIZER_IDS_TIMEOUT_S", 0.05)
    with pytest.raises(TimeoutError, match="no tokenizer ids"):
        engine_proc._await_tokenizer_ids(b)


def test_eos_ids_that_arrive_later_end_requests(tiny_model_dirs):
    from pdserve.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore
    from pdserve.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=str(tiny_model_dirs["qwen3"]), device="cpu", dtype="float32",
                                   num_gpu_blocks=32, block_size=4, max_model_len=64, max_num_batched_tokens=32))
    try:
        core.add_request("probe", [3, 1, 4], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        first = []
        while core.has_work():
            for o in core.step():
                first += o.new_token_ids
        core.set_tokenizer_eos({first[0]})  # the greedy first token is now an end of sequence
        core.add_request("ends", [3, 1, 4], SamplingParams(max_tokens=3, temperature=0.0))
        out = []
        while core.has_work():
            for o in core.step():
                out += o.new_token_ids
                finish = o.finish_reason
        assert out == first[:1] and finish == "stop"
    finally:
        core.close()


def test_an_engine_that_fails_to_build_is_reported_by_the_server_side(tiny_model_dirs):
    """The engine fails while the server still loads the tokenizer: the start fails with the engine's reason."""
    import asyncio

    from pdserve.config import EngineConfig
    from pdserve.engine.async_llm import AsyncLLM
    from pdserve.model.dummy_tokenizer import tokenizer_path_for
    from pdserve.model.loader import resolve_model

    tok = tokenizer_path_for(resolve_model("qwen3-0.6b"))  # the tiny checkpoint has none: a word-level one
    llm = AsyncLLM(EngineConfig(model=str(tiny_model_dirs["qwen3"]), tokenizer=tok, device="cpu", dtype="float32",
                                num_gpu_blocks=32, block_size=4, max_model_len=10**9))

    async def go():
        try:
            await llm.start()
        finally:
            await llm.shutdown()

    with pytest.raises(RuntimeError, match="the engine failed to start: .*max_model_len"):
        asyncio.run(go())
