// The decode roofline of `sparrow bench sweep`: the fastest a decode step of a model could possibly run on
// one GPU, from config.json alone, so each measured point of the Pareto sweep has its physical limit
// beside it (docs/bench.md, "Sweep and roofline").
//
// One decode step of B sequences whose mean context is C tokens must at least
//   read    bytes(B, C) = W_dense + n_moe · D(B) · W_expert + B · Σ_layers [ min(C, A_l) · kv_l + C · ix_l + s_l ]
//   compute flops(B, C) = B · ( 2 · (P_dense + n_moe · k · P_expert) + Σ_layers [ min(C, A_l) · f_l + C · g_l + h_l ] )
// and takes time(B, C) = max(bytes / HBM bandwidth, flops / peak FLOP/s), whichever binds; every sequence
// gets one token per step, so tokens/s/user = 1 / time and tokens/s/GPU = B / time. Here
//   W_dense, P_dense   bytes / elements of the weights every step reads whatever the batch: attention, KDA
//                      and indexer projections, dense MLPs, shared experts, routers, norms, lm_head (the
//                      embedding table is not: a step gathers B of its rows)
//   W_expert, P_expert one routed expert of one MoE layer (gate, up, down); n_moe MoE layers
//   D(B) = E · (1 − (1 − k/E)^B)  the expected number of distinct experts B tokens touch when each picks
//                      k of E uniformly at random (a random router's routing; a trained router's load
//                      balance loss aims at the same spread)
//   kv_l, ix_l         bytes of one cached token's attention row (MLA latent, GQA K/V) and index key
//                      (DSA, MSA) in layer l, as the paged cache stores them on a GPU (cache/planner.h)
//   A_l                keys attention reads per query: DSA's index_topk, MSA's top blocks × block size,
//                      all C for dense attention (so sparse layers read only the selected tokens, and
//                      every index key)
//   s_l, h_l           KDA: the recurrent state read and written, and its update FLOPs, per sequence
//   f_l, g_l           attention FLOPs per attended key (QK and PV: MLA absorbed 2·heads·(576 + 512),
//                      GQA 2·heads·head_dim·2) and indexer FLOPs per scored key (2·index_heads·index_dim)
// Weights are counted as sparrow stores them on a GPU: matrices bfloat16, vectors float32, and with an FP8
// quantization_config the projections take_linear reads and the routed experts in FP8 (1 byte plus one
// fp32 scale per 128x128 block). It is a decode-only bound: prefill is counted free, so it also bounds
// total (input + output) tokens/s by B / time · (input + output) / output.
//
// Over several GPUs (ParallelLayout: tensor parallel T inside each of D data-parallel groups, docs/parallel.md)
// every term above becomes one GPU's share, and the step adds its collectives, which a decode step does not
// overlap with its reads (each needs the previous layer's output):
//   - weights: what every rank keeps whole (norms, routers, MLA's q_a / kv_a projections, the DSA indexer,
//     MSA's index key, KDA's low-rank gate inputs, the latent MoE's down / up: W_rep) plus 1 / T of the rest;
//     the routed experts 1 / (T·D) each, touched by all B sequences of all groups: D(B) · W_expert / (T·D);
//   - per sequence, a group holds B / D of them: MLA latents and DSA / MSA index keys are read whole by each
//     of its T ranks (replicated, as vLLM keeps them), GQA K/V by min(T, kv_heads), KDA states by T;
//   - FLOPs likewise: the split projections and attention heads / T, the indexer whole (DSA) or by its heads
//     (MSA), the experts' B · k products / (T·D);
//   - collectives (a ring's bus traffic over the GPU's link, plus a fixed latency per call): with T > 1, two
//     all-reduces of [B/D, hidden] bf16 a layer (and one more for a latent MoE's latent), the embedding's
//     all-reduce and the head's all-gather of [B/D, vocab] fp32; with D > 1, each MoE layer's all-gather and
//     reduce-scatter of every group's rows (D · B/D rows of hidden bf16 each way).
//   time = max(bytes / HBM, FLOPs / peak) + collective time; tokens/s/GPU = B / time / (T·D).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "bench/workloads.h"
#include "formats/config.h"

