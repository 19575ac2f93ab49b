#include "core/json_input.h"

#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace sparrow {
namespace {

// nlohmann's SAX events (the interface of nlohmann::json_sax) turned into a value, one container per
// open array or object.
template <typename Json>
class Builder {
 public:
  bool null() { return add(Json(nullptr)); }
  bool boolean(bool v) { return add(Json(v)); }
  bool number_integer(typename Json::number_integer_t v) { return add(Json(v)); }
  bool number_unsigned(typename Json::number_unsigned_t v) { return add(Json(v)); }
  bool number_float(typename Json::number_float_t v, const std::string&) { return add(Json(v)); }
  bool string(std::string& v) { return add(Json(std::move(v))); }
  bool binary(typename Json::binary_t&) { return false; }  // not in JSON text
  bool start_object(size_t) { return open(Json::object()); }
  bool start_array(size_t) { return open(Json::array()); }
  bool key(std::string& k) {
    key_ = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(size_t, const std::string&, const nlohmann::detail::exception&) { return false; }

  bool too_deep() const { return too_deep_; }
  Json& root() { return root_; }

 private:
  static constexpr bool kOrdered = std::is_same_v<Json, nlohmann::ordered_json>;

  // An ordered object of more members than this finds its keys through Open::places. (nlohmann's
  // ordered_map is a vector of pairs whose own lookups search it from the start; a sorted object is a
  // std::map, which needs no help.)
  static constexpr size_t kIndexedSize = 16;

  struct Open {
    Json* container;
    std::unordered_map<std::string, size_t> places;  // key -> its place; empty while the object is small
  };

  // Where key_ sits in an open ordered object, or pairs.size() when it is new.
  template <typename Pairs>
  size_t find_member(const Open& object, const Pairs& pairs) const {
    if (!object.places.empty()) {
      auto it = object.places.find(key_);
      return it == object.places.end() ? pairs.size() : it->second;
    }
    size_t at = 0;
    while (at < pairs.size() && pairs[at].first != key_) ++at;
    return at;
  }

  // Puts `v` where the parser is (the root, the open array, or the open object under key_); returns
  // where it went.
  Json* place(Json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Open& top = open_.back();
    if (top.container->is_array()) {
      top.container->push_back(std::move(v));
      return &top.container->back();
    }
    auto& members = top.container->template get_ref<typename Json::object_t&>();
    if constexpr (kOrdered) {
      auto& pairs = static_cast<typename Json::object_t::Container&>(members);
      size_t at = find_member(top, pairs);
      if (at < pairs.size()) {
        pairs[at].second = std::move(v);  // a repeated key: its first place, its last value
      } else {
        pairs.emplace_back(key_, std::move(v));
        if (!top.places.empty() || pairs.size() == kIndexedSize)
          for (size_t i = top.places.size(); i < pairs.size(); ++i) top.places.emplace(pairs[i].first, i);
      }
      return &pairs[at].second;
    } else {
      Json& slot = members[key_];
      slot = std::move(v);
      return &slot;
    }
  }

  bool add(Json v) {
    place(std::move(v));
    return true;
  }

  bool open(Json container) {
    if (int(open_.size()) >= kMaxJsonDepth) {
      too_deep_ = true;
      return false;  // stops the parser
    }
    open_.push_back({place(std::move(container)), {}});
    return true;
  }

  bool close() {
    open_.pop_back();
    return true;
  }

  Json root_;
  std::vector<Open> open_;
  std::string key_;
  bool too_deep_ = false;
};

}  // namespace

template <typename Json>
JsonInput<Json> parse_json_input(std::string_view text) {
  Builder<Json> builder;
  JsonInput<Json> out;
  if (Json::sax_parse(text, &builder)) {
    out.value = std::move(builder.root());
  } else {
    out.status = builder.too_deep() ? JsonInput<Json>::Status::TooDeep : JsonInput<Json>::Status::Invalid;
    out.value = Json(nlohmann::detail::value_t::discarded);
  }
  return out;
}

template JsonInput<nlohmann::json> parse_json_input(std::string_view);
template JsonInput<nlohmann::ordered_json> parse_json_input(std::string_view);

}  // namespace sparrow
