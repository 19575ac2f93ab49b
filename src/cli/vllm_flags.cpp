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
const char* const kNoLora = "not part of sparrow's LoRA support (docs/lora.md)";
const char* const kExpertLoraForms =
    "sparrow reads every form of routed-expert adapter it knows (per expert, PEFT's stacks, vLLM's shared-outer "
    "experts.w1 / w2 / w3) by its tensors' names, whatever this flag says (docs/lora.md)";

const char* const kSpecConfig = "give speculative decoding as --speculative-config JSON (docs/speculative.md)";
const char* const kNoImages =
    "not one of sparrow's image settings: images come as image_url parts (data: URLs), limited by --limit-mm-per-prompt "
    "and --allowed-local-media-path (docs/vision.md)";
const char* const kNoStructured =
    "sparrow has one structured-output backend of its own (src/structured; see Structured outputs)";
const char* const kOneScheduler =
    "sparrow's scheduler is vLLM's default policy (first come, first served; chunked prefill; preemption by "
    "recomputation) with no further knobs";
const char* const kNoStats = "sparrow logs no periodic statistics; /metrics always serves them";

}  // namespace

const std::vector<VllmFlag>& vllm_only_flags() {
  static const std::vector<VllmFlag> table = {
      // Model and weights.
      {"--trust-remote-code,!--no-trust-remote-code", false, kIgnore, kNoPython},
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
      {"--disable-uvicorn-access-log,!--enable-uvicorn-access-log,!--no-disable-uvicorn-access-log", false, kIgnore, "sparrow's HTTP server is its own, not uvicorn"},
      {"--disable-fastapi-docs,!--enable-fastapi-docs,!--no-disable-fastapi-docs", false, kIgnore, "sparrow serves no /docs pages"},
      {"--root-path", true, kIgnore, "sparrow's routes are absolute; a proxy in front may strip a prefix"},
      {"--ssl-keyfile", true, kRefuse, kNoTls},
      {"--ssl-certfile", true, kRefuse, kNoTls},
      {"--ssl-ca-certs", true, kRefuse, kNoTls},
      {"--ssl-cert-reqs", true, kRefuse, kNoTls},
      {"--enable-ssl-refresh,!--disable-ssl-refresh,!--no-enable-ssl-refresh", false, kRefuse, kNoTls},
      {"--allowed-origins", true, kIgnore, kNoCors},
      {"--allowed-methods", true, kIgnore, kNoCors},
      {"--allowed-headers", true, kIgnore, kNoCors},
      {"--allow-credentials,!--no-allow-credentials", false, kIgnore, kNoCors},
      {"--middleware", true, kRefuse, kNoPython},
      {"--api-server-count,-asc", true, kIgnore, "sparrow's HTTP server is one process with its own threads", {"1"}},
      {"--response-role", true, kIgnore, "sparrow's chat responses always take the role \"assistant\"", {"assistant"}},
      {"--chat-template-content-format", true, kIgnore,
       "sparrow renders string and list message contents as the model's template expects", {"auto"}},
      {"--return-tokens-as-token-ids,!--no-return-tokens-as-token-ids", false, kRefuse, "token-id logprob strings are not supported"},
      {"--enable-server-load-tracking,!--disable-server-load-tracking,!--no-enable-server-load-tracking", false, kIgnore, "/metrics reports the running and waiting requests"},
      {"--enable-force-include-usage,!--disable-force-include-usage,!--no-enable-force-include-usage", false, kIgnore,
       "streamed responses include usage when the request asks (stream_options.include_usage)"},
      {"--enable-tokenizer-info-endpoint,!--disable-tokenizer-info-endpoint,!--no-enable-tokenizer-info-endpoint", false, kIgnore, "sparrow has no /tokenizer_info endpoint"},
      {"--log-config-file", true, kIgnore, "sparrow logs one line per event on stderr"},
      {"--max-log-len", true, kIgnore, "sparrow's request log lines hold no prompts"},
      {"--disable-frontend-multiprocessing", false, kIgnore, "sparrow's server and engine share one process"},
      {"--h11-max-incomplete-event-size", true, kIgnore, "see --http-max-body-size and the --http-* timeouts"},
      {"--h11-max-header-count", true, kIgnore, "see --http-max-body-size and the --http-* timeouts"},
      // Logging and observability.
      {"--disable-log-stats", false, kIgnore, kNoStats},
      {"--enable-log-requests,!--no-enable-log-requests", false, kIgnore, "sparrow logs each request unless --disable-log-requests",
       {"--enable-log-requests"}},
      {"--enable-log-outputs,!--disable-log-outputs,!--no-enable-log-outputs", false, kIgnore, "sparrow's request log lines hold no outputs"},
      {"--otlp-traces-endpoint", true, kIgnore, "sparrow exports no OpenTelemetry traces; /metrics has the timings"},
      {"--collect-detailed-traces", true, kIgnore, "sparrow exports no OpenTelemetry traces; /metrics has the timings"},
      {"--show-hidden-metrics-for-version", true, kIgnore, "sparrow's /metrics has no hidden metrics"},
      // Scheduling.
      {"--enable-chunked-prefill,!--disable-chunked-prefill,!--no-enable-chunked-prefill", false, kIgnore,
       "chunked prefill is always on in sparrow (--max-num-batched-tokens is the step's budget)",
       {"--enable-chunked-prefill"}},
      {"--scheduling-policy", true, kRefuse, kOneScheduler, {"fcfs"}},
      {"--max-num-partial-prefills", true, kIgnore, kOneScheduler, {"1"}},
      {"--max-long-partial-prefills", true, kIgnore, kOneScheduler, {"1"}},
      {"--long-prefill-token-threshold", true, kIgnore, kOneScheduler, {"0"}},
      {"--scheduler-cls", true, kRefuse, kNoPython},
      {"--async-scheduling,!--no-async-scheduling", false, kIgnore,
       "sparrow schedules each step on the engine thread between steps"},
      {"--stream-interval", true, kIgnore, "sparrow streams every token as it is sampled", {"1"}},
      {"--disable-cascade-attn,!--enable-cascade-attn,!--no-disable-cascade-attn", false, kIgnore, "sparrow has no cascade attention"},
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
      {"--compilation-config,-O,-cc", true, kIgnore, kGraphs},
      {"--cuda-graph-sizes", true, kIgnore, kGraphs},
      {"--max-seq-len-to-capture", true, kIgnore, kGraphs},
      {"--max-cudagraph-capture-size", true, kIgnore, kGraphs},
      {"--disable-custom-all-reduce,!--enable-custom-all-reduce,!--no-disable-custom-all-reduce", false, kIgnore,
       "sparrow's collectives are NCCL's (or gloo's on the host); it has no custom all-reduce yet"},
      {"--distributed-executor-backend", true, kRefuse,
       "sparrow runs one process per rank, started by itself or by mpirun / srun / torchrun (docs/parallel.md)",
       {"mp"}},
      {"--pipeline-parallel-size,-pp", true, kRefuse, "pipeline parallelism is not supported", {"1"}},
      {"--data-parallel-size-local,-dpl", true, kRefuse,
       "sparrow places the data-parallel ranks itself: --nnodes / --node-rank, or a launcher's variables "
       "(docs/parallel.md)", {"1"}},
      {"--data-parallel-rank,-dpn", true, kRefuse,
       "sparrow reads every rank from its launcher or starts a node's ranks itself (docs/parallel.md)", {"0"}},
      {"--data-parallel-start-rank,-dpr", true, kRefuse, "sparrow places the data-parallel ranks itself: see --node-rank", {"0"}},
      {"--data-parallel-address,-dpa", true, kRefuse, "the data-parallel ranks meet at --master-addr"},
      {"--data-parallel-rpc-port,-dpp", true, kRefuse, "the data-parallel ranks meet at --master-port"},
      {"--data-parallel-backend,-dpb", true, kRefuse,
       "sparrow's data-parallel ranks are processes it starts or a launcher starts (docs/parallel.md)", {"mp"}},
      {"--data-parallel-hybrid-lb,-dph,!--no-data-parallel-hybrid-lb", false, kRefuse,
       "one server (rank 0) balances requests over every data-parallel group"},
      {"--data-parallel-external-lb,-dpe,!--no-data-parallel-external-lb", false, kRefuse,
       "one server (rank 0) balances requests over every data-parallel group"},
      {"--enable-eplb,!--disable-eplb,!--no-enable-eplb", false, kRefuse, "expert-parallel load balancing is not supported"},
      {"--eplb-config", true, kRefuse, "expert-parallel load balancing is not supported"},
      {"--enable-dbo,!--disable-dbo,!--no-enable-dbo", false, kRefuse, "dual-batch overlap is not supported"},
      {"--all2all-backend", true, kIgnore,
       "sparrow's expert parallelism has each rank run its own experts and sums them with the layer's all-reduce"},
      {"--ray-workers-use-nsight,!--no-ray-workers-use-nsight", false, kRefuse, "sparrow does not run on Ray"},
      // Features not built yet.
      {"--lora-dtype", true, kIgnore, "LoRA weights are kept in the activations' type (bfloat16 on a GPU, float32 on the CPU)", {"auto"}},
      {"--fully-sharded-loras,!--no-fully-sharded-loras", false, kIgnore,
       "under tensor parallelism sparrow splits each LoRA adapter as its base weights are split (docs/lora.md)",
       {"--no-fully-sharded-loras"}},
      {"--mm-processor-kwargs", true, kIgnore, kNoImages},
      {"--mm-processor-cache-gb", true, kIgnore, kNoImages},
      {"--allowed-media-domains", true, kIgnore, kNoImages},
      {"--media-io-kwargs", true, kIgnore, kNoImages},
      {"--skip-mm-profiling,!--no-skip-mm-profiling", false, kIgnore, kNoImages},
      {"--language-model-only,!--no-language-model-only", false, kIgnore, "sparrow loads the language model only already"},
      {"--structured-outputs-config", true, kIgnore, kNoStructured},
      {"--guided-decoding-backend", true, kIgnore, kNoStructured},
      {"--reasoning-parser-plugin", true, kRefuse, kNoPython},
      {"--kv-events-config", true, kRefuse, "KV-cache events are not published"},
      {"--enable-sleep-mode,!--disable-sleep-mode,!--no-enable-sleep-mode", false, kRefuse, "sleep mode is not supported"},
      // The rest of vLLM 0.33.0's serve flags (its parser, `vllm serve --help=all`), by its argument groups.
      // options.
      {"--grpc", false, kRefuse, "sparrow serves HTTP only"},
      {"--aggregate-engine-logging", false, kIgnore, kNoStats},
      {"--fail-on-environ-validation,!--no-fail-on-environ-validation", false, kIgnore, "sparrow reads no VLLM_* environment variables"},
      {"--gdn-prefill-backend", true, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      {"--kda-prefill-backend", true, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      {"--kda-decode-backend", true, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      // Frontend.
      {"--trust-request-chat-template,!--no-trust-request-chat-template", false, kIgnore, "requests are rendered with the model's template or --chat-template"},
      {"--trust-request-mm-kwargs,!--no-trust-request-mm-kwargs", false, kIgnore, kNoImages},
      {"--default-chat-template-kwargs", true, kRefuse, "not supported: pass chat_template_kwargs in each request"},
      {"--reasoning-effort-map", true, kRefuse, "not supported: reasoning_effort reaches the template as the request gives it"},
      {"--exclude-tools-when-tool-choice-none,!--no-exclude-tools-when-tool-choice-none", false, kIgnore, "sparrow always leaves a request's tools out of the prompt when its tool_choice is \"none\" (see Tool calling)"},
      {"--tool-strict-level", true, kIgnore, kNoStructured},
      {"--tool-server", true, kRefuse, "built-in tool servers are not supported"},
      {"--enable-per-request-metrics,!--disable-per-request-metrics,!--no-enable-per-request-metrics", false, kIgnore, "responses carry no timing metrics; /metrics has them"},
      {"--sse-keep-alive-interval", true, kIgnore, "sparrow sends no SSE keep-alive comments", {"0"}},
      {"--enable-log-deltas,!--disable-log-deltas,!--no-enable-log-deltas", false, kIgnore, "sparrow's request log lines hold no outputs"},
      {"--cohere-is-reasoning-model,!--no-cohere-is-reasoning-model", false, kIgnore, "sparrow serves no Cohere API"},
      {"--cohere-format", true, kIgnore, "sparrow serves no Cohere API"},
      {"--anthropic-disabled-thinking-effort", true, kIgnore, "sparrow serves no Anthropic Messages API"},
      {"--log-error-stack,!--no-log-error-stack", false, kIgnore, "error responses are logged with their message only"},
      {"--tokens-only,!--no-tokens-only", false, kRefuse, "sparrow has no tokens-only mode"},
      {"--enable-scale-out,!--disable-scale-out,!--no-enable-scale-out", false, kRefuse, "the scale-out endpoints are not served"},
      {"--fingerprint-mode", true, kIgnore, "sparrow sets no system_fingerprint"},
      {"--fingerprint-value", true, kIgnore, "sparrow sets no system_fingerprint"},
      {"--grpc-port", true, kRefuse, "sparrow serves HTTP only"},
      {"--data-parallel-supervisor-port", true, kRefuse, "one server (rank 0) balances requests over every data-parallel group"},
      {"--dp-supervisor-probe-interval-s", true, kRefuse, "sparrow has no data-parallel supervisor: a dead rank ends the run"},
      {"--dp-supervisor-probe-timeout-s", true, kRefuse, "sparrow has no data-parallel supervisor: a dead rank ends the run"},
      {"--dp-supervisor-probe-failure-threshold", true, kRefuse, "sparrow has no data-parallel supervisor: a dead rank ends the run"},
      {"--uds", true, kRefuse, "sparrow listens on TCP only (--host, --port)"},
      {"--disable-access-log-for-endpoints", true, kIgnore, "the access log has no per-endpoint filter; --disable-log-requests turns it off"},
      {"--ssl-ciphers", true, kRefuse, kNoTls},
      {"--enable-offline-docs,!--disable-offline-docs,!--no-enable-offline-docs", false, kIgnore, "sparrow serves no /docs pages"},
      {"--enable-flash-late-interaction,!--disable-flash-late-interaction,!--no-enable-flash-late-interaction", false, kIgnore, "pooling and scoring models are not served"},
      // ModelConfig.
      {"--runner", true, kRefuse, "sparrow runs generative models only", {"auto", "generate"}},
      {"--convert", true, kRefuse, "sparrow runs generative models only", {"auto", "none"}},
      {"--hf-config-path", true, kRefuse, "config.json is read from the model folder"},
      {"--quantization-config", true, kIgnore, "sparrow reads the checkpoint's own quantization_config"},
      {"--allow-deprecated-quantization,!--no-allow-deprecated-quantization", false, kIgnore, "sparrow reads the checkpoint's own quantization_config"},
      {"--enable-return-routed-experts,!--disable-return-routed-experts,!--no-enable-return-routed-experts", false, kRefuse, "routed experts are not returned"},
      {"--return-sampling-mask,!--no-return-sampling-mask", false, kRefuse, "sampling masks are not returned"},
      {"--use-fp64-gumbel,!--no-use-fp64-gumbel", false, kIgnore, "sparrow's sampler draws its own way (docs/sampling.md)"},
      {"--enable-trace-replay,!--disable-trace-replay,!--no-enable-trace-replay", false, kRefuse, "trace replay is not supported"},
      {"--disable-sliding-window,!--enable-sliding-window,!--no-disable-sliding-window", false, kIgnore, "the served families have no sliding-window layers"},
      {"--skip-tokenizer-init,!--no-skip-tokenizer-init", false, kRefuse, "the tokenizer is always loaded"},
      {"--enable-prompt-embeds,!--disable-prompt-embeds,!--no-enable-prompt-embeds", false, kRefuse, "prompt embeddings are not accepted"},
      {"--model-class-overrides", true, kRefuse, kNoPython},
      {"--pooler-config", true, kRefuse, "pooling models are not served"},
      {"--sleep-mode-backend", true, kRefuse, "sleep mode is not supported"},
      {"--sleep-mode-offload-cudagraph,!--no-sleep-mode-offload-cudagraph", false, kRefuse, "sleep mode is not supported"},
      {"--sleep-preserve-parameter-names", true, kRefuse, "sleep mode is not supported"},
      {"--enable-cumem-allocator,!--disable-cumem-allocator,!--no-enable-cumem-allocator", false, kIgnore, "sparrow allocates its device memory once at start"},
      {"--enable-nccl-comm-suspend,!--disable-nccl-comm-suspend,!--no-enable-nccl-comm-suspend", false, kRefuse, "sleep mode is not supported"},
      {"--logits-processors", true, kRefuse, kNoPython},
      {"--io-processor-plugin", true, kRefuse, kNoPython},
      {"--renderer-num-workers", true, kIgnore, "requests are rendered on the server's connection threads"},
      // LoadConfig.
      {"--safetensors-load-strategy", true, kIgnore, "sparrow's loader reads the safetensors shards in parallel itself and takes no options"},
      {"--safetensors-prefetch-num-threads", true, kIgnore, "sparrow's loader reads the safetensors shards in parallel itself and takes no options"},
      {"--safetensors-prefetch-block-size", true, kIgnore, "sparrow's loader reads the safetensors shards in parallel itself and takes no options"},
      {"--model-loader-extra-config", true, kIgnore, "sparrow's loader reads the safetensors shards in parallel itself and takes no options"},
      {"--ignore-patterns", true, kIgnore, "sparrow reads the tensors its model needs and names the ones it skips"},
      {"--use-tqdm-on-load,!--no-use-tqdm-on-load", false, kIgnore, "sparrow's loader reads the safetensors shards in parallel itself and takes no options"},
      {"--pt-load-map-location", true, kIgnore, "sparrow reads safetensors only"},
      // AttentionConfig.
      {"--attention-backend", true, kIgnore, "sparrow has its own kernel for each attention kind (docs/gpu.md)"},
      // MambaConfig.
      {"--mamba-backend", true, kIgnore, "the served families have no Mamba layers; the KDA state is float32"},
      {"--mamba-ssu-algorithm", true, kIgnore, "the served families have no Mamba layers; the KDA state is float32"},
      {"--enable-mamba-cache-stochastic-rounding,!--disable-mamba-cache-stochastic-rounding,!--no-enable-mamba-cache-stochastic-rounding", false, kIgnore, "the served families have no Mamba layers; the KDA state is float32"},
      {"--mamba-cache-philox-rounds", true, kIgnore, "the served families have no Mamba layers; the KDA state is float32"},
      // ParallelConfig.
      {"--distributed-timeout-seconds", true, kIgnore, "set SPARROW_DISTRIBUTED_TIMEOUT_S (docs/parallel.md)"},
      {"--cpu-distributed-timeout-seconds", true, kIgnore, "set SPARROW_DISTRIBUTED_TIMEOUT_S (docs/parallel.md)"},
      {"--numa-bind,!--no-numa-bind", false, kIgnore, "ranks are not bound to NUMA nodes; use numactl or the launcher's binding"},
      {"--numa-bind-nodes", true, kIgnore, "ranks are not bound to NUMA nodes; use numactl or the launcher's binding"},
      {"--numa-bind-cpus", true, kIgnore, "ranks are not bound to NUMA nodes; use numactl or the launcher's binding"},
      {"--device-ids", true, kRefuse, "choose the GPUs with CUDA_VISIBLE_DEVICES"},
      {"--dcp-comm-backend", true, kRefuse, "sparrow's DCP runs on the model's collectives (NCCL, gloo on the CPU)"},
      {"--dcp-q-replicate,!--no-dcp-q-replicate", false, kRefuse, "sparrow's DCP all-gathers the queries of the DCP group (docs/parallel.md)"},
      {"--dcp-kv-cache-interleave-size", true, kRefuse, "sparrow's DCP deals out single tokens (token j on rank j mod W)", {"1"}},
      {"--cp-kv-cache-interleave-size", true, kRefuse, "sparrow's DCP deals out single tokens (token j on rank j mod W)", {"1"}},
      {"--prefill-context-parallel-size,-pcp", true, kRefuse,
       "sparrow's prefill shards tokens inside the TP group instead (--token-sharded-prefill, docs/parallel.md)", {"1"}},
      {"--data-parallel-multi-port-external-lb,-dpm", false, kRefuse,
       "one server (rank 0) balances requests over every data-parallel group"},
      {"--enable-hc-sp,!--disable-hc-sp,!--no-enable-hc-sp", false, kIgnore, "the served families have no HyperConnection layers"},
      {"--enable-batch-sharded-sampling,!--disable-batch-sharded-sampling,!--no-enable-batch-sharded-sampling", false, kIgnore, "rank 0 samples for the whole batch"},
      {"--enable-ep-weight-filter,!--disable-ep-weight-filter,!--no-enable-ep-weight-filter", false, kIgnore, "with --enable-expert-parallel each rank reads only its own experts already", {"--enable-ep-weight-filter"}},
      {"--enable-shm-tensor-arena,!--disable-shm-tensor-arena,!--no-enable-shm-tensor-arena", false, kIgnore, "rank 0 sends each step's plan to the other ranks itself (docs/parallel.md)"},
      {"--ubatch-size", true, kRefuse, "dual-batch overlap is not supported", {"0"}},
      {"--enable-elastic-ep,!--disable-elastic-ep,!--no-enable-elastic-ep", false, kRefuse, "elastic expert parallelism is not supported"},
      {"--elastic-ep-max-dp-size", true, kRefuse, "elastic expert parallelism is not supported"},
      {"--dbo-decode-token-threshold", true, kIgnore, "dual-batch overlap is not supported"},
      {"--dp-sync-interval", true, kIgnore, "sparrow's data-parallel leaders meet before every step (docs/parallel.md)"},
      {"--dbo-prefill-token-threshold", true, kIgnore, "dual-batch overlap is not supported"},
      {"--disable-nccl-for-dp-synchronization,!--enable-nccl-for-dp-synchronization,!--no-disable-nccl-for-dp-synchronization", false, kIgnore,
       "sparrow's data-parallel leaders meet over the host (gloo) before every step"},
      {"--expert-placement-strategy", true, kRefuse, "experts are dealt out in contiguous ranges, vLLM's linear placement", {"linear"}},
      {"--max-parallel-loading-workers", true, kIgnore, "sparrow's loader reads the safetensors shards in parallel itself and takes no options"},
      {"--enable-fault-tolerance,!--disable-fault-tolerance,!--no-enable-fault-tolerance", false, kRefuse, "a dead rank ends the run with a clear error (docs/parallel.md); nothing is recovered"},
      {"--fault-tolerance-config", true, kRefuse, "a dead rank ends the run with a clear error (docs/parallel.md); nothing is recovered"},
      // CacheConfig.
      {"--prefix-cache-retention-interval", true, kIgnore, "sparrow's packed cache has no such setting (docs/cache.md)"},
      {"--kv-cache-dtype-skip-layers", true, kRefuse, "every layer's cache takes --kv-cache-dtype"},
      {"--kv-sharing-fast-prefill,!--no-kv-sharing-fast-prefill", false, kIgnore, "sparrow's packed cache has no such setting (docs/cache.md)"},
      {"--swa-bounded-replay,!--no-swa-bounded-replay", false, kIgnore, "sparrow's packed cache has no such setting (docs/cache.md)"},
      {"--mamba-block-size", true, kIgnore, "sparrow's packed cache has no such setting (docs/cache.md)"},
      {"--prefix-match-unit", true, kIgnore, "prefix-cache hits land on block boundaries (--block-size)"},
      {"--mamba-cache-mode", true, kIgnore, "sparrow's packed cache has no such setting (docs/cache.md)"},
      {"--enable-mamba-shared-prefix-checkpoint,!--disable-mamba-shared-prefix-checkpoint,!--no-enable-mamba-shared-prefix-checkpoint", false, kIgnore, "sparrow's packed cache has no such setting (docs/cache.md)"},
      {"--replayssm-buffer-len", true, kIgnore, "sparrow's packed cache has no such setting (docs/cache.md)"},
      {"--use-replayssm,!--no-use-replayssm", false, kIgnore, "sparrow's packed cache has no such setting (docs/cache.md)"},
      // OffloadConfig.
      {"--offload-backend", true, kRefuse, "weights are not offloaded to host memory"},
      {"--cpu-offload-params", true, kRefuse, "weights are not offloaded to host memory"},
      {"--offload-group-size", true, kRefuse, "weights are not offloaded to host memory"},
      {"--offload-num-in-group", true, kRefuse, "weights are not offloaded to host memory"},
      {"--offload-prefetch-step", true, kRefuse, "weights are not offloaded to host memory"},
      {"--offload-params", true, kRefuse, "weights are not offloaded to host memory"},
      // MultiModalConfig.
      {"--enable-mm-embeds,!--disable-mm-embeds,!--no-enable-mm-embeds", false, kIgnore, kNoImages},
      {"--mm-processor-cache-type", true, kIgnore, kNoImages},
      {"--mm-hasher-algorithm", true, kIgnore, kNoImages},
      {"--mm-shm-cache-max-object-size-mb", true, kIgnore, kNoImages},
      {"--mm-encoder-only,!--no-mm-encoder-only", false, kIgnore, kNoImages},
      {"--mm-encoder-tp-mode", true, kIgnore, kNoImages},
      {"--mm-encoder-attn-backend", true, kIgnore, kNoImages},
      {"--mm-encoder-attn-dtype", true, kIgnore, kNoImages},
      {"--mm-encoder-fp8-scale-path", true, kIgnore, kNoImages},
      {"--mm-encoder-fp8-scale-save-path", true, kIgnore, kNoImages},
      {"--mm-encoder-fp8-scale-save-margin", true, kIgnore, kNoImages},
      {"--interleave-mm-strings,!--no-interleave-mm-strings", false, kIgnore, kNoImages},
      {"--video-pruning-rate", true, kIgnore, kNoImages},
      {"--video-pruning-method", true, kIgnore, kNoImages},
      {"--mm-tensor-ipc", true, kIgnore, kNoImages},
      {"--mm-processor-device", true, kIgnore, kNoImages},
      {"--mm-ipc-gpu-memory-gb", true, kIgnore, kNoImages},
      {"--mm-device-do-normalize,!--no-mm-device-do-normalize", false, kIgnore, kNoImages},
      // LoRAConfig.
      {"--enable-tower-connector-lora,!--disable-tower-connector-lora,!--no-enable-tower-connector-lora", false, kRefuse, kNoLora},
      {"--lora-target-modules", true, kRefuse, kNoLora},
      {"--default-mm-loras", true, kRefuse, kNoLora},
      {"--specialize-active-lora,!--no-specialize-active-lora", false, kRefuse, kNoLora},
      {"--enable-mixed-moe-lora-format,!--disable-mixed-moe-lora-format,!--no-enable-mixed-moe-lora-format", false,
       kIgnore, kExpertLoraForms},
      {"--enable-moe-shared-loras,!--disable-moe-shared-loras,!--no-enable-moe-shared-loras", false, kIgnore,
       kExpertLoraForms},
      {"--max-lora-cls-labels", true, kRefuse, kNoLora},
      // LoggingConfig.
      {"--logging-config", true, kIgnore, "sparrow logs one line per event on stderr"},
      {"--log-level", true, kIgnore, "sparrow logs one line per event on stderr"},
      // ObservabilityConfig.
      {"--per-request-spec-decode-metrics", true, kIgnore, "/metrics has the speculative decoding counters of the whole server (docs/speculative.md)"},
      {"--kv-cache-metrics,!--no-kv-cache-metrics", false, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      {"--kv-cache-metrics-sample", true, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      {"--custom-histogram-buckets", true, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      {"--cudagraph-metrics,!--no-cudagraph-metrics", false, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      {"--enable-layerwise-nvtx-tracing,!--disable-layerwise-nvtx-tracing,!--no-enable-layerwise-nvtx-tracing", false, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      {"--enable-mfu-metrics,!--disable-mfu-metrics,!--no-enable-mfu-metrics", false, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      {"--enable-logging-iteration-details,!--disable-logging-iteration-details,!--no-enable-logging-iteration-details", false, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      {"--jit-monitor-mode", true, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      {"--jit-monitor-verbose,!--no-jit-monitor-verbose", false, kIgnore, "not collected: /metrics has sparrow's metrics (docs/server.md)"},
      // SchedulerConfig.
      {"--max-num-scheduled-tokens", true, kRefuse, "use --max-num-batched-tokens"},
      {"--max-num-active-seqs", true, kRefuse, "use --max-num-seqs"},
      {"--max-num-queued-reqs", true, kRefuse, "use --max-queued-requests"},
      {"--max-num-queued-tokens", true, kIgnore, kOneScheduler},
      {"--long-prefill-token-threshold-adaptive,!--no-long-prefill-token-threshold-adaptive", false, kIgnore, kOneScheduler},
      {"--disable-chunked-mm-input,!--enable-chunked-mm-input,!--no-disable-chunked-mm-input", false, kIgnore, kOneScheduler},
      {"--scheduler-reserve-full-isl,!--no-scheduler-reserve-full-isl", false, kIgnore, kOneScheduler},
      {"--watermark", true, kIgnore, kOneScheduler},
      {"--prefill-schedule-interval", true, kIgnore, kOneScheduler},
      {"--disable-hybrid-kv-cache-manager,!--enable-hybrid-kv-cache-manager,!--no-disable-hybrid-kv-cache-manager", false, kIgnore, "sparrow's packed cache holds every layer kind in one block row (docs/cache.md)"},
      // CompilationConfig.
      {"--cudagraph-capture-sizes", true, kIgnore, kGraphs},
      // KernelConfig.
      {"--ir-op-priority", true, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      {"--enable-flashinfer-autotune,!--disable-flashinfer-autotune,!--no-enable-flashinfer-autotune", false, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      {"--monokernel,!--no-monokernel", false, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      {"--moe-backend", true, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      {"--linear-backend", true, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      {"--sparse-indexer-topk-backend", true, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      // VllmConfig.
      {"--spec-method", true, kRefuse, kSpecConfig},
      {"--spec-model", true, kRefuse, kSpecConfig},
      {"--spec-tokens", true, kRefuse, kSpecConfig},
      {"--watermark-config", true, kRefuse, "text watermarking is not supported"},
      {"--diffusion-config,-dc", true, kRefuse, "diffusion language models are not served"},
      {"--ec-transfer-config", true, kRefuse, "images' embeddings are not sent between instances (each embeds its own)"},
      {"--ec-manager-config", true, kIgnore, kNoImages},
      {"--engram-config", true, kRefuse, "n-gram embedding models are not served"},
      {"--reasoning-config", true, kIgnore, "reasoning is parsed by --reasoning-parser"},
      {"--kernel-config", true, kIgnore, "sparrow has one kernel for each operation, chosen by shape (docs/gpu.md)"},
      {"--additional-config", true, kIgnore, "sparrow has no platform plugins"},
      {"--aux-output-config", true, kIgnore, "auxiliary outputs are not returned"},
      {"--profiler-config", true, kIgnore, "profile with Nsight Systems or `sparrow bench forward` (docs/bench.md)"},
      {"--watchdog-config", true, kIgnore, "sparrow has no stack-dump watchdog"},
      {"--optimization-level", true, kIgnore, kGraphs},
      {"--performance-mode", true, kIgnore, "sparrow has one performance mode", {"balanced"}},
      {"--weight-transfer-config", true, kRefuse, "weight updates are not supported yet (issue 29)"},
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
    // Sparrow's own flags' spellings first, then the table's.
    std::vector<std::pair<std::string, std::string>> out = {
        {"-tp", "--tensor-parallel-size"}, {"-dp", "--data-parallel-size"}, {"-ep", "--enable-expert-parallel"},
        {"-dcp", "--decode-context-parallel-size"}, {"-ac", "--attention-config"}, {"-sc", "--speculative-config"}};
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
    // CLI11's names (negations marked "!" as in the table), multi-letter short spellings left out: main()
    // expands them.
    std::string names;
    for (const std::string& name : split_names(flag.names)) {
      if (is_multi_letter_short(name)) continue;
      names += (names.empty() ? "" : ",") + name;
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
        // The positive name, or the first negation (CLI11 does not say which of several was used).
        const size_t negation = flag.names.find(",!");
        given = negation == std::string::npos || *g.on ? name : split_names(flag.names.substr(negation + 2)).front();
        same = std::find(flag.same_as_sparrow.begin(), flag.same_as_sparrow.end(), given) != flag.same_as_sparrow.end();
      }
      if (same) continue;  // what sparrow does anyway
      if (flag.action == VllmFlagAction::Refuse) fail(given, ": not supported: ", flag.why);
      std::fprintf(stderr, "sparrow serve: %s: ignored: %s\n", given.c_str(), flag.why.c_str());
    }
  };
}

}  // namespace sparrow::cli
