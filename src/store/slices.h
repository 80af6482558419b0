// Private to src/store: what the store does with the caller's slices besides moving them:
// their length, the check that the store reads none in device memory, and their checksum
// (common/checksum.h), whole or a segment at a time.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "common/checksum.h"
#include "kvstash/store.h"

namespace kvstash::store {

std::uint64_t total_length(std::span<const Slice> slices);

// kInvalidArgument when a slice lies in device memory: the store reads no byte of it (a
// device sums it where it is: PutStream::append_summed, KvCache).
Status host_only(std::span<const Slice> slices, std::string_view what);

// The sum of bytes [begin, end) of the slices' concatenation, as one checksum segment.
std::uint64_t segment_sum_at(std::span<const Slice> slices, std::uint64_t begin, std::uint64_t end);

// The block digest of bytes [begin, end) of the slices' concatenation (at most one block).
std::uint64_t block_digest_at(std::span<const Slice> slices, std::uint64_t begin, std::uint64_t end);

// An object's checksum over host slices, fed in order as the bytes become available.
class SliceHasher {
 public:
  SliceHasher(std::span<const Slice> slices, std::uint64_t segment) : slices_(slices), hash_(segment) {}

  // Hashes the object's bytes up to `end` (from where the last call stopped).
  void advance_to(std::uint64_t end);
  sum::ObjectSum digest() { return hash_.finish(); }

 private:
  std::span<const Slice> slices_;
  sum::ObjectHasher hash_;
  std::size_t si_ = 0, soff_ = 0;
};

}  // namespace kvstash::store
