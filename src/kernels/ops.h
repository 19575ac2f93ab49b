// The operations model code is written in, on any device. Each takes and returns Tensors and runs
// where its inputs live: host float32 tensors go to the CPU reference ops (kernels/cpu/reference_ops.h), CUDA
// tensors to the GPU launchers (kernels/cuda/*). Model files call these and nothing device-specific,
// which is what "one model code over both backends" means here.
//
// On the GPU, activations are bfloat16 (as transformers runs these models in bf16) with fp32 math
// inside each kernel; weights are bfloat16, norm weights and biases fp32. `act_type(device)` is the
// activation type a device uses.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/communicator.h"
#include "core/tensor.h"
#include "kernels/expert_adapters.h"
#include "kernels/glu.h"
#include "kernels/sampling_rule.h"

namespace sparrow::ops {

ScalarType act_type(Device device);  // F32 on the CPU, BF16 on CUDA

// y[T, out] = x[T, in] · w[out, in]ᵀ; `out_type` F32 forces fp32 output (router logits, lm_head).
Tensor linear(const Tensor& x, const Tensor& w);
Tensor linear(const Tensor& x, const Tensor& w, ScalarType out_type);
void add_bias_(Tensor& y, const Tensor& bias);  // y[t] += bias

// RMSNorm of whole rows (width = w.numel() = row width).
Tensor rms_norm(const Tensor& x, const Tensor& w, float eps, bool unit_offset = false);
// The residual add and the norm after it: x += delta, then returns rms_norm(x, w, eps, unit_offset), the
// values add_ and rms_norm give (one launch on a GPU).
Tensor add_rms_norm_(Tensor& x, const Tensor& delta, const Tensor& w, float eps, bool unit_offset = false);
// In place over `groups` groups of w.numel() values per row starting at column first_col
// (groups = -1: as many as fill the rest of the row). Heads share one weight.
void rms_norm_(Tensor& x, const Tensor& w, float eps, bool unit_offset = false, int64_t first_col = 0,
               int64_t groups = -1);
Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps);

void add_(Tensor& y, const Tensor& x);  // y += x
void scale_(Tensor& x, float s);        // x *= s
void mul_sigmoid_(Tensor& y, const Tensor& gate);  // y *= sigmoid(gate), elementwise
// GELU in place, elementwise: the erf form (torch's gelu, transformers' GELUActivation) or, with tanh_form,
// torch's approximate="tanh" (gelu_pytorch_tanh). The vision towers' activations (model/vision_encoder.h).
void gelu_(Tensor& x, bool tanh_form = false);
// Each row of scale * x (fp32 [rows, cols]) through a softmax, as a new [rows, cols] in act_type of x's device
// (attention probabilities ready for the product with the values: fp32 on the CPU, bf16 on a GPU).
Tensor softmax_rows(const Tensor& x, float scale);
// Rotation by given angles, in place: x [rows, heads * head_dim]; cos and sin fp32 [rows, R] on x's device, R <=
// head_dim / 2; in every head, pair j (interleaved: values 2j and 2j + 1; else NeoX halves: j and j + R) turns by
// row r's angle j: (a, b) -> (a cos - b sin, b cos + a sin). Values past the 2R rotated ones pass through. For
// rotations whose angles are not position x frequency (the vision towers' 2-D and 3-D RoPE).
void rotate_pairs_(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim, bool interleaved);
// AttnRes (Kimi K3, cpu::attn_res_mix): the softmax mix of the sources ([rows, width] each, one type and
// device) with the query norm * proj (fp32 [width] each); a new [rows, width] of the sources' type.
Tensor attn_res_mix(std::span<const Tensor> sources, const Tensor& norm, const Tensor& proj, float eps);

