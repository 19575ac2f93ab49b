// Radix top-k (kernels/cuda/topk) against cpu::top_k: identical index sets, ascending, -1 padding, on
// random rows, rows full of ties, NaN / -inf / signed zeros, rows shorter than k, and rows long enough
// to be split over many CTAs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/cuda/topk/topk.h"
#include "kernels/cuda/topk/topk_registers.cuh"
#include "kernels/cuda/topk/topk_sampled.cuh"

namespace {

using namespace sparrow;

enum class Fill { Normal, FewValues, AllEqual, Specials, Sorted, Narrow, Ascending, Descending, KthTies, SampleTrap };

void run_case(int64_t rows, int64_t max_len, int k, Fill fill, bool vary_len, std::mt19937& rng, unsigned seed) {
  const int64_t ld = max_len + int64_t(rng() % 4);  // rows start at every alignment mod 16 B
  std::vector<float> s(rows * ld);
  std::vector<int32_t> len(rows);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> few(0, 4);
  for (int64_t r = 0; r < rows; ++r) {
    len[r] = int32_t(vary_len ? int64_t(rng() % (max_len + 1)) : max_len);
    if (vary_len && r == 0) len[r] = int32_t(max_len);
    for (int64_t i = 0; i < ld; ++i) {
      float v;
      switch (fill) {
        case Fill::Normal: v = nd(rng); break;
        case Fill::FewValues: v = float(few(rng)) * 0.5f; break;
        case Fill::AllEqual: v = 1.25f; break;
        case Fill::Sorted: v = float(i % 1000); break;
        // The indexer's scores: a narrow positive range, so most share their top key bits.
        case Fill::Narrow: v = 3.0f + 0.001f * float(rng() % 4096) / 4096.0f; break;
        // Every step raises the running threshold (worst case for the streaming filter) or never does.
        case Fill::Ascending: v = float(i) * 0.25f; break;
        case Fill::Descending: v = -float(i) * 0.25f; break;
        // Large values exactly where the sampled threshold samples a row of 2^17 (every 128th score from
        // the 64th): its bound L then admits fewer than k scores and the exact fallback must run.
        case Fill::SampleTrap: v = i % 128 == 64 ? 100.0f + nd(rng) : nd(rng); break;
        // A few large values, then a huge tie that holds the k-th element.
        case Fill::KthTies: v = rng() % 997 == 0 ? 2.0f + float(rng() % 8) : (rng() % 3 ? 1.0f : -1.0f); break;
        default: {
          int t = int(rng() % 10);
          v = t == 0 ? NAN : t == 1 ? -INFINITY : t == 2 ? -0.0f : t == 3 ? 0.0f : t == 4 ? INFINITY : nd(rng);
        }
      }
      s[r * ld + i] = v;
    }
  }
  float* ds;
  int32_t *dl, *dout;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&ds), s.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dl), rows * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dout), rows * k * 4), cudaSuccess);
  cudaMemcpy(ds, s.data(), s.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dl, len.data(), rows * 4, cudaMemcpyHostToDevice);
  // Every implementation on every case it takes, and Auto (one of them by size, or the index prefix when
  // every row fits in k).
  for (cuda::TopkMethod method : {cuda::TopkMethod::RadixPasses, cuda::TopkMethod::StreamingFilter,
                                  cuda::TopkMethod::SampledThreshold, cuda::TopkMethod::RegisterRadix,
                                  cuda::TopkMethod::Auto}) {
    if (method == cuda::TopkMethod::StreamingFilter && k > cuda::kTopkStreamingMaxK) continue;
    if (method == cuda::TopkMethod::SampledThreshold && !cuda::topk_sampled::supports(max_len)) continue;
    if (method == cuda::TopkMethod::RegisterRadix && !cuda::topk_registers::supports(max_len)) continue;
    const char* name = method == cuda::TopkMethod::RadixPasses        ? "radix passes"
                       : method == cuda::TopkMethod::StreamingFilter  ? "streaming filter"
                       : method == cuda::TopkMethod::SampledThreshold ? "sampled threshold"
                       : method == cuda::TopkMethod::RegisterRadix    ? "register radix"
                                                                      : "auto";
    const size_t wsb = cuda::topk_workspace_bytes(rows, max_len, k, method);
    void* ws = nullptr;
    if (wsb) ASSERT_EQ(cudaMalloc(&ws, wsb), cudaSuccess);
    if (ws) cudaMemset(ws, 0x5A, wsb);  // the launch must not rely on a clean workspace
    std::vector<int32_t> got(rows * k);
    for (int rep = 0; rep < 2; ++rep) {  // twice: determinism and workspace reuse
      cudaMemset(dout, 0x7B, rows * k * 4);
      cuda::topk_rows(ds, ld, dl, rows, max_len, k, dout, ws, wsb, nullptr, method);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<int32_t> again(rows * k);
      cudaMemcpy(again.data(), dout, rows * k * 4, cudaMemcpyDeviceToHost);
      if (rep == 1) ASSERT_EQ(again, got) << name << " not deterministic, seed " << seed;
      got = again;
    }
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int32_t> ref = cpu::top_k(&s[r * ld], len[r], k);
      std::sort(ref.begin(), ref.end());
      ref.resize(k, -1);
      std::vector<int32_t> g(got.begin() + r * k, got.begin() + (r + 1) * k);
      ASSERT_EQ(g, ref) << name << ": row " << r << " len " << len[r] << " k " << k << " max_len " << max_len
                        << " fill " << int(fill) << " seed " << seed;
    }
    cudaFree(ws);
  }
  cudaFree(ds);
  cudaFree(dl);
  cudaFree(dout);
}

