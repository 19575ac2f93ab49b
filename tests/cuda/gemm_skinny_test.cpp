// kernels/cuda/gemm/gemm_skinny (skinny::kernel, the MoE decode kernel, on dense matrices) against a
// double-precision CPU product: m = 1..8 rows, n from 8 to 34000 (partial last 16-row groups; one K range
// or K split over the grid), k from 8 to 7168 (partial 128-column scale blocks), bf16 and e4m3 weights,
// bf16 and fp32 outputs, padded row strides; outputs poisoned, a guard row and the padding columns must
// stay untouched; every case launched twice and the two results compared bit for bit (the split-K partial
// sums are added in a fixed order). Then ops::linear: m <= 8 with FP8 weights takes this path (its result is
// bit-identical to a direct launch) and matches the CPU op.
//
// The bound, per output (i, o), with S = Σ_j |x[i][j] W[o][j]| and ref the exact product (double):
//   |got - ref| <= acc + r_out * (|ref| + acc),   acc = (k / 16 + 64) * 2^-22 * S,
// r_out = 2^-8 for bf16 outputs (round to nearest: half of bf16's 2^-7 relative spacing) and 2^-24 for
// fp32. acc covers fp32 accumulation: each output is a chain of at most k/16 mma steps (16 products each)
// plus one scale multiply-add per 128 columns and one addition per K range (< 64 in all here), each adding
// at most one rounding (2^-24) of a partial sum bounded by S; the factor 4 (2^-22) leaves room for the
// tensor cores' internal accumulation, which need not round to nearest. The products themselves are exact
// (bf16 x bf16 and e4m3 -> bf16 are exact in fp32). A weight scale off by 2x in one 128x128 block moves
// the outputs of those rows by their whole block partial, ~sqrt(128) typical products, far past acc: that
// check must fail the bound.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "gpu_test_util.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"
#include "kernels/cuda/gemm/gemm_skinny.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#include "kernels/ops.h"
#include "model_test_util.h"
#include "rt_test_util.h"

