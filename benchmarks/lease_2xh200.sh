#!/usr/bin/env bash
# The 2xH200 lease of the session, one stage per device call (written before the lease; a machine goes back 30 s
# after a call ends). Staged files (ignored, carried one folder per call): .vllm-stage/{deps,p0..p5,model,model-moe,
# anchors,nixl,nx0,nx1} (benchmarks/vs_vllm/side_by_side.sh) and .mc (the Mooncake CUDA 13 wheel, or its first part
# mcpart00 with the second in .mc1, and the .deb libraries it loads: libibverbs1, ibverbs-providers, libnuma1,
# libnl-3-200, libnl-route-3-200).
#   OUT=$OUT bash benchmarks/lease_2xh200.sh STAGE
# Stages:
#   engine     async scheduling on vs off (greedy tokens compared, steady decode ms/step at batch 1 and 256); the
#              async-scheduling and fp8 attention GPU tests
#   sbs        vLLM and pdserve side by side, one GPU each at once, dummy Qwen3-8B bf16 (1024/1024 c256, 8192/16), each
#              server measured by vLLM's client and pdserve's in two alternating rounds
#   moe        the same with dummy Qwen3-30B-A3B and --kv-cache-dtype fp8 on both
#   pd         pdserve 1P1D (`serve --prefill 1 --decode 1`) and vLLM 1P1D NIXL, 1024/1024 c256 and 8192/16
#   transfer   benchmarks/transfer/run_2xh200.sh with NIXL and Mooncake installed; the PD GPU tests
#   verify_xfer the 2-GPU tests; the transfer table (every transport, NIXL's own anchor run beside NIXL via our
#              agent, the memory checks, GPU-isolated processes)
#   verify_pd  the 1P1D handover and TTFT (benchmarks/router/pd_handover.py) with every GPU visible, with each
#              instance seeing only its own (--isolate-gpus), and with an fp8 KV cache; then (PD_XFER=0: not) the
#              cuda_ipc transfer rows, every GPU visible and GPU-isolated
#   tp_tests   the TP GPU tests (TP=2 vs TP=1 with graphs, a rank killed, prefill TP=1 -> decode TP=2 over cuda_ipc)
#              with their tracebacks
#   tp_bench   decode step times at TP=1 and TP=2, NCCL and symmetric-memory sums (benchmarks/engine/bench_tp.py)
#   warm_check pdserve with and without the start-up warm-up (one GPU each, at once), each measured twice in a row
#   tp_sbs     vLLM -tp 2, then pdserve -tp 2, dummy Qwen3-8B bf16 (1024/1024 c256, 8192/16), measured by vLLM's
#              client (SBS_CLIENTS="vllm pdserve": then also by pdserve's)
#   pd_ahead   1P1D handover and TTFT at 8k and 32k with --kv-push-ahead on and off
#   moe_tune   the fused MoE tile table for Qwen3-30B-A3B's experts, tuned on both GPUs at once and merged
#   interfere  decoders' TPOT alone and under a stream of 32k prompts, vLLM and pdserve arms of --max-long-prefill-tokens
#              (INTERF_ARMS="pd-vllm pd-pdserve": 1P1D deployments of both on both GPUs)
#   unpack     the staging tar (.stage/c0..c9, one part carried per call) joined into .vllm-stage; vLLM installed
#   mem_tests  the KV sizing GPU tests, on GPU 0
#   lib_tests  the GPU tests of the library prefill and of the start-up warm-up, on GPU 0
#   pd_one     PD_MODE=pd-pdserve or pd-vllm: one 1P1D deployment, 1024/1024 c256 and 8192/16, vLLM's client
#   pd_itl     (written in session 34, not yet run) why pdserve's p99 inter-token latency in 1P1D rose from 28 ms
#              (session 26) to 40-42 ms (session 33): `pdserve serve --prefill 1 --decode 1` with each instance's
#              engine stats line every 2 s (pdlogs/decode0.log.gz: steps/s, ms a step and how much of it waited for the
#              GPU, running, KV use), vLLM's client at 1024/1024 c256 with --save-detailed, compacted to each
#              request's long gaps in its own time (compact_detail.py: >= 1.5x the median gap); into pd-pdserve.tgz
#   pd_policy  1P1D with the router's local-prefill fallback as shipped and off (always remote), pdserve's client;
#              GC_PROBE=1: every process logs its garbage-collection pauses
#   attn_sweep the decode attention tile sweep (bf16 and fp8 pools, 64- to 256-key tiles)
#   moeclients dummy Qwen3-30B-A3B with --kv-cache-dtype fp8 side by side (vLLM with FLASH_ATTN), each server measured
#              by vLLM's client and then by pdserve's (`pdserve bench serve`), back to back
set -uo pipefail
STAGE=${1:?stage}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
W="$OUT/$STAGE"; mkdir -p "$W"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$W/pip.txt" 2>&1 || echo "editable install failed"
nvidia-smi -L > "$W/gpus.txt" 2>&1
t0=$(date +%s)
SBS="benchmarks/vs_vllm/side_by_side.sh"
transport_wheels() {  # Mooncake's .deb libraries unpacked and its wheel, NIXL's wheels (nx0 + nx1 joined), under /tmp
  mkdir -p /tmp/mcroot && for f in .mc/*.deb; do dpkg -x "$f" /tmp/mcroot; done
  export LD_LIBRARY_PATH="/tmp/mcroot/usr/lib/x86_64-linux-gnu:/tmp/mcroot/usr/lib/x86_64-linux-gnu/libibverbs:${LD_LIBRARY_PATH:-}"
  # the Mooncake wheel: whole in .mc, or in two parts (.mc/mcpart00, .mc1/mcpart01) where the tree leaves less room
  mkdir -p /tmp/mcw && cp .mc/*.whl /tmp/mcw/ 2>/dev/null
  [ -f .mc/mcpart00 ] && cat .mc/mcpart00 .mc1/mcpart01 \
    > /tmp/mcw/mooncake_transfer_engine_cuda13-0.3.14-cp312-cp312-manylinux_2_28_x86_64.whl
  mkdir -p /tmp/nixlw; cp .vllm-stage/nixl/*.whl /tmp/nixlw/ 2>/dev/null
  [ -f .vllm-stage/nx0/nxpart00 ] && cat .vllm-stage/nx0/nxpart00 .vllm-stage/nx1/nxpart01 \
    > /tmp/nixlw/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
}
case $STAGE in
  engine)
    timeout 300 python3 benchmarks/engine/async_check.py --model qwen3-8b --out "$W/async_check.json" 2>&1 \
      | grep -v " INFO " | tail -8
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_async_scheduling.py \
      tests/ops/test_attention_decode.py tests/ops/test_fp8_kv.py 2>&1 | tee "$W/gpu_tests.txt" | tail -4 ;;
  sbs)
    WORKLOADS=${SBS_WORKLOADS:-"1024:1024:512:256 8192:16:16:1"} CLIENTS="${SBS_CLIENTS:-vllm pdserve}" CLIENT_ROUNDS=${SBS_ROUNDS:-2} \
      OUT=$W STAGE=.vllm-stage \
      VLLM_USE_FLASHINFER_SAMPLER=0 timeout 560 bash $SBS single 2>&1 | tail -40
    for f in "$W"/*.log; do gzip -f "$f"; done
    tar czf "$OUT/sbs.tgz" -C "$OUT" sbs ;;
  moe)
    WORKLOADS="1024:1024:512:256 8192:16:16:1" MODEL=.vllm-stage/model-moe VLLM_ARGS="--kv-cache-dtype fp8 --attention-backend FLASH_ATTN" \
      PDSERVE_ARGS="--kv-cache-dtype fp8" OUT=$W STAGE=.vllm-stage VLLM_USE_FLASHINFER_SAMPLER=0 \
      timeout 560 bash $SBS single 2>&1 | tail -25
    tar czf "$OUT/moe.tgz" -C "$OUT" moe ;;
  tp_tests)
    # the two files at once (each engine of theirs is small; 32 cores); SIGINT at the limit makes pytest print the
    # failures it has (SIGTERM prints nothing)
    # (with the KV transfer's GPU tests: VMM pools and cuda_ipc/nccl between processes that see one GPU each)
    for t in tests/disagg/test_pd_tp_gpu.py tests/parallel/test_tp_gpu.py "tests/kv/test_kv_vmm.py tests/kv/test_kv_cuda.py"; do
      timeout -s INT -k 20 ${TEST_LIMIT:-330} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
        --durations=8 $t > "$W/gpu_tests_$(basename ${t%% *} .py).txt" 2>&1 &
    done
    wait
    for f in "$W"/gpu_tests_*.txt; do echo "== $f"; tail -40 "$f"; done
    tar czf "$OUT/tp_tests.tgz" -C "$OUT" tp_tests ;;
  tp_bench)
    echo "== TP step times: TP=1, TP=2 with NCCL sums, TP=2 with symmetric-memory sums"
    timeout 500 python3 benchmarks/engine/bench_tp.py --model qwen3-8b --load-format dummy --all-reduce nccl,symm_mem \
      --iters 20 --timeout 200 --out "$W/tp_qwen3-8b.json" > "$W/bench_tp.txt" 2>&1
    grep -v " INFO " "$W/bench_tp.txt" | tail -16
    tar czf "$OUT/tp_bench.tgz" -C "$OUT" tp_bench ;;
  warm_check)
    # the start-up warm-up's effect: pdserve --warmup on GPU 0 and --no-warmup on GPU 1 at once, dummy Qwen3-8B
    # (.vllm-stage/model: its config and tokenizer), each measured twice in a row by pdserve's client (1024/1024
    # c256; another seed each time, so the second run gets no prefix-cache hits from the first)
    M=.vllm-stage/model; S=""; B=""
    for g in 0 1; do
      flag=$([ $g = 0 ] && echo --warmup || echo --no-warmup)
      # a Triton cache each: the warmed server's compiled kernels must not serve the other's first requests
      CUDA_VISIBLE_DEVICES=$g TRITON_CACHE_DIR=/tmp/triton_cache_$g pdserve serve --model $M --load-format dummy \
        --max-model-len 4096 $flag \
        --served-model-name qwen3-dummy --port 820$g > "$W/server_$g.log" 2>&1 & S="$S $!"
    done
    for g in 0 1; do
      for i in $(seq 240); do curl -sf localhost:820$g/health > /dev/null && break; sleep 1; done
      echo "GPU $g: answering after $i s"
    done
    for g in 0 1; do
      ( for seed in 1 2; do
          timeout 200 pdserve bench serve --backend vllm --base-url http://127.0.0.1:820$g --model qwen3-dummy \
            --tokenizer $M --dataset-name random --random-input-len 1024 --random-output-len 1024 --num-prompts 512 \
            --max-concurrency 256 --ignore-eos --seed $seed --num-warmups 2 --disable-tqdm --no-plots --save-result \
            --result-dir "$W" --result-filename "gpu${g}_run$seed.json" > "$W/gpu${g}_run$seed.txt" 2>&1
        done ) & B="$B $!"
    done
    wait $B
    for f in "$W"/gpu*_run*.json; do python3 benchmarks/vs_vllm/compare.py --line "$f"; done
    grep -h "warm-up\|engine ready\|KV sizing" "$W"/server_*.log
    kill $S 2>/dev/null; sleep 3; gzip -f "$W"/*.log
    tar czf "$OUT/warm_check.tgz" -C "$OUT" warm_check ;;
  tp_sbs)
    WORKLOADS=${SBS_WORKLOADS:-"1024:1024:512:256 8192:16:16:1"} CLIENTS=${SBS_CLIENTS:-vllm} TP=2 OUT=$W STAGE=.vllm-stage \
      VLLM_USE_FLASHINFER_SAMPLER=0 timeout 560 bash $SBS tp 2>&1 | tail -25
    for f in "$W"/*.log; do gzip -f "$f"; done
    tar czf "$OUT/tp_sbs.tgz" -C "$OUT" tp_sbs ;;
  pd)
    WORKLOADS="1024:1024:512:256 8192:16:16:1" OUT=$W STAGE=.vllm-stage timeout 560 bash $SBS pd-pdserve pd-vllm \
      2>&1 | tail -25 ;;
  verify_xfer)
    S=.vllm-stage; transport_wheels
    echo "== 2-GPU tests"
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kv tests/disagg tests/parallel 2>&1 \
      | tee "$W/gpu_tests_2gpu.txt" | grep -v "^\.*$" | tail -12
    echo "== transfer table"
    RUNS="cuda_ipc all_transports nccl_memcheck cuda_ipc_isolated_vmm nccl_isolated nixl_anchor" \
      NIXL_ANCHOR=$S/anchors/nixl_kv_transfer.py NIXL_WHEELS=/tmp/nixlw MOONCAKE_WHEELS=/tmp/mcw OUT=$W/transfer \
      timeout 330 bash benchmarks/transfer/run_2xh200.sh 2>&1 | grep -E "^(===|write|read|single|\[|machine)" | tail -40
    tar czf "$OUT/verify_xfer.tgz" -C "$OUT" verify_xfer ;;
  verify_pd)
    H="python3 benchmarks/router/pd_handover.py --model qwen3-8b --load-format dummy --max-model-len 33024"
    echo "== 1P1D handover, every GPU visible (the docs' run)"
    timeout 230 $H --prompt-lens 1024 8192 32768 --num-requests 8 --out "$W/pd_handover.json" > "$W/pd_handover.txt" 2>&1
    tail -6 "$W/pd_handover.txt"
    echo "== 1P1D handover, each instance sees only its own GPU (CUDA_VISIBLE_DEVICES)"
    timeout 110 $H --prompt-lens 8192 --num-requests 6 --launcher-args=--isolate-gpus \
      --out "$W/pd_handover_isolated.json" > "$W/pd_handover_isolated.txt" 2>&1
    tail -4 "$W/pd_handover_isolated.txt"
    echo "== 1P1D handover, fp8 KV cache"
    timeout 110 $H --prompt-lens 8192 --num-requests 6 "--instance-args=--kv-cache-dtype fp8" \
      --out "$W/pd_handover_fp8.json" > "$W/pd_handover_fp8.txt" 2>&1
    tail -4 "$W/pd_handover_fp8.txt"
    if [ "${PD_XFER:-1}" = 1 ]; then  # the cuda_ipc rows of the transfer table (no wheels needed), same machine
      echo "== cuda_ipc transfer: every GPU visible, and each process seeing only its own"
      RUNS="cuda_ipc cuda_ipc_isolated_vmm" OUT=$W/transfer timeout 150 bash benchmarks/transfer/run_2xh200.sh 2>&1 \
        | grep -E "^(===|write|read|single|\[|machine|cuda)" | tail -20
    fi
    tar czf "$OUT/verify_pd.tgz" -C "$OUT" verify_pd ;;
  moeclients)
    WORKLOADS="1024:1024:512:256 8192:16:16:1" CLIENTS="vllm pdserve" MODEL=.vllm-stage/model-moe \
      VLLM_ARGS="--kv-cache-dtype fp8 --attention-backend FLASH_ATTN" PDSERVE_ARGS="--kv-cache-dtype fp8" OUT=$W VLLM_USE_FLASHINFER_SAMPLER=0 \
      STAGE=.vllm-stage timeout 540 bash $SBS single 2>&1 | tail -25
    tar czf "$OUT/moeclients.tgz" -C "$OUT" moeclients ;;
  transfer)
    S=.vllm-stage; transport_wheels
    NIXL_WHEELS=/tmp/nixlw MOONCAKE_WHEELS=/tmp/mcw OUT=$W timeout 420 bash benchmarks/transfer/run_2xh200.sh 2>&1 | tail -40
    echo "== PD GPU tests"
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kv tests/disagg tests/parallel 2>&1 \
      | tee "$W/gpu_tests_pd.txt" | grep -v "^\.*$" | tail -15 ;;
  pd_ahead)
    # push-ahead on (the default) and off: 1P1D handover and TTFT at 8k and 32k tokens (8k-token chunks: a 32k
    # prompt's first three chunks go ahead)
    H="python3 benchmarks/router/pd_handover.py --model qwen3-8b --load-format dummy --max-model-len 33024"
    for mode in ahead after; do
      args=$([ $mode = after ] && echo "--instance-args=--no-kv-push-ahead" || echo "")
      echo "== push $mode"
      timeout 280 $H --prompt-lens 8192 32768 --num-requests 6 $args --out "$W/pd_$mode.json" > "$W/pd_$mode.txt" 2>&1
      tail -5 "$W/pd_$mode.txt"
    done
    tar czf "$OUT/pd_ahead.tgz" -C "$OUT" pd_ahead ;;
  moe_tune)
    # the fused MoE tiles of dummy Qwen3-30B-A3B's experts (E=128, N=768, K=2048, top-8, bf16): small token buckets
    # on GPU 0 and large ones on GPU 1 at once, each into its own file, merged into the table pdserve looks up
    # (the merged file lands under $OUT: copy it to pdserve/ops/configs/fused_moe/)
    CUDA_VISIBLE_DEVICES=0 timeout 540 python3 benchmarks/moe/tune_fused_moe.py --tokens 1 2 4 8 16 24 32 48 64 96 \
      128 192 --max-minutes 7.5 --out "$W/part0.json" > "$W/tune0.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 540 python3 benchmarks/moe/tune_fused_moe.py --tokens 4096 3072 2048 1536 1024 \
      768 512 384 256 --max-minutes 7.5 --out "$W/part1.json" > "$W/tune1.txt" 2>&1 &
    wait
    tail -n 14 "$W"/tune0.txt "$W"/tune1.txt
    python3 - "$W" <<'PY'
import json, sys
from pathlib import Path
from pdserve.ops.fused_moe_config import config_file_name
import torch
w = Path(sys.argv[1])
parts = [json.loads(p.read_text()) for p in sorted(w.glob("part*.json"))]
table = {**parts[0], "configs": {}, "tuning": {}}
for p in parts:
    table["configs"].update(p["configs"]); table["tuning"].update(p["tuning"])
table["configs"] = dict(sorted(table["configs"].items(), key=lambda kv: int(kv[0])))
table["tuning"] = dict(sorted(table["tuning"].items(), key=lambda kv: int(kv[0])))
k = table["key"]
name = config_file_name(k["E"], k["N"], k["K"], getattr(torch, k["dtype"]), k["device"])
(w / name).write_text(json.dumps(table, indent=1))
print("merged", len(table["configs"]), "buckets ->", name)
PY
    tar czf "$OUT/moe_tune.tgz" -C "$OUT" moe_tune ;;
  attn_sweep)
    # the split-K decode kernel's tiles (now with 256-key tiles) for bf16 and fp8 pools, GPU 0
    timeout 500 python3 benchmarks/attention/sweep_decode.py --out "$W/decode_sweep.json" 2>&1 | tail -12
    tar czf "$OUT/attn_sweep.tgz" -C "$OUT" attn_sweep ;;
  interfere)
    # decoding requests' TPOT under a stream of long prompts (benchmarks/vs_vllm/interference.sh): vLLM on GPU 0, the
    # pdserve arms (--max-long-prefill-tokens) one after the other on GPU 1; vLLM installed by unpack;
    # INTERF_ARMS="pd-vllm pd-pdserve": the same through 1P1D deployments on both GPUs (vLLM with NIXL, then pdserve)
    OUT=$W STAGE=.vllm-stage ARMS="${INTERF_ARMS:-vllm pdserve:0 pdserve:2048 pdserve:1024}" \
      timeout ${INTERF_LIMIT:-560} bash benchmarks/vs_vllm/interference.sh 2>&1 | tail -20
    tar czf "$OUT/interfere.tgz" -C "$OUT" interfere ;;
  lib_tests)
    # the GPU tests of the library prefill (cuDNN against the torch reference, from MIN_CHUNK tokens on a prefix) and of
    # the start-up warm-up (nothing compiled after it), on GPU 0
    CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_LIMIT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
      tests/ops/test_library_prefill.py tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" \
      | cut -c1-900 | tail -8 ;;
  mem_tests)
    # the KV sizing GPU tests (the largest steps beside the sized pool), on GPU 0
    CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_LIMIT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
      tests/engine/test_memory_profile.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -8
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  unpack)
    # the staging tar, carried in parts one per call (.stage/cNN/partNN, names that sort in order; session 25: the
    # tree left ~40 MB a call, session 31: ~33 MB, so eleven parts of 31 MB, c00..c10, without the NIXL wheels that
    # only the PD stages need; session 33: twelve of 31.2 MB, c00..c11, with them), joined and unpacked into
    # .vllm-stage; vLLM installed into /tmp/site (kept while warm)
    cat .stage/c*/part* | tar x && rm -rf .stage && du -sh .vllm-stage/*
    OUT=/tmp/sbs_install STAGE=.vllm-stage bash $SBS 2>&1 | tail -3
    PYTHONPATH=/tmp/site python3 -c "import vllm, nixl; print('vllm', vllm.__version__)" 2>&1 | tail -1 ;;
  pd_one)
    # one 1P1D deployment (PD_MODE: pd-pdserve or pd-vllm) a call, vLLM's client, 1024/1024 c256 and 8192/16 one
    # at a time; the folder comes back as $OUT/<mode>.tgz (more than 8 files), its summary lines on stdout
    R=/tmp/res/${PD_MODE:?PD_MODE}; mkdir -p $R
    WORKLOADS=${PD_WORKLOADS:-"1024:1024:512:256 8192:16:16:1"} OUT=$R STAGE=.vllm-stage \
      timeout ${PD_LIMIT:-540} bash $SBS $PD_MODE 2>&1 | tail -12
    rm -f $R/pdlogs/deployment-secret  # the launcher's secret for this deployment: not a result
    for f in $R/*.log $R/pdlogs/*.log; do [ -f "$f" ] && gzip -f "$f"; done
    cp "$W"/gpus.txt $R/ 2>/dev/null; tar czf "$OUT/$PD_MODE.tgz" -C /tmp/res $PD_MODE ;;
  pd_itl)
    # pd_one's deployment and client, with the instances' stats lines and the client's long gaps kept
    PD_MODE=pd-pdserve PD_WORKLOADS="1024:1024:512:256" PDSERVE_ARGS="--log-stats-interval 2" DETAILED=1 \
      OUT=$OUT bash "$0" pd_one ;;
  pd_policy)
    # `pdserve serve --prefill 1 --decode 1` with the router's local-prefill fallback as shipped (a prefill instance
    # with more than --prefill-max-waiting-tokens queued takes no new prompt: the decode instance prefills it) and
    # with it off (every prompt prefilled remotely, as vLLM's proxy does); pdserve's client (no vLLM staged:
    # carry .vllm-stage/model alone), 1024/1024 c256; the router's counters of local prefills after each arm
    M=.vllm-stage/model; R=/tmp/res/pd_policy; mkdir -p $R
    # PD_ARMS: "shipped" runs the default of the tree (since session 25: no limit), "limit" the old 32768, "always"
    # an explicit no-limit, "nofreeze" the shipped one with PDSERVE_GC_FREEZE=0
    for arm in ${PD_ARMS:-shipped always}; do
      extra=""; [ $arm = always ] && extra="--prefill-max-waiting-tokens 1000000000"
      [ $arm = limit ] && extra="--prefill-max-waiting-tokens 32768"
      # "nofreeze": the shipped deployment with its processes' start-up heaps left to the collector (pdserve.gc_heap)
      nofreeze=""; [ $arm = nofreeze ] && nofreeze="env PDSERVE_GC_FREEZE=0"
      # GC_PROBE=1: every process of the deployment logs its garbage collector's pauses (benchmarks/debug/gc_probe)
      probe=""; [ "${GC_PROBE:-0}" = 1 ] && probe="env PYTHONPATH=$PWD/benchmarks/debug/gc_probe GC_PROBE_DIR=$R/gc_$arm"
      T0=$(date +%s)
      $probe $nofreeze pdserve serve --model $M --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
        --served-model-name qwen3-dummy --prefill 1 --decode 1 --port 8000 --log-dir $R/logs_$arm $extra \
        > $R/serve_$arm.log 2>&1 & pid=$!
      ok=0
      for i in $(seq 300); do
        curl -sf -m 10 localhost:8000/v1/completions -H 'Content-Type: application/json' \
          -d '{"model": "qwen3-dummy", "prompt": "t1 t2 t3", "max_tokens": 2}' > /dev/null && { ok=1; break; }
        kill -0 $pid 2>/dev/null || break; sleep 1
      done
      echo "== $arm: answering after $(( $(date +%s) - T0 )) s (ok=$ok)"
      [ $ok = 1 ] && timeout 200 pdserve bench serve --backend vllm --base-url http://127.0.0.1:8000 --model qwen3-dummy \
        --tokenizer $M --dataset-name random --random-input-len 1024 --random-output-len 1024 --num-prompts 512 \
        --max-concurrency 256 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
        --num-warmups 2 --seed 0 --disable-tqdm --no-plots --save-result --result-dir $R \
        --result-filename $arm.json > $R/bench_$arm.txt 2>&1
      rm -f $R/$arm.pdserve.json
      python3 benchmarks/vs_vllm/compare.py --line $R/$arm.json
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: round(d[k], 1) for k in ('duration', 'mean_itl_ms', 'median_itl_ms', 'p99_itl_ms', 'median_ttft_ms')})" $R/$arm.json
      curl -s -m 10 localhost:8000/metrics | grep -E "^pdserve:router_(local_prefill|requests|kv_transfers)" \
        | tee $R/router_metrics_$arm.txt
      kill $pid; for i in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
      pkill -9 -f "pdserve.server" 2>/dev/null; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null; sleep 2
    done
    rm -f $R/logs_*/deployment-secret; for f in $R/*.log $R/logs_*/*.log; do [ -f "$f" ] && gzip -f "$f"; done
    tar czf "$OUT/pd_policy.tgz" -C /tmp/res pd_policy ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
echo "stage $STAGE took $(( $(date +%s) - t0 )) s"
