// A trace's requests replayed through an in-process cache of blocks: the reference a real
// cell's replay is measured against (its hit rate under the same policy and capacity), and
// Belady's rule, the offline bound no online policy reaches.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvstash/status.h"

namespace kvstash::replay {

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
  kArc,     // ARC: recency and frequency lists whose split adapts to hits on their ghosts
  // Prefix-aware, learned: each request's blocks are kept for a time learned online per class
  // of (its conversation's turn, its prompt's length, the prompt's last block), the times
  // chosen to fill the capacity with the most hits per block-second (replay_model.cc).
  kTurnTtl,
};

// The policy's name in the bench's rows ("lru", "belady", "s3-fifo", "arc", "turn-ttl").
const char* policy_name(ReplayPolicy policy);

// Which blocks a request looks up and saves.
enum class ReplaySaves : std::uint8_t {
  // As the trace's README measures it: every block, the partial last one too; a block past the
  // first miss that the cache holds is used, not saved again.
  kEveryBlock,
  // As kvstash's connectors run: only whole blocks are looked up and saved (a partial last
  // block is computed, never stored), and every block from the hit on is put, one the cache
  // holds replaced: when the cache is full, a put evicts first (the cell reserves the new
  // copy's page before it frees the old one).
  kConnector,
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

// The blocks of a request that are looked up and saved (its first ones): all, or only the
// whole ones (a partial last block is never saved by a connector).
std::size_t blocks_kept(const TraceRequest& r, std::uint32_t block_tokens, ReplaySaves saves);

// Each request's time in seconds from the first's, as turn-ttl's model counts it: its
// timestamp, or a millisecond after the request before it if that is later (a trace's requests
// of one timestamp come in turn, as in a cell).
std::vector<double> request_times(std::span<const TraceRequest> trace);

// The prompt tokens of a request's first `blocks` blocks (the last one what the prompt has).
std::uint64_t prefix_tokens(const TraceRequest& r, std::size_t blocks, std::uint32_t block_tokens);

// Each request in turn: the leading blocks the cache holds are hits (used again: their recency
// renewed), the rest are computed and saved (`saves` says which), each evicting one block when
// the cache holds `capacity_blocks`. A block is `block_tokens` tokens, the last one of a prompt
// what is left of it.
ModelResult replay_model(std::span<const TraceRequest> trace, std::uint64_t capacity_blocks,
                         ReplayPolicy policy, std::uint32_t block_tokens = 512,
                         ReplaySaves saves = ReplaySaves::kEveryBlock);

// What a pool over an NVMe tier gives (the tier's own counts beside ModelResult's).
struct TierResult {
  ModelResult total;                  // hits found in either
  std::uint64_t tier_hit_blocks = 0;  // of total.hit_blocks, found on the tier: promoted back
  std::uint64_t written_down = 0;     // blocks the pool gave up, moved down to the tier
  std::uint64_t tier_evictions = 0;   // blocks the tier gave up (gone from both)
};

// The trace through a pool of `pool_blocks` over a tier of `tier_blocks`, each least recently
// used first, as the connectors save (whole blocks): a block the pool gives up moves down to
// the tier (the node's write-down keeping ahead of the puts), the tier's own least recent one
// going when it is full; a hit on the tier is promoted back into the pool (one more block
// moving down when the pool is full). A prefix hit runs over blocks in either.
TierResult replay_tiers(std::span<const TraceRequest> trace, std::uint64_t pool_blocks,
                        std::uint64_t tier_blocks, std::uint32_t block_tokens = 512);

}  // namespace kvstash::replay
