// `kvstash-bench replay`: a production trace through a real cell (a private Redis and kvstashd
// on loopback), the requests' prefix lookups, loads and saves as a connector makes them, beside
// the in-process model of each eviction policy and Belady's offline rule at the same capacity.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvstash/types.h"
#include "tools/kvstash/replay_model.h"

namespace kvstash::bench {

using replay::ModelResult;
using replay::policy_name;
using replay::read_trace;
using replay::replay_model;
using replay::replay_tiers;
using replay::ReplayPolicy;
using replay::ReplaySaves;
using replay::TierResult;
using replay::TraceRequest;

struct ReplayBenchOptions {
  std::string trace;                                         // the trace's path
  std::vector<std::uint64_t> capacities{2000, 6000, 20000};  // in blocks
  std::size_t requests = 0;                                  // the first N requests (0: all)
  std::uint32_t block_tokens = 512;
  ReplaySaves saves = ReplaySaves::kConnector;
  bool model_only = false;  // no cell: the model's rows alone
  // Capacities of an NVMe tier under the pool, in blocks: rows of the model of a pool over a
  // tier (replay_tiers) at each capacity and each of these, and (unless model_only) of a cell
  // whose node runs such a tier (kvstashd --ssd: a file in tier_dir, removed afterwards; the
  // file system must take O_DIRECT).
  std::vector<std::uint64_t> tier_capacities;
  std::string tier_dir = ".";
  // The eviction policies the cell replays the trace under (kvstash policy), each in a cell of
  // its own, each compared with the model's run of the same policy.
  std::vector<ReplayPolicy> cell_policies{ReplayPolicy::kLru};
  // The cell: a block of the trace is an object of block_bytes (a 512-token block of a real
  // model is tens of MiB; scaled down so that thousands fit here), one page of a node whose pool
  // holds `capacity` blocks.
  std::uint64_t block_bytes = 16u << 10;
  TransportKind transport = TransportKind::kShm;
  // Requests are issued at their trace time divided by `speed` (0: each as soon as the last
  // one ended).
  double speed = 0;
  // The TTFT estimate: a prompt's missing tokens are computed at prefill_tokens_per_s, its hit
  // tokens loaded at the run's measured load bandwidth as kv_bytes_per_token each.
  double prefill_tokens_per_s = 8000;
  std::uint64_t kv_bytes_per_token = 128u << 10;
  bool json = false;
  std::string plot;  // SVG: token hit rate over capacity, each policy and the cell
};

// Runs it. 0 on success; 1 for a cell that would not start, a wrong byte or a failed
// operation; 2 for a trace that cannot be read.
int run_replay(const ReplayBenchOptions& options);

}  // namespace kvstash::bench
