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
# NUM_REQUESTS gives every workload that many requests on both engines (default: each workload's own);
# long-context at 24 requests:
#   WORKLOADS=long-context NUM_REQUESTS=24 bash benchmarks/peer_workloads.sh MODEL_DIR
# SAMPLING, a JSON list of settings (SamplingParams fields added to every request; default '[{}]',
# temperature alone), runs each workload under each setting on both engines: vLLM all of them in its
# one process, micro-vLLM one process per workload and setting. Top-p alone and penalties on the recipe:
#   WORKLOADS=recipe MAX_MODEL_LEN=4096 SAMPLING='[{"top_p": 0.95}, {"repetition_penalty": 1.1}]' \
#     bash benchmarks/peer_workloads.sh MODEL_DIR
# The environment (vLLM from a bundle, EXTRA_WHEELS) is benchmarks/peer_env.sh's. The json-schema
# workload needs the real xgrammar, which vLLM's wheels only stub, and what it imports (pydantic and its
# needs in the versions of vLLM's wheels, so that shadowing those changes nothing), and lm-format-enforcer
# with interegular, which vLLM imports to validate any request with a schema, as EXTRA_WHEELS:
#   EXTRA_WHEELS=.whlso WORKLOADS=json-schema MAX_MODEL_LEN=4096 bash benchmarks/peer_workloads.sh MODEL_DIR
# WORKLOADS=latency times the latency batches instead, greedy (1, 8 and 64 prompts of 512 tokens, 128
# output tokens: benchmarks/latency.py, and vllm_workloads.py --latency on vLLM's engine loop), each
# engine once, max_model_len 4,096:
#   WORKLOADS=latency bash benchmarks/peer_workloads.sh MODEL_DIR
set -u
[ $# -eq 1 ] || { echo "usage: bash benchmarks/peer_workloads.sh MODEL_DIR"; exit 2; }
MODEL=$1
WORKLOADS=${WORKLOADS:-shared-prefix long-context}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8512}  # the long-context workload's 8,000 prompt tokens + 512 output tokens
KV_CACHE_DTYPE=${KV_CACHE_DTYPE:-auto}
SAMPLING=${SAMPLING:-'[{}]'}
requests=(${NUM_REQUESTS:+--num-requests $NUM_REQUESTS})
# One setting a line, for throughput.py; a SAMPLING that is not JSON objects stops here.
SETTINGS=$(cd benchmarks && python3 -c 'import json, sys, workloads
print("\n".join(json.dumps(s) for s in workloads.sampling_settings(sys.argv[1])))' "$SAMPLING") || exit 2

. benchmarks/peer_env.sh

if [ "$WORKLOADS" = latency ]; then
  vllm_args=(--latency)
else
  vllm_args=(--workload $WORKLOADS --repeat 2 --max-model-len $MAX_MODEL_LEN --sampling-params "$SAMPLING" "${requests[@]}")
fi
PYTHONPATH=$VLLM_PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout $(( $(left) < 300 ? $(left) : 300 )) \
  python3 benchmarks/vllm_workloads.py --model "$MODEL" --kv-cache-dtype $KV_CACHE_DTYPE "${vllm_args[@]}" \
  > "$OUT/vllm_workloads.log" 2>&1
echo "== vllm rc=$? ($(( $(date +%s) - T0 ))s into the run)"
grep -E "^RESULT|FAILED|Traceback|Error" "$OUT/vllm_workloads.log" | grep -v "_moe_C" | cut -c1-600 | tail -24

if [ "$WORKLOADS" = latency ]; then
  PYTHONPATH="$OURS_PYTHONPATH" timeout $(( $(left) - 5 )) python3 benchmarks/latency.py --model "$MODEL" \
    --kv-cache-dtype $KV_CACHE_DTYPE > "$OUT/ours_latency.log" 2>&1
  echo "== micro-vllm latency rc=$? ($(( $(date +%s) - T0 ))s into the run)"
  grep -E "^run|Traceback|Error" "$OUT/ours_latency.log" | cut -c1-400
  echo "run took $(( $(date +%s) - T0 ))s"
  exit 0
fi

runs=()
for workload in $WORKLOADS; do
  while IFS= read -r setting; do runs+=("$workload $setting"); done <<< "$SETTINGS"
done
for i in "${!runs[@]}"; do  # the time left is shared out evenly among the runs still to come
  workload=${runs[$i]%% *}; setting=${runs[$i]#* }
  log="$OUT/ours_${workload}_$i.log"
  PYTHONPATH="$OURS_PYTHONPATH" timeout $(( ($(left) - 5) / (${#runs[@]} - i) )) \
    python3 benchmarks/throughput.py --model "$MODEL" --workload "$workload" --repeat 2 "${requests[@]}" \
    --max-model-len $MAX_MODEL_LEN --kv-cache-dtype $KV_CACHE_DTYPE --sampling-params "$setting" > "$log" 2>&1
  echo "== micro-vllm $workload $setting rc=$? ($(( $(date +%s) - T0 ))s into the run)"
  grep -E "^workload|^micro-vllm|Traceback|Error" "$log" | cut -c1-400 | tail -6
done
echo "run took $(( $(date +%s) - T0 ))s"
