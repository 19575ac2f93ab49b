#include "core/kv_layout.h"

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

}  // namespace sparrow
