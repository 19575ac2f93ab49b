// kernels/cuda/gemm/gemm_fp8 against the CPU: the activation quantiser and the weight dequantiser bit for bit
// (cpu::float_to_e4m3 / e4m3_to_float, a plain loop for the scales), and the FP8 block-scaled product
// against a double-precision product of the same dequantised operands (x quantised exactly as the GPU
// does, W = e4m3 * its 128x128 block scale). Random shapes include DeepSeek-V3.2's projections (some
// scaled down), m = 1, 7, 128, 1000, partial 128-blocks in every dimension, padded strides, weight scales
// needing the L4 padding copy and outputs needing the padded-row copy; fresh seeds, outputs poisoned.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/fp8_codec.h"
#include "kernels/cuda/gemm/gemm_fp8.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#include "gpu_test_util.h"
#include "rt_test_util.h"

namespace sparrow {
namespace {

using cuda::ElemType;
using test::DeviceBuffer;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A random finite e4m3 code: any byte but the two NaNs (0x7F, 0xFF).
uint8_t random_code(std::mt19937_64& rng) {
  for (;;) {
    const uint8_t c = uint8_t(rng() & 0xFF);
    if ((c & 0x7F) != 0x7F) return c;
  }
}

// Values over many binades (so some codes land in e4m3's subnormal range), random signs, a few exact
// zeros and negative zeros; rounded to bf16 (what the device holds).
std::vector<float> random_activations(std::mt19937_64& rng, size_t count, float lo_exp, float hi_exp) {
  std::uniform_real_distribution<float> e(lo_exp, hi_exp);
  std::vector<float> v(count);
  for (float& x : v) {
    const uint64_t r = rng();
    if (r % 97 == 0) x = (r & 1) ? 0.0f : -0.0f;
    else x = test::round_bf16(std::exp2(e(rng)) * ((r >> 8) & 1 ? -1.0f : 1.0f));
  }
  return v;
}

// The CPU twin of quantize_fp8_rows: scale = amax / 448, code = e4m3(x / scale), zero group -> 0 and 0.
void quantize_cpu(int64_t m, int64_t k, const std::vector<float>& x, int64_t ldx, std::vector<uint8_t>& q,
                  std::vector<float>& scales) {
  const int64_t groups = ceil_div(k, 128);
  q.assign(m * k, 0);
  scales.assign(groups * m, 0.0f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c1 = std::min(k, (g + 1) * 128);
      float amax = 0.0f;
      for (int64_t j = g * 128; j < c1; ++j) amax = std::max(amax, std::fabs(x[i * ldx + j]));
      const float scale = amax / cpu::kE4m3Max;
      scales[g * m + i] = scale;
      for (int64_t j = g * 128; j < c1; ++j) q[i * k + j] = amax == 0.0f ? 0 : cpu::float_to_e4m3(x[i * ldx + j] / scale);
    }
}

::testing::AssertionResult same_bits(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return ::testing::AssertionFailure() << "byte " << i << ": got 0x" << std::hex << int(got[i]) << ", expected 0x"
                                           << int(want[i]);
  return ::testing::AssertionSuccess();
}

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Runs `f` and expects a sparrow::Error whose message contains `needle`.
template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one containing \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(CudaGemmFp8, QuantizeRowsMatchesCpuBitExactly) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t m, k, ldx;
  };
  // Vector path (aligned, k % 4 == 0) and the scalar one (odd k or stride), partial last groups.
  const Case cases[] = {{1, 128, 128}, {7, 7168, 7168}, {33, 200, 208}, {128, 1536, 1536},
                        {1000, 512, 520}, {5, 3, 5},     {3, 130, 131},   {64, 576, 576}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "m=" << c.m << " k=" << c.k << " ldx=" << c.ldx);
    std::vector<float> x = random_activations(rng, c.m * c.ldx, -30.0f, 4.0f);
    // An all-zero group (scale 0, codes 0) and a group of one huge value among tiny ones.
    for (int64_t j = 0; j < std::min<int64_t>(c.k, 128); ++j) x[j] = 0.0f;
    if (c.m > 1) x[c.ldx + std::min<int64_t>(c.k - 1, 5)] = test::round_bf16(3.0e4f);
    std::vector<uint8_t> q_ref;
    std::vector<float> s_ref;
    quantize_cpu(c.m, c.k, x, c.ldx, q_ref, s_ref);
    DeviceBuffer dx(test::to_bf16(x)), dq(c.m * c.k), ds(s_ref.size() * 4);
    dq.poison();
    ds.poison();
    cuda::quantize_fp8_rows(c.m, c.k, dx.get(), c.ldx, dq.get<uint8_t>(), ds.get<float>(), cuda::stream());
    EXPECT_TRUE(same_bits(dq.download<uint8_t>(c.m * c.k), q_ref)) << "codes";
    EXPECT_TRUE(same_bits(bytes_of(ds.download<float>(s_ref.size())), bytes_of(s_ref))) << "scales";
  }
}

