// Mixture-of-experts on the GPU: routing, and the routed experts of a whole step in one pass.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemm/gemm.h"

namespace sparrow::cuda {

// DeepSeek-V3's grouped sigmoid routing (transformers DeepseekV3TopkRouter / MoE.route_tokens_to_experts),
// per token: s = sigmoid(logits) (fp32 [tokens, experts]); choice = s + bias; groups scored by the sum of
// their two best choices, the topk_group best groups kept; the top_k best choices among them (ties to the
// smaller index); weights s[chosen] (normalised by their sum + 1e-20 when `normalize`) * scaling.
// experts: int32 [tokens, top_k]; weights fp32 [tokens, top_k].
void route_grouped_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t num_experts,
                           int64_t n_group, int64_t topk_group, int64_t top_k, bool normalize, float scaling,
                           int32_t* experts, float* weights, cudaStream_t stream);
// The same with the normalisation's epsilon explicit (SigmoidRouter::normalize_eps: DeepSeek 1e-20,
// MiniMax 0); the form above uses 1e-20.
void route_grouped_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t num_experts,
                           int64_t n_group, int64_t topk_group, int64_t top_k, bool normalize, float normalize_eps,
                           float scaling, int32_t* experts, float* weights, cudaStream_t stream);

// Benchmarks' simulated routing (kernels/uniform_routing.h): overwrites each token's experts with top_k
// distinct uniform draws keyed by its bf16 hidden state x[t] (bf16 [tokens, hidden]) and `salt`, and its
// weights with `weight`. The same experts as the CPU's draw for the same bf16 values.
void simulate_uniform_routing(const void* x, int64_t tokens, int64_t hidden, int64_t num_experts,
                              int64_t top_k, uint32_t salt, float weight, int32_t* experts, float* weights,
                              cudaStream_t stream);

// Expert parallel (ops::keep_local_experts_): ids in [first, first + count) become id - first, the
// others -1, which the expert kernels skip. experts: int32 [slots], in place.
void keep_local_experts(int32_t* experts, int64_t slots, int first, int count, cudaStream_t stream);

// Routed experts over all tokens of a step:
//   out[t] = sum_j weights[t, j] * down[e] · act(gate_up[e] · x[t]),  e = experts[t, j]
// x bf16 [tokens, hidden]; gate_up bf16 [E, 2*inter, hidden]; down bf16 [E, hidden, inter]; out bf16
// [tokens, hidden] (overwritten). Tokens are grouped by expert on the device (no host round trip) and
// each expert's tokens go through one product; `workspace` is from moe_workspace_bytes.
//
// Every path rounds the intermediate h = act(·) and each slot's weighted output to bf16 and sums a
// token's slots in slot order in fp32 (one final bf16 rounding), and every path is deterministic: the
// same inputs give the same bits run to run, whatever the routing. Which path runs is decided on the
// host from the sizes alone (moe_experts_path), the same for the bf16, FP8 and packed forms:
//   Decode when tokens * top_k <= 8 * num_experts (at most 8 rows per expert on average: decode steps)
//     and hidden, inter <= ~57K: each output element is one fp32 accumulation over k (bf16 tensor-core
//     products of the bf16 weights and activations). A different summation order from the other paths:
//     results agree with them within rounding, not bit for bit.
//   Wgmma (on average >= 32 rows per expert, hidden % 256 == 0, inter % 128 == 0) and Tiled (otherwise):
//     bf16 weight tiles on the tensor cores, fp32 accumulation; the two may differ in the last bit.
enum class MoePath { Decode, Tiled, Wgmma };

