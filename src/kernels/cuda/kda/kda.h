// Kimi Delta Attention (KDA, src/model/kda_mixer.h) on the GPU: the short causal convolution with its saved
// tail, the gate activations, the delta-rule recurrence over each sequence's fp32 state, and the gated
// output norm. Each kernel is the twin of the CPU code in src/kernels/cpu/kda_reference.cpp and is tested against it
// (tests/cuda/kda_test.cpp).
//
// Batches: the rows [T, ...] of all sequences are stacked; sequence s owns rows begin[s] .. end[s] - 1
// (KdaSequences below; a sequence may have no rows this launch, and then its states are left as they
// are). A step may run a sequence's rows in two launches (up to a prefix-cache snapshot, then the rest:
// model/kda_mixer.h), so the ranges need not tile the rows.
// Per-sequence states live in the sequence's state slot (a paged cache's per-sequence slot,
// cache/kv_cache.h): the state of one layer and kind sits `offset` bytes into slots[s]:
//   conv tail   fp32 [kernel - 1, channels]: the last kernel-1 inputs, oldest first
//   recurrent   fp32 [heads, D, D]: S[h][k][v], key index first (as kda.h)
// All math is fp32; every tensor here is fp32 unless said otherwise. All pointers are device pointers.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda {

// The sequences of a launch. Device arrays except num_seqs and max_count.
struct KdaSequences {
  const int32_t* begin = nullptr;  // [num_seqs] first row of sequence s
  const int32_t* end = nullptr;    // [num_seqs] one past its last row
  uint8_t* const* slots = nullptr; // [num_seqs] its state slot
  int num_seqs = 0;
  int64_t max_count = 0;           // host: >= every end[s] - begin[s] (sizes grids)
};

// Causal depthwise convolution + SiLU (KdaMixer's conv over [q | k | v] before the projections' split):
//   y[t, c] = silu( sum_{j<K} weight[c, j] * h[t + j, c] ),  h = [tails[s] (K-1 rows) | x rows of s]
// so column K-1 of weight multiplies the current token and the tail stands for the K-1 tokens before
// the first. Afterwards tails[s] holds the last K-1 rows of h (with fewer than K-1 new rows, the old
// tail shifted up by the count, then the new rows).
//   x, y     [T, channels], row stride `channels`; y must not overlap x
//   weight   [channels, kernel], 2 <= kernel <= 8
//   tail_offset  bytes from a slot's start to the layer's conv tail
void kda_short_conv(const float* x, float* y, int64_t channels, const float* weight, int kernel,
                    const KdaSequences& seqs, int64_t tail_offset, cudaStream_t stream);

// The gates, as cpu::kda_gates (kernels/cpu/kda_reference.h), in place allowed (g may be f, beta may be b),
// with s = f[t, c] + dt_bias[c] and a = exp(A_log[c / head_dim]):
//   g[t, c]    = -a * softplus(s)                 lower_bound == 0 (Kimi Linear)
//   g[t, c]    = lower_bound * sigmoid(a * s)     lower_bound < 0  (Kimi K3)
//   beta[t, h] = sigmoid(b[t, h])
// softplus(x) = x above 20, else log(1 + exp(x)) (KimiLinearForgetGate).
//   f, g [rows, heads * head_dim]; b, beta [rows, heads]; dt_bias [heads * head_dim]; A_log [heads]
void kda_gates(const float* f, const float* dt_bias, const float* A_log, const float* b, float* g, float* beta,
               int64_t rows, int heads, int head_dim, float lower_bound, cudaStream_t stream);

