#!/usr/bin/env bash
# On the GPU machine: joins the parts pack.sh wrote (from one or more folders, in name order) into a
# site-packages tree and checks that vLLM's server imports. Then, in the same shell:
#   export PYTHONPATH=$SITE VLLM="python3 -m vllm.entrypoints.cli.main"
#   PEERS=vllm VLLM_ARGS=... bench/sweep.sh SHAPE
#
#   bench/peers/vllm/setup.sh PARTS_DIR [SITE]     SITE default /tmp/vllm-site
set -euo pipefail
PARTS="${1:?usage: setup.sh PARTS_DIR [SITE]}"
SITE="${2:-/tmp/vllm-site}"
mkdir -p "$SITE"
if [[ -f "$PARTS/SHA256SUMS" ]]; then (cd "$PARTS" && sha256sum -c --quiet SHA256SUMS); fi
cat "$PARTS"/vllm-site.tar.xz.* | xz -d -T0 | tar x -C "$SITE"

# One fix, for Hopper only. vLLM 0.26.0's MiniMax-M3 model allocates the indexer's shared top-k buffer
# token-major, [tokens, index heads, top-k] (the layout its Blackwell MSA kernels take), but on every other
# GPU its Triton indexer and sparse attention (models/minimax_m3/common/) slice and write it head-major,
# buf[:, :num_decode_tokens] and buf[:, nd:num_tokens]: with more decode tokens than index heads (4) the
# slices leave the buffer and the engine dies with "an illegal memory access" (c >= 16 in our sweep; at
# c <= 4 it reads wrong block ids). vLLM PR #48604 describes the same fault on A100. Allocating the buffer
# head-major makes the Triton path's views consistent; the H200 never takes the Blackwell path.
python3 - "$SITE/vllm/models/minimax_m3/nvidia/model.py" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
old = "self.topk_indices_buffer = torch.empty(\n                padded_num_tokens,\n                num_index_heads,"
new = "self.topk_indices_buffer = torch.empty(\n                num_index_heads,\n                padded_num_tokens,"
if new not in src:
    if old not in src:
        sys.exit(f"{path}: the top-k buffer allocation is not where setup.sh expects it (another vLLM version?)")
    open(path, "w").write(src.replace(old, new))
    print("patched the MiniMax-M3 top-k buffer to head-major (Hopper's Triton path)")
PY
PYTHONPATH="$SITE" python3 -c 'import vllm, vllm.entrypoints.openai.api_server; print("vllm", vllm.__version__, "imports")'
