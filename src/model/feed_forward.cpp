#include "model/feed_forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/bfloat16.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/ops.h"
#include "kernels/uniform_routing.h"

namespace sparrow {

void Activation::apply(const float* gate, const float* up, float* out, int64_t n) const {
  if (kind == SiluGlu)
    cpu::silu_glu(gate, up, out, n);
  else
    cpu::clamped_swiglu(gate, up, out, n, alpha, limit);
}

DenseMlp DenseMlp::load(Checkpoint& ckpt, const std::string& prefix, int64_t hidden, int64_t intermediate,
                        Activation act) {
  DenseMlp mlp;
  mlp.act = act;
  if (ckpt.has(prefix + "gate_up_proj.weight")) {
    mlp.gate_up = ckpt.take_linear(prefix + "gate_up_proj.weight", {2 * intermediate, hidden});
  } else {
    // FP8 gate and up stack with their scales only when the gate ends on a 128-row scale block.
    auto take = [&](const std::string& name) {
      return intermediate % 128 == 0 ? ckpt.take_linear(name, {intermediate, hidden}) : ckpt.take(name, {intermediate, hidden});
    };
    mlp.gate_up = ops::concat_rows(take(prefix + "gate_proj.weight"), take(prefix + "up_proj.weight"));
  }
  mlp.down = ckpt.take_linear(prefix + "down_proj.weight", {hidden, intermediate});
  return mlp;
}

ops::Glu Activation::glu_kind() const { return kind == SiluGlu ? ops::Glu::SiluGlu : ops::Glu::ClampedSwiglu; }

Tensor DenseMlp::forward(const Tensor& x) const {
  Tensor gate_up_out = ops::linear(x, gate_up);  // [T, 2I]
  return ops::linear(ops::glu(gate_up_out, act.glu_kind(), act.alpha, act.limit), down);
}

Tensor SigmoidRouter::load_bias(Checkpoint& ckpt, const std::string& name, int64_t num_experts) {
  return ckpt.has(name) ? ckpt.take(name, {num_experts}) : Tensor::zeros({num_experts}, ScalarType::F32, ckpt.device());
}

Routing SigmoidRouter::route(const Tensor& x) const {
  const int64_t t = x.dim(0), e = weight.dim(0);
  SPARROW_CHECK(e % n_group == 0, "router: ", e, " experts do not split into ", n_group, " groups");
  const int64_t per_group = e / n_group;
  Tensor logits = cpu::linear(x, weight);  // [T, E], fp32 as transformers' router
  Routing r;
  r.top_k = top_k;
  r.experts.resize(t * top_k);
  r.weights.resize(t * top_k);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> scores(e), choice(e), group_scores(n_group);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = 0; j < e; ++j) {
      scores[j] = cpu::sigmoid(logits.row(i)[j]);
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
      r.experts[i * top_k + j] = chosen[j];
      r.weights[i * top_k + j] = w * routed_scaling_factor;
    }
  }
  if (simulate_uniform) {
    // Keyed by the bf16 form of the token's first values, as the GPU's bf16 activations are.
    std::vector<uint16_t> bits(std::min<int64_t>(x.dim(1), uniform_routing::kKeyValues));
    for (int64_t i = 0; i < t; ++i) {
      for (size_t v = 0; v < bits.size(); ++v) bits[v] = float_to_bf16(x.row(i)[v]);
      uniform_routing::draw_experts(uniform_routing::token_key(bits.data(), int64_t(bits.size()), simulation_salt), e,
                                    top_k, r.experts.data() + i * top_k);
      std::fill_n(r.weights.data() + i * top_k, top_k, simulated_weight());
    }
  }
  return r;
}

