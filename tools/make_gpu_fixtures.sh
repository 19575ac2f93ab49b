#!/usr/bin/env bash
# The GPU fixtures: tiny transformers checkpoints with the real attention geometry the Hopper kernels are
# built for (MLA latent 512 + rope 64, DSA index keys 32 heads x 128), bf16 weights so that the reference
# runs on exactly the weights the GPU holds, every expert routed (8 of 8: routing cannot flip under bf16),
# prompts of 40, 100 and 140 tokens (the longer two beyond the top-64 index budget). Run on the GPU
# machine (torch + transformers 5.17); writes OUT_DIR/<name>/ for each name given (default: all).
#   tools/make_gpu_fixtures.sh OUT_DIR [deepseek_v32_gpu] [kimi_linear_gpu] [kimi_k3_1_pro_gpu]
# (kimi_k3_1_pro_gpu comes from tools/kimi_k3_reference.py --variant k3_1_pro_gpu, which needs only torch.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: tools/make_gpu_fixtures.sh OUT_DIR [names...]}
shift
names=("$@")
[[ ${#names[@]} -eq 0 ]] && names=(deepseek_v32_gpu kimi_linear_gpu kimi_k3_1_pro_gpu)

common=(--prompt-lengths 40,100,140 --min-gap 1e-5 --max-tries 60)
# MLA with the kernels' geometry; 16 heads of 32 + 64.
mla=(--override hidden_size=128 --override num_attention_heads=16 --override num_key_value_heads=16
     --override kv_lora_rank=512 --override qk_nope_head_dim=32 --override qk_rope_head_dim=64
     --override v_head_dim=32)
index=(--override index_n_heads=32 --override index_head_dim=128 --override index_topk=64)
kimi_moe=(--override num_local_experts=8 --override num_experts_per_tok=8 --override n_group=1
          --override topk_group=1)

for name in "${names[@]}"; do
  case "$name" in
    deepseek_v32_gpu)
      python3 tools/make_fixtures.py --out "$out" --family deepseek_v32 --name "$name" "${mla[@]}" "${index[@]}" \
        --override q_lora_rank=64 --override num_hidden_layers=2 --override max_position_embeddings=512 \
        --override n_routed_experts=8 --override num_experts_per_tok=8 --override n_group=1 --override topk_group=1 \
        "${common[@]}" ;;
    kimi_linear_gpu)  # KDA 2 heads x 128 (Kimi's head size)
      python3 tools/make_fixtures.py --out "$out" --family kimi_linear --name "$name" --storage bfloat16 \
        "${mla[@]}" "${kimi_moe[@]}" --override linear_num_heads=2 --override linear_head_dim=128 "${common[@]}" ;;
    kimi_k3_1_pro_gpu)  # the released K3 + K3.1 Pro's indexer, its float64 reference (docs/models.md)
      python3 tools/kimi_k3_reference.py --variant k3_1_pro_gpu --out "$out/$name" ;;
    *) echo "unknown GPU fixture $name" >&2; exit 2 ;;
  esac
done
