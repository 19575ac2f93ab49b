// LoRA on the routed experts inside the expert kernels (moe.h's ExpertLora says what is computed): the
// shrink kernel u = A · activation row per adapted pair, and LoraTerms, which an epilogue asks for B[col] · u.
// Rows are the expert kernels' sorted rows (a pair's position after the sort by expert, pos_of_pair).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/moe/moe.h"

namespace sparrow::cuda::expert_lora {

using bf16 = __nv_bfloat16;

enum Projection { Gate = 0, Up = 1, Down = 2 };

// The workspace: u [pairs, 3, max_rank] fp32 by sorted row, then row_entry [pairs] int32 (adapter * experts +
// expert, -1 for a row no adapter touches).
inline size_t u_bytes(int64_t pairs, int64_t max_rank) {
  return (size_t(pairs) * 3 * size_t(max_rank) * sizeof(float) + 255) / 256 * 256;
}

// What an epilogue reads: a zero-initialised LoraTerms (entries null) adds nothing.
struct LoraTerms {
  const ExpertLoraEntry* entries = nullptr;
  const int32_t* row_entry = nullptr;
  const float* u = nullptr;
  int64_t slots = 0;  // adapters * experts: the stride between the projections' tables
  int max_rank = 0;

  // One sorted row's factors for one projection: B's rows and u; b null where nothing is adapted.
  struct Row {
    const bf16* b = nullptr;
    const float* v = nullptr;
    int rank = 0;
    bool vectors = false;  // rank a multiple of 8 and both rows on 16 bytes: 16-byte loads
  };
  __device__ __forceinline__ Row row_of(int64_t row, int proj) const {
    Row r;
    if (entries == nullptr) return r;
    const int32_t at = row_entry[row];
    if (at < 0) return r;
    const ExpertLoraEntry& e = entries[proj * slots + at];
    r.b = static_cast<const bf16*>(e.b);
    r.v = u + (row * 3 + proj) * int64_t(max_rank);
    r.rank = e.rank;
    r.vectors = e.rank % 8 == 0 && max_rank % 4 == 0 && reinterpret_cast<uintptr_t>(e.b) % 16 == 0;
    return r;
  }
  // B[col] · u of that row, fp32 in rank order; 0 where nothing is adapted. With `vectors`, B and u come in
  // 16-byte pieces (one load for 8 of B, two for 8 of u); the fma order is the same either way.
  __device__ __forceinline__ static float dot(const Row& r, int64_t col) {
    if (r.b == nullptr) return 0.0f;
    const bf16* b = r.b + col * r.rank;
    float sum = 0.0f;
    if (r.vectors) {
#pragma unroll 4
      for (int k = 0; k < r.rank; k += 8) {
        const uint4 bv = *reinterpret_cast<const uint4*>(b + k);
        const float4 u0 = *reinterpret_cast<const float4*>(r.v + k), u1 = *reinterpret_cast<const float4*>(r.v + k + 4);
        const bf16* bb = reinterpret_cast<const bf16*>(&bv);
        const float uu[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) sum = fmaf(__bfloat162float(bb[i]), uu[i], sum);
      }
      return sum;
    }
    for (int k = 0; k < r.rank; ++k) sum = fmaf(__bfloat162float(b[k]), r.v[k], sum);
    return sum;
  }
  // B[col] · u of sorted row `row` for projection `proj`.
  __device__ __forceinline__ float term(int64_t row, int64_t col, int proj) const { return dot(row_of(row, proj), col); }
};

inline LoraTerms terms_of(const ExpertLora& lora, int64_t pairs, int64_t num_experts) {
  LoraTerms t;
  t.entries = lora.entries;
  t.u = static_cast<const float*>(lora.workspace);
  const char* workspace = static_cast<const char*>(lora.workspace);
  t.row_entry = reinterpret_cast<const int32_t*>(workspace + u_bytes(pairs, lora.max_rank));
  t.slots = int64_t(lora.adapters) * num_experts;
  t.max_rank = lora.max_rank;
  return t;
}

constexpr int SHRINK_THREADS = 256;
constexpr int SHRINK_ROWS = 8;  // rank indices a block sums at once (8 independent 16-byte loads a thread)

// For each pair p routed to a local expert: its row's entry (first_proj == Gate only) and u[row][proj] = A ·
// act for proj in [first_proj, last_proj], act = x[token] (act_by_row false) or act[row] (the sorted h rows).
// A block takes one item (pair, projection, group of SHRINK_ROWS rank indices), grid-stride, so a one-token
// step spreads its few pairs over many SMs. Thread t sums the 8-element pieces t, t + 256, ... of its rows in
// order, with every load of a round issued before the products (the loop is latency-bound otherwise); then
// each warp's butterfly and the warps' partial sums in warp order: the same order for every row.
__global__ void __launch_bounds__(SHRINK_THREADS)
    shrink_kernel(ExpertLora lora, LoraTerms terms, const int32_t* experts, const int32_t* pos_of_pair,
                  int64_t pairs, int top_k, int num_experts, const bf16* act, int64_t K, bool act_by_row,
                  int first_proj, int last_proj, int rank_groups) {
  __shared__ float partial[SHRINK_THREADS / 32][SHRINK_ROWS];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* u = const_cast<float*>(terms.u);
  int32_t* row_entry = const_cast<int32_t*>(terms.row_entry);
  const int projections = last_proj - first_proj + 1;
  const int64_t items = pairs * projections * rank_groups;
  const int64_t pieces = K / 8;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t p = item / (int64_t(projections) * rank_groups);
    const int proj = first_proj + int(item / rank_groups % projections);
    const int k0 = int(item % rank_groups) * SHRINK_ROWS;
    const int32_t row = pos_of_pair[p];
    if (row < 0) continue;  // another rank's expert
    const int64_t token = p / top_k;
    const int32_t adapter = lora.token_adapter[token];
    const int32_t at = adapter < 0 ? -1 : adapter * num_experts + experts[p];
    if (first_proj == Gate && proj == Gate && k0 == 0 && threadIdx.x == 0) row_entry[row] = at;
    if (at < 0) continue;
    const ExpertLoraEntry e = lora.entries[proj * terms.slots + at];
    if (e.a == nullptr || k0 >= e.rank) continue;
    const int rows = min(SHRINK_ROWS, e.rank - k0);
    const bf16* a_row = act + (act_by_row ? int64_t(row) : token) * K;
    const bf16* w = static_cast<const bf16*>(e.a) + int64_t(k0) * K;
    float sum[SHRINK_ROWS];
#pragma unroll
    for (int j = 0; j < SHRINK_ROWS; ++j) sum[j] = 0.0f;
    for (int64_t c = threadIdx.x; c < pieces; c += SHRINK_THREADS) {
      const uint4 xv = *reinterpret_cast<const uint4*>(a_row + c * 8);
      uint4 wv[SHRINK_ROWS];
#pragma unroll
      for (int j = 0; j < SHRINK_ROWS; ++j)
        wv[j] = j < rows ? *reinterpret_cast<const uint4*>(w + j * K + c * 8) : make_uint4(0, 0, 0, 0);
      const bf16* xb = reinterpret_cast<const bf16*>(&xv);
#pragma unroll
      for (int j = 0; j < SHRINK_ROWS; ++j) {
        const bf16* wb = reinterpret_cast<const bf16*>(&wv[j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[j] = fmaf(__bfloat162float(wb[i]), __bfloat162float(xb[i]), sum[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < SHRINK_ROWS; ++j) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], offset);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < SHRINK_ROWS; ++j) partial[warp][j] = sum[j];
    }
    __syncthreads();
    if (threadIdx.x < rows) {
      float total = 0.0f;
      for (int w8 = 0; w8 < SHRINK_THREADS / 32; ++w8) total += partial[w8][threadIdx.x];
      u[(int64_t(row) * 3 + proj) * terms.max_rank + k0 + threadIdx.x] = total;
    }
    __syncthreads();  // partial is reused by the next item
  }
}

// Launches shrink_kernel over the step's pairs.
inline void shrink(const ExpertLora& lora, const LoraTerms& terms, const int32_t* experts, const int32_t* pos_of_pair,
                   int64_t pairs, int top_k, int num_experts, const bf16* act, int64_t K, bool act_by_row,
                   int first_proj, int last_proj, cudaStream_t stream) {
  const int rank_groups = (lora.max_rank + SHRINK_ROWS - 1) / SHRINK_ROWS;
  const int64_t items = pairs * (last_proj - first_proj + 1) * rank_groups;
  const unsigned blocks = unsigned(items < 65536 ? items : 65536);
  if (blocks == 0) return;
  shrink_kernel<<<blocks, SHRINK_THREADS, 0, stream>>>(lora, terms, experts, pos_of_pair, pairs, top_k, num_experts,
                                                       act, K, act_by_row, first_proj, last_proj, rank_groups);
}

}  // namespace sparrow::cuda::expert_lora
