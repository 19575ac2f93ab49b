// sparrow serve [MODEL_DIR] [flags]: the OpenAI-compatible HTTP server (src/server/server.h) over the
// serving engine. Flags take vLLM's names where vLLM has the same setting (`vllm serve --help`), so a
// vLLM command line mostly works unchanged. With no MODEL_DIR it serves the bundled default model.
//
// SIGTERM / SIGINT drain: new requests get 503, running ones may finish within --shutdown-timeout, the
// rest are aborted, then the process exits.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>
#include <type_traits>

#include "cache/planner.h"
#include "cli/commands.h"
#include "cli/vllm_flags.h"
#include "core/error.h"
#include "distributed/ucx_kv_transfer.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "formats/config.h"
#include "formats/quantization.h"
#include "model/model.h"
#include "runner/decode_graphs.h"
#include "server/parsers/parser.h"
#include "server/server.h"
#include "tokenizer/tokenizer.h"

namespace sparrow::cli {
namespace fs = std::filesystem;

namespace {

// "4GiB", "512MiB", "1.5GB", "100000": K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti powers of 1024; a
// trailing "B" is optional. `flag` names the flag in errors.
int64_t parse_byte_size(const std::string& flag, const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    fail(flag, ": '", text, "' is not a size (e.g. 4GiB, 512MiB, 2000000000)");
  }
  std::string unit = text.substr(used);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  const std::string prefixes = "KMGT";
  double scale = 1;
  if (!unit.empty()) {
    size_t power = prefixes.find(char(std::toupper(unit[0])));
    bool binary = unit.size() == 2 && (unit[1] == 'i' || unit[1] == 'I');
    SPARROW_CHECK(power != std::string::npos && (unit.size() == 1 || binary), flag, ": unknown unit in '", text,
                  "' (use K, M, G, T, Ki, Mi, Gi or Ti, with or without B)");
    scale = std::pow(binary ? 1024.0 : 1000.0, double(power + 1));
  }
  SPARROW_CHECK(value > 0, flag, " must be positive");
  return int64_t(value * scale);
}

nlohmann::json read_json_if_present(const fs::path& path) {
  if (!fs::exists(path)) return nlohmann::json::object();
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!j.is_discarded() && j.is_object(), path.string(), ": not a JSON object");
  return j;
}

// --generation-config auto: the model's generation_config.json supplies the default temperature,
// top_p, top_k, min_p and repetition_penalty of requests that do not set them, and max_new_tokens caps
// an unset max_tokens (vLLM's default behaviour); "vllm" ignores the file; a folder reads its file.
void apply_generation_config(const std::string& mode, const std::string& model_dir, server::ServingOptions& options) {
  if (mode == "vllm") return;
  SPARROW_CHECK(mode == "auto" || fs::is_directory(mode), "--generation-config ", mode,
                ": not a directory (expected auto, vllm, or a folder holding generation_config.json)");
  const fs::path path = fs::path(mode == "auto" ? model_dir : mode) / "generation_config.json";
  nlohmann::json config = read_json_if_present(path);
  SamplingParams& s = options.default_sampling;
  // Each default must fit its field (a float32 or an int64), as a request's own value must.
  auto number = [&](const char* key, auto& field) {
    using Field = std::decay_t<decltype(field)>;
    if (!config.contains(key) || !config[key].is_number()) return;
    double value = config[key].get<double>();
    bool fits = std::is_floating_point_v<Field> ? std::fabs(value) <= std::numeric_limits<float>::max()
                                                : value >= -9.2e18 && value <= 9.2e18;
    SPARROW_CHECK(fits, path.string(), ": \"", key, "\" is out of range (", config[key].dump(), ")");
    field = config[key].get<Field>();
  };
  number("temperature", s.temperature);
  number("top_p", s.top_p);
  number("top_k", s.top_k);
  number("min_p", s.min_p);
  number("repetition_penalty", s.repetition_penalty);
  if (config.contains("max_new_tokens") && config["max_new_tokens"].is_number_integer())
    options.default_max_tokens = config["max_new_tokens"].get<int64_t>();
}

