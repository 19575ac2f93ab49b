// cuBLASLt bf16 products at the real models' projection shapes: the ceiling every linear layer of the
// GPU path runs at (compute-bound for prefill-sized m, memory-bound on the weights for decode-sized m).
// gemm_fp8: the FP8 block-scaled product (gemm_fp8.h, activation quantisation included) at
// DeepSeek-V3.2's projection shapes, each beside the bf16 product of the same shape in the same run.
// gemm_skinny: the decode-sized products (m = 1, 4, 8) of gemm_skinny.h at DeepSeek-V3.2's, MiniMax-M3.1's
// and the lm_heads' shapes, bf16 and FP8, each beside cuBLASLt on the same operands in the same run
// (rows cublaslt_bf16 / cublaslt_fp8: gemm_nt, gemm_fp8_block_scaled), the limit bytes / 4.3 TB/s.
// gemm_mx: the MX / NV weights as released (MXFP8, MXFP4, NVFP4) on the skinny kernel beside FP8 at the same
// shapes, and MXFP8 above decode sizes (widened per call, then cuBLASLt) beside FP8 and bf16.
#include <cuda_bf16.h>

#include <string>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/gemm/dequantize.h"
#include "kernels/cuda/gemm/gemm.h"
#include "kernels/cuda/gemm/gemm_fp8.h"
#include "kernels/cuda/gemm/gemm_skinny.h"
#include "kernels/cuda/kernel_bench.h"
#include "core/device/cuda_check.h"
#include "core/device/device.h"
#include "core/device/stream.h"

namespace sparrow::cuda {

namespace {

__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(0.5f * hash_unit(uint64_t(seed) << 40 ^ uint64_t(i)));
}

// Random finite e4m3 codes (the two NaN codes 0x7F / 0xFF become 0x7E / 0xFE).
__global__ void fill_e4m3(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t c = uint8_t(hash32(uint64_t(seed) << 40 ^ uint64_t(i)));
    p[i] = (c & 0x7F) == 0x7F ? uint8_t(c ^ 1) : c;
  }
}

// Positive block scales around 1e-3 (a checkpoint's weight_scale_inv is of that order).
__global__ void fill_scales(float* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = 1e-3f * (1.5f + hash_unit(uint64_t(seed) << 40 ^ uint64_t(i)));
}

bool wanted(const KernelBenchOptions& options, const char* kernel) {
  return options.filter.empty() || std::string(kernel).find(options.filter) != std::string::npos;
}

// One bf16 gemm_nt row: y[m, n] = x[m, k] · w[n, k]ᵀ, all bf16.
KernelBenchRow bf16_row(const std::string& shape, int64_t m, int64_t n, int64_t k, int iterations) {
  void *x = device::alloc(m * k * 2), *w = device::alloc(n * k * 2), *y = device::alloc(m * n * 2);
  fill_bf16<<<1024, 256, 0, stream()>>>(static_cast<__nv_bfloat16*>(x), m * k, 1);
  fill_bf16<<<1024, 256, 0, stream()>>>(static_cast<__nv_bfloat16*>(w), n * k, 2);
  SPARROW_CUDA_CHECK_LAUNCH();
  const GemmOperand gx{x, ElemType::BF16, k, 0}, gw{w, ElemType::BF16, k, 0};
  const GemmOutput gy{y, ElemType::BF16, n, 0};
  KernelBenchRow row;
  row.kernel = "gemm_bf16";
  row.shape = shape + " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
  row.median_us = median_launch_us([&](cudaStream_t st) { gemm_nt(m, n, k, gx, gw, gy, 1.0f, 0.0f, 1, st); },
                                   stream(), iterations);
  row.bytes = 2.0 * (m * k + n * k + m * n);
  row.flops = 2.0 * m * n * k;
  row.note = "cuBLASLt, bf16 in and out, fp32 accumulation";
  device::free(x);
  device::free(w);
  device::free(y);
  return row;
}

