#include "model/kda_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/batch_invariance.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/kda_reference.h"
#include "kernels/ops.h"
#include "model/device_step.h"
#include "model/lora.h"
#include "model/tensor_parallel.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/kda/kda.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#endif

namespace sparrow {

namespace {

// [a; b; c] along the first dimension.
Tensor stack_rows(const Tensor& a, const Tensor& b, const Tensor& c) { return ops::concat_rows(ops::concat_rows(a, b), c); }

}  // namespace

KdaMixer::KdaMixer(const KdaConfig& config, KdaWeights weights) : config_(config), w_(std::move(weights)) {}

std::unique_ptr<KdaMixer> KdaMixer::load(Checkpoint& ckpt, const std::string& prefix, const KdaConfig& config) {
  const int64_t hidden = config.hidden, H = config.num_heads, D = config.head_dim, P = config.projection_dim();
  const int64_t kernel = config.conv_kernel;
  SPARROW_CHECK(ckpt.device() == Device::Cpu || D == 16 || D == 32 || D == 64 || D == 128,
                "the GPU KDA kernels take linear_head_dim 16, 32, 64 or 128; this model has ", D, " (use --device cpu)");
  SPARROW_CHECK(ckpt.device() == Device::Cpu || (kernel >= 2 && kernel <= 8), "the GPU KDA kernels take "
                "linear_conv_kernel_dim 2 to 8; this model has ", kernel, " (use --device cpu)");
  // Tensor parallel: each rank keeps its heads (their rows of q/k/v, their convolution channels, gates and
  // decay rates, their recurrent state) and o_proj's matching columns; the low-rank gates' first
  // projections and the norm weight are replicated.
  const TensorParallel& tp = ckpt.tensor_parallel();
  const IndexRange mine = even_share(tp, H, "linear_attn_config.num_heads");
  const Split rows = split_for(tp, mine, 0, D);  // a head's D rows of a [P, ...] tensor
  KdaWeights w;
  // One statement per tensor: errors then name the first one wrong (argument order is unspecified).
  const Tensor q_proj = ckpt.take_linear(prefix + "q_proj.weight", {P, hidden}, rows);
  const Tensor k_proj = ckpt.take_linear(prefix + "k_proj.weight", {P, hidden}, rows);
  w.qkv_proj = stack_rows(q_proj, k_proj, ckpt.take_linear(prefix + "v_proj.weight", {P, hidden}, rows));
  // The conv taps and decay rates stay fp32 on every device: the GPU kernels read them so.
  if (ckpt.has(prefix + "conv1d.weight")) {
    // Fused: q, k and v channels one after the other, each split by heads.
    const Split channels = tp.sharded() ? Split{0, rows.begin, rows.end, 3} : Split{};
    w.conv = ckpt.take_fp32(prefix + "conv1d.weight", {3 * P, 1, kernel}, channels).reshape({3 * mine.count() * D, kernel});
  } else {  // Kimi's original checkpoint: one convolution per projection (transformers concatenates them)
    const int64_t p = mine.count() * D;
    const Tensor q_conv = ckpt.take_fp32(prefix + "q_conv1d.weight", {P, 1, kernel}, rows).reshape({p, kernel});
    const Tensor k_conv = ckpt.take_fp32(prefix + "k_conv1d.weight", {P, 1, kernel}, rows).reshape({p, kernel});
    w.conv = stack_rows(q_conv, k_conv, ckpt.take_fp32(prefix + "v_conv1d.weight", {P, 1, kernel}, rows).reshape({p, kernel}));
  }
  // transformers moves these under forget_gate.; the original checkpoint keeps them on self_attn.
  const std::string gate = ckpt.has(prefix + "forget_gate.A_log") ? prefix + "forget_gate." : prefix;
  w.f_a_proj = ckpt.take_linear(gate + "f_a_proj.weight", {D, hidden});
  w.f_b_proj = ckpt.take_linear(gate + "f_b_proj.weight", {P, D}, rows);
  w.dt_bias = ckpt.take_fp32(gate + "dt_bias", {P}, rows);
  const bool flat_A_log = ckpt.has(gate + "A_log") && ckpt.stored_shape(gate + "A_log").size() == 1;
  w.A_log = ckpt.take_fp32(gate + "A_log", flat_A_log ? Shape{H} : Shape{1, 1, H, 1},
                           split_for(tp, mine, flat_A_log ? 0 : 2)).reshape({mine.count()});
  w.b_proj = ckpt.take_linear(prefix + "b_proj.weight", {H, hidden}, split_for(tp, mine, 0));
  if (config.full_rank_gate) {
    w.g_proj = ckpt.take_linear(prefix + "g_proj.weight", {P, hidden}, rows);
  } else {
    w.g_a_proj = ckpt.take_linear(prefix + "g_a_proj.weight", {D, hidden});
    w.g_b_proj = ckpt.take_linear(prefix + "g_b_proj.weight", {P, D}, rows);
  }
  w.o_norm = ckpt.take_fp32(prefix + "o_norm.weight", {D});
  w.o_proj = ckpt.take_linear(prefix + "o_proj.weight", {hidden, P}, split_for(tp, mine, 1, D));
  KdaConfig mine_config = config;
  mine_config.num_heads = mine.count();
  auto kda = std::make_unique<KdaMixer>(mine_config, std::move(w));
  kda->tp_ = tp;
  kda->prefix_ = prefix;
  kda->gate_prefix_ = gate;
  return kda;
}

LayerCacheSpec KdaMixer::cache_spec_for(const KdaConfig& config) {
  const int64_t P = config.projection_dim();
  LayerCacheSpec spec;
  spec.states.push_back({StateKind::ConvTail, (config.conv_kernel - 1) * 3 * P});
  spec.states.push_back({StateKind::Recurrent, config.num_heads * config.head_dim * config.head_dim});
  return spec;
}

// The projections on either device with fp32 outputs, then three phases that each dispatch to the CPU
// reference (kernels/cpu/kda_reference.h) or the CUDA kernels (kernels/cuda/kda): the gates, the conv and
// the delta rule over each sequence's states, and the gated norm.
Tensor KdaMixer::forward(const Tensor& x, const Batch& batch, int layer) {
  Tensor qkv = ops::linear(x, w_.qkv_proj, ScalarType::F32);  // [T, 3P] before the conv
  const int64_t p = qkv.dim(1) / 3;
  lora::add_(qkv, x, batch, prefix_, "q_proj", 0);
  lora::add_(qkv, x, batch, prefix_, "k_proj", p);
  lora::add_(qkv, x, batch, prefix_, "v_proj", 2 * p);
  Tensor f_a = ops::linear(x, w_.f_a_proj);
  lora::add_(f_a, x, batch, gate_prefix_, "f_a_proj");
  Tensor log_decay = ops::linear(f_a, w_.f_b_proj, ScalarType::F32);  // [T, P]
  lora::add_(log_decay, f_a, batch, gate_prefix_, "f_b_proj");
  Tensor beta = ops::linear(x, w_.b_proj, ScalarType::F32);  // [T, H]
  lora::add_(beta, x, batch, prefix_, "b_proj");
  Tensor out_gate;  // [T, P]
  if (config_.full_rank_gate) {
    out_gate = ops::linear(x, w_.g_proj, ScalarType::F32);
    lora::add_(out_gate, x, batch, prefix_, "g_proj");
  } else {
    Tensor g_a = ops::linear(x, w_.g_a_proj);
    lora::add_(g_a, x, batch, prefix_, "g_a_proj");
    out_gate = ops::linear(g_a, w_.g_b_proj, ScalarType::F32);
    lora::add_(out_gate, g_a, batch, prefix_, "g_b_proj");
  }
  gates_(log_decay, beta);
  Tensor core = mix(qkv, log_decay, beta, batch, layer);
  const Tensor normed = gated_norm(core, out_gate);
  Tensor out = ops::linear(normed, w_.o_proj);
  lora::add_(out, normed, batch, prefix_, "o_proj");
  ops::all_reduce_(tp_, out);
  return out;
}

void KdaMixer::gates_(Tensor& log_decay, Tensor& beta) const {
  const int64_t T = log_decay.dim(0), H = config_.num_heads, D = config_.head_dim;
  if (log_decay.on_cpu())
    return cpu::kda_gates(log_decay.data(), w_.dt_bias.data(), w_.A_log.data(), beta.data(), log_decay.data(),
                          beta.data(), T, H, D, config_.decay_lower_bound);
#if SPARROW_HAVE_CUDA
  cuda::kda_gates(log_decay.data(), w_.dt_bias.data(), w_.A_log.data(), beta.data(), log_decay.data(), beta.data(), T,
                  int(H), int(D), config_.decay_lower_bound, cuda::stream());
#else
  fail("KDA on a GPU in a build without the CUDA backend");
#endif
}

Tensor KdaMixer::gated_norm(Tensor& core, const Tensor& out_gate) const {
  if (core.on_cpu()) {
    cpu::kda_gated_rms_norm(core, out_gate, w_.o_norm, config_.norm_eps);
    return core;
  }
#if SPARROW_HAVE_CUDA
  // Into bf16 for o_proj.
  Tensor normed = Tensor::empty({core.dim(0), core.dim(1)}, ScalarType::BF16, core.device());
  cuda::kda_gated_rms_norm(core.data(), out_gate.data(), w_.o_norm.data(), normed.raw(), /*out_bf16=*/true,
                           core.dim(0), int(config_.num_heads), int(config_.head_dim), config_.norm_eps,
                           cuda::stream());
  return normed;
#else
  (void)out_gate;
  fail("KDA on a GPU in a build without the CUDA backend");
#endif
}

// The conv and the delta rule over each sequence's saved states, stopping at a prefix-caching snapshot to
// copy the states there. CPU: one sequence at a time, the chunked form for prefill and the recurrent one
// for a single token, as transformers. GPU: all sequences per launch; a step's snapshot
// (DeviceStep::seq_split) splits it into two launches of the conv and the delta rule with the state
// copies between them; decode steps (one row per sequence) always issue the same launches, so a CUDA graph
// replays them whatever the snapshots.
Tensor KdaMixer::mix(const Tensor& qkv, const Tensor& log_decay, const Tensor& beta, const Batch& batch,
                     int layer) const {
  const int64_t T = qkv.dim(0), H = config_.num_heads, D = config_.head_dim, P = config_.projection_dim();
  const int64_t kernel = config_.conv_kernel, tail = kernel - 1;
  const int64_t conv_size = tail * 3 * P, recurrent_size = H * D * D;
  if (qkv.on_cpu()) {
    Tensor q = Tensor::empty({T, P}), k = Tensor::empty({T, P}), v = Tensor::empty({T, P});
    Tensor core = Tensor::empty({T, P});
    for (const SeqSlice& seq : batch.seqs) {
      float* conv_state = seq.cache().state(layer, StateKind::ConvTail);
      float* recurrent_state = seq.cache().state(layer, StateKind::Recurrent);

      // [saved tail | new inputs]: a fresh sequence's tail is zeros, like the conv's zero padding.
      std::vector<float> history(conv_size + seq.count * 3 * P);
      std::memcpy(history.data(), conv_state, sizeof(float) * conv_size);
      std::memcpy(history.data() + conv_size, qkv.row(seq.offset), sizeof(float) * seq.count * 3 * P);
      cpu::kda_short_conv(history.data(), w_.conv.data(), kernel, seq.count, H, D, q.row(seq.offset),
                          k.row(seq.offset), v.row(seq.offset), P);
      // The conv tail after the first n new tokens: the last `tail` inputs before them.
      auto conv_tail_after = [&](int64_t n) { return history.data() + n * 3 * P; };
      std::memcpy(conv_state, conv_tail_after(seq.count), sizeof(float) * conv_size);

      // The delta rule over new tokens [begin, end) of this sequence, continuing recurrent_state.
      auto run_delta_rule = [&](int64_t begin, int64_t end) {
        const int64_t t = seq.offset + begin;
        cpu::DeltaRuleInputs in;
        in.length = end - begin;
        in.num_heads = H;
        in.head_dim = D;
        in.q = q.row(t);
        in.k = k.row(t);
        in.v = v.row(t);
        in.log_decay = log_decay.row(t);
        in.beta = beta.row(t);
        // The exact token-serial recurrence for every row, prefill included (transformers runs the chunked
        // form there; the two agree to fp32 rounding): chunks would make a row's arithmetic depend on where
        // the step and the prefix-cache snapshot split its sequence, and a row must not depend on its batch
        // (batch invariance, tests/batch_invariance_test.cpp).
        cpu::delta_rule_recurrent(in, recurrent_state, core.row(t));
      };
      const int64_t snapshot_at = seq.cache().snapshot_position(seq.start(), seq.start() + seq.count);
      SPARROW_CHECK(snapshot_at <= seq.start() + seq.count, "KDA layer ", layer, ": snapshot position ", snapshot_at,
                    " lies beyond this step's last token ", seq.start() + seq.count - 1);
      if (snapshot_at > seq.start()) {
        // Prefix caching wants the state after position snapshot_at - 1: stop there, copy, go on.
        const int64_t split = snapshot_at - seq.start();
        run_delta_rule(0, split);
        std::memcpy(seq.cache().snapshot(layer, StateKind::ConvTail), conv_tail_after(split),
                    sizeof(float) * conv_size);
        std::memcpy(seq.cache().snapshot(layer, StateKind::Recurrent), recurrent_state,
                    sizeof(float) * recurrent_size);
        if (split < seq.count) run_delta_rule(split, seq.count);
      } else {
        run_delta_rule(0, seq.count);
      }
    }
    return core;
  }
#if SPARROW_HAVE_CUDA
  constexpr int64_t kChunkedFrom = 64;  // rows of the longest sequence: one whole chunk
  const DeviceStep& step = device_step(batch);
  const PagedStorage& storage = *step.storage;
  cudaStream_t stream = cuda::stream();

  auto* slots = reinterpret_cast<uint8_t* const*>(step.state_slots.as<int64_t>());
  const int num_seqs = int(batch.seqs.size());
  const int32_t* seq_rows = step.seq_rows.as<int32_t>();
  const int32_t* split = step.seq_split.as<int32_t>();
  const cuda::KdaSequences before{seq_rows, split, slots, num_seqs, step.max_seq_rows};
  const cuda::KdaSequences after{split, seq_rows + 1, slots, num_seqs, step.max_seq_rows};
  const int64_t tail_offset = storage.state_offset(layer, StateKind::ConvTail);
  const int64_t state_offset = storage.state_offset(layer, StateKind::Recurrent);

  Tensor conv = Tensor::empty({T, 3 * P}, ScalarType::F32, qkv.device());  // [q | k | v] after conv + SiLU
  Tensor core = Tensor::empty({T, P}, ScalarType::F32, qkv.device());
  // A sequence with a whole chunk of rows runs the chunk-parallel form on the tensor cores (as transformers
  // runs chunk_kimi_delta_attention for prefill); shorter ones, decode included, the exact token-serial
  // recurrence. In batch-invariant mode every row takes the recurrence, as on the CPU: whether a sequence
  // runs chunked depends on the longest sequence of the step, and where its chunks fall on where the step
  // and the prefix-cache snapshot split it (core/batch_invariance.h).
  const bool chunked = step.max_seq_rows >= kChunkedFrom && (D == 64 || D == 128) && !batch_invariant();
  Tensor workspace;
  if (chunked)
    workspace = Tensor::empty({int64_t(cuda::kda_delta_rule_chunked_workspace_bytes(T, num_seqs, int(H), int(D)))},
                              ScalarType::U8, qkv.device());
  auto run = [&](const cuda::KdaSequences& seqs) {
    cuda::kda_short_conv(qkv.data(), conv.data(), 3 * P, w_.conv.data(), int(config_.conv_kernel), seqs, tail_offset,
                         stream);
    // l2norm and the q scale happen inside (normalize_qk), as cpu::kda_short_conv applies them after the conv.
    const float *q = conv.data(), *k = conv.data() + P, *v = conv.data() + 2 * P;
    if (chunked)
      cuda::kda_delta_rule_chunked(q, k, v, 3 * P, log_decay.data(), beta.data(), core.data(), int(H), int(D),
                                   /*normalize_qk=*/true, seqs, state_offset, workspace.raw(), stream);
    else
      cuda::kda_delta_rule(q, k, v, 3 * P, log_decay.data(), beta.data(), core.data(), int(H), int(D),
                           /*normalize_qk=*/true, seqs, state_offset, stream);
  };
  run(before);
  auto* snapshots = reinterpret_cast<uint8_t* const*>(step.snapshot_slots.as<int64_t>());
  cuda::kda_copy_states(before, snapshots, tail_offset, conv_size * int64_t(sizeof(float)), stream);
  cuda::kda_copy_states(before, snapshots, state_offset, recurrent_size * int64_t(sizeof(float)), stream);
  if (step.rows_after_snapshot) run(after);
  return core;
#else
  (void)log_decay, (void)beta, (void)batch;
  fail("KDA on a GPU in a build without the CUDA backend");
#endif
}

}  // namespace sparrow
