// `kvstash-bench checksum` (checksum_bench.h). One buffer of random bytes, hashed `rounds` times per
// row; GB/s = bytes hashed / wall time. The tree on several threads splits the segment's
// blocks into contiguous ranges, one per thread, and folds their digests: the same sum.
#include "checksum_bench.h"

#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/checksum.h"

namespace kvstash::bench {
namespace {

using Clock = std::chrono::steady_clock;

// The tree's segment sum of `n` bytes with `threads` threads hashing disjoint block ranges.
std::uint64_t tree_sum(const unsigned char* p, std::uint64_t n, std::uint32_t threads) {
  if (threads <= 1) return sum::segment_sum(p, n);
  const std::uint64_t k = sum::block_count(n);
  std::vector<std::uint64_t> digests(k);
  std::vector<std::thread> pool;
  for (std::uint32_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (std::uint64_t i = k * t / threads; i < k * (t + 1) / threads; ++i) {
        const std::uint64_t off = i * sum::kBlockBytes;
        digests[i] = sum::block_digest(p + off, std::min(sum::kBlockBytes, n - off));
      }
    });
  }
  for (auto& th : pool) th.join();
  return sum::fold_digests(std::move(digests), n);
}

}  // namespace

int run_checksum(const ChecksumBenchOptions& o) {
  std::vector<unsigned char> src(o.bytes), dst(o.bytes);
  std::mt19937_64 rng(1);
  for (std::size_t i = 0; i + 8 <= src.size(); i += 8) {
    const std::uint64_t x = rng();
    std::memcpy(src.data() + i, &x, 8);
  }
  struct Row {
    std::string what;
    double gbps = 0;
  };
  std::vector<Row> rows;
  auto measure = [&](const std::string& what, auto&& fn) {
    fn();  // warm
    const auto t0 = Clock::now();
    for (std::uint32_t r = 0; r < o.rounds; ++r) fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    rows.push_back({what, static_cast<double>(o.bytes) * o.rounds / s / 1e9});
  };
  measure("memcpy", [&] { std::memcpy(dst.data(), src.data(), src.size()); });
  std::uint64_t streaming = 0;
  measure("xxh3-64 streaming (libxxhash, schema 2)", [&] {
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, src.data(), src.size());
    streaming = XXH3_64bits_digest(st);
    XXH3_freeState(st);
  });
  std::vector<std::uint64_t> sums;
  for (std::uint32_t t = 1; t <= std::max<std::uint32_t>(1, o.threads); ++t) {
    std::uint64_t s = 0;
    measure("xxh3 tree, " + std::to_string(t) + (t == 1 ? " thread" : " threads"),
            [&] { s = tree_sum(src.data(), src.size(), t); });
    sums.push_back(s);
  }
  // The shm put's one pass: each block digested as it is copied, then folded.
  std::uint64_t fused = 0;
  measure("memcpy + xxh3 tree in one pass (shm put), 1 thread", [&] {
    std::vector<std::uint64_t> words(sum::block_count(src.size()) + 1);
    sum::copy_and_digest(dst.data(), src.data(), src.size(), words.data());
    fused = sum::fold(words.data(), sum::block_count(src.size()), src.size());
  });
  sums.push_back(fused);
  std::uint64_t portable = 0;
  measure("xxh3 tree, the GPU's portable core, 1 thread", [&] {
    const std::uint64_t k = sum::block_count(src.size());
    std::vector<std::uint64_t> words(k + 1);
    for (std::uint64_t i = 0; i < k; ++i) {
      const std::uint64_t off = i * sum::kBlockBytes;
      words[i] = sum::xxh3_64(src.data() + off, std::min<std::uint64_t>(sum::kBlockBytes, src.size() - off));
    }
    portable = sum::fold(words.data(), k, src.size());
  });
  sums.push_back(portable);
  for (std::uint64_t s : sums) {
    if (s != sums.front()) {
      std::cerr << "kvstash-bench checksum: the tree's sum differs between thread counts or cores\n";
      return 1;
    }
  }
  (void)streaming;
  const double memcpy_gbps = rows.front().gbps, stream_gbps = rows[1].gbps;
  if (!o.json) {
    std::printf("%s of random bytes, %u rounds per row, one process\n",
                (std::to_string(o.bytes >> 20) + " MiB").c_str(), o.rounds);
    std::printf("%-46s %8s %10s %12s\n", "what", "GB/s", "x memcpy", "x streaming");
  }
  for (const Row& r : rows) {
    if (o.json) {
      std::cout << nlohmann::json{{"what", r.what},
                                  {"bytes", o.bytes},
                                  {"gbps", r.gbps},
                                  {"vs_memcpy", r.gbps / memcpy_gbps},
                                  {"vs_streaming", r.gbps / stream_gbps}}
                       .dump()
                << "\n";
    } else {
      std::printf("%-46s %8.2f %9.2fx %11.2fx\n", r.what.c_str(), r.gbps, r.gbps / memcpy_gbps,
                  r.gbps / stream_gbps);
    }
  }
  if (!o.json) {
    std::printf(
        "\nxxh3 tree: 4 KiB block digests folded per segment (docs/metadata.md); the host's block digests "
        "are "
        "libxxhash's XXH3, the GPU's the shared core's portable one; every row gives the same sum.\n");
  }
  return 0;
}

}  // namespace kvstash::bench
