// DSA indexer kernels (kernels/cuda/dsa_indexer) against the CPU, for every index-key format (FP8 132 B,
// MXFP4 68 B, NVFP4 72 B): the FP8 codec, key writes into random non-contiguous pages (byte for byte the
// CPU page codec's, cache/page_codec.cpp), query quantisation, and index scores for decode and prefill
// shapes of both models' head counts against CPU loops over the keys as the CPU decodes them (MXFP4: and
// widens them, fp4_keys.cuh) with the queries rounded as the kernels round them.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cache/page_codec.h"
#include "core/bfloat16.h"
#include "core/error.h"
#include "gpu_test_util.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"
#include "kernels/cuda/dsa_indexer/index_scores.h"

namespace {

using namespace sparrow;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

constexpr PageFormat kFormats[] = {PageFormat::Fp8IndexKey, PageFormat::Mxfp4Rows, PageFormat::Nvfp4Rows};

CacheDtype cache_dtype(PageFormat f) {
  return f == PageFormat::Fp8IndexKey ? CacheDtype::Fp8 : f == PageFormat::Mxfp4Rows ? CacheDtype::Mxfp4 : CacheDtype::Nvfp4;
}
const PageCodec& codec(PageFormat f) { return page_codec(cache_dtype(f), PageKind::DsaIndexKey); }
const PageSpec kKeySpec{PageKind::DsaIndexKey, 128};

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

// A paged pool of index keys in `format` holding `ctx[s]` tokens for each sequence, pages in random order,
// a few pages nobody owns. Every byte starts at 0xFF (as the device copy is poisoned).
struct Pool {
  PageFormat format;
  int block_size = 64;
  int64_t stride = 0;  // pages per sequence in the table
  std::vector<int64_t> table;
  std::vector<uint8_t> bytes;
  int64_t value_bytes() const { return format == PageFormat::Fp8IndexKey ? 128 : 64; }
  int64_t scale_bytes() const { return format == PageFormat::Nvfp4Rows ? 8 : 4; }
  int64_t page_bytes() const { return int64_t(block_size) * cuda::dsa_key_bytes(format); }
  Pool(PageFormat f, const std::vector<int64_t>& ctx, int bs, std::mt19937& rng) : format(f), block_size(bs) {
    int64_t total = 0;
    for (int64_t c : ctx) {
      stride = std::max(stride, (c + bs - 1) / bs);
      total += (c + bs - 1) / bs;
    }
    stride = std::max<int64_t>(stride, 1);
    total += 3;
    std::vector<int64_t> ids(total);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ctx.size() * stride, -1);
    size_t next = 0;
    for (size_t s = 0; s < ctx.size(); ++s)
      for (int64_t pg = 0; pg < (ctx[s] + bs - 1) / bs; ++pg) table[s * stride + pg] = ids[next++] * page_bytes();
    bytes.assign(total * page_bytes(), 0xFF);
  }
  uint8_t* page(int seq, int64_t pos) { return bytes.data() + table[seq * stride + pos / block_size]; }
  int64_t slot(int64_t pos) const { return pos % block_size; }
  uint8_t* values(int seq, int64_t pos) { return page(seq, pos) + slot(pos) * value_bytes(); }
  uint8_t* scales(int seq, int64_t pos) {
    return page(seq, pos) + int64_t(block_size) * value_bytes() + slot(pos) * scale_bytes();
  }
  // What the CPU stores for `row` at (seq, pos): the page codec's bytes.
  void encode(int seq, int64_t pos, const float* row) {
    codec(format).encode(kKeySpec, block_size, row, slot(pos), 1, reinterpret_cast<std::byte*>(page(seq, pos)));
  }
  // The key at (seq, pos) as the kernels multiply it: k (128 values) times one factor. FP8: the e4m3 values
  // and the fp32 scale. NVFP4: the CPU decode (exact in f16), factor 1. MXFP4: the CPU decode widened to
  // e4m3 relative to 2^(eref - 127), eref = max(largest E8M0 byte, 7) - 6, which is the factor
  // (fp4_keys.cuh: exact unless a block lies more than 14 binades below the key's largest).
  void key(int seq, int64_t pos, float* k, double& factor) {
    if (format == PageFormat::Fp8IndexKey) {
      for (int i = 0; i < 128; ++i) k[i] = cpu::e4m3_to_float(values(seq, pos)[i]);
      factor = *reinterpret_cast<const float*>(scales(seq, pos));
      return;
    }
    codec(format).decode(kKeySpec, block_size, reinterpret_cast<const std::byte*>(page(seq, pos)), slot(pos), 1, k);
    factor = 1.0;
    if (format == PageFormat::Mxfp4Rows) {
      const uint8_t* sc = scales(seq, pos);
      const int eref = std::max<int>(*std::max_element(sc, sc + 4), 7) - 6;
      for (int i = 0; i < 128; ++i) k[i] = cpu::e4m3_to_float(cpu::float_to_e4m3(std::ldexp(k[i], 127 - eref)));
      factor = std::ldexp(1.0, eref - 127);
    }
  }
};

