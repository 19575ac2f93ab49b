#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "cache/kv_plan.h"
#include "cli/commands.h"
#include "core/batch_invariance.h"
#include "core/device/device.h"
#include "core/error.h"
#include "distributed/process_group.h"
#include "model/dspark.h"
#include "model/mtp.h"
#include "runner/data_parallel.h"
#include "runner/step_plan.h"
#include "vision/image_processor.h"

namespace sparrow::cli {
namespace {
std::vector<std::pair<CLI::App*, std::function<void()>>>& actions() {
  static std::vector<std::pair<CLI::App*, std::function<void()>>> a;
  return a;
}
}  // namespace

namespace {
bool enforce_eager = false;  // one command runs per process
std::string load_format = "auto";
std::string moe_routing_simulation;
ParallelConfig parallel_config;
char** program_arguments = nullptr;
const std::string* attention_config_flag = nullptr;  // --attention-config of the command, when it has one
// --token-sharded-prefill; -1: the backend's default, kDefaultTokenShardedPrefillCpu tokens on the CPU (where it was
// measured faster from there: docs/parallel.md), off on a GPU (no GPU path yet).
int64_t token_sharded_prefill_rows = -1;
constexpr int64_t kDefaultTokenShardedPrefillCpu = 512;

// This process's place in a tensor-parallel run (docs/parallel.md), once its model is loaded: rank 0 keeps
// the plan channel its runners drive the workers through. The channel goes before the group (it says Stop
// over the group's plan communicator).
// With data parallelism each group's leader keeps the meeting of the leaders (runner/data_parallel.h); in
// a command other than serve the first group runs the command and the other groups follow its steps
// (follow_first_group), so rank 0 tells them when the command is over.
struct ParallelRun {
  std::unique_ptr<ProcessGroup> group;
  std::unique_ptr<WorkerChannel> workers;
  std::unique_ptr<DataParallelSync> data_parallel;
  bool groups_follow = false;  // the other groups follow rank 0's steps (not serve)
  ~ParallelRun() {
    if (data_parallel && groups_follow && group && group->data_parallel_rank() == 0) {
      try {
        data_parallel->exchange(0, /*stop=*/true);
      } catch (const Error&) {
        // A group already gone: the supervisor reports it.
      }
    }
    data_parallel.reset();
    workers.reset();
    group.reset();
  }
};
ParallelRun& parallel_run() {
  static ParallelRun run;
  return run;
}
}  // namespace

void set_program_arguments(char** argv) { program_arguments = argv; }

void add_device_option(CLI::App* sub, std::string& device) {
  sub->add_option("--device", device, "where the model runs: cpu or cuda (an NVIDIA Hopper GPU)")
      ->capture_default_str();
  sub->add_flag("--enforce-eager,!--no-enforce-eager", enforce_eager, "launch every kernel of a decode step directly (no CUDA graphs)");
  sub->add_flag_callback(
      "--batch-invariant", [] { set_batch_invariant(true); },
      "a request's logprobs are bitwise the same whatever batch it runs in (vLLM's VLLM_BATCH_INVARIANT=1, "
      "also read; docs/engine.md): on the GPU each kernel makes the choice that depends on the row alone");
  sub->add_option("--load-format", load_format,
                  "auto, safetensors or fastsafetensors: the folder's weights, read ahead in parallel (one fast "
                  "path, whatever the name); dummy: random weights from config.json alone (benchmarks at real "
                  "dimensions, docs/bench.md)")
      ->capture_default_str();
  sub->add_option("--moe-routing-simulation", moe_routing_simulation,
                  "uniform_random: route each token to uniformly drawn experts, as the roofline assumes (benchmarks "
                  "only: outputs are no longer the model's; vLLM's VLLM_MOE_ROUTING_SIMULATION_STRATEGY)");
  sub->add_option("--tensor-parallel-size", parallel_config.tensor_parallel_size,
                  "processes the model is split over (also -tp; docs/parallel.md): without a launcher this process starts and "
                  "supervises the other ranks on this machine; under torchrun-style variables, mpirun or srun it is "
                  "the rank they say")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--data-parallel-size", parallel_config.data_parallel_size,
                  "groups of --tensor-parallel-size processes that each run their own requests, attention and KV "
                  "cache, the routed experts split over all of them (also -dp; docs/parallel.md)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--decode-context-parallel-size", parallel_config.decode_context_parallel_size,
                  "tensor-parallel ranks, this many at a time, that share out the MLA latents and DSA index keys by "
                  "token (also -dcp; vLLM's DCP: W times the context, docs/parallel.md); must divide "
                  "--tensor-parallel-size")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--token-sharded-prefill", token_sharded_prefill_rows,
                  "under --tensor-parallel-size: steps of at least this many tokens run the MLA layers' indexer and "
                  "attention on a share of the tokens for every head (two all-to-alls) instead of every token for "
                  "this rank's heads; 0: never; default 512 on the CPU, off on a GPU (docs/parallel.md, "
                  "\"Token-sharded prefill\")")
      ->check(CLI::NonNegativeNumber);
  sub->add_flag("--enable-expert-parallel,!--disable-expert-parallel,!--no-enable-expert-parallel",
                parallel_config.enable_expert_parallel,
               "deal the routed experts out whole over the tensor-parallel ranks instead of splitting each one "
               "(vLLM's expert parallelism; attention and shared experts stay tensor parallel)");
  sub->add_option("--nnodes,-n", parallel_config.nnodes,
                  "machines the ranks run on, without a launcher: each starts --tensor-parallel-size / nnodes of them "
                  "(the same command on each, with its --node-rank and --master-addr)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--node-rank,-r", parallel_config.node_rank,
                  "which of the --nnodes machines this is: 0 serves, the others run with --headless")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  sub->add_flag("--headless", parallel_config.headless,
                "run this node's ranks only, no server (the nodes after the first, --node-rank 1 and up)");
  sub->add_option("--master-addr", parallel_config.master_addr,
                  "rank 0's address, where the ranks meet (default MASTER_ADDR, else 127.0.0.1)");
  sub->add_option("--master-port", parallel_config.master_port,
                  "the port rank 0 listens on for them (default MASTER_PORT, else a free port on one machine and "
                  "29500 under a launcher)")
      ->check(CLI::Range(1, 65535));
}

