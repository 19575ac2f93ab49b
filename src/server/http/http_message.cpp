#include "server/http/http_message.h"

#include <cctype>
#include <cstdio>

namespace sparrow::server::http {

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

std::string Request::field(std::string_view name) const {
  for (const auto& [field_name, value] : fields)
    if (equals_ignoring_case(field_name, name)) return value;
  return "";
}

std::optional<std::string> Request::verbatim_field(std::string_view name) const {
  std::optional<std::string> found;
  std::string_view rest = header_section;
  bool request_line = true;
  while (!rest.empty()) {
    size_t end = rest.find("\r\n");
    std::string_view line = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 2);
    if (request_line) {
      request_line = false;
      continue;
    }
    size_t colon = line.find(':');
    // A field name has no whitespace before its colon (RFC 9112 section 5.1); a line starting with
    // whitespace continues the previous field (obsolete line folding), which no credential needs.
    if (colon == std::string_view::npos || !equals_ignoring_case(line.substr(0, colon), name)) continue;
    if (found) return std::nullopt;  // given twice: ambiguous
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
    found = std::string(value);
  }
  return found;
}

std::string_view reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "";
  }
}

std::string http_date(std::time_t time) {
  std::tm utc{};
  gmtime_r(&time, &utc);
  char text[40];
  std::strftime(text, sizeof text, "%a, %d %b %Y %H:%M:%S GMT", &utc);  // the C locale's names, as required
  return text;
}

std::string response_head(const Response& response, int version, Framing framing, bool keep_alive,
                          size_t content_length, std::time_t now) {
  std::string head = version == 10 ? "HTTP/1.0 " : "HTTP/1.1 ";
  head += std::to_string(response.status);
  head += ' ';
  head += reason_phrase(response.status);
  head += "\r\nDate: " + http_date(now) + "\r\n";
  if (!response.content_type.empty()) head += "Content-Type: " + response.content_type + "\r\n";
  for (const auto& [name, value] : response.fields) head += name + ": " + value + "\r\n";
  if (framing == Framing::ContentLength) head += "Content-Length: " + std::to_string(content_length) + "\r\n";
  if (framing == Framing::Chunked) head += "Transfer-Encoding: chunked\r\n";
  // HTTP/1.1 connections persist unless closed; HTTP/1.0 ones only when both sides say keep-alive
  // (RFC 9112 section 9.3).
  if (!keep_alive)
    head += "Connection: close\r\n";
  else if (version == 10)
    head += "Connection: keep-alive\r\n";
  head += "\r\n";
  return head;
}

std::string chunk(std::string_view data) {
  if (data.empty()) return "";
  char size[20];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  std::string out = size;
  out.append(data);
  out += "\r\n";
  return out;
}

std::string target_path(std::string_view target) {
  // Absolute form ("http://host/path?q"): drop the scheme and authority.
  if (size_t scheme = target.find("://"); scheme != std::string_view::npos && !target.empty() && target.front() != '/') {
    size_t path = target.find('/', scheme + 3);
    target = path == std::string_view::npos ? std::string_view("/") : target.substr(path);
  }
  return std::string(target.substr(0, target.find_first_of("?#")));
}

}  // namespace sparrow::server::http