// One FP8 row at the same shape: e4m3 weights with 128x128 fp32 block scales, bf16 x quantised per
// (row, 128 columns) inside the timed call, bf16 y.
KernelBenchRow fp8_row(const std::string& shape, int64_t m, int64_t n, int64_t k, int iterations) {
  const int64_t scale_count = ((n + 127) / 128) * ((k + 127) / 128);
  void* x = device::alloc(m * k * 2);
  auto* w = static_cast<uint8_t*>(device::alloc(n * k));
  auto* s = static_cast<float*>(device::alloc(scale_count * 4));
  void* y = device::alloc(m * n * 2);
  fill_bf16<<<1024, 256, 0, stream()>>>(static_cast<__nv_bfloat16*>(x), m * k, 1);
  fill_e4m3<<<1024, 256, 0, stream()>>>(w, n * k, 2);
  fill_scales<<<64, 256, 0, stream()>>>(s, scale_count, 3);
  SPARROW_CUDA_CHECK_LAUNCH();
  KernelBenchRow row;
  row.kernel = "gemm_fp8";
  row.shape = shape + " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
  row.median_us = median_launch_us(
      [&](cudaStream_t st) { gemm_fp8_block_scaled(m, n, k, x, k, w, s, y, ElemType::BF16, n, st); }, stream(),
      iterations);
  // Minimum traffic: the e4m3 weights and their scales, x (bf16) in, y (bf16) out. The quantised copy of x
  // (m*k bytes written and read again) is overhead this implementation adds, so it is not counted.
  row.bytes = double(n * k) + 4.0 * scale_count + 2.0 * m * k + 2.0 * m * n;
  row.flops = 2.0 * m * n * k;
  row.fp8_products = true;
  row.note = "cuBLASLt fp8 gemm, e4m3 x e4m3, 128x128 weight / 1x128 activation fp32 block scales, bf16 x quantised "
             "in the call, bf16 out";
  device::free(x);
  device::free(w);
  device::free(s);
  device::free(y);
  return row;
}

// Random scale bytes for group-scaled weights: E8M0 codes 2^-10 .. 2^-7 (MX), or positive finite E4M3
// codes 2^-3 .. ~2 (NVFP4, whose global scale is then 1e-3).
__global__ void fill_group_scales(uint8_t* p, int64_t n, bool e4m3, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(uint64_t(seed) << 40 ^ uint64_t(i));
    p[i] = e4m3 ? uint8_t(0x28 + h % 0x18) : uint8_t(117 + h % 4);
  }
}

const char* codes_name(WeightCodes codes) {
  switch (codes) {
    case WeightCodes::Bf16: return "bf16";
    case WeightCodes::Fp8: return "fp8";
    case WeightCodes::Nvfp4: return "nvfp4";
    case WeightCodes::Mxfp4: return "mxfp4";
    case WeightCodes::Mxfp8: return "mxfp8";
  }
  return "?";
}

// A weight matrix [n, k] stored as `codes`, with random codes and scales, on the device.
struct BenchWeight {
  WeightCodes codes;
  void* w = nullptr;
  void* scales = nullptr;
  float* global = nullptr;
  double bytes = 0;  // codes + scales
  BenchWeight(WeightCodes c, int64_t n, int64_t k) : codes(c) {
    const bool fp4 = c == WeightCodes::Nvfp4 || c == WeightCodes::Mxfp4;
    const int64_t code_bytes = c == WeightCodes::Bf16 ? 2 * n * k : fp4 ? n * k / 2 : n * k;
    w = device::alloc(code_bytes);
    if (c == WeightCodes::Bf16) fill_bf16<<<1024, 256, 0, stream()>>>(static_cast<__nv_bfloat16*>(w), n * k, 2);
    else fill_e4m3<<<1024, 256, 0, stream()>>>(static_cast<uint8_t*>(w), code_bytes, 2);  // FP4: any byte is valid
    int64_t scale_bytes = 0;
    if (c == WeightCodes::Fp8) {
      const int64_t count = ((n + 127) / 128) * ((k + 127) / 128);
      scale_bytes = 4 * count;
      scales = device::alloc(scale_bytes);
      fill_scales<<<64, 256, 0, stream()>>>(static_cast<float*>(scales), count, 3);
    } else if (c != WeightCodes::Bf16) {
      scale_bytes = n * (k / (c == WeightCodes::Nvfp4 ? 16 : 32));
      scales = device::alloc(scale_bytes);
      fill_group_scales<<<256, 256, 0, stream()>>>(static_cast<uint8_t*>(scales), scale_bytes, c == WeightCodes::Nvfp4,
                                                   3);
    }
    if (c == WeightCodes::Nvfp4) {
      const float one_thousandth = 1e-3f;
      global = static_cast<float*>(device::alloc(4));
      device::copy_to_device(global, &one_thousandth, 4);
    }
    SPARROW_CUDA_CHECK_LAUNCH();
    bytes = double(code_bytes) + double(scale_bytes);
  }
  ~BenchWeight() {
    device::free(w);
    device::free(scales);
    device::free(global);
  }
};

