// LoRA on the routed experts (model/lora.h builds these; ops::moe_experts applies them): the rows
// [begin, end) of one adapter's sequences and, per expert of the layer's stack (its local numbering), the
// adapter's low-rank pairs. Gate's and up's terms join the expert's gate and up rows before the GLU, down's
// its output, per routed slot: the two points where vLLM's fused_moe_lora adds them.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace sparrow {

struct ExpertLowRank {
  const Tensor* a = nullptr;  // [r, in]
  const Tensor* b = nullptr;  // [out, r], times the adapter's scaling; both null: not adapted
};

struct ExpertAdapterRun {
  int64_t begin = 0, end = 0;
  std::vector<ExpertLowRank> gate, up, down;  // by local expert
};

}  // namespace sparrow
