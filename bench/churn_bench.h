// `kvstash-bench churn`: a cache that is full all the time. Clients put (and get, stream,
// remove, touch) objects over a key space whose working set is several times the pool, so
// nearly every put evicts or replaces. Reported over time: put success, stored bytes over pool
// bytes (efficiency), evictions/s, pages reserved and in limbo, and the hit ratio of gets.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::bench {

struct ChurnBenchOptions {
  // Object sizes, log-uniform in [min_size, max_size]: "mixed" is 4 KiB..8 MiB, "kv" KV-cache
  // chunks of 1..128 MiB.
  std::uint64_t min_size = 4u << 10;
  std::uint64_t max_size = 8u << 20;
  std::uint32_t nodes = 2;
  std::uint64_t node_capacity = 64u << 20;
  std::uint64_t page_size = 1u << 20;
  // Keys the clients write over; 0: enough for three times the pool at the mean size.
  std::uint32_t keys = 0;
  std::uint32_t clients = 1;
  double seconds = 45;
  double interval = 1;
  // Weights of the operations: put, stream (a PutStream in pieces), get, remove, touch.
  double put = 1, stream = 0, get = 0, remove = 0, touch = 0;
  // Of the puts: with a TTL of 0.2..2 s; with a deadline of 1..50 ms from now.
  double ttl_fraction = 0.1;
  double short_deadline_fraction = 0.25;
  // Of the stream puts: aborted midway; of the gets: cancelled from another thread.
  double cancel_fraction = 0;
  TransportKind transport = TransportKind::kShm;
  // Give each node an NVMe tier: a file in this directory (on a file system with O_DIRECT) of
  // ssd_capacity bytes (0: eight pools).
  std::string ssd_dir;
  std::uint64_t ssd_capacity = 0;
  std::uint64_t seed = 1;
  bool json = false;
  std::string plot;  // SVG: efficiency, put success and limbo over time
  // Exit 1 when the whole run's put success is below this (0: never), for scripted checks.
  double min_put_success = 0;
};

// "put=4,get=3,stream=1": the operation weights. kInvalidArgument naming a bad item.
Status parse_churn_mix(std::string_view text, ChurnBenchOptions* options);

// "mixed", "kv", or "A-B" (sizes): min_size/max_size. kInvalidArgument otherwise.
Status parse_churn_sizes(std::string_view text, ChurnBenchOptions* options);

// Runs it. Exit code: 0, 1 (a cell that would not start, a wrong byte, put success below
// --min-put-success), 2 (options found bad only now).
int run_churn(const ChurnBenchOptions& options);

}  // namespace kvstash::bench
