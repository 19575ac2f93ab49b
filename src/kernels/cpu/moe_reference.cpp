#include "kernels/cpu/moe_reference.h"

#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/cpu/stored_weights.h"

namespace sparrow::cpu {

void route_grouped_sigmoid(const Tensor& logits, const Tensor& bias, int64_t n_group, int64_t topk_group,
                           int64_t top_k, bool normalize, float normalize_eps, float scaling, int32_t* experts,
                           float* weights) {
  const int64_t t = logits.dim(0), e = logits.dim(1);
  SPARROW_CHECK(n_group > 0 && e % n_group == 0, "router: ", e, " experts do not split into ", n_group, " groups");
  SPARROW_CHECK(top_k > 0 && top_k <= e, "router: top_k ", top_k, " of ", e, " experts");
  const int64_t per_group = e / n_group;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> scores(e), choice(e), group_scores(n_group);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = 0; j < e; ++j) {
      scores[j] = sigmoid(logits.row(i)[j]);
      choice[j] = scores[j] + bias.data()[j];
    }
    if (n_group > 1) {
      // A group's score is the sum of its two best biased scores; keep the topk_group best groups.
      for (int64_t g = 0; g < n_group; ++g) {
        auto best = cpu::top_k(choice.data() + g * per_group, per_group, 2);
        group_scores[g] = 0;
        for (int32_t b : best) group_scores[g] += choice[g * per_group + b];
      }
      auto kept = cpu::top_k(group_scores.data(), n_group, topk_group);
      std::vector<bool> keep(n_group, false);
      for (int32_t g : kept) keep[g] = true;
      for (int64_t j = 0; j < e; ++j)
        if (!keep[j / per_group]) choice[j] = neg_inf;
    }
    auto chosen = cpu::top_k(choice.data(), e, top_k);
    float sum = 0;
    for (int64_t j = 0; j < top_k; ++j) sum += scores[chosen[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      float w = scores[chosen[j]];
      if (normalize) w /= sum + normalize_eps;
      experts[i * top_k + j] = chosen[j];
      weights[i * top_k + j] = w * scaling;
    }
  }
}

namespace {

// out[j] += B (A in[j]) over the slot rows j of `slots` whose token lies in [run.begin, run.end).
void add_low_rank(const ExpertLowRank& pair, const ExpertAdapterRun& run, const std::vector<int64_t>& slots,
                  int64_t top_k, const Tensor& in, int64_t in_width, float* out, int64_t out_stride,
                  int64_t out_width) {
  if (!pair.a) return;
  const Tensor &a = *pair.a, &b = *pair.b;
  const int64_t r = a.dim(0);
  SPARROW_CHECK(a.dim(1) == in_width && b.dim(0) == out_width && b.dim(1) == r, "moe LoRA: [", b.dim(0), " x ",
                a.dim(1), "] for an expert projection of [", out_width, " x ", in_width, "]");
  std::vector<float> u(size_t(r), 0.f);
  for (size_t j = 0; j < slots.size(); ++j) {
    const int64_t token = slots[j] / top_k;
    if (token < run.begin || token >= run.end) continue;
    const float* v = in.row(int64_t(j));
    for (int64_t k = 0; k < r; ++k) {
      const float* ak = a.row(k);
      float sum = 0;
      for (int64_t i = 0; i < in_width; ++i) sum += ak[i] * v[i];
      u[size_t(k)] = sum;
    }
    float* o = out + int64_t(j) * out_stride;
    for (int64_t d = 0; d < out_width; ++d) {
      const float* bd = b.row(d);
      float sum = 0;
      for (int64_t k = 0; k < r; ++k) sum += bd[k] * u[size_t(k)];
      o[d] += sum;
    }
  }
}

}  // namespace

Tensor moe_experts(const Tensor& x, const int32_t* experts, const float* weights, int64_t top_k,
                   const Tensor& gate_up, const Tensor& down, Glu kind, float alpha, float limit,
                   std::span<const ExpertAdapterRun> adapters) {
  const int64_t t = x.dim(0), hidden = x.dim(1);
  const int64_t num_experts = gate_up.dim(0), inter = stored_cols(down);
  std::vector<float> gate_up_f32, down_f32;  // one expert's weights in fp32 when stored otherwise
  // Group the (token, slot) pairs by expert so each expert runs one matrix product over its tokens.
  std::vector<std::vector<int64_t>> assigned(num_experts);
  for (int64_t i = 0; i < t * top_k; ++i) {
    if (experts[i] == -1) continue;  // another rank's expert (ops::keep_local_experts_)
    SPARROW_CHECK(experts[i] >= 0 && experts[i] < num_experts, "moe: expert ", experts[i], " of ", num_experts);
    assigned[experts[i]].push_back(i);
  }
  for (const ExpertAdapterRun& run : adapters)
    SPARROW_CHECK(int64_t(run.gate.size()) == num_experts && int64_t(run.up.size()) == num_experts &&
                      int64_t(run.down.size()) == num_experts,
                  "moe LoRA: adapter terms for ", run.gate.size(), " experts of ", num_experts);
  Tensor out = Tensor::zeros({t, hidden});
  for (int64_t ex = 0; ex < num_experts; ++ex) {
    const auto& slots = assigned[ex];
    if (slots.empty()) continue;
    const int64_t n = int64_t(slots.size());
    Tensor in = Tensor::empty({n, hidden});
    for (int64_t j = 0; j < n; ++j) std::memcpy(in.row(j), x.row(slots[j] / top_k), sizeof(float) * hidden);
    Tensor projected = Tensor::empty({n, 2 * inter});
    gemm_nt(n, 2 * inter, hidden, in.data(), hidden, widened_matrix(gate_up, ex, gate_up_f32), hidden,
            projected.data(), 2 * inter);
    for (const ExpertAdapterRun& run : adapters) {
      add_low_rank(run.gate[size_t(ex)], run, slots, top_k, in, hidden, projected.data(), 2 * inter, inter);
      add_low_rank(run.up[size_t(ex)], run, slots, top_k, in, hidden, projected.data() + inter, 2 * inter, inter);
    }
    Tensor act_out = Tensor::empty({n, inter});
    for (int64_t j = 0; j < n; ++j) {
      const float* gate = projected.row(j);
      cpu::glu(kind, gate, gate + inter, act_out.row(j), inter, alpha, limit);
    }
    Tensor y = Tensor::empty({n, hidden});
    gemm_nt(n, hidden, inter, act_out.data(), inter, widened_matrix(down, ex, down_f32), inter, y.data(), hidden);
    for (const ExpertAdapterRun& run : adapters)
      add_low_rank(run.down[size_t(ex)], run, slots, top_k, act_out, inter, y.data(), hidden, hidden);
    for (int64_t j = 0; j < n; ++j) {
      float w = weights[slots[j]];
      float* o = out.row(slots[j] / top_k);
      const float* yr = y.row(j);
      for (int64_t d = 0; d < hidden; ++d) o[d] += w * yr[d];
    }
  }
  return out;
}

}  // namespace sparrow::cpu
