#!/usr/bin/env bash
# A one-GPU lease (nvidia-h200; the 2-GPU kinds withheld): one stage per device call, written before the lease (a
# machine goes back 30 s after a call ends). Staged files as in lease_2xh200.sh (.vllm-stage/{p0..p5,deps,model,
# model-moe,anchors}).
#   OUT=$OUT bash benchmarks/lease_1gpu.sh STAGE
# A stage is kept as it ran, the record of its folder under benchmarks/lease_sNN; the switches of A/Bs that lost were
# removed after them (session 40: rotary.WIDE_TILE, decode.EARLY_TILE/EARLY_V, decode.SELF_MERGE,
# decode.ROPE_MANY_PROGRAMS), so such a stage runs again only at its recorded tree.
# Stages:
#   warm_test  the GPU test that a burst after the warm-up compiles no kernel (run with a staging call: ~40 s)
#   check      the GPU tests of the engine's newest paths (the KV pool sized from a measured step, async scheduling,
#              decode attention, fp8 KV); then one pdserve server as the side-by-side starts it (dummy Qwen3-8B,
#              --gpu-memory-utilization 0.9): its KV sizing lines, KV tokens and start-up; then the decode attention
#              tile sweep with what is left of the call
#   install    vLLM 0.22 from the staged parts into /tmp/site (kept while the machine stays warm)
#   sbs        vLLM, then pdserve, on the one GPU (SINGLE_GPU=1), dummy Qwen3-8B bf16, vLLM's client: 1024/1024 c256,
#              8192/16 and 32768/16 one at a time
#   steps      engine steps against their floors (bench_steps.py: decode at batch 1 and 256, prefill of one 8k prompt
#              and of eight 1k prompts, mixed steps), a burst of 256 1k prompts through EngineCore.step (the c256
#              client's first wave), the async decode loop; then a kernel profile of the prefill, mixed and batch-1 steps
#   serve_tl   pdserve serve driven by pdserve's client at 1024/1024 c256, then 1024/16 c256 (a burst of prompts with
#              little decoding), each with serve_timeline.py recording the CPU of the server's processes and the
#              engine's queue; the client's per-request TTFTs split into the first wave and the rest; the kernels the
#              server compiled after its warm-up; the GPU test that a burst after the warm-up compiles nothing
#   moe        Qwen3-30B-A3B with an fp8 KV cache, vLLM then pdserve on the one GPU, 1024/1024 c256 (~390 s;
#              SBS_WORKLOADS: others)
#   attn       the prefill attention kernel's GPU tests, then bench_attention.py (bf16: decode 1x8192, prefill 1k/8k/32k)
#              with the prefill tile sweep; the best tiles (--best-out) go to /tmp/prefill_best.json, which the later
#              stages of the lease use (PDSERVE_PREFILL_CONFIG) when they beat the default by more than 2 %
#   steps8k    Qwen3-8B's 8k prefill and decode steps against their floors, the 8k prefill's kernels, and the
#              Qwen3-30B-A3B 8k prefill's kernels (fp8 KV) with what is left of the call
#   newkv      prefill attention reading the step's new K/V from k/v (default) vs all from the pool: the GPU tests of the
#              prefill kernel, fp8 KV and the backend, then bench_attention.py both ways (hk 4 and 8, bf16 and fp8 pools)
#   newkv_steps the same A/B on the 8k prefill step of dummy Qwen3-30B-A3B (fp8 KV) and Qwen3-8B (bench_steps.py)
#   chunks32k  the four 8k chunks of a 32k prompt (dummy Qwen3-8B) against their floors; the last chunk's kernels
#   skinny     the skinny linear kernel's GPU tests; bench_linear.py's tile sweep against cuBLAS on Qwen3-8B's and
#              Qwen3-30B-A3B's projections (1..16 rows); the measured table goes to /tmp/skinny_best.json
#   skinny_steps decode steps of 1..16 rows (dummy Qwen3-8B) with the skinny kernel (the table above) and without,
#              then the batch-1 8k decode step's kernels
#   pdl        GPU tests (skinny linear, PDL bit-identity and graphs vs eager, decode attention, the warm-up compiles
#              nothing); decode steps of dummy Qwen3-8B with PDL early, late and off, then with neither PDL nor the
#              skinny kernel; the batch-1 8k decode step's kernels
#   splits     the decode kernel's split rule on whole steps (dummy Qwen3-8B, bf16 then fp8 KV): today's (2 waves, 256
#              keys a split at least) against 4 waves and 64 keys, alternating twice
#   s13        session 13's one call: the GPU tests of the warm-up (a burst compiles nothing), the KV pool's sizing and
#              decode attention with the split rule's new defaults (4 waves, 64 keys a split); one pdserve server as the
#              side-by-side starts it (KV sizing lines, KV tokens, start-up); then decode steps of dummy Qwen3-8B, the
#              earlier rule (2 waves, 256 keys) and the new one in the order old, new, new, old (drift cancels)
#   loopgap    why the async decode loop at batch 1 and 8k stayed at 4.6 ms a step when the decode graph's step got
#              faster (lease_s13): the loop under the torch profiler (bench_steps.py --profile-loop: the GPU's busy and
#              idle time a step, its longest idle gaps), with the split rule's default and the earlier one
#   s14        the next session's first call (written in session 13, not yet run): the KV sizing GPU tests and one
#              pdserve server's sizing lines (did cuBLAS's early workspace free the 0.61 GiB of cached blocks the probe
#              left?), then the loopgap stage's profile of the async decode loop
#   s14b       session 14's second machine, first call: what keeps 0.55-0.61 GiB of PyTorch's free cached blocks after the
#              KV sizing probe (probe_memory.py: the segments that hold free bytes beside live blocks, and what
#              allocated those), then the same with PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF, free pages go
#              back to the device): the probe, the KV sizing GPU tests, one server's sizing lines, decode steps and the
#              GPU tests of graphs and the warm-up; the sizing GPU tests without it (claim_blas_workspace reverted)
#   s14c       session 14's check of the KV sizing changes (merged projections allocate only their stack, no holes
#              between the weights; the probe's peak counts what the allocator reserved): probe_memory.py, the KV sizing
#              and transformers-agreement GPU tests, one server's sizing lines and KV tokens
#   s15        the next session's first call (written in session 14, not yet run): the KV sizing GPU tests (the failing
#              largest-step case at 0.6 now names the parts of what was in use), then the chunks32k stage (the 32k
#              prompt's 8k chunks against their floors and the last chunk's kernels: 32k TTFT is 1.12-1.19x vLLM's)
#   s16a       the KV sizing test's step peaks, torch's SDPA backends (cuDNN) vs the Triton prefill on 32k chunks,
#              the batch-1 8k decode step's kernels with PDL on
#   s16b       cuDNN for long prefill rows: GPU tests, first calls, 4k chunks, the 32k chunks as engine steps A/B
#   s16c       the library prefill's warm-up: GPU tests, a server's start-up, the first long prompts' TTFT
#   s17a       a batch-256 decode step and a mixed step: steps, kernels, GPU idle time; cuBLAS at 64..2048 rows
#   s17b       the async loop's batch-256 kernels; per-step cases on a zero KV pool and on a random one
#   s17c       the decode kernel's many-program tile and the greedy bf16 argmax: GPU tests, steps and loops A/B
#   s17d       the steady async loop at batch 256 under the profiler: kernels and idle gaps
#   s17e       the session's GPU tests at its final engine code, in four groups
#   s18a       a Triton tile GEMM against cuBLAS at 32..1024 rows (it lost; not in the engine)
#   s18b       the warm-up's mixed step of the many-program decode tile with several splits: GPU tests, a server at 16
#              Poisson requests/s (pdserve's client, twice), the kernels it compiled while serving
#   s18c       cuBLASLt against cuBLAS: the projections at 64..1024 rows, then steps and the loop at batch 256, A/B/A/B
#   s19a       what fusing the norms, SiLU*mul and the KV write away could save at most (--ablate), batch 1 and 256;
#              the projections at 128..512 rows split over K in one batched GEMM against cuBLAS's one product
#   s19b       the norms and SiLU*mul folded into one-row products: GPU tests, then the batch-1 step and loops folded
#              and not, on, off, on, off
#   s19c       the norm's squares summed in the product's own pass: GPU tests, then the batch-1 step and loops with
#              all, none, the norms only, the activation only folded
#   s19d       the activation alone folded into the one-row down projection: GPU tests, batch-1 step and loops A/B x3
#   s19e       (needs commit ea7eeda's tree) the KV write folded into the rotary kernel: GPU tests, batch-1 step and loops
#              at 1 and 256 A/B x2
#   s19f       the session's final engine code: GPU tests, then the batch-1 step and loops folded and not
#   s21a       the library prefill fed leaner: GPU tests, the row old vs new and the 32k chunks as steps; o/down/qkv
#              split over K with float32 parts
#   s21b       the one-pass sampling kernel: tests, the warm-up burst test, the sampler alone, the decode loops at
#              temperature 1 with the kernel and with the torch path
#   s21c_tests the sampling kernel split over programs: tests, warm-up burst, the sampler alone
#   s21c_loops the decode loops at temperature 1, kernel vs torch path, arms $ARMS
#   s22a       o/down split over K, parts summed by the next add+RMSNorm: GPU tests, the table measured, steps and
#              the batch-256 loop at temperature 1 with and without the split (on, off, on, off)
#   s22b       the batch-256 loop at temperature 1 under the profiler with the shipped split table; the loop without
#              and with the split (off, on, off, on)
#   s22c       the sampling kernel with per-lane bests against s21's: tests, the sampler alone, the loops at
#              temperature 1 (new, old, new, old)
#   s22d       the split table on another GPU kind (H100): tests, bench_split_k.py, the batch-256 loop on and off
#   s22e       probes: the batch-256 step's KV read (paged read-only, flat, the decode kernel) and the sampling
#              kernel's launch shapes
#   s22f       the sampling kernel at 8 warps: tests, warm-up burst, the sampler alone; the batch-256 loop with one
#              split (as shipped) and with two (--decode-waves 32), alternating
#   s22g       the session's code against 45e1c9d's (archived untracked under benchmarks/lease_s22/_old/): loops at
#              temperature 1, batch 256 and batch 1 at 8k, alternating
#   s23a       probes: the decode kernel's batch-256 tiles and a persistent flattened-loop variant; which decode
#              products gain from a split over K
#   s23b       GPU tests of the KV write in the rotary kernel; Nsight Compute on the batch-256 decode kernel against
#              the read-only pass
#   s23e       the inverse-CDF sampling kernel: GPU tests, the warm-up burst, the sampler alone
#   s23c       the session's code against de870cd's (archived untracked under benchmarks/lease_s23/_old/): loops at
#              temperature 1, batch 256 and batch 1 at 8k, alternating
#   s23d       the KV write in the rotary kernel on and off (--no-kv-write-early), loops alternating
#   s23f       the decode kernel with the block table read a tile ahead, against the engine's (probe)
#   s23g       the decode kernel with its registers capped (maxnreg), with and without the block table read ahead
#   s23h       decode read-ahead + KV write in the rotary kernel: GPU tests; loops with both and with neither
#   s23i       the batch-256 loop's kernels under the profiler with the session's code
#   s24a       the add+RMSNorm folded into the one-row products around it: GPU tests (the kernels, the engine
#              against transformers, the warm-up burst), then the batch-1 step and loops (8k, 1k) folded and not, on,
#              off, on, off
#   s24b       the batch-1 8k loop's kernels under the profiler with the norm fold (kernels a step, GPU idle)
#   s27a       cuBLASLt's candidate algorithms for the decode products (probe_lt_algos.py) against torch's pick; the
#              steady loops as shipped
#   s28a       the warm-up's GPU tests (a step of 4096 + 1 tokens compiles nothing); a 32k prompt's 2048-token chunks
#              with cuDNN from 2048 tokens and as shipped
#   s28b       chunks of 256-2048 tokens on aligned and unaligned prefixes, cuDNN (MIN_CHUNK 256) against Triton
#   s28c       the merge kernel's one-binary GPU test, with the fix and with it reverted (should fail)
#   s28d       the library prefill's GPU tests; long prompts after the warm-up build no cuDNN plan (plan_watch)
#   s29a       (run in session 29) the one-row products alone (bench_linear sweep at 1 row) and the batch-1 8k loop's kernels
#              under the profiler with PDL off: where the batch-1 step's time above its floor goes
#   moe_tune   the fused MoE tile table for Qwen3-30B-A3B's experts, the buckets a 1024/1024 c256 run and 8k prefill
#              chunks use first (the tuner stops starting buckets after --max-minutes)
#   s29b       the batch-1 loops' kernels by their position in the step (per-layer kinds told apart), PDL off at 8k and
#              32k, then PDL early at 8k
#   s29c       the folded one-row products' own tiles: bench_linear.py --folds, the GPU tests with the measured table,
#              the batch-1 loops with it and without (new, old, new)
#   s30a       (written in session 29, run in session 30) s29c again with every tile also prefetching its next weight tile
#              (bench_linear.py --folds --prefetch; against the fold entries s29c shipped)
#   s29d       (written in session 29, run in session 30) the decode kernel at one row, 8k and 32k: every tile x split
#              count x block-table prefetch (sweep_decode.py)
#   s30b       the decode kernel's first tile read before its PDL wait (decode.EARLY_TILE): the batch-1 loops (8k, 1k)
#              per arm, in order: off, on, on with other few-row tiles, on with fewer splits, off, on
#   s30d       the early tile with K alone (decode.EARLY_V False) against K and V and against off: the graphs'
#              PDL-changes-no-bit test, the engine against transformers and the decode kernel's GPU tests; then the
#              batch-1 loops at 8k and 32k, in order: off, k, kv, off, k, kv
#   s30e       the early tile with K and V at 128 registers a thread against off: batch-1 loops at 8k and 32k (off, kv, off,
#              kv), then the PDL-changes-no-bit graph test with it (as far as S30E_LIMIT allows)
#   s31a       (written in session 30, not yet run) whether serving adds to the batch-1 step: the async loop at 8k
#              (bench_steps.py, --max-model-len 40960 as the server), then `pdserve serve` as the side by side starts it,
#              pdserve's client one request at a time: 8192/16 x 16 (the criterion's workload) and 8192/256 x 4 (steady
#              pace), then the loop again. Carry .vllm-stage/model (the dummy Qwen3-8B's config and tokenizer, 3.5 MB)
#   s31b       (written in session 30, not yet run) the folded down projection alone with PDL off (s29b timed it at 44.6
#              us a launch in the PDL-off loop, against 27.7 us alone with PDL): bench_linear.py --folds --shipped-only
#              with --pdl early, then off; the plain one-row products with PDL off
#   s31c       (written in session 30, not yet run) where the shipped batch-1 step's time goes under PDL: each kernel's
#              marginal time (how far it pushes the GPU's latest end; bench_steps.py's marginal_slots_us) by kind, at 8k
#              and 32k
#   s31d       (written in session 30, not yet run) the decode kernel merging its own splits (decode.SELF_MERGE): its GPU
#              tests with it on, then the batch-1 loops at 8k and 32k, in order off, on, off, on
#   s31e       (written in session 31) the decode kernel taking the layer's QK-norm, rotary and K/V write
#              (decode.ROPE_IN_DECODE, off as written): its kernel GPU tests, the engine's GPU tests with it on (against
#              transformers, graphs' PDL changes no bit, a burst after the warm-up compiles nothing, async); then the
#              loops at 1x8k, 1x32k and 64x2k, one process an arm, in order off, on, on0 (no register limit), off, on, on0
#   s32a       (written in session 31, not yet run) the rotary in the many-program decode launch of a batch-256 step
#              (decode.ROPE_MANY_PROGRAMS, off as shipped): loops at 256x1k and 1x8k, one process an arm, in order off,
#              many (held to ROPE_MAXNREG: ptxas on sm_90 spills 18 bytes), many0 (no limit, 144 registers: 3 programs
#              an SM; the one-row tile unlimited too), twice; then the batch-256 loop's kernels with their marginal
#              times (as s31c at one row)
#   s32b       what the KV sizing probe's peak is made of, and what the engine holds before it beyond the weights
#              (probe_memory.py with the allocator's history from the start: session 31's pool was 109.32 GiB against
#              vLLM's 109.35 on a warm start)
#   s32c       the KV sizing's second probe (a prompt of the model's length alone, its last chunk on the longest
#              prefix, measured in place of library_reserve's bound): probe_memory.py, the KV sizing and warm-up GPU
#              tests, one server's sizing lines, KV blocks and start-up
#   s32d       the engine microbenchmark at the session's tree: bench_steps.py's default cases (decode at 1 and 256
#              rows of ~1k, 1 and 32 of ~8k, the 8k prefill against the matmul ceiling, a mixed step) and its steady
#              loops at temperature 1, dummy Qwen3-8B
#   s33a       (run at 0efacc0, whose decode.HEAD_FIRST and its tests and bench_steps.py switch were taken out after it)
#              the decode kernel's grid heads first: the KV read probe (quick: the paged read's best tiles and the
#              decode kernel, both grid orders) at 12 and 36 layers a block (0.79 and 2.36 MB blocks) with random pages
#              and at 36 with each row's pages in order; the heads-first GPU tests; then loops at 256x1k and 1x8k, one
#              process an arm, in order off, hf, off, hf
#   s33b       a Triton GEMM with TMA loads (bench_tma_linear.py: rows- and weight-major tiles, one program a tile or
#              persistent) against cuBLAS at 256 rows over dummy Qwen3-8B's qkv, o, gate_up and down
#   s34a       the engine's stats line while serving 1024/1024 at c256 (pdserve bench's client, 512 prompts): one
#              `pdserve serve` of dummy Qwen3-8B (carry .vllm-stage/model) with --log-stats-interval 2 and
#              serve_timeline.py beside it (the server processes' CPU); its log says how busy the engine was and how much
#              of a step went to waiting for the GPU (server.log, c256.txt, timeline.txt); then bench_steps.py's default
#              cases and loops, which now print each against its serial bound as well as its floor (steps.txt). Session
#              33's s33c (never run) with serve_timeline.py and bench_steps.py added; s33c is gone
#   s34b       (after `lease_2xh200.sh unpack` of the twelve staged parts in earlier calls of the same machine) vLLM 0.22,
#              then pdserve, on the one GPU, vLLM's client, 1024/1024 c256 (sbs/); then bench_steps.py on the steps
#              such a run is made of (decode at 256 rows on 1k and 2k of context, eight 1k prompts alone and beside
#              256 decodes) with the ceilings that run_bound.py divides the run's work by (steps.txt, steps.json)
#   s35a       (after `lease_2xh200.sh unpack`) vLLM 0.22, then pdserve, on the one GPU, vLLM's client, 8192/16 and
#              32768/16 one at a time, each run between two scrapes of the server's /metrics: what each server measured
#              of its own inter-token latency and TPOT (server_latency.py), beside what vLLM's client did (sbs/)
#   s35c       dummy Qwen3-30B-A3B with an fp8 KV cache (bench_steps.py): decode at 1 and 256 rows, prefill of one 8k
#              prompt and of eight 1k prompts, seven 1k prompts beside 256 decodes, the async loops at 1 and 256 rows,
#              each against its floor and serial bound with each token's top-8 experts counted (steps.txt, steps.json)
#   s35e       (carry .vllm-stage/model-moe) a MoE layer's routing in one Triton launch (pdserve.ops.moe_route) and its
#              rows grouped by one program (moe_align up to ONE_PROGRAM_PAIRS): their GPU tests and the MoE model
#              against transformers on CUDA; bench_route.py (each against the torch / three-kernel way, in CUDA
#              graphs); dummy Qwen3-30B-A3B's steps with both and with neither, arms off, on, off, on; then one
#              `pdserve serve` of it with pdserve's client at 1024/1024 c256 and the kernels it compiled while serving
#   s36b       the decode kernel on an fp8 pool at dummy Qwen3-30B-A3B's heads (32 over 4, d=128) where rows x KV
#              heads fill the many-program waves: its GPU tests (the new fp8 many-program tiles among them), then
#              sweep_decode.py --prefetch at 160-256 rows of 1-2k keys; the best tile with the block table read ahead
#              (geometric mean over the shapes) goes to /tmp/fp8_many_tile.txt; then the MoE GPU tests session 35's
#              limit cut off (CUDA row grouping at 128 experts, the routing kernel, graph replay, shipped tables, the
#              MoE model against transformers) with what is left of the call
#   s36d       V of an fp8 pool widened by inline PTX in the decode kernel (decode.FP8_V_WIDEN): its GPU tests; the fp8
#              tile sweep at the MoE's heads with and without it (and the read ahead); the best many-program variant
#              (tile, widen; read ahead) to /tmp/fp8_many.txt; then dummy Qwen3-30B-A3B's batch-256 step and loop as
#              shipped (off) and with that variant (on)
#   s36e       (after the staging calls) the MoE side by side (`moe` with SBS_WORKLOADS, default 1024/1024 c256 and 8192/16
#              one at a time) at the fp8 many-program tile with V widened; then, with what is left of the call, the fp8
#              sweep at a few rows (the table's tiles, V widened by PTX and not: decode.FP8_V_WIDEN_FEW's evidence)
#   s36f       the GPU tests of the decode kernel, fp8 KV and the warm-up at the fp8 many-program tile with V widened
#   s37a       (written in session 36, not yet run) the warm-up's burst test on dummy Qwen3-0.6B and on the seeds' model with
#              an fp8 pool (after the warm-up step session 36 added: no kernel compiled), fp8 KV's GPU tests (s36f did
#              not reach them), the decode kernel's fp8 tests (V by PTX, the rotary in the kernel on an fp8 pool)
#   s37b       (written in session 36, not yet run) dummy Qwen3-30B-A3B's batch-1 loops (1k, 8k) and few-row decode
#              steps: as shipped (off), V by PTX in few-row launches too (wf: --decode-fp8-v-widen-few), and with the
#              rotary in the decode kernel on the fp8 pool (wfr: also --decode-rope-fp8), in the order off, wf, wfr,
#              off, wf, wfr
#   s37c       (written in session 36, not yet run) a MoE layer's experts summed by the next add+RMSNorm (model.moe.SUM_IN_NORM):
#              its GPU tests, then dummy Qwen3-30B-A3B's steps and loops at 1 and 256 rows with it (on) and without
#              (off), arms off, on, off, on
#   s37d       session 37's shipped fp8/MoE defaults (V by PTX in few-row launches, the rotary in the fp8 decode kernel
#              below 8 rows, the experts summed by the norm): the burst and fp8-rotary GPU tests, then dummy
#              Qwen3-30B-A3B's steps and loops with the three (new) and without (old), arms old, new, old, new
#   s38a       (written in session 37, not yet run) the MoE GPU tests in full at session 37's defaults (s37e's were cut
#              by the device budget; the 30B sparse-block test since sums the PartialSums the block returns), then
#              dummy Qwen3-8B's batch-256 and batch-1 async loops at temperature 1 (the dense criterion's numbers)
#   s38b       (written in session 37, not yet run) a sparse block's router product through the skinny kernel
#              (model.moe.ROUTER_SKINNY): its GPU tests, then dummy Qwen3-30B-A3B's batch-1 steps and loops with it (on)
#              and without (off), arms off, on, off, on
#   s38c       (written in session 37, not yet run) dummy Qwen3-30B-A3B's batch-1 decode splits: the shipped rule
#              (at least 64 keys a split: 16 splits at 1k, 64 at 8k over its 4 KV heads) against at least 256 and 512
#              keys a split (bench_steps.py --min-split-keys), arms base, k256, k512, base, k256, k512
#   s39a       (written in session 38, run in 39) long prefill rows over an fp8 pool through cuDNN
#              (library_prefill.FP8_POOLS, the prefix dequantized as it is gathered): the library's GPU tests, then
#              dummy Qwen3-30B-A3B's (fp8 KV) fresh 8k prompt and 8k chunk on a 24k prefix with it (on) and without
#              (off), arms off, on, off, on; then the MoE beside vLLM with it, before shipping it on: `PDSERVE_PREFILL_LIBRARY_FP8=1
#              SBS_WORKLOADS="8192:16:16:1 32768:16:8:1" lease_1gpu.sh moe` after the staging calls
#   s39b       (written in session 39) with fp8 pools through cuDNN shipped on: the GPU tests of the library, the warm-up
#              and the KV sizing (each now also over an fp8 pool, and a whole engine over one with long prompts
#              against the Triton kernel's logits), the other fp8 GPU tests, then the 41 MoE GPU tests s38a's cut
#              left unrun
#   s39c       (written in session 39) the GPU tests s39b's limits cut: the fp8 ones after the 14th, the MoE's last
#   s39d       (written in session 39) where dummy Qwen3-30B-A3B's (fp8 KV) prefill goes now that fp8 pools' long rows
#              take cuDNN: the kernels of a fresh 8192-token prompt (60 % of its compute floor in s39a) and of the
#              8192-token chunk on a 24576-token prefix
#   s40a       (written in session 39, ran in session 40 at fa5e404; rotary.WIDE_TILE and --rope-wide-tile were removed
#              after it: no faster, and not bitwise equal on the GPU) wide programs of the QK-norm + rotary kernel in
#              steps of at least rotary.WIDE_MIN_TOKENS tokens (rotary.WIDE_TILE; s39d: 7.7 of the MoE's 153 ms 8k
#              prefill, ~1 TB/s): the rotary GPU tests (bytes equal to the narrow programs'), then dummy Qwen3-30B-A3B's
#              (fp8 KV) fresh 8k prompt and 8k chunk on a 24k prefix with programs of at most 512 (w0, as shipped), 1024
#              and 2048 elements, twice; then dummy Qwen3-8B's fresh 8k prompt, w0 and w2048 twice
#   s40b       (written in session 39, ran in session 40: the merged table no faster, not shipped) the fused MoE's tiles
#              for prefill-sized steps: the shipped H200 table stops at the 4096-token bucket, so an 8192-token step
#              runs 4096's tiles (s39d: expert GEMMs 62.8 of the 8k prompt's 153 ms, ~470 TFLOP/s); tune_fused_moe.py
#              --tokens 8192 16384 merges those buckets into a copy of the table, then the MoE's prefill steps with the
#              shipped table (old) and the merged one (new), alternated; the merged table is kept as $W/table_new.json
#              (ship it only if new wins)
#   s40c       (written in session 39, ran in session 40: shipped on) cuDNN's inputs that need no padding as views of
#              the step's fused q/k/v (library_prefill.STRIDED_INPUTS; s39d: 144 copy kernels, 5.2 of the MoE's 153-ms
#              8k prompt): the library's GPU tests and the warm-up's plan test (both with it), then dummy
#              Qwen3-30B-A3B's (fp8 KV) fresh 8k prompt and 8k chunks on 8k and 24k prefixes, and dummy Qwen3-8B's,
#              off/on twice
#   s40d       (written in session 40) the GPU tests at session 40's defaults (STRIDED_INPUTS on, the rotary's wide
#              programs removed): the library's, the warm-up's, the KV sizing's and the rotary's; then the kernels of
#              dummy Qwen3-30B-A3B's (fp8 KV) fresh 8192-token prompt (s39d counted 144 copy kernels there)
#   s40e       (written in session 40) the engine microbenchmark's criteria at session 40's tree (dummy Qwen3-8B:
#              steps and steady loops at 1 and 256 rows of ~1k against their floors, the 8k prefill against the
#              matmul ceiling), a shorter s32d
#   s43a       (session 43) the long-prefill row's merge kernel (_merge_two_kernel: ~140 us a layer on an 8192-token
#              chunk, ~3x the bytes' time at the copy rate, s42a): its launch variants on the row's own inputs
#              (bench_merge.py: the outputs' pointers' alignment specialized or not, rows a program, warps), then dummy
#              Qwen3-8B's 8k chunks on 16k and 24k prefixes with the merge as shipped and as the best variant, in
#              the order shipped, best, shipped, best
#   s43b       (session 43) the GPU tests of the library row and the merge at the merge's new launch, and of the
#              warm-up (a burst compiles nothing); the 24k chunk's kernels with the merge as before (free:32:4) and as
#              shipped; then dummy Qwen3-8B's 32k prompt as four 8k chunks (s42a again)
#   s42d       (session 42) s42c's row and gathered arm timed one after the other (--interleave 7), in two processes
#              one after the other, on the 32k prompt's chunks on 8k, 16k and 24k prefixes
#   s42c       (session 42) the 32k prompt's 8k chunks through the library row against one call of cuDNN's frontend
#              graph (nvidia-cudnn-frontend, carried in .whl): causal aligned bottom-right over the gathered prefix and
#              new K/V, or over the pool's pages through a page table; every plan of cuDNN's heuristics timed
#   s42b       (written in session 41, ran in session 42 after the staging calls and `lease_2xh200.sh unpack` on the
#              same machine) the 32k prompt's 8k chunks through the library row (gather, cuDNN, merge) against vLLM's
#              FlashAttention 3 over the same pages (bench_library_row.py --fa3, vLLM from /tmp/site)
#   s42a       (written in session 41, ran in session 42) where a 32k prompt's prefill goes (session 41: pdserve's own
#              32k TTFT ~5 % above vLLM's by both servers' /metrics): dummy Qwen3-8B's 8192-token chunks fresh and on 8k,
#              16k and 24k prefixes against their floors and serial bounds, then the kernels of the chunk on 24k
#   dense      dummy Qwen3-8B bf16 (.vllm-stage/model), vLLM then pdserve on the one GPU, vLLM's client
#              (SBS_WORKLOADS, default 1024/1024 c256); into dense.tgz
#   s41e       where a mixed step's time goes at the session's tree: dummy Qwen3-8B's batch-256 decode step and mixed
#              steps (256 decodes + 512, 1024 or 2048 prompt tokens) against their floors, then the mixed steps' kernels
#              and the GPU's idle gaps under the profiler
#   s41d       can a product hide under the batch-256 decode attention? benchmarks/attention/probe_overlap.py (the
#              o and gate_up products at 256 rows on a second stream beside the decode kernel, eager and in a graph)
#   s41b       s41a's GPU tests that its 330 s left unrun: the graphs' last four, the engine against transformers
#              and the async loop on CUDA, with their durations
#   s41a       (written in session 40, run in session 41: its GPU tests stopped at 330 s after 68 passed, s41b ran
#              the rest) the decode kernel's GPU tests after session 40 removed its early tile, self merge and
#              many-program rotary (its sm_90 PTX proven equivalent offline,
#              benchmarks/attention/ptx_equivalence.py): decode, graphs, the engine against transformers, async, fused
#              engine; then dummy Qwen3-8B's decode steps and loops at 1x1k, 1x8k and 256x1k against their floors
#   s30c       the GPU tests of the decode kernel, the graphs (PDL changes no bit) and the engine against transformers
#              with the early tile; the decode sweep at 1-4 rows with it and without (sweep_decode.py --early)
set -uo pipefail
STAGE=${1:?stage}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
W="$OUT/$STAGE"; mkdir -p "$W"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$W/pip.txt" 2>&1 || echo "editable install failed"
nvidia-smi -L | tee "$W/gpus.txt"
t0=$(date +%s)
M=.vllm-stage/model
if [ -f /tmp/prefill_best.json ] && python3 -c "import json,sys; sys.exit(json.load(open('/tmp/prefill_best.json'))['speedup_geomean_vs_default'] <= 1.02)"; then
  export PDSERVE_PREFILL_CONFIG=/tmp/prefill_best.json  # measured best on this GPU by the attn stage
  echo "PDSERVE_PREFILL_CONFIG: $(cat /tmp/prefill_best.json | tr -d '\n ' | cut -c1-200)" | tee "$W/prefill_config.txt"
