// GQA attention over the paged K/V cache (src/kernels/cuda/gqa) against a float64 CPU loop over the same
// values, dense causal and MSA block-sparse, decode and prefill, in every K/V page format (bf16, FP8 rows,
// NVFP4 rows: the pages are encoded by the CPU page codec and the reference reads the codec's decoded
// values); and the K/V cache write, byte for byte the CPU codec's (bf16: a copy).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cache/page_codec.h"
#include "core/bfloat16.h"
#include "gpu_test_util.h"
#include "kernels/cuda/gqa/gqa_attention.h"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {
namespace {

static_assert(kGqaKvTensorScale == kKvTensorScale, "the GPU kernels and the CPU codec disagree on the scale");

const PageFormat kFormats[] = {PageFormat::BFloat16, PageFormat::Fp8Rows, PageFormat::Nvfp4Rows};
CacheDtype dtype_of(PageFormat f) {
  if (f == PageFormat::BFloat16) return CacheDtype::BFloat16;
  return f == PageFormat::Fp8Rows ? CacheDtype::Fp8 : CacheDtype::Nvfp4;
}
const PageCodec& codec_of(PageFormat f) { return page_codec(dtype_of(f), PageKind::GqaKeyValue); }
const char* name_of(PageFormat f) { return cache_dtype_name(dtype_of(f)); }

float bf16_at(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return bf16_to_float(b);
}

uint64_t fresh_seed() { return std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32); }

// A fast stream of uniform values (splitmix64) for filling large caches.
struct FastRandom {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform(float a) { return (float(next() >> 40) * (2.0f / 16777216.0f) - 1.0f) * a; }  // [-a, a)
};

struct Shape {
  const char* name;
  int heads, kv_heads, head_dim;
  int index_heads, index_block, max_blocks;  // MSA selection
};
// The test fixture's tiny model, MiniMax-M3.1-like (whole model: 64 heads over 4 kv heads, but 16 / 4 here),
// MiniMax-M3.1 at TP4 (one kv head and 16 query heads per GPU), and odd groupings.
const Shape kFixture{"fixture", 4, 2, 16, 2, 8, 3};
const Shape kMiniMax{"minimax", 16, 4, 128, 4, 128, 16};
const Shape kMiniMaxTp4{"minimax_tp4", 16, 1, 128, 1, 128, 16};
const Shape kWide{"wide", 64, 2, 64, 8, 64, 8};    // 32 heads per kv head, 8 per index head
const Shape kOdd{"odd", 12, 4, 256, 6, 32, 5};     // 3 heads per kv head, 2 per index head
const Shape kMqa{"mqa", 48, 1, 80, 2, 16, 10};     // head_dim 80 (padded bucket), 24 heads per index head

// A paged pool holding lens[s] tokens per sequence in pages scattered at random, 0xFF bytes (NaN) wherever
// no token lives, rows of random K/V (uniform in [-amplitude, amplitude], rounded to bf16) in bf16 pages:
// `pool`, which the reference reads. For a narrow format the rows are also encoded by the CPU page codec
// into pages of that format (`narrow`, `narrow_table`, what the kernel reads), and the bf16 rows are
// replaced by the codec's decoded values (exactly bf16 values), so both pools hold the same numbers.
struct PagedKv {
  int kv_heads, head_dim, block_size;
  int64_t row_bytes = 0, stride = 1;
  std::vector<uint8_t> pool;
  std::vector<int64_t> page_table;
  PageFormat format = PageFormat::BFloat16;
  std::vector<uint8_t> narrow;
  std::vector<int64_t> narrow_table;

