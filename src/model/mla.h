// Multi-head Latent Attention (DeepSeek-V2/V3/V3.2, Kimi Linear), computed in the absorbed form.
//
// transformers 5.17 (DeepseekV32Attention.forward, KimiLinearAttention.forward), per token x:
//   q            = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x) when q_lora_rank = 0
//   q[h]         = [q_nope (qk_nope_head_dim) | q_rot (qk_rope_head_dim)]
//   c | k_rot    = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)          (c: kv_lora_rank)
//   q_rot, k_rot = interleaved RoPE (apply_rotary_pos_emb_interleave); none when rope is absent (Kimi NoPE)
//   k[h] = [W_UK[h] c | k_rot],  v[h] = W_UV[h] c,  with kv_b_proj = [W_UK[0]; W_UV[0]; W_UK[1]; ...]
//   out  = o_proj(concat_h softmax(q[h]·k[h] * scale) v[h])
//   (Kimi K3, mla_use_output_gate: out = o_proj(attn * sigmoid(g_proj(x))); vLLM 0.33
//   models/kimi_k3/nvidia/mla.py, forward's _gate_sigmoid_mul)
// Instead of expanding every cached latent into per-head keys and values, we fold W_UK into the
// query and W_UV into the output (the same sums in another order):
//   q_abs[h] = [q_nope[h] · W_UK[h] | q_rot[h]]         score(s) = q_abs[h] · [c_s | k_rot_s]
//   out[h]   = W_UV[h] · (sum_s p_s c_s)
// so the cache holds one row per token, shared by all heads.
//
// Cache (PageKind::MlaLatent, through the sequence's SequenceCache): per token kv_lora_rank +
// qk_rope_head_dim floats, [ c (kv_a_layernorm applied) | k_rot (roped) ].
//
// With a DSA indexer (DeepSeek-V3.2, Kimi K3) each query attends only to the keys the indexer
// selects; without one, to its whole causal prefix.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "core/tensor.h"
#include "formats/checkpoint.h"
#include "model/decoder.h"
#include "model/dsa_indexer.h"
#include "model/rope.h"

namespace sparrow {

struct MlaOptions {
  int64_t hidden = 0;
  int64_t num_heads = 0;
  int64_t q_lora_rank = 0;  // 0: a plain q_proj (Kimi Linear); else q_a_proj -> q_a_layernorm -> q_b_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // Multiplies q·k before the softmax: qk_head_dim^-0.5, times mscale^2 for DeepSeek YaRN
  // (transformers yarn_apply_mscale; see mla_softmax_scale below).
  float softmax_scale = 0.0f;
  // Interleaved RoPE over qk_rope_head_dim; absent = NoPE (Kimi Linear: k_rot and q_rot unrotated).
  std::optional<Rope> rope;
  // RMSNorm eps of q_a_layernorm / kv_a_layernorm: transformers builds both with the RMSNorm default
  // 1e-6, not rms_norm_eps.
  float q_norm_eps = 1e-6f;
  float kv_norm_eps = 1e-6f;
  // config.attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj (not q_proj, q_b_proj, kv_b_proj).
  bool attention_bias = false;
  bool output_gate = false;  // mla_use_output_gate (Kimi K3): g_proj [heads * v_head_dim, hidden]
  // Every query of a sequence's step sees all of that step's rows, not only those up to its own position
  // (the DSpark drafter's block: vLLM 0.33 models/kimi_k3/nvidia/mla.py non_causal_multi_token_decode).
  bool non_causal = false;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t cache_row() const { return kv_lora_rank + qk_rope_head_dim; }  // floats per cached token
  PageSpec cache_page() const { return {PageKind::MlaLatent, cache_row(), qk_rope_head_dim}; }
};

// qk_head_dim^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 when rope_parameters has a
// rope_type other than "default" and a non-zero mscale_all_dim (transformers yarn_apply_mscale).
float mla_softmax_scale(int64_t qk_head_dim, const nlohmann::json& rope_parameters);

class MlaMixer : public Mixer {
 public:
  // prefix: "model.layers.N.self_attn." Takes q_proj or q_a_proj/q_a_layernorm/q_b_proj,
  // kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (and their biases when attention_bias).
  // `indexer` may be null (dense causal attention); it needs q_lora_rank > 0 (it reads q_resid).
  static std::unique_ptr<MlaMixer> load(Checkpoint& ckpt, const std::string& prefix, const MlaOptions& options,
                                        std::unique_ptr<DsaIndexer> indexer);

