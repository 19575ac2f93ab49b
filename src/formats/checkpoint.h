// A Hugging Face model folder: config.json plus model.safetensors or a sharded
// model.safetensors.index.json. Weights are handed to the model as fp32 tensors by name; the checkpoint
// keeps track of which names were taken so that leftovers are reported as errors.
//
// Quantized weights (formats/quantization.h: DeepSeek's FP8 with block scales, MXFP8, ModelOpt NVFP4,
// compressed-tensors MXFP4) are found under the weight's logical name (`<base>.weight`, whatever tensors
// store it) and dequantized exactly on load; the config must declare the MX and NVFP4 formats it stores
// (quantization_config / hf_quant_config.json). FP8 with block scales needs no declaration:
// w[i][j] = e4m3[i][j] * scale_inv[i / 128][j / 128] (quantization_config.weight_block_size).
#pragma once
#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "core/tensor.h"
#include "formats/config.h"
#include "formats/quantization.h"
#include "formats/load_progress.h"
#include "formats/safetensors.h"
#include "formats/shard_prefetch.h"

namespace sparrow {

// Tensor parallelism: the part of a stored tensor one rank takes (docs/parallel.md). Along `dim`, the
// tensor is `chunks` equal consecutive pieces (a fused gate_up_proj is two: gate rows, then up rows) and the
// rank takes indices [begin, end) of each piece, concatenated in order; chunks 1 is a plain range.
struct Split {
  int dim = 0;
  int64_t begin = 0, end = -1;  // end -1 (the default): the whole tensor
  int64_t chunks = 1;
  bool whole() const { return end < 0; }
  // The equal part `rank` of `size` of `n` indices (n % size == 0 is the caller's check).
  static Split part(int dim, int64_t n, int rank, int size, int64_t chunks = 1) {
    return {dim, n / size * rank, n / size * (rank + 1), chunks};
  }
  // `expected` with this split applied.
  Shape of(const Shape& expected) const;
};

// The part `split` names of a host tensor of a plain type (fp32, bf16): a copy holding only that part.
Tensor slice_host(const Tensor& t, const Split& split);

// Named tensors in host memory (TensorInfo::data points into `memory`, which keeps the bytes alive for as long
// as a loaded model's views of them live).
struct TensorsInMemory {
  std::vector<TensorInfo> tensors;
  std::shared_ptr<void> memory;
};

class Checkpoint {
 public:
  // Opens dir/config.json and the safetensors files; errors are one line naming the problem.
  // The FP8 block size comes from config.json quantization_config.weight_block_size (default 128x128).
  static std::unique_ptr<Checkpoint> open(const std::string& dir);
  // --load-format dummy (vLLM's): dir/config.json alone; no weight file is opened or read. Every take*()
  // synthesises the tensor asked for, in the shape asked for, deterministic from `seed` and the name
  // (formats/dummy_weights.h: real-init scales). has() answers false, so each family picks its default
  // layout (transformers' names, separate projections) and leaves out optional tensors (router
  // correction biases, a tied head's copy); finish() finds nothing left over. On a GPU each tensor is
  // generated in host chunks and uploaded, matrices in bfloat16, vectors in float32; with an FP8
  // quantization_config (quant_method "fp8", 128x128 blocks) the weights a real checkpoint would keep in
  // FP8 there (take_linear's projections, routed experts) are FP8 codes with block scales; with MX / NV
  // formats declared, those weights are codes and group scales as QuantizationConfig::expert_packed and
  // linear_packed say.
  static std::unique_ptr<Checkpoint> open_dummy(const std::string& dir, uint64_t seed = 0);

  const std::string& dir() const { return dir_; }
  const Config& config() const { return config_; }
  const QuantizationConfig& quantization() const { return quantization_; }
  bool dummy() const { return dummy_; }
  // A dummy checkpoint: the elements of every tensor handed out so far (the model's parameter count once
  // it is loaded).
  int64_t dummy_params() const { return dummy_params_; }

