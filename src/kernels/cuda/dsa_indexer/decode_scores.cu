// Index scores for decode-sized batches on Hopper's FP8 tensor cores (wgmma, PTX ISA "Asynchronous
// warpgroup level matrix multiply-accumulate"): the same scores as index_scores.cu's tiled kernel,
//   score[t, s] = kscale[s] * sum_h w[t, h] * relu(q8[t, h] · k8[s]),
// computed as one m64 x n(heads) x k128 product per tile of 64 keys:
//   A = 64 keys x 128 e4m3 (K-major, from the paged cache), B = heads x 128 e4m3 (the row's query, K-major),
//   D[key, head] in fp32 registers; each thread then owns two keys' partial head sums.
// Hopper has no FP8 mma.sync (the tiled kernel's e4m3 mma.sync is emulated through f16), so only wgmma
// reads FP8 at full rate.
//
// One CTA (one warpgroup of 128 threads) scores one query row over a range of its keys. Tiles are copied
// into shared memory with cp.async in the 128-byte swizzled layout wgmma reads (16-byte chunk c of row r
// at r * 128 + ((c ^ (r % 8)) * 16), 1024-byte aligned), STAGES tiles in flight, so the kernel is bound by
// the 132 bytes per key it reads from HBM.
#include "kernels/cuda/dsa_indexer/decode_scores.cuh"

#include <algorithm>

#include "kernels/cuda/runtime/cuda_check.h"

namespace sparrow::cuda {

namespace {

constexpr int kDim = kDsaIndexDim;     // 128 e4m3 values = one 128-byte swizzle row
constexpr int kTileKeys = 64;          // wgmma M
constexpr int kThreads = 128;          // one warpgroup
constexpr int kStages = 4;
constexpr int kTileBytes = kTileKeys * kDim;  // 8 KB
constexpr int kQueryBytes = 64 * kDim;        // room for 64 heads

// Shared memory: [query 8 KB][STAGES x key tile 8 KB][STAGES x 64 key scales], plus 1 KB to align.
constexpr int kSmemBytes = kQueryBytes + kStages * kTileBytes + kStages * kTileKeys * 4 + 1024;

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, zero-filled when !valid (src-size 0 reads nothing).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void wait_pending() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format" for wgmma): K-major rows of 128
// bytes with the 128-byte swizzle; 8-row core groups 1024 bytes apart (stride byte offset); the leading
// byte offset is unused when a row is one swizzle atom wide.
__device__ __forceinline__ uint64_t descriptor(const void* p) {
  const uint32_t addr = smem_address(p);
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

template <int N>
struct Accumulator {
  float d[N / 2];
};

// D (+)= A · Bᵀ, m64 nN k32, e4m3 inputs, fp32 accumulation.
__device__ __forceinline__ void wgmma_k32(Accumulator<64>& acc, uint64_t a, uint64_t b, int accumulate) {
  float* d = acc.d;
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"
      "%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_k32(Accumulator<32>& acc, uint64_t a, uint64_t b, int accumulate) {
  float* d = acc.d;
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate));
}

struct DecodeParams {
  const uint8_t* q;  // [rows, heads, 128] e4m3
  const float* w;    // [rows, heads]
  const int32_t* row_seq;
  const int32_t* row_visible;
  const uint8_t* pool;
  const int64_t* page_table;
  int64_t stride;
  int block_size;
  float* scores;
  int64_t ld;
  int64_t max_visible;
  int64_t keys_per_cta;  // a multiple of kTileKeys
};

template <int HEADS>
__global__ void __launch_bounds__(kThreads) decode_scores_kernel(DecodeParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* query = smem;
  uint8_t* tiles = smem + kQueryBytes;
  float* scales = reinterpret_cast<float*>(tiles + kStages * kTileBytes);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t row = blockIdx.y;
  const int seq = p.row_seq[row];
  const int64_t visible = p.row_visible[row];
  const int64_t k_begin = int64_t(blockIdx.x) * p.keys_per_cta;
  const int64_t k_end = min(k_begin + p.keys_per_cta, p.max_visible);
  const int64_t k_scored = min(k_end, visible);  // keys at or past `visible` are -inf without reading them
  float* out = p.scores + row * p.ld;

  // Past the causal bound: -inf, nothing to read.
  for (int64_t s = max(k_begin, k_scored) + tid; s < k_end; s += kThreads) out[s] = -INFINITY;
  if (k_scored <= k_begin) return;
  const int tiles_total = int((k_scored - k_begin + kTileKeys - 1) / kTileKeys);
  const int64_t* pages = p.page_table + int64_t(seq) * p.stride;

  // This thread's head weights: D's columns 8j + 2(lane % 4) + {0, 1}.
  constexpr int J = HEADS / 8;
  float w0[J], w1[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    w0[j] = p.w[row * HEADS + 8 * j + 2 * (lane % 4)];
    w1[j] = p.w[row * HEADS + 8 * j + 2 * (lane % 4) + 1];
  }

  // The query, swizzled: HEADS rows x 8 chunks.
  const uint8_t* q = p.q + row * HEADS * kDim;
  for (int c = tid; c < HEADS * 8; c += kThreads) {
    const int h = c / 8, chunk = c % 8;
    copy16(query + h * kDim + ((chunk ^ (h % 8)) * 16), q + h * kDim + chunk * 16, true);
  }

  // Tile `t` into stage t % kStages: chunk i of the 512 (key i / 8, 16-byte chunk i % 8), and the scales.
  auto load_tile = [&](int t) {
    if (t < tiles_total) {
      uint8_t* dst = tiles + (t % kStages) * kTileBytes;
      const int64_t first = k_begin + int64_t(t) * kTileKeys;
#pragma unroll
      for (int i = 0; i < kTileKeys * 8 / kThreads; ++i) {
        const int c = tid + i * kThreads, r = c / 8, chunk = c % 8;
        const int64_t key = first + r;
        const bool valid = key < k_scored;
        const int64_t k = valid ? key : 0;
        const int64_t page = k / p.block_size, slot = k - page * p.block_size;
        const uint8_t* src = p.pool + pages[page] + slot * kDim + chunk * 16;
        copy16(dst + r * kDim + ((chunk ^ (r % 8)) * 16), src, valid);
      }
      if (tid < kTileKeys) {
        const int64_t key = first + tid;
        const bool valid = key < k_scored;
        const int64_t k = valid ? key : 0;
        const int64_t page = k / p.block_size, slot = k - page * p.block_size;
        copy4(scales + (t % kStages) * kTileKeys + tid,
              p.pool + pages[page] + int64_t(p.block_size) * kDim + slot * 4, valid);
      }
    }
    commit();  // an empty group past the end keeps the group count uniform
  };

#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) load_tile(t);

  const int g = lane / 4;
#pragma unroll 1
  for (int t = 0; t < tiles_total; ++t) {
    load_tile(t + kStages - 1);
    wait_pending<kStages - 1>();  // tile t (and the query) have landed for this thread's copies
    // cp.async writes are generic-proxy writes; wgmma reads through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();

    const uint8_t* keys = tiles + (t % kStages) * kTileBytes;
    Accumulator<HEADS> acc;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < kDim / 32; ++kk)
      wgmma_k32(acc, descriptor(keys + kk * 32), descriptor(query + kk * 32), kk > 0);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

    // D layout (m64nNk32, fp32): acc.d[4j + 0/1] = key 16 * warp + g, heads 8j + 2(lane % 4) + 0/1;
    // acc.d[4j + 2/3] = key 16 * warp + g + 8, the same heads.
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      s0 += w0[j] * fmaxf(acc.d[4 * j], 0.0f) + w1[j] * fmaxf(acc.d[4 * j + 1], 0.0f);
      s1 += w0[j] * fmaxf(acc.d[4 * j + 2], 0.0f) + w1[j] * fmaxf(acc.d[4 * j + 3], 0.0f);
    }
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if (lane % 4 < 2) {
      const int local = 16 * warp + g + 8 * (lane % 4);
      const int64_t key = k_begin + int64_t(t) * kTileKeys + local;
      if (key < k_scored) out[key] = (lane % 4 == 0 ? s0 : s1) * scales[(t % kStages) * kTileKeys + local];
    }
    __syncthreads();  // the stage is refilled by the next iteration's load
  }
  wait_pending<0>();
}

}  // namespace