// Rows of `table` for the ids (ids on the host; the result lives with the table, in act_type).
Tensor embedding(const Tensor& table, const std::vector<int32_t>& ids);
// The given rows of x, in order (a new tensor).
Tensor select_rows(const Tensor& x, const std::vector<int64_t>& rows);
// The same with the ids / row indices already on the device (int32; a step's inputs, model/device_step.h):
// nothing crosses from the host, so a CUDA graph can capture them. The ids are not range-checked here
// (the engine validates prompts; sampled ids are in range).
Tensor embedding(const Tensor& table, const Tensor& ids);
Tensor select_rows(const Tensor& x, const Tensor& rows);
// Tensor parallelism (core/communicator.h, docs/parallel.md). Unsharded, each is a no-op or the identity.
// x summed over the group in place: the output of a row-parallel projection, or a vocab-parallel embedding.
void all_reduce_(const TensorParallel& tp, Tensor& x);
// The ranks' column parts side by side: rank r's x [T, c_r] lands at column r * part, where part is every
// rank's width but the last ones' (model/tensor_parallel.h vocab_share); [T, total] (the logits).
Tensor all_gather_columns(const TensorParallel& tp, const Tensor& x, int64_t part, int64_t total);
// Data parallelism (TensorParallel::data_parallel): the rows of every data-parallel group side by side,
// group d's counts[d] rows (x holds this group's counts[dp_rank]) at row counts[0] + ... + counts[d - 1];
// [sum of counts, width]. Over tp.dp_comm (an all-gather of parts padded to the largest count).
Tensor all_gather_rows(const TensorParallel& tp, const Tensor& x, const std::vector<int64_t>& counts);
// Its transpose: x [sum of counts, width] holds a term for every group's rows; returns this group's
// counts[dp_rank] rows summed over the data-parallel ranks (a reduce-scatter of padded parts).
Tensor reduce_scatter_rows(const TensorParallel& tp, const Tensor& x, const std::vector<int64_t>& counts);
// Data parallelism with expert parallelism: the routed rows only, over tp.dp_comm. The caller sets `to`: to[d]
// lists the rows of x (this group's) that group d's rank must see (those with a slot routed to its experts);
// send_rows returns the rows every group sent this rank, source group after source group ([sum of from,
// width]), and fills in the rest (one all-gather of the counts, one all-to-all padded to `largest`).
struct RowExchange {
  std::vector<std::vector<int64_t>> to;
  std::vector<int64_t> from;  // rows each group sent this rank
  int64_t largest = 0;        // the most rows any group sent any other: the all-to-alls' part
};
Tensor send_rows(const TensorParallel& tp, const Tensor& x, RowExchange& exchange);
// The way back: y (fp32) holds a term for each row send_rows returned, in its order; each goes back to its
// source, which gets [rows, width]: zeros plus, group after group, the term group d returned for row to[d][i].
Tensor return_rows(const TensorParallel& tp, const Tensor& y, const RowExchange& exchange, int64_t rows);
// A vocab-parallel embedding: rows of `table_part`, the vocabulary's rows [first, first + rows), for the
// ids it holds and zeros for the others (whose rows another rank adds); every id is checked against
// `vocab`.
Tensor embedding_part(const Tensor& table_part, int64_t first, int64_t vocab, const std::vector<int32_t>& ids);
// [a; b] along the first dimension (load time).
Tensor concat_rows(const Tensor& a, const Tensor& b);
// A weight matrix in its stored form (bf16, FP8 with block scales, or MX / NV codes with group scales) in
// the compute type of its device: on a GPU, a quantized matrix as bf16, each value the exact dequantization
// rounded once (kernels/cuda/gemm/dequantize.h, gemm_fp8.h); on the CPU, fp32, exactly
// (kernels/cpu/stored_weights.h).
Tensor dequantize_weight(const Tensor& w);

// Rotary embedding in place: per row r and head h < heads, the `rot` values at column
// first_col + h * head_stride, at position positions[r] (int64 tensor on x's device); inv_freq is fp32
// on x's device; cos/sin scaled by attention_scaling. Pairings as model/rope.h.
// Heads of head_dim < 2 * inv_freq.numel() values rotated whole as transformers does with
// cos[..., :head_dim] (cpu::apply_rope_neox_narrow_head); the CPU only.
void rope_narrow_heads_(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_scaling,
                        int64_t head_dim);
void rope_(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_scaling, int64_t first_col,
           int64_t heads, int64_t head_stride, bool interleaved);
// Each w.numel()-wide head of every row RMS-normalised (w shared by the heads; 1 + w when unit_offset),
// then rotated as rope_ rotates heads at stride w.numel(): rms_norm_ then rope_, the same values, one launch
// on a GPU (heads of up to 128 values; wider ones take the two ops).
void rms_norm_rope_heads_(Tensor& x, const Tensor& w, float eps, bool unit_offset, const Tensor& positions,
                          const Tensor& inv_freq, float attention_scaling, bool interleaved);

// Gated activation of rows [gate | up] (2 * inter wide) -> [T, inter] (kernels/glu.h says each kind).
Tensor glu(const Tensor& gate_up, Glu kind, float alpha = 1.0f, float limit = 0.0f);

// Copies `lines` runs of `width` elements: run i from src at src_offset + i * src_pitch to dst at
// dst_offset + i * dst_pitch (e.g. every head's rotary part of a [T, heads, dim] tensor).
void copy_lines(Tensor& dst, int64_t dst_offset, int64_t dst_pitch, const Tensor& src, int64_t src_offset,
                int64_t src_pitch, int64_t width, int64_t lines);

