// What the whole-model GPU tests share (and the CPU's tensor-parallel test: nothing here needs a device):
// reading a fixture's token lists, comparing logits row by row, and the greedy choice with its margin.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"

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

}  // namespace sparrow::model_test
