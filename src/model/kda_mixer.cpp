#include "model/kda_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/ops.h"
#include "model/device_step.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/kda/kda.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#endif

namespace sparrow {

// ---------------------------------------------------------------------------------------------
// The delta rule, token by token (transformers recurrent_kimi_delta_attention). Per head, per token:
//   S *= exp(g) (row k scaled by exp(g[k]));  u = beta (v - S^T k);  S += k u^T;  o = S^T q.
void delta_rule_recurrent(const DeltaRuleInputs& in, float* state, float* out) {
  const int64_t T = in.length, H = in.num_heads, D = in.head_dim;
  parallel_for(H, [&](int64_t head_begin, int64_t head_end) {
    std::vector<float> update(D);
    for (int64_t h = head_begin; h < head_end; ++h) {
      float* S = state + h * D * D;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t at = (t * H + h) * D;
        const float *q = in.q + at, *k = in.k + at, *v = in.v + at, *g = in.log_decay + at;
        const float beta = in.beta[t * H + h];
        for (int64_t i = 0; i < D; ++i) {
          const float decay = std::exp(g[i]);
          for (int64_t j = 0; j < D; ++j) S[i * D + j] *= decay;
        }
        // update = beta * (v - S^T k)
        std::fill(update.begin(), update.end(), 0.0f);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) update[j] += k[i] * S[i * D + j];
        for (int64_t j = 0; j < D; ++j) update[j] = (v[j] - update[j]) * beta;
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) S[i * D + j] += k[i] * update[j];
        float* o = out + at;
        std::fill(o, o + D, 0.0f);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) o[j] += q[i] * S[i * D + j];
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The delta rule, chunk-parallel (transformers chunk_kimi_delta_attention, the fla formulation).
// Within a chunk of n <= C tokens starting from state S, with G[r] = g[0] + ... + g[r] (per key
// channel) and decay(r, i) = exp(G[r] - G[i]) for i <= r:
//   A[r][i]   = -beta[r] * sum_d k[r][d] k[i][d] decay(r, i)[d]      (i < r, else 0)
//   T         = (I - A)^-1 by forward substitution, the rows of A rewritten in place
//   U         = T (beta * V),   W = T (beta * exp(G) * K)
//   Vn        = U - W S                          (the "new values" after the state's prediction)
//   Aqk[r][i] = sum_d q[r][d] k[i][d] decay(r, i)[d]                 (i <= r)
//   O         = (exp(G) * Q) S + Aqk Vn
//   S        <- exp(G[n-1]) * S + (exp(G[n-1] - G) * K)^T Vn
// Every exponent is a difference G[r] - G[i] with i <= r (or G[r] itself), so it is <= 0: the
// decays are computed directly and never as exp(G) * exp(-G), which would overflow.
// A ragged last chunk is handled as is: transformers pads it with k = v = beta = g = 0 rows, which
// contribute nothing.
void delta_rule_chunked(const DeltaRuleInputs& in, float* state, float* out, int64_t chunk_size) {
  const int64_t T = in.length, H = in.num_heads, D = in.head_dim, C = chunk_size;
  SPARROW_CHECK(C > 0, "delta rule: chunk size must be positive");
  parallel_for(H, [&](int64_t head_begin, int64_t head_end) {
    // Per-chunk scratch, row-major: [C, D] and [C, C].
    std::vector<float> Q(C * D), K(C * D), V(C * D), G(C * D), beta(C);
    std::vector<float> A(C * C), Aqk(C * C), row(C), KbG(C * D), U(C * D), W(C * D), Vn(C * D), last_decay(D);
    for (int64_t h = head_begin; h < head_end; ++h) {
      float* S = state + h * D * D;
      for (int64_t c0 = 0; c0 < T; c0 += C) {
        const int64_t n = std::min(C, T - c0);
        for (int64_t r = 0; r < n; ++r) {
          const int64_t at = ((c0 + r) * H + h) * D;
          std::memcpy(&Q[r * D], in.q + at, sizeof(float) * D);
          std::memcpy(&K[r * D], in.k + at, sizeof(float) * D);
          std::memcpy(&V[r * D], in.v + at, sizeof(float) * D);
          for (int64_t d = 0; d < D; ++d) G[r * D + d] = (r ? G[(r - 1) * D + d] : 0.0f) + in.log_decay[at + d];
          beta[r] = in.beta[(c0 + r) * H + h];
        }

        // A (strictly lower) and Aqk (lower, diagonal included) share the pairwise decays.
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t i = 0; i <= r; ++i) {
            float kk = 0.0f, qk = 0.0f;
            for (int64_t d = 0; d < D; ++d) {
              const float decay = std::exp(G[r * D + d] - G[i * D + d]);
              kk += K[r * D + d] * beta[r] * K[i * D + d] * decay;
              qk += Q[r * D + d] * K[i * D + d] * decay;
            }
            A[r * C + i] = i < r ? -kk : 0.0f;
            Aqk[r * C + i] = qk;
          }
        }
        // Forward substitution, row by row, each row using the rows above as already rewritten:
        // A[r][j] += sum_{j<m<r} A[r][m] A[m][j]; then T = A + I.
        for (int64_t r = 1; r < n; ++r) {
          for (int64_t j = 0; j < r; ++j) row[j] = A[r * C + j];
          for (int64_t j = 0; j < r; ++j) {
            float sum = row[j];
            for (int64_t m = j + 1; m < r; ++m) sum += row[m] * A[m * C + j];
            A[r * C + j] = sum;
          }
        }
        for (int64_t r = 0; r < n; ++r) A[r * C + r] = 1.0f;

        // U = T (beta V), W = T (beta exp(G) K); V and K are rescaled in place, no longer needed as they were.
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t d = 0; d < D; ++d) {
            V[i * D + d] *= beta[i];
            KbG[i * D + d] = K[i * D + d] * beta[i] * std::exp(G[i * D + d]);
          }
        }
        for (int64_t r = 0; r < n; ++r) {
          float* u = &U[r * D];
          float* w = &W[r * D];
          std::fill(u, u + D, 0.0f);
          std::fill(w, w + D, 0.0f);
          for (int64_t i = 0; i <= r; ++i) {
            const float t = A[r * C + i];
            for (int64_t d = 0; d < D; ++d) {
              u[d] += t * V[i * D + d];
              w[d] += t * KbG[i * D + d];
            }
          }
        }
        // Vn = U - W S
        for (int64_t r = 0; r < n; ++r) {
          float* vn = &Vn[r * D];
          std::fill(vn, vn + D, 0.0f);
          for (int64_t i = 0; i < D; ++i) {
            const float w = W[r * D + i];
            for (int64_t j = 0; j < D; ++j) vn[j] += w * S[i * D + j];
          }
          for (int64_t j = 0; j < D; ++j) vn[j] = U[r * D + j] - vn[j];
        }
        // O = (exp(G) Q) S + Aqk Vn
        for (int64_t r = 0; r < n; ++r) {
          float* o = out + ((c0 + r) * H + h) * D;
          std::fill(o, o + D, 0.0f);
          for (int64_t i = 0; i < D; ++i) {
            const float qd = Q[r * D + i] * std::exp(G[r * D + i]);
            for (int64_t j = 0; j < D; ++j) o[j] += qd * S[i * D + j];
          }
          for (int64_t i = 0; i <= r; ++i) {
            const float a = Aqk[r * C + i];
            for (int64_t j = 0; j < D; ++j) o[j] += a * Vn[i * D + j];
          }
        }
        // S <- exp(G[n-1]) S + (exp(G[n-1] - G) K)^T Vn
        const float* G_last = &G[(n - 1) * D];
        for (int64_t i = 0; i < D; ++i) last_decay[i] = std::exp(G_last[i]);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) S[i * D + j] *= last_decay[i];
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t i = 0; i < D; ++i) {
            const float kd = K[r * D + i] * std::exp(G_last[i] - G[r * D + i]);
            for (int64_t j = 0; j < D; ++j) S[i * D + j] += kd * Vn[r * D + j];
          }
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
namespace {

// transformers' kimi_linear l2norm (matching fla): x / sqrt(sum(x^2) + eps), eps added, not clamped.
void l2_normalize(float* x, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

// softplus as KimiLinearForgetGate writes it: x above 20, else log(1 + exp(x)).
float softplus(float x) { return x > 20.0f ? x : std::log(1.0f + std::exp(x)); }

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
  KdaWeights w;
  // One statement per tensor: errors then name the first one wrong (argument order is unspecified).
  const Tensor q_proj = ckpt.take_linear(prefix + "q_proj.weight", {P, hidden});
  const Tensor k_proj = ckpt.take_linear(prefix + "k_proj.weight", {P, hidden});
  w.qkv_proj = stack_rows(q_proj, k_proj, ckpt.take_linear(prefix + "v_proj.weight", {P, hidden}));
  // The conv taps and decay rates stay fp32 on every device: the GPU kernels read them so.
  if (ckpt.has(prefix + "conv1d.weight")) {
    w.conv = ckpt.take_fp32(prefix + "conv1d.weight", {3 * P, 1, kernel}).reshape({3 * P, kernel});
  } else {  // Kimi's original checkpoint: one convolution per projection (transformers concatenates them)
    const Tensor q_conv = ckpt.take_fp32(prefix + "q_conv1d.weight", {P, 1, kernel}).reshape({P, kernel});
    const Tensor k_conv = ckpt.take_fp32(prefix + "k_conv1d.weight", {P, 1, kernel}).reshape({P, kernel});
    w.conv = stack_rows(q_conv, k_conv, ckpt.take_fp32(prefix + "v_conv1d.weight", {P, 1, kernel}).reshape({P, kernel}));
  }
  // transformers moves these under forget_gate.; the original checkpoint keeps them on self_attn.
  const std::string gate = ckpt.has(prefix + "forget_gate.A_log") ? prefix + "forget_gate." : prefix;
  w.f_a_proj = ckpt.take_linear(gate + "f_a_proj.weight", {D, hidden});
  w.f_b_proj = ckpt.take_linear(gate + "f_b_proj.weight", {P, D});
  w.dt_bias = ckpt.take_fp32(gate + "dt_bias", {P});
  w.A_log = ckpt.take_fp32(gate + "A_log", {1, 1, H, 1}).reshape({H});
  w.b_proj = ckpt.take_linear(prefix + "b_proj.weight", {H, hidden});
  w.g_a_proj = ckpt.take_linear(prefix + "g_a_proj.weight", {D, hidden});
  w.g_b_proj = ckpt.take_linear(prefix + "g_b_proj.weight", {P, D});
  w.o_norm = ckpt.take_fp32(prefix + "o_norm.weight", {D});
  w.o_proj = ckpt.take_linear(prefix + "o_proj.weight", {hidden, P});
  return std::make_unique<KdaMixer>(config, std::move(w));
}

LayerCacheSpec KdaMixer::cache_spec_for(const KdaConfig& config) {
  const int64_t P = config.projection_dim();
  LayerCacheSpec spec;
  spec.states.push_back({StateKind::ConvTail, (config.conv_kernel - 1) * 3 * P});
  spec.states.push_back({StateKind::Recurrent, config.num_heads * config.head_dim * config.head_dim});
  return spec;
}

Tensor KdaMixer::forward(const Tensor& x, const Batch& batch, int layer) {
  if (!x.on_cpu()) return forward_gpu(x, batch, layer);
  const int64_t T = x.dim(0), H = config_.num_heads, D = config_.head_dim, P = config_.projection_dim();
  const int64_t kernel = config_.conv_kernel, tail = kernel - 1;

  // Everything that only depends on the token itself, for the whole batch at once.
  const Tensor qkv = ops::linear(x, w_.qkv_proj);                          // [T, 3P] before the conv
  Tensor log_decay = ops::linear(ops::linear(x, w_.f_a_proj), w_.f_b_proj);  // [T, P]
  Tensor beta = ops::linear(x, w_.b_proj);                                 // [T, H]
  const Tensor out_gate = ops::linear(ops::linear(x, w_.g_a_proj), w_.g_b_proj);  // [T, P]
  parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* g = log_decay.row(t);
      for (int64_t c = 0; c < P; ++c) g[c] = -std::exp(w_.A_log.data()[c / D]) * softplus(g[c] + w_.dt_bias.data()[c]);
      for (int64_t h = 0; h < H; ++h) beta.row(t)[h] = cpu::sigmoid(beta.row(t)[h]);
    }
  });

  Tensor q = Tensor::empty({T, P}), k = Tensor::empty({T, P}), v = Tensor::empty({T, P});
  Tensor core = Tensor::empty({T, P});
  const float q_scale = float(1.0 / std::sqrt(double(D)));
  const int64_t conv_size = tail * 3 * P, recurrent_size = H * D * D;
  for (const SeqSlice& seq : batch.seqs) {
    float* conv_state = seq.cache().state(layer, StateKind::ConvTail);
    float* recurrent_state = seq.cache().state(layer, StateKind::Recurrent);

    // Causal depthwise conv + SiLU over [saved tail | new inputs] (transformers causal_conv1d_fn with
    // the cached left context; a fresh sequence's tail is zeros, like the conv's zero padding).
    std::vector<float> history(conv_size + seq.count * 3 * P);
    std::memcpy(history.data(), conv_state, sizeof(float) * conv_size);
    std::memcpy(history.data() + conv_size, qkv.row(seq.offset), sizeof(float) * seq.count * 3 * P);
    parallel_for(seq.count, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = seq.offset + i;
        float* dst[3] = {q.row(t), k.row(t), v.row(t)};
        for (int64_t c = 0; c < 3 * P; ++c) {
          const float* taps = w_.conv.row(c);
          float sum = 0.0f;
          for (int64_t j = 0; j < kernel; ++j) sum += taps[j] * history[(i + j) * 3 * P + c];
          dst[c / P][c % P] = cpu::silu(sum);
        }
        for (int64_t h = 0; h < H; ++h) {
          l2_normalize(q.row(t) + h * D, D, q_scale);
          l2_normalize(k.row(t) + h * D, D, 1.0f);
        }
      }
    });
    // The conv tail after the first n new tokens: the last `tail` inputs before them.
    auto conv_tail_after = [&](int64_t n) { return history.data() + n * 3 * P; };
    std::memcpy(conv_state, conv_tail_after(seq.count), sizeof(float) * conv_size);

    // The delta rule over new tokens [begin, end) of this sequence, continuing recurrent_state.
    auto run_delta_rule = [&](int64_t begin, int64_t end) {
      const int64_t t = seq.offset + begin;
      DeltaRuleInputs in;
      in.length = end - begin;
      in.num_heads = H;
      in.head_dim = D;
      in.q = q.row(t);
      in.k = k.row(t);
      in.v = v.row(t);
      in.log_decay = log_decay.row(t);
      in.beta = beta.row(t);
      // As transformers: the recurrent kernel for a single new token, the chunked one otherwise.
      if (in.length == 1)
        delta_rule_recurrent(in, recurrent_state, core.row(t));
      else
        delta_rule_chunked(in, recurrent_state, core.row(t));
    };
    const int64_t snapshot_at = seq.cache().snapshot_position(seq.start(), seq.start() + seq.count);
    SPARROW_CHECK(snapshot_at <= seq.start() + seq.count, "KDA layer ", layer, ": snapshot position ", snapshot_at,
                  " lies beyond this step's last token ", seq.start() + seq.count - 1);
    if (snapshot_at > seq.start()) {
      // Prefix caching wants the state after position snapshot_at - 1: stop there, copy, go on.
      const int64_t split = snapshot_at - seq.start();
      run_delta_rule(0, split);
      std::memcpy(seq.cache().snapshot(layer, StateKind::ConvTail), conv_tail_after(split), sizeof(float) * conv_size);
      std::memcpy(seq.cache().snapshot(layer, StateKind::Recurrent), recurrent_state, sizeof(float) * recurrent_size);
      if (split < seq.count) run_delta_rule(split, seq.count);
    } else {
      run_delta_rule(0, seq.count);
    }
  }

  // KimiLinearRMSNormGated: per-head RMSNorm, weight, then times sigmoid(gate).
  ops::rms_norm_(core, w_.o_norm, config_.norm_eps);
  parallel_for(T, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < P; ++c) core.row(t)[c] *= cpu::sigmoid(out_gate.row(t)[c]);
  });
  return ops::linear(core, w_.o_proj);
}

