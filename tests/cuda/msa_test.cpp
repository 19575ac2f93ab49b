// MSA block selector kernels (kernels/cuda/msa) against the CPU rule (select_blocks in
// model/msa_indexer.h) on block scores computed here from the same bf16 values: key writes into random
// non-contiguous pages, and the kept blocks of decode and prefill rows for the test fixture's shape
// (dim 16, index block 8, top-3) and MiniMax-M3.1's (dim 128, index block 128, top-16), contexts up to
// 40K keys, 0-2 forced local blocks, both score tilings on every case.
//
// Exact comparisons use small-integer bf16 values, for which every dot product is an integer far below
// 2^24, hence exact in fp32 whatever the summation order: the GPU's scores then equal the CPU's bit for
// bit and any tie is a true tie, resolved by the same rule (smaller block id). Random real values are
// checked for near-optimality instead (ties and near-ties may legitimately go either way there).
//
// FP8 keys: the write is byte for byte the CPU page codec's (page_codec(fp8, MsaIndexKey)), and every
// selection case runs again on FP8 pages of the same keys, whose kept blocks must equal exactly those of
// the bf16 kernel on the dequantised keys (and the CPU rule's, for the exact value kinds).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cache/page_codec.h"
#include "core/bfloat16.h"
#include "gpu_test_util.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cuda/msa/msa.h"
#include "model/msa_indexer.h"

namespace {

using namespace sparrow;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x


// A paged pool of dim-wide rows (bf16, or E4M3 when value_bytes is 1) holding ctx[s] tokens for each
// sequence, pages in random order.
struct Pool {
  int block_size = 64;
  int dim = 0;
  int value_bytes = 2;
  int64_t stride = 0;  // pages per sequence in the table
  std::vector<int64_t> table;
  std::vector<uint8_t> bytes;
  int64_t row_bytes() const { return int64_t(dim) * value_bytes; }
  int64_t page_bytes() const { return int64_t(block_size) * row_bytes(); }
  Pool(const std::vector<int64_t>& ctx, int bs, int d, std::mt19937& rng, int vb = 2)
      : block_size(bs), dim(d), value_bytes(vb) {
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
  uint8_t* row_at(size_t seq, int64_t pos) {
    return bytes.data() + table[seq * stride + pos / block_size] + (pos % block_size) * row_bytes();
  }
  uint16_t* row(size_t seq, int64_t pos) { return reinterpret_cast<uint16_t*>(row_at(seq, pos)); }
};

TEST(CudaMsa, WriteKeysFillTheirPageSlots) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int dim : {128, 16, 24}) {
    for (int bs : {16, 64}) {
      const std::vector<int64_t> ctx = {1, 77, 64, 300, 1000};
      Pool pool(ctx, bs, dim, rng);
      // Every position of every sequence in a shuffled order, and two padding rows (position -1).
      std::vector<int32_t> tseq, tpos;
      for (size_t s = 0; s < ctx.size(); ++s)
        for (int64_t j = 0; j < ctx[s]; ++j) tseq.push_back(int32_t(s)), tpos.push_back(int32_t(j));
      tseq.push_back(0), tpos.push_back(-1);
      tseq.push_back(3), tpos.push_back(-1);
      std::vector<size_t> order(tseq.size());
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<int32_t> s2(tseq.size()), p2(tseq.size());
      for (size_t i = 0; i < order.size(); ++i) s2[i] = tseq[order[i]], p2[i] = tpos[order[i]];
      const int64_t count = int64_t(s2.size());
      std::vector<uint16_t> keys(count * dim);
      for (auto& v : keys) v = float_to_bf16(nd(rng));
      test::DeviceArray<uint16_t> dk(keys);
      test::DeviceArray<int32_t> ds(s2), dp(p2);
      test::DeviceArray<int64_t> dt(pool.table);
      test::DeviceArray<uint8_t> dpool(pool.bytes.size());
      CK(cudaMemset(dpool.ptr, 0xA5, pool.bytes.size()));
      cuda::msa_write_keys(dk.ptr, count, dim, ds.ptr, dp.ptr, dt.ptr, pool.stride, bs, dpool.ptr,
                           cuda::MsaKeyFormat::BFloat16, nullptr);
      CK(cudaDeviceSynchronize());
      const std::vector<uint8_t> got = dpool.download();
      // Every owned slot holds its row; everything else (pages nobody owns, slots past a sequence's end)
      // is untouched.
      std::vector<uint8_t> want(pool.bytes.size(), 0xA5);
      pool.bytes = want;
      for (int64_t i = 0; i < count; ++i)
        if (p2[i] >= 0) std::memcpy(pool.row(s2[i], p2[i]), &keys[i * dim], dim * 2);
      ASSERT_EQ(0, std::memcmp(pool.bytes.data(), got.data(), got.size()))
          << "dim " << dim << " block_size " << bs << " seed " << seed;
    }
  }
}

