#include "kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/batch_invariance.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/bfloat16.h"
#include "kernels/cpu/moe_reference.h"
#include "kernels/cpu/reference_ops.h"
#include "kernels/cpu/reference_sampling.h"
#include "kernels/cpu/stored_weights.h"
#include "kernels/uniform_routing.h"
#include "core/device/device.h"

#if SPARROW_HAVE_CUDA
#include "kernels/cuda/elementwise/elementwise.h"
#include "kernels/cuda/gemm/dequantize.h"
#include "kernels/cuda/gemm/gemm.h"
#include "kernels/cuda/gemm/gemm_fp8.h"
#include "kernels/cuda/gemm/gemm_skinny.h"
#include "core/device/stream.h"
#include "kernels/cuda/moe/moe.h"
#include "kernels/cuda/sampling/sampling.h"
#endif

namespace sparrow::ops {

namespace {

[[noreturn, maybe_unused]] void no_cuda() { fail("a CUDA tensor reached an op in a build without the CUDA backend"); }

void same_device(const Tensor& a, const Tensor& b, const char* op) {
  SPARROW_CHECK(a.device() == b.device(), op, ": operands on different devices (", device_name(a.device()), ", ",
                device_name(b.device()), ")");
}

void require_f32(const Tensor& x, const char* op) {
  SPARROW_CHECK(x.type() == ScalarType::F32, op, ": the CPU path computes in float32, got ", scalar_name(x.type()));
}

#if SPARROW_HAVE_CUDA
cuda::ElemType elem(const Tensor& x) {
  SPARROW_CHECK(x.type() == ScalarType::F32 || x.type() == ScalarType::BF16, "GPU op on a ", scalar_name(x.type()),
                " tensor");
  return x.type() == ScalarType::F32 ? cuda::ElemType::F32 : cuda::ElemType::BF16;
}
#endif

// How a weight is stored (the kernels' WeightCodes, kernels/cuda/gemm/gemm.h), from its type and its
// scales' type (core/tensor.h): e4m3 codes carry fp32 128x128 block scales (FP8) or E8M0 group scales
// (MXFP8); E2M1 codes E4M3 group scales and a global scale (NVFP4) or E8M0 group scales (MXFP4).
enum class Stored { Plain, Fp8, Nvfp4, Mxfp4, Mxfp8 };
Stored stored_as(const Tensor& w) {
  if (!w.block_scales().defined()) return Stored::Plain;
  const bool e8m0 = w.block_scales().type() == ScalarType::F8E8M0;
  if (w.type() == ScalarType::E2M1x2) return e8m0 ? Stored::Mxfp4 : Stored::Nvfp4;
  if (w.type() == ScalarType::F8E4M3) return e8m0 ? Stored::Mxfp8 : Stored::Fp8;
  return Stored::Plain;
}
[[maybe_unused]] bool group_scaled(Stored s) { return s == Stored::Nvfp4 || s == Stored::Mxfp4 || s == Stored::Mxfp8; }
// Columns of a weight matrix [rows, cols] (FP4: two codes a byte).
int64_t weight_cols(const Tensor& w) {
  return w.type() == ScalarType::E2M1x2 ? 2 * w.dim(w.ndim() - 1) : w.dim(w.ndim() - 1);
}
#if SPARROW_HAVE_CUDA
cuda::WeightCodes codes_of(Stored s) {
  switch (s) {
    case Stored::Fp8: return cuda::WeightCodes::Fp8;
    case Stored::Nvfp4: return cuda::WeightCodes::Nvfp4;
    case Stored::Mxfp4: return cuda::WeightCodes::Mxfp4;
    case Stored::Mxfp8: return cuda::WeightCodes::Mxfp8;
    case Stored::Plain: break;
  }
  return cuda::WeightCodes::Bf16;
}
#endif

}  // namespace

ScalarType act_type(Device device) { return device == Device::Cpu ? ScalarType::F32 : ScalarType::BF16; }

Tensor linear(const Tensor& x, const Tensor& w) { return linear(x, w, x.type()); }

Tensor linear(const Tensor& x, const Tensor& w, ScalarType out_type) {
  same_device(x, w, "linear");
  const int64_t in = weight_cols(w);
  [[maybe_unused]] const int64_t out = w.dim(0);
  SPARROW_CHECK(x.numel() % in == 0, "linear: input ", shape_str(x.shape()), " does not match weight ",
                shape_str(w.shape()));
  if (x.on_cpu()) {
    require_f32(x, "linear");
    return cpu::linear(x, w);
  }
#if SPARROW_HAVE_CUDA
  const int64_t rows = x.numel() / in;
  Tensor y = Tensor::empty({rows, out}, out_type, x.device());
  if (rows == 0) return y;
  const Stored stored = stored_as(w);
  const cuda::WeightCodes codes = codes_of(stored);
  SPARROW_CHECK(stored == Stored::Plain || (x.type() == ScalarType::BF16 && w.block_scales().defined()),
                "linear: a quantized weight needs bf16 activations and its scales");
  const void* scales = stored == Stored::Plain ? nullptr : w.block_scales().raw();
  const float* global = stored == Stored::Nvfp4 ? w.global_scales().as<float>() : nullptr;
  // Decode-sized products with FP8 or MX / NV weights (at most 8 rows: the n of the kernel's mma.m16n8k16)
  // stream the weights through the skinny kernel (gemm_skinny.h), reading the codes in place, without a
  // launch quantising the activations: up to 2x cuBLASLt's FP8 path there (bench/results/kernels.md,
  // "Skinny products"). bf16 weights stay on cuBLASLt, which reached 16-100% of HBM against the skinny
  // kernel's 12-79% in the same run. Not in batch-invariant mode (core/batch_invariance.h): its sums are
  // not the larger products' (gemm_fp8.h), so a row would round one way alone and another in a batch.
  if (stored != Stored::Plain && rows <= cuda::kSkinnyMaxRows && !batch_invariant() &&
      cuda::gemm_skinny_unsupported(rows, out, in, codes, x.raw(), in, w.raw(), scales, global, y.raw(), elem(y),
                                    out) == nullptr) {
    const size_t ws_bytes = cuda::gemm_skinny_workspace_bytes(rows, out, in, codes);
    Tensor ws = ws_bytes > 0 ? Tensor::empty({int64_t(ws_bytes)}, ScalarType::U8, x.device()) : Tensor();
    cuda::gemm_skinny(rows, out, in, codes, x.raw(), in, w.raw(), scales, global, y.raw(), elem(y), out,
                      ws_bytes > 0 ? ws.raw() : nullptr, ws_bytes, cuda::stream());
    return y;
  }
  if (stored == Stored::Fp8) {
    // An FP8 checkpoint's weight (Checkpoint::take_linear): the activations are quantised per 128
    // columns and the product runs on the FP8 tensor cores with both block scales.
    cuda::gemm_fp8_block_scaled(rows, out, in, x.raw(), in, w.as<uint8_t>(), static_cast<const float*>(scales),
                                y.raw(), elem(y), out, cuda::stream());
    return y;
  }
  if (group_scaled(stored)) {
    // Above decode sizes an MX / NV weight is widened to a bf16 scratch and multiplied by cuBLASLt
    // (gemm/dequantize.h says why and what it costs).
    Tensor wide = Tensor::empty({out, in}, ScalarType::BF16, x.device());
    cuda::dequantize_grouped(codes, out, in, w.as<uint8_t>(), static_cast<const uint8_t*>(scales), global,
                             wide.raw(), cuda::stream());
    cuda::gemm_nt(rows, out, in, {x.raw(), elem(x), in, 0}, {wide.raw(), cuda::ElemType::BF16, in, 0},
                  {y.raw(), elem(y), out, 0}, 1.0f, 0.0f, 1, cuda::stream());
    return y;
  }
  cuda::gemm_nt(rows, out, in, {x.raw(), elem(x), in, 0}, {w.raw(), elem(w), in, 0}, {y.raw(), elem(y), out, 0},
                1.0f, 0.0f, 1, cuda::stream());
  return y;
#else
  no_cuda();
#endif
}

void add_bias_(Tensor& y, const Tensor& bias) {
  same_device(y, bias, "add_bias");
  const int64_t n = bias.numel();
  SPARROW_CHECK(n > 0 && y.numel() % n == 0, "add_bias: ", shape_str(y.shape()), " vs bias ", shape_str(bias.shape()));
  if (y.on_cpu()) {
    for (int64_t t = 0; t < y.numel() / n; ++t) {
      float* row = y.data() + t * n;
      for (int64_t i = 0; i < n; ++i) row[i] += bias.data()[i];
    }
    return;
  }
#if SPARROW_HAVE_CUDA
  cuda::add_bias(y.raw(), elem(y), y.numel() / n, n, bias.as<float>(), cuda::stream());
#else
  no_cuda();
#endif
}

Tensor rms_norm(const Tensor& x, const Tensor& w, float eps, bool unit_offset) {
  if (x.on_cpu()) return cpu::rms_norm(x, w, eps, unit_offset);
  same_device(x, w, "rms_norm");
  const int64_t width = x.dim(-1);
  SPARROW_CHECK(w.numel() == width, "rms_norm: weight of ", w.numel(), " for rows of ", width);
#if SPARROW_HAVE_CUDA
  Tensor y = Tensor::empty(x.shape(), x.type(), x.device());  // out of place: no copy of x first
  cuda::rms_norm_rows(x.raw(), elem(x), y.raw(), elem(y), x.numel() / width, width, w.as<float>(), eps, unit_offset,
                      cuda::stream());
  return y;
#else
  no_cuda();
#endif
}

Tensor add_rms_norm_(Tensor& x, const Tensor& delta, const Tensor& w, float eps, bool unit_offset) {
  if (x.on_cpu() || delta.type() != x.type()) {
    add_(x, delta);
    return rms_norm(x, w, eps, unit_offset);
  }
  same_device(x, delta, "add_rms_norm");
  same_device(x, w, "add_rms_norm");
  const int64_t width = x.dim(-1);
  SPARROW_CHECK(x.numel() == delta.numel(), "add_rms_norm: size mismatch ", shape_str(x.shape()), " vs ",
                shape_str(delta.shape()));
  SPARROW_CHECK(w.numel() == width, "add_rms_norm: weight of ", w.numel(), " for rows of ", width);
#if SPARROW_HAVE_CUDA
  Tensor y = Tensor::empty(x.shape(), x.type(), x.device());
  cuda::add_rms_norm_rows(x.raw(), delta.raw(), elem(x), y.raw(), elem(y), x.numel() / width, width, w.as<float>(),
                          eps, unit_offset, cuda::stream());
  return y;
#else
  no_cuda();
#endif
}

void rms_norm_(Tensor& x, const Tensor& w, float eps, bool unit_offset, int64_t first_col, int64_t groups) {
  same_device(x, w, "rms_norm");
  const int64_t width = w.numel(), row = x.dim(-1), rows = x.numel() / row;
  if (groups < 0) groups = (row - first_col) / width;
  SPARROW_CHECK(width > 0 && first_col >= 0 && first_col + groups * width <= row, "rms_norm: ", groups, " groups of ",
                width, " from column ", first_col, " do not fit rows of ", row);
  if (x.on_cpu()) {
    require_f32(x, "rms_norm");
    if (first_col == 0 && groups * width == row) return cpu::rms_norm_inplace(x, w, eps, unit_offset);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        float* p = x.data() + r * row + first_col + g * width;
        cpu::rms_normalize(p, width, eps);
        for (int64_t i = 0; i < width; ++i) p[i] *= unit_offset ? 1.0f + w.data()[i] : w.data()[i];
      }
    return;
  }
#if SPARROW_HAVE_CUDA
  cuda::rms_norm(x.raw(), elem(x), rows, row, first_col, groups, width, w.as<float>(), eps, unit_offset,
                 cuda::stream());
#else
  no_cuda();
#endif
}

Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps) {
  same_device(x, w, "layer_norm");
  if (x.on_cpu()) return cpu::layer_norm(x, w, b, eps);
#if SPARROW_HAVE_CUDA
  Tensor y = x.clone();
  cuda::layer_norm(y.raw(), elem(y), y.numel() / w.numel(), w.numel(), w.as<float>(), b.as<float>(), eps,
                   cuda::stream());
  return y;
#else
  no_cuda();
#endif
}

