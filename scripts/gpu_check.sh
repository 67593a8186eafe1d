#!/usr/bin/env bash
# The one command a developer sends to the GPU machine: GPU tests, then the benchmarks.
#   bash scripts/gpu_check.sh [tests] [throughput] [latency] [eager] [unfused] [unfused-sampler] [sweep] [gemm]   (default: all of them)
# Logs, results.jsonl and a Markdown results table (results.md) go under $OUT when it is set (the device
# tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stages=${*:-tests throughput latency eager unfused unfused-sampler sweep gemm}
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# The device's copy of the tree may carry a stale .git: the sender stamps .gpu_commit (docs/benchmarks.md,
# "Running it").
{ cat .gpu_commit 2>/dev/null || git rev-parse --short HEAD; } | sed 's/^/commit /' | tee -a "$OUT/gpu.txt"

for stage in $stages; do
  echo "=== $stage"
  case $stage in
    # The engine-level tests first: they are the ones a short lease must not cut off.
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 tests/test_gpu.py tests/ 2>&1 | tee "$OUT/gpu_tests.log" || status=1 ;;
    throughput) python3 benchmarks/throughput.py --compare-hf 16 --profile --json "$OUT/results.jsonl" 2>&1 | tee "$OUT/throughput.log" || status=1 ;;
    latency) python3 benchmarks/latency.py --json "$OUT/results.jsonl" 2>&1 | tee "$OUT/latency.log" || status=1 ;;
    eager) python3 benchmarks/throughput.py --enforce-eager --json "$OUT/results.jsonl" 2>&1 | tee "$OUT/eager.log" || status=1 ;;
    unfused) python3 benchmarks/throughput.py --no-fused-ops --json "$OUT/results.jsonl" 2>&1 | tee "$OUT/unfused.log" || status=1 ;;
    unfused-sampler) python3 benchmarks/throughput.py --no-fused-sampler --json "$OUT/results.jsonl" 2>&1 | tee "$OUT/unfused_sampler.log" || status=1 ;;
    sweep) python3 benchmarks/attention_sweep.py --json "$OUT/results.jsonl" 2>&1 | tee "$OUT/sweep.log" || status=1 ;;
    gemm) python3 benchmarks/gemm_shapes.py --json "$OUT/results.jsonl" 2>&1 | tee "$OUT/gemm.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
echo "=== results"
if [ -f "$OUT/results.jsonl" ]; then python3 benchmarks/results_table.py "$OUT/results.jsonl" | tee "$OUT/results.md"; fi
exit $status
