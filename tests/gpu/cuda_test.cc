// The CUDA device (src/kvcache/cuda) as the CUDA runtime really behaves. One source, two
// binaries:
//   cuda_test        the real runtime and kernels: skips without a GPU; scripts/gpu-check runs it
//                    (also with CUDA_DEVICE_MAX_CONNECTIONS=1) on a host with a GPU;
//   cuda_model_test  tests/gpu/cuda_model, a CPU model of the runtime (streams, the legacy default
//                    stream, events, the per-thread last error, stream memory operations on
//                    shared hardware queues, primary contexts, device memory the host cannot
//                    touch) with host twins of the kernels: it runs here, in every test run.
// Where the two disagree, the model is wrong and gets fixed. Each test names the finding (a way
// the runtime behaves) it guards, and fails on a CUDA device that does not allow for it.
#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "common/checksum.h"
#include "kvcache/cuda/cuda_device.h"
#include "kvcache/cuda/kernels.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "tests/harness/local_cluster.h"
#include "watchdog.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;

#define CUDA_OK(call)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (call);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_); \
  } while (0)

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

#define REQUIRE_GPUS(n)                                                                                 \
  do {                                                                                                  \
    if (gpu_count() < (n))                                                                              \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), " << gpu_count()                                     \
                   << " here (cuda_model_test runs this on the CPU model; scripts/gpu-check on a GPU)"; \
  } while (0)

