#include "cache/kv_plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace sparrow {

namespace {

// "a 1 + b 2" for a by-component list (its "total" left out).
std::string components(const std::vector<std::pair<std::string, int64_t>>& list) {
  std::string out;
  for (const auto& [name, bytes] : list)
    if (name != "total") out += (out.empty() ? "" : " + ") + name + " " + grouped_digits(bytes);
  return out;
}

int64_t total_of(const std::vector<std::pair<std::string, int64_t>>& list) {
  return list.empty() ? 0 : list.back().second;
}

}  // namespace

std::vector<LayerCacheSpec> spec_per_rank(const std::vector<LayerCacheSpec>& spec, int64_t tp, int64_t dcp) {
  SPARROW_CHECK(tp >= 1, "--tensor-parallel-size must be at least 1, got ", tp);
  SPARROW_CHECK(dcp >= 1 && tp % dcp == 0, "--decode-context-parallel-size ", dcp,
                " must divide --tensor-parallel-size ", tp, " (DCP shares the TP ranks)");
  std::vector<LayerCacheSpec> out = spec;
  for (size_t layer = 0; layer < out.size(); ++layer) {
    for (PageSpec& page : out[layer].pages) {
      if (page.kind == PageKind::MlaLatent || page.kind == PageKind::DsaIndexKey) {
        page.token_shards = dcp;  // every dcp-th token on each rank of a DCP group
        continue;
      }
      SPARROW_CHECK(dcp == 1, "--decode-context-parallel-size shards MLA latents and DSA index keys; layer ", layer,
                    " caches ", page_kind_name(page.kind), " pages");
      const int64_t heads = page.heads;
      SPARROW_CHECK(heads >= 1 && page.width % heads == 0, "layer ", layer, ": a K/V page of ", page.width,
                    " values does not split into ", heads, " heads");
      SPARROW_CHECK(heads % tp == 0 || tp % heads == 0, "--tensor-parallel-size ", tp, " and the model's ", heads,
                    " KV heads must divide one another");
      const int64_t per_rank = std::max<int64_t>(1, heads / tp);
      page.width = page.width / heads * per_rank;
      page.heads = per_rank;
    }
    for (StateSpec& state : out[layer].states) {
      SPARROW_CHECK(state.size % tp == 0, "layer ", layer, ": its ", state_kind_name(state.kind), " state (",
                    state.size, " floats) does not split across ", tp, " tensor-parallel ranks");
      state.size /= tp;
    }
  }
  return out;
}

KvPlan plan_kv(const std::vector<LayerCacheSpec>& spec, const KvPlanOptions& options) {
  const int64_t tp = options.tensor_parallel_size, dcp = options.decode_context_parallel_size;
  SPARROW_CHECK(dcp >= 1, "--decode-context-parallel-size must be at least 1, got ", dcp);
  SPARROW_CHECK(tp >= 1 && tp % dcp == 0, "--decode-context-parallel-size ", dcp,
                " must divide --tensor-parallel-size ", tp, " (DCP shares the TP ranks)");
  SPARROW_CHECK(options.memory_bytes > 0, "--memory must be positive");
  SPARROW_CHECK(options.max_model_len > 0, "--max-model-len must be positive, got ", options.max_model_len);

  // One rank's rows, planned as a GPU's cache (auto dtypes as on a GPU). One state slot and no prefix
  // snapshots: the slots are counted per context below.
  CacheConfig config;
  config.block_size = options.block_size;
  config.kv_cache_dtype = options.kv_cache_dtype;
  config.indexer_kv_dtype = options.indexer_kv_dtype;
  config.device = Device::Cuda;
  config.memory_bytes = options.memory_bytes;
  config.max_num_seqs = 1;
  config.enable_prefix_caching = false;
  const CachePlan rank = plan_cache(spec_per_rank(spec, tp, dcp), config);

  KvPlan plan;
  plan.options = options;
  plan.bytes_per_token = rank.bytes_per_token;
  plan.state_bytes_per_sequence = rank.state_bytes_per_sequence;
  plan.kv_dtype = cache_dtype_name(rank.dtype);
  plan.index_dtype = cache_dtype_name(rank.index_dtype);
  plan.row_bytes = rank.row_bytes;
  plan.state_slot_bytes = rank.state_slot_bytes;
  plan.block_size = rank.block_size;
  // A block row holds this rank's share of block_size tokens (under DCP, 1 / dcp of the MLA rows).
  const int64_t rows_per_context = (options.max_model_len + rank.block_size - 1) / rank.block_size;
  plan.max_contexts = options.memory_bytes / (rows_per_context * rank.row_bytes + rank.state_slot_bytes);
  const int64_t rows = (options.memory_bytes - plan.max_contexts * rank.state_slot_bytes) / rank.row_bytes;
  plan.max_tokens = rows * rank.block_size;
  return plan;
}

std::string KvPlan::json() const {
  nlohmann::ordered_json j;
  j["bytes_per_token"] = nlohmann::ordered_json::object();
  for (const auto& [name, bytes] : bytes_per_token) j["bytes_per_token"][name] = bytes;
  j["max_tokens"] = max_tokens;
  j["max_contexts"] = max_contexts;
  return j.dump();
}

std::string KvPlan::text() const {
  std::ostringstream out;
  char memory[32];
  std::snprintf(memory, sizeof memory, "%.2f GiB", double(options.memory_bytes) / double(int64_t(1) << 30));
  out << "kv plan: " << kv_dtype << " cache, " << index_dtype << " index keys, tensor parallel "
      << options.tensor_parallel_size << ", decode context parallel " << options.decode_context_parallel_size
      << ", " << block_size << "-token blocks, " << memory << " per GPU\n";
  out << "bytes per token of context, on each GPU: " << grouped_digits(total_of(bytes_per_token)) << " ("
      << components(bytes_per_token) << ")\n";
  if (!state_bytes_per_sequence.empty())
    out << "recurrent state per sequence, on every GPU: " << grouped_digits(total_of(state_bytes_per_sequence))
        << " (" << components(state_bytes_per_sequence) << ")\n";
  out << "fits: " << grouped_digits(max_tokens) << " tokens";
  if (options.decode_context_parallel_size > 1)
    out << " (each GPU stores one token in " << options.decode_context_parallel_size << ")";
  out << ", " << grouped_digits(max_contexts) << " full contexts of " << grouped_digits(options.max_model_len)
      << " tokens\n";
  return out.str();
}

}  // namespace sparrow