  Tensor forward(const Tensor& x, const Batch& batch, int layer) override;
  LayerCacheSpec cache_spec() const override;
  std::string name() const override { return indexer_ ? "mla+dsa" : "mla"; }
  // The cache of an MLA layer with these options, with a DSA indexer when `index` is not null.
  static LayerCacheSpec cache_spec_for(const MlaOptions& options, const DsaIndexerOptions* index);

  const MlaOptions& options() const { return options_; }
  // Mixer::store_rows: [kv_a_layernorm(c) | rope(k_rot)] of x at the batch's positions.
  void store_rows(const Tensor& x, const Batch& batch, int layer) const override;

 private:
  // This step's cache rows [T, latent + rot] of x: [kv_a_layernorm(c) | rope(k_rot)].
  Tensor cache_rows(const Tensor& x, const Batch& batch) const;
  // Writes new_rows into the layer's pages at the batch's positions.
  void write_rows(const Tensor& new_rows, const Batch& batch, int layer) const;
  // The attention core, the one entry point on either device: stores this step's cache rows (new_rows,
  // [T, latent + rot]) in the layer's pages and returns mixed [T, heads, kv_lora_rank] for the absorbed
  // queries q_abs [T, heads, latent + rot]. `selected` is the indexer's table (DsaIndexer::select), empty
  // without an indexer.
  Tensor attend(const Tensor& q_abs, const Tensor& new_rows, const Tensor& selected, const Batch& batch,
                int layer) const;
  // attend() under decode context parallelism (CPU): this rank stores and attends over its share of the
  // tokens for the query heads of its whole DCP group, and the group merges the shares by log-sum-exp.
  Tensor attend_context_parallel(const Tensor& q_abs, const Tensor& new_rows, const Tensor& selected,
                                 const Batch& batch, int layer) const;
  // Token-sharded prefill (CPU; model/context_parallel.h): every rank stores every row, the group trades
  // [all rows, my heads] of q_abs for [my rows, all heads] by an all-to-all, attends its pieces' rows for
  // every head (`selected`: the indexer's table of those rows, select_pieces), and a second all-to-all brings
  // back [all rows, my heads].
  Tensor attend_token_sharded(const Tensor& q_abs, const Tensor& new_rows, const Tensor& selected, const Batch& batch,
                              int layer, const std::vector<RowPiece>& pieces) const;

  MlaOptions options_;
  Tensor q_proj;          // [H * qk_head_dim, hidden]        (q_lora_rank = 0)
  Tensor q_a_proj;        // [q_lora_rank, hidden]            (q_lora_rank > 0)
  Tensor q_a_bias;        // [q_lora_rank]                    (attention_bias)
  Tensor q_a_norm;        // [q_lora_rank]
  Tensor q_b_proj;        // [H * qk_head_dim, q_lora_rank]
  Tensor kv_a_proj;       // [kv_lora_rank + qk_rope_head_dim, hidden]
  Tensor kv_a_bias;       // [kv_lora_rank + qk_rope_head_dim] (attention_bias)
  Tensor kv_a_norm;       // [kv_lora_rank]
  Tensor kv_b_proj;       // [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
  Tensor g_proj;          // [H * v_head_dim, hidden]           (output_gate)
  Tensor o_proj;          // [hidden, H * v_head_dim]
  Tensor o_bias;          // [hidden]                         (attention_bias)
  std::unique_ptr<DsaIndexer> indexer_;
  // Sharded: H above and options_.num_heads are this rank's heads (model/tensor_parallel.h), and forward()
  // sums o_proj's output over the group before the bias. Decode context parallel (tp.dcp_size > 1): the
  // latent pages hold every dcp_size-th token (model/context_parallel.h).
  TensorParallel tp;
  std::string prefix_;  // the weights' names start with it ("model.layers.N.self_attn."): LoRA modules (model/lora.h)
};

}  // namespace sparrow
