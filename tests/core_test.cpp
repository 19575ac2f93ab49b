#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/tensor.h"
#include "kernels/cpu/reference_ops.h"
#include "runner/decode_graphs.h"

using namespace sparrow;

TEST(CoreTensor, RowsAndReshapeShareStorage) {
  Tensor t = Tensor::zeros({4, 3});
  Tensor r = t.rows(1, 3);
  r.row(0)[2] = 5.0f;
  EXPECT_EQ(t.row(1)[2], 5.0f);
  EXPECT_EQ(r.dim(0), 2);
  Tensor flat = t.reshape({12});
  EXPECT_EQ(flat.data()[5], 5.0f);
  EXPECT_THROW(t.reshape({5}), Error);
  EXPECT_THROW(t.rows(3, 5), Error);
}

TEST(CoreTensor, ByteViewsAndCopies) {
  Tensor buffer = Tensor::zeros({64}, ScalarType::U8);
  Tensor ints = buffer.view_bytes(16, {4}, ScalarType::I32);
  Tensor values = Tensor::empty({4}, ScalarType::I32);
  for (int i = 0; i < 4; ++i) values.as<int32_t>()[i] = 10 * i + 1;
  ints.copy_from(values);
  EXPECT_EQ(buffer.as<int32_t>()[4 + 2], 21);  // byte 16 is int 4
  EXPECT_EQ(buffer.as<uint8_t>()[0], 0);
  EXPECT_THROW(buffer.view_bytes(60, {2}, ScalarType::I32), Error);
  EXPECT_THROW(ints.copy_from(Tensor::empty({5}, ScalarType::I32)), Error);
  EXPECT_THROW(ints.copy_from(Tensor::empty({4})), Error);  // float32 into int32
}

// A CUDA graph's launch shape: never below what the batch needs, at most 1/8 beyond it past 1024 keys,
// and the page table long enough for the padded bound.
TEST(DecodeGraphs, PaddedShapesBoundTheWaste) {
  for (int64_t visible : {1, 127, 128, 129, 1000, 1025, 4097, 100000, 131072, 1000001}) {
    const StepShape least{(visible + 63) / 64, visible};
    const StepShape padded = DecodeGraphs::padded(least, 64);
    EXPECT_GE(padded.max_visible, visible);
    EXPECT_GE(padded.table_stride * 64, padded.max_visible);
    EXPECT_GE(padded.table_stride, least.table_stride);
    if (visible > 1024) EXPECT_LE(padded.max_visible, visible + visible / 8 + 1) << visible;
    EXPECT_EQ(DecodeGraphs::padded(least, 64).max_visible, padded.max_visible);  // a function of the shape
  }
  EXPECT_EQ(DecodeGraphs::padded({2, 100}, 64).max_visible, DecodeGraphs::padded({2, 120}, 64).max_visible)
      << "nearby lengths share a graph";
}

