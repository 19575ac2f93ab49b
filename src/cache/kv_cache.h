// The serving engine's KV cache: a pool of block rows (cache/planner.h) shared by all running
// sequences, with prefix caching, and per-sequence state slots for recurrent layers.
//
// Sequences. Each running sequence owns a block table (the blocks holding its tokens 0..n-1, block i
// holding tokens i*block_size .. (i+1)*block_size - 1) and, when the model has recurrent layers, a state
// slot. The model reaches them through view(seq), a SequenceCache (core/sequence_cache.h): rows go
// through the page-address translation below, state straight to the slot.
//
// A step of the engine, for each sequence it runs:
//   allocate(seq, tokens after the step)      room for the new tokens (false: out of blocks, preempt)
//   model.forward(...)                        writes and reads through view(seq)
//   commit_tokens(seq, tokens, cached_length) the step's tokens are now cached; full blocks enter the
//                                             prefix cache
// and for a new request: create_sequence(), match_prefix(seq, prompt) (the tokens it may skip), then
// the steps above from that length on. free_sequence() returns everything (finish, abort, preemption).
//
// Prefix caching. A full block's key chains its tokens to its parent's key (cache/prefix_hash.h). When
// a committed block fills up it is registered under its key (unless another block already is); a new
// request takes the longest run of registered blocks matching its prompt (never its last token: that
// one must be computed to give logits), sharing them by reference count. Cached blocks are never
// written again. A block nobody references stays cached and is reused as a free block only when no
// never-cached block is left, least recently released first (LRU; a sequence's tail blocks go first).
//
// Recurrent layers (KDA) cannot restart from rows: a hit must also restore their state as it stood at
// the end of the last reused block. During each step the cache asks the model (through
// SequenceCache::snapshot_position) for a copy of the state at the last block boundary the step
// reaches; commit_tokens attaches it to the block ending there. Hits on such models stop at the
// longest matched block that has a snapshot. Snapshots live in their own slots (as many as state slots)
// and are evicted least recently used first, or with their block.
//
// Speculative decoding rolls recurrent layers back the same way: before a step that verifies draft
// tokens, mark_rollback(seq, p) makes the step's snapshot the state after position p - 1 (the last token
// known to be right) instead of a block boundary's; when a draft is rejected, roll_back(seq) copies it
// back into the state slot and the engine runs the accepted tokens again in the next step. A rollback
// snapshot that falls on a block boundary still serves the prefix cache when its block is committed.
//
// Not thread-safe: the engine loop owns it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache/planner.h"
#include "cache/prefix_hash.h"
#include "core/kv_transfer.h"
#include "core/tensor.h"
#include "core/sequence_cache.h"

namespace sparrow {

using SeqId = int64_t;

// Block rows live on config.device: host memory, or GPU memory that the GPU kernels address directly
// (PagedStorage, core/kv_layout.h); view(seq)->write/read still work there, through a copy, for
// tests and tools.
class KvCache final : public PagedStorage {
 public:
  KvCache(std::vector<LayerCacheSpec> spec, CacheConfig config);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const CachePlan& plan() const { return plan_; }
  int64_t num_free_blocks() const;       // free + evictable (cached, unreferenced)
  double usage() const;                  // fraction of blocks referenced by sequences (for /metrics)
  int64_t num_free_state_slots() const;  // for models with recurrent layers: sequences that can still start
  int64_t num_cached_blocks() const;     // blocks registered in the prefix cache

