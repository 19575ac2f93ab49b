#!/usr/bin/env bash
# Packs vLLM 0.26.0 (requirements.txt) for a GPU machine that cannot reach PyPI: downloads the wheels here
# (Python 3.12, manylinux x86-64), unpacks them into one site-packages tree (a wheel is a zip of its
# installed files), drops the files that machine does not run, and writes it as parts of at most PART_MB
# MiB each, so a transfer with a size limit per call can carry them one at a time.
#
#   bench/peers/vllm/pack.sh [OUT]      OUT default .peers/vllm-pack (git-ignored); PART_MB default 63
#
# Writes OUT/vllm-site.tar.xz.<n> (about 250 MB in all) and OUT/SHA256SUMS. On the GPU machine,
# bench/peers/vllm/setup.sh joins and unpacks them.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT="${1:-$HERE/../../../.peers/vllm-pack}"
PART_MB="${PART_MB:-63}"
mkdir -p "$OUT/wheels"
grep -v '^#' "$HERE/requirements.txt" | grep . > "$OUT/requirements.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d "$OUT/wheels" -r "$OUT/requirements.txt"
site="$OUT/site"
rm -rf "$site" && mkdir -p "$site"
for w in "$OUT"/wheels/*.whl; do python3 -m zipfile -e "$w" "$site"; done
# FlashAttention-2 (sm80; Hopper takes FA3) and DeepGEMM's extension for the Pythons the machine lacks.
rm -f "$site"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$site"/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
find "$site" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$OUT"/vllm-site.tar.xz*
# -9: its 64 MiB dictionary also makes the threads' blocks large, so the parts come out ~5% smaller
# than with -6/-7 (about 250 MB). Then as few parts as PART_MB allows, of equal size.
tar cf - -C "$site" . | xz -T0 -9 > "$OUT/vllm-site.tar.xz"
size=$(stat -c %s "$OUT/vllm-site.tar.xz")
parts=$(( (size + PART_MB * 1048576 - 1) / (PART_MB * 1048576) ))
split -n "$parts" -d -a 1 "$OUT/vllm-site.tar.xz" "$OUT/vllm-site.tar.xz."
rm "$OUT/vllm-site.tar.xz"
(cd "$OUT" && sha256sum vllm-site.tar.xz.* > SHA256SUMS)
rm -rf "$site"
ls -l "$OUT"/vllm-site.tar.xz.*
