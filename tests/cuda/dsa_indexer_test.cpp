// DSA indexer kernels (kernels/cuda/dsa_indexer) against CPU loops over the same FP8 values: the
// FP8 codec, key writes into random non-contiguous pages, query quantisation, and index scores for
// decode and prefill shapes of both models' head counts.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/bfloat16.h"
#include "gpu_test_util.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cuda/dsa_indexer/index_scores.h"

namespace {

using namespace sparrow;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x


// CPU model of the quantiser: scale = amax / 448, code = e4m3(x / scale).
void quantize_ref(const float* x, uint8_t* codes, float& scale) {
  float amax = 0;
  for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(x[i]));
  scale = amax / 448.0f;
  for (int i = 0; i < 128; ++i) codes[i] = cpu::float_to_e4m3(scale > 0 ? x[i] / scale : 0.0f);
}

TEST(CudaDsaIndexer, Fp8EncodeMatchesCpuCodec) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::vector<float> x;
  for (int c = 0; c < 256; ++c) {  // every code, the midpoints around it and their neighbours
    float v = cpu::e4m3_to_float(uint8_t(c));
    if (std::isnan(v)) continue;
    x.push_back(v);
    float next = c == 0x7E || c == 0xFE ? v * 1.1f : cpu::e4m3_to_float(uint8_t(c + 1));
    float mid = 0.5f * (v + next);
    x.push_back(mid);
    x.push_back(std::nextafter(mid, 0.0f));
    x.push_back(std::nextafter(mid, mid * 4));
  }
  const float inf = INFINITY;
  for (float v : {inf, -inf, NAN, -NAN, 0.0f, -0.0f, 464.0f, 465.0f, 1e-30f, -1e-30f, 0x1p-10f}) x.push_back(v);
  std::uniform_real_distribution<float> lm(-14.0f, 10.0f);
  for (int i = 0; i < 200000; ++i) {
    if (i % 2) {
      uint32_t b = rng();
      float v;
      std::memcpy(&v, &b, 4);
      x.push_back(v);
    } else {
      x.push_back(std::exp2(lm(rng)) * (rng() & 1 ? 1.f : -1.f));
    }
  }
  test::DeviceArray<float> dx(x);
  test::DeviceArray<uint8_t> dout(x.size());
  CK(cudaMemset(dout.ptr, 0xAA, x.size()));
  cuda::fp8_e4m3_encode(dx.ptr, int64_t(x.size()), dout.ptr, nullptr);
  CK(cudaDeviceSynchronize());
  auto got = dout.download();
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(int(got[i]), int(cpu::float_to_e4m3(x[i]))) << "x=" << x[i] << " seed " << seed;
}

// A paged pool holding `ctx[s]` tokens for each sequence, pages in random order.
struct Pool {
  int block_size = 64;
  int64_t stride = 0;  // pages per sequence in the table
  std::vector<int64_t> table;
  std::vector<uint8_t> bytes;
  int64_t page_bytes() const { return int64_t(block_size) * 132; }
  Pool(const std::vector<int64_t>& ctx, int bs, std::mt19937& rng) : block_size(bs) {
    int64_t total = 0;
    for (int64_t c : ctx) {
      stride = std::max(stride, (c + bs - 1) / bs);
      total += (c + bs - 1) / bs;
    }
    stride = std::max<int64_t>(stride, 1);
    total += 3;  // a few pages nobody owns
    std::vector<int64_t> ids(total);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ctx.size() * stride, -1);
    size_t next = 0;
    for (size_t s = 0; s < ctx.size(); ++s)
      for (int64_t pg = 0; pg < (ctx[s] + bs - 1) / bs; ++pg) table[s * stride + pg] = ids[next++] * page_bytes();
    bytes.assign(total * page_bytes(), 0);
  }
  uint8_t* value(int seq, int64_t pos) {
    return bytes.data() + table[seq * stride + pos / block_size] + (pos % block_size) * 128;
  }
  float* scale(int seq, int64_t pos) {
    return reinterpret_cast<float*>(bytes.data() + table[seq * stride + pos / block_size] +
                                    int64_t(block_size) * 128) + pos % block_size;
  }
};