  PagedKv(const std::vector<int>& lens, int kvh, int d, int bs, std::mt19937_64& rng, bool fill_rows,
          PageFormat f = PageFormat::BFloat16, float amplitude = 1.0f)
      : kv_heads(kvh), head_dim(d), block_size(bs), format(f) {
    row_bytes = int64_t(4) * kv_heads * head_dim;
    const int64_t page_bytes = block_size * row_bytes + 48;  // other layers' pages sit between ours
    int64_t total_pages = 0;
    for (int len : lens) {
      const int64_t pages = (len + block_size - 1) / block_size;
      stride = std::max(stride, pages + 1);  // a spare entry per sequence, never used
      total_pages += pages;
    }
    total_pages += 3;  // unused pages
    std::vector<int64_t> slots(total_pages);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    pool.assign(size_t(total_pages * page_bytes), 0xff);
    page_table.assign(lens.size() * stride, -1);
    int64_t next = 0;
    FastRandom fr{rng()};
    for (size_t s = 0; s < lens.size(); ++s) {
      const int64_t pages = (lens[s] + block_size - 1) / block_size;
      for (int64_t i = 0; i < pages; ++i) page_table[s * stride + i] = slots[next++] * page_bytes;
      if (!fill_rows) continue;
      for (int j = 0; j < lens[s]; ++j) {
        uint8_t* dst = row(int(s), j);
        for (int64_t i = 0; i < row_bytes / 2; ++i) {
          const uint16_t b = float_to_bf16(fr.uniform(amplitude));
          std::memcpy(dst + 2 * i, &b, 2);
        }
      }
    }
    if (format == PageFormat::BFloat16) return;
    // The narrow pages: the same page order (slot i of the bf16 pool -> slot i here), their own size.
    const int64_t narrow_page = codec_of(format).page_bytes(spec(), block_size) + 48;
    narrow.assign(size_t(total_pages * narrow_page), 0xff);
    narrow_table.assign(page_table.size(), -1);
    for (size_t i = 0; i < page_table.size(); ++i)
      if (page_table[i] >= 0) narrow_table[i] = page_table[i] / page_bytes * narrow_page;
    if (!fill_rows) return;
    std::vector<float> values(spec().width), back(spec().width);
    for (size_t s = 0; s < lens.size(); ++s)
      for (int j = 0; j < lens[s]; ++j) {
        uint8_t* src = row(int(s), j);
        for (int64_t i = 0; i < spec().width; ++i) values[i] = bf16_at(src + 2 * i);
        std::byte* page = narrow_page_of(int(s), j);
        codec_of(format).encode(spec(), block_size, values.data(), j % block_size, 1, page);
        codec_of(format).decode(spec(), block_size, page, j % block_size, 1, back.data());
        for (int64_t i = 0; i < spec().width; ++i) {
          const uint16_t b = float_to_bf16(back[i]);
          EXPECT_EQ(bf16_to_float(b), back[i]) << "a decoded value is no bf16 value";
          std::memcpy(src + 2 * i, &b, 2);
        }
      }
  }
  PageSpec spec() const { return {PageKind::GqaKeyValue, int64_t(2) * kv_heads * head_dim, 0, kv_heads}; }
  std::byte* narrow_page_of(int seq, int64_t pos) {
    return reinterpret_cast<std::byte*>(narrow.data() + narrow_table[seq * stride + pos / block_size]);
  }
  // What the kernel reads: the narrow pages, or the bf16 ones.
  const std::vector<uint8_t>& device_pool() const { return format == PageFormat::BFloat16 ? pool : narrow; }
  const std::vector<int64_t>& device_table() const {
    return format == PageFormat::BFloat16 ? page_table : narrow_table;
  }
  uint8_t* row(int seq, int64_t pos) {
    return pool.data() + page_table[seq * stride + pos / block_size] + (pos % block_size) * row_bytes;
  }
  const uint8_t* row(int seq, int64_t pos) const {
    return pool.data() + page_table[seq * stride + pos / block_size] + (pos % block_size) * row_bytes;
  }
};

// Kept blocks of every (row, index head): random subsets of the blocks the row sees that always include its
// own block, ascending, -1 padded; now and then fewer blocks, or a block wholly in the row's future (which
// must contribute nothing).
std::vector<int32_t> make_blocks(const Shape& sh, const std::vector<int>& row_pos, std::mt19937_64& rng) {
  const int64_t rows = int64_t(row_pos.size());
  std::vector<int32_t> blocks(size_t(rows * sh.index_heads * sh.max_blocks), -1);
  std::vector<int> older;
  for (int64_t r = 0; r < rows; ++r) {
    const int own = row_pos[r] / sh.index_block;
    for (int g = 0; g < sh.index_heads; ++g) {
      older.resize(own);
      std::iota(older.begin(), older.end(), 0);
      std::shuffle(older.begin(), older.end(), rng);
      int n = std::min(sh.max_blocks - 1, own);
      if (rng() % 4 == 0) n = int(rng() % uint64_t(n + 1));
      std::vector<int> chosen(older.begin(), older.begin() + n);
      chosen.push_back(own);
      if (rng() % 8 == 0 && int(chosen.size()) < sh.max_blocks) chosen.push_back(own + 1);
      std::sort(chosen.begin(), chosen.end());
      int32_t* dst = blocks.data() + (r * sh.index_heads + g) * sh.max_blocks;
      for (size_t i = 0; i < chosen.size(); ++i) dst[i] = chosen[i];
    }
  }
  return blocks;
}

