// Plain messages between sparrow's own processes (the step plans of runner/step_plan.h, the requests and
// events between data-parallel engines of engine/remote_groups.h): little-endian fixed-width fields (both
// ends are the same build), strings and vectors prefixed by a count. A Reader throws a one-line
// sparrow::Error naming the message for anything truncated, padded or too large, never reading past the end.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"

namespace sparrow::wire {

class Writer {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t at = bytes.size();
    bytes.resize(at + sizeof(T));
    std::memcpy(bytes.data() + at, &value, sizeof(T));
  }
  void put(const std::string& text) {
    put<uint64_t>(text.size());
    bytes.insert(bytes.end(), text.begin(), text.end());
  }
  template <typename T>
  void put(const std::vector<T>& values) {
    put<uint64_t>(values.size());
    for (const T& v : values) put<T>(v);
  }
  std::vector<uint8_t> bytes;
};

class Reader {
 public:
  // `what` names the message in errors ("step plan", "request").
  Reader(const std::vector<uint8_t>& bytes, const char* what) : bytes_(bytes), what_(what) {}
  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T value;
    std::memcpy(&value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  std::string get_string() {
    const uint64_t n = get<uint64_t>();
    need(n);
    std::string text(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += n;
    return text;
  }
  template <typename T>
  std::vector<T> get_vector() {
    const uint64_t n = get_count(sizeof(T));  // a count no message could hold fails here, before allocating
    std::vector<T> values(n);
    for (T& v : values) v = get<T>();
    return values;
  }
  // A count of items of at least `item_bytes` each that the rest of the message can hold.
  uint64_t get_count(uint64_t item_bytes) {
    const uint64_t n = get<uint64_t>();
    SPARROW_CHECK(item_bytes == 0 || n <= (bytes_.size() - at_) / item_bytes, what_, ": a count of ", n,
                  " items in ", bytes_.size(), " bytes");
    return n;
  }
  void finish() const { SPARROW_CHECK(at_ == bytes_.size(), what_, ": ", bytes_.size() - at_, " bytes left over"); }

 private:
  void need(uint64_t n) const { SPARROW_CHECK(n <= bytes_.size() - at_, what_, ": truncated (", bytes_.size(), " bytes)"); }
  const std::vector<uint8_t>& bytes_;
  const char* what_;
  size_t at_ = 0;
};

}  // namespace sparrow::wire
