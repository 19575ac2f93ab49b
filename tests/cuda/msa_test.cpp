// MSA block selector kernels (kernels/cuda/msa) against the CPU rule (select_blocks in
// kernels/cpu/msa_reference.h) on block scores computed here from the same key values: key writes into random
// non-contiguous pages, and the kept blocks of decode and prefill rows for the test fixture's shape
// (dim 16, index block 8, top-3) and MiniMax-M3.1's (dim 128, index block 128, top-16), contexts up to
// 40K keys, 0-2 forced local blocks, both score tilings on every case, in every key format.
//
// Exact comparisons use small-integer query values and keys whose dot products are exact in fp32
// whatever the summation order (small integers, or their FP8 / NVFP4 / MXFP4 roundings: dyadic values of
// a few bits): the GPU's scores then equal the CPU's bit for bit and any tie is a true tie, resolved by
// the same rule (smaller block id). Random real values are checked for near-optimality instead (ties and
// near-ties may legitimately go either way there), and against the model's own CPU selector
// (cpu::msa_select, fp32 BLAS scores) up to near-ties, with the queries rounded to bf16 as the GPU's.
//
// Narrow keys (FP8, NVFP4, MXFP4): the write is byte for byte the CPU page codec's (page_codec(dtype,
// MsaIndexKey)), edge values included, and every selection case runs on pages the CPU codec encoded, the
// reference using the codec's decoded keys.
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
#include "kernels/cuda/msa/msa.h"
#include "kernels/cpu/msa_reference.h"

