#include "server/parsers/text_scan.h"

#include <algorithm>

namespace sparrow::parsers {

MarkerHit find_marker(std::string_view text, const std::vector<std::string_view>& markers, bool at_end) {
  MarkerHit hit{text.size(), -1, 0};
  for (size_t i = 0; i < markers.size(); ++i) {
    size_t pos = text.find(markers[i]);
    if (pos != std::string_view::npos && (hit.marker < 0 || pos < hit.pos)) hit = {pos, static_cast<int>(i), markers[i].size()};
  }
  if (hit.found() || at_end) return hit;
  // Hold back the longest tail that is the beginning of some marker.
  size_t held = 0;
  for (std::string_view marker : markers) {
    for (size_t n = std::min(marker.size() - 1, text.size()); n > held; --n) {
      if (text.substr(text.size() - n) == marker.substr(0, n)) {
        held = n;
        break;
      }
    }
  }
  hit.pos = text.size() - held;
  return hit;
}

size_t leading_space(std::string_view text) {
  size_t n = 0;
  while (n < text.size() && is_space(text[n])) ++n;
  return n;
}

size_t trailing_space(std::string_view text) {
  size_t n = 0;
  while (n < text.size() && is_space(text[text.size() - 1 - n])) ++n;
  return n;
}

std::string_view trim(std::string_view text) {
  text.remove_prefix(leading_space(text));
  text.remove_suffix(trailing_space(text));
  return text;
}

std::map<std::string, std::string> parse_attributes(std::string_view text) {
  std::map<std::string, std::string> attributes;
  size_t i = 0;
  while (true) {
    i += leading_space(text.substr(i));
    size_t equals = text.find('=', i);
    if (equals == std::string_view::npos) break;
    std::string name(trim(text.substr(i, equals - i)));
    i = equals + 1;
    i += leading_space(text.substr(i));
    size_t end;
    std::string value;
    if (i < text.size() && (text[i] == '"' || text[i] == '\'')) {
      end = text.find(text[i], i + 1);
      if (end == std::string_view::npos) end = text.size();
      value = text.substr(i + 1, end - i - 1);
      i = std::min(end + 1, text.size());
    } else {
      end = i;
      while (end < text.size() && !is_space(text[end])) ++end;
      value = text.substr(i, end - i);
      i = end;
    }
    attributes[name] = value;
  }
  return attributes;
}

std::string json_text(const nlohmann::json& value) {
  return value.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

std::string json_string_body(std::string_view raw) {
  std::string quoted = json_text(nlohmann::json(std::string(raw)));
  return quoted.substr(1, quoted.size() - 2);
}

}  // namespace sparrow::parsers
