// The decoder stack every family shares (transformers' *DecoderLayer / *Model / *ForCausalLM):
//   x = embed(tokens)
//   for each layer:  x = x + mixer(norm_in(x));  x = x + ffn(norm_post(x))
//   logits = lm_head(norm_final(x))
// A family differs only in which mixer (MLA, MLA+DSA, GQA+MSA, KDA) and which feed-forward (dense MLP,
// MoE) each layer gets, and in its RMSNorm convention; it builds a DecoderModel and is a short file.
//
// Kimi K3 replaces the residual stream by AttnRes (attention over the depth; vLLM 0.33
// models/kimi_k3/nvidia/model.py KimiLinearModel.forward and KimiDecoderLayer._pre_attn_norm /
// _post_attn_norm, ops/attn_res.py). Layers form blocks of attn_res_block_size; the sources are the
// embedding, the sum of every sublayer output of each finished block, and the partial sum of the current
// block; each sublayer's input is a softmax mix of them (ops::attn_res_mix, one learned query per
// sublayer) instead of x:
//   partial = x = embed(tokens); sources = []
//   for layer l:  if l starts a block: sources += partial (the finished block; the embedding first)
//                 a = mixer(norm_in(mix(sources [+ partial unless l starts a block])))
//                 partial = a if l starts a block, else partial + a
//                 partial += ffn(norm_post(mix(sources + partial)))   (added before the next layer)
//   logits = lm_head(norm_final(mix_output(sources + partial)))
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/tensor.h"
#include "model/model.h"
#include "model/vision_encoder.h"

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
  // Only the cache rows that x ([batch.size(), hidden], normalised) would write at the batch's positions, no
  // attention: the DSpark drafter's context (model/dspark.h). On a GPU the batch's step inputs must be
  // attached. Mixers without such rows refuse.
  virtual void store_rows(const Tensor& x, const Batch& batch, int layer) const;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // [T, hidden] -> [T, hidden]. `batch` is the step x belongs to: a data-parallel MoE reads every group's
  // token count from it (Batch::group_tokens).
  virtual Tensor forward(const Tensor& x, const Batch& batch) const = 0;
  virtual std::string name() const = 0;  // its kind, for step profiles: "mlp", "moe"
  // Whether it meets the other data-parallel groups inside (a MoE whose experts every group shares): a
  // group without tokens in a step still runs it, on no rows (Model::step_idle).
  virtual bool spans_groups() const { return false; }
};

// One AttnRes mix point: the learned query is norm * proj (fp32 [hidden] each).
struct AttnResQuery {
  Tensor norm;
  Tensor proj;
};

struct DecoderLayer {
  Tensor input_norm;  // [hidden]
  Tensor post_norm;   // [hidden]
  AttnResQuery before_mixer, before_ffn;  // AttnRes only (self_attention_res_*, mlp_res_*)
  std::unique_ptr<Mixer> mixer;
  std::unique_ptr<FeedForward> ffn;
};

// How residual_stack runs a stack: its norms, the cache index of its first layer, and what its marks start
// with (the DSpark drafter's "dspark ").
struct ResidualStack {
  float norm_eps = 1e-6f;
  bool norm_unit_offset = false;
  int first_cache_layer = 0;
  std::string mark_prefix;
};

// The pre-norm residual stream through `layers`, from x to the hidden states before the final norm:
// x += mixer(input_norm(x)); x += ffn(post_norm(x)). Marks "mixer <kind>" and "ffn <kind>" after each part.
// With `streams`, the stream after each layer i that `capture(i)` names is copied into (*streams)[i].
// The target's stack (DecoderModel) and the DSpark drafter's (model/dspark.h) run on it.
Tensor residual_stack(std::vector<DecoderLayer>& layers, Tensor x, const Batch& batch, const ResidualStack& how,
                      StepMarks* marks, const std::function<bool(size_t)>& capture = {},
                      std::vector<Tensor>* streams = nullptr);

class DecoderModel : public Model {
 public:
  std::string type;
  Device placed_on = Device::Cpu;  // where the weights are (Checkpoint::place_on)
  int64_t vocab = 0;
  int64_t hidden = 0;
  float norm_eps = 1e-6f;
  bool norm_unit_offset = false;  // Gemma-style RMSNorm (x̂ * (1 + w)), as MiniMax-M3 uses
  Tensor embed;                   // [vocab, hidden]; sharded: this rank's rows (model/tensor_parallel.h)
  Tensor final_norm;              // [hidden]
  Tensor lm_head;                 // [vocab, hidden] (may share storage with embed when tied); sharded: its rows
  std::string embed_name, head_name;  // their checkpoint names (the same when tied): a drafter reads them whole
  TensorParallel tp;              // the tensor-parallel group (Checkpoint::tensor_parallel)
  int64_t vocab_first = 0;        // sharded: the first vocabulary row of embed and lm_head here
  int64_t vocab_part = 0;         // sharded: the rows each rank holds (the last ones may hold fewer)
  std::vector<DecoderLayer> layers;
  int64_t attn_res_block = 0;     // layers per AttnRes block; 0: the residual stream
  AttnResQuery output_attn_res;   // AttnRes only: the mix before the final norm
  // Batch::keep_hidden_states: the hidden states handed to an MTP drafter are taken after the final norm
  // (true) or before it.
  bool hidden_for_drafter_normed = true;
  // The layers whose output streams a DSpark drafter reads (model/dspark.h). When set, keep_hidden_states
  // leaves their concatenation in list order ([rows, hidden * n]) in batch.hidden_states instead. The stream
  // after layer t: x (the residual stream), or under AttnRes the current block's partial sum with layer t's
  // feed-forward output added (vLLM 0.33 kimi_k3/nvidia/model.py _capture_aux_hidden_stream, under its
  // default VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0).
  std::vector<int> aux_hidden_layers;
  // A vision-language checkpoint's tower (ModelFamily::load_vision), on the host; null for text only.
  std::unique_ptr<VisionEncoder> vision_tower;

  // Takes embed_tokens and norm under `decoder_prefix` (e.g. "model.") and the output head `head`
  // (this rank's vocabulary rows of both when the checkpoint is sharded).
  // With tied embeddings the head is the embedding; transformers ties it even when the file also holds
  // a head, which is then taken and dropped.
  void take_embeddings(Checkpoint& ckpt, const std::string& decoder_prefix, const std::string& head, bool tied);

  const std::string& model_type() const override { return type; }
  Device device() const override { return placed_on; }
  // Not data parallel: a decode graph would fix every group's token count (its collectives' sizes).
  bool capturable() const override {
    return !tp.data_parallel() && (!tp.sharded() || tp.comm->device() == placed_on);
  }
  int64_t vocab_size() const override { return vocab; }
  int64_t num_layers() const override { return int64_t(layers.size()); }
  std::vector<LayerCacheSpec> cache_spec() const override;
  // The stack itself, from the batch's tokens to its logits on the model's device (on a GPU, from the
  // step's inputs in batch.device_step).
  Tensor forward(const Batch& batch, StepMarks* marks) override;
  const VisionEncoder* vision() const override { return vision_tower.get(); }
  void step_idle(const Batch& batch) override;

 private:
  // The AttnRes layers, from the embedded tokens to the hidden states before the final norm (residual_stack
  // runs the others). With `streams`, the stream after each layer of aux_hidden_layers is copied into
  // (*streams)[layer].
  Tensor attn_res_layers(Tensor embedded, const Batch& batch, StepMarks* marks, std::vector<Tensor>* streams);
  bool captures(size_t layer) const;
  void place_embedded_rows(Tensor& x, const Batch& batch) const;
};

}  // namespace sparrow
