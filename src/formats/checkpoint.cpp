#include "formats/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/device/device.h"
#include "core/error.h"
#include "core/parallel.h"
#include "formats/dummy_weights.h"
#include "formats/load_progress.h"
#include "formats/shard_prefetch.h"
#include "kernels/cpu/fp4_codec.h"

namespace sparrow {

namespace fs = std::filesystem;

namespace {

constexpr const char* kScaleSuffix = "_scale_inv";  // DeepSeek-V3's name for FP8 block scales

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool starts_with_any(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const std::string& prefix : prefixes)
    if (name.starts_with(prefix)) return true;
  return false;
}


// model.safetensors.index.json: {"metadata": {...}, "weight_map": {tensor name: shard file name}}.
std::map<std::string, std::string> read_weight_map(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK(in, path, ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json index = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  SPARROW_CHECK(!index.is_discarded(), path, ": not valid JSON");
  SPARROW_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), path,
                ": missing object 'weight_map'");
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    SPARROW_CHECK(file.is_string(), path, ": weight_map entry '", name, "' must be a file name, found ", file.dump());
    weight_map[name] = file.get<std::string>();
  }
  return weight_map;
}

}  // namespace

namespace {

// Whether `path` exists, false for a name the filesystem refuses to look up (too long, ...): a shard name in
// an index is the checkpoint's word, and such a name is then reported missing rather than escaping as a
// std::filesystem::filesystem_error.
bool path_exists(const fs::path& path) {
  std::error_code ignored;
  return fs::exists(path, ignored);
}
bool is_folder(const fs::path& path) {
  std::error_code ignored;
  return fs::is_directory(path, ignored);
}

}  // namespace

std::unique_ptr<Checkpoint> Checkpoint::open(const std::string& dir) {
  auto checkpoint = std::unique_ptr<Checkpoint>(new Checkpoint());
  checkpoint->dir_ = dir;
  const fs::path root(dir);
  SPARROW_CHECK(is_folder(root), dir, ": not a directory");
  SPARROW_CHECK(path_exists(root / "config.json"), dir, ": missing config.json");
  checkpoint->config_ = Config::load((root / "config.json").string());

  checkpoint->quantization_ = read_quantization(dir, checkpoint->config_);

  const fs::path index_path = root / "model.safetensors.index.json";
  const fs::path single_path = root / "model.safetensors";
  if (path_exists(index_path)) {
    std::map<std::string, std::string> weight_map = read_weight_map(index_path.string());
    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
    for (const auto& [name, shard] : weight_map) {
      if (shards.count(shard)) continue;
      const fs::path shard_path = root / shard;
      SPARROW_CHECK(path_exists(shard_path), index_path.string(), ": shard '", shard, "' (listed for tensor '", name,
                    "') does not exist");
      shards[shard] = SafetensorsFile::open(shard_path.string());
      checkpoint->add_file(shards[shard]);
    }
    for (const auto& [name, shard] : weight_map) {
      SPARROW_CHECK(shards[shard]->tensors().count(name), index_path.string(), ": tensor '", name,
                    "' is listed in the index but missing from ", shard);
    }
  } else {
    SPARROW_CHECK(path_exists(single_path), dir, ": missing model.safetensors (or model.safetensors.index.json)");
    checkpoint->add_file(SafetensorsFile::open(single_path.string()));
  }
  return checkpoint;
}

std::unique_ptr<Checkpoint> Checkpoint::open_dummy(const std::string& dir, uint64_t seed) {
  auto checkpoint = std::unique_ptr<Checkpoint>(new Checkpoint());
  checkpoint->dir_ = dir;
  const fs::path root(dir);
  SPARROW_CHECK(is_folder(root), dir, ": not a directory");
  SPARROW_CHECK(path_exists(root / "config.json"), dir, ": missing config.json");
  checkpoint->config_ = Config::load((root / "config.json").string());
  checkpoint->dummy_ = true;
  checkpoint->dummy_seed_ = seed;
  const Config& config = checkpoint->config_;
  // MiniMax-M3's RMSNorms are Gemma-style (model/minimax_m3.cpp): their identity weight is 0.
  checkpoint->dummy_unit_norms_ = config.get_string("model_type", "").starts_with("minimax_m3");
  // The FP8 kernels take DeepSeek's 128x128 blocks only; other quantizations load as bf16 dummies.
  const QuantizationConfig quantization = read_quantization(dir, config);
  checkpoint->dummy_fp8_ = quantization.fp8_128x128();
  // MX / NV formats in the config (as released): dummy experts and projections in them, read in place.
  checkpoint->dummy_experts_ = quantization.expert_packed();
  checkpoint->dummy_linear_ = quantization.linear_packed();
  return checkpoint;
}

Tensor Checkpoint::dummy_take(const std::string& name, const Shape& shape, bool fp32_everywhere) {
  const ScalarType type =
      device_ == Device::Cpu || fp32_everywhere || shape.size() < 2 ? ScalarType::F32 : ScalarType::BF16;
  dummy_params_ += shape_numel(shape);
  return dummy_tensor(dummy_init(name, shape, dummy_unit_norms_), dummy_key(dummy_seed_, name), shape, type, device_);
}

Tensor Checkpoint::dummy_fp8(const std::string& name, const Shape& shape, const Shape& scale_shape) {
  const DummyInit init = dummy_init(name, shape, dummy_unit_norms_);
  dummy_params_ += shape_numel(shape);
  Tensor codes = dummy_tensor(init, dummy_key(dummy_seed_, name), shape, ScalarType::F8E4M3, device_);
  // Codes are e4m3(448 u): one scale, a / 448, turns them back into u * a in every block.
  Tensor scales = Tensor::empty(scale_shape);
  std::fill(scales.data(), scales.data() + scales.numel(), init.scale / 448.0f);
  return codes.with_block_scales(scales.to(device_));
}