void add_(Tensor& y, const Tensor& x) {
  same_device(y, x, "add");
  SPARROW_CHECK(y.numel() == x.numel(), "add: size mismatch ", shape_str(y.shape()), " vs ", shape_str(x.shape()));
  if (y.on_cpu()) return cpu::add_inplace(y, x);
#if SPARROW_HAVE_CUDA
  cuda::add(x.raw(), elem(x), y.raw(), elem(y), y.numel(), cuda::stream());
#else
  no_cuda();
#endif
}

void scale_(Tensor& x, float s) {
  if (x.on_cpu()) {
    for (int64_t i = 0; i < x.numel(); ++i) x.data()[i] *= s;
    return;
  }
#if SPARROW_HAVE_CUDA
  cuda::scale(x.raw(), elem(x), x.numel(), s, cuda::stream());
#else
  no_cuda();
#endif
}

void mul_sigmoid_(Tensor& y, const Tensor& gate) {
  same_device(y, gate, "mul_sigmoid");
  SPARROW_CHECK(y.numel() == gate.numel(), "mul_sigmoid: size mismatch ", shape_str(y.shape()), " vs ",
                shape_str(gate.shape()));
  if (y.on_cpu()) {
    for (int64_t i = 0; i < y.numel(); ++i) y.data()[i] *= cpu::sigmoid(gate.data()[i]);
    return;
  }
#if SPARROW_HAVE_CUDA
  cuda::mul_sigmoid(y.raw(), elem(y), gate.raw(), elem(gate), y.numel(), cuda::stream());
#else
  no_cuda();
#endif
}

