#!/usr/bin/env bash
# The shared-prefix and long-context workloads (benchmarks/workloads.py) on vLLM and on micro-vLLM in
# one GPU run. Run it where ../shared/peers/compare.sh runs: from the project's root, carrying
# .peers/c2 and .peers/bin, right after .peers/bin/stage.sh (which leaves vLLM's part 1 in /root/vx
# and the checkpoint in /root/qwen3r). vLLM runs both workloads in one process, paying its start-up
# (about 75 s) once; micro-vLLM runs one process per workload. Both engines get the same
# max_model_len, the long-context workload's. Each workload is timed twice per engine, each run from
# an empty prefix cache. Logs land in $OUT; BUDGET_S bounds the whole run (default 540 s);
# KV_CACHE_DTYPE (auto or fp8, default auto) sets both engines' KV cache dtype; WORKLOADS and
# MAX_MODEL_LEN choose others (the recipe with fp8 caches on both engines:
# WORKLOADS=recipe MAX_MODEL_LEN=4096 KV_CACHE_DTYPE=fp8 bash benchmarks/peer_workloads.sh).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/peers-out}; mkdir -p "$OUT"
T0=$(date +%s); DEADLINE=$(( T0 + ${BUDGET_S:-540} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
WORKLOADS=${WORKLOADS:-shared-prefix long-context}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8512}  # the long-context workload's 8,000 prompt tokens + 512 output tokens
KV_CACHE_DTYPE=${KV_CACHE_DTYPE:-auto}

if [ ! -d /root/vx/vllm ]; then  # unpacked as compare.sh does
  [ -f /root/vx/vllm.tar.xz.part00 ] || { echo "no vLLM part 1 in /root/vx: run stage.sh first"; exit 3; }
  {
    cat /root/vx/vllm.tar.xz.part00 .peers/c2/vllm.tar.xz.part01 > /root/vx/vllm.tar.xz
    echo "$(cat .peers/c2/SHA256)  /root/vx/vllm.tar.xz" | sha256sum -c - || exit 4
    xz -dc /root/vx/vllm.tar.xz | tar -x -C /root/vx && rm -f /root/vx/vllm.tar.xz
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .peers/c2/whl/*.whl || exit 5
    cp -r .peers/c2/stubs/* /tmp/site/
  } > "$OUT/unpack.log" 2>&1 || { echo "unpack failed"; cat "$OUT/unpack.log"; exit 6; }
fi
[ -f /root/qwen3r/config.json ] || { echo "no checkpoint in /root/qwen3r: run stage.sh first"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

PYTHONPATH=/root/vx:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout $(( $(left) < 300 ? $(left) : 300 )) \
  python3 benchmarks/vllm_workloads.py --model /root/qwen3r --workload $WORKLOADS --repeat 2 \
  --max-model-len $MAX_MODEL_LEN --kv-cache-dtype $KV_CACHE_DTYPE > "$OUT/vllm_workloads.log" 2>&1
echo "== vllm rc=$? ($(( $(date +%s) - T0 ))s into the run)"
grep -E "^RESULT|FAILED|Traceback|Error" "$OUT/vllm_workloads.log" | grep -v "_moe_C" | cut -c1-600 | tail -8

set -- $WORKLOADS
while [ $# -gt 0 ]; do  # the time left is shared out evenly among the workloads still to run
  workload=$1; shift
  PYTHONPATH="$PWD/src:$PWD/benchmarks" timeout $(( ($(left) - 5) / ($# + 1) )) \
    python3 benchmarks/throughput.py --model /root/qwen3r --workload "$workload" --repeat 2 \
    --max-model-len $MAX_MODEL_LEN --kv-cache-dtype $KV_CACHE_DTYPE > "$OUT/ours_$workload.log" 2>&1
  echo "== micro-vllm $workload rc=$? ($(( $(date +%s) - T0 ))s into the run)"
  grep -E "^workload|^micro-vllm|Traceback|Error" "$OUT/ours_$workload.log" | cut -c1-400 | tail -6
done
echo "run took $(( $(date +%s) - T0 ))s"