struct ServeFlags {
  std::string model, host = "127.0.0.1", api_key, tool_call_parser, reasoning_parser, chat_template, speculative_config;
  std::vector<std::string> served_model_names;
  int64_t port = 8000;
  int64_t max_model_len = 0, block_size = 64, max_num_seqs = 64, max_num_batched_tokens = 2048;
  int64_t max_logprobs = kMaxLogprobs, max_queued_requests = 1024, num_gpu_blocks_override = 0;
  // The HTTP layer's limits (server/http/http_server.h).
  double http_header_timeout = 10, http_request_timeout = 60, http_keep_alive_timeout = 5;
  int64_t http_max_connections = 1024;
  std::string http_max_body_size = "32MiB";
  std::string kv_cache_dtype = "auto", attention_config, kv_cache_memory, generation_config = "auto", device = "cpu";
  double gpu_memory_utilization = 0;
  bool enable_auto_tool_choice = false, prefix_caching = true;
  bool disable_log_requests = false, enable_prompt_tokens_details = false, enable_request_id_headers = false;
  int64_t seed = -1;
  double shutdown_timeout = 30;
  LoraFlags lora;
  std::string limit_mm_per_prompt, allowed_local_media_path;  // images (docs/vision.md)
  std::string kv_transfer_config;  // prefill/decode disaggregation (docs/disaggregation.md)
};

// SIGTERM / SIGINT: the handler only writes the signal number to a pipe (all it may safely do, and it
// works whichever thread the signal lands on, OpenBLAS's included); a thread reads it and drains.
int stop_pipe[2] = {-1, -1};
extern "C" void on_stop_signal(int signal) {
  char byte = char(signal);
  [[maybe_unused]] ssize_t written = write(stop_pipe[1], &byte, 1);
}

// The HTTP flags, checked before the model loads: a mistake is one line at once, not after minutes.
server::ServerConfig server_config_from(const ServeFlags& flags) {
  SPARROW_CHECK(flags.port >= 0 && flags.port <= 65535, "--port must be in 0-65535 (got ", flags.port, ")");
  auto duration = [](const char* flag, double seconds, bool zero_allowed) {
    SPARROW_CHECK(std::isfinite(seconds) && seconds < 1e9 && (seconds > 0 || (zero_allowed && seconds == 0)), flag, " must be ",
                  zero_allowed ? "0 or more" : "more than 0", " seconds (got ", seconds, ")");
    return std::chrono::milliseconds(std::max<int64_t>(std::llround(seconds * 1000), seconds > 0 ? 1 : 0));
  };
  SPARROW_CHECK(flags.http_max_connections >= 1, "--http-max-connections must be at least 1");
  SPARROW_CHECK(flags.max_queued_requests >= 0, "--max-queued-requests must be 0 or more");
  server::ServerConfig config;
  config.http.host = flags.host;
  config.http.port = int(flags.port);
  config.http.header_timeout = duration("--http-header-timeout", flags.http_header_timeout, false);
  config.http.request_timeout = duration("--http-request-timeout", flags.http_request_timeout, false);
  config.http.keep_alive_timeout = duration("--http-keep-alive-timeout", flags.http_keep_alive_timeout, true);
  config.http.max_connections = size_t(flags.http_max_connections);
  config.http.max_body_bytes = size_t(parse_byte_size("--http-max-body-size", flags.http_max_body_size));
  config.http.log_requests = !flags.disable_log_requests;
  config.http.request_id_headers = flags.enable_request_id_headers;
  if (!flags.api_key.empty())
    config.api_key = flags.api_key;
  else if (const char* key = std::getenv("SPARROW_API_KEY"); key && *key)
    config.api_key = key;
  config.max_num_seqs = flags.max_num_seqs;
  config.max_queued_requests = flags.max_queued_requests;
  return config;
}

