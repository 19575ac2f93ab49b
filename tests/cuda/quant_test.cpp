// The device number codecs (kernels/cuda/quant/fp4.cuh, through the launchers of quant.h) against the
// CPU reference (kernels/cpu/fp8_codec.h, kernels/cpu/fp4_codec.h), bit for bit: on the committed vectors
// (tests/data/quant_vectors.json), every code of every element format, and random rows of many shapes
// with specials mixed in (a fresh seed each run, printed on failure; outputs poisoned before each launch).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>

#include "gpu_test_util.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"
#include "kernels/cuda/quant/quant.h"
#include "../quant_vectors.h"

using namespace sparrow;
using sparrow::testing::bits_of_float;
using sparrow::testing::same_float;

namespace {

const sparrow::testing::QuantVectors& vectors() {
  static const sparrow::testing::QuantVectors v = sparrow::testing::load_quant_vectors();
  return v;
}

std::vector<uint8_t> gpu_encode(cuda::QuantElement element, const std::vector<float>& x) {
  test::DeviceArray<float> dx(x);
  test::DeviceArray<uint8_t> codes(x.size());
  codes.poison();
  cuda::quant_encode(element, dx.ptr, int64_t(x.size()), codes.ptr, nullptr);
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  return codes.download();
}

std::vector<float> gpu_decode(cuda::QuantElement element, const std::vector<uint8_t>& codes) {
  test::DeviceArray<uint8_t> dc(codes);
  test::DeviceArray<float> x(codes.size());
  x.poison();
  cuda::quant_decode(element, dc.ptr, int64_t(codes.size()), x.ptr, nullptr);
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  return x.download();
}

struct Quantized {
  std::vector<uint8_t> packed, scales;
};

int block_of(cuda::Fp4Format format) { return format == cuda::Fp4Format::Nvfp4 ? cpu::kNvfp4Block : cpu::kMxfp4Block; }

Quantized gpu_quantize(cuda::Fp4Format format, const std::vector<float>& x, int64_t rows, int64_t width, float global) {
  test::DeviceArray<float> dx(x);
  test::DeviceArray<uint8_t> packed(rows * cpu::fp4_packed_bytes(width));
  test::DeviceArray<uint8_t> scales(rows * cpu::fp4_num_blocks(width, block_of(format)));
  packed.poison();
  scales.poison();
  cuda::fp4_quantize(format, dx.ptr, rows, width, global, packed.ptr, scales.ptr, nullptr);
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  return {packed.download(), scales.download()};
}

std::vector<float> gpu_dequantize(cuda::Fp4Format format, const Quantized& q, int64_t rows, int64_t width, float global) {
  test::DeviceArray<uint8_t> packed(q.packed), scales(q.scales);
  test::DeviceArray<float> x(rows * width);
  x.poison();
  cuda::fp4_dequantize(format, packed.ptr, scales.ptr, rows, width, global, x.ptr, nullptr);
  SPARROW_CUDA_CHECK(cudaDeviceSynchronize());
  return x.download();
}

// The CPU reference, row by row.
Quantized cpu_quantize(cuda::Fp4Format format, const std::vector<float>& x, int64_t rows, int64_t width, float global) {
  const int64_t pb = cpu::fp4_packed_bytes(width), sb = cpu::fp4_num_blocks(width, block_of(format));
  Quantized q{std::vector<uint8_t>(rows * pb), std::vector<uint8_t>(rows * sb)};
  for (int64_t r = 0; r < rows; ++r) {
    if (format == cuda::Fp4Format::Nvfp4)
      cpu::nvfp4_quantize(x.data() + r * width, width, global, q.packed.data() + r * pb, q.scales.data() + r * sb);
    else
      cpu::mxfp4_quantize(x.data() + r * width, width, q.packed.data() + r * pb, q.scales.data() + r * sb);
  }
  return q;
}

std::vector<float> cpu_dequantize(cuda::Fp4Format format, const Quantized& q, int64_t rows, int64_t width, float global) {
  const int64_t pb = cpu::fp4_packed_bytes(width), sb = cpu::fp4_num_blocks(width, block_of(format));
  std::vector<float> x(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    if (format == cuda::Fp4Format::Nvfp4)
      cpu::nvfp4_dequantize(q.packed.data() + r * pb, q.scales.data() + r * sb, width, global, x.data() + r * width);
    else
      cpu::mxfp4_dequantize(q.packed.data() + r * pb, q.scales.data() + r * sb, width, x.data() + r * width);
  }
  return x;
}

}  // namespace