TEST(CudaTopk, MatchesCpuTopK) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  run_case(3, 100, 2048, Fill::Normal, true, rng, seed);  // all shorter than k
  run_case(4, 2048, 2048, Fill::Normal, false, rng, seed);
  run_case(4, 2049, 2048, Fill::Normal, false, rng, seed);
  run_case(16, 8192, 2048, Fill::Normal, true, rng, seed);
  run_case(5, 20000, 2048, Fill::FewValues, true, rng, seed);
  run_case(2, 50000, 2048, Fill::AllEqual, false, rng, seed);
  run_case(3, 40000, 2048, Fill::Specials, true, rng, seed);
  run_case(2, 30000, 100, Fill::Sorted, false, rng, seed);
  run_case(1, 131072, 2048, Fill::Normal, false, rng, seed);
  run_case(1, 131072, 2048, Fill::FewValues, false, rng, seed);
  run_case(8, 131072, 2048, Fill::Normal, true, rng, seed);
  run_case(64, 32768, 2048, Fill::Normal, true, rng, seed);
  run_case(2, 1 << 20, 2048, Fill::Normal, false, rng, seed);
  run_case(1, 300000, 2048, Fill::FewValues, false, rng, seed);
  run_case(3, 5000, 1, Fill::Normal, false, rng, seed);
  run_case(3, 70000, 777, Fill::Specials, false, rng, seed);
}