Tensor Checkpoint::dummy_grouped(const std::string& name, const Shape& shape, WeightFormat format,
                                 const Shape& global_shape) {
  const bool nvfp4 = format == WeightFormat::Nvfp4, fp4 = format != WeightFormat::Mxfp8;
  const int64_t group = scale_group(format), cols = shape.back();
  const DummyInit init = dummy_init(name, shape, dummy_unit_norms_);
  dummy_params_ += shape_numel(shape);
  Shape code_shape = shape, scale_shape = shape;
  code_shape.back() = fp4 ? cols / 2 : cols;
  scale_shape.back() = cols / group;
  Tensor codes = dummy_tensor(init, dummy_key(dummy_seed_, name), code_shape,
                              fp4 ? ScalarType::E2M1x2 : ScalarType::F8E4M3, device_);
  // Uniform E2M1 codes have an RMS of ~2.93 and e4m3 codes are e4m3(448 u), u * a one of a / sqrt(3):
  // one factor for all, a / (sqrt(3) 2.93) or a / 448.
  const float factor = fp4 ? init.scale / (std::sqrt(3.0f) * 2.926f) : init.scale / 448.0f;
  Tensor scales = Tensor::empty(scale_shape, nvfp4 ? ScalarType::F8E4M3 : ScalarType::F8E8M0);
  Tensor global;
  if (nvfp4) {  // scales 1.0 (E4M3 0x38), the factor in weight_scale_2
    std::fill_n(scales.as<uint8_t>(), scales.numel(), uint8_t(0x38));
    global = Tensor::empty(global_shape);
    std::fill_n(global.data(), global.numel(), factor);
    global = global.to(device_);
  } else {  // the nearest power of two
    const int code = std::clamp(127 + int(std::lround(std::log2(factor))), 1, 254);
    std::fill_n(scales.as<uint8_t>(), scales.numel(), uint8_t(code));
  }
  return codes.with_group_scales(scales.to(device_), global);
}

void Checkpoint::add_file(std::shared_ptr<SafetensorsFile> file) {
  for (const auto& [name, info] : file->tensors()) {
    auto existing = index_.find(name);
    SPARROW_CHECK(existing == index_.end(), dir_, ": tensor '", name, "' appears in both ", existing->second->file,
                  " and ", file->path());
    index_[name] = &info;
    owner_[name] = file;
  }
  files_.push_back(std::move(file));
}

void Checkpoint::replace_tensors(const TensorsInMemory& tensors) {
  SPARROW_CHECK(!dummy_, "new weights for a --load-format dummy model: it has no tensors to replace");
  auto plain = [](DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32; };
  for (const TensorInfo& info : tensors.tensors) {
    auto it = index_.find(info.name);
    SPARROW_CHECK(it != index_.end(), "new weights: '", info.name, "' is not a tensor of ", dir_);
    const TensorInfo& stored = *it->second;
    SPARROW_CHECK(info.shape == stored.shape, "new weights: '", info.name, "' has shape ", shape_str(info.shape),
                  ", the model's is ", shape_str(stored.shape));
    SPARROW_CHECK(info.dtype == stored.dtype || (plain(info.dtype) && plain(stored.dtype)), "new weights: '",
                  info.name, "' comes as ", dtype_name(info.dtype), " where the model stores ", dtype_name(stored.dtype),
                  " (a quantized weight is replaced in its own format, with its scales)");
    const int64_t elements = shape_numel(info.shape);
    SPARROW_CHECK(info.nbytes == size_t(elements) * dtype_size(info.dtype), "new weights: '", info.name, "' holds ",
                  info.nbytes, " bytes for ", elements, " ", dtype_name(info.dtype), " values");
    replaced_.push_back(std::make_unique<TensorInfo>(info));
    replaced_.back()->file = "the new weights";
    it->second = replaced_.back().get();
    owner_[info.name] = tensors.memory;
  }
}

void Checkpoint::mark_taken(const std::string& name) {
  if (!taken_.insert(name).second) return;
  auto it = index_.find(name);
  if (it == index_.end()) return;
  bytes_taken_ += int64_t(it->second->nbytes);
  if (progress_) progress_->add(int64_t(it->second->nbytes));
}

int64_t Checkpoint::total_bytes() const {
  int64_t total = 0;
  for (const auto& [name, info] : index_) total += int64_t(info->nbytes);
  return total;
}

void Checkpoint::prefetch(int threads, int64_t window_bytes) {
  if (dummy_ || prefetcher_) return;
  std::vector<std::string> paths;
  for (const auto& file : files_) paths.push_back(file->path());
  prefetcher_ = std::make_unique<ShardPrefetcher>(std::move(paths), threads, window_bytes,
                                                  [this] { return bytes_taken_.load(); });
}

bool Checkpoint::has(const std::string& name) const {
  if (dummy_) return false;
  return index_.count(name) > 0 || (name.ends_with(".weight") && index_.count(name + "_packed") > 0);
}

int64_t Checkpoint::count_prefixed(const std::string& prefix) const {
  int64_t n = 0;
  for (auto it = index_.lower_bound(prefix); it != index_.end() && it->first.starts_with(prefix); ++it) ++n;
  return n;
}

Shape Checkpoint::stored_shape(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail("missing tensor '", name, "' in ", dir_);
  return it->second->shape;
}

