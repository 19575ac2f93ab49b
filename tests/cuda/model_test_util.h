// What the whole-model GPU tests share (and the CPU's tensor-parallel test: nothing here needs a device):
// reading a fixture's token lists, comparing logits row by row, and the greedy choice with its margin.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "formats/safetensors.h"
#include "kernels/cpu/fp8_codec.h"

namespace sparrow::model_test {

using Tokens = std::vector<int32_t>;

// The lists under `key` of a fixture's JSON file ("prompts" in prompts.json, "completions" in greedy.json).
inline std::vector<Tokens> token_lists(const std::filesystem::path& path, const char* key) {
  std::ifstream in(path);
  const nlohmann::json json = nlohmann::json::parse(in);
  std::vector<Tokens> lists;
  for (const auto& l : json.at(key)) lists.push_back(l.get<Tokens>());
  return lists;
}

inline double relative_l2(const float* a, const float* ref, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// The same for two host fp32 tensors of as many elements.
inline double relative_l2(const Tensor& ours, const Tensor& ref) {
  EXPECT_EQ(ours.numel(), ref.numel());
  return relative_l2(ours.data(), ref.data(), std::min(ours.numel(), ref.numel()));
}

// The largest relative L2 error of a row of `ours` against the same row of `ref` (infinite on NaN).
inline double worst_row_error(const Tensor& ours, const Tensor& ref) {
  EXPECT_EQ(ours.shape(), ref.shape());
  double worst = 0;
  for (int64_t t = 0; t < ref.dim(0); ++t) {
    const double e = relative_l2(ours.row(t), ref.row(t), ref.dim(1));
    worst = std::isnan(e) ? INFINITY : std::max(worst, e);
  }
  return worst;
}

inline int32_t argmax(const float* row, int64_t n) { return int32_t(std::max_element(row, row + n) - row); }

// Largest minus second largest: below bf16 noise the greedy choice may flip.
inline float top2_margin(const float* row, int64_t n) {
  float first = -INFINITY, second = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] > first) {
      second = first;
      first = row[i];
    } else if (row[i] > second) {
      second = row[i];
    }
  }
  return first - second;
}

// Writes the fixture at `from` into `to` as an FP8 checkpoint (DeepSeek-V3's format: e4m3 weights, one fp32
// scale per 128x128 block in <name>_scale_inv, quantization_config.weight_block_size): every 2-D weight but
// the embedding, the head and the router, quantised from its float32 values; the rest as float32. On the
// GPU such projections stay FP8 and multiply on the FP8 tensor cores. Returns how many were quantised.
inline int write_fp8_checkpoint(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::filesystem::create_directories(to);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(from / "config.json"));
  config["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}};
  std::ofstream(to / "config.json") << config.dump();

  // safetensors by hand: F32 tensors as they are, the quantised ones as F8_E4M3 + F32 scales.
  struct Entry {
    std::string name, dtype;
    Shape shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> entries;
  auto file = SafetensorsFile::open((from / "model.safetensors").string());
  int quantized = 0;
  for (const auto& [name, info] : file->tensors()) {
    const Tensor t = to_float32(info, file);
    const bool linear = t.ndim() == 2 && name.find("embed_tokens") == std::string::npos &&
                        name.find("lm_head") == std::string::npos && name.find("mlp.gate.") == std::string::npos;
    if (!linear) {
      entries.push_back({name, "F32", t.shape(), std::vector<uint8_t>(t.as<uint8_t>(), t.as<uint8_t>() + t.nbytes())});
      continue;
    }
    const int64_t rows = t.dim(0), cols = t.dim(1), br = (rows + 127) / 128, bc = (cols + 127) / 128;
    std::vector<float> scales(br * bc, 0.0f);
    std::vector<uint8_t> codes(rows * cols);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        scales[(i / 128) * bc + j / 128] = std::max(scales[(i / 128) * bc + j / 128], std::fabs(t.row(i)[j]));
    for (float& s : scales) s = s / cpu::kE4m3Max;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float s = scales[(i / 128) * bc + j / 128];
        codes[i * cols + j] = cpu::float_to_e4m3(s > 0 ? t.row(i)[j] / s : 0.0f);
      }
    entries.push_back({name, "F8_E4M3", t.shape(), codes});
    const auto* sb = reinterpret_cast<const uint8_t*>(scales.data());
    entries.push_back({name + "_scale_inv", "F32", {br, bc}, std::vector<uint8_t>(sb, sb + scales.size() * 4)});
    ++quantized;
  }
  nlohmann::json header = nlohmann::json::object();
  size_t offset = 0;
  for (const Entry& e : entries) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  std::ofstream out(to / "model.safetensors", std::ios::binary);
  const uint64_t length = text.size();
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << text;
  for (const Entry& e : entries) out.write(reinterpret_cast<const char*>(e.bytes.data()), std::streamsize(e.bytes.size()));
  return quantized;
}

}  // namespace sparrow::model_test
