#include "model/decoder.h"

#include <cstring>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "kernels/cpu/ops.h"

namespace sparrow {

std::vector<LayerCacheSpec> DecoderModel::cache_spec() const {
  std::vector<LayerCacheSpec> spec;
  for (const DecoderLayer& layer : layers) spec.push_back(layer.mixer->cache_spec());
  return spec;
}

void DecoderModel::take_embeddings(Checkpoint& ckpt, const std::string& decoder_prefix, const std::string& head_name,
                                   bool tied) {
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
  Tensor x = cpu::embedding(embed, batch.tokens);
  for (size_t i = 0; i < layers.size(); ++i) {
    DecoderLayer& layer = layers[i];
    Tensor mixed = layer.mixer->forward(cpu::rms_norm(x, layer.input_norm, norm_eps, norm_unit_offset), batch, int(i));
    cpu::add_inplace(x, mixed);
    cpu::add_inplace(x, layer.ffn->forward(cpu::rms_norm(x, layer.post_norm, norm_eps, norm_unit_offset)));
  }
  for (const SeqSlice& s : batch.seqs) s.state->length += s.count;

  if (!batch.all_logits) {
    Tensor last = Tensor::empty({int64_t(batch.seqs.size()), hidden});
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      const SeqSlice& s = batch.seqs[i];
      std::memcpy(last.row(i), x.row(s.offset + s.count - 1), sizeof(float) * hidden);
    }
    x = last;
  }
  cpu::rms_norm_inplace(x, final_norm, norm_eps, norm_unit_offset);
  return cpu::linear(x, lm_head);
}

}  // namespace sparrow
