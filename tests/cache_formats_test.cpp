// The quantised cache formats of issue 7 (cache/page_codec.h, docs/cache.md): every page layout byte for
// byte against the CPU number codecs, the bytes per token the seeds quote, the dtype flags and their
// resolution per page kind. cache_test.cpp runs every fixture family with every format
// (CacheExactness.EveryCacheFormatRunsTheFamily); kv_plan_test.cpp checks capacity.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "cache/page_codec.h"
#include "cache/planner.h"
#include "core/error.h"
#include "formats/config.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;

namespace {

constexpr int64_t kGiB = int64_t(1) << 30;

std::vector<float> random_rows(int64_t count, int64_t width, unsigned seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> rows(count * width);
  for (float& x : rows) x = normal(rng);
  return rows;
}

const uint8_t* bytes(const std::vector<std::byte>& page, int64_t at) {
  return reinterpret_cast<const uint8_t*>(page.data()) + at;
}

// Encodes `count` rows as tokens first.. of a page of `tokens`, and decodes them back.
struct Encoded {
  std::vector<std::byte> page;
  std::vector<float> back;
};
Encoded round_trip(const PageCodec& codec, const PageSpec& spec, int64_t tokens, const std::vector<float>& rows,
                   int64_t first) {
  const int64_t count = int64_t(rows.size()) / spec.width;
  Encoded e;
  e.page.assign(codec.page_bytes(spec, tokens), std::byte{0xEE});
  codec.encode(spec, tokens, rows.data(), first, count, e.page.data());
  e.back.resize(rows.size());
  codec.decode(spec, tokens, e.page.data(), first, count, e.back.data());
  return e;
}

}  // namespace

// The compact FP8 latent: 512 + 64 e4m3 values, one scale per layer (1.0) outside the page: 576 bytes.
TEST(CacheFormats, Fp8PerTensorLatentIs576E4m3Bytes) {
  const PageSpec spec{PageKind::MlaLatent, 576, 64};
  const PageCodec& codec = page_codec(CacheDtype::Fp8PerTensor, PageKind::MlaLatent);
  EXPECT_EQ(codec.format(), PageFormat::Fp8Rows);
  EXPECT_EQ(codec.page_bytes(spec, 64), 64 * 576);
  const std::vector<float> rows = random_rows(3, 576, 1);
  const Encoded e = round_trip(codec, spec, 64, rows, 10);
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t i = 0; i < 576; ++i) {
      const uint8_t code = *bytes(e.page, (10 + t) * 576 + i);
      ASSERT_EQ(code, cpu::float_to_e4m3(rows[t * 576 + i] / kKvTensorScale));
      ASSERT_EQ(e.back[t * 576 + i], cpu::e4m3_to_float(code) * kKvTensorScale);
    }
  EXPECT_EQ(kKvTensorScale, 1.0f);
}

// The NVFP4 latent: per token [256 B e2m1 NoPE | 64 B e4m3 rope | 32 B e4m3 scales] = 352 bytes.
TEST(CacheFormats, Nvfp4LatentIs352Bytes) {
  const PageSpec spec{PageKind::MlaLatent, 576, 64};
  const PageCodec& codec = page_codec(CacheDtype::Nvfp4, PageKind::MlaLatent);
  EXPECT_EQ(codec.format(), PageFormat::Nvfp4Latent);
  EXPECT_EQ(codec.page_bytes(spec, 64), 64 * 352);
  const std::vector<float> rows = random_rows(4, 576, 2);
  const Encoded e = round_trip(codec, spec, 64, rows, 60);
  for (int64_t t = 0; t < 4; ++t) {
    const int64_t token = (60 + t) * 352;
    std::vector<uint8_t> packed(256), scales(32);
    cpu::nvfp4_quantize(rows.data() + t * 576, 512, kKvTensorScale, packed.data(), scales.data());
    EXPECT_EQ(0, std::memcmp(bytes(e.page, token), packed.data(), 256)) << t;
    EXPECT_EQ(0, std::memcmp(bytes(e.page, token + 320), scales.data(), 32)) << t;
    for (int64_t i = 0; i < 64; ++i)
      EXPECT_EQ(*bytes(e.page, token + 256 + i), cpu::float_to_e4m3(rows[t * 576 + 512 + i])) << i;
    std::vector<float> nope(512);
    cpu::nvfp4_dequantize(packed.data(), scales.data(), 512, kKvTensorScale, nope.data());
    for (int64_t i = 0; i < 512; ++i) ASSERT_EQ(e.back[t * 576 + i], nope[i]);
    for (int64_t i = 0; i < 64; ++i)
      ASSERT_EQ(e.back[t * 576 + 512 + i], cpu::e4m3_to_float(*bytes(e.page, token + 256 + i)));
  }
  // Tokens outside [60, 64) were not touched.
  for (int64_t b = 0; b < 60 * 352; ++b) ASSERT_EQ(e.page[b], std::byte{0xEE});
  EXPECT_THROW(codec.page_bytes({PageKind::MlaLatent, 72, 64}, 64), Error);  // NoPE 8: no multiple of 16
}