void gelu_(Tensor& x, bool tanh_form) {
  if (x.on_cpu()) {
    float* p = x.data();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] = cpu::gelu(p[i], tanh_form);
    return;
  }
#if SPARROW_HAVE_CUDA
  cuda::gelu(x.raw(), elem(x), x.numel(), tanh_form, cuda::stream());
#else
  no_cuda();
#endif
}

Tensor softmax_rows(const Tensor& x, float scale) {
  SPARROW_CHECK(x.type() == ScalarType::F32 && x.ndim() == 2, "softmax_rows: x must be fp32 [rows, cols], got ",
                shape_str(x.shape()));
  const int64_t rows = x.dim(0), cols = x.dim(1);
  Tensor y = Tensor::empty({rows, cols}, act_type(x.device()), x.device());
  if (x.on_cpu()) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* in = x.row(r);
      float* out = y.row(r);
      float top = -INFINITY, total = 0.0f;
      for (int64_t j = 0; j < cols; ++j) top = std::max(top, in[j] * scale);
      for (int64_t j = 0; j < cols; ++j) total += (out[j] = std::exp(in[j] * scale - top));
      for (int64_t j = 0; j < cols; ++j) out[j] /= total;
    }
    return y;
  }
#if SPARROW_HAVE_CUDA
  cuda::softmax_rows(x.as<float>(), rows, cols, scale, y.raw(), elem(y), cuda::stream());
  return y;
#else
  no_cuda();
#endif
}

void rotate_pairs_(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim, bool interleaved) {
  same_device(x, cos, "rotate_pairs");
  same_device(x, sin, "rotate_pairs");
  const int64_t rows = x.dim(0), R = cos.ndim() == 2 ? cos.dim(1) : 0;
  SPARROW_CHECK(x.ndim() == 2 && head_dim > 0 && x.dim(1) % head_dim == 0 && cos.type() == ScalarType::F32 &&
                    sin.type() == ScalarType::F32 && cos.shape() == sin.shape() && cos.ndim() == 2 &&
                    cos.dim(0) == rows && 2 * R <= head_dim,
                "rotate_pairs: x [rows, heads * ", head_dim, "] with fp32 cos and sin [rows, <= head_dim / 2], got ",
                shape_str(x.shape()), ", ", shape_str(cos.shape()), ", ", shape_str(sin.shape()));
  const int64_t heads = x.dim(1) / head_dim;
  if (x.on_cpu()) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        float* head = x.row(r) + h * head_dim;
        for (int64_t j = 0; j < R; ++j) {
          const int64_t i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + R;
          const float a = head[i0], b = head[i1], c = cos.row(r)[j], s = sin.row(r)[j];
          head[i0] = a * c - b * s;
          head[i1] = b * c + a * s;
        }
      }
    return;
  }
#if SPARROW_HAVE_CUDA
  cuda::rotate_pairs(x.raw(), elem(x), rows, heads, head_dim, cos.as<float>(), sin.as<float>(), R, interleaved,
                     cuda::stream());
#else
  no_cuda();
#endif
}

Tensor attn_res_mix(std::span<const Tensor> sources, const Tensor& norm, const Tensor& proj, float eps) {
  SPARROW_CHECK(!sources.empty(), "attn_res_mix: no sources");
  const Tensor& first = sources[0];
  const int64_t width = first.dim(-1), rows = first.numel() / width;
  for (const Tensor& s : sources) {
    same_device(s, first, "attn_res_mix");
    SPARROW_CHECK(s.shape() == first.shape() && s.type() == first.type(), "attn_res_mix: sources differ: ",
                  shape_str(s.shape()), " vs ", shape_str(first.shape()));
  }
  SPARROW_CHECK(norm.numel() == width && proj.numel() == width && norm.type() == ScalarType::F32 &&
                    proj.type() == ScalarType::F32,
                "attn_res_mix: norm and proj must be fp32 [", width, "]");
  Tensor out = Tensor::empty(first.shape(), first.type(), first.device());
  if (first.on_cpu()) {
    std::vector<const float*> rows_of;
    for (const Tensor& s : sources) rows_of.push_back(s.data());
    cpu::attn_res_mix(rows_of, norm.data(), proj.data(), eps, out.data(), rows, width);
    return out;
  }
#if SPARROW_HAVE_CUDA
  cuda::AttnResSources from;
  SPARROW_CHECK(int64_t(sources.size()) <= cuda::kMaxAttnResSources, "attn_res_mix: ", sources.size(),
                " sources, the GPU kernel takes at most ", cuda::kMaxAttnResSources);
  for (const Tensor& s : sources) from.rows[from.count++] = s.raw();
  cuda::attn_res_mix(from, elem(first), rows, width, norm.data(), proj.data(), eps, out.raw(), cuda::stream());
  return out;
#else
  no_cuda();
#endif
}

Tensor embedding(const Tensor& table, const std::vector<int32_t>& ids) {
  const int64_t vocab = table.dim(0);
  [[maybe_unused]] const int64_t width = table.dim(1);
  for (int32_t id : ids)
    SPARROW_CHECK(id >= 0 && id < vocab, "token id ", id, " out of range [0, ", vocab, ")");
  if (table.on_cpu()) return cpu::embedding(table, ids);
#if SPARROW_HAVE_CUDA
  // (A copy from pageable memory returns once staged: `ids` need not outlive it.)
  Tensor dev_ids = Tensor::empty({int64_t(ids.size())}, ScalarType::I32, table.device());
  device::copy_to_device(dev_ids.raw(), ids.data(), ids.size() * sizeof(int32_t));
  Tensor out = Tensor::empty({int64_t(ids.size()), width}, act_type(table.device()), table.device());
  cuda::embedding(table.raw(), elem(table), dev_ids.as<int32_t>(), int64_t(ids.size()), width, out.raw(), elem(out),
                  cuda::stream());
  return out;
#else
  no_cuda();
#endif
}