namespace sparrow {
namespace {

using cuda::ElemType;
using test::DeviceBuffer;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint8_t random_code(std::mt19937_64& rng) {  // any finite e4m3 code (not 0x7F / 0xFF)
  for (;;) {
    const uint8_t c = uint8_t(rng() & 0xFF);
    if ((c & 0x7F) != 0x7F) return c;
  }
}

struct Case {
  int64_t m, n, k;
  bool fp8;
  ElemType out;
  int64_t x_pad, y_pad;  // extra elements per row of x (a multiple of 8) and y
};

std::string describe(const Case& c) {
  return (testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k << (c.fp8 ? " e4m3" : " bf16")
                             << " out=" << (c.out == ElemType::F32 ? "f32" : "bf16") << " x_pad=" << c.x_pad
                             << " y_pad=" << c.y_pad)
      .GetString();
}

// Random operands of a case and the exact product.
struct Operands {
  std::vector<float> x;            // [m, ldx], bf16 values
  std::vector<uint8_t> codes;      // FP8: [n, k]
  std::vector<float> scales;       // FP8: [ceil(n/128), ceil(k/128)]
  std::vector<float> wb;           // bf16 weights: [n, k], bf16 values
  std::vector<double> ref, abs_sum;  // [m, n]
};

double weight(const Case& c, const Operands& op, int64_t o, int64_t j) {
  if (!c.fp8) return op.wb[o * c.k + j];
  return double(cpu::e4m3_to_float(op.codes[o * c.k + j])) * op.scales[(o / 128) * ceil_div(c.k, 128) + j / 128];
}

void reference(const Case& c, Operands& op) {
  const int64_t ldx = c.k + c.x_pad;
  op.ref.assign(c.m * c.n, 0.0);
  op.abs_sum.assign(c.m * c.n, 0.0);
  std::vector<double> wrow(c.k);
  for (int64_t o = 0; o < c.n; ++o) {
    for (int64_t j = 0; j < c.k; ++j) wrow[j] = weight(c, op, o, j);
    for (int64_t i = 0; i < c.m; ++i) {
      double acc = 0, abs = 0;
      const float* xr = &op.x[i * ldx];
      for (int64_t j = 0; j < c.k; ++j) {
        const double p = double(xr[j]) * wrow[j];
        acc += p;
        abs += std::fabs(p);
      }
      op.ref[i * c.n + o] = acc;
      op.abs_sum[i * c.n + o] = abs;
    }
  }
}

Operands random_operands(const Case& c, std::mt19937_64& rng) {
  Operands op;
  const int64_t ldx = c.k + c.x_pad;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), row_exp(-3.0f, 3.0f);
  op.x.resize(c.m * ldx);
  for (int64_t i = 0; i < c.m; ++i) {
    const float mag = std::exp2(row_exp(rng));
    for (int64_t j = 0; j < ldx; ++j) op.x[i * ldx + j] = test::round_bf16(mag * u(rng));
  }
  if (c.fp8) {
    op.codes.resize(c.n * c.k);
    for (uint8_t& v : op.codes) v = random_code(rng);
    std::uniform_real_distribution<float> log_scale(-14.0f, -6.0f);
    op.scales.resize(ceil_div(c.n, 128) * ceil_div(c.k, 128));
    for (float& v : op.scales) v = std::exp2(log_scale(rng));
  } else {
    op.wb.resize(c.n * c.k);
    for (float& v : op.wb) v = test::round_bf16(0.1f * u(rng));
  }
  reference(c, op);
  return op;
}

// The device result of a case (raw bytes of the (m + 1) x ldy output buffer, guard row included).
std::vector<uint8_t> launch(const Case& c, const DeviceBuffer& dx, const DeviceBuffer& dw, const float* scales,
                            DeviceBuffer& dy) {
  const int64_t ldx = c.k + c.x_pad, ldy = c.n + c.y_pad;
  const cuda::WeightCodes codes = c.fp8 ? cuda::WeightCodes::Fp8 : cuda::WeightCodes::Bf16;
  const size_t ws_bytes = cuda::gemm_skinny_workspace_bytes(c.m, c.n, c.k, codes);
  DeviceBuffer ws(std::max<size_t>(ws_bytes, 1));
  ws.poison();  // partial sums must all be written before they are read
  dy.poison();
  if (c.fp8)
    cuda::gemm_skinny(c.m, c.n, c.k, cuda::WeightCodes::Fp8, dx.get(), ldx, dw.get<uint8_t>(), scales, nullptr,
                      dy.get(), c.out, ldy, ws_bytes ? ws.get() : nullptr, ws_bytes, nullptr);
  else
    cuda::gemm_skinny(c.m, c.n, c.k, cuda::WeightCodes::Bf16, dx.get(), ldx, dw.get(), nullptr, nullptr, dy.get(),
                      c.out, ldy, ws_bytes ? ws.get() : nullptr, ws_bytes, nullptr);
  device::synchronize();
  return dy.download<uint8_t>(dy.bytes());
}

// Largest |got - ref| / bound over the m x n outputs (NaN sticks), with where; bytes written outside them.
struct Check {
  double worst = 0;
  int64_t at = 0;
  float got = 0;
  int64_t written_outside = 0;
};

Check check(const Case& c, const Operands& op, const std::vector<uint8_t>& raw) {
  const bool f32 = c.out == ElemType::F32;
  const int64_t ldy = c.n + c.y_pad;
  const double r_out = f32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8);
  const double acc_rel = double(c.k / 16 + 64) * std::ldexp(1.0, -22);
  Check r;
  const std::vector<float> got = test::read_strided_output(raw, c.m, c.n, ldy, f32, r.written_outside);
  for (int64_t e = 0; e < c.m * c.n; ++e) {
    const double ref = op.ref[e], acc = acc_rel * op.abs_sum[e];
    const double bound = acc + r_out * (std::fabs(ref) + acc);
    const double d = std::fabs(double(got[e]) - ref);
    const double ratio = d == 0 ? 0.0 : d / bound;
    if (!std::isnan(r.worst) && !(ratio <= r.worst)) {
      r.worst = ratio;
      r.at = e;
      r.got = got[e];
    }
  }
  return r;
}

