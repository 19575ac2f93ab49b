#include "kernels/cpu/stored_weights.h"

#include <cstring>

#include "core/bfloat16.h"
#include "core/error.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"

namespace sparrow::cpu {

int64_t stored_cols(const Tensor& w) {
  return w.type() == ScalarType::E2M1x2 ? 2 * w.dim(-1) : w.dim(-1);
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows [first, first + rows) of an e4m3 matrix [.., cols] with its own [ceil(rows/128), ceil(cols/128)]
// block scales `scales`, into out.
void widen_fp8_block(const uint8_t* codes, const float* scales, int64_t rows, int64_t cols, float* out) {
  const int64_t col_blocks = ceil_div(cols, 128);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = e4m3_to_float(codes[r * cols + c]) * scales[(r / 128) * col_blocks + c / 128];
}

}  // namespace

const float* widened_matrix(const Tensor& w, int64_t index, std::vector<float>& scratch) {
  SPARROW_CHECK(w.on_cpu() && (w.ndim() == 2 || w.ndim() == 3), "widened_matrix: a host matrix or expert stack, got ",
                shape_str(w.shape()));
  const bool stacked = w.ndim() == 3;
  const int64_t count = stacked ? w.dim(0) : 1;
  SPARROW_CHECK(index >= 0 && index < count, "widened_matrix: matrix ", index, " of ", count);
  const int64_t rows = w.dim(-2), cols = stored_cols(w), n = rows * cols;
  if (w.type() == ScalarType::F32) return w.data() + index * n;
  scratch.resize(size_t(n));
  float* out = scratch.data();
  if (w.type() == ScalarType::BF16) {
    const uint16_t* bits = w.as<uint16_t>() + index * n;
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(bits[i]);
    return out;
  }
  const Tensor& scales = w.block_scales();
  SPARROW_CHECK(scales.defined(), "widened_matrix: a ", scalar_name(w.type()), " weight without its scales");
  const bool e8m0 = scales.type() == ScalarType::F8E8M0;
  if (w.type() == ScalarType::F8E4M3 && !e8m0) {  // DeepSeek's FP8: 128x128 fp32 block scales
    const uint8_t* codes = w.as<uint8_t>() + index * n;
    const float* s = scales.data();
    if (scales.ndim() == 4) {  // stacked gate_up: each half [rows / 2, cols] with its own grid
      const int64_t half = rows / 2, grid = scales.dim(2) * scales.dim(3);
      widen_fp8_block(codes, s + (index * 2) * grid, half, cols, out);
      widen_fp8_block(codes + half * cols, s + (index * 2 + 1) * grid, half, cols, out + half * cols);
    } else {
      widen_fp8_block(codes, s + index * ceil_div(rows, 128) * ceil_div(cols, 128), rows, cols, out);
    }
    return out;
  }
  // Group-scaled: every row has its own [cols / group] scales.
  const int64_t group = e8m0 ? kMxfp4Block : kNvfp4Block, groups = cols / group;
  const uint8_t* row_scales = scales.as<uint8_t>() + index * rows * groups;
  if (w.type() == ScalarType::F8E4M3) {  // MXFP8
    const uint8_t* codes = w.as<uint8_t>() + index * n;
    for (int64_t i = 0; i < n; ++i) out[i] = e4m3_to_float(codes[i]) * e8m0_to_float(row_scales[i / group]);
    return out;
  }
  const uint8_t* packed = w.as<uint8_t>() + index * (n / 2);
  if (e8m0) {  // MXFP4
    for (int64_t r = 0; r < rows; ++r)
      mxfp4_dequantize(packed + r * (cols / 2), row_scales + r * groups, cols, out + r * cols);
    return out;
  }
  // NVFP4, in the order formats/quantization.cpp's dequantize_nvfp4 multiplies: e2m1 * (e4m3 * global).
  const Tensor& global = w.global_scales();
  SPARROW_CHECK(global.defined(), "widened_matrix: an NVFP4 weight without its global scale");
  const int64_t globals_per_matrix = global.numel() / count;  // 2: a stacked gate_up's halves
  for (int64_t r = 0; r < rows; ++r) {
    const float g = global.data()[index * globals_per_matrix + (globals_per_matrix == 2 ? r / (rows / 2) : 0)];
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = e2m1_to_float(fp4_code(packed + r * (cols / 2), c)) *
                          (e4m3_to_float(row_scales[r * groups + c / group]) * g);
  }
  return out;
}

}  // namespace sparrow::cpu
