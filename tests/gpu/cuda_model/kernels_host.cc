// Host twins of the KV-cache layer's kernels (src/kvcache/cuda/kernels.cu) for the CPU model of
// the CUDA runtime (cuda_model.h): the handles kernels.h declares, each a KernelTwin with the
// kernel's parameter list, so the real launch code (kernels_launch.cc) runs unchanged. A twin
// does what its kernel does, byte for byte, reaching device memory only through the model's
// view (a host touch of device memory faults). What a twin cannot check is the kernel's own
// indexing on a GPU: tests/gpu/cuda_test.cc holds the kernels against CPU references there.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "common/checksum_core.h"
#include "cuda_model/cuda_model.h"
#include "kvcache/cuda/kernels.h"

namespace kvstash::cuda {
namespace {

using cuda_model::Launch;
using cuda_model::view;

template <typename T>
const T* device_array(const T* p, std::size_t n) {
  return n == 0 ? nullptr : static_cast<const T*>(view(p, n * sizeof(T)));
}

void copy_twin(const Launch& l) {
  const auto* pieces = device_array(l.arg<const CopyPiece*>(0), l.arg<std::uint32_t>(1));
  for (std::uint32_t i = 0; i < l.arg<std::uint32_t>(1); ++i) {
    const CopyPiece& p = pieces[i];
    if (p.bytes != 0) std::memmove(view(p.dst, p.bytes), view(p.src, p.bytes), p.bytes);
  }
}

void digests_twin(const Launch& l) {
  const std::uint32_t n = std::min<std::uint32_t>(l.arg<std::uint32_t>(1), l.grid.y);
  const auto* segments = device_array(l.arg<const DigestSegment*>(0), n);
  std::vector<unsigned char> block(sum::kBlockBytes);
  for (std::uint32_t s = 0; s < n; ++s) {
    const DigestSegment& seg = segments[s];
    const auto* runs = device_array(seg.runs, seg.run_count);
    for (std::uint64_t b = 0; b < sum::block_count(seg.length); ++b) {
      const std::uint64_t first = b * sum::kBlockBytes;
      const std::uint64_t len = std::min<std::uint64_t>(sum::kBlockBytes, seg.length - first);
      std::uint64_t filled = 0;
      for (std::uint32_t r = 0; r < seg.run_count && filled < len; ++r) {
        const DigestRun& run = runs[r];
        const std::uint64_t at = first + filled;
        if (at < run.begin || at >= run.begin + run.bytes) continue;
        const std::uint64_t take = std::min(run.begin + run.bytes - at, len - filled);
        std::memcpy(block.data() + filled,
                    view(static_cast<const std::byte*>(run.src) + (at - run.begin), take), take);
        filled += take;
      }
      const std::uint64_t digest = sum::xxh3_64(block.data(), len);
      std::memcpy(view(seg.digests + b, sizeof digest), &digest, sizeof digest);
    }
  }
}

void fill_twin(const Launch& l) {
  auto* dst = l.arg<std::uint64_t*>(0);
  const auto words = l.arg<std::uint64_t>(1);
  const auto seed = l.arg<std::uint64_t>(2);
  const auto delay_ns = l.arg<std::uint64_t>(3);
  // The kernel's CTAs sleep in parallel: the launch ends delay_ns late, not CTAs x delay_ns.
  std::this_thread::sleep_for(std::chrono::nanoseconds(delay_ns));
  auto* out = static_cast<std::uint64_t*>(view(dst, words * sizeof(std::uint64_t)));
  for (std::uint64_t i = 0; i < words; ++i) {
    std::uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    out[i] = z ^ (z >> 31);
  }
}

const cuda_model::KernelTwin kCopy{
    "copy_pieces", {sizeof(const CopyPiece*), sizeof(std::uint32_t)}, copy_twin};
const cuda_model::KernelTwin kDigests{
    "segment_digests", {sizeof(const DigestSegment*), sizeof(std::uint32_t)}, digests_twin};
const cuda_model::KernelTwin kFill{
    "fill_words",
    {sizeof(std::uint64_t*), sizeof(std::uint64_t), sizeof(std::uint64_t), sizeof(std::uint64_t)},
    fill_twin};

const void* registered(const cuda_model::KernelTwin* twin) {
  cuda_model::register_twin(twin);
  return twin;
}

}  // namespace

const void* copy_kernel() {
  static const void* handle = registered(&kCopy);
  return handle;
}
const void* digests_kernel() {
  static const void* handle = registered(&kDigests);
  return handle;
}
const void* fill_kernel() {
  static const void* handle = registered(&kFill);
  return handle;
}

}  // namespace kvstash::cuda

// For tests that drive the model from Python through ctypes (tests/gpu/vllm_gpu_model_test.py: an
// "attention kernel" writing a layer late on a stream): the fill kernel's launch, with C linkage.
extern "C" int kvstash_cuda_model_fill_words(void* dst, std::uint64_t words, std::uint64_t seed,
                                             std::uint64_t delay_ns, void* stream) {
  return kvstash::cuda::launch_fill_words(dst, words, seed, delay_ns, stream);
}
