// Subcommands of the `sparrow` binary. add_X registers X's flags and remembers what to run when X is
// selected; run_selected() runs it after parsing. Each lives in X_command.cpp (detokenize beside tokenize,
// bench kv-quality in kv_quality_command.cpp), so that no file here shares its name with one of the
// engine's (engine/generate.cpp, cache/kv_plan.cpp); what several share is in common.cpp and
// text_generation.h.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/planner.h"
#include "engine/speculative.h"
#include "model/lora.h"
#include "model/model.h"
#include "vision/image_input.h"
#include "runner/model_runner.h"

namespace sparrow::cli {

void add_score(CLI::App& app);
void add_generate(CLI::App& app);
void add_bench(CLI::App& app);
void add_serve(CLI::App& app);
void add_render(CLI::App& app);
void add_tokenize(CLI::App& app);
void add_detokenize(CLI::App& app);
void add_chat(CLI::App& app);
void add_perplexity(CLI::App& app);
void add_kv_plan(CLI::App& app);
void add_proxy(CLI::App& app);
// sparrow bench kv-quality (kv_quality_command.cpp), registered under `bench`.
void add_bench_kv_quality(CLI::App* bench);

// The bundled model's folder (models/minimax_m3, found beside the executable's folder or in the
// current directory), for commands run without --model; a one-line error if it is not there
// (common.cpp).
std::string default_model_dir();

// A --model argument's config.json: MODEL/config.json, or MODEL itself when it is a file (a shape config
// such as bench/shapes/*.json). A MODEL that is neither (a typo, a Hugging Face hub id) is a one-line
// "not a directory" error saying how to get a local folder.
std::string model_config_path(const std::string& model);
// The model folder's context length (formats/config.h model_positions); nullopt when it has none.
std::optional<ModelPositions> model_positions(const std::string& model);
// The same, a one-line error when config.json has none: the one context-length rule, used by every
// command (serve and kv-plan unless --max-model-len is given; generate, chat, perplexity, kv-quality).
int64_t model_context_length(const std::string& model);

// --device cpu|cuda (vLLM's flag): where the model runs; vLLM's --enforce-eager (no CUDA graphs) and
// --load-format auto|safetensors|fastsafetensors|dummy (dummy: random weights from config.json alone).
void add_device_option(CLI::App* sub, std::string& device);
// load_model on `device` ("cpu" | "cuda") with the --load-format choices applied. With
// --tensor-parallel-size N (or under a launcher) this process joins or starts the run first and loads its
// part of the model; on a worker rank the call never returns (it runs rank 0's steps, then exits). With
// --data-parallel-size D the run is D groups of N ranks, and `groups` says what their leaders do: serve
// (EveryGroupServes: each runs an engine of its own), take a share of the command's inputs
// (EveryGroupTakesAShare: cli_group_share, cli_gather_shares), or leave the command to the first group
// (FirstGroupRuns: the call never returns on the other leaders, which step along with it, their experts
// serving its tokens, then exit).
enum class GroupRole { FirstGroupRuns, EveryGroupServes, EveryGroupTakesAShare };
std::unique_ptr<Model> load_cli_model(const std::string& dir, const std::string& device,
                                      GroupRole groups = GroupRole::FirstGroupRuns);
// Data parallel, EveryGroupTakesAShare: the inputs of n this group runs, every D-th from its group number (all
// of them without data parallelism).
std::vector<size_t> cli_group_share(size_t n);
// After its share: this group steps along (idle, its experts serving the others' tokens) until every group
// is done, then hands `mine` to rank 0, which gets every group's in group order (its own first). Without data
// parallelism {mine}; on the other groups' leaders an empty list (their command ends there, quietly).
// `runner`: one of this group's runners (it sends the idle steps to the group's workers).
// The bytes are a message of core/wire.h.
std::vector<std::vector<uint8_t>> cli_gather_shares(ModelRunner& runner, std::vector<uint8_t> mine);
// This process's data-parallel group (0 without data parallelism), and how many groups there are.
int cli_data_parallel_rank();
int cli_data_parallel_size();
// Serving with --data-parallel-size, on a group's leader (engine/remote_groups.h): rank 0's links to the
// other leaders, or another leader's link to rank 0 (ProcessGroup::connect_engine_links).
std::vector<Communicator*> cli_engine_links();
// The same run without a model (bench collectives): joins or starts it and returns the group's model
// communicator; every rank returns and runs the command itself. Errors without -tp N > 1 or a launcher.
Communicator& join_cli_group(const std::string& device);
// How the command's model runners run steps: --enforce-eager; on rank 0 of a tensor-parallel run, the
// workers they drive.
RunnerOptions cli_runner_options();
// The parallel layout load_cli_model made, in words: "one process (tensor parallel 1)" or "tensor parallel 4
// (4 processes, expert parallel)".
std::string cli_parallel_layout();
// No tensor- or data-parallel group: the model runs in this process alone.
bool cli_single_process();
// main() records its arguments (what the workers a tensor-parallel run starts are given). On an error it
// calls report_failure: the message goes to stderr ("error: ...", with the rank on a worker) and a tensor-parallel run
// is abandoned: its workers are killed rather than told to stop.
void set_program_arguments(char** argv);
void report_failure(const char* message);

// vLLM's LoRA flags (docs/lora.md): --enable-lora, --lora-modules NAME=PATH | JSON ..., --max-loras,
// --max-lora-rank, --max-cpu-loras.
struct LoraFlags {
  bool enable = false;
  std::vector<std::string> modules;
  int64_t max_loras = 1, max_lora_rank = 16, max_cpu_loras = 0;  // vLLM's defaults; max_cpu_loras 0: max_loras
};
void add_lora_options(CLI::App* sub, LoraFlags& flags);
// The flags checked at once (before the model loads): one-line errors.
void check_lora_flags(const LoraFlags& flags);
// The --lora-modules adapters (model/lora.h) for `model` (rank 0's part of it under tensor parallelism; the
// workers load theirs when a step first needs one). Errors under data or decode context parallelism.
std::vector<std::shared_ptr<const LoraAdapter>> load_cli_loras(const LoraFlags& flags, const std::string& model_dir,
                                                              const Model& model);

// vLLM's --kv-cache-dtype and --attention-config (JSON; sparrow takes "indexer_kv_dtype"): the cache
// formats of docs/cache.md. serve, perplexity and bench kv-quality share them.
void add_cache_format_options(CLI::App* sub, std::string& kv_cache_dtype, std::string& attention_config);
// Those flags applied to `config`, each checked at once (a typo is a one-line error before anything loads).
void apply_cache_format_flags(const std::string& kv_cache_dtype, const std::string& attention_config,
                              CacheConfig& config);
// One prefill of `ids` as a fresh sequence in a paged KvCache of `config`'s formats (block_size 64, no
// prefix caching, a budget of just the rows it needs): the logits [ids.size(), vocab] on the CPU.
Tensor forward_in_kv_cache(ModelRunner& runner, const std::vector<int32_t>& ids, CacheConfig config);

// perplexity's recipe (perplexity_command.cpp): the ids cut into consecutive windows of `window` tokens
// (a last window of one token dropped), and the summed negative log-likelihood of a window's tokens after
// its first given its logits.
std::vector<std::vector<int32_t>> perplexity_windows(const std::vector<int32_t>& ids, int64_t window);
double window_nll(const Tensor& logits, const std::vector<int32_t>& chunk);

// vLLM's --speculative-config (engine/speculative.h, docs/speculative.md): serve, generate and chat.
void add_speculative_option(CLI::App* sub, std::string& json);
// The flag's config, checked at once (empty text: no speculation); one notice for the vLLM keys it ignores.
SpeculativeConfig read_speculative_config(const std::string& json);
// Method draft_model: its draft model (config.model) loaded on `device` in this process, unsharded; method mtp:
// the MTP layer of the served model's folder `model_dir` (one process only: not under -tp / -dp yet); method
// dspark: the DSpark drafter of config.model bound to `target` (model/dspark.h; under -tp / -dp whole on each
// group's rank 0); null for ngram.
std::unique_ptr<Model> load_draft_model(const SpeculativeConfig& config, const std::string& model_dir,
                                        const std::string& device, Model& target);

// Registers the action of a subcommand (called from add_X).
void on_selected(CLI::App* sub, std::function<void()> action);
void run_selected();

// A prompt file: {"prompts": [[id, ...], ...]}, where a prompt may also be {"ids": [...], "images": ["a.png", ...]}
// (the ids holding each image's placeholder tokens as its processor expands them, the paths relative to the file).
// Errors name the file and the problem.
struct PromptFile {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<std::string>> images;  // each prompt's image paths, resolved; empty lists for text
  bool has_images() const;
};
PromptFile read_prompt_file(const std::string& path);
// The prompt's images as the engine takes them (vision/image_input.h), processed for the model in `model_dir` and
// placed on its placeholders (`placeholder`, the tower's id); one-line errors naming the prompt and the image.
std::vector<vision::ImageInput> prompt_images(const PromptFile& file, size_t prompt, const std::string& model_dir,
                                              int32_t placeholder);

}  // namespace sparrow::cli