Tensor select_rows(const Tensor& x, const std::vector<int64_t>& rows) {
  const int64_t width = x.row_size();
  Tensor out = Tensor::empty({int64_t(rows.size()), width}, x.type(), x.device());
  const int64_t row_bytes = width * scalar_size(x.type());
  for (int64_t r : rows) SPARROW_CHECK(r >= 0 && r < x.dim(0), "select_rows: row ", r, " out of range");
  if (x.on_cpu()) {
    for (size_t i = 0; i < rows.size(); ++i)
      std::memcpy(out.as<char>() + i * row_bytes, x.as<char>() + rows[i] * row_bytes, row_bytes);
    return out;
  }
#if SPARROW_HAVE_CUDA
  std::vector<int32_t> index(rows.begin(), rows.end());
  Tensor dev_index = Tensor::empty({int64_t(index.size())}, ScalarType::I32, x.device());
  device::copy_to_device(dev_index.raw(), index.data(), index.size() * sizeof(int32_t));
  cuda::gather_rows(x.raw(), elem(x), dev_index.as<int32_t>(), int64_t(index.size()), width, out.raw(),
                    cuda::stream());
  return out;
#else
  no_cuda();
#endif
}

Tensor embedding(const Tensor& table, const Tensor& ids) {
  SPARROW_CHECK(ids.type() == ScalarType::I32 && ids.ndim() == 1, "embedding: ids must be a vector of int32");
  if (ids.on_cpu()) return embedding(table, std::vector<int32_t>(ids.as<int32_t>(), ids.as<int32_t>() + ids.numel()));
  same_device(table, ids, "embedding");
#if SPARROW_HAVE_CUDA
  Tensor out = Tensor::empty({ids.numel(), table.dim(1)}, act_type(table.device()), table.device());
  cuda::embedding(table.raw(), elem(table), ids.as<int32_t>(), ids.numel(), table.dim(1), out.raw(), elem(out),
                  cuda::stream());
  return out;
#else
  no_cuda();
#endif
}

Tensor select_rows(const Tensor& x, const Tensor& rows) {
  SPARROW_CHECK(rows.type() == ScalarType::I32 && rows.ndim() == 1, "select_rows: rows must be a vector of int32");
  if (rows.on_cpu()) return select_rows(x, std::vector<int64_t>(rows.as<int32_t>(), rows.as<int32_t>() + rows.numel()));
  same_device(x, rows, "select_rows");
#if SPARROW_HAVE_CUDA
  Tensor out = Tensor::empty({rows.numel(), x.row_size()}, x.type(), x.device());
  cuda::gather_rows(x.raw(), elem(x), rows.as<int32_t>(), rows.numel(), x.row_size(), out.raw(), cuda::stream());
  return out;
#else
  no_cuda();
#endif
}

Tensor concat_rows(const Tensor& a, const Tensor& b) {
  same_device(a, b, "concat_rows");
  const Stored stored = stored_as(a);
  // Matrices that cannot stack as stored (stored differently, e.g. a bf16 stack of NVFP4 projections and a
  // third NVFP4 one; FP8 whose first rows do not end on a 128-row scale block) stack dequantized: bf16 on a
  // GPU, fp32 on the CPU.
  const bool fp8_misaligned = stored == Stored::Fp8 && a.dim(0) % 128 != 0;
  if ((stored_as(b) != stored || a.type() != b.type() || fp8_misaligned) && a.ndim() == 2 && b.ndim() == 2 &&
      (stored != Stored::Plain || stored_as(b) != Stored::Plain))
    return concat_rows(stored == Stored::Plain ? a : dequantize_weight(a),
                       stored_as(b) == Stored::Plain ? b : dequantize_weight(b));
  if (a.on_cpu() && a.type() != b.type() && a.ndim() == 2 && b.ndim() == 2)  // bf16 beside fp32 (CPU)
    return concat_rows(dequantize_weight(a), dequantize_weight(b));
  SPARROW_CHECK(a.type() == b.type() && a.row_size() == b.row_size() && stored_as(b) == stored, "concat_rows: ",
                shape_str(a.shape()), " and ", shape_str(b.shape()), " differ in row width, type or format");
  Shape shape = a.shape();
  shape[0] += b.dim(0);
  auto bytes = [](const Tensor& t) { return t.view_bytes(0, t.shape(), ScalarType::U8); };
  if (stored == Stored::Fp8) {
    // FP8 weights: the block scales stack too (a's rows end on a scale block: above).
    Tensor scales = concat_rows(a.block_scales(), b.block_scales());
    return concat_rows(bytes(a), bytes(b)).view_bytes(0, shape, ScalarType::F8E4M3).with_block_scales(scales);
  }
  if (group_scaled(stored)) {
    // MX / NV weights: every row has its own group scales, so codes and scales stack row by row. NVFP4's
    // global scale is one per matrix: two matrices with different ones stack only as bf16.
    Tensor global;
    if (stored == Stored::Nvfp4) {
      const Tensor ga = a.global_scales().to(Device::Cpu), gb = b.global_scales().to(Device::Cpu);
      if (ga.numel() != 1 || gb.numel() != 1 || ga.data()[0] != gb.data()[0])
        return concat_rows(dequantize_weight(a), dequantize_weight(b));
      global = a.global_scales();
    }
    const Tensor& sa = a.block_scales();
    Shape scale_shape = sa.shape();
    scale_shape[0] += b.block_scales().dim(0);
    Tensor scales = concat_rows(bytes(sa), bytes(b.block_scales())).view_bytes(0, scale_shape, sa.type());
    return concat_rows(bytes(a), bytes(b)).view_bytes(0, shape, a.type()).with_group_scales(scales, global);
  }
  Tensor out = Tensor::empty(shape, a.type(), a.device());
  if (a.on_cpu()) {
    std::memcpy(out.raw(), a.raw(), a.nbytes());
    std::memcpy(out.as<char>() + a.nbytes(), b.raw(), b.nbytes());
    return out;
  }
#if SPARROW_HAVE_CUDA
  device::copy_device(out.raw(), a.raw(), a.nbytes());
  device::copy_device(out.as<char>() + a.nbytes(), b.raw(), b.nbytes());
  return out;
#else
  no_cuda();
#endif
}