  // Where take() and take_experts() put tensors: the host (float32, the default) or a GPU, where
  // matrices (2 or more dimensions) become bfloat16 and vectors (norm weights, biases) stay float32.
  void place_on(Device device) { device_ = device; }
  Device device() const { return device_; }
  // The part of each weight taken with a split (tensor parallel): what this rank holds of it, by name. LoRA
  // adapters (model/lora.h) take the same part of their matrices.
  const std::map<std::string, Split>& splits() const { return splits_; }
  // The tensor-parallel group the model being loaded belongs to: the family loaders take this rank's part
  // of each split weight (model/tensor_parallel.h) and keep the group to reduce over. Unsharded by default.
  void set_tensor_parallel(const TensorParallel& tp) { tensor_parallel_ = tp; }
  const TensorParallel& tensor_parallel() const { return tensor_parallel_; }

  // Whether the weight `name` is stored, in any format (an MXFP4 `<base>.weight` is `<base>.weight_packed`).
  bool has(const std::string& name) const;
  // The shape `name` is stored in (a plain tensor; for a release that ships a vector in one of several
  // layouts, e.g. KDA's A_log as [heads] or [1, 1, heads, 1]). "missing tensor 'x'" when absent.
  Shape stored_shape(const std::string& name) const;
  // How many stored tensors' names start with `prefix` (e.g. a vision tower the loader skips).
  int64_t count_prefixed(const std::string& prefix) const;
  // The tensor (fp32 on the host; see place_on) with exactly the expected shape; "missing tensor 'x'" or
  // "tensor 'x': expected shape [a, b], found [c, d]" otherwise. Marks the name (and its scales) used.
  // Quantized weights are dequantized exactly (formats/quantization.h); on a GPU they are placed as bfloat16.
  // F32 tensors are read-only views of the mapped file (clone() before writing in place).
  Tensor take(const std::string& name, const Shape& expected);
  // A weight matrix only `ops::linear` reads ([out, in]). On a GPU, an FP8 tensor with 128x128 block
  // scales stays FP8 (its scales attached, Tensor::block_scales) and the product runs on the FP8 tensor
  // cores (kernels/cuda/gemm/gemm_fp8.h), when its shape suits that product: in % 16 == 0 and
  // out % 8 == 0; on the CPU a bf16 matrix stays a view of the mapped file and an FP8 one its codes with
  // their scales (kernels/cpu/stored_weights.h widens them per product); an MXFP8, NVFP4 or MXFP4 tensor
  // stays as stored (codes with their group scales,
  // Tensor::with_group_scales, read in place by ops::linear) when in % 32 == 0. Anything else is take().
  Tensor take_linear(const std::string& name, const Shape& expected);
  // A tensor that stays float32 wherever it is placed (weights a kernel reads in fp32 whatever their
  // rank, e.g. KDA's convolution taps and decay rates).
  Tensor take_fp32(const std::string& name, const Shape& expected);
  // An integer tensor (I64 or I32, e.g. a reduced draft vocabulary's d2t map), on the host; zeros from a
  // dummy checkpoint.
  std::vector<int64_t> take_ints(const std::string& name, const Shape& expected);
  // This rank's part of a split tensor (tensor parallelism), `expected` being the stored (whole) shape;
  // placed as take() / take_linear() place them. Only the part is converted and placed: a bf16 or fp32
  // tensor is read from the mapped file, a quantized one dequantized on the host first (the part then
  // placed as bf16 on a GPU, fp32 on the CPU; kept as stored: issue 23).
  Tensor take(const std::string& name, const Shape& expected, const Split& split);
  Tensor take_linear(const std::string& name, const Shape& expected, const Split& split);
  Tensor take_fp32(const std::string& name, const Shape& expected, const Split& split);

