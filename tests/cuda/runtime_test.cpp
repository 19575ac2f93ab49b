// GPU runtime (pool, stream, copies), cuBLASLt products against cpu::gemm_nt / gemm_nn, and argmax_rows
// against the CPU sampler's order (cpu::top_k). Each test skips without a device.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/ops.h"
#include "kernels/cuda/gemm/gemm.h"
#include "core/device/cuda_check.h"
#include "core/device/device.h"
#include "core/device/stream.h"
#include "kernels/cuda/sampling/sampling.h"
#include "gpu_test_util.h"
#include "rt_test_util.h"

namespace sparrow {
namespace {

using test::DeviceBuffer;

TEST(CudaRuntime, DeviceAndStream) {
  SPARROW_REQUIRE_GPU();
  EXPECT_TRUE(device::available());
  EXPECT_NO_THROW(device::require());
  cudaStream_t s = cuda::stream();
  EXPECT_NE(s, nullptr);
  EXPECT_EQ(s, cuda::stream());
  unsigned flags = 0;
  ASSERT_EQ(cudaStreamGetFlags(s, &flags), cudaSuccess);
  EXPECT_TRUE(flags & cudaStreamNonBlocking);
}

TEST(CudaRuntime, PoolReusesBlocksAndCountsBytes) {
  SPARROW_REQUIRE_GPU();
  const size_t before = device::bytes_in_use();
  void* a = device::alloc(1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 256, 0u);
  EXPECT_GE(device::bytes_in_use(), before + 1000);
  device::free(a);
  EXPECT_EQ(device::bytes_in_use(), before);
  void* b = device::alloc(1000);  // same size class: the block comes back
  EXPECT_EQ(a, b);
  void* c = device::alloc(size_t(3) << 20);
  EXPECT_NE(c, b);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c) % 256, 0u);
  device::free(b);
  device::free(c);
  device::free(nullptr);
  EXPECT_EQ(device::bytes_in_use(), before);
  device::release_cached_memory();
  EXPECT_EQ(device::bytes_in_use(), before);
  void* zero = device::alloc(0);
  EXPECT_NE(zero, nullptr);
  device::free(zero);
  // The peak counter (gpu_kv_cache_bytes measures a step's scratch with it): the most in use since a reset.
  device::reset_peak();
  EXPECT_EQ(device::peak_bytes(), device::bytes_in_use());
  void* big = device::alloc(size_t(5) << 20);
  void* small = device::alloc(size_t(1) << 20);
  device::free(big);
  device::free(small);
  EXPECT_EQ(device::peak_bytes(), before + (size_t(6) << 20));
  device::reset_peak();
  EXPECT_EQ(device::peak_bytes(), before);
  size_t free_bytes = 0, total_bytes = 0;
  device::memory_info(free_bytes, total_bytes);
  EXPECT_GT(total_bytes, free_bytes);
}

// The pool's size classes (no device needed): small and step-sized requests round up by at most 25%,
// so a step's scratch finds its blocks again; from 1 GiB on (weights, caches) only to the driver's 2 MiB.
TEST(CudaPool, SizeClassesWasteLittleOnLargeBlocks) {
  EXPECT_EQ(device::pool_size_class(0), 256u);
  EXPECT_EQ(device::pool_size_class(1000), 1024u);
  EXPECT_EQ(device::pool_size_class(size_t(64) << 10), size_t(64) << 10);
  EXPECT_EQ(device::pool_size_class((size_t(64) << 10) + 1), size_t(80) << 10);  // 1.25 x 64 KiB
  EXPECT_EQ(device::pool_size_class(size_t(300) << 20), size_t(320) << 20);      // 1.25 x 256 MiB
  for (size_t bytes = 100; bytes < (size_t(1) << 30); bytes = bytes * 3 / 2 + 7) {
    const size_t cls = device::pool_size_class(bytes);
    EXPECT_GE(cls, bytes);
    EXPECT_LE(double(cls), std::max(1.25 * double(bytes), double(bytes) + 255)) << bytes;
  }
  // Kimi-Linear-48B's expert stacks [256, 2048, 2304] and [256, 2304, 1024] in bf16, and its recurrent
  // state for 512 sequences: 2 MiB multiples, never a 25% class (2.68 / 1.34 / 25.8 GB).
  const size_t gate_up = size_t(256) * 2048 * 2304 * 2, down = size_t(256) * 2304 * 1024 * 2;
  const size_t state = size_t(512) * 44892160;
  for (size_t bytes : {gate_up, down, state, size_t(1) << 30}) {
    const size_t cls = device::pool_size_class(bytes);
    EXPECT_EQ(cls % (size_t(2) << 20), 0u) << bytes;
    EXPECT_GE(cls, bytes);
    EXPECT_LT(cls - bytes, size_t(2) << 20) << bytes;
  }
}

