#include "cache/page_codec.h"

#include <cstring>
#include <type_traits>

#include "core/error.h"

namespace sparrow {

CacheDtype parse_cache_dtype(const std::string& name) {
  if (name == "auto" || name == "float32") return CacheDtype::Float32;
  if (name == "bfloat16") return CacheDtype::BFloat16;
  fail("unsupported kv cache dtype '", name, "' (supported: auto, float32, bfloat16)");
}

const char* cache_dtype_name(CacheDtype dtype) {
  switch (dtype) {
    case CacheDtype::Float32: return "float32";
    case CacheDtype::BFloat16: return "bfloat16";
  }
  return "?";
}

uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);  // NaN: keep it a (quiet) NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round half to even on the dropped 16 bits
  return uint16_t(bits >> 16);
}

float bf16_to_float(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
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

}  // namespace

const PageCodec& page_codec(CacheDtype dtype, PageKind kind) {
  static const TokenMajorCodec<float> float32;
  static const TokenMajorCodec<uint16_t> bfloat16;
  // Every page kind stores float32 and bfloat16 rows alike; quantized dtypes will pick per kind.
  switch (dtype) {
    case CacheDtype::Float32: return float32;
    case CacheDtype::BFloat16: return bfloat16;
  }
  fail("no page codec for kv cache dtype ", int(dtype), " and page kind ", page_kind_name(kind));
}

}  // namespace sparrow