void run_case(const Case& c, std::mt19937_64& rng) {
  SCOPED_TRACE(describe(c));
  const Operands op = random_operands(c, rng);
  DeviceBuffer dx(test::to_bf16(op.x));
  DeviceBuffer dw(c.n * c.k * (c.fp8 ? 1 : 2));
  if (c.fp8) dw.upload(op.codes);
  else dw.upload(test::to_bf16(op.wb));
  DeviceBuffer ds(c.fp8 ? op.scales : std::vector<float>{0.0f});
  const int64_t es = c.out == ElemType::F32 ? 4 : 2;
  DeviceBuffer dy((c.m + 1) * (c.n + c.y_pad) * es);  // one guard row past y
  const std::vector<uint8_t> first = launch(c, dx, dw, ds.get<float>(), dy);
  const Check r = check(c, op, first);
  EXPECT_EQ(r.written_outside, 0) << "bytes written outside the m x n output";
  EXPECT_TRUE(r.worst <= 1.0) << "output (" << r.at / c.n << ", " << r.at % c.n << "): got " << r.got
                              << ", expected " << op.ref[r.at] << " (" << r.worst << " x the bound)";
  const std::vector<uint8_t> second = launch(c, dx, dw, ds.get<float>(), dy);
  EXPECT_TRUE(first == second) << "two launches on the same inputs differ";
}

TEST(CudaGemmSkinny, MatchesDoubleReference) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // n: one partial group (8), whole groups (16), a partial last group (24 = 16 + 8; 1000 = 62 x 16 + 8),
  // kv_a_proj's 576 (36 groups: K split into many ranges). k: one piece (16), partial 128-column blocks
  // (144 = 128 + 16, 272 = 2 x 128 + 16), DeepSeek's hidden 7168 (56 blocks). Each (n, k) for every m,
  // outputs and strides varying with the case.
  int index = 0;
  for (bool fp8 : {true, false})
    for (int64_t n : {8, 16, 24, 576, 1000})
      for (int64_t k : {16, 144, 272, 7168})
        for (int64_t m = 1; m <= 8; ++m, ++index) {
          const ElemType out = index % 2 ? ElemType::F32 : ElemType::BF16;
          const bool padded = index % 3 == 0;
          run_case(Case{m, n, k, fp8, out, padded ? 8 : 0, padded ? 5 : 0}, rng);
        }
  // bf16 weights with k % 16 == 8 (a lane's last 16-byte piece alone in its slab).
  for (int64_t m : {1, 5, 8}) {
    run_case(Case{m, 40, 8, false, ElemType::F32, 0, 0}, rng);
    run_case(Case{m, 200, 1000, false, ElemType::BF16, 16, 3}, rng);
  }
  // Enough 16-row groups (> 16 per SM on an H200) for one K range: the kernel stores y itself.
  for (bool fp8 : {true, false}) {
    run_case(Case{1, 34000, 272, fp8, ElemType::BF16, 0, 0}, rng);
    run_case(Case{8, 34008, 144, fp8, ElemType::F32, 8, 1}, rng);
  }
}

TEST(CudaGemmSkinny, WrongScaleFailsTheBound) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int64_t k : {512, 7168}) {
    const Case c{4, 256, k, true, ElemType::F32, 0, 0};
    SCOPED_TRACE(describe(c));
    const Operands op = random_operands(c, rng);
    std::vector<float> wrong = op.scales;
    wrong[ceil_div(c.k, 128) + 1] *= 2.0f;  // block (1, 1): rows 128..255, columns 128..255
    DeviceBuffer dx(test::to_bf16(op.x)), dw(op.codes), ds(op.scales), dwrong(wrong);
    DeviceBuffer dy((c.m + 1) * c.n * 4);
    EXPECT_LE(check(c, op, launch(c, dx, dw, ds.get<float>(), dy)).worst, 1.0) << "right scales";
    EXPECT_GT(check(c, op, launch(c, dx, dw, dwrong.get<float>(), dy)).worst, 1.0) << "a wrong scale passed";
  }
}

