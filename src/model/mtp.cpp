#include "model/mtp.h"

#include "core/error.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/families.h"

namespace sparrow {

std::vector<LayerCacheSpec> MtpDrafter::cache_spec() const {
  std::vector<LayerCacheSpec> spec = target_cache_spec;
  spec.push_back(layer.mixer->cache_spec());
  return spec;
}

Tensor MtpDrafter::forward(const Batch& batch, StepMarks* marks) {
  const bool on_gpu = placed_on != Device::Cpu;
  const int64_t rows = batch.size();
  SPARROW_CHECK(batch.hidden_states_in.defined() && batch.hidden_states_in.dim(0) == rows &&
                    batch.hidden_states_in.dim(1) == hidden,
                "mtp: the batch brings no target hidden state for each of its ", rows, " rows");
  Tensor e = on_gpu ? ops::embedding(embed, device_step(batch).token_ids) : ops::embedding(embed, batch.tokens);
  // vLLM masks the input embedding at position 0 ("not needed by MTP").
  Tensor zero_row;
  for (int64_t r = 0; r < rows; ++r) {
    if (batch.positions[size_t(r)] != 0) continue;
    if (!zero_row.defined()) zero_row = Tensor::zeros({1, hidden}, e.type(), e.device());
    ops::copy_lines(e, r * hidden, hidden, zero_row, 0, hidden, hidden, 1);
  }
  const Tensor e_normed = ops::rms_norm(e, enorm, norm_eps, norm_unit_offset);
  const Tensor h_normed = ops::rms_norm(batch.hidden_states_in, hnorm, norm_eps, norm_unit_offset);
  Tensor both = Tensor::empty({rows, 2 * hidden}, e_normed.type(), e_normed.device());
  ops::copy_lines(both, 0, 2 * hidden, e_normed, 0, hidden, hidden, rows);
  ops::copy_lines(both, hidden, 2 * hidden, h_normed.to(both.device(), both.type()), 0, hidden, hidden, rows);
  Tensor x = ops::linear(both, eh_proj);
  const Tensor mixed =
      layer.mixer->forward(ops::rms_norm(x, layer.input_norm, norm_eps, norm_unit_offset), batch, layer_index);
  if (marks) marks->mark("mtp mixer");
  // The residual add folded into the post-norm (one launch on a GPU), as DecoderModel::residual_layers.
  ops::add_(x, layer.ffn->forward(ops::add_rms_norm_(x, mixed, layer.post_norm, norm_eps, norm_unit_offset), batch));
  if (marks) marks->mark("mtp ffn");
  // Every row's normed state when it is what the next step reads; else only the logit rows get normed.
  const bool norm_all = recycles_normed || batch.all_logits;
  if (norm_all) x = ops::rms_norm(x, norm, norm_eps, norm_unit_offset);
  if (!recycles_normed) batch.hidden_states = x;
  Tensor last = x;
  if (!batch.all_logits) {
    last = select_logit_rows(x, batch);
    if (!norm_all) ops::rms_norm_(last, norm, norm_eps, norm_unit_offset);
  }
  if (recycles_normed) batch.hidden_states = x;
  return ops::linear(last, head, ScalarType::F32);
}

void require_mtp_layer(const Checkpoint& ckpt, const std::string& layer_prefix) {
  SPARROW_CHECK(ckpt.dummy() || ckpt.has(layer_prefix + "eh_proj.weight"), "speculative decoding: method \"mtp\": the "
                "checkpoint has no ", layer_prefix, "eh_proj.weight (its multi-token-prediction layer)");
}

std::unique_ptr<MtpDrafter> load_mtp_drafter(const std::string& dir, Device device, const LoadOptions& options) {
  SPARROW_CHECK(!options.tensor_parallel.sharded(), "the MTP layer is not split over tensor-parallel ranks yet");
  std::unique_ptr<Checkpoint> ckpt = open_checkpoint(dir, device, options);
  const ModelFamily& family = model_family(ckpt->config());
  SPARROW_CHECK(family.load_mtp != nullptr, "speculative decoding: method \"mtp\" is not built for ",
                ckpt->config().get_string("model_type"), " yet (sparrow runs DeepSeek-V3.2's MTP layer)");
  std::unique_ptr<MtpDrafter> drafter = family.load_mtp(*ckpt, family.text(ckpt->config()), family.weight_prefix);
  simulate_routing(drafter->layer, drafter->layer_index, options);
  return drafter;
}

}  // namespace sparrow
