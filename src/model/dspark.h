// DSpark, the drafter of speculative decoding's "dspark" method (the drafter both seed articles serve with).
// vLLM 0.33: v1/worker/gpu/spec_decode/dspark/speculator.py (DSparkSpeculator) and two architectures:
//   k3_dspark   Kimi K3's: models/kimi_k3/nvidia/dspark_mla.py (K3DSparkModel),
//               transformers_utils/configs/k3_dspark.py (K3DSparkConfig); MLA layers.
//   qwen3       the Qwen3 DSpark drafter (architectures Qwen3DSparkModel, or DSparkDraftModel with
//               model_type qwen3), which MiniMax-M3.1 is served with (../shared/docs/real-models.md §3.1,
//               INFERRED there): model_executor/models/qwen3_dspark.py on qwen3_dflash.py's backbone;
//               GQA layers with q/k norms, optionally a sliding window, and its own head over a reduced
//               draft vocabulary (d2t) where the checkpoint has one.
//
// A small dense transformer that drafts a block of N tokens in one non-causal pass from the target's
// hidden states, then corrects the block left to right with a low-rank Markov head while sampling:
//   context   for every target position p:  c_p = context_norm(context_proj([s_{t_1}(p) ; ... ; s_{t_n}(p)]))
//             where s_t(p) is the target's stream after layer t (DecoderModel::aux_hidden_layers); each draft
//             layer j writes only its cache row for p from c_p (Mixer::store_rows): MLA [kv_a_layernorm_j(c)
//             | rope(k_pe)] of kv_a_proj_with_mqa_j(c_p); GQA [rope(k_norm_j(k_proj_j c_p)) | v_proj_j c_p].
//             (Qwen3 names: context_proj = fc, context_norm = hidden_norm.)                  (store_context)
//   block     tokens [bonus, mask x (N-1)] at positions L-1 .. L+N-2 (L - 1: the bonus token's, the newest
//             token the target sampled): x = embed(tokens) (the target's embedding), then per layer
//             x += attention(input_norm(x)) with every query seeing the whole context and the whole block
//             (non-causal, unless the config makes a layer causal; the block's own rows enter the cache),
//             x += MLP(post_norm(x)); the base logits over the draft vocabulary are lm_head(final_norm(x))
//             (the target's head, or the drafter's own) times logit_scale                       (forward)
//   drafts    prev = bonus; for i < N: logits_i = base_i + markov_w2 · markov_w1[prev]; d_i = draw(logits_i)
//             as a draft id, mapped to the target's vocabulary (d2t); prev = that target id. Query i predicts
//             the token at position L + i.                                                    (markov_bias)
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
  std::string type = "k3_dspark";     // the config's model_type: k3_dspark or qwen3
  Device placed_on = Device::Cpu;
  int64_t vocab = 0, hidden = 0;
  int64_t draft_vocab = 0;            // the base logits' width: vocab, or fewer (a reduced draft vocabulary)
  float norm_eps = 1e-6f;
  float logit_scale = 1.0f;
  int32_t mask_token = 0;             // the block's filler token (dspark_noise_token_id / mask_token_id)
  std::vector<int> target_layer_ids;  // the target's layers whose output streams feed the context
  Tensor embed;                       // the target's (shared, as vLLM's load_dspark_model shares it)
  Tensor lm_head;                     // [draft_vocab, hidden]: the target's, or the drafter's own
  std::vector<int64_t> draft_to_target;  // d2t: draft id d is target id d + d2t[d]; empty: the same ids
  int64_t draft_topk = 0;             // dspark_draft_topk of a Qwen3 drafter's config (engine/dspark_proposer.h)
  Tensor context_proj;                // [hidden, target_hidden * target_layer_ids.size()]
  Tensor context_norm;                // [hidden]
  std::vector<DecoderLayer> layers;   // MLA or GQA attention + dense MLP each
  Tensor final_norm;                  // [hidden]
  Tensor markov_w1;                   // [vocab, markov_rank]: the previous (target) token's Markov embedding
  Tensor markov_w2;                   // [draft_vocab, markov_rank]: its bias on the logits
  int first_layer = 0;                // the cache index of its first layer (the target's layers come first)
  std::vector<LayerCacheSpec> target_cache_spec;

  const std::string& model_type() const override { return type; }
  // The target's vocabulary: the drafts it proposes are target ids (target_token).
  int64_t vocab_size() const override { return vocab; }
  int64_t num_layers() const override { return first_layer + int64_t(layers.size()); }
  Device device() const override { return placed_on; }
  // Its blocks attend non-causally, which the decode graphs' causal bounds do not express: eager only.
  bool capturable() const override { return false; }
  std::vector<LayerCacheSpec> cache_spec() const override;
  // The query block: every sequence's rows are [bonus, mask, ...] at consecutive positions right after its
  // context; returns the base logits over the draft vocabulary (fp32 [rows, draft_vocab], the rows
  // Model::forward says: every row for the proposer's all_logits batches), before the Markov bias.
  Tensor forward(const Batch& batch, StepMarks* marks) override;
  // The context: batch.hidden_states_in holds the target's captured streams ([rows, target_hidden * n]) of
  // the batch's rows, whose positions are the target's; writes every draft layer's cache row there. On a GPU
  // the batch's step inputs must be attached (runner/step_inputs.h).
  void store_context(const Batch& batch);
  // logit_scale · markov_w2 · markov_w1[previous[i]] for each target id previous[i]: fp32
  // [previous.size(), draft_vocab] on the model's device.
  Tensor markov_bias(const std::vector<int32_t>& previous) const;
  // The target id of draft id d (vLLM's map_draft_to_target).
  int32_t target_token(int32_t draft_id) const;
  // Host fp32 [rows, draft_vocab] logits as the target vocabulary's [rows, vocab]: a target id no draft id
  // maps to is -inf (the draft distribution verification compares with the target's).
  Tensor target_logits(const Tensor& draft_logits) const;
};

// The DSpark drafter of folder `dir` (config.json model_type k3_dspark, or qwen3 with architectures
// Qwen3DSparkModel / DSparkDraftModel) for `target`, on the target's device: shares the target's embedding
// (and its output head unless the drafter brings its own) and makes the target keep the streams its
// context reads (DecoderModel::aux_hidden_layers). A target split over tensor-parallel ranks (rank 0's
// part) holds a share of the vocabulary rows: the drafter then reads the whole embedding and head from the
// target's folder `target_dir` (it runs whole on rank 0, as the MTP layer does). One-line errors for
// another drafter type, a config vLLM refuses (K3DSparkConfig, qwen3_dspark.py's load_weights), parts
// sparrow does not build (attention sinks, biases), a drafter that does not fit the target (hidden size,
// vocabulary, layer ids), or a target sparrow cannot read the streams of (not a decoder stack).
std::unique_ptr<DSparkDrafter> load_dspark_drafter(const std::string& dir, Model& target,
                                                   const LoadOptions& options = {}, const std::string& target_dir = "");

}  // namespace sparrow
