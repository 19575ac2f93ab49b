// A Hugging Face model folder: config.json plus model.safetensors or a sharded
// model.safetensors.index.json. Weights are handed to the model as fp32 tensors by name; the checkpoint
// keeps track of which names were taken so that leftovers are reported as errors.
//
// FP8 E4M3 weights with DeepSeek's 128x128 block scales (`<name>_scale_inv`, one fp32 per block, as
// DeepSeek-V3/V3.2 ship, quantization_config.weight_block_size) are dequantized on load:
// w[i][j] = e4m3[i][j] * scale_inv[i / 128][j / 128].
#pragma once
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "formats/config.h"
#include "formats/safetensors.h"

namespace sparrow {

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
  // FP8 there (take_linear's projections, routed experts) are FP8 codes with block scales.
  static std::unique_ptr<Checkpoint> open_dummy(const std::string& dir, uint64_t seed = 0);

  const std::string& dir() const { return dir_; }
  const Config& config() const { return config_; }
  bool dummy() const { return dummy_; }
  // A dummy checkpoint: the elements of every tensor handed out so far (the model's parameter count once
  // it is loaded).
  int64_t dummy_params() const { return dummy_params_; }

  // Where take() and take_experts() put tensors: the host (float32, the default) or a GPU, where
  // matrices (2 or more dimensions) become bfloat16 and vectors (norm weights, biases) stay float32.
  void place_on(Device device) { device_ = device; }
  Device device() const { return device_; }

  bool has(const std::string& name) const;
  // The tensor (fp32 on the host; see place_on) with exactly the expected shape; "missing tensor 'x'" or
  // "tensor 'x': expected shape [a, b], found [c, d]" otherwise. Marks the name (and its scale) used.
  // F32 tensors are read-only views of the mapped file (clone() before writing in place).
  Tensor take(const std::string& name, const Shape& expected);
  // A weight matrix only `ops::linear` reads ([out, in]). On a GPU, an FP8 tensor with 128x128 block
  // scales stays FP8 (its scales attached, Tensor::block_scales) and the product runs on the FP8 tensor
  // cores (kernels/cuda/gemm/gemm_fp8.h), when its shape suits that product: in % 16 == 0 and
  // out % 8 == 0. Anything else is take().
  Tensor take_linear(const std::string& name, const Shape& expected);
  // A tensor that stays float32 wherever it is placed (weights a kernel reads in fp32 whatever their
  // rank, e.g. KDA's convolution taps and decay rates).
  Tensor take_fp32(const std::string& name, const Shape& expected);

  // Expert weights in either layout transformers writes:
  //   fused:      <prefix>.gate_up_proj [E, 2I, H] and <prefix>.down_proj [E, H, I]
  //   per expert: <prefix>.<e>.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]
  //               (or the release names w1 = gate, w3 = up, w2 = down)
  struct Experts {
    Tensor gate_up;  // [E, 2I, H]: rows [0, I) gate, [I, 2I) up
    Tensor down;     // [E, H, I]
  };
  // On a GPU, FP8 experts (per-expert tensors with 128x128 scales) stay FP8 with their scales attached.
  Experts take_experts(const std::string& prefix, int64_t num_experts, int64_t intermediate, int64_t hidden);

  // Throws "unexpected tensor 'x' in <file>" for any tensor never taken (ignoring names matched by
  // `ignore_prefixes`, e.g. MTP layers or a vision tower the text model does not use).
  void finish(const std::vector<std::string>& ignore_prefixes = {});

 private:
  std::string dir_;
  Config config_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> index_;
  std::map<std::string, std::shared_ptr<SafetensorsFile>> owner_;
  std::set<std::string> taken_;
  int64_t block_rows_ = 128;  // FP8 scale block: one scale per block_rows_ x block_cols_ weights
  int64_t block_cols_ = 128;

  Device device_ = Device::Cpu;

  // --load-format dummy (open_dummy)
  bool dummy_ = false;
  bool dummy_fp8_ = false;          // quantization_config asks for FP8 block-scaled weights
  bool dummy_unit_norms_ = false;   // Gemma-style norms (x̂ · (1 + w)): identity weight 0
  uint64_t dummy_seed_ = 0;
  int64_t dummy_params_ = 0;
  // The tensor `name` of `shape`, placed as take() (or, fp32_everywhere, take_fp32) places it.
  Tensor dummy_take(const std::string& name, const Shape& shape, bool fp32_everywhere);
  // FP8 codes of `shape` ([..., rows, cols]) with one scale per 128x128 block, on the device; `scales`
  // is the shape of the block-scale tensor the kernels expect.
  Tensor dummy_fp8(const std::string& name, const Shape& shape, const Shape& scales);

  void add_file(std::shared_ptr<SafetensorsFile> file);
  Tensor take_host(const std::string& name, const Shape& expected);  // take() before placement
  Tensor place(const Tensor& t) const;
  Tensor dequantize_fp8(const TensorInfo& weight, const std::string& scale_name);
  // An F8_E4M3 tensor's codes as they are (host) and its block scales; marks both taken.
  Tensor take_fp8_codes(const std::string& name, const Shape& expected, Tensor& scales);
  Experts take_fp8_experts(const std::string& prefix, int64_t E, int64_t I, int64_t H, const char* gate_name,
                           const char* up_name, const char* down_name);
};

}  // namespace sparrow
