// MLA attention kernels (src/kernels/cuda/mla) against a float64 CPU loop over the exactly dequantised
// cache, and the cache write kernel against a CPU encoding of the FlashMLA FP8 layout, byte for byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cuda/mla/mla_attention.h"
#include "kernels/cuda/runtime/cuda_check.h"
#include "core/bfloat16.h"
#include "gpu_test_util.h"

namespace sparrow::cuda {
namespace {

// ---- CPU codecs (the test's own: e4m3 "fn" of OCP FP8, bias 7, no infinities, 0x7f/0xff NaN) ----
float e4m3_decode(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  float v = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(float(8 + man), exp - 10);
  return sign ? -v : v;
}
const std::vector<float>& e4m3_positive_table() {  // codes 0..126 (0x7f is NaN), increasing
  static const std::vector<float> table = [] {
    std::vector<float> t(127);
    for (int c = 0; c < 127; ++c) t[c] = e4m3_decode(uint8_t(c));
    return t;
  }();
  return table;
}
// Round to nearest, ties to the even code, saturating at 448 (cvt.rn.satfinite.e4m3x2.f32).
uint8_t e4m3_encode(float x) {
  const std::vector<float>& t = e4m3_positive_table();
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  int code;
  if (a >= t[126]) {
    code = 126;
  } else {
    const int hi = int(std::lower_bound(t.begin(), t.end(), a) - t.begin());  // t[hi] >= a
    if (t[hi] == a || hi == 0) {
      code = hi;
    } else {
      const float dlo = a - t[hi - 1], dhi = t[hi] - a;
      code = dlo < dhi ? hi - 1 : dhi < dlo ? hi : ((hi - 1) % 2 == 0 ? hi - 1 : hi);
    }
  }
  return uint8_t(sign | code);
}

// Encodes one [512 | 64] row in `format`; `deq` receives the exact values a reader must see.
void encode_row(MlaCacheFormat format, const float* x, uint8_t* dst, float* deq) {
  if (format == MlaCacheFormat::kFp8) {
    for (int g = 0; g < 4; ++g) {
      float amax = 0;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(x[g * 128 + i]));
      const float scale = amax / 448.0f;
      std::memcpy(dst + 512 + 4 * g, &scale, 4);
      for (int i = 0; i < 128; ++i) {
        const uint8_t c = scale > 0 ? e4m3_encode(x[g * 128 + i] / scale) : 0;
        dst[g * 128 + i] = c;
        if (deq) deq[g * 128 + i] = e4m3_decode(c) * scale;
      }
    }
    for (int i = 0; i < 64; ++i) {
      const uint16_t b = float_to_bf16(x[512 + i]);
      std::memcpy(dst + 528 + 2 * i, &b, 2);
      if (deq) deq[512 + i] = bf16_to_float(b);
    }
  } else {
    for (int i = 0; i < kMlaRow; ++i) {
      const uint16_t b = float_to_bf16(x[i]);
      std::memcpy(dst + 2 * i, &b, 2);
      if (deq) deq[i] = bf16_to_float(b);
    }
  }
}

// A paged pool holding `lens[s]` tokens per sequence in pages scattered at random, with garbage (NaN
// bit patterns) everywhere no token lives, and the exact values each token must read as.
struct TestCache {
  MlaCacheFormat format;
  int block_size = 64;
  int64_t pages_stride = 0;
  std::vector<uint8_t> pool;
  std::vector<int64_t> page_offsets;
  std::vector<std::vector<float>> values;  // per sequence [len, 576]

