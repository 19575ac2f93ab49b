#include "core/tensor.h"

#include <cstring>

#include "core/bfloat16.h"
#include "core/error.h"

#include "core/device/device.h"

namespace sparrow {

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const char* device_name(Device device) { return device == Device::Cpu ? "cpu" : "cuda"; }

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::Cpu;
  if (name == "cuda") {
    device::require();  // in a build without the CUDA backend: says so
    return Device::Cuda;
  }
  fail("unknown device '", name, "' (expected cpu or cuda)");
}

int64_t scalar_size(ScalarType type) {
  switch (type) {
    case ScalarType::F32: return 4;
    case ScalarType::BF16: return 2;
    case ScalarType::I32: return 4;
    case ScalarType::I64: return 8;
    case ScalarType::U8: return 1;
    case ScalarType::F8E4M3: return 1;
    case ScalarType::E2M1x2: return 1;
    case ScalarType::F8E8M0: return 1;
  }
  return 0;
}

const char* scalar_name(ScalarType type) {
  switch (type) {
    case ScalarType::F32: return "float32";
    case ScalarType::BF16: return "bfloat16";
    case ScalarType::I32: return "int32";
    case ScalarType::I64: return "int64";
    case ScalarType::U8: return "uint8";
    case ScalarType::F8E4M3: return "float8_e4m3fn";
    case ScalarType::E2M1x2: return "float4_e2m1fn_x2";
    case ScalarType::F8E8M0: return "float8_e8m0fnu";
  }
  return "?";
}

Tensor Tensor::empty(Shape shape, ScalarType type, Device device) {
  Tensor t;
  const int64_t n = shape_numel(shape);
  SPARROW_CHECK(n >= 0, "tensor with negative size ", shape_str(shape));
  const size_t bytes = size_t(n > 0 ? n : 1) * size_t(scalar_size(type));
  if (device == Device::Cpu) {
    // 64-byte aligned host memory (AVX loads, and bytes the GPU copies from).
    void* p = ::operator new[](bytes, std::align_val_t(64));
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { ::operator delete[](q, std::align_val_t(64)); });
  } else {
    void* p = device::alloc(bytes);
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { device::free(q); });
  }
  t.data_ = t.storage_.get();
  t.shape_ = std::move(shape);
  t.type_ = type;
  t.device_ = device;
  return t;
}

Tensor Tensor::zeros(Shape shape, ScalarType type, Device device) {
  Tensor t = empty(std::move(shape), type, device);
  if (device == Device::Cpu) {
    std::memset(t.data_, 0, t.nbytes());
  } else {
    device::zero(t.data_, size_t(t.nbytes()));
  }
  return t;
}

Tensor Tensor::view(float* data, Shape shape, std::shared_ptr<void> keep_alive) {
  Tensor t;
  t.data_ = data;
  t.shape_ = std::move(shape);
  t.storage_ = std::move(keep_alive);
  return t;
}

Tensor Tensor::view(void* data, Shape shape, ScalarType type, std::shared_ptr<void> keep_alive) {
  Tensor t = view(static_cast<float*>(data), std::move(shape), std::move(keep_alive));
  t.type_ = type;
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  SPARROW_CHECK(shape_numel(shape) == numel(), "cannot reshape ", shape_str(shape_), " to ", shape_str(shape));
  Tensor t = *this;
  t.block_scales_.reset();  // a part or reshape of a quantized matrix no longer matches its scales
  t.global_scales_.reset();
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::view_bytes(int64_t byte_offset, Shape shape, ScalarType type) const {
  const int64_t bytes = shape_numel(shape) * scalar_size(type);
  SPARROW_CHECK(byte_offset >= 0 && byte_offset + bytes <= nbytes(), "view_bytes: ", bytes, " bytes at ", byte_offset,
                " exceed the tensor's ", nbytes());
  Tensor t = *this;
  t.block_scales_.reset();  // a part or reshape of a quantized matrix no longer matches its scales
  t.global_scales_.reset();
  t.data_ = static_cast<char*>(data_) + byte_offset;
  t.shape_ = std::move(shape);
  t.type_ = type;
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  SPARROW_CHECK(!shape_.empty() && begin >= 0 && begin <= end && end <= shape_[0], "rows [", begin, ", ", end,
                ") out of range for ", shape_str(shape_));
  Tensor t = *this;
  t.block_scales_.reset();  // a part or reshape of a quantized matrix no longer matches its scales
  t.global_scales_.reset();
  t.data_ = static_cast<char*>(data_) + begin * row_size() * scalar_size(type_);
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, type_, device_);
  if (numel() == 0) return t;
  if (device_ == Device::Cpu) {
    std::memcpy(t.data_, data_, nbytes());
  } else {
    device::copy_device(t.data_, data_, nbytes());
  }
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  SPARROW_CHECK(src.type_ == type_ && src.numel() == numel(), "copy_from: ", scalar_name(src.type_), " ",
                shape_str(src.shape_), " into ", scalar_name(type_), " ", shape_str(shape_));
  if (numel() == 0) return;
  if (device_ == Device::Cpu && src.device_ == Device::Cpu) {
    std::memcpy(data_, src.data_, nbytes());
    return;
  }
  if (src.device_ == Device::Cpu) device::copy_to_device(data_, src.data_, nbytes());
  else if (device_ == Device::Cpu) device::copy_to_host_sync(data_, src.data_, nbytes());
  else device::copy_device(data_, src.data_, nbytes());
}

