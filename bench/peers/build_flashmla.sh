#!/usr/bin/env bash
# Builds the FlashMLA peer (github.com/deepseek-ai/FlashMLA) on the GPU machine, for sm_90a only, so that
# bench/peers/flashmla_peer.py can time it next to sparrow's kernels in the same run.
#
#   bench/peers/build_flashmla.sh            # builds into /tmp/flashmla-build (FLASHMLA_BUILD_DIR)
#   FLASHMLA_FULL=1 bench/peers/build_flashmla.sh   # also compile FlashMLA's SM100 units (slow, not needed on H200)
#
# The sources come from .peers/FlashMLA (git-ignored, exported from the upstream mirror with its pinned
# CUTLASS include trees; .peers/FlashMLA/PEER_VERSION names the commits). Nothing is built inside the repo:
# the tree is copied to the build dir, and only that copy's setup.py is adjusted:
#   - the `git submodule update` call is dropped (no git, no network there; CUTLASS is already in place);
#   - FLASH_MLA_DISABLE_SM100=1 / FLASH_MLA_DISABLE_FP16=1 drop the sm_100f gencode and the fp16 dense decode;
#   - the SM100 translation units (still listed unconditionally upstream, with device code #if'd out but heavy
#     CUTLASS host templates) are replaced by bench/peers/flashmla_sm100_stubs.cpp, unless FLASHMLA_FULL=1;
#   - with CUDA 13 the host compiler needs include/cccl for the <cuda/std/...> headers CUTLASS pulls in.
# Prints FLASHMLA_BUILD_SECONDS=<n> and FLASHMLA_DIR=<dir> on success; exits non-zero on failure (the last
# lines of the build log are printed). Python package needs: setuptools, ninja (both in the GPU image); wheels in
# .whl/ are installed to /tmp/site first if present.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SRC="$ROOT/.peers/FlashMLA"
BUILD="${FLASHMLA_BUILD_DIR:-/tmp/flashmla-build}"
LOG="${FLASHMLA_BUILD_LOG:-$BUILD.log}"

if [[ ! -f "$SRC/setup.py" || ! -f "$SRC/csrc/cutlass/include/cutlass/cutlass.h" ]]; then
  echo "build_flashmla: $SRC is missing (export FlashMLA and its CUTLASS include trees into .peers/; see PEER_VERSION)" >&2
  exit 2
fi

if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

start=$(date +%s.%N)

# Preconditions torch's extension builder needs; say which one is missing instead of a long compiler log.
python3 - <<'EOF'
import os, shutil, sysconfig, sys
import torch
from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available
inc = sysconfig.get_paths()["include"]
print(f"build_flashmla: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA_HOME={CUDA_HOME}, "
      f"ninja={is_ninja_available()}, Python.h={'yes' if os.path.exists(os.path.join(inc, 'Python.h')) else 'MISSING in ' + inc}, "
      f"gpu={torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}", flush=True)
if not is_ninja_available():
    print("build_flashmla: ninja is missing: the build would fall back to one file at a time", file=sys.stderr)
EOF

rm -rf "$BUILD"
mkdir -p "$(dirname "$BUILD")"
cp -r "$SRC" "$BUILD"
cp "$ROOT/bench/peers/flashmla_sm100_stubs.cpp" "$BUILD/csrc/sparrow_sm100_stubs.cpp"

FLASHMLA_FULL="${FLASHMLA_FULL:-0}" python3 - "$BUILD/setup.py" <<'EOF'
import os, re, sys
path = sys.argv[1]
text = open(path).read()
# No git and no network on the GPU machine; CUTLASS is exported already.
text = text.replace('subprocess.run(["git", "submodule", "update", "--init", "csrc/cutlass"])', "pass")
if os.environ.get("FLASHMLA_FULL", "0") != "1":
    lines = text.split("\n")
    kept, dropped = [], 0
    for line in lines:
        if re.match(r'\s*"csrc/sm100/.*\.cu",\s*$', line):
            dropped += 1
            continue
        kept.append(line)
    assert dropped > 0, "no SM100 sources found in setup.py: upstream layout changed"
    text = "\n".join(kept)
    text = text.replace('"csrc/api/api.cpp",', '"csrc/api/api.cpp",\n            "csrc/sparrow_sm100_stubs.cpp",', 1)
    print(f"build_flashmla: replaced {dropped} SM100 units with csrc/sparrow_sm100_stubs.cpp", flush=True)
# CUDA 13 moved libcu++ under include/cccl; CUTLASS asks the host compiler for <cuda/std/...>.
text = text.replace(
    'cxx_args = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"]',
    'cxx_args = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"]\n'
    'if CUDA_HOME and os.path.isdir(os.path.join(CUDA_HOME, "include", "cccl")):\n'
    '    cxx_args += ["-isystem", os.path.join(CUDA_HOME, "include", "cccl")]', 1)
open(path, "w").write(text)
EOF

export FLASH_MLA_DISABLE_SM100=1 FLASH_MLA_DISABLE_FP16=1
export MAX_JOBS="${MAX_JOBS:-16}" NVCC_THREADS="${NVCC_THREADS:-1}"
export TORCH_CUDA_ARCH_LIST="9.0a"

echo "build_flashmla: building in $BUILD (MAX_JOBS=$MAX_JOBS, sm_90a only), log $LOG" >&2
if ! (cd "$BUILD" && python3 setup.py build_ext --inplace > "$LOG" 2>&1); then
  # ptxas -v prints a line per kernel; show the errors first, then the tail.
  grep -n -E "error|Error|FAILED" "$LOG" | grep -v -E "warn-on|Werror" | head -40 >&2 || true
  tail -n 40 "$LOG" >&2
  echo "build_flashmla: FAILED after $(python3 -c "print(round($(date +%s.%N) - $start))") s" >&2
  exit 1
fi

(cd /tmp && PYTHONPATH="$BUILD${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import flash_mla, flash_mla.cuda; print('build_flashmla: import ok', flash_mla.cuda.__file__)")
grep -E "bytes spill stores" "$LOG" | grep -v " 0 bytes spill stores" | sort | uniq -c | head -5 >&2 || true  # FlashMLA spills?
echo "FLASHMLA_BUILD_SECONDS=$(python3 -c "print(round($(date +%s.%N) - $start, 1))")"
echo "FLASHMLA_DIR=$BUILD"