namespace {

using namespace sparrow;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

static_assert(cuda::kMsaKeyTensorScale == kKvTensorScale, "the GPU selector and the CPU codec disagree on the scale");

// The key formats, and the cache dtype whose MsaIndexKey codec stores each.
const PageFormat kFormats[] = {PageFormat::BFloat16, PageFormat::Fp8Rows,
                                       PageFormat::Nvfp4Rows, PageFormat::Mxfp4Rows};
const PageFormat kNarrowFormats[] = {PageFormat::Fp8Rows, PageFormat::Nvfp4Rows,
                                             PageFormat::Mxfp4Rows};
CacheDtype dtype_of(PageFormat f) {
  switch (f) {
    case PageFormat::BFloat16: return CacheDtype::BFloat16;
    case PageFormat::Fp8Rows: return CacheDtype::Fp8;
    case PageFormat::Nvfp4Rows: return CacheDtype::Nvfp4;
    case PageFormat::Mxfp4Rows: return CacheDtype::Mxfp4;
  }
  return CacheDtype::BFloat16;
}
const PageCodec& codec_of(PageFormat f) { return page_codec(dtype_of(f), PageKind::MsaIndexKey); }
std::string name_of(PageFormat f) { return std::string(cache_dtype_name(dtype_of(f))) + " keys"; }

// A paged pool of dim-wide keys in one format (its codec's page layout; bf16 by default) holding ctx[s]
// tokens for each sequence, pages in random order.
struct Pool {
  int block_size = 64;
  int dim = 0;
  PageFormat format = PageFormat::BFloat16;
  int64_t stride = 0;  // pages per sequence in the table
  std::vector<int64_t> table;
  std::vector<uint8_t> bytes;
  PageSpec spec() const { return {PageKind::MsaIndexKey, dim}; }
  int64_t page_bytes() const { return codec_of(format).page_bytes(spec(), block_size); }
  Pool(const std::vector<int64_t>& ctx, int bs, int d, std::mt19937& rng,
       PageFormat f = PageFormat::BFloat16)
      : block_size(bs), dim(d), format(f) {
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
  std::byte* page(size_t seq, int64_t pos) {
    return reinterpret_cast<std::byte*>(bytes.data() + table[seq * stride + pos / block_size]);
  }
  // bf16 pools: the key's row.
  uint16_t* row(size_t seq, int64_t pos) {
    return reinterpret_cast<uint16_t*>(page(seq, pos)) + (pos % block_size) * int64_t(dim);
  }
  // Stores a key (dim floats) through the format's codec; returns its decoded values (exactly bf16 values).
  std::vector<float> put(size_t seq, int64_t pos, const float* key) {
    const PageCodec& codec = codec_of(format);
    codec.encode(spec(), block_size, key, pos % block_size, 1, page(seq, pos));
    std::vector<float> back(dim);
    codec.decode(spec(), block_size, page(seq, pos), pos % block_size, 1, back.data());
    return back;
  }
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
                           PageFormat::BFloat16, nullptr);
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

// Narrow pages are what the CPU page codec stores for the same bf16 rows, byte for byte: FP8 rounding to
// nearest even (bf16 has the bits for every E4M3 midpoint, so ties occur), saturation at ±448,
// infinities, NaN, subnormals and values that round to zero; NVFP4 / MXFP4 blocks with E2M1 midpoints,
// saturated and zero-scale blocks, NaN and infinities (MXFP4's NaN scale), dims with a shorter last
// block (24, 40): from random bit patterns, edge values and N(0, 2) at random block magnitudes.
TEST(CudaMsa, WriteNarrowKeysMatchTheCpuPageCodec) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::uniform_int_distribution<int> bits(0, 0xFFFF), pick(0, 3), magnitude(-12, 10);
  // E4M3 edges: 448 (largest), 464 (its midpoint to the next power of two), 2^-9 (smallest subnormal),
  // 2^-10 (its midpoint to zero, even: 0), 3 * 2^-10, midpoints 1.0625 / 1.1875; E2M1 midpoints 0.25,
  // 0.75, 1.25, 1.75, 2.5, 3.5, 5 (ties to even) and 6, 7 (saturating) at block amax 6.
  const float special[] = {0.0f,    -0.0f,    448.0f,   464.0f,  480.0f,  1e30f,    INFINITY, -INFINITY,
                           NAN,     0x1p-9f,  0x1p-10f, 3 * 0x1p-10f, 1.0625f, 1.1875f, -2.375f,
                           0x1p-6f * 1.0625f, 240.0f, 248.0f, 0.25f, 0.75f, -1.25f, 1.75f, 2.5f, -3.5f, 5.0f,
                           6.0f,    7.0f,     -6.0f};
  for (const PageFormat format : kNarrowFormats) {
    const PageCodec& codec = codec_of(format);
    for (int dim : {128, 16, 24, 40}) {
      for (int bs : {16, 64}) {
        SCOPED_TRACE(name_of(format) + " dim " + std::to_string(dim) + " block_size " + std::to_string(bs) +
                     " seed " + std::to_string(seed));
        const PageSpec spec{PageKind::MsaIndexKey, dim};
        ASSERT_EQ(codec.page_bytes(spec, bs), bs * cuda::msa_key_bytes(format, dim));
        const std::vector<int64_t> ctx = {1, 77, 64, 300, 1000};
        Pool pool(ctx, bs, dim, rng, format);
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
        for (int64_t r = 0; r < count; ++r) {
          const float scale = std::ldexp(1.0f, magnitude(rng));  // blocks of many magnitudes
          for (int d = 0; d < dim; ++d) {
            uint16_t& v = keys[r * dim + d];
            switch (pick(rng)) {
              case 0: v = bits(rng) % 64 == 0 ? uint16_t(bits(rng)) : float_to_bf16(nd(rng) * scale); break;
              case 1: v = float_to_bf16(special[std::uniform_int_distribution<size_t>(0, std::size(special) - 1)(rng)]);
                      break;
              default: v = float_to_bf16(nd(rng) * scale); break;
            }
          }
        }
        test::DeviceArray<uint16_t> dk(keys);
        test::DeviceArray<int32_t> ds(s2), dp(p2);
        test::DeviceArray<int64_t> dt(pool.table);
        test::DeviceArray<uint8_t> dpool(pool.bytes.size());
        CK(cudaMemset(dpool.ptr, 0xA5, pool.bytes.size()));
        cuda::msa_write_keys(dk.ptr, count, dim, ds.ptr, dp.ptr, dt.ptr, pool.stride, bs, dpool.ptr, format, nullptr);
        CK(cudaDeviceSynchronize());
        const std::vector<uint8_t> got = dpool.download();
        // The CPU codec encodes each row (as floats: exactly the bf16 values) into its page slot; every other
        // byte keeps the poison.
        pool.bytes.assign(pool.bytes.size(), 0xA5);
        std::vector<float> row(dim);
        for (int64_t i = 0; i < count; ++i) {
          if (p2[i] < 0) continue;
          for (int d = 0; d < dim; ++d) row[d] = bf16_to_float(keys[i * dim + d]);
          codec.encode(spec, bs, row.data(), p2[i] % bs, 1, pool.page(s2[i], p2[i]));
        }
        for (size_t b = 0; b < got.size(); ++b)
          ASSERT_EQ(int(got[b]), int(pool.bytes[b])) << "byte " << b;
      }
    }
  }
}

enum class Values {
  SmallInts,  // integers in [-3, 3]: exact scores, many ties
  Periodic,   // small integers repeating every index block: every full block ties with block 0
  DeadBlocks, // positive queries; some blocks' keys are -2^126 everywhere (their scores overflow to -inf)
  Tiny,       // keys: integers in [-3, 3] times 2^-9 (FP8: E4M3 subnormals, widened through bf16 subnormals)
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
  int init = 0;                  // sparse_init_block: the first blocks forced too
};

// Query rows: one per sequence at its last position (decode).
void add_decode(Case& c) {
  for (size_t s = 0; s < c.ctx.size(); ++s) c.row_seq.push_back(int32_t(s)), c.row_pos.push_back(int32_t(c.ctx[s] - 1));
}
// Rows of sequence s at positions first .. ctx[s]-1 (a prefill chunk).
void add_prefill(Case& c, int s, int64_t first) {
  for (int64_t p = first; p < c.ctx[s]; ++p) c.row_seq.push_back(s), c.row_pos.push_back(int32_t(p));
}

// One case in one key format: the keys are stored through the format's CPU codec (bf16: rounded to bf16)
// into a pool of that format, and the CPU reference uses the codec's decoded keys (exactly bf16 values).
// The kernel's kept blocks must equal the CPU rule's on exact value kinds and be near-optimal on real
// values.
void run_case_in(const Case& c, std::mt19937& rng, unsigned seed, PageFormat format) {
  SCOPED_TRACE(c.name + " " + name_of(format) + " seed " + std::to_string(seed));
  const int dim = c.dim, H = c.heads;
  Pool pool(c.ctx, c.block_size, dim, rng, format);
  std::uniform_int_distribution<int> small(-3, 3), positive(1, 3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::bernoulli_distribution dead(0.3);
  // Keys: host copies of the decoded values, and the pool.
  std::vector<std::vector<float>> keys(c.ctx.size());
  std::vector<float> key(dim);
  for (size_t s = 0; s < c.ctx.size(); ++s) {
    keys[s].resize(c.ctx[s] * dim);
    std::vector<char> dead_block(c.ctx[s] / c.ib + 1);
    for (auto& d : dead_block) d = dead(rng);
    for (int64_t j = 0; j < c.ctx[s]; ++j) {
      for (int i = 0; i < dim; ++i) {
        float v = 0;
        switch (c.values) {
          case Values::SmallInts: v = float(small(rng)); break;
          case Values::Periodic: v = j < c.ib ? float(small(rng)) : keys[s][(j % c.ib) * dim + i]; break;
          case Values::DeadBlocks: v = dead_block[j / c.ib] ? -0x1p126f : float(small(rng)); break;
          case Values::Tiny: v = float(small(rng)) * 0x1p-9f; break;
          case Values::Normal: v = bf16_to_float(float_to_bf16(nd(rng))); break;
        }
        key[i] = v;
      }
      const std::vector<float> back = pool.put(s, j, key.data());
      std::copy(back.begin(), back.end(), keys[s].begin() + j * dim);
    }
  }
  const int64_t rows = int64_t(c.row_seq.size());
  std::vector<float> q(rows * H * dim);
  std::vector<uint16_t> qb(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    switch (c.values) {
      case Values::SmallInts:
      case Values::Periodic:
      case Values::Tiny: q[i] = float(small(rng)); break;
      case Values::DeadBlocks: q[i] = float(positive(rng)); break;
      case Values::Normal: q[i] = bf16_to_float(float_to_bf16(nd(rng))); break;
    }
    qb[i] = float_to_bf16(q[i]);
  }
  int64_t max_position = 0;
  for (int32_t p : c.row_pos) max_position = std::max<int64_t>(max_position, p);
  max_position += c.max_position_pad;

  // Reference block scores (double; exact for the exact value kinds) and the CPU selection.
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
      want[r * H + h] = cpu::select_blocks(std::move(fs), pos, c.ib, c.topk, c.local, c.init);
      std::sort(want[r * H + h].begin(), want[r * H + h].end());
    }
  }

