#include "bench/workloads.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <numbers>

#include "core/base64.h"
#include "core/error.h"
#include "tokenizer/utf8.h"
#include "vision/image.h"

namespace sparrow::bench {
namespace {

// Without a tokenizer: short, frequent English words, which byte-level BPE vocabularies hold as one
// token each (with the leading space), so n words are close to n tokens.
const char* const kWords[] = {
    "the",    "of",    "and",   "to",     "in",    "is",    "that",  "for",   "it",    "as",    "was",   "with",
    "be",     "by",    "on",    "not",    "he",    "this",  "are",   "or",    "his",   "from",  "at",    "which",
    "but",    "have",  "an",    "had",    "they",  "you",   "were",  "their", "one",   "all",   "we",    "can",
    "her",    "has",   "there", "been",   "if",    "more",  "when",  "will",  "would", "who",   "so",    "no",
    "time",   "new",   "file",  "code",   "data",  "line",  "test",  "value", "name",  "list",  "type",  "error",
    "return", "call",  "input", "output", "state", "model", "table", "start", "end",   "first", "last",  "next",
    "number", "word",  "part",  "place",  "case",  "point", "group", "world", "year",  "work",  "system",
    "program", "set",  "open",  "read",   "write", "run",   "check", "make",  "find",  "use",   "show",  "change"};
constexpr int64_t kNumWords = int64_t(sizeof(kWords) / sizeof(kWords[0]));

// Tokens a chat template spends on one message's framing (role markers, separators): an estimate for
// the client-side count; the server's usage gives the real one.
constexpr int64_t kMessageOverhead = 4;
// JSON around one tool schema (keys, types, parameter), and a rendered tool call.
constexpr int64_t kToolSchemaOverhead = 40, kToolCallOverhead = 16;
// The fraction of turns followed by a tool result rather than a new user message. Public coding-agent
// traces show about 8 tool-triggered model calls per user request (docs/bench.md).
constexpr double kToolResultShare = 0.85;
// Log-space spreads of the lognormal length and think-time draws (docs/bench.md).
constexpr double kToolResultSigma = 1.4, kUserMessageSigma = 1.0, kOutputSigma = 0.6, kThinkSigma = 1.0;
// AgentX caps replayed idle gaps at 300 s.
constexpr int64_t kMaxThinkMs = 300000;

struct ToolSpec {
  const char* name;
  const char* parameter;
};
const ToolSpec kTools[] = {{"read_file", "path"},       {"write_file", "path"},       {"edit_file", "path"},
                           {"run_command", "command"}, {"search_code", "query"},     {"list_directory", "path"},
                           {"fetch_url", "url"},        {"update_plan", "plan"}};
constexpr int64_t kNumTools = int64_t(sizeof(kTools) / sizeof(kTools[0]));

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

Rng::Rng(uint64_t seed, uint64_t stream) {
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), uint32_t(stream), uint32_t(stream >> 32)};
  engine_.seed(seq);
}

void Rng::fill(uint8_t* out, size_t n) {
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t bits = engine_();
    for (size_t b = 0; b < 8 && i + b < n; ++b) out[i + b] = uint8_t(bits >> (8 * b));
  }
}

double Rng::uniform() { return double(engine_() >> 11) * 0x1.0p-53; }

int64_t Rng::integer(int64_t lo, int64_t hi) {
  return std::min(hi, lo + int64_t(uniform() * double(hi - lo + 1)));
}

double Rng::normal() {
  const double u1 = 1.0 - uniform(), u2 = uniform();  // u1 in (0, 1]
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

double Rng::gamma(double shape, double scale) {
  if (shape < 1) return gamma(shape + 1, scale) * std::pow(uniform(), 1.0 / shape);  // Marsaglia-Tsang's boost
  const double d = shape - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    const double x = normal();
    double v = 1.0 + c * x;
    if (v <= 0) continue;
    v = v * v * v;
    const double u = uniform();
    if (u < 1.0 - 0.0331 * x * x * x * x || std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v)))
      return d * v * scale;
  }
}

int64_t Rng::lognormal(double median, double sigma, int64_t lo, int64_t hi) {
  const double draw = median * std::exp(sigma * normal());
  return std::clamp(int64_t(std::llround(std::min(draw, 1e15))), lo, hi);
}