namespace {
// Joins (or starts) the tensor-parallel run this process is part of.
ParallelRun& start_run(const std::string& device, const LaunchEnv& env) {
  ParallelRun& run = parallel_run();
  SPARROW_CHECK(!run.group, "a command joins its tensor-parallel run once");
  SPARROW_CHECK(program_arguments, "the program's arguments were not recorded (set_program_arguments)");
  // A GPU rank takes its GPU first (NCCL joins on the current device). NCCL when every rank on this machine has
  // a GPU of its own; ranks that share one stage their collectives through the host (docs/parallel.md).
  ParallelConfig config = parallel_config;
  if (parse_device(device) != Device::Cpu) {
    sparrow::device::select_for_local_rank(env.local_rank);
    const int ranks_here = env.launcher.empty() ? config.world_size() / std::max(1, config.nnodes)
                                                : env.local_world_size;
    config.device_collectives = ranks_here <= sparrow::device::count() && !std::getenv("SPARROW_HOST_COLLECTIVES");
  }
  run.group = ProcessGroup::start(config, env, program_arguments);
  return run;
}
}  // namespace

Communicator& join_cli_group(const std::string& device) {
  const LaunchEnv env = read_launch_env();
  SPARROW_CHECK(parallel_config.multi_process() || !env.launcher.empty(),
                "this command needs a group of processes: give --tensor-parallel-size N (N >= 2) or start it "
                "under a launcher (docs/parallel.md)");
  Communicator* model = start_run(device, env).group->model();
  SPARROW_CHECK(model, "this command measures a tensor-parallel group: give --tensor-parallel-size N (N >= 2)");
  return *model;
}

namespace {
// A data-parallel group after the first, in a command other than serve: its steps are the first group's
// (each on no rows of its own: the experts it holds serve the first group's tokens) until that group's
// command ends.
[[noreturn]] void follow_first_group(std::unique_ptr<Model> model) {
  ParallelRun& run = parallel_run();
  {
    ModelRunner runner(*model, cli_runner_options());
    while (runner.run_idle() != IdleStep::Stopped) {
    }
  }
  run.data_parallel.reset();
  run.workers.reset();  // the group's workers leave
  model.reset();
  run.group.reset();
  std::fflush(nullptr);
  std::_Exit(0);
}

// --load-format and --moe-routing-simulation, for the model and its MTP drafter alike.
LoadOptions weight_options() {
  LoadOptions options;
  options.load_format = load_format;
  options.moe_routing_simulation = moe_routing_simulation;
  return options;
}
}  // namespace

