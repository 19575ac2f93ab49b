#include "model/lora.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "formats/safetensors.h"
#include "kernels/ops.h"
#include "model/model.h"

namespace sparrow {

namespace fs = std::filesystem;

const LoraWeights* LoraAdapter::find(const std::string& module) const {
  auto it = modules.find(module);
  return it == modules.end() ? nullptr : &it->second;
}

namespace {

enum ExpertProjection { kNotAnExpert = -1, kGate, kUp, kDown };

// Which of an expert's three projections `leaf` names, under either naming (Checkpoint's
// kTransformersExpertNames, kReleaseExpertNames).
ExpertProjection expert_projection(const std::string& leaf) {
  for (const Checkpoint::ExpertNames& n : {Checkpoint::kTransformersExpertNames, Checkpoint::kReleaseExpertNames}) {
    if (leaf == n.gate) return kGate;
    if (leaf == n.up) return kUp;
    if (leaf == n.down) return kDown;
  }
  return kNotAnExpert;
}

// The expert number of a routed expert's projection ("<moe>.experts.<e>.<leaf>", leaf one of an expert's
// three), else -1.
int64_t routed_expert_of(const std::string& module) {
  const size_t leaf = module.rfind('.');
  if (leaf == std::string::npos || leaf == 0 || expert_projection(module.substr(leaf + 1)) == kNotAnExpert) return -1;
  const size_t number = module.rfind('.', leaf - 1);
  if (number == std::string::npos) return -1;
  const std::string digits = module.substr(number + 1, leaf - number - 1);
  if (digits.empty() || digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  if (!module.substr(0, number).ends_with(".experts")) return -1;
  return std::stoll(digits);
}

}  // namespace

void LoraAdapter::index_routed_experts() {
  expert_stacks.clear();
  for (const auto& [module, weights] : modules) {
    const int64_t expert = routed_expert_of(module);
    if (expert < 0) continue;
    const size_t leaf = module.rfind('.'), number = module.rfind('.', leaf - 1);
    const ExpertProjection projection = expert_projection(module.substr(leaf + 1));
    ExpertPairs& stack = expert_stacks[module.substr(0, number + 1)];
    auto& list = projection == kGate ? stack.gate : projection == kUp ? stack.up : stack.down;
    if (int64_t(list.size()) <= expert) list.resize(size_t(expert) + 1, nullptr);
    list[size_t(expert)] = &weights;
  }
}

bool lora_supported_module(const std::string& module) {
  static const std::set<std::string> kLeaves = {
      "q_proj",   "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj",    "k_proj",    "v_proj",    "f_a_proj",
      "f_b_proj", "b_proj",   "g_proj",   "g_a_proj",           "g_b_proj",  "gate_proj", "up_proj",   "gate_up_proj", "down_proj", "kv_b_proj"};
  // The indexers' projections: DSA's (indexer.wq_b / wk / weights_proj) and MSA's (indexer.q_proj / k_proj,
  // index_q_proj / index_k_proj in MiniMax's release names).
  static const std::set<std::string> kIndexerLeaves = {"wq_b", "wk", "weights_proj", "q_proj", "k_proj"};
  const size_t dot = module.rfind('.');
  const std::string leaf = dot == std::string::npos ? module : module.substr(dot + 1);
  if (module.find(".indexer.") != std::string::npos) return kIndexerLeaves.count(leaf) > 0;
  if (leaf == "index_q_proj" || leaf == "index_k_proj") return true;
  if (module.find(".gate.") != std::string::npos) return false;  // the routers: not adapted yet
  if (routed_expert_of(module) >= 0) return true;
  // A routed experts' stack ("mlp.experts.gate_up_proj") is adapted by expert, under the names above.
  return kLeaves.count(leaf) && module.find(".experts.") == std::string::npos;
}

namespace {

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK(in, "LoRA adapter: cannot open '", path.string(), "'");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    fail("LoRA adapter: '", path.string(), "' is not valid JSON (syntax error at byte ", e.byte, ")");
  }
}

// The base weight of `module` as stored ([out, in]; packed FP4 holds two values a byte), or {} where it is
// stored under other names (MXFP4's weight_packed: checked at first use).
Shape stored_weight_shape(Checkpoint& model, const std::string& module, const std::string& name) {
  SPARROW_CHECK(model.has(module + ".weight"), "LoRA adapter '", name, "': the model has no weight '", module,
                ".weight'");
  try {
    return model.stored_shape(module + ".weight");
  } catch (const Error&) {
    return {};
  }
}

// A routed expert's projection: its own weight, or its part of the stack that holds every expert
// (transformers' fused layout: gate_up_proj [E, 2I, H], gate rows first, and down_proj [E, H, I]).
Shape routed_expert_shape(Checkpoint& model, const std::string& module, int64_t expert, const std::string& name) {
  const size_t leaf_at = module.rfind('.'), number_at = module.rfind('.', leaf_at - 1);
  const std::string stack = module.substr(0, number_at), leaf = module.substr(leaf_at + 1);
  if (model.has(module + ".weight") || !model.has(stack + ".down_proj")) return stored_weight_shape(model, module, name);
  SPARROW_CHECK(leaf == "gate_proj" || leaf == "up_proj" || leaf == "down_proj", "LoRA adapter '", name,
                "': module '", module, "': the model stacks its experts under gate_up_proj / down_proj, so their "
                "parts are named gate_proj, up_proj and down_proj");
  const bool down = leaf == "down_proj";
  const Shape whole = model.stored_shape(stack + (down ? ".down_proj" : ".gate_up_proj"));
  SPARROW_CHECK(whole.size() == 3 && expert < whole[0], "LoRA adapter '", name, "': module '", module,
                "': the model's stack ", stack, " holds ", whole.empty() ? 0 : whole[0], " experts");
  return down ? Shape{whole[1], whole[2]} : Shape{whole[1] / 2, whole[2]};
}

// The naming the checkpoint gives the experts of stack "<moe>.experts": the releases' w1 / w3 / w2 where it
// has them, else transformers' gate_proj / up_proj / down_proj.
const Checkpoint::ExpertNames& expert_names_in(Checkpoint& model, const std::string& stack) {
  return model.has(stack + ".0.w1.weight") ? Checkpoint::kReleaseExpertNames : Checkpoint::kTransformersExpertNames;
}

// PEFT's form for experts stacked in one parameter (LoraConfig.target_parameters on transformers' fused
// MoE): "<moe>.experts.base_layer" adapts gate_up_proj [E, 2I, H] and "<moe>.experts" down_proj [E, H, I].
bool is_expert_stack(const std::string& module) {
  return module.ends_with(".experts.base_layer") || module.ends_with(".experts");
}

struct LowRank {
  Tensor a, b;  // [r, in], [out, r]
};

// Such a pair, lora_A [E * r, in] and lora_B [out, r * E], as per-expert modules under the names the
// checkpoint gives its experts: expert e's pair is A's rows [e * r, (e + 1) * r) and B's columns k * E + e
// (vLLM 0.33 lora/model_manager.py splits them so; PEFT's merge_and_unload agrees), and gate_up's B rows
// are the gate's, then the up's.
void split_expert_stack(const std::string& module, const LowRank& pair, int64_t r, Checkpoint& model,
                        std::map<std::string, LowRank>& out) {
  const bool gate_up = module.ends_with(".base_layer");
  const std::string stack = gate_up ? module.substr(0, module.size() - std::string(".base_layer").size()) : module;
  const Checkpoint::ExpertNames& names = expert_names_in(model, stack);
  const int64_t experts = pair.a.dim(0) / r, in = pair.a.dim(1), rows = pair.b.dim(0);
  for (int64_t e = 0; e < experts; ++e) {
    Tensor a = Tensor::empty({r, in}), b = Tensor::empty({rows, r});
    std::memcpy(a.data(), pair.a.row(e * r), sizeof(float) * size_t(r * in));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t k = 0; k < r; ++k) b.data()[i * r + k] = pair.b.row(i)[k * experts + e];
    const std::string expert = cat(stack, ".", e, ".");
    if (!gate_up) {
      out[expert + names.down] = {a, b};
      continue;
    }
    const int64_t half = rows / 2;
    out[expert + names.gate] = {a, slice_host(b, Split{0, 0, half})};
    out[expert + names.up] = {a, slice_host(b, Split{0, half, rows})};
  }
}

