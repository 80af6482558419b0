// The GPU side of the KV-cache layer: one launch copies a list of pieces (a request's
// scattered blocks into a contiguous staging buffer, or back), one launch digests the 4 KiB
// blocks of one or more segments with the host's own checksum core (common/checksum_core.h),
// and a fill kernel writes synthetic KV late (tests, the benchmark).
//
// The kernels themselves are in kernels.cu (device code, built by nvcc); the launches are
// host code (kernels_launch.cc) that passes their handles to cudaLaunchKernel, so that every
// launch reports its own error and a CPU model of the runtime (tests/gpu/cuda_model) can run the
// same launch code with host twins of the kernels.
//
// Thread safety: stateless; a launch is ordered on its stream.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvstash::cuda {

// One piece of a copy. Pointers are device pointers or host memory the device reaches (pinned
// and mapped).
struct CopyPiece {
  const void* src = nullptr;
  void* dst = nullptr;
  std::uint64_t bytes = 0;
};

// Long runs are cut into pieces of at most this many bytes, one CTA's work at a time, so that
// a contiguous chunk (adjacent blocks merge into one run) spreads over the whole GPU.
inline constexpr std::uint64_t kPieceBytes = 32 << 10;

// How many pieces a run of `bytes` becomes (0 for 0 bytes).
constexpr std::size_t pieces_of(std::uint64_t bytes) {
  return static_cast<std::size_t>((bytes + kPieceBytes - 1) / kPieceBytes);
}

// Writes the pieces of copying `bytes` from `src` to `dst` into `out` (pieces_of(bytes)
// entries); returns the number written.
std::size_t write_pieces(const void* src, void* dst, std::uint64_t bytes, CopyPiece* out);

// One run of a segment to digest: `bytes` at `src`, starting `begin` bytes into the segment.
struct DigestRun {
  const void* src = nullptr;
  std::uint64_t bytes = 0;
  std::uint64_t begin = 0;
};

// A segment: the concatenation of its runs (in order, `begin` ascending from 0), `length`
// bytes, whose 4 KiB blocks' XXH3-64 go to `digests` (device-reachable, sum::block_count
// entries; a block may span runs).
struct DigestSegment {
  const DigestRun* runs = nullptr;
  std::uint32_t run_count = 0;
  std::uint64_t length = 0;
  std::uint64_t* digests = nullptr;
};

// Copies every piece in one launch on `stream` (a cudaStream_t; nullptr: the legacy default
// stream). `pieces` is in device-reachable memory (n entries); destinations do not overlap.
// `sm_count` sizes the grid. Returns the launch's own cudaError_t (0: launched); errors of the
// copy itself surface at the next synchronisation.
int launch_copy(const CopyPiece* pieces, std::uint32_t n, int sm_count, void* stream);

// Digests every block of `n` segments (device-reachable) in one launch, a warp per block.
int launch_digests(const DigestSegment* segments, std::uint32_t n, std::uint64_t max_length, int sm_count,
                   void* stream);

// Fills `words` 64-bit words at device address `dst` with splitmix64(seed + i), each CTA
// starting `delay_ns` late: synthetic KV written by a kernel that finishes after its caller
// moved on (the tests, kvstash-bench kvcache --gpu).
int launch_fill_words(void* dst, std::uint64_t words, std::uint64_t seed, std::uint64_t delay_ns,
                      void* stream);

// The kernels' handles for cudaLaunchKernel (kernels.cu; the CPU model's twins in tests).
// Their parameters, in order:
//   copy:    (const CopyPiece* pieces, std::uint32_t n)
//   digests: (const DigestSegment* segments, std::uint32_t n)          gridDim.y = segment
//   fill:    (std::uint64_t* dst, std::uint64_t words, std::uint64_t seed, std::uint64_t delay_ns)
const void* copy_kernel();
const void* digests_kernel();
const void* fill_kernel();

// Threads per CTA of the copy and fill kernels, and warps per CTA of the digest kernel (each
// warp stages one 4 KiB block in shared memory).
inline constexpr unsigned kCopyThreads = 256;
inline constexpr unsigned kDigestWarps = 4;

}  // namespace kvstash::cuda
