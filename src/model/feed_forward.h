// Feed-forward blocks shared by the families: the gated MLP and the mixture of experts.
//
// Routers (transformers 5.17):
//   DeepSeek-V3/V3.2 and Kimi (DeepseekV32TopkRouter, KimiLinearTopkRouter): sigmoid scores, plus
//     e_score_correction_bias for choosing only; experts grouped into n_group groups, each group scored by
//     the sum of its two best biased scores, the best topk_group groups kept; top_k experts among them;
//     weights = unbiased scores, optionally normalised (sum + 1e-20), times routed_scaling_factor.
//   MiniMax-M3 (MiniMaxM3VLTopKRouter): the same with one group, normalised without epsilon; the block
//     multiplies the routed sum by routed_scaling_factor afterwards (equal up to rounding, done here
//     on the weights).
// Activations (kernels/glu.h): SiLU-gated (silu(gate) * up), MiniMax's clamped SwiGLU, Kimi K3's SiTU.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"
#include "model/decoder.h"

namespace sparrow {

// The experts' and MLPs' gated activation and its two parameters (kernels/glu.h says what each kind uses).
struct Activation {
  Glu kind = Glu::SiluGlu;
  float alpha = 1.0f;
  float limit = 0.0f;
};

// gate/up/down MLP. gate_up is [2I, H] (gate rows first), down is [H, I]. Tensor parallel (vLLM's
// MergedColumnParallelLinear + RowParallelLinear): each rank keeps I / size of the intermediate width, the
// gate's and the up's rows of it and down's columns, and the output is summed over the group.
struct DenseMlp : FeedForward {
  Tensor gate_up;
  Tensor down;
  Activation act;
  TensorParallel tp;
  std::string prefix;  // the weights' names start with it ("model.layers.N.mlp."): LoRA modules (model/lora.h)

  // Loads either <prefix>.gate_proj/.up_proj/.down_proj or a fused <prefix>.gate_up_proj (this rank's part
  // of them when the checkpoint is sharded).
  static DenseMlp load(Checkpoint& ckpt, const std::string& prefix, int64_t hidden, int64_t intermediate,
                       Activation act);
  Tensor forward(const Tensor& x, const Batch& batch) const override;  // [T, H] -> [T, H]
  // This rank's term of the output, before the sum over the group (the whole output unsharded); x holds
  // the batch's rows (the adapters' terms, model/lora.h).
  Tensor partial(const Tensor& x, const Batch& batch) const;
  std::string name() const override { return "mlp"; }
};

struct SigmoidRouter {
  Tensor weight;  // [E, H]
  Tensor bias;    // [E] e_score_correction_bias (zeros if the checkpoint has none)
  int64_t top_k = 1, n_group = 1, topk_group = 1;
  bool normalize = true;
  float normalize_eps = 1e-20f;  // DeepSeek adds 1e-20 to the denominator, MiniMax does not
  float routed_scaling_factor = 1.0f;

  // `--moe-routing-simulation uniform_random`, for benchmarks (kernels/uniform_routing.h): after the router
  // has run (its cost stays in the step), each token's experts become top_k distinct uniform draws keyed by
  // its hidden state and `simulation_salt` (the layer), each weighted routed_scaling_factor / top_k. The
  // model's outputs are then no longer its own.
  bool simulate_uniform = false;
  uint32_t simulation_salt = 0;
  float simulated_weight() const { return routed_scaling_factor / float(top_k); }  // each simulated expert's

  // Each token's experts and weights, on x's device ([T, H]; kernels/ops.h route_grouped_sigmoid and, when
  // simulating, simulate_uniform_routing).
  ops::Routing route(const Tensor& x) const;