// vLLM's form for shared-outer expert adapters (--enable-moe-shared-loras; vllm/lora/layers/fused_moe.py):
// "<moe>.experts.w1" / "w3" / "w2" (gate, up, down), each with lora_A [E_A, r, in] and lora_B [E_B, out, r],
// where a factor of expert dimension 1 is shared by every expert (vLLM shares gate's and up's A and down's
// B so) and one of E_A, E_B is the expert count E.
bool is_shared_outer_stack(const std::string& module) {
  return module.ends_with(".experts.w1") || module.ends_with(".experts.w2") || module.ends_with(".experts.w3");
}

// Such a pair as per-expert modules under the checkpoint's expert names: expert e's pair is A[e] (A[0] when
// shared) and B[e] (B[0]). A shared factor is one tensor that every expert's module holds, so it is stored
// once (load_lora_adapter places each distinct factor once).
void split_shared_outer_stack(const std::string& module, const Tensor& a, const Tensor& b, int64_t r,
                              Checkpoint& model, const std::string& name, std::map<std::string, LowRank>& out) {
  const int64_t experts = std::max(a.dim(0), b.dim(0));
  SPARROW_CHECK(a.dim(1) == r && b.dim(2) == r && (a.dim(0) == 1 || a.dim(0) == experts) &&
                    (b.dim(0) == 1 || b.dim(0) == experts) && experts > 1,
                "LoRA adapter '", name, "': module '", module, "' has lora_A ", shape_str(a.shape()), " and lora_B ",
                shape_str(b.shape()), " (expected [experts or 1, ", r, ", in] and [experts or 1, out, ", r,
                "], at least one of them by expert)");
  const std::string stack = module.substr(0, module.size() - 3), which = module.substr(module.size() - 2);
  const Checkpoint::ExpertNames& names = expert_names_in(model, stack);
  const std::string leaf = which == "w1" ? names.gate : which == "w3" ? names.up : names.down;
  const Tensor shared_a = a.dim(0) == 1 ? a.reshape({a.dim(1), a.dim(2)}) : Tensor();
  const Tensor shared_b = b.dim(0) == 1 ? b.reshape({b.dim(1), b.dim(2)}) : Tensor();
  for (int64_t e = 0; e < experts; ++e)
    out[cat(stack, ".", e, ".", leaf)] = {
        a.dim(0) == 1 ? shared_a : a.rows(e, e + 1).reshape({a.dim(1), a.dim(2)}),
        b.dim(0) == 1 ? shared_b : b.rows(e, e + 1).reshape({b.dim(1), b.dim(2)})};
}

}  // namespace

