// The packed, paged KV cache (src/cache) and the model's cache interface (model/sequence_cache.h):
//   - the planner's row layout, and bytes per token / state bytes per sequence against hand-computed
//     values for every family, on the tiny fixtures and on real shapes (bench/shapes/*.json);
//   - the block pool: allocation, reference counts, freeing everything;
//   - the prefix cache: hits, misses, the last prompt token, LRU eviction, recurrent snapshots;
//   - exactness: on every fixture family, a request whose prefix comes from the prefix cache gives the
//     logits it gives without the hit; a bfloat16 cache stays close to float32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "cache/page_codec.h"
#include "cache/planner.h"
#include "core/error.h"
#include "formats/config.h"
#include "model/model.h"
#include "test_util.h"

using namespace sparrow;
namespace fs = std::filesystem;

namespace {

using Tokens = std::vector<int32_t>;

constexpr int64_t kGiB = int64_t(1) << 30;

fs::path source_path(const std::string& relative) { return fs::path(SPARROW_SOURCE_DIR) / relative; }

int64_t component(const std::vector<std::pair<std::string, int64_t>>& list, const std::string& name) {
  for (const auto& [key, bytes] : list)
    if (key == name) return bytes;
  return -1;
}

CacheConfig make_config(int64_t block_size, const std::string& dtype, int64_t memory_bytes, int64_t max_num_seqs = 4,
                        bool prefix_caching = true) {
  CacheConfig c;
  c.block_size = block_size;
  c.kv_cache_dtype = dtype;
  c.memory_bytes = memory_bytes;
  c.max_num_seqs = max_num_seqs;
  c.enable_prefix_caching = prefix_caching;
  return c;
}

std::vector<LayerCacheSpec> spec_of_config_file(const fs::path& path) {
  return cache_spec_from_config(Config::load(path.string()));
}

// A one-layer attention-only spec with rows of `width` floats.
std::vector<LayerCacheSpec> attention_spec(int64_t width) { return {{{{PageKind::MlaLatent, width}}, {}}}; }

// A two-layer hybrid spec: one attention layer, one recurrent layer (states of 3 and 5 floats).
std::vector<LayerCacheSpec> hybrid_spec() {
  return {{{{PageKind::MlaLatent, 2}}, {}}, {{}, {{StateKind::ConvTail, 3}, {StateKind::Recurrent, 5}}}};
}

Tokens iota_tokens(int64_t n, int32_t first) {
  Tokens t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = first + int32_t(i);
  return t;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Planner

TEST(CachePlanner, PagesFollowLayerOrderOnSixtyFourByteBoundaries) {
  const std::vector<LayerCacheSpec> spec = {
      {{{PageKind::MlaLatent, 5, 2}, {PageKind::DsaIndexKey, 3}}, {}},
      {{{PageKind::GqaKeyValue, 4}}, {}},
      {{}, {{StateKind::ConvTail, 7}, {StateKind::Recurrent, 9}}},
  };
  // float32, 4-token blocks: pages of 4*5*4 = 80, 4*3*4 = 48 and 4*4*4 = 64 bytes at offsets 0,
  // align64(80) = 128 and align64(128 + 48) = 192; the row ends at 256. The state slot: 28 bytes of
  // conv tail at 0, 36 bytes of recurrent state at 64, 128 in all.
  const int64_t row = 256, slot = 128;
  const CachePlan plan = plan_cache(spec, make_config(4, "float32", 10 * row + 4 * slot, /*max_num_seqs=*/2));
  ASSERT_EQ(plan.pages.size(), 3u);
  EXPECT_EQ(plan.page(0, PageKind::MlaLatent)->offset, 0);
  EXPECT_EQ(plan.page(0, PageKind::DsaIndexKey)->offset, 128);
  EXPECT_EQ(plan.page(1, PageKind::GqaKeyValue)->offset, 192);
  EXPECT_EQ(plan.page(1, PageKind::GqaKeyValue)->page_bytes, 64);
  EXPECT_EQ(plan.page(1, PageKind::MlaLatent), nullptr);
  EXPECT_EQ(plan.row_bytes, row);
  EXPECT_EQ(plan.state(2, StateKind::ConvTail)->offset, 0);
  EXPECT_EQ(plan.state(2, StateKind::Recurrent)->offset, 64);
  EXPECT_EQ(plan.state_slot_bytes, slot);
  // Two running sequences and two snapshots take 4 slots; the rest of the budget is 10 rows.
  EXPECT_EQ(plan.num_state_slots, 2);
  EXPECT_EQ(plan.num_snapshot_slots, 2);
  EXPECT_EQ(plan.num_blocks, 10);
  EXPECT_EQ(plan.max_tokens(), 40);
  EXPECT_EQ(component(plan.bytes_per_token, "mla_latent"), 20);
  EXPECT_EQ(component(plan.bytes_per_token, "dsa_index_key"), 12);
  EXPECT_EQ(component(plan.bytes_per_token, "gqa_kv"), 16);
  EXPECT_EQ(component(plan.bytes_per_token, "total"), 48);
  EXPECT_EQ(component(plan.state_bytes_per_sequence, "total"), 64);

  // bfloat16 halves every page: 40, 24, 32 bytes at 0, 64, 128; the row is align64(160) = 192.
  const CachePlan half = plan_cache(spec, make_config(4, "bfloat16", 10 * row + 4 * slot, 2));
  EXPECT_EQ(half.page(0, PageKind::DsaIndexKey)->offset, 64);
  EXPECT_EQ(half.page(1, PageKind::GqaKeyValue)->offset, 128);
  EXPECT_EQ(half.row_bytes, 192);
  EXPECT_EQ(component(half.bytes_per_token, "total"), 24);
  EXPECT_EQ(half.state_slot_bytes, slot);  // state stays fp32

  // Without prefix caching there are no snapshot slots, and their memory becomes rows.
  const CachePlan no_prefix = plan_cache(spec, make_config(4, "float32", 10 * row + 4 * slot, 2, false));
  EXPECT_EQ(no_prefix.num_snapshot_slots, 0);
  EXPECT_EQ(no_prefix.num_blocks, 11);
}

TEST(CachePlanner, RejectsWhatItCannotPlan) {
  EXPECT_THROW(plan_cache(attention_spec(4), make_config(48, "float32", kGiB)), Error);   // not a power of two
  EXPECT_THROW(plan_cache(attention_spec(4), make_config(64, "nvfp4", kGiB)), Error);    // 4 is no multiple of 16
  EXPECT_THROW(plan_cache(attention_spec(4), make_config(64, "fp6", kGiB)), Error);      // no such dtype
  EXPECT_THROW(plan_cache(attention_spec(4), make_config(64, "float32", 1000)), Error);  // no room for a row
  EXPECT_THROW(plan_cache(hybrid_spec(), make_config(4, "float32", 4 * 64 + 100)), Error);  // the slots fill it
  EXPECT_EQ(parse_cache_dtype("auto"), CacheDtype::Float32);
}

TEST(CachePlanner, SummaryNamesEveryFigure) {
  const CachePlan plan = plan_cache(hybrid_spec(), make_config(4, "bfloat16", 64 * 1024, 2));
  const std::string text = plan.summary(100);
  for (const char* part : {"bfloat16", "4-token blocks", "mla_latent", "conv_tail", "recurrent", "full contexts of 100"})
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing from:\n" << text;
}

// Every fixture family, float32 (4 bytes a float), from the fixture's config.json.
TEST(CachePlanner, BytesPerTokenOfTheFixtureFamilies) {
  struct Expected {
    const char* fixture;
    int64_t mla, dsa, gqa, msa, total, conv, recurrent;
  };
  const Expected expected[] = {
      // 3 layers of MLA (kv_lora_rank 32 + rope 8 = 40 floats) + DSA (index_head_dim 16).
      {"deepseek_v32", 3 * 40 * 4, 3 * 16 * 4, -1, -1, 3 * 56 * 4, -1, -1},
      // 2 MLA layers of 40 floats; 2 KDA layers of 4 heads x 16: conv tail (4-1) x 3 x 64 floats,
      // recurrent 4 x 16 x 16 floats.
      {"kimi_linear", 2 * 40 * 4, -1, -1, -1, 2 * 40 * 4, 2 * 3 * 192 * 4, 2 * 1024 * 4},
      // Kimi K3: 3 MLA layers of kv_lora_rank 16 + 4 = 20 floats; 5 KDA layers of 4 heads x 16.
      {"kimi_k3", 3 * 20 * 4, -1, -1, -1, 3 * 20 * 4, 5 * 3 * 192 * 4, 5 * 1024 * 4},
      // K3.1 Pro: the same with a DSA indexer (index_head_dim 16) on the 3 MLA layers.
      {"kimi_k3_1_pro", 3 * 20 * 4, 3 * 16 * 4, -1, -1, 3 * 36 * 4, 5 * 3 * 192 * 4, 5 * 1024 * 4},
      // 3 GQA layers of 2 kv heads x 16 for K and V; MSA index keys (16) on layers 1 and 2.
      {"minimax_m3", -1, -1, 3 * 64 * 4, 2 * 16 * 4, (3 * 64 + 2 * 16) * 4, -1, -1},
      {"minimax_m3_vl", -1, -1, 3 * 64 * 4, 2 * 16 * 4, (3 * 64 + 2 * 16) * 4, -1, -1},
  };
  for (const Expected& e : expected) {
    SCOPED_TRACE(e.fixture);
    const auto spec = spec_of_config_file(source_path("tests/fixtures") / e.fixture / "config.json");
    const CachePlan plan = plan_cache(spec, make_config(64, "float32", kGiB));
    EXPECT_EQ(component(plan.bytes_per_token, "mla_latent"), e.mla);
    EXPECT_EQ(component(plan.bytes_per_token, "dsa_index_key"), e.dsa);
    EXPECT_EQ(component(plan.bytes_per_token, "gqa_kv"), e.gqa);
    EXPECT_EQ(component(plan.bytes_per_token, "msa_index_key"), e.msa);
    EXPECT_EQ(component(plan.bytes_per_token, "total"), e.total);
    EXPECT_EQ(component(plan.state_bytes_per_sequence, "conv_tail"), e.conv);
    EXPECT_EQ(component(plan.state_bytes_per_sequence, "recurrent"), e.recurrent);
  }
}

// Real models in bfloat16 (2 bytes a value), from the shape configs in bench/shapes/.
TEST(CachePlanner, BytesPerTokenOfRealModelsInBfloat16) {
  const CacheConfig config = make_config(64, "bfloat16", 64 * kGiB, /*max_num_seqs=*/4);
  {
    SCOPED_TRACE("DeepSeek-V3.2");
    const CachePlan plan = plan_cache(spec_of_config_file(source_path("bench/shapes/deepseek_v3.2.json")), config);
    // 61 layers x (MLA 512 + 64 values = 1,152 B, index key 128 values = 256 B).
    EXPECT_EQ(component(plan.bytes_per_token, "mla_latent"), 61 * 1152);  // 70,272
    EXPECT_EQ(component(plan.bytes_per_token, "dsa_index_key"), 61 * 256);  // 15,616
    EXPECT_EQ(component(plan.bytes_per_token, "total"), 85888);
    EXPECT_EQ(plan.row_bytes, 64 * 85888);  // every page a multiple of 64 bytes: no padding
    EXPECT_EQ(plan.state_slot_bytes, 0);
    // 64 GiB / 5,496,832 B = 12,501 rows = 800,064 tokens; a 163,840-token context takes 2,560 rows.
    EXPECT_EQ(plan.num_blocks, 12501);
    EXPECT_EQ(plan.full_contexts(163840), 4);
  }
  {
    SCOPED_TRACE("Kimi-Linear-48B-A3B");
    const CachePlan plan = plan_cache(spec_of_config_file(source_path("bench/shapes/kimi_linear_48b.json")), config);
    // 7 MLA layers x 1,152 B; 20 KDA layers x (conv tail 3 x 3 x 4,096 floats = 147,456 B,
    // recurrent 32 x 128 x 128 floats = 2,097,152 B), fp32.
    EXPECT_EQ(component(plan.bytes_per_token, "mla_latent"), 8064);
    EXPECT_EQ(component(plan.bytes_per_token, "total"), 8064);
    EXPECT_EQ(component(plan.state_bytes_per_sequence, "conv_tail"), 20 * 147456);     // 2,949,120
    EXPECT_EQ(component(plan.state_bytes_per_sequence, "recurrent"), 20 * 2097152);    // 41,943,040
    EXPECT_EQ(component(plan.state_bytes_per_sequence, "total"), 44892160);
    EXPECT_EQ(plan.state_slot_bytes, 44892160);
    // 4 running + 4 snapshot slots take 359,137,280 B; the rest of 64 GiB holds
    // (68,719,476,736 - 359,137,280) / 516,096 = 132,456 rows.
    EXPECT_EQ(plan.row_bytes, 64 * 8064);
    EXPECT_EQ(plan.num_blocks, 132456);
    EXPECT_EQ(plan.full_contexts(1048576), 4);  // rows for 8 contexts of 1M tokens (16,384 rows each), 4 state slots
  }
  {
    SCOPED_TRACE("Kimi K3.1 Pro");
    const CachePlan plan = plan_cache(spec_of_config_file(source_path("bench/shapes/kimi_k3.1_pro.json")), config);
    // 24 MLA + DSA layers x (1,152 + 256 B); 69 KDA layers x (conv tail 3 x 3 x 12,288 floats =
    // 442,368 B, recurrent 96 x 128 x 128 floats = 6,291,456 B).
    EXPECT_EQ(component(plan.bytes_per_token, "mla_latent"), 24 * 1152);  // 27,648
    EXPECT_EQ(component(plan.bytes_per_token, "dsa_index_key"), 24 * 256);  // 6,144
    EXPECT_EQ(component(plan.bytes_per_token, "total"), 33792);
    EXPECT_EQ(component(plan.state_bytes_per_sequence, "conv_tail"), 69 * 442368);     // 30,523,392
    EXPECT_EQ(component(plan.state_bytes_per_sequence, "recurrent"), 69 * 6291456);    // 434,110,464
    EXPECT_EQ(component(plan.state_bytes_per_sequence, "total"), 464633856);
  }
  {
    SCOPED_TRACE("MiniMax-M3.1");
    const CachePlan plan = plan_cache(spec_of_config_file(source_path("bench/shapes/minimax_m3.1.json")), config);
    // 60 layers x K and V of 4 heads x 128 (2,048 B); index keys of 128 (256 B) on the 57 MSA layers.
    EXPECT_EQ(component(plan.bytes_per_token, "gqa_kv"), 60 * 2048);  // 122,880
    EXPECT_EQ(component(plan.bytes_per_token, "msa_index_key"), 57 * 256);  // 14,592
    EXPECT_EQ(component(plan.bytes_per_token, "total"), 137472);
  }
}

// The cache spec from a config alone is the one the loaded model reports.
TEST(CacheSpec, FromConfigMatchesTheLoadedModel) {
  for (const fs::directory_entry& entry : fs::directory_iterator(source_path("tests/fixtures"))) {
    if (!fs::exists(entry.path() / "config.json")) continue;
    if (entry.path().filename().string().ends_with("_dspark")) continue;  // drafters (model/dspark.h)
    if (entry.path().filename().string().ends_with("_vision")) continue;  // a vision tower alone (kimi_k3_vision.h)
    SCOPED_TRACE(entry.path().filename().string());
    const std::unique_ptr<Model> model = load_model(entry.path().string());
    EXPECT_EQ(spec_of_config_file(entry.path() / "config.json"), model->cache_spec());
  }
}

// ---------------------------------------------------------------------------------------------
// Block pool

TEST(CachePool, AllocatesWholeBlocksAndFreesEverything) {
  // One layer of 2 floats, 4-token blocks of 32 bytes padded to 64: 10 rows.
  KvCache cache(attention_spec(2), make_config(4, "float32", 10 * 64));
  ASSERT_EQ(cache.plan().num_blocks, 10);
  const SeqId a = cache.create_sequence(), b = cache.create_sequence();
  EXPECT_TRUE(cache.allocate(a, 5));  // 2 blocks
  EXPECT_EQ(cache.block_table(a).size(), 2u);
  EXPECT_TRUE(cache.allocate(a, 8));  // still 2
  EXPECT_EQ(cache.block_table(a).size(), 2u);
  EXPECT_TRUE(cache.allocate(b, 24));  // 6 blocks
  EXPECT_EQ(cache.num_free_blocks(), 2);
  EXPECT_DOUBLE_EQ(cache.usage(), 0.8);
  EXPECT_FALSE(cache.allocate(a, 17));  // needs 3 more, 2 left: refused, nothing taken
  EXPECT_EQ(cache.block_table(a).size(), 2u);
  EXPECT_EQ(cache.num_free_blocks(), 2);
  cache.free_sequence(a);
  cache.free_sequence(b);
  EXPECT_EQ(cache.num_free_blocks(), cache.plan().num_blocks);
  EXPECT_DOUBLE_EQ(cache.usage(), 0.0);
  EXPECT_THROW(cache.view(a), Error);
}

TEST(CachePool, RowsGoThroughThePageAddressOfTheirBlock) {
  // Two layers: MLA rows of 3 floats and DSA keys of 2; float32, 4-token blocks.
  const std::vector<LayerCacheSpec> spec = {{{{PageKind::MlaLatent, 3}, {PageKind::DsaIndexKey, 2}}, {}},
                                            {{{PageKind::MlaLatent, 3}}, {}}};
  KvCache cache(spec, make_config(4, "float32", 8 * 256));
  const SeqId filler = cache.create_sequence(), seq = cache.create_sequence();
  ASSERT_TRUE(cache.allocate(filler, 4));  // so that seq's blocks do not start at row 0
  ASSERT_TRUE(cache.allocate(seq, 7));
  std::vector<float> rows(7 * 2);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = float(i) + 0.5f;
  SequenceCache& view = *cache.view(seq);
  view.write(0, PageKind::DsaIndexKey, 0, 3, rows.data());
  view.write(0, PageKind::DsaIndexKey, 3, 4, rows.data() + 3 * 2);  // crosses into the second block

  // Token 5 is token 1 of the sequence's second block: at page_offsets[1] + 1 * 2 floats.
  const std::vector<int64_t> offsets = cache.page_offsets(seq, 0, PageKind::DsaIndexKey);
  ASSERT_EQ(offsets.size(), 2u);
  const PagePlacement& page = *cache.plan().page(0, PageKind::DsaIndexKey);
  EXPECT_EQ(offsets[1], cache.block_table(seq)[1] * cache.plan().row_bytes + page.offset);
  float stored[2];
  std::memcpy(stored, cache.pool() + offsets[1] + 1 * 2 * sizeof(float), sizeof stored);
  EXPECT_EQ(stored[0], rows[5 * 2]);
  EXPECT_EQ(stored[1], rows[5 * 2 + 1]);

  std::vector<float> back(7 * 2);
  view.read(0, PageKind::DsaIndexKey, 0, 7, back.data());
  EXPECT_EQ(back, rows);
  EXPECT_THROW(view.read(0, PageKind::DsaIndexKey, 0, 9, back.data()), Error);  // beyond its blocks
  EXPECT_THROW(view.write(1, PageKind::DsaIndexKey, 0, 1, rows.data()), Error);  // layer 1 has no index keys
}

TEST(CachePool, BfloatSixteenRowsRoundToNearestEven) {
  KvCache cache(attention_spec(4), make_config(4, "bfloat16", 4 * 64));
  const SeqId seq = cache.create_sequence();
  ASSERT_TRUE(cache.allocate(seq, 1));
  // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0); 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
  const float rows[4] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f, 1e-3f};
  cache.view(seq)->write(0, PageKind::MlaLatent, 0, 1, rows);
  float back[4];
  cache.view(seq)->read(0, PageKind::MlaLatent, 0, 1, back);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 1.0f + 1.0f / 64);
  EXPECT_EQ(back[2], -2.5f);
  EXPECT_NEAR(back[3], 1e-3f, 1e-3f / 128);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f)), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST(CachePool, StateSlotsStartAtZeroAndAreLimited) {
  KvCache cache(hybrid_spec(), make_config(4, "float32", 64 * 1024, /*max_num_seqs=*/2));
  EXPECT_EQ(cache.num_free_state_slots(), 2);
  const SeqId a = cache.create_sequence();
  float* conv = cache.view(a)->state(1, StateKind::ConvTail);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(conv[i], 0.0f);
  conv[0] = 7;
  cache.view(a)->state(1, StateKind::Recurrent)[4] = 9;
  const SeqId b = cache.create_sequence();
  EXPECT_EQ(cache.view(b)->state(1, StateKind::Recurrent)[4], 0.0f);
  EXPECT_EQ(cache.num_free_state_slots(), 0);
  EXPECT_THROW(cache.create_sequence(), Error);
  cache.free_sequence(a);
  const SeqId c = cache.create_sequence();  // reuses a's slot, cleared
  EXPECT_EQ(cache.view(c)->state(1, StateKind::ConvTail)[0], 0.0f);
  EXPECT_EQ(cache.view(c)->state(1, StateKind::Recurrent)[4], 0.0f);
  EXPECT_THROW(cache.view(c)->state(0, StateKind::ConvTail), Error);  // layer 0 is attention
}

