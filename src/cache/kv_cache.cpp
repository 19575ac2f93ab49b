#include "cache/kv_cache.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cache/prefix_hash.h"
#include "core/error.h"

#include "core/device/device.h"

namespace sparrow {

namespace {

// Copies a page between host and GPU memory (synchronously).
void copy_page(void* dst, const void* src, int64_t bytes, bool to_host) {
  if (to_host)
    device::copy_to_host_sync(dst, src, size_t(bytes));
  else {
    device::copy_to_device(dst, src, size_t(bytes));
    device::synchronize();
  }
}

// Slot bytes where the cache lives: host memory, or the GPU (in stream order with the kernels).
void zero_bytes(Device device, std::byte* dst, int64_t bytes) {
  if (device == Device::Cpu) return void(std::memset(dst, 0, size_t(bytes)));
  device::zero(dst, size_t(bytes));
}

void copy_bytes(Device device, std::byte* dst, const std::byte* src, int64_t bytes) {
  if (device == Device::Cpu) return void(std::memcpy(dst, src, size_t(bytes)));
  device::copy_device(dst, src, size_t(bytes));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The model's view of one sequence: rows through the block table, state in the sequence's slot.
class KvCache::View : public SequenceCache {
 public:
  View(KvCache& cache, Sequence& seq, SeqId id) : cache_(cache), seq_(seq), id_(id) {}

  const PagedStorage* paged() const override { return &cache_; }
  const std::vector<int32_t>& block_table() const override { return seq_.blocks; }
  void reserve(int64_t tokens) override {
    if (seq_.mirrored) {  // rank 0 allocated: its table must cover the step
      SPARROW_CHECK(tokens <= int64_t(seq_.blocks.size()) * cache_.plan_.block_size, "kv cache: a mirrored table of ",
                    seq_.blocks.size(), " blocks for ", tokens, " tokens");
      return;
    }
    SPARROW_CHECK(cache_.allocate(id_, tokens), "kv cache: no room for ", tokens, " tokens (",
                  cache_.num_free_blocks(), " free blocks of ", cache_.plan_.block_size, " tokens)");
  }

  // Positions are rows of the page: a token's position, or its local row in a DCP share (PageSpec::token_shards).
  void write(int layer, PageKind kind, int64_t pos, int64_t count, const float* rows) override {
    const PagePlacement& page = placement(layer, kind);
    check_range(page, pos, pos + count);
    const int64_t page_rows = page.rows;
    for (int64_t done = 0; done < count;) {
      const int64_t at = pos + done, i = at % page_rows, n = std::min(count - done, page_rows - i);
      const int32_t block = seq_.blocks[at / page_rows];
      SPARROW_CHECK(seq_.mirrored || (!cache_.blocks_[block].cached && cache_.blocks_[block].refs == 1),
                    "kv cache: layer ", layer, " writes position ", at, " into shared block ", block);
      with_host_page(block, page, /*write_back=*/true, [&](std::byte* bytes) {
        page.codec->encode(page.spec, page_rows, rows + done * page.spec.width, i, n, bytes);
      });
      done += n;
    }
  }

  void read(int layer, PageKind kind, int64_t begin, int64_t end, float* rows) const override {
    const PagePlacement& page = placement(layer, kind);
    check_range(page, begin, end);
    const int64_t page_rows = page.rows;
    for (int64_t at = begin; at < end;) {
      const int64_t i = at % page_rows, n = std::min(end - at, page_rows - i);
      with_host_page(seq_.blocks[at / page_rows], page, /*write_back=*/false, [&](std::byte* bytes) {
        page.codec->decode(page.spec, page_rows, bytes, i, n, rows + (at - begin) * page.spec.width);
      });
      at += n;
    }
  }

  float* state(int layer, StateKind kind) override {
    return cache_.state_address(cache_.state_slot(seq_.state_slot), state_placement(layer, kind));
  }
  std::byte* state_slot() override { return seq_.state_slot >= 0 ? cache_.state_slot(seq_.state_slot) : nullptr; }
  int32_t state_slot_index() const override { return seq_.state_slot; }
  int32_t snapshot_slot_index() const override { return seq_.snapshot_slot; }

  // The last block boundary this step reaches, if a snapshot slot can be had for it (a mirror: rank 0's).
  int64_t snapshot_position(int64_t begin, int64_t end) override {
    if (seq_.mirrored)
      return seq_.snapshot_slot >= 0 && seq_.snapshot_position > begin && seq_.snapshot_position <= end
                 ? seq_.snapshot_position : -1;
    if (seq_.rollback)  // speculative decoding's rollback point wins over a block boundary
      return seq_.snapshot_position > begin && seq_.snapshot_position <= end ? seq_.snapshot_position : -1;
    if (!cache_.config_.enable_prefix_caching || !cache_.has_recurrent_state()) return -1;
    const int64_t position = end / cache_.plan_.block_size * cache_.plan_.block_size;
    if (position <= begin) return -1;
    if (seq_.snapshot_position != position) {  // the first layer of this step to ask
      cache_.drop_pending_snapshot(seq_);
      seq_.snapshot_position = position;
      seq_.snapshot_slot = cache_.take_snapshot_slot();
    }
    return seq_.snapshot_slot >= 0 ? position : -1;
  }

  float* snapshot(int layer, StateKind kind) override {
    SPARROW_CHECK(seq_.snapshot_slot >= 0, "kv cache: layer ", layer, " writes a snapshot nobody asked for");
    return cache_.state_address(cache_.snapshot_slot(seq_.snapshot_slot), state_placement(layer, kind));
  }
  std::byte* snapshot_slot() override {
    return seq_.snapshot_slot >= 0 ? cache_.snapshot_slot(seq_.snapshot_slot) : nullptr;
  }

 private:
  // Host pools are coded in place; a GPU pool's page goes through a host copy (tests and tools only:
  // the GPU path writes and reads pages with its own kernels).
  template <typename Code>
  void with_host_page(int32_t block, const PagePlacement& page, bool write_back, Code code) const {
    std::byte* address = cache_.page_address(block, page);
    if (cache_.device() == Device::Cpu) return code(address);
    Tensor staged = Tensor::empty({page.page_bytes}, ScalarType::U8);
    copy_page(staged.raw(), address, page.page_bytes, /*to_host=*/true);
    code(static_cast<std::byte*>(staged.raw()));
    if (write_back) copy_page(address, staged.raw(), page.page_bytes, /*to_host=*/false);
  }

  const PagePlacement& placement(int layer, PageKind kind) const {
    const PagePlacement* page = cache_.plan_.page(layer, kind);
    SPARROW_CHECK(page != nullptr, "kv cache: layer ", layer, " has no ", page_kind_name(kind), " page");
    return *page;
  }
  const StatePlacement& state_placement(int layer, StateKind kind) const {
    const StatePlacement* state = cache_.plan_.state(layer, kind);
    SPARROW_CHECK(state != nullptr, "kv cache: layer ", layer, " has no ", state_kind_name(kind), " state");
    return *state;
  }
  void check_range(const PagePlacement& page, int64_t begin, int64_t end) const {
    const int64_t held = int64_t(seq_.blocks.size()) * page.rows;
    SPARROW_CHECK(0 <= begin && begin <= end && end <= held, "kv cache: layer ", page.layer, " accesses ",
                  page_kind_name(page.spec.kind), " rows ", begin, "..", end, " of a sequence with room for ", held);
  }

  KvCache& cache_;
  Sequence& seq_;
  SeqId id_;
};

// ---------------------------------------------------------------------------------------------
KvCache::KvCache(std::vector<LayerCacheSpec> spec, CacheConfig config)
    : config_(std::move(config)), plan_(plan_cache(spec, config_)) {
  static std::atomic<uint64_t> next_uid{1};
  uid_ = next_uid++;
  // Host rows are left uninitialised (the OS commits pages on first touch, so a large budget costs
  // nothing until used); GPU rows come from the device pool.
  rows_ = Tensor::empty({plan_.num_blocks * plan_.row_bytes}, ScalarType::U8, plan_.device);
  // State slots live with the rows, so the GPU kernels update them in place.
  state_slots_ = Tensor::empty({plan_.num_state_slots * plan_.state_slot_bytes}, ScalarType::U8, plan_.device);
  snapshot_slots_ = Tensor::empty({plan_.num_snapshot_slots * plan_.state_slot_bytes}, ScalarType::U8, plan_.device);
  blocks_.resize(plan_.num_blocks);
  // Stacks popped from the back: block 0 and slot 0 are handed out first.
  for (int64_t b = plan_.num_blocks - 1; b >= 0; --b) free_blocks_.push_back(int32_t(b));
  for (int64_t s = plan_.num_state_slots - 1; s >= 0; --s) free_state_slots_.push_back(int32_t(s));
  snapshots_.resize(plan_.num_snapshot_slots);
  for (int64_t s = plan_.num_snapshot_slots - 1; s >= 0; --s) free_snapshots_.push_back(int32_t(s));
}

KvCache::~KvCache() {
  if (on_destroy_) on_destroy_();
}

int64_t KvCache::num_free_blocks() const { return int64_t(free_blocks_.size() + evictable_.size()); }

double KvCache::usage() const {
  return double(plan_.num_blocks - num_free_blocks()) / double(plan_.num_blocks);
}

int64_t KvCache::num_free_state_slots() const {
  return has_recurrent_state() ? int64_t(free_state_slots_.size()) : int64_t(INT32_MAX);
}

int64_t KvCache::num_cached_blocks() const { return int64_t(prefix_index_.size()); }

KvCache::Sequence& KvCache::sequence(SeqId seq) {
  auto it = sequences_.find(seq);
  SPARROW_CHECK(it != sequences_.end(), "kv cache: no sequence ", seq);
  return it->second;
}

const KvCache::Sequence& KvCache::sequence(SeqId seq) const {
  auto it = sequences_.find(seq);
  SPARROW_CHECK(it != sequences_.end(), "kv cache: no sequence ", seq);
  return it->second;
}

std::byte* KvCache::page_address(int32_t block, const PagePlacement& page) const {
  return pool() + int64_t(block) * plan_.row_bytes + page.offset;
}

PagedStorage::Page KvCache::page(int layer, PageKind kind) const {
  const PagePlacement* p = plan_.page(layer, kind);
  SPARROW_CHECK(p != nullptr, "kv cache: layer ", layer, " has no ", page_kind_name(kind), " page");
  return {p->offset, p->codec->format()};
}

std::byte* KvCache::state_slot(int32_t slot) const {
  SPARROW_CHECK(slot >= 0, "kv cache: the sequence has no state slot");
  return static_cast<std::byte*>(const_cast<void*>(state_slots_.raw())) + int64_t(slot) * plan_.state_slot_bytes;
}

std::byte* KvCache::snapshot_slot(int32_t slot) const {
  return static_cast<std::byte*>(const_cast<void*>(snapshot_slots_.raw())) + int64_t(slot) * plan_.state_slot_bytes;
}

int64_t KvCache::state_offset(int layer, StateKind kind) const {
  const StatePlacement* state = plan_.state(layer, kind);
  SPARROW_CHECK(state != nullptr, "kv cache: layer ", layer, " has no ", state_kind_name(kind), " state");
  return state->offset;
}

float* KvCache::state_address(std::byte* slot, const StatePlacement& state) const {
  return reinterpret_cast<float*>(slot + state.offset);
}

SeqId KvCache::create_sequence(uint64_t prefix_root, std::vector<HashedSpan> spans) {
  SPARROW_CHECK(!has_recurrent_state() || !free_state_slots_.empty(), "kv cache: all ", plan_.num_state_slots,
                " state slots are taken (at most max_num_seqs sequences run at once)");
  const SeqId id = next_id_++;
  Sequence& s = sequences_[id];
  s.prefix_root = prefix_root;
  s.spans = std::move(spans);
  if (has_recurrent_state()) {
    s.state_slot = free_state_slots_.back();
    free_state_slots_.pop_back();
    write_state({s.state_slot, -1});
  }
  s.view = std::make_unique<View>(*this, s, id);
  return id;
}

void KvCache::apply(const StateOp& op) {
  SPARROW_CHECK(op.state_slot >= 0 && op.state_slot < plan_.num_state_slots && op.from_snapshot < plan_.num_snapshot_slots,
                "kv cache: state op on slot ", op.state_slot, " / snapshot ", op.from_snapshot, " of ",
                plan_.num_state_slots, " / ", plan_.num_snapshot_slots);
  write_state(op);
}

void KvCache::write_state(const StateOp& op) {
  if (op.from_snapshot < 0) zero_bytes(plan_.device, state_slot(op.state_slot), plan_.state_slot_bytes);
  else copy_bytes(plan_.device, state_slot(op.state_slot), snapshot_slot(op.from_snapshot), plan_.state_slot_bytes);
  if (record_state_ops_) state_ops_.push_back(op);
}

SeqId KvCache::mirror(std::vector<int32_t> blocks, int32_t state_slot, int32_t snapshot_slot,
                      int64_t snapshot_position) {
  for (int32_t block : blocks)
    SPARROW_CHECK(block >= 0 && block < plan_.num_blocks, "kv cache: mirrored block ", block, " of ", plan_.num_blocks);
  SPARROW_CHECK(state_slot < plan_.num_state_slots && snapshot_slot < plan_.num_snapshot_slots &&
                    (state_slot >= 0 || !has_recurrent_state()),
                "kv cache: mirrored state slot ", state_slot, " / snapshot slot ", snapshot_slot, " of ",
                plan_.num_state_slots, " / ", plan_.num_snapshot_slots);
  const SeqId id = next_id_++;
  Sequence& s = sequences_[id];
  s.mirrored = true;
  s.blocks = std::move(blocks);
  s.state_slot = state_slot;
  s.snapshot_slot = snapshot_slot;
  s.snapshot_position = snapshot_position;
  s.view = std::make_unique<View>(*this, s, id);
  return id;
}

void KvCache::drop_mirror(SeqId seq) {
  SPARROW_CHECK(sequence(seq).mirrored, "kv cache: drop_mirror on sequence ", seq, ", which is not a mirror");
  sequences_.erase(seq);
}

SequenceCache* KvCache::view(SeqId seq) { return sequence(seq).view.get(); }

// ---------------------------------------------------------------------------------------------
// Blocks.

int32_t KvCache::take_block() {
  int32_t block;
  if (!free_blocks_.empty()) {
    block = free_blocks_.back();
    free_blocks_.pop_back();
  } else {
    block = evictable_.front();
    evictable_.pop_front();
    uncache(block);
  }
  blocks_[block].refs = 1;
  return block;
}

void KvCache::add_ref(int32_t block) {
  Block& b = blocks_[block];
  if (b.refs++ == 0 && b.cached) evictable_.erase(b.evictable_at);
}

void KvCache::release_ref(int32_t block) {
  Block& b = blocks_[block];
  if (--b.refs > 0) return;
  if (b.cached) {
    b.evictable_at = evictable_.insert(evictable_.end(), block);
  } else {
    free_blocks_.push_back(block);
  }
}

void KvCache::uncache(int32_t block) {
  Block& b = blocks_[block];
  prefix_index_.erase(b.hash);
  b.cached = false;
  if (b.snapshot >= 0) {
    snapshot_lru_.erase(snapshots_[b.snapshot].lru_at);
    free_snapshot_slot(b.snapshot);
    b.snapshot = -1;
  }
}

bool KvCache::allocate(SeqId seq, int64_t total_tokens) {
  Sequence& s = sequence(seq);
  const int64_t needed = (total_tokens + plan_.block_size - 1) / plan_.block_size - int64_t(s.blocks.size());
  if (needed <= 0) return true;
  if (needed > num_free_blocks()) return false;
  for (int64_t i = 0; i < needed; ++i) s.blocks.push_back(take_block());
  return true;
}

void KvCache::free_sequence(SeqId seq) {
  Sequence& s = sequence(seq);
  // Tail first, so that a sequence's last blocks are the first evicted.
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) release_ref(*it);
  if (s.state_slot >= 0) free_state_slots_.push_back(s.state_slot);
  drop_pending_snapshot(s);
  sequences_.erase(seq);
}

// ---------------------------------------------------------------------------------------------
// Prefix caching.

int64_t KvCache::match_prefix(SeqId seq, const std::vector<int32_t>& prompt) {
  Sequence& s = sequence(seq);
  SPARROW_CHECK(s.blocks.empty() && s.committed == 0, "kv cache: match_prefix on sequence ", seq,
                ", which already holds tokens");
  if (!config_.enable_prefix_caching || prompt.empty()) return 0;
  prefix_queries_ += int64_t(prompt.size());

  // The longest run of cached blocks, never including the prompt's last token.
  const int64_t block_size = plan_.block_size;
  const int64_t max_blocks = (int64_t(prompt.size()) - 1) / block_size;
  std::vector<int32_t> matched;
  std::vector<uint64_t> keys;
  for (int64_t i = 0; i < max_blocks; ++i) {
    const uint64_t key = block_hash(keys.empty() ? s.prefix_root : keys.back(), prompt.data() + i * block_size,
                                    i * block_size, block_size, s.spans);
    auto it = prefix_index_.find(key);
    if (it == prefix_index_.end()) break;
    matched.push_back(it->second);
    keys.push_back(key);
  }
  // Recurrent layers resume only where their state was saved.
  if (has_recurrent_state()) {
    while (!matched.empty() && blocks_[matched.back()].snapshot < 0) {
      matched.pop_back();
      keys.pop_back();
    }
  }
  if (matched.empty()) return 0;

  for (int32_t block : matched) add_ref(block);
  s.blocks = matched;
  s.hashes = keys;
  s.committed = int64_t(matched.size()) * block_size;
  if (has_recurrent_state()) {
    const int32_t slot = blocks_[matched.back()].snapshot;
    write_state({s.state_slot, slot});
    snapshot_lru_.splice(snapshot_lru_.end(), snapshot_lru_, snapshots_[slot].lru_at);  // most recently used
  }
  prefix_hits_ += s.committed;
  return s.committed;
}

bool KvCache::mark_rollback(SeqId seq, int64_t position) {
  Sequence& s = sequence(seq);
  SPARROW_CHECK(has_recurrent_state() && !s.mirrored && position > s.committed, "kv cache: rollback point ", position,
                " for sequence ", seq, " (", s.committed, " tokens committed)");
  drop_pending_snapshot(s);
  s.snapshot_slot = take_snapshot_slot();
  if (s.snapshot_slot < 0) return false;
  s.snapshot_position = position;
  s.rollback = true;
  return true;
}

void KvCache::roll_back(SeqId seq) {
  Sequence& s = sequence(seq);
  SPARROW_CHECK(s.rollback && s.snapshot_slot >= 0, "kv cache: sequence ", seq, " has no rollback snapshot");
  write_state({s.state_slot, s.snapshot_slot});
}

void KvCache::commit_tokens(SeqId seq, const std::vector<int32_t>& tokens, int64_t cached_length) {
  Sequence& s = sequence(seq);
  const int64_t block_size = plan_.block_size;
  SPARROW_CHECK(cached_length >= s.committed && cached_length <= int64_t(tokens.size()) &&
                    cached_length <= int64_t(s.blocks.size()) * block_size,
                "kv cache: sequence ", seq, " commits ", cached_length, " tokens (", tokens.size(),
                " given, ", s.committed, " committed, room for ", s.blocks.size() * block_size, ")");
  s.committed = cached_length;
  if (s.rollback) {
    // A rollback snapshot serves the prefix cache only where it falls on a block boundary.
    s.rollback = false;
    if (!config_.enable_prefix_caching || s.snapshot_position % block_size != 0 || s.snapshot_position > cached_length)
      drop_pending_snapshot(s);
  }
  if (!config_.enable_prefix_caching) return;

  // Register the newly full blocks, unless an equal block already is.
  for (int64_t i = int64_t(s.hashes.size()); i < cached_length / block_size; ++i) {
    const uint64_t key = block_hash(i == 0 ? s.prefix_root : s.hashes.back(), tokens.data() + i * block_size,
                                    i * block_size, block_size, s.spans);
    s.hashes.push_back(key);
    if (prefix_index_.count(key)) continue;
    Block& b = blocks_[s.blocks[i]];
    b.cached = true;
    b.hash = key;
    prefix_index_[key] = s.blocks[i];
  }
  if (s.snapshot_slot >= 0 && s.snapshot_position <= cached_length) attach_snapshot(s);
}

int32_t KvCache::take_snapshot_slot() {
  if (!free_snapshots_.empty()) {
    const int32_t slot = free_snapshots_.back();
    free_snapshots_.pop_back();
    return slot;
  }
  if (snapshot_lru_.empty()) return -1;
  const int32_t slot = snapshot_lru_.front();  // evict the least recently used snapshot
  snapshot_lru_.pop_front();
  blocks_[snapshots_[slot].block].snapshot = -1;
  snapshots_[slot].block = -1;
  return slot;
}

void KvCache::free_snapshot_slot(int32_t slot) {
  snapshots_[slot].block = -1;
  free_snapshots_.push_back(slot);
}

// The pending snapshot belongs to the block ending at its position, or to the block registered under
// that block's key; dropped when that block already has one.
void KvCache::attach_snapshot(Sequence& s) {
  const uint64_t key = s.hashes[s.snapshot_position / plan_.block_size - 1];
  auto it = prefix_index_.find(key);
  if (it != prefix_index_.end() && blocks_[it->second].snapshot < 0) {
    Block& b = blocks_[it->second];
    b.snapshot = s.snapshot_slot;
    snapshots_[s.snapshot_slot].block = it->second;
    snapshots_[s.snapshot_slot].lru_at = snapshot_lru_.insert(snapshot_lru_.end(), s.snapshot_slot);
  } else {
    free_snapshot_slot(s.snapshot_slot);
  }
  s.snapshot_slot = -1;
  s.snapshot_position = -1;
}

void KvCache::drop_pending_snapshot(Sequence& s) {
  if (s.snapshot_slot >= 0) free_snapshot_slot(s.snapshot_slot);
  s.snapshot_slot = -1;
  s.snapshot_position = -1;
  s.rollback = false;
}

// ---------------------------------------------------------------------------------------------
// Page addresses.

const std::vector<int32_t>& KvCache::block_table(SeqId seq) const { return sequence(seq).blocks; }

std::vector<int64_t> KvCache::page_offsets(SeqId seq, int layer, PageKind kind) const {
  const PagePlacement* page = plan_.page(layer, kind);
  SPARROW_CHECK(page != nullptr, "kv cache: layer ", layer, " has no ", page_kind_name(kind), " page");
  std::vector<int64_t> offsets;
  for (int32_t block : sequence(seq).blocks) offsets.push_back(int64_t(block) * plan_.row_bytes + page->offset);
  return offsets;
}

std::vector<KvRegion> KvCache::transfer_regions(SeqId seq) const {
  const Sequence& s = sequence(seq);
  std::vector<KvRegion> regions;
  for (const int32_t block : s.blocks) regions.push_back({pool() + int64_t(block) * row_bytes(), row_bytes()});
  if (has_recurrent_state()) regions.push_back({state_slot(s.state_slot), plan_.state_slot_bytes});
  return regions;
}

void KvCache::copy_out(const KvRegion& region, std::byte* host) const {
  if (device() == Device::Cpu) std::memcpy(host, region.data, size_t(region.bytes));
  else device::copy_to_host_sync(host, region.data, size_t(region.bytes));
}

void KvCache::copy_in(const std::byte* host, const KvRegion& region) {
  if (device() == Device::Cpu) {
    std::memcpy(region.data, host, size_t(region.bytes));
  } else {
    device::copy_to_device(region.data, host, size_t(region.bytes));
    device::synchronize();  // the host bytes may go once this returns
  }
}

}  // namespace sparrow
