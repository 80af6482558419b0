// `kvstash-bench serve`: an engine's request stream, simulated, with kvstash under its paged
// KV cache.
//
// Sessions start from one of a few shared system prompts and come back for several turns (a
// user message, then the model's answer). The engine's cache holds only some sessions: when a
// turn needs room, the least recently used idle sessions are offloaded (their full chunks
// saved through KvCache, their blocks freed). A turn whose session is not resident looks its
// tokens up (contains_prefix) and loads the chunks the cell holds, layer by layer, into fresh
// blocks; the rest of its tokens are "computed" (their KV written by the bench). A new session
// finds its system prompt's chunks that other sessions saved.
//
// Reported: the hit rate (tokens loaded / tokens the turns needed and did not hold), restore
// time per token, bytes moved, and per restored token the same bytes through Redis itself
// (GET of chunk-sized values on the same Redis, measured in the run) and recomputation at a
// stated prefill rate (--prefill-rate: an assumption, not a measurement).
#pragma once

#include <cstdint>

#include "kvstash/types.h"

namespace kvstash::bench {

struct ServeBenchOptions {
  std::uint32_t sessions = 8;
  std::uint32_t system_prompts = 2;
  std::uint32_t system_tokens = 1024;   // tokens of each shared system prompt
  std::uint32_t turns = 3;              // per session
  std::uint32_t user_tokens = 256;      // per turn
  std::uint32_t answer_tokens = 128;    // per turn
  std::uint32_t resident_sessions = 3;  // how many whole sessions the engine's cache holds
  std::uint32_t chunk_tokens = 256;
  double prefill_rate = 10000;  // tokens/s the engine would recompute at (stated, not measured)
  TransportKind transport = TransportKind::kShm;
  std::uint32_t seed = 1;
  bool json = false;
};

// Runs it against a private redis-server and kvstashd on loopback. Returns the exit code: 0,
// 1 when a save or load failed or loaded wrong bytes, 2 for bad options.
int run_serve(const ServeBenchOptions& options);

}  // namespace kvstash::bench