// ---------------------------------------------------------------------------------------------
// Prefix cache (attention-only: no snapshots needed)

namespace {

// Runs a sequence's tokens into the cache as a model would: allocate, write a row per token (its
// token id, so reads can be checked), commit.
void fill(KvCache& cache, SeqId seq, const Tokens& tokens, int64_t from = 0) {
  ASSERT_TRUE(cache.allocate(seq, int64_t(tokens.size())));
  for (int64_t pos = from; pos < int64_t(tokens.size()); ++pos) {
    const float row[2] = {float(tokens[pos]), float(pos)};
    cache.view(seq)->write(0, PageKind::MlaLatent, pos, 1, row);
  }
  cache.commit_tokens(seq, tokens, int64_t(tokens.size()));
}

}  // namespace

TEST(CachePrefix, ReusesTheLongestCachedPrefixButNeverTheLastToken) {
  KvCache cache(attention_spec(2), make_config(4, "float32", 16 * 64));
  const Tokens first = iota_tokens(10, 100);  // blocks [100..103] [104..107], 2 tokens in a third
  const SeqId a = cache.create_sequence();
  EXPECT_EQ(cache.match_prefix(a, first), 0);  // empty cache: a miss
  fill(cache, a, first);
  EXPECT_EQ(cache.num_cached_blocks(), 2);
  cache.free_sequence(a);

  // Same first 9 tokens, then different: both full blocks are reused, the rows are a's.
  Tokens second = first;
  second[9] = 7;
  second.push_back(8);
  const SeqId b = cache.create_sequence();
  EXPECT_EQ(cache.match_prefix(b, second), 8);
  std::vector<float> rows(8 * 2);
  cache.view(b)->read(0, PageKind::MlaLatent, 0, 8, rows.data());
  for (int pos = 0; pos < 8; ++pos) EXPECT_EQ(rows[pos * 2], float(first[pos]));
  fill(cache, b, second, 8);

  // A prompt of exactly two blocks reuses only the first: its last token must be computed.
  const SeqId c = cache.create_sequence();
  EXPECT_EQ(cache.match_prefix(c, Tokens(first.begin(), first.begin() + 8)), 4);
  // A different first token shares nothing, whatever follows (keys are chained).
  Tokens other = first;
  other[0] = 1;
  const SeqId d = cache.create_sequence();
  EXPECT_EQ(cache.match_prefix(d, other), 0);

  EXPECT_EQ(cache.prefix_queries(), 10 + 11 + 8 + 10);
  EXPECT_EQ(cache.prefix_hits(), 8 + 4);
}