// The start-up summary, one block on stderr once the model is loaded and the cache planned: what is
// served and how (issue 27; vLLM logs the same facts across its start-up).
void print_start_summary(const std::string& model_dir, const server::ServingOptions& options, const Engine& engine,
                         bool on_gpu) {
  std::string out = "sparrow serve: model " + model_dir + ", served as '" + options.served_model_names.front() + "'";
  for (size_t i = 1; i < options.served_model_names.size(); ++i) out += ", '" + options.served_model_names[i] + "'";
  out += "\n";
  const Model& model = engine.model();
  std::string architecture;
  std::string quantization = "none (weights as stored)";
  try {
    Config config = Config::load(model_config_path(model_dir));
    if (config.has("architectures") && !config.json()["architectures"].empty())
      architecture = " (" + config.json()["architectures"][0].get<std::string>() + ")";
    QuantizationConfig q = read_quantization(std::filesystem::is_directory(model_dir) ? model_dir : ".", config);
    if (!q.method.empty())
      quantization = q.describe() + "; routed experts as " + weight_format_name(q.expert_packed()) +
                     ", other projections as " + weight_format_name(q.linear_packed());
  } catch (const std::exception& e) {
    quantization = std::string("unknown (") + e.what() + ")";
  }
  out += "sparrow serve: architecture " + model.model_type() + architecture + ", " + std::to_string(model.num_layers()) +
         " layers, vocabulary " + std::to_string(model.vocab_size()) + "\n";
  out += std::string("sparrow serve: weights computed in ") + (on_gpu ? "bfloat16 on the GPU" : "float32 on the CPU") +
         "; checkpoint quantization: " + quantization + "\n";
  out += "sparrow serve: parallel layout: " + cli_parallel_layout() + "\n";
  for (const auto& adapter : options.lora_adapters)
    out += "sparrow serve: LoRA adapter '" + adapter->name + "' (rank " + std::to_string(adapter->rank) + ", " +
           std::to_string(adapter->modules.size()) + " modules) from " + adapter->path + "\n";
  out += engine.cache_plan().summary(engine.max_model_len());
  if (out.back() != '\n') out += "\n";
  out += "sparrow serve: max_model_len " + std::to_string(engine.max_model_len()) + "\n";
  // Decode graphs are captured per step shape the second time it is seen (runner/decode_graphs.h), so none
  // exists yet at start.
  std::string graphs = !on_gpu                      ? "off (the CPU backend)"
                       : cli_runner_options().enforce_eager ? "off (--enforce-eager)"
                                                    : "decode and even verify steps of up to " +
                                                          std::to_string(DecodeGraphs::kMaxRows) +
                                                          " rows, each step shape captured the second time it "
                                                          "is seen (none yet)";
  out += "sparrow serve: CUDA graphs: " + graphs + "\n";
  const SpeculativeConfig& speculative = engine.config().speculative;
  if (speculative.enabled())
    out += "sparrow serve: speculative decoding: " + speculative.method +
           (speculative.model.empty() ? "" : " (" + speculative.model + ")") + ", " +
           std::to_string(speculative.num_speculative_tokens) + " draft tokens a step, " +
           (speculative.synthetic ? "synthetic acceptance at " + std::to_string(speculative.synthetic_acceptance_rate) +
                                        " a draft (a benchmark: the text is not the model's)"
                                  : std::string("lossless verification")) +
           "\n";
  std::fputs(out.c_str(), stderr);
}

