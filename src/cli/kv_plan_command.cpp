// sparrow kv-plan --model DIR [--kv-cache-dtype D] [--attention-config JSON] [--tensor-parallel-size N]
//   [--decode-context-parallel-size W] --memory GiB [--max-model-len L] [--block-size B] [--json]
// How many bytes a token costs per cache component on each GPU, and how many tokens and full contexts
// fit: from config.json alone (no weights: DIR may hold only a config, or be a shape config file such as
// bench/shapes/kimi_k3.1_pro.json). The rules per component are in src/cache/kv_plan.h.
#include <cstdio>

#include "cache/kv_plan.h"
#include "cli/commands.h"
#include "core/error.h"
#include "formats/config.h"
#include "model/model.h"

namespace sparrow::cli {

namespace {

struct KvPlanFlags {
  std::string model, kv_cache_dtype = "auto", attention_config;
  int64_t tensor_parallel_size = 1, decode_context_parallel_size = 1, max_model_len = 0, block_size = 64;
  double memory_gib = 0;
  bool json = false;
};

void kv_plan(const KvPlanFlags& flags) {
  SPARROW_CHECK(flags.memory_gib > 0, "--memory must be a positive number of GiB, got ", flags.memory_gib);
  CacheConfig cache;
  parse_cache_dtype(flags.kv_cache_dtype);  // names the accepted values
  if (!flags.attention_config.empty()) apply_attention_config(flags.attention_config, cache);
  KvPlanOptions options;
  options.kv_cache_dtype = flags.kv_cache_dtype;
  options.indexer_kv_dtype = cache.indexer_kv_dtype;
  options.tensor_parallel_size = flags.tensor_parallel_size;
  options.decode_context_parallel_size = flags.decode_context_parallel_size;
  options.memory_bytes = int64_t(flags.memory_gib * double(int64_t(1) << 30));
  options.max_model_len = flags.max_model_len > 0 ? flags.max_model_len : model_context_length(flags.model);
  options.block_size = flags.block_size;
  const Config config = Config::load(model_config_path(flags.model));
  const KvPlan plan = plan_kv(cache_spec_from_config(config), options);
  const std::string out = flags.json ? plan.json() + "\n" : plan.text();
  std::fputs(out.c_str(), stdout);
}

}  // namespace

void add_kv_plan(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "kv-plan", "Bytes per token by cache component, and the tokens and full contexts that fit per GPU (config.json alone)");
  sub->footer(
      "Per GPU (vLLM's rules): MLA latents and DSA / MSA index keys are whole on every tensor-parallel GPU; GQA K/V "
      "heads divide by --tensor-parallel-size (down to one head a GPU); KDA recurrent state divides by it too; "
      "--decode-context-parallel-size W stores every W-th token on each GPU. Recurrent state is per sequence: each "
      "full context costs its tokens' block rows plus one state, so max_contexts = memory / that, and max_tokens "
      "counts the tokens that fit beside the states of max_contexts sequences (docs/cache.md).");
  static KvPlanFlags f;
  sub->add_option("--model", f.model, "model folder (only config.json is read) or a shape config file")->required();
  sub->add_option("--kv-cache-dtype", f.kv_cache_dtype,
                  "auto (bfloat16, as on a GPU), float32, bfloat16, fp8 (= fp8_e4m3, fp8_ds_mla: 656-byte MLA "
                  "latents), fp8_per_tensor (576-byte MLA latents), nvfp4")
      ->capture_default_str();
  sub->add_option("--attention-config", f.attention_config,
                  "JSON, e.g. {\"indexer_kv_dtype\": \"mxfp4\"}: auto (fp8 DSA keys, MSA keys as the kv dtype), "
                  "float32, bfloat16, fp8, mxfp4, nvfp4");
  sub->add_option("--tensor-parallel-size", f.tensor_parallel_size, "GPUs the attention heads are split over")
      ->capture_default_str();
  sub->add_option("--decode-context-parallel-size", f.decode_context_parallel_size,
                  "GPUs the tokens are split over (divides --tensor-parallel-size)")
      ->capture_default_str();
  sub->add_option("--memory", f.memory_gib, "KV-cache memory per GPU, in GiB (pages and recurrent state)")->required();
  sub->add_option("--max-model-len", f.max_model_len, "tokens of one full context (default: the model's)");
  sub->add_option("--block-size", f.block_size, "tokens per cache block")->capture_default_str();
  sub->add_flag("--json", f.json,
                "print {\"bytes_per_token\": {<component>: n, ..., \"total\": n}, \"max_tokens\": n, "
                "\"max_contexts\": n}");
  on_selected(sub, [] { kv_plan(f); });
}

}  // namespace sparrow::cli
