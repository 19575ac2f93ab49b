#include "engine/speculative.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_input.h"
#include "engine/draft_model.h"
#include "engine/dspark_proposer.h"
#include "engine/mtp_proposer.h"
#include "engine/sequence.h"
#include "kernels/sampling_rule.h"
#include "model/dspark.h"
#include "model/mtp.h"

namespace sparrow {

namespace {

int64_t integer_key(const nlohmann::json& j, const std::string& key, int64_t min, int64_t max) {
  const nlohmann::json& v = j.at(key);
  SPARROW_CHECK(v.is_number_integer(), "--speculative-config: \"", key, "\" must be an integer, got ", v.dump());
  const int64_t n = v.get<int64_t>();
  SPARROW_CHECK(n >= min && n <= max, "--speculative-config: \"", key, "\" must be in [", min, ", ", max, "], got ", n);
  return n;
}

std::string string_key(const nlohmann::json& j, const std::string& key) {
  const nlohmann::json& v = j.at(key);
  SPARROW_CHECK(v.is_string(), "--speculative-config: \"", key, "\" must be a string, got ", v.dump());
  return v.get<std::string>();
}

// The longest draft a step may verify: past a few dozen tokens nothing is gained (acceptance decays
// geometrically) and a step's rows grow with it.
constexpr int64_t kMaxSpeculativeTokens = 32;

}  // namespace

SpeculativeConfig parse_speculative_config(std::string_view text) {
  const JsonInput<nlohmann::json> input = parse_json_input<nlohmann::json>(text);
  SPARROW_CHECK(input.ok() && input.value.is_object(),
                "--speculative-config must be a JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'");
  const nlohmann::json& j = input.value;
  // Keys vLLM's SpeculativeConfig takes that change nothing in sparrow (docs/speculative.md says why).
  static const std::set<std::string> ignored = {"quantization", "max_model_len", "revision", "code_revision",
                                                "draft_tensor_parallel_size", "disable_padded_drafter_batch",
                                                "enforce_eager", "disable_log_stats", "disable_by_batch_size",
                                                "enable_adaptive_verification"};
  static const std::set<std::string> used = {"method", "model", "num_speculative_tokens", "draft_sample_method",
                                             "prompt_lookup_min", "prompt_lookup_max", "rejection_sample_method",
                                             "synthetic_acceptance_rate", "synthetic_acceptance_length",
                                             "dspark_draft_topk"};
  SpeculativeConfig config;
  for (const auto& [key, value] : j.items()) {
    if (value.is_null()) continue;  // vLLM's None: the default
    if (ignored.count(key)) {
      config.ignored_keys.push_back(key);
      continue;
    }
    SPARROW_CHECK(used.count(key), "--speculative-config: unknown key \"", key,
                  "\" (sparrow reads method, model, num_speculative_tokens, draft_sample_method, prompt_lookup_min, "
                  "prompt_lookup_max; docs/speculative.md lists the vLLM keys it accepts and ignores)");
  }
  auto has = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };

  if (has("model")) config.model = string_key(j, "model");
  if (has("method")) config.method = string_key(j, "method");
  if (config.method == "[ngram]" || config.model == "[ngram]") config.method = "ngram", config.model.clear();
  if (config.method.empty()) {
    SPARROW_CHECK(!config.model.empty(), "--speculative-config needs \"method\" (ngram or draft_model) or a draft \"model\"");
    config.method = "draft_model";
  }
  if (config.method == "deepseek_mtp") config.method = "mtp";  // vLLM's older name
  for (const char* later : {"mimo_mtp", "ernie_mtp", "dflash", "eagle", "eagle3", "medusa", "mlp_speculator"})
    SPARROW_CHECK(config.method != later, "--speculative-config: method \"", config.method,
                  "\" is not built yet; sparrow runs \"ngram\", \"draft_model\", \"mtp\" and \"dspark\"");
  SPARROW_CHECK(config.method == "ngram" || config.method == "draft_model" || config.method == "mtp" ||
                    config.method == "dspark",
                "--speculative-config: unknown method \"", config.method,
                "\" (sparrow runs \"ngram\", \"draft_model\", \"mtp\" and \"dspark\")");

