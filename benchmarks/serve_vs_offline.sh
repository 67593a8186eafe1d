#!/usr/bin/env bash
# The server against the offline engine on the same requests, in one run (docs/benchmarks.md, "Serving"):
#   bash benchmarks/serve_vs_offline.sh MODEL_DIR [benchmarks/serve.py's arguments...]
# First benchmarks/throughput.py on MODEL_DIR (offline; it detokenizes when the model has a tokenizer, as
# the server must), then `micro-vllm serve MODEL_DIR` and benchmarks/serve.py against it. Logs under $OUT.
set -u
cd "$(dirname "$0")/.."
model=$1; shift
OUT=${OUT:-/tmp/serve_vs_offline}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
port=${PORT:-8123}

python3 benchmarks/throughput.py --model "$model" --repeat 2 > "$OUT/offline.log" 2>&1
grep "^micro-vllm:" "$OUT/offline.log" | cut -c1-90

python3 -m micro_vllm serve "$model" --port "$port" --max-model-len 4096 --disable-uvicorn-access-log > "$OUT/server.log" 2>&1 &
server=$!
until curl -sf "localhost:$port/health" > /dev/null; do
  kill -0 $server 2> /dev/null || { echo "the server exited:"; tail -20 "$OUT/server.log"; exit 1; }
  sleep 1
done
python3 benchmarks/serve.py --url "http://localhost:$port" "$@" | tee "$OUT/serve.jsonl"
echo "the server's threads, CPU time used:"; ps -L -o tid,time,comm -p $server | sort -k2 -r | head -5
echo "after the runs:"; curl -s "localhost:$port/metrics" | grep -E "^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc)"
kill $server; wait $server
