#!/usr/bin/env bash
# One prefill and one decode instance behind `sparrow proxy` against one instance, on this machine's CPU, with the
# same `sparrow bench serve` load (bench/results/disaggregation.md). Usage: bench/disaggregation_cpu.sh [OUT_DIR]
# Ports 8300-8303 must be free. The bundled model (models/minimax_m3, 1,024 positions) keeps it CI-sized.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${SPARROW:-build/sparrow}
M=models/minimax_m3
OUT=${1:-/tmp/disaggregation-bench}
mkdir -p "$OUT"
LOAD=(--dataset-name random --random-input-len 768 --random-output-len 64 --tokenizer "$M" --num-prompts 24
      --max-concurrency 4 --ignore-eos --seed 1 --disable-tqdm --save-result --result-dir "$OUT")
kv() { echo "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"$1\", \"kv_port\": 0$2}"; }

$B serve $M --port 8300 --kv-cache-memory 2GiB --disable-log-requests > "$OUT/single.log" 2>&1 &
single=$!
until curl -sf localhost:8300/health > /dev/null; do sleep 0.5; done
$B bench serve --port 8300 "${LOAD[@]}" --result-filename single.json > "$OUT/single-bench.txt" 2>&1
kill $single && wait $single || true

$B serve $M --port 8301 --kv-cache-memory 2GiB --disable-log-requests --kv-transfer-config "$(kv kv_producer '')" \
    > "$OUT/prefill.log" 2>&1 &
prefill=$!
$B serve $M --port 8302 --kv-cache-memory 2GiB --disable-log-requests \
    --kv-transfer-config "$(kv kv_consumer ', "kv_connector_extra_config": {"log_transfers": true}')" > "$OUT/decode.log" 2>&1 &
decode=$!
until curl -sf localhost:8301/health > /dev/null && curl -sf localhost:8302/health > /dev/null; do sleep 0.5; done
$B proxy --prefill http://127.0.0.1:8301 --decode http://127.0.0.1:8302 --port 8303 > "$OUT/proxy.log" 2>&1 &
proxy=$!
until curl -sf localhost:8303/health > /dev/null; do sleep 0.2; done
$B bench serve --port 8303 "${LOAD[@]}" --result-filename 1p1d.json > "$OUT/1p1d-bench.txt" 2>&1
curl -s localhost:8302/metrics | grep '^sparrow:kv_transfer' > "$OUT/decode-metrics.txt"
kill $proxy $prefill $decode && wait || true
grep -E "Output token thr|Mean TTFT|P99 TTFT|Mean TPOT|P99 TPOT" "$OUT/single-bench.txt" "$OUT/1p1d-bench.txt"
