#include "model/model.h"

#include <algorithm>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/families.h"
#include "model/feed_forward.h"

namespace sparrow {

Model::~Model() = default;

LoraTarget Model::lora_target() const {
  LoraTarget target(device());
  target.splits = weight_splits;
  target.routed_experts_refused = routed_expert_lora_refused;
  return target;
}

Batch make_batch(const std::vector<std::pair<SequenceState*, std::vector<int32_t>>>& parts) {
  Batch batch;
  for (const auto& [state, tokens] : parts) {
    SPARROW_CHECK(!tokens.empty(), "a sequence in the batch has no new tokens");
    SPARROW_CHECK(state->cache != nullptr, "a sequence in the batch has no cache");
    batch.seqs.push_back(SeqSlice{state, batch.size(), int64_t(tokens.size())});
    for (size_t i = 0; i < tokens.size(); ++i) {
      batch.tokens.push_back(tokens[i]);
      batch.positions.push_back(state->length + int64_t(i));
    }
  }
  return batch;
}

Tensor select_logit_rows(const Tensor& x, const Batch& batch) {
  if (x.device() != Device::Cpu) return ops::select_rows(x, device_step(batch).logit_rows);
  std::vector<int64_t> rows;
  for (const SeqSlice& s : batch.seqs)
    for (int64_t r = s.offset + s.count - s.logits; r < s.offset + s.count; ++r) rows.push_back(r);
  return ops::select_rows(x, rows);
}

bool Batch::has_lora() const {
  for (const SeqSlice& seq : seqs)
    if (seq.state->lora) return true;
  return false;
}

int64_t Batch::logit_rows() const {
  if (all_logits) return size();
  int64_t rows = 0;
  for (const SeqSlice& s : seqs) rows += s.logits;
  return rows;
}

const Tensor& Batch::positions_on(Device device) const {
  if (device != Device::Cpu && device_step) return device_step->positions;  // uploaded with the step's inputs
  if (!positions_tensor.defined() || positions_tensor.device() != device || positions_tensor.numel() != size()) {
    Tensor host = Tensor::empty({size()}, ScalarType::I64);
    std::copy(positions.begin(), positions.end(), host.as<int64_t>());
    positions_tensor = host.to(device);
  }
  return positions_tensor;
}

std::unique_ptr<Model> load_model(const std::string& dir, Device device) { return load_model(dir, device, LoadOptions{}); }

namespace {

// One-line errors for an unknown load format / routing simulation.
void check_load_format(const std::string& load_format) {
  SPARROW_CHECK(load_format == "auto" || load_format == "safetensors" || load_format == "fastsafetensors" ||
                    load_format == "dummy",
                "--load-format must be auto, safetensors, fastsafetensors or dummy, not '", load_format, "'");
}

void check_moe_routing_simulation(const std::string& strategy) {
  SPARROW_CHECK(strategy.empty() || strategy == "uniform_random",
                "--moe-routing-simulation must be uniform_random (or absent: the model's own routing), not '",
                strategy, "'");
}

}  // namespace

// The registry (families.h). MiniMax-M3 is served from its text-only causal LM or from the text half of
// a vision-language checkpoint.
const ModelFamily kModelFamilies[] = {
    {"deepseek_v32", "deepseek_v32", nullptr, "model.", load_deepseek_v32, deepseek_v32_cache_spec, load_deepseek_v32_mtp},
    {"kimi_linear", "kimi_linear", nullptr, "model.", load_kimi_linear, kimi_linear_cache_spec},
    {"kimi_k3", "kimi_linear", "text_config", "language_model.model.", load_kimi_k3, kimi_k3_cache_spec, load_kimi_k3_mtp,
     load_kimi_k3_vision},
    {"minimax_m3_vl_text", "minimax_m3", nullptr, "model.", load_minimax_m3, minimax_m3_cache_spec, load_minimax_m3_mtp},
    {"minimax_m3", "minimax_m3", nullptr, "model.", load_minimax_m3, minimax_m3_cache_spec, load_minimax_m3_mtp},
    {"minimax_m3_vl", "minimax_m3", "text_config", "model.language_model.", load_minimax_m3, minimax_m3_cache_spec, load_minimax_m3_mtp,
     load_minimax_m3_vision},
};

const ModelFamily& model_family(const Config& config) {
  const std::string type = config.get_string("model_type");
  const std::vector<std::string> archs =
      config.has("architectures") ? config.get_string_list("architectures") : std::vector<std::string>{};
  const bool drafter = type == "k3_dspark" || std::find_if(archs.begin(), archs.end(), [](const std::string& a) {
                                                return a.find("DSpark") != std::string::npos;
                                              }) != archs.end();
  SPARROW_CHECK(!drafter, "config.json: ", archs.empty() ? type : archs.front(), " is a DSpark drafter, not a model to "
                "serve: give its folder to --speculative-config '{\"method\": \"dspark\", \"model\": DIR, "
                "\"num_speculative_tokens\": N}' beside the model it drafts for");
  std::string supported;
  for (const ModelFamily& family : kModelFamilies) {
    if (type == family.model_type) return family;
    supported += std::string(supported.empty() ? "" : ", ") + family.model_type;
  }
  config.unsupported("model_type", type, supported);
}

std::unique_ptr<Checkpoint> open_checkpoint(const std::string& dir, Device device, const LoadOptions& options) {
  check_load_format(options.load_format);
  check_moe_routing_simulation(options.moe_routing_simulation);
  std::unique_ptr<Checkpoint> ckpt =
      options.load_format == "dummy" ? Checkpoint::open_dummy(dir, options.dummy_seed) : Checkpoint::open(dir);
  if (device != Device::Cpu) ckpt->place_on(device);
  if (options.replaced_tensors) ckpt->replace_tensors(*options.replaced_tensors);
  return ckpt;
}

void simulate_routing(DecoderLayer& layer, int layer_index, const LoadOptions& options) {
  if (options.moe_routing_simulation.empty()) return;
  if (auto* moe = dynamic_cast<MoeBlock*>(layer.ffn.get())) {
    moe->router.simulate_uniform = true;
    moe->router.simulation_salt = uint32_t(layer_index);
  }
}

std::unique_ptr<Model> load_model(const std::string& dir, Device device, const LoadOptions& options) {
  std::unique_ptr<Checkpoint> ckpt = open_checkpoint(dir, device, options);
  if (options.tensor_parallel.sharded()) {
    SPARROW_CHECK(options.tensor_parallel.comm && options.tensor_parallel.comm->size() == options.tensor_parallel.size,
                  "load_model: a tensor-parallel group of ", options.tensor_parallel.size, " needs its communicator");
    const TensorParallel& tp = options.tensor_parallel;
    SPARROW_CHECK(tp.token_sharded_prefill_rows == 0 || device == Device::Cpu,
                  "--token-sharded-prefill runs on the CPU backend so far (issue 28)");
    SPARROW_CHECK(!tp.context_parallel() || (tp.size % tp.dcp_size == 0 && tp.dcp_comm && tp.dcp_comm->size() == tp.dcp_size),
                  "load_model: a decode-context-parallel group of ", tp.dcp_size, " needs its communicator and must "
                  "divide the tensor-parallel size ", tp.size);
    ckpt->set_tensor_parallel(options.tensor_parallel);
  }
  const int64_t total_bytes = ckpt->total_bytes();
  const bool report = !ckpt->dummy() && options.progress && total_bytes >= options.progress_min_bytes;
  LoadProgress progress(total_bytes, report ? options.progress : nullptr, options.progress_live);
  ckpt->report_to(&progress);
  if (!ckpt->dummy() && options.prefetch_threads > 0)
    ckpt->prefetch(options.prefetch_threads, options.prefetch_window_bytes);
  const ModelFamily& family = model_family(ckpt->config());
  std::unique_ptr<DecoderModel> model = family.load(*ckpt, family.text(ckpt->config()), family.weight_prefix);
  ckpt->report_to(nullptr);
  progress.finish();
  // The vision tower runs on rank 0's device (the engine there embeds a step's images; docs/vision.md); the other
  // ranks go without.
  if (family.load_vision && options.tensor_parallel.rank == 0)
    model->vision_tower = family.load_vision(dir, device, ckpt->dummy());
  model->weight_splits = ckpt->splits();
  if (options.tensor_parallel.data_parallel())
    model->routed_expert_lora_refused = "LoRA on the routed experts is not applied under data parallelism (another "
                                        "group's ranks run this group's tokens through their experts)";
  for (size_t layer = 0; layer < model->layers.size(); ++layer) simulate_routing(model->layers[layer], int(layer), options);
  if (options.tensor_parallel.context_parallel()) {
    // DCP shards the MLA caches' tokens (model/context_parallel.h); a layer that caches anything else would
    // keep whole rows the others' shares do not match.
    for (const LayerCacheSpec& layer : model->cache_spec())
      for (const PageSpec& page : layer.pages)
        SPARROW_CHECK(page.kind == PageKind::MlaLatent || page.kind == PageKind::DsaIndexKey,
                      "--decode-context-parallel-size shards MLA latents and DSA index keys; this model also caches ",
                      page_kind_name(page.kind), " pages (run it without -dcp)");
  }
  return model;
}

std::vector<LayerCacheSpec> cache_spec_from_config(const Config& config) {
  const ModelFamily& family = model_family(config);
  return family.cache_spec(family.text(config));
}

}  // namespace sparrow
