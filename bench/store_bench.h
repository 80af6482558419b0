// `kvstash-bench store`: offloads the KV cache of N sessions of a Llama-2-7B-shaped model to
// remote memory through the Store and restores it, and pushes the same bytes through Redis
// itself (HSET/HGET, the tutorial's approach) as the baseline measured in the same run. Every
// restored byte is compared with what was offloaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/status.h"

namespace kvstash::bench {

// Llama-2-7B in fp16: 2 (K,V) x 32 layers x 32 kv-heads x 128 head-dim x 2 bytes.
inline constexpr std::uint64_t kKvBytesPerToken = 2ull * 32 * 32 * 128 * 2;
inline constexpr std::uint32_t kMaxTokens = 32768;

// Backend names, in the order they are measured (the baseline first: the others' ratios
// need it).
inline constexpr std::string_view kRedisBytes = "redis-bytes";
inline constexpr std::string_view kStoreBackends[] = {"kvstash-shm", "kvstash-tcp", "kvstash-ucx",
                                                      "kvstash-verbs"};

struct StoreBenchOptions {
  std::uint32_t sessions = 8;
  // Tokens per session: picked uniformly in [min_tokens, max_tokens] with a fixed seed.
  std::uint32_t min_tokens = 256;
  std::uint32_t max_tokens = 256;
  // When set, every session is exactly this many bytes and the tokens are ignored.
  std::uint64_t object_size = 0;
  // Backend names (kvstash-shm, kvstash-tcp, kvstash-ucx, redis-bytes); empty: all built in.
  std::vector<std::string> backends;
  // Each round puts every session, then gets every session back.
  std::uint32_t rounds = 3;
  // An existing cell's Redis; empty: start a private redis-server and kvstashd.
  std::string redis_url;
  std::string redis_password;
  // Pool of the private kvstashd; 0: all sessions of one round + 25%, in whole pages.
  std::uint64_t capacity = 0;
  // Page size of the private kvstashd; 0: kvstashd's default.
  std::uint64_t page_size = 0;
  bool json = false;
  // Cluster token for the tcp transport (the private kvstashd gets it in a 0600 file).
  std::string token;
  // "connection" or "lease": overrides the cell's rkey scope; empty: the cell's.
  std::string rkey_scope;
};

// "256" or "256-4096" into min_tokens/max_tokens. kInvalidArgument (naming the text) unless
// 1 <= A <= B <= kMaxTokens.
Status parse_token_range(std::string_view text, StoreBenchOptions* options);

// "kvstash-shm,redis-bytes" or "all" (empty result: every one built in). kInvalidArgument
// naming an unknown backend.
Result<std::vector<std::string>> parse_backends(std::string_view list);

// Runs the benchmark and prints its rows. Returns the exit code: 0, 1 on a failed or
// corrupted operation or when the cell could not be started, 2 for option values found bad
// only now (a URL, a capacity too small for the sessions).
int run_store(const StoreBenchOptions& options);

}  // namespace kvstash::bench
