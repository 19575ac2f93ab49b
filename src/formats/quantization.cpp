#include "formats/quantization.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "kernels/cpu/fp4_codec.h"
#include "kernels/cpu/fp8_codec.h"

namespace sparrow {

namespace fs = std::filesystem;

const char* weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::Dense: return "dense";
    case WeightFormat::Fp8Block: return "FP8 block-scaled";
    case WeightFormat::Mxfp8: return "MXFP8";
    case WeightFormat::Nvfp4: return "NVFP4";
    case WeightFormat::Mxfp4: return "MXFP4";
  }
  return "?";
}

std::string QuantizationConfig::describe() const {
  if (method.empty()) return "no quantization";
  std::string out = method + " (" + source + "):";
  for (WeightFormat f : formats) out += std::string(out.back() == ':' ? " " : ", ") + weight_format_name(f);
  return out;
}

namespace {

std::string upper(std::string s) {
  for (char& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// One ModelOpt algo (a whole-model quant_algo or one entry of MIXED_PRECISION's quantized_layers) with its
// group_size (0: not given).
void add_modelopt_algo(QuantizationConfig& q, const Config& where, const std::string& field, const std::string& algo,
                       int64_t group_size) {
  const std::string name = upper(algo);
  if (name == "NVFP4" || name == "W4A16_NVFP4") {
    where.require(group_size == 0 || group_size == 16, field, "group_size 16 for NVFP4 (one E4M3 scale per 16 values)");
    q.formats.insert(WeightFormat::Nvfp4);
  } else if (name == "MXFP8") {
    where.require(group_size == 0 || group_size == 32, field, "group_size 32 for MXFP8 (one E8M0 scale per 32 values)");
    q.formats.insert(WeightFormat::Mxfp8);
  } else if (name == "FP8_PB_WO" || name == "FP8_BLOCK_SCALES") {
    if (group_size > 0) q.block_rows = q.block_cols = group_size;
    q.formats.insert(WeightFormat::Fp8Block);
  } else {
    where.unsupported(field, algo, "NVFP4, W4A16_NVFP4, MXFP8, FP8_PB_WO, FP8_BLOCK_SCALES, MIXED_PRECISION");
  }
}

// ModelOpt's settings, from hf_quant_config.json's "quantization" object or a modelopt quantization_config.
void read_modelopt(QuantizationConfig& q, const Config& c) {
  const std::string algo = c.get_string("quant_algo");
  if (upper(algo) != "MIXED_PRECISION") return add_modelopt_algo(q, c, "quant_algo", algo, c.get_int("group_size", 0));
  c.require(c.has("quantized_layers") && c.json()["quantized_layers"].is_object(), "quantized_layers",
            "an object of per-layer recipes for MIXED_PRECISION");
  const Config layers = c.get_object("quantized_layers");
  for (const auto& [layer, recipe] : layers.json().items()) {
    const Config r = layers.get_object(layer);
    add_modelopt_algo(q, r, "quant_algo", r.get_string("quant_algo"), r.get_int("group_size", 0));
  }
}

// compressed-tensors: each config group's weight scheme must be an MX format.
void read_compressed_tensors(QuantizationConfig& q, const Config& c) {
  c.require(c.has("config_groups") && c.json()["config_groups"].is_object(), "config_groups",
            "an object of quantization groups");
  const Config groups = c.get_object("config_groups");
  for (const auto& [name, group] : groups.json().items()) {
    const Config g = groups.get_object(name);
    if (!g.has("weights")) continue;  // an activation-only group
    const Config w = g.get_object("weights");
    const std::string type = w.get_string("type", "");
    const int64_t bits = w.get_int("num_bits");
    const bool mx = type == "float" && w.get_string("strategy", "") == "group" && w.get_int("group_size", 0) == 32;
    if (mx && bits == 4)
      q.formats.insert(WeightFormat::Mxfp4);
    else if (mx && bits == 8)
      q.formats.insert(WeightFormat::Mxfp8);
    else
      w.unsupported("num_bits", std::to_string(bits) + " (type '" + type + "', group_size " +
                                    std::to_string(w.get_int("group_size", 0)) + ")",
                    "float weights of 4 (MXFP4) or 8 (MXFP8) bits, strategy group, group_size 32");
  }
}

}  // namespace

int64_t scale_group(WeightFormat format) {
  return format == WeightFormat::Nvfp4 ? cpu::kNvfp4Block : cpu::kMxfp4Block;
}

QuantizationConfig read_quantization(const std::string& dir, const Config& config) {
  QuantizationConfig q;
  const fs::path hf_quant = fs::path(dir) / "hf_quant_config.json";
  if (fs::exists(hf_quant)) {
    const Config file = Config::load(hf_quant.string());
    q.method = "modelopt";
    q.source = "hf_quant_config.json";
    read_modelopt(q, file.get_object("quantization"));
    return q;
  }
  return quantization_from_config(config);
}

QuantizationConfig quantization_from_config(const Config& config) {
  QuantizationConfig q;
  if (!config.has("quantization_config")) return q;
  const Config c = config.get_object("quantization_config");
  q.method = c.get_string("quant_method");
  q.source = "config.json";
  if (q.method == "fp8") {
    if (c.has("weight_block_size")) {
      std::vector<int64_t> block = c.get_int_list("weight_block_size");
      c.require(block.size() == 2 && block[0] > 0 && block[1] > 0, "weight_block_size",
                "two positive integers [rows, cols]");
      q.block_rows = block[0];
      q.block_cols = block[1];
    }
    q.formats.insert(WeightFormat::Fp8Block);
  } else if (q.method == "modelopt") {
    read_modelopt(q, c);
  } else if (q.method == "compressed-tensors") {
    read_compressed_tensors(q, c);
  } else {
    c.unsupported("quant_method", q.method, "fp8, modelopt, compressed-tensors");
  }
  return q;
}

void dequantize_mxfp8(const uint8_t* e4m3, const uint8_t* e8m0_scales, int64_t n, float* out) {
  // OCP MX v1.0: every MX format scales blocks of 32, MXFP8 as MXFP4.
  for (int64_t i = 0; i < n; ++i)
    out[i] = cpu::e4m3_to_float(e4m3[i]) * cpu::e8m0_to_float(e8m0_scales[i / cpu::kMxfp4Block]);
}

void dequantize_nvfp4(const uint8_t* packed, const uint8_t* e4m3_scales, float scale_2, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = cpu::e2m1_to_float(cpu::fp4_code(packed, i)) *
             (cpu::e4m3_to_float(e4m3_scales[i / cpu::kNvfp4Block]) * scale_2);
}

}  // namespace sparrow