  // Expert weights in either layout transformers writes:
  //   fused:      <prefix>.gate_up_proj [E, 2I, H] and <prefix>.down_proj [E, H, I]
  //   per expert: <prefix>.<e>.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]
  //               (or the release names w1 = gate, w3 = up, w2 = down)
  struct Experts {
    Tensor gate_up;  // [E, 2I, H]: rows [0, I) gate, [I, 2I) up
    Tensor down;     // [E, H, I]
  };
  // The names of per-expert tensors under `prefix` (transformers' or the releases'); an error when neither.
  struct ExpertNames {
    const char *gate, *up, *down;
  };
  // transformers' names, and those the DeepSeek / MiniMax releases use (w1 = gate, w3 = up, w2 = down).
  static constexpr ExpertNames kTransformersExpertNames{"gate_proj", "up_proj", "down_proj"};
  static constexpr ExpertNames kReleaseExpertNames{"w1", "w3", "w2"};
  const ExpertNames* expert_names(const std::string& prefix) const;
  // On a GPU, FP8 experts (per-expert tensors with 128x128 scales) stay FP8 with their scales attached,
  // NVFP4, MXFP4 and MXFP8 experts as stored (Tensor::with_group_scales).
  Experts take_experts(const std::string& prefix, int64_t num_experts, int64_t intermediate, int64_t hidden);
  // Tensor parallel inside each expert: the intermediate indices [split.begin, split.end) of every expert
  // (gate and up rows, down columns); `split.dim` and `chunks` are ignored. Dequantized on the host, placed
  // as bf16 on a GPU and fp32 on the CPU.
  Experts take_experts(const std::string& prefix, int64_t num_experts, int64_t intermediate, int64_t hidden,
                       const Split& intermediate_split);
  // Expert parallel: the whole experts [experts.begin, experts.end) of the num_experts (`experts.dim` and
  // `chunks` are ignored), stacked from 0 and placed as take_experts() places them all. The other experts'
  // tensors are left unread, and finish() does not count them as unexpected.
  Experts take_expert_range(const std::string& prefix, int64_t num_experts, int64_t intermediate, int64_t hidden,
                            const Split& experts);

  // Loading at the disk's speed: reads the shard files ahead of the takes, `threads` files at once and at
  // most `window_bytes` ahead of the bytes taken so far (formats/shard_prefetch.h). Nothing for a dummy.
  void prefetch(int threads, int64_t window_bytes);
  // Every tensor taken from now on counts its stored bytes in `progress` (may be null).
  void report_to(LoadProgress* progress) { progress_ = progress; }
  // The stored bytes of every tensor in the folder; of those taken so far.
  int64_t total_bytes() const;
  int64_t bytes_taken() const { return bytes_taken_.load(); }

  // Tensors handed in from memory instead of the folder's (an RL trainer's new weights, through the Python
  // API's update_weights): each replaces the folder's tensor of its name, in the same shape, stored either in
  // the same dtype or, where the folder's is bf16, f16 or f32, in any of those three (a quantized tensor comes
  // with its scales under their own names). One-line errors for a name the folder lacks, another shape or
  // dtype.
  void replace_tensors(const TensorsInMemory& tensors);

  // Throws "unexpected tensor 'x' in <file>" for any tensor never taken (ignoring names matched by
  // `ignore_prefixes`, e.g. MTP layers or a vision tower the text model does not use).
  void finish(const std::vector<std::string>& ignore_prefixes = {});

 private:
  std::string dir_;
  Config config_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> index_;
  std::map<std::string, Split> splits_;  // splits()
  std::vector<std::unique_ptr<TensorInfo>> replaced_;  // replace_tensors' infos, which index_ points to
  std::map<std::string, std::shared_ptr<void>> owner_;  // what keeps each tensor's bytes alive (its file)
  std::set<std::string> taken_;
  std::vector<std::string> left_prefixes_;  // other ranks' experts (take_expert_range)
  std::atomic<int64_t> bytes_taken_{0};
  LoadProgress* progress_ = nullptr;
  std::unique_ptr<ShardPrefetcher> prefetcher_;
  QuantizationConfig quantization_;  // FP8 scale block: one scale per block_rows x block_cols weights

  Device device_ = Device::Cpu;
  TensorParallel tensor_parallel_;

