#!/usr/bin/env bash
# Decoding requests' TPOT under a stream of long prompts (issue 10: "chunked prefill that keeps decode TPOT flat"),
# vLLM 0.22 and pdserve measured by vLLM's own client. Each server runs the decoders alone (DEC, default 1024 in /
# 1024 out, 128 prompts at concurrency 32, ~32 s), then the same decoders again with a stream of long prompts started
# DELAY seconds after them (LONG, default 32768 in / 1 out, 8 prompts one at a time, ~10 s): the decoders' TPOT and
# inter-token latencies in both runs, and the long prompts' TTFT. No warm-up requests (a warm-up request of the
# decoders' client decodes its 1024 tokens before the run starts: in session 27's first run it outlasted the long
# stream); every run its own --seed, so no run hits another's prefix cache. The summary gives each run's start and end
# (from its result: saved at the end, after `duration` s), so a long stream that missed the decoders shows.
#
#   OUT=$OUT STAGE=.vllm-stage bash benchmarks/vs_vllm/interference.sh
# ARMS (default "vllm pdserve:0 pdserve:2048 pdserve:1024", as lease_2xh200.sh interfere runs them): vllm, or pdserve:N with --max-long-prefill-tokens N;
# on two GPUs also pd-vllm (vLLM 1P1D with NixlConnector behind the anchors' proxy: prefill on GPU 0, decode on GPU 1)
# and pd-pdserve (`pdserve serve --prefill 1 --decode 1`), where the long prompts are prefilled on the other GPU.
# With two GPUs the vllm arm runs on GPU 0 while the pdserve arms run one after the other on GPU 1 (GPUS=1: every
# arm on GPU 0, in order); the pd arms then run one after the other on both. vLLM from /tmp/site (side_by_side.sh or
# lease_2xh200.sh unpack installed it, with NIXL when staged).
set -u
S=${STAGE:-.vllm-stage}; OUT=${OUT:-/tmp/interference}; mkdir -p "$OUT"
M=${MODEL:-$S/model}; NAME=qwen3-dummy
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
V="env PYTHONPATH=/tmp/site python3 -m vllm.entrypoints.cli.main"
DEC=${DEC:-1024:1024:128:32}; LONG=${LONG:-32768:1:8:1}; DELAY=${DELAY:-8}
ARMS=${ARMS:-"vllm pdserve:0 pdserve:2048 pdserve:1024"}
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
command -v pdserve >/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2

