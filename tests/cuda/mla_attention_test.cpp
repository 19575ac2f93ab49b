// MLA attention kernels (src/kernels/cuda/mla) in every latent format they read (bf16, FlashMLA's FP8
// 656 B, FP8 rows 576 B, NVFP4 352 B), against the CPU page codecs (cache/page_codec.h: the definition of
// each format's bytes) and a float64 CPU attention over the codecs' decoded rows:
//   - the write kernel's bytes equal the codec's encode, byte for byte (edge values included);
//   - a row attending to one key returns that key's decoded latent exactly (so the in-register
//     dequantisation is exact, every value and every code), and its lse the decoded rope value;
//   - random sparse and dense attention equals the reference up to bf16 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "cache/page_codec.h"
#include "core/bfloat16.h"
#include "gpu_test_util.h"
#include "kernels/cpu/fp8_codec.h"
#include "kernels/cuda/mla/mla_attention.h"
#include "core/device/cuda_check.h"

namespace sparrow::cuda {
namespace {

static_assert(kMlaTensorScale == sparrow::kKvTensorScale, "the kernels' per-layer scale is the cache's");

constexpr PageFormat kAllFormats[] = {PageFormat::BFloat16, PageFormat::Fp8Latent, PageFormat::Fp8Rows,
                                          PageFormat::Nvfp4Latent};

const char* format_name(PageFormat format) {
  switch (format) {
    case PageFormat::BFloat16: return "bf16";
    case PageFormat::Fp8Latent: return "fp8";
    case PageFormat::Fp8Rows: return "fp8_per_tensor";
    case PageFormat::Nvfp4Latent: return "nvfp4";
  }
  return "?";
}

// The CPU codec of a format (--kv-cache-dtype name -> page_codec), checked to be the layout the kernels read.
const PageCodec& codec_of(PageFormat format) {
  static const PageSpec spec{PageKind::MlaLatent, kMlaRow, kMlaRope, 1};
  CacheDtype dtype{};
  PageFormat layout{};
  switch (format) {
    case PageFormat::BFloat16: dtype = CacheDtype::BFloat16, layout = PageFormat::BFloat16; break;
    case PageFormat::Fp8Latent: dtype = CacheDtype::Fp8, layout = PageFormat::Fp8Latent; break;
    case PageFormat::Fp8Rows: dtype = CacheDtype::Fp8PerTensor, layout = PageFormat::Fp8Rows; break;
    case PageFormat::Nvfp4Latent: dtype = CacheDtype::Nvfp4, layout = PageFormat::Nvfp4Latent; break;
  }
  const PageCodec& codec = page_codec(dtype, PageKind::MlaLatent);
  EXPECT_EQ(codec.format(), layout) << format_name(format);
  EXPECT_EQ(codec.page_bytes(spec, 1), mla_row_bytes(format)) << format_name(format);
  return codec;
}

const PageSpec& latent_spec() {
  static const PageSpec spec{PageKind::MlaLatent, kMlaRow, kMlaRope, 1};
  return spec;
}

// Encodes one [512 | 64] row with the format's CPU codec; `deq` (if set) receives the codec's decode,
// the exact values a reader must see.
void encode_row(PageFormat format, const float* x, uint8_t* dst, float* deq) {
  const PageCodec& codec = codec_of(format);
  codec.encode(latent_spec(), 1, x, 0, 1, reinterpret_cast<std::byte*>(dst));
  if (deq) codec.decode(latent_spec(), 1, reinterpret_cast<const std::byte*>(dst), 0, 1, deq);
}

// Random latent rows with one magnitude per 16 values (one NVFP4 block), so block scales, FP8 group
// scales and the FP8-rows range all vary. `edges` adds blocks of zeros, tiny values (FP8 subnormals,
// NVFP4 blocks whose scale rounds to zero), large and saturating values, and NVFP4 rounding ties.
void random_row(std::mt19937_64& rng, bool edges, float* x) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> log_mag(-3.f, 1.5f);
  static constexpr float kTies[16] = {6.f, 0.25f, -0.75f, 1.25f, -1.75f, 2.5f, -3.5f, 5.f,
                                      -0.25f, 0.75f, -1.25f, 1.75f, -2.5f, 3.5f, -5.f, -0.f};
  for (int b = 0; b < kMlaRow / 16; ++b) {
    float* v = x + 16 * b;
    const int kind = edges ? int(rng() % 8) : 7;
    const float m = std::exp(log_mag(rng));
    for (int i = 0; i < 16; ++i) {
      switch (kind) {
        case 0: v[i] = (i & 1) ? -0.f : 0.f; break;
        case 1: v[i] = normal(rng) * 1e-4f; break;                             // FP8 subnormals, NVFP4 scale 0
        case 2: v[i] = normal(rng) * 3e-3f; break;                             // NVFP4 subnormal block scales
        case 3: v[i] = normal(rng) * 200.f; break;                             // near E4M3's 448
        case 4: v[i] = normal(rng) * 1e4f; break;                              // saturating FP8 rows
        case 5: v[i] = std::ldexp(kTies[i], int(rng() % 12) - 6); break;       // exact ties of the E2M1 grid
        case 6: v[i] = (i == 3 ? 40.f : normal(rng) * 0.05f); break;           // one outlier per block
        default: v[i] = normal(rng) * m;
      }
    }
  }
}

// A paged pool holding `lens[s]` tokens per sequence in pages scattered at random, with garbage (NaN
// bit patterns) everywhere no token lives, and the exact values each token must read as.
struct TestCache {
  PageFormat format;
  int block_size = 64;
  int64_t pages_stride = 0;
  std::vector<uint8_t> pool;
  std::vector<int64_t> page_offsets;
  std::vector<std::vector<float>> values;  // per sequence [len, 576], the codec's decode

