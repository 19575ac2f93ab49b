#include "runner/decode_graphs.h"

#include <cstdio>

#include "core/device/device.h"
#include "core/device/graph.h"
#include "core/error.h"

namespace sparrow {

namespace {

// n rounded up so that a bucket spans at most 1/8 of its size: multiples of 128 up to 1024, then
// eight buckets per power of two.
int64_t bucket(int64_t n) {
  if (n <= 1024) return std::max<int64_t>((n + 127) / 128 * 128, 128);
  const int64_t step = (int64_t(1) << (63 - __builtin_clzll(uint64_t(n)))) / 8;
  return (n + step - 1) / step * step;
}

}  // namespace

struct DecodeGraphs::Graph {
  Tensor inputs;  // the step's inputs (model/device_step.h), refilled before each replay
  Tensor logits;  // written by each replay (graph pool)
  Tensor hidden;  // the same for the hidden states, when the key keeps them
  Tensor hidden_in;  // the hidden states a drafter's step brings (Batch::hidden_states_in), refilled
  device::Graph graph;
  int64_t last_used = 0;
};

DecodeGraphs::DecodeGraphs(int64_t max_graphs) : max_graphs_(max_graphs) {}
DecodeGraphs::~DecodeGraphs() = default;

bool DecodeGraphs::eligible(const Batch& batch) {
  if (batch.all_logits || batch.seqs.empty() || batch.size() > kMaxRows) return false;
  // LoRA adapters add products per run of sequences (model/lora.h): the launches depend on the batch's
  // mix, so such steps run eagerly.
  if (batch.has_lora()) return false;
  // An image's embeddings are copied in from the host: prefill only, eager.
  if (!batch.embedded_rows.empty()) return false;
  // Uneven rows would change the launch (the longest sequence's rows pick the recurrent layers' kernel,
  // row pairs the indexer's), so only even steps replay.
  const SeqSlice& first = batch.seqs[0];
  if (first.logits != 1 && first.logits != first.count) return false;
  for (const SeqSlice& s : batch.seqs)
    if (s.count != first.count || s.logits != first.logits) return false;
  return true;
}

StepShape DecodeGraphs::padded(const StepShape& least, int64_t block_size) {
  StepShape shape;
  shape.max_visible = bucket(least.max_visible);
  shape.table_stride = bucket(std::max(least.table_stride, (shape.max_visible + block_size - 1) / block_size));
  shape.rows_after_snapshot = least.rows_after_snapshot;
  return shape;
}

Tensor DecodeGraphs::run(const Batch& batch, Device device, const std::function<Tensor()>& compute) {
  SPARROW_CHECK(eligible(batch), "DecodeGraphs::run: not an even decode or verify step");
  const StepShape least = step_shape(batch, device);
  const StepShape shape = padded(least, batch.seqs[0].cache().paged()->block_size());
  const bool hidden_in = batch.hidden_states_in.defined();
  const Key key{batch.size(),       batch.seqs[0].count, batch.seqs[0].logits, batch.keep_hidden_states,
                hidden_in,          shape.table_stride,  shape.max_visible,    shape.rows_after_snapshot};
  const int64_t bytes = step_buffer_bytes(batch.size(), int64_t(batch.seqs.size()), shape);

  auto it = graphs_.find(key);
  if (it == graphs_.end() && (uncapturable_.count(key) || seen_once_.insert(key).second)) {
    // First sight (or never capturable): run directly, in the padded shape like the graph would.
    upload_device_step(batch, shape, Tensor::empty({bytes}, ScalarType::U8, device));
    return compute();
  }
  if (it == graphs_.end()) {
    if (int64_t(graphs_.size()) >= max_graphs_) {
      auto oldest = graphs_.begin();
      for (auto g = graphs_.begin(); g != graphs_.end(); ++g)
        if (g->second->last_used < oldest->second->last_used) oldest = g;
      device::synchronize();  // its last replay may still run
      graphs_.erase(oldest);
    }
    auto graph = std::make_unique<Graph>();
    graph->inputs = Tensor::empty({bytes}, ScalarType::U8, device);
    upload_device_step(batch, shape, graph->inputs);
    if (hidden_in) {
      graph->hidden_in = batch.hidden_states_in.clone();
      batch.hidden_states_in = graph->hidden_in;
    }
    try {
      graph->graph.capture([&] {
        graph->logits = compute();
        graph->hidden = batch.hidden_states;
      });
    } catch (const Error& e) {
      std::fprintf(stderr, "sparrow: decode step of %lld rows (%lld a sequence) runs without a CUDA graph: %s\n",
                   static_cast<long long>(batch.size()), static_cast<long long>(batch.seqs[0].count), e.what());
      uncapturable_.insert(key);
      return compute();  // the inputs are uploaded already
    }
    it = graphs_.emplace(key, std::move(graph)).first;
  } else {
    upload_device_step(batch, shape, it->second->inputs);
    if (hidden_in) {
      it->second->hidden_in.copy_from(batch.hidden_states_in);
      batch.hidden_states_in = it->second->hidden_in;
    }
  }
  Graph& g = *it->second;
  g.last_used = ++clock_;
  g.graph.replay();
  ++replays_;
  if (batch.keep_hidden_states) batch.hidden_states = g.hidden.clone();
  return g.logits.clone();  // the next replay overwrites g.logits (and g.hidden)
}

}  // namespace sparrow