// LoRA on the routed experts (kernels/expert_adapters.h) as the expert kernels take it: the low-rank terms
// join the gate's and the up's fp32 sums before the activation and the down's sum before the pair weight, the
// two points where vLLM's fused_moe_lora adds them. For each adapted (token, slot) pair, u = A · x (gate, up)
// and u = A · h (down: h the bf16 activation row the down product reads) in fp32 over bf16 operands, in an
// order fixed by the row's own sizes; each output element then adds B[col] · u in fp32 in its epilogue.
// Every path's epilogue adds them (decode, WMMA tiles, wgmma). Deterministic, and a pair's terms do not depend
// on the other rows of the step.
struct ExpertLoraEntry {
  const void* a = nullptr;  // bf16 [rank, in]; null: this (adapter, expert, projection) is not adapted
  const void* b = nullptr;  // bf16 [out, rank], times the adapter's scaling
  int32_t rank = 0;
};
struct ExpertLora {
  const int32_t* token_adapter = nullptr;   // [tokens]: the adapter whose entries a token uses, -1 none
  const ExpertLoraEntry* entries = nullptr;  // [3][adapters][num_experts]: gate, then up, then down
  int adapters = 0;
  int max_rank = 0;                          // every entry's rank is at most this
  void* workspace = nullptr;                 // expert_lora_workspace_bytes(tokens * top_k, max_rank), 16-byte aligned
};
size_t expert_lora_workspace_bytes(int64_t pairs, int64_t max_rank);
MoePath moe_experts_path(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter);
size_t moe_workspace_bytes(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t hidden, int64_t inter);
void moe_experts(const void* x, int64_t tokens, int64_t hidden, const int32_t* experts, const float* weights,
                 int64_t top_k, const void* gate_up, const void* down, int64_t num_experts, int64_t inter,
                 Glu glu_kind, float alpha, float limit, void* out, void* workspace, cudaStream_t stream,
                 const ExpertLora* lora = nullptr);

// The same with FP8 E4M3 expert weights and DeepSeek's 128x128 block scales (fp32, a checkpoint's
// weight_scale_inv), so FP8 checkpoints' experts stay FP8 on the GPU (half the bytes the decode reads).
//   gate_up: e4m3 [E, 2*inter, hidden], rows [0, inter) the gate, rows [inter, 2*inter) the up projection;
//   gate_up_scales: fp32 [E, 2, ceil(inter/128), ceil(hidden/128)], the gate's blocks then the up's:
//     W[e][i][j] = e4m3(gate_up[e][i][j]) * gate_up_scales[e][i / inter][(i % inter) / 128][j / 128],
//     i.e. each half keeps its own checkpoint tensor's [ceil(inter/128), ceil(hidden/128)] scales, exact
//     even when inter % 128 != 0 (the up rows' blocks then do not line up with 128-row blocks of the
//     stacked matrix). When inter % 128 == 0 this is the same array as [E, 2*inter/128, ceil(hidden/128)].
//   down: e4m3 [E, hidden, inter]; down_scales: fp32 [E, ceil(hidden/128), ceil(inter/128)]:
//     W[e][i][j] = e4m3(down[e][i][j]) * down_scales[e][i / 128][j / 128].
// Rounding, by path (moe_experts_path; activations stay bf16 on every path, no activation quantisation):
//   Tiled, Wgmma: weight tiles are dequantised as they are staged into shared memory, bf16(e4m3 * scale)
//     (the exact e4m3 value times the fp32 scale, one fp32 rounding, then round to nearest even to bf16;
//     the same values as dequantize_fp8_blocks in kernels/cuda/gemm/gemm_fp8.h), and the products then run
//     exactly as in moe_experts (bf16 tensor cores, fp32 accumulation, the same order). So the result is
//     bit-identical to moe_experts on the weights dequantised that way.
//   Decode: the scale is applied per 128-column block, not per weight: for each output element and each
//     block b of 128 columns, the raw e4m3 values (exact in bf16) times the bf16 activations are summed in
//     fp32 (tensor cores), and that block partial is multiplied by the block's scale and added to the
//     fp32 accumulator: sum_b scale_b * (sum_{k in b} e4m3_k * a_k). No bf16 rounding of weights, so this
//     is not bit-identical to moe_experts on bf16(e4m3 * scale) weights; the two agree within rounding
//     (the bf16 weight rounding, 2^-8 relative per weight, plus each path's bf16 roundings of h, of the
//     slot outputs and of out). Deterministic run to run.
// hidden and inter must be multiples of 16 (the e4m3 rows are read in 16-byte pieces); the workspace is
// moe_workspace_bytes's; operands 16-byte aligned, scales 4-byte aligned.
void moe_experts_fp8(const void* x, int64_t tokens, int64_t hidden, const int32_t* experts, const float* weights,
                     int64_t top_k, const uint8_t* gate_up, const float* gate_up_scales, const uint8_t* down,
                     const float* down_scales, int64_t num_experts, int64_t inter, Glu glu_kind, float alpha,
                     float limit, void* out, void* workspace, cudaStream_t stream, const ExpertLora* lora = nullptr);