// Keys with the edge cases of every format: zeros, all equal, all negative, tiny (scales clamped or
// rounding to zero, fp32 subnormals), saturating, blocks of very different magnitudes, and (4-bit formats,
// whose codecs define them) infinities and NaNs.
std::vector<float> edge_keys(PageFormat format, int64_t count, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-8, 8);
  std::vector<float> keys(count * 128);
  for (int64_t t = 0; t < count; ++t)
    for (int b = 0; b < 8; ++b) {  // each block of 16 its own magnitude
      const float m = std::ldexp(1.0f, ex(rng));
      for (int i = 0; i < 16; ++i) keys[t * 128 + b * 16 + i] = nd(rng) * m;
    }
  auto row = [&](int64_t t) { return keys.data() + (t % count) * 128; };
  std::fill(row(5), row(5) + 128, 0.0f);
  std::fill(row(6), row(6) + 128, 3.0f);
  for (int i = 0; i < 128; ++i) row(7)[i] = -std::fabs(row(7)[i]) - 0.01f;
  for (int i = 0; i < 128; ++i) row(8)[i] = nd(rng) * 1e-30f;
  for (int i = 0; i < 128; ++i) row(9)[i] = nd(rng) * 1e-39f;  // fp32 subnormals
  for (int i = 0; i < 128; ++i) row(10)[i] = nd(rng) * 1e30f;
  for (int i = 0; i < 128; ++i) row(11)[i] = nd(rng) * (i < 32 ? 1e4f : i < 64 ? 1.0f : i < 96 ? 1e-4f : 1e-9f);
  for (int i = 0; i < 128; ++i) row(12)[i] = (i % 2 ? 1.0f : -1.0f) * 6.0f * std::ldexp(1.0f, i % 9 - 4);
  if (format != PageFormat::Fp8IndexKey) {
    row(13)[3] = INFINITY;
    row(14)[40] = -INFINITY;
    row(15)[77] = NAN;
    row(16)[127] = NAN, row(16)[0] = INFINITY;
  }
  return keys;
}