// FP8 pages are what the CPU page codec stores for the same bf16 rows, byte for byte: rounding to
// nearest even (bf16 has the bits for every E4M3 midpoint, so ties occur), saturation at ±448,
// infinities, NaN, subnormals and values that round to zero, from random bit patterns and N(0, 2).
TEST(CudaMsa, WriteFp8KeysMatchTheCpuPageCodec) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::uniform_int_distribution<int> bits(0, 0xFFFF), pick(0, 3);
  // Midpoints between neighbouring E4M3 values, and the edges: 448 (largest), 464 (its midpoint to the
  // next power of two), 2^-9 (smallest subnormal), 2^-10 (its midpoint to zero, even: 0), 3 * 2^-10.
  const float special[] = {0.0f,          -0.0f,         448.0f,   464.0f,  480.0f, 1e30f,          INFINITY,
                           -INFINITY,     NAN,           0x1p-9f,  0x1p-10f, 3 * 0x1p-10f, 1.0625f, 1.1875f,
                           -2.375f,       0x1p-6f * 1.0625f, 240.0f, 248.0f};
  const PageCodec& codec = page_codec(CacheDtype::Fp8, PageKind::MsaIndexKey);
  ASSERT_EQ(codec.format(), PageFormat::Fp8Rows);
  for (int dim : {128, 16, 24}) {
    for (int bs : {16, 64}) {
      const PageSpec spec{PageKind::MsaIndexKey, dim};
      ASSERT_EQ(codec.page_bytes(spec, bs), int64_t(bs) * dim);
      const std::vector<int64_t> ctx = {1, 77, 64, 300, 1000};
      Pool pool(ctx, bs, dim, rng, /*value_bytes=*/1);
      std::vector<int32_t> tseq, tpos;
      for (size_t s = 0; s < ctx.size(); ++s)
        for (int64_t j = 0; j < ctx[s]; ++j) tseq.push_back(int32_t(s)), tpos.push_back(int32_t(j));
      tseq.push_back(2), tpos.push_back(-1);
      std::vector<size_t> order(tseq.size());
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<int32_t> s2(tseq.size()), p2(tseq.size());
      for (size_t i = 0; i < order.size(); ++i) s2[i] = tseq[order[i]], p2[i] = tpos[order[i]];
      const int64_t count = int64_t(s2.size());
      std::vector<uint16_t> keys(count * dim);
      for (auto& v : keys) {
        switch (pick(rng)) {
          case 0: v = uint16_t(bits(rng)); break;  // any bf16, NaNs and infinities included
          case 1: v = float_to_bf16(special[std::uniform_int_distribution<size_t>(0, std::size(special) - 1)(rng)]);
                  break;
          default: v = float_to_bf16(nd(rng)); break;
        }
      }
      test::DeviceArray<uint16_t> dk(keys);
      test::DeviceArray<int32_t> ds(s2), dp(p2);
      test::DeviceArray<int64_t> dt(pool.table);
      test::DeviceArray<uint8_t> dpool(pool.bytes.size());
      CK(cudaMemset(dpool.ptr, 0xA5, pool.bytes.size()));
      cuda::msa_write_keys(dk.ptr, count, dim, ds.ptr, dp.ptr, dt.ptr, pool.stride, bs, dpool.ptr,
                           cuda::MsaKeyFormat::Fp8, nullptr);
      CK(cudaDeviceSynchronize());
      const std::vector<uint8_t> got = dpool.download();
      // The CPU codec encodes each row (as floats: exactly the bf16 values) into its page slot.
      pool.bytes.assign(pool.bytes.size(), 0xA5);
      std::vector<float> row(dim);
      for (int64_t i = 0; i < count; ++i) {
        if (p2[i] < 0) continue;
        for (int d = 0; d < dim; ++d) row[d] = bf16_to_float(keys[i * dim + d]);
        uint8_t* page = pool.bytes.data() + pool.table[s2[i] * pool.stride + p2[i] / bs];
        codec.encode(spec, bs, row.data(), p2[i] % bs, 1, reinterpret_cast<std::byte*>(page));
      }
      for (size_t b = 0; b < got.size(); ++b)
        ASSERT_EQ(int(got[b]), int(pool.bytes[b])) << "byte " << b << " dim " << dim << " block_size " << bs
                                                   << " seed " << seed;
    }
  }
}