  TestCache(MlaCacheFormat f, const std::vector<int>& lens, std::mt19937_64& rng) : format(f) {
    const int64_t row_bytes = mla_row_bytes(format);
    const int64_t page_bytes = block_size * row_bytes + 48;  // other layers' pages sit between ours
    int64_t total_pages = 0;
    for (int len : lens) {
      const int64_t pages = (len + block_size - 1) / block_size;
      pages_stride = std::max(pages_stride, pages);
      total_pages += pages;
    }
    pages_stride = std::max<int64_t>(pages_stride, 1);
    total_pages += 3;  // unused pages
    std::vector<int64_t> slots(total_pages);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    pool.assign(size_t(total_pages * page_bytes), 0xff);
    page_offsets.assign(lens.size() * pages_stride, -1);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> mag(-2.f, 1.f);
    int64_t next = 0;
    std::vector<float> x(kMlaRow);
    for (size_t s = 0; s < lens.size(); ++s) {
      const int64_t pages = (lens[s] + block_size - 1) / block_size;
      for (int64_t i = 0; i < pages; ++i) page_offsets[s * pages_stride + i] = slots[next++] * page_bytes;
      values.emplace_back(size_t(lens[s]) * kMlaRow);
      for (int j = 0; j < lens[s]; ++j) {
        for (int g = 0; g < 4; ++g) {  // per-group magnitudes differ, so the scales matter
          const float m = std::exp(mag(rng));
          for (int i = 0; i < 128; ++i) x[g * 128 + i] = normal(rng) * m;
        }
        for (int i = 0; i < 64; ++i) x[512 + i] = normal(rng);
        uint8_t* dst = pool.data() + page_offsets[s * pages_stride + j / block_size] + (j % block_size) * row_bytes;
        encode_row(format, x.data(), dst, values[s].data() + size_t(j) * kMlaRow);
      }
    }
  }
};

struct Reference {
  std::vector<float> out;  // [rows, heads, 512]
  std::vector<float> lse;  // [rows, heads]
};

// keys(r): the token positions row r attends to.
template <typename Keys>
Reference reference(const TestCache& cache, const std::vector<float>& q, const std::vector<int>& row_seq,
                    int heads, float scale, Keys keys) {
  const int64_t rows = int64_t(row_seq.size());
  Reference ref;
  ref.out.assign(size_t(rows * heads * kMlaLatent), 0.f);
  ref.lse.assign(size_t(rows * heads), -INFINITY);
  auto work = [&](int64_t r0, int64_t r1) {
    std::vector<double> logits, acc(kMlaLatent);
    for (int64_t r = r0; r < r1; ++r) {
      const std::vector<int> ks = keys(r);
      const std::vector<float>& vals = cache.values[row_seq[r]];
      for (int h = 0; h < heads; ++h) {
        if (ks.empty()) continue;
        const float* qh = q.data() + (r * heads + h) * kMlaRow;
        logits.resize(ks.size());
        double mx = -INFINITY;
        for (size_t i = 0; i < ks.size(); ++i) {
          const float* row = vals.data() + size_t(ks[i]) * kMlaRow;
          double d = 0;
          for (int k = 0; k < kMlaRow; ++k) d += double(qh[k]) * row[k];
          logits[i] = d * scale;
          mx = std::max(mx, logits[i]);
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (size_t i = 0; i < ks.size(); ++i) {
          const double p = std::exp(logits[i] - mx);
          sum += p;
          const float* row = vals.data() + size_t(ks[i]) * kMlaRow;
          for (int k = 0; k < kMlaLatent; ++k) acc[k] += p * row[k];
        }
        for (int k = 0; k < kMlaLatent; ++k) ref.out[(r * heads + h) * kMlaLatent + k] = float(acc[k] / sum);
        ref.lse[r * heads + h] = float(mx + std::log(sum));
      }
    }
  };
  const int threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back(work, rows * t / threads, rows * (t + 1) / threads);
  for (auto& t : pool) t.join();
  return ref;
}

// Compares GPU outputs with the reference; every element must have been written (poisoned before).
void expect_close(const Reference& ref, const std::vector<uint16_t>& out, const std::vector<float>& lse,
                  int64_t rows, int heads, const std::string& what) {
  int bad = 0;
  double worst = 0;
  for (int64_t rh = 0; rh < rows * heads; ++rh) {
    double err = 0, norm = 0;
    bool finite = true;
    for (int k = 0; k < kMlaLatent; ++k) {
      const float g = bf16_to_float(out[rh * kMlaLatent + k]);
      const float r = ref.out[rh * kMlaLatent + k];
      finite = finite && std::isfinite(g);
      err += double(g - r) * (g - r);
      norm += double(r) * r;
    }
    const float rl = ref.lse[rh], gl = lse[rh];
    bool ok = finite;
    if (std::isinf(rl)) {
      ok = ok && std::isinf(gl) && gl < 0 && err == 0;
    } else {
      const double rel = std::sqrt(err) / (std::sqrt(norm) + 1e-20);
      worst = std::max(worst, rel);
      // FP8 latents carry 3 mantissa bits (up to 1/16 relative per value): allow more than for bf16.
      const double tolerance = what.find("fp8") != std::string::npos ? 2.5e-2 : 1.5e-2;
      ok = ok && rel < tolerance && std::fabs(gl - rl) < 2e-2 + 2e-3 * std::fabs(rl);
    }
    if (!ok && bad++ < 5)
      ADD_FAILURE() << what << ": row " << rh / heads << " head " << rh % heads << " lse gpu " << gl << " ref " << rl
                    << " rel err " << std::sqrt(err) / (std::sqrt(norm) + 1e-20) << " finite " << finite;
  }
  EXPECT_EQ(bad, 0) << what << " (" << bad << " bad (row, head) pairs)";
  std::printf("  %s: worst rel L2 %.2e\n", what.c_str(), worst);
}

uint64_t fresh_seed() { return std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32); }

struct Case {
  bool sparse;
  MlaCacheFormat format;
  int heads;
  int topk;               // sparse only
  std::vector<int> lens;  // per sequence
  int q_per_seq;
};

void run_case(const Case& c, std::mt19937_64& rng) {
  const int64_t rows = int64_t(c.lens.size()) * c.q_per_seq;
  const std::string what = std::string(c.sparse ? "sparse" : "dense") + (c.format == MlaCacheFormat::kFp8 ? " fp8" : " bf16") +
                           " heads=" + std::to_string(c.heads) + (c.sparse ? " topk=" + std::to_string(c.topk) : "") +
                           " seqs=" + std::to_string(c.lens.size()) + " q=" + std::to_string(c.q_per_seq) +
                           " maxlen=" + std::to_string(*std::max_element(c.lens.begin(), c.lens.end()));
  TestCache cache(c.format, c.lens, rng);
  std::vector<int> row_seq(rows), row_len(rows);
  for (int64_t r = 0; r < rows; ++r) {
    row_seq[r] = int(r / c.q_per_seq);
    // causal: the last row sees the whole sequence, earlier rows one token less each
    row_len[r] = std::max(0, c.lens[row_seq[r]] - (c.q_per_seq - 1 - int(r % c.q_per_seq)));
  }
  std::vector<int32_t> indices;
  if (c.sparse) {
    indices.assign(size_t(rows * c.topk), -1);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int> tokens(row_len[r]);
      std::iota(tokens.begin(), tokens.end(), 0);
      std::shuffle(tokens.begin(), tokens.end(), rng);
      int n = std::min<int>(c.topk, row_len[r]);
      if (rng() % 3 == 0) n = int(rng() % (n + 1));  // some rows leave slots unused (-1), some use none
      std::vector<int> slots(c.topk);
      std::iota(slots.begin(), slots.end(), 0);
      if (rng() % 2) std::shuffle(slots.begin(), slots.end(), rng);  // -1 padding anywhere, not only at the end
      for (int i = 0; i < n; ++i) indices[r * c.topk + slots[i]] = tokens[i];
    }
  }
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> q_bits(size_t(rows * c.heads * kMlaRow));
  std::vector<float> q(q_bits.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q_bits[i] = float_to_bf16(normal(rng));
    q[i] = bf16_to_float(q_bits[i]);
  }
  const float scale = 1.0f / std::sqrt(192.0f);

