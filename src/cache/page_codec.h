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

#include "model/sequence_cache.h"

namespace sparrow {

enum class CacheDtype { Float32, BFloat16 };

// --kv-cache-dtype: "auto" (the backend's default: float32 on the CPU), "float32", "bfloat16".
CacheDtype parse_cache_dtype(const std::string& name);
const char* cache_dtype_name(CacheDtype dtype);  // "float32", "bfloat16"

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
};

const PageCodec& page_codec(CacheDtype dtype, PageKind kind);

// bfloat16 <-> float32: round to nearest even (NaN stays NaN), and the exact widening.
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);

}  // namespace sparrow
