// How fast warps can stream a weight matrix with each load pattern, and nothing else (no products): the
// ceiling the skinny decode products (kernels/cuda/gemm/skinny.cuh) can reach with their load pattern, against
// other patterns moving the same bytes. bench/results/kernels.md ("Load patterns") has a run.
//   nvcc -arch=sm_90a -O3 -o stream_probe bench/probes/stream_probe.cu && ./stream_probe
// Each row: median of 10 launches after 3, L2 flushed (a 256 MB memset) before each; "16w" gives each CTA
// 50 KB of unused shared memory so that 4 CTAs (16 warps) fit an SM, as the skinny kernel's registers
// allow, "max" lets the occupancy float.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

__device__ __forceinline__ uint4 ldg_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ldg_plain(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// MODE 0: lane (g,t): rows 16w+g and +8, bytes s*64 + 16t (the skinny kernel's pattern)
// MODE 1: lane l: rows 16w + 4i + l/8 (i = 0..3), bytes s*128 + 16 (l%8): four rows x 128 B an instruction
// MODE 2: warp's 16 rows read one after another, 512 contiguous bytes an instruction
template <int MODE, int U, bool HINT>
__global__ void __launch_bounds__(128) probe(const uint8_t* w, int64_t row_bytes, int64_t groups, unsigned* sink) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t group = int64_t(blockIdx.x) * 4 + warp;
  if (group >= groups) return;
  const uint8_t* base = w + group * 16 * row_bytes;
  uint32_t acc = 0;
  auto ld = [&](const uint8_t* p) { return HINT ? ldg_stream(p) : ldg_plain(p); };
  if (MODE == 0) {
    const int g = lane / 4, t = lane % 4;
    const uint8_t* lo = base + g * row_bytes + 16 * t;
    const uint8_t* hi = base + (g + 8) * row_bytes + 16 * t;
    const int nslabs = int(row_bytes / 64);
    uint4 rl[U], rh[U];
#pragma unroll
    for (int u = 0; u < U; ++u) { rl[u] = ld(lo + u * 64); rh[u] = ld(hi + u * 64); }
#pragma unroll 1
    for (int s0 = 0; s0 < nslabs; s0 += U) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int s = s0 + u;
        acc ^= rl[u].x ^ rl[u].y ^ rl[u].z ^ rl[u].w ^ rh[u].x ^ rh[u].y ^ rh[u].z ^ rh[u].w;
        if (s + U < nslabs) { rl[u] = ld(lo + (s + U) * 64); rh[u] = ld(hi + (s + U) * 64); }
      }
    }
  } else if (MODE == 1) {
    // 2 KB a "slab" (16 rows x 128 B): 4 instructions of 4 rows x 128 B; ring of U/2 slabs (same bytes in flight)
    const int r = lane / 8, c = lane % 8;
    const int nslabs = int(row_bytes / 128);
    constexpr int V = U / 2;
    uint4 q[V][4];
#pragma unroll
    for (int u = 0; u < V; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) q[u][i] = ld(base + (4 * i + r) * row_bytes + u * 128 + 16 * c);
#pragma unroll 1
    for (int s0 = 0; s0 < nslabs; s0 += V) {
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const int s = s0 + u;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc ^= q[u][i].x ^ q[u][i].y ^ q[u][i].z ^ q[u][i].w;
        if (s + V < nslabs)
#pragma unroll
          for (int i = 0; i < 4; ++i) q[u][i] = ld(base + (4 * i + r) * row_bytes + (s + V) * 128 + 16 * c);
      }
    }
  } else {
    // contiguous: 16 rows x row_bytes one after the other, 512 B an instruction, 2U instructions in flight
    const int64_t total = 16 * row_bytes / 512;
    constexpr int V = 2 * U;
    uint4 q[V];
#pragma unroll
    for (int u = 0; u < V; ++u) q[u] = ld(base + u * 512 + 16 * lane);
#pragma unroll 1
    for (int64_t s0 = 0; s0 < total; s0 += V) {
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const int64_t s = s0 + u;
        acc ^= q[u].x ^ q[u].y ^ q[u].z ^ q[u].w;
        if (s + V < total) q[u] = ld(base + (s + V) * 512 + 16 * lane);
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int MODE, int U, bool HINT>
float run(const uint8_t* w, int64_t row_bytes, int64_t rows, unsigned* sink, void* flush, size_t flush_bytes, int smem_bytes) {
  const int64_t groups = rows / 16;
  const unsigned grid = unsigned((groups + 3) / 4);
  cudaFuncSetAttribute(probe<MODE, U, HINT>, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> ts;
  for (int it = 0; it < 13; ++it) {
    cudaMemsetAsync(flush, it, flush_bytes);
    cudaEventRecord(a);
    probe<MODE, U, HINT><<<grid, 128, smem_bytes>>>(w, row_bytes, groups, sink);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    if (it >= 3) ts.push_back(ms * 1000);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main() {
  const size_t flush_bytes = size_t(256) << 20;
  void* flush; cudaMalloc(&flush, flush_bytes);
  unsigned* sink; cudaMalloc(&sink, 4);
  struct Shape { const char* name; int64_t rows, row_bytes; };
  // DeepSeek 1-token gate/up: 8 experts x 4096 rows x 7168 B; a whole-GPU 1 GB read; o_proj fp8 7168 x 16384
  const Shape shapes[] = {{"ds_gateup_8x4096x7168", 8 * 4096, 7168}, {"ds_down_8x7168x2048", 8 * 7168, 2048},
                          {"o_proj_7168x16384", 7168, 16384}, {"big_131072x7168", 131072, 7168}};
  for (const Shape& s : shapes) {
    uint8_t* w; cudaMalloc(&w, size_t(s.rows) * s.row_bytes);
    cudaMemset(w, 1, size_t(s.rows) * s.row_bytes);
    const double bytes = double(s.rows) * s.row_bytes;
    auto report = [&](const char* mode, float us) {
      printf("%-24s %-28s %9.1f us %6.2f TB/s %5.1f%%\n", s.name, mode, us, bytes / us / 1e6, bytes / us / 1e6 / 4.3 * 100);
    };
    report("rows8x64 U4 L2::256B 16w", run<0, 4, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 50 * 1024));
    report("rows8x64 U4 L2::256B max", run<0, 4, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 0));
    report("rows8x64 U4 plain 16w", run<0, 4, false>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 50 * 1024));
    report("rows8x64 U4 plain max", run<0, 4, false>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 0));
    report("rows8x64 U8 L2::256B 16w", run<0, 8, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 50 * 1024));
    report("rows8x64 U8 L2::256B max", run<0, 8, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 0));
    report("rows4x128 U4 L2::256B 16w", run<1, 4, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 50 * 1024));
    report("rows4x128 U4 L2::256B max", run<1, 4, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 0));
    report("rows4x128 U8 L2::256B 16w", run<1, 8, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 50 * 1024));
    report("rows4x128 U8 L2::256B max", run<1, 8, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 0));
    report("contig512 U4 L2::256B 16w", run<2, 4, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 50 * 1024));
    report("contig512 U4 L2::256B max", run<2, 4, true>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 0));
    report("contig512 U8 plain 16w", run<2, 8, false>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 50 * 1024));
    report("contig512 U8 plain max", run<2, 8, false>(w, s.row_bytes, s.rows, sink, flush, flush_bytes, 0));
    cudaFree(w);
  }
  cudaError_t e = cudaGetLastError();
  printf("status: %s\n", cudaGetErrorString(e));
  return 0;
}
