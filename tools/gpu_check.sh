#!/usr/bin/env bash
# On the GPU machine: the GPU tests, then sparrow serving the GPU fixtures on the device (OpenAI completions
# with token-id prompts, a prefix-cache hit, streaming, /metrics): deepseek_v32 and kimi_k3 with the default
# caches, and deepseek_v32 and minimax_m3 with the 4-bit ones (NVFP4 latents or K/V, MXFP4 / NVFP4 index
# keys); then forward throughput (deepseek_v32's, minimax_m3's and kimi_k3's GPU fixtures, CUDA graphs on
# and off; FORWARD=0 skips it). GPU_TESTS=<gtest filter> runs those GPU tests only (default Cuda*), suite
# by suite with a time limit each (below); SERVE=0 skips the serving checks.
# GPU_SANITIZE=<tool> (memcheck, racecheck, synccheck, initcheck) runs each suite under NVIDIA's
# compute-sanitizer with that tool: any error it reports fails the suite (exit code 86), and the first
# reports are shown; combine with SERVE=0 FORWARD=0 for a sanitizer-only run (docs/gpu.md).
#   tools/gpu_check.sh [BIN_DIR]     (BIN_DIR holds sparrow and sparrow_tests; default build)
# The binaries are built on the project machine (sm_90a); .devlibs/ carries the shared libraries the GPU
# machine lacks (docs/gpu.md). Tests find the repo through the path compiled into them, so the repo is
# linked there when it sits elsewhere.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BIN=${1:-build}
export LD_LIBRARY_PATH="$ROOT/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
status=0
compiled_root=$(strings "$BIN/sparrow_tests" | grep -m1 -o '^/.*/tests/cache_test.cpp$' | sed 's|/tests/cache_test.cpp||')
[[ -n "$compiled_root" && ! -e "$compiled_root" ]] && mkdir -p "$(dirname "$compiled_root")" && ln -s "$ROOT" "$compiled_root"

# Suite by suite, each under its own time limit (GPU_SUITE_TIMEOUT s, default 300) and with its own log
# (LOG_DIR, default /tmp/gpu-tests), so that one slow or hung suite neither hides the others' results nor
# loses its own output: one summary line per suite, and the end of the log of any that did not pass.
# GPU_JOBS=N runs N suites at once on the one GPU (default 1; the sanitizer's slowdown is mostly host work,
# so a sanitizer run gains most from it).
echo "== GPU tests (${GPU_TESTS:-Cuda*}), suite by suite${GPU_SANITIZE:+, under compute-sanitizer --tool $GPU_SANITIZE}"
export BIN GPU_SUITE_TIMEOUT GPU_SANITIZE
export LOG_DIR="${LOG_DIR:-/tmp/gpu-tests}"
mkdir -p "$LOG_DIR"
# "Suite.Test" per line for the tests the filter selects (gtest lists a suite, then its tests indented).
export TESTS
TESTS=$("$BIN/sparrow_tests" --gtest_filter="${GPU_TESTS:-Cuda*}" --gtest_list_tests |
  awk '/^[^ ]/ {suite = $1; next} {print suite $1}')
# One suite: its summary line (and, unless it passed, the lines that say why); exit status 0 when it passed.
run_suite() {
  local suite=$1 start=$SECONDS rc summary
  local log="$LOG_DIR/${suite//\//_}.log" filter
  filter=$(grep "^$suite\." <<< "$TESTS" | paste -sd: -)
  local sanitizer=()
  [[ -n "${GPU_SANITIZE:-}" ]] && sanitizer=("$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
                                             --tool "$GPU_SANITIZE" --error-exitcode 86 --print-limit 10 --require-cuda-init no)
  timeout "${GPU_SUITE_TIMEOUT:-300}" stdbuf -oL "${sanitizer[@]}" "$BIN/sparrow_tests" --gtest_filter="$filter" > "$log" 2>&1
  rc=$?
  summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$log" | head -3 | tr '\n' ' ')
  local out
  case $rc in
    0) out="ok      $suite ($((SECONDS - start)) s) $summary" ;;
    86) out="SANITIZER $suite ($((SECONDS - start)) s): $(grep -m1 'ERROR SUMMARY' "$log")" ;;
    124) out="TIMEOUT $suite after $((SECONDS - start)) s (last: $(grep -E '^\[ RUN' "$log" | tail -1))" ;;
    *) out="FAILED  $suite ($((SECONDS - start)) s) $summary" ;;
  esac
  [[ $rc == 0 ]] || out+=$'\n'"$(grep -E '^\[  FAILED  \]|Failure|error|^=========' "$log" | head -30)"$'\n'"$(tail -n 15 "$log")"
  echo "$out"  # one write, so that suites run at once do not interleave their lines
  return $((rc != 0))
}
export -f run_suite
sed 's/\..*//' <<< "$TESTS" | uniq | xargs -r -P "${GPU_JOBS:-1}" -I{} bash -c 'run_suite "$1"' _ {} || status=1