std::shared_ptr<const LoraAdapter> load_lora_adapter(const std::string& name, const std::string& path,
                                                     const std::string& model_dir, const LoraTarget& target,
                                                     int64_t max_rank) {
  const fs::path root(path);
  SPARROW_CHECK(fs::is_directory(root), "LoRA adapter '", name, "': '", path, "' is not a folder");
  const nlohmann::json config = read_json(root / "adapter_config.json");
  SPARROW_CHECK(config.is_object(), "LoRA adapter '", name, "': adapter_config.json is not a JSON object");
  auto value = [&](const char* key) { return config.contains(key) ? config[key] : nlohmann::json(); };
  const nlohmann::json peft_type = value("peft_type");
  SPARROW_CHECK(peft_type.is_null() || peft_type == "LORA", "LoRA adapter '", name, "': peft_type ", peft_type.dump(),
                " is not LORA");
  SPARROW_CHECK(value("r").is_number_integer() && value("r").get<int64_t>() > 0, "LoRA adapter '", name,
                "': adapter_config.json needs a positive integer \"r\"");
  auto adapter = std::make_shared<LoraAdapter>();
  adapter->name = name;
  adapter->path = path;
  adapter->rank = value("r").get<int64_t>();
  adapter->base_model = model_dir;
  adapter->max_rank = max_rank;
  static std::atomic<uint64_t> loads{0};
  const uint64_t load = ++loads;
  adapter->prefix_root = XXH3_64bits_withSeed(name.data(), name.size(), load) | 1;  // never kRootBlockHash (0)
  SPARROW_CHECK(adapter->rank <= max_rank, "LoRA adapter '", name, "': rank ", adapter->rank,
                " is above --max-lora-rank ", max_rank);
  const double alpha = value("lora_alpha").is_number() ? value("lora_alpha").get<double>() : double(adapter->rank);
  const bool rslora = value("use_rslora").is_boolean() && value("use_rslora").get<bool>();
  // PEFT's LoraLayer.update_layer: scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.
  adapter->scaling = float(rslora ? alpha / std::sqrt(double(adapter->rank)) : alpha / double(adapter->rank));
  SPARROW_CHECK(!(value("use_dora").is_boolean() && value("use_dora").get<bool>()), "LoRA adapter '", name,
                "': DoRA (use_dora) is not supported");
  SPARROW_CHECK(value("bias").is_null() || value("bias") == "none", "LoRA adapter '", name, "': bias ",
                value("bias").dump(), " is not supported (only \"none\")");
  SPARROW_CHECK(value("modules_to_save").is_null() || value("modules_to_save").empty(), "LoRA adapter '", name,
                "': modules_to_save is not supported");
  SPARROW_CHECK(!(value("fan_in_fan_out").is_boolean() && value("fan_in_fan_out").get<bool>()), "LoRA adapter '",
                name, "': fan_in_fan_out is not supported");
  SPARROW_CHECK(value("rank_pattern").is_null() || value("rank_pattern").empty(), "LoRA adapter '", name,
                "': rank_pattern is not supported");
  SPARROW_CHECK(value("alpha_pattern").is_null() || value("alpha_pattern").empty(), "LoRA adapter '", name,
                "': alpha_pattern is not supported");

  const fs::path weights = root / "adapter_model.safetensors";
  SPARROW_CHECK(fs::exists(weights), "LoRA adapter '", name, "': ", path,
                " has no adapter_model.safetensors (adapter_model.bin, a pickle, is not read)");
  auto file = SafetensorsFile::open(weights.string());
  // PEFT names: base_model.model.<module>.lora_A.weight / .lora_B.weight (some savers add the adapter's
  // name, ".lora_A.default.weight").
  struct Pair {
    const TensorInfo* a = nullptr;
    const TensorInfo* b = nullptr;
  };
  std::map<std::string, Pair> pairs;
  for (const auto& [key, info] : file->tensors()) {
    std::string module = key;
    const std::string prefix = "base_model.model.";
    if (module.rfind(prefix, 0) == 0) module = module.substr(prefix.size());
    bool is_a = false;
    size_t at = std::string::npos;
    for (const char* suffix : {".lora_A.weight", ".lora_A.default.weight"})
      if ((at = module.rfind(suffix)) != std::string::npos && at + std::string(suffix).size() == module.size()) {
        is_a = true;
        break;
      }
    if (!is_a)
      for (const char* suffix : {".lora_B.weight", ".lora_B.default.weight"})
        if ((at = module.rfind(suffix)) != std::string::npos && at + std::string(suffix).size() == module.size()) break;
    SPARROW_CHECK(at != std::string::npos && at > 0, "LoRA adapter '", name, "': unexpected tensor '", key,
                  "' (expected <module>.lora_A.weight and <module>.lora_B.weight)");
    module = module.substr(0, at);
    SPARROW_CHECK(lora_supported_module(module) || is_expert_stack(module) || is_shared_outer_stack(module),
                  "LoRA adapter '", name, "': module '", module,
                  "' is not one sparrow adapts yet (attention and indexer projections, MLPs, shared and routed "
                  "experts; not the routers)");
    (is_a ? pairs[module].a : pairs[module].b) = &info;
  }
  SPARROW_CHECK(!pairs.empty(), "LoRA adapter '", name, "': adapter_model.safetensors holds no LoRA weights");
  const std::unique_ptr<Checkpoint> model = Checkpoint::open(model_dir);
  const ScalarType type = ops::act_type(target.device);
  // Each pair as read (fp32 on the host), the stacked experts' split by expert.
  std::map<std::string, LowRank> read;
  for (const auto& [module, pair] : pairs) {
    SPARROW_CHECK(pair.a && pair.b, "LoRA adapter '", name, "': module '", module, "' has lora_", pair.a ? "A" : "B",
                  " without lora_", pair.a ? "B" : "A");
    const int64_t r = adapter->rank;
    if (is_shared_outer_stack(module)) {
      SPARROW_CHECK(pair.a->shape.size() == 3 && pair.b->shape.size() == 3, "LoRA adapter '", name, "': module '",
                    module, "' has lora_A ", shape_str(pair.a->shape), " and lora_B ", shape_str(pair.b->shape),
                    " (expected [experts or 1, ", r, ", in] and [experts or 1, out, ", r, "])");
      split_shared_outer_stack(module, to_float32(*pair.a, file), to_float32(*pair.b, file).clone(), r, *model, name,
                               read);
      continue;
    }
    const bool stack = is_expert_stack(module);
    SPARROW_CHECK(pair.a->shape.size() == 2 && pair.b->shape.size() == 2 &&
                      (stack ? pair.a->shape[0] % r == 0 && pair.a->shape[0] == pair.b->shape[1]
                             : pair.a->shape[0] == r && pair.b->shape[1] == r),
                  "LoRA adapter '", name, "': module '", module, "' has lora_A ", shape_str(pair.a->shape),
                  " and lora_B ", shape_str(pair.b->shape),
                  stack ? cat(" (expected [experts x ", r, ", in] and [out, ", r, " x experts])")
                        : cat(" (expected [", r, ", in] and [out, ", r, "])"));
    LowRank pair_read{to_float32(*pair.a, file), to_float32(*pair.b, file).clone()};
    if (stack)
      split_expert_stack(module, pair_read, r, *model, read);
    else
      read[module] = std::move(pair_read);
  }
  // Each distinct factor goes to the device once (B scaled once): the factors a shared-outer stack shares
  // by expert, and A of gate and up, which PEFT's stacks share, are held by several modules.
  std::map<std::pair<const float*, int64_t>, Tensor> placed;
  auto place = [&](Tensor& host, bool is_b) {
    auto [at, fresh] = placed.try_emplace({host.data(), host.numel()});
    if (fresh) {
      if (is_b) ops::scale_(host, adapter->scaling);
      at->second = host.to(target.device, type);
    }
    return at->second;
  };
  for (auto& [module, pair] : read) {
    Tensor& a = pair.a;
    Tensor& b = pair.b;
    const int64_t expert = routed_expert_of(module);
    if (expert >= 0)
      SPARROW_CHECK(target.routed_experts_refused.empty(), "LoRA adapter '", name, "': module '", module, "': ",
                    target.routed_experts_refused);
    // Against the base weight as the checkpoint stores it ([out, in]; packed FP4 holds two values a byte).
    const Shape base = expert >= 0 ? routed_expert_shape(*model, module, expert, name) : stored_weight_shape(*model, module, name);
    if (base.size() == 2)
      SPARROW_CHECK(base[0] == b.dim(0) && (base[1] == a.dim(1) || 2 * base[1] == a.dim(1)), "LoRA adapter '", name,
                    "': module '", module, "' is [", b.dim(0), " x ", a.dim(1), "], the model's weight ",
                    shape_str(base));
    if (auto split = target.splits.find(module + ".weight"); split != target.splits.end()) {
      SPARROW_CHECK(split->second.dim == 0 || split->second.dim == 1, "LoRA adapter '", name, "': module '", module,
                    "' is split along dimension ", split->second.dim);
      if (split->second.dim == 0)
        b = slice_host(b, split->second);
      else
        a = slice_host(a, split->second);
    }
    adapter->modules[module] = {place(a, false), place(b, true)};
  }
  adapter->index_routed_experts();
  return adapter;
}