TEST(CoreParallel, CoversEveryIndexOnce) {
  for (int64_t n : {1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    parallel_for(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(CoreParallel, NestedCallsRunSerially) {
  std::atomic<int> total{0};
  parallel_for(4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) parallel_for(10, [&](int64_t b2, int64_t e2) { total += int(e2 - b2); });
  });
  EXPECT_EQ(total.load(), 40);
}

TEST(CpuOps, LinearMatchesLoop) {
  Tensor x = Tensor::empty({3, 5}), w = Tensor::empty({4, 5});
  for (int i = 0; i < 15; ++i) x.data()[i] = 0.1f * i - 0.7f;
  for (int i = 0; i < 20; ++i) w.data()[i] = 0.05f * (i % 7) - 0.1f;
  Tensor y = cpu::linear(x, w);
  ASSERT_EQ(y.shape(), (Shape{3, 4}));
  for (int t = 0; t < 3; ++t)
    for (int o = 0; o < 4; ++o) {
      double ref = 0;
      for (int i = 0; i < 5; ++i) ref += double(x.row(t)[i]) * w.row(o)[i];
      EXPECT_NEAR(y.row(t)[o], ref, 1e-6);
    }
}

// A row's product is bit-identical whether it runs alone or among others, at any offset in the batch:
// what lets a request's greedy tokens be the same alone and in a batch (reference_ops.cpp, kRowTile).
TEST(CpuOps, ProductsAreBatchInvariant) {
  const int64_t rows = 37, n = 67, k = 131;  // nothing a multiple of a BLAS kernel's blocking
  std::vector<float> x(rows * k), w(n * k), w_kn(k * n), base(rows * n);
  uint32_t state = 12345;
  auto next = [&] { state = state * 1664525u + 1013904223u; return float(int(state >> 9) % 2001 - 1000) / 997.0f; };
  for (float& v : x) v = next();
  for (float& v : w) v = next();
  for (float& v : w_kn) v = next();
  for (float& v : base) v = next();
  for (bool transposed : {true, false}) {
    for (float beta : {0.0f, 1.0f}) {
      auto product = [&](int64_t first, int64_t count) {
        std::vector<float> y(base.begin() + first * n, base.begin() + (first + count) * n);
        if (transposed) cpu::gemm_nt(count, n, k, x.data() + first * k, k, w.data(), k, y.data(), n, beta);
        else cpu::gemm_nn(count, n, k, x.data() + first * k, k, w_kn.data(), n, y.data(), n, beta);
        return y;
      };
      std::vector<float> all = product(0, rows);
      for (int64_t count : {1, 2, 3, 7, 8, 9, 16, 20})
        for (int64_t first = 0; first + count <= rows; first += 5) {
          std::vector<float> part = product(first, count);
          ASSERT_EQ(0, std::memcmp(part.data(), all.data() + first * n, part.size() * sizeof(float)))
              << (transposed ? "gemm_nt" : "gemm_nn") << " beta " << beta << ": rows " << first << ".."
              << first + count << " differ from the same rows in one call of " << rows;
        }
    }
  }
}

TEST(CpuOps, RmsNormPerHeadAndUnitOffset) {
  Tensor x = Tensor::empty({1, 4});
  float v[4] = {1, 2, 3, 4};
  std::copy(v, v + 4, x.data());
  Tensor w = Tensor::empty({2});
  w.data()[0] = 2.0f;
  w.data()[1] = 0.5f;
  Tensor y = cpu::rms_norm(x, w, 0.0f);  // two groups of two
  float r0 = 1.0f / std::sqrt((1 + 4) / 2.0f), r1 = 1.0f / std::sqrt((9 + 16) / 2.0f);
  EXPECT_NEAR(y.data()[0], 1 * r0 * 2.0f, 1e-6);
  EXPECT_NEAR(y.data()[1], 2 * r0 * 0.5f, 1e-6);
  EXPECT_NEAR(y.data()[2], 3 * r1 * 2.0f, 1e-6);
  Tensor g = cpu::rms_norm(x, w, 0.0f, /*unit_offset=*/true);
  EXPECT_NEAR(g.data()[3], 4 * r1 * 1.5f, 1e-6);
}

TEST(CpuOps, SoftmaxHandlesMaskedEntries) {
  float x[4] = {0.0f, -INFINITY, 0.0f, -INFINITY};
  cpu::softmax_inplace(x, 4);
  EXPECT_FLOAT_EQ(x[0], 0.5f);
  EXPECT_FLOAT_EQ(x[1], 0.0f);
  float all_masked[2] = {-INFINITY, -INFINITY};
  cpu::softmax_inplace(all_masked, 2);
  EXPECT_EQ(all_masked[0], 0.0f);
}

TEST(CpuOps, TopKBreaksTiesTowardSmallerIndex) {
  float s[6] = {1, 3, 3, NAN, 2, 3};
  auto idx = cpu::top_k(s, 6, 4);
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 2, 5, 4}));
  EXPECT_EQ(cpu::top_k(s, 6, 10).size(), 6u);
  EXPECT_EQ(cpu::top_k(s, 6, 10).back(), 3);  // NaN ranks last
}

TEST(CpuOps, EmbeddingRejectsOutOfRangeIds) {
  Tensor table = Tensor::zeros({4, 2});
  EXPECT_THROW(cpu::embedding(table, {0, 4}), Error);
  EXPECT_THROW(cpu::embedding(table, {-1}), Error);
}
