#!/usr/bin/env bash
# vLLM 0.22 and pdserve on the same lent machine, measured by the same client (vLLM's own `bench serve`), random
# weights in a real model's shape; then compare.py writes the ratios. Adapted from shared/anchors/side_by_side.sh
# (staging is the same: $STAGE/p0..pN the vLLM wheel split in parts vpart00.. small enough to carry one per call, $STAGE/deps, $STAGE/nixl, $STAGE/model[-moe]).
#
#   OUT=$OUT STAGE=.vllm-stage bash benchmarks/vs_vllm/side_by_side.sh MODE [MODE ...]
# MODE: single (vLLM on GPU 0, pdserve on GPU 1 at once; SINGLE_GPU=1: one after the other on GPU 0),
#       tp (vLLM then pdserve, each with --tensor-parallel-size $TP, default 2, on GPUs 0..TP-1),
#       pd-vllm (1P1D NixlConnector), pd-pdserve (`pdserve serve --prefill 1 --decode 1`),
#       colo-vllm / colo-pdserve (two colocated instances behind a proxy / `pdserve serve --both 2`).
# Knobs: CLIENTS ("vllm pdserve": each workload measured by vLLM's client, then by `pdserve bench serve` into
# <name>_<in>x<out>_c<conc>_pdclient.json), CLIENT_ROUNDS (k > 1: the clients alternate k times, rounds after the
# first written as <name>_<in>x<out>_c<conc>_r<k>[_pdclient].json, so run-to-run drift is measured beside the clients'
# difference), DETAILED=1 (both clients keep per-request start times and TTFTs: compact_detail.py), SERVERS (with
# SINGLE_GPU=1: "vllm" or "pdserve" alone), PDCLIENT_ARGS (extra flags for pdserve's client, e.g. --trust-env), MODEL (default $STAGE/model), VLLM_ARGS / PDSERVE_ARGS (e.g. "--kv-cache-dtype fp8"), SAME_SEED (1: every round's prompts seed 0), WORKLOADS
# ("in:out:prompts:concurrency ...", default "1024:1024:512:256 8192:16:16:1 32768:16:8:1").
# Each run measured by vLLM's client also gets <name>_<in>x<out>_c<conc>.server.json: what the server's own /metrics
# histograms measured of it (server_latency.py: mean TTFT, inter-token latency, vLLM's per-request TPOT).
# Each server's start-up time (launch -> first completion answered) and KV capacity (tokens, from its log) are
# written to $OUT/<name>_server.json; each workload to $OUT/<name>_<in>x<out>_c<conc>.json (vLLM's format).
set -u
S=${STAGE:-.vllm-stage}; OUT=${OUT:-/tmp/sbs}; mkdir -p "$OUT"
A=$S/anchors; M=${MODEL:-$S/model}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
WORKLOADS=${WORKLOADS:-"1024:1024:512:256 8192:16:16:1 32768:16:8:1"}
MAXLEN=${MAXLEN:-40960}

