// The GPU gather/scatter kernel against a CPU reference: a request's scattered blocks packed
// into a poisoned staging buffer and scattered back into another (poisoned) cache, every byte
// compared, including the ones that must stay untouched. Skips, saying why, without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <vector>

#include "common/checksum.h"
#include "kvcache/cuda/cuda_device.h"
#include "kvcache/cuda/kernels.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "tools/common/local_cluster.h"

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

TEST(Cuda, AKvCacheInGpuMemorySavesAndLoadsThroughPinnedBounceBuffers) {
  REQUIRE_GPU();
  auto gpu = cuda::cuda_device(0);
  ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
  auto redis = tools::LocalRedis::start({});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  auto node = tools::LocalNode::start({.redis_url = (*redis)->url(), .capacity = "64MiB", .node_id = "gpu1"});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  StoreOptions so;
  so.redis_url = (*redis)->url();
  auto store = Store::open(so);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();

  KvCacheShape shape{.num_layers = 4, .num_blocks = 48, .block_size = 16, .num_kv_heads = 8, .head_dim = 128};
  const std::uint64_t bb = shape.block_bytes(), layer_bytes = 2 * shape.num_blocks * bb;
  std::vector<std::vector<unsigned char>> host(shape.num_layers, std::vector<unsigned char>(layer_bytes));
  std::vector<void*> a(shape.num_layers), b(shape.num_layers);
  std::mt19937_64 rng(5);
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    for (auto& c : host[l]) c = static_cast<unsigned char>(rng());
    CUDA_OK(cudaMalloc(&a[l], layer_bytes));
    CUDA_OK(cudaMalloc(&b[l], layer_bytes));
    CUDA_OK(cudaMemcpy(a[l], host[l].data(), layer_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(b[l], 0x5a, layer_bytes));
  }
  auto kva =
      KvCache::open(**store, KvLayout::per_layer(shape, a, MemoryKind::kCuda).value(),
                    {.model = "gpu-model", .chunk_tokens = 256}, {.device = *gpu, .path = KvPath::kStaged});
  // The loading cache chooses its own path: GPUDirect where a transport registers GPU
  // memory, else staging by the CUDA device of the tensors' GPU.
  auto kvb = KvCache::open(**store, KvLayout::per_layer(shape, b, MemoryKind::kCuda).value(),
                           {.model = "gpu-model", .chunk_tokens = 256});
  ASSERT_TRUE(kva.is_ok()) << kva.status().to_string();
  ASSERT_TRUE(kvb.is_ok()) << kvb.status().to_string();
  EXPECT_EQ((*kva)->data_path(), "staged");
  EXPECT_EQ((*kvb)->device().name(), "cuda");

  std::vector<std::uint32_t> tokens(512);
  for (auto& t : tokens) t = static_cast<std::uint32_t>(rng() % 32000);
  std::vector<std::uint32_t> blocks_a(shape.num_blocks), blocks_b(shape.num_blocks);
  std::iota(blocks_a.begin(), blocks_a.end(), 0u);
  std::iota(blocks_b.begin(), blocks_b.end(), 0u);
  std::shuffle(blocks_a.begin(), blocks_a.end(), std::mt19937(6));
  std::shuffle(blocks_b.begin(), blocks_b.end(), std::mt19937(7));
  blocks_a.resize(32);
  blocks_b.resize(32);
  auto save = (*kva)->begin_save(tokens, blocks_a, 0, 2);
  ASSERT_TRUE(save.is_ok());
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) ASSERT_TRUE(save->save_layer(l).is_ok());
  for (const auto& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  auto load = (*kvb)->begin_load(tokens, blocks_b, 2);
  ASSERT_TRUE(load.is_ok());
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) ASSERT_TRUE(load->wait_layer(l).is_ok()) << l;
  for (const auto& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();

  std::vector<unsigned char> got(layer_bytes);
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    CUDA_OK(cudaMemcpy(got.data(), b[l], layer_bytes, cudaMemcpyDeviceToHost));
    std::vector<bool> written(shape.num_blocks, false);
    for (std::size_t i = 0; i < blocks_b.size(); ++i) {
      written[blocks_b[i]] = true;
      for (std::uint32_t p = 0; p < 2; ++p) {
        ASSERT_EQ(std::memcmp(got.data() + (p * shape.num_blocks + blocks_b[i]) * bb,
                              host[l].data() + (p * shape.num_blocks + blocks_a[i]) * bb, bb),
                  0)
            << "layer " << l << " block " << i;
      }
    }
    for (std::uint32_t blk = 0; blk < shape.num_blocks; ++blk) {
      if (written[blk]) continue;
      for (std::uint64_t k = 0; k < bb; ++k)
        ASSERT_EQ(got[blk * bb + k], 0x5a) << "an unlisted block was written";
    }
  }
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    cudaFree(a[l]);
    cudaFree(b[l]);
  }
}