// Batched products over sub-matrices of tensors (MLA's per-head absorbed weights):
//   for b < batch: C_b[m, n] = A_b[m, k] · (B_b[k, n] | B_b[n, k]ᵀ)
// where X_b starts at element offset + b * batch_stride of its tensor, rows `ld` elements apart.
struct MatView {
  const Tensor* tensor = nullptr;
  int64_t offset = 0;
  int64_t ld = 0;
  int64_t batch_stride = 0;
};
void batched_matmul_nn(int64_t batch, int64_t m, int64_t n, int64_t k, MatView a, MatView b, const Tensor& c,
                       int64_t c_offset, int64_t ldc, int64_t c_batch_stride);
void batched_matmul_nt(int64_t batch, int64_t m, int64_t n, int64_t k, MatView a, MatView b, const Tensor& c,
                       int64_t c_offset, int64_t ldc, int64_t c_batch_stride);

// Mixture of experts, on either device (kernels/cpu/moe_reference.h defines them; kernels/cuda/moe is tested
// against it):
// DeepSeek-V3's grouped sigmoid routing of fp32 router logits [T, E] with the correction bias.
struct Routing {
  Tensor experts;  // int32 [T, top_k]
  Tensor weights;  // fp32 [T, top_k], scaling included
};
Routing route_grouped_sigmoid(const Tensor& logits, const Tensor& bias, int64_t n_group, int64_t topk_group,
                              int64_t top_k, bool normalize, float normalize_eps, float scaling);
// Benchmarks' simulated routing (kernels/uniform_routing.h): overwrites `routing` with top_k distinct
// uniform experts per token, keyed by x's bf16 rows and `salt`, each weighted `weight`.
void simulate_uniform_routing(const Tensor& x, Routing& routing, int64_t num_experts, uint32_t salt, float weight);
// Expert parallel: the slots routed to experts [first, first + count) renumbered from 0 (this rank's stack),
// every other slot -1, which moe_experts skips.
void keep_local_experts_(Routing& routing, int64_t first, int64_t count);
// sum_j weights[t, j] * down[e] · glu(gate_up[e] · x[t]) over the routed experts e = experts[t, j] (slots
// with e = -1 skipped).
// On a GPU the experts are bf16, FP8 with block scales, or FP4 (E2M1x2 codes [E, 2I, H / 2] and [E, H, I / 2]
// with their group and global scales attached: Tensor::with_group_scales, kernels/cuda/moe/moe.h).
// `adapters`: LoRA terms of some rows' sequences (kernels/expert_adapters.h; on the GPU, moe.h's ExpertLora).
Tensor moe_experts(const Tensor& x, const Routing& routing, const Tensor& gate_up, const Tensor& down, Glu kind,
                   float alpha, float limit, std::span<const ExpertAdapterRun> adapters = {});

// The token bitmasks of some rows of a step (structured outputs, allowed_token_ids): rows[k]'s mask is
// words[k * words_per_row, (k + 1) * words_per_row), bit t set when token t may be drawn
// (kernels/sampling_rule.h's token_allowed). Rows not listed are not masked.
struct TokenBitmask {
  std::span<const int32_t> rows;  // each at most once
  std::span<const uint32_t> words;
  int64_t words_per_row = 0;  // at least ceil(vocab / 32)
};

// Sampling (kernels/sampling_rule.h): applies `adjustments`, then `mask`, to a copy of `logits` (fp32
// [rows, vocab], left as it is: log-probabilities read the raw logits), then draws one token per row with
// draws[row]. Returns the tokens on the host; from a GPU only the ids cross (and the masks' words go up).
std::vector<int32_t> sample_tokens(const Tensor& logits, std::span<const TokenDraw> draws,
                                   std::span<const LogitAdjustment> adjustments, const TokenBitmask& mask = {});

// A point on a device's timeline, for profiling (runner/step_profile.h): on the CPU, whose ops return when
// their work is done, the clock; on a GPU an event recorded after the work queued so far.
class TimeMark {
 public:
  static TimeMark now(Device device);
  // Seconds from `from` to `to` (on a GPU it waits for `to`).
  friend double seconds_between(const TimeMark& from, const TimeMark& to);

 private:
  std::chrono::steady_clock::time_point cpu_{};
  std::shared_ptr<void> event_;  // CUDA: the event, destroyed with the last copy
};

}  // namespace sparrow::ops