  TestCache(PageFormat f, const std::vector<int>& lens, std::mt19937_64& rng, bool edges = false) : format(f) {
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
    int64_t next = 0;
    std::vector<float> x(kMlaRow);
    for (size_t s = 0; s < lens.size(); ++s) {
      const int64_t pages = (lens[s] + block_size - 1) / block_size;
      for (int64_t i = 0; i < pages; ++i) page_offsets[s * pages_stride + i] = slots[next++] * page_bytes;
      values.emplace_back(size_t(lens[s]) * kMlaRow);
      for (int j = 0; j < lens[s]; ++j) {
        random_row(rng, edges, x.data());
        uint8_t* dst = pool.data() + page_offsets[s * pages_stride + j / block_size] + (j % block_size) * row_bytes;
        encode_row(format, x.data(), dst, values[s].data() + size_t(j) * kMlaRow);
      }
    }
  }
  const uint8_t* row(int seq, int token) const {
    return pool.data() + page_offsets[seq * pages_stride + token / block_size] + (token % block_size) * mla_row_bytes(format);
  }
};

// The nearest f16 to x (ties to even; f16's subnormals included, no overflow in these tests): the wgmma
// kernel widens FP8 latents to f16 (wgmma_kernel.cuh, latent_f16).
float round_to_f16(float x) {
  if (x == 0.f || !std::isfinite(x)) return x;
  int e;
  std::frexp(x, &e);                                   // |x| in [2^(e-1), 2^e)
  const int quantum = std::max(e, -13) - 11;           // 11 significant bits; 2^-24 below 2^-14
  return std::ldexp(std::nearbyint(std::ldexp(x, -quantum)), quantum);
}

// Latent value k (< 512) of a cached row as a kernel produces it before the product. The FP8 656 B
// format on the wgmma kernel: f16(e4m3 * f16(scale)); elsewhere the codec's decode.
float kernel_latent(const TestCache& cache, int seq, int token, int k, MlaKernel kernel) {
  if (cache.format == PageFormat::Fp8Latent && kernel == MlaKernel::Wgmma) {
    const uint8_t* row = cache.row(seq, token);
    float scale;
    std::memcpy(&scale, row + 512 + 4 * (k / 128), 4);
    return round_to_f16(cpu::e4m3_to_float(row[k]) * round_to_f16(scale));
  }
  return cache.values[seq][size_t(token) * kMlaRow + k];
}

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

// Relative L2 error allowed per (row, head). The reference reads the codec's decoded values, so only the
// kernel's own rounding counts: P and the output in bf16 (f16 for the FP8 formats on the wgmma kernel) for
// every format; kFp8 also rounds each dequantised value e4m3 * fp32 scale to bf16 (f16 on the wgmma kernel;
// the other formats' values are exact bf16 numbers).
double tolerance(PageFormat format) { return format == PageFormat::Fp8Latent ? 2.5e-2 : 1.5e-2; }

// Compares GPU outputs with the reference; every element must have been written (poisoned before).
void expect_close(const Reference& ref, const std::vector<uint16_t>& out, const std::vector<float>& lse,
                  int64_t rows, int heads, double tol, const std::string& what) {
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
      ok = ok && rel < tol && std::fabs(gl - rl) < 2e-2 + 2e-3 * std::fabs(rl);
    }
    if (!ok && bad++ < 5)
      ADD_FAILURE() << what << ": row " << rh / heads << " head " << rh % heads << " lse gpu " << gl << " ref " << rl
                    << " rel err " << std::sqrt(err) / (std::sqrt(norm) + 1e-20) << " finite " << finite;
  }
  EXPECT_EQ(bad, 0) << what << " (" << bad << " bad (row, head) pairs)";
  std::printf("  %s: worst rel L2 %.2e\n", what.c_str(), worst);
}