  // --load-format dummy (open_dummy)
  bool dummy_ = false;
  bool dummy_fp8_ = false;          // quantization_config asks for FP8 block-scaled weights
  WeightFormat dummy_experts_ = WeightFormat::Dense;  // QuantizationConfig::expert_packed()
  WeightFormat dummy_linear_ = WeightFormat::Dense;   // QuantizationConfig::linear_packed()
  bool dummy_unit_norms_ = false;   // Gemma-style norms (x̂ · (1 + w)): identity weight 0
  uint64_t dummy_seed_ = 0;
  int64_t dummy_params_ = 0;
  // The tensor `name` of `shape`, placed as take() (or, fp32_everywhere, take_fp32) places it.
  Tensor dummy_take(const std::string& name, const Shape& shape, bool fp32_everywhere);
  // FP8 codes of `shape` ([..., rows, cols]) with one scale per 128x128 block, on the device; `scales`
  // is the shape of the block-scale tensor the kernels expect.
  Tensor dummy_fp8(const std::string& name, const Shape& shape, const Shape& scales);
  // An MX / NV matrix or stack of `shape` [..., rows, cols] in `format` (codes, group scales, NVFP4's
  // global scales of `global_shape`): random codes whose values have the RMS dummy_init gives bf16 weights.
  Tensor dummy_grouped(const std::string& name, const Shape& shape, WeightFormat format, const Shape& global_shape);

  void add_file(std::shared_ptr<SafetensorsFile> file);
  void mark_taken(const std::string& name);  // and count its bytes
  Tensor take_host(const std::string& name, const Shape& expected);  // take() before placement
  // A view of the mapped bytes when `name` is stored as `type` in exactly `expected` (marked taken), so
  // that it reaches a GPU in one copy with no conversion; an undefined tensor otherwise.
  Tensor take_mapped(const std::string& name, const Shape& expected, ScalarType type);
  Tensor place(const Tensor& t) const;
  // The tensor as stored when plain (a view of the mapped bf16 / fp32 bytes), else converted to fp32 on the
  // host (F16, quantized formats); marks it taken.
  Tensor take_stored_host(const std::string& name, const Shape& expected);
  // How the weight `name` is stored: its format and tensors; "missing tensor" and inconsistent siblings
  // are one-line errors.
  struct Stored {
    WeightFormat format = WeightFormat::Dense;
    const TensorInfo* data = nullptr;         // the values or the codes
    const TensorInfo* scale = nullptr;        // block scales (FP8, MX, NVFP4)
    const TensorInfo* scale_2 = nullptr;      // NVFP4's per-tensor scale
    const TensorInfo* input_scale = nullptr;  // NVFP4's activation scale (taken, not used), if stored
  };
  Stored stored(const std::string& name) const;
  Tensor dequantize_fp8(const TensorInfo& weight, const std::string& scale_name);
  Tensor dequantize_packed(const Stored& weight, const Shape& expected);  // MXFP8, NVFP4, MXFP4
  // A packed weight's shapes checked against `expected` and it and its siblings marked taken; returns
  // NVFP4's weight_scale_2 (1 for the other formats).
  float take_packed(const Stored& weight, const Shape& expected);
  // An F8_E4M3 tensor's codes as they are (host) and its block scales; marks both taken.
  Tensor take_fp8_codes(const std::string& name, const Shape& expected, Tensor& scales);
  // Whole experts first .. first + count - 1 of num_experts (take_experts: all of them).
  Experts take_whole_experts(const std::string& prefix, int64_t num_experts, int64_t I, int64_t H, int64_t first,
                             int64_t count);
  // Experts first .. first + E - 1 of the per-expert tensors, stacked from 0.
  Experts take_fp8_experts(const std::string& prefix, int64_t first, int64_t E, int64_t I, int64_t H,
                           const char* gate_name, const char* up_name, const char* down_name);
  Experts take_grouped_experts(const std::string& prefix, int64_t first, int64_t E, int64_t I, int64_t H,
                               const char* gate_name, const char* up_name, const char* down_name, WeightFormat format);
  // An MX / NV matrix as stored, codes and group scales (and NVFP4's global scale), on the device.
  Tensor take_grouped(const Stored& weight, const Shape& expected);
};

}  // namespace sparrow
