#!/usr/bin/env bash
# One call on the GPU machine: the gpu-marked tests, the engine throughput bench and the serving
# bench, results under $OUT. Usage (device tool, carrying .whl and .gpu_carry):
#   bash bench/gpu_session.sh [bars19] [attnb1] [gridbar] [tests] [twins] [startup] [generate] [sampler] [ways] [launch] [toy] [cond] [cmdbuf] [loading] [throughput] [unroll] [profile] [e2e] [grouped] [linear] [topk] [nextfp8] [nextprefill] [w4] [tcint4] [int4pre] [gen4] [fp4dot] [m1pack] [wholek] [fuse] [chain4] [ncu4] [pdl] [l2prefetch] [promote] [fp8moe] [moe4] [fp8gmm] [masktoy] [spec] [serve] [acceptance] [lora] [structured] [prefix]
#   (default: tests throughput serve; acceptance takes ACCEPTANCE_ARGS, e.g. "--family llama3-8b")
# A 30-minute device budget, back to back (a machine idle 30 s is given back; H200, 2026-12-01):
# `tests` alone (56 s in session 8; cut at 130 s after 24 tests in session 9: give it up to 300 s),
# then `startup loading` (~220 s + ~120 s), `acceptance` with
# "--family llama3-8b --family qwen3-30b-a3b --family mamba2-2.7b" (~490 s), then
# "--family qwen3-next-80b-a3b --family nemotron-h-8b" (~455 s), `generate` (3 runs, ~400 s); with
# ACCEPTANCE_ARGS='... --engine-config {"enable_prefix_caching":true}' the same traffic with
# prefix caching on (Mamba-2 alone: 79 s); with '--family qwen3-next-80b-a3b --engine-config
# {"speculative_config":{"method":"mtp","num_speculative_tokens":2}}' the models get a random MTP
# head and the traffic drafts with it (CPU smoke: PASS, session 13). Run parts one after another:
# five acceptance processes plus pytest at once starved the 16 cores and finished nothing in 185 s.
# Session 10 (2026-12-02) took: tests 248 s, startup+loading 184 s, generate 232 s, acceptance of
# two families 329-414 s, `LINEAR_ARGS=--fp8-batch linear` 102 s (before the W8A8 variants).
# Session 11: tests 250 s, acceptance of Mamba-2 + Llama-3-8B 300 s, generate (4 runs, 128 steps)
# 322 s, linear --fp8-batch + structured 157 s, prefix (3 runs) 405 s; a fresh machine's start
# counts ~85 s of device time before the first command.
# Session 13: `tests startup` 332 s, acceptance of Llama-3-8B + Qwen3-30B-A3B + Mamba-2 405 s, of
# Qwen3-Next + Nemotron-H 335 s; `spec` (Llama-3-8B, batches 1,64, --repeats 2 --steps 12) 67 s;
# the Qwen3-Next MTP cost (SPEC_MTP_ONLY=1 skips the Llama run) did not compile 4 layers in 100 s.
# Session 20: `spec acceptance` (Llama only) 238 s from a cold start; `generate` (2 runs) + `lora`
# (auto kernel) 296 s; `spec tests` 369 s warm (tests cut at 290 s, 99%).
# Session 21: `spec lora` (two spec variants) 324 s cold; `tests` 338 s warm (cut at 330 s, 99%);
# `tests` (GPU_TEST_FILES=tests/test_paged_attention.py: 45 s) + `acceptance` (Qwen3-Next with MTP)
# 290 s cold; `spec` (one / two variants) 59 / 79 s warm; `acceptance` (Llama) + `lora --profile` 336 s cold.
# Session 22: `lora` (batches 1,64, one slot count) ~110-150 s, with --profile ~165 s; `lora tests`
# (GPU_TEST_FILES=tests/test_lora.py: 70 s) 228 s; `acceptance lora` (Llama) 288 s; a start refused once.
# Session 23: `tests lora` (test_lora.py, 3 LoRA kernels: OOM at the third before the bench freed its
# weights) 257 s cold; `lora` (2 kernels, batches 1,16,64, --profile) + two scratch b1 runs 333 s;
# `acceptance` (Llama, 162 s) + `w4` (W4_ARGS="--shapes qkv,gate_up --kinds int4 --ms 1", W4_KINDS=" ")
# 235 s cold; two refused starts cost ~90 s of budget each.
# Session 26: `masktoy structured` (it ran the `toy` part too: a pattern match, a word now) + an int4
# generate 146 s cold; `structured` with STRUCTURED_ARGS="--profile DIR --repeats 1..3" 84-95 s
# warm or cold (the profile adds ~10 s per mode); `acceptance` (Llama, 141 s) + `structured` 221 s
# cold; one machine taken back mid-call (~180 s of budget lost).
# Session 30: `tests w4 structured` (test_w4.py 39 s, W4 int4 M=1 half2 sweep, 3 structured runs)
# 264 s cold; `fp8gmm acceptance structured` (Llama) 283 s; `tests fp8gmm nextprefill` 287 s;
# `acceptance structured` (Qwen3-Next with {"quantization":"fp8"}: 204 s; the profile) 288 s.
# Session 31 (cold each): `tests gen4 structured` (3 test files 49 s, bf16 + int4 batch 1 with
# profiles, 3x4 structured runs) 300 s; `w4 acceptance` (narrow split-K sweep, Qwen3-30B-A3B 142 s)
# 260 s; `structured acceptance` (4 repeats, Llama 155 s) 240 s; `structured` (5 repeats x 3
# variants) 92 s; `gen4` (3 kinds, batch 64, 2 repeats) 277 s; `tests gen4 fp8gmm acceptance`
# 347 s (GENERATE_LIMIT=100 cut the FP8 generate while it compiled: give it 150).
# Session 32 (cold each): `tests linear gen4` (test_linear_kernels 25 s, linear --fp8-batch with
# --budget-s 90, bf16 + fp8 batch 64, 2 repeats) 304-355 s; `gen4 acceptance` (Llama FP8, 140 s)
# 318 s; `tests structured` (4 test files 53 s) 143 s; `structured` (3 variants) 87 s.
# Session 35: `tests linear gen4` (4 test files 82 s, linear --fp8-batch --budget-s 150, three
# batch-1 kinds with profiles) 488 s cold; `gen4` (bf16 + fp8, batch 64) 184 s cold; eight refused
# starts cost ~90 s of budget each (status's "later means in about 10 min": wait that long).
# Session 36 (an H100 80GB: no H200 lent): `acceptance` of Llama-3-8B + Qwen3-30B-A3B + Mamba-2 484 s
# cold, of Qwen3-Next + Nemotron-H 383 s warm, `structured` (5 repeats) 69 s warm, `gen4` (3 kinds,
# batches 1,64) 273 s warm; the next call (`w4` sweep + two generates) lost its machine mid-call and
# the rest of the budget with it (~470 s): keep a call well inside what is left.
# Session 37: no GPU at the start; from 09:29 kinds were listed, but seven calls started no machine (706 s of
# budget lost to the refusals). Next: `acceptance` (engine host code changed), then
# `GPU_TEST_FILES=tests/test_w4.py bash bench/gpu_session.sh tests fp4dot` (~40 s + ~300 s: the NVFP4 tensor-core
# kernel's gpu tests, its sweep, three batch-64 generates), then `m1pack`, then `pdl` (~300 s: four generates,
# with and without XLA's programmatic dependent launch).
# Session 38: seven refused starts (~90 s of budget each), then one H200: `acceptance` of Llama-3-8B +
# Qwen3-30B-A3B + Mamba-2 473 s cold, of Qwen3-Next + Nemotron-H 400 s warm, `tests` (test_w4.py, 56 s) +
# the fp4 sweep at 64 rows (cut at 90 s after q|k|v and o) 188 s, one NVFP4 batch-64 generate 118 s.
# Do not export XLA_PYTHON_CLIENT_PREALLOCATE=false around a generate: its KV pool then fails to allocate.
# Next: `acceptance` first (after the run, session 38 changed every step's sampling inputs: logit_bias's
# suppress_bias table), then `m1pack` (~360 s), `pdl` (~300 s), the fp4 sweep's gate|up and down
# (FP4DOT_MS=64,256) and `fp4dot`'s three batch-64 generates in one call (bf16 beside NVFP4 at last).
# Session 39: an H100 (one start refused, ~180 s): `acceptance` of three families 445 s cold, of two 423 s warm,
# `m1pack` 261 s warm (its HLO dump made the archive too large: nothing came back; now one module), three batch-1
# generates 281 s warm. After those calls every step's sampling inputs changed again (SamplingMetadata.mask_logprobs)
# and bad_words / sliding windows / o_proj biases came in: next, `acceptance` first, then on an H200
# `M1PACK_SWEEP="--min-block-k 4096" bash bench/gpu_session.sh m1pack` (the whole-K tiles; the packed_x picks were
# lost), `pdl` only at batch 64 (batch 1 on the H100: no gain), `fp4dot`.
# Session 40: an H100 again: `acceptance` of three families 525 s cold, of two 391 s warm (all PASS), `m1pack` with
# M1PACK_SWEEP="--min-block-k 4096" 231 s (whole-K tiles: -11..-45% on q|k|v, o, gate|up in isolation, but the int4
# batch-1 device step stayed 2.75 ms; its bf16 / NVFP4 generates aborted on XLA_FLAGS=" ", fixed), `fp4dot` with
# FP4DOT_LIMIT=60 GENERATE_LIMIT=115 360 s (the default NVFP4 generate printed nothing at 115 s: keep 150; the
# archive was lost to stray HLO dump files in $OUT, now dumped under /tmp). After those calls session 40 changed the
# verify step's masks (bad_words under speculation), the server's chat output (reasoning parsers, echo) and added
# Mixtral: next, `acceptance` first, then `wholek` (~330 s: the int4 batch-1 step profiled, shipped table against the
# whole-K picks: which of its 12 kernels a layer take the time in the graph), `fp4dot` with its defaults, `pdl` at
# batch 64.
# Session 41: an H100: `tests fuse` (GPU_TEST_FILES=tests/test_w4.py, then batch-1 generates) 329 s cold, `acceptance`
# of three families 385 s warm, of two 304 s warm (all PASS), an HLO dump 81 s, two remat-off generates 178 s; a second
# machine for two NVFP4 generates 139 s cold. Next: `fuse` (the layer fusion both ways beside bf16, ~400 s) on an H200
# if one comes, then `fp4dot` with its defaults and `pdl` at batch 64; `acceptance` first if a step or kernel changed.
# Session 42: a GPU only late: on an H100 `tests acceptance` (test_w4_moe.py; Qwen3-Next + Nemotron-H after the GDN
# regroup: PASS) 333 s cold, `tests moe4` 203 s warm (the 4-bit expert kernel slower than XLA's gather: made opt-in);
# on an H200 `tests moe4` with MOE4_LIMIT=3 262 s cold (8 gpu cases pass; the XLA default through generate); two
# starts refused. Next: `acceptance` of Llama-3-8B + Qwen3-30B-A3B + Mamba-2 (their loaders changed), then
# `acceptance` with ACCEPTANCE_ARGS='--family qwen3-30b-a3b --family qwen3-next-80b-a3b --engine-config
# {"quantization":"int4"}' (and nemotron-h-8b with {"quantization":"fp8"}); then the list of session 41.
# Session 43: one H100 call (every other start refused, 23:19-01:01 UTC; the refusals took the budget): `tests promote`
# with GPU_TEST_FILES="tests/test_w4.py tests/test_linear_kernels.py" 303 s cold: the PDL cases pass; the promote
# form faulted (misaligned address) at 8- and 24-row tiles of x, fixed since on the CPU only
# (`bench/results/session43_2026-12-06.md`). Next, first: `tests promote` with GPU_TEST_FILES="tests/test_w4.py::
# test_w4_mgpu_gpu tests/test_linear_kernels.py::test_w8a8_gpu_any_rows_and_stacked_terms" PROMOTE_MS=1 (~80 s +
# ~120 s + two batch-1 generates ~190 s: promote + PDL against the default, on an H200 if one comes), then
# `l2prefetch` (~330 s: batch 64, FP8 / int4 with and without `kernel_pdl`), then the `acceptance` runs listed for
# session 42 below (not run in sessions 42-43 for Llama-3-8B, Qwen3-30B-A3B and Mamba-2).
# Session 44: three refused starts (181 + 180 + 105 s of budget), then one H100: `tests acceptance` (the two gpu test
# functions above: 30 passed, the promote fix holds; Llama-3-8B + Qwen3-30B-A3B + Mamba-2: PASS) 502 s cold, `promote`
# (M = 1 sweep, three batch-1 generates) 320 s warm, `promote` with PROMOTE_MS=64 PROMOTE_BATCHES=64 and two
# batch-64 generates 198 s warm (`bench/results/session44_2026-12-06.md`): promote slower at 1 and 64 rows (off),
# the first PDL form 1.4-2.9x slower per kernel (changed since: release after the main loop, first fill prefetched).
# Next: `promote` with PROMOTE_ONLY='^auto(_pdl)?$' PROMOTE_MS=1,64 PROMOTE_RUNS=' ' (~90 s: the new PDL form in
# isolation), then `l2prefetch` (~330 s) if it is no slower, then the session-42 acceptance variants (int4 / fp8 MoE).
# Session 45: one H100, no refusals: `tests promote` (the two gpu test functions: 30 passed; `auto` against `auto_pdl`
# at M = 1, 64) 140 s cold, `l2prefetch` 380 s, `acceptance` of Qwen3-30B-A3B + Qwen3-Next with {"quantization":"int4"}
# 402 s (PASS), of Nemotron-H with {"quantization":"fp8"} 193 s (PASS), `pdl` 329 s, all warm
# (`bench/results/session45_2026-12-06.md`): the second PDL form is still 1.3-1.6x slower at M = 1 (stays off).
# Session 46: six calls, all H100, no refusals (`bench/results/session46_2026-12-06.md`): `chain4 gen4` 204 s cold,
# `tests chain4` (GPU_TEST_FILES=tests/test_w4.py: 58 passed; --per-projection) 96 s cold, `ncu4` 39 s cold (Nsight
# Compute works here: --set full on 8 launches), `m1pack ncu4` (warps sweep, two generates) 329 s cold, `gen4 ncu4
# m1pack` cut at 560 s (a 112-step unrolled variant compiled for minutes under ncu), `tests ncu4` 68 s cold. Parts run
# in this file's order, not the order given (ncu4 before m1pack). A cold call cost ~60 s of budget before its command.
# Session 47: four calls, all H100 (`bench/results/session47_2026-12-06.md`): `tests ncu4` (test_w4.py: 60 passed;
# the one-process sweep segfaulted after q|k|v) 114 s cold, `ncu4` int4 with NCU4_GENERATE=1 (one process a
# projection, 4 x 146 launches, three generates) 412 s cold, `ncu4` NCU4_KIND=fp4 509 s cold (its nvfp4 generates
# cut by GENERATE_LIMIT=100: nvfp4 needs ~150), `gen4 acceptance` (int4 + nvfp4 at batch 1; Llama-3-8B int4 PASS)
# 355 s warm. The table's one-row picks for q|k|v, o, gate|up now come from these sweeps.
# After call 4 the one-row half2 kernel changed (the ring carries x as loaded; `ring_scales`, off, carries the
# scales too; not run on a GPU; the table's picks compile to the registers they had, bench/kernels/w4_ptxas.py).
# Session 48: eight calls on one H100, warm after the first (`bench/results/session48_2026-12-06.md`): `tests`
# (test_w4.py: 67 passed, session 47's change holds) 76 s cold, `ncu4` int4 with NCU4_GENERATE=1 456 s, `ncu4`
# NCU4_KIND=fp4 + int4 `acceptance` (PASS) 321 s, `gen4` (nvfp4 int4 bf16, batch 1) + NVFP4 gate|up and down
# under ncu 409 s, four short calls. ncu segfaulted before the first launch of NVFP4's gate|up twice (and down
# once); the same process ran without ncu, and under ncu alone in a later call. NVFP4's q|k|v and o took 8 warps after call 3.
# Next: `tests` with GPU_TEST_FILES=tests/test_w4.py first. The table's NVFP4 8-warp picks ran only through the
# sweep and `generate`, not the gpu tests: the table-pick cases read the table. Then, on an H200,
# GEN4_KINDS="bf16 int4 nvfp4" GEN4_BATCHES=1 `gen4` (the issue's bars are the H200's), `fuse`, `fp4dot`, and
# `ncu4` sweeps for both kinds (the H200's picks may differ); the default `acceptance` families.
# Session 49 (`bench/results/session49_2026-12-06.md`): `tests gen4` (test_w4.py 70 passed; three kinds with
# GEN4_PROFILE) 382 s cold on an H100; `gen4` bf16 int4 with GEN4_HOST_PROFILE=1 182 s; then two trees in one
# call (.gpu_carry/tree_base.tar beside tree.tar, each extracted to its own directory; the "tree at commit"
# line reads the shared .gpu_carry/commit, so it names the new tree's for both) with `acceptance` (Llama) 255 s.
# Eight starts were refused (~650 s of budget in all; ~10 min each time before that kind was tried again).
# Next: on an H200, GEN4_KINDS="bf16 int4 nvfp4" GEN4_BATCHES=1 GEN4_HOST_PROFILE=1 `gen4` (one launch a step
# now; logprobs=5's step through generate is not settled), `fuse`, the default `acceptance` families,
# `structured` (the free step launches once now, the constrained one twice), `startup` (the forward
# executables sample too: more to compile).
# Session 50 (`bench/results/session50_2026-12-06.md`): the H200 was refused at every try (six starts); three H100
# calls: `python3 bench/pdl_triton_probe.py --out $OUT/pdl` from the repo root (~10 s warm; no early start
# through XLA, one through Triton's own launcher; but B's wait was compiled away then: rerun), then the probe
# + FUSE_ONLY="bf16 int4 int4_fused nvfp4" `fuse` + `w4` with the table's M = 1 picks only (beside XLA's bf16
# dot) in 303 s cold. Next: that call on an H200: `bars19` runs it (o and down in the sweep too).
# Session 51 (every call an H100; two starts refused): `bars19` 422 s cold (the probe settled: no PDL for Pallas Triton
# kernels through XLA; bf16's generate failed to launch ptxas, now retried once), `attnb1` 219 s cold (a 108-variant
# sweep, cut by its budget) and 83 s (18 candidates, round-robin), `fuse` with FUSE_ONLY="bf16 int4" 148 s warm.
# Next (an H200 above all): `bars19` (~330-420 s; its generates now run the engine's default max_model_len, 4096,
# where sessions 15-51 ran 512: compare with this session's H100 run first if an H100 comes), then `acceptance`.
# The decode kernel's in-kernel split merge (`tickets`, session 51, not in the engine yet) has run in interpret mode
# only: `GPU_TEST_FILES=tests/test_paged_attention.py bash bench/gpu_session.sh tests attnb1` with
# ATTNB1_ARGS="--ctx 128,2048 --max-ctx 4096 --only 64,16,4,3;64,16,4,1;64,8,4,3;128,1,4,3" (each power-of-two
# split count also runs merged) says whether it works there and what it saves. `gridbar` (~20 s) says what a grid
# barrier in one kernel costs against a kernel boundary (the persistent per-layer kernel's premise).
# Session 52 (every call an H100; six starts refused, ~90 s each): `tests attnb1 gridbar` 78 s cold (the merge's gpu
# tests pass; merged 9.08 against 6.33 us at ctx 128; a grid barrier 0.527 against a boundary's 0.517 us), then `tests attnb1`
# + FUSE_ONLY="bf16 int4" `fuse` + Llama `acceptance` 339 s cold (the second merge form: 6.29 / 13.43 against
# 6.60 / 11.08 us at ctx 128 / 2048, off), acceptance of Qwen3-Next + Nemotron-H 311 s warm. Several invocations of
# this script in one call nested their archives (each tarred $OUT, the one before's results.tgz included); since
# then each run unpacks the one before's archive first, so the last archive holds every run's files, flat.
# Session 53 (H200 starts refused seven times, one machine taken back mid-call; one H100 came): the G-row merge
# (applied to the working tree only) with `tests attnb1` + Llama-3-8B and Qwen3-Next `acceptance` 395 s cold, then
# `acceptance` of Nemotron-H + Mamba-2 + Qwen3-30B-A3B 333 s warm (PASS, all five at bb66a95).
# Next (an H200 above all): `bars19`, FUSE_ONLY="bf16 int4 nvfp4".
# The script archives $OUT into $OUT/results.tgz itself: do not tar $OUT again (that lost call 1's files).
# .whl holds the wheels the machine lacks, for Python 3.12 manylinux (see the device README):
#   fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection
#   opentelemetry-api (fastapi >= 0.16x imports it) fla-core, tokamax 0.0.17 with qwix einshape
#   jaxtyping wadler_lindig immutabledict tensorboardx, llguidance;
# .gpu_carry/smollm2_tok the SmolLM2 tokenizer files (for a random-weight serving checkpoint and the
#   structured-output bench; `python bench/structured_output.py --save-tokenizer .gpu_carry/smollm2_tok`).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [[ -f $OUT/results.tgz ]]; then  # an earlier run of this script in the same call archived its files: unpack
  (cd "$OUT" && tar xzf results.tgz && rm results.tgz)  # them, so this run's archive holds both, flat