TEST(CachePrefix, SharedBlocksAreReferenceCountedAndNeverWritten) {
  KvCache cache(attention_spec(2), make_config(4, "float32", 16 * 64));
  const Tokens prompt = iota_tokens(9, 0);
  const SeqId a = cache.create_sequence();
  fill(cache, a, prompt);
  const SeqId b = cache.create_sequence();
  ASSERT_EQ(cache.match_prefix(b, prompt), 8);
  EXPECT_EQ(cache.block_table(b)[0], cache.block_table(a)[0]);
  EXPECT_EQ(cache.block_table(b)[1], cache.block_table(a)[1]);
  const float row[2] = {0, 0};
  EXPECT_THROW(cache.view(b)->write(0, PageKind::MlaLatent, 3, 1, row), Error);  // a cached block
  cache.free_sequence(a);
  // b still holds the two shared blocks; a's third block is free again.
  EXPECT_EQ(cache.num_free_blocks(), 16 - 2);
  EXPECT_DOUBLE_EQ(cache.usage(), 2.0 / 16);
  cache.free_sequence(b);
  EXPECT_EQ(cache.num_free_blocks(), 16);
  EXPECT_EQ(cache.num_cached_blocks(), 2);  // free, but still cached until their rows are needed
}

TEST(CachePrefix, EvictsLeastRecentlyReleasedBlocksFirstTailFirst) {
  // 6 rows. Two finished sequences of two full blocks each leave 4 cached blocks.
  KvCache cache(attention_spec(2), make_config(4, "float32", 6 * 64));
  const Tokens old_prompt = iota_tokens(9, 0), new_prompt = iota_tokens(9, 50);
  for (const Tokens* prompt : {&old_prompt, &new_prompt}) {
    const SeqId s = cache.create_sequence();
    fill(cache, s, Tokens(prompt->begin(), prompt->begin() + 8));
    cache.free_sequence(s);
  }
  EXPECT_EQ(cache.num_cached_blocks(), 4);
  // A sequence needing 3 rows takes the 2 never-cached rows, then evicts the oldest sequence's tail block.
  const SeqId big = cache.create_sequence();
  ASSERT_TRUE(cache.allocate(big, 12));
  EXPECT_EQ(cache.num_cached_blocks(), 3);
  const SeqId probe = cache.create_sequence();
  EXPECT_EQ(cache.match_prefix(probe, old_prompt), 4);  // its first block survived
  cache.free_sequence(probe);
  const SeqId probe2 = cache.create_sequence();
  EXPECT_EQ(cache.match_prefix(probe2, new_prompt), 8);  // the newer sequence is intact
  cache.free_sequence(probe2);
  cache.free_sequence(big);
  EXPECT_EQ(cache.num_free_blocks(), 6);
}