Checkpoint::Stored Checkpoint::stored(const std::string& name) const {
  auto find = [&](const std::string& n) -> const TensorInfo* {
    auto it = index_.find(n);
    return it == index_.end() ? nullptr : it->second;
  };
  // `<base>.weight`'s siblings are `<base>.weight_scale` etc.; a weight named otherwise has `<name>_scale_inv`.
  const std::string base = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : "";
  auto sibling = [&](const char* suffix) { return base.empty() ? nullptr : find(base + suffix); };
  auto is_e8m0 = [](const TensorInfo* t) { return t->dtype == DType::U8 || t->dtype == DType::F8_E8M0; };
  Stored w;
  w.data = find(name);
  if (!w.data && (w.data = sibling(".weight_packed"))) {  // compressed-tensors' packed 4-bit weight
    w.format = WeightFormat::Mxfp4;
    w.scale = sibling(".weight_scale");
    SPARROW_CHECK(w.scale && is_e8m0(w.scale), "tensor '", w.data->name, "' is a packed 4-bit weight but its E8M0 ",
                  "scales '", base, ".weight_scale' (U8 or F8_E8M0) are missing (in ", w.data->file, ")");
  } else if (!w.data) {
    fail("missing tensor '", name, "' in ", dir_);
  } else if (w.data->dtype == DType::F8_E4M3) {
    w.scale = find(name + kScaleSuffix);
    if (!w.scale) w.scale = sibling(".weight_scale");
    SPARROW_CHECK(w.scale, "tensor '", name, "' is F8_E4M3 but its block scales '", name, kScaleSuffix,
                  "' are missing (in ", w.data->file, ")");
    w.format = is_e8m0(w.scale) ? WeightFormat::Mxfp8 : WeightFormat::Fp8Block;
  } else if (w.data->dtype == DType::U8) {
    w.format = WeightFormat::Nvfp4;
    w.scale = sibling(".weight_scale");
    w.scale_2 = sibling(".weight_scale_2");
    w.input_scale = sibling(".input_scale");
    SPARROW_CHECK(w.scale && w.scale->dtype == DType::F8_E4M3 && w.scale_2, "tensor '", name, "' is U8 (packed ",
                  "NVFP4) but its E4M3 scales '", base, ".weight_scale' or its '", base,
                  ".weight_scale_2' are missing (in ", w.data->file, ")");
  }
  if (w.format != WeightFormat::Dense && w.format != WeightFormat::Fp8Block)
    SPARROW_CHECK(quantization_.declares(w.format), "tensor '", name, "' is stored as ", weight_format_name(w.format),
                  ", which the checkpoint's quantization config does not declare (", quantization_.describe(), ")");
  return w;
}

Tensor Checkpoint::take_mapped(const std::string& name, const Shape& expected, ScalarType type) {
  auto it = index_.find(name);
  if (it == index_.end()) return {};
  const TensorInfo& info = *it->second;
  SPARROW_CHECK(type == ScalarType::BF16 || type == ScalarType::F32, "take_mapped: bf16 or fp32 only");
  const DType stored_as = type == ScalarType::BF16 ? DType::BF16 : DType::F32;
  if (info.dtype != stored_as || info.shape != expected || shape_numel(expected) == 0) return {};
  mark_taken(name);
  return Tensor::view(const_cast<uint8_t*>(info.data), expected, type, owner_.at(name));
}

// On a GPU, a tensor stored as it will be placed (bf16 matrices, fp32 vectors) goes from the mapped file to
// the device in one copy; anything else converts on the host first (Tensor::to).
Tensor Checkpoint::take(const std::string& name, const Shape& expected) {
  if (dummy_) return dummy_take(name, expected, /*fp32_everywhere=*/false);
  if (device_ != Device::Cpu) {
    Tensor mapped = take_mapped(name, expected, expected.size() >= 2 ? ScalarType::BF16 : ScalarType::F32);
    if (mapped.defined()) return mapped.to(device_);
  }
  return place(take_host(name, expected));
}

Tensor Checkpoint::take_fp32(const std::string& name, const Shape& expected) {
  if (dummy_) return dummy_take(name, expected, /*fp32_everywhere=*/true);
  if (device_ != Device::Cpu) {
    Tensor mapped = take_mapped(name, expected, ScalarType::F32);
    if (mapped.defined()) return mapped.to(device_);
  }
  Tensor t = take_host(name, expected);
  return device_ == Device::Cpu ? t : t.to(device_, ScalarType::F32);
}

Tensor Checkpoint::take_linear(const std::string& name, const Shape& expected) {
  if (dummy_) {
    if (device_ != Device::Cpu && dummy_linear_ != WeightFormat::Dense && expected.size() == 2 && expected[1] % 32 == 0)
      return dummy_grouped(name, expected, dummy_linear_, {1});
    if (device_ != Device::Cpu && dummy_fp8_ && expected.size() == 2 && expected[1] % 16 == 0 && expected[0] % 8 == 0)
      return dummy_fp8(name, expected, {ceil_div(expected[0], 128), ceil_div(expected[1], 128)});
    return take(name, expected);
  }
  const bool gpu = device_ != Device::Cpu;
  if (expected.size() == 2 && expected[1] % 32 == 0) {
    const Stored weight = stored(name);
    if (group_scaled(weight.format)) return take_grouped(weight, expected);
  }
  auto it = index_.find(name);
  // On the CPU a bf16 matrix stays a view of the mapped file, read when a product first needs it
  // (kernels/cpu/stored_weights.h widens it per product).
  if (!gpu && expected.size() == 2) {
    Tensor mapped = take_mapped(name, expected, ScalarType::BF16);
    if (mapped.defined()) return mapped;
  }
  const bool fp8 = it != index_.end() && it->second->dtype == DType::F8_E4M3 && expected.size() == 2 &&
                   it->second->shape == expected && quantization_.block_rows == 128 &&
                   quantization_.block_cols == 128 && (!gpu || (expected[1] % 16 == 0 && expected[0] % 8 == 0));
  if (!fp8 || stored(name).format != WeightFormat::Fp8Block) return take(name, expected);
  Tensor scales;
  Tensor codes = take_fp8_codes(name, expected, scales);
  return codes.with_block_scales(scales.clone()).to(device_);
}

