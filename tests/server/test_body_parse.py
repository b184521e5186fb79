"""parse_json: orjson (when installed) for speed, the stdlib for every body orjson would read differently or refuses,
so both give the same objects and the same errors."""

from __future__ import annotations

import json
import random

import pytest

import pdserve.server.body as body
from pdserve.protocol import APIError

orjson = pytest.importorskip("orjson")

BODIES = [
    b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0.5, "stream": true}',
    b'{"prompt": "caf\\u00e9 \\ud83d\\ude00", "stop": ["\\n"], "logit_bias": {"5": -1.5}}',
    b'{"prompt": "x", "seed": 123456789012345678901234567890}',  # beyond 64 bits: an exact int, as the stdlib reads it
    b'{"prompt": "x", "seed": -9999999999999999999}',
    b'{"prompt": "x", "a": 1, "a": 2}',  # the last duplicate wins in both
    b'{"prompt": "x", "n": -0.0, "b": null, "c": [[[1]]]}',
    b"[1, 2]",
    b"null",
]


@pytest.mark.parametrize("raw", BODIES)
def test_the_same_object_with_orjson_and_without(raw, monkeypatch):
    fast = body.parse_json(raw)
    monkeypatch.setattr(body, "orjson", None)
    slow = body.parse_json(raw)
    assert fast == slow and json.dumps(fast) == json.dumps(slow)  # ints stay ints, floats floats


@pytest.mark.parametrize("raw", [b'{"t": NaN}', b'{"t": 1e999}', b'{"p": "\\ud800"}', b"[" * 5000 + b"]" * 5000,
                                 b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}", b'{"p": "x"', b'{"p": "\xff"}'])
def test_the_same_errors_with_orjson_and_without(raw, monkeypatch):
    with pytest.raises(APIError) as fast:
        body.parse_json(raw)
    monkeypatch.setattr(body, "orjson", None)
    with pytest.raises(APIError) as slow:
        body.parse_json(raw)
    assert str(fast.value) == str(slow.value)


def test_a_long_prompt_of_ids_parses_exactly():
    ids = [random.Random(0).randrange(0, 200_000) for _ in range(32_768)]
    raw = json.dumps({"prompt": ids, "max_tokens": 4}).encode()
    got = body.parse_json(raw)
    assert got["prompt"] == ids and all(type(t) is int for t in got["prompt"][:100])
