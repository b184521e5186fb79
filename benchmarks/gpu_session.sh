#!/usr/bin/env bash
# One lease, several stages: the GPU measurements of every issue, packed so each device call returns one
# archive. Run from the repository root on the lent machine:
#   PDSERVE_GIT_COMMIT=<sha> OUT=$OUT bash benchmarks/gpu_session.sh STAGE
# STAGE: tests_engine_transfer (2 GPUs) | server_pd (2 GPUs) | server_search or search (1 GPU)
# Every stage writes its JSON files and logs into $OUT/<stage>/ and packs them as $OUT/<stage>.tgz.
set -uo pipefail
STAGE=${1:?stage}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
W="$OUT/$STAGE"; mkdir -p "$W"
python -m pip install -q --no-deps --no-build-isolation -e . > "$W/pip.txt" 2>&1 || echo "editable install failed; using PYTHONPATH"
nvidia-smi -L > "$W/gpus.txt"; nvidia-smi topo -m >> "$W/gpus.txt" 2>&1
pack() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" "$STAGE"; }
trap pack EXIT
case $STAGE in
  tests_engine_transfer)
    echo "== GPU tests"
    timeout 240 python -m pytest -q -m gpu --continue-on-collection-errors tests 2>&1 | tee "$W/gpu_tests.txt" | tail -15
    echo "== engine (dummy qwen3-8b, GPU 0)"
    CUDA_VISIBLE_DEVICES=0 timeout 300 python benchmarks/engine/bench_engine.py --out "$W/engine_qwen3-8b.json" \
      2>&1 | tee "$W/engine.txt" | grep -v INFO | tail -14
    echo "== transfer (2 GPUs)"
    NIXL_WHEELS=${NIXL_WHEELS:-} OUT="$W/transfer" timeout 400 bash benchmarks/transfer/run_2xh200.sh 2>&1 \
      | tee "$W/transfer.txt" | tail -30
    ;;
  server_pd)
    echo "== GPU tests"
    timeout 200 python -m pytest -q -m gpu --continue-on-collection-errors tests 2>&1 | tee "$W/gpu_tests.txt" | tail -6
    echo "== server decode step vs engine step (GPU 0)"
    CUDA_VISIBLE_DEVICES=0 timeout 330 python benchmarks/server/decode_step.py --model qwen3-8b --load-format dummy \
      --batch 256 --out "$W/decode_step_qwen3-8b.json" 2>&1 | tee "$W/decode_step.txt" | grep -v INFO | tail -12
    echo "== PD handover and TTFT (1P1D on GPU 0 and 1)"
    timeout 300 python benchmarks/router/pd_handover.py --model qwen3-8b --load-format dummy --max-model-len 33024 \
      --prompt-lens 1024 8192 32768 --num-requests 12 --out "$W/pd_handover.json" 2>&1 | tee "$W/pd_handover.txt" \
      | grep -v INFO | tail -20
    ;;
  server_search)
    echo "== server decode step vs engine step (GPU 0)"
    CUDA_VISIBLE_DEVICES=0 timeout 240 python benchmarks/server/decode_step.py --model qwen3-8b --load-format dummy \
      --batch 256 --out "$W/decode_step_qwen3-8b.json" 2>&1 | tee "$W/decode_step.txt" | grep -v INFO | tail -12
    ;&
  search)
    echo "== SLO search (dummy qwen3-8b, GPU 0)"
    CUDA_VISIBLE_DEVICES=0 python -m pdserve.cli serve --model qwen3-8b --load-format dummy --port 8000 \
      --max-model-len 4096 > "$W/server.log" 2>&1 &
    SP=$!
    for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
    OUT="$W" timeout 450 bash benchmarks/serve/search_h200.sh http://127.0.0.1:8000 2>&1 | tee "$W/search.txt" | tail -25
    kill -INT $SP; wait $SP
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