// A hang (a GPU-side wait nothing will ever release) fails the test loudly, and ends the
// process, instead of stalling the suite.
test::Watchdog hang_guard(std::chrono::seconds limit, const char* what) {
  return test::Watchdog(Clock::now() + limit, [what, limit] {
    std::fprintf(stderr,
                 "\n*** HANG: %s did not finish within %llds: a GPU-side wait was never released ***\n", what,
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(1);
  });
}

// What the fill kernel writes: word i of a fill with `seed` (kernels.cu's splitmix64).
std::uint64_t filled_word(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// 4 layers, 32 blocks of 16 tokens, 8 heads of 128 (32 KiB blocks, 2 MiB layers); 256-token
// chunks of 16 blocks.
constexpr KvCacheShape kShape{
    .num_layers = 4, .num_blocks = 32, .block_size = 16, .num_kv_heads = 8, .head_dim = 128};
constexpr std::uint64_t kLayerBytes = 2ull * kShape.num_blocks * 16 * 8 * 128 * 2;
constexpr std::uint32_t kChunkTokens = 256;

// An engine's cache: one cudaMalloc per layer on the calling thread's current device.
struct GpuCache {
  std::vector<void*> layers;
  GpuCache() = default;
  GpuCache(const GpuCache&) = delete;
  ~GpuCache() {
    for (void* p : layers) cudaFree(p);
  }
  // Allocates every layer and fills it with `byte`.
  ::testing::AssertionResult allocate(unsigned char byte) {
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      void* p = nullptr;
      if (cudaMalloc(&p, kLayerBytes) != cudaSuccess || cudaMemset(p, byte, kLayerBytes) != cudaSuccess)
        return ::testing::AssertionFailure() << "cudaMalloc/cudaMemset of a layer";
      layers.push_back(p);
    }
    return ::testing::AssertionSuccess();
  }
  // Writes filled_layer(seed + l) into every layer l (defined below).
  ::testing::AssertionResult fill(std::uint64_t seed);
  std::vector<unsigned char> read(std::uint32_t l) const {
    std::vector<unsigned char> out(kLayerBytes);
    EXPECT_EQ(cudaMemcpy(out.data(), layers[l], kLayerBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

std::uint64_t at_block(std::uint32_t part, std::uint32_t block) {
  return (part * kShape.num_blocks + block) * kShape.block_bytes();
}

// Whether `got`'s blocks `to` hold what `want`'s blocks `from` hold, every part.
::testing::AssertionResult same_blocks(const std::vector<unsigned char>& want,
                                       const std::vector<std::uint32_t>& from,
                                       const std::vector<unsigned char>& got,
                                       const std::vector<std::uint32_t>& to) {
  for (std::size_t i = 0; i < from.size(); ++i) {
    for (std::uint32_t p = 0; p < 2; ++p) {
      if (std::memcmp(want.data() + at_block(p, from[i]), got.data() + at_block(p, to[i]),
                      kShape.block_bytes()) != 0)
        return ::testing::AssertionFailure() << "block " << i << " part " << p << " differs";
    }
  }
  return ::testing::AssertionSuccess();
}

// The bytes a fill of layer-sized memory with `seed` leaves.
std::vector<unsigned char> filled_layer(std::uint64_t seed) {
  std::vector<unsigned char> out(kLayerBytes);
  for (std::uint64_t i = 0; i < kLayerBytes / 8; ++i) {
    const std::uint64_t w = filled_word(seed, i);
    std::memcpy(out.data() + i * 8, &w, 8);
  }
  return out;
}

::testing::AssertionResult GpuCache::fill(std::uint64_t seed) {
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    const auto bytes = filled_layer(seed + l);
    if (cudaMemcpy(layers[l], bytes.data(), kLayerBytes, cudaMemcpyHostToDevice) != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaMemcpy of layer " << l;
  }
  return ::testing::AssertionSuccess();
}

std::vector<std::uint32_t> token_ids(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint32_t> t(n);
  std::mt19937 rng(seed);
  for (auto& x : t) x = rng() % 32000;
  return t;
}

std::vector<std::uint32_t> shuffled_blocks(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint32_t> all(kShape.num_blocks);
  std::iota(all.begin(), all.end(), 0u);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(n);
  return all;
}

// A private cell (redis-server and one kvstashd) and a store on it.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no GPU here (cuda_model_test runs these on the CPU model)";
    auto r = harness::LocalRedis::start({});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    redis_ = std::move(r).value();
    auto n =
        harness::LocalNode::start({.redis_url = redis_->url(), .capacity = "96MiB", .node_id = "gpu-node"});
    ASSERT_TRUE(n.is_ok()) << n.status().to_string();
    node_ = std::move(n).value();
    StoreOptions so;
    so.redis_url = redis_->url();
    so.timeout = 20s;
    auto s = Store::open(so);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    store_ = std::move(s).value();
  }
  void TearDown() override {
    store_.reset();
    node_.reset();
    redis_.reset();
  }

  // A cache over `c` (the calling thread's device), staged unless said otherwise.
  std::unique_ptr<KvCache> open(const GpuCache& c, KvPath path = KvPath::kStaged) {
    auto layout = KvLayout::per_layer(kShape, c.layers, MemoryKind::kCuda);
    EXPECT_TRUE(layout.is_ok()) << layout.status().to_string();
    auto kv = KvCache::open(*store_, std::move(layout).value(),
                            {.model = "gpu-model", .chunk_tokens = kChunkTokens}, {.path = path});
    EXPECT_TRUE(kv.is_ok()) << kv.status().to_string();
    return kv.is_ok() ? std::move(kv).value() : nullptr;
  }

  std::unique_ptr<harness::LocalRedis> redis_;
  std::unique_ptr<harness::LocalNode> node_;
  std::unique_ptr<Store> store_;
};

// ---- the kernels (or their twins) against the host -------------------------------------------

// Finding 6: long runs are cut into pieces (a contiguous chunk spreads over the GPU); gathers
// and scatters of shuffled and contiguous blocks, and of unaligned runs, land every byte and
// no other; device checksums of runs whose 4 KiB blocks span runs equal the host's.
TEST_F(CudaTest, CopiesAndChecksumsOfScatteredAndLongRunsMatchTheHost) {
  auto dev = cuda::cuda_device(0);
  ASSERT_TRUE(dev.is_ok()) << dev.status().to_string();
  GpuCache src, dst;
  ASSERT_TRUE(src.allocate(0));
  ASSERT_TRUE(dst.allocate(0x5a));
  std::vector<unsigned char> host(kLayerBytes);
  std::mt19937_64 rng(3);
  for (auto& c : host) c = static_cast<unsigned char>(rng());
  CUDA_OK(cudaMemcpy(src.layers[0], host.data(), kLayerBytes, cudaMemcpyHostToDevice));
  auto layout = KvLayout::per_layer(kShape, src.layers, MemoryKind::kCuda).value();
  auto pinned = (*dev)->allocate_host(kLayerBytes);
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  const Deadline deadline = deadline_after(30s);
  auto* s = static_cast<std::byte*>(src.layers[0]);
  auto* d = static_cast<std::byte*>(dst.layers[0]);
  struct Case {
    const char* name;
    std::vector<std::uint32_t> blocks;
  };
  std::vector<std::uint32_t> all(kShape.num_blocks);
  std::iota(all.begin(), all.end(), 0u);
  for (const Case& c : {Case{"shuffled", shuffled_blocks(13, 4)}, Case{"contiguous", all}}) {
    std::vector<KvRun> runs;
    ASSERT_TRUE(layout.layer_runs(0, c.blocks, runs).is_ok());
    if (std::string(c.name) == "contiguous") {
      EXPECT_EQ(runs.size(), 1u) << "adjacent blocks (and parts) merge into one long run";
    }
    std::memset(pinned->get(), 0xab, kLayerBytes);
    ASSERT_TRUE((*dev)->gather(runs, pinned->get(), deadline).is_ok()) << c.name;
    std::uint64_t at = 0;
    for (const KvRun& r : runs) {
      ASSERT_EQ(std::memcmp(pinned->get() + at, host.data() + (r.addr - s), r.length), 0) << c.name;
      at += r.length;
    }
    for (std::uint64_t i = at; i < kLayerBytes; ++i)
      ASSERT_EQ(static_cast<unsigned char>(pinned->get()[i]), 0xab) << c.name << ": written past the runs";
    // Scatter back into the other cache at the same offsets: those bytes equal, the rest poison.
    std::vector<KvRun> into;
    for (const KvRun& r : runs) into.push_back({d + (r.addr - s), r.length, 0});
    ASSERT_TRUE((*dev)->scatter(pinned->get(), into, deadline).is_ok()) << c.name;
    const std::vector<unsigned char> back = dst.read(0);
    std::vector<bool> written(kLayerBytes, false);
    for (const KvRun& r : runs) std::fill_n(written.begin() + (r.addr - s), r.length, true);
    for (std::uint64_t i = 0; i < kLayerBytes; ++i)
      ASSERT_EQ(back[i], written[i] ? host[i] : 0x5a) << c.name << " byte " << i;
    CUDA_OK(cudaMemset(dst.layers[0], 0x5a, kLayerBytes));
  }
  // Checksums where the bytes are: runs at odd offsets and lengths, so blocks span runs.
  const KvRun odd[] = {
      {s + 5, 70000, 0}, {s + 200000, 4096, 0}, {s + 300001, 123457, 0}, {s + 1048576, 1, 0}};
  std::vector<unsigned char> packed;
  for (const KvRun& r : odd)
    packed.insert(packed.end(), host.data() + (r.addr - s), host.data() + (r.addr - s) + r.length);
  auto on_gpu = (*dev)->segment_sum(odd, false, deadline);
  ASSERT_TRUE(on_gpu.is_ok()) << on_gpu.status().to_string();
  EXPECT_EQ(*on_gpu, sum::segment_sum(packed.data(), packed.size()));
  for (std::uint64_t length : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{4095}, std::uint64_t{4096},
                               std::uint64_t{4097}, std::uint64_t{1000003}, kLayerBytes}) {
    const KvRun whole{s, length, 0};
    auto got = (*dev)->segment_sum({&whole, 1}, false, deadline);
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    EXPECT_EQ(*got, sum::segment_sum(host.data(), length)) << "length " << length;
  }
}

// ---- stream ordering --------------------------------------------------------------------------

// Finding 1: torch's default stream has handle 0, CUDA's legacy default stream, which orders
// after every blocking stream. A save passed that handle (vLLM's call pattern), or nothing at
// all, waits for the kernel that writes the layer; before, a null stream meant "nothing to wait
// for", and the save stored (and checksummed) the bytes from before the kernel.
TEST_F(CudaTest, ASaveOrderedOnTheLegacyDefaultStreamStoresTheKernelsBytes) {
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(0x11));  // what an unordered save would store
  ASSERT_TRUE(b.allocate(0x5a));
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  cudaStream_t blocking = nullptr;
  CUDA_OK(cudaStreamCreate(&blocking));  // a blocking stream: the legacy stream orders after it
  const auto tokens = token_ids(kChunkTokens, 1);
  const auto from = shuffled_blocks(16, 2), to = shuffled_blocks(16, 3);
  auto save = kva->begin_save(tokens, from, 0, 1);
  ASSERT_TRUE(save.is_ok()) << save.status().to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    // Odd layers are written on the blocking stream, even ones on the legacy stream itself.
    void* on = l % 2 ? static_cast<void*>(blocking) : nullptr;
    ASSERT_EQ(cuda::launch_fill_words(a.layers[l], kLayerBytes / 8, 100 + l, 40'000'000, on), 0);
    const KvSync after = l < 2 ? KvSync::stream(nullptr) : KvSync{};  // torch's handle 0; the default
    ASSERT_TRUE(save->save_layer(l, after).is_ok());
  }
  for (const Status& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  // The load, vLLM's way too: the engine's default stream waits for each layer on the GPU.
  auto load = kvb->begin_load(tokens, to, 1, {}, KvSync::stream(nullptr));
  ASSERT_TRUE(load.is_ok()) << load.status().to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    ASSERT_TRUE(load->wait_layer_on(l, nullptr).is_ok()) << l;
  CUDA_OK(cudaStreamSynchronize(nullptr));
  for (const Status& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    EXPECT_TRUE(same_blocks(filled_layer(100 + l), from, b.read(l), to))
        << "layer " << l << ": the kernel's bytes";
  CUDA_OK(cudaStreamDestroy(blocking));
}

// Finding 2: a query that finds the engine's work pending returns cudaErrorNotReady, which the
// runtime also records as the thread's last error; the saver's next launch, checked with
// cudaGetLastError(), read it and failed the save with "device not ready". Every layer here
// is written late, so the saver's first queries find it pending.
TEST_F(CudaTest, ASaveAfterAQueryFoundTheEnginesWorkPendingStillLaunches) {
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(0));
  ASSERT_TRUE(b.allocate(0x5a));
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  cudaStream_t attention = nullptr;
  cudaEvent_t written = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&attention, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&written, cudaEventDisableTiming));
  const auto tokens = token_ids(2 * kChunkTokens, 5);
  const auto from = shuffled_blocks(32, 6), to = shuffled_blocks(32, 7);
  auto save = kva->begin_save(tokens, from, 0, 2);
  ASSERT_TRUE(save.is_ok());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    ASSERT_EQ(cuda::launch_fill_words(a.layers[l], kLayerBytes / 8, 7 + l, 30'000'000, attention), 0);
    if (l % 2 == 0) {
      ASSERT_TRUE(save->save_layer(l, KvSync::stream(attention)).is_ok());
    } else {
      CUDA_OK(cudaEventRecord(written, attention));
      ASSERT_TRUE(save->save_layer(l, KvSync::event(written)).is_ok());
    }
  }
  for (const Status& st : save->wait()) EXPECT_TRUE(st.is_ok()) << st.to_string();
  for (const Status& st : kvb->load(tokens, to, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    EXPECT_TRUE(same_blocks(filled_layer(7 + l), from, b.read(l), to)) << "layer " << l;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "kvstash left nothing in the caller's last error";
  CUDA_OK(cudaEventDestroy(written));
  CUDA_OK(cudaStreamDestroy(attention));
}

// Finding 3: a GPU-side wait depends on host progress alone. Before, a load's events came from
// a private stream waiting on a counter the host raised only after kvstash's own scatter (or
// checksum) kernels ran on other streams; with CUDA_DEVICE_MAX_CONNECTIONS=1 (meson test
// cuda_model_one_queue; scripts/gpu-check on a GPU) every stream shares one hardware queue, the
// kernel sat behind the wait, and the load hung. Here the engine hands every layer to its
// stream (half as events) before a byte has landed; a hang fails the test.
TEST_F(CudaTest, ALoadsStreamWaitsDependOnlyOnTheHost) {
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(0));
  ASSERT_TRUE(b.allocate(0x5a));
  std::vector<std::vector<unsigned char>> want(kShape.num_layers);
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    want[l] = filled_layer(50 + l);
    CUDA_OK(cudaMemcpy(a.layers[l], want[l].data(), kLayerBytes, cudaMemcpyHostToDevice));
  }
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(2 * kChunkTokens, 8);
  const auto from = shuffled_blocks(32, 9), to = shuffled_blocks(32, 10);
  for (const Status& st : kva->save(tokens, from, 0, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  cudaStream_t compute = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  std::vector<unsigned char> got(kLayerBytes * kShape.num_layers);
  {
    auto dog = hang_guard(60s, "a load handed to the engine's stream");
    auto load = kvb->begin_load(tokens, to, 2, {}, KvSync::stream(compute));
    ASSERT_TRUE(load.is_ok()) << load.status().to_string();
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      if (l % 2 == 0) {
        ASSERT_TRUE(load->wait_layer_on(l, compute).is_ok());
      } else {
        auto e = load->layer_event(l);
        ASSERT_TRUE(e.is_ok()) << e.status().to_string();
        CUDA_OK(cudaStreamWaitEvent(compute, static_cast<cudaEvent_t>(*e), 0));
      }
      // The engine's "attention": reads the layer right after the wait, on its stream.
      CUDA_OK(cudaMemcpyAsync(got.data() + l * kLayerBytes, b.layers[l], kLayerBytes, cudaMemcpyDeviceToHost,
                              compute));
    }
    CUDA_OK(cudaStreamSynchronize(compute));
    for (const Status& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    std::vector<unsigned char> layer(got.begin() + l * kLayerBytes, got.begin() + (l + 1) * kLayerBytes);
    EXPECT_TRUE(same_blocks(want[l], from, layer, to)) << "what the stream read after its wait, layer " << l;
  }
  CUDA_OK(cudaStreamDestroy(compute));
}

// Finding 3, the direct path's half, at the device: layers that a NIC wrote (here: the host,
// with synchronous copies before anything is queued: a copy is stream work, which a queued
// wait could hold up in a shared hardware queue, where a NIC's writes are not) are checked by
// the digest kernel on the engine's stream after each release; a corrupt layer's sum differs,
// which KvLoad::wait() reports before the engine returns the step's tokens.
TEST_F(CudaTest, TheDirectHandoverChecksEachLayerOnTheEnginesStream) {
  auto dev = cuda::cuda_device(0);
  ASSERT_TRUE(dev.is_ok()) << dev.status().to_string();
  GpuCache c;
  ASSERT_TRUE(c.allocate(0));
  auto layout = KvLayout::per_layer(kShape, c.layers, MemoryKind::kCuda).value();
  const auto blocks = shuffled_blocks(16, 11);
  KvHandoverPlan plan{.staged = false, .layers = kShape.num_layers, .layer_bytes = layout.layer_bytes(16)};
  plan.runs.resize(1);
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    std::vector<KvRun> runs;
    ASSERT_TRUE(layout.layer_runs(l, blocks, runs).is_ok());
    plan.runs[0].push_back(runs);
  }
  cudaStream_t compute = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  std::vector<std::uint64_t> want(kShape.num_layers);
  {
    auto dog = hang_guard(60s, "the direct handover");
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      std::vector<unsigned char> bytes = filled_layer(70 + l);
      if (l == 2) bytes[at_block(1, blocks[3]) + 9] ^= 1;  // corrupt
      CUDA_OK(cudaMemcpy(c.layers[l], bytes.data(), kLayerBytes, cudaMemcpyHostToDevice));
      std::vector<unsigned char> packed;
      for (const KvRun& r : plan.runs[0][l]) {
        const std::uint64_t off = r.addr - static_cast<std::byte*>(c.layers[l]);
        const std::vector<unsigned char> clean = filled_layer(70 + l);
        packed.insert(packed.end(), clean.begin() + off, clean.begin() + off + r.length);
      }
      want[l] = sum::segment_sum(packed.data(), packed.size());
    }
    auto h = (*dev)->handover(plan);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) ASSERT_TRUE((*h)->queue(l, compute).is_ok());
    std::this_thread::sleep_for(20ms);
    EXPECT_FALSE((*h)->passed()) << "the stream waits for the host's release";
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) (*h)->release_through(l + 1);
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      auto got = (*h)->sum(0, l, deadline_after(30s));
      ASSERT_TRUE(got.is_ok()) << got.status().to_string();
      if (l == 2) {
        EXPECT_NE(*got, want[l]) << "the corrupt layer is caught on the device";
      } else {
        EXPECT_EQ(*got, want[l]) << "layer " << l;
      }
    }
    CUDA_OK(cudaStreamSynchronize(compute));
    EXPECT_TRUE((*h)->passed());
  }
  CUDA_OK(cudaStreamDestroy(compute));
}