  test::DeviceArray<uint16_t> dq(qb);
  test::DeviceArray<int32_t> drs(c.row_seq), drp(c.row_pos);
  test::DeviceArray<int64_t> dt(pool.table);
  test::DeviceArray<uint8_t> dpool(pool.bytes);
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
    cuda::msa_select_blocks(dq.ptr, rows, H, dim, drs.ptr, drp.ptr, max_position, dpool.ptr, format, dt.ptr,
                            pool.stride, c.block_size, c.ib, c.topk, c.local, c.init, dblocks.ptr, dcounts.ptr, dws.ptr, wsb,
                            nullptr, kernel);
    CK(cudaDeviceSynchronize());
    const std::vector<int32_t> got = dblocks.download(), counts = dcounts.download();
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
        for (int64_t b = 0; b < std::min<int64_t>(c.init, newest + 1); ++b) forced[b] = 1;
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

// Every case in every key format.
void run_case(const Case& c, std::mt19937& rng, unsigned seed) {
  for (const PageFormat format : kFormats) run_case_in(c, rng, seed, format);
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

// sparse_init_block > 0 (vLLM reads it; every release has 0): the first blocks are forced beside the
// local ones, in decode and prefill rows, up to the whole budget.
TEST(CudaMsa, SelectForcesInitBlocksAsTheCpuDoes) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int init : {1, 2, 3})
    for (int local : {0, 1}) {
      Case dec = fixture_case("fixture decode, init blocks", {1, 5, 9, 17, 25, 64, 300}, local, 16);
      dec.init = init;
      add_decode(dec);
      run_case(dec, rng, seed);
      Case pre = fixture_case("fixture prefill, init blocks", {300}, local, 64);
      pre.init = init;
      add_prefill(pre, 0, 0);
      run_case(pre, rng, seed);
    }
  Case c = minimax_case("minimax decode, init blocks", {1, 129, 2049, 16385}, 1, 64);
  c.init = 2;
  add_decode(c);
  run_case(c, rng, seed);
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

// Keys of magnitude 2^-9 .. 3 * 2^-9: E4M3 subnormals, which the FP8 path widens through bf16 subnormals
// (a flush to zero anywhere would zero every score); exact for every format.
TEST(CudaMsa, SelectReadsTinyKeysExactly) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  Case m = minimax_case("minimax tiny keys", {3000, 700, 5000}, 1, 64);
  m.values = Values::Tiny;
  add_decode(m);
  add_prefill(m, 1, 600);
  run_case(m, rng, seed);
  Case f = fixture_case("fixture tiny keys", {300, 41}, 1, 16);
  f.values = Values::Tiny;
  add_decode(f);
  run_case(f, rng, seed);
}