TEST(CudaDsaIndexer, WriteKeysAndQuantizeQueriesMatchCpu) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    std::vector<int64_t> ctx = {1, 77, 64, 300, 1000};
    Pool pool(ctx, 64, rng);
    // Every position of every sequence, in a shuffled order.
    std::vector<int32_t> tseq, tpos;
    for (size_t s = 0; s < ctx.size(); ++s)
      for (int64_t j = 0; j < ctx[s]; ++j) tseq.push_back(int32_t(s)), tpos.push_back(int32_t(j));
    std::vector<size_t> order(tseq.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> s2(tseq.size()), p2(tseq.size());
    for (size_t i = 0; i < order.size(); ++i) s2[i] = tseq[order[i]], p2[i] = tpos[order[i]];
    const int64_t count = int64_t(s2.size());
    std::vector<float> keys(count * 128);
    for (auto& v : keys) v = nd(rng);
    for (int i = 0; i < 128; ++i) keys[5 * 128 + i] = 0.0f;  // an all-zero key
    std::vector<uint16_t> kb(keys.size());
    if (bf16) {
      for (size_t i = 0; i < keys.size(); ++i) kb[i] = float_to_bf16(keys[i]), keys[i] = bf16_to_float(kb[i]);
    }
    test::DeviceArray<float> dk(keys);
    test::DeviceArray<uint16_t> dkb(kb);
    test::DeviceArray<int32_t> ds(s2), dp(p2);
    test::DeviceArray<int64_t> dt(pool.table);
    test::DeviceArray<uint8_t> dpool(pool.bytes.size());
    CK(cudaMemset(dpool.ptr, 0xFF, pool.bytes.size()));
    cuda::dsa_write_keys(bf16 ? static_cast<const void*>(dkb.ptr) : dk.ptr, bf16 ? cuda::DsaDType::BF16 : cuda::DsaDType::F32,
                         count, ds.ptr, dp.ptr, dt.ptr, pool.stride, pool.block_size, dpool.ptr, nullptr);
    CK(cudaDeviceSynchronize());
    pool.bytes = dpool.download();
    for (int64_t i = 0; i < count; ++i) {
      uint8_t codes[128];
      float sc;
      quantize_ref(&keys[i * 128], codes, sc);
      ASSERT_EQ(0, std::memcmp(codes, pool.value(s2[i], p2[i]), 128)) << "token " << i << " seed " << seed;
      ASSERT_EQ(sc, *pool.scale(s2[i], p2[i])) << "token " << i << " seed " << seed;
    }
    // Queries.
    for (int heads : {32, 64}) {
      const int64_t rows = 37;
      std::vector<float> q(rows * heads * 128), w(rows * heads);
      for (auto& v : q) v = nd(rng);
      for (auto& v : w) v = nd(rng);
      std::vector<uint16_t> qb(q.size());
      if (bf16)
        for (size_t i = 0; i < q.size(); ++i) qb[i] = float_to_bf16(q[i]), q[i] = bf16_to_float(qb[i]);
      test::DeviceArray<float> dq(q), dw(w);
      test::DeviceArray<uint16_t> dqb(qb);
      test::DeviceArray<uint8_t> dq8(q.size());
      test::DeviceArray<float> dwf(w.size());
      CK(cudaMemset(dq8.ptr, 0xFF, q.size()));
      CK(cudaMemset(dwf.ptr, 0xFF, w.size() * 4));
      cuda::dsa_quantize_queries(bf16 ? static_cast<const void*>(dqb.ptr) : dq.ptr,
                                 bf16 ? cuda::DsaDType::BF16 : cuda::DsaDType::F32, dw.ptr, rows, heads, dq8.ptr, dwf.ptr,
                                 nullptr);
      CK(cudaDeviceSynchronize());
      auto q8 = dq8.download();
      auto wf = dwf.download();
      for (int64_t v = 0; v < rows * heads; ++v) {
        uint8_t codes[128];
        float sc;
        quantize_ref(&q[v * 128], codes, sc);
        ASSERT_EQ(0, std::memcmp(codes, &q8[v * 128], 128)) << "vector " << v << " seed " << seed;
        ASSERT_EQ(w[v] * sc, wf[v]) << "vector " << v << " seed " << seed;
      }
    }
  }
}

