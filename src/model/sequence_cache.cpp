#include "model/sequence_cache.h"

#include "core/error.h"

namespace sparrow {

const char* page_kind_name(PageKind kind) {
  switch (kind) {
    case PageKind::MlaLatent: return "mla_latent";
    case PageKind::DsaIndexKey: return "dsa_index_key";
    case PageKind::GqaKeyValue: return "gqa_kv";
    case PageKind::MsaIndexKey: return "msa_index_key";
  }
  return "?";
}

const char* state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::ConvTail: return "conv_tail";
    case StateKind::Recurrent: return "recurrent";
  }
  return "?";
}

const PageSpec* LayerCacheSpec::page(PageKind kind) const {
  for (const PageSpec& p : pages)
    if (p.kind == kind) return &p;
  return nullptr;
}

const StateSpec* LayerCacheSpec::state(StateKind kind) const {
  for (const StateSpec& s : states)
    if (s.kind == kind) return &s;
  return nullptr;
}

float* SequenceCache::snapshot(int layer, StateKind kind) {
  fail("this sequence cache keeps no state snapshots (layer ", layer, ", ", state_kind_name(kind), ")");
}

const std::vector<int32_t>& SequenceCache::block_table() const {
  static const std::vector<int32_t> none;
  return none;
}

}  // namespace sparrow