Tensor dequantize_weight(const Tensor& w) {
  const Stored stored = stored_as(w);
  SPARROW_CHECK(w.ndim() == 2, "dequantize_weight: expects a matrix, got ", scalar_name(w.type()), " ",
                shape_str(w.shape()));
  const int64_t rows = w.dim(0), cols = weight_cols(w);
  if (w.on_cpu()) {
    std::vector<float> scratch;
    const float* values = cpu::widened_matrix(w, 0, scratch);
    Tensor out = Tensor::empty({rows, cols});
    std::memcpy(out.data(), values, size_t(rows * cols) * sizeof(float));
    return out;
  }
  SPARROW_CHECK(stored != Stored::Plain, "dequantize_weight: expects a quantized matrix on a GPU, got ",
                scalar_name(w.type()));
#if SPARROW_HAVE_CUDA
  Tensor out = Tensor::empty({rows, cols}, ScalarType::BF16, w.device());
  if (stored == Stored::Fp8)
    cuda::dequantize_fp8_blocks(rows, cols, w.as<uint8_t>(), w.block_scales().as<float>(), out.raw(), cuda::stream());
  else
    cuda::dequantize_grouped(codes_of(stored), rows, cols, w.as<uint8_t>(), w.block_scales().as<uint8_t>(),
                             stored == Stored::Nvfp4 ? w.global_scales().as<float>() : nullptr, out.raw(),
                             cuda::stream());
  return out;
#else
  no_cuda();
#endif
}

namespace {
// One position's cos/sin per frequency, with Rope::angles' arithmetic: angle = inv_freq * pos in fp32,
// cos/sin scaled by attention_scaling afterwards.
void rope_table(const Tensor& inv_freq, int64_t position, float attention_scaling, std::vector<float>& cos,
                std::vector<float>& sin) {
  const float pos = float(position);
  for (size_t i = 0; i < cos.size(); ++i) {
    const float angle = inv_freq.data()[i] * pos;
    cos[i] = std::cos(angle) * attention_scaling;
    sin[i] = std::sin(angle) * attention_scaling;
  }
}
}  // namespace

void rope_narrow_heads_(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_scaling,
                        int64_t head_dim) {
  same_device(x, positions, "rope");
  const int64_t rot = 2 * inv_freq.numel(), row = x.dim(-1), rows = x.numel() / row;
  SPARROW_CHECK(x.on_cpu(), "rope of heads narrower than the rotary dims (",head_dim, " < ", rot,
                ") runs on the CPU only");
  SPARROW_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim < rot && row % head_dim == 0, "rope: heads of ",
                head_dim, " values in rows of ", row, " against ", rot, " rotary dims");
  SPARROW_CHECK(positions.numel() == rows && positions.type() == ScalarType::I64, "rope: ", positions.numel(),
                " positions for ", rows, " rows");
  require_f32(x, "rope");
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    std::vector<float> cos(rot / 2), sin(rot / 2);
    for (int64_t r = begin; r < end; ++r) {
      rope_table(inv_freq, positions.as<int64_t>()[r], attention_scaling, cos, sin);
      for (int64_t h = 0; h < row / head_dim; ++h)
        cpu::apply_rope_neox_narrow_head(x.row(r) + h * head_dim, cos.data(), sin.data(), int(head_dim), int(rot));
    }
  });
}

void rms_norm_rope_heads_(Tensor& x, const Tensor& w, float eps, bool unit_offset, const Tensor& positions,
                          const Tensor& inv_freq, float attention_scaling, bool interleaved) {
  const int64_t head_dim = w.numel(), row = x.dim(-1), rows = x.numel() / row, rot = 2 * inv_freq.numel();
  SPARROW_CHECK(head_dim > 0 && row % head_dim == 0, "rms_norm_rope_heads: rows of ", row, " are not heads of ",
                head_dim);
  if (x.on_cpu() || head_dim > 128 || rot == 0 || rot > head_dim) {
    rms_norm_(x, w, eps, unit_offset, 0, row / head_dim);
    rope_(x, positions, inv_freq, attention_scaling, 0, row / head_dim, head_dim, interleaved);
    return;
  }
  same_device(x, w, "rms_norm_rope_heads");
  same_device(x, positions, "rms_norm_rope_heads");
  SPARROW_CHECK(positions.numel() == rows && positions.type() == ScalarType::I64, "rms_norm_rope_heads: ",
                positions.numel(), " positions for ", rows, " rows");
#if SPARROW_HAVE_CUDA
  cuda::rms_norm_rope_heads(x.raw(), elem(x), rows, row / head_dim, head_dim, w.as<float>(), eps, unit_offset, rot,
                            positions.as<int64_t>(), inv_freq.as<float>(), attention_scaling, interleaved,
                            cuda::stream());
#else
  no_cuda();
#endif
}

void rope_(Tensor& x, const Tensor& positions, const Tensor& inv_freq, float attention_scaling, int64_t first_col,
           int64_t heads, int64_t head_stride, bool interleaved) {
  same_device(x, positions, "rope");
  const int64_t rot = 2 * inv_freq.numel(), row = x.dim(-1), rows = x.numel() / row;
  if (rot == 0 || rows == 0) return;
  SPARROW_CHECK(positions.numel() == rows && positions.type() == ScalarType::I64, "rope: ", positions.numel(),
                " positions for ", rows, " rows");
  SPARROW_CHECK(first_col + (heads - 1) * head_stride + rot <= row, "rope: heads do not fit the row");
  if (x.on_cpu()) {
    require_f32(x, "rope");
    parallel_for(rows, [&](int64_t begin, int64_t end) {
      std::vector<float> cos(rot / 2), sin(rot / 2);
      for (int64_t r = begin; r < end; ++r) {
        rope_table(inv_freq, positions.as<int64_t>()[r], attention_scaling, cos, sin);
        for (int64_t h = 0; h < heads; ++h) {
          float* p = x.row(r) + first_col + h * head_stride;
          if (interleaved)
            cpu::apply_rope_interleaved(p, cos.data(), sin.data(), int(rot));
          else
            cpu::apply_rope_neox(p, cos.data(), sin.data(), int(rot));
        }
      }
    });
    return;
  }
#if SPARROW_HAVE_CUDA
  cuda::rope(x.raw(), elem(x), rows, row, first_col, heads, head_stride, rot, positions.as<int64_t>(),
             inv_freq.as<float>(), attention_scaling, interleaved, cuda::stream());
#else
  no_cuda();
#endif
}

Tensor glu(const Tensor& gate_up, Glu kind, float alpha, float limit) {
  const int64_t inter = gate_up.dim(-1) / 2, rows = gate_up.numel() / (2 * inter);
  Tensor out = Tensor::empty({rows, inter}, gate_up.type(), gate_up.device());
  if (gate_up.on_cpu()) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* gate = gate_up.row(r);
      const float* up = gate + inter;
      cpu::glu(kind, gate, up, out.row(r), inter, alpha, limit);
    }
    return out;
  }