fi
# dummy Qwen3-8B decode steps (bench_steps.py) without the eager comparison, mixed or prefill cases
STEPS_8B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --mixed= --prefill="
profile_b1_8k() {  # MIN_SECONDS TOP: the batch-1 8k decode step's kernels ($B) with what is left of the call
  local left=$(( 560 - ($(date +%s) - t0) ))
  [ $left -gt $1 ] && timeout $left $B --profile "decode:1x8192" --top $2 --out "$W/profile.json" > "$W/profile.txt" 2>&1
  grep -v " INFO " "$W/profile.txt" | grep -A$(( $2 + 4 )) "^profile"
}
fold_ab() {  # LIMIT_S ARM_S ARMS...: the batch-1 8k step and the batch-1 loops (8k, 1k) per arm, in order, until
  # LIMIT_S into the call, each at most ARM_S; arms named off* run with --no-fold (the activation's own kernel)
  local limit=$1 per=$2 v a left; shift 2
  for v in "$@"; do
    left=$(( limit - ($(date +%s) - t0) )); [ $left -lt 45 ] && { echo "no time left for $v"; break; }
    a=""; case $v in off*) a="--no-fold" ;; esac
    timeout $(( left < per ? left : per )) $STEPS_8B --max-model-len 16384 --iters 30 $a --decode 1x8192 \
      --loop 1x8192,1x1024 --loop-steps 100 --out "$W/steps_$v.json" > "$W/steps_$v.txt" 2>&1
    echo "== $v"; grep -E "^(decode|loop)[^ ]*:|Error" "$W/steps_$v.txt" | grep -v "async off" | cut -c1-200
  done
}
sampler_loops() {  # ARMS...: the steady decode loops (256x1024, 1x8192) at temperature 1 per arm, in order, until
  # 560 s into the call; arms named torch* run with --sampler torch (no one-pass sampling kernel); `save` after each
  local v a left
  for v in "$@"; do
    left=$(( 560 - ($(date +%s) - t0) )); [ $left -lt 60 ] && { echo "no time left for $v"; break; }
    a=""; case $v in torch*) a="--sampler torch" ;; esac
    timeout $(( left < 130 ? left : 130 )) $STEPS_8B --max-model-len 16384 --decode= --loop 256x1024,1x8192 \
      --loop-steps 100 --loop-temperature 1.0 $a --out "$W/loop_$v.json" > "$W/loop_$v.txt" 2>&1
    echo "== $v"; grep -E "^loop[^ ]*:|Error" "$W/loop_$v.txt" | grep -v "async off" | cut -c1-220
    save
  done
}
ab_loops() {  # PREFIX PATTERN FLAGS CASES ARMS...: dummy Qwen3-8B steps and steady loops at temperature 1 (CASES:
  # bench_steps.py's --decode/--loop arguments) per arm, in order, until 565 s into the call, each at most 110 s; arms
  # matching PATTERN run with FLAGS; results in $W/PREFIX_<arm>.json; `save` after each
  local prefix=$1 pat=$2 flags=$3 cases=$4 v a left; shift 4
  for v in "$@"; do
    left=$(( 565 - ($(date +%s) - t0) )); [ $left -lt 50 ] && { echo "no time left for $v"; break; }
    a=""; case $v in $pat) a="$flags" ;; esac
    timeout $(( left < 110 ? left : 110 )) $STEPS_8B --max-model-len 16384 --iters 20 $a $cases --loop-steps 100 \
      --loop-temperature 1.0 --out "$W/${prefix}_$v.json" > "$W/${prefix}_$v.txt" 2>&1
    echo "== $v"; grep -E "^(decode|loop)[^ ]*:|Error" "$W/${prefix}_$v.txt" | grep -v "async off" | cut -c1-220
    save
  done
}
gpu_tests() {  # LIMIT PYTEST_ARGS...: the GPU tests given under `timeout LIMIT` into $W/gpu_tests.txt, their tail
  # printed, then `save`
  local limit=$1; shift
  timeout $limit python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short "$@" > "$W/gpu_tests.txt" 2>&1
  grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -6
  save
}
moe_arms() {  # CASES NAME=FLAGS...: dummy Qwen3-30B-A3B's steps and steady loops (fp8 KV, temperature 1; CASES:
  # bench_steps.py's --decode/--loop arguments) per arm, in order, until 575 s into the call, each at most 110 s; an
  # arm NAME=FLAGS runs with FLAGS (commas for spaces); results in $W/steps_<i>_<NAME>.json; `save` after each
  local cases=$1 i=0 spec name flags left; shift
  for spec in "$@"; do
    i=$((i + 1)); name=${spec%%=*}; flags=${spec#*=}; flags=${flags//,/ }
    left=$(( 575 - ($(date +%s) - t0) )); [ $left -lt 60 ] && { echo "no time left for $name"; break; }
    timeout $(( left < 110 ? left : 110 )) python3 benchmarks/engine/bench_steps.py --model qwen3-30b-a3b \
      --kv-cache-dtype fp8 --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 16384 \
      --iters 10 --loop-steps 60 --loop-temperature 1.0 --prefill= --mixed= $cases $flags \
      --out "$W/steps_${i}_$name.json" > "$W/steps_${i}_$name.txt" 2>&1
    grep -E "^(decode|loop)[^ ]*:|Error" "$W/steps_${i}_$name.txt" | grep -v "async off" | cut -c1-150 \
      | sed "s/^/$name($i) /"
    save
  done
}
# one pdserve server of dummy Qwen3-8B as the side by side starts it (--gpu-memory-utilization 0.9, --max-model-len
# 40960), model $1 (a dir or a shipped shape): its start-up (launch to first completion), KV sizing and warm-up lines
sizing_server() {
  echo "== pdserve serve, dummy Qwen3-8B, --gpu-memory-utilization 0.9, --max-model-len 40960"
  local T0=$(date +%s.%N)
  pdserve serve --model $1 --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
    --served-model-name qwen3-dummy --port 8200 > "$W/server.log" 2>&1 & local S=$!
  for i in $(seq 200); do
    curl -sf localhost:8200/v1/completions -H 'Content-Type: application/json' \
      -d '{"model":"qwen3-dummy","prompt":"t1 t2 t3","max_tokens":2}' > /dev/null && break
    kill -0 $S 2>/dev/null || { echo "server exited"; break; }; sleep 1
  done
  python3 -c "import time,sys; print(f'first completion answered {time.time()-float(sys.argv[1]):.1f} s after launch')" $T0 \
    | tee "$W/startup.txt"
  grep -h "KV sizing\|KV cache\|blocks\|warm-up\|engine ready\|Error\|error" "$W/server.log" | grep -v " 200 " \
    | cut -c1-600 | head -16
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee "$W/mem.txt"
  kill $S; wait $S 2>/dev/null; gzip -f "$W/server.log"
}
# the batch-1 loops per arm, one process each, in order, until LIMIT s into the call, each at most PER s: dummy
# Qwen3-8B at --max-model-len MAX_LEN, bench_steps.py's --loop LOOPS at temperature 1, with the flags the stage's
# arm_flags function gives the arm; results in $W/loop_<i>_<arm>.json; `save` after each
b1_arms() {  # LIMIT PER MAX_LEN LOOPS ARMS...
  local limit=$1 per=$2 len=$3 loops=$4 arm i=0 left; shift 4
  for arm in "$@"; do
    i=$((i + 1)); left=$(( limit - ($(date +%s) - t0) )); [ $left -lt 40 ] && { echo "no time left for $arm"; break; }
    timeout $(( left < per ? left : per )) $STEPS_8B --max-model-len $len --iters 20 --decode= $(arm_flags $arm) \
      --loop $loops --loop-steps 100 --loop-temperature 1.0 --out "$W/loop_${i}_$arm.json" > "$W/loop_${i}_$arm.txt" 2>&1
    grep -E "^loop:[^ ]* async on|Error" "$W/loop_${i}_$arm.txt" | sed "s/^/$arm: /" | cut -c1-200
    save
  done
}
# a pdserve server of dummy Qwen3-8B ($M) as the side by side starts it, on port 8200, log in $W/server.log; S is its
# pid; returns once it answers a completion (or exited, or 200 s)
start_8b_server() {
  pdserve serve --model $M --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
    --served-model-name qwen3-dummy --port 8200 > "$W/server.log" 2>&1 & S=$!
  for i in $(seq 200); do
    curl -sf localhost:8200/v1/completions -H 'Content-Type: application/json' \
      -d '{"model":"qwen3-dummy","prompt":"t1 t2 t3","max_tokens":2}' > /dev/null && break
    kill -0 $S 2>/dev/null || { echo "server exited"; break; }; sleep 1
  done
}
case $STAGE in
  attn)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_prefill.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | tail -8
    timeout 330 python3 benchmarks/attention/bench_attention.py --out "$W/attention.json" --kv-dtypes bf16 \
      --decode-batches 1 --decode-contexts 8192 --prefill-lens 1024,8192,32768 --sweep --best-out "$W/prefill_best.json" \
      > "$W/attention.txt" 2>&1
    grep -v "^sweep" "$W/attention.txt" | tail -12; grep "^sweep" "$W/attention.txt" | sort -t: -k2 | head -40
    [ -f "$W/prefill_best.json" ] && cp "$W/prefill_best.json" /tmp/prefill_best.json
    tar czf "$OUT/attn.tgz" -C "$OUT" attn ;;
  warm_test)  # the GPU test that a burst after the warm-up compiles nothing (pdserve.ops.jit_watch names any)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py 2>&1 \
      | grep -v "^\.*$" | cut -c1-700 | tail -${JIT_LINES:-12} ;;
  check)
    timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short --durations=6 \
      tests/engine/test_memory_profile.py tests/engine/test_async_scheduling.py tests/ops/test_attention_decode.py \
      tests/ops/test_fp8_kv.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | tail -25
    sizing_server $M
    left=$(( 540 - ($(date +%s) - t0) ))
    echo "== decode attention tile sweep (${left} s left)"
    [ $left -gt 60 ] && timeout $left python3 benchmarks/attention/sweep_decode.py --out "$W/decode_sweep.json" 2>&1 | tail -12
    tar czf "$OUT/check.tgz" -C "$OUT" check ;;
  install)
    OUT=/tmp/sbs_install STAGE=.vllm-stage bash benchmarks/vs_vllm/side_by_side.sh
    PYTHONPATH=/tmp/site python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1 ;;
  sbs)
    WORKLOADS=${SBS_WORKLOADS:-"1024:1024:512:256 8192:16:16:1 32768:16:4:1"} CLIENTS=${SBS_CLIENTS:-vllm} SINGLE_GPU=1 \
      SERVERS=${SBS_SERVERS:-"vllm pdserve"} DETAILED=${SBS_DETAILED:-0} CLIENT_ROUNDS=${SBS_ROUNDS:-1} OUT=$W STAGE=.vllm-stage \
      PDCLIENT_ARGS=${SBS_PDCLIENT_ARGS:-} \
      VLLM_USE_FLASHINFER_SAMPLER=0 timeout 570 bash benchmarks/vs_vllm/side_by_side.sh single 2>&1 | tail -30
    echo "pdserve compiled $(grep -c 'compiled a kernel while serving' "$W/pdserve.log") kernels while serving"
    for f in "$W"/*.log; do gzip -f "$f"; done
    tar czf "$OUT/sbs.tgz" -C "$OUT" sbs ;;
  steps)
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9"
    timeout 300 $B --decode 1x1024,1x8192,256x1024 --prefill 8192,8x1024 \
      --mixed 256x1024+512,128x512+8x1008,256x1024+7x1024 --no-compare-eager --burst 256x1024 \
      --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -v " INFO " "$W/steps.txt" | tail -24; grep -h "KV sizing" "$W/steps.txt"
    timeout 200 $B --profile "prefill:8x1024;mixed:128x512+8x1008;decode:1x8192" --no-compare-eager --top 22 \
      --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | tail -80
    tar czf "$OUT/steps.tgz" -C "$OUT" steps ;;
  serve_tl)
    pdserve serve --model $M --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
      --served-model-name qwen3-dummy --port 8200 > "$W/server.log" 2>&1 & S=$!
    for i in $(seq 200); do
      curl -sf localhost:8200/v1/completions -H 'Content-Type: application/json' \
        -d '{"model":"qwen3-dummy","prompt":"t1 t2 t3","max_tokens":2}' > /dev/null && break; sleep 1
    done
    for run in 1024x1024 1024x16; do
      o=${run#*x}
      python3 benchmarks/server/serve_timeline.py --url http://127.0.0.1:8200 --pid $S --out "$W/timeline_$run.json" \
        > "$W/timeline_$run.txt" 2>&1 & T=$!
      timeout 200 pdserve bench serve --backend vllm --base-url http://127.0.0.1:8200 --model qwen3-dummy --tokenizer $M \
        --dataset-name random --random-input-len 1024 --random-output-len $o --num-prompts 512 --max-concurrency 256 \
        --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --num-warmups 2 \
        --disable-tqdm --no-plots --save-result --result-dir "$W" \
        --result-filename "c256_$run.json" > "$W/c256_$run.txt" 2>&1
      kill -INT $T; wait $T
      echo "== $run"; cat "$W/timeline_$run.txt"
      python3 benchmarks/vs_vllm/compare.py --line "$W/c256_$run.json"
      python3 benchmarks/server/serve_timeline.py --waves "$W/c256_$run.pdserve.json"
    done
    echo "== kernels compiled while serving (pdserve.ops.jit_watch)"
    grep -c "compiled a kernel while serving" "$W/server.log"; grep "compiled a kernel while serving" "$W/server.log" | cut -c25-700 | head -${JIT_LINES:-12}
    curl -s localhost:8200/load; echo
    kill $S; wait $S 2>/dev/null; gzip -f "$W"/*.log "$W"/*.pdserve.json "$W"/timeline_*.json
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py 2>&1 | grep -v "^\.*$" | cut -c1-700 | tail -${JIT_LINES:-12}
    tar czf "$OUT/serve_tl.tgz" -C "$OUT" serve_tl ;;
  moe)  # Qwen3-30B-A3B (dummy, .vllm-stage/model-moe), fp8 KV on both, vLLM then pdserve on the one GPU
    WORKLOADS=${SBS_WORKLOADS:-"1024:1024:512:256"} MODEL=.vllm-stage/model-moe \
      VLLM_ARGS="--kv-cache-dtype fp8 --attention-backend FLASH_ATTN" PDSERVE_ARGS="--kv-cache-dtype fp8" CLIENTS=vllm \
      SINGLE_GPU=1 OUT=$W STAGE=.vllm-stage VLLM_USE_FLASHINFER_SAMPLER=0 timeout 540 \
      bash benchmarks/vs_vllm/side_by_side.sh single 2>&1 | tail -14
    echo "pdserve compiled $(grep -c 'compiled a kernel while serving' "$W/pdserve.log") kernels while serving"
    for f in "$W"/*.log; do gzip -f "$f"; done
    tar czf "$OUT/moe.tgz" -C "$OUT" moe ;;
  steps8k)  # Qwen3-8B's 8k prefill step against its floor and its kernels; the MoE model's 8k prefill kernels
    B="python3 benchmarks/engine/bench_steps.py --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --mixed= --loop="
    timeout 120 $B --model qwen3-8b --decode 1x1024,256x1024 --prefill 8192 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(prefill|decode):|ceilings" "$W/steps.txt"
    timeout 100 $B --model qwen3-8b --profile "prefill:8192" --top 12 --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -A16 "^profile"
    left=$(( 560 - ($(date +%s) - t0) ))
    [ $left -gt 100 ] && timeout $left $B --model qwen3-30b-a3b --kv-cache-dtype fp8 --profile "prefill:8192" --top 16 \
      --out "$W/moe_profile.json" > "$W/moe_profile.txt" 2>&1
    grep -v " INFO " "$W/moe_profile.txt" | grep -A20 "^profile"
    tar czf "$OUT/steps8k.tgz" -C "$OUT" steps8k ;;
  newkv)  # prefill reading the step's new K/V from k/v (default) vs all from the pool: GPU tests and the kernel A/B
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_prefill.py \
      tests/ops/test_fp8_kv.py tests/ops/test_attention_backend.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | tail -8
    for hk in 4 8; do for nk in new-kv no-new-kv; do
      timeout 150 python3 benchmarks/attention/bench_attention.py --out "$W/attn_hk${hk}_$nk.json" --kv-dtypes bf16,fp8 \
        --hk $hk --decode-batches 1 --decode-contexts 1024 --prefill-lens 1024,8192,32768 --no-sdpa --$nk \
        > "$W/attn_hk${hk}_$nk.txt" 2>&1
      echo "== hk $hk --$nk"; grep -E "^(prefill|mixed)" "$W/attn_hk${hk}_$nk.txt" | cut -c1-150
    done; done
    tar czf "$OUT/newkv.tgz" -C "$OUT" newkv ;;
  newkv_steps)  # the same A/B on whole engine steps: dummy Qwen3-30B-A3B with fp8 KV, then Qwen3-8B (bf16 KV)
    B="python3 benchmarks/engine/bench_steps.py --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --mixed= --loop="
    for m in "qwen3-30b-a3b --kv-cache-dtype fp8" "qwen3-8b"; do for nk in prefill-new-kv no-prefill-new-kv; do
      n=$(echo "${m%% *}_$nk")
      timeout 140 $B --model $m --decode 1x1024 --prefill 8192 --$nk \
        --out "$W/$n.json" > "$W/$n.txt" 2>&1
      echo "== $m --$nk"; grep -E "^(prefill|decode):|ceilings" "$W/$n.txt"
    done; done
    tar czf "$OUT/newkv_steps.tgz" -C "$OUT" newkv_steps ;;
  chunks32k)  # the four 8192-token chunks of a 32k prompt (Qwen3-8B, bf16): each step against its floor, then the kernels of the last
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --mixed= --loop= --max-model-len 40960"
    timeout 200 $B --decode 1x32768 --prefill 8192,8192+8192,16384+8192,24576+8192 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(prefill|decode)[^ ]*:|ceilings" "$W/steps.txt"
    timeout 200 $B --profile "prefill:24576+8192" --top 14 --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -A18 "^profile"
    tar czf "$OUT/chunks32k.tgz" -C "$OUT" chunks32k ;;
  skinny)
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_linear.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | tail -6
    for m in qwen3-8b qwen3-30b-a3b; do
      timeout 240 python3 benchmarks/engine/bench_linear.py --model $m --sweep --best-out "$W/best_$m.json" \
        --out "$W/linear_$m.json" > "$W/linear_$m.txt" 2>&1
      grep -E "^(ceilings|precompiled)|rows" "$W/linear_$m.txt"
    done
    python3 -c "import json,sys; t={}; [t.update(json.load(open(f))) for f in sys.argv[1:]]; json.dump(t, open('/tmp/skinny_best.json','w'), indent=1)" \
      "$W"/best_*.json && cp /tmp/skinny_best.json "$W/skinny_best.json"
    tar czf "$OUT/skinny.tgz" -C "$OUT" skinny ;;
  skinny_steps)
    [ -f /tmp/skinny_best.json ] && export PDSERVE_SKINNY_CONFIG=/tmp/skinny_best.json
    echo "PDSERVE_SKINNY_CONFIG=${PDSERVE_SKINNY_CONFIG:-}"
    B="$STEPS_8B --max-model-len 16384"
    for sk in skinny no-skinny; do
      timeout 170 $B --decode 1x1024,1x8192,2x1024,4x1024,8x1024,16x1024 --loop 1x1024 --$sk \
        --out "$W/steps_$sk.json" > "$W/steps_$sk.txt" 2>&1
      echo "== --$sk"; grep -E "^(decode|loop)[^ ]*:|ceilings" "$W/steps_$sk.txt"
    done
    profile_b1_8k 90 16
    tar czf "$OUT/skinny_steps.tgz" -C "$OUT" skinny_steps ;;
  pdl)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short ${PDL_TESTS:-tests/ops/test_linear.py \
      tests/engine/test_cuda_graphs.py tests/ops/test_attention_decode.py tests/engine/test_warmup.py} 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-600 | tail -12
    B="$STEPS_8B --max-model-len 16384"
    for ab in early late off "off --no-skinny"; do
      n=$(echo $ab | tr -d ' -')
      timeout 100 $B --decode 1x1024,1x8192,2x1024,4x1024,8x1024,16x1024,256x1024 --loop 1x1024,1x8192 --iters 40 --pdl $ab \
        --out "$W/steps_$n.json" > "$W/steps_$n.txt" 2>&1
      echo "== --pdl $ab"; grep -E "^(decode|loop)[^ ]*:|ceilings" "$W/steps_$n.txt"
    done
    profile_b1_8k 60 14
    tar czf "$OUT/pdl.tgz" -C "$OUT" pdl ;;
  splits)
    B="$STEPS_8B --max-model-len 40960 --iters 40"
    for r in 1 2; do for v in "base" "w4k64"; do
      a=""; [ $v = w4k64 ] && a="--decode-waves 4 --min-split-keys 64"
      timeout 75 $B --decode 1x1024,1x8192,1x32768,4x8192,8x1024,16x1024,256x1024 --loop 1x8192 $a \
        --out "$W/bf16_${v}_$r.json" > "$W/bf16_${v}_$r.txt" 2>&1
      echo "== bf16 $v $r"; grep -E "^(decode|loop)[^ ]*:" "$W/bf16_${v}_$r.txt" | grep -v "async off"
    done; done
    for v in "base" "w4k64"; do
      a=""; [ $v = w4k64 ] && a="--decode-waves 4 --min-split-keys 64"
      timeout 60 $B --kv-cache-dtype fp8 --decode 1x1024,1x8192,1x32768,4x8192 --loop= $a \
        --out "$W/fp8_${v}.json" > "$W/fp8_${v}.txt" 2>&1
      echo "== fp8 $v"; grep -E "^decode[^ ]*:" "$W/fp8_${v}.txt"
    done
    tar czf "$OUT/splits.tgz" -C "$OUT" splits ;;
  s13)
    save() { tar czf "$OUT/s13.tgz" -C "$OUT" s13; }
    timeout 210 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short --durations=6 \
      tests/engine/test_warmup.py tests/engine/test_memory_profile.py tests/ops/test_attention_decode.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-700 | tail -16
    save
    sizing_server qwen3-8b
    save
    B="$STEPS_8B --max-model-len 40960 --iters 40 --decode 1x1024,1x8192,1x32768,4x8192,16x1024 --loop 1x8192"
    for v in old1 new1 new2 old2; do
      left=$(( 545 - ($(date +%s) - t0) )); [ $left -lt 40 ] && { echo "no time left for $v"; break; }
      a=""; case $v in old*) a="--decode-waves 2 --min-split-keys 256" ;; esac
      timeout $(( left < 80 ? left : 80 )) $B $a --out "$W/steps_$v.json" > "$W/steps_$v.txt" 2>&1
      echo "== $v"; grep -E "^(decode|loop)[^ ]*:" "$W/steps_$v.txt" | grep -v "async off"
      save
    done ;;
  loopgap)
    B="$STEPS_8B --max-model-len 40960 --iters 20 --decode 1x8192 --loop 1x8192 --profile-loop 1x8192 --loop-steps 50"
    for v in new old; do
      a=""; [ $v = old ] && a="--decode-waves 2 --min-split-keys 256"
      timeout 150 $B $a --out "$W/loop_$v.json" > "$W/loop_$v.txt" 2>&1
      echo "== $v"; grep -E "^(decode|loop)[^ ]*:|^  idle" "$W/loop_$v.txt" | grep -v "async off"
    done
    tar czf "$OUT/loopgap.tgz" -C "$OUT" loopgap ;;
  s14)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_memory_profile.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-400 | tail -6
    sizing_server qwen3-8b
    tar czf "$OUT/s14.tgz" -C "$OUT" s14
    OUT=$OUT bash "$0" loopgap ;;
  s14b)
    save() { tar czf "$OUT/s14b.tgz" -C "$OUT" s14b; }
    timeout 120 python3 benchmarks/engine/probe_memory.py --out "$W/probe_default.json" > "$W/probe_default.txt" 2>&1
    echo "== probe, default allocator"; grep -v " INFO " "$W/probe_default.txt" | cut -c1-400 | head -40
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_memory_profile.py 2>&1 \
      | tee "$W/gpu_tests_default.txt" | grep -v "^\.*$" | cut -c1-400 | tail -4
    save
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    timeout 120 python3 benchmarks/engine/probe_memory.py --out "$W/probe_expandable.json" > "$W/probe_expandable.txt" 2>&1
    echo "== probe, expandable segments"; grep -v " INFO " "$W/probe_expandable.txt" | cut -c1-400 | head -12
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_memory_profile.py \
      tests/engine/test_cuda_graphs.py tests/engine/test_warmup.py 2>&1 \
      | tee "$W/gpu_tests_expandable.txt" | grep -v "^\.*$" | cut -c1-600 | tail -8
    save
    sizing_server qwen3-8b
    save
    left=$(( 550 - ($(date +%s) - t0) ))
    for v in expandable default; do
      [ $v = default ] && unset PYTORCH_CUDA_ALLOC_CONF
      [ $left -gt 100 ] && timeout 60 $STEPS_8B --max-model-len 40960 --iters 40 --decode 1x8192,16x1024,256x1024 \
        --loop 1x8192 --out "$W/steps_$v.json" > "$W/steps_$v.txt" 2>&1
      echo "== steps, $v"; grep -E "^(decode|loop)[^ ]*:" "$W/steps_$v.txt" | grep -v "async off"
    done
    save ;;
  s14c)
    save() { tar czf "$OUT/s14c.tgz" -C "$OUT" s14c; }
    timeout 120 python3 benchmarks/engine/probe_memory.py --out "$W/probe.json" > "$W/probe.txt" 2>&1
    echo "== probe"; grep -v " INFO " "$W/probe.txt" | cut -c1-300 | head -8
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_memory_profile.py \
      tests/engine/test_vs_transformers.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-400 | tail -8
    save
    sizing_server qwen3-8b
    save ;;
  s15)
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_memory_profile.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-700 | tail -6
    tar czf "$OUT/s15.tgz" -C "$OUT" s15
    OUT=$OUT bash "$0" chunks32k ;;
  s16a)  # the KV sizing GPU tests (the step's own allocated/reserved peaks in the message), torch's SDPA backends
    # (cuDNN, flash, efficient) against the Triton prefill kernel on the 32k prompt's chunks, the batch-1 8k decode
    # step's kernels with PDL on (as served)
    save() { tar czf "$OUT/s16a.tgz" -C "$OUT" s16a; }
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_memory_profile.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    save
    timeout 240 python3 benchmarks/attention/probe_sdpa_backends.py --out "$W/sdpa.json" > "$W/sdpa.txt" 2>&1
    cut -c1-400 "$W/sdpa.txt" | grep -v "^  " | head -20; grep "^  " "$W/sdpa.txt" | sort | uniq | cut -c1-300 | head -8
    save
    B="$STEPS_8B --max-model-len 16384"
    profile_b1_8k 60 24
    save ;;
  s16b)  # cuDNN for long prefill rows: its GPU tests and the KV sizing tests, its first calls on new shapes and 4k
    # chunks against Triton, then the 32k prompt's 8k chunks as engine steps with it (default) and without it
    save() { tar czf "$OUT/s16b.tgz" -C "$OUT" s16b; }
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_library_prefill.py \
      tests/engine/test_memory_profile.py tests/ops/test_attention_backend.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -8
    save
    timeout 120 python3 benchmarks/attention/probe_sdpa_backends.py --out "$W/sdpa.json" \
      --first-calls 0:3001,0:3002,0:3100,1234:8192,1235:8192,1300:8100,20000:8192,20100:8150 --cases 24576:8192,0:8192 \
      > "$W/sdpa.txt" 2>&1
    grep -E "^(first|ctx)|refused" "$W/sdpa.txt" | sed 's/ | efficient: RuntimeError//' | cut -c1-300
    save
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --mixed= --loop= --max-model-len 40960"
    for lib in auto none; do
      PDSERVE_PREFILL_LIBRARY=$lib timeout 120 $B --decode= --prefill 8192,8192+8192,16384+8192,24576+8192 \
        --out "$W/steps_$lib.json" > "$W/steps_$lib.txt" 2>&1
      echo "== PDSERVE_PREFILL_LIBRARY=$lib"; grep -E "^(prefill|decode)[^ ]*:|KV sizing: the largest|Error" "$W/steps_$lib.txt" | cut -c1-300
      save
    done ;;
  s16c)  # the library prefill's start-up warm-up: GPU tests (library, warm-up: nothing compiles after it), one server
    # of dummy Qwen3-8B (start-up, the warm-up line), the first long prompts' TTFT on it, each length twice
    save() { tar czf "$OUT/s16c.tgz" -C "$OUT" s16c; }
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_library_prefill.py \
      tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-700 | tail -8
    save
    T0=$(date +%s.%N)
    start_8b_server
    python3 -c "import time,sys; print(f'first completion answered {time.time()-float(sys.argv[1]):.1f} s after launch')" $T0 \
      | tee "$W/startup.txt"
    grep -h "warm-up\|engine ready\|KV sizing: the largest\|Error" "$W/server.log" | cut -c1-300
    timeout 200 python3 benchmarks/serve/first_long_requests.py --url http://127.0.0.1:8200 --model qwen3-dummy \
      --out "$W/first.json" --lengths 8000,8100,5000,20000,33000,36000
    grep -c "compiled a kernel while serving" "$W/server.log" | sed 's/^/kernels compiled while serving: /'
    kill $S; wait $S 2>/dev/null; gzip -f "$W/server.log"
    save ;;
  s17a)  # where a batch-256 decode step and a mixed step (256 decodes + a 512-token chunk) go: steps, their kernels
    # and the GPU's idle time, the async loop's GPU timeline at batch 256, and cuBLAS's products at 64..1024 rows
    B="$STEPS_8B --max-model-len 16384"
    timeout 150 $B --decode 256x1024,1x8192 --mixed 256x1024+512,256x1024+1024 --loop 256x1024 --iters 30 \
      --profile-loop 256x1024 --loop-steps 40 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(decode|mixed|loop)[^ ]*:|^  idle|ceilings" "$W/steps.txt" | grep -v "async off"
    timeout 170 $B --decode 256x1024 --mixed 256x1024+512 --loop= --top 45 \
      --profile "decode:256x1024;mixed:256x1024+512" --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -A60 "^profile" | cut -c1-160
    timeout 150 python3 benchmarks/engine/bench_gemm_rows.py --rows 64,128,256,512,768,1024,2048 \
      --out "$W/gemm_rows.json" > "$W/gemm_rows.txt" 2>&1; cat "$W/gemm_rows.txt"
    tar czf "$OUT/s17a.tgz" -C "$OUT" s17a ;;
  s17b)  # why the async loop's batch-256 step (14.6 ms) took less GPU time than the same step run alone (18.1 ms,
    # 16.4 of kernels): the loop's kernels; the per-step cases on a zero pool and on one filled with random values
    B="$STEPS_8B --max-model-len 16384 --iters 30 --top 25"
    timeout 200 $B --decode 1x1024,1x8192,256x1024 --loop 1x1024,1x8192,256x1024 --profile-loop 256x1024 \
      --loop-steps 40 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -v " INFO " "$W/steps.txt" | grep -E "^(decode|loop)[^ ]*:|^  idle|ceilings|^\||^profile|GPU busy" \
      | grep -v "async off" | cut -c1-170 | head -60
    timeout 120 $B --decode 1x8192,256x1024 --loop= --fill-kv --out "$W/steps_fill.json" > "$W/steps_fill.txt" 2>&1
    echo "== --fill-kv"; grep -E "^decode[^ ]*:" "$W/steps_fill.txt"
    timeout 150 $B --decode 256x1024 --loop= --fill-kv --profile "decode:256x1024" \
      --out "$W/profile_fill.json" > "$W/profile_fill.txt" 2>&1
    grep -v " INFO " "$W/profile_fill.txt" | grep -A30 "^profile" | cut -c1-160
    tar czf "$OUT/s17b.tgz" -C "$OUT" s17b ;;
  s17c)  # the decode kernel's many-program tile (64 keys, 3 stages) and the greedy argmax on bf16 logits: GPU tests
    # (decode attention, a burst after the warm-up compiles nothing, graphs, async); then whole steps and the steady
    # decode loop with the tile and without it, in the order new, old, new, old
    timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      tests/engine/test_warmup.py tests/engine/test_cuda_graphs.py tests/engine/test_async_gpu.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-600 | tail -12
    B="$STEPS_8B --max-model-len 16384 --iters 30"
    for v in new1 old1 new2 old2; do
      left=$(( 540 - ($(date +%s) - t0) )); [ $left -lt 50 ] && { echo "no time left for $v"; break; }
      a=""; case $v in old*) a="--many-programs-tile none" ;; esac
      timeout $(( left < 75 ? left : 75 )) $B $a --decode 256x1024,128x2048,64x1024,1x8192 --mixed 256x1024+512 \
        --loop 1x8192,256x1024 --loop-steps 60 --out "$W/steps_$v.json" > "$W/steps_$v.txt" 2>&1
      echo "== $v"; grep -E "^(decode|mixed|loop)[^ ]*:" "$W/steps_$v.txt" | grep -v "async off" | cut -c1-230
    done
    tar czf "$OUT/s17c.tgz" -C "$OUT" s17c ;;
  s17d)  # the steady async loop at batch 256 under the profiler: its kernels against the same step alone, and
    # where the GPU idles between them (longest gaps, with the kernels on either side)
    B="$STEPS_8B --max-model-len 16384 --iters 20 --top 30"
    timeout 250 $B --decode 256x1024 --loop 256x1024 --profile-loop 256x1024 --loop-steps 40 \
      --out "$W/loop.json" > "$W/loop.txt" 2>&1
    grep -v " INFO " "$W/loop.txt" | grep -E "^(decode|loop)[^ ]*:|^  idle|^\||^profile|GPU busy" \
      | grep -v "async off" | cut -c1-200 | head -60
    tar czf "$OUT/s17d.tgz" -C "$OUT" s17d ;;
  s17e)  # the session's GPU tests at its final engine code, one pytest per file group (a group's failure is its own)
    for g in "tests/ops/test_attention_decode.py tests/engine/test_warmup.py" \
             "tests/engine/test_cuda_graphs.py tests/engine/test_async_gpu.py" \
             "tests/engine/test_vs_transformers.py tests/engine/test_fused_engine.py" \
             "tests/engine/test_memory_profile.py tests/ops/test_library_prefill.py"; do
      left=$(( 560 - ($(date +%s) - t0) )); [ $left -lt 30 ] && { echo "no time left for: $g"; break; }
      echo "== $g"
      timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line $g 2>&1 \
        | tee -a "$W/gpu_tests.txt" | grep -E "passed|failed|Error" | cut -c1-300 | tail -4
    done
    tar czf "$OUT/s17e.tgz" -C "$OUT" s17e ;;
  s18a)  # a Triton tile GEMM (benchmarks/engine/bench_tile_linear.py) against cuBLAS over Qwen3-8B's and Qwen3-30B-A3B's
    # projections at 32..1024 rows. As run in lease_s18 (code eba5aa1) the kernel was wired into the engine and the
    # stage also ran the GPU tests and steps with its table and without; the kernel lost and was taken out
    timeout 240 python3 benchmarks/engine/bench_tile_linear.py --model qwen3-8b,qwen3-30b-a3b \
      --rows 32,64,96,128,192,256,384,512,768,1024 --best-out "$W/tile_table.json" --out "$W/tile_linear.json" \
      > "$W/tile_linear.txt" 2>&1
    grep -E "rows +(64|128|256|512):|step|^ceil|precomp|Error" "$W/tile_linear.txt" | cut -c1-230
    tar czf "$OUT/s18a.tgz" -C "$OUT" s18a ;;
  s18b)  # the warm-up's mixed step of the many-program decode tile with several splits: the GPU tests of the decode
    # kernel and the warm-up (a prompt arriving beside 1, 2, 5, 10 decoding requests compiles nothing); then a server
    # as lease_s18's client rounds ran it, pdserve's client at 16 Poisson requests/s twice, and what it compiled
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-600 | tail -8
    pdserve serve --model $M --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
      --served-model-name qwen3-dummy --port 8200 --no-enable-prefix-caching > "$W/server.log" 2>&1 & S=$!
    for i in $(seq 150); do
      curl -sf localhost:8200/v1/completions -H 'Content-Type: application/json' \
        -d '{"model":"qwen3-dummy","prompt":"t1 t2 t3","max_tokens":2}' > /dev/null && break; sleep 1
    done
    grep -h "warm-up:" "$W/server.log" | cut -c1-200
    for r in 1 2; do
      timeout 120 pdserve bench serve --backend vllm --base-url http://127.0.0.1:8200 --model qwen3-dummy --tokenizer $M \
        --dataset-name random --random-input-len 1024 --random-output-len 256 --num-prompts 320 --request-rate 16 \
        --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --num-warmups 2 --seed 0 \
        --disable-tqdm --no-plots --save-result --result-dir "$W" \
        --result-filename "poisson_r$r.json" > "$W/poisson_r$r.txt" 2>&1
      python3 benchmarks/vs_vllm/compare.py --line "$W/poisson_r$r.json"
    done
    echo "kernels compiled while serving: $(grep -c 'compiled a kernel while serving' "$W/server.log")"
    grep "compiled a kernel while serving" "$W/server.log" | cut -c25-400 | head -5
    kill $S; wait $S 2>/dev/null; gzip -f "$W/server.log"; rm -f "$W"/*.pdserve.json
    tar czf "$OUT/s18b.tgz" -C "$OUT" s18b ;;
  s18c)  # cuBLASLt (torch.backends.cuda.preferred_blas_library) against torch's default cuBLAS: the projections at
    # 64..1024 rows both ways (bench_gemm_rows.py), then steps and the steady loop at batch 256 both ways, default,
    # lt, default, lt
    for b in cublas cublaslt; do
      timeout 100 python3 benchmarks/engine/bench_gemm_rows.py --rows 64,128,256,512,1024 --blas $b \
        --out "$W/gemm_rows_$b.json" > "$W/gemm_rows_$b.txt" 2>&1
      echo "== $b"; grep -E "BLAS|rows +(128|256|512):|step's" "$W/gemm_rows_$b.txt" | cut -c1-140
    done
    B="$STEPS_8B --max-model-len 16384 --iters 30"
    for v in cublas1 cublaslt1 cublas2 cublaslt2; do
      left=$(( 560 - ($(date +%s) - t0) )); [ $left -lt 50 ] && { echo "no time left for $v"; break; }
      timeout $(( left < 70 ? left : 70 )) $B --blas ${v%[12]} --decode 256x1024,64x1024 --mixed 256x1024+512 \
        --loop 256x1024 --loop-steps 60 --out "$W/steps_$v.json" > "$W/steps_$v.txt" 2>&1
      echo "== $v"; grep -E "^(decode|mixed|loop)[^ ]*:" "$W/steps_$v.txt" | grep -v "async off" | cut -c1-230
    done
    tar czf "$OUT/s18c.tgz" -C "$OUT" s18c ;;
  s19a)  # what fusing the small kernels away could save at most (bench_steps.py --ablate: the layers' RMS norms, SiLU*mul,
    # the KV write skipped; outputs wrong, timings only) at batch 1 (8k) and 256 (1k), steps and the steady loop; and
    # the projections at 128..512 rows as 2..4 K slices in one batched GEMM (split-K) against cuBLAS's one product
    timeout 120 python3 benchmarks/engine/bench_gemm_rows.py --rows 128,256,512 --split-k 1,2,3,4 \
      --out "$W/gemm_splitk.json" > "$W/gemm_splitk.txt" 2>&1
    grep -E "rows +(256):|step's|^ceil|Error" "$W/gemm_splitk.txt" | cut -c1-170
    B="$STEPS_8B --max-model-len 16384 --iters 30"
    for v in none all norm act kv_write none2; do
      left=$(( 570 - ($(date +%s) - t0) )); [ $left -lt 50 ] && { echo "no time left for $v"; break; }
      a=""; case $v in none*) ;; all) a="--ablate norm,act,kv_write" ;; *) a="--ablate $v" ;; esac
      timeout $(( left < 75 ? left : 75 )) $B $a --decode 1x8192,256x1024 --loop 1x8192,256x1024 --loop-steps 60 \
        --out "$W/steps_$v.json" > "$W/steps_$v.txt" 2>&1
      echo "== $v"; grep -E "^(decode|loop)[^ ]*:|Error" "$W/steps_$v.txt" | grep -v "async off" | cut -c1-200
    done
    tar czf "$OUT/s19a.tgz" -C "$OUT" s19a ;;
  s19b)  # the norms folded into the one-row q/k/v and gate_up products and SiLU*mul into the down projection: GPU tests
    # (the skinny kernels, PDL bit-identity, graphs, the warm-up compiles nothing, transformers' agreement), then
    # the batch-1 decode step (8k) and the steady loop at batch 1 (8k, 1k) folded and not, in the order on, off, on, off
    timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_linear.py \
      tests/ops/test_pdl.py tests/engine/test_fused_engine.py tests/engine/test_vs_transformers.py \
      tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-600 | tail -12
    fold_ab 570 65 on1 off1 on2 off2
    tar czf "$OUT/s19b.tgz" -C "$OUT" s19b ;;
  s19c)  # s19b's fold made the batch-1 loop slower (every program summed the row's squares before streaming its
    # weights); now the squares are summed in the product's own pass and 1/rms scales the outputs at the end. GPU
    # tests (skinny/folded kernels, PDL, the warm-up compiles nothing), then the batch-1 step and loops with all,
    # none, the norms only and the activation only folded, then all and none again (as run at 45a3d61, whose
    # bench_steps took --fold all|norm|act|none; the norm's fold was then taken out)
    timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_linear.py \
      tests/ops/test_pdl.py tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" \
      | cut -c1-600 | tail -12
    B="$STEPS_8B --max-model-len 16384 --iters 30"
    for v in all1 none1 norm act all2 none2; do
      left=$(( 570 - ($(date +%s) - t0) )); [ $left -lt 45 ] && { echo "no time left for $v"; break; }
      timeout $(( left < 60 ? left : 60 )) $B --fold ${v%[12]} --decode 1x8192 --loop 1x8192,1x1024 \
        --loop-steps 100 --out "$W/steps_$v.json" > "$W/steps_$v.txt" 2>&1
      echo "== $v"; grep -E "^(decode|loop)[^ ]*:|Error" "$W/steps_$v.txt" | grep -v "async off" | cut -c1-200
    done
    tar czf "$OUT/s19c.tgz" -C "$OUT" s19c ;;
  s19d)  # the activation alone folded into the one-row down projection (the norm's fold taken out after s19c): GPU
    # tests, then the batch-1 step and loops folded and not, alternating three times
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_linear.py \
      tests/ops/test_pdl.py tests/engine/test_fused_engine.py tests/engine/test_vs_transformers.py \
      tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-600 | tail -12
    fold_ab 575 55 on1 off1 on2 off2 on3 off3
    tar czf "$OUT/s19d.tgz" -C "$OUT" s19d ;;
  s19e)  # as run at ea7eeda (lease_s19/s19e), then reverted: the KV write folded into the rotary kernel (the backend's write
    # kernel skipped) measured no faster. GPU tests, then the batch-1 step and the steady loops at batch 1 (8k) and
    # 256 (1k) with it and without (--no-rope-kv, an option of that commit's bench_steps), twice
    echo "stage s19e needs commit ea7eeda's tree (pdserve.ops.rotary's KV write): check it out first"; exit 2 ;;
  s19f)  # the session's final engine code (the activation's math shared by its kernel and the folded product): GPU
    # tests (activation, skinny/folded kernels, PDL, the engine against the reference path and transformers, the
    # warm-up compiles nothing), then the batch-1 step and loops folded and not
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_activation.py \
      tests/ops/test_linear.py tests/ops/test_pdl.py tests/engine/test_fused_engine.py \
      tests/engine/test_vs_transformers.py tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" \
      | grep -v "^\.*$" | cut -c1-600 | tail -12
    fold_ab 560 60 on1 off1 on2 off2
    tar czf "$OUT/s19f.tgz" -C "$OUT" s19f ;;
  s20_pd_share|s20_pd_share2)  # (s20_pd_share2: the same after cuda_ipc waits for a pending producer off the GIL,
    # with the cuda_ipc GPU tests first) 1P1D on ONE GPU (--allow-gpu-sharing: prefill and decode instances both on cuda:0, cuda_ipc between
    # them), whole-block pushes (the default over cuda_ipc) against --kv-layerwise on, bf16 then fp8 KV, arms alternating;
    # dummy Qwen3-8B, 8000 KV blocks per instance (two instances share the GPU's memory)
    [ $STAGE = s20_pd_share2 ] && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
      tests/kv/test_kv_cuda.py 2>&1 | tee "$W/gpu_tests_kv_cuda.txt" | tail -8
    H="python3 benchmarks/router/pd_handover.py --model qwen3-8b --load-format dummy --max-model-len 33024 --launcher-args=--allow-gpu-sharing"
    for kv in auto fp8; do
      lens="8192 32768"; [ $kv = fp8 ] && lens="8192"
      for arm in whole layerwise; do
        a="--num-gpu-blocks 8000 --kv-cache-dtype $kv"; [ $arm = layerwise ] && a="$a --kv-layerwise on"
        echo "== $kv KV, $arm"
        timeout 170 $H --prompt-lens $lens --num-requests 6 "--instance-args=$a" --out "$W/pd_${kv}_${arm}.json" \
          > "$W/pd_${kv}_${arm}.txt" 2>&1
        grep -E "^\| (8192|32768)|Traceback|Error" "$W/pd_${kv}_${arm}.txt" | tail -4
        [ -f "$W/pd_${kv}_${arm}.json" ] && python3 -c "
import json, sys
for n, r in json.load(open(sys.argv[1]))['results'].items():
    f = lambda k: '-' if not r.get(k) else '%.2f' % (r[k]['p50'] * 1e3)
    print(n, ' '.join(k + '=' + f(k) for k in ('prefill_s', 'handover_s', 'push_start_s', 'push_landed_s', 'admit_s')))
" "$W/pd_${kv}_${arm}.json"
      done
    done
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s20_phases)  # the handover in phases (prefill done -> push began -> notification taken -> admitted), 1P1D on ONE GPU
    # as s20_pd_share's whole-block arm, bf16 then fp8 KV: what is fixed in a handover, whatever the bytes
    H="python3 benchmarks/router/pd_handover.py --model qwen3-8b --load-format dummy --max-model-len 33024 --launcher-args=--allow-gpu-sharing"
    for kv in auto fp8; do
      echo "== $kv KV"
      timeout 200 $H --prompt-lens 1024 8192 32768 --num-requests 6 "--instance-args=--num-gpu-blocks 8000 --kv-cache-dtype $kv" \
        --out "$W/phases_${kv}.json" > "$W/phases_${kv}.txt" 2>&1
      python3 - "$W/phases_${kv}.json" <<'PY'
import json, sys
for n, r in json.load(open(sys.argv[1]))["results"].items():
    f = lambda k: "-" if not r.get(k) else f"{r[k]['p50'] * 1e3:.2f}"
    print(n, " ".join(f"{k}={f(k)}" for k in ("handover_s", "push_start_s", "push_landed_s", "admit_s", "push_s",
                                               "order_path_s", "first_token_out_s")))
PY
    done
    tar czf "$OUT/s20_phases.tgz" -C "$OUT" s20_phases ;;
  s21a)  # the library prefill fed leaner (the prefix gathered by a Triton kernel, no zero-filled copies of inputs that
    # already fit, one query copy for both calls): GPU tests, the row old vs new on the 32k chunks (bench_library_row),
    # the four chunks as engine steps; then o/down/qkv split over K with float32 parts at 32..384 rows
    save() { tar czf "$OUT/s21a.tgz" -C "$OUT" s21a; }
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_library_prefill.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -8
    save
    timeout 150 python3 benchmarks/attention/bench_library_row.py --out "$W/library_row.json" > "$W/library_row.txt" 2>&1
    grep -E "^ctx|Error|error" "$W/library_row.txt" | cut -c1-400
    save
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --mixed= --loop= --max-model-len 40960"
    timeout 150 $B --decode= --prefill 8192,8192+8192,16384+8192,24576+8192 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(prefill|decode)[^ ]*:|ceilings|Error" "$W/steps.txt" | cut -c1-300
    save
    left=$(( 560 - ($(date +%s) - t0) ))
    [ $left -gt 60 ] && timeout $left python3 benchmarks/engine/bench_gemm_rows.py --shapes o,down,qkv \
      --rows 32,64,128,192,256,384 --split-k 2,3,4 --parts-dtype fp32 --out "$W/gemm_split.json" > "$W/gemm_split.txt" 2>&1
    grep -E "rows|ceilings" "$W/gemm_split.txt" | cut -c1-200
    save ;;
  s21b)  # the one-pass sampling kernel (pdserve.ops.sampling): its tests (compiled), the warm-up's burst test (the
    # burst now half at the default temperature), the sampler alone torch vs kernel, then the steady decode loops at
    # temperature 1 (what vLLM's bench serve requests get) with the kernel and with the torch path, alternating
    save() { tar czf "$OUT/s21b.tgz" -C "$OUT" s21b; }
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_sampling_kernel.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py 2>&1 \
      | tee "$W/gpu_tests_warmup.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    save
    timeout 90 python3 benchmarks/engine/bench_sampler.py --out "$W/sampler.json" 2>&1 | grep -E "^rows|Error" | tee "$W/sampler.txt"
    save
    sampler_loops kernel1 torch1 kernel2 torch2 ;;
  s21c_tests)  # the sampling kernel split over programs for few rows (s21b: one program a row took 155 us for one
    # row): its tests compiled, the warm-up burst test, the sampler alone torch vs kernel
    save() { tar czf "$OUT/s21c_tests.tgz" -C "$OUT" s21c_tests; }
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_sampling_kernel.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py \
      tests/ops/test_library_prefill.py 2>&1 | tee "$W/gpu_tests_warmup.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    timeout 90 python3 benchmarks/engine/bench_sampler.py --out "$W/sampler.json" 2>&1 | grep -E "^rows|Error" | tee "$W/sampler.txt"
    save ;;
  s21c_loops)  # the steady decode loops at temperature 1, the kernel and the torch path, arms $ARMS in order
    save() { tar czf "$OUT/s21c_loops.tgz" -C "$OUT" s21c_loops; }
    sampler_loops ${ARMS:-kernel1 torch1} ;;
  s22a)  # o/down split over K with float32 parts summed by the next add+RMSNorm (pdserve.ops.split_k): GPU tests
    # (the fold against the reference, cuBLAS's parts, a tiny model through graphs with the split; the sampling
    # kernel's per-row offsets, changed after s21's lease); the table measured (bench_split_k.py, written to
    # $W/split_k_table.json and used by the rest of the call); then whole steps and the steady loop at batch 256
    # (temperature 1) with the split and without, in the order on, off, on, off
    save() { tar czf "$OUT/s22a.tgz" -C "$OUT" s22a; }
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_split_k.py \
      tests/ops/test_norm.py tests/engine/test_split_k_engine.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" \
      | cut -c1-900 | tail -8
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_sampling_kernel.py 2>&1 \
      | tee "$W/gpu_tests_sampling.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    save
    timeout 150 python3 benchmarks/engine/bench_split_k.py --out "$W/split_k.json" --table-out "$W/split_k_table.json" \
      > "$W/split_k.txt" 2>&1
    grep -E "rows (128|192|256|384|512):|a step|table|ceilings|Error" "$W/split_k.txt" | cut -c1-300
    save
    [ -f "$W/split_k_table.json" ] && export PDSERVE_SPLIT_K_CONFIG="$W/split_k_table.json"
    ab_loops steps "off*" --no-split-k "--decode 128x1024,192x1024,256x1024 --loop 256x1024" on1 off1 on2 off2 ;;
  s22b)  # the steady batch-256 loop at temperature 1 with the shipped split table: its kernels and the GPU's idle
    # time under the profiler; then the loop with the split and without, in the order off, on, off, on
    save() { tar czf "$OUT/s22b.tgz" -C "$OUT" s22b; }
    timeout 200 $STEPS_8B --max-model-len 16384 --iters 20 --top 30 --decode= --loop 256x1024 \
      --profile-loop 256x1024 --loop-steps 40 --loop-temperature 1.0 --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -E "^loop[^ ]*:|^  idle|^\||^profile|GPU busy" | grep -v "async off" \
      | cut -c1-200 | head -45
    save
    ab_loops loop "off*" --no-split-k "--decode= --loop 256x1024" off1 on1 off2 on2 ;;
  s22c)  # the sampling kernel with one reduction per program (per-lane bests) against s21's (two block reductions per
    # 512 columns; benchmarks/lease_s22/_old_sampling.py, untracked, carried for this call): tests, the sampler alone
    # and the steady loops at temperature 1 (256x1024, 1x8192), in the order new, old, new, old
    save() { tar czf "$OUT/s22c.tgz" -C "$OUT" s22c; }
    cp pdserve/ops/sampling.py /tmp/sampling_new.py
    use() { if [ $1 = old ]; then cp benchmarks/lease_s22/_old_sampling.py pdserve/ops/sampling.py; else cp /tmp/sampling_new.py pdserve/ops/sampling.py; fi; }
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_sampling_kernel.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py 2>&1 \
      | tee "$W/gpu_tests_warmup.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    save
    for v in new old; do
      use $v
      timeout 90 python3 benchmarks/engine/bench_sampler.py --out "$W/sampler_$v.json" 2>&1 | grep -E "^rows|Error" \
        | sed "s/^/$v: /" | tee "$W/sampler_$v.txt"
    done
    save
    for v in new1 old1 new2 old2; do
      left=$(( 565 - ($(date +%s) - t0) )); [ $left -lt 60 ] && { echo "no time left for $v"; break; }
      use ${v%?}
      timeout $(( left < 100 ? left : 100 )) $STEPS_8B --max-model-len 16384 --decode= --loop 256x1024,1x8192 \
        --loop-steps 100 --loop-temperature 1.0 --out "$W/loop_$v.json" > "$W/loop_$v.txt" 2>&1
      echo "== $v"; grep -E "^loop[^ ]*:|Error" "$W/loop_$v.txt" | grep -v "async off" | cut -c1-220
      save
    done
    use new ;;
  s22d)  # the split table on another GPU kind (an H100 when run there): GPU tests of the split, bench_split_k.py's
    # table (used by the rest of the call), then the batch-256 loop at temperature 1 with it and without (on, off)
    save() { tar czf "$OUT/s22d.tgz" -C "$OUT" s22d; }
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_split_k.py \
      tests/ops/test_norm.py tests/engine/test_split_k_engine.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" \
      | cut -c1-900 | tail -8
    timeout 150 python3 benchmarks/engine/bench_split_k.py --out "$W/split_k.json" --table-out "$W/split_k_table.json" \
      > "$W/split_k.txt" 2>&1
    grep -E "a step|table|ceilings|Error" "$W/split_k.txt" | cut -c1-400
    save
    [ -f "$W/split_k_table.json" ] && export PDSERVE_SPLIT_K_CONFIG="$W/split_k_table.json"
    ab_loops loop "off*" --no-split-k "--decode= --loop 256x1024" on1 off1 ;;
  s22e)  # where the batch-256 step's last few percent could come from: the KV read by a read-only probe over the
    # decode kernel's paged pattern against a flat stream and the decode kernel (probe_kv_read.py); the sampling
    # kernel's launch shape (bench_sampler.py --sweep)
    save() { tar czf "$OUT/s22e.tgz" -C "$OUT" s22e; }
    timeout 300 python3 benchmarks/attention/probe_kv_read.py --out "$W/kv_read.json" > "$W/kv_read.txt" 2>&1
    grep -E "^(decode|flat)|GB a layer|Error" "$W/kv_read.txt" | cut -c1-200
    grep -E "^paged" "$W/kv_read.txt" | sort -n -r -k8 | head -8
    save
    timeout 200 python3 benchmarks/engine/bench_sampler.py --sweep --out "$W/sampler.json" > "$W/sampler.txt" 2>&1
    grep -E "^rows|Error" "$W/sampler.txt"
    for r in 1 64 256; do grep -E "^sweep rows +$r " "$W/sampler.txt" | sort -n -k8 | head -3; done
    save ;;
  s22f)  # the sampling kernel at 8 warps a program (s22e's sweep): its tests, the warm-up burst (compiles nothing), the
    # sampler alone; then the batch-256 loop at temperature 1 with the decode kernel's rule as shipped (one split at
    # 256 rows) and with 32 waves' worth of programs (two splits and the merge), in the order base, w32, base, w32
    save() { tar czf "$OUT/s22f.tgz" -C "$OUT" s22f; }
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_sampling_kernel.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py 2>&1 \
      | tee "$W/gpu_tests_warmup.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    timeout 90 python3 benchmarks/engine/bench_sampler.py --out "$W/sampler.json" 2>&1 | grep -E "^rows|Error" \
      | tee "$W/sampler.txt"
    save
    ab_loops loop "w32*" "--decode-waves 32" "--decode= --loop 256x1024" base1 w32a base2 w32b ;;
  s22g)  # the session's code against the code it started from (45e1c9d's pdserve/, archived into the untracked
    # benchmarks/lease_s22/_old/ and carried for this call, first on PYTHONPATH in the `old` arms): the steady loops at
    # temperature 1, batch 256 at 1k and batch 1 at 8k, in the order new, old, new, old
    save() { tar czf "$OUT/s22g.tgz" -C "$OUT" s22g; }
    for v in new1 old1 new2 old2; do
      left=$(( 565 - ($(date +%s) - t0) )); [ $left -lt 60 ] && { echo "no time left for $v"; break; }
      pp=""; case $v in old*) pp="$PWD/benchmarks/lease_s22/_old" ;; esac
      PYTHONPATH=$pp timeout $(( left < 120 ? left : 120 )) $STEPS_8B --max-model-len 16384 --decode= \
        --loop 256x1024,1x8192 --loop-steps 100 --loop-temperature 1.0 --out "$W/loop_$v.json" > "$W/loop_$v.txt" 2>&1
      echo "== $v"; grep -E "^loop[^ ]*:|Error" "$W/loop_$v.txt" | grep -v "async off" | cut -c1-220
      PYTHONPATH=$pp python3 -P -c "import pdserve.ops.sampling as s; print('sampling from', s.__file__, 'split_k:', end=' '); import importlib.util as u; print(u.find_spec('pdserve.ops.split_k') is not None)"
      save
    done ;;
  s23a)  # exploration: the decode kernel's batch-256 tiles and a persistent flattened-loop variant
    # (probe_decode_variants.py), and which of a step's products would gain from a split over K (probe_gemm_split.py)
    save() { tar czf "$OUT/s23a.tgz" -C "$OUT" s23a; }
    timeout 240 python3 benchmarks/attention/probe_decode_variants.py --out "$W/decode_variants.json" \
      > "$W/decode_variants.txt" 2>&1
    grep -v "^$" "$W/decode_variants.txt" | cut -c1-200 | tail -25
    save
    timeout 240 python3 benchmarks/engine/probe_gemm_split.py --out "$W/gemm_split.json" > "$W/gemm_split.txt" 2>&1
    grep -v "^$" "$W/gemm_split.txt" | cut -c1-200 | tail -34
    save ;;
  s23b)  # the KV write inside the rotary kernel on the GPU (tests: fp8 pools, graphs against eager with the Triton
    # backend, the warm-up burst compiles nothing while serving); then Nsight Compute on the batch-256 decode kernel
    # and the read-only pass over the same pages
    save() { tar czf "$OUT/s23b.tgz" -C "$OUT" s23b; }
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_rotary.py \
      tests/ops/test_attention_kv_write.py tests/engine/test_cuda_graphs.py tests/engine/test_split_k_engine.py \
      tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -8
    save
    uname -r | tee "$W/kernel.txt"
    left=$(( 560 - ($(date +%s) - t0) ))
    [ $left -gt 60 ] && timeout $left ncu --clock-control none -k regex:"_decode_kernel|_paged_read_kernel" \
      --launch-skip 2 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
      python3 benchmarks/attention/ncu_decode.py > "$W/ncu.txt" 2>&1
    grep -E "regs|==PROF==|Error|_kernel|Throughput|Duration|Occupancy|Registers|Shared Memory|Stall|Warp Cycles|Block Limit|Waves" "$W/ncu.txt" | cut -c1-160 | head -70
    save ;;
  s23e)  # the inverse-CDF sampling kernel: its tests on the GPU, the sampler alone with the launch-shape sweep
    save() { tar czf "$OUT/s23e.tgz" -C "$OUT" s23e; }
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ops/test_sampling_kernel.py 2>&1 \
      | tee "$W/gpu_tests_sampling.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py 2>&1 \
      | tee "$W/gpu_tests_warmup.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    save
    timeout 120 python3 benchmarks/engine/bench_sampler.py --sweep --out "$W/sampler.json" > "$W/sampler.txt" 2>&1
    grep -E "^rows|Error" "$W/sampler.txt"; for r in 1 64 256; do grep -E "^sweep rows +$r " "$W/sampler.txt" | sort -n -k8 | head -3; done
    save ;;
  s23c)  # the session's engine code against the code it started from (de870cd's pdserve/, archived into the
    # untracked benchmarks/lease_s23/_old/ and first on PYTHONPATH in the `old` arms): the steady loops at
    # temperature 1, batch 256 at 1k and batch 1 at 8k, in the order new, old, new, old
    save() { tar czf "$OUT/s23c.tgz" -C "$OUT" s23c; }
    for v in new1 old1 new2 old2; do
      left=$(( 565 - ($(date +%s) - t0) )); [ $left -lt 60 ] && { echo "no time left for $v"; break; }
      pp=""; case $v in old*) pp="$PWD/benchmarks/lease_s23/_old" ;; esac
      PYTHONPATH=$pp timeout $(( left < 130 ? left : 130 )) $STEPS_8B --max-model-len 16384 --decode= \
        --loop 256x1024,1x8192 --loop-steps 100 --loop-temperature 1.0 --out "$W/loop_$v.json" > "$W/loop_$v.txt" 2>&1
      echo "== $v"; grep -E "^loop[^ ]*:|Error" "$W/loop_$v.txt" | grep -v "async off" | cut -c1-220
      PYTHONPATH=$pp python3 -P -c "import pdserve.ops.sampling as s; print('sampling from', s.__file__)"
      save
    done ;;
  s23d)  # the KV write inside the rotary kernel on and off (--no-kv-write-early: the backend's write_kv kernel), the
    # rest of the session's code the same (the decode read-ahead on): the batch-256 and batch-1 8k loops at
    # temperature 1, in the order on, off, on, off
    save() { tar czf "$OUT/s23d.tgz" -C "$OUT" s23d; }
    ab_loops loop "off*" --no-kv-write-early "--decode= --loop 256x1024,1x8192" on1 off1 on2 off2 ;;
  s23f)  # the decode kernel with the block table read a tile ahead (probe_decode_variants.py: the pipeliner then keeps
    # num_stages - 1 K/V tiles in flight) against the engine's, at several tiles, two rounds
    save() { tar czf "$OUT/s23f.tgz" -C "$OUT" s23f; }
    timeout 300 python3 benchmarks/attention/probe_decode_variants.py --out "$W/decode_variants.json" \
      > "$W/decode_variants.txt" 2>&1
    grep -v "^$" "$W/decode_variants.txt" | cut -c1-200 | tail -32
    save ;;
  s23g)  # the decode kernel's registers capped (maxnreg: 5 programs an SM instead of 4) with and without the block
    # table read a tile ahead, against the engine's kernel as shipped (probe_decode_variants.py), two rounds
    save() { tar czf "$OUT/s23g.tgz" -C "$OUT" s23g; }
    timeout 300 python3 benchmarks/attention/probe_decode_variants.py --out "$W/decode_variants.json" \
      > "$W/decode_variants.txt" 2>&1
    grep -v "^$" "$W/decode_variants.txt" | cut -c1-200 | tail -32
    save ;;
  s23h)  # the decode kernel's block table read a tile ahead and the KV write in the rotary kernel on the GPU: decode
    # and warm-up tests; then the steady loops at temperature 1 with both (new) and with neither (old:
    # --no-decode-prefetch --no-kv-write-early), in the order new, old, new, old
    save() { tar czf "$OUT/s23h.tgz" -C "$OUT" s23h; }
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    save
    ab_loops loop "old*" "--no-decode-prefetch --no-kv-write-early" "--decode= --loop 256x1024,1x8192" \
      new1 old1 new2 old2 ;;
  s23i)  # the batch-256 loop at temperature 1 under the profiler with the session's code (the decode read-ahead, the
    # KV write in the rotary kernel, the inverse-CDF sampler): its kernels and the GPU's idle time
    save() { tar czf "$OUT/s23i.tgz" -C "$OUT" s23i; }
    timeout 250 $STEPS_8B --max-model-len 16384 --iters 20 --top 30 --decode= --loop 256x1024 \
      --profile-loop 256x1024 --loop-steps 40 --loop-temperature 1.0 --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -E "^loop[^ ]*:|^  idle|^\||^profile|GPU busy" | grep -v "async off" \
      | cut -c1-200 | head -40
    save ;;
  s24a)  # the add+RMSNorm folded into the one-row products around it (pdserve.ops.norm_fold)
    save() { tar czf "$OUT/s24a.tgz" -C "$OUT" s24a; }
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_norm_fold.py \
      tests/ops/test_linear.py tests/engine/test_warmup.py \
      tests/engine/test_vs_transformers.py::test_one_row_norm_fold_on_cuda_is_as_close_to_transformers_as_the_norm_kernels 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -8
    save
    ab_loops loop "off*" "--no-fold-norm" "--decode 1x8192 --loop 1x8192,1x1024" on1 off1 on2 off2 ;;
  s24b)  # the batch-1 8k loop at temperature 1 under the profiler with the norm fold
    timeout 250 $STEPS_8B --max-model-len 16384 --iters 20 --top 30 --decode= --loop 1x8192 \
      --profile-loop 1x8192 --loop-steps 60 --loop-temperature 1.0 --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -E "^loop[^ ]*:|^  idle|^\||^profile|GPU busy" | grep -v "async off" \
      | cut -c1-200 | head -40
    tar czf "$OUT/s24b.tgz" -C "$OUT" s24b ;;
  s27a)  # cuBLASLt's candidate algorithms for Qwen3-8B's products at 128..512 rows, each timed against torch's pick
    # (probe_lt_algos.py); then the steady loops at temperature 1 as shipped (this machine's baseline)
    save() { tar czf "$OUT/s27a.tgz" -C "$OUT" s27a; }
    timeout 330 python3 benchmarks/engine/probe_lt_algos.py --rows ${LT_ROWS:-128,192,256,320,384,512} \
      --algos ${LT_ALGOS:-32} --out "$W/lt_algos.json" > "$W/lt_algos.txt" 2>&1
    grep -v "^$" "$W/lt_algos.txt" | cut -c1-250 | tail -40
    save
    ab_loops loop "none" "" "--decode= --loop 256x1024,1x8192" base1 ;;
  s28a)  # the GPU tests of the warm-up, among them that a step of 4096 + 1
    # tokens compiles nothing after it (layers.mlp_parts); then a 32k prompt's 2048-token chunks as engine steps with
    # cuDNN's prefill from 2048 tokens (PDSERVE_PREFILL_LIBRARY_MIN_CHUNK=2048) and as shipped (the Triton kernel below
    # 4096), an 8192-token chunk beside them: is --max-long-prefill-tokens' slower prefill the kernel choice?
    save() { tar czf "$OUT/s28a.tgz" -C "$OUT" s28a; }
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -6
    save
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --mixed= --loop= --decode= --max-model-len 40960"
    for arm in lib2048 shipped; do
      e=""; [ $arm = lib2048 ] && e="PDSERVE_PREFILL_LIBRARY_MIN_CHUNK=2048"
      env $e timeout 150 $B --prefill 2048+2048,8192+2048,16384+2048,24576+2048,30720+2048,24576+8192 \
        --out "$W/chunks_$arm.json" > "$W/chunks_$arm.txt" 2>&1
      echo "== $arm"; grep -E "^prefill[^ ]*:|Error" "$W/chunks_$arm.txt" | cut -c1-200
      save
    done ;;
  s28b)  # a chunk on a prefix below 2048 tokens: cuDNN (PDSERVE_PREFILL_LIBRARY_MIN_CHUNK=256) against the Triton
    # kernel (as shipped: MIN_CHUNK 4096), chunks of 256-2048 tokens on prefixes aligned to PREFIX_BUCKET (1024) and
    # not (16900, 17000, 30000: the causal call carries the prefix's tokens past the bucket as dummy query rows);
    # 16384+4096 takes cuDNN in both arms (the control)
    save() { tar czf "$OUT/s28b.tgz" -C "$OUT" s28b; }
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --mixed= --loop= --decode= --max-model-len 40960"
    P=1024+1024,8192+1024,16384+1024,30720+1024,16900+1024,8192+512,30720+512,16900+512,8192+256,30720+256,17000+2048,30000+2048,16384+4096
    for arm in lib256 shipped; do
      e=""; [ $arm = lib256 ] && e="PDSERVE_PREFILL_LIBRARY_MIN_CHUNK=256"
      env $e timeout 200 $B --prefill $P --out "$W/chunks_$arm.json" > "$W/chunks_$arm.txt" 2>&1
      echo "== $arm"; grep -E "^prefill[^ ]*:|Error" "$W/chunks_$arm.txt" | cut -c1-200
      save
    done ;;
  s28c)  # the merge kernel as one binary for any chunk length and offset: its GPU test, then the same test with the
    # kernel's decorator reverted to a plain @triton.jit in this (device) copy, where it should fail
    T="tests/ops/test_library_prefill.py::test_merge_two_is_one_binary_for_any_length_and_offset"
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line $T 2>&1 | tee "$W/fixed.txt" | tail -3
    sed -i 's/^@triton.jit(do_not_specialize=\["L"\].*$/@triton.jit/' pdserve/ops/attention/merge.py
    grep -n "^@triton.jit" pdserve/ops/attention/merge.py
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line $T 2>&1 | tee "$W/reverted.txt" | tail -3 ;;
  s28d)  # cuDNN's prefill on planned shapes only below MIN_CHUNK, and the plan watcher: the library prefill's GPU tests,
    # and that long prompts after the warm-up (capped chunks beside a decoding request, full chunks alone) build no
    # cuDNN plan while a prefix-cache hit of a new long chunk length builds one
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_library_prefill.py \
      tests/engine/test_warmup.py::test_long_prompts_after_the_warm_up_build_no_cudnn_plan 2>&1 | tee "$W/gpu_tests.txt" \
      | grep -v "^\.*$" | cut -c1-1500 | tail -12 ;;
  s29a)  # (written in session 28, not yet run) where the batch-1 8k step's 0.7 ms above its floor goes: the one-row
    # products alone (bench_linear.py: cuBLAS, the shipped skinny tile and the sweep's best, GB/s against the copy
    # rate; session 12 had qkv and o at 3.4-3.5 TB/s against 4.2-4.5 for gate_up and lm_head), then the batch-1 8k
    # loop under the profiler with programmatic dependent launch off (each kernel's own time, not its wait) and the
    # same loop as shipped (PDL early) for the step time
    save() { tar czf "$OUT/s29a.tgz" -C "$OUT" s29a; }
    timeout 240 python3 benchmarks/engine/bench_linear.py --model qwen3-8b --rows 1 --sweep \
      --out "$W/linear.json" > "$W/linear.txt" 2>&1
    grep -v " INFO " "$W/linear.txt" | grep -E "^\||GB/s" | cut -c1-200 | head -24
    save
    timeout 200 $STEPS_8B --max-model-len 16384 --iters 20 --top 30 --decode= --loop 1x8192 --pdl off \
      --profile-loop 1x8192 --loop-steps 60 --loop-temperature 1.0 --out "$W/profile_pdl_off.json" \
      > "$W/profile_pdl_off.txt" 2>&1
    grep -v " INFO " "$W/profile_pdl_off.txt" | grep -E "^loop[^ ]*:|^\||^profile|GPU busy" | grep -v "async off" \
      | cut -c1-200 | head -30
    save ;;
  s29b)  # the batch-1 loops' kernels by position in the step (bench_steps.py prints each per-layer kernel's launches
    # folded by kind: q/k/v, o, gate_up, down and the LM head for the one-row products), with programmatic dependent
    # launch off (each kernel's own time) at 8k and 32k of context, then as shipped (PDL early: a kernel's time holds
    # its wait for the one before) at 8k
    save() { tar czf "$OUT/s29b.tgz" -C "$OUT" s29b; }
    timeout 200 $STEPS_8B --max-model-len 40960 --iters 20 --top 12 --decode= --pdl off \
      --profile-loop 1x8192,1x32768 --loop-steps 40 --loop-temperature 1.0 --out "$W/slots_pdl_off.json" \
      > "$W/slots_pdl_off.txt" 2>&1
    grep -v " INFO " "$W/slots_pdl_off.txt" | grep -E "^loop[^ ]*:|^\||^profile|by position" | cut -c1-400 | head -40
    save
    timeout 150 $STEPS_8B --max-model-len 16384 --iters 20 --top 12 --decode= \
      --profile-loop 1x8192 --loop-steps 40 --loop-temperature 1.0 --out "$W/slots_pdl_early.json" \
      > "$W/slots_pdl_early.txt" 2>&1
    grep -v " INFO " "$W/slots_pdl_early.txt" | grep -E "^loop[^ ]*:|by position" | cut -c1-400 | head -12
    save ;;
  s29c|s30a)  # the folded one-row products' own tiles (pdserve.ops.linear.fold_config): bench_linear.py --folds sweeps
    # the sum kernel with each fold of Qwen3-8B's batch-1 step (q/k/v and gate_up "in", o "out", down "act_out")
    # against the tile serving takes; the GPU tests of the skinny kernel and the norm fold with the measured table;
    # then the batch-1 loops with the measured table (new) and as shipped (old), in the order new, old, new.
    # s30a (written in session 29, not yet run): the same with every tile also prefetching (SkinnyConfig.prefetch: the
    # next weight tile loaded a step ahead, a register double buffer), against the fold entries s29c shipped
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    extra=""; [ $STAGE = s30a ] && extra="--prefetch"
    timeout 200 python3 benchmarks/engine/bench_linear.py --model qwen3-8b --rows 1 --folds $extra --precompile-procs 16 \
      --fold-out "$W/folds_table.json" --out "$W/folds.json" > "$W/folds.txt" 2>&1
    grep -v " INFO " "$W/folds.txt" | grep -E "shipped tile|^    |Error|error" | cut -c1-300 | head -24
    save
    [ -f "$W/folds_table.json" ] || { echo "no table"; exit 0; }
    PDSERVE_SKINNY_CONFIG="$W/folds_table.json" timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
      --tb=short tests/ops/test_linear.py tests/ops/test_norm_fold.py 2>&1 | tee "$W/gpu_tests.txt" | tail -3
    i=0
    for arm in new old new; do
      i=$((i + 1))
      if [ $arm = new ]; then export PDSERVE_SKINNY_CONFIG="$W/folds_table.json"; else unset PDSERVE_SKINNY_CONFIG; fi
      timeout 90 $STEPS_8B --max-model-len 16384 --iters 20 --decode= --loop 1x8192,1x1024 --loop-steps 100 \
        --loop-temperature 1.0 --out "$W/loop_${i}_$arm.json" > "$W/loop_${i}_$arm.txt" 2>&1
      grep -E "^loop:[^ ]* async on" "$W/loop_${i}_$arm.txt" | sed "s/^/$arm: /" | cut -c1-200
      save
    done
    unset PDSERVE_SKINNY_CONFIG ;;
  s30b)  # the decode kernel's first tile read before its PDL wait (decode.EARLY_TILE), batch-1 loops at 8k and 1k; one
    # process an arm, in order. Arms: off (--no-decode-early-tile), on (K and V early, no register limit: the default
    # at 533530a, where this ran; (64, 4, 2), 64 splits at one row), t32 (on, few-row tile (32, 4, 2)), w8 (on,
    # (64, 8, 2)), s48 (on, 3 waves: 49 splits, 392 programs, so a 157-register program (3 an SM) fits one wave)
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    arm_flags() {
      local e="--decode-early-tile --decode-early-v --decode-early-maxnreg 0"
      case $1 in off) echo "--no-decode-early-tile" ;; on) echo "$e" ;; t32) echo "$e --few-rows-tile 32,4,2" ;;
        w8) echo "$e --few-rows-tile 64,8,2" ;; s48) echo "$e --decode-waves 3" ;; esac
    }
    b1_arms 570 80 16384 1x8192,1x1024 off on t32 w8 s48 off on ;;
  s30d)  # the early tile, K alone (as shipped) against K and V and against off: GPU tests, then batch-1 loops at 8k, 32k
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
      tests/engine/test_cuda_graphs.py::test_pdl_changes_no_bit tests/engine/test_vs_transformers.py \
      tests/engine/test_async_gpu.py tests/ops/test_attention_decode.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-600 | tail -12
    save
    arm_flags() {
      case $1 in off) echo "--no-decode-early-tile" ;; k) echo "--decode-early-tile --no-decode-early-v" ;;
        kv) echo "--decode-early-tile --decode-early-v --decode-early-maxnreg 0" ;; esac
    }
    b1_arms 560 80 40960 1x8192,1x32768 off k kv off k kv ;;
  s30e)  # the early tile with K and V held at 128 registers (decode.EARLY_V_MAXNREG: 4 programs an SM) against off,
    # batch-1 loops at 8k and 32k, in order off, kv, off, kv; then the graphs' PDL-changes-no-bit test with it
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    arm_flags() {
      case $1 in off) echo "--no-decode-early-tile" ;;
        kv) echo "--decode-early-tile --decode-early-v --decode-early-maxnreg 128" ;; esac
    }
    b1_arms 560 70 40960 1x8192,1x32768 off kv off kv
    left=$(( ${S30E_LIMIT:-240} - ($(date +%s) - t0) ))
    [ $left -gt 30 ] && timeout $left python3 -c "import sys, pytest; from pdserve.ops.attention import decode as d
d.EARLY_V = True; sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '-rfE', '--tb=short',
'tests/engine/test_cuda_graphs.py::test_pdl_changes_no_bit']))" 2>&1 | tee "$W/gpu_tests.txt" | tail -3
    save ;;
  s31a)  # the batch-1 step in serving against the engine loop on the same GPU (8k context, temperature 1: what a
    # request of vLLM's client gets). Needs .vllm-stage/model carried (config and tokenizer of the dummy Qwen3-8B)
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    loop8k() {
      timeout 90 $STEPS_8B --max-model-len 40960 --iters 20 --decode= --loop 1x8192 --loop-steps 200 \
        --loop-temperature 1.0 --out "$W/loop_$1.json" > "$W/loop_$1.txt" 2>&1
      grep -E "^loop:[^ ]* async on|Error" "$W/loop_$1.txt" | sed "s/^/$1: /" | cut -c1-200
    }
    loop8k before; save
    start_8b_server
    for run in 8192x16x16 8192x256x4; do
      IFS=x read -r i o n <<< "$run"
      timeout 120 pdserve bench serve --backend vllm --base-url http://127.0.0.1:8200 --model qwen3-dummy --tokenizer $M \
        --dataset-name random --random-input-len $i --random-output-len $o --num-prompts $n --max-concurrency 1 \
        --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --num-warmups 1 --seed 0 \
        --disable-tqdm --no-plots --save-result --result-dir "$W" --result-filename "serve_$run.json" \
        > "$W/serve_$run.txt" 2>&1
      echo "== $run"; python3 benchmarks/vs_vllm/compare.py --line "$W/serve_$run.json"
      save
    done
    kill $S; wait $S 2>/dev/null; gzip -f "$W/server.log"; rm -f "$W"/*.pdserve.json
    loop8k after; save ;;
  s31b)  # the folded one-row products alone with PDL as shipped and off, then the plain ones with PDL off
    for pdl in early off; do
      timeout 120 python3 benchmarks/engine/bench_linear.py --model qwen3-8b --rows 1 --folds --shipped-only --pdl $pdl \
        --out "$W/folds_$pdl.json" > "$W/folds_$pdl.txt" 2>&1
      echo "== folds, PDL $pdl"; grep -v " INFO " "$W/folds_$pdl.txt" | grep -E "shipped tile|Error|error" | cut -c1-200
    done
    timeout 120 python3 benchmarks/engine/bench_linear.py --model qwen3-8b --rows 1 --pdl off --out "$W/plain_off.json" \
      > "$W/plain_off.txt" 2>&1
    grep -v " INFO " "$W/plain_off.txt" | tail -12 | cut -c1-200
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s31c)  # the batch-1 loops' kernels by kind under PDL as shipped: each launch's marginal time (what it adds to the step)
    timeout 200 $STEPS_8B --max-model-len 40960 --iters 20 --top 12 --decode= \
      --profile-loop 1x8192,1x32768 --loop-steps 40 --loop-temperature 1.0 --out "$W/marginal.json" \
      > "$W/marginal.txt" 2>&1
    grep -v " INFO " "$W/marginal.txt" | grep -E "^loop[^ ]*:|^\||^profile|marginal" | cut -c1-400 | head -60
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s31d)  # the decode kernel merging its own splits (decode.SELF_MERGE, off as shipped): GPU tests with it on, then loops
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 150 python3 -c "import sys, pytest; from pdserve.ops.attention import decode as d
d.SELF_MERGE = True; sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '-rfE', '--tb=short', '-x',
'tests/ops/test_attention_decode.py', '-k', 'cuda and not lens1']))" 2>&1 | tee "$W/gpu_tests.txt" | tail -3
    save
    arm_flags() { case $1 in off) echo "--no-decode-self-merge" ;; on) echo "--decode-self-merge" ;; esac; }
    b1_arms 560 70 40960 1x8192,1x32768 off on off on ;;
  s31e)  # the decode kernel with the layer's QK-norm, rotary and K/V write in it (decode.ROPE_IN_DECODE): GPU tests,
    # then loops (off, on, on without ROPE_MAXNREG, twice)
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      -k "rope" 2>&1 | tee "$W/gpu_tests_kernel.txt" | grep -v "^\.*$" | cut -c1-600 | tail -6
    timeout 200 python3 -c "import sys, pytest; from pdserve.ops.attention import decode as d
d.ROPE_IN_DECODE = True; sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '-rfE', '--tb=short',
'tests/engine/test_vs_transformers.py', 'tests/engine/test_cuda_graphs.py::test_pdl_changes_no_bit',
'tests/engine/test_warmup.py::test_a_burst_after_the_warm_up_compiles_nothing', 'tests/engine/test_async_gpu.py']))" \
      2>&1 | tee "$W/gpu_tests_engine.txt" | grep -v "^\.*$" | cut -c1-600 | tail -8
    save
    arm_flags() {
      case $1 in off) echo "--no-decode-rope" ;; on) echo "--decode-rope" ;;
        on0) echo "--decode-rope --decode-rope-maxnreg 0" ;; esac
    }
    b1_arms 560 75 40960 1x8192,1x32768,64x2048 off on on0 off on on0 ;;
  s32a)  # the rotary in the many-program decode launch (decode.ROPE_MANY_PROGRAMS): loops per arm, then the
    # batch-256 loop's kernels with their marginal times
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    arm_flags() {
      case $1 in off) echo "--no-decode-rope-many" ;; many) echo "--decode-rope-many" ;;
        many0) echo "--decode-rope-many --decode-rope-maxnreg 0" ;; esac
    }
    b1_arms 440 80 16384 256x1024,1x8192 off many many0 off many many0
    left=$(( 570 - ($(date +%s) - t0) ))
    [ $left -gt 60 ] && timeout $left $STEPS_8B --max-model-len 16384 --iters 20 --top 14 --decode= --loop= \
      --profile-loop 256x1024 --loop-steps 20 --loop-temperature 1.0 --out "$W/marginal256.json" \
      > "$W/marginal256.txt" 2>&1
    grep -v " INFO " "$W/marginal256.txt" 2>/dev/null | grep -E "^loop[^ ]*:|^\||^profile|marginal" | cut -c1-300 | head -30
    save ;;
  s33a)  # the decode kernel's grid heads first (decode.HEAD_FIRST): probes, tests, then the loops per arm
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    for v in "12 random" "36 random" "36 seq"; do
      set -- $v
      timeout 90 python3 benchmarks/attention/probe_kv_read.py --quick --layers $1 --pages $2 \
        --out "$W/kv_read_$1_$2.json" > "$W/kv_read_$1_$2.txt" 2>&1
      grep -E "GB a layer|paged|decode|Error" "$W/kv_read_$1_$2.txt" | cut -c1-200
    done
    timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      -k heads_first 2>&1 | tee "$W/gpu_tests.txt" | tail -3
    save
    arm_flags() { case $1 in off) echo "--no-decode-head-first" ;; hf) echo "--decode-head-first" ;; esac; }
    b1_arms 580 95 16384 256x1024,1x8192 off hf off hf
    save ;;
  s33b)  # a TMA GEMM against cuBLAS at 256 rows
    timeout 560 python3 benchmarks/engine/bench_tma_linear.py --rows 256 --out "$W/tma.json" > "$W/tma.txt" 2>&1
    grep -E "^ceilings|^precompiled|rows|Error" "$W/tma.txt" | cut -c1-400
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s35a)  # batch-1 TPOT at 8k and 32k prompts as each server measures it itself: vLLM then pdserve on the one GPU,
    # vLLM's client, each run between two scrapes of the server's /metrics (side_by_side.sh: <run>.server.json)
    WORKLOADS="8192:16:16:1 32768:16:8:1" CLIENTS=vllm SINGLE_GPU=1 SERVERS="vllm pdserve" CLIENT_ROUNDS=1 \
      OUT=$W/sbs STAGE=.vllm-stage VLLM_USE_FLASHINFER_SAMPLER=0 timeout 560 \
      bash benchmarks/vs_vllm/side_by_side.sh single 2>&1 | tail -16
    python3 benchmarks/vs_vllm/compare.py --dir $W/sbs --out $W/sbs/comparison.json 2>&1 | grep -A4 "servers' own"
    for f in "$W"/sbs/*.log; do gzip -f "$f"; done
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s35c)  # dummy Qwen3-30B-A3B with an fp8 KV cache: its steps and loops against their floors (each token's top-8
    # experts counted), the steps a 1024/1024 c256 run is made of
    timeout 560 python3 benchmarks/engine/bench_steps.py --model qwen3-30b-a3b --kv-cache-dtype fp8 --load-format dummy \
      --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 16384 --iters 10 --loop-steps 60 \
      --loop-temperature 1.0 --decode 1x1024,256x1024,256x2048 --prefill 8192,8x1024 --mixed 256x1024+7x1024 \
      --loop 1x1024,256x1024 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(decode|prefill|mixed|loop)[^ ]*:|Error|ceilings" "$W/steps.txt" | grep -v "async off" | cut -c1-260
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s35e)  # a MoE layer's routing in one launch and its rows grouped by one program: GPU tests, the micro-benchmark,
    # the steps of dummy Qwen3-30B-A3B (fp8 KV) with both and with neither (arms off, on, off, on), then one server
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/model/test_fused_moe_kernel.py \
      tests/model/test_qwen3_moe_vs_transformers.py -k "align or route or graph or transformers" \
      > "$W/gpu_tests.txt" 2>&1; grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -8
    timeout 90 python3 benchmarks/moe/bench_route.py --out "$W/route.json" > "$W/route.txt" 2>&1; cut -c1-220 "$W/route.txt"
    save
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-30b-a3b --kv-cache-dtype fp8 --load-format dummy \
      --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 16384 --iters 10 --loop-steps 60 \
      --loop-temperature 1.0 --decode 1x1024,256x1024 --prefill 8192 --mixed= --loop 1x1024,256x1024"
    i=0
    for arm in off on off on; do
      i=$((i + 1)); F=""; [ $arm = off ] && F="--no-moe-route-kernel --no-moe-align-one-program"
      timeout 100 $B $F --out "$W/steps_${i}_$arm.json" > "$W/steps_${i}_$arm.txt" 2>&1
      grep -E "^(decode|prefill|loop)[^ ]*:|Error" "$W/steps_${i}_$arm.txt" | grep -v "async off" | cut -c1-150 \
        | sed "s/^/$arm($i) /"
    done
    save
    pdserve serve --model .vllm-stage/model-moe --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
      --kv-cache-dtype fp8 --served-model-name qwen3-dummy --port 8200 > "$W/server.log" 2>&1 & S=$!
    for i in $(seq 150); do
      curl -sf localhost:8200/v1/completions -H 'Content-Type: application/json' \
        -d '{"model":"qwen3-dummy","prompt":"t1 t2 t3","max_tokens":2}' > /dev/null && break; sleep 1
    done
    echo "server answered at $(( $(date +%s) - t0 )) s of the call"
    timeout 120 pdserve bench serve --backend vllm --base-url http://127.0.0.1:8200 --model qwen3-dummy \
      --tokenizer .vllm-stage/model-moe --dataset-name random --random-input-len 1024 --random-output-len 1024 \
      --num-prompts 512 --max-concurrency 256 --ignore-eos --percentile-metrics ttft,tpot,itl,e2el \
      --metric-percentiles 50,90,99 --num-warmups 1 --disable-tqdm --no-plots --save-result --result-dir "$W" \
      --result-filename c256.json > "$W/c256.txt" 2>&1
    python3 benchmarks/vs_vllm/compare.py --line "$W/c256.json" 2>/dev/null
    echo "pdserve compiled $(grep -c 'compiled a kernel while serving' "$W/server.log") kernels while serving"
    kill $S; wait $S 2>/dev/null; gzip -f "$W/server.log"; rm -f "$W"/*.pdserve.json
    save ;;
  s36b)  # the fp8 pool's decode kernel at the MoE's heads: GPU tests, the tile sweep with the read ahead, MoE tests
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      -k "fp8 or decode_matches_reference_cuda" > "$W/decode_tests.txt" 2>&1
    grep -v "^\.*$" "$W/decode_tests.txt" | cut -c1-400 | tail -6
    timeout 200 python3 benchmarks/attention/sweep_decode.py --hq 32 --hk 4 --head-dim 128 --kv fp8 --prefetch \
      --shapes 256x1024,256x2048,160x1536 --layers 12 --out "$W/sweep.json" > "$W/sweep.txt" 2>&1
    grep -E "^fp8|Error" "$W/sweep.txt" | cut -c1-200
    python3 - "$W/sweep.json" <<'PY' | tee "$W/fp8_many_tile.txt"
import json, math, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r.get("us") and r["prefetch"]]
shapes = {(r["batch"], r["context"]) for r in rows}
score = {}
for r in rows:
    score.setdefault(tuple(r["tile"]), []).append(r["of_floor"])
full = {t: math.exp(sum(map(math.log, v)) / len(v)) for t, v in score.items() if len(v) == len(shapes)}
best = max(full, key=full.get)
print(",".join(map(str, best)), f"geo-mean {100 * full[best]:.1f}% of the copy rate over {len(shapes)} shapes")
PY
    cut -d' ' -f1 "$W/fp8_many_tile.txt" > /tmp/fp8_many_tile.txt
    save
    left=$(( 570 - ($(date +%s) - t0) ))
    [ $left -gt 60 ] && timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
      tests/model/test_fused_moe_kernel.py tests/model/test_qwen3_moe_vs_transformers.py \
      -k "(align and 128) or route or graph or tables or transformers" > "$W/moe_tests.txt" 2>&1
    grep -v "^\.*$" "$W/moe_tests.txt" | cut -c1-400 | tail -8
    save ;;
  s36d)  # an fp8 pool's V widened by inline PTX: GPU tests, the sweep with and without, the MoE steps off and on
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      -k "fp8_v_widened or fp8_many_program" > "$W/decode_tests.txt" 2>&1
    grep -v "^\.*$" "$W/decode_tests.txt" | cut -c1-400 | tail -6
    timeout 240 python3 benchmarks/attention/sweep_decode.py --hq 32 --hk 4 --head-dim 128 --kv fp8 --prefetch \
      --v-widen --tiles "64,4,2;64,4,3;128,4,2;128,4,3;128,8,2;128,8,3;256,8,2;64,8,3" \
      --shapes 256x1024,256x2048,160x1536 --layers 12 --out "$W/sweep.json" > "$W/sweep.txt" 2>&1
    grep -E "^fp8 b=|Error" "$W/sweep.txt" | cut -c1-200
    python3 - "$W/sweep.json" <<'PY' | tee "$W/fp8_many.txt"
import json, math, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r.get("us")]
shapes = {(r["batch"], r["context"]) for r in rows}
def gm(pick):
    score = {}
    for r in rows:
        if pick(r):
            score.setdefault((tuple(r["tile"]), r["v_widen"]), []).append(r["of_floor"])
    return {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in score.items() if len(v) == len(shapes)}
ahead = gm(lambda r: r["prefetch"])
(tile, widen), best = max(ahead.items(), key=lambda kv: kv[1])
shipped = gm(lambda r: r["engine"])
print(",".join(map(str, tile)), int(widen), f"geo-mean {100 * best:.1f}% of the copy rate over {len(shapes)} shapes;",
      "as shipped", " ".join(f"{t} {100 * v:.1f}%" for (t, _), v in shipped.items()))
PY
    cut -d' ' -f1,2 "$W/fp8_many.txt" > /tmp/fp8_many.txt
    save
    read T WIDEN < /tmp/fp8_many.txt
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-30b-a3b --kv-cache-dtype fp8 --load-format dummy \
      --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 16384 --iters 10 --loop-steps 60 \
      --loop-temperature 1.0 --decode 256x1024 --prefill= --mixed= --loop 256x1024"
    i=0
    for arm in off on; do
      i=$((i + 1)); F=""
      [ $arm = on ] && F="--many-programs-tile-fp8 $T $([ "$WIDEN" = 1 ] && echo --decode-fp8-v-widen)"
      left=$(( 575 - ($(date +%s) - t0) ))
      [ $left -gt 60 ] && timeout $left $B $F --out "$W/steps_${i}_$arm.json" > "$W/steps_${i}_$arm.txt" 2>&1
      grep -E "^(decode|loop)[^ ]*:|Error" "$W/steps_${i}_$arm.txt" | grep -v "async off" | cut -c1-150 \
        | sed "s/^/$arm($i) /"
      save
    done ;;
  s36e)  # the MoE side by side, then the fp8 sweep at a few rows with and without V widened by PTX
    SBS_WORKLOADS=${SBS_WORKLOADS:-"1024:1024:512:256 8192:16:16:1"} OUT=$OUT bash "$0" moe
    left=$(( 570 - ($(date +%s) - t0) ))
    [ $left -gt 40 ] && timeout $left python3 benchmarks/attention/sweep_decode.py --hq 32 --hk 4 --head-dim 128 \
      --kv fp8 --v-widen --splits 0 --tiles "64,4,2;64,4,3;128,4,2;128,4,3" --shapes 1x1024,1x8192,4x8192,32x4096 \
      --layers 12 --out "$W/sweep_few.json" > "$W/sweep_few.txt" 2>&1
    grep -E "^fp8 b=|Error" "$W/sweep_few.txt" | cut -c1-200
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s36f)  # the decode kernel's, fp8 KV's and the warm-up's GPU tests at the shipped fp8 decode defaults
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      tests/ops/test_fp8_kv.py tests/engine/test_warmup.py > "$W/gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -8
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s37a)  # the warm-up's burst test with an fp8 pool, fp8 KV's GPU tests, the decode kernel's fp8 GPU tests
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py \
      tests/ops/test_fp8_kv.py tests/ops/test_attention_decode.py -k "burst or fp8" > "$W/gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -8
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s37b)  # the MoE's batch-1 loops with V by PTX in few-row launches and the rotary in the decode kernel, and without
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    off="off=--no-decode-fp8-v-widen-few,--no-decode-rope-fp8"
    wf="wf=--decode-fp8-v-widen-few,--no-decode-rope-fp8"
    wfr="wfr=--decode-fp8-v-widen-few,--decode-rope-fp8"
    moe_arms "--decode 1x1024,1x8192,32x4096 --loop 1x1024,1x8192" $off $wf $wfr $off $wf $wfr ;;
  s37c)  # the MoE's experts summed by the next norm: GPU tests, then the steps and loops with it and without
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/model/test_fused_moe_kernel.py \
      -k "summed_by" > "$W/gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -6
    moe_arms "--decode 1x1024,256x1024 --loop 1x1024,256x1024" off=--no-moe-sum-in-norm on=--moe-sum-in-norm \
      off=--no-moe-sum-in-norm on=--moe-sum-in-norm ;;
  s37d)  # the shipped fp8/MoE defaults of session 37: GPU tests, then steps and loops with them (new) and without (old)
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_warmup.py \
      tests/ops/test_attention_decode.py -k "burst or (rope and fp8) or widen" > "$W/gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -6
    save
    old="old=--no-decode-fp8-v-widen-few,--no-decode-rope-fp8,--no-moe-sum-in-norm"
    moe_arms "--decode 1x1024,32x4096,256x1024 --loop 1x1024,1x8192,256x1024" $old new= $old new= ;;
  s38a)  # the MoE GPU tests in full, then dummy Qwen3-8B's loops
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/model/test_qwen3_moe_vs_transformers.py \
      tests/model/test_fused_moe_kernel.py > "$W/moe_gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/moe_gpu_tests.txt" | cut -c1-400 | tail -6
    save
    timeout $(( 575 - ($(date +%s) - t0) )) $STEPS_8B --max-model-len 16384 --iters 10 --decode 256x1024 \
      --loop 256x1024,1x8192 --loop-temperature 1.0 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(decode|loop)[^ ]*:|Error|ceilings" "$W/steps.txt" | grep -v "async off" | cut -c1-200
    save ;;
  s38b)  # the MoE router through the skinny kernel: GPU tests, then the batch-1 steps and loops with it and without
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/model/test_qwen3_moe_vs_transformers.py \
      -k "router" > "$W/gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -6
    moe_arms "--decode 1x1024,4x1024 --loop 1x1024,1x8192" off=--no-moe-router-skinny on=--moe-router-skinny \
      off=--no-moe-router-skinny on=--moe-router-skinny ;;
  s39a)  # long prefill rows over an fp8 pool through cuDNN: GPU tests, then the MoE's prefill steps with it and without
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_library_prefill.py \
      > "$W/gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -6
    save
    i=0
    for v in off on off on; do
      i=$((i + 1)); left=$(( 575 - ($(date +%s) - t0) )); [ $left -lt 60 ] && { echo "no time left for $v"; break; }
      timeout $(( left < 110 ? left : 110 )) python3 benchmarks/engine/bench_steps.py --model qwen3-30b-a3b \
        --kv-cache-dtype fp8 --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960 \
        --iters 5 --decode= --mixed= --loop= --prefill 8192,24576+8192 --$([ $v = on ] || echo no-)library-fp8-pools \
        --out "$W/steps_${i}_$v.json" > "$W/steps_${i}_$v.txt" 2>&1
      grep -E "^prefill[^ ]*:|Error|KV sizing" "$W/steps_${i}_$v.txt" | cut -c1-200 | sed "s/^/$v($i) /"
      save
    done ;;
  s39b)  # fp8 pools through cuDNN shipped on: library, warm-up, sizing and fp8 GPU tests; then the 41 unrun MoE ones
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_library_prefill.py \
      tests/engine/test_warmup.py tests/engine/test_memory_profile.py > "$W/gpu_tests_library.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests_library.txt" | cut -c1-400 | tail -8
    save
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -k fp8 tests/engine/test_cuda_graphs.py \
      tests/ops/test_attention_backend.py tests/engine/test_fused_engine.py tests/ops/test_attention_prefill.py \
      tests/ops/test_attention_decode.py tests/ops/test_attention_kv_write.py > "$W/gpu_tests_fp8.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests_fp8.txt" | cut -c1-400 | tail -6
    save
    M2="tests/model/test_qwen3_moe_vs_transformers.py tests/model/test_fused_moe_kernel.py"
    python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider $M2 2>/dev/null | sed -n '167,207p' > "$W/moe_ids.txt"
    left=$(( 575 - ($(date +%s) - t0) ))
    echo "$(wc -l < "$W/moe_ids.txt") MoE tests, $left s left"
    [ $left -gt 30 ] && timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
      $(cat "$W/moe_ids.txt") > "$W/moe_gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/moe_gpu_tests.txt" | cut -c1-400 | tail -6
    save ;;
  s39c)  # the GPU tests s39b's limits cut: the fp8 ones after the 14th, the last MoE one
    F8="tests/engine/test_cuda_graphs.py tests/ops/test_attention_backend.py tests/engine/test_fused_engine.py
      tests/ops/test_attention_prefill.py tests/ops/test_attention_decode.py tests/ops/test_attention_kv_write.py"
    python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider -k fp8 $F8 2>/dev/null | grep "::" | sed -n '15,$p' \
      > "$W/ids.txt"
    python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/model/test_qwen3_moe_vs_transformers.py \
      tests/model/test_fused_moe_kernel.py 2>/dev/null | sed -n '207p' >> "$W/ids.txt"
    echo "$(wc -l < "$W/ids.txt") tests"
    timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short $(cat "$W/ids.txt") > "$W/gpu_tests.txt" 2>&1
    grep -v "^\.*$" "$W/gpu_tests.txt" | cut -c1-400 | tail -6
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s39d)  # dummy Qwen3-30B-A3B's (fp8 KV) prefill kernels at the shipped defaults: a fresh 8k prompt, an 8k chunk on 24k
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-30b-a3b --kv-cache-dtype fp8 --load-format dummy \
      --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960 --iters 5 --decode= --mixed= --loop="
    timeout 240 $B --profile "prefill:8192;prefill:24576+8192" --top 24 --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -E -A30 "^profile" | cut -c1-160 | head -70
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s40a)  # wide rotary programs in long steps: GPU tests, then prefill steps per arm (the MoE with fp8 KV, dense 8B)
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    gpu_tests 150 tests/ops/test_rotary.py
    i=0
    for spec in "moe 0" "moe 1024" "moe 2048" "moe 0" "moe 1024" "moe 2048" "8b 0" "8b 2048" "8b 0" "8b 2048"; do
      set -- $spec; i=$((i + 1)); left=$(( 575 - ($(date +%s) - t0) )); [ $left -lt 50 ] && { echo "no time for $spec"; break; }
      if [ $1 = moe ]; then m="--model qwen3-30b-a3b --kv-cache-dtype fp8 --prefill 8192,24576+8192"
      else m="--model qwen3-8b --prefill 8192"; fi
      timeout $(( left < 90 ? left : 90 )) python3 benchmarks/engine/bench_steps.py $m --load-format dummy \
        --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960 --iters 5 --decode= --mixed= --loop= \
        --rope-wide-tile $2 --out "$W/steps_${i}_$1_w$2.json" > "$W/steps_${i}_$1_w$2.txt" 2>&1
      grep -E "^prefill[^ ]*:|Error" "$W/steps_${i}_$1_w$2.txt" | cut -c1-200 | sed "s/^/$1 w$2($i) /"
      save
    done ;;
  s40b)  # the fused MoE's tiles for 8192- and 16384-token steps, tuned and merged; the MoE's prefill steps old/new
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    T=pdserve/ops/configs/fused_moe/E=128,N=768,K=2048,dtype=bfloat16,device=NVIDIA_H200.json
    cp "$T" "$W/table_old.json"
    timeout 330 python3 benchmarks/moe/tune_fused_moe.py --tokens 8192 16384 --max-minutes 4.5 > "$W/tune.txt" 2>&1
    tail -4 "$W/tune.txt" | cut -c1-300
    cp "$T" "$W/table_new.json"
    save
    i=0
    for v in old new old new; do
      i=$((i + 1)); left=$(( 575 - ($(date +%s) - t0) )); [ $left -lt 50 ] && { echo "no time for $v"; break; }
      cp "$W/table_$v.json" "$T"
      timeout $(( left < 80 ? left : 80 )) python3 benchmarks/engine/bench_steps.py --model qwen3-30b-a3b \
        --kv-cache-dtype fp8 --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960 \
        --iters 5 --decode= --mixed= --loop= --prefill 8192,24576+8192 --out "$W/steps_${i}_$v.json" \
        > "$W/steps_${i}_$v.txt" 2>&1
      grep -E "^prefill[^ ]*:|Error" "$W/steps_${i}_$v.txt" | cut -c1-200 | sed "s/^/$v($i) /"
      save
    done
    cp "$W/table_old.json" "$T" ;;
  s40c)  # cuDNN's unpadded inputs as views of the fused q/k/v: GPU tests, then prefill steps off/on (MoE fp8, dense 8B)
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    gpu_tests 200 tests/ops/test_library_prefill.py \
      "tests/engine/test_warmup.py::test_long_prompts_after_the_warm_up_build_no_cudnn_plan"
    i=0
    for spec in "moe off" "moe on" "moe off" "moe on" "8b off" "8b on" "8b off" "8b on"; do
      set -- $spec; i=$((i + 1)); left=$(( 575 - ($(date +%s) - t0) )); [ $left -lt 50 ] && { echo "no time for $spec"; break; }
      if [ $1 = moe ]; then m="--model qwen3-30b-a3b --kv-cache-dtype fp8"; else m="--model qwen3-8b"; fi
      timeout $(( left < 90 ? left : 90 )) python3 benchmarks/engine/bench_steps.py $m --load-format dummy \
        --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960 --iters 5 --decode= --mixed= --loop= \
        --prefill 8192,8192+8192,24576+8192 --$([ $2 = on ] || echo no-)library-strided-inputs \
        --out "$W/steps_${i}_$1_$2.json" > "$W/steps_${i}_$1_$2.txt" 2>&1
      grep -E "^prefill[^ ]*:|Error" "$W/steps_${i}_$1_$2.txt" | cut -c1-200 | sed "s/^/$1 $2($i) /"
      save
    done ;;
  s40d)  # GPU tests at session 40's defaults (cuDNN's unpadded inputs as views; the rotary's narrow programs only),
    # then where dummy Qwen3-30B-A3B's (fp8 KV) fresh 8k prompt goes with them
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    gpu_tests 300 tests/ops/test_library_prefill.py tests/engine/test_warmup.py tests/engine/test_memory_profile.py \
      tests/ops/test_rotary.py
    timeout $(( 570 - ($(date +%s) - t0) )) python3 benchmarks/engine/bench_steps.py --model qwen3-30b-a3b \
      --kv-cache-dtype fp8 --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960 \
      --iters 5 --decode= --mixed= --loop= --profile "prefill:8192" --top 24 --out "$W/profile.json" \
      > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -E -A30 "^profile" | cut -c1-160 | head -40
    save ;;
  s40e)  # the engine microbenchmark's criteria at session 40's tree: dummy Qwen3-8B's batch-1 and batch-256 steps and
    # steady loops against their floors, the 8k prefill against the matmul ceiling
    timeout 200 python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 \
      --no-compare-eager --max-model-len 16384 --iters 10 --decode 1x1024,256x1024 --prefill 8192 --mixed= \
      --loop 1x1024,256x1024 --loop-steps 60 --loop-temperature 1.0 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(decode|prefill|loop)[^ ]*:|Error" "$W/steps.txt" | grep -v "async off" | cut -c1-220
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s43a)  # the merge's launch variants, then whole chunks A/B (shipped, best, shipped, best)
    timeout 170 python3 benchmarks/attention/bench_merge.py --out "$W/merge.json" > "$W/merge.txt" 2>&1
    tail -2 "$W/merge.txt"; grep -E "24576 \+ 8192" "$W/merge.txt" | cut -c1-120
    BEST=$(python3 -c "import json; print(json.load(open('$W/merge.json'))['best'])" 2>/dev/null || echo free:32:4)
    B="benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960"
    i=0
    for arm in free:32:4 $BEST free:32:4 $BEST; do
      i=$((i + 1))
      left=$(( 570 - ($(date +%s) - t0) )); [ $left -lt 40 ] && { echo "no time left for run $i"; break; }
      timeout $left python3 benchmarks/attention/bench_merge.py --run-with $arm -- $B --iters 5 --decode= --loop= \
        --mixed= --prefill 16384+8192,24576+8192 --out "$W/steps_$i.json" > "$W/steps_$i.txt" 2>&1
      echo "$i $arm ($(( $(date +%s) - t0 )) s): $(grep -E '^prefill[^ ]*:' "$W/steps_$i.txt" | cut -d'(' -f1 | tr '\n' ' ')"
    done ;;
  s43b)  # the library row's and the warm-up's GPU tests at the merge's new launch, then the 24k chunk's kernels with
    # the merge as shipped before and now, then s42a's four chunks
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_library_prefill.py \
      tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | tail -6
    B="benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960"
    for arm in free:32:4 shipped; do
      left=$(( 420 - ($(date +%s) - t0) )); [ $left -lt 40 ] && { echo "no time left for the profile of $arm"; break; }
      n=$(echo $arm | tr ':' '_')
      if [ $arm = shipped ]; then run="python3 $B"; else run="python3 benchmarks/attention/bench_merge.py --run-with $arm -- $B"; fi
      timeout $left $run --profile "prefill:24576+8192" --top 12 --out "$W/profile_$n.json" > "$W/profile_$n.txt" 2>&1
      echo "$arm: $(grep -E '_merge_two_kernel' "$W/profile_$n.txt" | head -1 | cut -c1-120)"
    done
    timeout $(( 580 - ($(date +%s) - t0) )) python3 $B --iters 5 --decode= --loop= --mixed= \
      --prefill 8192,8192+8192,16384+8192,24576+8192 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^prefill[^ ]*:|Error" "$W/steps.txt" | cut -c1-220
    tar czf "$OUT/s43b.tgz" -C "$OUT" s43b ;;
  s42d)  # s42c's row and gathered arm interleaved, in two processes one after the other; carry .whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cfe .whl/nvidia_cudnn_frontend-*.whl \
      > "$W/pip_cfe.txt" 2>&1 || echo "the frontend's install failed"
    for i in 1 2; do
      PYTHONPATH=/tmp/cfe timeout 200 python3 benchmarks/attention/probe_cudnn_frontend.py --interleave 7 \
        --cases 8192:8192,16384:8192,24576:8192 --out "$W/cudnn_fe_$i.json" > "$W/cudnn_fe_$i.txt" 2>&1
      grep -E "^ctx|interleaved|failed" "$W/cudnn_fe_$i.txt" | cut -c1-400
    done ;;
  s42c)  # the library row against one cuDNN frontend call (causal bottom-right; gathered or paged K/V), every plan;
    # carry .whl (nvidia-cudnn-frontend's cp312 wheel)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cfe .whl/nvidia_cudnn_frontend-*.whl \
      > "$W/pip_cfe.txt" 2>&1 || echo "the frontend's install failed"
    PYTHONPATH=/tmp/cfe timeout 420 python3 benchmarks/attention/probe_cudnn_frontend.py --out "$W/cudnn_fe.json" 2>&1 \
      | tee "$W/cudnn_fe.txt" | tail -30 ;;
  s42b)  # the library row against vLLM's FA3 on the 32k prompt's chunks
    PYTHONPATH=/tmp/site timeout 420 python3 benchmarks/attention/bench_library_row.py --fa3 \
      --cases 0:8192,8192:8192,16384:8192,24576:8192 --out "$W/library_row.json" 2>&1 | tee "$W/library_row.txt" | tail -16 ;;
  s42a)  # the 32k prompt's four 8192-token chunks and the last one's kernels
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 40960"
    timeout 240 $B --iters 5 --decode= --loop= --mixed= --prefill 8192,8192+8192,16384+8192,24576+8192 \
      --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^prefill[^ ]*:|Error" "$W/steps.txt" | cut -c1-220
    timeout $(( 500 - ($(date +%s) - t0) )) $B --profile "prefill:24576+8192" --top 16 --out "$W/profile.json" \
      > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -E -A22 "^profile" | cut -c1-150 | head -30 ;;
  dense)  # dummy Qwen3-8B bf16, vLLM then pdserve on the one GPU
    WORKLOADS=${SBS_WORKLOADS:-"1024:1024:512:256"} CLIENTS=vllm SINGLE_GPU=1 OUT=$W STAGE=.vllm-stage \
      VLLM_USE_FLASHINFER_SAMPLER=0 timeout 560 bash benchmarks/vs_vllm/side_by_side.sh single 2>&1 | tail -14
    echo "pdserve compiled $(grep -c 'compiled a kernel while serving' "$W/pdserve.log") kernels while serving"
    for f in "$W"/*.log; do gzip -f "$f"; done
    tar czf "$OUT/dense.tgz" -C "$OUT" dense ;;
  s41e)  # the mixed steps' times and profiles
    B="python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 16384"
    timeout 150 $B --iters 10 --decode 256x1024 --prefill= --loop= --mixed 256x1024+512,256x1024+1024,256x1024+2048 \
      --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(decode|mixed)[^ ]*:|Error" "$W/steps.txt" | cut -c1-220
    timeout $(( 290 - ($(date +%s) - t0) )) $B --profile "mixed:256x1024+512;mixed:256x1024+1024" --top 14 \
      --out "$W/profile.json" > "$W/profile.txt" 2>&1
    grep -v " INFO " "$W/profile.txt" | grep -E -A24 "^profile" | cut -c1-150 | head -60 ;;
  s41d)  # the decode attention and a product on two streams at once (probe_overlap.py)
    timeout 420 python3 benchmarks/attention/probe_overlap.py --out "$W/overlap.json" 2>&1 | tee "$W/overlap.txt" | tail -40 ;;
  s41b)  # what s41a's 330 s left unrun (it stopped in test_cuda_graphs after 68 passed)
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    G=tests/engine/test_cuda_graphs.py
    gpu_tests 540 --durations=15 $G::test_bf16_graphs_track_eager $G::test_fp8_kv_close_to_model_dtype_on_cuda \
      $G::test_pdl_changes_no_bit $G::test_skinny_linear_tracks_cublas tests/engine/test_vs_transformers.py \
      tests/engine/test_async_gpu.py ;;
  s41a)  # the decode kernel after session 40's removal of its losing switches (PTX-equivalent offline): its GPU tests,
    # the graphs', the engine's against transformers and the async loop's; then the engine microbenchmark's loops
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    gpu_tests 330 tests/ops/test_attention_decode.py tests/engine/test_cuda_graphs.py \
      tests/engine/test_vs_transformers.py tests/engine/test_async_gpu.py tests/engine/test_fused_engine.py
    timeout $(( 570 - ($(date +%s) - t0) )) python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy \
      --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 16384 --iters 10 --decode 1x1024,1x8192,256x1024 \
      --prefill= --mixed= --loop 1x1024,1x8192,256x1024 --loop-steps 60 --loop-temperature 1.0 --out "$W/steps.json" \
      > "$W/steps.txt" 2>&1
    grep -E "^(decode|loop)[^ ]*:|Error" "$W/steps.txt" | grep -v "async off" | cut -c1-220
    save ;;
  s38c)  # the MoE's batch-1 decode splits: the shipped rule against fewer, longer splits
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    moe_arms "--decode 1x1024,1x8192 --loop 1x1024,1x8192" base= k256=--min-split-keys,256 k512=--min-split-keys,512 \
      base= k256=--min-split-keys,256 k512=--min-split-keys,512 ;;
  s34b)  # vLLM then pdserve at 1024/1024 c256 on the one GPU, then the run's steps against their bounds
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    WORKLOADS="1024:1024:512:256" CLIENTS=vllm SINGLE_GPU=1 SERVERS="vllm pdserve" CLIENT_ROUNDS=1 OUT=$W/sbs \
      STAGE=.vllm-stage VLLM_USE_FLASHINFER_SAMPLER=0 timeout 420 bash benchmarks/vs_vllm/side_by_side.sh single 2>&1 | tail -12
    for f in "$W"/sbs/*.log; do gzip -f "$f"; done
    save
    timeout $(( 575 - ($(date +%s) - t0) )) python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy \
      --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 16384 --iters 10 --decode 256x1024,256x2048 \
      --prefill 8x1024 --mixed 256x1024+7x1024 --loop= --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(decode|prefill|mixed)[^ ]*:|Error|ceilings" "$W/steps.txt" | cut -c1-260
    save ;;
  s34a)  # the engine's stats line under 1024/1024 c256, then bench_steps.py's defaults with the serial bound
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    pdserve serve --model $M --load-format dummy --max-model-len 40960 --gpu-memory-utilization 0.9 \
      --served-model-name qwen3-dummy --port 8200 --log-stats-interval 2 > "$W/server.log" 2>&1 & S=$!
    for i in $(seq 150); do
      curl -sf localhost:8200/v1/completions -H 'Content-Type: application/json' \
        -d '{"model":"qwen3-dummy","prompt":"t1 t2 t3","max_tokens":2}' > /dev/null && break; sleep 1
    done
    echo "ready after $(( $(date +%s) - t0 )) s"
    python3 benchmarks/server/serve_timeline.py --url http://127.0.0.1:8200 --pid $S --out "$W/timeline.json" \
      > "$W/timeline.txt" 2>&1 & T=$!
    timeout 110 pdserve bench serve --backend vllm --base-url http://127.0.0.1:8200 --model qwen3-dummy --tokenizer $M \
      --dataset-name random --random-input-len 1024 --random-output-len 1024 --num-prompts 512 --max-concurrency 256 \
      --ignore-eos --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --num-warmups 1 \
      --disable-tqdm --no-plots --save-result --result-dir "$W" --result-filename "c256.json" > "$W/c256.txt" 2>&1
    kill -INT $T; wait $T
    cat "$W/timeline.txt" | cut -c1-300 | tail -20
    python3 benchmarks/vs_vllm/compare.py --line "$W/c256.json" 2>/dev/null
    sleep 3; grep "pdserve.server.stats" "$W/server.log" | cut -c1-330 | tail -40
    kill $S; wait $S 2>/dev/null; gzip -f "$W"/*.log "$W"/*.pdserve.json "$W"/timeline.json 2>/dev/null
    save
    timeout $(( 570 - ($(date +%s) - t0) )) python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy \
      --gpu-memory-utilization 0.9 --no-compare-eager --max-model-len 16384 --iters 10 --loop-steps 60 \
      --loop-temperature 1.0 --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(decode|prefill|mixed|loop)[^ ]*:|Error|ceilings" "$W/steps.txt" | grep -v "async off" | cut -c1-260
    save ;;
  s32b)  # the KV sizing probe's peak by allocation site
    timeout 200 python3 benchmarks/engine/probe_memory.py --out "$W/probe.json" > "$W/probe.txt" 2>&1
    grep -v " INFO " "$W/probe.txt" | cut -c1-300 | head -60
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s32c)  # the KV sizing's second probe: the probe, the GPU tests, a server
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 200 python3 benchmarks/engine/probe_memory.py --out "$W/probe.json" > "$W/probe.txt" 2>&1
    grep -v " INFO " "$W/probe.txt" | cut -c1-300 | head -24; grep "KV sizing" "$W/probe.txt" | cut -c1-400
    save
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/engine/test_memory_profile.py \
      tests/engine/test_warmup.py 2>&1 | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-900 | tail -8
    save
    sizing_server qwen3-8b
    save ;;
  s32d)  # bench_steps.py's default cases and loops
    timeout 260 python3 benchmarks/engine/bench_steps.py --model qwen3-8b --load-format dummy --gpu-memory-utilization 0.9 \
      --no-compare-eager --max-model-len 16384 --iters 10 --loop-steps 60 --loop-temperature 1.0 \
      --out "$W/steps.json" > "$W/steps.txt" 2>&1
    grep -E "^(decode|prefill|mixed|loop)[^ ]*:|Error" "$W/steps.txt" | grep -v "async off" | cut -c1-220
    tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE ;;
  s30c)  # the early tile's GPU tests, then the decode sweep at 1-4 rows with and without it
    save() { tar czf "$OUT/$STAGE.tgz" -C "$OUT" $STAGE; }
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short tests/ops/test_attention_decode.py \
      tests/engine/test_cuda_graphs.py tests/engine/test_vs_transformers.py tests/engine/test_async_gpu.py 2>&1 \
      | tee "$W/gpu_tests.txt" | grep -v "^\.*$" | cut -c1-600 | tail -12
    save
    timeout $(( 570 - ($(date +%s) - t0) )) python3 benchmarks/attention/sweep_decode.py --shapes 1x8192,1x1024,4x8192,1x32768 \
      --splits 0,48,128 --kv bf16 --early --out "$W/decode_early.json" > "$W/decode_early.txt" 2>&1
    grep -v " INFO " "$W/decode_early.txt" | grep -E "^    |b=" | cut -c1-200 | head -40
    save ;;
  s29d)  # the decode kernel at one row (8k and 32k of context, bf16 pool): every tile, split count and block-table
    # prefetch (sweep_decode.py; s29b: 13.2 us a layer at 8k in the loop, 33.5 MB of KV, 512 programs of 128 keys)
    timeout ${SWEEP_LIMIT:-170} python3 benchmarks/attention/sweep_decode.py --shapes 1x8192,1x32768 \
      --splits 0,16,24,32,48,128 --kv bf16 --prefetch --out "$W/decode_b1.json" > "$W/decode_b1.txt" 2>&1
    grep -v " INFO " "$W/decode_b1.txt" | grep -E "^    |b=" | cut -c1-200 | head -20
    tar czf "$OUT/s29d.tgz" -C "$OUT" s29d ;;
  moe_tune)
    timeout ${TUNE_LIMIT:-540} python3 benchmarks/moe/tune_fused_moe.py --tokens 256 4096 128 2048 64 1024 512 1 8 32 \
      16 2 4 96 192 384 768 1536 3072 24 48 --max-minutes ${TUNE_MINUTES:-7.5} --out "$W/table.json" > "$W/tune.txt" 2>&1
    tail -n 25 "$W/tune.txt"
    tar czf "$OUT/moe_tune.tgz" -C "$OUT" moe_tune ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
echo "stage $STAGE took $(( $(date +%s) - t0 )) s"