Tensor slice_host(const Tensor& t, const Split& split) {
  const Shape& shape = t.shape();
  int64_t outer = 1, inner = scalar_size(t.type());
  for (int d = 0; d < split.dim; ++d) outer *= shape[d];
  for (size_t d = split.dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t piece = shape[split.dim] / split.chunks, part_bytes = (split.end - split.begin) * inner;
  Tensor out = Tensor::empty(split.of(shape), t.type());
  const uint8_t* from = t.as<uint8_t>();
  uint8_t* to = out.as<uint8_t>();
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t c = 0; c < split.chunks; ++c, to += part_bytes)
      std::memcpy(to, from + (o * shape[split.dim] + c * piece + split.begin) * inner, size_t(part_bytes));
  return out;
}

Shape Split::of(const Shape& expected) const {
  if (whole()) return expected;
  SPARROW_CHECK(dim >= 0 && size_t(dim) < expected.size() && chunks >= 1 && expected[dim] % chunks == 0 &&
                    0 <= begin && begin < end && end <= expected[dim] / chunks,
                "split [", begin, ", ", end, ") of ", chunks, " piece(s) along dimension ", dim, " does not fit ",
                shape_str(expected));
  Shape part = expected;
  part[dim] = (end - begin) * chunks;
  return part;
}

Tensor Checkpoint::take_stored_host(const std::string& name, const Shape& expected) {
  for (ScalarType type : {ScalarType::BF16, ScalarType::F32}) {
    Tensor mapped = take_mapped(name, expected, type);
    if (mapped.defined()) return mapped;
  }
  return take_host(name, expected);
}

Tensor Checkpoint::take(const std::string& name, const Shape& expected, const Split& split) {
  if (split.whole()) return take(name, expected);
  splits_[name] = split;
  if (dummy_) return dummy_take(name, split.of(expected), /*fp32_everywhere=*/false);
  Tensor part = slice_host(take_stored_host(name, expected), split);
  return device_ == Device::Cpu ? part.to(Device::Cpu, ScalarType::F32) : place(part);
}

Tensor Checkpoint::take_fp32(const std::string& name, const Shape& expected, const Split& split) {
  if (split.whole()) return take_fp32(name, expected);
  splits_[name] = split;
  if (dummy_) return dummy_take(name, split.of(expected), /*fp32_everywhere=*/true);
  return slice_host(take_stored_host(name, expected), split).to(device_, ScalarType::F32);
}

Tensor Checkpoint::take_linear(const std::string& name, const Shape& expected, const Split& split) {
  if (split.whole()) return take_linear(name, expected);
  splits_[name] = split;
  if (dummy_) return take(name, expected, split);
  Tensor part = slice_host(take_stored_host(name, expected), split);
  // On the CPU a bf16 part stays bf16, widened per product as a whole stored matrix is.
  return device_ == Device::Cpu ? part : place(part);
}

// On a GPU, an MX / NV weight stays as stored: its codes and group scales (and NVFP4's global scale) go
// to the device as they are mapped, read in place by the products (kernels/ops.h linear).
Tensor Checkpoint::take_grouped(const Stored& weight, const Shape& expected) {
  const float scale_2 = take_packed(weight, expected);
  const int64_t rows = expected[0], cols = expected[1], group = scale_group(weight.format);
  const bool fp4 = weight.format != WeightFormat::Mxfp8, nvfp4 = weight.format == WeightFormat::Nvfp4;
  const auto& owner = owner_.at(weight.data->name);
  Tensor codes = Tensor::view(const_cast<uint8_t*>(weight.data->data), {rows, fp4 ? cols / 2 : cols},
                              fp4 ? ScalarType::E2M1x2 : ScalarType::F8E4M3, owner);
  Tensor scales = Tensor::view(const_cast<uint8_t*>(weight.scale->data), {rows, cols / group},
                               nvfp4 ? ScalarType::F8E4M3 : ScalarType::F8E8M0, owner_.at(weight.scale->name));
  Tensor global;
  if (nvfp4) {
    global = Tensor::empty({1});
    global.data()[0] = scale_2;
  }
  return codes.with_group_scales(scales, global).to(device_);
}

Tensor Checkpoint::take_fp8_codes(const std::string& name, const Shape& expected, Tensor& scales) {
  auto it = index_.find(name);
  SPARROW_CHECK(it != index_.end(), "missing tensor '", name, "' in ", dir_);
  const TensorInfo& info = *it->second;
  SPARROW_CHECK(info.dtype == DType::F8_E4M3 && info.shape == expected, "tensor '", name, "': expected F8_E4M3 ",
                shape_str(expected), ", found ", dtype_name(info.dtype), " ", shape_str(info.shape));
  const int64_t rows = expected[expected.size() - 2], cols = expected.back();
  const Stored weight = stored(name);
  SPARROW_CHECK(weight.format == WeightFormat::Fp8Block, "tensor '", name, "': expected FP8 with block scales, found ",
                weight_format_name(weight.format));
  mark_taken(name);
  scales = take_host(weight.scale->name,
                     {ceil_div(rows, quantization_.block_rows), ceil_div(cols, quantization_.block_cols)});
  // The mapped codes themselves (read-only): they reach a GPU in one copy.
  return Tensor::view(const_cast<uint8_t*>(info.data), expected, ScalarType::F8E4M3, owner_.at(name));
}

Tensor Checkpoint::place(const Tensor& t) const {
  if (device_ == Device::Cpu) return t;
  return t.to(device_, t.ndim() >= 2 ? ScalarType::BF16 : ScalarType::F32);
}