TEST(CachePrefix, RecurrentModelsResumeOnlyWhereAStateWasSaved) {
  // Block 4; the model is simulated: each step writes rows and, when asked, a snapshot of its state
  // (set to the step's last position, so restores can be checked).
  KvCache cache(hybrid_spec(), make_config(4, "float32", 64 * 1024, /*max_num_seqs=*/2));
  const Tokens prompt = iota_tokens(14, 0);
  auto run_step = [&](SeqId seq, const Tokens& tokens, int64_t begin, int64_t end) {
    if (!cache.allocate(seq, end)) fail("out of blocks");
    SequenceCache& view = *cache.view(seq);
    std::vector<float> rows((end - begin) * 2, 1.0f);
    view.write(0, PageKind::MlaLatent, begin, end - begin, rows.data());
    const int64_t snap = view.snapshot_position(begin, end);
    EXPECT_EQ(snap, view.snapshot_position(begin, end));  // the same answer for every layer
    if (snap > 0) {
      std::fill_n(view.snapshot(1, StateKind::ConvTail), 3, float(snap));
      std::fill_n(view.snapshot(1, StateKind::Recurrent), 5, float(snap));
    }
    std::fill_n(view.state(1, StateKind::Recurrent), 5, float(end));
    cache.commit_tokens(seq, tokens, end);
    return snap;
  };

  const SeqId a = cache.create_sequence();
  EXPECT_EQ(run_step(a, prompt, 0, 6), 4);    // state saved at 4
  EXPECT_EQ(run_step(a, prompt, 6, 7), -1);   // no boundary reached
  EXPECT_EQ(run_step(a, prompt, 7, 13), 12);  // the last boundary of the step: 12, not 8
  cache.free_sequence(a);
  EXPECT_EQ(cache.num_cached_blocks(), 3);

  // Blocks up to 12 are cached, but the state exists at 4 and 12 only.
  const SeqId b = cache.create_sequence();
  EXPECT_EQ(cache.match_prefix(b, prompt), 12);
  EXPECT_EQ(cache.view(b)->state(1, StateKind::Recurrent)[0], 12.0f);
  EXPECT_EQ(cache.view(b)->state(1, StateKind::ConvTail)[2], 12.0f);
  const SeqId c = cache.create_sequence();
  Tokens diverging = prompt;
  diverging[10] = 99;  // shares blocks 0 and 1 (8 tokens), but there is no state at 8
  EXPECT_EQ(cache.match_prefix(c, diverging), 4);
  EXPECT_EQ(cache.view(c)->state(1, StateKind::Recurrent)[0], 4.0f);
}