TextMaker::TextMaker(std::shared_ptr<const Tokenizer> tokenizer) : tokenizer_(std::move(tokenizer)) {
  if (!tokenizer_) return;
  // Tokens that are whole characters: their text re-encodes stably (byte fragments of a character
  // would decode to U+FFFD).
  for (TokenId id = 0; id < tokenizer_->vocab_size(); ++id) {
    const std::string* bytes = tokenizer_->token_bytes(id);
    if (bytes && !bytes->empty() && !tokenizer_->is_special(id) && utf8::is_valid(*bytes)) allowed_.push_back(id);
  }
  SPARROW_CHECK(!allowed_.empty(), "--tokenizer: the vocabulary has no ordinary tokens to make prompts of");
}

std::string TextMaker::make(Rng& rng, int64_t tokens, const std::string& before) const {
  std::string text;
  if (tokens <= 0) return text;
  if (!tokenizer_) {
    for (int64_t i = 0; i < tokens; ++i) (text += ' ') += kWords[rng.integer(0, kNumWords - 1)];
    return text;
  }
  auto random_id = [&] { return allowed_[size_t(rng.integer(0, int64_t(allowed_.size()) - 1))]; };
  std::vector<TokenId> ids = tokenizer_->encode(before);
  const size_t target = ids.size() + size_t(tokens);
  while (ids.size() < target) ids.push_back(random_id());
  // Neighbouring tokens may merge when the text is re-encoded (also across the seam with `before`):
  // trim or pad the end and retry until the count holds.
  for (int attempt = 0; attempt < 10; ++attempt) {
    text = tokenizer_->decode(ids);
    std::vector<TokenId> encoded = tokenizer_->encode(text);
    if (encoded.size() == target) break;
    const size_t kept = std::min(encoded.size(), target);
    encoded.resize(target);
    for (size_t i = kept; i < target; ++i) encoded[i] = random_id();
    ids = std::move(encoded);
    text = tokenizer_->decode(ids);
  }
  // Decoding reproduces `before` (whole characters) ahead of the new text.
  return text.compare(0, before.size(), before) == 0 ? text.substr(before.size()) : text;
}

int64_t TextMaker::count(const std::string& text, int64_t estimate) const {
  return tokenizer_ ? int64_t(tokenizer_->encode(text).size()) : estimate;
}

std::vector<Job> random_workload(const RandomOptions& o, const TextMaker& text) {
  SPARROW_CHECK(o.num_prompts > 0, "--num-prompts must be positive");
  SPARROW_CHECK(o.range_ratio >= 0 && o.range_ratio < 1, "--random-range-ratio must be in [0, 1)");
  SPARROW_CHECK(o.input_len >= 0 && o.prefix_len >= 0 && o.output_len > 0,
                "--random-input-len and --random-prefix-len must be >= 0, --random-output-len positive");
  const auto low = [&](int64_t n) { return int64_t(std::floor(double(n) * (1 - o.range_ratio))); };
  const auto high = [&](int64_t n) { return int64_t(std::ceil(double(n) * (1 + o.range_ratio))); };
  SPARROW_CHECK(o.prefix_len + low(o.input_len) >= 1, "--random-input-len / --random-prefix-len leave prompts empty");
  Rng rng(o.seed, 1);
  const std::string prefix = text.make(rng, o.prefix_len);
  std::vector<Job> jobs(size_t(o.num_prompts));
  for (Job& job : jobs) {
    const int64_t input = rng.integer(low(o.input_len), high(o.input_len));
    const int64_t output = rng.integer(std::max<int64_t>(1, low(o.output_len)), high(o.output_len));
    WorkItem item;
    item.prompt = prefix + text.make(rng, input, prefix);
    item.prompt_len = text.count(item.prompt, o.prefix_len + input);
    item.output_len = output;
    job.requests.push_back(std::move(item));
  }
  return jobs;
}

std::vector<ImageBucket> parse_image_buckets(const std::string& text) {
  // {(H, W, T): p, ...}: numbers only, so a small scanner reads it (whitespace anywhere).
  std::vector<ImageBucket> buckets;
  size_t at = 0;
  auto skip = [&] { while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at]))) ++at; };
  auto expect = [&](char c) {
    skip();
    SPARROW_CHECK(at < text.size() && text[at] == c, "--random-mm-bucket-config: expected '", c, "' at character ",
                  at, " of \"", text, "\" (vLLM's form: {(256, 256, 1): 0.5, (720, 1280, 1): 0.5})");
    ++at;
  };
  auto number = [&] {
    skip();
    size_t used = 0;
    double value = 0;
    try {
      value = std::stod(text.substr(at), &used);
    } catch (const std::exception&) {
      fail("--random-mm-bucket-config: expected a number at character ", at, " of \"", text, "\"");
    }
    at += used;
    return value;
  };
  expect('{');
  skip();
  while (at < text.size() && text[at] != '}') {
    ImageBucket b;
    expect('(');
    b.height = int64_t(number());
    expect(',');
    b.width = int64_t(number());
    expect(',');
    b.frames = int64_t(number());
    expect(')');
    expect(':');
    b.probability = number();
    SPARROW_CHECK(b.height > 0 && b.width > 0 && b.frames > 0 && b.probability >= 0,
                  "--random-mm-bucket-config: a bucket needs positive sizes and a probability >= 0");
    buckets.push_back(b);
    skip();
    if (at < text.size() && text[at] == ',') ++at;
    skip();
  }
  expect('}');
  return buckets;
}

