// The table of vllm_flags.h and the check that reports the flags given.
#include "cli/vllm_flags.h"

#include <algorithm>
#include <cstdio>
#include <memory>

#include "core/error.h"

namespace sparrow::cli {

namespace {

constexpr VllmFlagAction kIgnore = VllmFlagAction::Ignore;
constexpr VllmFlagAction kRefuse = VllmFlagAction::Refuse;

// Reasons shared by several flags.
const char* const kNoPython = "sparrow's model code is built in: nothing from the model folder or a plugin is run";
const char* const kLocalOnly =
    "sparrow serves local model folders only and downloads nothing (fetch the checkpoint first, e.g. with "
    "`huggingface-cli download`)";
const char* const kGraphs =
    "sparrow captures CUDA graphs for its decode steps itself (--enforce-eager turns them off); there is no "
    "torch.compile stage to configure";
const char* const kNoTls = "sparrow serves plain HTTP: put a TLS-terminating proxy in front of it";
const char* const kNoCors = "sparrow sends no CORS headers: browsers on other origins need a proxy that adds them";
const char* const kNoLora = "LoRA adapters are not supported yet (issue 29)";
const char* const kNoSpec = "speculative decoding is not supported yet (issue 26)";
const char* const kNoImages = "sparrow serves text only: the vision towers are not loaded yet (issue 30)";
const char* const kNoStructured = "constrained decoding is not supported yet (issue 27): requests asking for it get a 400";
const char* const kNoDisagg = "prefill/decode disaggregation is not supported yet (issue 31)";
const char* const kOneScheduler =
    "sparrow's scheduler is vLLM's default policy (first come, first served; chunked prefill; preemption by "
    "recomputation) with no further knobs";
const char* const kNoStats = "sparrow logs no periodic statistics; /metrics always serves them";

}  // namespace

const std::vector<VllmFlag>& vllm_only_flags() {
  static const std::vector<VllmFlag> table = {
      // Model and weights.
      {"--trust-remote-code", false, kIgnore, kNoPython},
      {"--dtype", true, kIgnore,
       "sparrow computes in bfloat16 on a GPU and float32 on the CPU backend, whatever the checkpoint's dtype; "
       "quantised weights stay in their stored format",
       {"auto", "bfloat16"}},
      {"--quantization,-q", true, kIgnore,
       "sparrow reads the checkpoint's own quantization_config (FP8 blocks, MXFP8, MXFP4, NVFP4) and needs no "
       "method named"},
      {"--tokenizer", true, kRefuse, "sparrow reads the tokenizer from the model folder"},
      {"--tokenizer-mode", true, kIgnore, "sparrow has one tokenizer implementation (tokenizer.json)", {"auto"}},
      {"--revision", true, kRefuse, kLocalOnly},
      {"--code-revision", true, kRefuse, kLocalOnly},
      {"--tokenizer-revision", true, kRefuse, kLocalOnly},
      {"--download-dir", true, kRefuse, kLocalOnly},
      {"--hf-token", true, kIgnore, kLocalOnly},
      {"--hf-overrides", true, kRefuse, "sparrow reads config.json as it is; edit a copy of the folder instead"},
      {"--config-format", true, kIgnore, "sparrow reads config.json (the Hugging Face format)", {"auto", "hf"}},
      {"--load-format-options", true, kIgnore, "sparrow's safetensors loader has no options"},
      {"--max-logprobs-mode,--logprobs-mode", true, kIgnore,
       "sparrow's logprobs are the processed distribution's log-probabilities"},
      {"--seed-all", false, kIgnore, "--seed seeds every request that has none"},
      {"--config", true, kRefuse, "sparrow takes its settings as flags; a YAML config file is not read"},
      {"--tool-parser-plugin", true, kRefuse, kNoPython},
      {"--worker-cls", true, kRefuse, kNoPython},
      {"--worker-extension-cls", true, kRefuse, kNoPython},
      {"--model-impl", true, kIgnore, "sparrow has one implementation of each model family", {"auto"}},
      {"--override-generation-config", true, kRefuse,
       "give request defaults through --generation-config (a folder with generation_config.json)"},
      // Server front end.
      {"--uvicorn-log-level", true, kIgnore, "sparrow's HTTP server is its own, not uvicorn"},
      {"--disable-uvicorn-access-log", false, kIgnore, "sparrow's HTTP server is its own, not uvicorn"},
      {"--disable-fastapi-docs", false, kIgnore, "sparrow serves no /docs pages"},
      {"--root-path", true, kIgnore, "sparrow's routes are absolute; a proxy in front may strip a prefix"},
      {"--ssl-keyfile", true, kRefuse, kNoTls},
      {"--ssl-certfile", true, kRefuse, kNoTls},
      {"--ssl-ca-certs", true, kRefuse, kNoTls},
      {"--ssl-cert-reqs", true, kRefuse, kNoTls},
      {"--enable-ssl-refresh", false, kRefuse, kNoTls},
      {"--allowed-origins", true, kIgnore, kNoCors},
      {"--allowed-methods", true, kIgnore, kNoCors},
      {"--allowed-headers", true, kIgnore, kNoCors},
      {"--allow-credentials", false, kIgnore, kNoCors},
      {"--middleware", true, kRefuse, kNoPython},
      {"--api-server-count,-asc", true, kIgnore, "sparrow's HTTP server is one process with its own threads", {"1"}},
      {"--response-role", true, kIgnore, "sparrow's chat responses always take the role \"assistant\"", {"assistant"}},
      {"--chat-template-content-format", true, kIgnore,
       "sparrow renders string and list message contents as the model's template expects", {"auto"}},
      {"--return-tokens-as-token-ids", false, kRefuse, "token-id logprob strings are not supported"},
      {"--enable-request-id-headers", false, kIgnore, "sparrow's responses carry their id in the body"},
      {"--enable-server-load-tracking", false, kIgnore, "/metrics reports the running and waiting requests"},
      {"--enable-force-include-usage", false, kIgnore,
       "streamed responses include usage when the request asks (stream_options.include_usage)"},
      {"--enable-tokenizer-info-endpoint", false, kIgnore, "sparrow has no /tokenizer_info endpoint"},
      {"--log-config-file", true, kIgnore, "sparrow logs one line per event on stderr"},
      {"--max-log-len", true, kIgnore, "sparrow's request log lines hold no prompts"},
      {"--disable-frontend-multiprocessing", false, kIgnore, "sparrow's server and engine share one process"},
      {"--h11-max-incomplete-event-size", true, kIgnore, "see --http-max-body-size and the --http-* timeouts"},
      {"--h11-max-header-count", true, kIgnore, "see --http-max-body-size and the --http-* timeouts"},
      // Logging and observability.
      {"--disable-log-stats", false, kIgnore, kNoStats},
      {"--enable-log-requests", false, kIgnore, "sparrow logs each request unless --disable-log-requests",
       {"--enable-log-requests"}},
      {"--enable-log-outputs", false, kIgnore, "sparrow's request log lines hold no outputs"},
      {"--otlp-traces-endpoint", true, kIgnore, "sparrow exports no OpenTelemetry traces; /metrics has the timings"},
      {"--collect-detailed-traces", true, kIgnore, "sparrow exports no OpenTelemetry traces; /metrics has the timings"},
      {"--show-hidden-metrics-for-version", true, kIgnore, "sparrow's /metrics has no hidden metrics"},
      // Scheduling.
      {"--enable-chunked-prefill,--no-enable-chunked-prefill", false, kIgnore,
       "chunked prefill is always on in sparrow (--max-num-batched-tokens is the step's budget)",
       {"--enable-chunked-prefill"}},
      {"--scheduling-policy", true, kRefuse, kOneScheduler, {"fcfs"}},
      {"--max-num-partial-prefills", true, kIgnore, kOneScheduler, {"1"}},
      {"--max-long-partial-prefills", true, kIgnore, kOneScheduler, {"1"}},
      {"--long-prefill-token-threshold", true, kIgnore, kOneScheduler, {"0"}},
      {"--scheduler-cls", true, kRefuse, kNoPython},
      {"--async-scheduling,--no-async-scheduling", false, kIgnore,
       "sparrow schedules each step on the engine thread between steps"},
      {"--stream-interval", true, kIgnore, "sparrow streams every token as it is sampled", {"1"}},
      {"--disable-cascade-attn", false, kIgnore, "sparrow has no cascade attention"},
      // Memory and cache.
      {"--swap-space", true, kIgnore,
       "sparrow does not swap KV blocks to host memory: a preempted request is recomputed"},
      {"--cpu-offload-gb", true, kRefuse, "weights are not offloaded to host memory"},
      {"--kv-offloading-size", true, kRefuse, "the KV cache is not offloaded to host memory"},
      {"--kv-offloading-backend", true, kRefuse, "the KV cache is not offloaded to host memory"},
      {"--prefix-caching-hash-algo", true, kIgnore, "sparrow hashes prefix blocks with xxHash3 (128 bit)"},
      {"--calculate-kv-scales", false, kIgnore,
       "sparrow's FP8 caches are scaled per block (fp8) or by a fixed 1.0 (fp8_per_tensor); docs/cache.md"},
      {"--mamba-ssm-cache-dtype", true, kIgnore, "the KDA state is kept in float32", {"auto", "float32"}},
      {"--mamba-cache-dtype", true, kIgnore, "the KDA state is kept in float32", {"auto", "float32"}},
      // Execution.
      {"--compilation-config,-O", true, kIgnore, kGraphs},
      {"--cuda-graph-sizes", true, kIgnore, kGraphs},
      {"--max-seq-len-to-capture", true, kIgnore, kGraphs},
      {"--max-cudagraph-capture-size", true, kIgnore, kGraphs},
      {"--disable-custom-all-reduce", false, kIgnore,
       "sparrow's collectives are NCCL's (or gloo's on the host); it has no custom all-reduce yet"},
      {"--distributed-executor-backend", true, kRefuse,
       "sparrow runs one process per rank, started by itself or by mpirun / srun / torchrun (docs/parallel.md)",
       {"mp"}},
      {"--pipeline-parallel-size,-pp", true, kRefuse, "pipeline parallelism is not supported", {"1"}},
      {"--data-parallel-size,-dp", true, kRefuse,
       "data parallelism is not supported yet (issue 23): use --tensor-parallel-size with --enable-expert-parallel",
       {"1"}},
      {"--data-parallel-size-local,-dpl", true, kRefuse, "data parallelism is not supported yet (issue 23)", {"1"}},
      {"--data-parallel-rank,-dpn", true, kRefuse, "data parallelism is not supported yet (issue 23)", {"0"}},
      {"--data-parallel-start-rank,-dpr", true, kRefuse, "data parallelism is not supported yet (issue 23)", {"0"}},
      {"--data-parallel-address,-dpa", true, kRefuse, "data parallelism is not supported yet (issue 23): see --master-addr"},
      {"--data-parallel-rpc-port,-dpp", true, kRefuse, "data parallelism is not supported yet (issue 23): see --master-port"},
      {"--data-parallel-backend,-dpb", true, kRefuse, "data parallelism is not supported yet (issue 23)"},
      {"--data-parallel-hybrid-lb", false, kRefuse, "data parallelism is not supported yet (issue 23)"},
      {"--data-parallel-external-lb", false, kRefuse, "data parallelism is not supported yet (issue 23)"},
      {"--decode-context-parallel-size,-dcp", true, kRefuse, "decode context parallelism is not supported yet (issue 28)",
       {"1"}},
      {"--enable-eplb", false, kRefuse, "expert-parallel load balancing is not supported"},
      {"--eplb-config", true, kRefuse, "expert-parallel load balancing is not supported"},
      {"--enable-dbo", false, kRefuse, "dual-batch overlap is not supported"},
      {"--all2all-backend", true, kIgnore,
       "sparrow's expert parallelism has each rank run its own experts and sums them with the layer's all-reduce"},
      {"--ray-workers-use-nsight", false, kRefuse, "sparrow does not run on Ray"},
      // Features not built yet.
      {"--speculative-config", true, kRefuse, kNoSpec},
      {"--enable-lora", false, kRefuse, kNoLora},
      {"--lora-modules", true, kRefuse, kNoLora},
      {"--max-loras", true, kRefuse, kNoLora},
      {"--max-lora-rank", true, kRefuse, kNoLora},
      {"--max-cpu-loras", true, kRefuse, kNoLora},
      {"--lora-dtype", true, kRefuse, kNoLora},
      {"--fully-sharded-loras", false, kRefuse, kNoLora},
      {"--limit-mm-per-prompt", true, kIgnore, kNoImages},
      {"--mm-processor-kwargs", true, kIgnore, kNoImages},
      {"--mm-processor-cache-gb", true, kIgnore, kNoImages},
      {"--allowed-local-media-path", true, kIgnore, kNoImages},
      {"--allowed-media-domains", true, kIgnore, kNoImages},
      {"--media-io-kwargs", true, kIgnore, kNoImages},
      {"--skip-mm-profiling", false, kIgnore, kNoImages},
      {"--language-model-only", false, kIgnore, "sparrow loads the language model only already"},
      {"--structured-outputs-config", true, kIgnore, kNoStructured},
      {"--guided-decoding-backend", true, kIgnore, kNoStructured},
      {"--reasoning-parser-plugin", true, kRefuse, kNoPython},
      {"--kv-transfer-config", true, kRefuse, kNoDisagg},
      {"--kv-events-config", true, kRefuse, "KV-cache events are not published"},
      {"--enable-sleep-mode", false, kRefuse, "sleep mode is not supported"},
  };
  return table;
}

namespace {

// A table entry's names split at the commas.
std::vector<std::string> split_names(const std::string& names) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= names.size()) {
    const size_t comma = names.find(',', start);
    out.push_back(names.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}
bool is_multi_letter_short(const std::string& name) { return name.size() > 2 && name[0] == '-' && name[1] != '-'; }

}  // namespace

std::string expand_vllm_short_flag(const std::string& arg) {
  static const std::vector<std::pair<std::string, std::string>> aliases = [] {
    std::vector<std::pair<std::string, std::string>> out = {{"-tp", "--tensor-parallel-size"}};  // a flag sparrow has
    for (const VllmFlag& flag : vllm_only_flags())
      for (const std::string& name : split_names(flag.names))
        if (is_multi_letter_short(name)) out.emplace_back(name, split_names(flag.names).front());
    return out;
  }();
  for (const auto& [short_name, long_name] : aliases) {
    if (arg == short_name) return long_name;
    if (arg.starts_with(short_name + "=")) return long_name + arg.substr(short_name.size());
  }
  return arg;
}

std::function<void()> add_vllm_only_flags(CLI::App* sub) {
  struct Given {
    const VllmFlag* flag;
    CLI::Option* option;
    std::shared_ptr<std::string> value;  // a value flag's argument
    std::shared_ptr<bool> on;            // a switch pair: whether the positive name was the one given
  };
  auto all = std::make_shared<std::vector<Given>>();
  for (const VllmFlag& flag : vllm_only_flags()) {
    Given g{&flag, nullptr, std::make_shared<std::string>(), std::make_shared<bool>(false)};
    // CLI11's names: multi-letter short spellings left out (main() expands them), a switch's "--no-x"
    // written as CLI11's negation "!--no-x".
    std::string names;
    for (const std::string& name : split_names(flag.names)) {
      if (is_multi_letter_short(name)) continue;
      names += (names.empty() ? "" : ",") + std::string(name.starts_with("--no-") ? "!" : "") + name;
    }
    if (flag.takes_value) g.option = sub->add_option(names, *g.value);
    else g.option = sub->add_flag(names, *g.on);
    g.option->group("");  // hidden from --help: docs/server.md lists them
    all->push_back(g);
  }
  return [all] {
    for (const Given& g : *all) {
      if (g.option->count() == 0) continue;
      const VllmFlag& flag = *g.flag;
      const std::string name = flag.names.substr(0, flag.names.find(','));
      std::string given;  // as the user wrote it, for the message
      bool same = false;
      if (flag.takes_value) {
        given = name + " " + *g.value;
        same = std::find(flag.same_as_sparrow.begin(), flag.same_as_sparrow.end(), *g.value) != flag.same_as_sparrow.end();
      } else {
        const size_t comma = flag.names.find(",--no-");
        given = comma == std::string::npos || *g.on ? name : flag.names.substr(comma + 1);
        same = std::find(flag.same_as_sparrow.begin(), flag.same_as_sparrow.end(), given) != flag.same_as_sparrow.end();
      }
      if (same) continue;  // what sparrow does anyway
      if (flag.action == VllmFlagAction::Refuse) fail(given, ": not supported: ", flag.why);
      std::fprintf(stderr, "sparrow serve: %s: ignored: %s\n", given.c_str(), flag.why.c_str());
    }
  };
}

}  // namespace sparrow::cli
