// The GPU side of the KV-cache layer: one kernel launch copies a list of runs (a request's
// scattered blocks into a contiguous staging buffer, or back), and one digests the 4 KiB
// blocks of a segment with the host's own checksum core (common/checksum_core.h). Compiled
// by nvcc where the CUDA toolkit is found (KVSTASH_HAVE_CUDA_KERNELS says whether it was).
//
// Thread safety: stateless; a launch is ordered on its stream.
#pragma once

#include <cstdint>

namespace kvstash::cuda {

// One contiguous copy. Pointers are device pointers or host memory the device can reach
// (pinned and mapped).
struct CopyRun {
  const void* src = nullptr;
  void* dst = nullptr;
  std::uint64_t bytes = 0;
};

// Copies every run in one launch on `stream` (a cudaStream_t; nullptr: the default stream).
// `runs` is in device-reachable memory (n entries). Runs must not overlap each other's
// destinations. Returns the cudaError_t of the launch (0: launched; errors of the copy itself
// surface at the next synchronisation).
int launch_copy_runs(const CopyRun* runs, std::uint32_t n, void* stream);

// Writes the XXH3-64 of each 4 KiB block of the `length` bytes at device address `segment`
// into `digests` (device-reachable, sum::block_count(length) entries), one thread per block.
// Returns the launch's cudaError_t.
int launch_block_digests(const void* segment, std::uint64_t length, std::uint64_t* digests, void* stream);

// Fills `words` 64-bit words at device address `dst` with splitmix64(seed + i), each block
// of threads starting `delay_ns` late: synthetic KV written by a kernel that finishes after
// its caller moved on (tests/cuda_test.cc, kvstash-bench kvcache --gpu).
int launch_fill_words(void* dst, std::uint64_t words, std::uint64_t seed, std::uint64_t delay_ns,
                      void* stream);

}  // namespace kvstash::cuda