enum class Values {
  SmallInts,  // integers in [-3, 3]: exact scores, many ties
  Periodic,   // small integers repeating every index block: every full block ties with block 0
  DeadBlocks, // positive queries; some blocks' keys are -2^126 everywhere (their scores overflow to -inf)
  Normal,     // N(0, 1): near-optimality check only
};

struct Case {
  std::string name;
  int dim, ib, topk, local, heads, block_size;
  std::vector<int64_t> ctx;     // keys per sequence
  std::vector<int32_t> row_seq; // query rows (any order)
  std::vector<int32_t> row_pos; // -1: a padding row
  Values values = Values::SmallInts;
  int64_t max_position_pad = 0;  // added to the largest position for max_position
};

// Query rows: one per sequence at its last position (decode).
void add_decode(Case& c) {
  for (size_t s = 0; s < c.ctx.size(); ++s) c.row_seq.push_back(int32_t(s)), c.row_pos.push_back(int32_t(c.ctx[s] - 1));
}
// Rows of sequence s at positions first .. ctx[s]-1 (a prefill chunk).
void add_prefill(Case& c, int s, int64_t first) {
  for (int64_t p = first; p < c.ctx[s]; ++p) c.row_seq.push_back(s), c.row_pos.push_back(int32_t(p));
}

