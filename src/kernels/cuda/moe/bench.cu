// bench_moe: the routed experts of one MoE layer (moe.h: moe_experts with bf16 weights, moe_experts_fp8 with
// e4m3 weights and 128x128 block scales, moe_experts_nvfp4 / _mxfp4 / _mxfp8: moe_experts_packed with the
// released MX / NV formats) at the real models' shapes, the whole call timed (sort by expert, the two grouped
// products, the combine):
//   deepseek_v3.2  hidden 7168, moe_intermediate 2048, 256 experts, top-8, SiLU GLU
//   kimi_k3.1_pro  the latent experts: width 3584 (routed_expert_hidden_size), moe_intermediate 3072, 896
//                  experts, top-16, SiLU GLU (bench/shapes/kimi_k3.1_pro.json; released as MXFP4)
//   minimax_m3.1   hidden 6144, intermediate 3072, 128 experts, top-4, clamped SwiGLU (bench/shapes/minimax_m3.1.json;
//                  M3.1-Flash releases its experts as NVFP4)
// Every expert of the layer is in memory (Kimi's bf16 experts are 59 GB: a model is skipped with a message
// when the device has not that much free), so the experts a step touches and the rows each gets are those of
// the real layer. FP4 weights are random codes (every E2M1 code is finite) with positive scales.
//
// Tokens: decode batches 1, 4, 8, 16, 64, 128, 256 (one token per sequence) and prefill chunks 4096 and
// 16384. The routing is fixed per token count (a host generator with a fixed seed): top_k distinct experts
// per token, uniform at random, weights uniform in [0.1, 1). Up to 8 rows per expert on average (tokens *
// top_k <= 8 * experts: here every decode batch) the call takes moe.cu's decode path, above it the tiled or
// the wgmma kernels; the note names the path (moe_experts_path).
//
// Bytes (minimum HBM traffic): the weights of the distinct experts the routing touches (counted exactly from
// the routing, close to the expected E (1 - (1 - k/E)^T): DeepSeek 8, 30.5, 102, 222 experts at 1, 4, 16, 64
// tokens; MiniMax 4, 15.3, 51, 111; FP8: the codes plus their fp32 block scales), x read and out written
// (bf16), the routing read (int32 id + fp32 weight per pair). The intermediates (h, the per-pair outputs)
// are this implementation's overhead and not counted. FLOPs: 2 * pairs * 3 * hidden * inter (gate, up and
// down products), plus 4 per GLU element (pairs * inter) and 2 per output element per pair (the weighted
// sum). Decode is bound by the experts' bytes, so its % of 4.3 TB/s is the figure to read; prefill by FLOPs
// where the rows per expert exceed the ridge point (790e12 / 4.3e12 = 184 FLOP/B, i.e. ~184 rows per expert
// in bf16): DeepSeek at 16K tokens (512 rows per expert) is compute-bound, at 4K (128) still memory-bound.
// The note gives both fractions.
//
// moe_experts_fp8_lora: the FP8 call with one rank-16 LoRA adapter over every token on every expert's gate, up
// and down (moe.h ExpertLora), as an RL rollout with an adapter on all experts runs it. Its bytes add the touched
// experts' bf16 pairs (16 * 3 * (hidden + inter) values an expert, ~2% of its FP8 weights at DeepSeek's shape) and
// its FLOPs the two low-rank products of each pair: the row against moe_experts_fp8's is the adapters' cost.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/bench_random.cuh"
#include "kernels/cuda/kernel_bench.h"
#include "kernels/cuda/moe/moe.h"
#include "core/device/cuda_check.h"
#include "core/device/device.h"
#include "core/device/stream.h"

