// How a checkpoint's weights are quantized, read once from its config (the one parser of
// config.json `quantization_config` and ModelOpt's hf_quant_config.json), and the exact dequantization of
// each stored format.
//
// The formats (one logical weight [..., rows, cols] each; names for a weight `<base>.weight`):
//   Fp8Block  DeepSeek-V3 / ModelOpt FP8_PB_WO: `<base>.weight` F8_E4M3 and its block scales
//             `<base>.weight_scale_inv` (or ModelOpt's `<base>.weight_scale`), F32 [ceil(rows / br),
//             ceil(cols / bc)] (128x128 unless quantization_config.weight_block_size says otherwise):
//               w = e4m3 * scale[i / br][j / bc]
//   Mxfp8     OCP MX (ModelOpt MXFP8, MiniMax-M3's non-expert weights): `<base>.weight` F8_E4M3 and
//             `<base>.weight_scale_inv` (or `.weight_scale`) U8 / F8_E8M0 [rows, cols / 32]:
//               w = e4m3 * 2^(e8m0 - 127)
//   Nvfp4     ModelOpt NVFP4 (MiniMax-M3.1-Flash's routed experts): `<base>.weight` U8 [rows, cols / 2]
//             (two E2M1 codes a byte, element 2i in the low nibble), `<base>.weight_scale` F8_E4M3
//             [rows, cols / 16], `<base>.weight_scale_2` F32 (one value) and `<base>.input_scale` F32
//             (one value, the activations' static scale; weights dequantized here do not use it):
//               w = e2m1 * (e4m3(weight_scale) * weight_scale_2)
//             in that order, as vLLM 0.33's dequantize_to_dtype (quantization/utils/nvfp4_emulation_utils.py).
//   Mxfp4     compressed-tensors MXFP4 (Kimi K3's routed experts): `<base>.weight_packed` U8 [rows, cols / 2]
//             and `<base>.weight_scale` U8 / F8_E8M0 [rows, cols / 32]:
//               w = e2m1 * 2^(e8m0 - 127)
// E8M0 code 255 is NaN (OCP MX v1.0 5.4.1). Every product above is exact in fp32 except NVFP4's two (fp32
// rounding, in the order given), so the CPU reference holds exactly the dequantized values.
#pragma once
#include <cstdint>
#include <set>
#include <string>

#include "formats/config.h"

namespace sparrow {

enum class WeightFormat { Dense, Fp8Block, Mxfp8, Nvfp4, Mxfp4 };
const char* weight_format_name(WeightFormat format);
// Values per scale of the MX and NVFP4 formats: 16 for NVFP4, 32 for MXFP8 and MXFP4 (OCP MX v1.0).
int64_t scale_group(WeightFormat format);
// The formats with one scale per group of a row's values (MXFP8, NVFP4, MXFP4).
inline bool group_scaled(WeightFormat format) {
  return format == WeightFormat::Mxfp8 || format == WeightFormat::Nvfp4 || format == WeightFormat::Mxfp4;
}

struct QuantizationConfig {
  std::string method;               // "" (none), "fp8", "modelopt" or "compressed-tensors"
  std::string source;               // where it was read: "config.json" or "hf_quant_config.json"
  std::set<WeightFormat> formats;   // the stored formats the config declares (Dense is always allowed)
  int64_t block_rows = 128, block_cols = 128;  // Fp8Block's scale block

  bool declares(WeightFormat format) const { return format == WeightFormat::Dense || formats.count(format) > 0; }
  // DeepSeek's FP8 with 128x128 blocks: the only block FP8 the GPU kernels (and dummy weights) take.
  bool fp8_128x128() const { return method == "fp8" && block_rows == 128 && block_cols == 128; }
  // How the GPU stores what this config quantizes, when no checkpoint says it per tensor (dummy weights,
  // the roofline): the routed experts in the FP4 format declared (MXFP4 first: Kimi K3; NVFP4:
  // MiniMax-M3.1-Flash), else MXFP8 if declared (MiniMax-M3), else Dense; the other projections MXFP8
  // when declared (MiniMax-M3 and M3.1-Flash), else Dense (an FP4-only config quantizes experts only).
  WeightFormat expert_packed() const {
    return declares(WeightFormat::Mxfp4)   ? WeightFormat::Mxfp4
           : declares(WeightFormat::Nvfp4) ? WeightFormat::Nvfp4
           : declares(WeightFormat::Mxfp8) ? WeightFormat::Mxfp8
                                           : WeightFormat::Dense;
  }
  WeightFormat linear_packed() const {
    return declares(WeightFormat::Mxfp8) ? WeightFormat::Mxfp8 : WeightFormat::Dense;
  }
  // The formats this config declares, e.g. "modelopt (hf_quant_config.json): NVFP4, MXFP8".
  std::string describe() const;
};

// Reads `config`'s quantization_config and, when present, `dir`/hf_quant_config.json (ModelOpt's file,
// which wins over a modelopt quantization_config). Recognised:
//   quant_method "fp8" (DeepSeek: weight_block_size);
//   "modelopt" or hf_quant_config.json: quant_algo NVFP4 / W4A16_NVFP4 (group_size 16), MXFP8,
//     FP8_PB_WO / FP8_BLOCK_SCALES (group_size = block), or MIXED_PRECISION with `quantized_layers`
//     naming one of these per layer;
//   "compressed-tensors": config_groups whose weights are float, 4 bits (MXFP4) or 8 bits (MXFP8), strategy
//     "group", group_size 32.
// Anything else (another method, another algo or group size) is a one-line error naming the field and what
// sparrow reads.
QuantizationConfig read_quantization(const std::string& dir, const Config& config);
// The same from config.json's quantization_config alone (no hf_quant_config.json: e.g. the roofline's
// shape files).
QuantizationConfig quantization_from_config(const Config& config);

// Dequantization of one matrix row, exact as the header says; n values each call. (MXFP4 is the codec's own
// cpu::mxfp4_dequantize, kernels/cpu/fp4_codec.h; NVFP4 weights multiply in vLLM's order, which differs from
// the NVFP4 KV-cache codec's.)
void dequantize_mxfp8(const uint8_t* e4m3, const uint8_t* e8m0_scales, int64_t n, float* out);
void dequantize_nvfp4(const uint8_t* packed, const uint8_t* e4m3_scales, float scale_2, int64_t n, float* out);

}  // namespace sparrow
