# The environment in which vLLM and micro-vLLM run beside each other on one checkpoint; sourced, from
# the project's root, by peer_workloads.sh and peer_serving.sh once their own arguments are checked
# (MODEL set). It sets OUT (default /tmp/peers-out), left (the seconds of BUDGET_S, default 540 s, still
# to come), VLLM_PYTHONPATH and OURS_PYTHONPATH, and stops the run (exit 3 to 7) when a part is missing.
# vLLM 0.24 is imported as the environment has it, or from VLLM_DIR (with the wheels it imports in
# VLLM_SITE, default /tmp/site) when that is set. A bundle packed in two parts is unpacked there
# first when VLLM_DIR holds no vLLM yet: VLLM_DIR holds the first part (vllm.tar.xz.part00),
# VLLM_BUNDLE the second (vllm.tar.xz.part01), its SHA256, the wheels (whl/) and stubs
# (docs/benchmarks.md, "How to reproduce").
# EXTRA_WHEELS, a folder of wheels, is installed into EXTRA_SITE (default /tmp/site-extra), which both
# engines import ahead of their other packages: what a workload needs beyond vLLM's wheels (xgrammar
# for the json-schema workload, the HTTP server's packages for peer_serving.sh).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/peers-out}; mkdir -p "$OUT"
T0=$(date +%s); DEADLINE=$(( T0 + ${BUDGET_S:-540} ))
left() { echo $(( DEADLINE - $(date +%s) )); }

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
