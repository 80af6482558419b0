// `kvstash-bench checksum`: the object checksum (the xxh3 tree, common/checksum.h) on the
// host against the references measured in the same run: memcpy of the same bytes, and
// libxxhash's streaming XXH3-64 (the single-stream checksum schema 2 used).
#pragma once

#include <cstdint>

namespace kvstash::bench {

struct ChecksumBenchOptions {
  std::uint64_t bytes = 64ull << 20;  // hashed per round
  std::uint32_t rounds = 10;
  std::uint32_t threads = 2;  // the tree's blocks spread over this many threads (one row each, 1..N)
  bool json = false;
};

// Prints one row per way of hashing; 0 on success, 1 when two ways disagree on a sum.
int run_checksum(const ChecksumBenchOptions& options);

}  // namespace kvstash::bench
