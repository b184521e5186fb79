#!/usr/bin/env bash
# Seed SLO search on one GPU: the highest request rate at which p90 TTFT <= 5 s and p90 TPOT <= 50 ms hold
# for random 1024-token prompts and 1024-token outputs (ignore_eos), against an already running endpoint.
#
#   OUT=/path/to/out bash benchmarks/serve/search_h200.sh http://127.0.0.1:8000 [TOKENIZER]
#
# The endpoint is anything OpenAI-compatible (pdserve serve, a pdserve router, vLLM, SGLang). The tokenizer
# must be the served model's: without TOKENIZER the served model name is used, which covers pdserve's shipped
# shapes (`pdserve serve --model qwen3-8b --load-format dummy` serves "qwen3-8b" with a word-level tokenizer,
# id i <-> "t<i>", giving exact prompt lengths); for vLLM pass the dir make_dummy_model_dir.py wrote.
# Writes search.json (every trial, every request), search.csv (the result row), search_trials.csv (one row a
# trial), search.md, the PNG plots and search.log into $OUT (benchmarks/serve/seeds_h200.sh runs several input
# lengths in one go). The whole search is held to TIME_BUDGET seconds (default 330):
# each trial sends max(5 x rate, 10) requests, arrivals capped at MAX_DURATION s, waits at most DRAIN s for
# the stragglers (unfinished ones count as SLO violations), and overloaded trials stop as soon as they must fail.
set -euo pipefail

URL=${1:?usage: search_h200.sh BASE_URL [TOKENIZER]}
TOKENIZER=${2:-}
OUT=${OUT:?set OUT to the output directory}
TIME_BUDGET=${TIME_BUDGET:-330}
MAX_DURATION=${MAX_DURATION:-15}
DRAIN=${DRAIN:-75}
START_RATE=${START_RATE:-2}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-1024}
SLO=${SLO:-p90_ttft_ms<=5000,p90_tpot_ms<=50}

REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# 30 s of grace beyond the budget for the last trial's drain and writing the files
timeout --signal=INT --kill-after=20 $((TIME_BUDGET + DRAIN + 30)) \
python -m pdserve.bench search \
  --base-url "$URL" --endpoint /v1/completions ${TOKENIZER:+--tokenizer "$TOKENIZER"} \
  --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --ignore-eos \
  --slo "$SLO" --start-rate "$START_RATE" --growth 2 --tolerance 0.25 \
  --requests-per-rate 5 --min-requests 10 --max-duration "$MAX_DURATION" --drain-timeout "$DRAIN" \
  --time-budget "$TIME_BUDGET" --cooldown 3 --request-timeout 300 \
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
  --result-dir "$OUT" --result-filename search.json --disable-tqdm 2>&1 | tee "$OUT/search.log"
