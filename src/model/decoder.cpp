#include "model/decoder.h"

#include <cstring>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"

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
  for (const SeqSlice& s : batch.seqs) s.cache().reserve(s.start() + s.count);
  Tensor x = ops::embedding(embed, batch.tokens);
  for (size_t i = 0; i < layers.size(); ++i) {
    DecoderLayer& layer = layers[i];
    ops::add_(x, layer.mixer->forward(ops::rms_norm(x, layer.input_norm, norm_eps, norm_unit_offset), batch, int(i)));
    ops::add_(x, layer.ffn->forward(ops::rms_norm(x, layer.post_norm, norm_eps, norm_unit_offset)));
  }
  for (const SeqSlice& s : batch.seqs) s.state->length += s.count;

  if (!batch.all_logits) {
    std::vector<int64_t> last;
    for (const SeqSlice& s : batch.seqs) last.push_back(s.offset + s.count - 1);
    x = ops::select_rows(x, last);
  }
  ops::rms_norm_(x, final_norm, norm_eps, norm_unit_offset);
  // Logits in fp32 on the host, whatever the device: the sampler and log-probabilities read them there.
  // (Sampling on the GPU, so that only token ids cross, is the next step for large batches.)
  return ops::linear(x, lm_head, ScalarType::F32).to(Device::Cpu);
}

}  // namespace sparrow