namespace sparrow::cuda {

namespace {

struct Model {
  const char* name;
  int64_t hidden, inter, experts, top_k;
  Glu glu;
};

const Model kModels[] = {
    {"deepseek_v3.2", 7168, 2048, 256, 8, Glu::SiluGlu},
    {"kimi_k3.1_pro", 3584, 3072, 896, 16, Glu::SiluGlu},
    {"minimax_m3.1", 6144, 3072, 128, 4, Glu::ClampedSwiglu},
};
constexpr float kAlpha = 1.702f, kLimit = 7.0f;  // MiniMax's swiglu_alpha / swiglu_limit defaults

// Uniform in [-scale, scale).
__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(scale * hash_unit(seed << 40 ^ uint64_t(i)));
}

// Random finite e4m3 codes (the NaN codes 0x7F / 0xFF become 0x7E / 0xFE).
__global__ void fill_e4m3(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t c = uint8_t(hash32(seed << 40 ^ uint64_t(i)));
    p[i] = (c & 0x7F) == 0x7F ? uint8_t(c ^ 1) : c;
  }
}

// Random bytes (FP4: two E2M1 codes each, all finite).
__global__ void fill_bytes(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(hash32(seed << 40 ^ uint64_t(i)));
}

// Random scale codes in [lo, lo + span): E4M3 (NVFP4) or E8M0 (MXFP4) near the products' O(1) range.
__global__ void fill_scale_codes(uint8_t* p, int64_t n, uint64_t seed, int lo, int span) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(lo + int(hash32(seed << 40 ^ uint64_t(i)) % uint32_t(span)));
}

// Positive block scales in [0.5, 2.5) * base.
__global__ void fill_scales(float* p, int64_t n, uint64_t seed, float base) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = base * (1.5f + hash_unit(seed << 40 ^ uint64_t(i)));
}

struct HostRouting {
  std::vector<int32_t> experts;
  std::vector<float> weights;
  int64_t distinct = 0;  // experts used by at least one token
};

HostRouting make_routing(int64_t tokens, int64_t num_experts, int64_t top_k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, int32_t(num_experts - 1));
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  HostRouting r;
  std::vector<char> used(num_experts, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const size_t first = r.experts.size();
    while (int64_t(r.experts.size() - first) < top_k) {
      const int32_t e = pick(rng);
      if (std::find(r.experts.begin() + first, r.experts.end(), e) == r.experts.end()) r.experts.push_back(e);
    }
    for (int64_t j = 0; j < top_k; ++j) r.weights.push_back(weight(rng));
  }
  for (int32_t e : r.experts) used[e] = 1;
  r.distinct = std::count(used.begin(), used.end(), char(1));
  return r;
}

// cudaMalloc that reports failure instead of throwing (a model that does not fit is skipped).
void* try_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(bytes, 1)) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return p;
}

std::string fmt_pct(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.0f%%", 100.0 * v);
  return buf;
}

// The expert path a shape takes, as the rows' notes name it.
const char* path_label(MoePath path) {
  return path == MoePath::Decode ? "decode path" : path == MoePath::Wgmma ? "wgmma path" : "tiled path (WMMA)";
}

}  // namespace