fi
parts=${*:-tests throughput serve}
if [[ $parts == *bars19* ]]; then  # issue 19's batch-1 bars in one call (session 50; ~400 s warm on an H100): the
  # PDL probe, `fuse` (bf16, int4, int4 fused, NVFP4 through generate) and `w4` (the table's M = 1 picks alone)
  parts="$parts fuse w4"
  FUSE_ONLY=${FUSE_ONLY:-bf16 int4 int4_fused nvfp4}
  W4_ARGS=${W4_ARGS:---shapes gate_up,qkv,o,down --kinds int4,fp4 --ms 1 --with-tuned --only ring_scales,swap_ab}
  W4_KINDS=${W4_KINDS:- }  # (no generates after the sweep: `fuse` ran them)
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
# the commit the tree is (the machine's copy of .git may be stale): `git rev-parse HEAD >
# .gpu_carry/commit` before the call; reports then name it
commit_arg=$([[ -f .gpu_carry/commit ]] && echo "--git-commit $(cat .gpu_carry/commit)")
[[ -n $commit_arg ]] && echo "tree at commit $(cat .gpu_carry/commit)" | tee "$OUT/commit.txt"
# tokamax imports xprof (its profiler's kernel stats) at import time; the machine lacks xprof and
# its dependency tree, so a stub module stands in for that one import (nothing here profiles).
if ! python3 -c "import xprof" 2>/dev/null; then
  mkdir -p /tmp/site/xprof/cli/tools
  touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py /tmp/site/xprof/cli/tools/__init__.py
  echo 'def compute_kernel_stats(*a, **k): raise NotImplementedError("xprof stub")' \
    > /tmp/site/xprof/cli/tools/get_kernel_stats_tool.py
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__, jax.devices())" | tee -a "$OUT/device.txt"

