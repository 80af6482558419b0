// `kvstash-bench tier`: the NVMe tier's device layer (src/node/ssd_device.h: O_DIRECT through
// io_uring) writing and reading a file sequentially in page-sized I/Os, against fio's O_DIRECT
// io_uring job of the same file, block size and depth in the same run (docs/nvme-tier.md).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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

// `kvstash-bench tier --store`: the tier under a real kvstashd (a private Redis, a node with
// a pool of `pool` bytes over --ssd `path`, a Store over tcp), per object size: puts of
// `objects` objects (the pool holds a fraction: the rest moves down, the puts paced by the
// write-down so that none is evicted), then gets of the objects on the tier with `sessions`
// at once (each promoted: the node's read into pool pages, then the client's read), every
// one checked byte for byte; fio's O_DIRECT write and read of a file of the same size on the
// same file system, in the same run, as the reference.
struct TierStoreBenchOptions {
  std::string path;
  std::vector<std::uint64_t> object_sizes{4ull << 20, 64ull << 20};
  std::uint64_t pool = 256ull << 20;
  std::uint64_t page = 4ull << 20;
  std::uint32_t pools_of_objects = 3;  // objects put: this many pools' worth
  std::uint32_t sessions = 4;
  std::uint32_t depth = 16;            // fio's iodepth (the node keeps a job's I/Os in flight)
  bool verify_checksum = true;
  bool json = false;
};
int run_tier_store(const TierStoreBenchOptions& options);

// fio's bandwidth (GB/s) for `rw` ("write" or "read") of a file of `bytes` in I/Os of
// `io_bytes`, `depth` in flight, O_DIRECT through io_uring, best of `loops`; 0 and why when
// fio is missing or failed.
std::pair<double, std::string> fio_gbps(const std::string& path, const char* rw, std::uint64_t bytes,
                                        std::uint64_t io_bytes, std::uint32_t depth, std::uint32_t loops);

}  // namespace kvstash::bench