TEST(Cuda, TheChecksumKernelEqualsTheHostsCoreOnRandomData) {
  REQUIRE_GPU();
  std::mt19937_64 rng(11);
  std::vector<unsigned char> host(3u << 20);
  for (auto& c : host) c = static_cast<unsigned char>(rng());
  void* dev = nullptr;
  std::uint64_t* digests = nullptr;
  CUDA_OK(cudaMalloc(&dev, host.size()));
  CUDA_OK(cudaMallocManaged(&digests, (host.size() / 4096 + 1) * sizeof(std::uint64_t)));
  CUDA_OK(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice));
  // Every XXH3 path at once: lengths below one block, around it, and many blocks with a tail;
  // offsets 0 and 3 (unaligned loads).
  for (std::uint64_t length : {0ull, 1ull, 7ull, 16ull, 100ull, 240ull, 241ull, 4095ull, 4096ull, 4097ull,
                               1000003ull, (3ull << 20) - 3}) {
    for (std::uint64_t offset : {0ull, 3ull}) {
      if (offset + length > host.size()) continue;
      ASSERT_EQ(
          cuda::launch_block_digests(static_cast<unsigned char*>(dev) + offset, length, digests, nullptr), 0);
      CUDA_OK(cudaDeviceSynchronize());
      for (std::uint64_t i = 0; i < sum::block_count(length); ++i) {
        const std::uint64_t at = offset + i * 4096;
        ASSERT_EQ(digests[i],
                  sum::xxh3_64(host.data() + at, std::min<std::uint64_t>(4096, offset + length - at)))
            << "length " << length << " offset " << offset << " block " << i;
      }
    }
  }
  // The device's segment sum of scattered runs equals the host's over the same bytes.
  auto gpu = cuda::cuda_device(0);
  ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
  auto* d = static_cast<std::byte*>(dev);
  const KvRun runs[] = {{d + 5, 70000, 0}, {d + 200000, 4096, 0}, {d + 300001, 123457, 0}};
  std::vector<std::byte> packed;
  for (const KvRun& r : runs) {
    const auto* from = reinterpret_cast<const std::byte*>(host.data()) + (r.addr - d);
    packed.insert(packed.end(), from, from + r.length);
  }
  auto on_gpu = (*gpu)->segment_sum(runs);
  ASSERT_TRUE(on_gpu.is_ok()) << on_gpu.status().to_string();
  EXPECT_EQ(*on_gpu, sum::segment_sum(packed.data(), packed.size()));
  cudaFree(digests);
  cudaFree(dev);
}