namespace {

// Host-side type conversion between float32 and bfloat16 (other types only copy).
Tensor convert_on_host(const Tensor& x, ScalarType type) {
  Tensor out = Tensor::empty(x.shape(), type);
  const int64_t n = x.numel();
  if (x.type() == ScalarType::F32 && type == ScalarType::BF16) {
    for (int64_t i = 0; i < n; ++i) out.as<uint16_t>()[i] = float_to_bf16(x.as<float>()[i]);
  } else if (x.type() == ScalarType::BF16 && type == ScalarType::F32) {
    for (int64_t i = 0; i < n; ++i) out.as<float>()[i] = bf16_to_float(x.as<uint16_t>()[i]);
  } else {
    fail("cannot convert ", scalar_name(x.type()), " to ", scalar_name(type));
  }
  return out;
}

}  // namespace

void Tensor::fail_not_f32() const {
  fail("data(): the elements of a ", scalar_name(type_), " tensor ", shape_str(shape_), " are not fp32");
}

const Tensor& Tensor::block_scales() const {
  static const Tensor none;
  return block_scales_ ? *block_scales_ : none;
}

Tensor Tensor::with_block_scales(Tensor scales) const {
  // A matrix's scales are [ceil(rows/128), ceil(cols/128)]; stacked experts document their own layout
  // (kernels/cuda/moe/moe.h).
  const bool matrix_ok = ndim() != 2 || (scales.ndim() == 2 && scales.dim(0) == (dim(0) + 127) / 128 &&
                                         scales.dim(1) == (dim(1) + 127) / 128);
  SPARROW_CHECK(type_ == ScalarType::F8E4M3 && ndim() >= 2 && scales.type() == ScalarType::F32 && matrix_ok,
                "with_block_scales: an FP8 matrix ", shape_str(shape_), " takes fp32 scales [", (dim(0) + 127) / 128,
                ", ", (dim(1) + 127) / 128, "], got ", scalar_name(scales.type()), " ", shape_str(scales.shape()));
  Tensor t = *this;
  t.block_scales_ = std::make_shared<const Tensor>(std::move(scales));
  return t;
}

Tensor Tensor::with_group_scales(Tensor groups, Tensor global) const {
  const bool fp4 = type_ == ScalarType::E2M1x2, nvfp4 = fp4 && groups.type() == ScalarType::F8E4M3;
  const int64_t group = nvfp4 ? 16 : 32;
  const int64_t cols = ndim() >= 1 ? (fp4 ? 2 * dim(-1) : dim(-1)) : 0;
  bool shape_ok = (fp4 || type_ == ScalarType::F8E4M3) && ndim() >= 2 && groups.ndim() == ndim() &&
                  (nvfp4 || groups.type() == ScalarType::F8E8M0) && cols % group == 0 && groups.dim(-1) == cols / group;
  for (int i = 0; shape_ok && i + 1 < ndim(); ++i) shape_ok = groups.dim(i) == dim(i);
  SPARROW_CHECK(shape_ok, "with_group_scales: codes ", scalar_name(type_), " ", shape_str(shape_),
                " take F8E4M3 scales per 16 values (NVFP4) or F8E8M0 scales per 32 (MXFP4 and MXFP8), got ",
                scalar_name(groups.type()), " ", shape_str(groups.shape()));
  SPARROW_CHECK(nvfp4 == global.defined() && (!global.defined() || global.type() == ScalarType::F32),
                "with_group_scales: NVFP4 weights take fp32 global scales, MXFP4 and MXFP8 weights none");
  Tensor t = *this;
  t.block_scales_ = std::make_shared<const Tensor>(std::move(groups));
  t.global_scales_ = global.defined() ? std::make_shared<const Tensor>(std::move(global)) : nullptr;
  return t;
}

const Tensor& Tensor::global_scales() const {
  static const Tensor none;
  return global_scales_ ? *global_scales_ : none;
}

Tensor Tensor::to(Device device, ScalarType type) const {
  if (device == device_ && type == type_) return *this;
  auto coded = [](ScalarType t) {
    return t == ScalarType::F8E4M3 || t == ScalarType::E2M1x2 || t == ScalarType::F8E8M0;
  };
  if (coded(type_) || coded(type)) {
    // Quantized weights move between devices as they are, scales along; nothing converts to or from
    // their codes here.
    SPARROW_CHECK(type == type_, "cannot convert ", scalar_name(type_), " to ", scalar_name(type));
    Tensor out = empty(shape_, type, device);
    out.copy_from(*this);
    if (block_scales_) out.block_scales_ = std::make_shared<const Tensor>(block_scales_->to(device));
    if (global_scales_) out.global_scales_ = std::make_shared<const Tensor>(global_scales_->to(device));
    return out;
  }
  if (device_ == Device::Cpu && device == Device::Cpu) return convert_on_host(*this, type);
  if (device_ == Device::Cpu) {  // host -> device: convert on the host (halves the bytes sent for bf16)
    Tensor host = type == type_ ? *this : convert_on_host(*this, type);
    Tensor out = empty(shape_, type, Device::Cuda);
    // From pageable memory the copy returns once the bytes are staged, so `host` may be freed at once
    // (CUDA runtime API, "API synchronization behavior"): no wait for the device.
    device::copy_to_device(out.data_, host.data_, out.nbytes());
    return out;
  }
  // device -> host, or between types on the device: the bytes come to the host as they are and convert
  // there. The runtime runs no kernels (the GPU's conversion kernels are ops, kernels/ops.h); nothing
  // on a step's path converts a device tensor through here.
  Tensor raw = empty(shape_, type_, Device::Cpu);
  device::copy_to_host_sync(raw.data_, data_, nbytes());
  Tensor host = type == type_ ? raw : convert_on_host(raw, type);
  return device == Device::Cpu ? host : host.to(device, type);
}

}  // namespace sparrow