TEST(CudaGemmSkinny, RejectsBadArguments) {
  SPARROW_REQUIRE_GPU();
  DeviceBuffer x(1 << 16), w(1 << 16), s(1024), y(1 << 16), ws(1 << 20);
  const char* xp = x.get<char>();
  const uint8_t* wp = w.get<uint8_t>();
  const float* sp = s.get<float>();
  char* yp = y.get<char>();
  auto expect_error = [](auto&& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error thrown; expected one containing \"" << needle << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto fp8 = [&](int64_t m, int64_t n, int64_t k, const void* xx, int64_t ldx, const uint8_t* ww, const float* ss,
                 void* yy, ElemType t, int64_t ldy) {
    return [=, &ws] {
      cuda::gemm_skinny(m, n, k, cuda::WeightCodes::Fp8, xx, ldx, ww, ss, nullptr, yy, t, ldy, ws.get(), ws.bytes(),
                        nullptr);
    };
  };
  expect_error(fp8(9, 64, 128, xp, 128, wp, sp, yp, ElemType::BF16, 64), "m must be");
  expect_error(fp8(2, 64, 120, xp, 120, wp, sp, yp, ElemType::BF16, 64), "multiple of 16");
  expect_error(fp8(2, 64, 128, xp + 2, 128, wp, sp, yp, ElemType::BF16, 64), "16-byte aligned");
  expect_error(fp8(2, 64, 128, xp, 128, wp + 8, sp, yp, ElemType::BF16, 64), "16-byte aligned");
  expect_error(fp8(2, 64, 128, xp, 132, wp, sp, yp, ElemType::BF16, 64), "x row stride");
  expect_error(fp8(2, 64, 128, xp, 64, wp, sp, yp, ElemType::BF16, 64), "x row stride");
  expect_error(fp8(2, 64, 128, xp, 128, wp, sp, yp, ElemType::BF16, 32), "y row stride");
  expect_error(fp8(2, 64, 128, xp, 128, wp, sp, yp + 2, ElemType::F32, 64), "aligned to its element");
  expect_error(fp8(2, 64, 128, xp, 128, wp, nullptr, yp, ElemType::BF16, 64), "null weight scales");
  expect_error(fp8(2, 64, 128, nullptr, 128, wp, sp, yp, ElemType::BF16, 64), "null");
  expect_error(fp8(2, 0, 128, xp, 128, wp, sp, yp, ElemType::BF16, 64), "positive");
  expect_error(
      [&] {
        cuda::gemm_skinny(2, 64, 100, cuda::WeightCodes::Bf16, xp, 104, wp, nullptr, nullptr, yp, ElemType::BF16, 64,
                          nullptr, 0, nullptr);
      },
      "multiple of 8");
  // A split-K shape without its workspace.
  ASSERT_GT(cuda::gemm_skinny_workspace_bytes(1, 64, 4096, cuda::WeightCodes::Bf16), 0u);
  expect_error(
      [&] {
        cuda::gemm_skinny(1, 64, 4096, cuda::WeightCodes::Bf16, xp, 4096, wp, nullptr, nullptr, yp, ElemType::BF16, 64,
                          nullptr, 0, nullptr);
      },
      "workspace");
  // m = 0: nothing to do.
  EXPECT_NO_THROW(cuda::gemm_skinny(0, 64, 128, cuda::WeightCodes::Bf16, xp, 128, wp, nullptr, nullptr, yp,
                                    ElemType::BF16, 64, nullptr, 0, nullptr));
  EXPECT_NO_THROW(device::synchronize());
}

using model_test::relative_l2;

// ops::linear at m <= 8 on the GPU with FP8 weights: the skinny path (bit-identical to a direct launch on
// the same operands), close to the CPU op on the same bf16-rounded inputs (relative L2, the tolerance of
// ops_test's products); m = 9 and bf16 weights stay on cuBLASLt (faster there for bf16: kernels.md) and
// match too.

TEST(CudaGemmSkinny, LinearTakesTheSkinnyPathForSmallFp8M) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = 600, k = 1040;  // a partial last 16-row group and 128-column block
  // bf16 weights.
  Tensor wf = Tensor::empty({n, k});
  for (int64_t i = 0; i < wf.numel(); ++i) wf.data()[i] = test::round_bf16(0.05f * normal(rng));
  const Tensor wg = wf.to(Device::Cuda, ScalarType::BF16);
  // FP8 weights with block scales, and their dequantised fp32 twin for the CPU.
  const int64_t nb = ceil_div(n, 128), kb = ceil_div(k, 128);
  Tensor codes = Tensor::empty({n, k}, ScalarType::F8E4M3), scales = Tensor::empty({nb, kb});
  for (int64_t i = 0; i < n * k; ++i) codes.as<uint8_t>()[i] = random_code(rng);
  std::uniform_real_distribution<float> log_scale(-12.0f, -8.0f);
  for (int64_t i = 0; i < nb * kb; ++i) scales.data()[i] = std::exp2(log_scale(rng));
  Tensor wd = Tensor::empty({n, k});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j)
      wd.data()[i * k + j] =
          cpu::e4m3_to_float(codes.as<uint8_t>()[i * k + j]) * scales.data()[(i / 128) * kb + j / 128];
  const Tensor w8 = codes.with_block_scales(scales).to(Device::Cuda);
  for (int64_t m : {1, 3, 8, 9}) {
    SCOPED_TRACE(testing::Message() << "m=" << m);
    Tensor x = Tensor::empty({m, k});
    for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] = test::round_bf16(normal(rng));
    const Tensor xg = x.to(Device::Cuda, ScalarType::BF16);
    for (ScalarType out : {ScalarType::BF16, ScalarType::F32}) {
      SCOPED_TRACE(out == ScalarType::F32 ? "fp32 out" : "bf16 out");
      const Tensor yb = ops::linear(xg, wg, out), y8 = ops::linear(xg, w8, out);
      EXPECT_LE(relative_l2(yb.to(Device::Cpu, ScalarType::F32), ops::linear(x, wf)), 1.5e-2) << "bf16 weights";
      // m = 9 (cuBLASLt) quantises x to e4m3 per 1x128 block: ~2-4% relative error of its own.
      EXPECT_LE(relative_l2(y8.to(Device::Cpu, ScalarType::F32), ops::linear(x, wd)),
                m > cuda::kSkinnyMaxRows ? 6e-2 : 1.5e-2)
          << "FP8 weights";
      if (m > cuda::kSkinnyMaxRows) continue;
      // The same launch by hand: ops::linear must have taken this path (bit-identical results).
      const ElemType et = out == ScalarType::F32 ? ElemType::F32 : ElemType::BF16;
      const int64_t es = out == ScalarType::F32 ? 4 : 2;
      const size_t ws_bytes = cuda::gemm_skinny_workspace_bytes(m, n, k, cuda::WeightCodes::Fp8);
      DeviceBuffer ws(std::max<size_t>(ws_bytes, 1)), dy(m * n * es);
      dy.poison();
      cuda::gemm_skinny(m, n, k, cuda::WeightCodes::Fp8, xg.raw(), k, w8.as<uint8_t>(), w8.block_scales().as<float>(),
                        nullptr, dy.get(), et, n, ws.get(), ws_bytes, nullptr);
      std::vector<uint8_t> mine = dy.download<uint8_t>(m * n * es), theirs(m * n * es);
      device::copy_to_host_sync(theirs.data(), y8.raw(), theirs.size());
      EXPECT_TRUE(mine == theirs) << "ops::linear did not take the skinny path for FP8 weights";
    }
  }
}


