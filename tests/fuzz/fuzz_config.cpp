// config.json as the model loaders read it before any weight: the typed Config, the cache each family's
// layers need (cache_spec_from_config), the engine's cache plan and `sparrow kv-plan`'s, and the roofline's
// model cost. A config that is wrong for its family must be refused with a sparrow::Error naming the field.
#include <cmath>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "bench/roofline.h"
#include "cache/kv_plan.h"
#include "cache/planner.h"
#include "formats/config.h"
#include "fuzz_util.h"
#include "model/model.h"

using namespace sparrow;

namespace {

// config.json comes from the operator's model folder, not from a client, and nothing bounds its sizes:
// 2^40 layers or a head_dim of 2^30 only make the fuzzer wait on huge loops and allocations. Numbers are
// clamped to +-2^20 (beyond any layer count, head or hidden size of a real model; products of three still
// fit in int64), so that the fuzzer spends its time on shapes and types.
void clamp_numbers(nlohmann::json& value) {
  constexpr double kLargest = double(1 << 20);
  if (value.is_number() && std::fabs(value.get<double>()) > kLargest)
    value = value.get<double>() < 0 ? -int64_t(kLargest) : int64_t(kLargest);
  if (value.is_structured())
    for (auto& element : value) clamp_numbers(element);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto json = nlohmann::json::parse(fuzz::as_text(data, size), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return 0;
  clamp_numbers(json);
  fuzz::refusing_only_with_errors([&] {
    const Config config(json, "config.json");
    const std::vector<LayerCacheSpec> spec = cache_spec_from_config(config);
    CacheConfig cache;
    cache.memory_bytes = int64_t(64) << 20;
    plan_cache(spec, cache);
    KvPlanOptions options;
    options.memory_bytes = int64_t(1) << 30;
    options.max_model_len = 4096;
    plan_kv(spec, options);
  });
  fuzz::refusing_only_with_errors([&] { bench::model_cost(Config(json, "config.json")); });
  return 0;
}
