// Kimi Delta Attention (KDA, src/model/kda.h) on the GPU: the short causal convolution with its saved
// tail, the gate activations, the delta-rule recurrence over each sequence's fp32 state, and the gated
// output norm. Each kernel is the twin of the CPU code in src/model/kda.cpp and is tested against it
// (tests/cuda/kda_test.cpp).
//
// Batches: the rows [T, ...] of all sequences are stacked; sequence s owns rows
// seq_offset[s] .. seq_offset[s + 1] - 1 (seq_offset: device int32 [num_seqs + 1], non-decreasing; a
// sequence may have no rows, and then its states are left as they are).
// Per-sequence states are reached through device arrays of base pointers, one per sequence, so they can
// live anywhere in device memory (a SequenceCache's slots):
//   conv tail   tails[s]   fp32 [kernel - 1, channels]: the last kernel-1 inputs, oldest first
//   recurrent   states[s]  fp32 [heads, D, D]: S[h][k][v], key index first (as kda.h)
// All math is fp32; every tensor here is fp32 unless said otherwise. All pointers are device pointers.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparrow::cuda {

// Causal depthwise convolution + SiLU (KdaMixer's conv over [q | k | v] before the projections' split):
//   y[t, c] = silu( sum_{j<K} weight[c, j] * h[t + j, c] ),  h = [tails[s] (K-1 rows) | x rows of s]
// so column K-1 of weight multiplies the current token and the tail stands for the K-1 tokens before
// the first. Afterwards tails[s] holds the last K-1 rows of h (with fewer than K-1 new rows, the old
// tail shifted up by the count, then the new rows).
//   x, y     [T, channels], row stride `channels`; y must not overlap x
//   weight   [channels, kernel], 2 <= kernel <= 8
//   max_count (host) >= every sequence's row count (the total T will do): sizes the grid
void kda_short_conv(const float* x, float* y, int64_t channels, const float* weight, int kernel,
                    const int32_t* seq_offset, int num_seqs, int64_t max_count, float* const* tails,
                    cudaStream_t stream);

// The gates, as KdaMixer::forward computes them, in place allowed (g may be f, beta may be b):
//   g[t, c]    = -exp(A_log[c / head_dim]) * softplus(f[t, c] + dt_bias[c])     (c < heads * head_dim)
//   beta[t, h] = sigmoid(b[t, h])
// softplus(x) = x above 20, else log(1 + exp(x)) (KimiLinearForgetGate).
//   f, g [rows, heads * head_dim]; b, beta [rows, heads]; dt_bias [heads * head_dim]; A_log [heads]
void kda_gates(const float* f, const float* dt_bias, const float* A_log, const float* b, float* g, float* beta,
               int64_t rows, int heads, int head_dim, cudaStream_t stream);

// The delta rule, token by token in each sequence's order (delta_rule_recurrent): per head h and token t,
//   S = Diag(exp g_t) S;  u = beta_t (v_t - S^T k_t);  S += k_t u^T;  out_t = S^T q_t
// continuing each sequence's state states[s] and leaving the state after its last row there.
//   q, k, v   rows of stride qkv_stride (elements), head h at columns h*D .. h*D+D-1 of each (so the
//             three may be column ranges of one [T, 3P] buffer, kda_short_conv's output)
//   normalize_qk  false: q, k are already L2-normalised and q scaled by D^-1/2 (as DeltaRuleInputs);
//             true: q, k are the conv's outputs and the kernel applies KdaMixer's l2norm per head,
//             x / sqrt(sum x^2 + 1e-6), and q *= D^-1/2, on the fly (q, k in memory are not changed)
//   log_decay [T, heads * D] (g <= 0), beta [T, heads], out [T, heads * D]
//   head_dim  D in {16, 32, 64, 128}
// Exact for any count (decode: one row per sequence; prefill: many); one block per (sequence, head,
// slice of 32 value columns) walks the sequence's rows, the state slice held in registers.
void kda_delta_rule(const float* q, const float* k, const float* v, int64_t qkv_stride, const float* log_decay,
                    const float* beta, float* out, int heads, int head_dim, bool normalize_qk,
                    const int32_t* seq_offset, int num_seqs, float* const* states, cudaStream_t stream);

// KimiLinearRMSNormGated: per row t and head h, over the head's D values,
//   out[t, h, :] = o[t, h, :] / sqrt(mean(o[t, h, :]^2) + eps) * weight * sigmoid(gate[t, h, :])
//   o, gate [rows, heads * head_dim] fp32; weight [head_dim] (shared by the heads);
//   out [rows, heads * head_dim], fp32 or (out_bf16) bf16 bits; out may be o when fp32.
void kda_gated_rms_norm(const float* o, const float* gate, const float* weight, void* out, bool out_bf16, int64_t rows,
                        int heads, int head_dim, float eps, cudaStream_t stream);

}  // namespace sparrow::cuda
