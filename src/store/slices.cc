#include "store/slices.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace kvstash::store {

std::uint64_t total_length(std::span<const Slice> slices) {
  std::uint64_t n = 0;
  for (const Slice& s : slices) n += s.length;
  return n;
}

Status host_only(std::span<const Slice> slices, std::string_view what) {
  for (const Slice& s : slices) {
    if (s.memory != nullptr && s.memory->region().kind != MemoryKind::kHost) {
      return Status::invalid_argument("store: " + std::string(what) +
                                      " reads device memory, which the host must not touch: sum it on the "
                                      "device (PutStream::append_summed, KvCache) or turn the check off");
    }
  }
  return {};
}

std::uint64_t segment_sum_at(std::span<const Slice> slices, std::uint64_t begin, std::uint64_t end) {
  sum::ObjectHasher h(end - begin);
  std::uint64_t at = 0;
  for (const Slice& s : slices) {
    const std::uint64_t from = std::max(begin, at), to = std::min(end, at + s.length);
    if (from < to) h.update(static_cast<const std::byte*>(s.addr) + (from - at), to - from);
    at += s.length;
    if (at >= end) break;
  }
  return *h.last_segment_sum();
}

std::uint64_t block_digest_at(std::span<const Slice> slices, std::uint64_t begin, std::uint64_t end) {
  unsigned char block[sum::kBlockBytes];
  std::uint64_t at = 0, got = 0;
  for (const Slice& s : slices) {
    const std::uint64_t from = std::max(begin, at), to = std::min(end, at + s.length);
    if (from < to) {
      const auto* p = static_cast<const unsigned char*>(s.addr) + (from - at);
      if (to - from == end - begin) return sum::block_digest(p, to - from);  // whole in one slice
      std::memcpy(block + got, p, to - from);
      got += to - from;
    }
    at += s.length;
    if (at >= end) break;
  }
  return sum::block_digest(block, got);
}

void SliceHasher::advance_to(std::uint64_t end) {
  while (hash_.bytes() < end && si_ < slices_.size()) {
    const Slice& s = slices_[si_];
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(s.length - soff_, end - hash_.bytes()));
    hash_.update(static_cast<const std::byte*>(s.addr) + soff_, n);
    soff_ += n;
    if (soff_ == s.length) ++si_, soff_ = 0;
  }
}

}  // namespace kvstash::store
