#include "common/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace kvstash::units {

Result<std::uint64_t> parse_size(std::string_view text) {
  auto bad = [&] {
    // Appended piecewise: GCC 12 at -O3 warns falsely (-Wrestrict) on "'" + std::string(...).
    std::string m = "'";
    m.append(text).append("' is not a size (examples: 4096, 64KiB, 2GiB)");
    return Status::invalid_argument(std::move(m));
  };
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) return bad();
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + i, value);
  if (ec != std::errc() || end != text.data() + i) return bad();
  std::string unit;
  for (char c : text.substr(i)) {
    if (c != ' ') unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  double mult;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "k" || unit == "kib")
    mult = 1024.0;
  else if (unit == "m" || unit == "mib")
    mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb")
    mult = 1e3;
  else if (unit == "mb")
    mult = 1e6;
  else if (unit == "gb")
    mult = 1e9;
  else if (unit == "tb")
    mult = 1e12;
  else
    return bad();
  double bytes = value * mult;
  if (bytes >= 1.8e19 || bytes != std::floor(bytes)) return bad();
  return static_cast<std::uint64_t>(bytes);
}

Result<std::chrono::milliseconds> parse_duration(std::string_view text) {
  auto bad = [&] {
    std::string m = "'";
    m.append(text).append("' is not a duration (examples: 250ms, 3s, 2m)");
    return Status::invalid_argument(std::move(m));
  };
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + i, value);
  if (i == 0 || ec != std::errc() || end != text.data() + i) return bad();
  std::string_view unit = text.substr(i);
  double mult;
  if (unit.empty() || unit == "ms")
    mult = 1;
  else if (unit == "s")
    mult = 1e3;
  else if (unit == "m" || unit == "min")
    mult = 60e3;
  else if (unit == "h")
    mult = 3600e3;
  else
    return bad();
  double ms = value * mult;
  if (ms >= 1e15 || ms != std::floor(ms)) return bad();
  return std::chrono::milliseconds(static_cast<std::int64_t>(ms));
}

std::string format_size(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (v == std::floor(v))
    std::snprintf(buf, sizeof buf, "%.0f %s", v, kUnits[u]);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[u]);
  return buf;
}

}  // namespace kvstash::units
