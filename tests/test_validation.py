"""The token-id checks that every long prompt passes through (server, engine, PD order, router): the fast paths
(C-speed type and range tests) decide exactly as the element-by-element definitions."""

from __future__ import annotations

import pytest

from pdserve.disagg.routes import parse_order
from pdserve.protocol import _is_ids
from pdserve.validation import InvalidParameter, check_token_ids, ids_in_range

CASES = [[], [0], [5, 7, 9], [0, 99], [100], [-1], [3, True], [False], [1.0], [2, "3"], [2**70], [-(2**70)],
         [1, None], [[1]], list(range(100))]


def _slow_in_range(ids, vocab):
    return all(type(t) is int and t >= 0 and (vocab is None or t < vocab) for t in ids)


@pytest.mark.parametrize("ids", CASES)
@pytest.mark.parametrize("vocab", [100, None])
def test_fast_checks_decide_as_the_definition(ids, vocab):
    assert ids_in_range(ids, vocab) == _slow_in_range(ids, vocab)
    ok = _slow_in_range(ids, vocab)
    if ok:
        check_token_ids(ids, vocab, "prompt")
    else:
        with pytest.raises(InvalidParameter, match="prompt contains token ids outside the vocabulary"):
            check_token_ids(ids, vocab, "prompt")
    assert _is_ids(ids) == all(type(t) is int for t in ids)


def _order(ids) -> dict:
    return {"request_id": "r", "prompt_token_ids": ids, "sampling": {"max_tokens": 1},
            "dest": {"request_id": "d", "block_ids": [0, 1], "ranks": [{"agent": "a", "heads": [0, 2]}]}}


@pytest.mark.parametrize("ids", [[1, True], [1, -2], [1.5], ["1"]])
def test_a_prefill_order_refuses_what_is_no_token_id(ids):
    with pytest.raises(TypeError, match="prompt_token_ids"):
        parse_order(_order(ids))