  test::DeviceArray<uint8_t> d_pool(cache.pool);
  test::DeviceArray<int64_t> d_pages(cache.page_offsets);
  test::DeviceArray<uint16_t> d_q(q_bits);
  test::DeviceArray<int32_t> d_seq(row_seq), d_len(row_len);
  test::DeviceArray<int32_t> d_idx(c.sparse ? indices : std::vector<int32_t>{0});
  test::DeviceArray<uint16_t> d_out(size_t(rows * c.heads * kMlaLatent));
  test::DeviceArray<float> d_lse(size_t(rows * c.heads));
  SPARROW_CUDA_CHECK(cudaMemset(d_out.ptr, 0xff, d_out.n * 2));
  SPARROW_CUDA_CHECK(cudaMemset(d_lse.ptr, 0xff, d_lse.n * 4));
  MlaPagedCache pc{d_pool.ptr, d_pages.ptr, cache.pages_stride, cache.block_size, c.format};
  const int max_len = *std::max_element(c.lens.begin(), c.lens.end());
  const size_t ws = mla_attention_workspace_bytes(rows, c.heads, c.sparse ? c.topk : max_len);
  test::DeviceArray<uint8_t> d_ws(ws);
  SPARROW_CUDA_CHECK(cudaMemset(d_ws.ptr, 0xff, std::max<size_t>(ws, 1)));
  if (c.sparse)
    mla_sparse_attention(pc, d_q.ptr, d_seq.ptr, d_idx.ptr, rows, c.heads, c.topk, scale, d_out.ptr, d_lse.ptr, d_ws.ptr,
                         ws, nullptr);
  else
    mla_dense_attention(pc, d_q.ptr, d_seq.ptr, d_len.ptr, rows, c.heads, max_len, scale, d_out.ptr, d_lse.ptr, d_ws.ptr,
                        ws, nullptr);
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  const Reference ref = reference(cache, q, row_seq, c.heads, scale, [&](int64_t r) {
    std::vector<int> ks;
    if (c.sparse) {
      for (int i = 0; i < c.topk; ++i)
        if (indices[r * c.topk + i] >= 0) ks.push_back(indices[r * c.topk + i]);
    } else {
      for (int j = 0; j < row_len[r]; ++j) ks.push_back(j);
    }
    return ks;
  });
  expect_close(ref, d_out.download(), d_lse.download(), rows, c.heads, what + " (ws " + std::to_string(ws) + " B)");
}

