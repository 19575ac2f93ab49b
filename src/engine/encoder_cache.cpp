#include "engine/encoder_cache.h"

#include <algorithm>

#include "core/error.h"

namespace sparrow {

std::vector<Tensor> EncoderCache::get(const std::vector<const vision::ImageInput*>& images, const VisionEncoder& tower) {
  std::vector<Tensor> out(images.size());
  std::vector<size_t> missing;  // the first occurrence of each image not cached
  for (size_t i = 0; i < images.size(); ++i) {
    const uint64_t hash = images[i]->hash;
    if (auto it = entries_.find(hash); it != entries_.end()) {
      ++hits_;
      lru_.splice(lru_.end(), lru_, it->second.lru_at);
      out[i] = it->second.embeddings;
    } else if (std::none_of(missing.begin(), missing.end(), [&](size_t m) { return images[m]->hash == hash; })) {
      ++misses_;
      missing.push_back(i);
    } else {
      ++hits_;  // embedded by this call, for its first occurrence
    }
  }
  if (!missing.empty()) {
    // The missing images' patches stacked, one tower call, its rows split back by image.
    int64_t rows = 0;
    std::vector<vision::VisionGrid> grids;
    for (size_t m : missing) {
      rows += images[m]->pixel_values.dim(0);
      grids.push_back(images[m]->grid);
    }
    Tensor patches = Tensor::empty({rows, images[missing.front()]->pixel_values.dim(1)});
    int64_t at = 0;
    for (size_t m : missing) {
      const Tensor& p = images[m]->pixel_values;
      std::copy_n(p.data(), p.numel(), patches.data() + at);
      at += p.numel();
    }
    const auto start = std::chrono::steady_clock::now();
    const Tensor embeddings = tower.embed(patches, grids);
    encode_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++tower_calls_;
    int64_t first = 0;
    for (size_t m : missing) {
      const int64_t tokens = images[m]->tokens;
      SPARROW_CHECK(first + tokens <= embeddings.dim(0), "the vision tower made ", embeddings.dim(0), " rows for ",
                    missing.size(), " images");
      out[m] = embeddings.rows(first, first + tokens).clone();
      first += tokens;
    }
    SPARROW_CHECK(first == embeddings.dim(0), "the vision tower made ", embeddings.dim(0), " rows for images of ",
                  first, " placeholder tokens");
    for (size_t m : missing) insert(images[m]->hash, out[m]);
  }
  // A repeat of an image in the list takes its first occurrence's rows.
  for (size_t i = 0; i < images.size(); ++i)
    if (!out[i].defined())
      for (size_t j = 0; j < i; ++j)
        if (images[j]->hash == images[i]->hash && out[j].defined()) out[i] = out[j];
  return out;
}

void EncoderCache::insert(uint64_t hash, const Tensor& embeddings) {
  lru_.push_back(hash);
  entries_[hash] = {embeddings, std::prev(lru_.end())};
  rows_ += embeddings.dim(0);
  // The newest entry stays even when it alone passes the capacity: its sequence needs it for its next chunks.
  while (rows_ > capacity_rows_ && lru_.size() > 1) {
    auto oldest = entries_.find(lru_.front());
    rows_ -= oldest->second.embeddings.dim(0);
    entries_.erase(oldest);
    lru_.pop_front();
  }
}

}  // namespace sparrow
