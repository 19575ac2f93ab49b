// Capacity planning without weights or a GPU (`sparrow kv-plan`): from a model's cache spec (its
// config.json alone: cache_spec_from_config) and the cache formats, how many bytes one token costs on
// each GPU of a tensor-parallel (TP) / decode-context-parallel (DCP) group, and how many tokens and
// full contexts fit in a per-GPU memory budget.
//
// What one GPU (rank) of TP N and DCP W keeps, per component (vLLM's behaviour):
//   mla_latent     replicated: every rank keeps the whole latent of the tokens it stores (MLA is one
//                  shared KV head; vLLM's ModelConfig.get_num_kv_heads returns 1 for MLA, and the Kimi
//                  seed: "TP 会在每块 GPU 上复制 MLA latent").
//   dsa_index_key  replicated: one key per token, no heads to divide (vLLM's DeepseekV32IndexerCache; the
//                  Kimi seed: "在张量并行（TP）下，两者都会复制到每块 GPU 上").
//   gqa_kv         divided: max(1, kv_heads / N) KV heads per rank (vLLM's get_num_kv_heads), so
//                  heads split down to one per rank and are replicated beyond that. kv_heads and N must
//                  divide one another.
//   msa_index_key  replicated: one shared index-key head per layer (the MiniMax seed's "单个共享索引键头").
//   KDA state      divided: its heads split across the N ranks (vLLM's KDA layer takes num_heads / N;
//                  the Kimi seed: "KDA 状态本来就按 head 拆分"), so a sequence's state costs 1/N per rank.
//   DCP            rank r of a DCP group of W stores every W-th token of the MLA latents and DSA index keys
//                  (token j on rank j mod W; the Kimi seed: "W 块 GPU 中的第 r 块存储每第 W 个 token"): their
//                  pages hold block_size / W rows (PageSpec::token_shards), the real planner's layout. W
//                  must divide N (vLLM's DCP reuses the TP ranks) and the block size; a model that caches
//                  other pages (GQA K/V, MSA keys) is refused. Recurrent state is per sequence, not per
//                  token: DCP does not divide it.
//
// Memory (per rank): each full context of max_model_len tokens costs its ceil(max_model_len / block_size)
// block rows (each row this rank's share of block_size tokens) plus one recurrent-state slot, so
// max_contexts = floor(memory / that). max_tokens is the tokens the group holds beside the states of those
// max_contexts sequences: floor((memory - max_contexts x state) / row) rows x block_size tokens. (A server
// also keeps prefix-cache snapshots and a slot for every --max-num-seqs sequence: `sparrow serve` prints
// its own plan.)
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cache/planner.h"

namespace sparrow {

struct KvPlanOptions {
  std::string kv_cache_dtype = "auto";    // as CacheConfig, auto meaning a GPU's default (bfloat16)
  std::string indexer_kv_dtype = "auto";  // as CacheConfig, auto meaning a GPU's (fp8 DSA keys)
  int64_t tensor_parallel_size = 1;
  int64_t decode_context_parallel_size = 1;
  int64_t memory_bytes = 0;  // per GPU, for the KV cache (pages and recurrent state)
  int64_t max_model_len = 0;
  int64_t block_size = 64;
};

struct KvPlan {
  // Bytes one token of context costs each rank, by component, then "total" (under DCP W: a 1 / W share).
  std::vector<std::pair<std::string, int64_t>> bytes_per_token;
  // Recurrent state one sequence costs on each rank, by component, then "total" (empty without any).
  std::vector<std::pair<std::string, int64_t>> state_bytes_per_sequence;
  std::string kv_dtype, index_dtype;  // the formats the pages got
  int64_t row_bytes = 0, state_slot_bytes = 0, block_size = 0;
  int64_t max_tokens = 0;    // tokens of context the whole DCP group holds
  int64_t max_contexts = 0;  // sequences of max_model_len tokens that fit at once
  KvPlanOptions options;

  // {"bytes_per_token": {<component>: n, ..., "total": n}, "max_tokens": n, "max_contexts": n}
  std::string json() const;
  std::string text() const;  // the same for people, with the state and the parallel layout
};

// The spec one rank keeps under TP N and DCP W (GQA K/V heads and KDA states divided, MLA and DSA pages
// token-sharded, as above); one-line errors for head counts N does not divide and for DCP on a model
// with other pages.
std::vector<LayerCacheSpec> spec_per_rank(const std::vector<LayerCacheSpec>& spec, int64_t tensor_parallel_size,
                                          int64_t decode_context_parallel_size = 1);

KvPlan plan_kv(const std::vector<LayerCacheSpec>& spec, const KvPlanOptions& options);

}  // namespace sparrow
