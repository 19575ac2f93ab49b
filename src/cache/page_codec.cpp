#include "cache/page_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "kernels/cpu/fp8.h"

namespace sparrow {

CacheDtype parse_cache_dtype(const std::string& name, Device device) {
  if (name == "auto") return device == Device::Cpu ? CacheDtype::Float32 : CacheDtype::BFloat16;
  if (name == "float32") return CacheDtype::Float32;
  if (name == "bfloat16") return CacheDtype::BFloat16;
  if (name == "fp8" || name == "fp8_e4m3") return CacheDtype::Fp8;
  fail("unsupported kv cache dtype '", name, "' (supported: auto, float32, bfloat16, fp8, fp8_e4m3)");
}

const char* cache_dtype_name(CacheDtype dtype) {
  switch (dtype) {
    case CacheDtype::Float32: return "float32";
    case CacheDtype::BFloat16: return "bfloat16";
    case CacheDtype::Fp8: return "fp8";
  }
  return "?";
}

namespace {

// Rows stored token after token, each value one Element: the layout of float32 and bfloat16 pages.
template <typename Element>
class TokenMajorCodec : public PageCodec {
 public:
  int64_t page_bytes(const PageSpec& spec, int64_t tokens) const override {
    return tokens * spec.width * int64_t(sizeof(Element));
  }
  void encode(const PageSpec& spec, int64_t tokens, const float* rows, int64_t first, int64_t count,
              std::byte* page) const override {
    Element* dst = reinterpret_cast<Element*>(page) + first * spec.width;
    for (int64_t i = 0; i < count * spec.width; ++i) dst[i] = to_element(rows[i]);
  }
  void decode(const PageSpec& spec, int64_t tokens, const std::byte* page, int64_t first, int64_t count,
              float* rows) const override {
    const Element* src = reinterpret_cast<const Element*>(page) + first * spec.width;
    for (int64_t i = 0; i < count * spec.width; ++i) rows[i] = to_float(src[i]);
  }
  PageFormat format() const override {
    return std::is_same_v<Element, float> ? PageFormat::Float32 : PageFormat::BFloat16;
  }

