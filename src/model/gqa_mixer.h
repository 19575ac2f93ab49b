// MiniMax-M3's attention (transformers 5.17 MiniMaxM3VLAttention): grouped-query attention with
//   q = rope(rmsnorm_h(Wq x)),  k = rope(rmsnorm_h(Wk x)),  v = Wv x
// where rmsnorm_h is a Gemma-style RMSNorm (x̂ · (1 + w)) over head_dim applied to each head separately
// (one weight vector shared by all heads), and rope is NeoX's rotate-half on the first rot_dim dims of
// every head (rot_dim = head_dim · rope_parameters.partial_rotary_factor; the rest pass through).
// Softmax scale head_dim^-0.5, causal, no sliding window. Query head h reads kv head h / (H / H_kv).
// On MSA layers an MsaIndexer restricts each query to the key blocks it selects.
// The same block serves the Qwen3 DSpark drafter's layers (vLLM 0.33 model_executor/models/qwen3_dflash.py
// DFlashQwen3Attention; model/dspark.h): plain RMSNorm (x̂ · w) for the q/k norms, RoPE over the whole head
// (NeoX or, with is_neox_style false, GPT-J pairs), non-causal over a sequence's step, and an optional
// sliding window.
// Tensor parallel: each rank keeps its query heads, the kv heads and index heads they read (replicated when
// the group outnumbers them; model/tensor_parallel.h) and o_proj's matching columns; the counts below are
// this rank's, and forward() sums the output over the group.
//
// Cache (pages of this layer in the sequence's SequenceCache, one row per token):
//   GqaKeyValue: [K of kv head 0 .. H_kv-1 | V of kv head 0 .. H_kv-1], 2 · H_kv · head_dim floats;
//                K after the norm and the rotation, exactly what attention multiplies with.
//   MsaIndexKey: MSA layers only, the token's index key after its norm and rotation, index_head_dim floats.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "core/tensor.h"
#include "model/decoder.h"
#include "model/msa_indexer.h"
#include "model/rope.h"

namespace sparrow {

// Each norm.numel()-wide head of every row RMS-normalised (x̂ · w, or x̂ · (1 + w) with unit_offset), then its
// first rope.rot_dim() dims rotated by NeoX's rotate-half (or GPT-J's interleaved pairs), row t at
// positions[t]: ops::rms_norm_rope_heads_, one launch on a GPU.
void norm_and_rotate_heads(Tensor& x, const Tensor& norm, float eps, bool unit_offset, const Tensor& positions,
                           const Rope& rope, bool interleaved = false);

class GqaAttention : public Mixer {
 public:
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  float norm_eps = 1e-6f;
  Tensor q_proj;  // [heads * head_dim, hidden]
  Tensor k_proj;  // [kv_heads * head_dim, hidden]
  Tensor v_proj;  // [kv_heads * head_dim, hidden]
  Tensor o_proj;  // [hidden, heads * head_dim]
  Tensor q_norm;  // [head_dim]
  Tensor k_norm;  // [head_dim]
  Rope rope;
  bool unit_offset_norm = true;  // q/k norms x̂ · (1 + w) (MiniMax, Gemma-style); false: x̂ · w (Qwen3)
  bool rope_interleaved = false;  // GPT-J pairs instead of NeoX's halves
  // Every query of a sequence's step sees all of that step's rows, not only those up to its own position
  // (the DSpark drafter's block).
  bool non_causal = false;
  // > 0: a query at position q sees only keys at positions >= q - (sliding_window - 1) (FlashInfer's
  // window_left = sliding_window - 1; with non_causal there is no bound on the right within the step).
  int64_t sliding_window = 0;
  std::optional<MsaIndexer> indexer;  // set on MSA ("minimax_m3_sparse") layers
  TensorParallel tp;
  std::string prefix;  // the weights' names start with it ("model.layers.N.self_attn."): LoRA modules (model/lora.h)

  Tensor forward(const Tensor& x, const Batch& batch, int layer) override;
  LayerCacheSpec cache_spec() const override;
  std::string name() const override { return indexer ? "gqa+msa" : "gqa"; }
  // Mixer::store_rows: [rope(k_norm(k_proj x)) | v_proj x] of x at the batch's positions.
  void store_rows(const Tensor& x, const Batch& batch, int layer) const override;
  // The cache of a layer with these dimensions; index_head_dim 0 = no MSA indexer.
  static LayerCacheSpec cache_spec_for(int64_t kv_heads, int64_t head_dim, int64_t index_head_dim);

 private:
  // The attention core, the one entry point on either device: stores this step's K/V rows (k, v) in the
  // layer's pages and returns the attended rows [T, heads * head_dim]. `kept` is the MSA selection
  // (MsaIndexer::select) on MSA layers, empty otherwise.
  Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kept, const Batch& batch,
                int layer) const;
  // This step's K and V rows of x: k = rope(k_norm(k_proj x)), v = v_proj x.
  void key_value_rows(const Tensor& x, const Batch& batch, Tensor& k, Tensor& v) const;
  // Stores this step's K/V rows in the layer's pages.
  void write_rows(const Tensor& k, const Tensor& v, const Batch& batch, int layer) const;
};

}  // namespace sparrow
