// The vision tower's outputs by image (vLLM's encoder cache): an image's embeddings are made once, at the first
// step that runs any of its placeholder tokens, and kept for its later prefill chunks and for other requests that
// bring the same image (by content hash: vision/image_input.h). Least recently used out first once the rows kept
// pass the capacity; an entry handed out stays valid for its holder (Tensor storage is shared).
#pragma once
#include <chrono>
#include <cstdint>
#include <list>
#include <unordered_map>

#include "core/tensor.h"
#include "model/vision_encoder.h"
#include "vision/image_input.h"

namespace sparrow {

class EncoderCache {
 public:
  explicit EncoderCache(int64_t capacity_rows) : capacity_rows_(capacity_rows) {}

  // The image's embeddings ([image.tokens, hidden] fp32 on the host), from `tower` on a miss.
  Tensor get(const vision::ImageInput& image, const VisionEncoder& tower);

  int64_t hits() const { return hits_; }
  int64_t misses() const { return misses_; }
  int64_t rows() const { return rows_; }
  double encode_seconds() const { return encode_seconds_; }  // the tower's time on the misses

 private:
  struct Entry {
    Tensor embeddings;
    std::list<uint64_t>::iterator lru_at;
  };
  int64_t capacity_rows_;
  int64_t rows_ = 0, hits_ = 0, misses_ = 0;
  double encode_seconds_ = 0;
  std::unordered_map<uint64_t, Entry> entries_;
  std::list<uint64_t> lru_;  // most recently used last
};

}  // namespace sparrow
