// One launch for a request's scattered blocks: block b of the grid copies its share of the
// runs, 16 bytes per thread and step where source and destination are both 16-byte aligned
// (KV blocks are), byte by byte otherwise.
#include <cuda_runtime.h>

#include "kvcache/cuda/copy_runs.h"

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

}  // namespace

int launch_copy_runs(const CopyRun* runs, std::uint32_t n, void* stream) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = n < 65535u ? n : 65535u;
  copy_runs_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(runs, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvstash::cuda