TEST(CudaGemmFp8, DequantizeBlocksMatchesCpuBitExactly) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> log_scale(-16.0f, 4.0f);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {128, 128}, {300, 200}, {129, 896}, {576, 72},
                            {7, 13}, {1, 7168}}) {
    SCOPED_TRACE(testing::Message() << rows << "x" << cols);
    std::vector<uint8_t> w(rows * cols);
    for (uint8_t& c : w) c = random_code(rng);
    const int64_t rb = ceil_div(rows, 128), cb = ceil_div(cols, 128);
    std::vector<float> s(rb * cb);
    for (float& v : s) v = std::exp2(log_scale(rng));
    std::vector<uint16_t> ref(rows * cols);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        ref[i * cols + j] = test::f2bf(cpu::e4m3_to_float(w[i * cols + j]) * s[(i / 128) * cb + j / 128]);
    DeviceBuffer dw(w), ds(s), dout(rows * cols * 2);
    dout.poison();
    cuda::dequantize_fp8_blocks(rows, cols, dw.get<uint8_t>(), ds.get<float>(), dout.get(), nullptr);
    EXPECT_TRUE(same_bits(bytes_of(dout.download<uint16_t>(rows * cols)), bytes_of(ref)));
  }
}

struct ProductCase {
  const char* name;
  int64_t m, n, k;
  int64_t x_pad, y_pad;  // extra elements per row of x and y
  ElemType out;
  bool misaligned_scales;  // w_scales one float past a 16-byte boundary: the padded copy
  bool own_stream;         // run on a stream of its own (the engine stream then waits for it)
};