// ---------------------------------------------------------------------------------------------
// Exactness on the fixture models

namespace {

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(source_path("tests/fixtures")))
    if (fs::exists(entry.path() / "prompts.json")) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<Tokens> fixture_prompts(const std::string& name) {
  std::ifstream in(source_path("tests/fixtures") / name / "prompts.json");
  const nlohmann::json json = nlohmann::json::parse(in);
  std::vector<Tokens> prompts;
  for (const auto& p : json.at("prompts")) prompts.push_back(p.get<Tokens>());
  return prompts;
}

// One sequence on a KvCache, driven like the engine drives it.
struct PagedSequence {
  KvCache& cache;
  SeqId id;
  SequenceState state;
  Tokens tokens;
  std::vector<Tokens> steps;  // the new tokens of every step so far

  explicit PagedSequence(KvCache& c) : cache(c), id(c.create_sequence()) { state.cache = c.view(id); }
  ~PagedSequence() { cache.free_sequence(id); }

  int64_t match(const Tokens& prompt) {
    state.length = cache.match_prefix(id, prompt);
    tokens.assign(prompt.begin(), prompt.begin() + state.length);
    return state.length;
  }
  // One step: the logits of every new token.
  Tensor step(Model& model, const Tokens& new_tokens) {
    if (!cache.allocate(id, state.length + int64_t(new_tokens.size()))) fail("out of blocks");
    Tensor logits = sparrow::testing::run_step(model, make_batch({{&state, new_tokens}}));
    tokens.insert(tokens.end(), new_tokens.begin(), new_tokens.end());
    steps.push_back(new_tokens);
    cache.commit_tokens(id, tokens, state.length);
    return logits;
  }
};

