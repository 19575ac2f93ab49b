// Errors: one exception type for everything a user can cause (bad checkpoint, bad flag, bad request).
// Messages are one line and name the problem; callers at the edges (CLI, server) print them and exit
// or answer with an error, never crash.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace sparrow {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Concatenates any streamable values into one string: cat("layer ", 3, ": bad").
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(cat(args...));
}

}  // namespace sparrow

// A check on user-controlled input: throws sparrow::Error with the given message parts.
#define SPARROW_CHECK(cond, ...)              \
  do {                                        \
    if (!(cond)) ::sparrow::fail(__VA_ARGS__); \
  } while (0)