std::vector<int64_t> Checkpoint::take_ints(const std::string& name, const Shape& expected) {
  if (dummy_) return std::vector<int64_t>(size_t(shape_numel(expected)), 0);
  const TensorInfo& info = *stored(name).data;
  SPARROW_CHECK(info.shape == expected, "tensor '", name, "': expected shape ", shape_str(expected), ", found ",
                shape_str(info.shape), " (in ", info.file, ")");
  SPARROW_CHECK(info.dtype == DType::I64 || info.dtype == DType::I32, "tensor '", name, "' in ", info.file,
                ": expected integers (I64 or I32), found ", dtype_name(info.dtype));
  mark_taken(name);
  std::vector<int64_t> values(size_t(shape_numel(expected)));
  for (size_t i = 0; i < values.size(); ++i) {
    if (info.dtype == DType::I64) {
      std::memcpy(&values[i], info.data + i * 8, 8);
    } else {
      int32_t v;
      std::memcpy(&v, info.data + i * 4, 4);
      values[i] = v;
    }
  }
  return values;
}

Tensor Checkpoint::take_host(const std::string& name, const Shape& expected) {
  const Stored weight = stored(name);
  const TensorInfo& info = *weight.data;
  if (weight.format == WeightFormat::Mxfp4 || weight.format == WeightFormat::Nvfp4 ||
      weight.format == WeightFormat::Mxfp8)
    return dequantize_packed(weight, expected);
  SPARROW_CHECK(info.shape == expected, "tensor '", name, "': expected shape ", shape_str(expected), ", found ",
                shape_str(info.shape), " (in ", info.file, ")");
  mark_taken(name);
  if (weight.format == WeightFormat::Fp8Block) {
    mark_taken(weight.scale->name);
    return dequantize_fp8(info, weight.scale->name);
  }
  return to_float32(info, owner_.at(name));
}

// MXFP8, NVFP4 and MXFP4 (formats/quantization.h), row by row: each row of the weight has its own row of
// block scales, so leading dimensions (stacked experts) need nothing special.
float Checkpoint::take_packed(const Stored& weight, const Shape& expected) {
  const TensorInfo& data = *weight.data;
  const std::string& name = data.name;
  const char* format = weight_format_name(weight.format);
  SPARROW_CHECK(expected.size() >= 2, "tensor '", name, "': ", format, " weights need at least 2 dimensions, expected ",
                shape_str(expected));
  const int64_t cols = expected.back();
  const bool four_bit = weight.format != WeightFormat::Mxfp8;
  const int64_t group = scale_group(weight.format);
  Shape data_shape = expected, scale_shape = expected;
  if (four_bit) data_shape.back() = cpu::fp4_packed_bytes(cols);
  scale_shape.back() = ceil_div(cols, group);
  SPARROW_CHECK(data.shape == data_shape, "tensor '", name, "' (", format, "): expected ", four_bit ? "packed " : "",
                "shape ", shape_str(data_shape), " for the weight ", shape_str(expected), ", found ",
                shape_str(data.shape), " (in ", data.file, ")");
  const TensorInfo& scale = *weight.scale;
  SPARROW_CHECK(scale.shape == scale_shape, "tensor '", scale.name, "': expected shape ", shape_str(scale_shape),
                " (one scale per ", group, " values), found ", shape_str(scale.shape), " (in ", scale.file, ")");
  float scale_2 = 1.0f;
  if (weight.scale_2) {
    SPARROW_CHECK(weight.scale_2->dtype == DType::F32 && shape_numel(weight.scale_2->shape) == 1, "tensor '",
                  weight.scale_2->name, "': expected one F32 value, found ", dtype_name(weight.scale_2->dtype), " ",
                  shape_str(weight.scale_2->shape), " (in ", weight.scale_2->file, ")");
    std::memcpy(&scale_2, weight.scale_2->data, sizeof(float));
    mark_taken(weight.scale_2->name);
  }
  if (weight.input_scale) mark_taken(weight.input_scale->name);
  mark_taken(name);
  mark_taken(scale.name);
  return scale_2;
}

Tensor Checkpoint::dequantize_packed(const Stored& weight, const Shape& expected) {
  const float scale_2 = take_packed(weight, expected);
  const TensorInfo& data = *weight.data;
  const TensorInfo& scale = *weight.scale;
  const int64_t cols = expected.back();
  const int64_t group = scale_group(weight.format);
  Tensor out = Tensor::empty(expected);
  const auto* codes = static_cast<const uint8_t*>(data.data);
  const auto* scales = static_cast<const uint8_t*>(scale.data);
  const int64_t rows = shape_numel(expected) / std::max<int64_t>(cols, 1);
  const int64_t row_bytes = data.shape.back(), scale_cols = ceil_div(cols, group);
  parallel_for(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row_codes = codes + r * row_bytes;
      const uint8_t* row_scales = scales + r * scale_cols;
      float* row = out.data() + r * cols;
      if (weight.format == WeightFormat::Mxfp8)
        dequantize_mxfp8(row_codes, row_scales, cols, row);
      else if (weight.format == WeightFormat::Nvfp4)
        dequantize_nvfp4(row_codes, row_scales, scale_2, cols, row);
      else
        cpu::mxfp4_dequantize(row_codes, row_scales, cols, row);
    }
  });
  return out;
}

