#include "model/mla.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "kernels/cpu/mla_reference.h"
#include "kernels/ops.h"
#include "model/context_parallel.h"
#include "model/device_step.h"
#include "model/lora.h"
#include "model/tensor_parallel.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/mla/mla_attention.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#endif

namespace sparrow {

float mla_softmax_scale(int64_t qk_head_dim, const nlohmann::json& rope_parameters) {
  double scale = 1.0 / std::sqrt(double(qk_head_dim));
  if (!rope_parameters.is_object()) return float(scale);
  const std::string type = rope_parameters.value("rope_type", std::string("default"));
  const double mscale_all_dim =
      rope_parameters.contains("mscale_all_dim") && rope_parameters["mscale_all_dim"].is_number()
          ? rope_parameters["mscale_all_dim"].get<double>()
          : 0.0;
  if (type != "default" && mscale_all_dim != 0) {
    SPARROW_CHECK(rope_parameters.contains("factor") && rope_parameters["factor"].is_number(),
                  "config.json: rope_parameters.factor is required with mscale_all_dim");
    const double mscale = yarn_get_mscale(rope_parameters["factor"].get<double>(), mscale_all_dim);
    scale *= mscale * mscale;
  }
  return float(scale);
}

std::unique_ptr<MlaMixer> MlaMixer::load(Checkpoint& ckpt, const std::string& prefix, const MlaOptions& options,
                                         std::unique_ptr<DsaIndexer> indexer) {
  const MlaOptions& o = options;
  SPARROW_CHECK(o.hidden > 0 && o.num_heads > 0 && o.kv_lora_rank > 0 && o.qk_rope_head_dim >= 0 &&
                    o.qk_nope_head_dim >= 0 && o.qk_head_dim() > 0 && o.v_head_dim > 0 && o.q_lora_rank >= 0,
                "MLA: attention dimensions must be positive");
  SPARROW_CHECK(!o.rope || o.rope->rot_dim() == o.qk_rope_head_dim, "MLA: rotary dimension ",
                o.rope ? o.rope->rot_dim() : 0, " differs from qk_rope_head_dim ", o.qk_rope_head_dim);
#if SPARROW_HAVE_CUDA
  SPARROW_CHECK(ckpt.device() == Device::Cpu || (o.kv_lora_rank == cuda::kMlaLatent && o.qk_rope_head_dim == cuda::kMlaRope),
                "the GPU MLA kernels take kv_lora_rank ", cuda::kMlaLatent, " and qk_rope_head_dim ", cuda::kMlaRope,
                " (DeepSeek-V3.2, Kimi); this model has ", o.kv_lora_rank, " and ", o.qk_rope_head_dim,
                " (use --device cpu)");
#endif
  if (indexer) {
    SPARROW_CHECK(o.q_lora_rank > 0, "MLA: a DSA indexer needs q_lora_rank (it reads the query latent)");
    SPARROW_CHECK(indexer->options.query_input == o.q_lora_rank, "MLA: indexer query width ",
                  indexer->options.query_input, " differs from q_lora_rank ", o.q_lora_rank);
  }
  auto mla = std::make_unique<MlaMixer>();
  mla->options_ = options;
  mla->prefix_ = prefix;
  // Tensor parallel (vLLM's MLA under TP): each rank keeps its query heads, their rows of the query and
  // kv_b projections and their columns of o_proj; the latent projection, its cache and the indexer are
  // replicated, so every rank caches the same rows and selects the same keys.
  const TensorParallel& tp = mla->tp = ckpt.tensor_parallel();
  SPARROW_CHECK(!tp.context_parallel() || ckpt.device() == Device::Cpu,
                "decode context parallelism (--decode-context-parallel-size) runs on the CPU backend so far: the GPU "
                "MLA and indexer kernels read whole caches (issue 28)");
  const int64_t heads = o.num_heads;
  const IndexRange mine = even_share(tp, heads, "num_attention_heads");
  mla->options_.num_heads = mine.count();
  if (o.q_lora_rank > 0) {
    mla->q_a_proj = ckpt.take_linear(prefix + "q_a_proj.weight", {o.q_lora_rank, o.hidden});
    if (o.attention_bias) mla->q_a_bias = ckpt.take(prefix + "q_a_proj.bias", {o.q_lora_rank});
    mla->q_a_norm = ckpt.take(prefix + "q_a_layernorm.weight", {o.q_lora_rank});
    mla->q_b_proj = ckpt.take_linear(prefix + "q_b_proj.weight", {heads * o.qk_head_dim(), o.q_lora_rank},
                                     split_for(tp, mine, 0, o.qk_head_dim()));
  } else {
    mla->q_proj = ckpt.take_linear(prefix + "q_proj.weight", {heads * o.qk_head_dim(), o.hidden},
                                   split_for(tp, mine, 0, o.qk_head_dim()));
  }
  mla->kv_a_proj = ckpt.take_linear(prefix + "kv_a_proj_with_mqa.weight", {o.cache_row(), o.hidden});
  if (o.attention_bias) mla->kv_a_bias = ckpt.take(prefix + "kv_a_proj_with_mqa.bias", {o.cache_row()});
  mla->kv_a_norm = ckpt.take(prefix + "kv_a_layernorm.weight", {o.kv_lora_rank});
  mla->kv_b_proj = ckpt.take(prefix + "kv_b_proj.weight", {heads * (o.qk_nope_head_dim + o.v_head_dim), o.kv_lora_rank},
                             split_for(tp, mine, 0, o.qk_nope_head_dim + o.v_head_dim));
  if (o.output_gate)
    mla->g_proj = ckpt.take_linear(prefix + "g_proj.weight", {heads * o.v_head_dim, o.hidden},
                                   split_for(tp, mine, 0, o.v_head_dim));
  mla->o_proj = ckpt.take_linear(prefix + "o_proj.weight", {o.hidden, heads * o.v_head_dim},
                                 split_for(tp, mine, 1, o.v_head_dim));
  if (o.attention_bias) mla->o_bias = ckpt.take(prefix + "o_proj.bias", {o.hidden});
  mla->indexer_ = std::move(indexer);
  return mla;
}

LayerCacheSpec MlaMixer::cache_spec_for(const MlaOptions& options, const DsaIndexerOptions* index) {
  LayerCacheSpec spec;
  spec.pages.push_back(options.cache_page());
  if (index) spec.pages.push_back(index->cache_page());
  return spec;
}

LayerCacheSpec MlaMixer::cache_spec() const {
  LayerCacheSpec spec = cache_spec_for(options_, indexer_ ? &indexer_->options : nullptr);
  for (PageSpec& page : spec.pages) page.token_shards = tp.dcp_size;  // one rank's share of the tokens
  return spec;
}

Tensor MlaMixer::cache_rows(const Tensor& x, const Batch& batch) const {
  const MlaOptions& o = options_;
  // [kv_a_layernorm(c) | k_rot], the norm on c only.
  Tensor rows = ops::linear(x, kv_a_proj);
  lora::add_(rows, x, batch, prefix_, "kv_a_proj_with_mqa");
  if (o.attention_bias) ops::add_bias_(rows, kv_a_bias);
  ops::rms_norm_(rows, kv_a_norm, o.kv_norm_eps, false, /*first_col=*/0, /*groups=*/1);
  if (o.rope)
    ops::rope_(rows, batch.positions_on(x.device()), o.rope->inv_freq_on(x.device()), o.rope->attention_scaling,
               o.kv_lora_rank, 1, o.cache_row(), /*interleaved=*/true);
  return rows;
}

void MlaMixer::write_rows(const Tensor& new_rows, const Batch& batch, int layer) const {
  if (new_rows.on_cpu()) {
    for (const SeqSlice& seq : batch.seqs)
      seq.cache().write(layer, PageKind::MlaLatent, seq.start(), seq.count, new_rows.row(seq.offset));
    return;
  }
#if SPARROW_HAVE_CUDA
  const DeviceStep& step = device_step(batch);
  const PageFormat latent_format = step.format(layer, PageKind::MlaLatent);
  SPARROW_CHECK(cuda::mla_reads_latent_format(latent_format), "the GPU MLA kernels read bfloat16, fp8, fp8_per_tensor "
                "or nvfp4 latents (--kv-cache-dtype), not ", latent_format == PageFormat::Float32 ? "float32" : "these",
                " MLA pages");
  const cuda::MlaPagedCache cache{step.page_base(layer, PageKind::MlaLatent), step.page_table.as<int64_t>(),
                                  step.table_stride, step.block_size(), latent_format};
  cuda::mla_cache_write(cache, new_rows.raw(), cuda::MlaSourceType::kBf16, batch.size(), step.row_seq.as<int32_t>(),
                        step.row_pos.as<int32_t>(), 0, 0, cuda::stream());
#else
  (void)batch, (void)layer;
  fail("MLA on a GPU in a build without the CUDA backend");
#endif
}

void MlaMixer::store_rows(const Tensor& x, const Batch& batch, int layer) const {
  SPARROW_CHECK(!tp.sharded(), "MLA: store_rows under tensor parallelism");
  write_rows(cache_rows(x, batch), batch, layer);
}

Tensor MlaMixer::forward(const Tensor& x, const Batch& batch, int layer) {
  const MlaOptions& o = options_;
  const int64_t tokens = batch.size(), heads = o.num_heads;
  const int64_t nope = o.qk_nope_head_dim, rot = o.qk_rope_head_dim, latent = o.kv_lora_rank;
  const int64_t qk = o.qk_head_dim(), row_width = o.cache_row();
  const int64_t kv_b_rows_per_head = nope + o.v_head_dim;

  // Queries [T, heads * qk], each head [q_nope | q_rot]; q_resid also feeds the indexer.
  Tensor q_resid, q;
  if (o.q_lora_rank > 0) {
    q_resid = ops::linear(x, q_a_proj);
    lora::add_(q_resid, x, batch, prefix_, "q_a_proj");
    if (o.attention_bias) ops::add_bias_(q_resid, q_a_bias);
    ops::rms_norm_(q_resid, q_a_norm, o.q_norm_eps);
    q = ops::linear(q_resid, q_b_proj);
    lora::add_(q, q_resid, batch, prefix_, "q_b_proj");
  } else {
    q = ops::linear(x, q_proj);
    lora::add_(q, x, batch, prefix_, "q_proj");
  }

  const Tensor new_rows = cache_rows(x, batch);
  if (o.rope)
    ops::rope_(q, batch.positions_on(x.device()), o.rope->inv_freq_on(x.device()), o.rope->attention_scaling, nope,
               heads, qk, /*interleaved=*/true);

  // Absorbed queries [T, heads, latent + rot]: q_nope[h] · W_UK[h] next to q_rot[h], so that one dot
  // product with a cache row gives the expanded form's q[h] · k[h].
  Tensor q_abs = Tensor::empty({tokens, heads, row_width}, q.type(), q.device());
  ops::batched_matmul_nn(heads, tokens, latent, nope, {&q, 0, heads * qk, qk},
                         {&kv_b_proj, 0, latent, kv_b_rows_per_head * latent}, q_abs, 0, heads * row_width, row_width);
  // q_rot of every (token, head) is one line of `rot` values, qk apart in q and row_width apart in q_abs.
  ops::copy_lines(q_abs, latent, row_width, q, nope, qk, rot, tokens * heads);
  const lora::MlaDims lora_dims{heads, nope, o.v_head_dim, qk, row_width, latent};
  lora::add_absorbed_queries_(q_abs, q, batch, prefix_, lora_dims);

  // mixed[t, h] = sum_s softmax_s(q_abs[t, h] · row_s * scale) c_s, over the query's causal prefix or
  // the keys its indexer selects.
  Tensor selected;  // with an indexer: the key positions each row attends (DsaIndexer::select)
  Tensor mixed;
  if (token_sharded_step(tp, tokens, x.device())) {
    const std::vector<RowPiece> pieces = token_shard_pieces(batch, tp.rank, tp.size);
    if (indexer_) selected = indexer_->select_pieces(x, q_resid, batch, layer, pieces);
    mixed = attend_token_sharded(q_abs, new_rows, selected, batch, layer, pieces);
  } else {
    if (indexer_) selected = indexer_->select(x, q_resid, batch, layer);
    mixed = attend(q_abs, new_rows, selected, batch, layer);
  }

  // Back from latent space per head: out[t, h] = W_UV[h] · mixed[t, h], then o_proj.
  Tensor attended = Tensor::empty({tokens, heads * o.v_head_dim}, mixed.type(), mixed.device());
  ops::batched_matmul_nt(heads, tokens, o.v_head_dim, latent, {&mixed, 0, heads * latent, latent},
                         {&kv_b_proj, nope * latent, latent, kv_b_rows_per_head * latent}, attended, 0,
                         heads * o.v_head_dim, o.v_head_dim);
  lora::add_absorbed_outputs_(attended, mixed, batch, prefix_, lora_dims);
  if (o.output_gate) {
    Tensor gate = ops::linear(x, g_proj);
    lora::add_(gate, x, batch, prefix_, "g_proj");
    ops::mul_sigmoid_(attended, gate);
  }
  Tensor out = ops::linear(attended, o_proj);
  lora::add_(out, attended, batch, prefix_, "o_proj");
  ops::all_reduce_(tp, out);
  if (o.attention_bias) ops::add_bias_(out, o_bias);
  return out;
}

// This step's rows go into the layer's pages, then every row attends over its causal prefix or the keys
// the indexer selected: on the CPU through the sequence's cache as fp32 (kernels/cpu/mla_reference.h), on
// the GPU (kernels/cuda/mla) over the paged cache in place, quantised there in the cache's format (fp8,
// fp8_per_tensor, nvfp4).
Tensor MlaMixer::attend(const Tensor& q_abs, const Tensor& new_rows, const Tensor& selected, const Batch& batch,
                        int layer) const {
  const MlaOptions& o = options_;
  const int64_t rows = batch.size();
  if (tp.context_parallel()) return attend_context_parallel(q_abs, new_rows, selected, batch, layer);  // decode
  if (q_abs.on_cpu()) {
    const cpu::MlaShape shape{o.num_heads, o.kv_lora_rank, o.cache_row(), o.softmax_scale};
    const int64_t topk = indexer_ ? indexer_->options.topk : 0;
    Tensor mixed = Tensor::empty({rows, o.num_heads, o.kv_lora_rank});
    std::vector<float> prefix;
    write_rows(new_rows, batch, layer);
    std::vector<float> lse(size_t(o.num_heads));
    for (const SeqSlice& seq : batch.seqs) {
      // Read the whole causal prefix (this step's rows included).
      const int64_t end = seq.start() + seq.count;
      prefix.resize(end * o.cache_row());
      seq.cache().read(layer, PageKind::MlaLatent, 0, end, prefix.data());
      if (o.non_causal) {  // every query over all `end` rows
        for (int64_t i = 0; i < seq.count; ++i)
          cpu::mla_attention_over(shape, q_abs.row(seq.offset + i), prefix.data(), end, mixed.row(seq.offset + i),
                                  lse.data());
        continue;
      }
      cpu::mla_attention(shape, q_abs.row(seq.offset), seq.count, seq.start(), prefix.data(),
                         indexer_ ? selected.as<int32_t>() + seq.offset * topk : nullptr, topk,
                         mixed.row(seq.offset));
    }
    return mixed;
  }
#if SPARROW_HAVE_CUDA
  write_rows(new_rows, batch, layer);
  const DeviceStep& step = device_step(batch);
  const cuda::MlaPagedCache cache{step.page_base(layer, PageKind::MlaLatent), step.page_table.as<int64_t>(),
                                  step.table_stride, step.block_size(), step.format(layer, PageKind::MlaLatent)};
  cudaStream_t stream = cuda::stream();

  const int heads = int(o.num_heads);
  Tensor mixed = Tensor::empty({rows, o.num_heads, o.kv_lora_rank}, ScalarType::BF16, q_abs.device());
  if (indexer_) {
    const int topk = int(selected.dim(1));
    const size_t workspace_bytes = cuda::mla_attention_workspace_bytes(rows, heads, topk);
    Tensor workspace =
        Tensor::empty({int64_t(std::max<size_t>(workspace_bytes, 1))}, ScalarType::U8, q_abs.device());
    cuda::mla_sparse_attention(cache, q_abs.as<uint16_t>(), step.row_seq.as<int32_t>(), selected.as<int32_t>(), rows,
                               heads, topk, o.softmax_scale, mixed.as<uint16_t>(), nullptr, workspace.raw(),
                               workspace_bytes, stream);
  } else {
    const size_t workspace_bytes = cuda::mla_attention_workspace_bytes(rows, heads, step.max_visible);
    Tensor workspace =
        Tensor::empty({int64_t(std::max<size_t>(workspace_bytes, 1))}, ScalarType::U8, q_abs.device());
    // Non-causal: each row sees up to its sequence's last row of the step (an upload: no CUDA graph takes
    // such a batch, DSparkDrafter::capturable).
    Tensor visible = step.row_visible;
    if (o.non_causal) {
      Tensor bounds = Tensor::empty({rows}, ScalarType::I32);
      for (const SeqSlice& seq : batch.seqs)
        std::fill_n(bounds.as<int32_t>() + seq.offset, seq.count, int32_t(seq.start() + seq.count));
      visible = bounds.to(q_abs.device());
    }
    cuda::mla_dense_attention(cache, q_abs.as<uint16_t>(), step.row_seq.as<int32_t>(), visible.as<int32_t>(),
                              rows, heads, step.max_visible, o.softmax_scale, mixed.as<uint16_t>(), nullptr,
                              workspace.raw(), workspace_bytes, stream);
  }
  return mixed;
#else
  (void)new_rows, (void)selected, (void)layer;
  fail("MLA on a GPU in a build without the CUDA backend");
#endif
}

Tensor MlaMixer::attend_token_sharded(const Tensor& q_abs, const Tensor& new_rows, const Tensor& selected,
                                      const Batch& batch, int layer, const std::vector<RowPiece>& pieces) const {
  const MlaOptions& o = options_;
  const int W = tp.size;
  const int64_t rows = batch.size(), heads = o.num_heads, width = o.cache_row(), latent = o.kv_lora_rank;
  const int64_t topk = indexer_ ? indexer_->options.topk : 0;
  // Every rank's pieces (the same rule everywhere) and the most rows any rank takes, the all-to-alls' stride.
  std::vector<std::vector<RowPiece>> share(W);
  int64_t most = 0;
  for (int r = 0; r < W; ++r) {
    share[r] = r == tp.rank ? pieces : token_shard_pieces(batch, r, W);
    int64_t n = 0;
    for (const RowPiece& piece : share[r]) n += piece.count;
    most = std::max(most, n);
  }
  auto row_of = [&](const RowPiece& piece) { return batch.seqs[piece.seq].offset + piece.begin; };

  // [all rows, my heads] -> [my rows, the group's heads]: block d of the send buffer holds rank d's rows.
  std::vector<float> send(size_t(W * most * heads * width), 0.0f), recv(send.size());
  for (int d = 0; d < W; ++d) {
    int64_t at = 0;
    for (const RowPiece& piece : share[d])
      for (int64_t i = 0; i < piece.count; ++i, ++at)
        std::copy_n(q_abs.row(row_of(piece) + i), heads * width, send.data() + (d * most + at) * heads * width);
  }
  tp.comm->all_to_all(send.data(), recv.data(), most * heads * width, ScalarType::F32);
  const int64_t all_heads = heads * W, mine = [&] {
    int64_t n = 0;
    for (const RowPiece& piece : pieces) n += piece.count;
    return n;
  }();
  std::vector<float> queries(size_t(std::max<int64_t>(mine, 1) * all_heads * width));
  for (int64_t m = 0; m < mine; ++m)
    for (int src = 0; src < W; ++src)  // rank src's heads are heads src * heads .. (even_share)
      std::copy_n(recv.data() + (src * most + m) * heads * width, heads * width,
                  queries.data() + (m * all_heads + src * heads) * width);

  // Every rank stores every row (the latent cache stays replicated; under DCP its own rows), then attends its
  // pieces' rows over the step's context (under DCP gathered from the group: DCP prefill without a merge).
  store_step_rows(tp, batch, layer, PageKind::MlaLatent, new_rows);
  const std::vector<std::vector<float>> context = step_context(tp, batch, layer, PageKind::MlaLatent, width);
  const cpu::MlaShape shape{all_heads, latent, width, o.softmax_scale};
  std::vector<float> out(size_t(std::max<int64_t>(mine, 1) * all_heads * latent));
  int64_t done = 0;
  for (const RowPiece& piece : pieces) {
    const SeqSlice& seq = batch.seqs[piece.seq];
    const int64_t start = seq.start() + piece.begin;
    cpu::mla_attention(shape, queries.data() + done * all_heads * width, piece.count, start, context[piece.seq].data(),
                       indexer_ ? selected.as<int32_t>() + done * topk : nullptr, topk,
                       out.data() + done * all_heads * latent);
    done += piece.count;
  }

  // [my rows, the group's heads] -> [all rows, my heads].
  std::vector<float> back(size_t(W * most * heads * latent), 0.0f), home(back.size());
  for (int d = 0; d < W; ++d)
    for (int64_t m = 0; m < mine; ++m)
      std::copy_n(out.data() + (m * all_heads + d * heads) * latent, heads * latent,
                  back.data() + (d * most + m) * heads * latent);
  tp.comm->all_to_all(back.data(), home.data(), most * heads * latent, ScalarType::F32);
  Tensor mixed = Tensor::empty({rows, heads, latent});
  for (int src = 0; src < W; ++src) {
    int64_t at = 0;
    for (const RowPiece& piece : share[src])
      for (int64_t i = 0; i < piece.count; ++i, ++at)
        std::copy_n(home.data() + (src * most + at) * heads * latent, heads * latent, mixed.row(row_of(piece) + i));
  }
  return mixed;
}

// Rank r of the DCP group stores the rows of tokens j with j mod W = r (local row j / W), gathers the
// queries of the group's heads (vLLM's DCP all-gathers q the same way), attends each query over the local
// rows it sees (its local causal prefix, or its local rows of the indexer's global top-k) for every head of
// the group, and dcp_merge_attention combines the W shares into this rank's heads.
Tensor MlaMixer::attend_context_parallel(const Tensor& q_abs, const Tensor& new_rows, const Tensor& selected,
                                         const Batch& batch, int layer) const {
  const MlaOptions& o = options_;
  const int W = tp.dcp_size, me = tp.dcp_rank;
  const int64_t rows = batch.size(), heads = o.num_heads, width = o.cache_row(), latent = o.kv_lora_rank;
  const int64_t topk = indexer_ ? indexer_->options.topk : 0;
  SPARROW_CHECK(q_abs.on_cpu(), "decode context parallelism runs on the CPU backend so far");
  std::vector<float> queries(size_t(W * rows * heads * width));
  tp.dcp_comm->all_gather(q_abs.data(), queries.data(), rows * heads * width, ScalarType::F32);

  const cpu::MlaShape shape{heads, latent, width, o.softmax_scale};
  std::vector<float> partial(size_t(W * rows * heads * latent)), lse(size_t(W * rows * heads));
  std::vector<float> prefix, gathered;
  store_step_rows(tp, batch, layer, PageKind::MlaLatent, new_rows);
  for (const SeqSlice& seq : batch.seqs) {
    const int64_t start = seq.start(), end = start + seq.count, last = dcp_local_rows(end, me, W);
    prefix.resize(last * width);
    seq.cache().read(layer, PageKind::MlaLatent, 0, last, prefix.data());
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t t = seq.offset + i;
      const float* keys = prefix.data();
      int64_t n = dcp_local_rows(start + i + 1, me, W);
      if (indexer_) {  // this rank's rows of the row's selection (local rows, ascending, then -1)
        const int32_t* list = selected.as<int32_t>() + t * topk;
        n = std::find(list, list + topk, -1) - list;
        gathered.resize(n * width);
        for (int64_t j = 0; j < n; ++j) std::copy_n(prefix.data() + list[j] * width, width, gathered.data() + j * width);
        keys = gathered.data();
      }
      for (int owner = 0; owner < W; ++owner) {
        const int64_t at = owner * rows + t;  // [owner][row]
        cpu::mla_attention_over(shape, queries.data() + at * heads * width, keys, n,
                                partial.data() + at * heads * latent, lse.data() + at * heads);
      }
    }
  }
  std::vector<float> merged = dcp_merge_attention(tp, partial, lse, latent);
  Tensor mixed = Tensor::empty({rows, heads, latent});
  std::copy(merged.begin(), merged.end(), mixed.data());
  return mixed;
}

}  // namespace sparrow
