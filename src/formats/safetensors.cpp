#include "formats/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/bfloat16.h"
#include "core/error.h"
#include "core/parallel.h"

namespace sparrow {

// safetensors stores little-endian data and we read it in place.
static_assert(std::endian::native == std::endian::little,
              "sparrow reads safetensors data in place: little-endian only");

namespace {

struct DTypeEntry {
  DType dtype;
  const char* name;  // as spelled in the safetensors header
  size_t size;
};

constexpr DTypeEntry kDTypes[] = {
    {DType::F32, "F32", 4},   {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2},       {DType::F8_E4M3, "F8_E4M3", 1},
    {DType::I32, "I32", 4},   {DType::I64, "I64", 8}, {DType::U8, "U8", 1},           {DType::I8, "I8", 1},
    {DType::BOOL, "BOOL", 1}, {DType::F64, "F64", 8}, {DType::F8_E5M2, "F8_E5M2", 1}, {DType::F8_E8M0, "F8_E8M0", 1},
    {DType::I16, "I16", 2},   {DType::U16, "U16", 2}, {DType::U32, "U32", 4},         {DType::U64, "U64", 8},
};

const DTypeEntry& dtype_entry(DType t) {
  for (const DTypeEntry& entry : kDTypes)
    if (entry.dtype == t) return entry;
  fail("unknown dtype ", static_cast<int>(t));
}

// A non-negative JSON integer that fits in int64 (shapes and offsets); false for anything else.
bool to_size(const nlohmann::json& value, int64_t* out) {
  if (!value.is_number_unsigned()) return false;  // nlohmann parses every non-negative integer as unsigned
  uint64_t u = value.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = static_cast<int64_t>(u);
  return true;
}

// ---- Exact conversions to fp32 (every source value is representable in fp32) ----

float bits_to_float(uint32_t bits) { return std::bit_cast<float>(bits); }

// bf16 widening (core/bfloat16.h) is a shift: subnormals, inf and NaN included.

// IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
float f16_to_float(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  uint32_t exponent = (bits >> 10) & 0x1F;
  uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000 | (mantissa << 13));  // inf, NaN (payload kept)
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in fp32 (the mantissa has at most 10 bits).
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

// OCP FP8 E4M3 "fn": 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, only
// S.1111.111 (0x7F, 0xFF) is NaN, so the largest value is 0x7E = 448.
float e4m3_to_float(uint8_t code) {
  int exponent = (code >> 3) & 0xF;
  int mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 7 - 3);  // (1 + m/8) * 2^(e-7)
  }
  return (code & 0x80) ? -magnitude : magnitude;
}

// E8M0: an unsigned, biased exponent byte, 2^(code - 127); 0xFF is NaN.
float e8m0_to_float(uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

template <typename Code>
std::array<float, 256> byte_table(float (*decode)(Code)) {
  std::array<float, 256> table;
  for (int code = 0; code < 256; ++code) table[code] = decode(static_cast<Code>(code));
  return table;
}

// Converts n elements of `Source` (read with memcpy: the mapping gives no alignment guarantee) with `decode`.
template <typename Source, typename Decode>
void convert(const uint8_t* src, float* dst, int64_t n, Decode decode) {
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      Source value;
      std::memcpy(&value, src + i * sizeof(Source), sizeof(Source));
      dst[i] = decode(value);
    }
  });
}

std::string corrupt(const std::string& path) { return path + ": corrupt safetensors header: "; }

}  // namespace

const char* dtype_name(DType t) { return dtype_entry(t).name; }
size_t dtype_size(DType t) { return dtype_entry(t).size; }

