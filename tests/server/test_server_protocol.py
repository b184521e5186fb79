"""Request parsing and response shapes of pdserve.protocol, without a server."""

from __future__ import annotations

import json

import pytest

from pdserve import protocol as P
from pdserve.engine.outputs import TokenLogprob
from pdserve.errors import PromptTooLong
from pdserve.sampling_params import SamplingParams


def rejects(parse, body, param=None, status=400, contains=None) -> P.APIError:
    with pytest.raises(P.APIError) as info:
        parse(body)
    e = info.value
    assert e.status == status
    if param is not None:
        assert e.param == param
    if contains is not None:
        assert contains in e.message
    body = e.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return e


def test_completion_defaults_match_sampling_params():
    req = P.parse_completion({"model": "m", "prompt": "hi"})
    assert req.prompts == ["hi"] and req.model == "m" and not req.stream and req.n == 1
    assert req.sampling.max_tokens == SamplingParams().max_tokens
    assert not req.max_tokens_given
    assert req.sampling.temperature == SamplingParams().temperature


def test_completion_fields_reach_sampling_params():
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 4,
        "min_p": 0.1,
        "seed": 11,
        "stop": "END",
        "stop_token_ids": [5],
        "ignore_eos": True,
        "min_tokens": 2,
        "include_stop_str_in_output": True,
        "logprobs": 3,
        "user": "ignored",
        "pd": {"role": "decode", "peer": "x"},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = P.parse_completion(body)
    s = req.sampling
    assert req.prompts == [[1, 2, 3]]
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (7, 0, 0.5, 4, 0.1, 11)
    assert s.stop == ["END"] and s.stop_token_ids == [5] and s.ignore_eos and s.min_tokens == 2
    assert s.include_stop_str_in_output and s.logprobs == 3
    assert req.pd == {"role": "decode", "peer": "x"}
    assert req.stream and req.include_usage and req.max_tokens_given


def test_prompt_forms():
    assert P.parse_completion({"prompt": ["abc"]}).prompts == ["abc"]
    assert P.parse_completion({"prompt": [[4, 5]]}).prompts == [[4, 5]]
    assert P.parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert P.parse_completion({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    assert P.parse_completion({"prompt": ""}).prompts == [""]


def test_new_sampling_fields_reach_sampling_params():
    body = {"prompt": "a", "n": 3, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
            "logit_bias": {"17": 5, "3": -150}, "allowed_token_ids": [1, 2], "seed": -5}
    req = P.parse_completion(body)
    s = req.sampling
    assert req.n == 3 and (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1, 1.2)
    assert s.logit_bias == {17: 5.0, 3: -100.0}  # clamped to [-100, 100] as vLLM does
    assert s.allowed_token_ids == [1, 2] and s.seed == -5
    assert P.parse_completion({"prompt": "a", "seed": -1}).sampling.seed is None  # vLLM: -1 means no seed


def test_child_seeds_follow_vllm():
    s = P.parse_completion({"prompt": "a", "n": 3, "seed": 10}).sampling
    assert [P.child_sampling(s, i).seed for i in range(3)] == [10, 11, 12]
    unseeded = P.parse_completion({"prompt": "a", "n": 2}).sampling
    assert [P.child_sampling(unseeded, i).seed for i in range(2)] == [None, None]


@pytest.mark.parametrize(
    "body, param, contains",
    [
        ({"prompt": ["a", 1]}, "prompt", None),
        ({"prompt": [[1], []]}, "prompt", "prompt[1]"),
        ({"prompt": [[1], ["x"]]}, "prompt", "prompt[1]"),
        ({}, "prompt", "required"),
        ({"prompt": 5}, "prompt", None),
        ({"prompt": []}, "prompt", None),
        ({"prompt": [1, "x"]}, "prompt", None),
        ({"prompt": "a", "n": 2, "temperature": 0}, "n", "greedy"),
        ({"prompt": "a", "n": 0}, "n", None),
        ({"prompt": "a", "n": 200}, "n", "at most"),
        ({"prompt": ["a"] * 65, "n": 2}, "n", "at most"),
        ({"prompt": "a", "best_of": 2}, "best_of", "not supported"),
        ({"prompt": "a", "max_tokens": 2**63}, "max_tokens", "64-bit"),
        ({"prompt": "a", "top_k": 10**19}, "top_k", "64-bit"),
        ({"prompt": "a", "top_k": -2}, "top_k", None),
        ({"prompt": "a", "seed": 2**64}, "seed", "64-bit"),
        ({"prompt": "a", "seed": -(2**63) - 1}, "seed", "64-bit"),
        ({"prompt": "a", "min_tokens": 5, "max_tokens": 4}, "min_tokens", "at most"),
        ({"prompt": "a", "min_tokens": -1}, "min_tokens", None),
        ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty", None),
        ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty", None),
        ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", None),
        ({"prompt": "a", "min_p": 1.5}, "min_p", None),
        ({"prompt": "a", "top_p": 1.01}, "top_p", None),
        ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", None),
        ({"prompt": "a", "logit_bias": {"1": "big"}}, "logit_bias", None),
        ({"prompt": "a", "logit_bias": [1]}, "logit_bias", None),
        ({"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids", None),
        ({"prompt": "a", "allowed_token_ids": [-1]}, "allowed_token_ids", None),
        ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids", None),
        ({"prompt": "a", "logprobs": -1}, "logprobs", None),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", None),
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens", "integer"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens", "integer"),
        ({"prompt": "a", "temperature": 3}, "temperature", None),
        ({"prompt": "a", "temperature": "hot"}, "temperature", "number"),
        ({"prompt": "a", "top_p": 0}, "top_p", None),
        ({"prompt": "a", "logprobs": 21}, "logprobs", None),
        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo", None),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": "a", "stream": "yes"}, "stream", "boolean"),
        ({"prompt": "a", "stop": [1]}, "stop", None),
        ({"prompt": "a", "stop": [""]}, "stop", None),
        ({"prompt": "a", "pd": "x"}, "pd", None),
        ({"prompt": "a", "suffix": "z"}, "suffix", "not supported"),
        ({"prompt": "a", "seed": 1.5}, "seed", "integer"),
    ],
)
def test_invalid_completion_requests(body, param, contains):
    rejects(P.parse_completion, body, param, contains=contains)