  // A new, empty sequence. Throws when the model has recurrent layers and all max_num_seqs state
  // slots are taken (check num_free_state_slots first).
  // prefix_root: the hash chain's start (kRootBlockHash), another one for sequences whose rows differ for the
  // same tokens (a LoRA adapter's: Scheduler), so that their blocks never match the base model's.
  // `spans`: the runs of its tokens keyed by more than their ids (an image's placeholders: prefix_hash.h).
  SeqId create_sequence(uint64_t prefix_root = kRootBlockHash, std::vector<HashedSpan> spans = {});
  // Reuses the longest cached prefix of `prompt` for a sequence that holds nothing yet: returns the
  // tokens reused (a multiple of block_size, less than prompt.size(); 0 without prefix caching). The
  // sequence then holds them, as if computed and committed.
  int64_t match_prefix(SeqId seq, const std::vector<int32_t>& prompt);
  // Makes room for the sequence to hold `total_tokens` tokens; false (nothing changed) when there are
  // not enough free blocks.
  bool allocate(SeqId seq, int64_t total_tokens);
  // After a step: the sequence's tokens 0 .. cached_length-1 are computed and cached (`tokens` holds at
  // least those: prompt and generated tokens so far).
  void commit_tokens(SeqId seq, const std::vector<int32_t>& tokens, int64_t cached_length);
  // Returns the sequence's blocks and slots. Its view is invalid afterwards.
  void free_sequence(SeqId seq);
  // Speculative decoding, models with recurrent layers: the next step's snapshot is the state after
  // position - 1 (the step must run past it). False when no snapshot slot can be had (the step must then
  // not run draft tokens for the sequence).
  bool mark_rollback(SeqId seq, int64_t position);
  // After that step: the state slot goes back to the state at the marked position (a draft was rejected).
  // commit_tokens then lets the snapshot go (or keeps it for the prefix cache at a block boundary).
  void roll_back(SeqId seq);
  // What the model reads and writes through; stays valid until free_sequence(seq).
  SequenceCache* view(SeqId seq);

  // Tensor parallelism (runner/step_plan.h). Rank 0's cache decides; a worker's cache, of as many block rows
  // and slots, mirrors it: the state writes rank 0's cache makes outside a forward pass (a new sequence's
  // zeroed state, a prefix hit's restored snapshot) are recorded while `record_state_ops` is on and handed
  // over by take_state_ops(); a worker applies them (apply) and runs each step on sequences whose blocks and
  // slots are rank 0's (mirror), allocating nothing itself.
  struct StateOp {
    int32_t state_slot = -1;
    int32_t from_snapshot = -1;  // -1: zero the state slot; else copy this snapshot slot into it
  };
  void record_state_ops(bool on) { record_state_ops_ = on; }
  std::vector<StateOp> take_state_ops() { return std::exchange(state_ops_, {}); }
  void apply(const StateOp& op);
  // A sequence for one step of a worker: rank 0's block table, state slot and pending snapshot (slot and
  // position, -1 when none). drop_mirror() lets it go without touching any block's bookkeeping.
  SeqId mirror(std::vector<int32_t> blocks, int32_t state_slot, int32_t snapshot_slot, int64_t snapshot_position);
  void drop_mirror(SeqId seq);
  const CacheConfig& config() const { return config_; }
  // Unique in the process (never reused, unlike an address), and a hook the destructor calls: a tensor-
  // parallel rank 0 names its caches to its workers by uid and tells them when one is gone.
  uint64_t uid() const { return uid_; }
  void on_destroy(std::function<void()> hook) { on_destroy_ = std::move(hook); }

  // Prefill/decode disaggregation (engine/kv_handoff.h): the sequence's block rows in block-table order, then
  // its state slot when the model has recurrent layers, where they live (device addresses for a GPU pool, which
  // the transfer agent cannot read: such regions go through host memory with copy_out and copy_in).
  std::vector<KvRegion> transfer_regions(SeqId seq) const;
  void copy_out(const KvRegion& region, std::byte* host) const;  // a region of the pool to host memory
  void copy_in(const std::byte* host, const KvRegion& region);     // and back (done when it returns)

  // Prefix-cache statistics: prompt tokens looked up, and tokens reused.
  int64_t prefix_queries() const { return prefix_queries_; }
  int64_t prefix_hits() const { return prefix_hits_; }

