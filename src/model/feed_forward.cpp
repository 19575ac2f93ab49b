#include "model/feed_forward.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/lora.h"
#include "model/tensor_parallel.h"

namespace sparrow {

DenseMlp DenseMlp::load(Checkpoint& ckpt, const std::string& prefix, int64_t hidden, int64_t intermediate,
                        Activation act) {
  DenseMlp mlp;
  mlp.act = act;
  mlp.prefix = prefix;
  mlp.tp = ckpt.tensor_parallel();
  if (mlp.tp.sharded()) {
    const IndexRange mine = even_share(mlp.tp, intermediate, (prefix + " intermediate size").c_str());
    if (ckpt.has(prefix + "gate_up_proj.weight")) {
      mlp.gate_up = ckpt.take_linear(prefix + "gate_up_proj.weight", {2 * intermediate, hidden}, mine.split(0, 1, 2));
    } else {
      mlp.gate_up = ops::concat_rows(ckpt.take_linear(prefix + "gate_proj.weight", {intermediate, hidden}, mine.split(0)),
                                     ckpt.take_linear(prefix + "up_proj.weight", {intermediate, hidden}, mine.split(0)));
    }
    mlp.down = ckpt.take_linear(prefix + "down_proj.weight", {hidden, intermediate}, mine.split(1));
    return mlp;
  }
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

Tensor DenseMlp::partial(const Tensor& x, const Batch& batch) const {
  Tensor gate_up_out = ops::linear(x, gate_up);  // [T, 2I]
  lora::add_(gate_up_out, x, batch, prefix, "gate_proj", 0);
  lora::add_(gate_up_out, x, batch, prefix, "up_proj", gate_up_out.dim(1) / 2);
  lora::add_(gate_up_out, x, batch, prefix, "gate_up_proj");  // checkpoints with the two fused
  const Tensor hidden = ops::glu(gate_up_out, act.kind, act.alpha, act.limit);
  Tensor out = ops::linear(hidden, down);
  lora::add_(out, hidden, batch, prefix, "down_proj");
  return out;
}

Tensor DenseMlp::forward(const Tensor& x, const Batch& batch) const {
  Tensor out = partial(x, batch);
  ops::all_reduce_(tp, out);
  return out;
}

Tensor SigmoidRouter::load_bias(Checkpoint& ckpt, const std::string& name, int64_t num_experts) {
  return ckpt.has(name) ? ckpt.take(name, {num_experts}) : Tensor::zeros({num_experts}, ScalarType::F32, ckpt.device());
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
  moe->act = shape.act;
  const int64_t expert_width = shape.latent > 0 ? shape.latent : shape.hidden;
  if (shape.latent > 0) {
    moe->latent_down = ckpt.take_linear(prefix + "routed_expert_down_proj.weight", {shape.latent, shape.hidden});
    if (shape.latent_norm) moe->latent_norm = ckpt.take(prefix + "routed_expert_norm.weight", {shape.latent});
    moe->latent_up = ckpt.take_linear(prefix + "routed_expert_up_proj.weight", {shape.hidden, shape.latent});
    moe->latent_norm_eps = shape.latent_norm_eps;
  }
  moe->load_experts(ckpt, prefix + "experts", shape.num_experts, shape.intermediate, expert_width);
  if (shape.n_shared > 0)
    moe->shared.push_back(DenseMlp::load(ckpt, prefix + "shared_experts.", shape.hidden,
                                         shape.intermediate * shape.n_shared, moe->act));
  return moe;
}

void MoeBlock::load_experts(Checkpoint& ckpt, const std::string& prefix, int64_t num_experts, int64_t intermediate,
                            int64_t width) {
  tp = ckpt.tensor_parallel();
  this->num_experts = num_experts;
  experts_prefix = prefix + ".";
  // The experts' ranks: the group's, or under data parallelism every group's (TensorParallel::experts_group).
  const TensorParallel experts_group = tp.experts_group();
  if (!experts_group.sharded()) {
    experts = ckpt.take_experts(prefix, num_experts, intermediate, width);
  } else if (tp.expert_parallel) {
    const IndexRange mine = expert_share(experts_group, num_experts);
    first_expert = mine.begin;
    experts = ckpt.take_expert_range(prefix, num_experts, intermediate, width, mine.split(0));
  } else {
    const IndexRange mine = even_share(experts_group, intermediate, "moe_intermediate_size");
    experts = ckpt.take_experts(prefix, num_experts, intermediate, width, mine.split(0));
  }
}

// Routing and experts through kernels/ops.h on either device: the CPU reference
// (kernels/cpu/moe_reference.h) for host tensors, two kernels over the whole step on a GPU (no host round
// trip between them).
ops::Routing SigmoidRouter::route(const Tensor& x) const {
  // fp32 logits, as transformers' router computes them.
  ops::Routing routing = ops::route_grouped_sigmoid(ops::linear(x, weight, ScalarType::F32), bias, n_group,
                                                    topk_group, top_k, normalize, normalize_eps,
                                                    routed_scaling_factor);
  if (simulate_uniform) ops::simulate_uniform_routing(x, routing, weight.dim(0), simulation_salt, simulated_weight());
  return routing;
}

Tensor MoeBlock::routed(const Tensor& x, const Batch* batch) const {
  ops::Routing routing = router.route(x);
  // Expert parallel: the slots routed to this rank's experts, renumbered from 0; the others become -1 (skipped).
  const int64_t local = experts.gate_up.dim(0);
  if (local < num_experts) ops::keep_local_experts_(routing, first_expert, local);
  const std::vector<ExpertAdapterRun> adapters =
      batch ? lora::expert_runs(*batch, experts_prefix, first_expert, local) : std::vector<ExpertAdapterRun>();
  return ops::moe_experts(latent_down.defined() ? ops::linear(x, latent_down) : x, routing, experts.gate_up,
                          experts.down, act.kind, act.alpha, act.limit, adapters);
}

Tensor MoeBlock::dispatch_routed(const Tensor& x) const {
  // Which groups' ranks of the experts' group (this tensor-parallel rank in each group) own an expert some
  // slot of each row is routed to: the experts are dealt over all dp_size x size ranks as expert_share deals
  // them, and a rank of another tensor-parallel rank is reached by that rank of this group.
  const int D = tp.dp_size;
  ops::RowExchange exchange;
  exchange.to.resize(D);
  if (x.dim(0) > 0) {
    ops::Routing routing = router.route(x);
    const Tensor experts_host = routing.experts.to(Device::Cpu);
    std::vector<int64_t> owner_group(num_experts, -1);  // -1: owned by another tensor-parallel rank
    for (int d = 0; d < D; ++d) {
      const IndexRange share = expert_share(TensorParallel{d * tp.size + tp.rank, D * tp.size, nullptr, true}, num_experts);
      for (int64_t e = share.begin; e < share.end; ++e) owner_group[e] = d;
    }
    const int64_t top_k = experts_host.dim(1);
    for (int64_t t = 0; t < x.dim(0); ++t) {
      std::vector<bool> sent(D, false);
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t e = experts_host.as<int32_t>()[t * top_k + j];
        const int64_t d = e >= 0 && e < num_experts ? owner_group[e] : -1;
        if (d >= 0 && !sent[d]) sent[d] = true, exchange.to[d].push_back(t);
      }
    }
  }
  const Tensor received = ops::send_rows(tp, x, exchange);
  Tensor terms = received.dim(0) > 0 ? routed(received) : Tensor::zeros({0, experts_out_width()}, ScalarType::F32, x.device());
  return ops::return_rows(tp, terms.to(Device::Cpu, ScalarType::F32), exchange, x.dim(0)).to(x.device(), terms.type());
}

Tensor MoeBlock::forward(const Tensor& x, const Batch& batch) const {
  Tensor out;
  if (tp.data_parallel() && tp.expert_parallel) {
    // Whole experts over every rank: each row goes only to the ranks that own one of its experts.
    out = dispatch_routed(x);
    if (x.dim(0) == 0) return out;
  } else if (tp.data_parallel()) {
    // Every group's tokens through this rank's experts, this group's rows summed back over the groups; a
    // group without tokens (x has no rows) takes part for the others' sake and is done.
    const std::vector<int64_t>& counts = batch.group_tokens;
    out = ops::reduce_scatter_rows(tp, routed(ops::all_gather_rows(tp, x, counts)), counts);
    if (x.dim(0) == 0) return out;
  } else {
    out = routed(x, &batch);
  }
  if (latent_down.defined()) {
    Tensor latent = std::move(out);
    ops::all_reduce_(tp, latent);  // the whole routed latent before its norm
    if (latent_norm.defined()) ops::rms_norm_(latent, latent_norm, latent_norm_eps);
    out = ops::linear(latent, latent_up);
    if (shared.empty()) return out;
    Tensor shared_out = shared[0].partial(x, batch);
    for (size_t i = 1; i < shared.size(); ++i) ops::add_(shared_out, shared[i].partial(x, batch));
    ops::all_reduce_(tp, shared_out);
    ops::add_(out, shared_out);
    return out;
  }
  for (const DenseMlp& s : shared) ops::add_(out, s.partial(x, batch));
  ops::all_reduce_(tp, out);
  return out;
}

}  // namespace sparrow