  // The checkpoint's e_score_correction_bias `name` ([num_experts]), or zeros where it has none (always so
  // for --load-format dummy, whose has() is false) on the checkpoint's device, where the router reads it.
  static Tensor load_bias(Checkpoint& ckpt, const std::string& name, int64_t num_experts);
};

// The shape of a DeepSeek-V3-style MoE layer (DeepSeek-V3.2, Kimi): grouped sigmoid routing, gated experts
// and n_shared shared experts of the same width (none when 0); with `latent` > 0 Kimi K3's latent MoE.
struct GroupedMoeShape {
  int64_t hidden = 0, num_experts = 0, intermediate = 0, top_k = 0, n_group = 1, topk_group = 1, n_shared = 1;
  bool normalize = true;
  float routed_scaling_factor = 1.0f;
  Activation act;
  int64_t latent = 0;          // routed_expert_hidden_size; 0: the experts read x itself
  bool latent_norm = false;    // latent_moe_use_norm
  float latent_norm_eps = 1e-6f;
};

// Routed experts (weighted by the router) plus the shared experts. Tensor parallel inside each expert (vLLM's
// default without --enable-expert-parallel): every rank routes the same way (the router is replicated) and
// runs every expert on its part of the intermediate width; the partial sums meet in one all-reduce (a latent
// MoE reduces its routed latent before the norm, then the shared experts' terms). Expert parallel
// (TensorParallel::expert_parallel): a rank holds experts [first_expert, first_expert + E / size) whole and
// runs, for every token (the group's ranks all hold the whole step), only the slots routed to them; the
// same all-reduce then sums each token's slots from the ranks that own them (vLLM's EP without data
// parallelism: its all-gather / reduce-scatter dispatch over replicated tokens). Data parallel
// (TensorParallel::data_parallel): the experts are split over every rank of every group, and each group
// holds its own tokens; the groups' tokens are gathered (ops::all_gather_rows, over the ranks of the same
// tensor-parallel rank), routed and run through this rank's experts, and each group's rows are summed back
// to it (ops::reduce_scatter_rows) before the group's all-reduce (vLLM's naive all-gather / reduce-scatter
// dispatch, vllm/distributed/device_communicators/all2all.py). Kimi K3's latent MoE (vLLM 0.33
// models/kimi_k3/nvidia/model.py KimiMoE.forward, latent_moe_runner.py): the router reads x, the routed
// experts read z = latent_down x (width Z); their weighted sum is RMS-normalised (latent_norm) and
// projected back (latent_up) before the shared experts, which read x, are added.
struct MoeBlock : FeedForward {
  // Loads a DeepSeek-V3-style MoE under `prefix` (e.g. "model.layers.3.mlp."): gate.weight,
  // gate.e_score_correction_bias (zeros when absent), experts (either layout), shared_experts, and for
  // a latent MoE routed_expert_down_proj, routed_expert_norm, routed_expert_up_proj.
  static std::unique_ptr<MoeBlock> load_grouped(Checkpoint& ckpt, const std::string& prefix,
                                                const GroupedMoeShape& shape);
  // The routed experts under `prefix` (Checkpoint::take_experts) and the group to reduce over: this rank's
  // part of each expert, or under expert parallelism its share of whole experts.
  void load_experts(Checkpoint& ckpt, const std::string& prefix, int64_t num_experts, int64_t intermediate,
                    int64_t width);

  SigmoidRouter router;
  Checkpoint::Experts experts;    // gate_up [E, 2I, H or Z], down [E, H or Z, I] (E: this rank's under EP)
  int64_t first_expert = 0;       // the router's id of experts[0] (expert parallel)
  int64_t num_experts = 0;        // the router's
  std::string experts_prefix;     // the experts' names start with it ("model.layers.3.mlp.experts."): LoRA
  std::vector<DenseMlp> shared;   // zero or one shared-expert MLP
  Activation act;
  Tensor latent_down;             // [Z, hidden]  latent MoE only
  Tensor latent_norm;             // [Z]          latent MoE with latent_moe_use_norm
  Tensor latent_up;               // [hidden, Z]  latent MoE only
  float latent_norm_eps = 1e-6f;
  TensorParallel tp;

  Tensor forward(const Tensor& x, const Batch& batch) const override;  // routed (weighted) + shared experts
  std::string name() const override { return "moe"; }
  bool spans_groups() const override { return tp.data_parallel(); }
  // This rank's routed experts' weighted sum over x's tokens ([T, H], or the latent [T, Z]), before any
  // reduction over ranks; with `batch` (x's rows are its tokens), its adapters' routed-expert terms.
  Tensor routed(const Tensor& x, const Batch* batch = nullptr) const;
  // Data parallel with expert parallelism: routed()'s terms for this group's rows x, each row sent (by an
  // all-to-all, ops::send_rows) only to the groups whose rank owns one of its experts, their terms returned
  // and added (ops::return_rows) in group order: the sum the all-gather path adds, for the rows routed there.
  Tensor dispatch_routed(const Tensor& x) const;
  int64_t experts_out_width() const { return experts.down.dim(1); }  // H, or Z for a latent MoE
};

}  // namespace sparrow