with_xla_flags() {  # $1: extra XLA flags (may be empty), then the command: XLA_FLAGS=" " (a blank) is read as a
  # flag file's name and aborts the process (session 40 lost two generates to it)
  local f; f=$(echo ${XLA_FLAGS:-} $1); shift
  if [[ -n $f ]]; then XLA_FLAGS=$f "$@"; else "$@"; fi
}

if [[ $parts == *tests* ]]; then
  gpu_files=${GPU_TEST_FILES:-$(grep -l "mark.gpu" tests/test_*.py | grep -v test_server)}
  # --dist load (not the CPU addopts' loadfile: one file's GPU tests would run on one worker)
  # a test's own limit (pytest-timeout: it names the test and prints its stack) stays below the
  # whole run's, so a stuck test is named: on 2026-12-01 (session 9) the run was cut at 130 s
  # after 24 tests and the log said nothing about the rest
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${GPU_TEST_LIMIT:-300} python3 -m pytest -m gpu -n 12 --dist load \
    -p no:cacheprovider -p no:benchmark -rf --tb=short --timeout ${GPU_TEST_TIMEOUT:-150} --durations=20 -v \
    $gpu_files 2>&1 | tee "$OUT/gpu_tests.log" | grep -v " PASSED \| SKIPPED " | tail -45
  # (-v, without -q, which cancels it: each result is logged as it comes, so a run cut before its
  # summary still names its failures: session 14's stopped at 100% before printing which failed)
  grep " FAILED \| ERROR " "$OUT/gpu_tests.log" | head -20
