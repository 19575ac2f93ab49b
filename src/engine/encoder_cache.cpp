#include "engine/encoder_cache.h"

#include "core/error.h"

namespace sparrow {

Tensor EncoderCache::get(const vision::ImageInput& image, const VisionEncoder& tower) {
  if (auto it = entries_.find(image.hash); it != entries_.end()) {
    ++hits_;
    lru_.splice(lru_.end(), lru_, it->second.lru_at);
    return it->second.embeddings;
  }
  ++misses_;
  const auto start = std::chrono::steady_clock::now();
  Tensor embeddings = tower.embed(image.pixel_values, {image.grid});
  encode_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  SPARROW_CHECK(embeddings.dim(0) == image.tokens, "the vision tower made ", embeddings.dim(0),
                " rows for an image of ", image.tokens, " placeholder tokens");
  lru_.push_back(image.hash);
  entries_[image.hash] = {embeddings, std::prev(lru_.end())};
  rows_ += embeddings.dim(0);
  // The newest entry stays even when it alone passes the capacity: its sequence needs it for its next chunks.
  while (rows_ > capacity_rows_ && lru_.size() > 1) {
    auto oldest = entries_.find(lru_.front());
    rows_ -= oldest->second.embeddings.dim(0);
    entries_.erase(oldest);
    lru_.pop_front();
  }
  return embeddings;
}

}  // namespace sparrow
