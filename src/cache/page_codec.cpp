#include "cache/page_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"

namespace sparrow {

CacheDtype parse_cache_dtype(const std::string& name, Device device) {
  if (name == "auto") return device == Device::Cpu ? CacheDtype::Float32 : CacheDtype::BFloat16;
  if (name == "float32") return CacheDtype::Float32;
  if (name == "bfloat16") return CacheDtype::BFloat16;
  if (name == "fp8" || name == "fp8_e4m3" || name == "fp8_ds_mla") return CacheDtype::Fp8;
  if (name == "fp8_per_tensor") return CacheDtype::Fp8PerTensor;
  if (name == "nvfp4") return CacheDtype::Nvfp4;
  if (name == "mxfp4")
    fail("--kv-cache-dtype mxfp4: MXFP4 is an index-key format; use --attention-config '{\"indexer_kv_dtype\": \"mxfp4\"}'");
  fail("unsupported kv cache dtype '", name,
       "' (supported: auto, float32, bfloat16, fp8, fp8_e4m3, fp8_ds_mla, fp8_per_tensor, nvfp4)");
}

CacheDtype parse_indexer_kv_dtype(const std::string& name) {
  if (name == "float32") return CacheDtype::Float32;
  if (name == "bfloat16" || name == "bf16") return CacheDtype::BFloat16;
  if (name == "fp8" || name == "fp8_e4m3") return CacheDtype::Fp8;
  if (name == "mxfp4") return CacheDtype::Mxfp4;
  if (name == "nvfp4") return CacheDtype::Nvfp4;
  fail("unsupported indexer_kv_dtype '", name, "' (supported: auto, float32, bfloat16, bf16, fp8, fp8_e4m3, mxfp4, nvfp4)");
}

const char* cache_dtype_name(CacheDtype dtype) {
  switch (dtype) {
    case CacheDtype::Float32: return "float32";
    case CacheDtype::BFloat16: return "bfloat16";
    case CacheDtype::Fp8: return "fp8";
    case CacheDtype::Fp8PerTensor: return "fp8_per_tensor";
    case CacheDtype::Nvfp4: return "nvfp4";
    case CacheDtype::Mxfp4: return "mxfp4";
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
// RoPE'd keys have a wide dynamic range per dimension. A NoPE width that is no multiple of 128 (only
// the tiny test models) ends in a shorter group with a scale of its own.
class Fp8LatentCodec final : public PageCodec {
 public:
  static int64_t groups(const PageSpec& spec) { return (spec.width - spec.rope_width + 127) / 128; }
  static int64_t token_bytes(const PageSpec& spec) {
    const int64_t nope = spec.width - spec.rope_width;
    return nope + 4 * groups(spec) + 2 * spec.rope_width;
  }
  int64_t page_bytes(const PageSpec& spec, int64_t tokens) const override {
    SPARROW_CHECK(spec.width - spec.rope_width > 0, "fp8 kv cache: the MLA latent has no NoPE part");
    return tokens * token_bytes(spec);
  }
  void encode(const PageSpec& spec, int64_t tokens, const float* rows, int64_t first, int64_t count,
              std::byte* page) const override {
    const int64_t nope = spec.width - spec.rope_width, bytes = token_bytes(spec);
    for (int64_t t = 0; t < count; ++t) {
      const float* row = rows + t * spec.width;
      std::byte* out = page + (first + t) * bytes;
      auto* values = reinterpret_cast<uint8_t*>(out);
      auto* scales = reinterpret_cast<float*>(out + nope);
      auto* rope = reinterpret_cast<uint16_t*>(out + nope + 4 * groups(spec));
      for (int64_t g = 0; g < groups(spec); ++g) {
        const int64_t begin = g * 128, n = std::min<int64_t>(128, nope - begin);
        const float scale = fp8_scale(row + begin, n);
        scales[g] = scale;
        for (int64_t i = begin; i < begin + n; ++i) values[i] = fp8_code(row[i], scale);
      }
      for (int64_t i = 0; i < spec.rope_width; ++i) rope[i] = float_to_bf16(row[nope + i]);
    }
  }
  void decode(const PageSpec& spec, int64_t tokens, const std::byte* page, int64_t first, int64_t count,
              float* rows) const override {
    const int64_t nope = spec.width - spec.rope_width, bytes = token_bytes(spec);
    for (int64_t t = 0; t < count; ++t) {
      float* row = rows + t * spec.width;
      const std::byte* in = page + (first + t) * bytes;
      const auto* values = reinterpret_cast<const uint8_t*>(in);
      const auto* scales = reinterpret_cast<const float*>(in + nope);
      const auto* rope = reinterpret_cast<const uint16_t*>(in + nope + 4 * groups(spec));
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

// FP8 with one scale per layer (kKvTensorScale): every value one e4m3 byte, rows token after token.
// The MLA latent so (512 NoPE + 64 rope = 576 bytes) is the compact FP8 latent FlashInfer's MLA
// kernels read (vLLM's "fp8" on Blackwell, the seed's "576 字节的 FP8 latent"); GQA K/V and MSA
// index keys so are vLLM's FP8 KV cache (k/v scale per layer) and MSA's scale-free e4m3 index keys:
// 4 KV heads x 128 x (K, V) = 1,024 bytes, index key 128 bytes (the MiniMax seed's figures).
class Fp8RowsCodec final : public PageCodec {
 public:
  int64_t page_bytes(const PageSpec& spec, int64_t tokens) const override { return tokens * spec.width; }
  void encode(const PageSpec& spec, int64_t tokens, const float* rows, int64_t first, int64_t count,
              std::byte* page) const override {
    auto* out = reinterpret_cast<uint8_t*>(page) + first * spec.width;
    for (int64_t i = 0; i < count * spec.width; ++i) out[i] = cpu::float_to_e4m3(rows[i] / kKvTensorScale);
  }
  void decode(const PageSpec& spec, int64_t tokens, const std::byte* page, int64_t first, int64_t count,
              float* rows) const override {
    const auto* in = reinterpret_cast<const uint8_t*>(page) + first * spec.width;
    for (int64_t i = 0; i < count * spec.width; ++i) rows[i] = cpu::e4m3_to_float(in[i]) * kKvTensorScale;
  }
  PageFormat format() const override { return PageFormat::Fp8Rows; }
};

// MLA latent in NVFP4 (per token, tokens consecutive):
//   [NoPE as e2m1, two a byte (element 2i in the low nibble) | rope as e4m3 (per-layer scale) |
//    one e4m3 scale per 16 NoPE values, in order]
// = 256 + 64 + 32 = 352 bytes for 512 + 64: the seed's NVFP4 latent, in the order of vLLM's
// nvfp4_ds_mla layout (whose Blackwell kernels also permute the 32 scales; ours stay in order: the
// Hopper kernels dequantise in registers). The rope part is FP8, not FP4: RoPE'd dimensions spread
// too widely for 16-value blocks of 3 bits, and FP8 keeps the seed's 352. The NVFP4 second-level
// scale is kKvTensorScale. Every token starts on a 32-byte sector (352 = 11 x 32).
class Nvfp4LatentCodec final : public PageCodec {
 public:
  static int64_t token_bytes(const PageSpec& spec) {
    const int64_t nope = spec.width - spec.rope_width;
    return nope / 2 + spec.rope_width + nope / cpu::kNvfp4Block;
  }
  int64_t page_bytes(const PageSpec& spec, int64_t tokens) const override {
    const int64_t nope = spec.width - spec.rope_width;
    SPARROW_CHECK(nope > 0 && nope % cpu::kNvfp4Block == 0, "nvfp4 kv cache: the MLA latent's NoPE part (", nope,
                  " values) must be a multiple of 16 (one scale per 16)");
    return tokens * token_bytes(spec);
  }
  void encode(const PageSpec& spec, int64_t tokens, const float* rows, int64_t first, int64_t count,
              std::byte* page) const override {
    const int64_t nope = spec.width - spec.rope_width, bytes = token_bytes(spec);
    for (int64_t t = 0; t < count; ++t) {
      const float* row = rows + t * spec.width;
      auto* out = reinterpret_cast<uint8_t*>(page + (first + t) * bytes);
      cpu::nvfp4_quantize(row, nope, kKvTensorScale, out, out + nope / 2 + spec.rope_width);
      for (int64_t i = 0; i < spec.rope_width; ++i) out[nope / 2 + i] = cpu::float_to_e4m3(row[nope + i] / kKvTensorScale);
    }
  }
  void decode(const PageSpec& spec, int64_t tokens, const std::byte* page, int64_t first, int64_t count,
              float* rows) const override {
    const int64_t nope = spec.width - spec.rope_width, bytes = token_bytes(spec);
    for (int64_t t = 0; t < count; ++t) {
      float* row = rows + t * spec.width;
      const auto* in = reinterpret_cast<const uint8_t*>(page + (first + t) * bytes);
      cpu::nvfp4_dequantize(in, in + nope / 2 + spec.rope_width, nope, kKvTensorScale, row);
      for (int64_t i = 0; i < spec.rope_width; ++i) row[nope + i] = cpu::e4m3_to_float(in[nope / 2 + i]) * kKvTensorScale;
    }
  }
  PageFormat format() const override { return PageFormat::Nvfp4Latent; }
};

// NVFP4 or MXFP4 rows, "values then scales": the page's packed codes first, token after token
// (ceil(width / 2) bytes each, element 2i in the low nibble), then its block scales, token after token
// (ceil(width / block) bytes each: E4M3 per 16 values for NVFP4, E8M0 per 32 for MXFP4). So a token's
// codes are one aligned run for vector loads (64 bytes for a 128-value index key, 512 for GQA's 4 heads
// x 128 x (K, V)), as in DeepSeek's FP8 index-key pages. Bytes per token: GQA K/V 512 + 64 = 576
// (NVFP4), index key 64 + 8 = 72 (NVFP4), 64 + 4 = 68 (MXFP4: the seed's MXFP4 index key). Blocks run
// along the row, so with head dimensions that are multiples of the block no block spans two heads
// (nor K and V). A width that is no multiple of the block ends in a shorter block.
template <bool kNvfp4>
class Fp4RowsCodec final : public PageCodec {
 public:
  static constexpr int kBlock = kNvfp4 ? cpu::kNvfp4Block : cpu::kMxfp4Block;
  static int64_t value_bytes(const PageSpec& spec) { return cpu::fp4_packed_bytes(spec.width); }
  static int64_t scale_bytes(const PageSpec& spec) { return cpu::fp4_num_blocks(spec.width, kBlock); }
  int64_t page_bytes(const PageSpec& spec, int64_t tokens) const override {
    return tokens * (value_bytes(spec) + scale_bytes(spec));
  }
  void encode(const PageSpec& spec, int64_t tokens, const float* rows, int64_t first, int64_t count,
              std::byte* page) const override {
    auto* values = reinterpret_cast<uint8_t*>(page);
    uint8_t* scales = values + tokens * value_bytes(spec);
    for (int64_t t = first; t < first + count; ++t) {
      const float* row = rows + (t - first) * spec.width;
      uint8_t* v = values + t * value_bytes(spec);
      uint8_t* s = scales + t * scale_bytes(spec);
      if constexpr (kNvfp4) cpu::nvfp4_quantize(row, spec.width, kKvTensorScale, v, s);
      else cpu::mxfp4_quantize(row, spec.width, v, s);
    }
  }
  void decode(const PageSpec& spec, int64_t tokens, const std::byte* page, int64_t first, int64_t count,
              float* rows) const override {
    const auto* values = reinterpret_cast<const uint8_t*>(page);
    const uint8_t* scales = values + tokens * value_bytes(spec);
    for (int64_t t = first; t < first + count; ++t) {
      float* row = rows + (t - first) * spec.width;
      const uint8_t* v = values + t * value_bytes(spec);
      const uint8_t* s = scales + t * scale_bytes(spec);
      if constexpr (kNvfp4) cpu::nvfp4_dequantize(v, s, spec.width, kKvTensorScale, row);
      else cpu::mxfp4_dequantize(v, s, spec.width, row);
    }
  }
  PageFormat format() const override { return kNvfp4 ? PageFormat::Nvfp4Rows : PageFormat::Mxfp4Rows; }
};

}  // namespace

const PageCodec& page_codec(CacheDtype dtype, PageKind kind) {
  static const TokenMajorCodec<float> float32;
  static const TokenMajorCodec<uint16_t> bfloat16;
  static const Fp8LatentCodec fp8_latent;
  static const Fp8IndexKeyCodec fp8_index_key;
  static const Fp8RowsCodec fp8_rows;
  static const Nvfp4LatentCodec nvfp4_latent;
  static const Fp4RowsCodec<true> nvfp4_rows;
  static const Fp4RowsCodec<false> mxfp4_rows;
  // Every page kind stores float32 and bfloat16 rows alike; the narrow formats have a layout per kind.
  const bool index_key = kind == PageKind::DsaIndexKey || kind == PageKind::MsaIndexKey;
  switch (dtype) {
    case CacheDtype::Float32: return float32;
    case CacheDtype::BFloat16: return bfloat16;
    case CacheDtype::Fp8:
    case CacheDtype::Fp8PerTensor:
      if (kind == PageKind::DsaIndexKey) return fp8_index_key;  // DeepSeek's keys carry a scale each
      if (kind == PageKind::MlaLatent && dtype == CacheDtype::Fp8) return fp8_latent;
      return fp8_rows;
    case CacheDtype::Nvfp4:
      return kind == PageKind::MlaLatent ? static_cast<const PageCodec&>(nvfp4_latent) : nvfp4_rows;
    case CacheDtype::Mxfp4:
      if (index_key) return mxfp4_rows;
      fail("mxfp4 is an index-key format: ", page_kind_name(kind), " pages have no MXFP4 layout");
  }
  fail("no page codec for kv cache dtype ", int(dtype), " and page kind ", page_kind_name(kind));
}

}  // namespace sparrow