// On the staged path a layer is checked on the host before any byte of it is placed: a
// corrupt layer (and every layer after it in its chunk) never reaches the cache, even when the
// engine's stream already waits for it; the chunk is reported for recomputation.
TEST_F(CudaTest, ACorruptLayerNeverReachesTheCacheOnTheStagedPath) {
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(0));
  ASSERT_TRUE(b.allocate(0x5a));
  ASSERT_TRUE(a.fill(90));
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(kChunkTokens, 12);
  const auto from = shuffled_blocks(16, 13), to = shuffled_blocks(16, 14);
  for (const Status& st : kva->save(tokens, from, 0, 1)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  // Layer 2 of the stored object changes under its recorded checksums.
  const std::string key = kva->keys(tokens)[0];
  auto info = store_->stat(key);
  ASSERT_TRUE(info.is_ok());
  std::vector<std::byte> bytes(info->size);
  Slice whole{bytes.data(), bytes.size()};
  ASSERT_TRUE(store_->get(key, {&whole, 1}).is_ok());
  bytes[2 * kva->chunk_bytes() / kShape.num_layers + 77] ^= std::byte{1};
  ASSERT_TRUE(store_->put(key, {&whole, 1}, {.object_layout = info->object_layout}).is_ok());
  cudaStream_t compute = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  auto load = kvb->begin_load(tokens, to, 1, {}, KvSync::stream(compute));
  ASSERT_TRUE(load.is_ok());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) ASSERT_TRUE(load->wait_layer_on(l, compute).is_ok());
  CUDA_OK(cudaStreamSynchronize(compute));
  const auto statuses = load->wait();
  EXPECT_EQ(statuses[0].code(), StatusCode::kCorrupt) << statuses[0].to_string();
  EXPECT_EQ(load->failed_blocks(), to);
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    const auto got = b.read(l);
    if (l < 2) {
      EXPECT_TRUE(same_blocks(filled_layer(90 + l), from, got, to)) << "layer " << l << " checked and placed";
    } else {
      for (std::uint32_t blk : to)
        EXPECT_EQ(got[at_block(0, blk)], 0x5a)
            << "layer " << l << ": nothing placed from the corrupt layer on";
    }
  }
  CUDA_OK(cudaStreamDestroy(compute));
}