int64_t parse_image_limit(const std::string& json) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(j.is_object(), "--random-mm-limit-mm-per-prompt must be JSON such as '{\"image\": 3}'");
  for (const auto& [modality, value] : j.items()) {
    SPARROW_CHECK(modality == "image" || modality == "video", "--random-mm-limit-mm-per-prompt: unknown modality '",
                  modality, "'");
    SPARROW_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0,
                  "--random-mm-limit-mm-per-prompt: limits are counts >= 0");
  }
  return j.value("image", int64_t(255));
}

std::vector<Job> random_mm_workload(const RandomOptions& o, const RandomMmOptions& mm, const TextMaker& text) {
  SPARROW_CHECK(mm.base_items >= 0 && mm.items_range_ratio >= 0 && mm.items_range_ratio <= 1,
                "--random-mm-base-items-per-request must be >= 0 and --random-mm-num-mm-items-range-ratio in [0, 1]");
  std::vector<ImageBucket> images;
  double total = 0;
  for (const ImageBucket& b : mm.buckets) {
    if (b.probability == 0) continue;
    SPARROW_CHECK(b.frames == 1, "--random-mm-bucket-config: (", b.height, ", ", b.width, ", ", b.frames,
                  ") is a video; sparrow's benchmark sends images only");
    images.push_back(b);
    total += b.probability;
  }
  const int64_t low = int64_t(std::floor(double(mm.base_items) * (1 - mm.items_range_ratio)));
  const int64_t high = std::min(mm.image_limit, int64_t(std::ceil(double(mm.base_items) * (1 + mm.items_range_ratio))));
  SPARROW_CHECK(low <= high, "random-mm: at least ", low, " images a prompt, but --random-mm-limit-mm-per-prompt "
                "allows ", mm.image_limit);
  SPARROW_CHECK(high == 0 || total > 0, "--random-mm-bucket-config gives no image bucket a probability");
  std::vector<Job> jobs = random_workload(o, text);
  Rng rng(o.seed, 3);
  vision::Image image;
  for (Job& job : jobs) {
    const int64_t count = rng.integer(low, high);
    for (int64_t i = 0; i < count; ++i) {
      double draw = rng.uniform() * total;
      size_t pick = 0;
      while (pick + 1 < images.size() && draw >= images[pick].probability) draw -= images[pick++].probability;
      image.height = images[pick].height;
      image.width = images[pick].width;
      image.rgb.resize(size_t(image.height * image.width * 3));
      rng.fill(image.rgb.data(), image.rgb.size());
      job.requests[0].images.push_back("data:image/jpeg;base64," + base64_encode(vision::encode_jpeg(image)));
    }
  }
  return jobs;
}