// out[r, h, :] in float64 over the same bf16 values: softmax(scale q.K) V over the keys the row may see.
std::vector<float> reference(const Shape& sh, const PagedKv& kv, const std::vector<float>& q,
                             const std::vector<int>& row_seq, const std::vector<int>& row_pos,
                             const std::vector<int32_t>* blocks, float scale, const std::vector<int>& row_first) {
  const int64_t rows = int64_t(row_seq.size());
  const int D = sh.head_dim;
  std::vector<float> out(size_t(rows * sh.heads * D));
  auto work = [&](int64_t r0, int64_t r1) {
    std::vector<int> keys;
    std::vector<double> logits, acc(D);
    for (int64_t r = r0; r < r1; ++r) {
      const int pos = row_pos[r], seq = row_seq[r];
      for (int h = 0; h < sh.heads; ++h) {
        const int kvh = h / (sh.heads / sh.kv_heads);
        keys.clear();
        if (blocks) {
          const int g = h / (sh.heads / sh.index_heads);
          const int32_t* b = blocks->data() + (r * sh.index_heads + g) * sh.max_blocks;
          for (int i = 0; i < sh.max_blocks; ++i) {
            if (b[i] < 0) continue;
            for (int s = b[i] * sh.index_block; s < (b[i] + 1) * sh.index_block && s <= pos; ++s) keys.push_back(s);
          }
        } else {
          for (int s = row_first.empty() ? 0 : row_first[r]; s <= pos; ++s) keys.push_back(s);
        }
        const float* qh = q.data() + (r * sh.heads + h) * D;
        logits.resize(keys.size());
        double mx = -INFINITY;
        for (size_t i = 0; i < keys.size(); ++i) {
          const uint8_t* k = kv.row(seq, keys[i]) + int64_t(kvh) * D * 2;
          double d = 0;
          for (int c = 0; c < D; ++c) d += double(qh[c]) * bf16_at(k + 2 * c);
          logits[i] = d * scale;
          mx = std::max(mx, logits[i]);
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (size_t i = 0; i < keys.size(); ++i) {
          const double p = std::exp(logits[i] - mx);
          sum += p;
          const uint8_t* v = kv.row(seq, keys[i]) + int64_t(sh.kv_heads + kvh) * D * 2;
          for (int c = 0; c < D; ++c) acc[c] += p * bf16_at(v + 2 * c);
        }
        for (int c = 0; c < D; ++c) out[(r * sh.heads + h) * D + c] = float(acc[c] / sum);
      }
    }
  };
  const int threads = int(std::max(1u, std::min(32u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, rows * t / threads, rows * (t + 1) / threads);
  for (auto& t : pool) t.join();
  return out;
}

// rows_per_seq consecutive rows per sequence, ending at its last token (decode: 1-2, prefill: many).
// K/V in `format` pages, values uniform in [-amplitude, amplitude] (2^-7: mostly E4M3 subnormals, which the
// FP8 path widens through bf16 subnormals). window > 0 (dense): each row sees its last `window` keys only
// (row_first).
void run_case(const Shape& sh, bool sparse, const std::vector<int>& lens, int rows_per_seq, int block_size,
              int64_t visible_pad, std::mt19937_64& rng, PageFormat format, float amplitude = 1.0f, int window = 0) {
  const int64_t rows = int64_t(lens.size()) * rows_per_seq;
  const int D = sh.head_dim;
  std::string what = std::string(sh.name) + (sparse ? " sparse" : " dense") + " kv=" + name_of(format) +
                     (amplitude != 1.0f ? " amplitude=" + std::to_string(amplitude) : std::string()) +
                     " seqs=" + std::to_string(lens.size()) + " rows/seq=" + std::to_string(rows_per_seq) +
                     " cache_block=" + std::to_string(block_size) +
                     (window ? " window=" + std::to_string(window) : std::string()) + " lens=";
  for (size_t i = 0; i < lens.size() && i < 8; ++i) what += (i ? "," : "") + std::to_string(lens[i]);
  SCOPED_TRACE(what);

  PagedKv kv(lens, sh.kv_heads, D, block_size, rng, true, format, amplitude);
  std::vector<int> row_seq(rows), row_pos(rows);
  int max_pos = 0;
  for (int64_t r = 0; r < rows; ++r) {
    row_seq[r] = int(r / rows_per_seq);
    row_pos[r] = lens[row_seq[r]] - rows_per_seq + int(r % rows_per_seq);
    ASSERT_GE(row_pos[r], 0);
    max_pos = std::max(max_pos, row_pos[r]);
  }
  // Queries uniform in [-6, 6): with keys in [-1, 1] the logits' spread is about 2, so some rows are peaked.
  FastRandom fr{rng()};
  std::vector<uint16_t> q_bits(size_t(rows * sh.heads * D));
  std::vector<float> q(q_bits.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q_bits[i] = float_to_bf16(fr.uniform(6.0f));
    q[i] = bf16_to_float(q_bits[i]);
  }
  const std::vector<int32_t> blocks = sparse ? make_blocks(sh, row_pos, rng) : std::vector<int32_t>{-1};
  const float scale = float(1.0 / std::sqrt(double(D)));
  const int64_t max_visible = max_pos + 1 + visible_pad;
  const int ih = sparse ? sh.index_heads : 0, mb = sparse ? sh.max_blocks : 0;

  test::DeviceArray<uint8_t> d_pool(kv.device_pool());
  test::DeviceArray<int64_t> d_pages(kv.device_table());
  test::DeviceArray<uint16_t> d_q(q_bits);
  std::vector<int> row_first;
  if (window > 0)
    for (int pos : row_pos) row_first.push_back(std::max(0, pos - (window - 1)));
  test::DeviceArray<int32_t> d_seq(row_seq), d_pos(row_pos), d_blocks(blocks);
  test::DeviceArray<int32_t> d_first(row_first.empty() ? std::vector<int>{0} : row_first);
  test::DeviceArray<uint16_t> d_out(q_bits.size());
  const size_t ws =
      gqa_attention_workspace_bytes(rows, sh.heads, sh.kv_heads, D, max_visible, ih, mb, sh.index_block, format);
  test::DeviceArray<uint8_t> d_ws(ws);
  SPARROW_CUDA_CHECK(cudaMemset(d_out.ptr, 0xff, d_out.n * 2));
  SPARROW_CUDA_CHECK(cudaMemset(d_ws.ptr, 0xff, std::max<size_t>(ws, 1)));
  gqa_attention(d_q.ptr, d_out.ptr, rows, sh.heads, sh.kv_heads, D, scale, d_seq.ptr, d_pos.ptr, max_visible,
                sparse ? d_blocks.ptr : nullptr, ih, mb, sh.index_block, d_pages.ptr, kv.stride, block_size,
                d_pool.ptr, format, d_ws.ptr, ws, nullptr, window > 0 ? d_first.ptr : nullptr);
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = d_out.download();
  const std::vector<float> ref =
      reference(sh, kv, q, row_seq, row_pos, sparse ? &blocks : nullptr, scale, row_first);

  int bad = 0;
  double worst = 0;
  for (int64_t rh = 0; rh < rows * sh.heads; ++rh) {
    double err = 0, norm = 0;
    bool finite = true;
    for (int c = 0; c < D; ++c) {
      const float g = bf16_to_float(got[rh * D + c]), r = ref[rh * D + c];
      finite = finite && std::isfinite(g);
      err += double(g - r) * (g - r);
      norm += double(r) * r;
    }
    const double rel = std::sqrt(err) / (std::sqrt(norm) + 1e-30);
    if (finite) worst = std::max(worst, rel);
    // bf16 probabilities in P V and a bf16 output: a few 2^-9 relative errors.
    if ((!finite || !(rel < 2e-2)) && bad++ < 5)
      ADD_FAILURE() << what << ": row " << rh / sh.heads << " (pos " << row_pos[rh / sh.heads] << ") head "
                    << rh % sh.heads << " rel L2 err " << rel << (finite ? "" : " (non-finite / unwritten output)");
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " bad (row, head) pairs";
  std::printf("  %s (ws %zu B): worst rel L2 %.2e\n", what.c_str(), ws, worst);
}

std::vector<int> decode_lens(std::mt19937_64& rng, int rows_per_seq, int longest) {
  auto pick = [&](int lo, int hi) { return lo + int(rng() % uint64_t(hi - lo + 1)); };
  std::vector<int> lens = {rows_per_seq, pick(2, 40), 17, 300, 4097, pick(1, longest), longest};
  for (int& l : lens) l = std::max(l, rows_per_seq);
  std::shuffle(lens.begin(), lens.end(), rng);
  return lens;
}

TEST(CudaGqaAttention, DecodeMatchesCpuReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const PageFormat format : kFormats) {
    int n = 0;
    for (const Shape* sh : {&kFixture, &kMiniMax, &kMiniMaxTp4, &kWide, &kOdd, &kMqa}) {
      const bool main_shape = sh == &kFixture || sh == &kMiniMax || sh == &kMiniMaxTp4;
      for (const bool sparse : {false, true}) {
        for (const int rps : {1, 2}) {
          const int longest = main_shape ? 50000 : 12000;
          const int block_size = n++ % 2 ? 16 : 64;
          const int64_t pad = rng() % 2 ? 0 : int64_t(rng() % 5000);  // max_visible may exceed every row's keys
          run_case(*sh, sparse, decode_lens(rng, rps, longest), rps, block_size, pad, rng, format);
        }
      }
    }
    // One long sequence alone: the keys split over many blocks and merged by the combine kernel.
    run_case(kMiniMaxTp4, false, {200000}, 1, 64, 0, rng, format);
    run_case(kFixture, false, {131072 + int(rng() % 1000)}, 1, 16, 0, rng, format);
    // Small values: E4M3 subnormals (FP8), NVFP4 blocks with subnormal E4M3 scales.
    if (format != PageFormat::BFloat16) {
      run_case(kMiniMax, false, decode_lens(rng, 1, 5000), 1, 64, 0, rng, format, 0x1p-7f);
      run_case(kMiniMaxTp4, true, decode_lens(rng, 1, 5000), 1, 16, 0, rng, format, 0x1p-7f);
    }
  }
}

TEST(CudaGqaAttention, PrefillMatchesCpuReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const PageFormat format : kFormats) {
    int n = 0;
    for (const Shape* sh : {&kFixture, &kMiniMax, &kMiniMaxTp4, &kWide, &kOdd, &kMqa}) {
      for (const bool sparse : {false, true}) {
        const int block_size = n++ % 2 ? 16 : 64;
        // 300 consecutive rows after some earlier context (none, for the first shapes' dense case).
        const int context = n <= 2 ? 0 : int(rng() % 3000);
        run_case(*sh, sparse, {300 + context}, 300, block_size, 0, rng, format);
      }
    }
  }
}

// A sliding window (the Qwen3 DSpark drafter's layers, model/gqa_mixer.h): each row sees its last `window`
// keys, from row_first on; windows of 1 key, shorter than a key tile, across page and split boundaries, and
// longer than the context (then the whole causal prefix).
TEST(CudaGqaAttention, SlidingWindowMatchesCpuReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const PageFormat format : kFormats)
    for (const int window : {1, 7, 16, 100, 4096, 100000}) {
      run_case(kMiniMax, false, decode_lens(rng, 1, 20000), 1, 64, 0, rng, format, 1.0f, window);
      run_case(kFixture, false, decode_lens(rng, 2, 9000), 2, 16, 0, rng, format, 1.0f, window);
      run_case(kMiniMax, false, {200 + int(rng() % 3000)}, 200, 64, 0, rng, format, 1.0f, window);
    }
}

// Every format's write: bf16 a byte copy (any bit pattern, NaN included); FP8 and NVFP4 byte for byte the
// CPU codec's encoding of the same values: random bit patterns (NaN, infinities, subnormals), values at
// many block magnitudes (NVFP4 scales from zero and subnormal to saturated) and E4M3 / E2M1 midpoints.
TEST(CudaGqaAttention, WriteKvIsByteExact) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const float special[] = {0.0f, -0.0f, 448.0f, 464.0f, 1e30f, INFINITY, -INFINITY, NAN, 0x1p-9f, 0x1p-10f,
                           1.0625f, 0.25f, 0.75f, -1.25f, 1.75f, 2.5f, -3.5f, 5.0f, 6.0f, 7.0f};
  for (const PageFormat format : kFormats) {
    for (const Shape* sh : {&kFixture, &kMiniMax, &kOdd, &kMqa}) {
      for (const int block_size : {16, 64}) {
        const std::vector<int> lens = {1 + int(rng() % 200), 1 + int(rng() % 3000), 1 + int(rng() % 40)};
        PagedKv kv(lens, sh->kv_heads, sh->head_dim, block_size, rng, false, format);
        // Distinct random (sequence, position) targets: whole sequences' tails and scattered tokens.
        std::vector<std::pair<int, int>> all;
        for (size_t s = 0; s < lens.size(); ++s)
          for (int j = 0; j < lens[s]; ++j) all.emplace_back(int(s), j);
        std::shuffle(all.begin(), all.end(), rng);
        const int64_t rows = std::min<int64_t>(int64_t(all.size()), 1 + int64_t(rng() % 500));
        const int width = sh->kv_heads * sh->head_dim;
        std::vector<uint16_t> k(size_t(rows * width)), v(k.size());
        for (auto* x : {&k, &v})
          for (size_t i = 0; i < x->size(); ++i) {
            const uint64_t r = rng();
            const float block_scale = std::ldexp(1.0f, int(i / 16 * 7 % 24) - 14);  // 2^-14 .. 2^9 per 16 values
            switch (r % 8) {
              case 0: (*x)[i] = uint16_t(r >> 16); break;  // any bit pattern, NaN included
              case 1: (*x)[i] = float_to_bf16(special[(r >> 8) % std::size(special)]); break;
              default: (*x)[i] = float_to_bf16(FastRandom{r}.uniform(6.0f) * block_scale); break;
            }
          }
        std::vector<int32_t> row_seq(rows), row_pos(rows);
        std::vector<uint8_t> expected = kv.device_pool();
        std::vector<float> values(kv.spec().width);
        for (int64_t i = 0; i < rows; ++i) {
          row_seq[i] = all[i].first;
          row_pos[i] = all[i].second;
          if (format == PageFormat::BFloat16) {
            const int64_t off = kv.row(row_seq[i], row_pos[i]) - kv.pool.data();
            std::memcpy(expected.data() + off, k.data() + i * width, size_t(width) * 2);
            std::memcpy(expected.data() + off + int64_t(width) * 2, v.data() + i * width, size_t(width) * 2);
          } else {
            for (int c = 0; c < width; ++c) {
              values[c] = bf16_to_float(k[i * width + c]);
              values[width + c] = bf16_to_float(v[i * width + c]);
            }
            const int64_t off = kv.narrow_table[row_seq[i] * kv.stride + row_pos[i] / block_size];
            std::byte* page = reinterpret_cast<std::byte*>(expected.data()) + off;
            codec_of(format).encode(kv.spec(), block_size, values.data(), row_pos[i] % block_size, 1, page);
          }
        }
        test::DeviceArray<uint8_t> d_pool(kv.device_pool());
        test::DeviceArray<int64_t> d_pages(kv.device_table());
        test::DeviceArray<uint16_t> d_k(k), d_v(v);
        test::DeviceArray<int32_t> d_seq(row_seq), d_pos(row_pos);
        gqa_write_kv(d_k.ptr, d_v.ptr, rows, sh->kv_heads, sh->head_dim, d_seq.ptr, d_pos.ptr, d_pages.ptr, kv.stride,
                     block_size, d_pool.ptr, format, nullptr);
        SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint8_t> got = d_pool.download();
        int64_t mismatches = 0, first = -1;
        for (size_t i = 0; i < got.size(); ++i)
          if (got[i] != expected[i] && mismatches++ == 0) first = int64_t(i);
        EXPECT_EQ(mismatches, 0) << name_of(format) << " " << sh->name << " cache_block=" << block_size
                                 << " rows=" << rows << ": first differing byte " << first;
      }
    }
  }
}

}  // namespace
}  // namespace sparrow::cuda