// w[..., i, j] = e4m3[..., i, j] * scale_inv[..., i / block_rows, j / block_cols], in fp32 as DeepSeek's
// weight_dequant and transformers' Fp8Dequantize do. Edge blocks may be partial (rows or cols not a
// multiple of the block size); leading dimensions (the experts of a fused tensor) have their own scales.
Tensor Checkpoint::dequantize_fp8(const TensorInfo& weight, const std::string& scale_name) {
  SPARROW_CHECK(weight.shape.size() >= 2, "tensor '", weight.name, "': FP8 weights need at least 2 dimensions, found ",
                shape_str(weight.shape), " (in ", weight.file, ")");
  const int64_t rows = weight.shape[weight.shape.size() - 2];
  const int64_t cols = weight.shape.back();
  Shape scale_shape = weight.shape;
  const int64_t block_rows = quantization_.block_rows, block_cols = quantization_.block_cols;
  scale_shape[scale_shape.size() - 2] = ceil_div(rows, block_rows);
  scale_shape.back() = ceil_div(cols, block_cols);
  const Tensor scale = take_host(scale_name, scale_shape);

  Tensor out = to_float32(weight, nullptr);  // a fresh buffer: E4M3 values, exact in fp32
  const int64_t scale_rows = scale_shape[scale_shape.size() - 2];
  const int64_t scale_cols = scale_shape.back();
  const int64_t total_rows = (rows == 0 || cols == 0) ? 0 : out.numel() / cols;
  parallel_for(total_rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t matrix = r / rows, i = r % rows;
      const float* scale_row = scale.data() + (matrix * scale_rows + i / block_rows) * scale_cols;
      float* row = out.data() + r * cols;
      for (int64_t j = 0; j < cols; ++j) row[j] *= scale_row[j / block_cols];
    }
  });
  return out;
}

const Checkpoint::ExpertNames* Checkpoint::expert_names(const std::string& prefix) const {
  // Per-expert tensors, under transformers' names or the releases'.
  const ExpertNames* names = has(prefix + ".0.gate_proj.weight") ? &kTransformersExpertNames
                             : has(prefix + ".0.w1.weight")      ? &kReleaseExpertNames
                                                                 : nullptr;
  SPARROW_CHECK(names, "missing experts '", prefix, "': neither '", prefix, ".gate_up_proj' nor '", prefix,
                ".0.gate_proj.weight' (or '.0.w1.weight') in ", dir_);
  return names;
}

Checkpoint::Experts Checkpoint::take_experts(const std::string& prefix, int64_t E, int64_t I, int64_t H,
                                             const Split& intermediate_split) {
  if (intermediate_split.whole()) return take_experts(prefix, E, I, H);
  const int64_t begin = intermediate_split.begin, end = intermediate_split.end;
  // LoRA adapters name each expert's projections (model/lora.h): this rank's part under those names, also
  // where the checkpoint stacks the experts.
  const ExpertNames* lora_names =
      dummy_ || has(prefix + ".gate_up_proj") ? &kTransformersExpertNames : expert_names(prefix);
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = cat(prefix, ".", e, ".");
    splits_[expert + lora_names->gate + ".weight"] = splits_[expert + lora_names->up + ".weight"] = Split{0, begin, end};
    splits_[expert + lora_names->down + ".weight"] = Split{1, begin, end};
  }
  if (dummy_ || has(prefix + ".gate_up_proj"))
    return {take(prefix + ".gate_up_proj", {E, 2 * I, H}, Split{1, begin, end, 2}),
            take(prefix + ".down_proj", {E, H, I}, Split{2, begin, end, 1})};
  // Per-expert tensors: each expert's part, stacked in fp32 on the host, then placed.
  const ExpertNames* names = expert_names(prefix);
  const int64_t part = end - begin;
  Experts experts{Tensor::empty({E, 2 * part, H}), Tensor::empty({E, H, part})};
  auto stack = [&](const std::string& name, const Shape& shape, const Split& split, float* to) {
    Tensor rows = slice_host(take_stored_host(name, shape), split).to(Device::Cpu, ScalarType::F32);
    std::memcpy(to, rows.data(), size_t(rows.numel()) * sizeof(float));
  };
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = cat(prefix, ".", e, ".");
    float* gate_up = experts.gate_up.row(e);
    stack(expert + names->gate + ".weight", {I, H}, Split{0, begin, end}, gate_up);
    stack(expert + names->up + ".weight", {I, H}, Split{0, begin, end}, gate_up + part * H);
    stack(expert + names->down + ".weight", {H, I}, Split{1, begin, end}, experts.down.row(e));
  }
  return {place(experts.gate_up), place(experts.down)};
}

Checkpoint::Experts Checkpoint::take_experts(const std::string& prefix, int64_t num_experts, int64_t intermediate,
                                             int64_t hidden) {
  return take_whole_experts(prefix, num_experts, intermediate, hidden, 0, num_experts);
}

Checkpoint::Experts Checkpoint::take_expert_range(const std::string& prefix, int64_t num_experts, int64_t intermediate,
                                                  int64_t hidden, const Split& experts) {
  if (experts.whole()) return take_experts(prefix, num_experts, intermediate, hidden);
  SPARROW_CHECK(experts.begin >= 0 && experts.begin < experts.end && experts.end <= num_experts, prefix,
                ": experts [", experts.begin, ", ", experts.end, ") of ", num_experts);
  return take_whole_experts(prefix, num_experts, intermediate, hidden, experts.begin, experts.end - experts.begin);
}