// One case in one key format. Fp8: the keys are first rounded to E4M3 (the CPU codec's rule), the CPU
// reference and a bf16 pool use the dequantised values, and the FP8 pool holds the codes; the FP8 kernel's
// kept blocks must equal the bf16 kernel's on the dequantised pool exactly (and the CPU rule's, as bf16's).
void run_case_in(const Case& c, std::mt19937& rng, unsigned seed, cuda::MsaKeyFormat format) {
  const bool fp8 = format == cuda::MsaKeyFormat::Fp8;
  SCOPED_TRACE(c.name + (fp8 ? " fp8 keys" : " bf16 keys") + " seed " + std::to_string(seed));
  const int dim = c.dim, H = c.heads;
  Pool pool(c.ctx, c.block_size, dim, rng);
  Pool pool8(c.ctx, c.block_size, dim, rng, /*value_bytes=*/1);
  std::uniform_int_distribution<int> small(-3, 3), positive(1, 3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::bernoulli_distribution dead(0.3);
  // Keys: host copies (as floats, exactly the bf16 values) and the pool.
  std::vector<std::vector<float>> keys(c.ctx.size());
  for (size_t s = 0; s < c.ctx.size(); ++s) {
    keys[s].resize(c.ctx[s] * dim);
    std::vector<char> dead_block(c.ctx[s] / c.ib + 1);
    for (auto& d : dead_block) d = dead(rng);
    for (int64_t j = 0; j < c.ctx[s]; ++j)
      for (int i = 0; i < dim; ++i) {
        float v = 0;
        switch (c.values) {
          case Values::SmallInts: v = float(small(rng)); break;
          case Values::Periodic: v = j < c.ib ? float(small(rng)) : keys[s][(j % c.ib) * dim + i]; break;
          case Values::DeadBlocks: v = dead_block[j / c.ib] ? -0x1p126f : float(small(rng)); break;
          case Values::Normal: v = bf16_to_float(float_to_bf16(nd(rng))); break;
        }
        if (fp8) {
          const uint8_t code = cpu::float_to_e4m3(v);
          pool8.row_at(s, j)[i] = code;
          v = cpu::e4m3_to_float(code);  // exactly a bf16 value
        }
        keys[s][j * dim + i] = v;
        pool.row(s, j)[i] = float_to_bf16(v);
      }
  }
  const int64_t rows = int64_t(c.row_seq.size());
  std::vector<float> q(rows * H * dim);
  std::vector<uint16_t> qb(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    switch (c.values) {
      case Values::SmallInts:
      case Values::Periodic: q[i] = float(small(rng)); break;
      case Values::DeadBlocks: q[i] = float(positive(rng)); break;
      case Values::Normal: q[i] = bf16_to_float(float_to_bf16(nd(rng))); break;
    }
    qb[i] = float_to_bf16(q[i]);
  }
  int64_t max_position = 0;
  for (int32_t p : c.row_pos) max_position = std::max<int64_t>(max_position, p);
  max_position += c.max_position_pad;

  // Reference block scores (double; exact for the integer values) and the CPU selection.
  std::vector<std::vector<double>> ref(rows * H);
  std::vector<std::vector<int32_t>> want(rows * H);
  for (int64_t r = 0; r < rows; ++r) {
    const int pos = c.row_pos[r];
    if (pos < 0) continue;
    const std::vector<float>& ks = keys[c.row_seq[r]];
    for (int h = 0; h < H; ++h) {
      const float* qv = &q[(r * H + h) * dim];
      std::vector<double>& bs = ref[r * H + h];
      bs.assign(pos / c.ib + 1, -INFINITY);
      for (int64_t s = 0; s <= pos; ++s) {
        const float* kv = &ks[s * dim];
        double dot = 0;
        for (int i = 0; i < dim; ++i) dot += double(qv[i]) * double(kv[i]);
        // fp32 overflow as the GPU's fp32 sums see it (only the dead blocks get near it).
        if (std::fabs(dot) > 3.4e38) dot = dot > 0 ? INFINITY : -INFINITY;
        bs[s / c.ib] = std::max(bs[s / c.ib], dot);
      }
      std::vector<float> fs(bs.begin(), bs.end());
      want[r * H + h] = select_blocks(std::move(fs), pos, c.ib, c.topk, c.local);
      std::sort(want[r * H + h].begin(), want[r * H + h].end());
    }
  }

  test::DeviceArray<uint16_t> dq(qb);
  test::DeviceArray<int32_t> drs(c.row_seq), drp(c.row_pos);
  test::DeviceArray<int64_t> dt(pool.table);
  test::DeviceArray<uint8_t> dpool(pool.bytes), dpool8(fp8 ? pool8.bytes : std::vector<uint8_t>(1));
  test::DeviceArray<int64_t> dt8(pool8.table);
  test::DeviceArray<int32_t> dblocks(rows * H * c.topk), dcounts(rows * H);
  const size_t wsb = cuda::msa_select_workspace_bytes(rows, H, max_position, c.ib);
  test::DeviceArray<uint8_t> dws(wsb);
  ASSERT_NE(dws.ptr, nullptr);
  for (const auto kernel : {cuda::MsaScoreKernel::Decode, cuda::MsaScoreKernel::Prefill}) {
    const char* kname = kernel == cuda::MsaScoreKernel::Decode ? "decode tiling" : "prefill tiling";
    SCOPED_TRACE(kname);
    // Poison: outputs 0x7F7F7F7F; workspace 3.4e38 (an unwritten block score would win the top-k).
    CK(cudaMemset(dblocks.ptr, 0x7F, rows * H * c.topk * 4));
    CK(cudaMemset(dcounts.ptr, 0x7F, rows * H * 4));
    CK(cudaMemset(dws.ptr, 0x7F, std::max<size_t>(wsb, 1)));
    cuda::msa_select_blocks(dq.ptr, rows, H, dim, drs.ptr, drp.ptr, max_position, dpool.ptr,
                            cuda::MsaKeyFormat::BFloat16, dt.ptr, pool.stride, c.block_size, c.ib, c.topk, c.local,
                            dblocks.ptr, dcounts.ptr, dws.ptr, wsb, nullptr, kernel);
    CK(cudaDeviceSynchronize());
    const std::vector<int32_t> got = dblocks.download(), counts = dcounts.download();
    if (fp8) {
      // The FP8 pages of the same keys: exactly the bf16 kernel's output on the dequantised keys.
      CK(cudaMemset(dblocks.ptr, 0x7F, rows * H * c.topk * 4));
      CK(cudaMemset(dcounts.ptr, 0x7F, rows * H * 4));
      CK(cudaMemset(dws.ptr, 0x7F, std::max<size_t>(wsb, 1)));
      cuda::msa_select_blocks(dq.ptr, rows, H, dim, drs.ptr, drp.ptr, max_position, dpool8.ptr,
                              cuda::MsaKeyFormat::Fp8, dt8.ptr, pool8.stride, c.block_size, c.ib, c.topk, c.local,
                              dblocks.ptr, dcounts.ptr, dws.ptr, wsb, nullptr, kernel);
      CK(cudaDeviceSynchronize());
      const std::vector<int32_t> got8 = dblocks.download(), counts8 = dcounts.download();
      ASSERT_EQ(counts8, counts) << "fp8 keys: counts differ from the bf16 kernel's on the dequantised keys";
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(got8[i], got[i]) << "fp8 keys: entry " << i << " (vector " << i / c.topk
                                   << ") differs from the bf16 kernel's on the dequantised keys";
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int h = 0; h < H; ++h) {
        const int64_t v = r * H + h;
        const int32_t* out = &got[v * c.topk];
        const int pos = c.row_pos[r];
        std::string where = "row " + std::to_string(r) + " (seq " + std::to_string(c.row_seq[r]) + ", pos " +
                            std::to_string(pos) + ") head " + std::to_string(h);
        std::vector<int32_t> sel;
        for (int j = 0; j < c.topk; ++j)
          if (out[j] != -1) sel.push_back(out[j]);
        ASSERT_EQ(int(sel.size()), counts[v]) << where;
        for (int j = 0; j < c.topk; ++j)  // the ids first, then -1 padding
          ASSERT_EQ(out[j] == -1, j >= counts[v]) << where << " slot " << j << " = " << out[j];
        for (size_t j = 1; j < sel.size(); ++j) ASSERT_LT(sel[j - 1], sel[j]) << where << ": not ascending";
        if (pos < 0) continue;
        const std::vector<int32_t>& w = want[v];
        if (c.values != Values::Normal) {
          ASSERT_EQ(sel, w) << where;
          continue;
        }
        // Real values: the same count, every forced block, and the others among the best up to 1e-3.
        ASSERT_EQ(sel.size(), w.size()) << where;
        const int64_t newest = pos / c.ib;
        std::vector<char> forced(newest + 1, 0);
        for (int l = 0; l < c.local; ++l) forced[std::max<int64_t>(newest - l, 0)] = 1;
        std::vector<double> others;
        for (int64_t b = 0; b <= newest; ++b)
          if (!forced[b]) others.push_back(ref[v][b]);
        std::sort(others.begin(), others.end(), std::greater<>());
        const int free_slots = int(w.size()) - int(std::count(forced.begin(), forced.end(), 1));
        for (int64_t b = 0; b <= newest; ++b) {
          if (forced[b]) {
            ASSERT_TRUE(std::binary_search(sel.begin(), sel.end(), int32_t(b))) << where << " forced " << b;
          }
        }
        if (free_slots <= 0) continue;
        const double kth = others[free_slots - 1];
        for (int32_t b : sel) {
          ASSERT_GE(b, 0) << where;
          ASSERT_LE(b, newest) << where;
          if (!forced[b]) {
            ASSERT_GE(ref[v][b], kth - 1e-3 * std::max(1.0, std::fabs(kth))) << where << " block " << b;
          }
        }
      }
  }
}

void run_case(const Case& c, std::mt19937& rng, unsigned seed) {
  run_case_in(c, rng, seed, cuda::MsaKeyFormat::BFloat16);
  run_case_in(c, rng, seed, cuda::MsaKeyFormat::Fp8);
}

Case fixture_case(std::string name, std::vector<int64_t> ctx, int local, int block_size) {
  return Case{std::move(name), 16, 8, 3, local, 2, block_size, std::move(ctx), {}, {}};
}
Case minimax_case(std::string name, std::vector<int64_t> ctx, int local, int block_size) {
  return Case{std::move(name), 128, 128, 16, local, 4, block_size, std::move(ctx), {}, {}};
}

TEST(CudaMsa, SelectMatchesCpuFixtureShape) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int local : {0, 1, 2})
    for (int bs : {16, 64}) {
      Case dec = fixture_case("fixture decode", {1, 5, 8, 9, 16, 17, 24, 25, 64, 300, 1000}, local, bs);
      add_decode(dec);
      run_case(dec, rng, seed);
      Case pre = fixture_case("fixture prefill", {300, 40}, local, bs);
      add_prefill(pre, 0, 0);
      add_prefill(pre, 1, 30);
      run_case(pre, rng, seed);
    }
}