// The delta rule, token by token in each sequence's order (delta_rule_recurrent): per head h and token t,
//   S = Diag(exp g_t) S;  u = beta_t (v_t - S^T k_t);  S += k_t u^T;  out_t = S^T q_t
// continuing each sequence's state (state_offset bytes into its slot) and leaving the state after its
// last row there.
//   q, k, v   rows of stride qkv_stride (elements), head h at columns h*D .. h*D+D-1 of each (so the
//             three may be column ranges of one [T, 3P] buffer, kda_short_conv's output)
//   normalize_qk  false: q, k are already L2-normalised and q scaled by D^-1/2 (as DeltaRuleInputs);
//             true: q, k are the conv's outputs and the kernel applies KdaMixer's l2norm per head,
//             x / sqrt(sum x^2 + 1e-6), and q *= D^-1/2, on the fly (q, k in memory are not changed)
//   log_decay [T, heads * D] (g <= 0), beta [T, heads], out [T, heads * D]
//   head_dim  D in {16, 32, 64, 128}
// Exact for any count (decode: one row per sequence; prefill: many). When seqs.max_count is 1 (decode),
// a kernel that streams each state once (one block per sequence, head and 64 value columns, the slice
// loaded into registers with 16-byte loads when the state is 16-byte aligned); otherwise one block per
// (sequence, head, slice of 32 value columns) walks the sequence's rows, the state slice held in registers.
void kda_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* log_decay,
                    const float* beta, float* out, int heads, int head_dim, bool normalize_qk,
                    const KdaSequences& seqs, int64_t state_offset, cudaStream_t stream);

// The same recurrence in the chunk-parallel form (delta_rule_chunked in src/kernels/cpu/kda_reference.cpp; the fla
// library's chunk_kda): for prefill, where a sequence has many rows. Same arguments and result as
// kda_delta_rule, to the rounding of its tensor-core products (tf32 and bf16 operands, fp32 sums and state:
// about 1e-3 relative; kernels/cuda/kda/chunk.cu says how much), plus a device workspace of at least
// kda_delta_rule_chunked_workspace_bytes(total_rows, seqs.num_seqs, heads, head_dim) bytes, 16-byte
// aligned, where total_rows >= the sum of the sequences' row counts (e.g. the rows of q); nothing in it
// needs clearing, and it is free again once the launch's work on `stream` is done.
//   head_dim  D in {64, 128} (others: sparrow::Error; kda_delta_rule takes them)
// Three kernels: a one-block prefix sum (each sequence's first workspace record), the per-chunk
// preparation (all chunks of all sequences and heads at once), and the walk over each sequence's chunks.
void kda_delta_rule_chunked(const float* q, const float* k, const float* v, int64_t qkv_stride,
                            const float* log_decay, const float* beta, float* out, int heads, int head_dim,
                            bool normalize_qk, const KdaSequences& seqs, int64_t state_offset, void* workspace,
                            cudaStream_t stream);
// About 1.3 KB per row and head (644 * head_dim bytes per chunk of 64 rows and head), plus one chunk per
// sequence for its ragged last chunk.
size_t kda_delta_rule_chunked_workspace_bytes(int64_t total_rows, int num_seqs, int heads, int head_dim);

// Prefix-cache snapshots (model/kda_mixer.h): for every sequence s with snapshots[s] not null, copies `bytes`
// bytes at `offset` of its state slot to the same place in snapshots[s] (a slot of the same layout).
// Sequences with a null entry are skipped, so a CUDA graph can capture the copy once for every step.
void kda_copy_states(const KdaSequences& seqs, uint8_t* const* snapshots, int64_t offset, int64_t bytes,
                     cudaStream_t stream);

// KimiLinearRMSNormGated: per row t and head h, over the head's D values,
//   out[t, h, :] = o[t, h, :] / sqrt(mean(o[t, h, :]^2) + eps) * weight * sigmoid(gate[t, h, :])
//   o, gate [rows, heads * head_dim] fp32; weight [head_dim] (shared by the heads);
//   out [rows, heads * head_dim], fp32 or (out_bf16) bf16 bits; out may be o when fp32.
void kda_gated_rms_norm(const float* o, const float* gate, const float* weight, void* out, bool out_bf16, int64_t rows,
                        int heads, int head_dim, float eps, cudaStream_t stream);

}  // namespace sparrow::cuda