struct ScoreCase {
  int heads;
  std::vector<int64_t> ctx;      // per sequence: keys in the cache
  std::vector<int> rows_per_seq; // query rows per sequence (the last rows of its context)
  int block_size = 64;
};

void run_score_case(const ScoreCase& c, std::mt19937& rng, unsigned seed) {
  const int heads = c.heads;
  Pool pool(c.ctx, c.block_size, rng);
  // Random valid e4m3 codes (no NaN) and positive scales, written straight into the pages.
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> scd(0.001f, 0.02f);
  for (size_t s = 0; s < c.ctx.size(); ++s)
    for (int64_t j = 0; j < c.ctx[s]; ++j) {
      uint8_t* v = pool.value(int(s), j);
      for (int i = 0; i < 128; ++i) {
        int x;
        do x = code(rng); while ((x & 0x7F) == 0x7F);
        v[i] = uint8_t(x);
      }
      *pool.scale(int(s), j) = scd(rng);
    }
  std::vector<int32_t> row_seq, row_vis;
  int64_t max_vis = 0;
  for (size_t s = 0; s < c.ctx.size(); ++s)
    for (int r = 0; r < c.rows_per_seq[s]; ++r) {
      row_seq.push_back(int32_t(s));
      row_vis.push_back(int32_t(c.ctx[s] - c.rows_per_seq[s] + 1 + r));  // causal: row r sees up to itself
      max_vis = std::max<int64_t>(max_vis, row_vis.back());
    }
  const int64_t rows = int64_t(row_seq.size());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(rows * heads * 128), w(rows * heads);
  for (auto& v : q) v = nd(rng);
  for (auto& v : w) v = nd(rng) * 0.1f;
  const int64_t ld = max_vis + (max_vis % 2) + 6;
  test::DeviceArray<float> dq(q), dw(w);
  test::DeviceArray<uint8_t> dq8(q.size());
  test::DeviceArray<float> dwf(w.size());
  test::DeviceArray<int32_t> drs(row_seq), drv(row_vis);
  test::DeviceArray<int64_t> dt(pool.table);
  test::DeviceArray<uint8_t> dpool(pool.bytes);
  test::DeviceArray<float> dsc(size_t(rows * ld));
  cuda::dsa_quantize_queries(dq.ptr, cuda::DsaDType::F32, dw.ptr, rows, heads, dq8.ptr, dwf.ptr, nullptr);
  auto q8 = dq8.download();
  auto wf = dwf.download();
  std::vector<float> qf(q8.size());
  for (size_t i = 0; i < q8.size(); ++i) qf[i] = cpu::e4m3_to_float(q8[i]);
  std::vector<float> kf(128);
  std::uniform_int_distribution<int64_t> pick(0, 1 << 30);
  // Both kernels on every case (Auto picks one by row count). Hopper's FP8 wgmma accumulates with about
  // 14 mantissa bits (DeepSeek-V3 technical report, 3.3.2), hence its looser bound relative to the sum
  // of |products| (a wrong key, head or scale is off by O(1) of it).
  // The wgmma kernel also with pairs of rows per CTA (rows_per_sequence 2), whatever the cases' real
  // pairing: pairs that straddle two sequences must still score each against its own keys.
  for (const int variant : {0, 1, 2}) {
    const auto kernel = variant == 0 ? cuda::DsaScoreKernel::Tiles : cuda::DsaScoreKernel::Wgmma;
    const double tolerance = kernel == cuda::DsaScoreKernel::Wgmma ? 3e-4 : 2e-5;
    const char* name = variant == 0 ? "tiles" : variant == 1 ? "wgmma" : "wgmma, rows in pairs";
    CK(cudaMemset(dsc.ptr, 0xFF, rows * ld * 4));
    cuda::dsa_index_scores(dq8.ptr, dwf.ptr, rows, heads, drs.ptr, drv.ptr, dpool.ptr, dt.ptr, pool.stride, c.block_size, dsc.ptr,
                           ld, max_vis, nullptr, kernel, variant == 2 ? 2 : 1);
    CK(cudaDeviceSynchronize());
    auto got = dsc.download();
    for (int64_t r = 0; r < rows; ++r) {
      const int s = row_seq[r];
      const int64_t vis = row_vis[r];
      for (int64_t col = 0; col < ld; ++col) {
        const float g = got[r * ld + col];
        if (col >= max_vis) {
          uint32_t b;
          std::memcpy(&b, &g, 4);
          ASSERT_EQ(b, 0xFFFFFFFFu) << name << ": written past max_visible: row " << r << " col " << col << " seed "
                                    << seed;
        } else if (col >= vis) {
          ASSERT_TRUE(std::isinf(g) && g < 0) << name << ": row " << r << " col " << col << " got " << g << " seed "
                                              << seed;
        }
      }
      // Long rows: check a sample of columns (and the first and last 64); keeps the CPU reference fast.
      std::vector<int64_t> cols;
      if (vis <= 2048) {
        cols.resize(vis);
        std::iota(cols.begin(), cols.end(), 0);
      } else {
        for (int64_t i = 0; i < 64; ++i) cols.push_back(i), cols.push_back(vis - 1 - i);
        for (int i = 0; i < 3000; ++i) cols.push_back(pick(rng) % vis);
      }
      for (int64_t col : cols) {
        const uint8_t* kv = pool.value(s, col);
        const float ks = *pool.scale(s, col);
        for (int i = 0; i < 128; ++i) kf[i] = cpu::e4m3_to_float(kv[i]);
        double ref = 0, mag = 0;
        for (int h = 0; h < heads; ++h) {
          const float* qh = &qf[(r * heads + h) * 128];
          double dot = 0, adot = 0;
          for (int i = 0; i < 128; ++i) dot += double(qh[i]) * kf[i], adot += std::fabs(double(qh[i]) * kf[i]);
          ref += double(wf[r * heads + h]) * std::max(dot, 0.0);
          mag += std::fabs(double(wf[r * heads + h])) * adot;
        }
        ref *= ks;
        mag *= ks;
        const float g = got[r * ld + col];
        ASSERT_TRUE(std::isfinite(g)) << name << ": row " << r << " col " << col << " seed " << seed;
        ASSERT_NEAR(g, ref, tolerance * mag + 1e-30)
            << name << ": heads " << heads << " row " << r << " col " << col << " vis " << vis << " seed " << seed;
      }
    }
  }
}

