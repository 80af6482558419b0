#include "metadata/records.h"

#include "metadata/catalog_common.h"

namespace kvstash::metadata {

using detail::corrupt;
using detail::number;

std::string cell_prefix(std::string_view cell) {
  std::string p = "kvs:{kvs:";
  p.append(cell);
  p += '}';
  return p;
}

std::string copy_key(std::string_view key, std::uint32_t i) {
  std::string k(key);
  if (i > 0) k.append(1, '\x1f').append(std::to_string(i));
  return k;
}

Status validate_object_key(std::string_view key) {
  if (key.empty()) return Status::invalid_argument("object key is empty");
  if (key.size() > 1024) return Status::invalid_argument("object key is longer than 1024 bytes");
  return {};
}

bool valid_node_id(std::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

Result<std::vector<Extent>> parse_extents(std::string_view text) {
  std::vector<Extent> out;
  while (!text.empty()) {
    std::size_t end = text.find(';');
    std::string_view item = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    std::size_t c1 = item.find(','), c2 = item.rfind(',');
    if (c1 == std::string_view::npos || c1 == c2)
      return corrupt("malformed extent '" + std::string(item) + "'");
    auto page = number<std::uint64_t>(item.substr(c1 + 1, c2 - c1 - 1));
    auto gen = number<std::int64_t>(item.substr(c2 + 1));
    Extent e{std::string(item.substr(0, c1)), page.value_or(0), gen.value_or(0)};
    if (!page || !gen || *gen <= 0 || !valid_node_id(e.node)) {
      return corrupt("malformed extent '" + std::string(item) + "'");
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace kvstash::metadata