namespace sparrow::bench {

// One H200 (docs/gpu.md): HBM bandwidth as measured (spec 4.8 TB/s), dense bf16 tensor-core FLOP/s as
// cuBLASLt reaches them (spec ~989 TFLOP/s).
struct HardwareLimits {
  double hbm_bytes_per_s = 4.3e12;
  double flops_per_s = 790e12;
  // Between GPUs: NVLink 4 of an H200 HGX, 450 GB/s each way (spec 900 GB/s both ways), and what one small
  // collective costs whatever its size (NCCL's few-microsecond launch and protocol latency; assumed, not yet
  // measured here: bench collectives measures it where several GPUs are lent).
  double link_bytes_per_s = 450e9;
  double collective_latency_s = 10e-6;
};

// How the model is spread over GPUs (docs/parallel.md): T-way tensor parallel inside each of D
// data-parallel groups, the routed experts over all T·D GPUs (whole or split, the same bytes and FLOPs).
struct ParallelLayout {
  int64_t tensor_parallel = 1, data_parallel = 1;
  int64_t gpus() const { return tensor_parallel * data_parallel; }
};

// One layer's token mixer in cost terms (the symbols of the formula above).
struct MixerCost {
  std::string kind;                  // mla, mla_dsa, gqa, gqa_msa, kda
  int64_t heads = 0;                 // query heads (attention) or KDA heads: what tensor parallelism splits
  int64_t kv_heads = 0;              // GQA: K/V heads (split by min(T, kv_heads)); 0: the cache rows are replicated
  int64_t index_heads = 0;           // MSA: index heads, split with their groups; 0: the indexer is replicated
  double kv_bytes_per_token = 0;     // kv_l
  double index_bytes_per_token = 0;  // ix_l
  int64_t attended_limit = 0;        // A_l; 0: every cached key
  double flops_per_key = 0;          // f_l
  double index_flops_per_key = 0;    // g_l
  double state_bytes = 0;            // s_l
  double state_flops = 0;            // h_l
};

struct ModelCost {
  std::string model_type;
  double total_params = 0;      // every tensor the model loads (routers' correction biases aside)
  double embedding_params = 0;  // the input embedding table (also the head when tied)
  double dense_params = 0;      // P_dense
  double dense_bytes = 0;       // W_dense
  int64_t moe_layers = 0, num_experts = 0, experts_per_token = 0;
  double expert_params = 0;     // P_expert
  double expert_bytes = 0;      // W_expert
  double weight_bytes = 0;      // all weights as stored on the GPU (what must fit in its memory)
  // Of the dense weights, what every tensor-parallel rank keeps whole (W_rep above).
  double replicated_params = 0, replicated_bytes = 0;
  int64_t hidden = 0, vocab = 0;
  int64_t latent_moe_layers = 0, moe_latent = 0;  // Kimi K3's latent MoE: its layers' latent width
  std::vector<MixerCost> mixers;  // one per layer
};

// The cost of a model from its config.json (every family load_model takes). `kv_cache_dtype` is
// serve's --kv-cache-dtype on a GPU ("auto": bfloat16, DSA index keys FP8).
ModelCost model_cost(const Config& config, const std::string& kv_cache_dtype = "auto");
// `path`: a model folder or its config.json.
ModelCost model_cost_from_path(const std::string& path, const std::string& kv_cache_dtype = "auto");

// D(B): expected distinct experts when `tokens` tokens each pick `per_token` of `num_experts`.
double expected_distinct_experts(int64_t num_experts, int64_t per_token, double tokens);

// One decode step at batch B and mean context C.
struct DecodeStep {
  int64_t batch = 0;
  double context = 0;
  double weight_bytes = 0, kv_bytes = 0, bytes = 0, flops = 0;
  double distinct_experts = 0;  // per MoE layer
  ParallelLayout layout;        // bytes, flops and the seconds are one GPU's
  double collective_bytes = 0;  // bus traffic of the step's collectives, one GPU's
  int64_t collectives = 0;      // calls
  double memory_seconds = 0, compute_seconds = 0, collective_seconds = 0, seconds = 0;
  bool compute_bound = false;
  double tokens_per_s_per_user = 0, tokens_per_s_per_gpu = 0;
};
DecodeStep decode_roofline(const ModelCost& model, int64_t batch, double context, const HardwareLimits& hw,
                           const ParallelLayout& layout = {});

// The serving limit of the closed-loop workload at concurrency B: B requests, each with a prompt of
// I tokens and O output tokens, and each finished one replaced by a new one. Over one cycle (every user
// gets its O tokens, and B prompts are prefilled to keep B running) the GPU must at least
//   read    O · bytes(B, C)                               (the O decode steps; a prompt's weights reads
//                                                          are counted free: a step can carry them)
//   compute O · flops(B, C) + B · prefill_flops(I)        prefill_flops(I) = I · 2 · P_active +
//           Σ_layers [ Σ_{p=1..I} (min(p, A_l) · f_l + p · g_l) + I · h_l ]   (causal attention)
// and takes T = max(reads / HBM bandwidth, FLOPs / peak), as if prefill and decode overlapped perfectly
// in mixed steps; then tokens/s/user = O / T and tokens/s/GPU = B · (I + O) / T (output: B · O / T). The
// decode roofline above counts prefill free; at high concurrency the prompts' FLOPs are what binds.
struct ServingCycle {
  int64_t batch = 0;
  double input_len = 0, output_len = 0, context = 0;
  double decode_bytes = 0, decode_flops = 0, prefill_flops = 0;  // the whole cycle's (one GPU's)
  double memory_seconds = 0, compute_seconds = 0, collective_seconds = 0, seconds = 0;
  bool compute_bound = false;
  double tokens_per_s_per_user = 0, total_tokens_per_s_per_gpu = 0, output_tokens_per_s_per_gpu = 0;
};
// Over several GPUs: the decode steps' shares and collectives as above, the prompts' FLOPs spread evenly
// (their collectives counted free: a prefill's are large messages at the link's full rate, small next to its
// FLOPs).
ServingCycle serving_roofline(const ModelCost& model, int64_t batch, double input_len, double output_len,
                              const HardwareLimits& hw, const ParallelLayout& layout = {});
// FLOPs of one prompt of `tokens` tokens (the prefill_flops of ServingCycle).
double prefill_flops(const ModelCost& model, double tokens);

Json to_json(const DecodeStep& step);
Json to_json(const ServingCycle& cycle);
Json to_json(const ModelCost& model);  // the totals, not the per-layer list

}  // namespace sparrow::bench
