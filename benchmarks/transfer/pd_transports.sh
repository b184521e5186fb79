#!/usr/bin/env bash
# The transports PD instances can choose (--kv-transport), side by side on one host with 2 GPUs (written for 2xH200):
#   1. `pdserve bench transfer --transport all`: the KV of 8192 tokens of Qwen3-8B in 16-token blocks (512 blocks,
#      random block ids on both sides), WRITE and READ and single-block latency over every transport both processes
#      offer (tcp, cuda_ipc, nixl when importable, mooncake when importable, nccl), the peer-copy ceiling interleaved;
#   2. the memory check: 256 handovers of those 8192 tokens in flight at once over nccl, each process's peak GPU
#      memory before and during (fails if either grew by one handover's bytes: nccl moves straight between the pools).
# One JSON per run under $OUT (all_transports.json, nccl_memcheck.json) with its console output beside it
# (*.txt), then a summary table. Exit status: non-zero when a run failed (a checksum mismatch or memory growth too).
#   usage: OUT=/some/dir bash benchmarks/transfer/pd_transports.sh
# Optional: MOONCAKE_WHEELS=<folder with the mooncake-transfer-engine(-cuda13) wheel> installs it first (Mooncake
# then runs over its own TCP unless MOONCAKE_PROTOCOL=rdma); NIXL_WHEELS likewise for NIXL. A transport that cannot
# start in these processes is listed in the JSON's transports_skipped with the reason, never silently dropped.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-benchmarks/transfer/results}"
mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
for w in MOONCAKE NIXL; do
  dir_var="${w}_WHEELS"
  if [ -n "${!dir_var:-}" ]; then
    python -m pip install --no-deps --no-index "${!dir_var}"/*.whl > "$OUT/${w,,}_install.txt" 2>&1 \
      || echo "$w install failed (see ${w,,}_install.txt)"
  fi
done
# NVLink multicast off (NVLS): NCCL's communicators in the nccl transport must not ask the fabric for it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if command -v pdserve > /dev/null 2>&1; then BENCH=(pdserve bench transfer); else BENCH=(python -m pdserve.cli bench transfer); fi
W=(--model-config qwen3-8b --tokens 8192 --block-size 16 --layout random --devices cuda:0,cuda:1
   --kv-protocol "${MOONCAKE_PROTOCOL:-tcp}" --result-dir "$OUT")
failed=0
run() {  # name, then bench arguments; a failing run is reported and the next one still runs
  local name=$1; shift
  echo "=== $name: ${BENCH[*]} ${W[*]} $*"
  timeout 600 "${BENCH[@]}" "${W[@]}" "$@" --result-filename "$name.json" > "$OUT/$name.txt" 2>&1
  local rc=$?
  tail -20 "$OUT/$name.txt"
  if [ "$rc" -ne 0 ]; then echo "=== $name FAILED (exit $rc; see $OUT/$name.txt)"; failed=1; fi
}
run all_transports --transport all --ops write,read --iters 10 --warmup 2 --latency-iters 50
run nccl_memcheck --transport nccl --memcheck 256 --warmup 2
python benchmarks/transfer/summarize.py "$OUT" || failed=1
python - "$OUT" <<'EOF'
# the memory check's numbers in one line per process (peak before vs during, from the JSON)
import json, sys
from pathlib import Path
p = Path(sys.argv[1]) / "nccl_memcheck.json"
if p.exists():
    m = json.loads(p.read_text()).get("memcheck", {})
    for side, s in m.get("sides", {}).items():
        print(f"memcheck {side}: {json.dumps(s)}")
    print(f"memcheck: {m.get('transfers_in_flight')} x {m.get('bytes_per_transfer', 0) / 1e9:.3f} GB over "
          f"{m.get('transport')} in {m.get('seconds', float('nan')):.2f} s")
EOF
exit "$failed"
