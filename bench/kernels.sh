#!/usr/bin/env bash
# One command for the kernel benchmarks on the GPU machine: sparrow's kernels and their peers (PyTorch, FlashMLA)
# on the same shapes, in the same run, merged into one markdown table.
#
#   bench/kernels.sh [--quick]
#
# Writes into $OUT (the device tool's result folder; else out/kernels/):
#   sparrow.jsonl     build/sparrow bench kernels --json      (fields kernel, shape, impl, median_us, bytes, flops, note)
#   torch_dsa.jsonl   bench/peers/torch_dsa.py                (same JSON lines, impl "torch...")
#   torch_mla.jsonl   bench/peers/torch_mla.py
#   torch_moe.jsonl   bench/peers/torch_moe.py               (torch loop and grouped_mm)
#   kda_peers.jsonl   bench/peers/kda_peers.py               (fla chunk_kda when installed, transformers torch reference)
#   flashmla.jsonl    bench/peers/flashmla_peer.py            (if FlashMLA built; impl "flashmla")
#   kernels.md        tools/kernel_table.py over all of the above
#   kernels.log       every step's stderr (one file: the device tool returns at most 8 files)
# FlashMLA is compiled (bench/peers/build_flashmla.sh, ~minutes on 16 cores) in the background at low CPU priority
# while sparrow's kernels run; FLASHMLA=skip leaves it out, FLASHMLA=serial builds it first.
# Env: SPARROW (binary, default build/sparrow), ITERATIONS (timed launches per shape, default 20), FLASHMLA_DEADLINE_S (stop FlashMLA shapes after this many s).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
QUICK=()
[[ "${1:-}" == "--quick" ]] && QUICK=(--quick)
OUT="${OUT:-$ROOT/out/kernels}"
mkdir -p "$OUT"
LOG="$OUT/kernels.log"
: > "$LOG"
export LD_LIBRARY_PATH="$ROOT/.devlibs:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
SPARROW="${SPARROW:-$ROOT/build/sparrow}"
FLASHMLA="${FLASHMLA:-background}"
status=0

build_pid=""
rm -f /tmp/flashmla_build.txt /tmp/flashmla_build.err
if [[ "$FLASHMLA" == "background" ]]; then
  nice -n 19 bench/peers/build_flashmla.sh > /tmp/flashmla_build.txt 2> /tmp/flashmla_build.err &
  build_pid=$!
elif [[ "$FLASHMLA" == "serial" ]]; then
  bench/peers/build_flashmla.sh > /tmp/flashmla_build.txt 2> /tmp/flashmla_build.err || true
fi

echo "== sparrow bench kernels" >&2
if [[ -x "$SPARROW" ]]; then
  "$SPARROW" bench kernels "${QUICK[@]}" --iterations "${ITERATIONS:-20}" --json "$OUT/sparrow.jsonl" 2>> "$LOG" || { echo "sparrow bench failed (see kernels.log)" >&2; status=1; }
else
  echo "no $SPARROW (build the sparrow target and carry it)" >&2; status=1
fi

for peer in torch_dsa torch_mla torch_moe kda_peers; do
  echo "== $peer" >&2
  if [[ -f "bench/peers/$peer.py" ]]; then
    python3 "bench/peers/$peer.py" "${QUICK[@]}" > "$OUT/$peer.jsonl" 2>> "$LOG" || { echo "$peer failed (see kernels.log)" >&2; status=1; }
  else
    echo "bench/peers/$peer.py not written yet: skipped" >&2
  fi
done

if [[ "$FLASHMLA" != "skip" ]]; then
  [[ -n "$build_pid" ]] && { wait "$build_pid" || true; }
  cat /tmp/flashmla_build.err /tmp/flashmla_build.txt 2>/dev/null | tee -a "$LOG" >&2
  if grep -q '^FLASHMLA_DIR=' /tmp/flashmla_build.txt 2>/dev/null; then
    echo "== flashmla" >&2
    FLASHMLA_DIR=$(sed -n 's/^FLASHMLA_DIR=//p' /tmp/flashmla_build.txt) \
      python3 bench/peers/flashmla_peer.py "${QUICK[@]}" --deadline-s "${FLASHMLA_DEADLINE_S:-0}" \
      > "$OUT/flashmla.jsonl" 2>> "$LOG" || { echo "flashmla_peer failed (see kernels.log)" >&2; status=1; }
  else
    echo "FlashMLA did not build (build log in kernels.log): no FlashMLA column" | tee -a "$LOG" >&2
  fi
fi

python3 tools/kernel_table.py "$OUT"/*.jsonl > "$OUT/kernels.md" 2>> "$LOG" && cat "$OUT/kernels.md"
exit $status
