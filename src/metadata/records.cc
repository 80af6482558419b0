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
  // A corrupt count must not make this allocate without bound: no object spans more pages
  // than this (allocate in prelude/placement.lua refuses bigger puts).
  constexpr std::uint64_t kMaxPages = kMaxObjectPages;
  std::vector<Extent> out;
  while (!text.empty()) {
    std::size_t end = text.find(';');
    std::string_view item = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    // node,page,generation[,count]
    std::string_view field[4];
    std::size_t fields = 0;
    for (std::string_view rest = item;; ++fields) {
      const std::size_t comma = rest.find(',');
      if (fields == 4) {
        fields = 5;  // too many
        break;
      }
      field[fields] = rest.substr(0, comma);
      if (comma == std::string_view::npos) {
        ++fields;
        break;
      }
      rest = rest.substr(comma + 1);
    }
    auto malformed = [&] { return corrupt("malformed extent '" + std::string(item) + "'"); };
    if (fields != 3 && fields != 4) return malformed();
    auto page = number<std::uint64_t>(field[1]);
    auto gen = number<std::int64_t>(field[2]);
    auto count = fields == 4 ? number<std::uint64_t>(field[3]) : std::optional<std::uint64_t>(1);
    if (!page || !gen || *gen <= 0 || !count || *count == 0 || *count > kMaxPages - out.size() ||
        *page > ~0ull - *count || !valid_node_id(field[0])) {
      return malformed();
    }
    for (std::uint64_t i = 0; i < *count; ++i) out.push_back({std::string(field[0]), *page + i, *gen});
  }
  return out;
}

}  // namespace kvstash::metadata