client() {  # PORT SPEC(in:out:n:c) FILE SEED: vLLM's bench serve, one result JSON
  local i o n c; IFS=: read i o n c <<< "$2"
  timeout 400 $V bench serve --backend vllm --base-url http://127.0.0.1:$1 --model $NAME --tokenizer $M \
    --dataset-name random --random-input-len $i --random-output-len $o --num-prompts $n --max-concurrency $c \
    --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99,99.9 --num-warmups 0 --seed $4 \
    --save-result --result-dir "$OUT" --result-filename $3.json > "$OUT/$3.txt" 2>&1 || echo "$3: client failed"
}
ready() {  # PORT PID LOG: wait (at most 420 s) until a completion is answered
  local t
  for t in $(seq 840); do
    curl -sf localhost:$1/v1/completions -H 'Content-Type: application/json' \
      -d "{\"model\":\"$NAME\",\"prompt\":\"t1 t2 t3\",\"max_tokens\":2}" > /dev/null && return 0
    kill -0 $2 2>/dev/null || { echo "server exited:"; tail -5 "$3"; return 1; }
    sleep 0.5
  done
  echo "not answering after 420 s"; return 1
}
arm() {  # ARM GPU PORT
  local a=$1 gpu=$2 port=$3 tag pid log
  tag=${a/:/_}; log="$OUT/$tag.log"
  if [ "$a" = vllm ]; then
    CUDA_VISIBLE_DEVICES=$gpu $V serve $M --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
      --served-model-name $NAME --port $port > "$log" 2>&1 & pid=$!
  else
    CUDA_VISIBLE_DEVICES=$gpu env -u PYTHONPATH pdserve serve --model $M --load-format dummy --max-model-len 40960 \
      --gpu-memory-utilization 0.9 --served-model-name $NAME --port $port --max-long-prefill-tokens ${a#pdserve:} \
      > "$log" 2>&1 & pid=$!
  fi
  if ready $port $pid "$log"; then
    client $port $DEC ${tag}_dec_alone 11
    client $port $DEC ${tag}_dec_with_long 12 & local c=$!
    sleep $DELAY
    client $port $LONG ${tag}_long 13
    wait $c
  fi
  kill $pid 2>/dev/null; sleep 3; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
  for _ in $(seq 60); do  # the GPU's memory back before the next server sizes its KV pool
    [ "$(nvidia-smi -i $gpu --query-gpu=memory.used --format=csv,noheader,nounits)" -lt 2048 ] && break; sleep 1
  done
  gzip -f "$log"
}
pd_arm() {  # ARM (pd-vllm or pd-pdserve): a 1P1D deployment on GPUs 0 and 1, the clients on port 8000
  local a=$1 log="$OUT/$1.log" pids pid
  if [ "$a" = pd-vllm ]; then
    local kv='{"kv_connector":"NixlConnector","kv_role":"kv_both"}' c="$M --load-format dummy --max-model-len 40960"
    c="$c --gpu-memory-utilization 0.9 --served-model-name $NAME --kv-transfer-config $kv"
    CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 $V serve $c --port 8100 > "$OUT/pd-vllm_p.log" 2>&1 &
    pids=$!
    CUDA_VISIBLE_DEVICES=1 VLLM_NIXL_SIDE_CHANNEL_PORT=5601 $V serve $c --port 8300 > "$log" 2>&1 & pid=$!
    python3 $S/anchors/pd_proxy.py pd 8000 http://127.0.0.1:8100 http://127.0.0.1:8300 > "$OUT/pd-vllm_proxy.log" 2>&1 &
    pids="$pids $pid $!"
  else
    env -u PYTHONPATH pdserve serve --model $M --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
      --served-model-name $NAME --prefill 1 --decode 1 --port 8000 --log-dir "$OUT/pdlogs" > "$log" 2>&1 & pid=$!
    pids=$pid
  fi
  if ready 8000 $pid "$log"; then
    client 8000 $DEC ${a}_dec_alone 11
    client 8000 $DEC ${a}_dec_with_long 12 & local c=$!
    sleep $DELAY
    client 8000 $LONG ${a}_long 13
    wait $c
  fi
  kill $pids 2>/dev/null; sleep 3; kill -9 $pids 2>/dev/null; wait $pids 2>/dev/null
  for _ in $(seq 60); do  # both GPUs' memory back before the next deployment sizes its KV pools
    [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '$1 > 2048' | wc -l)" = 0 ] && break
    sleep 1
  done
  rm -f "$OUT/pdlogs/deployment-secret"  # the launcher's secret for this deployment: not a result
  for f in "$OUT"/pd-*.log "$OUT"/pdlogs/*.log; do [ -f "$f" ] && gzip -f "$f"; done
}
others=""; pds=""
for a in $ARMS; do
  case $a in vllm) ;; pd-*) pds="$pds $a" ;; *) others="$others $a" ;; esac
done
if [ "$GPUS" -ge 2 ] && [[ " $ARMS " == *" vllm "* ]]; then
  arm vllm 0 8100 & v=$!
  for a in $others; do arm $a 1 8200; done
  wait $v
else
  for a in $ARMS; do case $a in pd-*) ;; *) arm $a 0 8200 ;; esac; done
fi
if [ -n "$pds" ] && [ "$GPUS" -lt 2 ]; then echo "the pd arms ($pds) need two GPUs: left out"; pds=""; fi
for a in $pds; do pd_arm $a; done
# the table (benchmarks/summarize.py prints the same one into docs/benchmarks.md)
python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import summarize; summarize.interference_table(sys.argv[1])' \
  "$OUT"
