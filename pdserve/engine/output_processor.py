"""Turns the core's token outputs into what clients see: streamed UTF-8-safe text, stop strings applied, logprobs.

It runs beside the tokenizer (in the server process), not in the engine loop, so detokenizing hundreds of streams
never delays a GPU step. A stop-string hit finishes the request here; the caller then aborts it in the core.
"""

from __future__ import annotations

import time

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.messages import CoreOutput
from pdserve.engine.outputs import RequestOutput, TokenLogprob
from pdserve.sampling_params import SamplingParams


class RequestState:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 arrival_time: float | None = None):
        from pdserve.engine.stop_checker import StopChecker

        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self.stop = StopChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.num_output_tokens = 0
        self.output_token_ids: list[int] = []
        self.text = ""
        self.finished = False
        self.arrival_time = arrival_time or time.time()
        self.first_token_time: float | None = None

    def process(self, co: CoreOutput) -> RequestOutput:
        """Returns the delta for this core output; `finished` is set when the core or a stop string ended it."""
        now = time.time()
        if co.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.num_output_tokens += len(co.new_token_ids)
        self.output_token_ids.extend(co.new_token_ids)
        delta = ""
        if self.detok is not None:
            delta = self.detok.push(co.new_token_ids)
            if co.finished:
                delta += self.detok.flush()
        finished, reason, stop_reason = co.finished, co.finish_reason, co.stop_reason
        if self.stop is not None:
            emit, matched = self.stop.feed(delta)
            if matched is not None:
                finished, reason, stop_reason = True, "stop", matched
            elif finished:
                emit += self.stop.flush()
            delta = emit
        self.text += delta
        self.finished = finished
        lps = None
        if self.params.logprobs is not None and co.logprobs:
            lps = [TokenLogprob(t, lp[0], list(lp[1])) for t, lp in zip(co.new_token_ids, co.logprobs) if lp]
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=list(co.new_token_ids),
            new_text=delta,
            finished=finished,
            finish_reason=reason if finished else None,
            stop_reason=stop_reason if finished else None,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=co.num_cached_tokens,
            logprobs=lps,
            error=str(co.stop_reason) if reason == "error" else None,
            arrival_time=self.arrival_time,
            first_scheduled_time=co.first_scheduled_time,
            first_token_time=self.first_token_time,
        )