// The skinny product and cuBLASLt on the same shape: y[m, n] = x[m, k] · W[n, k]ᵀ, W stored as `codes`,
// x and y bf16. Minimum traffic: W (and its scales), x in, y out; the skinny path's split-K partial sums
// and cuBLASLt's quantised copy of x are overheads, not counted. cuBLASLt rows: bf16 for bf16 W, the FP8
// block-scaled product for FP8 W; the MX / NV formats (no cuBLASLt form on Hopper) are compared with the
// FP8 rows of the same shape.
void skinny_rows(const std::string& shape, int64_t m, int64_t n, int64_t k, WeightCodes codes, int iterations,
                 std::vector<KernelBenchRow>& rows) {
  const BenchWeight weight(codes, n, k);
  void* x = device::alloc(m * k * 2);
  void* y = device::alloc(m * n * 2);
  const size_t ws_bytes = gemm_skinny_workspace_bytes(m, n, k, codes);
  void* ws = ws_bytes ? device::alloc(ws_bytes) : nullptr;
  fill_bf16<<<1024, 256, 0, stream()>>>(static_cast<__nv_bfloat16*>(x), m * k, 1);
  SPARROW_CUDA_CHECK_LAUNCH();
  const std::string dims = " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
  const double bytes = weight.bytes + 2.0 * m * k + 2.0 * m * n;
  KernelBenchRow skinny;
  skinny.kernel = std::string("gemm_skinny_") + codes_name(codes);
  skinny.shape = shape + dims;
  skinny.median_us = median_launch_us(
      [&](cudaStream_t st) {
        gemm_skinny(m, n, k, codes, x, k, weight.w, weight.scales, weight.global, y, ElemType::BF16, n, ws, ws_bytes,
                    st);
      },
      stream(), iterations);
  skinny.bytes = bytes;
  skinny.flops = 2.0 * m * n * k;
  skinny.note = std::string("weights streamed once, mma.sync from registers, fp32 accumulation") +
                (codes == WeightCodes::Bf16  ? ", bf16"
                 : codes == WeightCodes::Fp8 ? ", bf16 x (not quantised), e4m3 W with 128x128 scales"
                                             : ", bf16 x, codes times their group scale in registers") +
                (ws_bytes ? ", K split over the grid + fixed-order reduction" : "");
  rows.push_back(skinny);
  if (codes == WeightCodes::Bf16 || codes == WeightCodes::Fp8) {
    const bool fp8 = codes == WeightCodes::Fp8;
    KernelBenchRow lt;
    lt.kernel = fp8 ? "cublaslt_fp8" : "cublaslt_bf16";
    lt.shape = shape + dims;
    lt.median_us = median_launch_us(
        [&](cudaStream_t st) {
          if (fp8) {
            gemm_fp8_block_scaled(m, n, k, x, k, static_cast<const uint8_t*>(weight.w),
                                  static_cast<const float*>(weight.scales), y, ElemType::BF16, n, st);
          } else {
            const GemmOperand gx{x, ElemType::BF16, k, 0}, gw{weight.w, ElemType::BF16, k, 0};
            gemm_nt(m, n, k, gx, gw, GemmOutput{y, ElemType::BF16, n, 0}, 1.0f, 0.0f, 1, st);
          }
        },
        stream(), iterations);
    lt.bytes = bytes;
    lt.flops = skinny.flops;
    lt.fp8_products = fp8;  // cuBLASLt quantises x and multiplies e4m3 x e4m3
    lt.note = fp8 ? "cuBLASLt beside gemm_skinny_fp8: x quantised per 1x128 in the call, FP8 tensor cores"
                  : "cuBLASLt beside gemm_skinny_bf16";
    rows.push_back(lt);
  }
  device::free(x);
  device::free(y);
  device::free(ws);
}

