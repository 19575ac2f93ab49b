#!/usr/bin/env bash
# Stands in for `vllm` in tests/bench/sweep_script_test.py: records the arguments bench/sweep.sh gives
# `vllm serve` (to $FAKE_VLLM_ARGV, and the routing simulation it was given to $FAKE_VLLM_ARGV.routing) and serves the folder with sparrow on the CPU on the same port, so the
# sweep's peer path (launch, wait for /v1/models, sweep by --base-url, plot) runs for real.
set -euo pipefail
printf '%s\n' "$@" > "${FAKE_VLLM_ARGV:?}"
printf '%s' "${VLLM_MOE_ROUTING_SIMULATION_STRATEGY-unset}" > "$FAKE_VLLM_ARGV.routing"
[[ "${1:-}" == serve ]] || { echo "fake vllm: only 'serve'" >&2; exit 2; }
model=$2
port=$(awk '/^--port$/ {getline; print; exit}' "$FAKE_VLLM_ARGV")
max_len=$(awk '/^--max-model-len$/ {getline; print; exit}' "$FAKE_VLLM_ARGV")
exec "${SPARROW:?}" serve "$model" --load-format dummy --device cpu --port "$port" --max-model-len "$max_len" \
  --kv-cache-memory 1GiB