// Index keys and GQA K/V in NVFP4 / MXFP4: all codes of the page, then all block scales.
TEST(CacheFormats, Fp4RowsAreValuesThenScales) {
  struct Case {
    CacheDtype dtype;
    PageKind kind;
    int64_t width, token_bytes, value_bytes;
    PageFormat format;
  };
  for (const Case& c : {Case{CacheDtype::Nvfp4, PageKind::GqaKeyValue, 1024, 576, 512, PageFormat::Nvfp4Rows},
                        Case{CacheDtype::Nvfp4, PageKind::MsaIndexKey, 128, 72, 64, PageFormat::Nvfp4Rows},
                        Case{CacheDtype::Nvfp4, PageKind::DsaIndexKey, 128, 72, 64, PageFormat::Nvfp4Rows},
                        Case{CacheDtype::Mxfp4, PageKind::DsaIndexKey, 128, 68, 64, PageFormat::Mxfp4Rows},
                        Case{CacheDtype::Mxfp4, PageKind::MsaIndexKey, 128, 68, 64, PageFormat::Mxfp4Rows},
                        Case{CacheDtype::Mxfp4, PageKind::DsaIndexKey, 16, 9, 8, PageFormat::Mxfp4Rows},
                        Case{CacheDtype::Nvfp4, PageKind::GqaKeyValue, 40, 23, 20, PageFormat::Nvfp4Rows}}) {
    SCOPED_TRACE(cat(cache_dtype_name(c.dtype), " ", page_kind_name(c.kind), " of ", c.width));
    const bool nvfp4 = c.dtype == CacheDtype::Nvfp4;
    const PageSpec spec{c.kind, c.width};
    const PageCodec& codec = page_codec(c.dtype, c.kind);
    EXPECT_EQ(codec.format(), c.format);
    const int64_t tokens = 64;
    EXPECT_EQ(codec.page_bytes(spec, tokens), tokens * c.token_bytes);
    const std::vector<float> rows = random_rows(3, c.width, 3);
    const Encoded e = round_trip(codec, spec, tokens, rows, 61);
    const int64_t scale_bytes = c.token_bytes - c.value_bytes;
    for (int64_t t = 0; t < 3; ++t) {
      std::vector<uint8_t> packed(c.value_bytes), scales(scale_bytes);
      std::vector<float> decoded(c.width);
      if (nvfp4) {
        cpu::nvfp4_quantize(rows.data() + t * c.width, c.width, kKvTensorScale, packed.data(), scales.data());
        cpu::nvfp4_dequantize(packed.data(), scales.data(), c.width, kKvTensorScale, decoded.data());
      } else {
        cpu::mxfp4_quantize(rows.data() + t * c.width, c.width, packed.data(), scales.data());
        cpu::mxfp4_dequantize(packed.data(), scales.data(), c.width, decoded.data());
      }
      EXPECT_EQ(0, std::memcmp(bytes(e.page, (61 + t) * c.value_bytes), packed.data(), c.value_bytes));
      EXPECT_EQ(0, std::memcmp(bytes(e.page, tokens * c.value_bytes + (61 + t) * scale_bytes), scales.data(),
                               scale_bytes));
      for (int64_t i = 0; i < c.width; ++i) ASSERT_EQ(e.back[t * c.width + i], decoded[i]);
    }
  }
}