// The model's CPU selector (MsaIndexer::select: fp32 BLAS scores over the cache's decoded keys) and the GPU's
// over the same pages, per key format, with the queries rounded to bf16 as the GPU's are: the same blocks,
// except where the block scores at the selection's boundary are within rounding of each other (then both
// selections must be near-optimal on exact scores).
TEST(CudaMsa, SelectMatchesTheModelsCpuSelectorPerKeyFormat) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  struct Shape {
    int dim, ib, topk, local, heads;
  };
  for (const Shape& sh : {Shape{128, 128, 16, 1, 4}, Shape{16, 8, 3, 1, 2}}) {
    const cpu::MsaSelectShape cpu_shape{sh.heads, sh.dim, sh.ib, sh.topk, sh.local, /*init_blocks=*/0};
    const std::vector<int64_t> ctx = sh.dim == 128 ? std::vector<int64_t>{9000, 3000, 129, 20000}
                                                  : std::vector<int64_t>{300, 1000, 9};
    // Decode rows of every sequence, and a prefill chunk of the second one.
    std::vector<int32_t> row_seq, row_pos;
    for (size_t s = 0; s < ctx.size(); ++s) row_seq.push_back(int32_t(s)), row_pos.push_back(int32_t(ctx[s] - 1));
    for (int64_t p = ctx[1] - 200; p < ctx[1] - 1; ++p) row_seq.push_back(1), row_pos.push_back(int32_t(p));
    const int64_t rows = int64_t(row_seq.size());
    std::vector<uint16_t> qb(rows * sh.heads * sh.dim);
    std::vector<float> q(qb.size());
    for (size_t i = 0; i < q.size(); ++i) qb[i] = float_to_bf16(nd(rng)), q[i] = bf16_to_float(qb[i]);
    int64_t max_position = 0;
    for (int32_t p : row_pos) max_position = std::max<int64_t>(max_position, p);
    for (const PageFormat format : kFormats) {
      SCOPED_TRACE(name_of(format) + " dim " + std::to_string(sh.dim) + " seed " + std::to_string(seed));
      Pool pool(ctx, 64, sh.dim, rng, format);
      std::vector<std::vector<float>> keys(ctx.size());
      std::vector<float> key(sh.dim);
      for (size_t s = 0; s < ctx.size(); ++s) {
        keys[s].resize(ctx[s] * sh.dim);
        for (int64_t j = 0; j < ctx[s]; ++j) {
          for (float& v : key) v = nd(rng);
          const std::vector<float> back = pool.put(s, j, key.data());
          std::copy(back.begin(), back.end(), keys[s].begin() + j * sh.dim);
        }
      }
      test::DeviceArray<uint16_t> dq(qb);
      test::DeviceArray<int32_t> drs(row_seq), drp(row_pos);
      test::DeviceArray<int64_t> dt(pool.table);
      test::DeviceArray<uint8_t> dpool(pool.bytes);
      test::DeviceArray<int32_t> dblocks(rows * sh.heads * sh.topk);
      const size_t wsb = cuda::msa_select_workspace_bytes(rows, sh.heads, max_position, sh.ib);
      test::DeviceArray<uint8_t> dws(wsb);
      dblocks.poison();
      cuda::msa_select_blocks(dq.ptr, rows, sh.heads, sh.dim, drs.ptr, drp.ptr, max_position, dpool.ptr, format,
                              dt.ptr, pool.stride, 64, sh.ib, sh.topk, sh.local, /*init_blocks=*/0, dblocks.ptr, nullptr, dws.ptr, wsb,
                              nullptr);
      CK(cudaDeviceSynchronize());
      const std::vector<int32_t> got = dblocks.download();
      int near_ties = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int pos = row_pos[r];
        const std::vector<float>& ks = keys[row_seq[r]];
        // The model's CPU path for this one query (cpu::msa_select of a decode step at `pos`).
        std::vector<int32_t> cpu_kept(sh.heads * sh.topk);
        cpu::msa_select(cpu_shape, &q[r * sh.heads * sh.dim], sh.heads * sh.dim, 1, pos, ks.data(), cpu_kept.data());
        for (int h = 0; h < sh.heads; ++h) {
          const std::string where = "row " + std::to_string(r) + " (pos " + std::to_string(pos) + ") head " +
                                    std::to_string(h);
          std::vector<int32_t> gpu_sel, cpu_sel;
          for (int j = 0; j < sh.topk; ++j)
            if (got[(r * sh.heads + h) * sh.topk + j] >= 0) gpu_sel.push_back(got[(r * sh.heads + h) * sh.topk + j]);
          for (int j = 0; j < sh.topk; ++j)
            if (cpu_kept[h * sh.topk + j] >= 0) cpu_sel.push_back(cpu_kept[h * sh.topk + j]);
          if (gpu_sel == cpu_sel) continue;
          // Exact block scores (double) decide whether the difference is a near-tie at the boundary.
          const float* qv = &q[(r * sh.heads + h) * sh.dim];
          std::vector<double> score(pos / sh.ib + 1, -INFINITY);
          for (int64_t s = 0; s <= pos; ++s) {
            double dot = 0;
            for (int i = 0; i < sh.dim; ++i) dot += double(qv[i]) * ks[s * sh.dim + i];
            score[s / sh.ib] = std::max(score[s / sh.ib], dot);
          }
          ASSERT_EQ(gpu_sel.size(), cpu_sel.size()) << where;
          std::vector<int32_t> only_gpu, only_cpu;
          std::set_difference(gpu_sel.begin(), gpu_sel.end(), cpu_sel.begin(), cpu_sel.end(),
                              std::back_inserter(only_gpu));
          std::set_difference(cpu_sel.begin(), cpu_sel.end(), gpu_sel.begin(), gpu_sel.end(),
                              std::back_inserter(only_cpu));
          double lo = INFINITY, hi = -INFINITY;
          for (int32_t b : only_gpu) lo = std::min(lo, score[b]), hi = std::max(hi, score[b]);
          for (int32_t b : only_cpu) lo = std::min(lo, score[b]), hi = std::max(hi, score[b]);
          // Scores are sums of 128 products of order 1: fp32 summation differs by ~1e-5 relative.
          ASSERT_LE(hi - lo, 1e-3 * std::max(1.0, std::fabs(hi))) << where << ": the selections differ beyond a tie";
          ++near_ties;
        }
      }
      EXPECT_LE(near_ties, int(rows) * sh.heads / 20) << "too many near-ties: the scores are not the same";
    }
  }
}

}  // namespace
