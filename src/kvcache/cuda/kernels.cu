// The KV-cache layer's kernels (kernels.h). Device code only: the launches are host code in
// kernels_launch.cc, which reaches these through the handles at the bottom.
//
// - copy: CTAs take pieces of at most kPieceBytes (a long run is many pieces), each thread
//   moving 8 x 16 bytes per step, loads before stores, where source, destination and length
//   are 16-byte aligned (as KV blocks are); byte by byte otherwise.
// - digests: a warp per 4 KiB block of a segment: the warp gathers the block's bytes from the
//   segment's runs into shared memory (coalesced 16-byte loads where aligned), then one lane
//   hashes them with the host's checksum core (common/checksum_core.h, compiled here as
//   device code), so that device digests and host digests are the same function.
#include <cuda_runtime.h>

#include "common/checksum_core.h"
#include "kvcache/cuda/kernels.h"

namespace kvstash::cuda {
namespace {

constexpr unsigned kVecPerThread = 8;  // 16-byte vectors a thread holds per step

__device__ void copy_piece(const CopyPiece& p) {
  const auto* src = static_cast<const unsigned char*>(p.src);
  auto* dst = static_cast<unsigned char*>(p.dst);
  const std::uint64_t bytes = p.bytes;
  const bool aligned =
      ((reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst) | bytes) & 15) == 0;
  if (!aligned) {
    for (std::uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
    return;
  }
  const auto* s4 = reinterpret_cast<const uint4*>(src);
  auto* d4 = reinterpret_cast<uint4*>(dst);
  const std::uint64_t words = bytes / 16;
  const std::uint64_t step = static_cast<std::uint64_t>(blockDim.x) * kVecPerThread;
  for (std::uint64_t base = 0; base < words; base += step) {
    uint4 v[kVecPerThread];
#pragma unroll
    for (unsigned k = 0; k < kVecPerThread; ++k) {
      const std::uint64_t i = base + k * blockDim.x + threadIdx.x;
      if (i < words) v[k] = s4[i];
    }
#pragma unroll
    for (unsigned k = 0; k < kVecPerThread; ++k) {
      const std::uint64_t i = base + k * blockDim.x + threadIdx.x;
      if (i < words) d4[i] = v[k];
    }
  }
}

__global__ void copy_pieces(const CopyPiece* pieces, std::uint32_t n) {
  for (std::uint32_t p = blockIdx.x; p < n; p += gridDim.x) {
    const CopyPiece piece = pieces[p];
    if (piece.bytes != 0) copy_piece(piece);
  }
}

// The first run of `seg` whose bytes reach past `offset` (runs are in `begin` order).
__device__ std::uint32_t run_at(const DigestSegment& seg, std::uint64_t offset) {
  std::uint32_t lo = 0, hi = seg.run_count;
  while (lo + 1 < hi) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (seg.runs[mid].begin <= offset) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__global__ void segment_digests(const DigestSegment* segments, std::uint32_t n) {
  __shared__ __align__(16) unsigned char staged[kDigestWarps][sum::kBlockBytes];
  if (blockIdx.y >= n) return;
  const DigestSegment seg = segments[blockIdx.y];
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* mine = staged[warp];
  const std::uint64_t blocks = sum::block_count(seg.length);
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * kDigestWarps;
  for (std::uint64_t b = static_cast<std::uint64_t>(blockIdx.x) * kDigestWarps + warp; b < blocks;
       b += stride) {
    const std::uint64_t first = b * sum::kBlockBytes;
    const std::uint64_t len = seg.length - first < sum::kBlockBytes ? seg.length - first : sum::kBlockBytes;
    // Gather the block from the runs it spans into this warp's shared buffer.
    std::uint64_t filled = 0;
    for (std::uint32_t r = run_at(seg, first); filled < len && r < seg.run_count; ++r) {
      const DigestRun run = seg.runs[r];
      const std::uint64_t from = first + filled - run.begin;  // offset into the run
      if (from >= run.bytes) continue;
      const std::uint64_t take = run.bytes - from < len - filled ? run.bytes - from : len - filled;
      const auto* src = static_cast<const unsigned char*>(run.src) + from;
      unsigned char* dst = mine + filled;
      if (((reinterpret_cast<std::uintptr_t>(src) | filled | take) & 15) == 0) {
        const auto* s4 = reinterpret_cast<const uint4*>(src);
        auto* d4 = reinterpret_cast<uint4*>(dst);
        for (std::uint64_t i = lane; i < take / 16; i += 32) d4[i] = s4[i];
      } else {
        for (std::uint64_t i = lane; i < take; i += 32) dst[i] = src[i];
      }
      filled += take;
    }
    __syncwarp();
    if (lane == 0) seg.digests[b] = sum::xxh3_64(mine, len);
    __syncwarp();  // the buffer is reused for the warp's next block
  }
}

// Writes splitmix64(seed + i) as word i, after thread 0 of each CTA slept `delay_ns`: an
// "attention kernel" that finishes late, for stream-ordering checks and synthetic caches.
__global__ void fill_words(std::uint64_t* dst, std::uint64_t words, std::uint64_t seed,
                           std::uint64_t delay_ns) {
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

const void* copy_kernel() { return reinterpret_cast<const void*>(&copy_pieces); }
const void* digests_kernel() { return reinterpret_cast<const void*>(&segment_digests); }
const void* fill_kernel() { return reinterpret_cast<const void*>(&fill_words); }

}  // namespace kvstash::cuda
