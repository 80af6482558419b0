// The kernels' launches (kernels.h): their shapes, and cudaLaunchKernel with each kernel's
// handle, so a launch returns its own error (never one an earlier call left in the thread's
// last error, as `kernel<<<...>>>(); return cudaGetLastError();` would).
#include <cuda_runtime.h>

#include <algorithm>

#include "common/checksum_core.h"
#include "kvcache/cuda/kernels.h"

namespace kvstash::cuda {
namespace {

// CTAs per SM a launch asks for at most: enough to hide memory latency, few enough that a
// grid-stride loop, not the block scheduler, does the spreading.
constexpr unsigned kCtasPerSm = 8;

unsigned grid_for(std::uint64_t work_items, int sm_count) {
  const std::uint64_t cap = static_cast<std::uint64_t>(std::max(sm_count, 1)) * kCtasPerSm;
  return static_cast<unsigned>(std::clamp<std::uint64_t>(work_items, 1, std::min<std::uint64_t>(cap, 65535)));
}

}  // namespace

std::size_t write_pieces(const void* src, void* dst, std::uint64_t bytes, CopyPiece* out) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t n = 0;
  for (std::uint64_t at = 0; at < bytes; at += kPieceBytes)
    out[n++] = {s + at, d + at, std::min(kPieceBytes, bytes - at)};
  return n;
}

int launch_copy(const CopyPiece* pieces, std::uint32_t n, int sm_count, void* stream) {
  if (n == 0) return cudaSuccess;
  void* args[] = {&pieces, &n};
  return static_cast<int>(cudaLaunchKernel(copy_kernel(), dim3(grid_for(n, sm_count)), dim3(kCopyThreads),
                                           args, 0, static_cast<cudaStream_t>(stream)));
}

int launch_digests(const DigestSegment* segments, std::uint32_t n, std::uint64_t max_length, int sm_count,
                   void* stream) {
  if (n == 0 || max_length == 0) return cudaSuccess;
  const std::uint64_t warps_of_work = sum::block_count(max_length);
  const dim3 grid(grid_for((warps_of_work + kDigestWarps - 1) / kDigestWarps, sm_count), n);
  void* args[] = {&segments, &n};
  return static_cast<int>(cudaLaunchKernel(digests_kernel(), grid, dim3(kDigestWarps * 32), args, 0,
                                           static_cast<cudaStream_t>(stream)));
}

int launch_fill_words(void* dst, std::uint64_t words, std::uint64_t seed, std::uint64_t delay_ns,
                      void* stream) {
  if (words == 0) return cudaSuccess;
  auto* out = static_cast<std::uint64_t*>(dst);
  void* args[] = {&out, &words, &seed, &delay_ns};
  const unsigned grid =
      static_cast<unsigned>(std::min<std::uint64_t>((words + kCopyThreads - 1) / kCopyThreads, 1024));
  return static_cast<int>(cudaLaunchKernel(fill_kernel(), dim3(grid), dim3(kCopyThreads), args, 0,
                                           static_cast<cudaStream_t>(stream)));
}

}  // namespace kvstash::cuda