// The same layer on the GPU (kernels/cuda/kda): the projections as bf16 products with fp32 outputs, then
// the gates, the conv and the delta rule in fp32 over each sequence's state slot, the gated norm into
// bf16 for o_proj. A step's snapshot (DeviceStep::seq_split) splits it into two launches of the conv and
// the delta rule with the state copies between them; decode steps (one row per sequence) always issue
// the same launches, so a CUDA graph replays them whatever the snapshots.
Tensor KdaMixer::forward_gpu(const Tensor& x, const Batch& batch, int layer) {
#if SPARROW_HAVE_CUDA
  constexpr int64_t kChunkedFrom = 64;  // rows of the longest sequence: one whole chunk
  const int64_t T = x.dim(0), H = config_.num_heads, D = config_.head_dim, P = config_.projection_dim();
  const DeviceStep& step = device_step(batch);
  const PagedStorage& storage = *step.storage;
  cudaStream_t stream = cuda::stream();

  const Tensor qkv = ops::linear(x, w_.qkv_proj, ScalarType::F32);  // [T, 3P] before the conv
  Tensor log_decay = ops::linear(ops::linear(x, w_.f_a_proj), w_.f_b_proj, ScalarType::F32);  // [T, P]
  Tensor beta = ops::linear(x, w_.b_proj, ScalarType::F32);                                   // [T, H]
  const Tensor out_gate = ops::linear(ops::linear(x, w_.g_a_proj), w_.g_b_proj, ScalarType::F32);  // [T, P]
  cuda::kda_gates(log_decay.data(), w_.dt_bias.data(), w_.A_log.data(), beta.data(), log_decay.data(), beta.data(), T,
                  int(H), int(D), stream);

  auto* slots = reinterpret_cast<uint8_t* const*>(step.state_slots.as<int64_t>());
  const int num_seqs = int(batch.seqs.size());
  const int32_t* seq_rows = step.seq_rows.as<int32_t>();
  const int32_t* split = step.seq_split.as<int32_t>();
  const cuda::KdaSequences before{seq_rows, split, slots, num_seqs, step.max_seq_rows};
  const cuda::KdaSequences after{split, seq_rows + 1, slots, num_seqs, step.max_seq_rows};
  const int64_t tail_offset = storage.state_offset(layer, StateKind::ConvTail);
  const int64_t state_offset = storage.state_offset(layer, StateKind::Recurrent);

  Tensor conv = Tensor::empty({T, 3 * P}, ScalarType::F32, x.device());  // [q | k | v] after conv + SiLU
  Tensor core = Tensor::empty({T, P}, ScalarType::F32, x.device());
  // A sequence with a whole chunk of rows runs the chunk-parallel form on the tensor cores (as transformers
  // runs chunk_kimi_delta_attention for prefill); shorter ones, decode included, the exact token-serial
  // recurrence.
  const bool chunked = step.max_seq_rows >= kChunkedFrom && (D == 64 || D == 128);
  Tensor workspace;
  if (chunked)
    workspace = Tensor::empty({int64_t(cuda::kda_delta_rule_chunked_workspace_bytes(T, num_seqs, int(H), int(D)))},
                              ScalarType::U8, x.device());
  auto run = [&](const cuda::KdaSequences& seqs) {
    cuda::kda_short_conv(qkv.data(), conv.data(), 3 * P, w_.conv.data(), int(config_.conv_kernel), seqs, tail_offset,
                         stream);
    // l2norm and the q scale happen inside (normalize_qk), as KdaMixer::forward applies them after the conv.
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
  cuda::kda_copy_states(before, snapshots, tail_offset, (config_.conv_kernel - 1) * 3 * P * int64_t(sizeof(float)),
                        stream);
  cuda::kda_copy_states(before, snapshots, state_offset, H * D * D * int64_t(sizeof(float)), stream);
  if (step.rows_after_snapshot) run(after);

  Tensor normed = Tensor::empty({T, P}, ScalarType::BF16, x.device());
  cuda::kda_gated_rms_norm(core.data(), out_gate.data(), w_.o_norm.data(), normed.raw(), /*out_bf16=*/true, T, int(H),
                           int(D), config_.norm_eps, stream);
  return ops::linear(normed, w_.o_proj);
#else
  (void)x, (void)batch, (void)layer;
  fail("KDA on a GPU in a build without the CUDA backend");
#endif
}

}  // namespace sparrow
