// The vision tower's outputs by image (vLLM's encoder cache): an image's embeddings are made once, at the first
// step that runs any of its placeholder tokens, and kept for its later prefill chunks and for other requests that
// bring the same image (by content hash: vision/image_input.h). Least recently used out first once the rows kept
// pass the capacity; an entry handed out stays valid for its holder (Tensor storage is shared). A step's images that
// are not cached go through the tower in one call (the products batched over all their patches; each image still
// attends to itself only, model/vision_encoder.h).
#pragma once
#include <chrono>
#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "model/vision_encoder.h"
#include "vision/image_input.h"

namespace sparrow {

class EncoderCache {
 public:
  explicit EncoderCache(int64_t capacity_rows) : capacity_rows_(capacity_rows) {}

  // Each image's embeddings ([image.tokens, hidden] fp32 on the host), in order: the cached ones, and the others
  // from one call of `tower` (an image twice in the list is embedded once). One query per image of the list.
  std::vector<Tensor> get(const std::vector<const vision::ImageInput*>& images, const VisionEncoder& tower);
  int64_t tower_calls() const { return tower_calls_; }

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
  void insert(uint64_t hash, const Tensor& embeddings);

  int64_t rows_ = 0, hits_ = 0, misses_ = 0, tower_calls_ = 0;
  double encode_seconds_ = 0;
  std::unordered_map<uint64_t, Entry> entries_;
  std::list<uint64_t> lru_;  // most recently used last
};

}  // namespace sparrow