TEST(CudaDsaIndexer, WriteKeysAndQuantizeQueriesMatchCpu) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (const PageFormat format : kFormats)
    for (const int block_size : {64, 32})
      for (int bf16 = 0; bf16 < 2; ++bf16) {
        SCOPED_TRACE(std::string(cuda::dsa_key_format_name(format)) + " block " + std::to_string(block_size) +
                     (bf16 ? " bf16" : " f32") + " seed " + std::to_string(seed));
        std::vector<int64_t> ctx = {1, 77, 64, 300, 1000};
        Pool pool(format, ctx, block_size, rng);
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
        std::vector<float> keys = edge_keys(format, count, rng);
        std::vector<uint16_t> kb(keys.size());
        if (bf16)
          for (size_t i = 0; i < keys.size(); ++i) kb[i] = float_to_bf16(keys[i]), keys[i] = bf16_to_float(kb[i]);
        test::DeviceArray<float> dk(keys);
        test::DeviceArray<uint16_t> dkb(kb);
        test::DeviceArray<int32_t> ds(s2), dp(p2);
        test::DeviceArray<int64_t> dt(pool.table);
        test::DeviceArray<uint8_t> dpool(pool.bytes.size());
        dpool.poison();
        cuda::dsa_write_keys(bf16 ? static_cast<const void*>(dkb.ptr) : dk.ptr,
                             bf16 ? cuda::DsaDType::BF16 : cuda::DsaDType::F32, count, ds.ptr, dp.ptr, dt.ptr,
                             pool.stride, pool.block_size, format, dpool.ptr, nullptr);
        CK(cudaDeviceSynchronize());
        const std::vector<uint8_t> got = dpool.download();
        for (int64_t i = 0; i < count; ++i) pool.encode(s2[i], p2[i], &keys[i * 128]);
        // The whole pool: every token's values and scales, and nothing written anywhere else.
        for (size_t b = 0; b < got.size(); ++b)
          ASSERT_EQ(int(got[b]), int(pool.bytes[b])) << "pool byte " << b << " (page offset " << b % pool.page_bytes()
                                                     << ")";
        if (format != PageFormat::Fp8IndexKey) continue;
        // Queries (the same FP8 quantisation for every key format).
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
          dq8.poison();
          dwf.poison();
          cuda::dsa_quantize_queries(bf16 ? static_cast<const void*>(dqb.ptr) : dq.ptr,
                                     bf16 ? cuda::DsaDType::BF16 : cuda::DsaDType::F32, dw.ptr, rows, heads, dq8.ptr,
                                     dwf.ptr, nullptr);
          CK(cudaDeviceSynchronize());
          auto q8 = dq8.download();
          auto wf = dwf.download();
          for (int64_t v = 0; v < rows * heads; ++v) {
            uint8_t codes[128];
            float sc;
            quantize_ref(&q[v * 128], codes, sc);
            ASSERT_EQ(0, std::memcmp(codes, &q8[v * 128], 128)) << "vector " << v;
            ASSERT_EQ(w[v] * sc, wf[v]) << "vector " << v;
          }
        }
      }
}

// Random key pages in `format`, written straight into the pages: FP8 any non-NaN code and a positive
// scale; MXFP4 any codes and E8M0 scales around a per-key exponent, mostly within a few binades of each
// other, sometimes far below (the widening's rounded blocks) or clamped at 0; NVFP4 any codes and any
// non-NaN positive E4M3 scale (0 included).
void fill_random_keys(Pool& pool, const std::vector<int64_t>& ctx, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scd(0.001f, 0.02f);
  std::uniform_int_distribution<int> base(110, 140), near(0, 3), far(0, 30), coin(0, 9), nv_scale(0, 0x7E);
  for (size_t s = 0; s < ctx.size(); ++s)
    for (int64_t j = 0; j < ctx[s]; ++j) {
      uint8_t* v = pool.values(int(s), j);
      uint8_t* sc = pool.scales(int(s), j);
      switch (pool.format) {
        case PageFormat::Fp8IndexKey: {
          for (int i = 0; i < 128; ++i) {
            int x;
            do x = byte(rng); while ((x & 0x7F) == 0x7F);
            v[i] = uint8_t(x);
          }
          const float f = scd(rng);
          std::memcpy(sc, &f, 4);
          break;
        }
        case PageFormat::Mxfp4Rows: {
          for (int i = 0; i < 64; ++i) v[i] = uint8_t(byte(rng));
          const int e = base(rng);
          for (int b = 0; b < 4; ++b) sc[b] = uint8_t(std::max(0, e - (coin(rng) < 2 ? far(rng) : near(rng))));
          if (coin(rng) == 0) sc[coin(rng) % 4] = 0;
          break;
        }
        case PageFormat::Nvfp4Rows:
          for (int i = 0; i < 64; ++i) v[i] = uint8_t(byte(rng));
          for (int b = 0; b < 8; ++b) sc[b] = uint8_t(nv_scale(rng));
          break;
      }
    }
}