  // The page-address translation (docs/cache.md): `layer`'s page of `kind` for the sequence's block i
  // starts at byte page_offsets(...)[i] of the pool, i.e. block_table[i] * row_bytes + the page's offset
  // in the row; token j of that block is the page codec's token j. Kernels get these addresses.
  const std::vector<int32_t>& block_table(SeqId seq) const;
  std::vector<int64_t> page_offsets(SeqId seq, int layer, PageKind kind) const;

  // PagedStorage
  Device device() const override { return plan_.device; }
  std::byte* pool() const override { return static_cast<std::byte*>(const_cast<void*>(rows_.raw())); }
  int64_t row_bytes() const override { return plan_.row_bytes; }
  int64_t block_size() const override { return plan_.block_size; }
  Page page(int layer, PageKind kind) const override;
  int64_t state_offset(int layer, StateKind kind) const override;

 private:
  class View;
  // Does `op` on the slots, and records it while record_state_ops is on: every state write outside a
  // forward pass goes through here.
  void write_state(const StateOp& op);

  struct Block {
    int32_t refs = 0;
    bool cached = false;   // registered in prefix_index_ under `hash`; then never written again
    uint64_t hash = 0;
    int32_t snapshot = -1; // the snapshot slot holding the recurrent state at this block's end
    std::list<int32_t>::iterator evictable_at;  // valid while cached and unreferenced
  };
  struct Snapshot {
    int32_t block = -1;  // the block it belongs to; -1 while free or pending
    std::list<int32_t>::iterator lru_at;
  };
  struct Sequence {
    std::vector<int32_t> blocks;  // the block table
    std::vector<uint64_t> hashes; // keys of its committed full blocks
    uint64_t prefix_root = kRootBlockHash;
    std::vector<HashedSpan> spans;  // create_sequence's
    int64_t committed = 0;
    int32_t state_slot = -1;
    int64_t snapshot_position = -1;  // this step's pending snapshot: position and slot (-1: none)
    int32_t snapshot_slot = -1;
    bool rollback = false;           // the pending snapshot is mark_rollback's
    bool mirrored = false;  // a worker's mirror of rank 0's sequence (mirror())
    std::unique_ptr<View> view;
  };

  Sequence& sequence(SeqId seq);
  const Sequence& sequence(SeqId seq) const;
  bool has_recurrent_state() const { return plan_.state_slot_bytes > 0; }
  std::byte* page_address(int32_t block, const PagePlacement& page) const;
  std::byte* state_slot(int32_t slot) const;     // the start of a state slot
  std::byte* snapshot_slot(int32_t slot) const;  // the start of a snapshot slot
  float* state_address(std::byte* slot, const StatePlacement& state) const;
  int32_t take_block();
  void add_ref(int32_t block);
  void release_ref(int32_t block);
  void uncache(int32_t block);
  int32_t take_snapshot_slot();
  void free_snapshot_slot(int32_t slot);
  void attach_snapshot(Sequence& s);
  void drop_pending_snapshot(Sequence& s);

  CacheConfig config_;
  CachePlan plan_;
  Tensor rows_;           // num_blocks block rows (bytes, on config.device)
  Tensor state_slots_;     // num_state_slots slots (bytes, on config.device)
  Tensor snapshot_slots_;  // num_snapshot_slots slots
  std::vector<Block> blocks_;
  std::vector<int32_t> free_blocks_;  // never cached (or evicted), unreferenced
  std::list<int32_t> evictable_;      // cached and unreferenced, least recently released first
  std::unordered_map<uint64_t, int32_t> prefix_index_;  // key -> block
  std::vector<int32_t> free_state_slots_;
  std::vector<Snapshot> snapshots_;
  std::vector<int32_t> free_snapshots_;
  std::list<int32_t> snapshot_lru_;   // attached snapshots, least recently used first
  std::unordered_map<SeqId, Sequence> sequences_;
  SeqId next_id_ = 0;
  uint64_t uid_;
  std::function<void()> on_destroy_;
  bool record_state_ops_ = false;
  std::vector<StateOp> state_ops_;
  int64_t prefix_queries_ = 0, prefix_hits_ = 0;
};

}  // namespace sparrow