uint64_t fresh_seed() { return std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32); }

// A problem shape; run_case runs it in one format.
struct Shape {
  bool sparse;
  int heads;
  int topk;               // sparse only
  std::vector<int> lens;  // per sequence
  int q_per_seq;
};

// Launches the sparse or dense kernel over `cache` (poisoned outputs and workspace) and downloads the results.
struct GpuResult {
  std::vector<uint16_t> out;
  std::vector<float> lse;
  size_t workspace = 0;
};
GpuResult run_gpu(const TestCache& cache, const Shape& c, const std::vector<uint16_t>& q_bits,
                  const std::vector<int>& row_seq, const std::vector<int>& row_len, const std::vector<int32_t>& indices,
                  float scale, MlaKernel kernel = MlaKernel::Auto) {
  const int64_t rows = int64_t(row_seq.size());
  test::DeviceArray<uint8_t> d_pool(cache.pool);
  test::DeviceArray<int64_t> d_pages(cache.page_offsets);
  test::DeviceArray<uint16_t> d_q(q_bits);
  test::DeviceArray<int32_t> d_seq(row_seq), d_len(row_len);
  test::DeviceArray<int32_t> d_idx(c.sparse ? indices : std::vector<int32_t>{0});
  test::DeviceArray<uint16_t> d_out(size_t(rows * c.heads * kMlaLatent));
  test::DeviceArray<float> d_lse(size_t(rows * c.heads));
  d_out.poison();
  d_lse.poison();
  MlaPagedCache pc{d_pool.ptr, d_pages.ptr, cache.pages_stride, cache.block_size, cache.format};
  const int max_len = *std::max_element(c.lens.begin(), c.lens.end());
  GpuResult result;
  result.workspace = mla_attention_workspace_bytes(rows, c.heads, c.sparse ? c.topk : max_len);
  test::DeviceArray<uint8_t> d_ws(result.workspace);
  d_ws.poison();
  if (c.sparse)
    mla_sparse_attention(pc, d_q.ptr, d_seq.ptr, d_idx.ptr, rows, c.heads, c.topk, scale, d_out.ptr, d_lse.ptr,
                         d_ws.ptr, result.workspace, nullptr, kernel);
  else
    mla_dense_attention(pc, d_q.ptr, d_seq.ptr, d_len.ptr, rows, c.heads, max_len, scale, d_out.ptr, d_lse.ptr,
                        d_ws.ptr, result.workspace, nullptr);
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  result.out = d_out.download();
  result.lse = d_lse.download();
  return result;
}