int32_t argmax(const float* row, int64_t n) { return int32_t(std::max_element(row, row + n) - row); }

// The largest relative L2 distance between the rows of b and the matching rows of a, from a's row a_from.
double worst_row_error(const Tensor& a, const Tensor& b, int64_t a_from = 0) {
  double worst = 0;
  for (int64_t r = 0; r < b.dim(0); ++r) {
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < b.dim(1); ++i) {
      const double d = double(a.row(a_from + r)[i]) - b.row(r)[i];
      diff += d * d;
      norm += double(b.row(r)[i]) * b.row(r)[i];
    }
    worst = std::max(worst, std::sqrt(diff / std::max(norm, 1e-300)));
  }
  return worst;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), sizeof(float) * a.numel()) == 0;
}

// 32 MiB per fixture model: hundreds of rows, and 16 state slots of the GPU fixtures (9 MB for kimi_linear_gpu).
constexpr int64_t kFixtureCacheBytes = int64_t(32) << 20;
// Logits of one computation scheduled differently (one prefill instead of a prefill and decodes):
// fp32 reordering only, like reference_test's consistency tolerance; measured <= 3e-6 here.
constexpr double kReorderingTolerance = 1e-5;

}  // namespace

class CacheExactness : public ::testing::TestWithParam<std::string> {};

// A first request runs its prompt (in prefill chunks of `chunk` tokens) and 60 greedy tokens; a second
// request repeats part of that. With the prefix-cache hit its logits are bit for bit those of the same
// steps run on an empty cache, for every family: attention rows come from the shared blocks, recurrent
// state from the snapshot at the hit's boundary. Against one prefill of the whole second prompt (another
// schedule) they agree to fp32 reordering.
TEST_P(CacheExactness, PrefixHitResumesExactly) {
  const std::unique_ptr<Model> model = load_model((source_path("tests/fixtures") / GetParam()).string());
  const std::vector<Tokens> prompts = fixture_prompts(GetParam());
  const Tokens& first_prompt = prompts[2];
  const Tokens& other = prompts[1];

  struct Case {
    int64_t block_size, chunk;
    bool whole_history;  // the second prompt extends the first conversation, or shares 70 prompt tokens
    int64_t expected_hit;
  };
  // Whole history: the decode step ending at 128 left a snapshot there. Part: a prefill chunk ended at 64,
  // or the one-step prefill stopped there to save it.
  for (const Case& c : {Case{64, 1 << 20, true, 128}, Case{16, 32, false, 64}, Case{64, 64, false, 64},
                        Case{64, 1 << 20, false, 64}}) {
    SCOPED_TRACE(cat("block size ", c.block_size, ", chunks of ", c.chunk,
                     c.whole_history ? ", whole history" : ", part of the prompt"));
    // 16 snapshot slots keep every state the first request saves (at most one per block: 8 here).
    const CacheConfig config = make_config(c.block_size, "float32", kFixtureCacheBytes, /*max_num_seqs=*/16);
    KvCache cache(model->cache_spec(), config);
    Tokens second_prompt;
    std::vector<Tokens> first_steps;
    {
      PagedSequence first(cache);
      first.match(first_prompt);
      Tensor logits;
      for (int64_t done = 0; done < int64_t(first_prompt.size()); done += c.chunk) {
        const int64_t end = std::min<int64_t>(first_prompt.size(), done + c.chunk);
        logits = first.step(*model, Tokens(first_prompt.begin() + done, first_prompt.begin() + end));
      }
      // (60 tokens: after the shortest such prompt, Kimi K3's 70, a decode step still crosses position 128.)
      for (int i = 0; i < 60; ++i) logits = first.step(*model, {argmax(logits.row(logits.dim(0) - 1), logits.dim(1))});
      second_prompt = c.whole_history ? first.tokens : Tokens(first_prompt.begin(), first_prompt.begin() + 70);
      second_prompt.insert(second_prompt.end(), other.begin(), other.end());
      first_steps = first.steps;
    }

    PagedSequence hit(cache);
    const int64_t reused = hit.match(second_prompt);
    ASSERT_EQ(reused, c.expected_hit);
    const Tensor with_hit = hit.step(*model, Tokens(second_prompt.begin() + reused, second_prompt.end()));

    // The same steps on an empty cache: the first request's steps up to the hit, then the rest.
    KvCache empty(model->cache_spec(), config);
    PagedSequence twin(empty);
    ASSERT_EQ(twin.match(second_prompt), 0);
    // A hit inside one of those steps cuts it there: the same rows and state, but from a shorter batch,
    // so equal only to fp32 reordering.
    bool same_batches = true;
    for (const Tokens& step : first_steps) {
      const int64_t left = reused - twin.state.length;
      if (left == 0) break;
      same_batches = same_batches && left >= int64_t(step.size());
      twin.step(*model, Tokens(step.begin(), step.begin() + std::min<int64_t>(left, step.size())));
    }
    const Tensor without_hit = twin.step(*model, Tokens(second_prompt.begin() + reused, second_prompt.end()));
    if (same_batches)
      EXPECT_TRUE(bitwise_equal(with_hit, without_hit)) << "relative L2 " << worst_row_error(with_hit, without_hit);
    else
      EXPECT_LE(worst_row_error(with_hit, without_hit), kReorderingTolerance);

    // One prefill of the whole second prompt, on the private growable cache.
    SequenceState dense = sparrow::testing::new_sequence(*model);
    const Tensor one_prefill = sparrow::testing::run_step(*model, make_batch({{&dense, second_prompt}}));
    EXPECT_LE(worst_row_error(one_prefill, with_hit, reused), kReorderingTolerance);
  }
}

