// The decoder stack every family shares (transformers' *DecoderLayer / *Model / *ForCausalLM):
//   x = embed(tokens)
//   for each layer:  x = x + mixer(norm_in(x));  x = x + ffn(norm_post(x))
//   logits = lm_head(norm_final(x))
// A family differs only in which mixer (MLA, MLA+DSA, GQA+MSA, KDA) and which feed-forward (dense MLP,
// MoE) each layer gets, and in its RMSNorm convention; it builds a DecoderModel and is a short file.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/model.h"

namespace sparrow {

class Checkpoint;

// A token mixer: attention of some kind, or a linear-attention recurrence.
class Mixer {
 public:
  virtual ~Mixer() = default;
  // x: [batch.size(), hidden], already normalised. Returns [batch.size(), hidden]. Reads and writes
  // layer `layer` of every sequence's cache (seq.cache()); positions come from batch.positions.
  // Must not change state->length (the model advances it after the last layer).
  virtual Tensor forward(const Tensor& x, const Batch& batch, int layer) = 0;
  // What forward() caches per token and per sequence.
  virtual LayerCacheSpec cache_spec() const = 0;
  // Its kind, for step profiles ("mla+dsa", "gqa+msa", "kda", ...).
  virtual std::string name() const = 0;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  virtual Tensor forward(const Tensor& x) const = 0;  // [T, hidden] -> [T, hidden]
  virtual std::string name() const = 0;                // its kind, for step profiles: "mlp", "moe"
};

struct DecoderLayer {
  Tensor input_norm;  // [hidden]
  Tensor post_norm;   // [hidden]
  std::unique_ptr<Mixer> mixer;
  std::unique_ptr<FeedForward> ffn;
};

class DecoderModel : public Model {
 public:
  std::string type;
  Device placed_on = Device::Cpu;  // where the weights are (Checkpoint::place_on)
  int64_t vocab = 0;
  int64_t hidden = 0;
  float norm_eps = 1e-6f;
  bool norm_unit_offset = false;  // Gemma-style RMSNorm (x̂ * (1 + w)), as MiniMax-M3 uses
  Tensor embed;                   // [vocab, hidden]
  Tensor final_norm;              // [hidden]
  Tensor lm_head;                 // [vocab, hidden] (may share storage with embed when tied)
  std::vector<DecoderLayer> layers;

  // Takes embed_tokens and norm under `decoder_prefix` (e.g. "model.") and the output head `head_name`.
  // With tied embeddings the head is the embedding; transformers ties it even when the file also holds
  // a head, which is then taken and dropped.
  void take_embeddings(Checkpoint& ckpt, const std::string& decoder_prefix, const std::string& head_name, bool tied);

  const std::string& model_type() const override { return type; }
  Device device() const override { return placed_on; }
  int64_t vocab_size() const override { return vocab; }
  int64_t num_layers() const override { return int64_t(layers.size()); }
  std::vector<LayerCacheSpec> cache_spec() const override;
  // The stack itself, from the batch's tokens to its logits on the model's device (on a GPU, from the
  // step's inputs in batch.device_step).
  Tensor forward(const Batch& batch, StepMarks* marks) override;
};

}  // namespace sparrow