fi
if [[ $parts == *throughput* ]]; then
  timeout 250 python3 bench/throughput.py --random-weights --shape llama3-8b --dtype bfloat16 \
    --batches 1,8,64 --context 512 --num-requests 64 --max-model-len 2048 \
    --out "$OUT/throughput_llama3_8b_gpu.json" 2>&1 | tail -30
fi
if [[ $parts == *unroll* ]]; then  # the same decode latency with the layer scan unrolled
  timeout 250 python3 bench/throughput.py --random-weights --shape llama3-8b --dtype bfloat16 \
    --batches 1,64 --context 512 --skip-throughput --max-model-len 2048 --unroll-layers \
    --out "$OUT/throughput_llama3_8b_gpu_unrolled.json" 2>&1 | tail -12
fi
if [[ $parts == *profile* ]]; then  # decode executables' HLO, cost analysis and per-kernel times
  for v in ${PROFILE_VARIANTS:-scan unroll}; do  # scan_dsf: XLA's dynamic-slice fusion on
    flag=$([[ $v == unroll ]] && echo --unroll-layers)
    xf=$([[ $v == scan_dsf ]] && echo --xla_gpu_enable_dynamic_slice_fusion=true)
    with_xla_flags "$xf" timeout 200 python3 bench/throughput.py --random-weights --shape llama3-8b --dtype bfloat16 \
      --batches 1,64 --context 512 --skip-throughput --max-model-len 2048 $flag --decode-steps 8 \
      --prefill-buckets 2048 --mixed-decode-buckets 64 \
      --profile "$OUT/profile_$v" --out "$OUT/profile_$v/throughput.json" 2>&1 | grep -v "^ *[0-9.]* us" | tail -8
    head -30 "$OUT"/profile_$v/decode_b1/kernels.txt
  done
fi
if [[ $parts == *e2e* ]]; then  # end-to-end decode latency against the roofline, per model shape
  common="--random-weights --dtype bfloat16 --batches 1,64 --context 512 --skip-throughput --max-model-len 2048
    --prefill-buckets 2048 --mixed-decode-buckets 64"
  # limits from 2026-11-29 (per-layer weights: Llama-3-8B compiles its 4 steps in 18 s, not 118);
  # the four runs exceed one 600 s call: split them with E2E_ONLY="name ..."
  for run in "llama3_8b:200:--shape llama3-8b --profile $OUT/profile_llama3_8b" \
             "qwen3_next_4l:200:--shape qwen3-next-80b-a3b --num-layers 4" \
             "nemotron_h_13l:150:--shape nemotron-h-8b --num-layers 13 --profile $OUT/profile_nemotron_h" \
             "llama3_8b_fp8:150:--shape llama3-8b --quantization fp8"; do
    IFS=: read -r name limit extra <<< "$run"
    [[ -n ${E2E_ONLY:-} && " $E2E_ONLY " != *" $name "* ]] && continue
    # each run logs to its own file, so a run that `timeout` kills still leaves its log
    timeout "$limit" python3 bench/throughput.py $common $extra --out "$OUT/e2e_$name.json" \
      > "$OUT/e2e_$name.log" 2>&1
    grep -v "^ *[0-9.]* us\|Delay kernel\|compiling steps" "$OUT/e2e_$name.log" | tail -9
  done
fi
if [[ $parts == *gdn* ]]; then  # GDN prefill/decode/conv kernels beside FLA in the same process
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${GDN_LIMIT:-200} python3 bench/kernels/gated_delta.py --out "$OUT/gdn" \
    --fla-prune-autotune --budget-s 150 2>&1 | tail -25
fi
if [[ $parts == *grouped* ]]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 bench/kernels/grouped_matmul.py --out "$OUT" 2>&1 | tail -30
fi
if [[ $parts == *linear* ]]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${LINEAR_LIMIT:-200} python3 bench/kernels/linear.py --out "$OUT/linear" \
    ${LINEAR_ARGS:-} 2>&1 | tail -30
fi
if [[ $parts == *serve* ]]; then
  python3 bench/random_checkpoint.py --shape smollm2-135m --dtype bfloat16 \
    --tokenizer-dir .gpu_carry/smollm2_tok --out /tmp/rand_smollm2 >/dev/null
  timeout 110 python3 bench/serve.py --launch /tmp/rand_smollm2 --rate 16 --num-requests 96 \
    --output-len 64 --label gpu-smollm2-random --out "$OUT/serve_gpu_smollm2.json" \
    -- --dtype bfloat16 --max-num-seqs 64 2>&1 | tail -20
  cp /tmp/metrale_bench_serve.log "$OUT/serve_server.log" 2>/dev/null; tail -15 /tmp/metrale_bench_serve.log
fi
if [[ $parts == *twins* ]]; then  # the acceptance run's float32 twins alone, every family in its own process
  for f in ${TWIN_FAMILIES:-llama3-8b qwen3-next-80b-a3b qwen3-30b-a3b nemotron-h-8b mamba2-2.7b}; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TWINS_LIMIT:-200} python3 bench/gpu_acceptance.py --family "$f" $commit_arg \
      --skip traffic --out "$OUT/twins_$f" > "$OUT/twins_$f.log" 2>&1 &
  done
  wait
  for f in "$OUT"/twins_*.log; do grep -v "^ *[0-9.]* us\|Delay kernel" "$f" | tail -4; done
fi
if [[ $parts == *startup* ]]; then  # default engine: cold / warm / JAX-cache-only start-up, TTFT, batch-64 generate
  timeout ${STARTUP_LIMIT:-330} python3 bench/startup.py --shape llama3-8b ${STARTUP_ARGS:---generate 64} \
    --out "$OUT/startup_llama3_8b.json" 2>&1 | tail -20
fi
if [[ $parts == *generate* ]]; then  # issue 15: LLM.generate decode step, greedy vs top_p (+logprobs=5) vs the device
  # step, bf16 as loaded, bf16 with the LM head scaled to a ~100-token nucleus, FP8 (~130 s each)
  for run in "generate_llama3_8b:--batches 1,8,64 --profile $OUT/profile_generate" "generate_llama3_8b_b1_64:--batches 1,64" \
             "generate_llama3_8b_nucleus100:--batches 1,64 --lm-head-scale auto" \
             "generate_llama3_8b_fp8:--batches 1,64 --quantization fp8" \
             "generate_llama3_8b_streams16:--batches 64 --engine-config {\"max_prefill_streams\":16}" \
             "generate_llama3_8b_count_kernel:--batches 1,64 --attention {\"sampler_kernel\":true}" \
             "generate_llama3_8b_noskip:--batches 1,64 --attention {\"sampler_skip\":false}" \
             "generate_llama3_8b_noremat:--batches 1,64 --attention {\"xla_remat\":false}"; do
    IFS=: read -r name extra <<< "$run"
    [[ -n ${GENERATE_ONLY:-} && " $GENERATE_ONLY " != *" $name "* ]] && continue
    # 128 decode steps (the issue's max_tokens=129): at 32 (session 10) batch 64 read 1.18x the device step
    timeout ${GENERATE_LIMIT:-200} python3 bench/generate_speed.py --shape llama3-8b --steps ${GENERATE_STEPS:-128} --repeats 2 $extra \
      --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    grep -v "rematerialization" "$OUT/$name.log" | tail -10
  done