// Waits may be mixed: some layers on the host, some on a stream, some never asked for (wait()
// places them); each layer is placed once, and all land.
TEST_F(CudaTest, MixedWaitsPlaceEveryLayer) {
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(0));
  ASSERT_TRUE(b.allocate(0x5a));
  ASSERT_TRUE(a.fill(30));
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(2 * kChunkTokens, 15);
  const auto from = shuffled_blocks(32, 16), to = shuffled_blocks(32, 17);
  for (const Status& st : kva->save(tokens, from, 0, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  cudaStream_t compute = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  auto load = kvb->begin_load(tokens, to, 2, {}, KvSync::none());
  ASSERT_TRUE(load.is_ok());
  ASSERT_TRUE(load->wait_layer(0).is_ok());              // the host, before any stream
  ASSERT_TRUE(load->wait_layer_on(1, compute).is_ok());  // a stream
  ASSERT_TRUE(load->wait_layer(2).is_ok());              // the host again, after
  // layer 3: nobody asks; wait() places it.
  CUDA_OK(cudaStreamSynchronize(compute));
  for (const Status& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(load->wait_layer_on(3, compute).code(), StatusCode::kInvalidArgument) << "after wait()";
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    EXPECT_TRUE(same_blocks(filled_layer(30 + l), from, b.read(l), to)) << "layer " << l;
  CUDA_OK(cudaStreamDestroy(compute));
}

// Finding 9: a load writes no block before the engine's earlier work on it (begin_load's
// `after`): here a kernel still writes the blocks 60 ms after the load begins.
TEST_F(CudaTest, ALoadWritesNoBlockBeforeTheEnginesEarlierWork) {
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(0));
  ASSERT_TRUE(b.allocate(0));
  ASSERT_TRUE(a.fill(20));
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(kChunkTokens, 18);
  const auto blocks = shuffled_blocks(16, 19);
  for (const Status& st : kva->save(tokens, blocks, 0, 1)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  cudaStream_t compute = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  for (bool streams : {false, true}) {
    // The previous owner of the blocks: a kernel writing every layer of b, late.
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
      ASSERT_EQ(cuda::launch_fill_words(b.layers[l], kLayerBytes / 8, 999, 60'000'000, compute), 0);
    auto load = kvb->begin_load(tokens, blocks, 1, {}, KvSync::stream(compute));
    ASSERT_TRUE(load.is_ok());
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      ASSERT_TRUE((streams ? load->wait_layer_on(l, compute) : load->wait_layer(l)).is_ok()) << l;
    }
    for (const Status& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
    CUDA_OK(cudaStreamSynchronize(compute));
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
      EXPECT_TRUE(same_blocks(filled_layer(20 + l), blocks, b.read(l), blocks))
          << (streams ? "stream" : "host") << " waits, layer " << l
          << ": the load's bytes, written after the kernel";
  }
  CUDA_OK(cudaStreamDestroy(compute));
}

// Finding 9: marks and stream waits are not stream-ordered work kvstash can do inside a CUDA
// graph being captured: refused with a clear error, and the load goes on for host waiters.
TEST_F(CudaTest, StreamsCapturingAGraphAreRefused) {
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(1));
  ASSERT_TRUE(b.allocate(0x5a));
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(kChunkTokens, 20);
  const auto blocks = shuffled_blocks(16, 21);
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto save = kva->begin_save(tokens, blocks, 0, 1);
  ASSERT_TRUE(save.is_ok());
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const Status refused = save->save_layer(0, KvSync::stream(s));
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.to_string();
  EXPECT_NE(refused.message().find("capturing a CUDA graph"), std::string::npos) << refused.to_string();
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  if (graph != nullptr) CUDA_OK(cudaGraphDestroy(graph));
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    ASSERT_TRUE(save->save_layer(l, KvSync::stream(s)).is_ok());
  for (const Status& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();

  auto load = kvb->begin_load(tokens, blocks, 1, {}, KvSync::none());
  ASSERT_TRUE(load.is_ok());
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  EXPECT_EQ(load->wait_layer_on(0, s).code(), StatusCode::kInvalidArgument);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  if (graph != nullptr) CUDA_OK(cudaGraphDestroy(graph));
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) ASSERT_TRUE(load->wait_layer(l).is_ok()) << l;
  for (const Status& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(same_blocks(a.read(0), blocks, b.read(0), blocks));
  CUDA_OK(cudaStreamDestroy(s));
}

// ---- contexts ---------------------------------------------------------------------------------

bool primary_context_active(int gpu) {
  using GetState = CUresult (*)(CUdevice, unsigned*, int*);
  using DeviceGet = CUresult (*)(CUdevice*, int);
  void* p = nullptr;
  void* q = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &p, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      cudaGetDriverEntryPointByVersion("cuDeviceGet", &q, 12000, cudaEnableDefault, &found) != cudaSuccess) {
    ADD_FAILURE() << "no cuDevicePrimaryCtxGetState";
    return true;
  }
  CUdevice dev = 0;
  unsigned flags = 0;
  int active = 0;
  EXPECT_EQ(reinterpret_cast<DeviceGet>(q)(&dev, gpu), CUDA_SUCCESS);
  EXPECT_EQ(reinterpret_cast<GetState>(p)(dev, &flags, &active), CUDA_SUCCESS);
  return active != 0;
}

CUcontext current_context() {
  using GetCurrent = CUresult (*)(CUcontext*);
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CUcontext ctx = nullptr;
  if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault, &found) ==
      cudaSuccess)
    reinterpret_cast<GetCurrent>(p)(&ctx);
  return ctx;
}

