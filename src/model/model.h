// The model interface: one forward pass over a batch of sequences, each contributing a run of new
// tokens that continue its cached state. Prefill is a long run, decode a run of one; both go through
// the same code, and a prefill followed by decodes must equal one long prefill.
//
// The per-sequence state (SequenceState) holds, for every layer, what that layer keeps between steps:
// attention keys / latents, index keys, convolution tails, recurrent state. On this CPU reference path
// each layer's cache is a growable fp32 buffer; the paged, packed cache of the serving engine replaces
// it behind the same forward() without changing the model math.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "formats/config.h"

namespace sparrow {

// What one layer keeps for one sequence. Blocks use the fields they need; layouts are documented
// at each block.
struct LayerState {
  std::vector<float> kv;          // per-token attention rows (MLA latent + rope key, or GQA K and V)
  std::vector<float> index_keys;  // per-token index keys (DSA indexer, MSA indexer)
  std::vector<float> conv;        // short-convolution tail (KDA): the last kernel-1 inputs
  std::vector<float> recurrent;   // recurrent state (KDA): [heads, head_k_dim, head_v_dim]
};

struct SequenceState {
  int64_t length = 0;  // tokens already processed (the position of the next token)
  std::vector<LayerState> layers;
};

// One sequence's share of a batch: rows [offset, offset + count) of the batch, at positions
// state->length ... state->length + count - 1.
struct SeqSlice {
  SequenceState* state;
  int64_t offset;
  int64_t count;
  int64_t start() const { return state->length; }
};

struct Batch {
  std::vector<int32_t> tokens;     // all new tokens, sequence after sequence
  std::vector<int64_t> positions;  // their absolute positions
  std::vector<SeqSlice> seqs;
  // true: logits for every token; false: only for each sequence's last token (decode, sampling).
  bool all_logits = true;
  int64_t size() const { return int64_t(tokens.size()); }
};

// Builds a batch from (state, new tokens) pairs.
Batch make_batch(const std::vector<std::pair<SequenceState*, std::vector<int32_t>>>& parts);

class Model {
 public:
  virtual ~Model() = default;

  virtual const std::string& model_type() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t num_layers() const = 0;

  // A fresh state for a new sequence.
  SequenceState new_sequence() const {
    SequenceState s;
    s.layers.resize(num_layers());
    return s;
  }

  // Runs the batch and advances each state's length. Returns fp32 logits: [batch.size(), vocab] when
  // batch.all_logits, else [batch.seqs.size(), vocab] for each sequence's last token.
  virtual Tensor forward(const Batch& batch) = 0;
};

// Loads a Hugging Face model folder; dispatches on config.json's model_type. One-line errors for
// anything wrong with the folder.
std::unique_ptr<Model> load_model(const std::string& dir);

}  // namespace sparrow
