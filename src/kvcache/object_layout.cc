#include "kvcache/object_layout.h"

#include "common/wire.h"

namespace kvstash::kvcache {

std::string object_layout(const std::string& tag, const std::vector<std::uint64_t>& sums) {
  std::string s = tag + ";xxh3=";
  for (std::size_t i = 0; i < sums.size(); ++i) {
    if (i > 0) s += ',';
    s += wire::to_hex64(sums[i]);
  }
  return s;
}

std::optional<std::vector<std::uint64_t>> parse_layout(std::string_view layout, std::string_view tag,
                                                       std::uint32_t layers) {
  const std::string_view head = ";xxh3=";
  if (layout.size() < tag.size() + head.size() || layout.substr(0, tag.size()) != tag ||
      layout.substr(tag.size(), head.size()) != head) {
    return std::nullopt;
  }
  std::string_view rest = layout.substr(tag.size() + head.size());
  std::vector<std::uint64_t> sums;
  while (!rest.empty()) {
    const std::string_view item = rest.substr(0, 16);
    if (item.size() != 16 || item.find_first_not_of("0123456789abcdef") != std::string_view::npos) {
      return std::nullopt;
    }
    sums.push_back(std::stoull(std::string(item), nullptr, 16));
    rest.remove_prefix(16);
    if (!rest.empty()) {
      // A comma separates two checksums; one at the end is not what object_layout() writes.
      if (rest[0] != ',' || rest.size() == 1) return std::nullopt;
      rest.remove_prefix(1);
    }
  }
  if (sums.size() != layers) return std::nullopt;
  return sums;
}

}  // namespace kvstash::kvcache
