#!/usr/bin/env bash
# The one command a developer sends to the GPU machine: GPU tests, then the benchmarks.
#   bash scripts/gpu_check.sh [tests] [throughput] [latency] [eager] [unfused] [unfused-sampler] [sweep] [gemm]   (default: all of them)
# Logs, results.jsonl and a Markdown results table (results.md) go under $OUT when it is set (else
# /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stages=${*:-tests throughput latency eager unfused unfused-sampler sweep gemm}
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# A copy of the tree sent to the GPU machine may carry a stale .git: the sender stamps .gpu_commit
# (docs/benchmarks.md, "How to reproduce").
{ cat .gpu_commit 2>/dev/null || git rev-parse --short HEAD; } | sed 's/^/commit /' | tee -a "$OUT/gpu.txt"

# run LOG SCRIPT [ARGS...]: a benchmark script that appends to results.jsonl, logged to $OUT/LOG.log
run() {
  local log=$1 script=$2; shift 2
  python3 "benchmarks/$script" "$@" --json "$OUT/results.jsonl" 2>&1 | tee "$OUT/$log.log" || status=1
}

# The GPU tests, within GPU_TEST_SECONDS (default 280: the stage fits a five-minute run). Only the
# files that mark GPU tests are collected (others import packages the GPU machine may lack), the
# engine-level ones first. Most of their time is Triton compiling kernels on the CPU, so with
# pytest-xdist installed they run in GPU_TEST_WORKERS processes (default 6; 0: one process) sharing
# the GPU; tests marked with one xdist_group run in one process, in turn. Each test's time is printed
# as it ends (tests/conftest.py), so a run the time limit cuts short still says where its time went.
gpu_tests() {
  local files parallel=""
  files="tests/test_gpu.py $(grep -rlE 'mark\.gpu' tests --include='test_*.py' | grep -v '^tests/test_gpu.py$' | sort)"
  if python3 -c "import xdist" 2>/dev/null && [ "${GPU_TEST_WORKERS:-6}" != 0 ]; then
    parallel="-n ${GPU_TEST_WORKERS:-6} --dist loadgroup"
  fi
  MICRO_VLLM_TEST_TIMES=1 timeout -k 10 "${GPU_TEST_SECONDS:-280}" \
    python3 -m pytest -q -m gpu -p no:cacheprovider --durations=20 $parallel $files 2>&1 | tee "$OUT/gpu_tests.log" || status=1
}

for stage in $stages; do
  echo "=== $stage"
  case $stage in
    tests) gpu_tests ;;
    throughput) run throughput throughput.py --compare-hf 16 --profile ;;
    latency) run latency latency.py ;;
    eager) run eager throughput.py --enforce-eager ;;
    unfused) run unfused throughput.py --custom-ops=none,+sampler ;;
    unfused-sampler) run unfused_sampler throughput.py --custom-ops=-sampler ;;
    sweep) run sweep attention_sweep.py ;;
    gemm) run gemm gemm_shapes.py ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
echo "=== results"
if [ -f "$OUT/results.jsonl" ]; then python3 benchmarks/results_table.py "$OUT/results.jsonl" | tee "$OUT/results.md"; fi
exit $status
