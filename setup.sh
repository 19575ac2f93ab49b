#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine:
#   ./setup.sh        install what is missing, build, and run the main job on the embedded default model
#   ./setup.sh test   install what is missing, build, and run the whole test suite, then the sanitizer
#                     build's tests and fuzz smoke runs (docs/testing.md)
# Set SPARROW_BUILD_DIR to build elsewhere (default: build/; the sanitizer build: SPARROW_ASAN_BUILD_DIR,
# default build-asan/).
set -euo pipefail
cd "$(dirname "$0")"
BUILD=${SPARROW_BUILD_DIR:-build}

# Debian packages the build and tests need (see docs/ARCHITECTURE.md, "Dependencies").
PACKAGES=(cmake ninja-build g++ pkg-config libopenblas-dev nlohmann-json3-dev libcli11-dev libgtest-dev libpcre2-dev libxxhash-dev libpng-dev libjpeg-dev libwebp-dev libcpp-httplib-dev libboost-dev libgloo-dev libucx-dev curl pybind11-dev python3-dev)
# The test mode's sanitizer build (docs/testing.md): clang with its sanitizer and libFuzzer runtimes, and
# llvm's llvm-symbolizer so that reports name files and lines.
# Open MPI's mpirun, one of the launchers a tensor-parallel run starts under (docs/parallel.md), is tested too.
if [ "${1:-}" = test ]; then PACKAGES+=(clang libclang-rt-14-dev llvm openmpi-bin); fi
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The CUDA backend is compiled whenever the toolkit is present (no GPU is needed to build it).
if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j"$(nproc)"

if [ "${1:-}" = test ]; then
  # Python references the tests compare against live (tokenizers, tiktoken, jinja2) and the official
  # OpenAI client that drives the server tests. Pinned to the versions the committed expectations came from.
  python3 -m pip install -q --disable-pip-version-check tokenizers==0.23.3 tiktoken==0.14.0 jinja2==3.1.6 \
      openai pytest httpx numpy
  ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"

  # The sanitizer build (docs/testing.md): clang, CPU only, AddressSanitizer and UndefinedBehaviorSanitizer
  # on the C++ tests (label sanitize) and a smoke run of every libFuzzer target (label fuzz). It runs on
  # OpenBLAS's Nehalem kernels (SSE4.2, which every x86-64 CPU of the last fifteen years has) rather than
  # the ones picked for this CPU, so a test that holds on one BLAS kernel's rounding only fails here.
  ASAN_BUILD=${SPARROW_ASAN_BUILD_DIR:-build-asan}
  cmake -S . -B "$ASAN_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++ -DSPARROW_CUDA=OFF \
      -DSPARROW_SANITIZE=address,undefined -DSPARROW_FUZZ=ON
  cmake --build "$ASAN_BUILD" -j"$(nproc)"
  OPENBLAS_CORETYPE=Nehalem ctest --test-dir "$ASAN_BUILD" --output-on-failure -j"$(nproc)" -L 'sanitize|fuzz'
else
  # The main job, on the bundled default model (models/minimax_m3, trained by tools/train_small_models.py):
  # a raw-text continuation, then the OpenAI-compatible server: a chat that calls a tool, and the answer
  # once the tool's result is in the conversation.
  "$BUILD"/sparrow generate --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0.7 --seed 3
  echo
  PORT=${SPARROW_PORT:-8765}
  "$BUILD"/sparrow serve --port "$PORT" --tool-call-parser minimax_m3 --reasoning-parser minimax_m3 \
      --enable-auto-tool-choice &
  server=$!
  trap 'kill $server 2>/dev/null' EXIT
  for _ in $(seq 100); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.2; done
  echo "== a chat with tools: the model reasons and calls the calculator"
  curl -s "localhost:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
      -d @docs/examples/chat_with_tools.json | python3 -m json.tool
  echo "== the same chat with the tool's result: the model answers from it"
  curl -s "localhost:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
      -d @docs/examples/chat_with_tool_result.json | python3 -m json.tool
fi