  SPARROW_CHECK(has("num_speculative_tokens"), "--speculative-config needs \"num_speculative_tokens\"");
  config.num_speculative_tokens = integer_key(j, "num_speculative_tokens", 1, kMaxSpeculativeTokens);

  if (has("draft_sample_method")) config.draft_sample_method = string_key(j, "draft_sample_method");
  SPARROW_CHECK(config.draft_sample_method == "greedy" || config.draft_sample_method == "probabilistic",
                "--speculative-config: draft_sample_method must be \"greedy\" or \"probabilistic\", got \"",
                config.draft_sample_method, "\"");
  SPARROW_CHECK(config.draft_sample_method == "greedy" || config.method == "draft_model" || config.method == "dspark",
                "--speculative-config: draft_sample_method \"probabilistic\" needs a draft with a distribution (method "
                "\"draft_model\" or \"dspark\"); ", config.method, "'s drafts are deterministic");

  // vLLM's rejection_sample_method: "strict" (the default: lossless) or "synthetic" (benchmarks).
  const std::string rule = has("rejection_sample_method") ? string_key(j, "rejection_sample_method") : "strict";
  SPARROW_CHECK(rule == "strict" || rule == "synthetic", "--speculative-config: rejection_sample_method \"", rule,
                "\" is not supported (\"strict\": lossless; \"synthetic\": benchmarks)");
  config.synthetic = rule == "synthetic";
  const bool rate = has("synthetic_acceptance_rate"), length = has("synthetic_acceptance_length");
  SPARROW_CHECK(config.synthetic == (rate || length) && !(rate && length),
                "--speculative-config: rejection_sample_method \"synthetic\" takes one of synthetic_acceptance_rate and "
                "synthetic_acceptance_length, and they belong to it alone");
  auto number = [&](const char* key, double min, double max) {
    SPARROW_CHECK(j[key].is_number(), "--speculative-config: \"", key, "\" must be a number, got ", j[key].dump());
    const double v = j[key].get<double>();
    SPARROW_CHECK(v >= min && v <= max, "--speculative-config: \"", key, "\" must be in [", min, ", ", max, "], got ", v);
    return v;
  };
  if (rate) config.synthetic_acceptance_rate = number("synthetic_acceptance_rate", 0, 1);
  if (length)
    config.synthetic_acceptance_rate = synthetic_rate_for_length(
        number("synthetic_acceptance_length", 1, double(config.num_speculative_tokens + 1)), config.num_speculative_tokens);

  if (has("dspark_draft_topk")) {
    SPARROW_CHECK(config.method == "dspark", "--speculative-config: dspark_draft_topk belongs to method \"dspark\"");
    config.dspark_draft_topk = integer_key(j, "dspark_draft_topk", 1, int64_t(1) << 30);
  }