// The paged float32 cache computes exactly what the private growable one does.
TEST_P(CacheExactness, PagedFloat32EqualsTheGrowableCache) {
  const std::unique_ptr<Model> model = load_model((source_path("tests/fixtures") / GetParam()).string());
  const Tokens prompt = fixture_prompts(GetParam())[2];
  // Without prefix caching (no snapshots, so recurrent passes are never split), prefill then decodes.
  KvCache cache(model->cache_spec(), make_config(16, "float32", kFixtureCacheBytes, 4, /*prefix_caching=*/false));
  PagedSequence paged(cache);
  SequenceState dense = sparrow::testing::new_sequence(*model);
  Tokens next(prompt.begin(), prompt.end() - 3);
  for (int i = 0; i < 4; ++i) {
    const Tensor a = paged.step(*model, next);
    const Tensor b = sparrow::testing::run_step(*model, make_batch({{&dense, next}}));
    EXPECT_TRUE(bitwise_equal(a, b)) << "step " << i << ": relative L2 " << worst_row_error(a, b);
    next = {prompt[prompt.size() - 3 + std::min(i, 2)]};
  }
}

// A bfloat16 cache rounds every cached row: the logits move a little, not a lot. Compared where every
// query attends to all its keys (16 tokens: below the fixtures' DSA top-k and MSA top blocks), since
// rounded index keys may legitimately select other keys in these tiny random models. Rounding can also
// flip a near-tied MoE routing choice, which moves that one position a lot (seen: 0.17 at one position of
// deepseek_v32), so the measure is the median position; a wrong row layout would move them all.
TEST_P(CacheExactness, BfloatSixteenCacheStaysCloseToFloat32) {
  const std::unique_ptr<Model> model = load_model((source_path("tests/fixtures") / GetParam()).string());
  const std::vector<Tokens> prompts = fixture_prompts(GetParam());
  KvCache cache(model->cache_spec(), make_config(16, "bfloat16", kFixtureCacheBytes));
  PagedSequence half(cache);
  SequenceState full = sparrow::testing::new_sequence(*model);
  Tokens next(prompts[0].begin(), prompts[0].begin() + 8);
  std::vector<double> errors;  // per position
  while (half.state.length < 16) {  // a prefill, then decodes
    const Tensor a = half.step(*model, next);
    const Tensor b = sparrow::testing::run_step(*model, make_batch({{&full, next}}));
    for (int64_t r = 0; r < b.dim(0); ++r) errors.push_back(worst_row_error(a.rows(r, r + 1), b.rows(r, r + 1)));
    next = {argmax(b.row(b.dim(0) - 1), b.dim(1))};
  }
  std::sort(errors.begin(), errors.end());
  const double median = errors[errors.size() / 2];
  EXPECT_GT(median, 0.0);  // it did round
  EXPECT_LE(median, 1e-2);

  // Long prompts run too (selections may differ from float32 there).
  PagedSequence longer(cache);
  const Tensor logits = longer.step(*model, prompts[2]);
  for (int64_t i = 0; i < logits.numel(); ++i) ASSERT_TRUE(std::isfinite(logits.data()[i]));
}

// Every cache format runs every family on the CPU, whose mixers read their pages back through the page
// codecs: a prefill and decodes give logits close to the float32 cache's (the median position, as
// above; FP4 rounds far more than bfloat16), and a long prompt (sparse selections) gives finite logits.
TEST_P(CacheExactness, EveryCacheFormatRunsTheFamily) {
  const std::unique_ptr<Model> model = load_model((source_path("tests/fixtures") / GetParam()).string());
  const std::vector<Tokens> prompts = fixture_prompts(GetParam());
  bool has_index_keys = false;
  for (const LayerCacheSpec& layer : model->cache_spec())
    has_index_keys |= layer.page(PageKind::DsaIndexKey) || layer.page(PageKind::MsaIndexKey);
  for (const char* kv : {"bfloat16", "fp8", "fp8_per_tensor", "nvfp4"}) {
    for (const char* index : {"auto", "bfloat16", "fp8", "mxfp4", "nvfp4"}) {
      if (!has_index_keys && std::string(index) != "auto") continue;
      SCOPED_TRACE(cat("--kv-cache-dtype ", kv, ", indexer_kv_dtype ", index));
      CacheConfig config = make_config(16, kv, kFixtureCacheBytes);
      config.indexer_kv_dtype = index;
      KvCache cache(model->cache_spec(), config);
      PagedSequence paged(cache);
      SequenceState full = sparrow::testing::new_sequence(*model);
      Tokens next(prompts[0].begin(), prompts[0].begin() + 8);
      std::vector<double> errors;
      while (paged.state.length < 16) {
        const Tensor a = paged.step(*model, next);
        const Tensor b = sparrow::testing::run_step(*model, make_batch({{&full, next}}));
        for (int64_t r = 0; r < b.dim(0); ++r) errors.push_back(worst_row_error(a.rows(r, r + 1), b.rows(r, r + 1)));
        next = {argmax(b.row(b.dim(0) - 1), b.dim(1))};
      }
      std::sort(errors.begin(), errors.end());
      const double median = errors[errors.size() / 2];
      // These random tiny models amplify rounding: measured medians are about 0.002-0.006 for bfloat16
      // (2^-9 relative rounding), 0.03-0.18 for FP8 (2^-4) and 0.14-0.43 for NVFP4 (up to 1/3), the
      // same whatever the index keys (16 tokens select every key); reading a neighbouring token's NVFP4 row
      // instead gives 0.63-1.1. Every layout is checked byte for byte in cache_formats_test.cpp.
      const std::string k(kv);
      EXPECT_GT(median, 0.0);
      EXPECT_LE(median, k == "bfloat16" ? 0.01 : k == "nvfp4" ? 0.5 : 0.25) << "median relative L2 of the logits";

      PagedSequence longer(cache);
      const Tensor logits = longer.step(*model, prompts[2]);
      for (int64_t i = 0; i < logits.numel(); ++i) ASSERT_TRUE(std::isfinite(logits.data()[i]));
    }
  }
}

