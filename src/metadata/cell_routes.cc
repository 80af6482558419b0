#include "metadata/cell_routes.h"

namespace kvstash::metadata {

std::string_view route_of(std::string_view key) {
  key = key.substr(0, key.find('\x1f'));  // a copy (PutOptions::replicas) routes as its object
  const auto open = key.find('{');
  if (open == std::string_view::npos) return key;
  const auto close = key.find('}', open + 1);
  if (close == std::string_view::npos || close == open + 1) return key;
  return key.substr(open + 1, close - open - 1);
}

std::uint64_t rendezvous_score(std::string_view cell, std::string_view route) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  auto feed = [&](std::string_view s) {
    for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  };
  feed(cell);
  feed(std::string_view("\0", 1));
  feed(route);
  // splitmix64's finalizer: FNV alone leaves the high bits of similar inputs alike.
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

std::size_t pick_cell(std::span<const std::string> cells, std::string_view route) {
  std::size_t best = cells.size();
  std::uint64_t best_score = 0;
  for (std::size_t i = 0; i < cells.size(); ++i) {
    const std::uint64_t s = rendezvous_score(cells[i], route);
    if (best == cells.size() || s > best_score) {
      best = i;
      best_score = s;
    }
  }
  return best;
}

}  // namespace kvstash::metadata
