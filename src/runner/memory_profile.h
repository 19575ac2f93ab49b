// How much of the GPU the KV cache may take (vLLM's --gpu-memory-utilization and profile run): sparrow
// may hold `utilization` of the GPU's memory, and the cache gets what is left of it once the weights and
// CUDA context (what the driver reports in use), one full step's scratch and one decode step's scratch
// (the CUDA graphs' pool) are counted. The two steps are run (dummy prompts in a cache just large
// enough, nothing kept) and measured by the device pool's peak.
#pragma once
#include <cstdint>

#include "cache/kv_cache.h"
#include "runner/model_runner.h"

namespace sparrow {

// The largest steps the scheduler will form (vLLM's --max-num-seqs, --max-num-batched-tokens,
// --max-model-len): what a memory profile must leave room for.
struct StepLimits {
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 2048;
  int64_t max_model_len = 0;  // prompt + generated tokens of one sequence
  // Speculative decoding's k: a decode step verifies up to k drafts a sequence, k + 1 rows with logits each.
  int64_t speculative_tokens = 0;
};

// The KV cache's bytes on the runner's GPU under `cache` (its format; its memory fields are ignored).
// Throws, naming the flags, when nothing is left.
int64_t gpu_kv_cache_bytes(ModelRunner& runner, const CacheConfig& cache, const StepLimits& limits,
                           double utilization);
// Its arithmetic, on numbers: utilization * total - in use - the two steps' scratch, or the error.
int64_t gpu_kv_cache_budget(double utilization, int64_t total_bytes, int64_t in_use_bytes, int64_t step_bytes,
                            int64_t graph_step_bytes);
// The cache a dummy step of `total` tokens in sequences of at most `per_sequence` (and at most
// `max_num_seqs` of them) runs in: just its blocks and state slots, no prefix caching.
CacheConfig dummy_step_cache_config(const Model& model, CacheConfig cache, int64_t max_num_seqs, int64_t per_sequence,
                                    int64_t total);

// One forward pass of `total` prompt tokens in sequences of at most `per_sequence` (and at most `max_seqs`
// of them), then the draw of a token for each of each sequence's last `logits_per_sequence` rows (a verify
// step of speculative decoding has k + 1), on `cache`; every sequence is freed again without committing its
// tokens (no prefix-cache entries). Returns the tokens run; rethrows the forward's error after freeing. (The
// engine's warm-up is one such step in its own cache.)
int64_t run_dummy_step(ModelRunner& runner, KvCache& cache, int64_t per_sequence, int64_t total, int64_t max_seqs,
                       int64_t logits_per_sequence = 1);

}  // namespace sparrow