// The CPU fixtures: the cases above place their hits by those prompts' lengths (the GPU fixtures' 140-token
// prompts leave their snapshots elsewhere; kimi_gpu_test checks prefix hits on those, on the GPU).
std::vector<std::string> cpu_fixture_names() {
  std::vector<std::string> names;
  for (const std::string& name : fixture_names())
    if (!name.ends_with("_gpu")) names.push_back(name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Cache, CacheExactness, ::testing::ValuesIn(cpu_fixture_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---- FP8 pages (DeepSeek-V3.2's formats): FlashMLA's 656-byte latent and the 132-byte index key ----

namespace {

std::vector<float> random_rows(int64_t count, int64_t width, uint32_t seed) {
  std::vector<float> rows(count * width);
  uint32_t state = seed;
  for (float& x : rows) {
    state = state * 1664525u + 1013904223u;
    x = (float(state >> 8) / float(1 << 24) - 0.5f) * 6.0f;
  }
  return rows;
}

}  // namespace

TEST(PageCodec, Fp8LatentIsFlashMlasLayout) {
  const PageSpec spec{PageKind::MlaLatent, 576, 64};
  const PageCodec& codec = page_codec(CacheDtype::Fp8, PageKind::MlaLatent);
  EXPECT_EQ(codec.format(), PageFormat::Fp8Latent);
  EXPECT_EQ(codec.page_bytes(spec, 64), 64 * 656);  // 512 e4m3 + 4 fp32 scales + 64 bf16
  std::vector<std::byte> page(codec.page_bytes(spec, 64));
  std::vector<float> rows = random_rows(5, 576, 7);
  std::fill(rows.begin() + 576, rows.begin() + 576 + 128, 0.0f);  // a group of zeros: scale 0, codes 0
  codec.encode(spec, 64, rows.data(), 3, 5, page.data());
  std::vector<float> back(5 * 576);
  codec.decode(spec, 64, page.data(), 3, 5, back.data());
  for (int64_t t = 0; t < 5; ++t) {
    const std::byte* token = page.data() + (3 + t) * 656;
    for (int g = 0; g < 4; ++g) {
      float scale;
      std::memcpy(&scale, token + 512 + 4 * g, 4);
      float amax = 0;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(rows[t * 576 + g * 128 + i]));
      EXPECT_EQ(scale, amax / 448.0f);
      for (int i = 0; i < 128; ++i) {  // e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative
        const float x = rows[t * 576 + g * 128 + i], y = back[t * 576 + g * 128 + i];
        EXPECT_LE(std::fabs(y - x), std::max(std::fabs(x) / 16.0f, scale * 0.002f)) << t << " " << g << " " << i;
        if (x == 0.0f) EXPECT_EQ(y, 0.0f);
      }
    }
    for (int i = 512; i < 576; ++i) EXPECT_EQ(back[t * 576 + i], bf16_to_float(float_to_bf16(rows[t * 576 + i])));
  }
  // A NoPE part that is no multiple of 128 (the tiny test models) ends in a shorter group with its own scale.
  const PageSpec small{PageKind::MlaLatent, 200, 8};  // 192 NoPE values: groups of 128 and 64
  EXPECT_EQ(codec.page_bytes(small, 4), 4 * (192 + 2 * 4 + 2 * 8));
  std::vector<std::byte> small_page(codec.page_bytes(small, 4));
  const std::vector<float> small_rows = random_rows(1, 200, 5);
  codec.encode(small, 4, small_rows.data(), 1, 1, small_page.data());
  float second_scale, amax = 0;
  std::memcpy(&second_scale, small_page.data() + 216 + 192 + 4, 4);
  for (int i = 128; i < 192; ++i) amax = std::max(amax, std::fabs(small_rows[i]));
  EXPECT_EQ(second_scale, amax / 448.0f);
  EXPECT_THROW(codec.page_bytes({PageKind::MlaLatent, 8, 8}, 64), Error);  // no NoPE part
}

TEST(PageCodec, Fp8IndexKeysAreValuesThenScales) {
  const PageSpec spec{PageKind::DsaIndexKey, 128, 0};
  const PageCodec& codec = page_codec(CacheDtype::Fp8, PageKind::DsaIndexKey);
  EXPECT_EQ(codec.format(), PageFormat::Fp8IndexKey);
  EXPECT_EQ(codec.page_bytes(spec, 64), 64 * 132);
  std::vector<std::byte> page(codec.page_bytes(spec, 64));
  const std::vector<float> rows = random_rows(2, 128, 11);
  codec.encode(spec, 64, rows.data(), 62, 2, page.data());
  std::vector<float> back(2 * 128);
  codec.decode(spec, 64, page.data(), 62, 2, back.data());
  for (int t = 0; t < 2; ++t) {
    float scale;
    std::memcpy(&scale, page.data() + 64 * 128 + (62 + t) * 4, 4);  // the scales follow all values
    EXPECT_GT(scale, 0.0f);
    for (int i = 0; i < 128; ++i)
      EXPECT_LE(std::fabs(back[t * 128 + i] - rows[t * 128 + i]), std::fabs(rows[t * 128 + i]) / 16.0f + 1e-6f);
  }
  EXPECT_EQ(page_codec(CacheDtype::Fp8, PageKind::GqaKeyValue).format(), PageFormat::Fp8Rows);
  EXPECT_THROW(page_codec(CacheDtype::Mxfp4, PageKind::GqaKeyValue), Error);  // MXFP4 is for index keys only
}

TEST(CachePlanner, DeepSeekV32InFp8Is656Plus132BytesPerLayer) {
  const Config config = Config::load((std::filesystem::path(SPARROW_SOURCE_DIR) / "bench/shapes/deepseek_v3.2.json").string());
  const std::vector<LayerCacheSpec> spec = cache_spec_from_config(config);
  const CachePlan plan = plan_cache(spec, make_config(64, "fp8", int64_t(8) << 30));
  const int64_t layers = int64_t(spec.size());
  for (const auto& [component, bytes] : plan.bytes_per_token) {
    if (component == "mla_latent") EXPECT_EQ(bytes, 656 * layers);
    if (component == "dsa_index_key") EXPECT_EQ(bytes, 132 * layers);
  }
  EXPECT_EQ(parse_cache_dtype("fp8_e4m3"), CacheDtype::Fp8);
  EXPECT_EQ(parse_cache_dtype("auto", Device::Cuda), CacheDtype::BFloat16);
}
