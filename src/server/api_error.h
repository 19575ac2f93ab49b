// Errors the HTTP API answers with. Every failure a client can cause becomes an ApiError, which the
// server turns into an OpenAI error object with the matching status, in vLLM's nested form
// (vllm serve/exception_handling/error_response.py):
//   {"error": {"message": "...", "type": "BadRequestError", "param": "tools", "code": 400}}
// `code` is the integer HTTP status, as vLLM sends it (OpenAI itself sends a string there).
#pragma once
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace sparrow::server {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {})
      : std::runtime_error(std::move(message)), status_(status), param_(std::move(param)) {}

  int status() const { return status_; }
  const std::string& param() const { return param_; }  // the request field at fault; empty if none

 private:
  int status_;
  std::string param_;
};

// The error type name for a status: 400 BadRequestError, 401 AuthenticationError, 404 NotFoundError,
// 413 RequestTooLargeError, 503 ServiceUnavailableError, 500 InternalServerError, ...
std::string error_type(int status);

// {"error": {"message", "type", "param", "code"}}; param is null when empty.
nlohmann::ordered_json error_body(int status, const std::string& message, const std::string& param = {});
inline nlohmann::ordered_json error_body(const ApiError& e) { return error_body(e.status(), e.what(), e.param()); }

// Shorthands for the common statuses.
[[noreturn]] inline void bad_request(std::string message, std::string param = {}) {
  throw ApiError(400, std::move(message), std::move(param));
}

}  // namespace sparrow::server