// Finding 4: two tensor-parallel ranks on GPUs 1 and 2, each on its own thread as vLLM's
// workers are (cudaSetDevice first), save and load through kvstash; no thread of kvstash's or
// theirs gains a context on GPU 0 (0.5 GiB each on a real GPU), and each rank's current device
// is as it was after every call. Before, saver, loader and marker threads called
// cudaHostAlloc or cudaEventQuery before any cudaSetDevice. Runs alone in its process (meson
// test cuda_model_ranks, with three model GPUs), so that nothing else touched GPU 0.
TEST_F(CudaTest, RanksOnGpus1And2CreateNoContextOnGpu0) {
  REQUIRE_GPUS(3);
  ASSERT_FALSE(primary_context_active(0)) << "GPU 0 has a context before the test: run it alone";
  std::vector<std::string> failures;
  std::mutex mu;
  auto rank = [&](int gpu) {
    auto fail = [&](std::string why) {
      std::lock_guard lock(mu);
      failures.push_back("rank on GPU " + std::to_string(gpu) + ": " + why);
    };
    auto same_device = [&](const char* after) {
      int now = -1;
      if (cudaGetDevice(&now) != cudaSuccess || now != gpu)
        fail(std::string("current device changed by ") + after);
    };
    if (cudaSetDevice(gpu) != cudaSuccess) return fail("cudaSetDevice");
    GpuCache a, b;
    if (!a.allocate(0) || !b.allocate(0x5a)) return fail("allocate");
    auto kva = open(a), kvb = open(b);  // cuda_device_of: the GPU that owns the tensors
    same_device("KvCache::open");
    if (!kva || !kvb || kva->device().name() != "cuda") return fail("open");
    cudaStream_t compute = nullptr;
    if (cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking) != cudaSuccess) return fail("stream");
    const auto tokens = token_ids(kChunkTokens, 40 + gpu);
    const auto blocks = shuffled_blocks(16, 41 + gpu);
    auto save = kva->begin_save(tokens, blocks, 0, 1);
    if (!save.is_ok()) return fail(save.status().to_string());
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      cuda::launch_fill_words(a.layers[l], kLayerBytes / 8, gpu * 10 + l, 5'000'000, compute);
      if (!save->save_layer(l, KvSync::stream(compute)).is_ok()) return fail("save_layer");
      same_device("save_layer");
    }
    for (const Status& st : save->wait())
      if (!st.is_ok()) return fail(st.to_string());
    same_device("KvSave::wait");
    auto load = kvb->begin_load(tokens, blocks, 1, {}, KvSync::stream(compute));
    if (!load.is_ok()) return fail(load.status().to_string());
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      if (!load->wait_layer_on(l, compute).is_ok()) return fail("wait_layer_on");
      same_device("wait_layer_on");
    }
    cudaStreamSynchronize(compute);
    for (const Status& st : load->wait())
      if (!st.is_ok()) return fail(st.to_string());
    same_device("KvLoad::wait");
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      if (!same_blocks(filled_layer(gpu * 10 + l), blocks, b.read(l), blocks))
        fail("layer " + std::to_string(l));
    }
    cudaStreamDestroy(compute);
  };
  std::thread r1(rank, 1), r2(rank, 2);
  r1.join();
  r2.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
  EXPECT_TRUE(primary_context_active(1) && primary_context_active(2));
  EXPECT_FALSE(primary_context_active(0)) << "a thread gained a context on GPU 0";
}