std::vector<int> random_lens(std::mt19937_64& rng, int n, int lo, int hi) {
  std::vector<int> lens(n);
  for (int& l : lens) l = lo + int(rng() % uint64_t(hi - lo + 1));
  return lens;
}

TEST(CudaMlaAttention, SparseMatchesCpuReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto fp8 = MlaCacheFormat::kFp8, bf16 = MlaCacheFormat::kBf16;
  const std::vector<Case> cases = {
      {true, fp8, 12, 2048, random_lens(rng, 3, 2500, 9000), 2},
      {true, bf16, 12, 2048, random_lens(rng, 2, 3000, 5000), 1},
      {true, fp8, 16, 16, random_lens(rng, 5, 1, 40), 1},
      {true, bf16, 16, 64, random_lens(rng, 4, 1, 200), 2},
      {true, fp8, 64, 512, random_lens(rng, 3, 100, 3000), 2},
      {true, bf16, 64, 100, random_lens(rng, 2, 50, 500), 1},
      {true, fp8, 128, 2048, random_lens(rng, 2, 2100, 6000), 2},
      {true, bf16, 128, 300, random_lens(rng, 3, 10, 1000), 1},
      {true, fp8, 96, 700, random_lens(rng, 2, 700, 2000), 2},
      {true, fp8, 16, 256, {3000}, 300},  // prefill: many rows of one sequence
      {true, bf16, 128, 128, {600}, 40},
  };
  for (const Case& c : cases) run_case(c, rng);
}

TEST(CudaMlaAttention, DenseMatchesCpuReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto fp8 = MlaCacheFormat::kFp8, bf16 = MlaCacheFormat::kBf16;
  const std::vector<Case> cases = {
      {false, fp8, 16, 0, random_lens(rng, 5, 1, 100), 1},
      {false, bf16, 12, 0, random_lens(rng, 4, 1, 300), 2},
      {false, fp8, 12, 0, {40000}, 1},
      {false, bf16, 16, 0, random_lens(rng, 2, 20000, 40000), 2},
      {false, fp8, 64, 0, random_lens(rng, 3, 1000, 5000), 2},
      {false, bf16, 128, 0, random_lens(rng, 2, 500, 3000), 1},
      {false, fp8, 128, 0, random_lens(rng, 64, 1, 300), 1},
      {false, fp8, 96, 0, random_lens(rng, 2, 100, 2000), 2},
      {false, bf16, 64, 0, {500}, 120},  // prefill-like: many rows, causal lengths
  };
  for (const Case& c : cases) run_case(c, rng);
}

