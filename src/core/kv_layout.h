// The cache's vocabulary, shared by the floors that write, store and read it: what a layer caches
// (page kinds with their widths, recurrent-state kinds with their sizes), the byte formats of pages, and
// a paged cache's storage as kernels address it. The model declares what its layers need in these words
// (LayerCacheSpec), the cache (src/cache/) plans and stores them, kernels read PageFormat's layouts in
// place; none of them includes another's headers for it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace sparrow {

// Per-token rows, one row per token and layer. The row layout of each kind is documented at the block
// that writes it (mla.h, dsa_indexer.h, gqa_mixer.h).
enum class PageKind {
  MlaLatent,    // MLA: [kv_a_layernorm(c) | roped k_rot], kv_lora_rank + qk_rope_head_dim floats
  DsaIndexKey,  // DSA indexer key, index_head_dim floats
  GqaKeyValue,  // GQA: [K of every kv head | V of every kv head]
  MsaIndexKey,  // MSA indexer key, index_head_dim floats
};
inline constexpr int kNumPageKinds = 4;

// Per-sequence state of a recurrent layer (kda_mixer.h), fp32 whatever the cache dtype.
enum class StateKind {
  ConvTail,   // the last kernel-1 inputs of the short convolution
  Recurrent,  // the delta-rule state
};
inline constexpr int kNumStateKinds = 2;

// Short names for printouts and metrics: "mla_latent", "dsa_index_key", "gqa_kv", "msa_index_key";
// "conv_tail", "recurrent".
const char* page_kind_name(PageKind kind);
const char* state_kind_name(StateKind kind);

struct PageSpec {
  PageKind kind{};
  int64_t width = 0;       // floats per token
  int64_t rope_width = 0;  // MLA: how many of them (at the end) are the rotary key; codecs may keep those wider
  // GQA K/V: the KV heads the width holds (K and V of each), which tensor parallelism divides among GPUs
  // (cache/kv_plan.h); 1 for pages every GPU keeps whole (MLA latents, index keys).
  int64_t heads = 1;
  // Decode context parallelism (docs/parallel.md, "Decode context parallelism"): the page holds one rank's
  // share of the tokens, every token_shards-th (token j on rank j mod token_shards, at local row
  // j / token_shards), so a block of block_size tokens keeps block_size / token_shards rows of it. 1: whole.
  int64_t token_shards = 1;
  bool operator==(const PageSpec&) const = default;
};

struct StateSpec {
  StateKind kind{};
  int64_t size = 0;  // floats per sequence
  bool operator==(const StateSpec&) const = default;
};

// Everything one layer caches: at most one page of each kind and one state of each kind.
struct LayerCacheSpec {
  std::vector<PageSpec> pages;
  std::vector<StateSpec> states;
  const PageSpec* page(PageKind kind) const;     // null when the layer has no such page
  const StateSpec* state(StateKind kind) const;  // null when the layer has no such state
  bool operator==(const LayerCacheSpec&) const = default;
};

// The byte layout of a page, as kernels that read pages in place must know it (cache/page_codec.h
// owns the layouts and docs/cache.md draws them).
enum class PageFormat {
  Float32,      // rows of width floats
  BFloat16,     // rows of width bf16
  Fp8Latent,    // MLA latent, FlashMLA's layout: per token [NoPE e4m3 | fp32 scale per 128 | rope bf16]
  Fp8IndexKey,  // DSA index key: [block_size x width e4m3][block_size x fp32 scale] ("values then scales")
  Fp8Rows,      // rows of width e4m3, the layer's fp32 scale outside the page (1.0): MLA 576, GQA K/V, MSA key
  Nvfp4Latent,  // MLA latent: per token [NoPE e2m1 packed | rope e4m3 | NoPE e4m3 scale per 16] (352 B)
  Nvfp4Rows,    // [block_size x width/2 e2m1 packed][block_size x width/16 e4m3 scales]: GQA K/V, index keys
  Mxfp4Rows,    // [block_size x width/2 e2m1 packed][block_size x width/32 e8m0 scales]: index keys
};

// A paged cache's storage as kernels see it. Token j of a sequence's page of (layer, kind) is slot
// j % block_size of the page starting at pool() + page(layer, kind).offset + block_table[j / block_size]
// * row_bytes(): one block table serves every layer and kind.
class PagedStorage {
 public:
  struct Page {
    int64_t offset = 0;  // bytes from the start of a block row
    PageFormat format{};
  };
  virtual ~PagedStorage() = default;
  virtual Device device() const = 0;
  virtual std::byte* pool() const = 0;
  virtual int64_t row_bytes() const = 0;
  virtual int64_t block_size() const = 0;
  virtual Page page(int layer, PageKind kind) const = 0;
  // Where (layer, kind)'s recurrent state lies in a sequence's state slot (SequenceCache::state_slot),
  // in bytes; snapshot slots have the same layout.
  virtual int64_t state_offset(int layer, StateKind kind) const = 0;
};

}  // namespace sparrow
