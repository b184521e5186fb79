"""What one pass over a long prompt's token ids costs on the way from the client to the prefill engine (CPU only).

A disaggregated request's ids are handled several times before the prompt computes: the router parses the JSON body
(and packs the ids for its prefix key), the decode instance parses and validates them, pickles them to its engine
(which unpickles and hashes them into blocks), packs the prefill order (msgpack), and the prefill instance unpacks,
validates and pickles them again. Each pass is timed here alone, on this machine, for the given prompt lengths:

    python benchmarks/router/intake_costs.py --tokens 8192 32768 --out benchmarks/router/results_cpu/intake_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import time

import msgpack

from pdserve.disagg.routes import unpack_order
from pdserve.engine.block_pool import hash_block
from pdserve.engine.messages import AddRequest
from pdserve.router import prefix
from pdserve.sampling_params import SamplingParams
from pdserve.server import body as body_mod
from pdserve.server.body import parse_json
from pdserve.validation import check_token_ids, ids_in_range

VOCAB = 151_936  # Qwen3's


def timed(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):  # the best of `reps`: a pass's own cost, not the machine's noise
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def stdlib_parse(raw: bytes, reps: int) -> float:
    """parse_json as on a machine without orjson (the comparison for its fast path)."""
    saved, body_mod.orjson = body_mod.orjson, None
    try:
        return timed(lambda: parse_json(raw), reps)
    finally:
        body_mod.orjson = saved


def passes(n: int, reps: int) -> dict[str, float]:
    rng = random.Random(n)
    ids = [rng.randrange(1000, VOCAB) for _ in range(n)]
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 16, "stream": True}).encode()
    obj = parse_json(body)
    msg = AddRequest("r", ids, SamplingParams(max_tokens=16))
    pickled = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    order = msgpack.packb({"request_id": "r", "prompt_token_ids": ids})

    def hashes() -> None:
        h = None
        for i in range(0, n - 15, 16):
            h = hash_block(h, tuple(ids[i:i + 16]))

    return {
        "client json.dumps": timed(lambda: json.dumps({"prompt": ids}), reps),
        "parse_json (router, instance)": timed(lambda: parse_json(body), reps),
        "parse_json, stdlib json only": stdlib_parse(body, reps),
        "prefix.token_ids (router)": timed(lambda: prefix.token_ids(obj["prompt"]), reps),
        "check_token_ids (instance)": timed(lambda: check_token_ids(ids, VOCAB, "prompt"), reps),
        "pickle AddRequest (server -> engine)": timed(lambda: pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), reps),
        "unpickle AddRequest (engine)": timed(lambda: pickle.loads(pickled), reps),
        "block hashes (engine)": timed(hashes, reps),
        "msgpack pack order (decode)": timed(lambda: msgpack.packb({"request_id": "r", "prompt_token_ids": ids}), reps),
        "unpack_order (prefill)": timed(lambda: unpack_order(order), reps),
        "ids_in_range (prefill order)": timed(lambda: ids_in_range(ids, None), reps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {str(n): passes(n, a.reps) for n in a.tokens}
    for n, r in res.items():
        print(f"{n} tokens: " + ", ".join(f"{k} {v:.2f} ms" for k, v in r.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"benchmark": "intake_costs", "machine": platform.node(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "reps": a.reps, "results_ms": res}, f, indent=1)


if __name__ == "__main__":
    main()