TEST(CudaRuntime, CopiesRoundTrip) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (size_t n : {size_t(1), size_t(777), size_t(1) << 20}) {
    std::vector<float> host = test::random_vector(rng, n);
    DeviceBuffer a(n * 4), b(n * 4);
    b.poison();
    device::copy_to_device(a.get(), host.data(), n * 4);
    device::copy_device(b.get(), a.get(), n * 4);
    std::vector<float> back(n, -7.0f);
    device::copy_to_host_sync(back.data(), b.get(), n * 4);
    EXPECT_EQ(std::memcmp(back.data(), host.data(), n * 4), 0) << "n=" << n;
  }
  device::copy_to_device(nullptr, nullptr, 0);  // empty copies are no-ops
  device::synchronize();
}

// Timing marks on the stream (ops::TimeMark, what bench forward --profile reads): the time between two
// marks is the device's time for the work between them, so 1 GiB of copies between marks takes longer than
// nothing between them, and at most the host's wall time around both (the marks wait for the work).
TEST(CudaRuntime, TimeMarksMeasureTheStreamsWork) {
  SPARROW_REQUIRE_GPU();
  const size_t bytes = size_t(1) << 30;
  DeviceBuffer a(bytes), b(bytes);
  const ops::TimeMark empty_from = ops::TimeMark::now(Device::Cuda);
  const ops::TimeMark empty_to = ops::TimeMark::now(Device::Cuda);
  const auto wall0 = std::chrono::steady_clock::now();
  const ops::TimeMark from = ops::TimeMark::now(Device::Cuda);
  for (int i = 0; i < 4; ++i) device::copy_device(b.get(), a.get(), bytes);
  const ops::TimeMark to = ops::TimeMark::now(Device::Cuda);
  const double seconds = seconds_between(from, to);  // waits for the copies
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  EXPECT_GT(seconds, 8.0 * double(bytes) / 5e12);  // 4 copies read and write 8 GiB: > 1.7 ms at 5 TB/s
  EXPECT_LE(seconds, wall);
  EXPECT_LT(seconds_between(empty_from, empty_to), seconds / 100);
  EXPECT_THROW(seconds_between(from, ops::TimeMark::now(Device::Cpu)), Error);  // marks of two devices
}

// ---- GEMM -----------------------------------------------------------------------------------------

struct GemmCase {
  int64_t m, n, k, batch;
  int64_t pad;  // extra elements per row of every operand
  bool nt;
  cuda::ElemType out;
  float alpha, beta;
};

void run_gemm_case(const GemmCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k << " batch=" << c.batch
                                  << " pad=" << c.pad << " nt=" << c.nt << " out="
                                  << (c.out == cuda::ElemType::F32 ? "f32" : "bf16") << " alpha=" << c.alpha
                                  << " beta=" << c.beta);
  const int64_t ldx = c.k + c.pad, wrows = c.nt ? c.n : c.k, wcols = c.nt ? c.k : c.n, ldw = wcols + c.pad,
                ldy = c.n + c.pad;
  const int64_t sx = c.m * ldx, sw = wrows * ldw, sy = c.m * ldy;
  std::vector<float> x = test::random_vector(rng, sx * c.batch), w = test::random_vector(rng, sw * c.batch),
                     y0 = test::random_vector(rng, sy * c.batch);
  for (float& v : x) v = test::round_bf16(v);
  for (float& v : w) v = test::round_bf16(v);
  if (c.out == cuda::ElemType::BF16)
    for (float& v : y0) v = test::round_bf16(v);
  // Reference: alpha * x·op(w) + beta * y0 in fp32 (OpenBLAS) on the bf16 values.
  std::vector<float> ref(sy * c.batch);
  for (int64_t b = 0; b < c.batch; ++b) {
    std::vector<float> prod(c.m * ldy, 0.0f);
    if (c.nt) cpu::gemm_nt(c.m, c.n, c.k, x.data() + b * sx, ldx, w.data() + b * sw, ldw, prod.data(), ldy);
    else cpu::gemm_nn(c.m, c.n, c.k, x.data() + b * sx, ldx, w.data() + b * sw, ldw, prod.data(), ldy);
    for (int64_t i = 0; i < c.m * ldy; ++i) ref[b * sy + i] = c.alpha * prod[i] + c.beta * y0[b * sy + i];
  }
  DeviceBuffer dx(test::to_bf16(x)), dw(test::to_bf16(w));
  const bool f32 = c.out == cuda::ElemType::F32;
  DeviceBuffer dy(sy * c.batch * (f32 ? 4 : 2));
  if (c.beta != 0) {
    if (f32) dy.upload(y0);
    else dy.upload(test::to_bf16(y0));
  } else {
    dy.poison();
  }
  cuda::GemmOperand gx{dx.get(), cuda::ElemType::BF16, ldx, sx}, gw{dw.get(), cuda::ElemType::BF16, ldw, sw};
  cuda::GemmOutput gy{dy.get(), c.out, ldy, sy};
  if (c.nt) cuda::gemm_nt(c.m, c.n, c.k, gx, gw, gy, c.alpha, c.beta, c.batch, cuda::stream());
  else cuda::gemm_nn(c.m, c.n, c.k, gx, gw, gy, c.alpha, c.beta, c.batch, nullptr);
  std::vector<float> got =
      f32 ? dy.download<float>(sy * c.batch) : test::from_bf16(dy.download<uint16_t>(sy * c.batch));
  // Compare the logical m x n entries only (padding columns are not part of y).
  std::vector<float> g, r;
  double max_ref = 0;
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) {
        g.push_back(got[b * sy + i * ldy + j]);
        r.push_back(ref[b * sy + i * ldy + j]);
        max_ref = std::max(max_ref, std::fabs(double(r.back())));
      }
  // fp32 out: only the summation order differs. bf16 out: one rounding of the result (2^-8 relative).
  const double rel = test::rel_error(g, r);
  if (f32) {
    EXPECT_LT(rel, 1e-5);
    EXPECT_TRUE(test::all_close(g, r, 1e-4, 1e-5 * max_ref));
  } else {
    EXPECT_LT(rel, 5e-3);
    EXPECT_TRUE(test::all_close(g, r, 1.0 / 128, 1e-4 * max_ref));
  }
}