bool dsa_decode_scores_supported(int heads) { return heads == 32 || heads == 64; }

void dsa_decode_scores(const uint8_t* q_fp8, const float* w_folded, int64_t rows, int heads, const int32_t* row_seq,
                       const int32_t* row_visible, const uint8_t* pool, const int64_t* page_table,
                       int64_t page_table_stride, int block_size, float* scores, int64_t ld, int64_t max_visible,
                       int sms, cudaStream_t stream) {
  SPARROW_CHECK(dsa_decode_scores_supported(heads), "dsa_decode_scores: heads must be 32 or 64, got ", heads);
  SPARROW_CHECK(rows < 65536, "dsa_decode_scores: too many rows (", rows, ")");
  if (rows <= 0 || max_visible <= 0) return;
  // One wave: as many CTAs as fit on the chip at once (a second, partly filled wave would leave SMs
  // idle at the end: 2 waves of 1024 CTAs over 660 slots run at ~78%), the keys of each row split
  // evenly over its CTAs, each reading at least 8 tiles (64 KB of keys) so that its query load and
  // pipeline fill are amortised.
  auto kernel = heads == 64 ? decode_scores_kernel<64> : decode_scores_kernel<32>;
  static int resident[2] = {0, 0};  // CTAs per SM, per instantiation
  int& per_sm = resident[heads == 64 ? 1 : 0];
  if (per_sm == 0) {
    SPARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    SPARROW_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmemBytes));
    per_sm = std::max(per_sm, 1);
  }
  const int64_t slots = int64_t(sms) * per_sm;
  const int64_t splits_wanted = std::max<int64_t>(1, slots / rows);
  int64_t per = (max_visible + splits_wanted - 1) / splits_wanted;
  per = std::max<int64_t>(per, 8 * kTileKeys);
  per = (per + kTileKeys - 1) / kTileKeys * kTileKeys;
  const int64_t splits = (max_visible + per - 1) / per;
  DecodeParams params{q_fp8, w_folded, row_seq, row_visible, pool, page_table, page_table_stride, block_size,
                      scores, ld, max_visible, per};
  const dim3 grid{unsigned(splits), unsigned(rows), 1u};
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
  SPARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace sparrow::cuda