std::string describe(const Shape& c, PageFormat format) {
  return std::string(c.sparse ? "sparse " : "dense ") + format_name(format) + " heads=" + std::to_string(c.heads) +
         (c.sparse ? " topk=" + std::to_string(c.topk) : "") + " seqs=" + std::to_string(c.lens.size()) +
         " q=" + std::to_string(c.q_per_seq) +
         " maxlen=" + std::to_string(*std::max_element(c.lens.begin(), c.lens.end()));
}

// Rows, their causal lengths and (sparse) random index lists with -1 slots anywhere.
void make_rows(const Shape& c, std::mt19937_64& rng, std::vector<int>& row_seq, std::vector<int>& row_len,
               std::vector<int32_t>& indices) {
  const int64_t rows = int64_t(c.lens.size()) * c.q_per_seq;
  row_seq.resize(rows);
  row_len.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    row_seq[r] = int(r / c.q_per_seq);
    // causal: the last row sees the whole sequence, earlier rows one token less each
    row_len[r] = std::max(0, c.lens[row_seq[r]] - (c.q_per_seq - 1 - int(r % c.q_per_seq)));
  }
  indices.clear();
  if (!c.sparse) return;
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

// Sparse attention has two kernels (Auto picks one by the head count): every sparse case runs both.
std::vector<MlaKernel> sparse_kernels(const Shape& c) {
  if (!c.sparse) return {MlaKernel::Auto};
  return {MlaKernel::Wgmma, MlaKernel::MmaSync};
}
std::string kernel_name(MlaKernel kernel) {
  return kernel == MlaKernel::MmaSync ? " [mma.sync kernel]" : kernel == MlaKernel::Wgmma ? " [wgmma kernel]" : "";
}

void run_case(const Shape& c, PageFormat format, std::mt19937_64& rng) {
  const int64_t rows = int64_t(c.lens.size()) * c.q_per_seq;
  const std::string what = describe(c, format);
  TestCache cache(format, c.lens, rng);
  std::vector<int> row_seq, row_len;
  std::vector<int32_t> indices;
  make_rows(c, rng, row_seq, row_len, indices);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> q_bits(size_t(rows * c.heads * kMlaRow));
  std::vector<float> q(q_bits.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q_bits[i] = float_to_bf16(normal(rng));
    q[i] = bf16_to_float(q_bits[i]);
  }
  const float scale = 1.0f / std::sqrt(192.0f);
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
  for (const MlaKernel kernel : sparse_kernels(c)) {
    const GpuResult got = run_gpu(cache, c, q_bits, row_seq, row_len, indices, scale, kernel);
    expect_close(ref, got.out, got.lse, rows, c.heads, tolerance(format),
                 what + kernel_name(kernel) + " (ws " + std::to_string(got.workspace) + " B)");
  }
}

std::vector<int> random_lens(std::mt19937_64& rng, int n, int lo, int hi) {
  std::vector<int> lens(n);
  for (int& l : lens) l = lo + int(rng() % uint64_t(hi - lo + 1));
  return lens;
}

TEST(CudaMlaAttention, SparseMatchesCpuReferenceInEveryFormat) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<Shape> shapes = {
      {true, 12, 2048, random_lens(rng, 3, 2500, 9000), 2},  // Kimi K3.1 Pro TP8: split keys
      {true, 16, 16, random_lens(rng, 5, 1, 40), 1},
      {true, 16, 64, random_lens(rng, 4, 1, 200), 2},
      {true, 32, 300, random_lens(rng, 3, 100, 1500), 2},
      {true, 64, 512, random_lens(rng, 3, 100, 3000), 2},
      {true, 64, 100, random_lens(rng, 2, 50, 500), 1},
      {true, 96, 700, random_lens(rng, 2, 700, 2000), 2},
      {true, 128, 2048, random_lens(rng, 2, 2100, 6000), 2},  // DeepSeek-V3.2 decode
      {true, 128, 300, random_lens(rng, 3, 10, 1000), 1},
      {true, 16, 256, {3000}, 300},  // prefill: many rows of one sequence
      {true, 128, 128, {600}, 40},
  };
  for (const Shape& c : shapes)
    for (PageFormat format : kAllFormats) run_case(c, format, rng);
}