bool parse_dtype(const std::string& name, DType* out) {
  for (const DTypeEntry& entry : kDTypes) {
    if (name == entry.name) {
      *out = entry.dtype;
      return true;
    }
  }
  return false;
}

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SPARROW_CHECK(fd >= 0, path, ": cannot open (", std::strerror(errno), ")");
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(path, ": truncated safetensors file (", size, " bytes, shorter than the 8-byte header length)");
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping stays valid without the descriptor
  SPARROW_CHECK(map != MAP_FAILED, path, ": cannot memory-map (", std::strerror(errno), ")");
  file->map_ = map;  // from here on the destructor unmaps, also when parsing fails
  file->size_ = size;
  const uint8_t* bytes = static_cast<const uint8_t*>(map);

  uint64_t header_length;
  std::memcpy(&header_length, bytes, 8);
  SPARROW_CHECK(header_length <= size - 8, path, ": truncated safetensors file (header length ", header_length,
                " but only ", size - 8, " bytes follow)");
  const char* header_text = reinterpret_cast<const char*>(bytes + 8);
  nlohmann::json header = nlohmann::json::parse(header_text, header_text + header_length, nullptr,
                                                /*allow_exceptions=*/false);
  SPARROW_CHECK(!header.is_discarded(), corrupt(path), "not valid JSON");
  SPARROW_CHECK(header.is_object(), corrupt(path), "not a JSON object");

  const uint8_t* data = bytes + 8 + header_length;
  const uint64_t data_size = size - 8 - header_length;
  struct Extent {
    int64_t begin, end;
    const std::string* name;
  };
  std::vector<Extent> extents;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;  // free-form string map; nothing we need
    std::string where = corrupt(path) + "tensor '" + name + "': ";
    SPARROW_CHECK(entry.is_object(), where, "expected an object");

    auto dtype_it = entry.find("dtype");
    SPARROW_CHECK(dtype_it != entry.end() && dtype_it->is_string(), where, "missing dtype");
    DType dtype;
    SPARROW_CHECK(parse_dtype(dtype_it->get<std::string>(), &dtype), where, "unknown dtype ", dtype_it->dump());

    auto shape_it = entry.find("shape");
    SPARROW_CHECK(shape_it != entry.end() && shape_it->is_array(), where, "missing shape");
    Shape shape;
    int64_t numel = 1;
    for (const nlohmann::json& dim : *shape_it) {
      int64_t extent;
      SPARROW_CHECK(to_size(dim, &extent), where, "shape ", shape_it->dump(), " must hold non-negative integers");
      SPARROW_CHECK(!__builtin_mul_overflow(numel, extent, &numel), where, "shape ", shape_it->dump(), " is too large");
      shape.push_back(extent);
    }
    int64_t nbytes;
    SPARROW_CHECK(!__builtin_mul_overflow(numel, static_cast<int64_t>(dtype_size(dtype)), &nbytes), where, "shape ",
                  shape_it->dump(), " is too large");

    auto offsets_it = entry.find("data_offsets");
    SPARROW_CHECK(offsets_it != entry.end() && offsets_it->is_array() && offsets_it->size() == 2, where,
                  "data_offsets must be [begin, end]");
    int64_t begin, end;
    SPARROW_CHECK(to_size((*offsets_it)[0], &begin) && to_size((*offsets_it)[1], &end) && begin <= end, where,
                  "data_offsets ", offsets_it->dump(), " must be non-negative integers with begin <= end");
    SPARROW_CHECK(static_cast<uint64_t>(end) <= data_size, path, ": truncated safetensors file: tensor '", name,
                  "' ends at byte ", end, " of the data but the data has only ", data_size, " bytes");
    SPARROW_CHECK(end - begin == nbytes, where, "data_offsets ", offsets_it->dump(), " hold ", end - begin,
                  " bytes but ", dtype_name(dtype), " ", shape_str(shape), " needs ", nbytes);

    TensorInfo info{name, dtype, std::move(shape), data + begin, static_cast<size_t>(nbytes), path};
    auto [it, inserted] = file->tensors_.emplace(name, std::move(info));
    extents.push_back({begin, end, &it->first});
  }

  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < extents.size(); ++i) {
    SPARROW_CHECK(extents[i].begin >= extents[i - 1].end, corrupt(path), "tensors '", *extents[i - 1].name, "' and '",
                  *extents[i].name, "' overlap");
  }
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, size_);
}

Tensor to_float32(const TensorInfo& info, std::shared_ptr<void> keep_alive) {
  const int64_t n = shape_numel(info.shape);
  if (info.dtype == DType::F32 && reinterpret_cast<uintptr_t>(info.data) % alignof(float) == 0) {
    // Zero copy: the mapping is read-only, so the view must not be written through.
    return Tensor::view(reinterpret_cast<float*>(const_cast<uint8_t*>(info.data)), info.shape, std::move(keep_alive));
  }
  Tensor out = Tensor::empty(info.shape);
  float* dst = out.data();
  switch (info.dtype) {
    case DType::F32:  // not 4-byte aligned in the file: copy
      if (n > 0) std::memcpy(dst, info.data, static_cast<size_t>(n) * sizeof(float));
      break;
    case DType::BF16:
      convert<uint16_t>(info.data, dst, n, bf16_to_float);
      break;
    case DType::F16:
      convert<uint16_t>(info.data, dst, n, f16_to_float);
      break;
    case DType::F8_E4M3: {
      static const std::array<float, 256> table = byte_table(e4m3_to_float);
      convert<uint8_t>(info.data, dst, n, [](uint8_t code) { return table[code]; });
      break;
    }
    case DType::F8_E8M0: {
      static const std::array<float, 256> table = byte_table(e8m0_to_float);
      convert<uint8_t>(info.data, dst, n, [](uint8_t code) { return table[code]; });
      break;
    }
    default:
      fail("tensor '", info.name, "' in ", info.file, ": unsupported dtype ", dtype_name(info.dtype),
           " (expected F32, F16, BF16 or F8_E4M3)");
  }
  return out;
}

namespace {

// The safetensors dtype a tensor is written as (FP4 codes as the releases store them: U8 pairs).
const char* stored_dtype(ScalarType type) {
  switch (type) {
    case ScalarType::F32: return "F32";
    case ScalarType::BF16: return "BF16";
    case ScalarType::I32: return "I32";
    case ScalarType::I64: return "I64";
    case ScalarType::U8: return "U8";
    case ScalarType::E2M1x2: return "U8";
    case ScalarType::F8E4M3: return "F8_E4M3";
    case ScalarType::F8E8M0: return "F8_E8M0";
  }
  return "?";
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  // Keys keep the order given, and the data follows in that same order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::set<std::string> names;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    SPARROW_CHECK(name != "__metadata__" && names.insert(name).second, path, ": cannot write tensor name '", name,
                  "' twice (or the reserved name __metadata__)");
    SPARROW_CHECK(tensor.defined() && tensor.on_cpu(), path, ": tensor '", name, "' has no host data");
    const int64_t nbytes = tensor.nbytes();
    header[name] = {{"dtype", stored_dtype(tensor.type())}, {"shape", tensor.shape()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  // Pad with spaces (the format allows trailing whitespace) so that the data starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t header_length = text.size();

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  SPARROW_CHECK(out, path, ": cannot open for writing");
  out.write(reinterpret_cast<const char*>(&header_length), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& [name, tensor] : tensors)
    out.write(static_cast<const char*>(tensor.raw()), static_cast<std::streamsize>(tensor.nbytes()));
  out.close();
  SPARROW_CHECK(out, path, ": write failed");
}

}  // namespace sparrow
