// KvCache on device memory the host cannot touch (tests/gpu/device_standin.h), end to end through a
// real redis-server and kvstashd, on every transport: the host never reads or writes a byte of
// the cache (a touch faults and names itself), the device copies and checksums it, saves wait
// for the engine's streams and loads hand each layer to them as an event.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <numeric>
#include <random>

#include "device_standin.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "kvstash_config.h"
#include "rdma_lane.h"
#include "test_util.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;
using test::DeviceStandin;

// 4 layers, 32 blocks of 16 tokens, 4 heads of 64 (8 KiB blocks); 64-token chunks of 4 blocks.
constexpr KvCacheShape kShape{
    .num_layers = 4, .num_blocks = 32, .block_size = 16, .num_kv_heads = 4, .head_dim = 64};
constexpr std::uint32_t kChunkTokens = 64;

struct Lane {
  const char* name;
  std::vector<TransportKind> transports;  // the client's
};

std::vector<Lane> lanes() {
  std::vector<Lane> out{{"tcp", {TransportKind::kTcp}}, {"shm", {TransportKind::kShm}}};
#if KVSTASH_HAVE_UCX
  out.push_back({"ucx", {TransportKind::kUcx, TransportKind::kTcp}});  // puts go over tcp (fenced)
#endif
#if KVSTASH_HAVE_VERBS
  out.push_back({"verbs", {TransportKind::kVerbs}});
#endif
  return out;
}

// One engine's cache on the stand-in: per-layer (2, num_blocks, ...) tensors at device addresses.
struct DeviceCache {
  DeviceCache(std::shared_ptr<DeviceStandin> d, std::size_t offset, std::uint64_t seed) : dev(std::move(d)) {
    const std::uint64_t layer_bytes = 2ull * kShape.num_blocks * kShape.block_bytes();
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      std::byte* p = dev->base() + offset + l * layer_bytes;
      test::fill_random({dev->view(p), layer_bytes}, seed + l);  // written "on the device"
      ptrs.push_back(p);
    }
  }
  std::byte* block(std::uint32_t l, std::uint32_t part, std::uint32_t b) const {
    return static_cast<std::byte*>(ptrs[l]) + (part * kShape.num_blocks + b) * kShape.block_bytes();
  }
  std::shared_ptr<DeviceStandin> dev;
  std::vector<void*> ptrs;
};

std::size_t cache_bytes() {
  return std::size_t{kShape.num_layers} * 2 * kShape.num_blocks * kShape.block_bytes();
}

std::vector<std::uint32_t> tokens(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint32_t> t(n);
  std::mt19937 rng(seed);
  for (auto& x : t) x = rng() % 32000;
  return t;
}

std::vector<std::uint32_t> scattered(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint32_t> all(kShape.num_blocks);
  std::iota(all.begin(), all.end(), 0u);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(n);
  return all;
}

void PrintTo(const Lane& l, std::ostream* os) { *os << l.name; }

class KvCacheDeviceTest : public ::testing::TestWithParam<Lane> {
 protected:
  void SetUp() override {
    if (GetParam().transports.front() == TransportKind::kVerbs) {
      Status verbs = test::verbs_available();
      KVSTASH_REQUIRE_RDMA(verbs.is_ok(), verbs.to_string());
    }
    auto r = harness::LocalRedis::start({});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    redis_ = std::move(r).value();
    auto n = harness::LocalNode::start(
        {.redis_url = redis_->url(),
         .capacity = "16MiB",
         .page_size = "256KiB",
         .node_id = "n1",
         .extra_args = {"--huge-pages", "off", "--transports", "all", "--ucx-allow-emulated-rma"}});
    ASSERT_TRUE(n.is_ok()) << n.status().to_string();
    node_ = std::move(n).value();
    StoreOptions o;
    o.redis_url = redis_->url();
    o.engine.transports = GetParam().transports;
    o.engine.ucx.allow_emulated_rma = true;
    o.engine.verbs.device_memory_by_address = true;  // the NIC reaches the stand-in (GPUDirect-style)
    o.timeout = 10s;
    auto s = Store::open(o);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    store_ = std::move(s).value();
    auto d = DeviceStandin::create(2 * cache_bytes());
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    dev_ = std::move(d).value();
    a_ = std::make_unique<DeviceCache>(dev_, 0, 100);
    b_ = std::make_unique<DeviceCache>(dev_, cache_bytes(), 200);
  }

