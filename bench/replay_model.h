// A trace's requests replayed through an in-process cache of blocks: the reference a real
// cell's replay is measured against (its hit rate under the same policy and capacity), and
// Belady's rule, the offline bound no online policy reaches.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvstash/status.h"

namespace kvstash::bench {

// One request of a trace (docs/benchmarks.md, "Real workload"): when it arrived, its prompt's
// tokens, and its prompt's blocks, chained: two requests that begin with the same block ids
// share that prefix, block for block. The last block may be partial.
struct TraceRequest {
  std::uint64_t at_ms = 0;
  std::uint32_t input_tokens = 0;
  std::uint32_t output_tokens = 0;
  std::vector<std::uint64_t> blocks;
};

// A trace in JSON lines ({"timestamp", "input_length", "output_length", "hash_ids"}), the first
// `limit` requests (0: all). kInvalidArgument names the line that is not one.
Result<std::vector<TraceRequest>> read_trace(const std::string& path, std::size_t limit = 0);

enum class ReplayPolicy : std::uint8_t {
  kLru,     // evict the block used longest ago
  kBelady,  // offline: evict the block (the incoming one included) used farthest ahead
  kS3Fifo,  // S3-FIFO: a small FIFO for new blocks, a main one for blocks used again, a ghost
};

struct ModelResult {
  std::uint64_t hit_tokens = 0;     // prompt tokens of the leading blocks found
  std::uint64_t prompt_tokens = 0;  // every request's prompt tokens
  std::uint64_t hit_blocks = 0;     // leading blocks found
  std::uint64_t block_uses = 0;     // every request's blocks
  std::uint64_t blocks_saved = 0;   // blocks put (found missing)
  std::uint64_t evictions = 0;
  // The prefill a workload saves: prompt tokens found over prompt tokens.
  double hit_rate() const { return prompt_tokens ? double(hit_tokens) / double(prompt_tokens) : 0.0; }
  // The same counted in whole blocks (a partial last block as a whole one), as the trace's
  // README states its figures.
  double block_hit_rate() const { return block_uses ? double(hit_blocks) / double(block_uses) : 0.0; }
};

// Each request in turn, as the connector runs it: the leading blocks the cache holds are hits
// (used again: their recency renewed), the rest are computed and saved, each evicting one
// block when the cache holds `capacity_blocks`. A block is `block_tokens` tokens, the last one
// of a prompt what is left of it.
ModelResult replay_model(std::span<const TraceRequest> trace, std::uint64_t capacity_blocks,
                         ReplayPolicy policy, std::uint32_t block_tokens = 512);

}  // namespace kvstash::bench

namespace kvstash::bench {

struct ReplayBenchOptions {
  std::string trace;                                         // the trace's path
  std::vector<std::uint64_t> capacities{2000, 6000, 20000};  // in blocks
  std::size_t requests = 0;                                  // the first N requests (0: all)
  std::uint32_t block_tokens = 512;
  bool json = false;
};

// `kvstash-bench replay`: the trace through the in-process model of each policy at each
// capacity, with Belady's rule as the bound: one row per (capacity, policy). 0 on success, 2
// for a trace that cannot be read.
int run_replay(const ReplayBenchOptions& options);

}  // namespace kvstash::bench