void serve(const ServeFlags& flags) {
  server::ServerConfig server_config = server_config_from(flags);
  check_lora_flags(flags.lora);
  const SpeculativeConfig speculative = read_speculative_config(flags.speculative_config);
  std::string model_dir = flags.model.empty() ? default_model_dir() : flags.model;
  // A --max-model-len beyond the positions the model was trained for is refused before anything loads,
  // as vLLM refuses it (its VLLM_ALLOW_LONG_MAX_MODEL_LEN override has no sparrow equivalent).
  const std::optional<ModelPositions> positions = model_positions(model_dir);  // "not a directory" first
  if (flags.max_model_len > 0 && positions && flags.max_model_len > positions->tokens)
    fail("--max-model-len ", flags.max_model_len, " is more than the model's ", positions->tokens, " positions (",
         positions->key, " in ", model_config_path(model_dir), ")");
  SPARROW_CHECK(flags.block_size == 64 || flags.block_size == 128 || flags.block_size == 256,
                "--block-size must be 64, 128 or 256: the block sizes sparrow's packed cache rows and their kernels "
                "are built for (docs/cache.md); vLLM's default of 16 is not one of them");
  SPARROW_CHECK(flags.gpu_memory_utilization >= 0 && flags.gpu_memory_utilization <= 1,
                "--gpu-memory-utilization must be in (0, 1]");

  EngineConfig config;
  config.cache.block_size = flags.block_size;
  apply_cache_format_flags(flags.kv_cache_dtype, flags.attention_config, config.cache);
  config.cache.max_num_seqs = flags.max_num_seqs;
  config.cache.enable_prefix_caching = flags.prefix_caching;
  if (!flags.kv_cache_memory.empty()) config.cache.memory_bytes = parse_byte_size("--kv-cache-memory", flags.kv_cache_memory);
  config.cache.num_blocks = flags.num_gpu_blocks_override;
  const bool on_gpu = parse_device(flags.device) != Device::Cpu;
  if (flags.gpu_memory_utilization > 0 && !on_gpu) config.cache.memory_fraction = flags.gpu_memory_utilization;
  config.max_num_seqs = flags.max_num_seqs;
  config.max_num_batched_tokens = flags.max_num_batched_tokens;
  config.max_model_len = flags.max_model_len > 0 ? flags.max_model_len : model_context_length(model_dir);
  for (int32_t id : eos_token_ids(model_dir)) config.eos_token_ids.push_back(id);

  server::ServingOptions options;
  options.served_model_names =
      flags.served_model_names.empty() ? std::vector<std::string>{model_dir} : flags.served_model_names;
  options.model_path = model_dir;
  options.max_logprobs = flags.max_logprobs;
  options.tool_call_parser = flags.tool_call_parser;
  options.reasoning_parser = flags.reasoning_parser;
  options.enable_auto_tool_choice = flags.enable_auto_tool_choice;
  options.enable_prompt_tokens_details = flags.enable_prompt_tokens_details;
  apply_generation_config(flags.generation_config, model_dir, options);
  // Unknown parser names are refused at start, not at the first request.
  if (!options.tool_call_parser.empty()) parsers::make_tool_parser(options.tool_call_parser, nullptr);
  if (!options.reasoning_parser.empty()) parsers::make_reasoning_parser(options.reasoning_parser);
  SPARROW_CHECK(!flags.enable_auto_tool_choice || !flags.tool_call_parser.empty(),
                "--enable-auto-tool-choice needs --tool-call-parser");

  std::shared_ptr<const Tokenizer> tokenizer;
  try {
    tokenizer = load_tokenizer(model_dir);
  } catch (const Error& e) {
    std::fprintf(stderr, "sparrow serve: no tokenizer (%s): only token-id prompts will be served\n", e.what());
  }
  std::shared_ptr<const ChatTemplate> chat_template;
  // An explicit --chat-template must load (a typo is an error, not a silent fallback).
  if (tokenizer && !flags.chat_template.empty())
    chat_template = std::make_shared<ChatTemplate>(ChatTemplate::load(model_dir, flags.chat_template));
  if (tokenizer && !chat_template) {
    try {
      chat_template = std::make_shared<ChatTemplate>(ChatTemplate::load(model_dir));
    } catch (const Error& e) {
      std::fprintf(stderr, "sparrow serve: no chat template (%s): /v1/chat/completions is off\n", e.what());
    }
  }

  // With --data-parallel-size every group's leader gets here and runs an engine (engine/remote_groups.h).
  std::unique_ptr<Model> model = load_cli_model(model_dir, flags.device, GroupRole::EveryGroupServes);
  options.lora_adapters = load_cli_loras(flags.lora, model_dir, *model);
  options.images = server::make_image_serving(model_dir, model->vision(), tokenizer.get(), flags.limit_mm_per_prompt,
                                             flags.allowed_local_media_path);
  if (const char* runtime = std::getenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING"); runtime && flags.lora.enable)
    options.runtime_lora_updating = std::string(runtime) == "1" || std::string(runtime) == "true" ||
                                    std::string(runtime) == "True" || std::string(runtime) == "TRUE";
  options.lora_base_model = model_dir;
  options.max_lora_rank = flags.lora.max_lora_rank;
  options.max_loras = flags.lora.max_loras;
  // Declared before the engine, which drafts with it.
  const std::unique_ptr<Model> draft_model = load_draft_model(speculative, model_dir, flags.device, *model);
  config.speculative = speculative;
  config.draft_model = draft_model.get();
  // Prefill/decode disaggregation: the transfer agent, declared before the engine that uses it.
  std::unique_ptr<KvTransferAgent> kv_agent;
  if (!flags.kv_transfer_config.empty()) {
    const KvTransferConfig kv = parse_kv_transfer_config(flags.kv_transfer_config);
    SPARROW_CHECK(cli_single_process(), "--kv-transfer-config: disaggregation "
                  "pairs single-process instances so far (no --tensor-parallel-size or --data-parallel-size)");
    kv_agent = make_ucx_kv_transfer(kv.ip, kv.port, kv.advertise_host);
    config.kv_transfer = kv.settings;
    config.kv_transfer.agent = kv_agent.get();
    std::fprintf(stderr, "sparrow serve: kv transfer: %s (%s) on %s, reached at %s:%d, engine id %s\n", kv.role.c_str(),
                 kv.connector.c_str(), kv_agent->backend().c_str(), kv_agent->address().host.c_str(),
                 kv_agent->address().port, kv.settings.engine_id.c_str());
  }
  // On a GPU without --kv-cache-memory, vLLM's meaning of --gpu-memory-utilization (default 0.9): the cache
  // gets what the weights and two measured steps leave of that share of the GPU (gpu_kv_cache_bytes).
  config.runner = cli_runner_options();
  if (on_gpu && config.cache.memory_bytes == 0) {
    ModelRunner profile_runner(*model, config.runner);
    config.cache.memory_bytes = gpu_kv_cache_bytes(profile_runner, config.cache, config.step_limits(),
                                                   flags.gpu_memory_utilization > 0 ? flags.gpu_memory_utilization : 0.9);
  }
  // On a GPU one full step runs before the server listens (EngineCore::warm_up): a --kv-cache-memory that
  // leaves no room for a step's activations is refused here rather than failing requests.
  config.warm_up = on_gpu;
  if (cli_data_parallel_rank() != 0) {
    // Another group's leader: its engine serves the requests rank 0's server hands it, until rank 0 stops.
    Engine engine(std::move(model), tokenizer, config);
    serve_remote_group(engine, *cli_engine_links().at(0), options.lora_adapters);
    return;
  }
  Engine engine(std::move(model), tokenizer, config);
  if (config.runner.data_parallel) engine.serve_groups(cli_engine_links());
  print_start_summary(model_dir, options, engine, on_gpu);

  std::optional<uint64_t> seed;
  if (flags.seed >= 0) seed = uint64_t(flags.seed);
  server::ServingContext context(engine, tokenizer, chat_template, options, seed);
  server::Server server(context, server_config);
  int port = server.bind();
  // The handlers go in before the start-up line: whoever reads it may send SIGTERM at once.
  SPARROW_CHECK(pipe(stop_pipe) == 0, "cannot create a pipe");
  struct sigaction action = {};
  action.sa_handler = on_stop_signal;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  std::printf("sparrow serve: %s as '%s' on http://%s:%d (max_model_len %lld)\n", model_dir.c_str(),
              context.model_name().c_str(), flags.host.c_str(), port, (long long)engine.max_model_len());
  std::fflush(stdout);
  std::thread signal_waiter([&] {
    char signal = 0;
    if (read(stop_pipe[0], &signal, 1) != 1 || signal == 0) return;  // 0: the server stopped by itself
    std::fprintf(stderr, "sparrow serve: %s: draining (up to %.0f s)\n", strsignal(signal), flags.shutdown_timeout);
    server.drain(std::chrono::milliseconds(int64_t(flags.shutdown_timeout * 1000)));
  });
  server.listen();
  on_stop_signal(0);  // wakes the waiter if no signal came
  signal_waiter.join();
  std::fprintf(stderr, "sparrow serve: stopped\n");
}

}  // namespace

