// Multi-token prediction, the drafter of speculative decoding's "mtp" method (DeepSeek-V3 technical report
// §2.2; vLLM deepseek_mtp.py, DeepSeekMultiTokenPredictorLayer and SharedHead). The checkpoint's layer after
// its last decoder layer (model.layers.{L}) predicts the token after next at a position p from the target's
// hidden state there and the embedding of the token that follows p:
//   x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])       the embedding is zeroed at position 0, as vLLM does
//   x = x + mixer(input_norm(x));  x = x + ffn(post_norm(x))  one decoder layer, its cache rows at 0 .. p
//   logits = head(norm(x))                                   shared_head
// Drafting k tokens applies the layer k times, each with its own output state in place of h (vLLM reuses
// the layer for every step): x itself (Kimi K3), or norm(x) (DeepSeek-V3.2: vLLM 0.33's deepseek_v32/nvidia/
// mtp.py recycles the post-norm state, "pre-final-norm ... lowers MTP acceptance"). Its cache rows live in the target's paged cache as layer L, so they follow the
// target's blocks (prefix hits, preemption, freeing); cache_spec() is the target's layers then its own.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/decoder.h"

namespace sparrow {

class MtpDrafter final : public Model {
 public:
  std::string type;  // the target's model_type
  Device placed_on = Device::Cpu;
  int64_t vocab = 0, hidden = 0;
  float norm_eps = 1e-6f;
  bool norm_unit_offset = false;
  Tensor embed;    // [vocab, hidden]: the layer's own embed_tokens, else the target's
  Tensor enorm, hnorm;
  Tensor eh_proj;  // [hidden, 2 * hidden]
  Tensor norm;     // shared_head.norm
  Tensor head;     // shared_head.head [vocab, hidden], else the target's lm_head
  DecoderLayer layer;
  int layer_index = 0;  // L: the layer's place in the cache (the target's layers come first)
  bool recycles_normed = false;  // the state handed to the next draft step is norm(x), not x
  std::vector<LayerCacheSpec> target_cache_spec;

  const std::string& model_type() const override { return type; }
  int64_t vocab_size() const override { return vocab; }
  int64_t num_layers() const override { return layer_index + 1; }
  Device device() const override { return placed_on; }
  // Its steps replay CUDA graphs too: a graph copies Batch::hidden_states_in into its own buffer.
  std::vector<LayerCacheSpec> cache_spec() const override;
  // The batch's tokens are t_{p+1} at positions p, batch.hidden_states_in the matching h_p; returns the
  // logits of each sequence's last SeqSlice::logits rows and leaves every row's output state (x or norm(x):
  // recycles_normed) in batch.hidden_states (the h of the next draft step; a batch from a CUDA graph has
  // them only with keep_hidden_states).
  Tensor forward(const Batch& batch, StepMarks* marks) override;
};

// The MTP layer of a model folder (the first of num_nextn_predict_layers), on `device`. One-line errors for a
// family without one in sparrow, a config without num_nextn_predict_layers, or missing weights.
// For the families' MTP loaders: a one-line error when the checkpoint has no layer under `layer_prefix`
// (model.layers.{L}.; its eh_proj marks it). A dummy checkpoint has every layer its config names.
void require_mtp_layer(const Checkpoint& ckpt, const std::string& layer_prefix);

// `options` as load_model takes them: --load-format dummy and --moe-routing-simulation reach the layer too
// (benchmarks of the verify path at real dimensions), and its tensor-parallel part must be unsharded.
std::unique_ptr<MtpDrafter> load_mtp_drafter(const std::string& dir, Device device, const LoadOptions& options = {});

}  // namespace sparrow
