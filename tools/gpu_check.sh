#!/usr/bin/env bash
# On the GPU machine: the GPU tests, then sparrow serving the GPU fixture on the device (OpenAI completion
# with token-id prompts, streaming, /metrics), then forward throughput on both devices (deepseek_v32's GPU
# fixture and minimax_m3's, CUDA graphs on and off).
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

echo "== GPU tests"
"$BIN/sparrow_tests" --gtest_filter='Cuda*' --gtest_brief=1 || status=1

echo "== sparrow serve --device cuda"
FIXTURE=tests/fixtures/deepseek_v32_gpu
"$BIN/sparrow" serve --device cuda --model "$FIXTURE" --port 18431 --max-model-len 512 > /tmp/serve.log 2>&1 &
server=$!
for _ in $(seq 60); do curl -sf localhost:18431/health > /dev/null && break; sleep 0.5; done
prompt=$(python3 -c "import json; print(json.load(open('$FIXTURE/prompts.json'))['prompts'][1])")
curl -sf localhost:18431/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$FIXTURE\", \"prompt\": $prompt, \"max_tokens\": 12, \"temperature\": 0}" || status=1
echo
curl -sfN localhost:18431/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$FIXTURE\", \"prompt\": $prompt, \"max_tokens\": 4, \"temperature\": 0.8, \"seed\": 1, \"stream\": true}" | head -c 600 || status=1
echo
curl -sf localhost:18431/metrics | grep -E "^vllm:(num_requests|prompt_tokens|generation_tokens)" | head -5
kill $server; wait $server 2>/dev/null
head -5 /tmp/serve.log

echo "== forward throughput (tiny model: launch-bound, for orientation only), CUDA graphs on and off"
"$BIN/sparrow" bench forward --device cpu --model "$FIXTURE" --prompt-tokens 256 --decode-tokens 32 --batch 8 || status=1
for model in "$FIXTURE" tests/fixtures/minimax_m3; do
  for batch in 1 8 64; do
    for eager in "" --enforce-eager; do
      "$BIN/sparrow" bench forward --device cuda $eager --model "$model" --prompt-tokens 256 --decode-tokens 64 \
        --batch $batch || status=1
    done
  done
done
exit $status