nixl_wheels() {  # $S/nixl: the small wheels; $S/nx0, $S/nx1: nixl_cu13's wheel in two parts (one per call)
  mkdir -p /tmp/nixlw; cp $S/nixl/*.whl /tmp/nixlw/ 2>/dev/null
  [ -f $S/nx0/nxpart00 ] && cat $S/nx0/nxpart00 $S/nx1/nxpart01 > /tmp/nixlw/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
}
install_vllm() {
  [ -d /tmp/site/vllm ] && return
  cat $(for i in 0 1 2 3 4 5 6 7 8 9; do ls $S/p$i/vpart* 2>/dev/null; done) > /tmp/vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl
  nixl_wheels  # NIXL for pd-vllm, when staged
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl $S/deps/*.whl $(ls /tmp/nixlw/*.whl 2>/dev/null) 2>&1 | tail -2
  rm -rf /tmp/site/nixl_ep /tmp/site/nixl_ep_cu13
}
install_pdserve() { command -v pdserve >/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2; }
install_vllm
V="env PYTHONPATH=/tmp/site python3 -m vllm.entrypoints.cli.main"
PD="env -u PYTHONPATH pdserve"
NAME=qwen3-dummy
VCOMMON="$M --load-format dummy --max-model-len $MAXLEN --gpu-memory-utilization 0.9 --served-model-name $NAME ${VLLM_ARGS:-}"
PCOMMON="--model $M --load-format dummy --max-model-len $MAXLEN --gpu-memory-utilization 0.9 --served-model-name $NAME ${PDSERVE_ARGS:-}"

# NAME PORT LOG T0 [PID]: wait for /health, answer one completion, record start-up seconds and the KV capacity;
# gives up at once when the server process PID has exited (its log's tail is printed)
ready() {
  local name=$1 port=$2 log=$3 t0=$4 pid=${5:-0}
  python3 - "$name" "$port" "$log" "$t0" "$OUT" "$pid" <<'PY'
import glob, json, os, re, sys, time, urllib.request
name, port, log, t0, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
pid = int(sys.argv[6])
url = f"http://127.0.0.1:{port}"
deadline = time.time() + 420


def exited() -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


while True:
    try:
        body = json.dumps({"model": "qwen3-dummy", "prompt": "t1 t2 t3", "max_tokens": 2}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()
        break
    except Exception:
        if pid and exited():
            tail = open(log, errors="replace").read()[-3000:]
            print(f"{name}: the server exited before answering; its log ends:\n{tail}"); sys.exit(1)
        if time.time() > deadline:
            print(f"{name}: not answering after 420 s"); sys.exit(1)
        time.sleep(0.5)
startup = time.time() - t0
text = open(log, errors="replace").read()
kv = None
m = re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)  # vLLM
if m:
    kv = int(m[-1].replace(",", ""))
m = re.findall(r"(\d+) KV blocks of (\d+) tokens", text)  # pdserve
if not m and kv is None:  # `pdserve serve --prefill/--decode`: the engines log to the launcher's --log-dir
    for f in sorted(glob.glob(os.path.join(os.path.dirname(log), "pdlogs", "decode*.log"))):
        m += re.findall(r"(\d+) KV blocks of (\d+) tokens", open(f, errors="replace").read())[-1:]
if m and kv is None:
    kv = sum(int(a) * int(b) for a, b in m[-1:])
json.dump({"name": name, "startup_s": startup, "kv_tokens": kv}, open(f"{out}/{name}_server.json", "w"))
print(f"{name}: first completion answered {startup:.1f} s after launch; KV capacity {kv} tokens")
PY
}
stop_all() { kill $(jobs -p) 2>/dev/null; sleep 3; kill -9 $(jobs -p) 2>/dev/null; wait 2>/dev/null; gpus_idle; }
gpus_idle() {  # up to 60 s for every GPU's memory to be given back (the next server sizes its KV cache from it)
  local i
  for i in $(seq 60); do
    [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '$1 > 2048' | wc -l)" = 0 ] && return
    sleep 1
  done
  echo "GPU memory still in use after 60 s:"; nvidia-smi --query-gpu=index,memory.used --format=csv
}
bench() {  # NAME PORT: every workload, vLLM's client; with CLIENTS="vllm pdserve" also pdserve's, CLIENT_ROUNDS times
  local w i o n c rate f r rf load seed
  for w in $WORKLOADS; do
    IFS=: read i o n c rate <<< "$w"; f=$1_${i}x${o}_c$c
    # c 0: no concurrency limit; a fifth field: Poisson arrivals at that many requests/s (<name>_..._c0_rate<R>)
    load=""; [ "$c" -gt 0 ] && load="--max-concurrency $c"
    [ -n "${rate:-}" ] && { load="$load --request-rate $rate"; f=${f}_rate$rate; }
    for r in $(seq ${CLIENT_ROUNDS:-1}); do
      rf=$f; [ $r -gt 1 ] && rf=${f}_r$r  # rounds after the first: <name>_r<k>[_pdclient].json, in ABAB order
      # each round its own prompts (--seed): a round repeating the last one's prompts is served from the prefix
      # cache (session 14: TTFT 34-66 ms in round 2 against 216-258 ms in round 1). SAME_SEED=1 (servers started
      # without prefix caching): every round, both clients, the same prompts and arrival times
      seed=$(( r - 1 )); [ "${SAME_SEED:-0}" = 1 ] && seed=0
      curl -s -m 10 http://127.0.0.1:$2/metrics > $OUT/$rf.metrics0.txt  # the server's own latency histograms
      timeout 600 $V bench serve --backend vllm --base-url http://127.0.0.1:$2 --model $NAME --tokenizer $M \
        --dataset-name random --random-input-len $i --random-output-len $o --num-prompts $n $load \
        --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --num-warmups 2 \
        --seed $seed --save-result $({ [ $c -ge 1 ] && [ $c -le 4 ]; } || [ "${DETAILED:-0}" = 1 ] && echo --save-detailed) --result-dir $OUT \
        --result-filename $rf.json > $OUT/$rf.txt 2>&1  # per-request ITLs at low concurrency: a mean TPOT below the mean ITL means chunks of several tokens
      [ "${DETAILED:-0}" = 1 ] && { [ $c -gt 4 ] || [ $c = 0 ]; } && python3 benchmarks/vs_vllm/compact_detail.py $OUT/$rf.json
      python3 benchmarks/vs_vllm/compare.py --line $OUT/$rf.json
      curl -s -m 10 http://127.0.0.1:$2/metrics > $OUT/$rf.metrics1.txt  # (server_latency.py: means over the run)
      python3 benchmarks/vs_vllm/server_latency.py $OUT/$rf.metrics0.txt $OUT/$rf.metrics1.txt $OUT/$rf.server.json
      rm -f $OUT/$rf.metrics0.txt $OUT/$rf.metrics1.txt
      if [[ " ${CLIENTS:-vllm} " == *" pdserve "* ]]; then  # the same workload again, measured by pdserve's client
        timeout 600 env -u PYTHONPATH pdserve bench serve --backend vllm --base-url http://127.0.0.1:$2 --model $NAME \
          --tokenizer $M --dataset-name random --random-input-len $i --random-output-len $o --num-prompts $n \
          $load --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
          --num-warmups 2 --seed $seed --disable-tqdm --no-plots --save-result $([ "${DETAILED:-0}" = 1 ] && echo --save-detailed) \
          --result-dir $OUT --result-filename ${rf}_pdclient.json ${PDCLIENT_ARGS:-} > $OUT/${rf}_pdclient.txt 2>&1
        [ "${DETAILED:-0}" = 1 ] && python3 benchmarks/vs_vllm/compact_detail.py $OUT/${rf}_pdclient.json
        rm -f $OUT/${rf}_pdclient.pdserve.json  # the per-request record (15 MB at 512 requests); the summary stays
        python3 benchmarks/vs_vllm/compare.py --line $OUT/${rf}_pdclient.json
      fi
    done
  done
}
single() {
  install_pdserve
  if [ "${SINGLE_GPU:-0}" = 1 ]; then  # SERVERS="vllm" or "pdserve": only that one (a call each where time is short)
    if [[ " ${SERVERS:-vllm pdserve} " == *" vllm "* ]]; then
      T0=$(date +%s.%N); CUDA_VISIBLE_DEVICES=0 $V serve $VCOMMON --port 8100 > $OUT/vllm.log 2>&1 &
      ready vllm_single 8100 $OUT/vllm.log $T0 $! && bench vllm_single 8100; stop_all
    fi
    if [[ " ${SERVERS:-vllm pdserve} " == *" pdserve "* ]]; then
      T0=$(date +%s.%N); CUDA_VISIBLE_DEVICES=0 $PD serve $PCOMMON --port 8200 > $OUT/pdserve.log 2>&1 &
      ready pdserve_single 8200 $OUT/pdserve.log $T0 $! && bench pdserve_single 8200; stop_all
    fi
  else
    T0=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=0 $V serve $VCOMMON --port 8100 > $OUT/vllm.log 2>&1 & v=$!
    CUDA_VISIBLE_DEVICES=1 $PD serve $PCOMMON --port 8200 > $OUT/pdserve.log 2>&1 & p=$!
    ready vllm_single 8100 $OUT/vllm.log $T0 $v & r1=$!; ready pdserve_single 8200 $OUT/pdserve.log $T0 $p & r2=$!
    wait $r1; ok1=$?; wait $r2; ok2=$?  # a server that did not start is left out; the other is still measured
    b=""
    [ $ok1 = 0 ] && { bench vllm_single 8100 > $OUT/a.txt & b="$b $!"; }
    [ $ok2 = 0 ] && { bench pdserve_single 8200 > $OUT/b.txt & b="$b $!"; }
    [ -n "$b" ] && wait $b
    cat $OUT/a.txt $OUT/b.txt 2>/dev/null; stop_all
  fi
}
tp() {  # vLLM, then pdserve, each with --tensor-parallel-size $TP on GPUs 0..TP-1 (one after the other)
  local n=${TP:-2} pid
  install_pdserve
  T0=$(date +%s.%N); $V serve $VCOMMON -tp $n --port 8100 > $OUT/vllm_tp$n.log 2>&1 & pid=$!
  ready vllm_tp$n 8100 $OUT/vllm_tp$n.log $T0 $pid && bench vllm_tp$n 8100; stop_all
  T0=$(date +%s.%N); $PD serve $PCOMMON -tp $n --port 8200 > $OUT/pdserve_tp$n.log 2>&1 & pid=$!
  ready pdserve_tp$n 8200 $OUT/pdserve_tp$n.log $T0 $pid && bench pdserve_tp$n 8200; stop_all
}
for MODE in "$@"; do
  echo "== $MODE"
  case $MODE in
    single) single ;;
    tp) tp ;;
    pd-vllm)
      KV='{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
      CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 $V serve $VCOMMON --port 8100 --kv-transfer-config "$KV" > $OUT/p.log 2>&1 &
      CUDA_VISIBLE_DEVICES=1 VLLM_NIXL_SIDE_CHANNEL_PORT=5601 $V serve $VCOMMON --port 8200 --kv-transfer-config "$KV" > $OUT/d.log 2>&1 &
      python3 $A/pd_proxy.py pd 8000 http://127.0.0.1:8100 http://127.0.0.1:8200 > $OUT/proxy.log 2>&1 &
      T0=$(date +%s.%N); ready vllm_pd 8000 $OUT/d.log $T0 || { stop_all; continue; }
      bench vllm_pd 8000; grep -h "KV Transfer metrics" $OUT/d.log | tail -1; stop_all ;;
    pd-pdserve)
      install_pdserve; T0=$(date +%s.%N)
      $PD serve $PCOMMON --prefill 1 --decode 1 --port 8000 --log-dir $OUT/pdlogs > $OUT/pdserve_pd.log 2>&1 &
      ready pdserve_pd 8000 $OUT/pdserve_pd.log $T0 $! || { stop_all; continue; }
      bench pdserve_pd 8000; stop_all ;;
    colo-vllm)
      CUDA_VISIBLE_DEVICES=0 $V serve $VCOMMON --port 8100 > $OUT/a.log 2>&1 &
      CUDA_VISIBLE_DEVICES=1 $V serve $VCOMMON --port 8200 > $OUT/b.log 2>&1 &
      python3 $A/pd_proxy.py rr 8000 http://127.0.0.1:8100 http://127.0.0.1:8200 > $OUT/proxy.log 2>&1 &
      T0=$(date +%s.%N); ready vllm_colo 8000 $OUT/a.log $T0 || { stop_all; continue; }
      bench vllm_colo 8000; stop_all ;;
    colo-pdserve)
      install_pdserve; T0=$(date +%s.%N)
      $PD serve $PCOMMON --both 2 --port 8000 --log-dir $OUT/pdlogs > $OUT/pdserve_colo.log 2>&1 &
      ready pdserve_colo 8000 $OUT/pdserve_colo.log $T0 $! || { stop_all; continue; }
      bench pdserve_colo 8000; stop_all ;;
    *) echo "unknown mode $MODE" ;;
  esac
done
python3 benchmarks/vs_vllm/compare.py --dir $OUT --out $OUT/comparison.json