# Serving on the device: a completion, a streamed sampled one, and the same prompt again (a prefix-cache
# hit: for kimi_k3 the KDA state comes back from a snapshot) with /metrics after.
serve_check() {
  local fixture=$1 port=$2
  shift 2  # more sparrow serve flags
  echo "== sparrow serve --device cuda --model $fixture $*"
  "$BIN/sparrow" serve --device cuda --model "$fixture" --port $port --max-model-len 512 "$@" > /tmp/serve.log 2>&1 &
  local server=$!
  for _ in $(seq 60); do curl -sf localhost:$port/health > /dev/null && break; sleep 0.5; done
  local prompt
  prompt=$(python3 -c "import json; print(json.load(open('$fixture/prompts.json'))['prompts'][2])")
  for _ in 1 2; do
    curl -sf localhost:$port/v1/completions -H 'Content-Type: application/json' \
      -d "{\"model\": \"$fixture\", \"prompt\": $prompt, \"max_tokens\": 12, \"temperature\": 0}" || status=1
    echo
  done
  # (to a file first: `curl | head` under pipefail fails whenever head stops reading early)
  curl -sfN localhost:$port/v1/completions -H 'Content-Type: application/json' \
    -d "{\"model\": \"$fixture\", \"prompt\": $prompt, \"max_tokens\": 4, \"temperature\": 0.8, \"seed\": 1, \"stream\": true}" \
    > /tmp/stream.txt || status=1
  head -c 600 /tmp/stream.txt
  echo
  curl -sf localhost:$port/metrics | grep -E "^vllm:(num_requests|prompt_tokens|generation_tokens|prefix_cache)" | head -8
  kill $server; wait $server 2>/dev/null
  head -5 /tmp/serve.log
}
FIXTURE=tests/fixtures/deepseek_v32_gpu
if [[ "${SERVE:-1}" != 0 ]]; then
  serve_check $FIXTURE 18431
  serve_check tests/fixtures/kimi_k3_1_pro_gpu 18432
  serve_check $FIXTURE 18433 --kv-cache-dtype nvfp4 --attention-config '{"indexer_kv_dtype": "mxfp4"}'
  serve_check tests/fixtures/minimax_m3 18434 --kv-cache-dtype nvfp4 --attention-config '{"indexer_kv_dtype": "nvfp4"}'
fi
[[ "${FORWARD:-1}" == 0 ]] && exit $status

echo "== forward throughput (tiny model: launch-bound, for orientation only), CUDA graphs on and off"
"$BIN/sparrow" bench forward --device cpu --model "$FIXTURE" --prompt-tokens 256 --decode-tokens 32 --batch 8 || status=1
for model in "$FIXTURE" tests/fixtures/minimax_m3 tests/fixtures/kimi_k3_1_pro_gpu; do
  for batch in 1 8 64; do
    for eager in "" --enforce-eager; do
      "$BIN/sparrow" bench forward --device cuda $eager --model "$model" --prompt-tokens 256 --decode-tokens 64 \
        --batch $batch || status=1
    done
  done
done
# Where a step's time goes (the decoder's marks as events on the stream; docs/bench.md).
"$BIN/sparrow" bench forward --device cuda --model tests/fixtures/kimi_k3_1_pro_gpu --prompt-tokens 256 --decode-tokens 16 \
  --batch 8 --repeats 1 --profile || status=1
exit $status
