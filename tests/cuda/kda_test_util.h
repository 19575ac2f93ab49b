// What the KDA kernel tests share (kda_test.cpp, kda_chunk_test.cpp): batches described by per-sequence
// row counts, and state slots laid out as a cache's would be.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/kda/kda.h"
#include "core/device/cuda_check.h"

namespace sparrow::test {

// "1,5,64,..." (the first 12 counts) for failure messages.
inline std::string counts_str(const std::vector<int>& counts) {
  std::string s;
  for (size_t i = 0; i < counts.size() && i < 12; ++i) s += (i ? "," : "") + std::to_string(counts[i]);
  if (counts.size() > 12) s += ",... (" + std::to_string(counts.size()) + " seqs)";
  return s;
}

// Row offsets [S + 1] of sequences with these row counts, stacked.
inline std::vector<int32_t> offsets_of(const std::vector<int>& counts) {
  std::vector<int32_t> off(counts.size() + 1, 0);
  for (size_t s = 0; s < counts.size(); ++s) off[s + 1] = off[s] + counts[s];
  return off;
}

// Per-sequence state slots of `size` floats (plus gaps) in one device allocation in a shuffled order, the
// state `offset` bytes into its slot, reached through a device array of slot pointers: what a cache's slots
// look like to the kernels. By default the offset is 12 bytes and slots lie size + 7 floats apart, so
// states are not 8-byte aligned and only some are 16-byte aligned; `aligned` puts every state on a 16-byte
// boundary, as the cache does (planner.h), which the decode kernel's 16-byte loads want.
struct KdaSlotStates {
  int64_t offset;  // bytes
  int64_t size;
  std::vector<int64_t> at;  // float offset of sequence s's state
  DeviceArray<float> pool;
  DeviceArray<uint8_t*> pointers;
  KdaSlotStates(int num_seqs, int64_t state_size, std::mt19937_64& rng, bool aligned = false)
      : offset(int64_t(sizeof(float)) * (aligned ? 4 : 3)),
        size(state_size),
        at(num_seqs),
        pool(size_t((num_seqs + 2) * stride_of(state_size, aligned))),
        pointers(size_t(num_seqs)) {
    const int64_t stride = stride_of(state_size, aligned);
    std::vector<int64_t> slots(num_seqs + 2);
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = int64_t(i);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<uint8_t*> ptrs(num_seqs);
    for (int s = 0; s < num_seqs; ++s) {
      at[s] = slots[s] * stride + offset / int64_t(sizeof(float));
      ptrs[s] = reinterpret_cast<uint8_t*>(pool.ptr + slots[s] * stride);
    }
    pool.poison();
    pointers.upload(ptrs);
  }
  // Floats from one slot to the next: the state, its offset and a gap (a multiple of 4 when aligned).
  static int64_t stride_of(int64_t state_size, bool aligned) {
    return aligned ? (state_size + 8 + 3) / 4 * 4 : state_size + 7;
  }
  // The launch's sequences: the rows of `offsets` ([S + 1], consecutive ranges).
  cuda::KdaSequences seqs(const DeviceArray<int32_t>& offsets, int64_t max_count) const {
    return cuda::KdaSequences{offsets.ptr, offsets.ptr + 1, pointers.ptr, int(at.size()), max_count};
  }
  void upload(int s, const float* src) {
    SPARROW_CUDA_CHECK(cudaMemcpy(pool.ptr + at[s], src, sizeof(float) * size, cudaMemcpyHostToDevice));
  }
  std::vector<float> download(int s) const {
    std::vector<float> host(static_cast<size_t>(size));
    SPARROW_CUDA_CHECK(cudaMemcpy(host.data(), pool.ptr + at[s], sizeof(float) * size, cudaMemcpyDeviceToHost));
    return host;
  }
};

// KdaMixer's l2norm (src/kernels/cpu/kda_reference.cpp): x / sqrt(sum x^2 + 1e-6), times scale.
inline void l2_normalize(float* x, int n, float scale) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum + 1e-6f);
  for (int i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

// Relative L2 error of each D-vector against the reference, with a floor of 1e-2 times the reference's RMS
// vector norm (a vector can be small by cancellation while its rounding follows the state's size).
inline int compare_vectors(const std::vector<float>& got, const std::vector<float>& ref, int D, double tol,
                           const std::string& what, double* worst_out) {
  const size_t vectors = ref.size() / D;
  double total = 0;
  for (float r : ref) total += double(r) * r;
  const double floor = 1e-2 * std::sqrt(total / std::max<size_t>(1, vectors));
  int bad = 0;
  double worst = 0;
  for (size_t i = 0; i < vectors; ++i) {
    double err = 0, norm = 0;
    bool finite = true;
    for (int d = 0; d < D; ++d) {
      const double gv = got[i * D + d], rv = ref[i * D + d];
      finite = finite && std::isfinite(gv);
      err += (gv - rv) * (gv - rv);
      norm += rv * rv;
    }
    const double rel = std::sqrt(err) / (std::sqrt(norm) + floor + 1e-30);
    if (finite) worst = std::max(worst, rel);
    if ((!finite || !(rel <= tol)) && bad++ < 5)
      ADD_FAILURE() << what << ": vector " << i << " rel L2 err " << rel << (finite ? "" : " (non-finite / unwritten)");
  }
  if (worst_out) *worst_out = std::max(*worst_out, worst);
  return bad;
}

}  // namespace sparrow::test