TEST(CudaGemm, MatchesCpuOnRandomShapes) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using cuda::ElemType;
  const GemmCase cases[] = {
      {1, 64, 128, 1, 0, true, ElemType::F32, 1.0f, 0.0f},
      {7, 200, 96, 1, 0, true, ElemType::BF16, 1.0f, 0.0f},
      {33, 512, 256, 1, 8, true, ElemType::F32, 0.5f, 0.0f},
      {128, 96, 1000, 1, 0, true, ElemType::BF16, 1.0f, 0.0f},
      {65, 130, 72, 1, 3, true, ElemType::F32, 1.0f, 1.0f},  // odd pad: 2-byte aligned rows
      {16, 48, 64, 1, 0, true, ElemType::BF16, 2.0f, 0.5f},
      {5, 64, 96, 1, 0, false, ElemType::F32, 1.0f, 0.0f},
      {100, 300, 40, 1, 8, false, ElemType::BF16, 1.0f, 0.0f},
      {9, 128, 512, 1, 0, false, ElemType::F32, 1.5f, -1.0f},
      {4, 64, 128, 12, 0, true, ElemType::F32, 1.0f, 0.0f},    // strided batched (per-head products)
      {3, 512, 128, 8, 0, false, ElemType::BF16, 1.0f, 0.0f},
      {17, 40, 24, 5, 8, true, ElemType::F32, 1.0f, 1.0f},
  };
  for (const GemmCase& c : cases) run_gemm_case(c, rng);
  // The same shapes again hit the plan cache.
  for (const GemmCase& c : cases) run_gemm_case(c, rng);
}

TEST(CudaGemm, RejectsBadArguments) {
  SPARROW_REQUIRE_GPU();
  DeviceBuffer a(1024);
  cuda::GemmOperand x{a.get(), cuda::ElemType::BF16, 8, 0}, w{a.get(), cuda::ElemType::BF16, 8, 0};
  cuda::GemmOutput y{a.get(), cuda::ElemType::F32, 4, 0};
  EXPECT_THROW(cuda::gemm_nt(2, 8, 8, x, w, y), Error);  // ldy < n
  cuda::GemmOperand xf{a.get(), cuda::ElemType::F32, 8, 0};
  cuda::GemmOutput y8{a.get(), cuda::ElemType::F32, 8, 0};
  EXPECT_THROW(cuda::gemm_nt(2, 8, 8, xf, w, y8), Error);  // fp32 operand
  EXPECT_NO_THROW(cuda::gemm_nt(0, 8, 8, x, w, y8));       // empty product
}

// ---- argmax ---------------------------------------------------------------------------------------

TEST(CudaRuntimeSampling, ArgmaxRowsMatchesCpuOrder) {
  SPARROW_REQUIRE_GPU();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int64_t vocab : {1, 7, 1000, 32000, 129280}) {
    const int64_t rows = 9;
    std::vector<float> logits = test::random_vector(rng, rows * vocab, -4, 4);
    // Row 1: coarse values (many exact ties); row 2: a NaN at the maximum's place; row 3: all -inf;
    // row 4: all NaN; row 5: the maximum repeated at two places.
    for (int64_t v = 0; v < vocab; ++v) logits[1 * vocab + v] = std::round(logits[1 * vocab + v]);
    logits[2 * vocab + vocab / 2] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t v = 0; v < vocab; ++v) logits[3 * vocab + v] = -std::numeric_limits<float>::infinity();
    for (int64_t v = 0; v < vocab; ++v) logits[4 * vocab + v] = std::numeric_limits<float>::quiet_NaN();
    logits[5 * vocab + vocab - 1] = 100;
    logits[5 * vocab + vocab / 3] = 100;
    DeviceBuffer dl(logits), ids(rows * 4);
    ids.poison();
    cuda::argmax_rows(dl.get<float>(), rows, vocab, ids.get<int32_t>(), cuda::stream());
    std::vector<int32_t> got = ids.download<int32_t>(rows);
    for (int64_t r = 0; r < rows; ++r)
      EXPECT_EQ(got[r], cpu::top_k(logits.data() + r * vocab, vocab, 1)[0]) << "vocab " << vocab << " row " << r;
  }
}

}  // namespace
}  // namespace sparrow
