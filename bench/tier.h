// `kvstash-bench tier`: the NVMe tier's device layer (src/node/ssd_device.h: O_DIRECT through
// io_uring) writing and reading a file sequentially in page-sized I/Os, against fio's O_DIRECT
// io_uring job of the same file, block size and depth in the same run (docs/nvme-tier.md).
#pragma once

#include <cstdint>
#include <string>

namespace kvstash::bench {

struct TierBenchOptions {
  std::string path;                       // a file on the tier's file system (created, removed after)
  std::uint64_t bytes = 1ull << 30;       // the file's size: each pass writes, then reads, all of it
  std::uint64_t io_bytes = 4ull << 20;    // one I/O: a page
  std::uint32_t depth = 16;               // I/Os in flight
  std::uint32_t rounds = 3;               // passes of each; the best is reported, as fio's
  bool json = false;
};

// Prints a row per (engine, op); 0 on success, 1 when the device failed.
int run_tier(const TierBenchOptions& options);

}  // namespace kvstash::bench