TEST(CudaMlaAttention, DenseMatchesCpuReferenceInEveryFormat) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<Shape> shapes = {
      {false, 16, 0, random_lens(rng, 5, 1, 100), 1},
      {false, 12, 0, random_lens(rng, 4, 1, 300), 2},
      {false, 12, 0, {40000}, 1},  // one long sequence: many splits
      {false, 16, 0, random_lens(rng, 2, 20000, 40000), 2},
      {false, 32, 0, random_lens(rng, 3, 200, 3000), 1},
      {false, 64, 0, random_lens(rng, 3, 1000, 5000), 2},
      {false, 96, 0, random_lens(rng, 2, 100, 2000), 2},
      {false, 128, 0, random_lens(rng, 2, 500, 3000), 1},
      {false, 128, 0, random_lens(rng, 64, 1, 300), 1},
      {false, 64, 0, {500}, 120},  // prefill-like: many rows, causal lengths
  };
  for (const Shape& c : shapes)
    for (PageFormat format : kAllFormats) run_case(c, format, rng);
}

// Every row attends to exactly one key, so the output is that key's latent (P = 1, exactly) and the
// lse its logit. With q one-hot on rope dimension h % 64 for head h (value 1), the logit is the key's
// rope value times the softmax scale. The rows hold the edge values of random_row, so this checks the
// in-register dequantisation of every format value for value: the bf16 output equals the codec's decode
// rounded to bf16 (exact for fp8_per_tensor and nvfp4, whose values are bf16 numbers; the wgmma kernel's
// FP8 656 B values are f16(e4m3 * f16(scale)), kernel_latent), and the lse the
// decoded rope value to fp32 rounding. Sparse (keys anywhere, -1 elsewhere, split across blocks) and dense
// (sequences of one token).
TEST(CudaMlaAttention, OneKeyReadsTheDecodedRowExactly) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const float scale = 0.0721f;
  for (PageFormat format : kAllFormats) {
    for (const Shape& c : {Shape{true, 128, 2048, random_lens(rng, 3, 1, 5000), 2},
                           Shape{true, 16, 512, random_lens(rng, 4, 1, 3000), 1},
                           Shape{true, 64, 64, random_lens(rng, 6, 1, 700), 1},
                           Shape{false, 32, 0, std::vector<int>(40, 1), 1}, Shape{false, 128, 0, {1, 1, 1}, 1}}) {
      const std::string what = describe(c, format) + " one key";
      SCOPED_TRACE(what);
      TestCache cache(format, c.lens, rng, /*edges=*/true);
      const int64_t rows = int64_t(c.lens.size()) * c.q_per_seq;
      std::vector<int> row_seq(rows), row_len(rows), key(rows);
      std::vector<int32_t> indices(c.sparse ? size_t(rows) * c.topk : 0, -1);
      for (int64_t r = 0; r < rows; ++r) {
        row_seq[r] = int(r / c.q_per_seq);
        row_len[r] = c.lens[row_seq[r]];
        key[r] = c.sparse ? int(rng() % uint64_t(row_len[r])) : 0;
        if (c.sparse) indices[r * c.topk + int(rng() % uint64_t(c.topk))] = key[r];
      }
      std::vector<uint16_t> q_bits(size_t(rows * c.heads * kMlaRow), 0);
      for (int64_t r = 0; r < rows; ++r)
        for (int h = 0; h < c.heads; ++h) q_bits[(r * c.heads + h) * kMlaRow + kMlaLatent + h % kMlaRope] = 0x3f80;
      for (const MlaKernel kernel : sparse_kernels(c)) {
        const GpuResult got = run_gpu(cache, c, q_bits, row_seq, row_len, indices, scale, kernel);
        int bad = 0;
        for (int64_t r = 0; r < rows && bad < 5; ++r) {
          const float* v = cache.values[row_seq[r]].data() + size_t(key[r]) * kMlaRow;
          for (int h = 0; h < c.heads && bad < 5; ++h) {
            const int64_t rh = r * c.heads + h;
            for (int k = 0; k < kMlaLatent; ++k) {
              const float decoded = kernel_latent(cache, row_seq[r], key[r], k, kernel);
              const float want = bf16_to_float(float_to_bf16(decoded)), have = bf16_to_float(got.out[rh * kMlaLatent + k]);
              if (!(have == want) && bad++ < 5)  // == : the kernel's fp32 accumulation turns -0 into +0
                ADD_FAILURE() << what << ": row " << r << " head " << h << " key " << key[r] << " value " << k
                              << ": gpu " << have << " want " << want << " (decoded " << v[k] << ")";
            }
            const double logit = double(v[kMlaLatent + h % kMlaRope]) * scale;
            if (!(std::fabs(got.lse[rh] - logit) <= 1e-5 * std::fabs(logit) + 1e-30) && bad++ < 5)
              ADD_FAILURE() << what << ": row " << r << " head " << h << " lse " << got.lse[rh] << " want " << logit
                            << " (rope value " << v[kMlaLatent + h % kMlaRope] << ")";
          }
        }
        EXPECT_EQ(bad, 0) << what << kernel_name(kernel);
      }
    }
  }
}