struct ScoreCase {
  int heads;
  std::vector<int64_t> ctx;      // per sequence: keys in the cache
  std::vector<int> rows_per_seq; // query rows per sequence (the last rows of its context)
  int block_size = 64;
};

void run_score_case(PageFormat format, const ScoreCase& c, std::mt19937& rng, unsigned seed) {
  const int heads = c.heads;
  const char* fname = cuda::dsa_key_format_name(format);
  Pool pool(format, c.ctx, c.block_size, rng);
  fill_random_keys(pool, c.ctx, rng);
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
  // The queries as every key format's kernels take them: e4m3 and a scale folded into the weights.
  cuda::dsa_quantize_queries(dq.ptr, cuda::DsaDType::F32, dw.ptr, rows, heads, dq8.ptr, dwf.ptr, nullptr);
  auto q8 = dq8.download();
  auto wf = dwf.download();
  std::vector<float> qf(q8.size());
  for (size_t i = 0; i < q8.size(); ++i) qf[i] = cpu::e4m3_to_float(q8[i]);

  // The reference on a sample of each row's columns (all of them up to 2048, else the first and last 64
  // and 3000 at random), computed once for every kernel: the score, and the sum of |products| that
  // scales the tolerance (a wrong key, head or scale is off by O(1) of it).
  struct Check {
    int64_t row, col;
    double ref, mag;
  };
  std::vector<Check> checks;
  std::uniform_int_distribution<int64_t> pick(0, 1 << 30);
  std::vector<float> kf(128);
  for (int64_t r = 0; r < rows; ++r) {
    const int s = row_seq[r];
    const int64_t vis = row_vis[r];
    std::vector<int64_t> cols;
    if (vis <= 2048) {
      cols.resize(vis);
      std::iota(cols.begin(), cols.end(), 0);
    } else {
      for (int64_t i = 0; i < 64; ++i) cols.push_back(i), cols.push_back(vis - 1 - i);
      for (int i = 0; i < 3000; ++i) cols.push_back(pick(rng) % vis);
    }
    for (int64_t col : cols) {
      double factor;
      pool.key(s, col, kf.data(), factor);
      double ref = 0, mag = 0;
      for (int h = 0; h < heads; ++h) {
        const float* qh = &qf[(r * heads + h) * 128];
        double dot = 0, adot = 0;
        for (int i = 0; i < 128; ++i) dot += double(qh[i]) * kf[i], adot += std::fabs(double(qh[i]) * kf[i]);
        ref += double(wf[r * heads + h]) * std::max(dot, 0.0);
        mag += std::fabs(double(wf[r * heads + h])) * adot;
      }
      checks.push_back({r, col, ref * factor, mag * factor});
    }
  }

  // Every kernel on every case (Auto picks one by format and row count: the tiled kernel for FP8 keys past
  // 256 rows, else the wgmma kernel). Hopper's FP8 wgmma accumulates with about 14 mantissa bits (DeepSeek-V3 technical
  // report, 3.3.2), hence its looser bound; the f16 product (NVFP4) accumulates in fp32, the emulated e4m3
  // mma.sync likewise. The wgmma kernel also with pairs of rows per CTA (rows_per_sequence 2), whatever the
  // cases' real pairing: pairs that straddle two sequences must still score each against its own keys.
  // The tiled kernel does not read NVFP4 keys (a one-line error).
  struct Variant {
    cuda::DsaScoreKernel kernel;
    int rows_per_sequence;
    const char* name;
  };
  const Variant variants[] = {{cuda::DsaScoreKernel::Tiles, 1, "tiles"},
                              {cuda::DsaScoreKernel::Wgmma, 1, "wgmma"},
                              {cuda::DsaScoreKernel::Wgmma, 2, "wgmma, rows in pairs"},
                              {cuda::DsaScoreKernel::Auto, 1, "auto"}};
  for (const Variant& v : variants) {
    const bool wgmma = v.kernel == cuda::DsaScoreKernel::Wgmma ||
                       (v.kernel == cuda::DsaScoreKernel::Auto && (format != PageFormat::Fp8IndexKey || rows <= 256));
    if (v.kernel == cuda::DsaScoreKernel::Tiles && format == PageFormat::Nvfp4Rows) {
      EXPECT_THROW(cuda::dsa_index_scores(dq8.ptr, dwf.ptr, rows, heads, drs.ptr, drv.ptr, dpool.ptr, dt.ptr,
                                          pool.stride, c.block_size, format, dsc.ptr, ld, max_vis, nullptr, v.kernel),
                   Error);
      continue;
    }
    const double tolerance = !wgmma ? 2e-5 : format == PageFormat::Nvfp4Rows ? 5e-5 : 3e-4;
    dsc.poison();
    cuda::dsa_index_scores(dq8.ptr, dwf.ptr, rows, heads, drs.ptr, drv.ptr, dpool.ptr, dt.ptr, pool.stride,
                           c.block_size, format, dsc.ptr, ld, max_vis, nullptr, v.kernel, v.rows_per_sequence);
    CK(cudaDeviceSynchronize());
    auto got = dsc.download();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t vis = row_vis[r];
      for (int64_t col = vis; col < ld; ++col) {
        const float g = got[r * ld + col];
        if (col >= max_vis) {
          uint32_t b;
          std::memcpy(&b, &g, 4);
          ASSERT_EQ(b, 0xFFFFFFFFu) << fname << " " << v.name << ": written past max_visible: row " << r << " col "
                                    << col << " seed " << seed;
        } else {
          ASSERT_TRUE(std::isinf(g) && g < 0) << fname << " " << v.name << ": row " << r << " col " << col << " got "
                                              << g << " seed " << seed;
        }
      }
    }
    for (const Check& ch : checks) {
      const float g = got[ch.row * ld + ch.col];
      ASSERT_TRUE(std::isfinite(g)) << fname << " " << v.name << ": row " << ch.row << " col " << ch.col << " seed "
                                    << seed;
      ASSERT_NEAR(g, ch.ref, tolerance * ch.mag + 1e-30)
          << fname << " " << v.name << ": heads " << heads << " row " << ch.row << " col " << ch.col << " vis "
          << row_vis[ch.row] << " seed " << seed;
    }
  }
}