// Plain FP8 rows for GQA K/V and MSA keys (1,024 and 128 bytes, the MiniMax seed's FP8 figures); DSA keys
// keep their per-token scale (132 bytes) in both FP8 spellings.
TEST(CacheFormats, Fp8FormsOfEveryKind) {
  EXPECT_EQ(page_codec(CacheDtype::Fp8, PageKind::GqaKeyValue).page_bytes({PageKind::GqaKeyValue, 1024}, 1), 1024);
  EXPECT_EQ(page_codec(CacheDtype::Fp8, PageKind::MsaIndexKey).page_bytes({PageKind::MsaIndexKey, 128}, 1), 128);
  EXPECT_EQ(page_codec(CacheDtype::Fp8, PageKind::MsaIndexKey).format(), PageFormat::Fp8Rows);
  for (CacheDtype d : {CacheDtype::Fp8, CacheDtype::Fp8PerTensor}) {
    EXPECT_EQ(page_codec(d, PageKind::DsaIndexKey).format(), PageFormat::Fp8IndexKey);
    EXPECT_EQ(page_codec(d, PageKind::GqaKeyValue).format(), PageFormat::Fp8Rows);
  }
  EXPECT_EQ(page_codec(CacheDtype::Fp8, PageKind::MlaLatent).format(), PageFormat::Fp8Latent);
  EXPECT_THROW(page_codec(CacheDtype::Mxfp4, PageKind::MlaLatent), Error);
}

// Bytes per token of the real shapes in every format, as docs/cache.md tabulates them.
TEST(CacheFormats, BytesPerTokenOfRealShapes) {
  auto per_token = [](const char* shape, const char* kv, const char* index) {
    const Config config = Config::load((std::filesystem::path(SPARROW_SOURCE_DIR) / "bench/shapes" / shape).string());
    CacheConfig c;
    c.kv_cache_dtype = kv;
    c.indexer_kv_dtype = index;
    c.memory_bytes = 64 * kGiB;
    c.max_num_seqs = 1;
    const CachePlan plan = plan_cache(cache_spec_from_config(config), c);
    std::vector<int64_t> out;
    for (const auto& [name, bytes] : plan.bytes_per_token) out.push_back(bytes);
    return out;  // components in row order, then the total
  };
  using V = std::vector<int64_t>;
  // DeepSeek-V3.2, 61 layers: latent and index key per layer.
  EXPECT_EQ(per_token("deepseek_v3.2.json", "fp8", "fp8"), (V{61 * 656, 61 * 132, 61 * 788}));
  EXPECT_EQ(per_token("deepseek_v3.2.json", "fp8_per_tensor", "fp8"), (V{61 * 576, 61 * 132, 61 * 708}));
  EXPECT_EQ(per_token("deepseek_v3.2.json", "nvfp4", "mxfp4"), (V{61 * 352, 61 * 68, 61 * 420}));
  EXPECT_EQ(per_token("deepseek_v3.2.json", "nvfp4", "nvfp4"), (V{61 * 352, 61 * 72, 61 * 424}));
  // Kimi K3.1 Pro, 24 MLA + DSA layers.
  EXPECT_EQ(per_token("kimi_k3.1_pro.json", "nvfp4", "mxfp4"), (V{24 * 352, 24 * 68, 24 * 420}));
  // MiniMax-M3.1: 60 GQA layers, 57 MSA.
  EXPECT_EQ(per_token("minimax_m3.1.json", "nvfp4", "nvfp4"), (V{34560, 57 * 72, 34560 + 57 * 72}));
  EXPECT_EQ(per_token("minimax_m3.1.json", "fp8", "fp8"), (V{61440, 57 * 128, 61440 + 57 * 128}));
  EXPECT_EQ(per_token("minimax_m3.1.json", "nvfp4", "auto"), (V{34560, 57 * 72, 34560 + 57 * 72}));
  EXPECT_EQ(per_token("minimax_m3.1.json", "bfloat16", "mxfp4"), (V{122880, 57 * 68, 122880 + 57 * 68}));
}

