// DSpark, the drafter of speculative decoding's "dspark" method (the drafter both seed articles serve Kimi
// K3.1 Pro with). vLLM 0.33: models/kimi_k3/nvidia/dspark_mla.py (K3DSparkModel),
// transformers_utils/configs/k3_dspark.py (K3DSparkConfig), v1/worker/gpu/spec_decode/dspark/speculator.py;
// ../shared/docs/real-models.md §3.
//
// A small dense MLA transformer that drafts a block of N tokens in one non-causal pass from the target's
// hidden states, then corrects the block left to right with a low-rank Markov head while sampling:
//   context   for every target position p:  c_p = context_norm(context_proj([s_{t_1}(p) ; ... ; s_{t_n}(p)]))
//             where s_t(p) is the target's stream after layer t (DecoderModel::aux_hidden_layers); each draft
//             layer j writes only its MLA cache row for p from c_p: [kv_a_layernorm_j(c) | rope(k_pe)] of
//             kv_a_proj_with_mqa_j(c_p)                                                     (store_context)
//   block     tokens [bonus, mask x (N-1)] at positions L-1 .. L+N-2 (L - 1: the bonus token's, the newest
//             token the target sampled): x = embed(tokens) (the target's embedding), then per layer
//             x += MLA(input_norm(x)) with every query seeing the whole context and the whole block
//             (non-causal; the block's own rows enter the cache), x += MLP(post_norm(x)); the base logits are
//             lm_head(final_norm(x)) (the target's head) times logit_scale                      (forward)
//   drafts    prev = bonus; for i < N: logits_i = base_i + markov_w2 · markov_w1[prev]; d_i = draw(logits_i);
//             prev = d_i. Query i predicts the token at position L + i.                   (markov_bias)
// Its layers' cache rows live in the target's paged cache after the target's layers (as the MTP layer's
// do, model/mtp.h), so they follow the target's blocks: prefix hits, preemption, freeing. The rows the
// block writes past the sequence are overwritten by the context rows once the target has run those
// positions.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/decoder.h"

namespace sparrow {

class DSparkDrafter final : public Model {
 public:
  std::string type = "k3_dspark";
  Device placed_on = Device::Cpu;
  int64_t vocab = 0, hidden = 0;
  float norm_eps = 1e-6f;
  float logit_scale = 1.0f;
  int32_t mask_token = 0;             // the block's filler token (dspark_noise_token_id / mask_token_id)
  std::vector<int> target_layer_ids;  // the target's layers whose output streams feed the context
  Tensor embed, lm_head;              // the target's (shared, as vLLM's load_dspark_model shares them)
  Tensor context_proj;                // [hidden, target_hidden * target_layer_ids.size()]
  Tensor context_norm;                // [hidden]
  std::vector<DecoderLayer> layers;   // MLA (non-causal, with RoPE) + dense MLP each
  Tensor final_norm;                  // [hidden]
  Tensor markov_w1;                   // [vocab, markov_rank]: the previous token's Markov embedding
  Tensor markov_w2;                   // [vocab, markov_rank]: its bias on the logits
  int first_layer = 0;                // the cache index of its first layer (the target's layers come first)
  std::vector<LayerCacheSpec> target_cache_spec;

  const std::string& model_type() const override { return type; }
  int64_t vocab_size() const override { return vocab; }
  int64_t num_layers() const override { return first_layer + int64_t(layers.size()); }
  Device device() const override { return placed_on; }
  // Its blocks attend non-causally, which the decode graphs' causal bounds do not express: eager only.
  bool capturable() const override { return false; }
  std::vector<LayerCacheSpec> cache_spec() const override;
  // The query block: every sequence's rows are [bonus, mask, ...] at consecutive positions right after its
  // context; returns the base logits (fp32, the rows Model::forward says: every row for the proposer's
  // all_logits batches), before the Markov bias.
  Tensor forward(const Batch& batch, StepMarks* marks) override;
  // The context: batch.hidden_states_in holds the target's captured streams ([rows, target_hidden * n]) of
  // the batch's rows, whose positions are the target's; writes every draft layer's cache row there. On a GPU
  // the batch's step inputs must be attached (runner/step_inputs.h).
  void store_context(const Batch& batch);
  // logit_scale · markov_w2 · markov_w1[previous[i]] for each i: fp32 [previous.size(), vocab] on the
  // model's device.
  Tensor markov_bias(const std::vector<int32_t>& previous) const;
};

// The DSpark drafter of folder `dir` (config.json model_type k3_dspark) for `target`, on the target's
// device: shares the target's embedding and output head and makes the target keep the streams its context
// reads (DecoderModel::aux_hidden_layers). A target split over tensor-parallel ranks (rank 0's part) holds
// a share of the vocabulary rows: the drafter then reads the whole embedding and head from the target's
// folder `target_dir` (it runs whole on rank 0, as the MTP layer does). One-line errors for another drafter
// type, a config vLLM's K3DSparkConfig refuses, a drafter that does not fit the target (hidden size,
// vocabulary, layer ids), or a target sparrow cannot read the streams of (not a decoder stack).
std::unique_ptr<DSparkDrafter> load_dspark_drafter(const std::string& dir, Model& target,
                                                   const LoadOptions& options = {}, const std::string& target_dir = "");

}  // namespace sparrow
