#!/usr/bin/env bash
# vLLM's OpenAI server and `micro-vllm serve` on one checkpoint and the same requests, in one GPU run:
#   bash benchmarks/peer_serving.sh MODEL_DIR [benchmarks/serve.py's arguments...]   (from the project's root)
# Each server in turn, vLLM first: started with the same settings, waited for on /health, driven by
# benchmarks/serve.py (the recipe's requests as streamed /v1/completions of token ids, temperature 0.6,
# EOS ignored), then stopped with its engine process. serve.py's arguments default to all the requests
# at once and then 32 a second, at most 256 in flight, each timed twice, from 4 client processes. Each
# server's JSON lines land in $OUT/vllm_serve.jsonl and $OUT/ours_serve.jsonl, its log beside them.
# The first timed run of each server starts from an empty prefix cache; the later ones find the
# recipe's prompts cached, on both servers alike.
# vLLM's side is `python3 -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs for one GPU
# (one API server process, the engine in a process of its own, as micro-vLLM's server has it), with
# vLLM 0.24's defaults otherwise. Both servers: bf16, 90% of GPU memory, seed 0, max_model_len
# MAX_MODEL_LEN (4096, the recipe's), 8,192 tokens a step (vLLM's server default on an H200; its offline
# LLM takes 16,384), no access log, request logging off (both servers' default), the checkpoint's
# tokenizer (both detokenize every token); SERVER_ARGS adds flags to both, e.g. '--kv-cache-dtype fp8'.
# ENGINES ("vllm ours") chooses the servers; PORT (8123) is vLLM's, ours listens on the next one.
# BUDGET_S (540 s) bounds the whole run, each server getting an even share of what is left.
# The environment is benchmarks/peer_env.sh's. Beyond vLLM's bundled wheels, its server imports uvicorn,
# watchfiles, prometheus-fastapi-instrumentator and model-hosting-container-standards (with jmespath);
# uvicorn takes httptools, as both servers ask (uvicorn[standard]); our server loads xgrammar at start:
# EXTRA_WHEELS=.whlserve holds them (docs/benchmarks.md, "How to reproduce"). Our server imports the
# bundle's fastapi, starlette and pydantic too (VLLM_SITE after its own path), so that both speak HTTP
# through the same packages.
set -u
[ $# -ge 1 ] || { echo "usage: bash benchmarks/peer_serving.sh MODEL_DIR [benchmarks/serve.py's arguments...]"; exit 2; }
MODEL=$1; shift
SERVE_ARGS=("$@")
[ $# -gt 0 ] || SERVE_ARGS=(--request-rate inf 32 --concurrency 256 --repeat 2 --client-processes 4)
ENGINES=${ENGINES:-vllm ours}
for engine in $ENGINES; do
  case $engine in vllm|ours) ;; *) echo "ENGINES='$ENGINES': '$engine' is none of vllm, ours"; exit 2 ;; esac
done
PORT=${PORT:-8123}
SERVER_FLAGS="--host 127.0.0.1 --max-model-len ${MAX_MODEL_LEN:-4096} --max-num-batched-tokens 8192 --dtype bfloat16
  --gpu-memory-utilization 0.9 --seed 0 --disable-uvicorn-access-log ${SERVER_ARGS:-}"

. benchmarks/peer_env.sh

stop_server() {  # its whole process group, the engine's process too, so that the GPU is free for the next
  [ -n "${server:-}" ] || return 0
  kill -TERM -- -"$server" 2> /dev/null
  for _ in $(seq 30); do kill -0 -- -"$server" 2> /dev/null || break; sleep 1; done
  kill -KILL -- -"$server" 2> /dev/null
  wait "$server" 2> /dev/null
  server=
}
trap stop_server EXIT

# serve ENGINE SECONDS PORT PYTHONPATH COMMAND...: the server in a process group of its own, serve.py
# against it once /health answers, all within SECONDS.
serve() {
  local engine=$1 end=$(( $(date +%s) + $2 )) port=$3 path=$4; shift 4
  local log="$OUT/${engine}_server.log"
  PYTHONPATH=$path setsid "$@" --port "$port" $SERVER_FLAGS > "$log" 2>&1 &
  server=$!
  until curl -sf --max-time 5 "127.0.0.1:$port/health" > /dev/null; do
    if ! kill -0 "$server" 2> /dev/null || [ "$(date +%s)" -ge "$end" ]; then
      echo "== $engine: no server ($(( $(date +%s) - T0 ))s into the run)"; tail -20 "$log"; stop_server; return
    fi
    sleep 1
  done
  echo "== $engine: serving $(( $(date +%s) - T0 ))s into the run"
  local seconds=$(( end - $(date +%s) ))
  PYTHONPATH=$OURS_PYTHONPATH timeout $(( seconds > 1 ? seconds : 1 )) python3 benchmarks/serve.py \
    --url "http://127.0.0.1:$port" "${SERVE_ARGS[@]}" > "$OUT/${engine}_serve.jsonl" 2> "$OUT/${engine}_client.log"
  echo "== $engine rc=$? ($(( $(date +%s) - T0 ))s into the run)"
  cat "$OUT/${engine}_serve.jsonl"; tail -5 "$OUT/${engine}_client.log"
  stop_server
}

engines=($ENGINES)
for i in "${!engines[@]}"; do
  share=$(( ($(left) - 5) / (${#engines[@]} - i) ))
  case ${engines[$i]} in
    vllm) serve vllm $share $PORT "$VLLM_PYTHONPATH" python3 -m vllm.entrypoints.openai.api_server --model "$MODEL" ;;
    ours) serve ours $share $(( PORT + 1 )) "$OURS_PYTHONPATH${VLLM_SITE:+:$VLLM_SITE}" \
            python3 -m micro_vllm serve "$MODEL" ;;
  esac
done
echo "run took $(( $(date +%s) - T0 ))s"
