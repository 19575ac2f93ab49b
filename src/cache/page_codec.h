// How cached rows are stored in a page: one codec per (cache dtype, page kind).
//
// A page holds the rows of one layer's page kind for the `tokens` tokens of one block. The codec owns
// the byte layout inside the page (docs/cache.md draws every one, with its bytes per token):
//
//   dtype            MLA latent (512 + 64)          DSA index key (128)      GQA K/V, MSA index key
//   float32          rows, 4 B a value              rows                     rows
//   bfloat16         rows, 2 B a value              rows                     rows
//   fp8              FlashMLA layout, 656 B         values then fp32 scales, rows of e4m3 (per-tensor
//                                                   132 B                    scale): K/V 4x128 1,024 B, key 128 B
//   fp8_per_tensor   rows of e4m3, 576 B            as fp8                   as fp8
//   nvfp4            NoPE e2m1 + rope e4m3 + NoPE   values then e4m3 scales, values then e4m3 scales:
//                    scales, 352 B                  72 B                     K/V 576 B, key 72 B
//   mxfp4            —                              values then e8m0 scales, values then e8m0 scales, key 68 B
//                                                   68 B
//
// Quantised values follow the CPU codecs (kernels/cpu/fp8_codec.h, kernels/cpu/fp4_codec.h), which the GPU's
// write kernels reproduce bit for bit. Formats with one scale for a whole layer (fp8 rows, the NVFP4
// second level) keep it outside the pages: kKvTensorScale, below.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/bfloat16.h"
#include "core/kv_layout.h"

namespace sparrow {

enum class CacheDtype { Float32, BFloat16, Fp8, Fp8PerTensor, Nvfp4, Mxfp4 };

// The per-layer ("per-tensor") fp32 scale of the formats that have one: FP8 rows store e4m3(x / s)
// and NVFP4 pages use s as their second-level scale (value = e2m1 * e4m3 block scale * s). It is a
// fixed 1.0 for every layer, not a value measured at the first write, because:
//   - MiniMax's own NVFP4 KV kernels (MSA, which M3.1 was trained with, quantisation-aware) use no
//     second-level scale at all, i.e. 1.0; vLLM's FP8 KV cache defaults its k/v scales to 1.0 too;
//   - a constant keeps every block self-describing: prefix-cache hits, block transfers between
//     prefill and decode instances and restarts never need a per-layer value next to the pages, and
//     the kernels one load fewer;
//   - with 1.0 the E4M3 block scales alone carry the range: NVFP4 blocks whose largest magnitude lies
//     in [6 * 2^-6, 6 * 448] = [0.094, 2688] get a normal (full-precision) block scale, which covers
//     the normalised latents and keys these caches hold (smaller blocks lose scale precision, blocks
//     below 6 * 2^-10 store zeros); FP8 rows hold magnitudes in [2^-9, 448] (saturating beyond).
// The seeds' byte counts (352, 34,560 per token) leave this scale out of the per-token bytes, as we do.
inline constexpr float kKvTensorScale = 1.0f;

// --kv-cache-dtype (vLLM's names where vLLM has the format):
//   auto            the backend's default: float32 on the CPU, bfloat16 on a GPU
//   float32, bfloat16
//   fp8, fp8_e4m3   FP8 E4M3 in each kind's FP8 layout; the MLA latent in FlashMLA's 656-byte layout
//   fp8_ds_mla      the same (vLLM's name for the FlashMLA layout; vLLM's FlashMLA-sparse backend also
//                   takes "fp8" for it)
//   fp8_per_tensor  FP8 with one scale per layer: the MLA latent as 576 e4m3 values (FlashInfer's MLA
//                   layout, what vLLM's "fp8" is on Blackwell and the seed's 576-byte FP8 latent);
//                   other kinds as fp8
//   nvfp4           NVFP4 (MLA 352 B, GQA K/V 576 B for 4 heads x 128, index keys 72 B)
// A one-line error names the accepted values ("mxfp4" is an index-key format only).
CacheDtype parse_cache_dtype(const std::string& name, Device device = Device::Cpu);
// --attention-config '{"indexer_kv_dtype": ...}' without "auto" (the planner resolves that): float32,
// bfloat16 (= bf16), fp8 (= fp8_e4m3), mxfp4, nvfp4.
CacheDtype parse_indexer_kv_dtype(const std::string& name);
const char* cache_dtype_name(CacheDtype dtype);  // "float32", "bfloat16", "fp8", "fp8_per_tensor", "nvfp4", "mxfp4"

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
