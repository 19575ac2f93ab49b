// Random PEFT LoRA adapters over a model folder's projections, the model with one merged into its weights,
// and the greedy prompts the LoRA tests run, for the CPU (lora_test.cpp) and the GPU (cuda/lora_gpu_test.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/request.h"
#include "formats/checkpoint.h"
#include "formats/safetensors.h"
#include "model/lora.h"
#include "test_util.h"

namespace sparrow::testing {

namespace fs = std::filesystem;

inline fs::path bundled(const std::string& name) { return fs::path(SPARROW_SOURCE_DIR) / "models" / name; }

// A projection LoRA may target and where its base weight lives: checkpoint tensor `key`, expert `expert`
// of a stack ([E, rows, cols], -1: a plain [rows, cols] weight), from row `first_row` on.
struct Target {
  std::string module, key;
  int64_t expert = -1, first_row = 0, rows = 0, cols = 0;
};

// The targets in checkpoint tensor `key` of `shape`: a projection's weight ("....self_attn.q_proj"), or the
// routed experts' stacks (gate_up_proj [E, 2I, H] holds each expert's gate_proj and up_proj, down_proj
// [E, H, I] its down_proj) when `routed_experts`.
inline std::vector<Target> targets_of(const std::string& key, const Shape& shape, bool routed_experts) {
  if (key.find("layers.") == std::string::npos || key.find("mtp") != std::string::npos) return {};
  const std::string suffix = ".weight";
  if (shape.size() == 2 && key.size() > suffix.size() && !key.compare(key.size() - suffix.size(), suffix.size(), suffix)) {
    const std::string module = key.substr(0, key.size() - suffix.size());
    if (!lora_supported_module(module) || (!routed_experts && module.find(".experts.") != std::string::npos)) return {};
    return {{module, key, -1, 0, shape[0], shape[1]}};
  }
  std::vector<Target> out;
  const bool gate_up = key.ends_with(".experts.gate_up_proj"), down = key.ends_with(".experts.down_proj");
  if (!routed_experts || shape.size() != 3 || !(gate_up || down)) return out;
  const std::string stack = key.substr(0, key.rfind('.') + 1);
  for (int64_t e = 0; e < shape[0]; ++e) {
    const std::string expert = stack + std::to_string(e) + ".";
    if (gate_up) {
      out.push_back({expert + "gate_proj", key, e, 0, shape[1] / 2, shape[2]});
      out.push_back({expert + "up_proj", key, e, shape[1] / 2, shape[1] / 2, shape[2]});
    } else {
      out.push_back({expert + "down_proj", key, e, 0, shape[1], shape[2]});
    }
  }
  return out;
}

struct Adapter {
  std::shared_ptr<TempDir> folder;  // removed with the last copy
  std::string dir() const { return folder->path(); }
  std::map<std::string, std::pair<Tensor, Tensor>> ab;  // module -> (A [r, in], B [out, r]) as written
  float scaling = 0;
};

// Which projections an adapter targets.
enum class Targets { All, NoRoutedExperts, RoutedExpertsOnly, IndexersOnly };

// A random rank-`r` adapter over the targetable projections of the model in `model_dir`, written as PEFT
// saves it.
// B's entries are b_scale / sqrt(r) times standard normal draws.
inline Adapter make_adapter(const fs::path& model_dir, int64_t r, uint32_t seed, Targets which = Targets::All,
                            float b_scale = 0.15f) {
  Adapter a;
  a.folder = std::make_shared<TempDir>();
  a.scaling = 2.0f;  // lora_alpha 2r
  auto file = SafetensorsFile::open((model_dir / "model.safetensors").string());
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [key, info] : file->tensors())
    for (const Target& t : targets_of(key, info.shape, which != Targets::NoRoutedExperts)) {
      if (which == Targets::RoutedExpertsOnly && t.module.find(".experts.") == std::string::npos) continue;
      if (which == Targets::IndexersOnly && t.module.find("index") == std::string::npos) continue;
      Tensor A = Tensor::zeros({r, t.cols}), B = Tensor::zeros({t.rows, r});
      for (int64_t i = 0; i < A.numel(); ++i) A.data()[i] = normal(rng) / std::sqrt(float(t.cols));
      for (int64_t i = 0; i < B.numel(); ++i) B.data()[i] = b_scale * normal(rng) / std::sqrt(float(r));
      out.emplace_back("base_model.model." + t.module + ".lora_A.weight", A);
      out.emplace_back("base_model.model." + t.module + ".lora_B.weight", B);
      a.ab[t.module] = {A, B};
    }
  write_safetensors(a.folder->file("adapter_model.safetensors"), out);
  a.folder->write("adapter_config.json",
                  "{\"peft_type\": \"LORA\", \"r\": " + std::to_string(r) + ", \"lora_alpha\": " + std::to_string(2 * r) +
                      ", \"bias\": \"none\", \"target_modules\": [\"q_proj\"], \"use_rslora\": false, \"use_dora\": false}");
  return a;
}

