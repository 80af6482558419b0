// The GPU gather/scatter kernel against a CPU reference: a request's scattered blocks packed
// into a poisoned staging buffer and scattered back into another (poisoned) cache, every byte
// compared, including the ones that must stay untouched. Skips, saying why, without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvcache/cuda/copy_runs.h"
#include "kvstash/kvcache.h"

namespace kvstash {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)

bool have_gpu(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = std::string("no GPU here (cudaGetDeviceCount: ") + cudaGetErrorString(e) +
           "); scripts/gpu-check runs this";
    return false;
  }
  if (n == 0) {
    *why = "no GPU here (no CUDA device); scripts/gpu-check runs this";
    return false;
  }
  return true;
}

#define REQUIRE_GPU()                         \
  do {                                        \
    std::string why;                          \
    if (!have_gpu(&why)) GTEST_SKIP() << why; \
  } while (0)

TEST(Cuda, GatherAndScatterOfScatteredBlocksMatchTheCpuReference) {
  REQUIRE_GPU();
  // One layer of a vLLM cache: (2, 64 blocks, 16 tokens, 8 heads, 128) fp16 = 32 KiB blocks.
  KvCacheShape shape{.num_layers = 1, .num_blocks = 64, .block_size = 16, .num_kv_heads = 8, .head_dim = 128};
  const std::uint64_t bb = shape.block_bytes(), layer_bytes = 2 * shape.num_blocks * bb;
  std::vector<unsigned char> host(layer_bytes);
  std::mt19937_64 rng(3);
  for (auto& c : host) c = static_cast<unsigned char>(rng());
  void *cache = nullptr, *other = nullptr, *staging = nullptr;
  CUDA_OK(cudaMalloc(&cache, layer_bytes));
  CUDA_OK(cudaMalloc(&other, layer_bytes));
  CUDA_OK(cudaMemcpy(cache, host.data(), layer_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(other, 0x5a, layer_bytes));  // poison: unwritten bytes must stay 0x5a

  // 13 scattered blocks (a run each per part) and, at odd offsets, two unaligned runs.
  std::vector<std::uint32_t> blocks(shape.num_blocks);
  std::iota(blocks.begin(), blocks.end(), 0u);
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(4));
  blocks.resize(13);
  void* layer[] = {cache};
  auto layout = KvLayout::per_layer(shape, layer, MemoryKind::kCuda).value();
  std::vector<KvRun> runs;
  ASSERT_TRUE(layout.layer_runs(0, blocks, runs).is_ok());
  std::uint64_t total = 0;
  for (const auto& r : runs) total += r.length;
  total += 2 * 1001;
  CUDA_OK(cudaMalloc(&staging, total + 4096));
  CUDA_OK(cudaMemset(staging, 0xab, total + 4096));

  std::vector<cuda::CopyRun> gather;
  std::vector<std::uint64_t> offsets;
  std::uint64_t at = 0;
  for (const auto& r : runs) {
    gather.push_back({r.addr, static_cast<unsigned char*>(staging) + at, r.length});
    offsets.push_back(static_cast<std::uint64_t>(r.addr - static_cast<std::byte*>(cache)));
    at += r.length;
  }
  for (std::uint64_t src : {std::uint64_t{7}, std::uint64_t{bb + 3}}) {
    gather.push_back(
        {static_cast<unsigned char*>(cache) + src, static_cast<unsigned char*>(staging) + at, 1001});
    offsets.push_back(src);
    at += 1001;
  }
  cuda::CopyRun* dev_runs = nullptr;
  CUDA_OK(cudaMalloc(&dev_runs, gather.size() * sizeof(cuda::CopyRun)));
  CUDA_OK(cudaMemcpy(dev_runs, gather.data(), gather.size() * sizeof(cuda::CopyRun), cudaMemcpyHostToDevice));
  ASSERT_EQ(cuda::launch_copy_runs(dev_runs, static_cast<std::uint32_t>(gather.size()), nullptr),
            cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());

  // The staging buffer holds the runs in order, then the poison.
  std::vector<unsigned char> packed(total + 4096);
  CUDA_OK(cudaMemcpy(packed.data(), staging, packed.size(), cudaMemcpyDeviceToHost));
  at = 0;
  for (std::size_t i = 0; i < gather.size(); ++i) {
    ASSERT_EQ(std::memcmp(packed.data() + at, host.data() + offsets[i], gather[i].bytes), 0) << "run " << i;
    at += gather[i].bytes;
  }
  for (std::uint64_t i = total; i < packed.size(); ++i) ASSERT_EQ(packed[i], 0xab) << "written past the runs";

  // Scatter back into the other cache at the same offsets: those bytes equal, the rest poison.
  std::vector<cuda::CopyRun> scatter;
  at = 0;
  for (std::size_t i = 0; i < gather.size(); ++i) {
    scatter.push_back({static_cast<unsigned char*>(staging) + at,
                       static_cast<unsigned char*>(other) + offsets[i], gather[i].bytes});
    at += gather[i].bytes;
  }
  CUDA_OK(
      cudaMemcpy(dev_runs, scatter.data(), scatter.size() * sizeof(cuda::CopyRun), cudaMemcpyHostToDevice));
  ASSERT_EQ(cuda::launch_copy_runs(dev_runs, static_cast<std::uint32_t>(scatter.size()), nullptr),
            cudaSuccess);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned char> back(layer_bytes);
  CUDA_OK(cudaMemcpy(back.data(), other, layer_bytes, cudaMemcpyDeviceToHost));
  std::vector<bool> written(layer_bytes, false);
  for (std::size_t i = 0; i < gather.size(); ++i) {
    for (std::uint64_t k = 0; k < gather[i].bytes; ++k) written[offsets[i] + k] = true;
  }
  for (std::uint64_t i = 0; i < layer_bytes; ++i) {
    ASSERT_EQ(back[i], written[i] ? host[i] : 0x5a)
        << "byte " << i << (written[i] ? " (copied)" : " (untouched)");
  }
  EXPECT_EQ(cuda::launch_copy_runs(dev_runs, 0, nullptr), cudaSuccess) << "nothing to copy";
  cudaFree(dev_runs);
  cudaFree(staging);
  cudaFree(other);
  cudaFree(cache);
}

}  // namespace
}  // namespace kvstash
