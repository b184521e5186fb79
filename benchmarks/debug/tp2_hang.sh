export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TP_RUN_LOG=INFO NCCL_DEBUG=WARN
mkdir -p $OUT/diag; python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
CFG='{"model":"qwen3-0.6b","load_format":"dummy","device":"cuda","dtype":"float32","num_gpu_blocks":512,"max_num_batched_tokens":96,"max_num_seqs":8,"max_model_len":2048,"tensor_parallel_size":2}'
python3 benchmarks/debug/run_with_stacks.py 100 -- python3 -m tests.parallel.tp_run run "$CFG" /tmp/tp2.pt > $OUT/diag/tp2.txt 2>&1; echo "tp2 rc=$?"
grep -v "^\s*$" $OUT/diag/tp2.txt | tail -150
