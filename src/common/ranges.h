// Sorted, disjoint ranges of an address space (kvstash::RemoteRange), as leases and grants
// hold them: whether one holds a transfer, and how a list of them is put in that shape.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvstash/transfer.h"

namespace kvstash::rangeset {

// Whether [addr, addr + length) lies inside one of `sorted` (by address, disjoint).
inline bool covers(std::span<const RemoteRange> sorted, std::uint64_t addr, std::uint64_t length) {
  auto it = std::upper_bound(sorted.begin(), sorted.end(), addr,
                             [](std::uint64_t a, const RemoteRange& r) { return a < r.addr; });
  if (it == sorted.begin()) return false;
  --it;
  return addr - it->addr <= it->length && length <= it->length - (addr - it->addr);
}

// Sorts `rs` by address and joins the ranges that overlap or touch.
inline void merge(std::vector<RemoteRange>& rs) {
  std::sort(rs.begin(), rs.end(), [](const RemoteRange& a, const RemoteRange& b) { return a.addr < b.addr; });
  std::size_t kept = 0;
  for (const RemoteRange& r : rs) {
    if (kept > 0 && r.addr <= rs[kept - 1].addr + rs[kept - 1].length) {
      RemoteRange& last = rs[kept - 1];
      last.length = std::max(last.length, r.addr + r.length - last.addr);
    } else {
      rs[kept++] = r;
    }
  }
  rs.resize(kept);
}

}  // namespace kvstash::rangeset