// The write kernel against the CPU encoding: every byte of the pool, written rows and untouched ones.
TEST(CudaMlaAttention, CacheWriteIsBitExact) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (MlaCacheFormat format : {MlaCacheFormat::kFp8, MlaCacheFormat::kBf16}) {
    for (MlaSourceType src_type : {MlaSourceType::kFloat32, MlaSourceType::kBf16}) {
      const std::vector<int> lens = random_lens(rng, 3, 1, 400);
      TestCache cache(format, lens, rng);  // existing rows stay; we overwrite some of them
      const int64_t row_bytes = mla_row_bytes(format);
      // Rows to write: a random subset of (seq, pos), in random order.
      std::vector<std::pair<int, int>> targets;
      for (size_t s = 0; s < lens.size(); ++s)
        for (int j = 0; j < lens[s]; ++j)
          if (rng() % 2) targets.push_back({int(s), j});
      std::shuffle(targets.begin(), targets.end(), rng);
      const int64_t count = int64_t(targets.size());
      std::normal_distribution<float> normal(0.f, 1.f);
      std::vector<float> src(size_t(count) * kMlaRow);
      std::vector<uint16_t> src_bf16(src.size());
      for (int64_t i = 0; i < count; ++i) {
        for (int g = 0; g < 4; ++g) {
          const int kind = int(rng() % 6);
          const float m = kind == 0 ? 0.f : kind == 1 ? 1e-30f : kind == 2 ? 1e20f : std::exp(normal(rng) * 3);
          for (int k = 0; k < 128; ++k) src[i * kMlaRow + g * 128 + k] = kind == 0 ? 0.f : normal(rng) * m;
        }
        for (int k = 0; k < 64; ++k) src[i * kMlaRow + 512 + k] = normal(rng);
      }
      if (src_type == MlaSourceType::kBf16)
        for (size_t i = 0; i < src.size(); ++i) {
          src_bf16[i] = float_to_bf16(src[i]);
          src[i] = bf16_to_float(src_bf16[i]);
        }
      std::vector<int32_t> row_seq(count), row_pos(count);
      std::vector<uint8_t> expected = cache.pool;
      for (int64_t i = 0; i < count; ++i) {
        row_seq[i] = targets[i].first;
        row_pos[i] = targets[i].second;
        const int64_t off = cache.page_offsets[targets[i].first * cache.pages_stride + targets[i].second / cache.block_size] +
                            (targets[i].second % cache.block_size) * row_bytes;
        encode_row(format, src.data() + i * kMlaRow, expected.data() + off, nullptr);
      }
      test::DeviceArray<uint8_t> d_pool(cache.pool);
      test::DeviceArray<int64_t> d_pages(cache.page_offsets);
      test::DeviceArray<int32_t> d_seq(row_seq), d_pos(row_pos);
      test::DeviceArray<float> d_src(src);
      test::DeviceArray<uint16_t> d_src16(src_bf16);
      MlaPagedCache pc{d_pool.ptr, d_pages.ptr, cache.pages_stride, cache.block_size, format};
      const void* s = src_type == MlaSourceType::kFloat32 ? static_cast<const void*>(d_src.ptr) : d_src16.ptr;
      mla_cache_write(pc, s, src_type, count, d_seq.ptr, d_pos.ptr, 0, 0, nullptr);
      // And one contiguous run of sequence 0 through the (seq0, start_pos) form.
      SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint8_t> got = d_pool.download();
      int64_t mismatches = 0, first = -1;
      for (size_t i = 0; i < got.size(); ++i)
        if (got[i] != expected[i] && mismatches++ == 0) first = int64_t(i);
      EXPECT_EQ(mismatches, 0) << "format " << int(format) << " src " << int(src_type) << ": first differing byte "
                               << first << " got " << (first >= 0 ? int(got[first]) : 0) << " want "
                               << (first >= 0 ? int(expected[first]) : 0);
      // Contiguous form: rows start_pos .. start_pos+n-1 of sequence lens.size()-1, from the first n source
      // rows (at most `count` of them exist: short random sequences may give fewer than 70).
      const int seq = int(lens.size()) - 1, n = int(std::min<int64_t>({lens[seq], 70, count})),
                start = lens[seq] - n;
      std::vector<uint8_t> expected2 = got;
      for (int i = 0; i < n; ++i) {
        const int pos = start + i;
        const int64_t off = cache.page_offsets[seq * cache.pages_stride + pos / cache.block_size] +
                            (pos % cache.block_size) * row_bytes;
        encode_row(format, src.data() + size_t(i) * kMlaRow, expected2.data() + off, nullptr);
      }
      mla_cache_write(pc, s, src_type, n, nullptr, nullptr, seq, start, nullptr);
      SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(d_pool.download() == expected2) << "contiguous write, format " << int(format);
    }
  }
}

}  // namespace
}  // namespace sparrow::cuda