void run_product_case(const ProductCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(testing::Message() << c.name << ": m=" << c.m << " n=" << c.n << " k=" << c.k << " x_pad=" << c.x_pad
                                  << " y_pad=" << c.y_pad << " out=" << (c.out == ElemType::F32 ? "f32" : "bf16")
                                  << (c.misaligned_scales ? " misaligned scales" : "")
                                  << (c.own_stream ? " own stream" : ""));
  const int64_t ldx = c.k + c.x_pad, ldy = c.n + c.y_pad;
  const int64_t nb = ceil_div(c.n, 128), kb = ceil_div(c.k, 128);
  // Weights: random finite codes, positive block scales over a few binades.
  std::vector<uint8_t> w(c.n * c.k);
  for (uint8_t& v : w) v = random_code(rng);
  std::uniform_real_distribution<float> log_scale(-14.0f, -6.0f);
  std::vector<float> ws(nb * kb);
  for (float& v : ws) v = std::exp2(log_scale(rng));
  // Activations: uniform in [-1, 1] times a per-row magnitude; one all-zero 128-group in row 0.
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), row_exp(-3.0f, 3.0f);
  std::vector<float> x(c.m * ldx);
  for (int64_t i = 0; i < c.m; ++i) {
    const float mag = std::exp2(row_exp(rng));
    for (int64_t j = 0; j < ldx; ++j) x[i * ldx + j] = test::round_bf16(mag * u(rng));
  }
  for (int64_t j = 0; j < std::min<int64_t>(c.k, 128); ++j) x[j] = 0.0f;

  // Reference: x quantised as the GPU does, both operands dequantised, products summed in double.
  std::vector<uint8_t> xq;
  std::vector<float> xs;
  quantize_cpu(c.m, c.k, x, ldx, xq, xs);
  std::vector<float> xd(c.m * c.k), wd(c.n * c.k);
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.k; ++j) xd[i * c.k + j] = cpu::e4m3_to_float(xq[i * c.k + j]) * xs[(j / 128) * c.m + i];
  for (int64_t i = 0; i < c.n; ++i)
    for (int64_t j = 0; j < c.k; ++j) wd[i * c.k + j] = cpu::e4m3_to_float(w[i * c.k + j]) * ws[(i / 128) * kb + j / 128];
  std::vector<double> ref(c.m * c.n);
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t o = 0; o < c.n; ++o) {
      double acc = 0;
      const float* a = &xd[i * c.k];
      const float* b = &wd[o * c.k];
      for (int64_t j = 0; j < c.k; ++j) acc += double(a[j]) * double(b[j]);
      ref[i * c.n + o] = acc;
    }

  const bool f32 = c.out == ElemType::F32;
  const int64_t es = f32 ? 4 : 2;
  DeviceBuffer dx(test::to_bf16(x)), dw(w);
  std::vector<float> ws_host = ws;
  if (c.misaligned_scales) ws_host.insert(ws_host.begin(), 0.0f);
  DeviceBuffer dws(ws_host);
  const float* ws_ptr = dws.get<float>() + (c.misaligned_scales ? 1 : 0);
  // One guard row past y: nothing may be written there, nor into the padding columns.
  DeviceBuffer dy((c.m + 1) * ldy * es);
  cudaStream_t own = nullptr;
  if (c.own_stream) {
    ASSERT_EQ(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking), cudaSuccess);
  }
  for (int rep = 0; rep < 2; ++rep) {  // the second launch reuses the cached plan
    SCOPED_TRACE(testing::Message() << "launch " << rep);
    dy.poison();
    device::synchronize();
    cuda::gemm_fp8_block_scaled(c.m, c.n, c.k, dx.get(), ldx, dw.get<uint8_t>(), ws_ptr, dy.get(), c.out, ldy,
                                c.own_stream ? own : cuda::stream());
    if (own) {
      ASSERT_EQ(cudaStreamSynchronize(own), cudaSuccess);
    }
    std::vector<uint8_t> raw = dy.download<uint8_t>((c.m + 1) * ldy * es);
    int64_t written_outside = 0;
    const std::vector<float> g = test::read_strided_output(raw, c.m, c.n, ldy, f32, written_outside);
    EXPECT_EQ(written_outside, 0) << "bytes written outside the m x n output";
    // Per row: |got - ref| <= tol * max_j |ref[i][j]|. bf16 out rounds once (2^-9 relative); the FP8
    // tensor cores accumulate each 128-deep block in reduced precision before cuBLASLt's fp32 promotion.
    const double tol = f32 ? 2e-3 : 1e-2;
    double worst = 0;  // largest |got - ref| / bound; NaN sticks
    int64_t worst_at = 0;
    for (int64_t i = 0; i < c.m; ++i) {
      double row_max = 0;
      for (int64_t j = 0; j < c.n; ++j) row_max = std::max(row_max, std::fabs(ref[i * c.n + j]));
      for (int64_t j = 0; j < c.n; ++j) {
        const double d = std::fabs(double(g[i * c.n + j]) - ref[i * c.n + j]);
        const double ratio = d == 0 ? 0.0 : d / (tol * row_max);
        if (!std::isnan(worst) && !(ratio <= worst)) {
          worst = ratio;
          worst_at = i * c.n + j;
        }
      }
    }
    EXPECT_TRUE(worst <= 1.0) << "element (" << worst_at / c.n << ", " << worst_at % c.n << "): got " << g[worst_at]
                              << ", expected " << ref[worst_at] << " (" << worst << " x the row tolerance)";
    EXPECT_LT(test::rel_error(g, std::vector<float>(ref.begin(), ref.end())), f32 ? 1e-3 : 5e-3);
  }
  if (own) {
    EXPECT_EQ(cudaStreamDestroy(own), cudaSuccess);
  }
}

TEST(CudaGemmFp8, ProductMatchesCpuReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // DeepSeek-V3.2 (hidden 7168, q_lora 1536, kv_lora 512 + rope 64, 128 heads): kv_a_proj 7168 -> 576,
  // q_b_proj 1536 -> 24576, o_proj 16384 -> 7168, experts 7168 -> 2x2048 and 2048 -> 7168; the larger
  // ones scaled down (by 8) to keep the CPU reference quick.
  const ProductCase cases[] = {
      {"kv_a_proj decode", 1, 576, 7168, 0, 0, ElemType::BF16, false, false},
      {"kv_a_proj", 7, 576, 7168, 0, 0, ElemType::F32, false, false},
      {"q_b_proj / 8", 1, 3072, 1536, 0, 0, ElemType::BF16, false, false},
      {"q_b_proj / 8", 4, 3072, 1536, 0, 0, ElemType::BF16, false, false},
      {"o_proj / 8", 128, 896, 2048, 0, 0, ElemType::BF16, false, false},
      {"gate_up / 8 (k blocks 7: padded scales)", 7, 512, 896, 0, 0, ElemType::F32, false, false},
      {"down / 8", 1000, 896, 256, 0, 0, ElemType::BF16, false, false},
      {"partial blocks, strided", 33, 200, 400, 8, 3, ElemType::BF16, false, false},
      {"partial blocks, strided", 5, 136, 144, 1, 4, ElemType::F32, true, false},
      {"square", 128, 256, 512, 0, 0, ElemType::F32, false, false},
      {"square, misaligned scales", 128, 256, 512, 0, 8, ElemType::BF16, true, false},
      {"tiny", 4, 8, 16, 0, 0, ElemType::BF16, false, false},
      {"tiny", 3, 4, 32, 0, 0, ElemType::F32, false, false},
      {"own stream", 7, 384, 1024, 0, 0, ElemType::BF16, false, true},
  };
  for (const ProductCase& c : cases) run_product_case(c, rng);
}