std::vector<Job> agentic_workload(const AgenticOptions& o, const TextMaker& text) {
  SPARROW_CHECK(o.sessions > 0 && o.max_turns > 0, "--agentic-sessions and --agentic-turns must be positive");
  SPARROW_CHECK(o.system_len >= 0 && o.append_len > 0 && o.output_len > 0 && o.think_time_ms >= 0,
                "--agentic-system-len, -append-len, -output-len and -think-time-ms must be positive");

  // The system prompt and tool schemas, shared by every session as they are by every user of one agent
  // (a third of the budget is the prompt, the rest about 200 tokens per tool, up to all eight tools).
  const int64_t tools_len = o.system_len * 2 / 3;
  const int64_t num_tools = std::clamp<int64_t>(tools_len / 200, 1, kNumTools);
  const int64_t description_len = std::max<int64_t>(1, tools_len / num_tools - kToolSchemaOverhead);
  const int64_t prompt_len = std::max<int64_t>(1, o.system_len - tools_len);
  Rng shared(o.seed, 2);
  const std::string system_prompt = text.make(shared, prompt_len);
  Json tools = Json::array();
  int64_t system_tokens = text.count(system_prompt, prompt_len) + kMessageOverhead;
  for (int64_t t = 0; t < num_tools; ++t) {
    const ToolSpec& spec = kTools[t];
    Json parameter = {{"type", "string"}, {"description", text.make(shared, 8)}};
    Json tool = {{"type", "function"},
                 {"function",
                  {{"name", spec.name},
                   {"description", text.make(shared, description_len)},
                   {"parameters",
                    {{"type", "object"},
                     {"properties", {{spec.parameter, std::move(parameter)}}},
                     {"required", {spec.parameter}}}}}}};
    system_tokens += text.count(tool.dump(), description_len + kToolSchemaOverhead);
    tools.push_back(std::move(tool));
  }

  const int64_t tool_lo = ceil_div(o.append_len, 10), tool_hi = 50 * o.append_len;
  const double user_median = std::max(1.0, double(o.append_len) / 3);
  const int64_t user_lo = ceil_div(o.append_len, 30), user_hi = 5 * o.append_len;
  const int64_t out_lo = ceil_div(o.output_len, 3), out_hi = ceil_div(10 * o.output_len, 3);

  std::vector<Job> jobs;
  for (int64_t s = 0; s < o.sessions; ++s) {
    Rng rng(o.seed, 1000 + uint64_t(s));  // one stream per session: a session does not depend on how many run
    Job job;
    job.tools = tools;
    job.messages = Json::array({{{"role", "system"}, {"content", system_prompt}}});
    int64_t context = system_tokens;
    auto append = [&](Json message, int64_t tokens) {
      job.messages.push_back(std::move(message));
      context += tokens + kMessageOverhead;
    };
    const int64_t task = rng.lognormal(user_median, kUserMessageSigma, user_lo, user_hi);
    append({{"role", "user"}, {"content", text.make(rng, task)}}, task);
    for (int64_t turn = 0; turn < o.max_turns; ++turn) {
      WorkItem item;
      item.output_len = rng.lognormal(double(o.output_len), kOutputSigma, out_lo, out_hi);
      if (context + item.output_len > o.max_context) break;  // a real agent would compact its context here
      item.messages = job.messages.size();
      item.prompt_len = context;
      if (turn > 0 && o.think_time_ms > 0)
        item.think_time_s = double(rng.lognormal(o.think_time_ms, kThinkSigma, 0, kMaxThinkMs)) / 1000;
      job.requests.push_back(item);

      // The recorded answer, then what the agent appends before its next turn.
      const bool tool_result = rng.uniform() < kToolResultShare;
      Json answer = {{"role", "assistant"}, {"content", text.make(rng, item.output_len)}};
      const std::string call_id = "call_" + std::to_string(turn);
      if (tool_result) {
        const ToolSpec& spec = kTools[rng.integer(0, num_tools - 1)];
        Json arguments = {{spec.parameter, text.make(rng, 6)}};
        answer["tool_calls"] = Json::array(
            {{{"id", call_id}, {"type", "function"}, {"function", {{"name", spec.name}, {"arguments", arguments.dump()}}}}});
      }
      append(std::move(answer), item.output_len + (tool_result ? kToolCallOverhead : 0));
      if (tool_result) {
        const int64_t n = rng.lognormal(double(o.append_len), kToolResultSigma, tool_lo, tool_hi);
        append({{"role", "tool"}, {"tool_call_id", call_id}, {"content", text.make(rng, n)}}, n);
      } else {
        const int64_t n = rng.lognormal(user_median, kUserMessageSigma, user_lo, user_hi);
        append({{"role", "user"}, {"content", text.make(rng, n)}}, n);
      }
    }
    if (!job.requests.empty()) jobs.push_back(std::move(job));
  }
  SPARROW_CHECK(!jobs.empty(), "--agentic-max-context ", o.max_context,
                " leaves no room for a first turn after the system prompt (about ", system_tokens, " tokens)");
  return jobs;
}

std::vector<double> arrival_times(int64_t n, double rate, double burstiness, uint64_t seed) {
  SPARROW_CHECK(rate > 0, "--request-rate must be positive (or inf)");
  SPARROW_CHECK(burstiness > 0, "--burstiness must be positive");
  std::vector<double> at(size_t(std::max<int64_t>(n, 0)), 0.0);
  if (std::isinf(rate) || at.empty()) return at;
  Rng rng(seed, 3);
  double t = 0;
  for (double& a : at) a = t += rng.gamma(burstiness, 1.0 / (rate * burstiness));
  // The sum of n random gaps misses n/rate by a few percent; scaling keeps runs of different seeds at
  // the same offered load.
  const double scale = double(n) / rate / at.back();
  for (double& a : at) a *= scale;
  return at;
}

}  // namespace sparrow::bench
