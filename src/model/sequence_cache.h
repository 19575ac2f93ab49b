// What a layer keeps between steps, and the one door through which it reads and writes it.
//
// Layers never own their cache. Each sequence comes with a SequenceCache; a layer writes the rows of
// its new tokens, gathers the rows a step needs into a contiguous fp32 buffer, and reaches its
// recurrent state through it. Two implementations exist:
//   - DenseSequenceCache (model/dense_sequence_cache.h): growable fp32 buffers owned by the sequence,
//     for offline use (Model::new_sequence: tests, `sparrow score`, `sparrow generate`);
//   - the serving engine's paged cache (cache/kv_cache.h): rows packed into block rows of a shared
//     pool in the cache dtype, state in per-request slots.
// The model math is the same on both: only where the rows live differs.
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

// One sequence's cache, as the model sees it. Positions are absolute token positions of the sequence.
class SequenceCache {
 public:
  virtual ~SequenceCache() = default;

  // Stores the rows (count x width floats, row-major) of tokens pos .. pos+count-1 in `layer`'s page.
  virtual void write(int layer, PageKind page, int64_t pos, int64_t count, const float* rows) = 0;
  // Gathers the rows of tokens begin .. end-1 into `rows` ((end-begin) x width floats), as fp32.
  virtual void read(int layer, PageKind page, int64_t begin, int64_t end, float* rows) const = 0;
  // The layer's state of `kind` (size floats from the spec; zeros for a fresh sequence), read and
  // updated in place.
  virtual float* state(int layer, StateKind kind) = 0;

  // Recurrent layers and prefix caching. A prefix-cache hit can only resume a recurrent layer where
  // its state was saved, so while the model runs positions [begin, end) the cache may ask for a copy
  // of every recurrent state as it stands after position p-1, for one p in (begin, end]:
  // snapshot_position returns that p, or -1 (the default: no snapshot). It answers the same for every
  // layer of a step. A recurrent layer then runs up to p, copies its state into snapshot(layer, kind),
  // and continues.
  virtual int64_t snapshot_position(int64_t begin, int64_t end) { return -1; }
  virtual float* snapshot(int layer, StateKind kind);

  // Paged caches: the storage and this sequence's block table, for kernels that address pages
  // directly (the GPU path); null / empty for caches without pages (DenseSequenceCache).
  virtual const PagedStorage* paged() const { return nullptr; }
  virtual const std::vector<int32_t>& block_table() const;
  // Paged caches with recurrent layers: the start of this sequence's state slot, and of the snapshot
  // slot this step's snapshot_position reserved (null when there is none), on the storage's device; a
  // layer's state lies paged()->state_offset(layer, kind) bytes in. Kernels update states through them.
  virtual std::byte* state_slot() { return nullptr; }
  virtual std::byte* snapshot_slot() { return nullptr; }
  // Makes room for tokens 0 .. tokens-1 where the cache allocates on demand (standalone sequences
  // of a paged cache); the serving engine allocates ahead of each step and this is then a check.
  virtual void reserve(int64_t tokens) {}
};

}  // namespace sparrow