fi
if [[ $parts == *sampler* ]]; then  # issues 15/16: the sampler alone at 1 / 64 / 320 rows (a verify step's, batch 64, k 4)
  # beside a baseline sampling.py carried as a file (the machine's copy has no git history)
  timeout ${SAMPLER_LIMIT:-120} python3 bench/sampling_cpu.py --baseline-rev "${SAMPLER_BASELINE:-baseline}" \
    --baseline-file "${SAMPLER_BASELINE_FILE:-.gpu_carry/sampling_baseline.py}" --rows 1,64,320 --vocab 128256 \
    --repeats 20 --out "$OUT/sampler_h200" 2>&1 | tail -16
fi
if [[ $parts == *ways* ]]; then  # the sampler's searches: ways per pass, XLA's reductions vs the counting kernel
  timeout ${WAYS_LIMIT:-150} python3 bench/kernels/filter_ways.py --out "$OUT/filter_ways.json" 2>&1 | tail -24
fi
if [[ $parts == *cond* ]]; then  # can lax.cond skip work without the host waiting (conditional command buffers)?
  timeout ${COND_LIMIT:-150} python3 bench/cond_toy.py --out "$OUT/cond_toy.json" 2>&1 | tail -10
fi
if [[ $parts == *launch* ]]; then  # the host's cost of launching a step executable (fresh vs the same input buffers)
  timeout ${LAUNCH_LIMIT:-200} python3 bench/launch_cost.py --out "$OUT/launch_cost.json" 2>&1 | tail -8
fi
if [[ " $parts " == *" toy "* ]]; then  # (the word: `masktoy` contains "toy") why a launch with fresh inputs waits for the previous step (a toy step)
  timeout ${TOY_LIMIT:-120} python3 bench/launch_toy.py --out "$OUT/launch_toy.json" 2>&1 | grep -v rematerial | tail -12
fi
if [[ $parts == *cmdbuf* ]]; then  # which step executables XLA captures as CUDA graphs (Mosaic vs Triton prefill attention)
  timeout ${CMDBUF_LIMIT:-200} python3 bench/command_buffers.py --out "$OUT/command_buffers" 2>&1 | cut -c1-400 | tail -30
fi
if [[ $parts == *topk* ]]; then  # issue 15: the sampler's top logprobs over chunk / round sizes, beside lax.top_k and torch
  timeout ${TOPK_LIMIT:-150} python3 bench/kernels/top_k.py --out "$OUT/top_k" 2>&1 | tail -32
fi
if [[ $parts == *nextfp8* ]]; then  # issue 19: Qwen3-Next shape (12 of 48 layers) decode, bf16 then FP8 experts and linears
  for q in bf16 fp8; do
    qa=$([[ $q == fp8 ]] && echo "--quantization fp8")
    timeout ${GENERATE_LIMIT:-240} python3 bench/generate_speed.py --shape qwen3-next-80b-a3b --num-layers 12 --steps 64 \
      --repeats 1 --batches 1,64 $qa --out "$OUT/generate_qwen3_next_12l_$q.json" > "$OUT/generate_qwen3_next_12l_$q.log" 2>&1
    grep -v "rematerialization" "$OUT/generate_qwen3_next_12l_$q.log" | tail -6
  done
fi
if [[ $parts == *tcint4* ]]; then  # issue 19: the int4 tensor-core GEMM (w4_mgpu.py) at M 8-64 beside bf16
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TCINT4_LIMIT:-240} python3 bench/kernels/w4_mgpu.py --out "$OUT/w4_mgpu" \
    ${TCINT4_ARGS:-} 2>&1 | grep -v "^W1\|Delay kernel" | tail -30
fi
if [[ $parts == *int4pre* ]]; then  # issue 19: int4 prefill linears, fused dequant+dot vs materialized vs bf16
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${INT4PRE_LIMIT:-200} python3 bench/kernels/w4_prefill.py \
    --out "$OUT/w4_prefill" ${INT4PRE_ARGS:-} 2>&1 | grep -v "^W1\|Delay kernel" | tail -15
fi
if [[ $parts == *gen4* ]]; then  # issue 19: generate (default EngineConfig) bf16 beside 4-bit, batches 1 and 64
  for q in ${GEN4_KINDS:-bf16 int4}; do  # a kind int4@NAME runs int4 with GEN4_VARIANT_NAME's --w4-mgpu JSON
    qa=$([[ $q != bf16 ]] && echo "--quantization ${q%@*}")
    [[ $q == *@* ]] && { vn="GEN4_VARIANT_${q#*@}"; qa="$qa --w4-mgpu ${!vn}"; }
    [[ -n ${GEN4_PROFILE:-} ]] && qa="$qa --profile $OUT/profile_gen_$q"  # kernels of the device steps
    [[ -n ${GEN4_HOST_PROFILE:-} ]] && qa="$qa --host-profile $OUT/host_gen_$q"  # the host's functions (cProfile)
    timeout ${GENERATE_LIMIT:-200} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats ${GEN4_REPEATS:-1} \
      --batches ${GEN4_BATCHES:-1,64} $qa --out "$OUT/generate_llama3_8b_$q.json" > "$OUT/generate_llama3_8b_$q.log" 2>&1
    grep -v "rematerialization" "$OUT/generate_llama3_8b_$q.log" | tail -6
  done