std::unique_ptr<Model> load_cli_model(const std::string& dir, const std::string& device, GroupRole groups) {
  LoadOptions options = weight_options();
  // A checkpoint of 1 GB or more shows its progress and load rate on stderr.
  options.progress = stderr;
  options.progress_live = ::isatty(STDERR_FILENO) != 0;
  const LaunchEnv env = read_launch_env();
  SPARROW_CHECK(parallel_config.tensor_parallel_size % parallel_config.decode_context_parallel_size == 0,
                "--decode-context-parallel-size ", parallel_config.decode_context_parallel_size,
                " must divide --tensor-parallel-size ", parallel_config.tensor_parallel_size,
                " (DCP shares the TP ranks: give -tp too)");
  // Batch-invariant mode on GPUs: NCCL's all-reduce orders a sum of three or more ranks by the message's size,
  // which moves with the batch; two ranks add one pair, the same either way.
  const int summing_ranks = parallel_config.tensor_parallel_size *
                            (parallel_config.enable_expert_parallel ? parallel_config.data_parallel_size : 1);
  SPARROW_CHECK(!batch_invariant() || parse_device(device) == Device::Cpu || summing_ranks <= 2,
                "batch-invariant mode on GPUs takes at most 2 ranks in a tensor- or expert-parallel group (NCCL's "
                "all-reduce sums three or more in an order that depends on the batch); this run sums over ",
                summing_ranks);
  if (!parallel_config.multi_process() && env.launcher.empty()) return load_model(dir, parse_device(device), options);

  // Tensor parallel: join (or start) the run, load this rank's part; a worker then only runs steps.
  ParallelRun& run = start_run(device, env);
  options.tensor_parallel = run.group->tensor_parallel();
  options.tensor_parallel.expert_parallel = parallel_config.enable_expert_parallel;
  options.tensor_parallel.token_sharded_prefill_rows =
      token_sharded_prefill_rows >= 0 ? token_sharded_prefill_rows
                                      : parse_device(device) == Device::Cpu ? kDefaultTokenShardedPrefillCpu : 0;
  if (attention_config_flag)  // the model's part of --attention-config (the cache's is applied with the cache)
    options.tensor_parallel.indexer_decode_cp = parse_attention_config(*attention_config_flag).indexer_decode_cp;
  if (run.group->rank() != 0) options.progress = nullptr;
  std::unique_ptr<Model> model = load_model(dir, parse_device(device), options);
  if (!run.group->leader()) {
    run_worker(*model, *run.group->plans(), cli_runner_options());
    model.reset();
    run.group.reset();
    std::fflush(nullptr);
    std::_Exit(0);
  }
  if (run.group->plans()) run.workers = std::make_unique<WorkerChannel>(*run.group->plans());
  if (run.group->leaders()) {
    run.data_parallel = std::make_unique<DataParallelSync>(*run.group->leaders());
    run.groups_follow = groups == GroupRole::FirstGroupRuns;
    if (run.groups_follow && run.group->data_parallel_rank() != 0) follow_first_group(std::move(model));
  }
  return model;
}

std::vector<size_t> cli_group_share(size_t n) {
  const ParallelRun& run = parallel_run();
  const size_t groups = run.data_parallel ? size_t(run.group->data_parallel_size()) : 1;
  const size_t mine = run.data_parallel ? size_t(run.group->data_parallel_rank()) : 0;
  std::vector<size_t> share;
  for (size_t i = mine; i < n; i += groups) share.push_back(i);
  if (groups > 1 && mine == 0) {
    std::string counts;
    for (size_t g = 0; g < groups; ++g) counts += (g ? " + " : "") + std::to_string(n / groups + (g < n % groups));
    std::fprintf(stderr, "sparrow: %zu inputs over %zu data-parallel groups, input i to group i mod %zu (%s)\n", n,
                 groups, groups, counts.c_str());
  }
  return share;
}

