// Weight matrices as a checkpoint stores them, for the fp32 reference ops. On the CPU the checkpoint keeps
// the weights ops::linear and the experts read in their stored form (formats/checkpoint.h): bf16 views of
// the mapped file, FP8 codes with DeepSeek's 128x128 block scales, or MX / NV codes with their group scales
// (core/tensor.h), so a model needs its checkpoint's size in memory rather than 2-4x it in fp32. Each
// product widens the one matrix it reads, exactly, into a scratch buffer and runs as before: the values are
// those formats/quantization.h's load-time dequantization gives (fp32 weights are read in place), so the
// CPU reference's results do not depend on where the widening happens.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace sparrow::cpu {

// Columns of a weight [..., rows, cols] (FP4 codes: two a byte).
int64_t stored_cols(const Tensor& w);

// Matrix `index` of `w` as fp32 rows (row-major [rows, cols]): a 2-D weight is index 0; stacked experts
// [E, rows, cols] are indexed by expert, their scales laid out as Checkpoint::take_experts says (FP8
// gate_up: [E, 2, ceil(I/128), ceil(H/128)], one grid per half; NVFP4 global scales [E, 2] or [E]).
// F32 weights are returned in place; every other form is widened into `scratch` (resized as needed).
// Widened values: bf16 exactly; FP8 e4m3 * block scale (one fp32 product); MXFP8 e4m3 * 2^(e8m0 - 127);
// MXFP4 e2m1 * 2^(e8m0 - 127); NVFP4 e2m1 * (e4m3 scale * global).
const float* widened_matrix(const Tensor& w, int64_t index, std::vector<float>& scratch);

}  // namespace sparrow::cpu