// `a` (an adapter over the routed experts, from make_adapter) rewritten in vLLM's shared-outer form
// (--enable-moe-shared-loras): per MoE, "<moe>.experts.w1" / "w3" / "w2" with lora_A [E or 1, r, in] and
// lora_B [E or 1, out, r]. Gate's and up's A and down's B become expert 0's for every expert (a.ab follows,
// so merged_model merges what the file says); the other factors stay by expert.
inline void make_shared_outer(Adapter& a) {
  struct Stack {
    std::map<std::string, std::map<int64_t, std::string>> by_leaf;  // "w1" / "w3" / "w2" -> expert -> module
  };
  std::map<std::string, Stack> stacks;  // by "<moe>.experts"
  for (const auto& [module, ab] : a.ab) {
    const size_t leaf_at = module.rfind('.'), number_at = module.rfind('.', leaf_at - 1);
    const std::string leaf = module.substr(leaf_at + 1), stack = module.substr(0, number_at);
    // The shared-outer file names its stacks by the release's leaves, whichever naming the modules had.
    const auto &t = Checkpoint::kTransformersExpertNames, &r = Checkpoint::kReleaseExpertNames;
    const std::string which = leaf == t.gate || leaf == r.gate ? r.gate : leaf == t.up || leaf == r.up ? r.up : r.down;
    stacks[stack].by_leaf[which][std::stoll(module.substr(number_at + 1, leaf_at - number_at - 1))] = module;
  }
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [stack, s] : stacks)
    for (const auto& [which, experts] : s.by_leaf) {
      const bool shared_a = which != "w2";
      const auto& [a0, b0] = a.ab.at(experts.begin()->second);
      const int64_t E = int64_t(experts.size()), r = a0.dim(0), in = a0.dim(1), rows = b0.dim(0);
      Tensor A = Tensor::zeros({shared_a ? 1 : E, r, in}), B = Tensor::zeros({shared_a ? E : 1, rows, r});
      for (const auto& [e, module] : experts) {
        auto& [ae, be] = a.ab.at(module);
        if (shared_a) ae = a0; else std::copy(ae.data(), ae.data() + ae.numel(), A.row(e));
        if (!shared_a) be = b0; else std::copy(be.data(), be.data() + be.numel(), B.row(e));
      }
      if (shared_a) std::copy(a0.data(), a0.data() + a0.numel(), A.data());
      else std::copy(b0.data(), b0.data() + b0.numel(), B.data());
      out.emplace_back("base_model.model." + stack + "." + which + ".lora_A.weight", A);
      out.emplace_back("base_model.model." + stack + "." + which + ".lora_B.weight", B);
    }
  write_safetensors(a.folder->file("adapter_model.safetensors"), out);
}

// The model with the adapter merged into its weights (W + scaling B A, in double, stored as fp32), in a folder
// removed with the returned object.
inline std::unique_ptr<TempDir> merged_model(const fs::path& model_dir, const Adapter& a) {
  auto dir = std::make_unique<TempDir>();
  for (const char* f : {"config.json", "generation_config.json"})
    if (fs::exists(model_dir / f)) fs::copy_file(model_dir / f, dir->file(f));
  auto file = SafetensorsFile::open((model_dir / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [key, info] : file->tensors()) {
    Tensor w = to_float32(info, file).clone();
    for (const Target& t : targets_of(key, info.shape, true)) {
      auto found = a.ab.find(t.module);
      if (found == a.ab.end()) continue;
      const auto& [A, B] = found->second;
      const int64_t r = A.dim(0);
      float* base = w.data() + (t.expert < 0 ? 0 : t.expert * w.dim(1) * t.cols) + t.first_row * t.cols;
      for (int64_t i = 0; i < t.rows; ++i)
        for (int64_t j = 0; j < t.cols; ++j) {
          double d = 0;
          for (int64_t k = 0; k < r; ++k) d += double(B.data()[i * r + k]) * A.data()[k * t.cols + j];
          base[i * t.cols + j] = float(double(base[i * t.cols + j]) + a.scaling * d);
        }
    }
    out.emplace_back(key, w);
  }
  write_safetensors(dir->file("model.safetensors"), out);
  return dir;
}

// Greedy requests "p0", "p1", ... of random ids (from 2 up) of the given lengths, 8 tokens each with `logprobs`
// top logprobs, and prompt logprobs when `prompt_logprobs` >= 0.
inline std::vector<Request> greedy_requests(int64_t vocab, const std::vector<int>& lengths, uint32_t seed,
                                            int64_t logprobs, int64_t prompt_logprobs = -1) {
  std::mt19937 rng(seed);
  std::vector<Request> requests;
  for (int length : lengths) {
    std::vector<int32_t> prompt(static_cast<size_t>(length));
    for (int32_t& id : prompt) id = int32_t(2 + rng() % uint32_t(vocab - 2));
    Request r{"p" + std::to_string(requests.size()), prompt, {}};
    r.params.max_tokens = 8;
    r.params.temperature = 0;
    r.params.ignore_eos = true;
    r.params.logprobs = logprobs;
    if (prompt_logprobs >= 0) r.params.prompt_logprobs = prompt_logprobs;
    requests.push_back(r);
  }
  return requests;
}

}  // namespace sparrow::testing
