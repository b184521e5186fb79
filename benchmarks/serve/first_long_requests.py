"""TTFT of the first long prompts a fresh server sees, each length twice with different tokens, one at a time.

Long prompts take the library prefill attention (pdserve.ops.attention.library_prefill), whose cuDNN plans are built
once per call shape: start-up builds the common ones (warm-up), the rest on first use. A first prompt of a length
whose TTFT is well above the second's is a shape that was not built ahead. Prompts are random token ids, sent as a
list of ids to /v1/completions (max_tokens 1), so no tokenizer is involved.

  python benchmarks/serve/first_long_requests.py --url http://127.0.0.1:8200 --model NAME --out FILE.json \
      --lengths 8000,20000,33000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request


def ttft_ms(url: str, model: str, ids: list[int]) -> float:
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return 1e3 * (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="8000,20000,33000")
    ap.add_argument("--vocab", type=int, default=150000)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        times = [ttft_ms(args.url, args.model, [rng.randrange(10, args.vocab) for _ in range(n)]) for _ in range(2)]
        rows.append({"tokens": n, "ttft_ms": times})
        print(f"{n:6} tokens: first {times[0]:8.1f} ms, second {times[1]:8.1f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "first_long_requests", "url": args.url, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
