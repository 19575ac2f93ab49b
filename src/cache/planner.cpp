#include "cache/planner.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/device/device.h"
#include "core/error.h"

namespace sparrow {

namespace {

constexpr int64_t kAlignment = 64;  // bytes: every page and state starts on a cache line

int64_t align_up(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

bool is_power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// Adds `bytes` to the entry `name` of a by-component list, creating it in first-seen order.
void add_to(std::vector<std::pair<std::string, int64_t>>& list, const std::string& name, int64_t bytes) {
  for (auto& [key, value] : list)
    if (key == name) {
      value += bytes;
      return;
    }
  list.emplace_back(name, bytes);
}

void append_total(std::vector<std::pair<std::string, int64_t>>& list) {
  int64_t total = 0;
  for (const auto& entry : list) total += entry.second;
  list.emplace_back("total", total);
}

std::string gib(int64_t bytes) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.2f GiB", double(bytes) / double(int64_t(1) << 30));
  return buffer;
}

// "a 1 + b 2" for the components of a by-component list (its "total" left out).
std::string components(const std::vector<std::pair<std::string, int64_t>>& list) {
  std::string out;
  for (const auto& [name, bytes] : list) {
    if (name == "total") continue;
    out += (out.empty() ? "" : " + ") + name + " " + grouped_digits(bytes);
  }
  return out;
}

int64_t total_of(const std::vector<std::pair<std::string, int64_t>>& list) {
  return list.empty() ? 0 : list.back().second;
}

}  // namespace

std::string grouped_digits(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

int64_t cache_memory_budget(const CacheConfig& config) {
  if (config.memory_bytes > 0) return config.memory_bytes;
  SPARROW_CHECK(config.memory_fraction > 0 && config.memory_fraction <= 1,
                "kv cache memory fraction must be in (0, 1], got ", config.memory_fraction);
  if (config.device == Device::Cuda) {
    size_t free_bytes = 0, total_bytes = 0;
    device::memory_info(free_bytes, total_bytes);
    return int64_t(double(free_bytes) * config.memory_fraction);
  }
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  return int64_t(ram * config.memory_fraction);
}

AttentionConfig parse_attention_config(const std::string& json) {
  AttentionConfig out;
  if (json.empty()) return out;
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!j.is_discarded() && j.is_object(), "--attention-config must be a JSON object, e.g. "
                "'{\"indexer_kv_dtype\": \"fp8\"}', got: ", json);
  for (const auto& [key, value] : j.items()) {
    SPARROW_CHECK(key == "indexer_kv_dtype" || key == "indexer_decode_cp", "--attention-config: unsupported key '",
                  key, "' (supported: indexer_kv_dtype, indexer_decode_cp)");
    if (key == "indexer_decode_cp") {
      SPARROW_CHECK(value.is_boolean(), "--attention-config: indexer_decode_cp must be true or false, got ", value.dump());
      out.indexer_decode_cp = value.get<bool>();
      continue;
    }
    SPARROW_CHECK(value.is_string(), "--attention-config: indexer_kv_dtype must be a string, got ", value.dump());
    const std::string name = value.get<std::string>();
    if (name != "auto") parse_indexer_kv_dtype(name);  // a one-line error naming the accepted values
    out.indexer_kv_dtype = name;
  }
  return out;
}

void apply_attention_config(const std::string& json, CacheConfig& config) {
  config.indexer_kv_dtype = parse_attention_config(json).indexer_kv_dtype;
}

CachePlan plan_cache(const std::vector<LayerCacheSpec>& spec, const CacheConfig& config) {
  SPARROW_CHECK(is_power_of_two(config.block_size), "kv cache block size must be a power of two, got ",
                config.block_size);
  SPARROW_CHECK(config.max_num_seqs > 0, "max_num_seqs must be positive, got ", config.max_num_seqs);
  CachePlan plan;
  plan.dtype = parse_cache_dtype(config.kv_cache_dtype, config.device);
  // The index keys' dtype when "auto": on a GPU, FP8 (the DSA scoring kernel reads FP8 keys); on the CPU
  // the kv dtype, whose index-key form of fp8_per_tensor is plain fp8.
  if (config.indexer_kv_dtype != "auto") plan.index_dtype = parse_indexer_kv_dtype(config.indexer_kv_dtype);
  else if (config.device != Device::Cpu) plan.index_dtype = CacheDtype::Fp8;
  else plan.index_dtype = plan.dtype == CacheDtype::Fp8PerTensor ? CacheDtype::Fp8 : plan.dtype;
  plan.device = config.device;
  plan.block_size = config.block_size;
  plan.page_lookup_.assign(spec.size() * kNumPageKinds, -1);
  plan.state_lookup_.assign(spec.size() * kNumStateKinds, -1);

  // The block row: every layer's pages in order, each on a 64-byte boundary.
  int64_t row = 0;
  for (size_t layer = 0; layer < spec.size(); ++layer) {
    for (const PageSpec& page : spec[layer].pages) {
      SPARROW_CHECK(page.width > 0, "layer ", layer, ": ", page_kind_name(page.kind), " page has no width");
      int& slot = plan.page_lookup_[layer * kNumPageKinds + int(page.kind)];
      SPARROW_CHECK(slot < 0, "layer ", layer, " has two ", page_kind_name(page.kind), " pages");
      PagePlacement p;
      p.layer = int(layer);
      p.spec = page;
      // Index keys take the indexer's dtype; "auto" means FP8 for DSA keys on a GPU (the indexer kernels read
      // them) and the cache's own dtype for MSA keys (the GPU MSA selector reads bf16).
      const bool explicit_index = config.indexer_kv_dtype != "auto";
      const bool index_key = page.kind == PageKind::DsaIndexKey || (page.kind == PageKind::MsaIndexKey && explicit_index);
      p.codec = &page_codec(index_key ? plan.index_dtype : plan.dtype, page.kind);
      SPARROW_CHECK(page.token_shards >= 1 && plan.block_size % page.token_shards == 0, "kv cache block size ",
                    plan.block_size, " does not split over ", page.token_shards,
                    " decode-context-parallel ranks (--block-size must be a multiple of -dcp)");
      p.rows = plan.block_size / page.token_shards;
      p.page_bytes = p.codec->page_bytes(page, p.rows);
      p.token_bytes = p.page_bytes / plan.block_size;
      p.offset = align_up(row);
      row = p.offset + p.page_bytes;
      slot = int(plan.pages.size());
      plan.pages.push_back(p);
      add_to(plan.bytes_per_token, page_kind_name(page.kind), p.token_bytes);
    }
  }
  plan.row_bytes = align_up(row);
  append_total(plan.bytes_per_token);
  SPARROW_CHECK(plan.row_bytes > 0, "the model caches nothing per token: there is no kv cache to plan");

  // The state slot: every recurrent layer's states in order, fp32, each on a 64-byte boundary.
  int64_t slot_bytes = 0;
  for (size_t layer = 0; layer < spec.size(); ++layer) {
    for (const StateSpec& state : spec[layer].states) {
      SPARROW_CHECK(state.size > 0, "layer ", layer, ": ", state_kind_name(state.kind), " state has no size");
      int& slot = plan.state_lookup_[layer * kNumStateKinds + int(state.kind)];
      SPARROW_CHECK(slot < 0, "layer ", layer, " has two ", state_kind_name(state.kind), " states");
      StatePlacement s;
      s.layer = int(layer);
      s.spec = state;
      s.offset = align_up(slot_bytes);
      slot_bytes = s.offset + state.size * int64_t(sizeof(float));
      slot = int(plan.states.size());
      plan.states.push_back(s);
      add_to(plan.state_bytes_per_sequence, state_kind_name(state.kind), state.size * int64_t(sizeof(float)));
    }
  }
  plan.state_slot_bytes = align_up(slot_bytes);
  if (!plan.state_bytes_per_sequence.empty()) append_total(plan.state_bytes_per_sequence);
  if (plan.state_slot_bytes > 0) {
    plan.num_state_slots = config.max_num_seqs;
    plan.num_snapshot_slots = config.enable_prefix_caching || config.rollback_snapshots ? config.max_num_seqs : 0;
  }

  // What is left of the budget after the state slots becomes block rows.
  const int64_t state_bytes = (plan.num_state_slots + plan.num_snapshot_slots) * plan.state_slot_bytes;
  plan.memory_bytes = config.num_blocks > 0 ? config.num_blocks * plan.row_bytes + state_bytes : cache_memory_budget(config);
  plan.num_blocks = (plan.memory_bytes - state_bytes) / plan.row_bytes;
  SPARROW_CHECK(plan.num_blocks >= 1, "kv cache memory ", grouped_digits(plan.memory_bytes), " bytes is too small: ",
                state_bytes > 0 ? cat(grouped_digits(state_bytes), " bytes of recurrent state slots and ") : std::string(),
                "at least one block row of ", grouped_digits(plan.row_bytes), " bytes are needed");
  return plan;
}

const PagePlacement* CachePlan::page(int layer, PageKind kind) const {
  if (layer < 0 || size_t(layer) * kNumPageKinds >= page_lookup_.size()) return nullptr;
  const int index = page_lookup_[layer * kNumPageKinds + int(kind)];
  return index < 0 ? nullptr : &pages[index];
}

const StatePlacement* CachePlan::state(int layer, StateKind kind) const {
  if (layer < 0 || size_t(layer) * kNumStateKinds >= state_lookup_.size()) return nullptr;
  const int index = state_lookup_[layer * kNumStateKinds + int(kind)];
  return index < 0 ? nullptr : &states[index];
}

int64_t CachePlan::full_contexts(int64_t max_model_len) const {
  const int64_t blocks_per_context = (max_model_len + block_size - 1) / block_size;
  int64_t contexts = blocks_per_context > 0 ? num_blocks / blocks_per_context : 0;
  if (state_slot_bytes > 0) contexts = std::min(contexts, num_state_slots);
  return contexts;
}

std::string CachePlan::summary(int64_t max_model_len) const {
  std::ostringstream out;
  out << "kv cache: " << cache_dtype_name(dtype);
  if (index_dtype != dtype) out << " (index keys " << cache_dtype_name(index_dtype) << ")";
  out << " on " << device_name(device) << ", " << block_size << "-token blocks, "
      << grouped_digits(total_of(bytes_per_token)) << " bytes per token (" << components(bytes_per_token) << ")\n";
  if (state_slot_bytes > 0) {
    out << "kv cache: recurrent state " << grouped_digits(total_of(state_bytes_per_sequence)) << " bytes per sequence ("
        << components(state_bytes_per_sequence) << "), " << num_state_slots << " running + " << num_snapshot_slots
        << " prefix snapshots\n";
  }
  out << "kv cache: " << gib(memory_bytes) << " holds " << grouped_digits(num_blocks) << " block rows of "
      << grouped_digits(row_bytes) << " bytes = " << grouped_digits(max_tokens()) << " tokens = "
      << grouped_digits(full_contexts(max_model_len)) << " full contexts of " << grouped_digits(max_model_len) << " tokens";
  return out.str();
}

std::string CachePlan::layout_key() const {
  // FNV-1a over the placements' numbers: the same build on both sides, so the same layout gives the same key.
  uint64_t hash = 0xcbf29ce484222325ull;
  auto mix = [&](int64_t v) {
    for (int b = 0; b < 8; ++b) hash = (hash ^ uint64_t((v >> (8 * b)) & 0xff)) * 0x100000001b3ull;
  };
  for (const PagePlacement& p : pages)
    for (int64_t v : {int64_t(p.layer), int64_t(p.spec.kind), p.spec.width, p.spec.rope_width, p.spec.heads,
                      p.spec.token_shards, p.offset, p.rows, p.page_bytes})
      mix(v);
  for (const StatePlacement& s : states)
    for (int64_t v : {int64_t(s.layer), int64_t(s.spec.kind), s.spec.size, s.offset}) mix(v);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)hash);
  return "block " + std::to_string(block_size) + ", row " + std::to_string(row_bytes) + " B, state " +
         std::to_string(state_slot_bytes) + " B, kv " + cache_dtype_name(dtype) + ", index " +
         cache_dtype_name(index_dtype) + ", layout " + hex;
}

}  // namespace sparrow
