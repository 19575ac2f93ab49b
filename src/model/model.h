// The model interface: one forward pass over a batch of sequences, each contributing a run of new
// tokens that continue its cached state. Prefill is a long run, decode a run of one; both go through
// the same code, and a prefill followed by decodes must equal one long prefill.
//
// Model::forward is the math alone. Running a batch (checking it, uploading the step's inputs,
// replaying a decode graph, advancing the sequences) is the runner's job (runner/model_runner.h).
//
// A sequence's cache (what each layer keeps between steps: attention rows, index keys, convolution
// tails, recurrent state) is reached through its SequenceCache (core/sequence_cache.h). Offline use
// gets a private one from ModelRunner::new_sequence(); the serving engine hands each running sequence a
// view of its paged cache (cache/kv_cache.h). The model math does not change between the two.
#pragma once
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/tensor.h"
#include "formats/checkpoint.h"
#include "formats/config.h"
#include "core/sequence_cache.h"
#include "model/lora.h"

namespace sparrow {

struct LoraAdapter;
class VisionEncoder;

struct SequenceState {
  int64_t length = 0;              // tokens already processed (the position of the next token)
  SequenceCache* cache = nullptr;  // where the layers keep this sequence's rows and state
  std::unique_ptr<SequenceCache> owned_cache;  // set when the sequence owns its cache (ModelRunner::new_sequence)
  std::shared_ptr<const LoraAdapter> lora;     // the sequence's LoRA adapter (model/lora.h); null: the base model
};


// One sequence's share of a batch: rows [offset, offset + count) of the batch, at positions
// state->length ... state->length + count - 1. Unless the batch wants every row's logits, its last
// `logits` rows get them: 1 to sample the next token, more to verify speculative draft tokens (the row
// before each draft token and the last).
struct SeqSlice {
  SequenceState* state;
  int64_t offset;
  int64_t count;
  int64_t logits = 1;
  int64_t start() const { return state->length; }
  SequenceCache& cache() const { return *state->cache; }
};

struct DeviceStep;
struct DecoderLayer;
class Checkpoint;
struct TensorsInMemory;

struct Batch {
  std::vector<int32_t> tokens;     // all new tokens, sequence after sequence
  std::vector<int64_t> positions;  // their absolute positions
  std::vector<SeqSlice> seqs;
  // true: logits for every token; false: only for each sequence's last SeqSlice::logits rows (decode,
  // sampling, speculative verification).
  bool all_logits = true;
  int64_t size() const { return int64_t(tokens.size()); }
  // Whether any sequence runs with a LoRA adapter (model/lora.h).
  bool has_lora() const;
  // Rows of the logits forward() returns: the batch's size, or the sequences' logits rows summed.
  int64_t logit_rows() const;

  // The positions as an int64 tensor on `device`, made on first use and shared by every layer.
  const Tensor& positions_on(Device device) const;
  mutable Tensor positions_tensor;
  mutable std::shared_ptr<const DeviceStep> device_step;  // model/device_step.h (attached by the runner)
  // Data parallelism (TensorParallel::data_parallel): every group's token count in this step, this group's
  // among them (attached by the runner: runner/data_parallel.h); empty otherwise.
  mutable std::vector<int64_t> group_tokens;
  // Speculative decoding's MTP and DSpark drafters (model/mtp.h, model/dspark.h) read the target's hidden
  // states: with keep_hidden_states, forward() leaves every row's (the state the output head reads,
  // [size(), hidden], or the streams of DecoderModel::aux_hidden_layers side by side, on the model's device)
  // in hidden_states; a drafter's batch brings them in hidden_states_in (the MTP layer gets its own back in
  // hidden_states).
  bool keep_hidden_states = false;
  mutable Tensor hidden_states;
  mutable Tensor hidden_states_in;  // mutable: a CUDA graph points it at its own copy (runner/decode_graphs.h)
  // Images (model/vision_encoder.h): rows whose input is given instead of their token's embedding, row
  // embedded_rows[i] taking row i of `embedded` ([embedded_rows.size(), hidden] fp32 on the host): an image's
  // placeholder tokens take the vision tower's output there (vLLM's merge_multimodal_embeddings). Empty for text.
  std::vector<int64_t> embedded_rows;
  Tensor embedded;
};

// The rows of `x` ([batch.size(), ...]) that get logits: each sequence's last SeqSlice::logits rows (on a GPU
// through the step's uploaded logit_rows). The output heads of the decoder and of the MTP layer read them.
Tensor select_logit_rows(const Tensor& x, const Batch& batch);

// Builds a batch from (state, new tokens) pairs.
Batch make_batch(const std::vector<std::pair<SequenceState*, std::vector<int32_t>>>& parts);

// Marks the end of each part of a forward pass (the embedding, each layer's mixer and feed-forward, ...),
// for step profiles (runner/step_profile.h).
class StepMarks {
 public:
  virtual ~StepMarks() = default;
  virtual void mark(const std::string& part) = 0;
};

class Model {
 public:
  virtual ~Model();