// Finding 4, on any GPU: a thread that never used CUDA calls into kvstash (a host wait) and
// leaves with no context bound, as it came; a caller's own binding is restored too.
TEST_F(CudaTest, KvstashLeavesTheCallersContextAsItWas) {
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(3));
  ASSERT_TRUE(b.allocate(0x5a));
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(kChunkTokens, 50);
  const auto blocks = shuffled_blocks(16, 51);
  for (const Status& st : kva->save(tokens, blocks, 0, 1)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  auto load = kvb->begin_load(tokens, blocks, 1, {}, KvSync::none());
  ASSERT_TRUE(load.is_ok());
  CUcontext before = reinterpret_cast<CUcontext>(1), after = reinterpret_cast<CUcontext>(1);
  std::thread fresh([&] {
    before = current_context();
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) (void)load->wait_layer(l);
    (void)load->wait();
    after = current_context();
  });
  fresh.join();
  EXPECT_EQ(before, nullptr);
  EXPECT_EQ(after, nullptr) << "kvstash left its context bound on a thread that had none";
  const CUcontext mine = current_context();
  ASSERT_TRUE(kvb->begin_load(tokens, blocks, 1)->wait()[0].is_ok());
  EXPECT_EQ(current_context(), mine);
}

// ---- drivers ----------------------------------------------------------------------------------

