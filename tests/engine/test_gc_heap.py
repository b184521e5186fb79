"""A serving process's start-up heap frozen out of the collector's scans (pdserve/gc_heap.py): on by default in the
engine process, off with PDSERVE_GC_FREEZE=0, never in a process that only uses pdserve as a library."""

from __future__ import annotations

import asyncio
import gc

from pdserve.gc_heap import freeze_startup_heap


def test_off_leaves_the_collector_as_it_was(monkeypatch):
    monkeypatch.setenv("PDSERVE_GC_FREEZE", "0")
    before = gc.get_freeze_count()
    assert freeze_startup_heap("test") == 0
    assert gc.get_freeze_count() == before


def test_on_freezes_what_survives_a_collection(monkeypatch):
    monkeypatch.delenv("PDSERVE_GC_FREEZE", raising=False)
    keep = [[i] for i in range(1000)]  # tracked objects that survive the collection
    try:
        n = freeze_startup_heap("test")
        assert n == gc.get_freeze_count() and n >= len(keep)
    finally:
        gc.unfreeze()  # the test process's heap goes back to the collector
    assert gc.get_freeze_count() == 0


def test_the_engine_process_freezes_its_heap_and_this_one_does_not(tiny_model_dirs):
    from pdserve.config import EngineConfig
    from pdserve.engine.async_llm import AsyncLLM
    from pdserve.model.dummy_tokenizer import tokenizer_path_for
    from pdserve.model.loader import resolve_model

    tok = tokenizer_path_for(resolve_model("qwen3-0.6b"))  # the tiny checkpoint has none: a word-level one
    llm = AsyncLLM(EngineConfig(model=str(tiny_model_dirs["qwen3"]), tokenizer=tok, device="cpu", dtype="float32",
                                num_gpu_blocks=32, block_size=4, max_model_len=64))
    before = gc.get_freeze_count()

    async def go():
        try:
            await llm.start()
            return llm.info["gc_frozen"]
        finally:
            await llm.shutdown()

    frozen = asyncio.run(go())
    assert len(frozen) == 1 and frozen[0] > 10_000  # one rank: torch, the model and the engine's own objects
    assert gc.get_freeze_count() == before  # the library user's process (this one) keeps its collector