void add_serve(CLI::App& app) {
  auto* sub = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
  static ServeFlags f;
  sub->add_option("model", f.model, "Hugging Face model folder (default: the bundled model)");
  sub->add_option("--model", f.model, "the model folder, as a flag");
  add_device_option(sub, f.device);
  add_speculative_option(sub, f.speculative_config);
  sub->add_option("--kv-transfer-config", f.kv_transfer_config,
                  "prefill/decode disaggregation, vLLM's JSON: {\"kv_connector\": \"NixlConnector\", \"kv_role\": "
                  "\"kv_producer\" | \"kv_consumer\" | \"kv_both\", \"kv_ip\", \"kv_port\", ...} (docs/disaggregation.md)");
  sub->add_option("--host", f.host, "address to listen on")->capture_default_str();
  sub->add_option("--port", f.port, "port to listen on (0: any free port)")->capture_default_str();
  sub->add_option("--api-key", f.api_key,
                  "require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
                  "(default: $SPARROW_API_KEY)");
  sub->add_option("--served-model-name", f.served_model_names,
                  "model name(s) the API accepts; the first is reported (default: the model folder)");
  sub->add_option("--max-model-len", f.max_model_len, "context length: prompt + output (default: the model's)");
  sub->add_option("--tool-call-parser", f.tool_call_parser,
                  "tool-call format: kimi_k3, kimi_k2, minimax_m3, minimax_m2, deepseek_v32");
  sub->add_option("--reasoning-parser", f.reasoning_parser,
                  "reasoning format: kimi_k3, kimi_k2, minimax_m3, minimax_m2, deepseek_v32");
  sub->add_flag("--enable-auto-tool-choice,!--disable-auto-tool-choice,!--no-enable-auto-tool-choice", f.enable_auto_tool_choice,
                "let the model decide when to call tools (tool_choice \"auto\"); needs --tool-call-parser");
  sub->add_option("--chat-template", f.chat_template, "Jinja chat template file to use instead of the model's");
  sub->add_option("--block-size", f.block_size, "KV-cache block size in tokens: 64, 128 or 256")->capture_default_str();
  add_cache_format_options(sub, f.kv_cache_dtype, f.attention_config);
  add_lora_options(sub, f.lora);
  sub->add_option("--kv-cache-memory,--kv-cache-memory-bytes", f.kv_cache_memory,
                  "KV-cache budget in bytes, e.g. 4GiB or 512MiB (default: --gpu-memory-utilization)");
  sub->add_option("--num-gpu-blocks-override", f.num_gpu_blocks_override,
                  "exactly this many KV-cache block rows, whatever the memory budget says (vLLM's flag; for tests "
                  "and for comparing runs block for block, on the CPU backend too)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--gpu-memory-utilization,--device-memory-utilization", f.gpu_memory_utilization,
                  "on a GPU (vLLM's meaning): the fraction of the GPU's memory sparrow may hold, the KV cache getting "
                  "what the weights and a full step's measured scratch leave of it (default 0.9); on the CPU backend: "
                  "the fraction of the machine's RAM for the KV cache (default 0.25). Ignored with --kv-cache-memory");
  sub->add_option("--max-num-seqs", f.max_num_seqs, "most requests running at once")->capture_default_str();
  sub->add_option("--max-num-batched-tokens", f.max_num_batched_tokens,
                  "tokens per engine step (chunked prefill budget)")
      ->capture_default_str();
  sub->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching,!--disable-prefix-caching", f.prefix_caching,
                "reuse the KV cache of shared prompt prefixes (default: on)");
  sub->add_option("--generation-config", f.generation_config,
                  "request defaults: auto (the model's generation_config.json), vllm (none), or a folder")
      ->capture_default_str();
  sub->add_option("--seed", f.seed, "seed the random draws of requests that give no seed of their own");
  sub->add_option("--max-logprobs", f.max_logprobs, "largest logprobs / top_logprobs accepted")->capture_default_str();
  sub->add_option("--limit-mm-per-prompt", f.limit_mm_per_prompt,
                  "images a prompt may hold, as JSON: '{\"image\": N}' (default 999, vLLM's)");
  sub->add_option("--allowed-local-media-path", f.allowed_local_media_path,
                  "a folder whose files chat requests may name as file:// image URLs (default: none)");
  sub->add_option("--max-queued-requests", f.max_queued_requests,
                  "completions that may wait for the engine beyond --max-num-seqs; more get 503 with Retry-After")
      ->capture_default_str();
  sub->add_option("--http-header-timeout", f.http_header_timeout,
                  "seconds a request's line and header fields may take to arrive, from its first byte (a new "
                  "connection's first request: from the connection's opening); then 408 and close")
      ->capture_default_str();
  sub->add_option("--http-request-timeout", f.http_request_timeout,
                  "seconds a whole request (body included) may take to arrive, and a write to the client to complete")
      ->capture_default_str();
  sub->add_option("--http-keep-alive-timeout", f.http_keep_alive_timeout,
                  "seconds an idle keep-alive connection stays open (0: one request per connection)")
      ->capture_default_str();
  sub->add_option("--http-max-connections", f.http_max_connections,
                  "open connections; a newcomer at the cap replaces the slowest idle or incomplete one, else 503")
      ->capture_default_str();
  sub->add_option("--http-max-body-size", f.http_max_body_size, "largest request body (e.g. 32MiB); larger get 413")
      ->capture_default_str();
  sub->add_flag("--enable-prompt-tokens-details,!--disable-prompt-tokens-details,!--no-enable-prompt-tokens-details",
                f.enable_prompt_tokens_details,
                "report usage.prompt_tokens_details.cached_tokens");
  sub->add_flag("--disable-log-requests", f.disable_log_requests, "do not log each request on stderr");
  sub->add_flag("--enable-request-id-headers,!--disable-request-id-headers,!--no-enable-request-id-headers",
                f.enable_request_id_headers,
                "every response carries X-Request-Id: the client's own, else a generated one (as the access log names it)");
  sub->add_option("--shutdown-timeout", f.shutdown_timeout,
                  "seconds running requests may take to finish after SIGTERM before they are aborted")
      ->capture_default_str();
  const std::function<void()> check_vllm_flags = add_vllm_only_flags(sub);
  on_selected(sub, [check_vllm_flags] {
    check_vllm_flags();
    serve(f);
  });
}

}  // namespace sparrow::cli