Tensor run_experts(const Tensor& x, const Routing& routing, const Checkpoint::Experts& experts,
                   const Activation& act) {
  const int64_t t = x.dim(0), hidden = x.dim(1);
  const int64_t num_experts = experts.gate_up.dim(0), inter = experts.down.dim(2);
  // Group the (token, slot) pairs by expert so each expert runs one matrix product over its tokens.
  std::vector<std::vector<int64_t>> assigned(num_experts);
  for (int64_t i = 0; i < t * routing.top_k; ++i) assigned[routing.experts[i]].push_back(i);
  Tensor out = Tensor::zeros({t, hidden});
  for (int64_t ex = 0; ex < num_experts; ++ex) {
    const auto& slots = assigned[ex];
    if (slots.empty()) continue;
    const int64_t n = int64_t(slots.size());
    Tensor in = Tensor::empty({n, hidden});
    for (int64_t j = 0; j < n; ++j) std::memcpy(in.row(j), x.row(slots[j] / routing.top_k), sizeof(float) * hidden);
    Tensor gate_up = Tensor::empty({n, 2 * inter});
    cpu::gemm_nt(n, 2 * inter, hidden, in.data(), hidden, experts.gate_up.row(ex), hidden, gate_up.data(), 2 * inter);
    Tensor act_out = Tensor::empty({n, inter});
    for (int64_t j = 0; j < n; ++j) act.apply(gate_up.row(j), gate_up.row(j) + inter, act_out.row(j), inter);
    Tensor y = Tensor::empty({n, hidden});
    cpu::gemm_nt(n, hidden, inter, act_out.data(), inter, experts.down.row(ex), inter, y.data(), hidden);
    for (int64_t j = 0; j < n; ++j) {
      float w = routing.weights[slots[j]];
      float* o = out.row(slots[j] / routing.top_k);
      const float* yr = y.row(j);
      for (int64_t d = 0; d < hidden; ++d) o[d] += w * yr[d];
    }
  }
  return out;
}

std::unique_ptr<MoeBlock> MoeBlock::load_grouped(Checkpoint& ckpt, const std::string& prefix,
                                                 const GroupedMoeShape& shape) {
  auto moe = std::make_unique<MoeBlock>();
  moe->router.weight = ckpt.take(prefix + "gate.weight", {shape.num_experts, shape.hidden});
  moe->router.bias = SigmoidRouter::load_bias(ckpt, prefix + "gate.e_score_correction_bias", shape.num_experts);
  moe->router.top_k = shape.top_k;
  moe->router.n_group = shape.n_group;
  moe->router.topk_group = shape.topk_group;
  moe->router.normalize = shape.normalize;
  moe->router.routed_scaling_factor = shape.routed_scaling_factor;
  moe->experts = ckpt.take_experts(prefix + "experts", shape.num_experts, shape.intermediate, shape.hidden);
  moe->shared.push_back(DenseMlp::load(ckpt, prefix + "shared_experts.", shape.hidden,
                                       shape.intermediate * shape.n_shared, moe->act));
  return moe;
}

Tensor MoeBlock::forward(const Tensor& x) const {
  Tensor out;
  if (x.on_cpu()) {
    out = run_experts(x, router.route(x), experts, act);
  } else {
    // The same routing and experts as route() / run_experts() above, as two device kernels over the
    // whole step (no host round trip between them).
    const SigmoidRouter& r = router;
    ops::DeviceRouting routing =
        ops::route_grouped_sigmoid(ops::linear(x, r.weight, ScalarType::F32), r.bias, r.n_group, r.topk_group,
                                   r.top_k, r.normalize, r.normalize_eps, r.routed_scaling_factor);
    if (r.simulate_uniform)
      ops::simulate_uniform_routing(x, routing, r.weight.dim(0), r.simulation_salt, r.simulated_weight());
    out = ops::moe_experts(x, routing, experts.gate_up, experts.down, act.glu_kind(), act.alpha, act.limit);
  }
  for (const DenseMlp& s : shared) ops::add_(out, s.forward(x));
  return out;
}

}  // namespace sparrow