// Shapes aimed at the streaming filter: buffer cuts, parts and merges, ties at the k-th key, odd
// lengths and alignments, many rows of different lengths in one launch, and the legacy path (k > 4096).
TEST(CudaTopk, StreamingFilterEdges) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int64_t len : {1, 2047, 2048, 2049, 2051, 16383, 16385, 20483}) run_case(3, len, 2048, Fill::Normal, false, rng, seed);
  run_case(5, 1, 1, Fill::Normal, false, rng, seed);
  run_case(4, 2, 1, Fill::AllEqual, false, rng, seed);
  run_case(6, 65537, 2048, Fill::KthTies, true, rng, seed);
  run_case(2, 200003, 2048, Fill::KthTies, false, rng, seed);
  run_case(3, 100001, 2048, Fill::AllEqual, false, rng, seed);
  run_case(2, 300001, 4096, Fill::AllEqual, false, rng, seed);
  run_case(4, 131071, 2048, Fill::Narrow, true, rng, seed);
  run_case(2, 131072, 2048, Fill::Ascending, false, rng, seed);
  run_case(2, 131073, 2048, Fill::Descending, false, rng, seed);
  run_case(1, 1 << 20, 2048, Fill::Ascending, false, rng, seed);
  run_case(1, (1 << 20) - 3, 2048, Fill::Narrow, false, rng, seed);
  run_case(3, 1 << 20, 2048, Fill::KthTies, true, rng, seed);
  run_case(40, 50000, 2048, Fill::Specials, true, rng, seed);  // several parts per row
  run_case(150, 9000, 2048, Fill::Normal, true, rng, seed);    // one part per row
  run_case(150, 40001, 3000, Fill::FewValues, true, rng, seed);
  run_case(7, 90000, 4096, Fill::Normal, true, rng, seed);     // the largest k of the streaming path
  run_case(3, 60000, 4097, Fill::Normal, true, rng, seed);     // legacy path
  run_case(2, 100000, 5000, Fill::KthTies, false, rng, seed);  // legacy path, ties
  run_case(3, 3000, 4097, Fill::Normal, true, rng, seed);      // legacy path, shorter rows
}

// Shapes aimed at the sampled threshold: clusters of 1 to 8 CTAs per row (rows x slices), a sample that
// misleads (the exact fallback), ties at the bound and at the k-th key, buffers that overflow, slices
// past the end of short rows.
TEST(CudaTopk, SampledThresholdEdges) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  run_case(1, 131072, 2048, Fill::SampleTrap, false, rng, seed);
  run_case(64, 131072, 2048, Fill::SampleTrap, false, rng, seed);
  run_case(64, 131072, 2048, Fill::Normal, true, rng, seed);   // two CTAs a row
  run_case(140, 131072, 2048, Fill::Narrow, true, rng, seed);  // one CTA a row
  run_case(140, 140000, 2048, Fill::Normal, false, rng, seed); // two CTAs a row, more rows than SMs
  run_case(2, 1 << 20, 2048, Fill::Specials, true, rng, seed); // eight
  run_case(9, 262147, 1000, Fill::KthTies, true, rng, seed);
  run_case(5, 40000, 3000, Fill::FewValues, false, rng, seed);
  run_case(3, 50000, 5000, Fill::Normal, true, rng, seed);
  run_case(4, 8192, 100, Fill::Descending, false, rng, seed);
  run_case(33, 32768, 2048, Fill::AllEqual, false, rng, seed);
}

}  // namespace

// Shapes aimed at the register radix select: clusters of 1 to 8 CTAs per row and 4 to 32 scores a
// thread (rows x lengths), slices past the end of short rows, a whole-bin early stop with ties in the bin,
// a key range of zero (all equal), NaN and infinities, k near the row length, every alignment of ld.
TEST(CudaTopk, RegisterRadixEdges) {
  SPARROW_REQUIRE_GPU();
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int64_t len : {2049, 4096, 6001, 8192, 16384, 16385, 32768, 65537, 131071, 131072})
    run_case(2, len, 2048, Fill::Normal, false, rng, seed);
  run_case(300, 131072, 2048, Fill::Normal, true, rng, seed);    // more clusters than fit at once
  run_case(200, 8192, 2048, Fill::Narrow, true, rng, seed);      // one CTA a row
  run_case(8, 100000, 2048, Fill::KthTies, true, rng, seed);
  run_case(3, 131072, 2048, Fill::AllEqual, false, rng, seed);
  run_case(5, 70000, 2048, Fill::Specials, true, rng, seed);
  run_case(2, 131072, 2048, Fill::Ascending, false, rng, seed);
  run_case(2, 90001, 2048, Fill::Descending, false, rng, seed);
  run_case(4, 20000, 19999, Fill::FewValues, false, rng, seed);  // k = n - 1
  run_case(6, 50000, 1, Fill::Sorted, true, rng, seed);
  run_case(3, 120000, 7000, Fill::Narrow, false, rng, seed);
}
