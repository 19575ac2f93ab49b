#include "runner/memory_profile.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cache/planner.h"
#include "core/device/device.h"
#include "core/error.h"
#include "kernels/ops.h"

namespace sparrow {

int64_t run_dummy_step(ModelRunner& runner, KvCache& cache, int64_t per_sequence, int64_t total, int64_t max_seqs,
                       int64_t logits_per_sequence) {
  std::vector<SeqId> ids;
  std::vector<SequenceState> states;
  states.reserve(size_t(std::max<int64_t>(max_seqs, 0)));  // `parts` points into it
  std::vector<std::pair<SequenceState*, std::vector<int32_t>>> parts;
  int64_t tokens = 0;
  while (tokens < total && int64_t(ids.size()) < max_seqs && cache.num_free_state_slots() > 0) {
    const int64_t n = std::min(per_sequence, total - tokens);
    const SeqId id = cache.create_sequence();
    ids.push_back(id);
    if (!cache.allocate(id, n)) break;  // a cache this small serves shorter steps only; run what fits
    states.emplace_back();
    states.back().cache = cache.view(id);
    std::vector<int32_t> prompt(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) prompt[size_t(i)] = int32_t((tokens + i) * 7919 % runner.model().vocab_size());
    parts.push_back({&states.back(), std::move(prompt)});
    tokens += n;
  }
  try {
    if (!parts.empty()) {
      Batch batch = make_batch(parts);
      batch.all_logits = false;
      for (SeqSlice& s : batch.seqs) s.logits = std::clamp<int64_t>(logits_per_sequence, 1, s.count);
      const Tensor logits = runner.run(batch);
      std::vector<TokenDraw> draws(size_t(batch.logit_rows()));
      ops::sample_tokens(logits, draws, {});
    }
  } catch (...) {
    for (SeqId id : ids) cache.free_sequence(id);
    throw;
  }
  for (SeqId id : ids) cache.free_sequence(id);
  return parts.empty() ? 0 : tokens;
}

CacheConfig dummy_step_cache_config(const Model& model, CacheConfig cache, int64_t max_num_seqs, int64_t per_sequence,
                                    int64_t total) {
  cache.max_num_seqs = std::min(max_num_seqs, (total + per_sequence - 1) / per_sequence);
  cache.device = model.device();
  cache.enable_prefix_caching = false;  // no snapshot slots: the step commits nothing
  cache.memory_bytes = int64_t(1) << 30;  // any budget: the plan's row and slot sizes do not depend on it
  const CachePlan plan = plan_cache(model.cache_spec(), cache);
  const int64_t block = plan.block_size;
  const int64_t rows = (total / per_sequence) * ((per_sequence + block - 1) / block) +
                       ((total % per_sequence) + block - 1) / block;
  cache.memory_bytes = rows * plan.row_bytes + plan.num_state_slots * plan.state_slot_bytes;
  return cache;
}

int64_t gpu_kv_cache_budget(double utilization, int64_t total_bytes, int64_t in_use_bytes, int64_t step_bytes,
                            int64_t graph_step_bytes) {
  SPARROW_CHECK(utilization > 0 && utilization <= 1, "--gpu-memory-utilization must be in (0, 1], got ", utilization);
  const int64_t budget = int64_t(utilization * double(total_bytes)) - in_use_bytes - step_bytes - graph_step_bytes;
  const auto gib = [](int64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f GiB", double(bytes) / double(int64_t(1) << 30));
    return std::string(text);
  };
  SPARROW_CHECK(budget > 0, "--gpu-memory-utilization ", utilization, " leaves nothing for the KV cache: of the GPU's ",
                gib(total_bytes), " (", gib(int64_t(utilization * double(total_bytes))), " allowed) the weights and the "
                "CUDA context hold ", gib(in_use_bytes), ", a full step's scratch takes ", gib(step_bytes),
                " and a decode step's in the CUDA graphs ", gib(graph_step_bytes),
                ": raise it, lower --max-num-batched-tokens or --max-num-seqs, or give --kv-cache-memory");
  return budget;
}

int64_t gpu_kv_cache_bytes(ModelRunner& runner, const CacheConfig& cache, const StepLimits& limits,
                           double utilization) {
  const Model& model = runner.model();
  SPARROW_CHECK(model.device() != Device::Cpu, "gpu_kv_cache_bytes: the model is on the CPU");
  // A step's scratch: the pool's peak while it runs in a cache just large enough, less what was live before.
  const auto scratch_of = [&](int64_t per_sequence, int64_t total, int64_t logits_per_sequence) {
    KvCache step_cache(model.cache_spec(),
                       dummy_step_cache_config(model, cache, limits.max_num_seqs, per_sequence, total));
    const int64_t with_cache = int64_t(device::bytes_in_use());
    device::reset_peak();
    run_dummy_step(runner, step_cache, per_sequence, total, limits.max_num_seqs, logits_per_sequence);
    return int64_t(device::peak_bytes()) - with_cache;
  };
  int64_t step = 0, graph_step = 0;
  try {
    step = scratch_of(std::min(limits.max_model_len, limits.max_num_batched_tokens), limits.max_num_batched_tokens, 1);
    // A decode step: one token a sequence, or with speculation k + 1 and as many rows of logits.
    const int64_t decode_rows = 1 + limits.speculative_tokens;
    graph_step = scratch_of(decode_rows, std::min(limits.max_num_seqs * decode_rows, limits.max_num_batched_tokens),
                            decode_rows);
  } catch (const std::exception& e) {
    fail("sizing the KV cache (--gpu-memory-utilization): a full engine step does not run beside the weights: ", e.what(),
         "; lower --max-num-batched-tokens");
  }
  device::release_cached_memory();  // the steps' blocks: counted in `step`, not in what the driver reports in use
  size_t free_bytes = 0, total_bytes = 0;
  device::memory_info(free_bytes, total_bytes);
  return gpu_kv_cache_budget(utilization, int64_t(total_bytes), int64_t(total_bytes - free_bytes), step, graph_step);
}

}  // namespace sparrow