  if (config.method == "ngram") {
    SPARROW_CHECK(config.model.empty(), "--speculative-config: method \"ngram\" takes no \"model\"");
    if (has("prompt_lookup_min")) config.prompt_lookup_min = integer_key(j, "prompt_lookup_min", 1, 1024);
    if (has("prompt_lookup_max")) config.prompt_lookup_max = integer_key(j, "prompt_lookup_max", 1, 1024);
    // vLLM's defaults (config/speculative.py): 5 and 5, or the one given for both.
    if (!config.prompt_lookup_min && !config.prompt_lookup_max) config.prompt_lookup_min = config.prompt_lookup_max = 5;
    if (!config.prompt_lookup_min) config.prompt_lookup_min = config.prompt_lookup_max;
    if (!config.prompt_lookup_max) config.prompt_lookup_max = config.prompt_lookup_min;
    SPARROW_CHECK(config.prompt_lookup_min <= config.prompt_lookup_max, "--speculative-config: prompt_lookup_min (",
                  config.prompt_lookup_min, ") exceeds prompt_lookup_max (", config.prompt_lookup_max, ")");
  } else if (config.method == "mtp") {
    // The target's own layers: vLLM accepts the target's folder as "model" too.
    SPARROW_CHECK(!has("prompt_lookup_min") && !has("prompt_lookup_max"),
                  "--speculative-config: prompt_lookup_min / prompt_lookup_max belong to method \"ngram\"");
    SPARROW_CHECK(config.draft_sample_method == "greedy", "--speculative-config: method \"mtp\" drafts greedily");
  } else {
    SPARROW_CHECK(!config.model.empty(), "--speculative-config: method \"", config.method,
                  "\" needs \"model\" (a local folder)");
    SPARROW_CHECK(!has("prompt_lookup_min") && !has("prompt_lookup_max"),
                  "--speculative-config: prompt_lookup_min / prompt_lookup_max belong to method \"ngram\"");
  }
  return config;
}

std::vector<int32_t> ngram_proposal(std::span<const int32_t> tokens, int64_t min_n, int64_t max_n, int64_t k) {
  const int64_t length = int64_t(tokens.size());
  if (k <= 0 || length < min_n + 1) return {};
  // Scan earlier end points from the most recent: the match ending at `end` (exclusive) has length n when
  // tokens[end - n .. end) equals the last n tokens. Keep the longest (ties: the most recent).
  int64_t best_n = 0, best_end = 0;
  for (int64_t end = length - 1; end >= min_n; --end) {
    int64_t n = 0;
    while (n < max_n && n < end && tokens[size_t(end - 1 - n)] == tokens[size_t(length - 1 - n)]) ++n;
    if (n >= min_n && n > best_n) {
      best_n = n;
      best_end = end;
      if (n == max_n) break;
    }
  }
  if (best_n == 0) return {};
  const int64_t count = std::min(k, length - best_end);
  return {tokens.begin() + best_end, tokens.begin() + best_end + count};
}

namespace {

class NgramProposer final : public DraftProposer {
 public:
  NgramProposer(int64_t min_n, int64_t max_n) : min_n_(min_n), max_n_(max_n) {}
  void propose(std::span<Sequence* const> seqs, std::span<const int64_t> max_tokens) override {
    for (size_t i = 0; i < seqs.size(); ++i)
      seqs[i]->draft = ngram_proposal(seqs[i]->tokens, min_n_, max_n_, max_tokens[i]);
  }

 private:
  int64_t min_n_, max_n_;
};

}  // namespace

std::unique_ptr<DraftProposer> make_draft_proposer(const SpeculativeConfig& config, Model* draft_model,
                                                   bool enforce_eager) {
  if (config.method == "ngram") return std::make_unique<NgramProposer>(config.prompt_lookup_min, config.prompt_lookup_max);
  if (config.method == "mtp") {
    auto* drafter = dynamic_cast<MtpDrafter*>(draft_model);
    SPARROW_CHECK(drafter != nullptr, "speculative decoding: method \"mtp\" without the checkpoint's MTP layer loaded");
    return make_mtp_proposer(*drafter, enforce_eager);
  }
  if (config.method == "dspark") {
    auto* drafter = dynamic_cast<DSparkDrafter*>(draft_model);
    SPARROW_CHECK(drafter != nullptr, "speculative decoding: method \"dspark\" without its drafter loaded");
    return make_dspark_proposer(*drafter, config.draft_sample_method == "probabilistic", config.dspark_draft_topk);
  }
  SPARROW_CHECK(config.method == "draft_model", "speculative decoding: unknown method \"", config.method, "\"");
  SPARROW_CHECK(draft_model != nullptr, "speculative decoding: method \"draft_model\" without a loaded draft model");
  return make_draft_model_proposer(*draft_model, config.draft_sample_method == "probabilistic", enforce_eager);
}