std::vector<std::vector<uint8_t>> cli_gather_shares(ModelRunner& runner, std::vector<uint8_t> mine) {
  ParallelRun& run = parallel_run();
  if (!run.data_parallel) return {std::move(mine)};
  SPARROW_CHECK(!run.groups_follow, "cli_gather_shares: the command was loaded with GroupRole::EveryGroupTakesAShare");
  // Every group steps until the exchange where all of them have nothing left (the same wave everywhere).
  for (IdleStep step = runner.run_idle(); step != IdleStep::Settled; step = runner.run_idle())
    SPARROW_CHECK(step != IdleStep::Stopped, "a data-parallel group left before the others were done");
  Communicator& leaders = *run.group->leaders();
  const int groups = leaders.size(), me = leaders.rank();
  int64_t size = int64_t(mine.size());
  std::vector<int64_t> sizes(groups);
  leaders.all_gather(&size, sizes.data(), 1, ScalarType::I64);
  if (me != 0) {
    leaders.send(mine.data(), size, 0);
    return {};
  }
  std::vector<std::vector<uint8_t>> all(groups);
  all[0] = std::move(mine);
  for (int g = 1; g < groups; ++g) {
    all[g].resize(size_t(sizes[g]));
    leaders.recv(all[g].data(), sizes[g], g);
  }
  return all;
}

std::vector<Communicator*> cli_engine_links() {
  ParallelRun& run = parallel_run();
  SPARROW_CHECK(run.group && run.data_parallel && !run.groups_follow,
                "the engines' links are for serving with --data-parallel-size");
  return run.group->connect_engine_links();
}

int cli_data_parallel_rank() {
  const ParallelRun& run = parallel_run();
  return run.group ? run.group->data_parallel_rank() : 0;
}

int cli_data_parallel_size() {
  const ParallelRun& run = parallel_run();
  return run.group ? run.group->data_parallel_size() : 1;
}

bool cli_single_process() { return parallel_run().group == nullptr; }

std::string cli_parallel_layout() {
  const ParallelRun& run = parallel_run();
  if (!run.group) return "one process (tensor parallel 1)";
  const int tp = run.group->tensor_parallel_size(), dp = run.group->data_parallel_size();
  const int dcp = parallel_config.decode_context_parallel_size;
  return "tensor parallel " + std::to_string(tp) + (dp > 1 ? " x data parallel " + std::to_string(dp) : "") +
         (dcp > 1 ? ", decode context parallel " + std::to_string(dcp) : "") + " (" +
         std::to_string(run.group->size()) + " processes" +
         (parallel_config.enable_expert_parallel ? ", expert parallel)" : ")");
}

void report_failure(const char* message) {
  ParallelRun& run = parallel_run();
  if (run.group && run.group->rank() != 0)
    std::fprintf(stderr, "error: tensor-parallel rank %d of %d: %s\n", run.group->rank(), run.group->size(), message);
  else
    std::fprintf(stderr, "error: %s\n", message);
  // The workers may be inside a collective rank 0 will never join: the supervisor's kill, not a Stop.
  run.workers.release();  // NOLINT: deliberately not destroyed (its destructor would send Stop)
  run.data_parallel.reset();  // the other groups are killed or see their peer gone: no stop to send
  if (run.group) run.group->kill_workers();
  run.group.reset();
}

RunnerOptions cli_runner_options() {
  RunnerOptions options;
  options.enforce_eager = enforce_eager;
  options.workers = parallel_run().workers.get();
  options.data_parallel = parallel_run().data_parallel.get();
  return options;
}

void add_lora_options(CLI::App* sub, LoraFlags& flags) {
  sub->add_flag("--enable-lora,!--disable-lora,!--no-enable-lora", flags.enable, "serve LoRA adapters (docs/lora.md)");
  sub->add_option("--lora-modules", flags.modules,
                  "adapters to serve, each NAME=PATH or a JSON object {\"name\": ..., \"path\": ...}; a request "
                  "naming NAME as its model runs with it");
  sub->add_option("--max-loras", flags.max_loras, "most adapters served at once")->capture_default_str();
  sub->add_option("--max-lora-rank", flags.max_lora_rank, "largest adapter rank accepted")->capture_default_str();
  sub->add_option("--max-cpu-loras", flags.max_cpu_loras, "accepted for vLLM's sake: every adapter stays on the device");
}