  virtual const std::string& model_type() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t num_layers() const = 0;

  // What each layer caches per token and per sequence (the paged cache's planner reads it).
  virtual std::vector<LayerCacheSpec> cache_spec() const = 0;

  // Where the weights live and the forward pass runs.
  virtual Device device() const { return Device::Cpu; }
  // Whether a CUDA graph may capture its decode steps: not when its collectives go through the host
  // (a tensor-parallel model on a host communicator: kernels/collective_ops.cpp).
  virtual bool capturable() const { return true; }

  // The forward pass over a checked batch whose caches have room for its tokens (and, on a GPU, whose
  // step's inputs are attached: model/device_step.h). Returns fp32 logits on the model's device:
  // [batch.logit_rows(), vocab]: every row when batch.all_logits, else each sequence's last
  // SeqSlice::logits rows, sequence after sequence. Writes the new tokens' rows and state into the caches but leaves each state's length
  // alone (the runner advances it). `marks`, when given, gets the end of each part.
  virtual Tensor forward(const Batch& batch, StepMarks* marks) = 0;
  // The vision tower that makes the embeddings of Batch::embedded_rows from images; null for a text-only model.
  virtual const VisionEncoder* vision() const { return nullptr; }
  // The part of each checkpoint weight this rank holds, by name, for the weights a tensor-parallel load
  // split (Checkpoint::splits; empty unsharded): LoRA adapters take the same part (model/lora.h).
  std::map<std::string, Split> weight_splits;
  // Why an adapter may not target the routed experts here ("" when it may): load_model's verdict.
  std::string routed_expert_lora_refused;
  // What LoRA adapters are loaded for (load_lora_adapter).
  LoraTarget lora_target() const;
  // A data-parallel group's step without tokens of its own while other groups run theirs
  // (batch.group_tokens set, this group's count 0): the parts that meet the other groups (the shared
  // experts' layers) run on no rows, in the forward pass's order, so that their collectives meet.
  virtual void step_idle(const Batch& batch) { (void)batch; }
};

// Loads a Hugging Face model folder onto `device`; dispatches on config.json's model_type. One-line
// errors for anything wrong with the folder, or for a family the device cannot run yet.
std::unique_ptr<Model> load_model(const std::string& dir, Device device = Device::Cpu);

// vLLM's --load-format: "auto", "safetensors" and "fastsafetensors" (vLLM's name for its fast loader) read
// the folder's safetensors through the one fast path: mmapped shards, read ahead in parallel
// (Checkpoint::prefetch); "dummy" builds the model from config.json alone with random weights at its real
// dimensions (Checkpoint::open_dummy, formats/dummy_weights.h), for benchmarks of shapes whose weights are
// not here.
struct LoadOptions {
  std::string load_format = "auto";
  // Shard files read ahead at once, and how far ahead of the loader (bytes).
  int prefetch_threads = 8;
  int64_t prefetch_window_bytes = int64_t(8) << 30;
  // Progress lines (formats/load_progress.h) go to `progress` (null: none) when the checkpoint holds at
  // least `progress_min_bytes`; `progress_live` redraws one line (a terminal).
  std::FILE* progress = nullptr;
  bool progress_live = false;
  int64_t progress_min_bytes = int64_t(1) << 30;
  uint64_t dummy_seed = 0;  // the dummy weights' seed
  // "uniform_random": every MoE layer routes each token to uniformly drawn experts (SigmoidRouter, for
  // benchmarks: vLLM's VLLM_MOE_ROUTING_SIMULATION_STRATEGY); empty: the model's own routing.
  std::string moe_routing_simulation;
  // Tensor parallelism (docs/parallel.md): this process's rank in the group it loads its part of the model
  // for, and the group's communicator (which must outlive the model). Unsharded by default.
  TensorParallel tensor_parallel;
  // New weights from memory in place of the folder's tensors of the same names (Checkpoint::replace_tensors:
  // the Python API's update_weights from host buffers). Null: the folder's own.
  std::shared_ptr<const TensorsInMemory> replaced_tensors;
};
std::unique_ptr<Model> load_model(const std::string& dir, Device device, const LoadOptions& options);

// What load_model and the MTP drafter's loader (model/mtp.h) share. The checkpoint of `dir` for the options'
// load format (its weights, or dummy ones from config.json alone) on `device`; a one-line error for an
// unknown load format or routing simulation.
std::unique_ptr<Checkpoint> open_checkpoint(const std::string& dir, Device device, const LoadOptions& options);
// The options' routing simulation on a decoder layer: its MoE block (if it has one) draws uniform experts,
// salted by the layer's index.
void simulate_routing(DecoderLayer& layer, int layer_index, const LoadOptions& options);

// The cache spec load_model(dir)->cache_spec() would give, from config.json alone (no weights): lets the
// cache planner size real models from their config (bench/shapes/*.json).
std::vector<LayerCacheSpec> cache_spec_from_config(const Config& config);

}  // namespace sparrow
