// The committed number-codec vectors (tests/data/quant_vectors.json, written by
// tools/make_quant_vectors.py from the format specifications), for the CPU test (quant_test.cpp) and
// the GPU test (cuda/quant_test.cpp). Floats travel as IEEE binary32 bit patterns.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sparrow::testing {

inline float float_of_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t bits_of_float(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
// Equal bits, or both NaN (a NaN's payload and sign are not part of any format's contract here).
inline bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || bits_of_float(a) == bits_of_float(b);
}

struct ElementCase {
  float x;
  uint8_t code;
};

struct BlockCase {
  std::string name;
  float global = 1.0f;  // NVFP4 only
  std::vector<float> x, decoded;
  std::vector<uint8_t> scales, packed;
};

struct QuantVectors {
  std::vector<ElementCase> e4m3, e2m1;
  std::vector<BlockCase> nvfp4, mxfp4;
};

inline QuantVectors load_quant_vectors() {
  const std::filesystem::path path = std::filesystem::path(SPARROW_SOURCE_DIR) / "tests/data/quant_vectors.json";
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  QuantVectors v;
  auto elements = [&](const char* key, std::vector<ElementCase>& out) {
    for (const auto& c : j.at(key)) out.push_back({float_of_bits(c[0].get<uint32_t>()), c[1].get<uint8_t>()});
  };
  auto floats = [](const nlohmann::json& list) {
    std::vector<float> out;
    for (const auto& b : list) out.push_back(float_of_bits(b.get<uint32_t>()));
    return out;
  };
  auto blocks = [&](const char* key, std::vector<BlockCase>& out) {
    for (const auto& c : j.at(key)) {
      BlockCase b;
      b.name = c.at("name").get<std::string>();
      if (c.contains("global")) b.global = float_of_bits(c["global"].get<uint32_t>());
      b.x = floats(c.at("x"));
      b.decoded = floats(c.at("decoded"));
      b.scales = c.at("scales").get<std::vector<uint8_t>>();
      b.packed = c.at("packed").get<std::vector<uint8_t>>();
      out.push_back(std::move(b));
    }
  };
  elements("e4m3", v.e4m3);
  elements("e2m1", v.e2m1);
  blocks("nvfp4", v.nvfp4);
  blocks("mxfp4", v.mxfp4);
  return v;
}

}  // namespace sparrow::testing