namespace {

struct LoraModule {
  std::string name, path;
};

// vLLM's LoRAParserAction: NAME=PATH, or a JSON object with "name" and "path" ("base_model_name" allowed).
LoraModule parse_lora_module(const std::string& text) {
  LoraModule m;
  if (!text.empty() && text.front() == '{') {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error&) {
      fail("--lora-modules: '", text, "' is not valid JSON");
    }
    SPARROW_CHECK(j.is_object() && j.contains("name") && j["name"].is_string() && j.contains("path") &&
                      j["path"].is_string(),
                  "--lora-modules: a JSON module needs string \"name\" and \"path\" (got ", text, ")");
    m.name = j["name"].get<std::string>();
    m.path = j["path"].get<std::string>();
  } else {
    const size_t eq = text.find('=');
    SPARROW_CHECK(eq != std::string::npos, "--lora-modules: expected NAME=PATH or a JSON object (got '", text, "')");
    m.name = text.substr(0, eq);
    m.path = text.substr(eq + 1);
  }
  SPARROW_CHECK(!m.name.empty() && !m.path.empty(), "--lora-modules: empty name or path in '", text, "'");
  return m;
}

}  // namespace

void check_lora_flags(const LoraFlags& flags) {
  SPARROW_CHECK(flags.enable || flags.modules.empty(), "--lora-modules needs --enable-lora");
  SPARROW_CHECK(flags.max_loras >= 1, "--max-loras must be at least 1 (got ", flags.max_loras, ")");
  SPARROW_CHECK(flags.max_lora_rank >= 1, "--max-lora-rank must be at least 1 (got ", flags.max_lora_rank, ")");
  SPARROW_CHECK(flags.max_cpu_loras == 0 || flags.max_cpu_loras >= flags.max_loras,
                "--max-cpu-loras (", flags.max_cpu_loras, ") must not be below --max-loras (", flags.max_loras, ")");
  SPARROW_CHECK(int64_t(flags.modules.size()) <= flags.max_loras, "--lora-modules names ", flags.modules.size(),
                " adapters, more than --max-loras ", flags.max_loras, " (sparrow keeps every adapter on the device)");
  std::vector<std::string> names;
  for (const std::string& text : flags.modules) {
    const LoraModule m = parse_lora_module(text);
    SPARROW_CHECK(std::find(names.begin(), names.end(), m.name) == names.end(), "--lora-modules: '", m.name,
                  "' is named twice");
    names.push_back(m.name);
  }
}

std::vector<std::shared_ptr<const LoraAdapter>> load_cli_loras(const LoraFlags& flags, const std::string& model_dir,
                                                              const Model& model) {
  check_lora_flags(flags);
  if (!flags.enable) return {};
  std::vector<std::shared_ptr<const LoraAdapter>> adapters;
  for (const std::string& text : flags.modules) {
    const LoraModule m = parse_lora_module(text);
    adapters.push_back(
        load_lora_adapter(m.name, m.path, model_dir, model.lora_target(), flags.max_lora_rank));
  }
  return adapters;
}

void add_cache_format_options(CLI::App* sub, std::string& kv_cache_dtype, std::string& attention_config) {
  attention_config_flag = &attention_config;
  sub->add_option("--kv-cache-dtype", kv_cache_dtype,
                  "KV-cache storage: auto (float32 on the CPU, bfloat16 on a GPU), float32, bfloat16, fp8 (= fp8_e4m3, "
                  "fp8_ds_mla: MLA latents in FlashMLA's 656-byte layout), fp8_per_tensor (MLA latents as 576 e4m3), "
                  "nvfp4 (docs/cache.md: each page kind's layout; the CPU and the GPU read every one)")
      ->capture_default_str();
  sub->add_option("--attention-config", attention_config,
                  "vLLM's attention settings as JSON: {\"indexer_kv_dtype\": auto|float32|bfloat16|fp8|mxfp4|nvfp4}, "
                  "the index keys' format (auto: fp8 DSA keys on a GPU, else the kv dtype); {\"indexer_decode_cp\": true}: "
                  "under -tp, each rank scores every MSA index head over its share of the key blocks (docs/parallel.md)");
}

void add_speculative_option(CLI::App* sub, std::string& json) {
  sub->add_option("--speculative-config", json,
                  "speculative decoding as vLLM's JSON (also -sc), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or "
                  "'{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 3}' (docs/speculative.md)");
}

SpeculativeConfig read_speculative_config(const std::string& json) {
  if (json.empty()) return {};
  SpeculativeConfig config = parse_speculative_config(json);
  if (!config.ignored_keys.empty()) {
    std::string keys;
    for (const std::string& key : config.ignored_keys) keys += (keys.empty() ? "" : ", ") + key;
    std::fprintf(stderr, "sparrow: --speculative-config: ignoring %s (docs/speculative.md says why)\n", keys.c_str());
  }
  return config;
}