TEST(CudaQuant, ElementCodecsMatchTheVectorsAndTheCpu) {
  SPARROW_REQUIRE_GPU();
  for (auto [element, cases] : {std::pair{cuda::QuantElement::E4m3, &vectors().e4m3},
                                std::pair{cuda::QuantElement::E2m1, &vectors().e2m1}}) {
    std::vector<float> x;
    for (const auto& c : *cases) x.push_back(c.x);
    const std::vector<uint8_t> got = gpu_encode(element, x);
    for (size_t i = 0; i < cases->size(); ++i)
      EXPECT_EQ(int(got[i]), int((*cases)[i].code)) << "x bits 0x" << std::hex << bits_of_float(x[i]);
  }
  // Every code decodes as on the CPU.
  std::vector<uint8_t> all(256);
  for (int c = 0; c < 256; ++c) all[c] = uint8_t(c);
  const std::vector<float> e4m3 = gpu_decode(cuda::QuantElement::E4m3, all);
  const std::vector<float> e2m1 = gpu_decode(cuda::QuantElement::E2m1, all);
  const std::vector<float> e8m0 = gpu_decode(cuda::QuantElement::E8m0, all);
  for (int c = 0; c < 256; ++c) {
    EXPECT_TRUE(same_float(e4m3[c], cpu::e4m3_to_float(uint8_t(c)))) << c;
    EXPECT_TRUE(same_float(e2m1[c], cpu::e2m1_to_float(uint8_t(c & 15)))) << c;
    EXPECT_TRUE(same_float(e8m0[c], cpu::e8m0_to_float(uint8_t(c)))) << c;
  }
}

TEST(CudaQuant, BlockCodecsMatchTheVectors) {
  SPARROW_REQUIRE_GPU();
  for (auto [format, cases] : {std::pair{cuda::Fp4Format::Nvfp4, &vectors().nvfp4},
                               std::pair{cuda::Fp4Format::Mxfp4, &vectors().mxfp4}}) {
    for (const auto& c : *cases) {
      SCOPED_TRACE(c.name);
      const int64_t n = int64_t(c.x.size());
      const Quantized q = gpu_quantize(format, c.x, 1, n, c.global);
      EXPECT_EQ(q.scales, c.scales);
      EXPECT_EQ(q.packed, c.packed);
      const std::vector<float> back = gpu_dequantize(format, {c.packed, c.scales}, 1, n, c.global);
      for (int64_t i = 0; i < n; ++i) EXPECT_TRUE(same_float(back[i], c.decoded[i])) << i;
    }
  }
}

TEST(CudaQuant, RandomRowsMatchTheCpuBitForBit) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::nanf(""), 1e-45f, -1e-40f, 6.0f, 5.0f, 0.25f, 3e38f};
  struct Shape {
    int64_t rows, width;
  };
  for (const Shape& shape : {Shape{1, 16}, Shape{3, 20}, Shape{7, 32}, Shape{5, 40}, Shape{64, 128}, Shape{33, 512},
                             Shape{9, 576}, Shape{17, 1024}, Shape{2, 7}}) {
    for (bool with_specials : {false, true}) {
      std::vector<float> x(shape.rows * shape.width);
      for (int64_t r = 0; r < shape.rows; ++r) {
        const float magnitude = std::ldexp(1.0f, exponent(rng));  // one range per row, as a cache row has
        for (int64_t i = 0; i < shape.width; ++i) x[r * shape.width + i] = normal(rng) * magnitude;
      }
      if (with_specials)
        for (int k = 0; k < 8; ++k) x[rng() % x.size()] = specials[rng() % std::size(specials)];
      for (cuda::Fp4Format format : {cuda::Fp4Format::Nvfp4, cuda::Fp4Format::Mxfp4}) {
        for (float global : {1.0f, 0.37f, 1e-3f}) {
          if (format == cuda::Fp4Format::Mxfp4 && global != 1.0f) continue;
          SCOPED_TRACE(::testing::Message() << "seed " << seed << ", " << shape.rows << " x " << shape.width
                                          << (format == cuda::Fp4Format::Nvfp4 ? " nvfp4" : " mxfp4") << ", global "
                                          << global << (with_specials ? ", specials" : ""));
          const Quantized want = cpu_quantize(format, x, shape.rows, shape.width, global);
          const Quantized got = gpu_quantize(format, x, shape.rows, shape.width, global);
          ASSERT_EQ(got.scales, want.scales);
          ASSERT_EQ(got.packed, want.packed);
          const std::vector<float> back = gpu_dequantize(format, got, shape.rows, shape.width, global);
          const std::vector<float> ref = cpu_dequantize(format, want, shape.rows, shape.width, global);
          for (size_t i = 0; i < back.size(); ++i) ASSERT_TRUE(same_float(back[i], ref[i])) << i;
        }
      }
      // The element encoders on the same values.
      for (cuda::QuantElement element : {cuda::QuantElement::E4m3, cuda::QuantElement::E2m1}) {
        const std::vector<uint8_t> got = gpu_encode(element, x);
        for (size_t i = 0; i < x.size(); ++i) {
          const uint8_t want = element == cuda::QuantElement::E4m3 ? cpu::float_to_e4m3(x[i]) : cpu::float_to_e2m1(x[i]);
          ASSERT_EQ(int(got[i]), int(want)) << "seed " << seed << " x " << x[i];
        }
      }
    }
  }
}