  // Opens a cache over `c` with the stand-in as its device (then seals the memory: every
  // registration a path needs is made).
  std::unique_ptr<KvCache> open(DeviceCache& c, KvPath path = KvPath::kAuto, bool seal = true) {
    auto layout = KvLayout::per_layer(kShape, c.ptrs, MemoryKind::kCuda);
    EXPECT_TRUE(layout.is_ok()) << layout.status().to_string();
    auto kv = KvCache::open(*store_, std::move(layout).value(), {.model = "m", .chunk_tokens = kChunkTokens},
                            {.device = dev_, .path = path});
    EXPECT_TRUE(kv.is_ok()) << kv.status().to_string();
    if (seal) {
      EXPECT_TRUE(dev_->seal().is_ok());
    }
    return kv.is_ok() ? std::move(kv).value() : nullptr;
  }

  // Whether chunk blocks `from` of `a` equal blocks `to` of `b`, compared on the device's side.
  ::testing::AssertionResult same_blocks(const DeviceCache& a, const std::vector<std::uint32_t>& from,
                                         const DeviceCache& b, const std::vector<std::uint32_t>& to) const {
    for (std::size_t i = 0; i < from.size(); ++i) {
      for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
        for (std::uint32_t p = 0; p < 2; ++p) {
          if (std::memcmp(dev_->view(a.block(l, p, from[i])), dev_->view(b.block(l, p, to[i])),
                          kShape.block_bytes()) != 0) {
            return ::testing::AssertionFailure() << "block " << i << " layer " << l << " part " << p;
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  std::unique_ptr<harness::LocalRedis> redis_;
  std::unique_ptr<harness::LocalNode> node_;
  std::unique_ptr<Store> store_;
  std::shared_ptr<DeviceStandin> dev_;
  std::unique_ptr<DeviceCache> a_, b_;
};

TEST(DeviceStandinTest, AHostTouchOfSealedMemoryFaultsAndNamesItselfWhileTheDeviceStillSeesTheBytes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto d = DeviceStandin::create(1 << 20);
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  std::byte* p = (*d)->base() + 4096;
  test::fill_random({(*d)->view(p), 8192}, 3);
  const auto expected = static_cast<std::uint8_t>((*d)->view(p)[5]);
  EXPECT_EQ(static_cast<std::uint8_t>(p[5]), expected) << "unsealed: one memory, two mappings";
  ASSERT_TRUE((*d)->seal().is_ok());
  EXPECT_DEATH({ [[maybe_unused]] volatile auto b = *reinterpret_cast<volatile std::uint8_t*>(p + 5); },
               "the host touched device memory");
  EXPECT_DEATH(std::memset(p, 0, 16), "the host touched device memory");
  EXPECT_EQ(static_cast<std::uint8_t>((*d)->view(p)[5]), expected);
  // The device's checksum kernel is the shared core: it equals the host's over the same bytes.
  const KvRun runs[] = {{p, 1000, 0}, {p + 3000, 5000, 0}};
  std::vector<std::byte> packed(6000);
  std::memcpy(packed.data(), (*d)->view(p), 1000);
  std::memcpy(packed.data() + 1000, (*d)->view(p + 3000), 5000);
  const Deadline deadline = deadline_after(10s);
  auto on_device = (*d)->segment_sum(runs, false, deadline);
  ASSERT_TRUE(on_device.is_ok());
  const KvRun whole{packed.data(), 6000, 0};
  EXPECT_EQ(*on_device, host_device()->segment_sum({&whole, 1}, false, deadline).value());
  const KvRun outside{p - 8192, 10, 0};
  EXPECT_EQ((*d)->segment_sum({&outside, 1}, false, deadline).status().code(), StatusCode::kInvalidArgument)
      << "outside its memory";
}

INSTANTIATE_TEST_SUITE_P(Transports, KvCacheDeviceTest, ::testing::ValuesIn(lanes()),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_P(KvCacheDeviceTest, StagedSavesAndLoadsNeverTouchDeviceMemoryFromTheHost) {
  auto kva = open(*a_, KvPath::kStaged);
  auto kvb = open(*b_, KvPath::kStaged);
  ASSERT_TRUE(kva && kvb);
  EXPECT_EQ(kva->data_path(), "staged");
  EXPECT_EQ(kva->device().name(), "standin");
  const auto t = tokens(2 * kChunkTokens, 1);
  const auto from = scattered(8, 2), to = scattered(8, 3);
  for (const Status& s : kva->save(t, from, 0, 2)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  const std::uint64_t copied = dev_->copied_bytes();
  EXPECT_EQ(copied, 2 * kva->chunk_bytes()) << "the device gathered every byte saved";
  for (const Status& s : kvb->load(t, to, 2)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(dev_->copied_bytes() - copied, 2 * kvb->chunk_bytes()) << "and scattered every byte loaded";
  EXPECT_TRUE(same_blocks(*a_, from, *b_, to));
}

TEST_P(KvCacheDeviceTest, ASaveStoresTheBytesTheEnginesKernelFinishedWritingAfterSaveLayer) {
  auto kva = open(*a_, KvPath::kStaged);
  auto kvb = open(*b_, KvPath::kStaged);
  ASSERT_TRUE(kva && kvb);
  void* compute = dev_->create_stream();
  void* written = dev_->create_event();
  const auto t = tokens(kChunkTokens, 4);
  const auto from = scattered(4, 5), to = scattered(4, 6);
  const std::size_t layer_bytes = 2ull * kShape.num_blocks * kShape.block_bytes();
  // The engine's "attention kernels": each writes its layer's final bytes 30 ms after it was
  // queued, and save_layer is called at once, ordered by the stream (odd layers: by an event).
  std::vector<std::vector<std::byte>> final_bytes(kShape.num_layers, std::vector<std::byte>(layer_bytes));
  auto save = kva->begin_save(t, from, 0, 1);
  ASSERT_TRUE(save.is_ok()) << save.status().to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    test::fill_random(final_bytes[l], 1000 + l);
    std::byte* layer = dev_->view(a_->ptrs[l]);
    dev_->launch(compute, [&, layer, l] {
      std::this_thread::sleep_for(30ms);
      std::memcpy(layer, final_bytes[l].data(), layer_bytes);
    });
    if (l % 2 == 0) {
      ASSERT_TRUE(save->save_layer(l, KvSync::stream(compute)).is_ok());
    } else {
      dev_->record(written, compute);
      ASSERT_TRUE(save->save_layer(l, KvSync::event(written)).is_ok());
    }
  }
  for (const Status& s : save->wait()) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (const Status& s : kvb->load(t, to, 1)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(same_blocks(*a_, from, *b_, to)) << "the stored bytes are the kernels' final ones";

  // The default (a null stream: the legacy default stream) orders after every blocking stream,
  // so a late kernel's bytes are what is stored even when the caller names no stream.
  std::byte* layer0 = dev_->view(a_->ptrs[0]);
  auto by_default = kva->begin_save(t, from, 0, 1);
  ASSERT_TRUE(by_default.is_ok());
  dev_->launch(compute, [&] {
    std::this_thread::sleep_for(100ms);
    test::fill_random({layer0, layer_bytes}, 76);
  });
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) ASSERT_TRUE(by_default->save_layer(l).is_ok());
  for (const Status& s : by_default->wait()) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (const Status& s : kvb->load(t, to, 1)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(same_blocks(*a_, from, *b_, to)) << "the default stream's save waited for the kernel";

  // KvSync::none() says there is nothing to wait for, and means it: a save that says so while
  // a kernel still writes stores the bytes from before the kernel (the test can tell).
  auto early = kva->begin_save(t, from, 0, 1);
  ASSERT_TRUE(early.is_ok());
  dev_->launch(compute, [&] {
    std::this_thread::sleep_for(300ms);
    test::fill_random({layer0, layer_bytes}, 77);
  });
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    ASSERT_TRUE(early->save_layer(l, KvSync::none()).is_ok());
  for (const Status& s : early->wait()) ASSERT_TRUE(s.is_ok()) << s.to_string();
  dev_->synchronize(compute);
  for (const Status& s : kvb->load(t, to, 1)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_FALSE(same_blocks(*a_, from, *b_, to)) << "an unordered save raced the kernel";
}

TEST_P(KvCacheDeviceTest, ASaveWhoseEngineWorkNeverFinishesFailsAtItsDeadlineAndCancelsAtOnce) {
  auto kva = open(*a_, KvPath::kStaged);
  ASSERT_TRUE(kva);
  // The engine's stream is stuck in a kernel until the test ends.
  void* stuck = dev_->create_stream();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  dev_->launch(stuck, [released] { released.wait(); });
  void* after_stuck = dev_->create_event();
  dev_->record(after_stuck, stuck);
  const auto t = tokens(kChunkTokens, 8);
  auto save = kva->begin_save(t, scattered(4, 9), 0, 1, deadline_after(300ms));
  ASSERT_TRUE(save.is_ok());
  ASSERT_TRUE(save->save_layer(0, KvSync::stream(stuck)).is_ok()) << "queued, not waited for";
  const auto t0 = Clock::now();
  auto st = save->wait();
  EXPECT_EQ(st[0].code(), StatusCode::kTimeout) << st[0].to_string();
  EXPECT_LT(Clock::now() - t0, 5s);
  EXPECT_EQ(kva->contains_prefix(t).value(), 0u);

  auto cancelled = kva->begin_save(t, scattered(4, 9), 0, 1, deadline_after(60s));
  ASSERT_TRUE(cancelled.is_ok());
  ASSERT_TRUE(cancelled->save_layer(0, KvSync::stream(stuck)).is_ok());
  const auto c0 = Clock::now();
  cancelled->cancel();
  EXPECT_LT(Clock::now() - c0, 2s) << "cancel does not wait for the engine's stuck work";
  EXPECT_EQ(cancelled->wait()[0].code(), StatusCode::kCancelled);
  EXPECT_EQ(kva->begin_save(t, scattered(4, 9), 0, 1)->save_layer(0, KvSync::event(nullptr)).code(),
            StatusCode::kInvalidArgument)
      << "an event kind needs an event";
  EXPECT_TRUE(kva->begin_save(t, scattered(4, 9), 0, 1)->save_layer(0, KvSync::event(after_stuck)).is_ok());
  release.set_value();
}

TEST_P(KvCacheDeviceTest, ALoadHandsEachLayerToTheEnginesStreamAsAnEvent) {
  auto kva = open(*a_, KvPath::kStaged);
  auto kvb = open(*b_, KvPath::kStaged);
  ASSERT_TRUE(kva && kvb);
  const auto t = tokens(2 * kChunkTokens, 10);
  const auto from = scattered(8, 11), to = scattered(8, 12);
  for (const Status& s : kva->save(t, from, 0, 2)) ASSERT_TRUE(s.is_ok()) << s.to_string();

  // The engine's "attention" for layer l waits on the load's event for l, on its own stream,
  // and then checks the layer's blocks where they are; the host never waits for the load.
  void* compute = dev_->create_stream();
  std::vector<int> layer_ok(kShape.num_layers, -1);
  auto load = kvb->begin_load(t, to, 2);
  ASSERT_TRUE(load.is_ok()) << load.status().to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    if (l % 2 == 0) {
      auto event = load->layer_event(l);
      ASSERT_TRUE(event.is_ok()) << event.status().to_string();
      dev_->wait_event(compute, *event);
    } else {
      ASSERT_TRUE(load->wait_layer_on(l, compute).is_ok());
    }
    dev_->launch(compute, [&, l] {
      bool ok = true;
      for (std::size_t i = 0; i < from.size(); ++i) {
        for (std::uint32_t p = 0; p < 2; ++p) {
          ok = ok && std::memcmp(dev_->view(a_->block(l, p, from[i])), dev_->view(b_->block(l, p, to[i])),
                                 kShape.block_bytes()) == 0;
        }
      }
      layer_ok[l] = ok ? 1 : 0;
    });
  }
  dev_->synchronize(compute);
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) EXPECT_EQ(layer_ok[l], 1) << "layer " << l;
  for (const Status& s : load->wait()) EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(load->layer_event(kShape.num_layers).status().code(), StatusCode::kInvalidArgument);

  // A chunk that is gone still completes every event: the engine's stream never hangs, and
  // failed_blocks says what to recompute.
  ASSERT_TRUE(store_->remove(kvb->keys(t)[1]).is_ok());
  auto partial = kvb->begin_load(t, to, 2);
  ASSERT_TRUE(partial.is_ok());
  auto last = partial->layer_event(kShape.num_layers - 1);
  ASSERT_TRUE(last.is_ok());
  dev_->wait_event(compute, *last);
  dev_->synchronize(compute);
  EXPECT_EQ(partial->failed_blocks(), std::vector<std::uint32_t>(to.begin() + 4, to.end()));
}

// (a) GPUDirect-style: verbs registers the stand-in before it is sealed, rxe reads and writes
// it, and the only code that reads it is the device's checksum kernel.
TEST_P(KvCacheDeviceTest, OverVerbsTheNicMovesDeviceMemoryAndTheDeviceChecksIt) {
  if (GetParam().transports.front() != TransportKind::kVerbs) {
    GTEST_SKIP() << "only verbs reaches device memory (here: the stand-in); tcp, shm and ucx stage it";
  }
  // Both caches registered before the memory is sealed (registering PROT_NONE memory is EFAULT).
  auto kva = open(*a_, KvPath::kDirect, /*seal=*/false);
  auto kvb = open(*b_, KvPath::kDirect);
  ASSERT_TRUE(kva && kvb);
  EXPECT_EQ(kva->data_path(), "direct");
  const auto t = tokens(2 * kChunkTokens, 21);
  const auto from = scattered(8, 22), to = scattered(8, 23);
  void* compute = dev_->create_stream();
  auto save = kva->begin_save(t, from, 0, 2);
  ASSERT_TRUE(save.is_ok()) << save.status().to_string();
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l)
    ASSERT_TRUE(save->save_layer(l, KvSync::stream(compute)).is_ok());
  for (const Status& s : save->wait()) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(dev_->summed_bytes(), 2 * kva->chunk_bytes()) << "every layer saved was summed on the device";
  auto load = kvb->begin_load(t, to, 2);
  ASSERT_TRUE(load.is_ok());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) ASSERT_TRUE(load->wait_layer_on(l, compute).is_ok());
  dev_->synchronize(compute);
  for (const Status& s : load->wait()) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(dev_->summed_bytes(), 4 * kva->chunk_bytes()) << "and every layer loaded checked there";
  EXPECT_EQ(dev_->copied_bytes(), 0u) << "no staging: the NIC moved the bytes";
  EXPECT_TRUE(same_blocks(*a_, from, *b_, to));

  // One object format: a cache in host memory loads what the device summed (its host checks
  // the device's layer sums), and the device checks what a host cache saved.
  std::vector<Buffer> host_layers;
  std::vector<void*> host_ptrs;
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    host_layers.push_back(Buffer::allocate(2ull * kShape.num_blocks * kShape.block_bytes()).value());
    host_ptrs.push_back(host_layers.back().data());
  }
  auto host = KvCache::open(*store_, KvLayout::per_layer(kShape, host_ptrs).value(),
                            {.model = "m", .chunk_tokens = kChunkTokens});
  ASSERT_TRUE(host.is_ok()) << host.status().to_string();
  for (const Status& s : (*host)->load(t, to, 2)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (std::size_t i = 0; i < from.size(); ++i) {
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        const std::byte* got = host_layers[l].data() + (p * kShape.num_blocks + to[i]) * kShape.block_bytes();
        ASSERT_EQ(std::memcmp(got, dev_->view(a_->block(l, p, from[i])), kShape.block_bytes()), 0)
            << "host load of block " << i << " layer " << l;
      }
    }
  }
  const auto t2 = tokens(kChunkTokens, 24);
  for (const Status& s : (*host)->save(t2, to, 0, 1)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  const std::uint64_t summed = dev_->summed_bytes();
  for (const Status& s : kva->load(t2, from, 1)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(dev_->summed_bytes() - summed, kva->chunk_bytes()) << "the device checked the host's sums";

  // A layer that does not match its checksum fails its chunk, caught on the device: the object
  // is rewritten with layer 2 changed under its old layout (per-layer sums).
  const std::string key = kva->keys(t)[0];
  auto info = store_->stat(key);
  ASSERT_TRUE(info.is_ok());
  std::vector<std::byte> bytes(info->size);
  Slice into{bytes.data(), bytes.size()};
  ASSERT_TRUE(store_->get(key, {&into, 1}).is_ok());
  bytes[2 * (info->size / kShape.num_layers) + 5] ^= std::byte{1};
  Slice from_host{bytes.data(), bytes.size()};
  ASSERT_TRUE(store_->put(key, {&from_host, 1}, {.object_layout = info->object_layout}).is_ok());
  auto bad = kvb->begin_load(t, to, 1);
  ASSERT_TRUE(bad.is_ok());
  EXPECT_TRUE(bad->wait_layer(1).is_ok());
  EXPECT_EQ(bad->wait_layer(2).code(), StatusCode::kCorrupt);
  EXPECT_EQ(bad->wait()[0].code(), StatusCode::kCorrupt);
}

TEST_P(KvCacheDeviceTest, TheDirectPathIsRefusedWhereNoTransportReachesTheDevice) {
  if (GetParam().transports.front() == TransportKind::kVerbs) {
    GTEST_SKIP() << "verbs reaches the stand-in (OverVerbsTheNicMovesDeviceMemoryAndTheDeviceChecksIt)";
  }
  auto layout = KvLayout::per_layer(kShape, a_->ptrs, MemoryKind::kCuda).value();
  auto kv = KvCache::open(*store_, layout, {.model = "m", .chunk_tokens = kChunkTokens},
                          {.device = dev_, .path = KvPath::kDirect});
  ASSERT_FALSE(kv.is_ok());
  EXPECT_NE(kv.status().message().find("registering the KV cache"), std::string::npos)
      << kv.status().to_string();
  // kAuto stages instead.
  auto staged = open(*a_);
  ASSERT_TRUE(staged);
  EXPECT_EQ(staged->data_path(), "staged");
}

}  // namespace
}  // namespace kvstash
