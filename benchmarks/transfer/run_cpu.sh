#!/usr/bin/env bash
# tcp transfer engine against the raw socket stream between the same two processes, on CPU (any machine):
# the KV of 2048 tokens of Qwen3-8B (128 random 16-token blocks, 302 MB), WRITE and READ, ceiling interleaved.
#   usage: OUT=/some/dir bash benchmarks/transfer/run_cpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-benchmarks/transfer/results_cpu}"
mkdir -p "$OUT"
python -m pdserve.bench.transfer --transport tcp --backend numpy --model-config qwen3-8b --tokens 2048 \
  --block-size 16 --iters 20 --warmup 3 --latency-iters 200 --result-dir "$OUT" --result-filename tcp_cpu.json
python benchmarks/transfer/summarize.py "$OUT"
