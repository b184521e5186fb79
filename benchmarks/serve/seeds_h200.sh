#!/usr/bin/env bash
# The seeds' benchmark in one command: for each input length, the highest request rate at which
# p90 TTFT <= 5 s and p90 TPOT <= 50 ms hold (random prompts, 1024-token outputs with ignore_eos), against an
# already running OpenAI-compatible endpoint (pdserve serve, a pdserve router, vLLM, SGLang).
#
#   OUT=/path/to/out bash benchmarks/serve/seeds_h200.sh http://127.0.0.1:8000 [TOKENIZER]
#
# Writes into $OUT: seeds.json (every trial and request), seeds.csv and seeds.md (one row per input length: the
# max rate, the lowest failing rate, goodput, throughput and p90s at that rate), seeds_trials.csv, the plots
# (seeds_max_rate.png across lengths, latency against rate, throughput against latency) and seeds.log.
# Each length's search gets TIME_BUDGET seconds (default 300); the next length starts at the rate the previous
# one reached. Environment overrides: INPUT_LENS, OUTPUT_LEN, SLO, START_RATE, TIME_BUDGET, MAX_DURATION, DRAIN.
# Without TOKENIZER the served model's name is used (pdserve's shipped shapes resolve to their word-level
# tokenizer); for vLLM pass the directory /work/shared/anchors/make_dummy_model_dir.py wrote.
set -euo pipefail

URL=${1:?usage: seeds_h200.sh BASE_URL [TOKENIZER]}
TOKENIZER=${2:-}
OUT=${OUT:?set OUT to the output directory}
INPUT_LENS=${INPUT_LENS:-1024,4096,8192,16384,32768}
OUTPUT_LEN=${OUTPUT_LEN:-1024}
SLO=${SLO:-p90_ttft_ms<=5000,p90_tpot_ms<=50}
START_RATE=${START_RATE:-2}
TIME_BUDGET=${TIME_BUDGET:-300}
MAX_DURATION=${MAX_DURATION:-15}
DRAIN=${DRAIN:-75}

REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
N_LENS=$(awk -F, '{print NF}' <<< "$INPUT_LENS")

# per length: the budget, the last trial's drain and 30 s of grace
timeout --signal=INT --kill-after=20 $(( N_LENS * (TIME_BUDGET + DRAIN + 30) )) \
python -m pdserve.bench search \
  --base-url "$URL" --endpoint /v1/completions ${TOKENIZER:+--tokenizer "$TOKENIZER"} \
  --dataset-name random --random-input-len "$INPUT_LENS" --random-output-len "$OUTPUT_LEN" --ignore-eos \
  --slo "$SLO" --start-rate "$START_RATE" --growth 2 --tolerance 0.25 \
  --requests-per-rate 5 --min-requests 10 --max-duration "$MAX_DURATION" --drain-timeout "$DRAIN" \
  --time-budget "$TIME_BUDGET" --cooldown 3 --request-timeout 300 \
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
  --result-dir "$OUT" --result-filename seeds.json --disable-tqdm 2>&1 | tee "$OUT/seeds.log"
