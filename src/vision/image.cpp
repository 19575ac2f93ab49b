#include "vision/image.h"

#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// jpeglib.h needs <cstdio> before it; jerror.h names the warning codes.
#include <jpeglib.h>
#include <jerror.h>
#include <png.h>
#include <webp/decode.h>

#include "core/error.h"

namespace sparrow::vision {
namespace {

void check_size(const char* format, int64_t height, int64_t width, const DecodeLimits& limits) {
  SPARROW_CHECK(height > 0 && width > 0, format, " image has no pixels (", width, "x", height, ")");
  SPARROW_CHECK(height * width <= limits.max_pixels, format, " image of ", width, "x", height, " = ",
                height * width, " pixels is over the limit of ", limits.max_pixels);
}

// Both C libraries report errors by longjmp. Each call into them runs inside `guarded`, whose frame is the
// jump's target and holds no C++ object, and the frames a jump skips (the library's, the callbacks', the
// lambda's) hold none either; the decoders themselves never call setjmp, so their locals are never clobbered.
template <typename JumpBuffer, typename Calls>
bool guarded(JumpBuffer& jump, Calls&& calls) {
  if (setjmp(jump)) return false;
  calls();
  return true;
}

// ---- PNG (libpng)

struct PngSource {
  const uint8_t* data;
  size_t size, at;
  char message[200];
};

void png_read_bytes(png_structp png, png_bytep out, png_size_t n) {
  auto* src = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > src->size - src->at) png_error(png, "the file ends early");
  std::memcpy(out, src->data + src->at, n);
  src->at += n;
}

void png_on_error(png_structp png, png_const_charp message) {
  auto* src = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(src->message, sizeof(src->message), "%s", message);
  png_longjmp(png, 1);
}

void png_on_warning(png_structp, png_const_charp) {}

struct PngHandles {
  png_structp png = nullptr;
  png_infop info = nullptr;
  ~PngHandles() { png_destroy_read_struct(&png, info ? &info : nullptr, nullptr); }
};

Image decode_png(std::string_view bytes, const DecodeLimits& limits) {
  PngSource src{reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), 0, {}};
  PngHandles h;
  h.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
  SPARROW_CHECK(h.png, "PNG: out of memory");
  h.info = png_create_info_struct(h.png);
  SPARROW_CHECK(h.info, "PNG: out of memory");
  png_set_read_fn(h.png, &src, png_read_bytes);
  // Bounds libpng checks while reading the header, before the limit below is applied.
  png_set_user_limits(h.png, 1u << 20, 1u << 20);
  png_set_chunk_malloc_max(h.png, 64u << 20);

