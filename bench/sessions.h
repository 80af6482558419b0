// The benchmark's synthetic KV cache: sessions of a Llama-2-7B-shaped model, sized from a
// fixed seed so that runs compare, filled with bytes that differ per backend, round and
// session so that a get returning another object fails the comparison.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvstash/memory.h"
#include "kvstash/status.h"
#include "store_bench.h"

namespace kvstash::bench {

std::uint64_t splitmix64(std::uint64_t& state);

// Bytes that differ per backend, round and session. A word at a time: generating a GiB must
// not take longer than moving it.
void fill_pattern(std::byte* p, std::size_t n, std::uint64_t backend, std::uint64_t round,
                  std::uint64_t session);

// Session sizes: every one `object_size`, or a token count drawn with a fixed seed (the same
// sessions in every run and on every machine) times the KV bytes of a token.
std::vector<std::uint64_t> session_sizes(const StoreBenchOptions& o);

struct Sessions {
  std::vector<std::uint64_t> sizes;
  std::vector<Buffer> source;  // one per session: what is put, and the truth a get is compared with
  Buffer restore;              // every get lands here (zeroed first), as into a GPU's free blocks
  std::uint64_t total = 0;
  std::uint64_t largest = 0;
};

// The sessions' buffers and the restore buffer, for `sizes` already set.
Status allocate_sessions(Sessions& s);

std::uint64_t round_up(std::uint64_t n, std::uint64_t unit);
// Whole pages objects of these sizes take.
std::uint64_t pages_for(const std::vector<std::uint64_t>& sizes, std::uint64_t page);
// MemAvailable from /proc/meminfo, in bytes; 0 when unknown.
std::uint64_t mem_available();

}  // namespace kvstash::bench
