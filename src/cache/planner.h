// The cache planner: from what every layer caches (Model::cache_spec) and the cache settings, the
// layout of one block row, the size of one state slot, and how many of each fit in the budget.
//
// Block row (see docs/cache.md for a worked example). The per-token cache is a pool of block rows; a
// row holds, for block_size consecutive tokens of one sequence, every attention layer's pages, layer
// after layer and in each layer in the order of its spec (MLA latent, then DSA index key; GQA K/V, then
// MSA index key). A page is block_size tokens of one (layer, kind) in the codec's layout, so pages of
// one row have different sizes. Each page starts on a 64-byte boundary (a cache line; what vector
// loads and GPU copies want), and a row's size is a multiple of 64, so every page of every row is
// aligned. With float32 / bfloat16 and block sizes of 64 or more every page is already a multiple of
// 64 bytes, so the alignment adds no padding.
//
// State slot. Recurrent layers (KDA) keep a fixed-size state per sequence instead of rows per token:
// all their states (conv tail, then recurrent state, layer after layer, each 64-byte aligned, fp32)
// form one slot. There is a slot for each running sequence (max_num_seqs), and with prefix caching as
// many snapshot slots again: the state saved at a cached block boundary so that a prefix hit can
// resume the recurrence exactly there.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cache/page_codec.h"
#include "core/kv_layout.h"

namespace sparrow {

struct CacheConfig {
  int64_t block_size = 64;              // tokens per block: a power of two (the server offers 64, 128, 256)
  // --kv-cache-dtype: auto (float32 on the CPU, bfloat16 on a GPU) | float32 | bfloat16 | fp8 (= fp8_e4m3,
  // fp8_ds_mla) | fp8_per_tensor | nvfp4 (cache/page_codec.h: what each means for each page kind).
  std::string kv_cache_dtype = "auto";
  // The indexers' key pages (vLLM's --attention-config indexer_kv_dtype): float32 | bfloat16 (bf16) | fp8 |
  // mxfp4 | nvfp4, or auto: DSA keys in fp8 on a GPU (its scoring kernel reads FP8 keys), MSA keys in
  // the kv dtype on a GPU, and on the CPU both in the kv dtype's counterpart (fp8_per_tensor -> fp8).
  std::string indexer_kv_dtype = "auto";
  Device device = Device::Cpu;          // where the pool lives
  int64_t memory_bytes = 0;             // budget for block rows + state slots (--kv-cache-memory)
  double memory_fraction = 0.25;        // when memory_bytes is 0: this fraction of the RAM (of the free GPU memory)
  int64_t max_num_seqs = 64;            // state slots for running sequences (models with recurrent layers)
  bool enable_prefix_caching = true;
  // Speculative decoding on a model with recurrent layers: every running sequence may hold a rollback
  // snapshot (KvCache::mark_rollback), so the snapshot slots exist without prefix caching too.
  bool rollback_snapshots = false;
  // When > 0: exactly this many block rows, whatever the budget: vLLM's --num-gpu-blocks-override, and a
  // tensor-parallel worker's twin of rank 0's cache, whose block tables it is given (runner/step_plan.h).
  int64_t num_blocks = 0;
};

// Where one layer's page of one kind sits in every block row.
struct PagePlacement {
  int layer = 0;
  PageSpec spec;
  int64_t offset = 0;       // bytes from the start of the row
  int64_t rows = 0;         // rows a page holds: block_size, or block_size / token_shards for a DCP share
  int64_t page_bytes = 0;   // `rows` rows in the codec's layout
  int64_t token_bytes = 0;  // page_bytes / block_size: what one token of context costs this rank in this page
  const PageCodec* codec = nullptr;
};

// Where one layer's state of one kind sits in every state slot (always fp32).
struct StatePlacement {
  int layer = 0;
  StateSpec spec;
  int64_t offset = 0;  // bytes from the start of the slot
};

class CachePlan {
 public:
  CacheDtype dtype = CacheDtype::Float32;        // every page kind but the indexers'
  CacheDtype index_dtype = CacheDtype::Float32;  // DSA / MSA index keys
  Device device = Device::Cpu;
  int64_t block_size = 0;
  int64_t row_bytes = 0;           // one block row
  int64_t num_blocks = 0;          // rows in the pool
  int64_t state_slot_bytes = 0;    // one sequence's recurrent state (0: the model has none)
  int64_t num_state_slots = 0;     // for running sequences
  int64_t num_snapshot_slots = 0;  // for states saved at cached block boundaries (prefix caching)
  int64_t memory_bytes = 0;        // the budget the plan fills
  std::vector<PagePlacement> pages;    // in row order
  std::vector<StatePlacement> states;  // in slot order
  // Bytes per cached token by component ("mla_latent", "dsa_index_key", "gqa_kv", "msa_index_key":
  // summed over layers), then "total".
  std::vector<std::pair<std::string, int64_t>> bytes_per_token;
  // Bytes of recurrent state per sequence by component ("conv_tail", "recurrent"), then "total".
  std::vector<std::pair<std::string, int64_t>> state_bytes_per_sequence;

  int64_t max_tokens() const { return num_blocks * block_size; }
  // Sequences of max_model_len tokens that fit at once (blocks, and state slots when there are any).
  int64_t full_contexts(int64_t max_model_len) const;
  // The page of `kind` of `layer`, or null when the layer has none.
  const PagePlacement* page(int layer, PageKind kind) const;
  const StatePlacement* state(int layer, StateKind kind) const;
  // The byte layout of a block row and a state slot in one line (block size, sizes, formats, and a hash of every
  // page's and state's placement): two caches whose keys are equal hold the same bytes at the same offsets, so
  // a row of one is a row of the other (prefill/decode disaggregation copies rows between instances).
  std::string layout_key() const;
  // The start-up printout: bytes per token by component, the row, the state slots, and how many
  // tokens and full max_model_len contexts fit in the budget.
  std::string summary(int64_t max_model_len) const;

 private:
  friend CachePlan plan_cache(const std::vector<LayerCacheSpec>& spec, const CacheConfig& config);
  std::vector<int> page_lookup_;   // [layer * kNumPageKinds + kind] -> index into pages, -1 = none
  std::vector<int> state_lookup_;  // [layer * kNumStateKinds + kind] -> index into states, -1 = none
};

// vLLM's --attention-config JSON (an object), the keys sparrow takes: "indexer_kv_dtype" (the index keys'
// format, checked at once) and "indexer_decode_cp" (MSA's indexer decode context parallelism under tensor
// parallelism, docs/parallel.md; the model reads it at load, TensorParallel::indexer_decode_cp). Anything
// else, or malformed JSON, is a one-line error naming what is accepted.
struct AttentionConfig {
  std::string indexer_kv_dtype = "auto";
  bool indexer_decode_cp = false;
};
AttentionConfig parse_attention_config(const std::string& json);
// The cache's part of it (indexer_kv_dtype) applied to `config`.
void apply_attention_config(const std::string& json, CacheConfig& config);

// Throws a one-line sparrow::Error for settings it cannot plan (block size not a power of two,
// unknown dtype, a budget too small for one block and the state slots).
CachePlan plan_cache(const std::vector<LayerCacheSpec>& spec, const CacheConfig& config);

// 1234567 -> "1,234,567" (the printouts' numbers).
std::string grouped_digits(int64_t n);

// The budget when CacheConfig::memory_bytes is 0: memory_fraction of the machine's physical RAM.
int64_t cache_memory_budget(const CacheConfig& config);

}  // namespace sparrow
