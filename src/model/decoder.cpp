#include "model/decoder.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/tensor_parallel.h"

namespace sparrow {

void Mixer::store_rows(const Tensor&, const Batch&, int) const {
  fail("a ", name(), " layer cannot write context rows without attending (the DSpark drafter's MLA and GQA can)");
}

std::vector<LayerCacheSpec> DecoderModel::cache_spec() const {
  std::vector<LayerCacheSpec> spec;
  for (const DecoderLayer& layer : layers) spec.push_back(layer.mixer->cache_spec());
  return spec;
}

void DecoderModel::take_embeddings(Checkpoint& ckpt, const std::string& decoder_prefix, const std::string& head,
                                   bool tied) {
  placed_on = ckpt.device();
  tp = ckpt.tensor_parallel();
  // Vocab-parallel (vLLM's VocabParallelEmbedding / ParallelLMHead): each rank keeps its rows of the
  // embedding and of the head; embedded rows are summed over the group, logits gathered.
  const Split rows = tp.sharded() ? vocab_share(tp, vocab).split(0) : Split{};
  vocab_first = rows.whole() ? 0 : rows.begin;
  vocab_part = rows.whole() ? vocab : (vocab + tp.size - 1) / tp.size;
  embed_name = decoder_prefix + "embed_tokens.weight";
  head_name = tied ? embed_name : head;
  embed = ckpt.take(embed_name, {vocab, hidden}, rows);
  final_norm = ckpt.take(decoder_prefix + "norm.weight", {hidden});
  if (!tied) {
    lm_head = ckpt.take(head, {vocab, hidden}, rows);
    return;
  }
  lm_head = embed;
  if (ckpt.has(head)) ckpt.take(head, {vocab, hidden}, rows);
}

bool DecoderModel::captures(size_t layer) const {
  return std::find(aux_hidden_layers.begin(), aux_hidden_layers.end(), int(layer)) != aux_hidden_layers.end();
}

// Each sublayer's output is added to the stream by the next norm (ops::add_rms_norm_: one launch for the
// add and the norm on a GPU); the last feed-forward output, or one whose stream is captured, is added on
// its own.
Tensor residual_stack(std::vector<DecoderLayer>& layers, Tensor x, const Batch& batch, const ResidualStack& how,
                      StepMarks* marks, const std::function<bool(size_t)>& capture, std::vector<Tensor>* streams) {
  Tensor pending;  // the previous feed-forward output, not yet in x
  for (size_t i = 0; i < layers.size(); ++i) {
    DecoderLayer& layer = layers[i];
    const Tensor h = pending.defined() ? ops::add_rms_norm_(x, pending, layer.input_norm, how.norm_eps, how.norm_unit_offset)
                                       : ops::rms_norm(x, layer.input_norm, how.norm_eps, how.norm_unit_offset);
    const Tensor mixed = layer.mixer->forward(h, batch, how.first_cache_layer + int(i));
    if (marks) marks->mark(how.mark_prefix + "mixer " + layer.mixer->name());
    pending = layer.ffn->forward(ops::add_rms_norm_(x, mixed, layer.post_norm, how.norm_eps, how.norm_unit_offset), batch);
    if (marks) marks->mark(how.mark_prefix + "ffn " + layer.ffn->name());
    const bool captured = streams && capture && capture(i);
    if (i + 1 == layers.size() || captured) {
      ops::add_(x, pending);
      pending = Tensor();
      if (captured) (*streams)[i] = x.clone();
    }
  }
  return x;
}

// The AttnRes stack as the header writes it; `pending` is the last feed-forward output, added to the
// partial sum where vLLM adds it (before the next layer's first mix, or the output mix).
Tensor DecoderModel::attn_res_layers(Tensor embedded, const Batch& batch, StepMarks* marks,
                                     std::vector<Tensor>* streams) {
  std::vector<Tensor> sources;  // the finished blocks, then (while mixing) the partial sum
  Tensor partial = std::move(embedded), pending;
  auto mix = [&](const AttnResQuery& query, bool with_partial) {
    if (with_partial) sources.push_back(partial);
    Tensor mixed = ops::attn_res_mix(sources, query.norm, query.proj, norm_eps);
    if (with_partial) sources.pop_back();
    return mixed;
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    DecoderLayer& layer = layers[i];
    const bool starts_block = int64_t(i) % attn_res_block == 0;
    if (pending.defined()) ops::add_(partial, pending);
    if (starts_block) sources.push_back(partial);  // partial is rebound below, never added to in place
    Tensor a = layer.mixer->forward(
        ops::rms_norm(mix(layer.before_mixer, !starts_block), layer.input_norm, norm_eps, norm_unit_offset), batch,
        int(i));
    if (starts_block)
      partial = std::move(a);
    else
      ops::add_(partial, a);
    if (marks) marks->mark("mixer " + layer.mixer->name());
    pending = layer.ffn->forward(
        ops::rms_norm(mix(layer.before_ffn, true), layer.post_norm, norm_eps, norm_unit_offset), batch);
    if (marks) marks->mark("ffn " + layer.ffn->name());
    if (streams && captures(i)) {  // prefix_sum + pending_mlp_out
      Tensor stream = partial.clone();
      ops::add_(stream, pending);
      (*streams)[i] = std::move(stream);
    }
  }
  if (pending.defined()) ops::add_(partial, pending);
  return mix(output_attn_res, true);
}

void DecoderModel::step_idle(const Batch& batch) {
  const Tensor none = Tensor::empty({0, hidden}, embed.type(), placed_on);
  for (DecoderLayer& layer : layers)
    if (layer.ffn->spans_groups()) layer.ffn->forward(none, batch);
}

// Batch::embedded_rows: each run of consecutive rows (an image's placeholders in one sequence's chunk) copied over
// the looked-up embeddings in one go, in the embedding's type on its device. Under tensor parallelism every rank
// does it after the embedding's all-reduce, on the whole rows.
void DecoderModel::place_embedded_rows(Tensor& x, const Batch& batch) const {
  const std::vector<int64_t>& rows = batch.embedded_rows;
  SPARROW_CHECK(batch.embedded.defined() && batch.embedded.ndim() == 2 && batch.embedded.dim(0) == int64_t(rows.size()) &&
                    batch.embedded.dim(1) == hidden,
                "a batch's embedded rows must come as [", rows.size(), ", ", hidden, "]");
  const Tensor values = batch.embedded.to(x.device(), x.type());
  for (size_t i = 0; i < rows.size();) {
    size_t end = i + 1;
    while (end < rows.size() && rows[end] == rows[end - 1] + 1) ++end;
    SPARROW_CHECK(rows[i] >= 0 && rows[end - 1] < batch.size(), "embedded row ", rows[end - 1], " outside a batch of ",
                  batch.size());
    ops::copy_lines(x, rows[i] * hidden, hidden, values, int64_t(i) * hidden, hidden, hidden, int64_t(end - i));
    i = end;
  }
}

Tensor DecoderModel::forward(const Batch& batch, StepMarks* marks) {
  const bool on_gpu = placed_on != Device::Cpu;
  // (A profiled step marks the end of each part; the marks are the only difference.)
  auto mark = [&](const std::string& part) {
    if (marks) marks->mark(part);
  };
  Tensor x;
  if (tp.sharded()) {
    x = ops::embedding_part(embed, vocab_first, vocab, batch.tokens);
    ops::all_reduce_(tp, x);
  } else {
    x = on_gpu ? ops::embedding(embed, device_step(batch).token_ids) : ops::embedding(embed, batch.tokens);
  }
  if (!batch.embedded_rows.empty()) place_embedded_rows(x, batch);
  mark("embedding");
  const bool capture = batch.keep_hidden_states && !aux_hidden_layers.empty();
  std::vector<Tensor> streams(capture ? layers.size() : 0);
  std::vector<Tensor>* kept = capture ? &streams : nullptr;
  x = attn_res_block > 0 ? attn_res_layers(std::move(x), batch, marks, kept)
                         : residual_stack(layers, std::move(x), batch, {norm_eps, norm_unit_offset, 0, ""}, marks,
                                          [this](size_t layer) { return captures(layer); }, kept);
  if (capture) {
    // The DSpark drafter's input: the streams side by side, in aux_hidden_layers' order.
    const int64_t rows = x.dim(0), n = int64_t(aux_hidden_layers.size());
    batch.hidden_states = Tensor::empty({rows, hidden * n}, x.type(), x.device());
    for (int64_t i = 0; i < n; ++i)
      ops::copy_lines(batch.hidden_states, i * hidden, hidden * n, streams[size_t(aux_hidden_layers[size_t(i)])], 0,
                      hidden, hidden, rows);
  } else if (batch.keep_hidden_states) {
    // The MTP drafter's input: the state after the final norm (vLLM's DeepseekV2Model returns it normed), or
    // before it (Kimi K3 normalises inside compute_logits).
    batch.hidden_states = hidden_for_drafter_normed ? ops::rms_norm(x, final_norm, norm_eps, norm_unit_offset) : x.clone();
  }
  if (!batch.all_logits) x = select_logit_rows(x, batch);
  ops::rms_norm_(x, final_norm, norm_eps, norm_unit_offset);
  mark("final norm");
  // fp32 logits where the model runs: on a GPU the sampler draws there and only token ids cross.
  Tensor logits = ops::all_gather_columns(tp, ops::linear(x, lm_head, ScalarType::F32), vocab_part, vocab);
  mark("lm_head");
  return logits;
}

}  // namespace sparrow
