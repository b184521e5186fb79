#!/usr/bin/env bash
# KV transfer engine on one host with 2 GPUs (written for the 2xH200 NV18 machine), in one go (~2 minutes):
#   cuda_ipc WRITE and READ of the KV of 8192 tokens of Qwen3-8B (512 random 16-token blocks, 1.21 GB) with the
#   peer-copy ceiling measured interleaved in the same run, single-block latency (call -> receiver notified),
#   the other copy engines (Triton kernel, one copy per block) and the coalesced (contiguous) layout for
#   comparison, tcp between the same two GPUs, and NIXL on the same workload when the nixl package is importable
#   (set NIXL_WHEELS=<dir of nixl / nixl_cu13 wheels> to install them first); then Mooncake (MOONCAKE_WHEELS=<dir
#   with the mooncake_transfer_engine_cuda13 wheel>; its TCP unless MOONCAKE_PROTOCOL=rdma) and NCCL on the same
#   workload, every transport in one table (--transport all), the NCCL memory check (256 handovers of 8192 tokens in
#   flight: peak GPU memory before and during), and cuda_ipc / nccl between processes that each see only their own
#   GPU (CUDA_VISIBLE_DEVICES=0 and =1; the pools allocated with pdserve.kv.vmm).
# The transports PD instances choose from, in one table with the nccl memory check: RUNS="all_transports nccl_memcheck".
# Writes one JSON per run into $OUT and prints a summary table (and the pass/fail of the issue's targets) last.
#   usage: OUT=/some/dir bash benchmarks/transfer/run_2xh200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-benchmarks/transfer/results}"
mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
if [ -n "${NIXL_WHEELS:-}" ]; then
  python -m pip install --no-deps --no-index "$NIXL_WHEELS"/*.whl > "$OUT/nixl_install.txt" 2>&1 || echo "nixl install failed (see nixl_install.txt)"
fi
if [ -n "${MOONCAKE_WHEELS:-}" ]; then
  python -m pip install --no-deps --no-index "$MOONCAKE_WHEELS"/*.whl > "$OUT/mooncake_install.txt" 2>&1 || echo "mooncake install failed (see mooncake_install.txt)"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MP="--kv-protocol ${MOONCAKE_PROTOCOL:-tcp}"
W="--model-config qwen3-8b --tokens 8192 --block-size 16 --devices cuda:0,cuda:1"
# RUNS="cuda_ipc nixl ...": only these runs (default: every one); NIXL_ANCHOR=<path of shared/anchors/nixl_kv_transfer.py>:
# NIXL's own block-major run of the same bytes too (nixl_anchor.txt), which summarize.py compares with NIXL via the agent
want() { [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $1 "* ]]; }
run() {  # name, then bench arguments; a failing run is reported and the script goes on
  local name=$1; shift
  want "$name" || return 0
  echo "=== $name: $*"
  timeout 300 python -m pdserve.bench.transfer $W "$@" --result-dir "$OUT" --result-filename "$name.json" 2>&1 | tee "$OUT/$name.txt" | tail -12
}
run cuda_ipc --transport cuda_ipc --iters 30 --warmup 5 --latency-iters 300
run cuda_ipc_kernel --transport cuda_ipc --cuda-copy kernel --ops write,read --iters 15 --latency-iters 100
run cuda_ipc_percopy --transport cuda_ipc --cuda-copy percopy --ops write --iters 10 --latency-iters 0
run cuda_ipc_contiguous --transport cuda_ipc --layout contiguous --ops write --iters 15 --latency-iters 0
run tcp_gpu --transport tcp --iters 5 --warmup 1 --latency-iters 50
if python -c "import importlib.util as u, sys; sys.exit(0 if any(u.find_spec(m) for m in ('nixl_cu13','nixl_cu12','nixl')) else 1)"; then
  run nixl --transport nixl --iters 20 --warmup 3 --latency-iters 100
else
  echo "=== nixl: not importable here (set NIXL_WHEELS to a folder with the nixl wheels to include it)"
fi
run nccl --transport nccl --iters 20 --warmup 3 --latency-iters 100
if python -c "import mooncake.engine" 2>/dev/null; then
  run mooncake --transport mooncake $MP --iters 10 --warmup 2 --latency-iters 50
else
  echo "=== mooncake: not importable here (set MOONCAKE_WHEELS to a folder with the Mooncake wheel to include it)"
fi
run all_transports --transport all $MP --iters 10 --warmup 2 --latency-iters 50
run nccl_memcheck --transport nccl --memcheck 256 --warmup 2
run cuda_ipc_memcheck --transport cuda_ipc --memcheck 256 --warmup 2
run cuda_ipc_isolated_vmm --transport cuda_ipc --isolate-gpus --pool-alloc vmm --iters 20 --warmup 3 --latency-iters 100
run nccl_isolated --transport nccl --isolate-gpus --pool-alloc vmm --iters 10 --warmup 2 --latency-iters 0
if [ -n "${NIXL_ANCHOR:-}" ] && want nixl_anchor; then
  echo "=== nixl_anchor: $NIXL_ANCHOR"
  timeout 300 python "$NIXL_ANCHOR" > "$OUT/nixl_anchor.txt" 2> "$OUT/nixl_anchor.err" || echo "nixl anchor failed (nixl_anchor.err)"
  tail -30 "$OUT/nixl_anchor.txt"
fi
python benchmarks/transfer/summarize.py "$OUT"