#if SPARROW_HAVE_CUDA
  cuda::glu(gate_up.raw(), elem(gate_up), out.raw(), elem(out), rows, inter,
            kind, alpha, limit,
            cuda::stream());
  return out;
#else
  no_cuda();
#endif
}

void copy_lines(Tensor& dst, int64_t dst_offset, int64_t dst_pitch, const Tensor& src, int64_t src_offset,
                int64_t src_pitch, int64_t width, int64_t lines) {
  same_device(dst, src, "copy_lines");
  SPARROW_CHECK(dst.type() == src.type(), "copy_lines: ", scalar_name(src.type()), " into ", scalar_name(dst.type()));
  if (lines == 0 || width == 0) return;
  SPARROW_CHECK(dst_offset + (lines - 1) * dst_pitch + width <= dst.numel() &&
                    src_offset + (lines - 1) * src_pitch + width <= src.numel(),
                "copy_lines: out of range");
  const int64_t e = scalar_size(dst.type());
  char* d = static_cast<char*>(dst.raw()) + dst_offset * e;
  const char* s = static_cast<const char*>(src.raw()) + src_offset * e;
  if (dst.on_cpu()) {
    for (int64_t i = 0; i < lines; ++i) std::memcpy(d + i * dst_pitch * e, s + i * src_pitch * e, width * e);
    return;
  }
#if SPARROW_HAVE_CUDA
  SPARROW_CHECK(cudaMemcpy2DAsync(d, dst_pitch * e, s, src_pitch * e, width * e, lines, cudaMemcpyDeviceToDevice,
                                  cuda::stream()) == cudaSuccess,
                "copy_lines: cudaMemcpy2DAsync failed");
#else
  no_cuda();
#endif
}

namespace {

void batched_matmul(bool transpose_b, int64_t batch, int64_t m, int64_t n, int64_t k, MatView a, MatView b,
                    const Tensor& c, int64_t c_offset, int64_t ldc, int64_t c_batch_stride) {
  same_device(*a.tensor, c, "batched_matmul");
  same_device(*b.tensor, c, "batched_matmul");
  if (c.on_cpu()) {
    float* cp = const_cast<float*>(c.data());
    for (int64_t i = 0; i < batch; ++i) {
      const float* ap = a.tensor->data() + a.offset + i * a.batch_stride;
      const float* bp = b.tensor->data() + b.offset + i * b.batch_stride;
      float* out = cp + c_offset + i * c_batch_stride;
      if (transpose_b)
        cpu::gemm_nt(m, n, k, ap, a.ld, bp, b.ld, out, ldc);
      else
        cpu::gemm_nn(m, n, k, ap, a.ld, bp, b.ld, out, ldc);
    }
    return;
  }
#if SPARROW_HAVE_CUDA
  auto operand = [](const MatView& v) {
    const int64_t bytes = scalar_size(v.tensor->type());
    return cuda::GemmOperand{static_cast<const char*>(v.tensor->raw()) + v.offset * bytes, elem(*v.tensor), v.ld,
                             v.batch_stride};
  };
  const cuda::GemmOutput out{const_cast<char*>(static_cast<const char*>(c.raw())) + c_offset * scalar_size(c.type()),
                             elem(c), ldc, c_batch_stride};
  if (transpose_b)
    cuda::gemm_nt(m, n, k, operand(a), operand(b), out, 1.0f, 0.0f, batch, cuda::stream());
  else
    cuda::gemm_nn(m, n, k, operand(a), operand(b), out, 1.0f, 0.0f, batch, cuda::stream());
#else
  no_cuda();
#endif
}

}  // namespace

void batched_matmul_nn(int64_t batch, int64_t m, int64_t n, int64_t k, MatView a, MatView b, const Tensor& c,
                       int64_t c_offset, int64_t ldc, int64_t c_batch_stride) {
  batched_matmul(false, batch, m, n, k, a, b, c, c_offset, ldc, c_batch_stride);
}

void batched_matmul_nt(int64_t batch, int64_t m, int64_t n, int64_t k, MatView a, MatView b, const Tensor& c,
                       int64_t c_offset, int64_t ldc, int64_t c_batch_stride) {
  batched_matmul(true, batch, m, n, k, a, b, c, c_offset, ldc, c_batch_stride);
}

Routing route_grouped_sigmoid(const Tensor& logits, const Tensor& bias, int64_t n_group, int64_t topk_group,
                              int64_t top_k, bool normalize, float normalize_eps, float scaling) {
  SPARROW_CHECK(logits.type() == ScalarType::F32, "router logits must be float32");
  const int64_t tokens = logits.dim(0), experts = logits.dim(1);
  if (logits.on_cpu()) {
    Routing r{Tensor::empty({tokens, top_k}, ScalarType::I32), Tensor::empty({tokens, top_k}, ScalarType::F32)};
    cpu::route_grouped_sigmoid(logits, bias, n_group, topk_group, top_k, normalize, normalize_eps, scaling,
                               r.experts.as<int32_t>(), r.weights.as<float>());
    return r;
  }
#if SPARROW_HAVE_CUDA
  // The kernel reads the bias through a raw pointer: one on the host is an illegal access on the device.
  SPARROW_CHECK(bias.device() == logits.device() && bias.type() == ScalarType::F32 && bias.numel() == experts,
                "router bias must be float32 with one value per expert (", experts, ") on the logits' device");
  Routing r{Tensor::empty({tokens, top_k}, ScalarType::I32, logits.device()),
                  Tensor::empty({tokens, top_k}, ScalarType::F32, logits.device())};
  cuda::route_grouped_sigmoid(logits.as<float>(), bias.as<float>(), tokens, experts, n_group, topk_group, top_k,
                              normalize, normalize_eps, scaling, r.experts.as<int32_t>(), r.weights.as<float>(),
                              cuda::stream());
  return r;
#else
  no_cuda();
#endif
}

void simulate_uniform_routing(const Tensor& x, Routing& routing, int64_t num_experts, uint32_t salt, float weight) {
  const int64_t top_k = routing.experts.dim(1);
  if (x.on_cpu()) {
    // Keyed by the bf16 form of the token's first values, as the GPU's bf16 activations are.
    std::vector<uint16_t> bits(std::min<int64_t>(x.dim(1), uniform_routing::kKeyValues));
    for (int64_t i = 0; i < x.dim(0); ++i) {
      for (size_t v = 0; v < bits.size(); ++v) bits[v] = float_to_bf16(x.row(i)[v]);
      uniform_routing::draw_experts(uniform_routing::token_key(bits.data(), int64_t(bits.size()), salt), num_experts,
                                    top_k, routing.experts.as<int32_t>() + i * top_k);
      std::fill_n(routing.weights.as<float>() + i * top_k, top_k, weight);
    }
    return;
  }
#if SPARROW_HAVE_CUDA
  SPARROW_CHECK(x.type() == ScalarType::BF16 && x.ndim() == 2 && routing.experts.dim(0) == x.dim(0),
                "simulated routing takes the bf16 [tokens, hidden] activations the routing is for");
  cuda::simulate_uniform_routing(x.raw(), x.dim(0), x.dim(1), num_experts, top_k, salt, weight,
                                 routing.experts.as<int32_t>(), routing.weights.as<float>(), cuda::stream());
#else
  (void)routing, (void)num_experts, (void)salt, (void)weight;
  no_cuda();
#endif
}