// Above decode sizes an MX / NV weight is widened to bf16 per call and multiplied by cuBLASLt
// (gemm/dequantize.h; ops::linear): that pair timed together, beside the bf16 and FP8 rows of the shape.
KernelBenchRow grouped_prefill_row(const std::string& shape, int64_t m, int64_t n, int64_t k, WeightCodes codes,
                                   int iterations) {
  const BenchWeight weight(codes, n, k);
  void* x = device::alloc(m * k * 2);
  void* wide = device::alloc(n * k * 2);
  void* y = device::alloc(m * n * 2);
  fill_bf16<<<1024, 256, 0, stream()>>>(static_cast<__nv_bfloat16*>(x), m * k, 1);
  SPARROW_CUDA_CHECK_LAUNCH();
  KernelBenchRow row;
  row.kernel = std::string("gemm_") + codes_name(codes);
  row.shape = shape + " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
  row.median_us = median_launch_us(
      [&](cudaStream_t st) {
        dequantize_grouped(codes, n, k, static_cast<const uint8_t*>(weight.w),
                           static_cast<const uint8_t*>(weight.scales), weight.global, wide, st);
        const GemmOperand gx{x, ElemType::BF16, k, 0}, gw{wide, ElemType::BF16, k, 0};
        gemm_nt(m, n, k, gx, gw, GemmOutput{y, ElemType::BF16, n, 0}, 1.0f, 0.0f, 1, st);
      },
      stream(), iterations);
  row.bytes = weight.bytes + 2.0 * m * k + 2.0 * m * n;
  row.flops = 2.0 * m * n * k;
  row.note = "dequantize_grouped to a bf16 scratch + cuBLASLt bf16 (the widening's 4 bytes a weight not counted)";
  device::free(x);
  device::free(wide);
  device::free(y);
  return row;
}

}  // namespace