TEST(CudaDsaIndexer, ScoresMatchCpuDecode) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int heads : {64, 32}) {
    run_score_case({heads, {1}, {1}}, rng, seed);
    run_score_case({heads, {5, 64, 65, 200}, {1, 1, 2, 1}}, rng, seed);
    run_score_case({heads, {3000, 17, 4097, 1, 999, 2}, {2, 1, 1, 1, 2, 2}}, rng, seed);
    run_score_case({heads, {300000}, {2}}, rng, seed);
    std::vector<int64_t> ctx;
    std::vector<int> rps;
    std::uniform_int_distribution<int64_t> len(1, 5000);
    for (int i = 0; i < 40; ++i) ctx.push_back(len(rng)), rps.push_back(1 + int(rng() % 2));
    run_score_case({heads, ctx, rps}, rng, seed);
  }
}

TEST(CudaDsaIndexer, ScoresMatchCpuPrefill) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int heads : {64, 32}) {
    run_score_case({heads, {500}, {500}}, rng, seed);          // a whole prompt
    run_score_case({heads, {2500, 300}, {333, 300}}, rng, seed);  // chunks continuing a cache, and a new one
    run_score_case({heads, {9000}, {257}}, rng, seed);
    run_score_case({heads, {130, 70}, {130, 3}, 32}, rng, seed);  // another block size
  }
}

}  // namespace
