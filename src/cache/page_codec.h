// How cached rows are stored in a page: one codec per (cache dtype, page kind).
//
// A page holds the rows of one layer's page kind for the `tokens` tokens of one block. The codec owns
// the byte layout inside the page: float32 and bfloat16 store the rows token after token (token i at
// i * width * element bytes). Formats that keep scales or split a row (issue 7's FP8 MLA latent with a
// bf16 rope part, FP8 index keys with "values then scales" pages, NVFP4 blocks) are further entries
// of the (dtype, kind) table in page_codec.cpp, each with its own layout: nothing else changes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/bfloat16.h"
#include "model/sequence_cache.h"

namespace sparrow {

enum class CacheDtype { Float32, BFloat16, Fp8 };

// --kv-cache-dtype: "auto" (the backend's default: float32 on the CPU, bfloat16 on a GPU), "float32",
// "bfloat16", "fp8" (= "fp8_e4m3"). FP8 exists for the MLA latent (FlashMLA's 656-byte layout) and
// the DSA index key (132 bytes); other page kinds reject it until their quantized formats land.
CacheDtype parse_cache_dtype(const std::string& name, Device device = Device::Cpu);
const char* cache_dtype_name(CacheDtype dtype);  // "float32", "bfloat16", "fp8"

class PageCodec {
 public:
  virtual ~PageCodec() = default;
  // Bytes of a page of `tokens` rows shaped like `spec`.
  virtual int64_t page_bytes(const PageSpec& spec, int64_t tokens) const = 0;
  // Stores rows (count x spec.width floats) as tokens first .. first+count-1 of a page of `tokens`.
  virtual void encode(const PageSpec& spec, int64_t tokens, const float* rows, int64_t first, int64_t count,
                      std::byte* page) const = 0;
  // The inverse: tokens first .. first+count-1 of the page, as fp32 rows.
  virtual void decode(const PageSpec& spec, int64_t tokens, const std::byte* page, int64_t first, int64_t count,
                      float* rows) const = 0;
  // The layout's name for kernels that read pages in place.
  virtual PageFormat format() const = 0;
};

// The codec of a page kind in a cache dtype; a one-line error for combinations that do not exist.
const PageCodec& page_codec(CacheDtype dtype, PageKind kind);


}  // namespace sparrow