Checkpoint::Experts Checkpoint::take_whole_experts(const std::string& prefix, int64_t num_experts, int64_t intermediate,
                                                   int64_t hidden, int64_t first, int64_t count) {
  const int64_t E = count, I = intermediate, H = hidden;
  const bool all = first == 0 && count == num_experts;
  const Split mine{0, first, first + count};  // of a fused [num_experts, ...] tensor
  if (dummy_) {  // transformers' fused layout, FP8 as take_fp8_experts lays it out when the config asks
    if (device_ != Device::Cpu && dummy_experts_ != WeightFormat::Dense && I % 32 == 0 && H % 32 == 0)
      return {dummy_grouped(prefix + ".gate_up_proj", {E, 2 * I, H}, dummy_experts_, {E, 2}),
              dummy_grouped(prefix + ".down_proj", {E, H, I}, dummy_experts_, {E})};
    if (device_ != Device::Cpu && dummy_fp8_ && I % 16 == 0 && H % 16 == 0) {
      const int64_t ib = ceil_div(I, 128), hb = ceil_div(H, 128);
      return {dummy_fp8(prefix + ".gate_up_proj", {E, 2 * I, H}, {E, 2, ib, hb}),
              dummy_fp8(prefix + ".down_proj", {E, H, I}, {E, hb, ib})};
    }
    return {take(prefix + ".gate_up_proj", {E, 2 * I, H}), take(prefix + ".down_proj", {E, H, I})};
  }
  const bool gpu = device_ != Device::Cpu;
  if (has(prefix + ".gate_up_proj")) {
    // transformers' fused layout (e.g. DeepseekV32NaiveMoe.gate_up_proj): gate rows first, then up. On the
    // CPU bf16 stays a view of the mapped file.
    auto fused = [&](const std::string& name, const Shape& shape) {
      if (!all) return take(name, shape, mine);
      Tensor mapped = gpu ? Tensor() : take_mapped(name, shape, ScalarType::BF16);
      return mapped.defined() ? mapped : take(name, shape);
    };
    return {fused(prefix + ".gate_up_proj", {num_experts, 2 * I, H}), fused(prefix + ".down_proj", {num_experts, H, I})};
  }
  const ExpertNames* names = expert_names(prefix);
  for (int64_t e = 0; e < num_experts; ++e)  // another rank's: never read, and not unexpected
    if (e < first || e >= first + count) left_prefixes_.push_back(cat(prefix, ".", e, "."));
  const std::string first_gate = cat(prefix, ".", first, ".", names->gate, ".weight");
  // Experts stay as stored (the CPU widens one expert per product, kernels/cpu/stored_weights.h). On a GPU
  // the FP8 expert kernel reads rows in 16-byte pieces (I and H multiples of 16) and the MX / NV ones whole
  // 32-value groups (multiples of 32).
  const WeightFormat format = stored(first_gate).format;
  if (format == WeightFormat::Fp8Block && quantization_.block_rows == 128 && quantization_.block_cols == 128 &&
      (!gpu || (I % 16 == 0 && H % 16 == 0)))
    return take_fp8_experts(prefix, first, E, I, H, names->gate, names->up, names->down);
  const int64_t whole = gpu ? 32 : group_scaled(format) ? scale_group(format) : 1;  // whole scale groups
  if (group_scaled(format) && I % whole == 0 && H % whole == 0)
    return take_grouped_experts(prefix, first, E, I, H, names->gate, names->up, names->down, format);
  if (format == WeightFormat::Dense && index_.at(first_gate)->dtype == DType::BF16) {
    // bf16 experts are stacked where they are placed straight from the mapped files, one copy per matrix.
    Experts experts{Tensor::empty({E, 2 * I, H}, ScalarType::BF16, device_),
                    Tensor::empty({E, H, I}, ScalarType::BF16, device_)};
    const size_t bytes = static_cast<size_t>(I * H) * 2;
    auto upload = [&](const std::string& name, const Shape& shape, Tensor& stack, int64_t at) {
      Tensor mapped = take_mapped(name, shape, ScalarType::BF16);
      if (!mapped.defined()) mapped = take_host(name, shape).to(Device::Cpu, ScalarType::BF16);  // another layout
      uint8_t* to = static_cast<uint8_t*>(stack.raw()) + at * bytes;
      if (gpu) device::copy_to_device(to, mapped.raw(), bytes);
      else std::memcpy(to, mapped.raw(), bytes);
    };
    for (int64_t e = 0; e < E; ++e) {
      const std::string expert = cat(prefix, ".", first + e, ".");
      upload(expert + names->gate + ".weight", {I, H}, experts.gate_up, 2 * e);
      upload(expert + names->up + ".weight", {I, H}, experts.gate_up, 2 * e + 1);
      upload(expert + names->down + ".weight", {H, I}, experts.down, e);
    }
    return experts;
  }
  Experts experts{Tensor::empty({E, 2 * I, H}), Tensor::empty({E, H, I})};
  const size_t matrix_bytes = static_cast<size_t>(I * H) * sizeof(float);
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = cat(prefix, ".", first + e, ".");
    Tensor gate = take_host(expert + names->gate + ".weight", {I, H});
    Tensor up = take_host(expert + names->up + ".weight", {I, H});
    Tensor down = take_host(expert + names->down + ".weight", {H, I});
    float* gate_up = experts.gate_up.row(e);
    std::memcpy(gate_up, gate.data(), matrix_bytes);
    std::memcpy(gate_up + I * H, up.data(), matrix_bytes);
    std::memcpy(experts.down.row(e), down.data(), matrix_bytes);
  }
  return {place(experts.gate_up), place(experts.down)};
}