TEST(CacheFormats, DtypeNamesAndTheirResolution) {
  EXPECT_EQ(parse_cache_dtype("fp8_ds_mla"), CacheDtype::Fp8);
  EXPECT_EQ(parse_cache_dtype("fp8_e4m3"), CacheDtype::Fp8);
  EXPECT_EQ(parse_cache_dtype("fp8_per_tensor"), CacheDtype::Fp8PerTensor);
  EXPECT_EQ(parse_cache_dtype("nvfp4"), CacheDtype::Nvfp4);
  EXPECT_EQ(parse_indexer_kv_dtype("bf16"), CacheDtype::BFloat16);
  EXPECT_EQ(parse_indexer_kv_dtype("mxfp4"), CacheDtype::Mxfp4);
  using sparrow::testing::error_message;
  using sparrow::testing::mentions;
  EXPECT_TRUE(mentions(error_message([] { parse_cache_dtype("int8"); }), {"'int8'", "fp8_ds_mla", "nvfp4"}));
  EXPECT_TRUE(mentions(error_message([] { parse_cache_dtype("mxfp4"); }), {"indexer_kv_dtype"}));
  EXPECT_TRUE(mentions(error_message([] { parse_indexer_kv_dtype("fp8_per_tensor"); }), {"mxfp4", "bf16"}));

  // "auto" index keys: the kv dtype's counterpart on the CPU, fp8 on a GPU.
  const std::vector<LayerCacheSpec> dsa = {{{{PageKind::MlaLatent, 576, 64}, {PageKind::DsaIndexKey, 128}}, {}}};
  CacheConfig c;
  c.memory_bytes = kGiB;
  c.kv_cache_dtype = "fp8_per_tensor";
  EXPECT_EQ(plan_cache(dsa, c).index_dtype, CacheDtype::Fp8);
  EXPECT_EQ(plan_cache(dsa, c).page(0, PageKind::DsaIndexKey)->token_bytes, 132);
  EXPECT_EQ(plan_cache(dsa, c).page(0, PageKind::MlaLatent)->token_bytes, 576);
  c.kv_cache_dtype = "nvfp4";
  EXPECT_EQ(plan_cache(dsa, c).index_dtype, CacheDtype::Nvfp4);
  c.device = Device::Cuda;  // the budget is explicit: no GPU is asked
  EXPECT_EQ(plan_cache(dsa, c).index_dtype, CacheDtype::Fp8);
  c.indexer_kv_dtype = "mxfp4";
  EXPECT_EQ(plan_cache(dsa, c).page(0, PageKind::DsaIndexKey)->codec->format(), PageFormat::Mxfp4Rows);
  EXPECT_EQ(plan_cache(dsa, c).page(0, PageKind::MlaLatent)->codec->format(), PageFormat::Nvfp4Latent);
}

TEST(CacheFormats, AttentionConfigTakesTheIndexerDtype) {
  CacheConfig c;
  apply_attention_config(R"({"indexer_kv_dtype": "mxfp4"})", c);
  EXPECT_EQ(c.indexer_kv_dtype, "mxfp4");
  apply_attention_config(R"({"indexer_kv_dtype": "auto"})", c);
  EXPECT_EQ(c.indexer_kv_dtype, "auto");
  apply_attention_config("{}", c);
  EXPECT_EQ(c.indexer_kv_dtype, "auto");
  using sparrow::testing::error_message;
  using sparrow::testing::mentions;
  EXPECT_TRUE(mentions(error_message([&] { apply_attention_config(R"({"indexer_kv_dtype": "fp4"})", c); }),
                       {"'fp4'", "mxfp4", "nvfp4"}));
  // indexer_decode_cp is the model's (MSA's indexer under -tp), read by parse_attention_config; the cache's
  // part leaves it alone.
  apply_attention_config(R"({"indexer_decode_cp": true, "indexer_kv_dtype": "nvfp4"})", c);
  EXPECT_EQ(c.indexer_kv_dtype, "nvfp4");
  c.indexer_kv_dtype = "auto";
  EXPECT_TRUE(parse_attention_config(R"({"indexer_decode_cp": true})").indexer_decode_cp);
  EXPECT_FALSE(parse_attention_config(R"({"indexer_kv_dtype": "fp8"})").indexer_decode_cp);
  EXPECT_TRUE(mentions(error_message([&] { parse_attention_config(R"({"indexer_decode_cp": 1})"); }),
                       {"indexer_decode_cp", "true or false"}));
  EXPECT_TRUE(mentions(error_message([&] { apply_attention_config(R"({"backend": "FLASHMLA"})", c); }),
                       {"'backend'", "supported: indexer_kv_dtype, indexer_decode_cp"}));
  EXPECT_TRUE(mentions(error_message([&] { apply_attention_config(R"(["fp8"])", c); }), {"JSON object"}));
  EXPECT_TRUE(mentions(error_message([&] { apply_attention_config("{indexer_kv_dtype: fp8}", c); }), {"JSON object"}));
  EXPECT_EQ(c.indexer_kv_dtype, "auto");
}
