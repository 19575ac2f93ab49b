// Random weights for `--load-format dummy` (vLLM's flag): a model built from config.json alone, at its real
// dimensions, to benchmark shapes whose weights are not on this machine (bench/shapes/serve/*.json).
//
// Every value is a pure function of (seed, tensor name, element index): a counter-based generator
// (splitmix64's finaliser over seed ^ hash(name) plus the index times the golden-ratio increment), so a
// tensor can be generated in any order, in chunks, on any number of threads, and two loads are equal bit
// for bit. On a GPU the same values are rounded to bfloat16 (or encoded in FP8, below), so a GPU dummy
// model is the CPU dummy model in the GPU's weight precision.
//
// The scale follows a real initialisation, so activations stay O(1) through the stack and gates and
// routers behave (docs/bench.md, "Dummy weights"):
//   matrices (rank >= 2)      uniform with std 1/sqrt(fan_in), fan_in = the last dimension (the input width
//                             of a [out, in] projection; of stacked experts [E, out, in]; a conv's taps)
//   norm weights (*norm.weight, rank 1)   ones; zeros for Gemma-style norms (x̂ · (1 + w), MiniMax-M3)
//   norm biases (*norm.bias)  zeros
//   A_log                     log(A), A uniform in [1, 16]  (KimiLinear's init: decay rates exp(A_log) in [1, 16])
//   dt_bias                   softplus⁻¹(dt), dt log-uniform in [0.001, 0.1]  (Mamba / fla's init)
//   other vectors (biases)    uniform in [-0.02, 0.02]
// FP8 weights (block-scaled E4M3, as DeepSeek ships them): code = e4m3(448 u), one scale a / 448 for every
// 128x128 block, where u is the uniform draw in [-1, 1) and a = sqrt(3) std its range; the dequantised
// weight is the fp32 value to E4M3's precision.
#pragma once
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace sparrow {

struct DummyInit {
  enum Kind {
    Uniform,    // u * scale, u uniform in [-1, 1)
    Constant,   // value
    ALog,       // log(1 + 15 * (u + 1) / 2)
    DtBias,     // softplus⁻¹(exp(log 0.001 + (u + 1) / 2 * (log 0.1 - log 0.001)))
  };
  Kind kind = Uniform;
  float scale = 0;  // Uniform: the half-width sqrt(3) * std
  float value = 0;  // Constant
};

// How the tensor `name` of `shape` is initialised (the rules above). `unit_offset_norms`: the model's
// RMSNorms compute x̂ · (1 + w), so an identity norm has weight 0.
DummyInit dummy_init(const std::string& name, const Shape& shape, bool unit_offset_norms);

// The generator's key of a tensor: mixes the seed and the name.
uint64_t dummy_key(uint64_t seed, const std::string& name);

// Values [begin, begin + count) of the tensor with `key`, as float32, bfloat16 bits, or (Uniform only)
// E4M3 codes of 448 u whose dequantisation scale is init.scale / 448. Parallel over the range.
void dummy_fill_f32(const DummyInit& init, uint64_t key, int64_t begin, int64_t count, float* out);
void dummy_fill_bf16(const DummyInit& init, uint64_t key, int64_t begin, int64_t count, uint16_t* out);
void dummy_fill_e4m3(uint64_t key, int64_t begin, int64_t count, uint8_t* out);
// Uniform random bytes: two E2M1 codes each, every code equally likely (values of RMS ~2.93).
void dummy_fill_e2m1x2(uint64_t key, int64_t begin, int64_t count, uint8_t* out);

// A tensor of `shape` and `type` (F32, BF16, F8E4M3 or E2M1x2) on `device` holding elements [0, numel)
// of the generator. Device tensors are filled from host chunks of at most a few tens of MB, so no host
// copy of the whole tensor (let alone of the model) ever exists. F8E4M3 and E2M1x2 need a Uniform init;
// their scales are left to the caller.
Tensor dummy_tensor(const DummyInit& init, uint64_t key, const Shape& shape, ScalarType type, Device device);

}  // namespace sparrow