TEST(CudaMsa, SelectMatchesCpuMiniMaxShapeDecode) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int local : {0, 1, 2}) {
    Case c = minimax_case("minimax decode", {1, 2, 127, 128, 129, 1000, 2048, 2049, 4096, 16385, 40000}, local,
                          local == 1 ? 16 : 64);
    add_decode(c);
    run_case(c, rng, seed);
  }
  // Many sequences of random lengths (a real decode batch).
  std::uniform_int_distribution<int64_t> len(1, 6000);
  Case c = minimax_case("minimax decode batch", {}, 1, 64);
  for (int i = 0; i < 64; ++i) c.ctx.push_back(len(rng));
  add_decode(c);
  run_case(c, rng, seed);
}

TEST(CudaMsa, SelectMatchesCpuMiniMaxShapePrefill) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int local : {0, 1, 2}) {
    Case whole = minimax_case("minimax prefill from 0", {700}, local, 64);
    add_prefill(whole, 0, 0);
    run_case(whole, rng, seed);
    Case chunk = minimax_case("minimax prefill chunk", {3000}, local, 16);
    add_prefill(chunk, 0, 2800);
    run_case(chunk, rng, seed);
  }
}

TEST(CudaMsa, SelectMatchesCpuMixedRowsAndPadding) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int shape = 0; shape < 2; ++shape) {
    // Prefill chunks of two sequences and decodes of others, rows shuffled, plus padding rows.
    Case c = shape ? minimax_case("minimax mixed", {900, 200, 5000, 1, 129}, 1, 64)
                   : fixture_case("fixture mixed", {90, 20, 500, 1, 9}, 1, 16);
    add_prefill(c, 0, 700);
    add_prefill(c, 1, 0);
    for (int s = 2; s < 5; ++s) c.row_seq.push_back(s), c.row_pos.push_back(int32_t(c.ctx[s] - 1));
    c.row_seq.push_back(0), c.row_pos.push_back(-1);
    c.row_seq.push_back(3), c.row_pos.push_back(-1);
    std::vector<size_t> order(c.row_seq.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    Case d = c;
    for (size_t i = 0; i < order.size(); ++i) d.row_seq[i] = c.row_seq[order[i]], d.row_pos[i] = c.row_pos[order[i]];
    d.max_position_pad = 1000;  // a padded bound changes nothing
    run_case(d, rng, seed);
  }
}