int32_t draw_draft_token(Sequence& seq, std::span<const float> logits) {
  // A salt that gives the drafts' draws keys apart from the target's (Sampler::key).
  constexpr uint64_t kDraftDraws = 0x5EC0'0003'C01D'5EEDull;
  const double temperature = seq.params().temperature;
  const int64_t vocab = int64_t(logits.size());
  double top = -std::numeric_limits<double>::infinity();
  for (float l : logits) top = std::max(top, double(l) / temperature);
  std::vector<double> weight(logits.size());
  double total = 0;
  for (int64_t t = 0; t < vocab; ++t) total += weight[size_t(t)] = std::exp(double(logits[size_t(t)]) / temperature - top);
  const uint64_t key = mix64(seq.sampler.key(seq.num_output() + int64_t(seq.draft.size())) ^ kDraftDraws);
  int32_t best = 0;
  double best_key = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < vocab; ++t) {
    const double q = weight[size_t(t)] / total;
    seq.draft_probs.push_back(float(q));
    if (q <= 0) continue;
    const double gumbel_key = std::log(q) - std::log(-std::log(uniform_at(key, t)));
    if (gumbel_key > best_key) best_key = gumbel_key, best = int32_t(t);
  }
  return best;
}

int32_t verify_draft_token(std::span<const double> p, std::span<const float> q, int32_t draft, uint64_t key) {
  SPARROW_CHECK(p.size() == q.size() && draft >= 0 && size_t(draft) < p.size(), "verification: draft ", draft,
                " against distributions of ", p.size(), " and ", q.size(), " tokens");
  // Index vocab (past every token's) keys the coin; the residual's Gumbel draw uses the token ids.
  const double u = uniform_at(key, int64_t(p.size()));
  if (p[size_t(draft)] >= u * double(q[size_t(draft)])) return -1;
  int32_t best = -1;
  double best_key = -std::numeric_limits<double>::infinity();
  for (size_t t = 0; t < p.size(); ++t) {
    const double residual = p[t] - double(q[t]);
    if (!(residual > 0)) continue;
    const double gumbel_key = std::log(residual) - std::log(-std::log(uniform_at(key, int64_t(t))));
    if (gumbel_key > best_key) best_key = gumbel_key, best = int32_t(t);
  }
  // p(d) < u·q(d) <= q(d) leaves some residual mass: the draft's own token has p < q, so another has p > q.
  SPARROW_CHECK(best >= 0, "verification: no residual probability (p and q are not distributions)");
  return best;
}

double synthetic_rate_for_length(double length, int64_t k) {
  SPARROW_CHECK(k >= 1 && length >= 1 && length <= double(k + 1), "synthetic acceptance length ", length,
                " outside [1, ", k + 1, "]");
  auto mean = [&](double r) {
    double sum = 1, power = 1;
    for (int64_t i = 0; i < k; ++i) sum += power *= r;
    return sum;
  };
  double low = 0, high = 1;  // mean is increasing in r
  for (int i = 0; i < 60; ++i) (mean((low + high) / 2) < length ? low : high) = (low + high) / 2;
  return (low + high) / 2;
}

int64_t synthetic_accepted(int64_t k, double rate, uint64_t key) {
  int64_t accepted = 0;
  while (accepted < k && uniform_at(key, accepted) <= rate) ++accepted;
  return accepted;
}

int64_t accepted_draft_tokens(std::span<const int32_t> drafts, std::span<const int32_t> target) {
  SPARROW_CHECK(target.size() == drafts.size() + 1, "verification: ", target.size(), " target tokens for ",
                drafts.size(), " drafts");
  int64_t accepted = 0;
  while (accepted < int64_t(drafts.size()) && drafts[size_t(accepted)] == target[size_t(accepted)]) ++accepted;
  return accepted;
}

}  // namespace sparrow
