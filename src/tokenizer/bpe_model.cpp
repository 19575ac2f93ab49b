#include "tokenizer/bpe_model.h"

#include <queue>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace sparrow {
namespace {

using nlohmann::json;

// The (left, right) strings of merge `index`, in either of tokenizer.json's two forms.
std::pair<std::string, std::string> merge_parts(const json& merge, size_t index) {
  if (merge.is_string()) {
    // "a b": tokenizers splits on the single space and wants exactly two parts.
    const std::string& line = merge.get_ref<const std::string&>();
    size_t space = line.find(' ');
    SPARROW_CHECK(space != std::string::npos && line.find(' ', space + 1) == std::string::npos,
                  "merge ", index, " is not two tokens separated by a space");
    return {line.substr(0, space), line.substr(space + 1)};
  }
  SPARROW_CHECK(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(),
                "merge ", index, " is neither \"a b\" nor [\"a\", \"b\"]");
  return {merge[0].get<std::string>(), merge[1].get<std::string>()};
}

bool is_set(const json& model, const char* key) {
  return model.contains(key) && !model[key].is_null() && model[key] != false;
}

}  // namespace

BpeModel::BpeModel(const json& model) {
  for (const char* option : {"dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"})
    SPARROW_CHECK(!is_set(model, option), "BPE option '", option, "' is not supported");
  SPARROW_CHECK(model.contains("vocab") && model["vocab"].is_object(), "BPE model without a vocab");
  for (const auto& [token, id] : model["vocab"].items()) {
    SPARROW_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() <= INT32_MAX,
                  "vocab entry '", token, "' has a bad id");
    vocab_[token] = id.get<TokenId>();
  }
  ignore_merges_ = model.value("ignore_merges", false);
  fuse_unk_ = model.value("fuse_unk", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    auto it = vocab_.find(model["unk_token"].get<std::string>());
    SPARROW_CHECK(it != vocab_.end(), "unk_token is not in the vocab");
    unk_id_ = it->second;
  }

  const json& merges = model.value("merges", json::array());
  SPARROW_CHECK(merges.is_array(), "BPE merges must be a list");
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    auto [left, right] = merge_parts(merges[rank], rank);
    auto l = vocab_.find(left), r = vocab_.find(right), result = vocab_.find(left + right);
    SPARROW_CHECK(l != vocab_.end() && r != vocab_.end() && result != vocab_.end(), "merge ", rank,
                  " ('", left, "' + '", right, "') uses a token that is not in the vocab");
    // A repeated pair keeps its last rank, as tokenizers' map construction does.
    merges_[pair_key(l->second, r->second)] = {uint32_t(rank), result->second};
  }
}

void BpeModel::encode(std::string_view piece, std::vector<TokenId>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(piece);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (piece.size() < kCacheMaxPieceBytes) {
    std::lock_guard lock(cache_mutex_);
    auto it = cache_.find(piece);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<TokenId> ids = merge_word(piece);
  out.insert(out.end(), ids.begin(), ids.end());
  if (piece.size() < kCacheMaxPieceBytes) {
    std::lock_guard lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(piece), std::move(ids));
  }
}

// tokenizers' BPE::merge_word and Word::merge_all: one symbol per character (unknown characters
// become unk_token, or vanish without one), then a queue of candidate merges ordered by (rank,
// position); a popped merge whose symbols have changed since it was queued is skipped.
std::vector<TokenId> BpeModel::merge_word(std::string_view piece) const {
  struct Symbol {
    TokenId id;
    int prev, next;  // neighbours in the word, -1 at the ends
    bool removed = false;
  };
  std::vector<Symbol> symbols;
  bool pending_unk = false;
  for (size_t i = 0; i < piece.size();) {
    size_t start = i;
    utf8::next(piece, i);
    auto it = vocab_.find(piece.substr(start, i - start));
    if (it != vocab_.end()) {
      symbols.push_back({it->second, 0, 0});
      pending_unk = false;
    } else if (unk_id_) {
      if (!(fuse_unk_ && pending_unk)) symbols.push_back({*unk_id_, 0, 0});
      pending_unk = true;
    }
  }
  for (int k = 0; k < int(symbols.size()); ++k) {
    symbols[k].prev = k - 1;
    symbols[k].next = k + 1 < int(symbols.size()) ? k + 1 : -1;
  }

  struct Candidate {
    uint32_t rank;
    int position;
    TokenId result;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : position > o.position; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto push_candidate = [&](int position) {
    int next = symbols[position].next;
    if (next < 0) return;
    auto it = merges_.find(pair_key(symbols[position].id, symbols[next].id));
    if (it != merges_.end()) queue.push({it->second.rank, position, it->second.result});
  };
  for (int k = 0; k + 1 < int(symbols.size()); ++k) push_candidate(k);

  while (!queue.empty()) {
    Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.position];
    if (left.removed || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.result != top.result) continue;  // stale
    left.id = top.result;
    right.removed = true;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.position;
    if (left.prev >= 0) push_candidate(left.prev);
    push_candidate(top.position);
  }

  std::vector<TokenId> ids;
  for (const Symbol& s : symbols)
    if (!s.removed) ids.push_back(s.id);
  return ids;
}

}  // namespace sparrow
