#include "runner/dense_sequence_cache.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace sparrow {

DenseSequenceCache::DenseSequenceCache(std::vector<LayerCacheSpec> spec)
    : spec_(std::move(spec)), pages_(spec_.size() * kNumPageKinds), states_(spec_.size() * kNumStateKinds) {
  for (size_t layer = 0; layer < spec_.size(); ++layer) {
    for (const PageSpec& p : spec_[layer].pages) pages_[layer * kNumPageKinds + int(p.kind)].width = p.width;
    for (const StateSpec& s : spec_[layer].states) {
      Buffer& b = states_[layer * kNumStateKinds + int(s.kind)];
      b.width = s.size;
      b.data.assign(s.size, 0.0f);  // a fresh sequence's state is zeros
    }
  }
}

const DenseSequenceCache::Buffer& DenseSequenceCache::page_buffer(int layer, PageKind kind) const {
  SPARROW_CHECK(layer >= 0 && size_t(layer) < spec_.size(), "sequence cache: no layer ", layer);
  const Buffer& b = pages_[layer * kNumPageKinds + int(kind)];
  SPARROW_CHECK(b.width > 0, "sequence cache: layer ", layer, " has no ", page_kind_name(kind), " page");
  return b;
}

DenseSequenceCache::Buffer& DenseSequenceCache::page_buffer(int layer, PageKind kind) {
  return const_cast<Buffer&>(std::as_const(*this).page_buffer(layer, kind));
}

void DenseSequenceCache::write(int layer, PageKind page, int64_t pos, int64_t count, const float* rows) {
  Buffer& b = page_buffer(layer, page);
  const int64_t held = int64_t(b.data.size()) / b.width;
  SPARROW_CHECK(pos >= 0 && pos <= held, "sequence cache: layer ", layer, " writes ", page_kind_name(page),
                " rows at position ", pos, " but holds ", held, " tokens");
  if (pos + count > held) b.data.resize((pos + count) * b.width);
  std::copy(rows, rows + count * b.width, b.data.begin() + pos * b.width);
}

void DenseSequenceCache::read(int layer, PageKind page, int64_t begin, int64_t end, float* rows) const {
  const Buffer& b = page_buffer(layer, page);
  SPARROW_CHECK(begin >= 0 && begin <= end && end * b.width <= int64_t(b.data.size()), "sequence cache: layer ",
                layer, " reads ", page_kind_name(page), " rows ", begin, "..", end, " but holds ",
                int64_t(b.data.size()) / b.width, " tokens");
  std::copy(b.data.begin() + begin * b.width, b.data.begin() + end * b.width, rows);
}

float* DenseSequenceCache::state(int layer, StateKind kind) {
  SPARROW_CHECK(layer >= 0 && size_t(layer) < spec_.size(), "sequence cache: no layer ", layer);
  Buffer& b = states_[layer * kNumStateKinds + int(kind)];
  SPARROW_CHECK(b.width > 0, "sequence cache: layer ", layer, " has no ", state_kind_name(kind), " state");
  return b.data.data();
}

int64_t DenseSequenceCache::tokens(int layer, PageKind page) const {
  const Buffer& b = page_buffer(layer, page);
  return int64_t(b.data.size()) / b.width;
}

SequenceState standalone_sequence(std::vector<LayerCacheSpec> spec) {
  SequenceState s;
  s.owned_cache = std::make_unique<DenseSequenceCache>(std::move(spec));
  s.cache = s.owned_cache.get();
  return s;
}

}  // namespace sparrow