  // Palette -> RGB (with tRNS -> alpha, dropped below), grey below 8 bits -> 8 bits, as PIL's raw modes
  // unpack them (1-bit 0/255, 2-bit x85, 4-bit x17); 16-bit samples stay 16-bit for the rules below. Only a
  // palette image asks for expansion: libpng's expansion would also turn a grey or RGB image's tRNS into an
  // alpha channel, and a 16-bit grey image with one would then lose the clipping rule below.
  const bool read_header = guarded(png_jmpbuf(h.png), [&] {
    png_read_info(h.png, h.info);
    const int color_type = png_get_color_type(h.png, h.info);
    if (color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(h.png);
    if (color_type == PNG_COLOR_TYPE_GRAY && png_get_bit_depth(h.png, h.info) < 8)
      png_set_expand_gray_1_2_4_to_8(h.png);
    png_set_interlace_handling(h.png);
    png_read_update_info(h.png, h.info);
  });
  if (!read_header) fail("PNG: ", src.message);
  const uint32_t width = png_get_image_width(h.png, h.info), height = png_get_image_height(h.png, h.info);
  const int channels = png_get_channels(h.png, h.info), bit_depth = png_get_bit_depth(h.png, h.info);
  const size_t row_bytes = png_get_rowbytes(h.png, h.info);

  check_size("PNG", height, width, limits);
  SPARROW_CHECK((bit_depth == 8 || bit_depth == 16) && channels >= 1 && channels <= 4,
                "PNG: unsupported layout (", channels, " channels of ", bit_depth, " bits)");
  std::vector<uint8_t> raw(row_bytes * height);
  std::vector<png_bytep> rows(height);
  for (uint32_t y = 0; y < height; ++y) rows[y] = raw.data() + y * row_bytes;
  png_bytepp row_pointers = rows.data();
  if (!guarded(png_jmpbuf(h.png), [&] { png_read_image(h.png, row_pointers); })) fail("PNG: ", src.message);

  // To RGB as PIL's convert("RGB") does: alpha dropped; 16-bit colour and grey+alpha keep the high byte
  // ("RGB;16B", "LA;16B"); 16-bit grey is clipped at 255 (I;16 -> RGB).
  Image image{int64_t(height), int64_t(width), std::vector<uint8_t>(size_t(height) * width * 3)};
  const int bytes_per_sample = bit_depth / 8;
  for (uint32_t y = 0; y < height; ++y)
    for (uint32_t x = 0; x < width; ++x) {
      const uint8_t* s = rows[y] + size_t(x) * channels * bytes_per_sample;
      uint8_t* d = image.rgb.data() + (size_t(y) * width + x) * 3;
      if (channels >= 3) {
        for (int c = 0; c < 3; ++c) d[c] = s[c * bytes_per_sample];
      } else if (bit_depth == 16 && channels == 1) {
        d[0] = d[1] = d[2] = s[0] != 0 ? 255 : s[1];
      } else {
        d[0] = d[1] = d[2] = s[0];
      }
    }
  return image;
}

// ---- JPEG (libjpeg-turbo)

struct JpegError {
  jpeg_error_mgr manager;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_on_error(j_common_ptr info) {
  auto* error = reinterpret_cast<JpegError*>(info->err);
  info->err->format_message(info, error->message);
  std::longjmp(error->jump, 1);
}

// Warnings are ignored as PIL ignores them, except the one a truncated file gives (libjpeg pads it with grey
// and goes on; PIL refuses it: "image file is truncated").
void jpeg_on_message(j_common_ptr info, int level) {
  if (level == -1 && info->err->msg_code == JWRN_JPEG_EOF) jpeg_on_error(info);
}

struct JpegHandle {
  jpeg_decompress_struct info{};
  JpegError error{};
  bool created = false;
  ~JpegHandle() {
    if (created) jpeg_destroy_decompress(&info);
  }
};

Image decode_jpeg(std::string_view bytes, const DecodeLimits& limits) {
  JpegHandle h;
  h.info.err = jpeg_std_error(&h.error.manager);
  h.error.manager.error_exit = jpeg_on_error;
  h.error.manager.emit_message = jpeg_on_message;
  jpeg_create_decompress(&h.info);  // reports no error but running out of memory
  h.created = true;
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t size = bytes.size();
  if (!guarded(h.error.jump, [&] {
        jpeg_mem_src(&h.info, data, size);
        jpeg_read_header(&h.info, TRUE);
      }))
    fail("JPEG: ", h.error.message);
  const J_COLOR_SPACE space = h.info.jpeg_color_space;
  if (space == JCS_CMYK || space == JCS_YCCK) fail("JPEG: CMYK images are not supported; send RGB or grey");
  check_size("JPEG", h.info.image_height, h.info.image_width, limits);
  // The library's defaults are PIL's: accurate integer IDCT, fancy upsampling.
  h.info.out_color_space = JCS_RGB;
  if (!guarded(h.error.jump, [&] { jpeg_start_decompress(&h.info); })) fail("JPEG: ", h.error.message);
  Image image{h.info.output_height, h.info.output_width,
              std::vector<uint8_t>(size_t(h.info.output_height) * h.info.output_width * 3)};
  uint8_t* pixels = image.rgb.data();
  const size_t row_bytes = size_t(image.width) * 3;
  if (!guarded(h.error.jump, [&] {
        while (h.info.output_scanline < h.info.output_height) {
          JSAMPROW row = pixels + h.info.output_scanline * row_bytes;
          jpeg_read_scanlines(&h.info, &row, 1);
        }
        jpeg_finish_decompress(&h.info);
      }))
    fail("JPEG: ", h.error.message);
  return image;
}

// ---- WebP (libwebp): lossy and lossless, alpha dropped; PIL decodes through the same library with its
// defaults (fancy upsampling). An animation is refused: which frame would be meant is the client's choice.

Image decode_webp(std::string_view bytes, const DecodeLimits& limits) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  WebPBitstreamFeatures features;
  const VP8StatusCode status = WebPGetFeatures(data, bytes.size(), &features);
  SPARROW_CHECK(status == VP8_STATUS_OK, "WebP: ", status == VP8_STATUS_NOT_ENOUGH_DATA ? "the file ends early"
                                                                                       : "not a valid WebP file");
  SPARROW_CHECK(!features.has_animation, "WebP: animated images are not supported; send one frame");
  check_size("WebP", features.height, features.width, limits);
  Image image{features.height, features.width, std::vector<uint8_t>(size_t(features.height) * features.width * 3)};
  SPARROW_CHECK(WebPDecodeRGBInto(data, bytes.size(), image.rgb.data(), image.rgb.size(), int(image.width * 3)),
                "WebP: the image data is corrupt or truncated");
  return image;
}

}  // namespace

