// `kvstash-bench kvcache`: saves and loads one Llama-2-7B session's KV cache, its blocks
// scattered over an engine's paged cache, through KvCache (layer by layer, every layer
// checksummed), against the same bytes put and got as contiguous chunk-sized objects through
// the Store in the same run. Every loaded block is compared with what was saved.
#pragma once

#include <memory>
#include <string>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvstash/kvcache.h"
#include "kvstash/types.h"

namespace kvstash {
class Store;
namespace harness {
class LocalRedis;
class LocalNode;
}  // namespace harness
}  // namespace kvstash

namespace kvstash::bench {

struct KvCacheBenchOptions {
  std::uint32_t tokens = 4096;    // one session; whole 256-token chunks
  std::uint32_t block_size = 16;  // tokens per block
  std::uint32_t rounds = 3;       // each saves then loads the session
  std::vector<TransportKind> transports{TransportKind::kShm, TransportKind::kTcp};
  bool json = false;
  bool gpu = false;  // the caches in GPU memory, staged (run_kvcache_gpu)
  // Both set: saved by the ranks of one tensor-parallel degree, loaded at another
  // (run_kvcache_tp).
  std::uint32_t save_tp = 0, load_tp = 0;
  bool hnd = false;  // blocks with heads outermost (HND) rather than tokens (NHD)
};

// What both forms measure: one Llama-2-7B session (fp16, vLLM's per-layer tensors with twice
// the blocks it needs), its tokens, and the scattered blocks it takes in the source cache and
// in the destination one.
struct BenchSession {
  KvCacheShape shape;
  std::uint64_t bytes = 0;
  std::size_t chunks = 0;  // of 256 tokens
  std::vector<std::uint32_t> tokens, blocks_src, blocks_dst;
};

// kInvalidArgument (say so, exit 2) unless the tokens are a positive multiple of 256 and the
// block size divides 256.
Result<BenchSession> plan_session(const KvCacheBenchOptions& options);

// An engine's cache in host memory: vLLM's per-layer (2, num_blocks, ...) tensors, populated
// with random bytes from `seed`.
struct HostKvCache {
  std::vector<Buffer> layers;
  std::vector<void*> ptrs;
};
Result<HostKvCache> allocate_host_cache(const KvCacheShape& shape, std::uint64_t seed);

// The private cell the host benches run against: a redis-server and a kvstashd of `capacity`
// bytes serving every transport, on loopback; stopped when it goes.
struct BenchCell {
  BenchCell();
  BenchCell(BenchCell&&) noexcept;
  ~BenchCell();
  std::unique_ptr<harness::LocalRedis> redis;
  std::unique_ptr<harness::LocalNode> node;
};
Result<BenchCell> start_bench_cell(std::uint64_t capacity);
// A store of `cell` preferring `kind` (UCX's emulated RMA allowed), with a 2-minute timeout.
Result<std::unique_ptr<Store>> open_bench_store(const BenchCell& cell, TransportKind kind);

// Redis's own time spent in a phase of the run: its scripts' (INFO commandstats, FCALL and EVALSHA: every
// kvstash metadata change is a script) and its process's CPU (INFO cpu, user + system), read
// before and after.
struct RedisCost {
  double commands_us = 0;
  double cpu_us = 0;
};
class RedisMeter {
 public:
  // Connects to `url`; a meter that cannot connect measures nothing (zeros).
  explicit RedisMeter(const std::string& url);
  ~RedisMeter();
  // Adds what Redis spent since the last call (or since it connected) to *cost.
  void add_since_last(RedisCost* cost);

 private:
  RedisCost read();
  struct Impl;
  std::unique_ptr<Impl> impl_;
  RedisCost last_;
};

// One timed round of the KvCache side, the same for host and GPU caches: `src` saves the
// session's blocks, `dst` loads them into its own; the seconds of each are added to *save_s
// and *load_s, and with a meter what Redis spent on each to *save_cost and *load_cost.
// Returns 1 when a chunk failed (said on stderr), else 0.
int time_save_and_load(KvCache& src, KvCache& dst, const BenchSession& s, double* save_s, double* load_s,
                       RedisMeter* meter = nullptr, RedisCost* save_cost = nullptr,
                       RedisCost* load_cost = nullptr);

// Runs it (a private redis-server and kvstashd on loopback) and prints its rows. Returns the
// exit code: 0, or 1 on a failed or corrupted operation.
int run_kvcache(const KvCacheBenchOptions& options);

// Saved at TP=save_tp, loaded at TP=load_tp (a thread per rank), keys by KV heads, against a
// same-degree load (keys by heads, and by rank) in the same run. Returns as run_kvcache; 2
// for degrees that do not divide the model's heads.
int run_kvcache_tp(const KvCacheBenchOptions& options);

// The same with both caches in GPU memory, staged through pinned bounce buffers by the CUDA
// copier, against cudaMemcpy device-to-host and host-to-device of the same bytes. Built only
// with CUDA (KVSTASH_BENCH_GPU).
int run_kvcache_gpu(const KvCacheBenchOptions& options);

}  // namespace kvstash::bench