// On a GPU, FP8 experts stay FP8 (kernels/cuda/moe/moe.h moe_experts_fp8): codes stacked as
// gate_up [E, 2I, H] and down [E, H, I]; the gate's and the up's block scales kept apart as
// [E, 2, ceil(I/128), ceil(H/128)] (their 128-row blocks need not line up once stacked), down's as
// [E, ceil(H/128), ceil(I/128)].
Checkpoint::Experts Checkpoint::take_fp8_experts(const std::string& prefix, int64_t first, int64_t E, int64_t I,
                                                 int64_t H, const char* gate_name, const char* up_name,
                                                 const char* down_name) {
  const int64_t ib = ceil_div(I, 128), hb = ceil_div(H, 128);
  Tensor gate_up = Tensor::empty({E, 2 * I, H}, ScalarType::F8E4M3), down = Tensor::empty({E, H, I}, ScalarType::F8E4M3);
  Tensor gate_up_scales = Tensor::empty({E, 2, ib, hb}), down_scales = Tensor::empty({E, hb, ib});
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = cat(prefix, ".", first + e, ".");
    Tensor scales;
    Tensor codes = take_fp8_codes(expert + gate_name + ".weight", {I, H}, scales);
    std::memcpy(gate_up.as<uint8_t>() + e * 2 * I * H, codes.raw(), size_t(I * H));
    std::memcpy(gate_up_scales.data() + (e * 2 + 0) * ib * hb, scales.data(), size_t(ib * hb) * sizeof(float));
    codes = take_fp8_codes(expert + up_name + ".weight", {I, H}, scales);
    std::memcpy(gate_up.as<uint8_t>() + e * 2 * I * H + I * H, codes.raw(), size_t(I * H));
    std::memcpy(gate_up_scales.data() + (e * 2 + 1) * ib * hb, scales.data(), size_t(ib * hb) * sizeof(float));
    codes = take_fp8_codes(expert + down_name + ".weight", {H, I}, scales);
    std::memcpy(down.as<uint8_t>() + e * H * I, codes.raw(), size_t(H * I));
    std::memcpy(down_scales.data() + e * hb * ib, scales.data(), size_t(hb * ib) * sizeof(float));
  }
  return {gate_up.with_block_scales(gate_up_scales).to(device_), down.with_block_scales(down_scales).to(device_)};
}

// On a GPU, MX / NV experts stay as stored (kernels/cuda/moe/moe.h moe_experts_packed): codes stacked as
// gate_up [E, 2I, H] and down [E, H, I] (FP4: H / 2 and I / 2 bytes, two codes each), their group scales
// as [E, 2I, H/g] and [E, H, I/g] (g = 16 NVFP4, 32 MXFP4 and MXFP8) and NVFP4's weight_scale_2 as [E, 2]
// (gate, up) and [E].
Checkpoint::Experts Checkpoint::take_grouped_experts(const std::string& prefix, int64_t first, int64_t E, int64_t I,
                                                     int64_t H, const char* gate_name, const char* up_name,
                                                     const char* down_name, WeightFormat format) {
  const bool nvfp4 = format == WeightFormat::Nvfp4, fp4 = format != WeightFormat::Mxfp8;
  const int64_t group = scale_group(format), per_byte = fp4 ? 2 : 1;
  const ScalarType code_type = fp4 ? ScalarType::E2M1x2 : ScalarType::F8E4M3;
  const ScalarType scale_type = nvfp4 ? ScalarType::F8E4M3 : ScalarType::F8E8M0;
  Tensor gate_up = Tensor::empty({E, 2 * I, H / per_byte}, code_type);
  Tensor down = Tensor::empty({E, H, I / per_byte}, code_type);
  Tensor gate_up_scales = Tensor::empty({E, 2 * I, H / group}, scale_type);
  Tensor down_scales = Tensor::empty({E, H, I / group}, scale_type);
  Tensor gate_up_global = nvfp4 ? Tensor::empty({E, 2}) : Tensor();
  Tensor down_global = nvfp4 ? Tensor::empty({E}) : Tensor();
  // One matrix [rows, cols] into the stacks at row `at` (its codes, its scales, its global scale).
  auto stack = [&](const std::string& name, int64_t rows, int64_t cols, Tensor& codes, Tensor& scales, int64_t at,
                   float* global) {
    const Stored weight = stored(name);
    SPARROW_CHECK(weight.format == format, "tensor '", name, "': stored as ", weight_format_name(weight.format),
                  ", the other experts as ", weight_format_name(format));
    const float scale_2 = take_packed(weight, {rows, cols});
    std::memcpy(codes.as<uint8_t>() + at * (cols / per_byte), weight.data->data, size_t(rows * cols / per_byte));
    std::memcpy(scales.as<uint8_t>() + at * (cols / group), weight.scale->data, size_t(rows * cols / group));
    if (global) *global = scale_2;
  };
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = cat(prefix, ".", first + e, ".");
    float* g = nvfp4 ? gate_up_global.data() + 2 * e : nullptr;
    stack(expert + gate_name + ".weight", I, H, gate_up, gate_up_scales, 2 * e * I, g);
    stack(expert + up_name + ".weight", I, H, gate_up, gate_up_scales, (2 * e + 1) * I, g ? g + 1 : nullptr);
    stack(expert + down_name + ".weight", H, I, down, down_scales, e * H, nvfp4 ? down_global.data() + e : nullptr);
  }
  return {gate_up.with_group_scales(gate_up_scales, gate_up_global).to(device_),
          down.with_group_scales(down_scales, down_global).to(device_)};
}

void Checkpoint::finish(const std::vector<std::string>& ignore_prefixes) {
  if (dummy_) return;  // it held exactly what was taken
  std::vector<std::string> unexpected;
  for (const auto& [name, info] : index_) {
    if (taken_.count(name) || starts_with_any(name, ignore_prefixes) || starts_with_any(name, left_prefixes_)) continue;
    // A weight's block scales belong to it even when the weight itself needed none.
    if (name.ends_with(kScaleSuffix) && taken_.count(name.substr(0, name.size() - std::strlen(kScaleSuffix)))) continue;
    unexpected.push_back(name);
  }
  if (unexpected.empty()) return;
  const TensorInfo& first = *index_.at(unexpected[0]);
  if (unexpected.size() == 1) fail("unexpected tensor '", first.name, "' in ", first.file);
  fail("unexpected tensor '", first.name, "' in ", first.file, " (and ", unexpected.size() - 1, " more never taken)");
}

}  // namespace sparrow
