#!/usr/bin/env bash
# The workloads of benchmarks/workloads.py on vLLM and on micro-vLLM in one GPU run, on one checkpoint:
#   bash benchmarks/peer_workloads.sh MODEL_DIR        (from the project's root)
# vLLM runs all the workloads in one process, paying its start-up (about 75 s) once; micro-vLLM runs one
# process per workload. Both engines get the same max_model_len, the long-context workload's unless
# MAX_MODEL_LEN says otherwise. Each workload is timed twice per engine, each run from an empty prefix
# cache. Logs land in $OUT; BUDGET_S bounds the whole run (default 540 s); WORKLOADS chooses the
# workloads (default: shared-prefix long-context); KV_CACHE_DTYPE (auto or fp8, default auto) sets both
# engines' KV cache dtype. The recipe with fp8 caches on both engines:
#   WORKLOADS=recipe MAX_MODEL_LEN=4096 KV_CACHE_DTYPE=fp8 bash benchmarks/peer_workloads.sh MODEL_DIR
# SAMPLING, a JSON list of settings (SamplingParams fields added to every request; default '[{}]',
# temperature alone), runs each workload under each setting on both engines: vLLM all of them in its
# one process, micro-vLLM one process per workload and setting. Top-p alone and penalties on the recipe:
#   WORKLOADS=recipe MAX_MODEL_LEN=4096 SAMPLING='[{"top_p": 0.95}, {"repetition_penalty": 1.1}]' \
#     bash benchmarks/peer_workloads.sh MODEL_DIR
# vLLM 0.24 is imported as the environment has it, or from VLLM_DIR (with the wheels it imports in
# VLLM_SITE, default /tmp/site) when that is set. A bundle packed in two parts is unpacked there
# first when VLLM_DIR holds no vLLM yet: VLLM_DIR holds the first part (vllm.tar.xz.part00),
# VLLM_BUNDLE the second (vllm.tar.xz.part01), its SHA256, the wheels (whl/) and stubs
# (docs/benchmarks.md, "How to reproduce").
# EXTRA_WHEELS, a folder of wheels, is installed into EXTRA_SITE (default /tmp/site-extra), which both
# engines import ahead of their other packages: the json-schema workload needs the real xgrammar,
# which vLLM's wheels only stub, and what it imports (pydantic and its needs in the versions of vLLM's
# wheels, so that shadowing those changes nothing):
#   EXTRA_WHEELS=.whlso WORKLOADS=json-schema MAX_MODEL_LEN=2048 bash benchmarks/peer_workloads.sh MODEL_DIR
set -u
[ $# -eq 1 ] || { echo "usage: bash benchmarks/peer_workloads.sh MODEL_DIR"; exit 2; }
MODEL=$1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/peers-out}; mkdir -p "$OUT"
T0=$(date +%s); DEADLINE=$(( T0 + ${BUDGET_S:-540} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
WORKLOADS=${WORKLOADS:-shared-prefix long-context}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8512}  # the long-context workload's 8,000 prompt tokens + 512 output tokens
KV_CACHE_DTYPE=${KV_CACHE_DTYPE:-auto}
SAMPLING=${SAMPLING:-'[{}]'}
# One setting a line, for throughput.py; a SAMPLING that is not JSON objects stops here.
SETTINGS=$(cd benchmarks && python3 -c 'import json, sys, workloads
print("\n".join(json.dumps(s) for s in workloads.sampling_settings(sys.argv[1])))' "$SAMPLING") || exit 2

VLLM_PYTHONPATH=${PYTHONPATH:-}
if [ -n "${VLLM_DIR:-}" ]; then
  VLLM_SITE=${VLLM_SITE:-/tmp/site}
  if [ ! -d "$VLLM_DIR/vllm" ]; then
    [ -n "${VLLM_BUNDLE:-}" ] || { echo "no vLLM in $VLLM_DIR, and no VLLM_BUNDLE to unpack"; exit 3; }
    [ -f "$VLLM_DIR/vllm.tar.xz.part00" ] || { echo "no vLLM part 1 (vllm.tar.xz.part00) in $VLLM_DIR"; exit 3; }
    {
      cat "$VLLM_DIR/vllm.tar.xz.part00" "$VLLM_BUNDLE/vllm.tar.xz.part01" > "$VLLM_DIR/vllm.tar.xz"
      echo "$(cat "$VLLM_BUNDLE/SHA256")  $VLLM_DIR/vllm.tar.xz" | sha256sum -c - || exit 4
      xz -dc "$VLLM_DIR/vllm.tar.xz" | tar -x -C "$VLLM_DIR" && rm -f "$VLLM_DIR/vllm.tar.xz"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$VLLM_SITE" "$VLLM_BUNDLE"/whl/*.whl || exit 5
      cp -r "$VLLM_BUNDLE"/stubs/* "$VLLM_SITE/"
    } > "$OUT/unpack.log" 2>&1 || { echo "unpack failed"; cat "$OUT/unpack.log"; exit 6; }
  fi
  VLLM_PYTHONPATH=$VLLM_DIR:$VLLM_SITE
fi
OURS_PYTHONPATH=$PWD/src:$PWD/benchmarks
if [ -n "${EXTRA_WHEELS:-}" ]; then  # after vLLM's wheels and stubs: ahead of them on its path
  EXTRA_SITE=${EXTRA_SITE:-/tmp/site-extra}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$EXTRA_SITE" \
    "$EXTRA_WHEELS"/*.whl > "$OUT/extra_wheels.log" 2>&1 \
    || { echo "EXTRA_WHEELS failed"; cat "$OUT/extra_wheels.log"; exit 7; }
  VLLM_PYTHONPATH=$EXTRA_SITE${VLLM_PYTHONPATH:+:$VLLM_PYTHONPATH}
  OURS_PYTHONPATH=$OURS_PYTHONPATH:$EXTRA_SITE
fi
[ -f "$MODEL/config.json" ] || { echo "no checkpoint in $MODEL (benchmarks/bench_model.py writes one)"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

PYTHONPATH=$VLLM_PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout $(( $(left) < 300 ? $(left) : 300 )) \
  python3 benchmarks/vllm_workloads.py --model "$MODEL" --workload $WORKLOADS --repeat 2 \
  --max-model-len $MAX_MODEL_LEN --kv-cache-dtype $KV_CACHE_DTYPE --sampling-params "$SAMPLING" \
  > "$OUT/vllm_workloads.log" 2>&1
echo "== vllm rc=$? ($(( $(date +%s) - T0 ))s into the run)"
grep -E "^RESULT|FAILED|Traceback|Error" "$OUT/vllm_workloads.log" | grep -v "_moe_C" | cut -c1-600 | tail -24

runs=()
for workload in $WORKLOADS; do
  while IFS= read -r setting; do runs+=("$workload $setting"); done <<< "$SETTINGS"
done
for i in "${!runs[@]}"; do  # the time left is shared out evenly among the runs still to come
  workload=${runs[$i]%% *}; setting=${runs[$i]#* }
  log="$OUT/ours_${workload}_$i.log"
  PYTHONPATH="$OURS_PYTHONPATH" timeout $(( ($(left) - 5) / (${#runs[@]} - i) )) \
    python3 benchmarks/throughput.py --model "$MODEL" --workload "$workload" --repeat 2 \
    --max-model-len $MAX_MODEL_LEN --kv-cache-dtype $KV_CACHE_DTYPE --sampling-params "$setting" > "$log" 2>&1
  echo "== micro-vllm $workload $setting rc=$? ($(( $(date +%s) - T0 ))s into the run)"
  grep -E "^workload|^micro-vllm|Traceback|Error" "$log" | cut -c1-400 | tail -6
done
echo "run took $(( $(date +%s) - T0 ))s"