 private:
  static Element to_element(float x) {
    if constexpr (std::is_same_v<Element, float>) return x;
    else return float_to_bf16(x);
  }
  static float to_float(Element x) {
    if constexpr (std::is_same_v<Element, float>) return x;
    else return bf16_to_float(x);
  }
};

// FP8 scales: amax / 448, so the largest value lands on E4M3's largest finite code; a group of zeros
// has scale 0 and codes 0. Values are coded as RNE(x / scale) with an IEEE division: exactly what the
// GPU's write kernels do (kernels/cuda/dsa_indexer, kernels/cuda/mla), so both write the same bytes.
float fp8_scale(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax / cpu::kE4m3Max;
}

uint8_t fp8_code(float x, float scale) { return scale > 0.0f ? cpu::float_to_e4m3(x / scale) : uint8_t(0); }

// MLA latent in FlashMLA's FP8 layout (per token, tokens consecutive): [NoPE part as e4m3 |
// one fp32 scale per 128 NoPE values | rope part as bf16] — 512 + 16 + 128 = 656 bytes for
// DeepSeek-V3.2's 512 + 64 (FlashMLA README, "FP8 KV cache"). The rope part stays bf16 because
// RoPE'd keys have a wide dynamic range per dimension.
class Fp8LatentCodec final : public PageCodec {
 public:
  static int64_t token_bytes(const PageSpec& spec) {
    const int64_t nope = spec.width - spec.rope_width;
    return nope + 4 * (nope / 128) + 2 * spec.rope_width;
  }
  int64_t page_bytes(const PageSpec& spec, int64_t tokens) const override {
    const int64_t nope = spec.width - spec.rope_width;
    SPARROW_CHECK(nope > 0 && nope % 128 == 0, "fp8 kv cache: the MLA latent (", nope,
                  " values) must be a multiple of 128 (one scale per 128)");
    return tokens * token_bytes(spec);
  }
  void encode(const PageSpec& spec, int64_t tokens, const float* rows, int64_t first, int64_t count,
              std::byte* page) const override {
    const int64_t nope = spec.width - spec.rope_width, groups = nope / 128, bytes = token_bytes(spec);
    for (int64_t t = 0; t < count; ++t) {
      const float* row = rows + t * spec.width;
      std::byte* out = page + (first + t) * bytes;
      auto* values = reinterpret_cast<uint8_t*>(out);
      auto* scales = reinterpret_cast<float*>(out + nope);
      auto* rope = reinterpret_cast<uint16_t*>(out + nope + 4 * groups);
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = fp8_scale(row + g * 128, 128);
        scales[g] = scale;
        for (int64_t i = 0; i < 128; ++i) values[g * 128 + i] = fp8_code(row[g * 128 + i], scale);
      }
      for (int64_t i = 0; i < spec.rope_width; ++i) rope[i] = float_to_bf16(row[nope + i]);
    }
  }
  void decode(const PageSpec& spec, int64_t tokens, const std::byte* page, int64_t first, int64_t count,
              float* rows) const override {
    const int64_t nope = spec.width - spec.rope_width, groups = nope / 128, bytes = token_bytes(spec);
    for (int64_t t = 0; t < count; ++t) {
      float* row = rows + t * spec.width;
      const std::byte* in = page + (first + t) * bytes;
      const auto* values = reinterpret_cast<const uint8_t*>(in);
      const auto* scales = reinterpret_cast<const float*>(in + nope);
      const auto* rope = reinterpret_cast<const uint16_t*>(in + nope + 4 * groups);
      for (int64_t i = 0; i < nope; ++i) row[i] = cpu::e4m3_to_float(values[i]) * scales[i / 128];
      for (int64_t i = 0; i < spec.rope_width; ++i) row[nope + i] = bf16_to_float(rope[i]);
    }
  }
  PageFormat format() const override { return PageFormat::Fp8Latent; }
};

// DSA index keys in FP8: all values of the page's tokens first (width e4m3 each), then one fp32 scale
// per token — 128 + 4 = 132 bytes per token for DeepSeek-V3.2 (its inference code's index cache).
// Values apart from scales keep each token's values one aligned 128-byte line for the scoring kernel.
class Fp8IndexKeyCodec final : public PageCodec {
 public:
  int64_t page_bytes(const PageSpec& spec, int64_t tokens) const override { return tokens * (spec.width + 4); }
  void encode(const PageSpec& spec, int64_t tokens, const float* rows, int64_t first, int64_t count,
              std::byte* page) const override {
    auto* values = reinterpret_cast<uint8_t*>(page);
    auto* scales = reinterpret_cast<float*>(page + tokens * spec.width);
    for (int64_t t = 0; t < count; ++t) {
      const float* row = rows + t * spec.width;
      const float scale = fp8_scale(row, spec.width);
      scales[first + t] = scale;
      for (int64_t i = 0; i < spec.width; ++i) values[(first + t) * spec.width + i] = fp8_code(row[i], scale);
    }
  }
  void decode(const PageSpec& spec, int64_t tokens, const std::byte* page, int64_t first, int64_t count,
              float* rows) const override {
    const auto* values = reinterpret_cast<const uint8_t*>(page);
    const auto* scales = reinterpret_cast<const float*>(page + tokens * spec.width);
    for (int64_t t = 0; t < count; ++t)
      for (int64_t i = 0; i < spec.width; ++i)
        rows[t * spec.width + i] = cpu::e4m3_to_float(values[(first + t) * spec.width + i]) * scales[first + t];
  }
  PageFormat format() const override { return PageFormat::Fp8IndexKey; }
};

}  // namespace

const PageCodec& page_codec(CacheDtype dtype, PageKind kind) {
  static const TokenMajorCodec<float> float32;
  static const TokenMajorCodec<uint16_t> bfloat16;
  static const Fp8LatentCodec fp8_latent;
  static const Fp8IndexKeyCodec fp8_index_key;
  // Every page kind stores float32 and bfloat16 rows alike; FP8 has a layout per kind.
  switch (dtype) {
    case CacheDtype::Float32: return float32;
    case CacheDtype::BFloat16: return bfloat16;
    case CacheDtype::Fp8:
      if (kind == PageKind::MlaLatent) return fp8_latent;
      if (kind == PageKind::DsaIndexKey) return fp8_index_key;
      fail("kv cache dtype fp8 has no layout for ", page_kind_name(kind), " pages yet (quantized GQA/MSA caches: issue 7)");
  }
  fail("no page codec for kv cache dtype ", int(dtype), " and page kind ", page_kind_name(kind));
}

}  // namespace sparrow