std::unique_ptr<Model> load_draft_model(const SpeculativeConfig& config, const std::string& model_dir,
                                        const std::string& device, Model& target) {
  if (config.method == "mtp") {
    // Under -tp / -dp the MTP layer runs whole on each group's rank 0, beside the engine that drafts with it
    // (docs/speculative.md): its cache rows sit in that rank's cache after the target's layers, whose pages
    // are this rank's share of the target's (cache/kv_plan.h spec_per_rank), and the workers never see it.
    try {
      std::unique_ptr<MtpDrafter> drafter = load_mtp_drafter(model_dir, parse_device(device), weight_options());
      if (parallel_run().group)
        drafter->target_cache_spec = spec_per_rank(drafter->target_cache_spec, parallel_config.tensor_parallel_size,
                                                   parallel_config.decode_context_parallel_size);
      return drafter;
    } catch (const Error& e) {
      fail("--speculative-config: ", e.what());
    }
  }
  if (config.method == "dspark") {
    model_config_path(config.model);  // "not a directory" with the hint, as for --model
    try {
      // Under -tp / -dp it runs whole on each group's rank 0, as the MTP layer does (above).
      return load_dspark_drafter(config.model, target, weight_options(), model_dir);
    } catch (const Error& e) {
      fail("--speculative-config: the DSpark drafter ", config.model, ": ", e.what());
    }
  }
  if (config.method != "draft_model") return nullptr;
  model_config_path(config.model);  // "not a directory" with the hint, as for --model
  try {
    return load_model(config.model, parse_device(device));
  } catch (const Error& e) {
    fail("--speculative-config: the draft model ", config.model, ": ", e.what());
  }
}

void apply_cache_format_flags(const std::string& kv_cache_dtype, const std::string& attention_config,
                              CacheConfig& config) {
  config.kv_cache_dtype = kv_cache_dtype;
  parse_cache_dtype(kv_cache_dtype);
  if (!attention_config.empty()) apply_attention_config(attention_config, config);
}

Tensor forward_in_kv_cache(ModelRunner& runner, const std::vector<int32_t>& ids, CacheConfig config) {
  const Model& model = runner.model();
  config.block_size = 64;
  config.max_num_seqs = 1;
  config.enable_prefix_caching = false;
  // Size the budget from the plan's row and slot sizes: what this one sequence needs, plus a row spare.
  config.memory_bytes = int64_t(1) << 40;  // large enough to plan; nothing is allocated by planning
  const CachePlan probe = plan_cache(model.cache_spec(), config);
  const int64_t blocks = (int64_t(ids.size()) + config.block_size - 1) / config.block_size + 1;
  config.memory_bytes = blocks * probe.row_bytes + 2 * probe.state_slot_bytes;
  KvCache cache(model.cache_spec(), config);
  const SeqId id = cache.create_sequence();
  SequenceState state;
  state.cache = cache.view(id);
  SPARROW_CHECK(cache.allocate(id, int64_t(ids.size())), "kv cache: no room for ", ids.size(), " tokens");
  Tensor logits = runner.run(make_batch({{&state, ids}})).to(Device::Cpu);
  cache.free_sequence(id);
  return logits;
}

// The bundled model: models/minimax_m3 of the source tree. It is looked for beside the executable's
// folder (build/sparrow -> models/minimax_m3), then in the current directory.
std::string default_model_dir() {
  namespace fs = std::filesystem;
  const fs::path bundled = fs::path("models") / "minimax_m3";
  std::vector<fs::path> candidates;
  std::error_code error;
  fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back(exe.parent_path().parent_path() / bundled);
  candidates.push_back(fs::current_path(error) / bundled);
  for (const fs::path& dir : candidates)
    if (fs::exists(dir / "config.json")) return dir.lexically_normal().string();
  fail("no --model given and the bundled model (", bundled.string(),
       ") is neither next to the executable's folder nor in the current directory; pass --model DIR");
}

std::string model_config_path(const std::string& model) {
  namespace fs = std::filesystem;
  if (fs::is_regular_file(model)) return model;
  if (!fs::is_directory(model)) {
    // sparrow reads local folders only; ORG/NAME is what a Hugging Face hub id looks like.
    bool hub_id = !model.empty() && std::count(model.begin(), model.end(), '/') == 1 && model.front() != '/' &&
                  model.front() != '.';
    fail(model, ": not a directory (sparrow reads a local Hugging Face model folder and downloads nothing: fetch ",
         hub_id ? "it" : "the model", " first, e.g. `huggingface-cli download ", hub_id ? model : "ORG/NAME",
         " --local-dir DIR`, and pass DIR)");
  }
  return (fs::path(model) / "config.json").string();
}