std::string encode_jpeg(const Image& image, int quality) {
  SPARROW_CHECK(image.height > 0 && image.width > 0 && int64_t(image.rgb.size()) == image.height * image.width * 3,
                "encode_jpeg: an image of ", image.width, "x", image.height, " with ", image.rgb.size(), " bytes");
  jpeg_compress_struct info{};
  JpegError error{};
  info.err = jpeg_std_error(&error.manager);
  error.manager.error_exit = jpeg_on_error;
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_create_compress(&info);
  const bool done = guarded(error.jump, [&] {
    jpeg_mem_dest(&info, &buffer, &size);
    info.image_width = JDIMENSION(image.width);
    info.image_height = JDIMENSION(image.height);
    info.input_components = 3;
    info.in_color_space = JCS_RGB;
    jpeg_set_defaults(&info);
    jpeg_set_quality(&info, quality, TRUE);
    jpeg_start_compress(&info, TRUE);
    while (info.next_scanline < info.image_height) {
      JSAMPROW row = const_cast<JSAMPROW>(image.pixel(int64_t(info.next_scanline), 0));
      jpeg_write_scanlines(&info, &row, 1);
    }
    jpeg_finish_compress(&info);
  });
  jpeg_destroy_compress(&info);
  std::string out = done ? std::string(reinterpret_cast<const char*>(buffer), size) : std::string();
  std::free(buffer);
  if (!done) fail("JPEG: ", error.message);
  return out;
}

std::string image_format(std::string_view bytes) {
  static constexpr unsigned char kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPng, 8) == 0) return "png";
  if (bytes.size() >= 3 && uint8_t(bytes[0]) == 0xff && uint8_t(bytes[1]) == 0xd8 && uint8_t(bytes[2]) == 0xff)
    return "jpeg";
  if (bytes.size() >= 12 && bytes.substr(0, 4) == "RIFF" && bytes.substr(8, 4) == "WEBP") return "webp";
  return "";
}

Image decode_image(std::string_view bytes, const DecodeLimits& limits) {
  const std::string format = image_format(bytes);
  if (format == "png") return decode_png(bytes, limits);
  if (format == "jpeg") return decode_jpeg(bytes, limits);
  if (format == "webp") return decode_webp(bytes, limits);
  fail("not an image sparrow can decode (PNG, JPEG or WebP expected; ", bytes.size(), " bytes)");
}

}  // namespace sparrow::vision
