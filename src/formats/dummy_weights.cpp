#include "formats/dummy_weights.h"

#include <algorithm>
#include <cmath>

#include "core/bfloat16.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/cpu/fp8_codec.h"

namespace sparrow {

namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

// splitmix64's output function (Steele, Lea, Flood, "Fast splittable pseudorandom number generators",
// OOPSLA 2014): a bijective mix whose outputs over consecutive multiples of kGolden pass BigCrush.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Element i's draw, uniform in [-1, 1): the top 24 bits (a float's mantissa) of the mixed counter.
float draw(uint64_t key, int64_t i) {
  const uint64_t bits = mix64(key + uint64_t(i + 1) * kGolden) >> 40;
  return float(bits) * (2.0f / 16777216.0f) - 1.0f;
}

float value_of(const DummyInit& init, uint64_t key, int64_t i) {
  switch (init.kind) {
    case DummyInit::Constant:
      return init.value;
    case DummyInit::ALog:
      return std::log(1.0f + 15.0f * 0.5f * (draw(key, i) + 1.0f));
    case DummyInit::DtBias: {
      const float lo = std::log(0.001f), hi = std::log(0.1f);
      const float dt = std::exp(lo + 0.5f * (draw(key, i) + 1.0f) * (hi - lo));
      return dt + std::log(-std::expm1(-dt));  // softplus(x) = dt  <=>  x = dt + log(1 - exp(-dt))
    }
    case DummyInit::Uniform:
    default:
      return draw(key, i) * init.scale;
  }
}

// Elements per parallel piece: large enough that the pool's overhead vanishes.
constexpr int64_t kPiece = 1 << 16;

template <typename Out, typename Convert>
void fill(int64_t begin, int64_t count, Out* out, Convert convert) {
  const int64_t pieces = (count + kPiece - 1) / kPiece;
  parallel_for(pieces, [&](int64_t p0, int64_t p1) {
    const int64_t lo = p0 * kPiece, hi = std::min(count, p1 * kPiece);
    for (int64_t i = lo; i < hi; ++i) out[i] = convert(begin + i);
  });
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

DummyInit dummy_init(const std::string& name, const Shape& shape, bool unit_offset_norms) {
  DummyInit init;
  if (ends_with(name, "A_log")) {
    init.kind = DummyInit::ALog;
  } else if (ends_with(name, "dt_bias")) {
    init.kind = DummyInit::DtBias;
  } else if (shape.size() == 1 && ends_with(name, "norm.weight")) {
    init.kind = DummyInit::Constant;
    init.value = unit_offset_norms ? 0.0f : 1.0f;
  } else if (shape.size() == 1 && ends_with(name, "norm.bias")) {
    init.kind = DummyInit::Constant;
    init.value = 0.0f;
  } else if (shape.size() >= 2) {
    const int64_t fan_in = std::max<int64_t>(1, shape.back());
    init.scale = float(std::sqrt(3.0 / double(fan_in)));  // uniform [-a, a] has std a / sqrt(3)
  } else {
    init.scale = 0.02f;
  }
  return init;
}

uint64_t dummy_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the name
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return mix64(mix64(seed + kGolden) ^ h);
}

void dummy_fill_f32(const DummyInit& init, uint64_t key, int64_t begin, int64_t count, float* out) {
  fill(begin, count, out, [&](int64_t i) { return value_of(init, key, i); });
}

void dummy_fill_bf16(const DummyInit& init, uint64_t key, int64_t begin, int64_t count, uint16_t* out) {
  fill(begin, count, out, [&](int64_t i) { return float_to_bf16(value_of(init, key, i)); });
}

void dummy_fill_e4m3(uint64_t key, int64_t begin, int64_t count, uint8_t* out) {
  fill(begin, count, out, [&](int64_t i) { return cpu::float_to_e4m3(draw(key, i) * cpu::kE4m3Max); });
}

void dummy_fill_e2m1x2(uint64_t key, int64_t begin, int64_t count, uint8_t* out) {
  fill(begin, count, out, [&](int64_t i) { return uint8_t(mix64(key + uint64_t(i + 1) * kGolden) >> 56); });
}

Tensor dummy_tensor(const DummyInit& init, uint64_t key, const Shape& shape, ScalarType type, Device device) {
  SPARROW_CHECK(type == ScalarType::F32 || type == ScalarType::BF16 || type == ScalarType::F8E4M3 ||
                    type == ScalarType::E2M1x2,
                "dummy weights: no generator for ", scalar_name(type));
  SPARROW_CHECK((type != ScalarType::F8E4M3 && type != ScalarType::E2M1x2) || init.kind == DummyInit::Uniform,
                "dummy weights: FP8 and FP4 codes only for uniform matrices");
  auto fill_host = [&](Tensor& t, int64_t begin) {
    const int64_t n = t.numel();
    if (type == ScalarType::F32) dummy_fill_f32(init, key, begin, n, t.as<float>());
    else if (type == ScalarType::BF16) dummy_fill_bf16(init, key, begin, n, t.as<uint16_t>());
    else if (type == ScalarType::F8E4M3) dummy_fill_e4m3(key, begin, n, t.as<uint8_t>());
    else dummy_fill_e2m1x2(key, begin, n, t.as<uint8_t>());
  };
  Tensor out = Tensor::empty(shape, type, device);
  if (device == Device::Cpu) {
    fill_host(out, 0);
    return out;
  }
  // Host chunks of 16M elements (32 MB of bf16), uploaded into the device tensor one after another.
  constexpr int64_t kChunk = int64_t(1) << 24;
  const int64_t n = out.numel();
  const Tensor flat = out.reshape({n});
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t end = std::min(n, begin + kChunk);
    Tensor host = Tensor::empty({end - begin}, type);
    fill_host(host, begin);
    Tensor part = flat.rows(begin, end);
    part.copy_from(host);
  }
  return out;
}

}  // namespace sparrow