fi
merge_w4_table() {  # $1: a sweep's tuned_w4.json, merged into the tree's table (a copy of the result beside it)
  python3 -c "import json, sys; f = 'pallas_kernels/linear/tuned_w4.json'; t = json.load(open(f)); \
t.update(json.load(open(sys.argv[1]))); open(f, 'w').write(json.dumps(t, indent=1, sort_keys=True) + '\\n')" "$1" \
    && cp pallas_kernels/linear/tuned_w4.json "${1%.json}_merged.json"
}
if [[ $parts == *wholek* ]]; then  # issue 19: the int4 batch-1 step profiled (kernels and the idle gaps between
  # them) with the shipped table, then with session 40's whole-K picks merged in: in isolation they saved ~15 us a
  # layer, in the step nothing (2.75 ms device both ways, H100)
  for t in shipped wholek; do
    [[ $t == wholek ]] && merge_w4_table bench/results/tuned_w4_m1_wholek_h100_2026-12-05_s40_call3.json
    timeout ${GENERATE_LIMIT:-150} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats 1 --batches 1 \
      --quantization int4 --profile "$OUT/profile_int4_b1_$t" --out "$OUT/generate_llama3_8b_int4_b1_$t.json" \
      > "$OUT/generate_llama3_8b_int4_b1_$t.log" 2>&1
    echo "== $t"; grep "batch   1" "$OUT/generate_llama3_8b_int4_b1_$t.log" | tail -4
    head -24 "$OUT"/profile_int4_b1_$t/*/kernels.txt 2>/dev/null
  done
fi
if [[ $parts == *chain4* ]]; then  # issue 19 (session 46): one-row int4 projections chained as in a decode layer beside
  # bf16, and (CHAIN4_ARGS=--per-projection) each alone, cold (HBM) and hot (L2) (~120 s)
  timeout ${CHAIN4_LIMIT:-240} python3 bench/kernels/w4_chain.py --out "$OUT/chain4" --layers ${CHAIN4_LAYERS:-16} \
    ${CHAIN4_ARGS:-} 2>&1 | grep -v rematerialization | tail -14
fi
if [[ $parts == *ncu4* ]]; then  # issue 19 (session 46): Nsight Compute on the one-row int4 kernel, each Llama-3-8B
  # projection twice (caches flushed between replays: HBM), the full section set; text pages kept, the report dropped
  # (NCU4_ARGS="--params JSON": W4Params for all four instead of the table's). NCU4_SWEEP=FIELDS instead: only the
  # duration of the table's pick and of each half2 SWEEP entry with FIELDS changed (e.g. "half2": all 73), twice each,
  # tabulated, the fastest merged into the table where 3% faster (NCU4_GENERATE=1: int4 batch 1 before and after)
  ncu --version | tail -1
  if [[ -n ${NCU4_SWEEP:-} ]]; then
    # one process a projection (session 47: one process for all four segfaulted after q|k|v's 146 launches);
    # NCU4_KIND=fp4: NVFP4's table instead (generate with nvfp4, then int4 with the tree's table, same call)
    csvs=(); kind=${NCU4_KIND:-int4}; quant=$([[ $kind == fp4 ]] && echo nvfp4 || echo int4)
    for proj in ${NCU4_PROJECTIONS:-qkv o gate_up down}; do
      d=$OUT/ncu4_sweep/$proj; mkdir -p "$d"
      timeout ${NCU4_LIMIT:-150} ncu --clock-control none -k regex:skinny_matmul_w4 \
        --metrics gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.avg \
        -f -o /tmp/w4_sweep_$proj python3 bench/kernels/w4_chain.py --ncu --sweep "$NCU4_SWEEP" --kind $kind --projection $proj \
        --out "$d" > "$d/run.log" 2>&1
      echo "$proj: $(grep -c '==PROF== Profiling' "$d/run.log") launches profiled; $(tail -1 "$d/run.log")"
      ncu -i /tmp/w4_sweep_$proj.ncu-rep --page raw --csv \
        --metrics gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.avg > "$d/durations.csv" \
        && csvs+=("$d/durations.csv")
    done
    python3 bench/kernels/w4_chain.py --ncu-table "${csvs[@]}" --out "$OUT/ncu4_sweep" | awk -F'|' '$5 + 0 <= 1.0' | head -40
    # NCU4_GENERATE=1: batch 1 through generate with the shipped table, with the merged one, and with the
    # merged one among split_k = 1 (its durations leave out split-K's XLA sum of the partials)
    cp pallas_kernels/linear/tuned_w4.json /tmp/tuned_w4_shipped.json
    runs="shipped:$quant merged:$quant nosplit:$quant"
    [[ $kind == fp4 ]] && runs="$runs shipped:int4"
    for run in $runs; do
      IFS=: read -r t q <<< "$run"
      cp /tmp/tuned_w4_shipped.json pallas_kernels/linear/tuned_w4.json
      [[ $t == merged ]] && merge_w4_table "$OUT/ncu4_sweep/tuned_w4.json"
      [[ $t == nosplit ]] && merge_w4_table "$OUT/ncu4_sweep/tuned_w4_nosplit.json"
      [[ -z ${NCU4_GENERATE:-} ]] && continue
      timeout ${GENERATE_LIMIT:-120} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats 1 --batches 1 \
        --quantization $q --out "$OUT/generate_llama3_8b_${q}_b1_$t.json" > "$OUT/generate_llama3_8b_${q}_b1_$t.log" 2>&1
      echo "== $q $t"; grep "batch   1" "$OUT/generate_llama3_8b_${q}_b1_$t.log" | tail -4
    done
    cp /tmp/tuned_w4_shipped.json pallas_kernels/linear/tuned_w4.json
  else
    timeout ${NCU4_LIMIT:-300} ncu --clock-control none --set full -k regex:skinny_matmul_w4 -c 8 -f -o /tmp/w4_m1 \
      python3 bench/kernels/w4_chain.py --ncu --out /tmp/ncu_x ${NCU4_ARGS:-} > "$OUT/ncu4_run.log" 2>&1
    tail -4 "$OUT/ncu4_run.log"
    ncu -i /tmp/w4_m1.ncu-rep --page details > "$OUT/ncu4_details.txt" 2>&1
    ncu -i /tmp/w4_m1.ncu-rep --page source --print-source sass --csv 2>&1 | gzip > "$OUT/ncu4_sass.csv.gz"
    grep -E "skinny|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Memory Throughput|DRAM Throughput|Executed Ipc A|Block Limit Reg|Waves Per SM|Stall" \
      "$OUT/ncu4_details.txt" | head -80
  fi
fi
if [[ $parts == *bars19* && -n ${BARS19_PROBE:-} ]]; then  # does XLA launch Pallas Triton kernels with PDL?
  # (session 51, H100, B's wait kept: no, +0.93 us after A whatever the options; BARS19_PROBE=1 runs it again)
  timeout ${PROBE_LIMIT:-100} python3 bench/pdl_triton_probe.py --out "$OUT/pdl" 2>&1 | grep -v Warning | tail -14
fi
if [[ $parts == *gridbar* ]]; then  # issue 19: a grid barrier inside one kernel against a kernel boundary (~20 s; the
  # barrier form hangs if the programs are not all resident: the timeout ends it)
  timeout ${GRIDBAR_LIMIT:-60} python3 bench/grid_barrier_probe.py --out "$OUT/gridbar" 2>&1 | grep -v Warning | tail -4
fi
if [[ $parts == *attnb1* ]]; then  # issue 19: decode attention at batch 1, a 32-layer chain, the params' sweep (~150 s)
  timeout ${ATTNB1_LIMIT:-200} python3 bench/kernels/decode_attention_b1.py --out "$OUT/attnb1" \
    --budget-s $(( ${ATTNB1_LIMIT:-200} - 30 )) ${ATTNB1_ARGS:-} 2>&1 | tail -8
fi
if [[ $parts == *fuse* ]]; then  # issue 19: `AttentionConfig.w4_fused_decode` (the one-row decode layer's norms, SwiGLU
  # and residual adds in the 4-bit kernel's launches; off by default) against the default, at batch 1 beside bf16
  # (~400 s; session 41 on an H100, one call each way: int4 device step 2.78-2.83 ms fused against 2.82-2.83,
  # NVFP4 3.13 against 3.07; run `tests` with GPU_TEST_FILES=tests/test_w4.py first)
  # (FUSE_ONLY="bf16 int4 int4_fused nvfp4": those runs only)
  for run in "bf16:" "int4:--quantization int4" "int4_fused:--quantization int4 --attention {\"w4_fused_decode\":true}" \
             "nvfp4:--quantization nvfp4" "nvfp4_fused:--quantization nvfp4 --attention {\"w4_fused_decode\":true}"; do
    IFS=: read -r name extra <<< "$run"
    [[ -n ${FUSE_ONLY:-} && " $FUSE_ONLY " != *" $name "* ]] && continue
    for try in 1 2; do  # (session 51: bf16's compile once failed with "Failed to launch ptxas": one retry)
      timeout ${GENERATE_LIMIT:-150} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats 1 \
        --batches 1 $extra --out "$OUT/generate_llama3_8b_${name}_b1.json" > "$OUT/generate_llama3_8b_${name}_b1.log" 2>&1
      grep -q "Failed to launch ptxas" "$OUT/generate_llama3_8b_${name}_b1.log" || break
    done
    echo "== $name"; grep "batch   1" "$OUT/generate_llama3_8b_${name}_b1.log" | tail -4
  done
fi
if [[ $parts == *m1pack* ]]; then  # issue 19: the half2 kernel at M = 1, some variants (M1PACK_SWEEP, default packed_x;
  # "--min-block-k 4096": session 39's whole-K tiles) beside the table's picks, merged, then generate at batch 1:
  # bf16, int4, NVFP4
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${M1PACK_LIMIT:-220} python3 bench/kernels/w4.py --out "$OUT/m1pack" \
    --budget-s $(( ${M1PACK_LIMIT:-220} - 40 )) --ms 1 ${M1PACK_SWEEP:---only packed_x} --with-tuned 2>&1 | tail -12
  merge_w4_table "$OUT/m1pack/tuned_w4.json"
  for q in ${M1PACK_KINDS:-bf16 int4 nvfp4}; do
    qa=$([[ $q != bf16 ]] && echo "--quantization $q")
    # int4: the decode step's optimized HLO (which XLA fusions run between the kernels: ~260 us a step)
    # (dumped outside $OUT: in session 40 dump files kept appearing there after the archive was made,
    # and the next call's 8-file limit then left its results.tgz out)
    xf=$([[ $q == int4 ]] && echo "--xla_dump_to=/tmp/hlo_int4_b1 --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*")
    with_xla_flags "$xf" timeout ${GENERATE_LIMIT:-150} python3 bench/generate_speed.py --shape llama3-8b \
      --steps 64 --repeats 1 --batches 1 $qa --out "$OUT/generate_llama3_8b_${q}_b1.json" \
      > "$OUT/generate_llama3_8b_${q}_b1.log" 2>&1
    grep "batch   1" "$OUT/generate_llama3_8b_${q}_b1.log" | tail -4
  done
  if [[ -d /tmp/hlo_int4_b1 ]]; then  # the batch-1 module only (its x is bf16[1,4096]), compressed;
    # session 39 kept every bucket's module (21 MB): the archive went over the size limit and nothing came back
    f=$(grep -l "jit(skinny_matmul_w4)/" /tmp/hlo_int4_b1/*decode_forward*gpu_after_optimizations.txt | head -1)
    [[ -n $f ]] && gzip -9c "$f" > "$OUT/decode_int4_b1_after_optimizations.txt.gz"
    rm -rf /tmp/hlo_int4_b1; ls -la "$OUT"/decode_int4_b1_* 2>/dev/null
  fi
fi
if [[ $parts == *fp4dot* ]]; then  # issue 19: NVFP4 at 2-64 rows through the 4-bit tensor-core kernel (session
  # 37, `fp4_tensor_cores`, the default since session 38) beside bf16 and the streaming kernel's dot path, then generate at
  # batch 64: bf16, NVFP4 through the dot path (fp4_tensor_cores off), NVFP4 by default (run `tests` with test_w4.py first)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${FP4DOT_LIMIT:-200} python3 bench/kernels/w4_mgpu.py \
    --out "$OUT/fp4dot" --kind fp4 --ms ${FP4DOT_MS:-16,64} ${FP4DOT_ARGS:-} 2>&1 | grep "^|" | tail -12
  for q in bf16 nvfp4 nvfp4_tc; do
    qa=$([[ $q != bf16 ]] && echo "--quantization nvfp4")
    ta=$([[ $q == nvfp4 ]] && echo '{"fp4_tensor_cores": false}' || echo '{}')
    timeout ${GENERATE_LIMIT:-150} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats 1 --batches 64 \
      $qa --attention "$ta" --out "$OUT/generate_llama3_8b_${q}_b64.json" > "$OUT/generate_llama3_8b_${q}_b64.log" 2>&1
    grep "batch  64" "$OUT/generate_llama3_8b_${q}_b64.log" | tail -4
  done
fi
if [[ $parts == *pdl* ]]; then  # issue 19: XLA's programmatic dependent launch (`AttentionConfig.xla_pdl`, off by
  # default) beside the default, Llama-3-8B bf16 and int4 at batches 1 and 64
  for q in bf16 int4; do
    qa=$([[ $q != bf16 ]] && echo "--quantization $q")
    for pdl in false true; do
      timeout ${GENERATE_LIMIT:-150} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats 1 \
        --batches 1,64 $qa --attention "{\"xla_pdl\": $pdl}" --out "$OUT/generate_llama3_8b_${q}_pdl_$pdl.json" \
        > "$OUT/generate_llama3_8b_${q}_pdl_$pdl.log" 2>&1
      echo "$q xla_pdl=$pdl"; grep "batch  *[0-9]" "$OUT/generate_llama3_8b_${q}_pdl_$pdl.log" | tail -4
    done
  done
fi
if [[ $parts == *promote* ]]; then  # issue 19 (session 43): the 4-bit tensor-core GEMM's `promote` form (codes upcast
  # to bf16 exactly, f32 products scaled afterwards) against the Triton kernel at M = 1 and the default form at 64, with
  # and without PDL; then generate (Llama-3-8B, PROMOTE_BATCHES, default 1) for PROMOTE_RUNS (name:extra args)
  only='^(auto|promote)(_pdl)?$|^promote_d[24]_s[148]$'
  runs='int4_promote_pdl:--quantization@int4@--attention@{"w4_promote":true,"kernel_pdl":true} int4:--quantization@int4 bf16:'
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${PROMOTE_LIMIT:-200} python3 bench/kernels/w4_mgpu.py --out "$OUT/promote" \
    --ms ${PROMOTE_MS:-1,64} --only "${PROMOTE_ONLY:-$only}" 2>&1 | grep "^|" | tail -12
  for run in ${PROMOTE_RUNS:-$runs}; do  # (@ for a space)
    IFS=: read -r name extra <<< "$run"
    timeout ${GENERATE_LIMIT:-150} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats 1 \
      --batches ${PROMOTE_BATCHES:-1} ${extra//@/ } --out "$OUT/generate_llama3_8b_${name}.json" > "$OUT/generate_llama3_8b_${name}.log" 2>&1
    echo "== $name"; grep "batch  *[0-9]" "$OUT/generate_llama3_8b_${name}.log" | tail -4
  done
fi
if [[ $parts == *l2prefetch* ]]; then  # issue 19 (session 43): our Mosaic GPU linears with programmatic dependent launch
  # (`AttentionConfig.kernel_pdl`: W8A8 and the 4-bit tensor-core GEMM, weights prefetched to L2 before the wait)
  # against the default, Llama-3-8B at L2PREFETCH_BATCHES (default 64), bf16 first; run `tests` with test_w4.py and
  # test_linear_kernels.py first (their PDL cases)
  # (L2PREFETCH_RUNS "name:args@with@spaces ...": e.g. fp8_kpdl_xpdl with {"kernel_pdl":true,"xla_pdl":true}, XLA's
  # kernels launched with PDL too, so that the fusion before a linear may release it early)
  runs='bf16: fp8:--quantization@fp8 fp8_kpdl:--quantization@fp8@--attention@{"kernel_pdl":true}
        int4:--quantization@int4 int4_kpdl:--quantization@int4@--attention@{"kernel_pdl":true}'
  for run in ${L2PREFETCH_RUNS:-$runs}; do
    IFS=: read -r name extra <<< "$run"
    timeout ${GENERATE_LIMIT:-150} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats 1 \
      --batches ${L2PREFETCH_BATCHES:-64} ${extra//@/ } --out "$OUT/generate_llama3_8b_${name}.json" > "$OUT/generate_llama3_8b_${name}.log" 2>&1
    echo "== $name"; grep "batch  *[0-9]" "$OUT/generate_llama3_8b_${name}.log" | tail -4
  done
fi
if [[ $parts == *w4* ]]; then  # issue 19: the 4-bit decode kernel's sweep, then generate at batch 1 / 64 (int4, nvfp4)
  # (W4_ARGS, e.g. "--shapes o,gate_up,down --kinds int4 --ms 1,64": session 15's 170 s swept q/k/v only;
  # merge $OUT/w4/tuned_w4.json into pallas_kernels/linear/tuned_w4.json)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${W4_LIMIT:-200} python3 bench/kernels/w4.py --out "$OUT/w4" \
    --budget-s $(( ${W4_LIMIT:-200} - 40 )) ${W4_ARGS:-} 2>&1 | tail -25
  for q in ${W4_KINDS:-int4 nvfp4}; do
    timeout ${GENERATE_LIMIT:-200} python3 bench/generate_speed.py --shape llama3-8b --steps 64 --repeats 1 \
      --batches 1,64 --quantization "$q" --out "$OUT/generate_llama3_8b_$q.json" > "$OUT/generate_llama3_8b_$q.log" 2>&1
    grep -v "rematerialization" "$OUT/generate_llama3_8b_$q.log" | tail -6
  done
fi
if [[ $parts == *masktoy* ]]; then  # issue 20: does a fresh mask wait for the running forward (device_put vs pinned host)?
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MASKTOY_LIMIT:-120} python3 bench/mask_transfer_toy.py \
    --out "$OUT/mask_transfer_toy.json" ${MASKTOY_ARGS:-} 2>&1 | tail -30
fi
if [[ $parts == *nextprefill* ]]; then  # issue 19: Qwen3-Next shape (4 layers) prefill-heavy offline throughput, bf16 then FP8
  for q in bf16 fp8; do
    qa=$([[ $q == fp8 ]] && echo "--quantization fp8")
    timeout ${PREFILL_LIMIT:-200} python3 bench/throughput.py --random-weights --shape qwen3-next-80b-a3b --num-layers 4 \
      --dtype bfloat16 $qa --skip-latency --num-requests 64 --prompt-len 512 1024 --output-len 8 16 --max-model-len 2048 \
      --out "$OUT/prefill_qwen3_next_4l_$q.json" > "$OUT/prefill_qwen3_next_4l_$q.log" 2>&1
    grep -v "rematerialization" "$OUT/prefill_qwen3_next_4l_$q.log" | tail -6
  done
fi
if [[ $parts == *fp8moe* ]]; then  # issue 19: one MoE layer's routed experts, FP8 kept FP8 against bf16 (tokamax)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${FP8MOE_LIMIT:-200} python3 bench/kernels/expert_fp8.py --out "$OUT/expert_fp8" \
    --tokamax 2>&1 | tail -20
fi
if [[ $parts == *moe4* ]]; then  # issue 19 (session 42): 4-bit MoE experts kept 4-bit. One layer's routed experts
  # (the Pallas expert kernel and XLA's gather, int4 and NVFP4, beside bf16 through tokamax and FP8; memcpy roofline),
  # then generate on a Qwen3-30B-A3B shape (4 layers, as the acceptance run), bf16 beside int4, batches 1 and 64
  # (session 42, H100: 203 s with `tests`; MOE4_LIMIT=3 skips the per-layer bench)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MOE4_LIMIT:-240} python3 bench/kernels/expert_fp8.py --out "$OUT/expert_w4" \
    --tokamax --w4 2>&1 | tail -45
  for q in bf16 int4; do
    qa=$([[ $q != bf16 ]] && echo "--quantization $q")
    timeout ${GENERATE_LIMIT:-200} python3 bench/generate_speed.py --shape qwen3-30b-a3b --num-layers 4 --steps 64 \
      --repeats 1 --batches 1,64 $qa --out "$OUT/generate_qwen3_30b_a3b_$q.json" > "$OUT/generate_qwen3_30b_a3b_$q.log" 2>&1
    echo "== $q"; grep -v "rematerialization" "$OUT/generate_qwen3_30b_a3b_$q.log" | tail -6
  done
fi
if [[ $parts == *fp8gmm* ]]; then  # issue 19: FP8 experts' grouped GEMM at prefill sizes, tokamax's quantized kernel
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${FP8GMM_LIMIT:-200} python3 bench/kernels/fp8_grouped.py \
    --out "$OUT/fp8_grouped" ${FP8GMM_ARGS:-} 2>&1 | grep -v "^W1\|Delay kernel" | tail -30
fi
if [[ $parts == *spec* ]]; then  # issue 16: verify step (k=4) against the decode step at batch 1 / 64, n-gram end to end
  if [[ -z ${SPEC_MTP_ONLY:-} ]]; then
    # SPEC_VARIANTS="default noskip prefillverify": the default kernels, then without the sampler's
    # skips (sampler_skip), then with the verify windows through the ragged prefill kernel
    # (verify_decode_kernel off; on by default since session 21)
    for v in ${SPEC_VARIANTS:-default}; do
      case $v in noskip) att='{"sampler_skip":false}' ;; prefillverify) att='{"verify_decode_kernel":false}' ;; *) att='{}' ;; esac
      timeout ${SPEC_LIMIT:-300} python3 bench/spec_decode.py cost --shape llama3-8b --batches 1,64 --attention "$att" \
        --profile "$OUT/spec_profile_llama3_8b_$v" --out "$OUT/spec_decode_cost_llama3_8b_$v.json" 2>&1 \
        | grep -v "rematerialization" | tail -12
    done
  fi
  # the Qwen3-Next shape (12 of 48 layers) drafting with its MTP head (random weights; SPEC_LLAMA_ONLY=1 skips it)
  [[ -z ${SPEC_LLAMA_ONLY:-} ]] && timeout ${SPEC_MTP_LIMIT:-300} python3 bench/spec_decode.py cost \
    --shape qwen3-next-80b-a3b --num-layers 12 --method mtp --batches 1,64 --profile "$OUT/spec_profile_qwen3_next_12l" \
    --out "$OUT/spec_decode_cost_qwen3_next_12l_mtp.json" 2>&1 | grep -v "rematerialization" | tail -12
fi
if [[ $parts == *loading* ]]; then  # issue 14: a page-cached safetensors checkpoint streamed to the device
  timeout ${LOADING_LIMIT:-240} python3 bench/load_speed.py --shape llama3-8b --num-layers 8 --dir /tmp/ckpt_llama8l \
    --out "$OUT/load_speed.json" 2>&1 | tail -4
fi
if [[ $parts == *acceptance* ]]; then  # every family, default EngineConfig, LLM.generate + HTTP server, twins
  timeout ${ACCEPTANCE_LIMIT:-570} python3 bench/gpu_acceptance.py --out "$OUT/acceptance" $commit_arg ${ACCEPTANCE_ARGS:-} 2>&1 \
    | grep -v "^ *[0-9.]* us" | tail -40
fi
if [[ $parts == *lora* ]]; then  # issue 18: decode step with 8 rank-16 adapters (all 7 projections) vs base
  timeout ${LORA_LIMIT:-400} python3 bench/lora.py --shape llama3-8b --batches 1,64 --num-adapters 8 --rank 16 \
    --kernels ${LORA_KERNELS:-auto,masked} ${LORA_ARGS:-} --out "$OUT/lora_llama3_8b.json" 2>&1 | tee "$OUT/lora.log" \
    | grep -v "^ *[0-9.]* us" | tail -12
fi
if [[ $parts == *structured* ]]; then  # issue 20: JSON-schema rows' cost per decode step at batch 64 (llguidance wheel in .whl)
  # the default EngineConfig (session 12 and before: --tuned, one decode bucket of 64); STRUCTURED_ARGS=--tuned for that
  timeout ${STRUCTURED_LIMIT:-300} python3 bench/structured_output.py --h200 --tokenizer-dir .gpu_carry/smollm2_tok \
    ${STRUCTURED_ARGS:-} --out "$OUT/structured_output_h200" 2>&1 | tail -8
fi
if [[ $parts == *prefix* ]]; then  # issue 17: TTFT of a 4,000-token second request, cached vs uncached, and from the host tier
  for run in "prefix_cache_llama3_8b:--shape llama3-8b" "prefix_cache_llama3_8b_host_tier:--shape llama3-8b --host-tier 16 --phases" \
             "prefix_cache_qwen3_next_12l:--shape qwen3-next-80b-a3b --num-layers 12"; do
    IFS=: read -r name extra <<< "$run"
    [[ -n ${PREFIX_ONLY:-} && " $PREFIX_ONLY " != *" $name "* ]] && continue
    timeout ${PREFIX_LIMIT:-500} python3 bench/prefix_cache.py $extra --prefix-len 4000 --repeats ${PREFIX_REPEATS:-3} \
      --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    grep -v "rematerialization" "$OUT/$name.log" | tail -8
  done
fi
# at most 8 files come back from $OUT: everything but the HLO dumps goes into one archive; the
# generate profiles' HLO (GEN4_PROFILE: which fusion is which kernel) goes in compressed
find "$OUT" -path '*profile_gen_*' -name hlo.txt -exec gzip -k {} \;
(cd "$OUT" && tar czf /tmp/results.tgz --exclude='hlo.txt' . && find . -mindepth 1 -delete && mv /tmp/results.tgz .)