// The write kernel against the CPU codec: every byte of the pool, written rows and untouched ones, in
// every format, from fp32 and bf16 sources, with edge values (zeros and -0, tiny, large and saturating,
// E2M1 rounding ties, one outlier per block; NaN and infinities for the FP8-rows and NVFP4 formats, whose
// writes use the CPU codecs' device twins and so agree on those too).
TEST(CudaMlaAttention, CacheWriteMatchesTheCpuCodec) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const float inf = std::numeric_limits<float>::infinity();
  for (PageFormat format : kAllFormats) {
    for (MlaSourceType src_type : {MlaSourceType::kFloat32, MlaSourceType::kBf16}) {
      SCOPED_TRACE(std::string(format_name(format)) + (src_type == MlaSourceType::kBf16 ? " from bf16" : " from fp32"));
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
      const bool specials = format == PageFormat::Fp8Rows || format == PageFormat::Nvfp4Latent;
      std::vector<float> src(size_t(count) * kMlaRow);
      std::vector<uint16_t> src_bf16(src.size());
      for (int64_t i = 0; i < count; ++i) {
        float* x = src.data() + i * kMlaRow;
        random_row(rng, /*edges=*/true, x);
        if (specials && rng() % 4 == 0) {
          const float special[] = {std::nanf(""), -std::nanf(""), inf, -inf, 1e30f, -1e30f, 1e-40f, -0.f};
          for (int k = 0; k < 6; ++k) x[rng() % kMlaRow] = special[rng() % 8];
        }
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
      SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint8_t> got = d_pool.download();
      int64_t mismatches = 0, first = -1;
      for (size_t i = 0; i < got.size(); ++i)
        if (got[i] != expected[i] && mismatches++ == 0) first = int64_t(i);
      EXPECT_EQ(mismatches, 0) << "first differing byte " << first << " got " << (first >= 0 ? int(got[first]) : 0)
                               << " want " << (first >= 0 ? int(expected[first]) : 0);
      // And one contiguous run through the (seq0, start_pos) form: rows start_pos .. start_pos+n-1 of
      // sequence lens.size()-1, from the first n source rows (at most `count` of them exist: short random
      // sequences may give fewer than 70).
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
      EXPECT_TRUE(d_pool.download() == expected2) << "contiguous write";
    }
  }
}

}  // namespace
}  // namespace sparrow::cuda