void bench_moe(const KernelBenchOptions& options, std::vector<KernelBenchRow>& rows) {
  auto wanted = [&](const char* kernel) {
    return options.filter.empty() || std::string(kernel).find(options.filter) != std::string::npos;
  };
  enum class W { Bf16, Fp8, Nvfp4, Mxfp4, Mxfp8 };
  const char* const names[] = {"moe_experts", "moe_experts_fp8", "moe_experts_nvfp4", "moe_experts_mxfp4",
                               "moe_experts_mxfp8"};
  std::vector<Model> models(std::begin(kModels), std::end(kModels));
  std::vector<int64_t> token_counts = {1, 4, 8, 16, 64, 128, 256, 4096, 16384};
  if (options.quick) {
    models.resize(1);
    token_counts = {8, 4096};
  }
  const int64_t max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
  // Other families' pooled blocks go back to the driver: the experts need most of the device.
  device::release_cached_memory();
  cudaStream_t st = stream();

  for (const Model& m : models)
    for (const W w : {W::Bf16, W::Fp8, W::Nvfp4, W::Mxfp4, W::Mxfp8}) {
      const char* kernel = names[int(w)];
      if (!wanted(kernel)) continue;
      // fp4 below: the group-scaled formats (MXFP8's codes a byte each, like FP8's).
      const bool fp8 = w == W::Fp8, mx8 = w == W::Mxfp8, fp4 = w == W::Nvfp4 || w == W::Mxfp4 || mx8;
      const int64_t H = m.hidden, I = m.inter, E = m.experts, k = m.top_k;
      const int64_t per_expert = 3 * H * I;  // gate, up and down weights
      const int64_t group = w == W::Nvfp4 ? 16 : 32;
      // FP8: fp32 block scales; FP4: one-byte group scales (gate/up's, down's) plus NVFP4's fp32 global ones.
      const int64_t gu_scales = fp4 ? E * 2 * I * (H / group) : E * 2 * (I / 128) * (H / 128);
      const int64_t dn_scales = fp4 ? E * H * (I / group) : E * (H / 128) * (I / 128);
      const int64_t scale_size = fp4 ? 1 : 4;
      const double bytes_per_weight = mx8 || fp8 ? 1.0 : fp4 ? 0.5 : 2.0;
      const size_t weight_bytes = size_t(double(E * per_expert) * bytes_per_weight);
      const size_t scale_bytes = (fp8 || fp4) ? size_t(gu_scales + dn_scales) * scale_size + E * 3 * 4 : 0;
      const size_t ws_bytes = moe_workspace_bytes(max_tokens, k, E, H, I);
      const size_t io_bytes = size_t(max_tokens) * H * 2 * 2 + size_t(max_tokens) * k * 8;
      const size_t need = weight_bytes + scale_bytes + ws_bytes + io_bytes + (size_t(512) << 20);  // + L2 flush, slack
      size_t free_bytes = 0, total_bytes = 0;
      SPARROW_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      if (need > free_bytes) {
        std::fprintf(stderr, "# bench_moe: %s %s skipped: needs %.1f GB, %.1f GB free\n", m.name, kernel, need / 1e9,
                     free_bytes / 1e9);
        continue;
      }
      void* gate_up = try_alloc(size_t(double(E * 2 * I * H) * bytes_per_weight));
      void* down = try_alloc(size_t(double(E * H * I) * bytes_per_weight));
      void* gu_s = (fp8 || fp4) ? try_alloc(size_t(gu_scales * scale_size)) : nullptr;
      void* dn_s = (fp8 || fp4) ? try_alloc(size_t(dn_scales * scale_size)) : nullptr;
      auto* global = static_cast<float*>(try_alloc(size_t(E) * 3 * 4));  // NVFP4: gate_up [E, 2], down [E]
      void* x = try_alloc(size_t(max_tokens) * H * 2);
      void* out = try_alloc(size_t(max_tokens) * H * 2);
      void* ws = try_alloc(ws_bytes);
      auto* d_experts = static_cast<int32_t*>(try_alloc(size_t(max_tokens) * k * 4));
      auto* d_weights = static_cast<float*>(try_alloc(size_t(max_tokens) * k * 4));
      auto release = [&] {
        for (void* p : {gate_up, down, gu_s, dn_s, static_cast<void*>(global), x, out, ws,
                        static_cast<void*>(d_experts), static_cast<void*>(d_weights)})
          if (p) cudaFree(p);
      };
      // LoRA (FP8 only): every expert's pairs in one buffer, the entries and token map, the kernels' workspace.
      constexpr int64_t kLoraRank = 16;
      const int64_t lora_per_expert = kLoraRank * 3 * (H + I);
      const bool with_lora = fp8 && wanted("moe_experts_fp8_lora");
      const size_t lora_entry_bytes = (size_t(3 * E) * sizeof(ExpertLoraEntry) + 15) / 16 * 16;
      void* lora_pairs = with_lora ? try_alloc(size_t(E * lora_per_expert) * 2) : nullptr;
      void* lora_tables = with_lora ? try_alloc(lora_entry_bytes + size_t(max_tokens) * 4) : nullptr;
      void* lora_ws = with_lora ? try_alloc(expert_lora_workspace_bytes(max_tokens * k, kLoraRank)) : nullptr;
      auto release_lora = [&] {
        for (void* p : {lora_pairs, lora_tables, lora_ws})
          if (p) cudaFree(p);
      };
      if (!gate_up || !down || ((fp8 || fp4) && (!gu_s || !dn_s)) || !global || !x || !out || !ws || !d_experts ||
          !d_weights) {
        release_lora();
        std::fprintf(stderr, "# bench_moe: %s %s skipped: out of device memory\n", m.name, kernel);
        release();
        continue;
      }
      if (fp8) {
        fill_e4m3<<<4096, 256, 0, st>>>(static_cast<uint8_t*>(gate_up), E * 2 * I * H, 1);
        fill_e4m3<<<4096, 256, 0, st>>>(static_cast<uint8_t*>(down), E * H * I, 2);
        // Uniform e4m3 codes have an RMS near 100: these scales keep the products O(1).
        fill_scales<<<256, 256, 0, st>>>(static_cast<float*>(gu_s), gu_scales, 3, 1.0f / (100.0f * std::sqrt(float(H))));
        fill_scales<<<256, 256, 0, st>>>(static_cast<float*>(dn_s), dn_scales, 4, 1.0f / (100.0f * std::sqrt(float(I))));
      } else if (fp4) {
        if (mx8) {
          fill_e4m3<<<4096, 256, 0, st>>>(static_cast<uint8_t*>(gate_up), E * 2 * I * H, 1);
          fill_e4m3<<<4096, 256, 0, st>>>(static_cast<uint8_t*>(down), E * H * I, 2);
        } else {
          fill_bytes<<<4096, 256, 0, st>>>(static_cast<uint8_t*>(gate_up), E * 2 * I * H / 2, 1);
          fill_bytes<<<4096, 256, 0, st>>>(static_cast<uint8_t*>(down), E * H * I / 2, 2);
        }
        // E2M1 codes have an RMS near 3: NVFP4 scales E4M3 0x20-0x2F (2^-3 .. 2^-2 * 1.875) with global
        // 1 / sqrt(K); MXFP4 scales 2^-8 .. 2^-5 (E8M0 119-122); e4m3 codes (RMS near 100) 2^-14 .. 2^-11.
        const int lo = w == W::Nvfp4 ? 0x20 : mx8 ? 113 : 119, span = w == W::Nvfp4 ? 16 : 4;
        fill_scale_codes<<<1024, 256, 0, st>>>(static_cast<uint8_t*>(gu_s), gu_scales, 3, lo, span);
        fill_scale_codes<<<1024, 256, 0, st>>>(static_cast<uint8_t*>(dn_s), dn_scales, 4, lo, span);
        std::vector<float> g(size_t(E) * 3);
        for (int64_t e = 0; e < E; ++e)
          g[2 * e] = g[2 * e + 1] = 1.0f / std::sqrt(float(H)), g[2 * E + e] = 1.0f / std::sqrt(float(I));
        SPARROW_CUDA_CHECK(cudaMemcpy(global, g.data(), g.size() * 4, cudaMemcpyHostToDevice));
      } else {
        fill_bf16<<<4096, 256, 0, st>>>(static_cast<__nv_bfloat16*>(gate_up), E * 2 * I * H, 1,
                                        1.0f / std::sqrt(float(H)));
        fill_bf16<<<4096, 256, 0, st>>>(static_cast<__nv_bfloat16*>(down), E * H * I, 2, 1.0f / std::sqrt(float(I)));
      }
      fill_bf16<<<4096, 256, 0, st>>>(static_cast<__nv_bfloat16*>(x), max_tokens * H, 5, 1.0f);
      SPARROW_CUDA_CHECK_LAUNCH();
      ExpertLora lora;
      const bool lora_ready = with_lora && lora_pairs && lora_tables && lora_ws;
      if (with_lora && !lora_ready)
        std::fprintf(stderr, "# bench_moe: %s LoRA skipped: out of device memory\n", m.name);
      if (lora_ready) {
        auto* pairs = static_cast<__nv_bfloat16*>(lora_pairs);
        fill_bf16<<<4096, 256, 0, st>>>(pairs, E * lora_per_expert, 6, 1.0f / std::sqrt(float(H)));
        SPARROW_CUDA_CHECK_LAUNCH();
        std::vector<char> host(lora_entry_bytes + size_t(max_tokens) * 4, 0);  // every token adapter 0
        auto* entries = reinterpret_cast<ExpertLoraEntry*>(host.data());
        const int64_t r = kLoraRank;
        // Per expert: gate A [r, H], B [I, r]; up the same; down A [r, I], B [H, r].
        for (int64_t e = 0; e < E; ++e) {
          __nv_bfloat16* base = pairs + e * lora_per_expert;
          entries[0 * E + e] = {base, base + r * H, int32_t(r)};
          entries[1 * E + e] = {base + r * (H + I), base + r * (2 * H + I), int32_t(r)};
          entries[2 * E + e] = {base + 2 * r * (H + I), base + r * (2 * H + 3 * I), int32_t(r)};
        }
        SPARROW_CUDA_CHECK(cudaMemcpy(lora_tables, host.data(), host.size(), cudaMemcpyHostToDevice));
        lora.entries = static_cast<const ExpertLoraEntry*>(lora_tables);
        lora.token_adapter = reinterpret_cast<const int32_t*>(static_cast<char*>(lora_tables) + lora_entry_bytes);
        lora.adapters = 1;
        lora.max_rank = int(r);
        lora.workspace = lora_ws;
      }
      SPARROW_CUDA_CHECK(cudaStreamSynchronize(st));

      for (const int64_t tokens : token_counts) {
        const HostRouting r = make_routing(tokens, E, k, 0x6d6f65ull * 1000003ull + uint64_t(tokens));
        SPARROW_CUDA_CHECK(cudaMemcpy(d_experts, r.experts.data(), r.experts.size() * 4, cudaMemcpyHostToDevice));
        SPARROW_CUDA_CHECK(cudaMemcpy(d_weights, r.weights.data(), r.weights.size() * 4, cudaMemcpyHostToDevice));
        const ExpertLora* adapters = nullptr;  // set for the LoRA row below
        auto launch = [&](cudaStream_t s) {
          const auto* gu8 = static_cast<const uint8_t*>(gate_up);
          const auto* dn8 = static_cast<const uint8_t*>(down);
          if (fp8)
            moe_experts_fp8(x, tokens, H, d_experts, d_weights, k, gu8, static_cast<const float*>(gu_s), dn8,
                            static_cast<const float*>(dn_s), E, I, m.glu, kAlpha, kLimit, out, ws, s, adapters);
          else if (fp4)
            moe_experts_packed(x, tokens, H, d_experts, d_weights, k,
                               w == W::Nvfp4   ? WeightCodes::Nvfp4
                               : w == W::Mxfp4 ? WeightCodes::Mxfp4
                                               : WeightCodes::Mxfp8,
                               gu8, static_cast<const uint8_t*>(gu_s), w == W::Nvfp4 ? global : nullptr, dn8,
                               static_cast<const uint8_t*>(dn_s), w == W::Nvfp4 ? global + 2 * E : nullptr, E, I,
                               m.glu, kAlpha, kLimit, out, ws, s);
          else
            moe_experts(x, tokens, H, d_experts, d_weights, k, gate_up, down, E, I, m.glu, kAlpha, kLimit, out, ws, s);
        };
        KernelBenchRow row;
        row.kernel = kernel;
        row.shape = std::string(m.name) + " experts=" + std::to_string(E) + " top_k=" + std::to_string(k) +
                    " hidden=" + std::to_string(H) + " inter=" + std::to_string(I) +
                    " tokens=" + std::to_string(tokens);
        row.median_us = median_launch_us(launch, st, options.iterations);
        const double pairs = double(tokens) * k;
        const double touched_scales =
            (fp8 || fp4) ? double(r.distinct) * double(gu_scales + dn_scales) / double(E) * double(scale_size) : 0.0;
        row.bytes = double(r.distinct) * double(per_expert) * bytes_per_weight + touched_scales +
                    2.0 * tokens * H * 2 + pairs * 8;
        row.flops = 2.0 * pairs * 3 * double(H) * double(I) + 4.0 * pairs * double(I) + 2.0 * pairs * double(H);
        const double seconds = row.median_us * 1e-6;
        // Every format takes the path moe_experts_path names (moe.h).
        const MoePath path = moe_experts_path(tokens, k, E, H, I);
        std::string how;
        if (fp4)
          how = std::string(path_label(path)) +
                (mx8 ? ": e4m3 experts read in place, each code turned into bf16 times its "
                     : ": packed e2m1 experts read in place, each code turned into bf16 times its ") +
                (w == W::Nvfp4 ? "E4M3 scale per 16 (global scale on the sums)" : "E8M0 scale per 32") +
                (path == MoePath::Decode  ? " in registers, mma.sync m16n8k16; "
                 : path == MoePath::Wgmma ? " per staged tile (codes and scales by cp.async), bf16 wgmma m64nNk16; "
                                          : " per staged tile; ");
        else if (path == MoePath::Decode)
          how = std::string("decode path: weights streamed by warps, mma.sync m16n8k16, ") +
                (fp8 ? "e4m3 experts converted exactly to bf16, 128x128 fp32 block scales applied per block sum; "
                     : "bf16 experts; ");
        else
          how = std::string(path == MoePath::Wgmma ? "wgmma path: " : "tiled path: ") +
                (fp8 ? "e4m3 experts, 128x128 fp32 block scales, dequantised to bf16 in shared memory; "
                     : "bf16 experts; ") +
                "bf16 tensor cores; ";
        row.note = how + "fp32 accumulation; " + std::to_string(r.distinct) + " of " + std::to_string(E) +
                   " experts touched; " + fmt_pct(row.bytes / kHbmBytesPerSecond / seconds) + " of 4.3 TB/s, " +
                   fmt_pct(row.flops / kBf16FlopsPerSecond / seconds) + " of 790 TFLOP/s";
        rows.push_back(row);
        if (!lora_ready) continue;
        adapters = &lora;
        KernelBenchRow with = row;
        with.kernel = "moe_experts_fp8_lora";
        with.shape += " rank=" + std::to_string(kLoraRank);
        with.median_us = median_launch_us(launch, st, options.iterations);
        with.bytes += double(r.distinct) * double(lora_per_expert) * 2.0;
        with.flops += pairs * 2.0 * double(lora_per_expert);
        const double lora_seconds = with.median_us * 1e-6;
        with.note = std::string(path_label(path)) +
                    " with a rank-16 adapter on every expert: u = A x per pair (a block a pair, projection and 8 rank indices), B u in the "
                    "epilogues; " + fmt_pct(with.bytes / kHbmBytesPerSecond / lora_seconds) + " of 4.3 TB/s; " +
                    std::to_string(int(100.0 * (with.median_us / row.median_us - 1.0) + 0.5)) +
                    "% over moe_experts_fp8";
        rows.push_back(with);
      }
      release_lora();
      release();
    }
}

}  // namespace sparrow::cuda