TEST(CudaGemmFp8, EmptyProducts) {
  SPARROW_REQUIRE_GPU();
  DeviceBuffer x(4096), w(4096), s(64), y(4096);
  // m = 0 or n = 0: nothing to do, nothing touched.
  EXPECT_NO_THROW(cuda::gemm_fp8_block_scaled(0, 8, 16, x.get(), 16, w.get<uint8_t>(), s.get<float>(), y.get(),
                                              ElemType::BF16, 8, nullptr));
  // k = 0: an empty reduction, y = 0 on its m x n entries only.
  y.poison();
  cuda::gemm_fp8_block_scaled(3, 8, 0, x.get(), 16, w.get<uint8_t>(), s.get<float>(), y.get(), ElemType::F32, 10,
                              nullptr);
  std::vector<float> got = y.download<float>(30);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 10; ++j) {
      if (j < 8) EXPECT_EQ(got[i * 10 + j], 0.0f) << i << "," << j;
      else EXPECT_TRUE(std::isnan(got[i * 10 + j])) << i << "," << j;
    }
}

TEST(CudaGemmFp8, RejectsBadArguments) {
  SPARROW_REQUIRE_GPU();
  DeviceBuffer x(1 << 16), w(1 << 16), s(1024), y(1 << 16);
  const void* xp = x.get();
  const uint8_t* wp = w.get<uint8_t>();
  const float* sp = s.get<float>();
  void* yp = y.get();
  auto gemm = [&](int64_t m, int64_t n, int64_t k, const void* xx, int64_t ldx, const uint8_t* ww, void* yy,
                  ElemType t, int64_t ldy) {
    return [=] { cuda::gemm_fp8_block_scaled(m, n, k, xx, ldx, ww, sp, yy, t, ldy, nullptr); };
  };
  expect_error(gemm(2, 64, 100, xp, 100, wp, yp, ElemType::BF16, 64), "multiple of 16");
  expect_error(gemm(2, 12, 128, xp, 128, wp, yp, ElemType::BF16, 12), "multiple of 8");
  expect_error(gemm(2, 6, 128, xp, 128, wp, yp, ElemType::F32, 6), "multiple of 4");
  expect_error(gemm(2, 64, 128, xp, 128, wp + 1, yp, ElemType::BF16, 64), "16-byte aligned");
  expect_error(gemm(2, 64, 128, xp, 64, wp, yp, ElemType::BF16, 64), "x row stride");
  expect_error(gemm(2, 64, 128, xp, 128, wp, yp, ElemType::BF16, 32), "y row stride");
  expect_error(gemm(2, 64, 128, nullptr, 128, wp, yp, ElemType::BF16, 64), "null");
  expect_error(gemm(2, 64, 128, xp, 128, nullptr, yp, ElemType::BF16, 64), "null");
  expect_error(gemm(2, 64, 128, xp, 128, wp, nullptr, ElemType::BF16, 64), "null");
  expect_error(gemm(-1, 64, 128, xp, 128, wp, yp, ElemType::BF16, 64), "bad sizes");
  expect_error([&] { cuda::gemm_fp8_block_scaled(2, 64, 128, xp, 128, wp, nullptr, yp, ElemType::BF16, 64, nullptr); },
               "null");
  expect_error([&] { cuda::quantize_fp8_rows(2, 128, xp, 100, w.get<uint8_t>(), s.get<float>(), nullptr); },
               "row stride");
  expect_error([&] { cuda::quantize_fp8_rows(2, 128, nullptr, 128, w.get<uint8_t>(), s.get<float>(), nullptr); },
               "null");
  expect_error([&] { cuda::quantize_fp8_rows(-2, 128, xp, 128, w.get<uint8_t>(), s.get<float>(), nullptr); },
               "bad sizes");
  expect_error([&] { cuda::dequantize_fp8_blocks(4, 4, nullptr, sp, yp, nullptr); }, "null");
  expect_error([&] { cuda::dequantize_fp8_blocks(4, -4, wp, sp, yp, nullptr); }, "bad sizes");
  // Nothing above reached the device: the stream is still healthy.
  EXPECT_NO_THROW(device::synchronize());
}

}  // namespace
}  // namespace sparrow