// Finding 5: a driver older than the linked runtime needs is refused naming the floor, by
// KvCache::open as by cuda_device(). Meson test cuda_model_old_driver runs it with a model
// driver for CUDA 12.2 (R535); elsewhere the driver is new enough and it says so.
TEST(CudaDriver, AnOlderDriverIsRefusedNamingTheFloor) {
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) GTEST_SKIP() << "no NVIDIA driver here";
  if (driver / 1000 >= CUDART_VERSION / 1000) {
    GTEST_SKIP() << "the driver (CUDA " << driver << ") is new enough for this runtime (" << CUDART_VERSION
                 << "); meson test cuda_model_old_driver runs this against a model of an older one";
  }
  auto dev = cuda::cuda_device(0);
  ASSERT_FALSE(dev.is_ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kUnavailable);
  const std::string m = dev.status().message();
  EXPECT_NE(m.find(CUDART_VERSION >= 13000 ? "R580" : "R525"), std::string::npos) << m;
  EXPECT_NE(m.find("the NVIDIA driver supports CUDA " + std::to_string(driver / 1000) + "."),
            std::string::npos)
      << m;
  auto via_kvcache = cuda_device(0);
  ASSERT_FALSE(via_kvcache.is_ok());
  EXPECT_NE(via_kvcache.status().message().find("R5"), std::string::npos) << via_kvcache.status().to_string();
}

