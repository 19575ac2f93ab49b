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

  // B[col] · u of sorted row `row` for projection `proj`, fp32 in rank order; 0 where nothing is adapted.
  __device__ __forceinline__ float term(int64_t row, int64_t col, int proj) const {
    if (entries == nullptr) return 0.0f;
    const int32_t at = row_entry[row];
    if (at < 0) return 0.0f;
    const ExpertLoraEntry& e = entries[proj * slots + at];
    if (e.b == nullptr) return 0.0f;
    const bf16* b = static_cast<const bf16*>(e.b) + col * e.rank;
    const float* v = u + (row * 3 + proj) * int64_t(max_rank);
    float sum = 0.0f;
    for (int k = 0; k < e.rank; ++k) sum = fmaf(__bfloat162float(b[k]), v[k], sum);
    return sum;
  }
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

constexpr int SHRINK_THREADS = 128;

// For each pair p routed to a local expert: its row's entry (first_proj == Gate only) and u[row][proj] = A ·
// act for proj in [first_proj, last_proj], act = x[token] (act_by_row false) or act[row] (the sorted h rows).
// One block a pair (grid-stride), one warp a rank index; each lane sums K / 8 / 32 pieces of 8 in order,
// then the warp's butterfly: the same order for every row.
__global__ void __launch_bounds__(SHRINK_THREADS)
    shrink_kernel(ExpertLora lora, LoraTerms terms, const int32_t* experts, const int32_t* pos_of_pair,
                  int64_t pairs, int top_k, int num_experts, const bf16* act, int64_t K, bool act_by_row,
                  int first_proj, int last_proj) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* u = const_cast<float*>(terms.u);
  int32_t* row_entry = const_cast<int32_t*>(terms.row_entry);
  for (int64_t p = blockIdx.x; p < pairs; p += gridDim.x) {
    const int32_t row = pos_of_pair[p];
    if (row < 0) continue;  // another rank's expert
    const int64_t token = p / top_k;
    const int32_t adapter = lora.token_adapter[token];
    const int32_t at = adapter < 0 ? -1 : adapter * num_experts + experts[p];
    if (first_proj == Gate && threadIdx.x == 0) row_entry[row] = at;
    if (at < 0) continue;
    const bf16* a_row = act + (act_by_row ? int64_t(row) : token) * K;
    for (int proj = first_proj; proj <= last_proj; ++proj) {
      const ExpertLoraEntry& e = lora.entries[proj * terms.slots + at];
      if (e.a == nullptr) continue;
      for (int k = warp; k < e.rank; k += SHRINK_THREADS / 32) {
        const bf16* w = static_cast<const bf16*>(e.a) + int64_t(k) * K;
        float sum = 0.0f;
        for (int64_t c = int64_t(lane) * 8; c < K; c += 32 * 8) {
          const uint4 wv = *reinterpret_cast<const uint4*>(w + c), xv = *reinterpret_cast<const uint4*>(a_row + c);
          const bf16* wb = reinterpret_cast<const bf16*>(&wv);
          const bf16* xb = reinterpret_cast<const bf16*>(&xv);
#pragma unroll
          for (int i = 0; i < 8; ++i) sum = fmaf(__bfloat162float(wb[i]), __bfloat162float(xb[i]), sum);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        if (lane == 0) u[(int64_t(row) * 3 + proj) * terms.max_rank + k] = sum;
      }
    }
  }
}

// Launches shrink_kernel over the step's pairs.
inline void shrink(const ExpertLora& lora, const LoraTerms& terms, const int32_t* experts, const int32_t* pos_of_pair,
                   int64_t pairs, int top_k, int num_experts, const bf16* act, int64_t K, bool act_by_row,
                   int first_proj, int last_proj, cudaStream_t stream) {
  const unsigned blocks = unsigned(pairs < 65536 ? pairs : 65536);
  if (blocks == 0) return;
  shrink_kernel<<<blocks, SHRINK_THREADS, 0, stream>>>(lora, terms, experts, pos_of_pair, pairs, top_k, num_experts,
                                                       act, K, act_by_row, first_proj, last_proj);
}

}  // namespace sparrow::cuda::expert_lora