namespace lora {

namespace {

// Calls f(begin, end, adapter) for each run of consecutive sequences (rows begin .. end, not empty) with
// the same adapter.
template <typename F>
void for_each_adapter_run(const Batch& batch, F f) {
  const std::vector<SeqSlice>& seqs = batch.seqs;
  for (size_t i = 0; i < seqs.size();) {
    const LoraAdapter* adapter = seqs[i].state->lora.get();
    size_t j = i + 1;
    while (j < seqs.size() && seqs[j].state->lora.get() == adapter) ++j;
    const int64_t begin = seqs[i].offset, end = seqs[j - 1].offset + seqs[j - 1].count;
    if (adapter && begin < end) f(begin, end, *adapter);
    i = j;
  }
}

// Calls f(begin, end, adapter, weights) for each run of consecutive sequences (rows begin .. end) whose
// adapter has `module`: each run gets its own products (the segmented form of punica / S-LoRA). Callers
// return before naming the module when !batch.has_lora(), every site of every layer asks on every step.
template <typename F>
void for_each_run(const Batch& batch, const std::string& module, F f) {
  for_each_adapter_run(batch, [&](int64_t begin, int64_t end, const LoraAdapter& adapter) {
    if (const LoraWeights* w = adapter.find(module)) f(begin, end, adapter, *w);
  });
}

void check_kv_b(const LoraWeights& w, const std::string& module, const MlaDims& d) {
  SPARROW_CHECK(w.a.dim(1) == d.latent && w.b.dim(0) == d.heads * (d.nope + d.v), "LoRA: module '", module, "' is [",
                w.b.dim(0), " x ", w.a.dim(1), "], the model's kv_b_proj [", d.heads * (d.nope + d.v), " x ", d.latent,
                "]");
}

}  // namespace

void add_(Tensor& y, const Tensor& x, const Batch& batch, const std::string& prefix, const char* name,
          int64_t first_col) {
  if (!batch.has_lora()) return;
  const std::string module = prefix + name;
  SPARROW_CHECK(x.dim(0) == batch.size() && y.dim(0) == batch.size(), "LoRA: ", module, " sees ", x.dim(0),
                " rows for a batch of ", batch.size());
  for_each_run(batch, module, [&](int64_t begin, int64_t end, const LoraAdapter& adapter, const LoraWeights& w) {
    const int64_t out = w.b.dim(0), width = y.dim(1);
    SPARROW_CHECK(w.a.dim(1) == x.dim(1) && first_col + out <= width, "LoRA adapter '", adapter.name, "': module '",
                  module, "' is [", out, " x ", w.a.dim(1), "], the model's projection [", width - first_col, " x ",
                  x.dim(1), "]");
    Tensor delta = ops::linear(ops::linear(x.rows(begin, end), w.a), w.b);  // [n, out]
    Tensor rows = y.rows(begin, end);
    if (delta.type() != rows.type()) delta = delta.to(rows.device(), rows.type());
    if (first_col == 0 && out == width) {
      ops::add_(rows, delta);
    } else {  // a part of a fused product's columns
      Tensor wide = Tensor::zeros({end - begin, width}, rows.type(), rows.device());
      ops::copy_lines(wide, first_col, width, delta, 0, out, out, end - begin);
      ops::add_(rows, wide);
    }
  });
}

void add_absorbed_queries_(Tensor& q_abs, const Tensor& q, const Batch& batch, const std::string& prefix,
                           const MlaDims& d) {
  if (!batch.has_lora() || d.nope == 0) return;  // nope 0: no W_UK rows, nothing reaches the queries
  const std::string module = prefix + "kv_b_proj";
  for_each_run(batch, module, [&](int64_t begin, int64_t end, const LoraAdapter&, const LoraWeights& w) {
    check_kv_b(w, module, d);
    const int64_t n = end - begin, r = w.a.dim(0);
    // t[., h] = q_nope[., h] · B_UK[h]: [n, heads, r]; then the latent part of q_abs[., h] += t[., h] · A.
    Tensor t = Tensor::empty({n, d.heads, r}, q.type(), q.device());
    ops::batched_matmul_nn(d.heads, n, r, d.nope, {&q, begin * d.heads * d.qk, d.heads * d.qk, d.qk},
                           {&w.b, 0, r, (d.nope + d.v) * r}, t, 0, d.heads * r, r);
    Tensor delta = Tensor::zeros({n, d.heads, d.row}, q_abs.type(), q_abs.device());
    ops::batched_matmul_nn(d.heads, n, d.latent, r, {&t, 0, d.heads * r, r}, {&w.a, 0, d.latent, 0}, delta, 0,
                           d.heads * d.row, d.row);
    Tensor rows = q_abs.rows(begin, end);
    ops::add_(rows, delta);
  });
}

void add_absorbed_outputs_(Tensor& attended, const Tensor& mixed, const Batch& batch, const std::string& prefix,
                           const MlaDims& d) {
  if (!batch.has_lora()) return;
  const std::string module = prefix + "kv_b_proj";
  for_each_run(batch, module, [&](int64_t begin, int64_t end, const LoraAdapter&, const LoraWeights& w) {
    check_kv_b(w, module, d);
    const int64_t n = end - begin, r = w.a.dim(0);
    // u[., h] = mixed[., h] · Aᵀ: [n, heads, r]; then attended[., h] += u[., h] · B_UV[h]ᵀ.
    Tensor u = Tensor::empty({n, d.heads, r}, mixed.type(), mixed.device());
    ops::batched_matmul_nt(d.heads, n, r, d.latent, {&mixed, begin * d.heads * d.latent, d.heads * d.latent, d.latent},
                           {&w.a, 0, d.latent, 0}, u, 0, d.heads * r, r);
    Tensor delta = Tensor::empty({n, d.heads * d.v}, attended.type(), attended.device());
    ops::batched_matmul_nt(d.heads, n, d.v, r, {&u, 0, d.heads * r, r}, {&w.b, d.nope * r, r, (d.nope + d.v) * r},
                           delta, 0, d.heads * d.v, d.v);
    Tensor rows = attended.rows(begin, end);
    ops::add_(rows, delta);
  });
}

std::vector<ExpertAdapterRun> expert_runs(const Batch& batch, const std::string& experts_prefix, int64_t first,
                                          int64_t count) {
  std::vector<ExpertAdapterRun> runs;
  if (!batch.has_lora()) return runs;
  for_each_adapter_run(batch, [&](int64_t begin, int64_t end, const LoraAdapter& adapter) {
    auto stack = adapter.expert_stacks.find(experts_prefix);
    if (stack == adapter.expert_stacks.end()) return;
    ExpertAdapterRun run{begin, end, std::vector<ExpertLowRank>(size_t(count)), std::vector<ExpertLowRank>(size_t(count)),
                         std::vector<ExpertLowRank>(size_t(count))};
    auto pairs = [&](const std::vector<const LoraWeights*>& by_expert, std::vector<ExpertLowRank>& out) {
      for (int64_t e = 0; e < count; ++e) {
        const size_t at = size_t(first + e);
        if (at < by_expert.size() && by_expert[at]) out[size_t(e)] = {&by_expert[at]->a, &by_expert[at]->b};
      }
    };
    pairs(stack->second.gate, run.gate);
    pairs(stack->second.up, run.up);
    pairs(stack->second.down, run.down);
    runs.push_back(std::move(run));
  });
  return runs;
}

}  // namespace lora
}  // namespace sparrow