// The same with expert weights as the MX / NV formats are released, read in place (FP4: half the bytes of
// FP8), each row with one scale per group of consecutive values:
//   Nvfp4 (ModelOpt): gate_up [E, 2*inter, hidden / 2] bytes, two E2M1 codes each (element 2i in the low
//     nibble); gate_up_scales E4M3 [E, 2*inter, hidden / 16]; gate_up_global fp32 [E, 2], the gate's and
//     the up's weight_scale_2; down [E, hidden, inter / 2], down_scales [E, hidden, inter / 16],
//     down_global [E]:  W[e][i][j] = e2m1 * e4m3(scale[e][i][j / 16]) * global[e](half of i)
//   Mxfp4 (compressed-tensors / OCP MX): the same codes, scales E8M0 per 32 values ([.., hidden / 32],
//     [.., inter / 32]), no global scales (null):  W = e2m1 * 2^(e8m0 - 127).
//   Mxfp8 (ModelOpt / OCP MX, MiniMax-M3's experts): e4m3 codes, one a byte (gate_up [E, 2*inter, hidden],
//     down [E, hidden, inter]), scales E8M0 per 32 as Mxfp4's, no global scales:  W = e4m3 * 2^(e8m0 - 127).
// Every format takes the path moe_experts_path names, as moe_experts does (group scales not 8-byte (NVFP4)
// or 4-byte (MX) aligned keep the Tiled path instead of Wgmma). Decode: the decode kernel (gemm/skinny.cuh) turns
// each code into bf16 times its group scale in registers (exact: code * scale fits bf16). Tiled (WMMA) and
// Wgmma: the raw codes and scales are staged by cp.async and each staged tile is converted into a bf16 tile
// with the same exact values. NVFP4's global scale multiplies each fp32 sum before the activation / the pair
// weight. Rounding: Decode is within rounding of moe_experts on the dequantised weights (the decode path's
// bound). Tiled and Wgmma read exactly the weights code * group scale (FP4's tiles carry a factor 2^-16 that
// the epilogue multiplies back, exactly), so with NVFP4's global scales 1 (MXFP4, MXFP8: always) the result
// is bit-identical to moe_experts on those weights as bf16, on the same path; other NVFP4 global scales
// scale the sums instead of the weights, within rounding of moe_experts on bf16(code * scale * global).
// hidden and inter must be multiples of 32.
// `kind` is one of WeightCodes' Nvfp4, Mxfp4, Mxfp8 (gemm.h).
void moe_experts_packed(const void* x, int64_t tokens, int64_t hidden, const int32_t* experts, const float* weights,
                        int64_t top_k, WeightCodes kind, const uint8_t* gate_up, const uint8_t* gate_up_scales,
                        const float* gate_up_global, const uint8_t* down, const uint8_t* down_scales,
                        const float* down_global, int64_t num_experts, int64_t inter, Glu glu_kind, float alpha,
                        float limit, void* out, void* workspace, cudaStream_t stream, const ExpertLora* lora = nullptr);

}  // namespace sparrow::cuda