std::optional<ModelPositions> model_positions(const std::string& model) {
  const std::string path = model_config_path(model);
  nlohmann::json config = nlohmann::json::object();
  if (std::filesystem::exists(path)) {
    std::ifstream in(path);
    config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    SPARROW_CHECK(!config.is_discarded() && config.is_object(), path, ": not a JSON object");
  }
  return sparrow::model_positions(config);
}

int64_t model_context_length(const std::string& model) {
  std::optional<ModelPositions> positions = model_positions(model);
  SPARROW_CHECK(positions, model_config_path(model),
                ": no context length (max_position_embeddings or another length field); serve and kv-plan "
                "take --max-model-len");
  return positions->tokens;
}

void on_selected(CLI::App* sub, std::function<void()> action) { actions().push_back({sub, std::move(action)}); }

void run_selected() {
  for (auto& [sub, action] : actions())
    if (sub->parsed()) action();
}

bool PromptFile::has_images() const {
  return std::any_of(images.begin(), images.end(), [](const std::vector<std::string>& list) { return !list.empty(); });
}

PromptFile read_prompt_file(const std::string& path) {
  std::ifstream in(path);
  SPARROW_CHECK(in, path, ": cannot open");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!j.is_discarded(), path, ": not valid JSON");
  SPARROW_CHECK(j.is_object() && j.contains("prompts") && j["prompts"].is_array(), path,
                ": expected {\"prompts\": [[id, ...], ...]}");
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  PromptFile file;
  for (const auto& p : j["prompts"]) {
    const size_t n = file.ids.size();
    const nlohmann::json* ids_json = &p;
    std::vector<std::string> images;
    if (p.is_object()) {
      SPARROW_CHECK(p.contains("ids"), path, ": prompt ", n, " is an object without \"ids\"");
      for (const auto& [key, value] : p.items())
        SPARROW_CHECK(key == "ids" || key == "images", path, ": prompt ", n, " has the unknown key \"", key,
                      "\" (a prompt takes ids and images)");
      ids_json = &p["ids"];
      if (p.contains("images")) {
        SPARROW_CHECK(p["images"].is_array(), path, ": prompt ", n, ": images must be a list of paths");
        for (const auto& image : p["images"]) {
          SPARROW_CHECK(image.is_string() && !image.get<std::string>().empty(), path, ": prompt ", n,
                        ": images must be a list of paths");
          images.push_back((folder / image.get<std::string>()).string());
        }
      }
    }
    SPARROW_CHECK(ids_json->is_array() && !ids_json->empty(), path, ": prompt ", n, " must be a non-empty list of ids");
    std::vector<int32_t> ids;
    for (const auto& v : *ids_json) {
      SPARROW_CHECK(v.is_number_integer(), path, ": prompt ", n, " holds a non-integer id");
      int64_t id = v.get<int64_t>();
      SPARROW_CHECK(id >= 0 && id <= INT32_MAX, path, ": prompt ", n, " holds the invalid id ", id);
      ids.push_back(int32_t(id));
    }
    file.ids.push_back(std::move(ids));
    file.images.push_back(std::move(images));
  }
  return file;
}

std::vector<vision::ImageInput> prompt_images(const PromptFile& file, size_t prompt, const std::string& model_dir,
                                              int32_t placeholder) {
  const std::vector<std::string>& paths = file.images[prompt];
  if (paths.empty()) return {};
  const vision::ImageProcessor processor = vision::ImageProcessor::for_model(model_dir);
  std::vector<vision::ImageInput> images;
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    SPARROW_CHECK(in, "prompt ", prompt, ": image ", path, ": cannot open");
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    try {
      images.push_back(processor.process(bytes));
    } catch (const std::exception& e) {
      fail("prompt ", prompt, ": image ", path, ": ", e.what());
    }
  }
  try {
    vision::place_images(file.ids[prompt], images, placeholder);
  } catch (const std::exception& e) {
    fail("prompt ", prompt, ": ", e.what());
  }
  return images;
}

}  // namespace sparrow::cli