void keep_local_experts_(Routing& routing, int64_t first, int64_t count) {
  const int64_t slots = routing.experts.numel();
  if (routing.experts.on_cpu()) {
    int32_t* ids = routing.experts.as<int32_t>();
    for (int64_t i = 0; i < slots; ++i) ids[i] = ids[i] >= first && ids[i] < first + count ? int32_t(ids[i] - first) : -1;
    return;
  }
#if SPARROW_HAVE_CUDA
  cuda::keep_local_experts(routing.experts.as<int32_t>(), slots, int(first), int(count), cuda::stream());
#else
  (void)first, (void)count;
  no_cuda();
#endif
}

#if SPARROW_HAVE_CUDA
namespace {

// The expert kernels' form of LoRA runs (kernels/cuda/moe/moe.h ExpertLora): the pairs' device pointers by
// (projection, run, expert) and each token's run, uploaded in one copy, and the kernels' workspace.
struct DeviceExpertLora {
  Tensor tables, workspace;  // held for the kernels
  cuda::ExpertLora lora;
};

DeviceExpertLora device_expert_lora(std::span<const ExpertAdapterRun> runs, int64_t tokens, int64_t top_k,
                                    int64_t num_experts, int64_t hidden, int64_t inter, Device device) {
  const int64_t slots = int64_t(runs.size()) * num_experts;
  const int64_t entry_bytes = (3 * slots * int64_t(sizeof(cuda::ExpertLoraEntry)) + 15) / 16 * 16;
  Tensor host = Tensor::empty({entry_bytes + tokens * int64_t(sizeof(int32_t))}, ScalarType::U8);
  auto* entries = reinterpret_cast<cuda::ExpertLoraEntry*>(host.as<uint8_t>());
  auto* token_adapter = reinterpret_cast<int32_t*>(host.as<uint8_t>() + entry_bytes);
  int64_t max_rank = 0;
  auto entry = [&](const ExpertLowRank& pair, int64_t in, int64_t out) {
    cuda::ExpertLoraEntry e;
    if (!pair.a) return e;
    const Tensor &a = *pair.a, &b = *pair.b;
    SPARROW_CHECK(a.type() == ScalarType::BF16 && b.type() == ScalarType::BF16 && !a.on_cpu() && !b.on_cpu() &&
                      a.dim(1) == in && b.dim(0) == out && b.dim(1) == a.dim(0),
                  "moe LoRA: bf16 GPU pairs [r, ", in, "] and [", out, ", r] expected, got [", a.dim(0), " x ",
                  a.dim(1), "] and [", b.dim(0), " x ", b.dim(1), "]");
    max_rank = std::max(max_rank, a.dim(0));
    e.a = a.raw(), e.b = b.raw(), e.rank = int32_t(a.dim(0));
    return e;
  };
  std::fill(token_adapter, token_adapter + tokens, -1);
  for (size_t i = 0; i < runs.size(); ++i) {
    const ExpertAdapterRun& run = runs[i];
    SPARROW_CHECK(int64_t(run.gate.size()) == num_experts && int64_t(run.up.size()) == num_experts &&
                      int64_t(run.down.size()) == num_experts && run.begin >= 0 && run.begin <= run.end &&
                      run.end <= tokens,
                  "moe LoRA: a run of rows [", run.begin, ", ", run.end, ") with terms for ", run.gate.size(),
                  " experts, for ", tokens, " rows and ", num_experts, " experts");
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t at = int64_t(i) * num_experts + e;
      entries[0 * slots + at] = entry(run.gate[size_t(e)], hidden, inter);
      entries[1 * slots + at] = entry(run.up[size_t(e)], hidden, inter);
      entries[2 * slots + at] = entry(run.down[size_t(e)], inter, hidden);
    }
    std::fill(token_adapter + run.begin, token_adapter + run.end, int32_t(i));
  }
  DeviceExpertLora d;
  d.tables = host.to(device);
  d.workspace = Tensor::empty(
      {int64_t(cuda::expert_lora_workspace_bytes(tokens * top_k, std::max<int64_t>(max_rank, 1)))}, ScalarType::U8,
      device);
  d.lora.entries = reinterpret_cast<const cuda::ExpertLoraEntry*>(d.tables.as<uint8_t>());
  d.lora.token_adapter = reinterpret_cast<const int32_t*>(d.tables.as<uint8_t>() + entry_bytes);
  d.lora.adapters = int(runs.size());
  d.lora.max_rank = int(std::max<int64_t>(max_rank, 1));
  d.lora.workspace = d.workspace.raw();
  return d;
}

}  // namespace
#endif

