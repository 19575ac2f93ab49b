// LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") as PEFT saves them
// (adapter_config.json + adapter_model.safetensors) and vLLM serves them: a targeted projection y = W x
// becomes y = W x + (alpha / r) B A x (alpha / sqrt(r) with use_rslora), for the rows of the sequences
// that use the adapter. Different adapters share one batch: each run of consecutive sequences with the same
// adapter gets its own two small products (the segmented form of punica / S-LoRA's grouped kernels, on the
// existing ops, so the same code runs on the CPU and the GPU).
//
// Targets: every projection a layer reads straight from one checkpoint weight of the attention (MLA's
// q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa / o_proj, GQA's q/k/v/o_proj, KDA's q/k/v_proj,
// f_a/f_b_proj, b_proj, g_proj, g_a/g_b_proj, o_proj; MLA's output gate g_proj; the DSA indexer's wq_b / wk /
// weights_proj, the MSA indexer's q_proj / k_proj, before their norms and rotations) and of the dense MLPs
// and shared experts (gate/up/down_proj, or gate_up_proj where the checkpoint fuses them).
// MLA's kv_b_proj too, in the absorbed form the attention uses (add_absorbed_queries_ / _outputs_). The
// routed experts by expert, as vLLM names them ("mlp.experts.7.gate_proj" / up_proj / down_proj, or the
// releases' w1 / w3 / w2), also where the checkpoint stacks every expert in one tensor, and PEFT's form for
// stacked experts (target_parameters: "experts.base_layer" / "experts", split by expert at load): inside the MoE
// (expert_runs, kernels/expert_adapters.h), on the CPU and the GPU. Not yet (a one-line error when an
// adapter targets them): the routers.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "formats/checkpoint.h"
#include "kernels/expert_adapters.h"

namespace sparrow {

struct Batch;

struct LoraWeights {
  Tensor a;  // [r, in]
  Tensor b;  // [out, r], times the adapter's scaling
};

struct LoraAdapter {
  std::string name, path;
  std::string base_model;  // the model folder it was checked against
  int64_t max_rank = 0;    // the limit it was loaded under
  int64_t rank = 0;
  float scaling = 1.0f;
  // Where the prefix cache's hash chain starts for its sequences (KvCache::create_sequence): one per loaded
  // adapter, so no block computed with it matches the base model's or another load's.
  uint64_t prefix_root = 0;
  // By the base module's name, e.g. "model.layers.3.self_attn.q_proj" (PEFT's key without its
  // "base_model.model." prefix and ".lora_A.weight" suffix).
  std::map<std::string, LoraWeights> modules;
  // The routed experts' pairs by stack ("<moe>.experts."), each projection indexed by expert (null where not
  // adapted), pointing into `modules`: built at load (index_routed_experts), so a step finds a layer's pairs
  // with one lookup (lora::expert_runs). Hence no copies.
  struct ExpertPairs {
    std::vector<const LoraWeights*> gate, up, down;
  };
  std::map<std::string, ExpertPairs> expert_stacks;

  LoraAdapter() = default;
  LoraAdapter(const LoraAdapter&) = delete;
  LoraAdapter& operator=(const LoraAdapter&) = delete;

  const LoraWeights* find(const std::string& module) const;
  // Whether some module is a routed expert's (lora::expert_runs).
  bool has_routed_experts() const { return !expert_stacks.empty(); }
  // Fills expert_stacks from `modules` (after every module is in).
  void index_routed_experts();
};

// What an adapter is loaded for (Model::lora_target): the model's device, the part of each base weight
// this rank holds (Model::weight_splits; empty unsharded), and why the routed experts cannot be adapted
// there ("" when they can).
struct LoraTarget {
  LoraTarget(Device device = Device::Cpu) : device(device) {}  // an unsharded model on `device`
  Device device;
  std::map<std::string, Split> splits;
  std::string routed_experts_refused;
};

// Reads the PEFT adapter folder `path` for the model in `model_dir` onto its device, in the activations' type
// (ops::act_type). One-line errors for a missing or malformed file, a rank above `max_rank`, a module the
// model's checkpoint does not have or whose shape differs from it, and what sparrow does not apply: DoRA,
// biases, modules_to_save, fan_in_fan_out, targets outside the list above (lora_supported_module), routed
// experts where `target` refuses them.
// Tensor parallel: a module keeps the part of B where its base weight is split by rows (its output) and of A
// where it is split by columns (its input: the rank's term then joins the weight's in the layer's
// all-reduce). An expert parallel rank keeps every expert's pairs and uses its own experts'.
std::shared_ptr<const LoraAdapter> load_lora_adapter(const std::string& name, const std::string& path,
                                                     const std::string& model_dir, const LoraTarget& target,
                                                     int64_t max_rank);

// Whether a module (e.g. "model.layers.3.self_attn.q_proj") is one of the targets above: its last name is
// a projection the layers adapt, and it is not a router's nor a routed experts' stack.
bool lora_supported_module(const std::string& module);

namespace lora {

// y[:, first_col ..] += each sequence's adapter term for `module` (prefix + name) over its rows of x; y and x
// hold the batch's rows in order. Nothing when no sequence of the batch has an adapter for it.
void add_(Tensor& y, const Tensor& x, const Batch& batch, const std::string& prefix, const char* name,
          int64_t first_col = 0);

// MLA's kv_b_proj ([heads x (nope + v), latent]: per head W_UK's nope rows, then W_UV's v rows), which the
// attention uses absorbed (model/mla.cpp): its adapter's terms in the same form, per head h,
//   q_abs[t, h, :latent] += (q[t, h, :nope] · B_UK[h]) A        (the absorbed queries, before attention)
//   attended[t, h]       += B_UV[h] (A · mixed[t, h])           (back from the latent space, before o_proj)
// q [T, heads x qk] (qk = nope + rope), q_abs [T, heads, row], mixed [T, heads, latent], attended
// [T, heads x v].
struct MlaDims {
  int64_t heads, nope, v, qk, row, latent;
};
void add_absorbed_queries_(Tensor& q_abs, const Tensor& q, const Batch& batch, const std::string& prefix,
                           const MlaDims& d);
void add_absorbed_outputs_(Tensor& attended, const Tensor& mixed, const Batch& batch, const std::string& prefix,
                           const MlaDims& d);

// The routed experts' terms of the batch's adapters for the MoE whose experts are named `experts_prefix`
// + "<e>." (e.g. "model.layers.3.mlp.experts."), for this rank's experts [first, first + count) of the
// router's numbering: one run per run of consecutive sequences whose adapter targets any of them. The runs
// point into the adapters, which the batch's sequences hold.
std::vector<ExpertAdapterRun> expert_runs(const Batch& batch, const std::string& experts_prefix, int64_t first,
                                          int64_t count);

}  // namespace lora
}  // namespace sparrow
