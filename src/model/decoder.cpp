#include "model/decoder.h"

#include <cstring>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/step_profile.h"

namespace sparrow {

std::vector<LayerCacheSpec> DecoderModel::cache_spec() const {
  std::vector<LayerCacheSpec> spec;
  for (const DecoderLayer& layer : layers) spec.push_back(layer.mixer->cache_spec());
  return spec;
}

void DecoderModel::take_embeddings(Checkpoint& ckpt, const std::string& decoder_prefix, const std::string& head_name,
                                   bool tied) {
  placed_on = ckpt.device();
  embed = ckpt.take(decoder_prefix + "embed_tokens.weight", {vocab, hidden});
  final_norm = ckpt.take(decoder_prefix + "norm.weight", {hidden});
  if (!tied) {
    lm_head = ckpt.take(head_name, {vocab, hidden});
    return;
  }
  lm_head = embed;
  if (ckpt.has(head_name)) ckpt.take(head_name, {vocab, hidden});
}

Tensor DecoderModel::forward(const Batch& batch) {
  SPARROW_CHECK(!batch.tokens.empty(), "empty batch");
  for (int32_t id : batch.tokens)  // checked here for both devices: the GPU embedding reads ids unchecked
    SPARROW_CHECK(id >= 0 && id < vocab, "token id ", id, " out of range [0, ", vocab, ")");
  for (const SeqSlice& s : batch.seqs) s.cache().reserve(s.start() + s.count);
  Tensor logits;
  if (step_profile) step_profile->start(placed_on);
  if (placed_on == Device::Cpu) {
    logits = compute_logits(batch);
  } else if (!enforce_eager && !step_profile && DecodeGraphs::eligible(batch)) {
    logits = graphs_.run(batch, placed_on, [&] { return compute_logits(batch); });
  } else {
    device_step(batch, placed_on);  // the step's inputs, uploaded once for every layer
    if (step_profile) step_profile->mark("inputs");
    logits = compute_logits(batch);
  }
  if (step_profile) step_profile->end_step();
  for (const SeqSlice& s : batch.seqs) s.state->length += s.count;
  return logits;
}

Tensor DecoderModel::compute_logits(const Batch& batch) {
  const bool on_gpu = placed_on != Device::Cpu;
  // (A profiled step marks the end of each part; the marks are the only difference.)
  auto mark = [&](const std::string& part) {
    if (step_profile) step_profile->mark(part);
  };
  Tensor x = on_gpu ? ops::embedding(embed, batch.device_step->token_ids) : ops::embedding(embed, batch.tokens);
  mark("embedding");
  for (size_t i = 0; i < layers.size(); ++i) {
    DecoderLayer& layer = layers[i];
    ops::add_(x, layer.mixer->forward(ops::rms_norm(x, layer.input_norm, norm_eps, norm_unit_offset), batch, int(i)));
    if (step_profile) mark("mixer " + layer.mixer->name());
    ops::add_(x, layer.ffn->forward(ops::rms_norm(x, layer.post_norm, norm_eps, norm_unit_offset)));
    if (step_profile) mark("ffn " + layer.ffn->name());
  }
  if (!batch.all_logits) {
    if (on_gpu) {
      x = ops::select_rows(x, batch.device_step->last_rows);
    } else {
      std::vector<int64_t> last;
      for (const SeqSlice& s : batch.seqs) last.push_back(s.offset + s.count - 1);
      x = ops::select_rows(x, last);
    }
  }
  ops::rms_norm_(x, final_norm, norm_eps, norm_unit_offset);
  mark("final norm");
  // fp32 logits where the model runs: on a GPU the sampler draws there and only token ids cross.
  Tensor logits = ops::linear(x, lm_head, ScalarType::F32);
  mark("lm_head");
  return logits;
}

}  // namespace sparrow