TEST(CudaDsaIndexer, ScoresMatchCpuDecode) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (const PageFormat format : kFormats)
    for (int heads : {64, 32}) {
      run_score_case(format, {heads, {1}, {1}}, rng, seed);
      run_score_case(format, {heads, {5, 64, 65, 200}, {1, 1, 2, 1}}, rng, seed);
      run_score_case(format, {heads, {3000, 17, 4097, 1, 999, 2}, {2, 1, 1, 1, 2, 2}}, rng, seed);
      run_score_case(format, {heads, {300000}, {2}}, rng, seed);
      std::vector<int64_t> ctx;
      std::vector<int> rps;
      std::uniform_int_distribution<int64_t> len(1, 5000);
      for (int i = 0; i < 40; ++i) ctx.push_back(len(rng)), rps.push_back(1 + int(rng() % 2));
      run_score_case(format, {heads, ctx, rps}, rng, seed);
      // Other block sizes: the FP8 kernel copies a 64-key tile from one page when block_size is a multiple
      // of 64 (64, 128, 192: a shift or a division to find it) and finds each key's page otherwise (32, 48).
      for (int block_size : {32, 48, 128, 192})
        run_score_case(format, {heads, {5000, 130, 1, 700}, {1, 2, 1, 1}, block_size}, rng, seed);
    }
}

TEST(CudaDsaIndexer, ScoresMatchCpuPrefill) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (const PageFormat format : kFormats)
    for (int heads : {64, 32}) {
      run_score_case(format, {heads, {500}, {500}}, rng, seed);             // a whole prompt
      run_score_case(format, {heads, {2500, 300}, {333, 300}}, rng, seed);  // chunks continuing a cache, and a new one
      run_score_case(format, {heads, {9000}, {257}}, rng, seed);
      run_score_case(format, {heads, {130, 70}, {130, 3}, 32}, rng, seed);  // another block size
    }
}

