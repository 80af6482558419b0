// The KV-cache layer's kernels: one launch copies a request's scattered blocks (16 bytes per
// thread and step where source and destination are both 16-byte aligned, as KV blocks are,
// byte by byte otherwise), and one launch digests a segment's 4 KiB blocks with the same
// checksum core the host runs (common/checksum_core.h, compiled here as device code).
#include <cuda_runtime.h>

#include "common/checksum_core.h"
#include "kvcache/cuda/kernels.h"

namespace kvstash::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void copy_runs_kernel(const CopyRun* runs, std::uint32_t n) {
  // Grid-stride over runs: block i takes runs i, i + gridDim.x, ...
  for (std::uint32_t r = blockIdx.x; r < n; r += gridDim.x) {
    const auto* src = static_cast<const unsigned char*>(runs[r].src);
    auto* dst = static_cast<unsigned char*>(runs[r].dst);
    const std::uint64_t bytes = runs[r].bytes;
    const bool aligned = ((reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst)) & 15) == 0;
    std::uint64_t done = 0;
    if (aligned) {
      const auto* s4 = reinterpret_cast<const uint4*>(src);
      auto* d4 = reinterpret_cast<uint4*>(dst);
      const std::uint64_t words = bytes / 16;
      for (std::uint64_t i = threadIdx.x; i < words; i += blockDim.x) d4[i] = s4[i];
      done = words * 16;
    }
    for (std::uint64_t i = done + threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
}

// Thread i digests block i of the segment: XXH3-64 of its (at most) 4 KiB.
__global__ void block_digests_kernel(const unsigned char* segment, std::uint64_t length, std::uint64_t* digests) {
  const std::uint64_t k = sum::block_count(length);
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < k;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t off = i * sum::kBlockBytes;
    const std::uint64_t n = length - off < sum::kBlockBytes ? length - off : sum::kBlockBytes;
    digests[i] = sum::xxh3_64(segment + off, n);
  }
}

// Writes splitmix64(seed + i) as word i, after thread 0 of each block slept `delay_ns`: an
// "attention kernel" that finishes late, for stream-ordering checks and synthetic caches.
__global__ void fill_words_kernel(std::uint64_t* dst, std::uint64_t words, std::uint64_t seed, std::uint64_t delay_ns) {
  if (delay_ns > 0 && threadIdx.x == 0) {
    for (std::uint64_t slept = 0; slept < delay_ns; slept += 1000000) __nanosleep(1000000);
  }
  __syncthreads();
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    dst[i] = z ^ (z >> 31);
  }
}

}  // namespace

int launch_fill_words(void* dst, std::uint64_t words, std::uint64_t seed, std::uint64_t delay_ns, void* stream) {
  if (words == 0) return cudaSuccess;
  const std::uint64_t want = (words + kThreads - 1) / kThreads;
  const unsigned blocks = want < 1024u ? static_cast<unsigned>(want) : 1024u;
  fill_words_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<std::uint64_t*>(dst),
                                                                               words, seed, delay_ns);
  return static_cast<int>(cudaGetLastError());
}

int launch_copy_runs(const CopyRun* runs, std::uint32_t n, void* stream) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = n < 65535u ? n : 65535u;
  copy_runs_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(runs, n);
  return static_cast<int>(cudaGetLastError());
}

int launch_block_digests(const void* segment, std::uint64_t length, std::uint64_t* digests, void* stream) {
  const std::uint64_t k = sum::block_count(length);
  if (k == 0) return cudaSuccess;
  constexpr unsigned kDigestThreads = 128;
  const std::uint64_t want = (k + kDigestThreads - 1) / kDigestThreads;
  const unsigned blocks = want < 65535u ? static_cast<unsigned>(want) : 65535u;
  block_digests_kernel<<<blocks, kDigestThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const unsigned char*>(segment), length, digests);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvstash::cuda
