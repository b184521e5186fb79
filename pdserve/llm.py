"""Offline generation: `LLM(model=...).generate(prompts, params)`, the engine core driven inline to completion."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields

from pdserve.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.output_processor import RequestState
from pdserve.engine.outputs import TokenLogprob
from pdserve.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        from pdserve.engine.tokenizer import Tokenizer
        from pdserve.model.loader import resolve_model

        names = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        if model is not None:
            kwargs["model"] = model
        self.config = EngineConfig(**kwargs)
        src = resolve_model(self.config.model)
        from pdserve.model.dummy_tokenizer import tokenizer_path_for

        self.tokenizer = Tokenizer.load(self.config.tokenizer or tokenizer_path_for(src))
        self.engine = EngineCore(self.config, eos_token_ids=set(self.tokenizer.eos_token_ids))
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationResult]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        results: dict[str, GenerationResult] = {}
        states: dict[str, RequestState] = {}
        order = []
        for prompt, p in zip(prompts, plist):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, p)
            states[rid] = RequestState(rid, ids, p, self.tokenizer)
            results[rid] = GenerationResult(rid, prompt if isinstance(prompt, str) else None, ids)
            order.append(rid)
        while states:
            for co in self.engine.step():
                st = states.get(co.request_id)
                if st is None:
                    continue
                out = st.process(co)
                res = results[co.request_id]
                res.num_cached_tokens = out.num_cached_tokens
                if out.logprobs:
                    res._lps = getattr(res, "_lps", []) + out.logprobs
                if out.finished:
                    if not co.finished:
                        self.engine.abort_request(co.request_id)
                    res.outputs = [CompletionOutput(0, st.text, st.output_token_ids, out.finish_reason,
                                                    out.stop_reason, getattr(res, "_lps", None))]
                    del states[co.request_id]
        while self.engine.has_work():  # async scheduling: a step of requests that ended may still be in flight
            self.engine.step()
        return [results[r] for r in order]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None):
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        return self.generate([self.tokenizer.encode_chat(m) for m in convs], sampling_params)