// MXFP4 blocks far below their key's largest are rounded when widened to e4m3 (fp4_keys.cuh): with the
// query nonzero only on such a block's dims the score is that block's alone, so a kernel that widened it
// otherwise (or skipped the rounding the CPU mirrors) is off by O(1) of it. Block 1 of key j lies d = j % 24
// binades below block 0: exact for d <= 14, rounded to nearest even beyond, zero from d = 19 on.
TEST(CudaDsaIndexer, Mxfp4BlocksFarBelowTheirKeysMaximumRoundAsOnTheCpu) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int heads : {64, 32}) {
    const std::vector<int64_t> ctx = {192};
    Pool pool(PageFormat::Mxfp4Rows, ctx, 64, rng);
    for (int64_t j = 0; j < ctx[0]; ++j) {
      uint8_t* v = pool.values(0, j);
      uint8_t* sc = pool.scales(0, j);
      for (int i = 0; i < 64; ++i) v[i] = uint8_t(rng());
      sc[0] = 130, sc[1] = uint8_t(130 - j % 24), sc[2] = 120, sc[3] = 125;
    }
    const int64_t rows = 3;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(rows * heads * 128, 0.0f), w(rows * heads);
    for (int64_t v = 0; v < rows * heads; ++v)
      for (int i = 32; i < 64; ++i) q[v * 128 + i] = nd(rng);
    for (auto& x : w) x = std::fabs(nd(rng)) * 0.1f;
    std::vector<int32_t> row_seq(rows, 0), row_vis(rows, int32_t(ctx[0]));
    test::DeviceArray<float> dq(q), dw(w);
    test::DeviceArray<uint8_t> dq8(q.size());
    test::DeviceArray<float> dwf(w.size());
    test::DeviceArray<int32_t> drs(row_seq), drv(row_vis);
    test::DeviceArray<int64_t> dt(pool.table);
    test::DeviceArray<uint8_t> dpool(pool.bytes);
    const int64_t ld = ctx[0];
    test::DeviceArray<float> dsc(size_t(rows * ld));
    cuda::dsa_quantize_queries(dq.ptr, cuda::DsaDType::F32, dw.ptr, rows, heads, dq8.ptr, dwf.ptr, nullptr);
    auto q8 = dq8.download();
    auto wf = dwf.download();
    for (const auto kernel : {cuda::DsaScoreKernel::Tiles, cuda::DsaScoreKernel::Wgmma}) {
      dsc.poison();
      cuda::dsa_index_scores(dq8.ptr, dwf.ptr, rows, heads, drs.ptr, drv.ptr, dpool.ptr, dt.ptr, pool.stride, 64,
                             PageFormat::Mxfp4Rows, dsc.ptr, ld, ctx[0], nullptr, kernel);
      CK(cudaDeviceSynchronize());
      auto got = dsc.download();
      std::vector<float> kf(128);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t col = 0; col < ctx[0]; ++col) {
          double factor;
          pool.key(0, col, kf.data(), factor);
          double ref = 0, mag = 0;
          for (int h = 0; h < heads; ++h) {
            double dot = 0, adot = 0;
            for (int i = 32; i < 64; ++i) {
              const double p = double(cpu::e4m3_to_float(q8[(r * heads + h) * 128 + i])) * kf[i];
              dot += p, adot += std::fabs(p);
            }
            ref += double(wf[r * heads + h]) * std::max(dot, 0.0);
            mag += std::fabs(double(wf[r * heads + h])) * adot;
          }
          ASSERT_NEAR(got[r * ld + col], ref * factor, 3e-4 * mag * factor + 1e-30)
              << (kernel == cuda::DsaScoreKernel::Tiles ? "tiles" : "wgmma") << ": heads " << heads << " key " << col
              << " (block 1 " << col % 24 << " binades below block 0) seed " << seed;
        }
    }
  }
}

}  // namespace