void bench_gemm(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  if (wanted(options, "gemm_skinny")) {  // --filter gemm_skinny: these rows only (cuBLASLt ones included)
    struct Proj {
      const char* name;
      int64_t n, k;
      bool fp8_too;  // the lm_heads are bf16 in the checkpoints
    };
    // [out, in] as stored. DeepSeek-V3.2: hidden 7168, q_lora 1536, 128 heads x (128 + 64) q, kv_lora 512 +
    // rope 64, 128 x 128 v into o_proj, shared expert intermediate 2048, vocab 129280. MiniMax-M3.1: hidden
    // 6144, 64 x 128 q heads, 4 x 128 kv heads, vocab 200064.
    std::vector<Proj> projs = {{"deepseek_v3.2 q_a_proj", 1536, 7168, true},
                               {"deepseek_v3.2 q_b_proj", 24576, 1536, true},
                               {"deepseek_v3.2 kv_a_proj_with_mqa", 576, 7168, true},
                               {"deepseek_v3.2 o_proj", 7168, 16384, true},
                               {"deepseek_v3.2 shared expert gate_up", 4096, 7168, true},
                               {"deepseek_v3.2 shared expert down", 7168, 2048, true},
                               {"minimax_m3.1 q_proj", 8192, 6144, true},
                               {"minimax_m3.1 k_proj / v_proj", 512, 6144, true},
                               {"minimax_m3.1 o_proj", 6144, 8192, true},
                               {"minimax_m3.1 lm_head", 200064, 6144, false},
                               {"deepseek_v3.2 lm_head", 129280, 7168, false}};
    std::vector<int64_t> ms = {1, 4, 8};
    if (options.quick) {
      projs = {projs[2], projs[3]};
      ms = {1};
    }
    for (const Proj& p : projs)
      for (int64_t m : ms) {
        if (p.fp8_too) skinny_rows(p.name, m, p.n, p.k, WeightCodes::Fp8, options.iterations, rows);
        skinny_rows(p.name, m, p.n, p.k, WeightCodes::Bf16, options.iterations, rows);
      }
  }
  if (wanted(options, "gemm_mx")) {  // --filter gemm_mx: the MX / NV weights as released, beside FP8
    // MiniMax-M3.1's projections (MXFP8 as released) and DeepSeek-V3.2's largest ones, every format.
    struct Proj {
      const char* name;
      int64_t n, k;
    };
    std::vector<Proj> projs = {{"minimax_m3.1 q_proj", 8192, 6144},
                               {"minimax_m3.1 k_proj / v_proj", 512, 6144},
                               {"minimax_m3.1 o_proj", 6144, 8192},
                               {"deepseek_v3.2 q_b_proj", 24576, 1536},
                               {"deepseek_v3.2 o_proj", 7168, 16384}};
    std::vector<int64_t> ms = {1, 8};
    if (options.quick) {
      projs.resize(1);
      ms = {1};
    }
    for (const Proj& p : projs) {
      for (int64_t m : ms)
        for (WeightCodes c : {WeightCodes::Fp8, WeightCodes::Mxfp8, WeightCodes::Mxfp4, WeightCodes::Nvfp4})
          skinny_rows(p.name, m, p.n, p.k, c, options.iterations, rows);
      if (options.quick) continue;
      rows.push_back(grouped_prefill_row(p.name, 4096, p.n, p.k, WeightCodes::Mxfp8, options.iterations));
      rows.push_back(fp8_row(p.name, 4096, p.n, p.k, options.iterations));
      rows.push_back(bf16_row(p.name, 4096, p.n, p.k, options.iterations));
    }
  }
  if (wanted(options, "gemm_fp8")) {
    struct Proj {
      const char* name;
      int64_t n, k;
    };
    // DeepSeek-V3.2 (hidden 7168, q_lora 1536, kv_lora 512 + rope 64, 128 heads x 128 v_head_dim, shared
    // expert intermediate 2048): weight shapes [out, in] as stored in the FP8 checkpoint.
    std::vector<Proj> projs = {{"deepseek_v3.2 q_b_proj", 24576, 1536},
                               {"deepseek_v3.2 kv_a_proj_with_mqa", 576, 7168},
                               {"deepseek_v3.2 o_proj", 7168, 16384},
                               {"deepseek_v3.2 shared expert gate_up", 4096, 7168},
                               {"deepseek_v3.2 shared expert down", 7168, 2048}};
    std::vector<int64_t> ms = {1, 64, 4096};
    if (options.quick) {
      projs.resize(1);
      ms = {1, 4096};
    }
    for (const Proj& p : projs)
      for (int64_t m : ms) {
        rows.push_back(fp8_row(p.name, m, p.n, p.k, options.iterations));
        rows.push_back(bf16_row(p.name, m, p.n, p.k, options.iterations));
      }
  }
  if (!wanted(options, "gemm_bf16")) return;
  struct Shape {
    const char* name;
    int64_t m, n, k;
  };
  // DeepSeek-V3.2 (hidden 7168): q_a (7168 -> 1536), MoE expert up (7168 -> 2048) and down; m = tokens.
  std::vector<Shape> shapes = {{"deepseek_v3.2 q_a_proj", 4096, 1536, 7168},
                               {"deepseek_v3.2 expert gate_up", 4096, 4096, 7168},
                               {"deepseek_v3.2 expert down", 4096, 7168, 2048},
                               {"square", 8192, 8192, 8192},
                               {"deepseek_v3.2 expert gate_up decode", 128, 4096, 7168}};
  if (options.quick) shapes.resize(2);
  for (const Shape& s : shapes) rows.push_back(bf16_row(s.name, s.m, s.n, s.k, options.iterations));
}

}  // namespace sparrow::cuda