TEST(CudaMsa, SelectMatchesCpuOtherShapes) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  struct Shape {
    int dim, ib, topk, local, heads;
  };
  // The generic dim path (not 16/128/256), one and 64 heads (a warp's vectors span many rows / part of
  // one), odd head counts (vector chunks straddle rows), index blocks smaller than a 16-key tile and not
  // dividing it, top-1 and top-64.
  const std::vector<Shape> shapes = {{24, 16, 5, 1, 3}, {8, 3, 4, 2, 1},    {256, 32, 7, 1, 5}, {64, 128, 16, 1, 64},
                                     {48, 5, 64, 3, 7}, {128, 100, 1, 0, 4}, {128, 1, 9, 1, 2}};
  for (const Shape& s : shapes) {
    Case c{"dim " + std::to_string(s.dim) + " ib " + std::to_string(s.ib) + " heads " + std::to_string(s.heads),
           s.dim, s.ib, s.topk, s.local, s.heads, 16, {1, 33, 700, 2500}, {}, {}};
    add_decode(c);
    add_prefill(c, 2, 500);
    run_case(c, rng, seed);
  }
}

TEST(CudaMsa, SelectTiesGoToTheSmallerBlock) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int local : {0, 1, 2}) {
    Case f = fixture_case("fixture ties", {1, 30, 200}, local, 16);
    f.values = Values::Periodic;
    add_decode(f);
    add_prefill(f, 2, 150);
    run_case(f, rng, seed);
    Case m = minimax_case("minimax ties", {5000, 300, 2100}, local, 64);
    m.values = Values::Periodic;
    add_decode(m);
    add_prefill(m, 1, 200);
    run_case(m, rng, seed);
  }
}