// A real kernel writes each layer 20 ms after save_layer was called with its stream (odd
// layers: an event recorded after it); the stored bytes are the kernel's. A load hands each
// layer to another stream as an event, and what that stream copies out after waiting is the
// layer's final bytes.
TEST(Cuda, StreamOrderedSavesStoreTheKernelsBytesAndLoadsSignalTheEnginesStream) {
  REQUIRE_GPU();
  auto redis = tools::LocalRedis::start({});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  auto node = tools::LocalNode::start({.redis_url = (*redis)->url(), .capacity = "64MiB", .node_id = "gpu2"});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  StoreOptions so;
  so.redis_url = (*redis)->url();
  auto store = Store::open(so);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  KvCacheShape shape{.num_layers = 4, .num_blocks = 32, .block_size = 16, .num_kv_heads = 8, .head_dim = 128};
  const std::uint64_t layer_bytes = 2ull * shape.num_blocks * shape.block_bytes();
  std::vector<void*> a(shape.num_layers), b(shape.num_layers);
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    CUDA_OK(cudaMalloc(&a[l], layer_bytes));
    CUDA_OK(cudaMalloc(&b[l], layer_bytes));
    CUDA_OK(cudaMemset(a[l], 0x11, layer_bytes));  // what an unordered save would store
    CUDA_OK(cudaMemset(b[l], 0x5a, layer_bytes));
  }
  // KVSTASH_GPU_PATH=direct|staged (scripts/gpu-check runs both where a NIC reaches the GPU).
  const char* want_path = std::getenv("KVSTASH_GPU_PATH");
  const KvPath path = want_path == nullptr                 ? KvPath::kAuto
                      : std::string(want_path) == "direct" ? KvPath::kDirect
                                                           : KvPath::kStaged;
  auto kva = KvCache::open(**store, KvLayout::per_layer(shape, a, MemoryKind::kCuda).value(),
                           {.model = "gpu-model", .chunk_tokens = 256}, {.path = path});
  auto kvb = KvCache::open(**store, KvLayout::per_layer(shape, b, MemoryKind::kCuda).value(),
                           {.model = "gpu-model", .chunk_tokens = 256}, {.path = path});
  ASSERT_TRUE(kva.is_ok() && kvb.is_ok()) << kva.status().to_string() << kvb.status().to_string();
  std::cout << "data path: " << (*kva)->data_path() << " (" << (*kva)->device().name() << " device)\n";
  cudaStream_t attention = nullptr, compute = nullptr;
  cudaEvent_t written = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&attention, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&written, cudaEventDisableTiming));
  std::vector<std::uint32_t> tokens(256), blocks(16);
  std::iota(tokens.begin(), tokens.end(), 7u);
  std::iota(blocks.begin(), blocks.end(), 3u);
  auto save = (*kva)->begin_save(tokens, blocks, 0, 1);
  ASSERT_TRUE(save.is_ok()) << save.status().to_string();
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    ASSERT_EQ(cuda::launch_fill_words(a[l], layer_bytes / 8, 100 + l, 20'000'000, attention), 0);
    if (l % 2 == 0) {
      ASSERT_TRUE(save->save_layer(l, {.stream = attention}).is_ok());
    } else {
      CUDA_OK(cudaEventRecord(written, attention));
      ASSERT_TRUE(save->save_layer(l, {.event = written}).is_ok());
    }
  }
  for (const auto& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();

  auto load = (*kvb)->begin_load(tokens, blocks, 1);
  ASSERT_TRUE(load.is_ok()) << load.status().to_string();
  std::vector<std::vector<unsigned char>> got(shape.num_layers, std::vector<unsigned char>(layer_bytes));
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    auto event = load->layer_event(l);
    ASSERT_TRUE(event.is_ok()) << event.status().to_string();
    CUDA_OK(cudaStreamWaitEvent(compute, static_cast<cudaEvent_t>(*event), 0));
    CUDA_OK(cudaMemcpyAsync(got[l].data(), b[l], layer_bytes, cudaMemcpyDeviceToHost, compute));
  }
  CUDA_OK(cudaStreamSynchronize(compute));
  std::vector<unsigned char> want(layer_bytes);
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    CUDA_OK(cudaMemcpy(want.data(), a[l], layer_bytes, cudaMemcpyDeviceToHost));
    for (std::uint32_t blk : blocks) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        const std::uint64_t at = (p * shape.num_blocks + blk) * shape.block_bytes();
        ASSERT_EQ(std::memcmp(got[l].data() + at, want.data() + at, shape.block_bytes()), 0)
            << "layer " << l << " block " << blk;
        ASSERT_NE(want[at], 0x11) << "the kernel's bytes, not the ones before it";
      }
    }
  }
  for (const auto& st : load->wait()) EXPECT_TRUE(st.is_ok()) << st.to_string();
  cudaEventDestroy(written);
  cudaStreamDestroy(attention);
  cudaStreamDestroy(compute);
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    cudaFree(a[l]);
    cudaFree(b[l]);
  }
}

}  // namespace
}  // namespace kvstash