Tensor moe_experts(const Tensor& x, const Routing& routing, const Tensor& gate_up, const Tensor& down, Glu kind,
                   float alpha, float limit, std::span<const ExpertAdapterRun> adapters) {
  if (x.on_cpu()) {
    require_f32(x, "moe_experts");
    return cpu::moe_experts(x, routing.experts.as<int32_t>(), routing.weights.as<float>(), routing.experts.dim(1),
                            gate_up, down, kind, alpha, limit, adapters);
  }
#if SPARROW_HAVE_CUDA
  const Stored stored = stored_as(gate_up);
  const bool scaled = gate_up.block_scales().defined() && down.block_scales().defined();
  SPARROW_CHECK(x.type() == ScalarType::BF16 && down.type() == gate_up.type() && stored_as(down) == stored &&
                    (stored != Stored::Plain ? scaled : gate_up.type() == ScalarType::BF16),
                "GPU experts take bf16 activations and bf16 weights, or quantized weights with their scales (gate_up "
                "and down in the same format)");
  const int64_t tokens = x.dim(0), hidden = x.dim(1), top_k = routing.experts.dim(1);
  const int64_t num_experts = gate_up.dim(0), inter = weight_cols(down);
  Tensor out = Tensor::empty({tokens, hidden}, ScalarType::BF16, x.device());
  Tensor workspace = Tensor::empty(
      {int64_t(cuda::moe_workspace_bytes(tokens, top_k, num_experts, hidden, inter))}, ScalarType::U8, x.device());
  const DeviceExpertLora lora = adapters.empty() ? DeviceExpertLora{}
                                                 : device_expert_lora(adapters, tokens, top_k, num_experts, hidden,
                                                                      inter, x.device());
  const cuda::ExpertLora* terms = adapters.empty() ? nullptr : &lora.lora;
  if (group_scaled(stored)) {
    const bool nvfp4 = stored == Stored::Nvfp4;
    cuda::moe_experts_packed(x.raw(), tokens, hidden, routing.experts.as<int32_t>(), routing.weights.as<float>(),
                             top_k, codes_of(stored), gate_up.as<uint8_t>(), gate_up.block_scales().as<uint8_t>(),
                             nvfp4 ? gate_up.global_scales().as<float>() : nullptr, down.as<uint8_t>(),
                             down.block_scales().as<uint8_t>(), nvfp4 ? down.global_scales().as<float>() : nullptr,
                             num_experts, inter, kind, alpha, limit, out.raw(), workspace.raw(), cuda::stream(), terms);
  } else if (stored == Stored::Fp8) {
    cuda::moe_experts_fp8(x.raw(), tokens, hidden, routing.experts.as<int32_t>(), routing.weights.as<float>(), top_k,
                          gate_up.as<uint8_t>(), gate_up.block_scales().as<float>(), down.as<uint8_t>(),
                          down.block_scales().as<float>(), num_experts, inter, kind, alpha, limit, out.raw(),
                          workspace.raw(), cuda::stream(), terms);
  } else {
    cuda::moe_experts(x.raw(), tokens, hidden, routing.experts.as<int32_t>(), routing.weights.as<float>(), top_k,
                      gate_up.raw(), down.raw(), num_experts, inter, kind, alpha, limit, out.raw(), workspace.raw(),
                      cuda::stream(), terms);
  }
  return out;
#else
  no_cuda();
#endif
}

std::vector<int32_t> sample_tokens(const Tensor& logits, std::span<const TokenDraw> draws,
                                   std::span<const LogitAdjustment> adjustments, const TokenBitmask& mask) {
  SPARROW_CHECK(logits.ndim() == 2 && logits.type() == ScalarType::F32, "sample_tokens: logits must be fp32 [rows, vocab]");
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  SPARROW_CHECK(int64_t(draws.size()) == rows, "sample_tokens: ", draws.size(), " draws for ", rows, " rows");
  for (const LogitAdjustment& a : adjustments)
    SPARROW_CHECK(a.row >= 0 && a.row < rows, "sample_tokens: adjustment for row ", a.row, " of ", rows);
  if (!mask.rows.empty()) {
    SPARROW_CHECK(mask.words_per_row * 32 >= vocab &&
                      int64_t(mask.words.size()) == int64_t(mask.rows.size()) * mask.words_per_row,
                  "sample_tokens: token bitmask of ", mask.words.size(), " words for ", mask.rows.size(),
                  " rows of ", vocab, " tokens");
    for (int32_t r : mask.rows) SPARROW_CHECK(r >= 0 && r < rows, "sample_tokens: bitmask for row ", r, " of ", rows);
  }
  std::vector<int32_t> tokens(rows);
  if (rows == 0) return tokens;
  if (logits.on_cpu()) {
    std::vector<const uint32_t*> row_mask(size_t(rows), nullptr);
    for (size_t k = 0; k < mask.rows.size(); ++k)
      row_mask[size_t(mask.rows[k])] = mask.words.data() + int64_t(k) * mask.words_per_row;
    std::vector<float> adjusted;
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.row(r);
      bool touched = row_mask[size_t(r)] != nullptr;
      for (const LogitAdjustment& a : adjustments) touched |= a.row == r;
      if (touched) {
        adjusted.assign(row, row + vocab);
        cpu::adjust_logits(adjusted.data(), vocab, int32_t(r), adjustments);
        if (row_mask[size_t(r)]) cpu::apply_token_bitmask(adjusted.data(), vocab, row_mask[size_t(r)]);
        row = adjusted.data();
      }
      tokens[r] = cpu::draw_token(row, vocab, draws[r]);
    }
    return tokens;
  }
#if SPARROW_HAVE_CUDA
  auto upload = [&](const void* data, size_t bytes) {
    Tensor host = Tensor::empty({int64_t(std::max<size_t>(bytes, 1))}, ScalarType::U8);
    std::memcpy(host.raw(), data, bytes);
    return host.to(logits.device());
  };
  Tensor source = logits;
  if (!adjustments.empty() || !mask.rows.empty()) source = logits.clone();
  if (!adjustments.empty()) {
    Tensor dev_adjustments = upload(adjustments.data(), adjustments.size_bytes());
    cuda::adjust_logits(source.as<float>(), vocab, dev_adjustments.as<LogitAdjustment>(), int64_t(adjustments.size()),
                        vocab, cuda::stream());
  }
  if (!mask.rows.empty()) {
    Tensor dev_rows = upload(mask.rows.data(), mask.rows.size_bytes());
    Tensor dev_words = upload(mask.words.data(), mask.words.size_bytes());
    cuda::apply_token_bitmask(source.as<float>(), vocab, vocab, dev_rows.as<int32_t>(), int64_t(mask.rows.size()),
                              dev_words.as<uint32_t>(), mask.words_per_row, cuda::stream());
  }
  Tensor dev_draws = upload(draws.data(), draws.size_bytes());
  Tensor dev_tokens = Tensor::empty({rows}, ScalarType::I32, logits.device());
  cuda::draw_tokens(source.as<float>(), rows, vocab, vocab, dev_draws.as<TokenDraw>(), dev_tokens.as<int32_t>(),
                    cuda::stream());
  device::copy_to_host_sync(tokens.data(), dev_tokens.raw(), rows * sizeof(int32_t));
  return tokens;
#else
  no_cuda();
#endif
}

TimeMark TimeMark::now(Device device) {
  TimeMark mark;
  if (device == Device::Cpu) {
    mark.cpu_ = std::chrono::steady_clock::now();
    return mark;
  }
  mark.event_ = std::shared_ptr<void>(device::record_event(), [](void* e) { device::destroy_event(e); });
  return mark;
}

double seconds_between(const TimeMark& from, const TimeMark& to) {
  SPARROW_CHECK(bool(from.event_) == bool(to.event_), "seconds_between: marks of two devices");
  if (!to.event_) return std::chrono::duration<double>(to.cpu_ - from.cpu_).count();
  return 1e-3 * double(device::elapsed_ms(from.event_.get(), to.event_.get()));
}

}  // namespace sparrow::ops