TEST(CudaMsa, SelectDropsBlocksScoringMinusInfinity) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int local : {0, 1}) {
    Case f = fixture_case("fixture dead blocks", {7, 20, 100, 300}, local, 16);
    f.values = Values::DeadBlocks;
    add_decode(f);
    add_prefill(f, 3, 250);
    run_case(f, rng, seed);
    Case m = minimax_case("minimax dead blocks", {2000, 5000}, local, 64);
    m.values = Values::DeadBlocks;
    add_decode(m);
    run_case(m, rng, seed);
  }
}

TEST(CudaMsa, SelectNearOptimalOnRealValues) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  Case d = minimax_case("minimax real values decode", {1, 129, 3000, 20000, 40000}, 1, 64);
  d.values = Values::Normal;
  add_decode(d);
  run_case(d, rng, seed);
  Case p = minimax_case("minimax real values prefill", {2500}, 2, 16);
  p.values = Values::Normal;
  add_prefill(p, 0, 2300);
  run_case(p, rng, seed);
  Case f = fixture_case("fixture real values", {300, 1000}, 1, 64);
  f.values = Values::Normal;
  add_decode(f);
  add_prefill(f, 0, 0);
  run_case(f, rng, seed);
}

TEST(CudaMsa, SelectInRowChunksWithAPaddedBound) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  // max_position far beyond the rows: 125001 blocks of 16 heads are 8 MB of scores per row, so the
  // launch runs in chunks of a few rows, and the selection works on its workspace rows in place.
  Case c{"row chunks", 16, 8, 3, 1, 16, 64, {3000, 50}, {}, {}};
  c.max_position_pad = 1000000;
  add_prefill(c, 0, 2960);
  add_decode(c);
  const int64_t rows = int64_t(c.row_seq.size()), max_position = 2999 + c.max_position_pad;
  ASSERT_LT(cuda::msa_select_workspace_bytes(rows, 16, max_position, 8),
            size_t(rows) * 16 * (max_position / 8 + 1) * sizeof(float));  // it does run in chunks
  run_case(c, rng, seed);
}

}  // namespace
