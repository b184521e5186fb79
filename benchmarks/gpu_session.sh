#!/usr/bin/env bash
# One device call per stage on a lent GPU machine, written before the lease (a machine goes back 30 s after a call
# ends). Run from the repository root there:
#   PDSERVE_GIT_COMMIT=<sha> OUT=$OUT bash benchmarks/gpu_session.sh STAGE
# Stages:
#   gpu_tests     every gpu-marked test of the engine, kernels, models and KV copies (pytest-xdist, 8 workers;
#                 TESTS=<paths> for a part of them)
#   engine_bench  engine step times vs floors (dummy Qwen3-8B), a decode-step profile, the attention kernels vs
#                 their floors and SDPA, the fused MoE at Qwen3-30B-A3B shapes (one GPU)
#   pd            1P1D handover latency and TTFT (2 GPUs), the PD GPU tests
# Each stage writes its logs and JSON under $OUT/<stage>/ and packs them as $OUT/<stage>.tgz (few files come back).
set -uo pipefail
STAGE=${1:?stage}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
W="$OUT/$STAGE"; mkdir -p "$W"
python -m pip install -q --no-deps --no-build-isolation -e . > "$W/pip.txt" 2>&1 || echo "editable install failed"
nvidia-smi -L > "$W/gpus.txt"; nvidia-smi topo -m >> "$W/gpus.txt" 2>&1
pack() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" "$STAGE"; }
trap pack EXIT
t0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - t0) )); }
case $STAGE in
  gpu_tests)
    timeout "$(left)" python -m pytest -q -m gpu -n 8 --dist loadfile -p no:cacheprovider --durations 15 \
      ${TESTS:-tests/ops tests/engine tests/model tests/kv/test_kv_cuda.py} ${EXTRA_TESTS:-} 2>&1 | tee "$W/gpu_tests.txt" \
      | grep -v "^\.*$" | tail -60
    ;;
  engine_bench)
    echo "== engine steps vs floors (dummy qwen3-8b)"
    timeout 270 python benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy \
      --out "$W/steps_qwen3-8b.json" 2>&1 | tee "$W/steps.txt" | grep -v " INFO " | tail -28
    echo "== decode step profile, batch 256"
    timeout 100 python benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy \
      --profile decode:256x1024 --top 15 --out "$W/profile_d256.json" 2>&1 | tee "$W/profile.txt" \
      | grep -v " INFO " | tail -22
    echo "== attention kernels"
    timeout "$(( $(left) - 70 ))" python benchmarks/attention/bench_attention.py --out "$W/attention_qwen3-8b.json" \
      2>&1 | tee "$W/attention.txt" | tail -40
    echo "== fused MoE (default configs)"
    timeout "$(left)" python benchmarks/moe/bench_fused_moe.py --defaults --out "$W/fused_moe_defaults.json" 2>&1 \
      | tee "$W/fused_moe.txt" | tail -16
    ;;
  pd)
    echo "== PD GPU tests (2 GPUs)"
    timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/kv tests/disagg tests/parallel 2>&1 \
      | tee "$W/gpu_tests_pd.txt" | grep -v "^\.*$" | tail -20
    echo "== PD handover and TTFT (1P1D on GPU 0 and 1)"
    timeout "$(left)" python benchmarks/router/pd_handover.py --model qwen3-8b --load-format dummy \
      --max-model-len 33024 --prompt-lens 1024 8192 32768 --num-requests 12 --out "$W/pd_handover.json" 2>&1 \
      | tee "$W/pd_handover.txt" | grep -v INFO | tail -20
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
echo "stage $STAGE took $(( $(date +%s) - t0 )) s"