def test_body_must_be_an_object():
    rejects(P.parse_completion, [1, 2], contains="JSON object")
    rejects(P.parse_chat, "hello", contains="JSON object")


def test_neutral_penalties_are_accepted():
    req = P.parse_completion({"prompt": "a", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}})
    assert not req.sampling.has_penalties and req.sampling.logit_bias is None


def test_chat_parsing():
    req = P.parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
            ],
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert req.sampling.max_tokens == 5  # max_completion_tokens wins over the deprecated max_tokens
    assert req.logprobs and req.top_logprobs == 2 and req.sampling.logprobs == 2


def test_chat_without_max_tokens_is_filled_from_the_context():
    req = P.parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert req.sampling.max_tokens is None and not req.max_tokens_given
    assert P.sampling_for_prompt(req, prompt_tokens=10, max_model_len=64).max_tokens == 54
    assert req.sampling.max_tokens is None  # the request's own parameters stay untouched


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 3, "temperature": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
    ],
)
def test_invalid_chat_requests(body, param):
    rejects(P.parse_chat, body, param)


def test_context_length_errors_name_both_numbers():
    req = P.parse_completion({"prompt": "a", "max_tokens": 10})
    with pytest.raises(P.APIError) as info:
        P.sampling_for_prompt(req, prompt_tokens=60, max_model_len=64)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert "64" in info.value.message and "70" in info.value.message and "60" in info.value.message
    assert info.value.message == str(PromptTooLong(60, 64, 10))  # one wording, shared with the engine
    req = P.parse_completion({"prompt": "a"})
    with pytest.raises(P.APIError) as info:
        P.sampling_for_prompt(req, prompt_tokens=64, max_model_len=64)
    assert "64 tokens" in info.value.message
    req = P.parse_completion({"prompt": "a"})  # default max_tokens shrinks to the room left
    assert P.sampling_for_prompt(req, prompt_tokens=60, max_model_len=64).max_tokens == 4


def test_tokenize_and_detokenize_requests():
    t = P.parse_tokenize({"prompt": "hi", "return_token_strs": True, "unknown": 1})
    assert (t.prompt, t.add_special_tokens, t.return_token_strs, t.messages) == ("hi", True, True, None)
    c = P.parse_tokenize({"messages": [{"role": "user", "content": "x"}]})
    assert c.messages == [{"role": "user", "content": "x"}] and not c.add_special_tokens and c.add_generation_prompt
    rejects(P.parse_tokenize, {"prompt": 5}, "prompt")
    rejects(P.parse_tokenize, {}, "prompt")
    assert P.parse_detokenize({"tokens": [1, 2]}) == (None, [1, 2])
    rejects(P.parse_detokenize, {"tokens": [1, "2"]}, "tokens")
    rejects(P.parse_detokenize, {"tokens": "12"}, "tokens")


def test_sse_framing_is_compact_json_and_done():
    chunk = P.completion_chunk("cmpl-1", 7, "m", "hé", None)
    raw = P.sse(chunk)
    assert raw.startswith(b"data: {") and raw.endswith(b"\n\n") and b"\n" not in raw[:-2]
    assert json.loads(raw[len(b"data: ") :].decode()) == chunk
    assert P.SSE_DONE == b"data: [DONE]\n\n"


def test_logprob_objects():
    text = {1: "a", 2: "bc", 3: "é"}.__getitem__
    entries = [TokenLogprob(1, -0.5, [(1, -0.5), (2, -1.0)]), TokenLogprob(2, -0.1, [(2, -0.1)])]
    acc = P.CompletionLogprobs(text, offset=3)
    first = acc.chunk(entries[:1])
    second = acc.chunk(entries[1:])
    assert first == {
        "tokens": ["a"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"a": -0.5, "bc": -1.0}],
        "text_offset": [3],
    }
    assert second["text_offset"] == [4]
    chat = P.chat_logprobs([TokenLogprob(3, -0.2, [(3, -0.2)])], text)
    assert chat == {
        "content": [
            {
                "token": "é",
                "logprob": -0.2,
                "bytes": [195, 169],
                "top_logprobs": [{"token": "é", "logprob": -0.2, "bytes": [195, 169]}],
            }
        ]
    }


def test_usage_totals():
    u = P.usage(5, 3, 2)
    assert u["total_tokens"] == 8 and u["prompt_tokens_details"] == {"cached_tokens": 2}


def test_vllm_extras():
    assert P.parse_completion({"prompt": "a", "return_tokens_as_token_ids": True}).tokens_as_ids
    rejects(P.parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}, "top_logprobs")
    rejects(P.parse_completion, {"prompt": "a", "use_beam_search": True}, "use_beam_search")
    chat = P.parse_chat({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False,
                         "continue_final_message": True})
    assert chat.continue_final_message and not chat.add_generation_prompt