// The MX / NV weights as released (gemm_skinny with Mxfp8, Mxfp4, Nvfp4 codes; ops::linear above decode
// sizes: dequantize_grouped + cuBLASLt), against a double reference on the exact dequantised weights, at
// shapes with a split K (576 x 7168), a partial last 16-row group (1000 rows) and K not a multiple of the
// 64-byte slab (k = 1056: MXFP8 16.5 slabs, FP4 8.25). Each element within the output's bf16 rounding plus
// fp32 accumulation error; a wrong group, nibble or scale moves elements by O(|ref|).
TEST(CudaGemmSkinny, GroupScaledWeightsMatchTheirDequantisedWeights) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Shape {
    int64_t n, k;
  };
  for (const cuda::WeightCodes codes : {cuda::WeightCodes::Mxfp8, cuda::WeightCodes::Mxfp4, cuda::WeightCodes::Nvfp4})
    for (const Shape shape : {Shape{576, 7168}, Shape{1000, 1056}, Shape{64, 64}}) {
      const bool mx8 = codes == cuda::WeightCodes::Mxfp8, nvfp4 = codes == cuda::WeightCodes::Nvfp4;
      const int64_t n = shape.n, k = shape.k, group = nvfp4 ? 16 : 32, per_byte = mx8 ? 1 : 2;
      SCOPED_TRACE(testing::Message() << (mx8 ? "mxfp8" : nvfp4 ? "nvfp4" : "mxfp4") << " n=" << n << " k=" << k);
      Tensor w = Tensor::empty({n, k / per_byte}, mx8 ? ScalarType::F8E4M3 : ScalarType::E2M1x2);
      Tensor scales = Tensor::empty({n, k / group}, nvfp4 ? ScalarType::F8E4M3 : ScalarType::F8E8M0);
      for (int64_t i = 0; i < w.numel(); ++i) w.as<uint8_t>()[i] = mx8 ? random_code(rng) : uint8_t(rng() & 0xFF);
      // Sums O(1): e4m3 codes (RMS ~100) times 2^-14 .. 2^-11, e2m1 (RMS ~3) times 2^-8 .. 2^-5 (MXFP4) or
      // E4M3 0.5-0.94 times global 1 / (4 sqrt(k)) (NVFP4).
      for (int64_t i = 0; i < scales.numel(); ++i)
        scales.as<uint8_t>()[i] = uint8_t(nvfp4 ? 0x30 + rng() % 16 : (mx8 ? 113 : 119) + rng() % 4);
      const float global_value = float(0.25 / std::sqrt(double(k)));
      std::vector<double> wd(size_t(n * k));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j) {
          const uint8_t b = w.as<uint8_t>()[(i * k + j) / per_byte],
                        sc = scales.as<uint8_t>()[i * (k / group) + j / group];
          const double code =
              mx8 ? double(cpu::e4m3_to_float(b)) : double(cpu::e2m1_to_float(j % 2 ? uint8_t(b >> 4) : b));
          const double scale = nvfp4 ? double(cpu::e4m3_to_float(sc)) * global_value : std::ldexp(1.0, int(sc) - 127);
          wd[size_t(i * k + j)] = code * scale;
        }
      Tensor global;
      if (nvfp4) {
        global = Tensor::empty({1});
        global.data()[0] = global_value;
      }
      const Tensor wg = w.with_group_scales(scales, global).to(Device::Cuda);
      for (int64_t m : {1, 3, 8, 24}) {
        SCOPED_TRACE(testing::Message() << "m=" << m);
        Tensor x = Tensor::empty({m, k});
        for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] = test::round_bf16(normal(rng));
        const Tensor y = ops::linear(x.to(Device::Cuda, ScalarType::BF16), wg, ScalarType::F32).to(Device::Cpu);
        int64_t bad = 0;
        double worst = 0;
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < n; ++c) {
            double ref = 0, mag = 0;
            for (int64_t j = 0; j < k; ++j) {
              const double p = double(x.data()[r * k + j]) * wd[size_t(c * k + j)];
              ref += p, mag += std::fabs(p);
            }
            // fp32 accumulation (~k 2^-24 |terms|, generously 2^-12), and above decode sizes the weights'
            // bf16 rounding (2^-9 |terms|).
            const double bound = (m > cuda::kSkinnyMaxRows ? 4e-3 : 2.5e-4) * mag + 1e-6;
            const double err = std::fabs(double(y.data()[r * n + c]) - ref);
            worst = std::max(worst, err / bound);
            bad += err > bound;
          }
        EXPECT_EQ(bad, 0) << "worst error / bound " << worst;
      }
    }
}

}  // namespace
}  // namespace sparrow