// ---- end to end -------------------------------------------------------------------------------

// A KV cache in GPU memory saves and loads through pinned bounce buffers (a cache of its own
// device, and one chosen by the tensors' GPU), every block where it belongs and no other.
TEST_F(CudaTest, AKvCacheInGpuMemorySavesAndLoadsThroughPinnedBounceBuffers) {
  auto gpu = cuda::cuda_device(0);
  ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(0));
  ASSERT_TRUE(b.allocate(0x5a));
  std::vector<std::vector<unsigned char>> host(kShape.num_layers, std::vector<unsigned char>(kLayerBytes));
  std::mt19937_64 rng(5);
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    for (auto& c : host[l]) c = static_cast<unsigned char>(rng());
    CUDA_OK(cudaMemcpy(a.layers[l], host[l].data(), kLayerBytes, cudaMemcpyHostToDevice));
  }
  auto kva = KvCache::open(*store_, KvLayout::per_layer(kShape, a.layers, MemoryKind::kCuda).value(),
                           {.model = "gpu-model", .chunk_tokens = kChunkTokens},
                           {.device = *gpu, .path = KvPath::kStaged});
  auto kvb = KvCache::open(*store_, KvLayout::per_layer(kShape, b.layers, MemoryKind::kCuda).value(),
                           {.model = "gpu-model", .chunk_tokens = kChunkTokens});
  ASSERT_TRUE(kva.is_ok()) << kva.status().to_string();
  ASSERT_TRUE(kvb.is_ok()) << kvb.status().to_string();
  EXPECT_EQ((*kva)->data_path(), "staged");
  EXPECT_EQ((*kvb)->device().name(), "cuda");
  const auto tokens = token_ids(2 * kChunkTokens, 6);
  const auto from = shuffled_blocks(32, 6), to = shuffled_blocks(32, 7);
  auto save = (*kva)->begin_save(tokens, from, 0, 2);
  ASSERT_TRUE(save.is_ok());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) ASSERT_TRUE(save->save_layer(l).is_ok());
  for (const auto& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  auto load = (*kvb)->begin_load(tokens, to, 2);
  ASSERT_TRUE(load.is_ok());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) ASSERT_TRUE(load->wait_layer(l).is_ok()) << l;
  for (const auto& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    const auto got = b.read(l);
    EXPECT_TRUE(same_blocks(host[l], from, got, to)) << "layer " << l;
    std::vector<bool> written(kShape.num_blocks, false);
    for (std::uint32_t blk : to) written[blk] = true;
    for (std::uint32_t blk = 0; blk < kShape.num_blocks; ++blk) {
      if (written[blk]) continue;
      for (std::uint32_t p = 0; p < 2; ++p)
        ASSERT_EQ(got[at_block(p, blk)], 0x5a) << "layer " << l << ": an unlisted block was written";
    }
  }
}

// Where a NIC reaches the GPU (KVSTASH_GPU_PATH=direct on a host with RDMA: scripts/gpu-check),
// the same stream-ordered save and load on the direct path; otherwise staged.
TEST_F(CudaTest, StreamOrderedSavesAndLoadsOnTheChosenPath) {
  const char* want_path = std::getenv("KVSTASH_GPU_PATH");
  const KvPath path = want_path == nullptr                 ? KvPath::kAuto
                      : std::string(want_path) == "direct" ? KvPath::kDirect
                                                           : KvPath::kStaged;
  GpuCache a, b;
  ASSERT_TRUE(a.allocate(0x11));
  ASSERT_TRUE(b.allocate(0x5a));
  auto kva = open(a, path), kvb = open(b, path);
  ASSERT_TRUE(kva && kvb);
  std::cout << "data path: " << kva->data_path() << " (" << kva->device().name() << " device)\n";
  cudaStream_t attention = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&attention, cudaStreamNonBlocking));
  const auto tokens = token_ids(kChunkTokens, 60);
  const auto blocks = shuffled_blocks(16, 61);
  auto save = kva->begin_save(tokens, blocks, 0, 1);
  ASSERT_TRUE(save.is_ok());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    ASSERT_EQ(cuda::launch_fill_words(a.layers[l], kLayerBytes / 8, 200 + l, 20'000'000, attention), 0);
    ASSERT_TRUE(save->save_layer(l, KvSync::stream(attention)).is_ok());
  }
  for (const auto& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  auto load = kvb->begin_load(tokens, blocks, 1, {}, KvSync::stream(attention));
  ASSERT_TRUE(load.is_ok());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    ASSERT_TRUE(load->wait_layer_on(l, attention).is_ok());
  CUDA_OK(cudaStreamSynchronize(attention));
  for (const auto& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    EXPECT_TRUE(same_blocks(filled_layer(200 + l), blocks, b.read(l), blocks)) << "layer " << l;
  CUDA_OK(cudaStreamDestroy(attention));
}

}  // namespace
}  // namespace kvstash
