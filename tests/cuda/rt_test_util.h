// Helpers for the GPU tests of the runtime and the small kernels: device buffers from the pool, host
// bf16 rounding (nearest even, as __float2bfloat16_rn), fresh seeds, poisoning and error measures.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/device/stream.h"

namespace sparrow::test {

inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
inline float bf2f(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float round_bf16(float f) { return bf2f(f2bf(f)); }
inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f2bf(v[i]);
  return out;
}
inline std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf2f(v[i]);
  return out;
}

// A pool allocation that goes back to the pool on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes), p_(device::alloc(bytes)) {}
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    upload(host);
  }
  ~DeviceBuffer() { device::free(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T = void>
  T* get() const { return static_cast<T*>(p_); }
  template <typename T>
  void upload(const std::vector<T>& host) {
    device::copy_to_device(p_, host.data(), host.size() * sizeof(T));
    device::synchronize();
  }
  template <typename T>
  std::vector<T> download(size_t count) const {
    std::vector<T> out(count);
    device::copy_to_host_sync(out.data(), p_, count * sizeof(T));
    return out;
  }
  // Fills with 0xFF bytes: NaN as fp32 and as bf16, -1 as int32, so unwritten outputs show.
  void poison() {
    if (cudaMemsetAsync(p_, 0xFF, bytes_, cuda::stream()) != cudaSuccess) ADD_FAILURE() << "poison failed";
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
  void* p_;
};

// A seed drawn fresh each run; shown by SCOPED_TRACE so a failure can be replayed.
inline uint64_t fresh_seed() { return (uint64_t(std::random_device{}()) << 32) | std::random_device{}(); }

inline std::vector<float> random_vector(std::mt19937_64& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The m x n values of a product's output downloaded as raw bytes: rows of `ld` elements (bf16, or fp32 when
// `f32`) plus one guard row, poisoned with 0xFF before the launch. Counts the bytes written outside the
// m x n values (the padding columns and the guard row) into `written_outside`.
inline std::vector<float> read_strided_output(const std::vector<uint8_t>& raw, int64_t m, int64_t n, int64_t ld,
                                              bool f32, int64_t& written_outside) {
  const int64_t es = f32 ? 4 : 2;
  std::vector<float> values;
  values.reserve(size_t(m * n));
  written_outside = 0;
  for (int64_t i = 0; i <= m; ++i)
    for (int64_t j = 0; j < ld; ++j) {
      const uint8_t* p = &raw[size_t((i * ld + j) * es)];
      if (i == m || j >= n) {
        for (int64_t b = 0; b < es; ++b) written_outside += p[b] != 0xFF;
        continue;
      }
      float v;
      if (f32) {
        std::memcpy(&v, p, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, p, 2);
        v = bf2f(h);
      }
      values.push_back(v);
    }
  return values;
}

// ‖a − b‖ / ‖b‖ (NaN anywhere gives NaN, which fails any "< tol" check).
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

// Every |a - b| <= rel * |b| + abs; reports the first offender.
inline ::testing::AssertionResult all_close(const std::vector<float>& a, const std::vector<float>& b, double rel,
                                            double abs) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "size " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    if (!(d <= rel * std::fabs(double(b[i])) + abs))
      return ::testing::AssertionFailure() << "element " << i << ": got " << a[i] << ", expected " << b[i]
                                           << " (|diff| " << d << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace sparrow::test
