// KvCache end to end: host memory laid out like vLLM's paged cache, saved through a real
// redis-server and kvstashd and loaded back into other blocks of another cache.
#include "kvstash/kvcache.h"

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <thread>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

#include "http_get.h"
#include "kvstash/store.h"
#include "metadata/cell.h"
#include "test_util.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;

// 4 layers, 64 blocks of 16 tokens, 2 heads of 64: 4 KiB blocks; 64-token chunks of 4 blocks.
KvCacheShape small_shape(KvBlockOrder order = KvBlockOrder::kNHD) {
  return {.num_layers = 4,
          .num_blocks = 64,
          .block_size = 16,
          .num_kv_heads = 2,
          .head_dim = 64,
          .dtype = KvDType::kFloat16,
          .order = order};
}

// 8 layers, 48 blocks of 16 tokens, 8 heads of 128: with 256-token chunks, 1 MiB per layer
// and 8 MiB per chunk, which lands in several steps.
KvCacheShape chunked_shape(KvBlockOrder order) {
  return {.num_layers = 8,
          .num_blocks = 48,
          .block_size = 16,
          .num_kv_heads = 8,
          .head_dim = 128,
          .dtype = KvDType::kFloat16,
          .order = order};
}

// One engine's cache: per-layer (2, num_blocks, ...) tensors in host memory.
struct HostCache {
  HostCache(const KvCacheShape& s, std::uint64_t seed) : shape(s) {
    for (std::uint32_t l = 0; l < s.num_layers; ++l) {
      layers.push_back(Buffer::allocate(2 * s.num_blocks * s.block_bytes()).value());
      test::fill_random(layers.back().bytes(), seed + l);
      ptrs.push_back(layers.back().data());
    }
  }
  // The bytes of (layer, part, block).
  std::span<const std::byte> block(std::uint32_t l, std::uint32_t part, std::uint32_t b) const {
    return {layers[l].data() + (part * shape.num_blocks + b) * shape.block_bytes(), shape.block_bytes()};
  }
  KvCacheShape shape;
  std::vector<Buffer> layers;
  std::vector<void*> ptrs;
};

std::vector<std::uint32_t> token_ids(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint32_t> t(n);
  std::mt19937 rng(seed);
  for (auto& x : t) x = rng() % 32000;
  return t;
}

// `n` distinct block ids in random order.
std::vector<std::uint32_t> scattered_blocks(std::size_t n, std::uint32_t num_blocks, std::uint32_t seed) {
  std::vector<std::uint32_t> all(num_blocks);
  std::iota(all.begin(), all.end(), 0u);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(n);
  return all;
}

class KvCacheTest : public ::testing::TestWithParam<KvBlockOrder> {
 protected:
  void SetUp() override {
    auto r = harness::LocalRedis::start({});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    redis_ = std::move(r).value();
    auto n = harness::LocalNode::start({.redis_url = redis_->url(),
                                        .redis_password = redis_->password(),
                                        .capacity = "48MiB",
                                        .page_size = "1MiB",
                                        .node_id = "n1",
                                        .extra_args = {"--huge-pages", "off"}});
    ASSERT_TRUE(n.is_ok()) << n.status().to_string();
    node_ = std::move(n).value();
    StoreOptions o;
    o.redis_url = redis_->url();
    o.redis_password = redis_->password();
    o.engine.prefer = TransportKind::kShm;
    o.timeout = 10s;
    auto s = Store::open(o);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    store_ = std::move(s).value();
  }

  std::unique_ptr<KvCache> open(HostCache& c, std::uint32_t chunk_tokens = 64) {
    auto layout = KvLayout::per_layer(c.shape, c.ptrs);
    EXPECT_TRUE(layout.is_ok()) << layout.status().to_string();
    auto kv = KvCache::open(*store_, std::move(layout).value(),
                            {.model = "test-model", .chunk_tokens = chunk_tokens});
    EXPECT_TRUE(kv.is_ok()) << kv.status().to_string();
    return kv.is_ok() ? std::move(kv).value() : nullptr;
  }

  std::unique_ptr<harness::LocalRedis> redis_;
  std::unique_ptr<harness::LocalNode> node_;
  std::unique_ptr<Store> store_;
};

INSTANTIATE_TEST_SUITE_P(Orders, KvCacheTest, ::testing::Values(KvBlockOrder::kNHD, KvBlockOrder::kHND),
                         [](const auto& info) { return info.param == KvBlockOrder::kNHD ? "NHD" : "HND"; });

TEST_P(KvCacheTest, ScatteredBlocksSaveAndLoadIntoOtherBlocksBitExact) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 100), b(shape, 200);  // b starts with other random bytes: a poison
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(4 * 64 + 10, 1);  // 4 full chunks and a partial one
  const auto blocks_a = scattered_blocks(17, shape.num_blocks, 2);
  const auto blocks_b = scattered_blocks(17, shape.num_blocks, 3);
  EXPECT_EQ(kva->chunk_bytes(), 4u * 2 * 4 * shape.block_bytes());

  EXPECT_EQ(kva->contains_prefix(tokens).value(), 0u);
  auto saved = kva->save(tokens, blocks_a, 0, 4);
  ASSERT_EQ(saved.size(), 4u);
  for (const auto& s : saved) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(kvb->contains_prefix(tokens).value(), 4u)
      << "another cache of the same model and layout finds them";

  const HostCache before_b = HostCache(shape, 200);  // what b held
  auto loaded = kvb->load(tokens, blocks_b, 4);
  for (const auto& s : loaded) ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::vector<bool> touched(shape.num_blocks, false);
  for (std::size_t i = 0; i < 16; ++i) {
    touched[blocks_b[i]] = true;
    for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        auto want = a.block(l, p, blocks_a[i]);
        auto got = b.block(l, p, blocks_b[i]);
        ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size()), 0)
            << "block " << i << " layer " << l << " part " << p;
      }
    }
  }
  // Blocks outside the list, the 17th block included (it holds only the partial chunk), are untouched.
  for (std::uint32_t blk = 0; blk < shape.num_blocks; ++blk) {
    if (touched[blk]) continue;
    for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        ASSERT_EQ(
            std::memcmp(b.block(l, p, blk).data(), before_b.block(l, p, blk).data(), shape.block_bytes()), 0)
            << "block " << blk << " was written though no chunk maps to it";
      }
    }
  }
}

TEST_P(KvCacheTest, AChunkGoneMeanwhileFailsAloneAndEndsThePrefix) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 7);
  auto kv = open(a);
  ASSERT_TRUE(kv);
  const auto tokens = token_ids(4 * 64, 9);
  const auto blocks = scattered_blocks(16, shape.num_blocks, 4);
  for (const auto& s : kv->save(tokens, blocks, 0, 4)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  ASSERT_TRUE(store_->remove(kv->keys(tokens)[2]).is_ok());  // evicted, say
  EXPECT_EQ(kv->contains_prefix(tokens).value(), 2u);
  auto loaded = kv->load(tokens, blocks, 4);
  EXPECT_TRUE(loaded[0].is_ok());
  EXPECT_TRUE(loaded[1].is_ok());
  EXPECT_EQ(loaded[2].code(), StatusCode::kNotFound) << loaded[2].to_string();
  EXPECT_TRUE(loaded[3].is_ok()) << "per-chunk errors: the others still load";
  auto load = kv->begin_load(tokens, blocks, 4);
  ASSERT_TRUE(load.is_ok());
  EXPECT_EQ(load->failed_blocks(), std::vector<std::uint32_t>(blocks.begin() + 8, blocks.begin() + 12))
      << "the blocks to recompute are chunk 2's";
  // Saving only the missing chunk mends the prefix.
  auto again = kv->save(tokens, blocks, 2, 1);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_TRUE(again[0].is_ok()) << again[0].to_string();
  EXPECT_EQ(kv->contains_prefix(tokens).value(), 4u);
}

// The store's own metrics (Store::metrics_text) count what happened: its operations by
// outcome, with their latency, the bytes per transport, and a KvCache's chunks by outcome,
// failed loads (which the engine computes again) included, and its layer waits.
TEST_P(KvCacheTest, TheStoreCountsItsOperationsAndTheCachesChunks) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 7);
  auto kv = open(a);
  ASSERT_TRUE(kv);
  const auto tokens = token_ids(4 * 64, 9);
  const auto blocks = scattered_blocks(16, shape.num_blocks, 4);
  for (const auto& s : kv->save(tokens, blocks, 0, 4)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  ASSERT_TRUE(store_->remove(kv->keys(tokens)[2]).is_ok());
  auto load = kv->begin_load(tokens, blocks, 4);
  ASSERT_TRUE(load.is_ok());
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) (void)load->wait_layer(l);
  auto loaded = load->wait();
  ASSERT_EQ(loaded.size(), 4u);
  std::string data(1000, 'x'), back(1000, '\0');
  Slice in{data.data(), data.size()}, out{back.data(), back.size()};
  ASSERT_TRUE(store_->put("m/one", {&in, 1}).is_ok());
  ASSERT_TRUE(store_->get("m/one", {&out, 1}).is_ok());
  EXPECT_EQ(store_->get("m/none", {&out, 1}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store_->contains_prefix(kv->keys(tokens)).value(), 2u);

  const std::string text = store_->metrics_text();
  EXPECT_EQ(test::metric(text, R"(kvstash_kvcache_chunks_total{op="save",status="ok"})"), 4) << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_kvcache_chunks_total{op="load",status="ok"})"), 3) << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_kvcache_chunks_total{op="load",status="not_found"})"), 1) << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_kvcache_layer_wait_duration_seconds_count)"), shape.num_layers)
      << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_ops_total{op="put",status="ok"})"), 1) << text;
  // The cache's chunk loads are the store's gets too: 3 found and 1 not, and the plain ones.
  EXPECT_EQ(test::metric(text, R"(kvstash_client_ops_total{op="get",status="ok"})"), 4) << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_ops_total{op="get",status="not_found"})"), 2) << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_ops_total{op="remove",status="ok"})"), 1) << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_ops_total{op="lookup",status="ok"})"), 1) << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_ops_total{op="put_stream",status="ok"})"), 4)
      << "the cache's chunk puts, not Store::put's own stream\n"
      << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_op_bytes_total{op="get"})"), 3.0 * kv->chunk_bytes() + 1000)
      << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_op_bytes_total{op="put"})"), 1000) << text;
  // The bytes moved over shm: the 4 chunks and the put written, 3 chunks and the get read.
  EXPECT_EQ(test::metric(text, R"(kvstash_client_transfer_bytes_total{op="write",transport="shm"})"),
            4.0 * kv->chunk_bytes() + 1000)
      << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_transfer_bytes_total{op="read",transport="shm"})"),
            3.0 * kv->chunk_bytes() + 1000)
      << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_transfer_bytes_total{op="read",transport="tcp"})"), 0)
      << text;
  // A histogram as the format has it: cumulative buckets, +Inf the count, a sum.
  EXPECT_NE(text.find("# TYPE kvstash_client_op_duration_seconds histogram\n"), std::string::npos) << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_op_duration_seconds_bucket{op="get",le="+Inf"})"), 6)
      << text;
  EXPECT_EQ(test::metric(text, R"(kvstash_client_op_duration_seconds_count{op="get"})"), 6) << text;
  EXPECT_LE(test::metric(text, R"(kvstash_client_op_duration_seconds_bucket{op="get",le="0.001"})"),
            test::metric(text, R"(kvstash_client_op_duration_seconds_bucket{op="get",le="0.01"})"));
  EXPECT_GT(test::metric(text, R"(kvstash_client_op_duration_seconds_sum{op="get"})"), 0) << text;
}

TEST_P(KvCacheTest, OtherLayoutsAndForeignObjectsNeverLoad) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 11);
  auto kv = open(a);
  ASSERT_TRUE(kv);
  const auto tokens = token_ids(2 * 64, 5);
  const auto blocks = scattered_blocks(8, shape.num_blocks, 6);
  for (const auto& s : kv->save(tokens, blocks, 0, 2)) ASSERT_TRUE(s.is_ok());
  // The other block order, the same model and tokens: other keys, nothing found.
  HostCache other(small_shape(GetParam() == KvBlockOrder::kNHD ? KvBlockOrder::kHND : KvBlockOrder::kNHD),
                  12);
  auto kv_other = open(other);
  ASSERT_TRUE(kv_other);
  EXPECT_EQ(kv_other->contains_prefix(tokens).value(), 0u);
  // Something else stored under a chunk's key: refused, not copied into the cache.
  std::vector<std::byte> junk(1000);
  Slice js{junk.data(), junk.size()};
  ASSERT_TRUE(store_->put(kv->keys(tokens)[1], {&js, 1}).is_ok());
  auto loaded = kv->load(tokens, blocks, 2);
  EXPECT_TRUE(loaded[0].is_ok());
  EXPECT_EQ(loaded[1].code(), StatusCode::kCorrupt) << loaded[1].to_string();
}

TEST_P(KvCacheTest, LayerWiseSaveAndLoadCompleteLayerByLayer) {
  // 8 layers of 1 MiB per 256-token chunk: a chunk's object lands in several steps.
  const KvCacheShape shape = chunked_shape(GetParam());
  HostCache a(shape, 21), b(shape, 22);
  auto kva = open(a, 256), kvb = open(b, 256);
  ASSERT_TRUE(kva && kvb);
  ASSERT_EQ(kva->chunk_bytes(), 8u << 20);
  const auto tokens = token_ids(3 * 256, 4);
  const auto blocks_a = scattered_blocks(48, shape.num_blocks, 8);
  const auto blocks_b = scattered_blocks(48, shape.num_blocks, 9);

  auto save = kva->begin_save(tokens, blocks_a, 0, 3);
  ASSERT_TRUE(save.is_ok()) << save.status().to_string();
  ASSERT_TRUE(save->save_layer(0).is_ok());
  EXPECT_EQ(save->save_layer(2).code(), StatusCode::kInvalidArgument) << "layers go in order";
  for (std::uint32_t l = 1; l < shape.num_layers; ++l) ASSERT_TRUE(save->save_layer(l).is_ok());
  EXPECT_EQ(kva->contains_prefix(tokens).value(), 0u) << "nothing is visible before wait() commits";
  for (const auto& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(kva->contains_prefix(tokens).value(), 3u);

  auto load = kvb->begin_load(tokens, blocks_b, 3);
  ASSERT_TRUE(load.is_ok()) << load.status().to_string();
  // Readiness only ever grows layer by layer: a later layer is never ready before an earlier.
  // Bounded by time, not by a count of polls: a slow machine takes more polls per layer.
  std::vector<int> ready_at(shape.num_layers, -1);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (int step = 0;
       std::count(ready_at.begin(), ready_at.end(), -1) > 0 && std::chrono::steady_clock::now() < give_up;
       ++step) {
    // Latest layer first: a layer seen ready before an earlier one in the same sweep is a
    // real inversion, not the sweep racing the transfer.
    for (std::uint32_t l = shape.num_layers; l-- > 0;) {
      if (ready_at[l] < 0 && load->layer_ready(l)) ready_at[l] = step;
    }
  }
  for (std::uint32_t l = 0; l < shape.num_layers; ++l)
    ASSERT_GE(ready_at[l], 0) << "layer " << l << " never ready";
  for (std::uint32_t l = 1; l < shape.num_layers; ++l) EXPECT_GE(ready_at[l], ready_at[l - 1]) << l;
  std::printf("[ info ] layers first seen ready at poll steps:");
  for (int r : ready_at) std::printf(" %d", r);
  std::printf("\n");
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
    ASSERT_TRUE(load->wait_layer(l).is_ok());
    // Layer l is in place once wait_layer(l) returned, whatever later layers do.
    for (std::size_t i = 0; i < 48; ++i) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        ASSERT_EQ(std::memcmp(a.block(l, p, blocks_a[i]).data(), b.block(l, p, blocks_b[i]).data(),
                              shape.block_bytes()),
                  0);
      }
    }
  }
  for (const auto& st : load->wait()) EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(load->wait_layer(shape.num_layers).code(), StatusCode::kInvalidArgument);
}

TEST_P(KvCacheTest, ALayerThatFailsItsChecksumFailsFromThatLayerOn) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 31), b(shape, 32);
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(2 * 64, 6);
  const auto blocks = scattered_blocks(8, shape.num_blocks, 10);
  for (const auto& st : kva->save(tokens, blocks, 0, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  // Chunk 1 is put back with its layer-2 checksum altered: the bytes no longer match it.
  const std::string key = kva->keys(tokens)[1];
  std::vector<std::byte> bytes(kva->chunk_bytes());
  Slice whole{bytes.data(), bytes.size()};
  auto info = store_->get(key, {&whole, 1});
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  std::string layout = info->object_layout;
  const std::size_t sums = layout.find(";xxh3=") + 6;
  ASSERT_NE(sums, std::string::npos + 6) << layout;
  char& digit = layout[sums + 2 * 17];  // the first hex digit of layer 2's checksum
  digit = digit == '0' ? '1' : '0';
  ASSERT_TRUE(store_->put(key, {&whole, 1}, {.object_layout = layout}).is_ok());

  auto load = kvb->begin_load(tokens, blocks, 2);
  ASSERT_TRUE(load.is_ok());
  EXPECT_TRUE(load->wait_layer(0).is_ok());
  EXPECT_TRUE(load->wait_layer(1).is_ok()) << "layers before the bad one stay usable";
  EXPECT_EQ(load->wait_layer(2).code(), StatusCode::kCorrupt);
  EXPECT_EQ(load->wait_layer(3).code(), StatusCode::kCorrupt);
  auto final = load->wait();
  EXPECT_TRUE(final[0].is_ok()) << "the other chunk loads whole";
  EXPECT_EQ(final[1].code(), StatusCode::kCorrupt) << final[1].to_string();
}

TEST_P(KvCacheTest, AnUnfinishedSaveLeavesNothingBehind) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 41);
  auto kv = open(a);
  ASSERT_TRUE(kv);
  const auto tokens = token_ids(2 * 64, 7);
  const auto blocks = scattered_blocks(8, shape.num_blocks, 11);
  {
    auto save = kv->begin_save(tokens, blocks, 0, 2);
    ASSERT_TRUE(save.is_ok());
    ASSERT_TRUE(save->save_layer(0).is_ok());
    auto st = save->wait();  // 1 of 4 layers
    EXPECT_EQ(st[0].code(), StatusCode::kInvalidArgument);
    auto dropped = kv->begin_save(tokens, blocks, 0, 2);
    ASSERT_TRUE(dropped.is_ok());
    ASSERT_TRUE(dropped->save_layer(0).is_ok());
  }  // `dropped` destroyed midway
  EXPECT_EQ(kv->contains_prefix(tokens).value(), 0u);
  EXPECT_EQ(kv->begin_save(tokens, blocks, 1, 2).status().code(), StatusCode::kInvalidArgument)
      << "chunk 2 has no tokens";
}

// A save names the keys it writes (the connector needs no second derivation of them), and the
// chunks' event data rides in their commits: once the cell's events are on, wait() has each
// chunk's first object logged as stored with its data, and says how many it announced.
TEST_P(KvCacheTest, ASaveNamesItsKeysAndItsCommitAnnouncesItsChunks) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 61);
  auto kv = open(a);
  ASSERT_TRUE(kv);
  const auto tokens = token_ids(3 * 64, 9);
  const auto blocks = scattered_blocks(12, shape.num_blocks, 13);
  const std::vector<std::string> events{"ev-0", "ev-1", "ev-2"};
  EXPECT_EQ(kv->begin_save(tokens, blocks, 0, 3, {}, {}, std::span(events).first(2)).status().code(),
            StatusCode::kInvalidArgument)
      << "one event per chunk";

  auto redis = metadata::RedisClient::connect({.url = redis_->url(), .password = redis_->password()});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  const std::string p = metadata::cell_prefix("default");
  ASSERT_TRUE((*redis)->command({"HSET", p + ":events", "maxlen", "1000"}).is_ok());

  auto save = kv->begin_save(tokens, blocks, 0, 3, {}, {}, events);
  ASSERT_TRUE(save.is_ok()) << save.status().to_string();
  EXPECT_EQ(save->keys(), kv->keys(tokens));
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) ASSERT_TRUE(save->save_layer(l).is_ok());
  for (const auto& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(save->announced(), 3u);

  const auto keys = kv->keys(tokens);
  std::vector<std::string> want, got;
  for (std::size_t c = 0; c < 3; ++c)
    want.push_back("stored " + keys[c * kv->objects_per_chunk()] + " " + events[c]);
  auto log = (*redis)->command({"XRANGE", p + ":events:log", "-", "+"}).value();
  for (std::size_t i = 0; i < log.size(); ++i) {
    const redisReply* f = log.element(i)->element[1];
    got.push_back(std::string(f->element[1]->str) + " " + f->element[3]->str + " " + f->element[5]->str);
  }
  std::ranges::sort(want);
  std::ranges::sort(got);
  EXPECT_EQ(got, want);
}

TEST_P(KvCacheTest, MemoryNoTransportReachesIsStagedThroughBounceBuffers) {
  // A cache the transports cannot register (marked GPU memory; it is host memory here, and
  // the host device copies it), 8 layers, 3 bounce slots per chunk. tests/gpu/kvcache_device_test.cc
  // runs the same through a device whose memory the host cannot touch.
  const KvCacheShape shape = chunked_shape(GetParam());
  HostCache dev_a(shape, 51), dev_b(shape, 52), host_c(shape, 53);
  auto layout_a = KvLayout::per_layer(shape, dev_a.ptrs, MemoryKind::kCuda).value();
  // No transport registers it and no GPU owns it, so staging on its GPU is refused too, and
  // the error says both; asked for the direct path only, the error is the transports'.
  auto refused = KvCache::open(*store_, layout_a, {.model = "test-model", .chunk_tokens = 256});
  ASSERT_FALSE(refused.is_ok());
  const std::string why = refused.status().message();
  EXPECT_NE(why.find("no transport reaches this GPU memory"), std::string::npos) << why;
  EXPECT_NE(why.find("KvCacheOptions::device"), std::string::npos) << why;
  EXPECT_NE(why.find("host memory"), std::string::npos) << "the transport's reason: " << why;
  auto direct_only = KvCache::open(*store_, layout_a, {.model = "test-model", .chunk_tokens = 256},
                                   {.path = KvPath::kDirect});
  ASSERT_FALSE(direct_only.is_ok());
  EXPECT_EQ(direct_only.status().message().find("no transport reaches"), std::string::npos)
      << direct_only.status().to_string();
  EXPECT_NE(direct_only.status().message().find("registering the KV cache"), std::string::npos)
      << direct_only.status().to_string();

  auto kva = KvCache::open(*store_, layout_a, {.model = "test-model", .chunk_tokens = 256},
                           {.device = host_device(), .bounce_slots = 3});
  ASSERT_TRUE(kva.is_ok()) << kva.status().to_string();
  EXPECT_EQ((*kva)->data_path(), "staged");
  EXPECT_EQ((*kva)->device().name(), "host");
  auto kvb = KvCache::open(*store_, KvLayout::per_layer(shape, dev_b.ptrs, MemoryKind::kCuda).value(),
                           {.model = "test-model", .chunk_tokens = 256},
                           {.device = host_device(), .bounce_slots = 1});
  ASSERT_TRUE(kvb.is_ok()) << kvb.status().to_string();
  auto kvc = open(host_c, 256);  // a direct cache reads what a staged one wrote: one object format
  ASSERT_TRUE(kvc);
  EXPECT_EQ(kvc->data_path(), "direct");

  const auto tokens = token_ids(2 * 256, 12);
  const auto blocks_a = scattered_blocks(32, shape.num_blocks, 13);
  const auto blocks_b = scattered_blocks(32, shape.num_blocks, 14);
  auto save = (*kva)->begin_save(tokens, blocks_a, 0, 2);
  ASSERT_TRUE(save.is_ok());
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) ASSERT_TRUE(save->save_layer(l).is_ok());
  for (const auto& st : save->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();

  auto check = [&](const HostCache& into, const std::vector<std::uint32_t>& blocks, const char* who) {
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
        for (std::uint32_t p = 0; p < 2; ++p) {
          ASSERT_EQ(std::memcmp(dev_a.block(l, p, blocks_a[i]).data(), into.block(l, p, blocks[i]).data(),
                                shape.block_bytes()),
                    0)
              << who << " block " << i << " layer " << l;
        }
      }
    }
  };
  auto load = (*kvb)->begin_load(tokens, blocks_b, 2);
  ASSERT_TRUE(load.is_ok());
  for (std::uint32_t l = 0; l < shape.num_layers; ++l) ASSERT_TRUE(load->wait_layer(l).is_ok()) << l;
  for (const auto& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  check(dev_b, blocks_b, "staged load");
  for (const auto& st : kvc->load(tokens, blocks_b, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  check(host_c, blocks_b, "direct load");
  const std::string cold = store_->metrics_text();
  EXPECT_GT(test::metric(cold, R"(kvstash_kvcache_bounce_takes_total{from="new"})"), 0) << cold;
  // And again: the bounce buffers come back from their pools.
  for (const auto& st : (*kva)->save(tokens, blocks_a, 0, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const auto& st : (*kvb)->load(tokens, blocks_b, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  check(dev_b, blocks_b, "second staged load");
  // A pool grows to the most buffers its cache had in use at once (here by the second round)
  // and no further: a third round takes every buffer from the pools.
  const std::string warm = store_->metrics_text();
  for (const auto& st : (*kva)->save(tokens, blocks_a, 0, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const auto& st : (*kvb)->load(tokens, blocks_b, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  const std::string third = store_->metrics_text();
  EXPECT_EQ(test::metric(third, R"(kvstash_kvcache_bounce_takes_total{from="new"})"),
            test::metric(warm, R"(kvstash_kvcache_bounce_takes_total{from="new"})"))
      << third;
  EXPECT_EQ(test::metric(third, "kvstash_kvcache_bounce_bytes_total"),
            test::metric(warm, "kvstash_kvcache_bounce_bytes_total"));
  EXPECT_GT(test::metric(third, R"(kvstash_kvcache_bounce_takes_total{from="pool"})"),
            test::metric(warm, R"(kvstash_kvcache_bounce_takes_total{from="pool"})"))
      << third;
}

TEST_P(KvCacheTest, ALoadCanStartAfterTheChunksTheEngineHolds) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 91), b(shape, 92);
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(3 * 64, 93);
  const auto blocks_a = scattered_blocks(12, shape.num_blocks, 94);
  const auto blocks_b = scattered_blocks(12, shape.num_blocks, 95);
  for (const auto& st : kva->save(tokens, blocks_a, 0, 3)) ASSERT_TRUE(st.is_ok());
  const HostCache before(shape, 92);                          // what b held: the same seed
  auto load = kvb->begin_load_range(tokens, blocks_b, 1, 2);  // chunks 1 and 2
  ASSERT_TRUE(load.is_ok());
  const auto statuses = load->wait();
  ASSERT_EQ(statuses.size(), 2u);
  for (const auto& st : statuses) EXPECT_TRUE(st.is_ok()) << st.to_string();
  for (std::size_t i = 0; i < 12; ++i) {
    for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        const auto& want = i < 4 ? before.block(l, p, blocks_b[i]) : a.block(l, p, blocks_a[i]);
        ASSERT_EQ(std::memcmp(want.data(), b.block(l, p, blocks_b[i]).data(), shape.block_bytes()), 0)
            << (i < 4 ? "chunk 0 is not loaded" : "chunks 1-2 land") << ": block " << i;
      }
    }
  }
  EXPECT_EQ(kvb->begin_load_range(tokens, blocks_b, 2, 2).status().code(), StatusCode::kInvalidArgument)
      << "chunk 3 has no tokens";
}

// Under turn-ttl a request's saves and loads carry its lookup's KvKeep: each object's use names
// its chunk's class (the request's turn, counted along the chain) and counts from the lookup.
TEST_P(KvCacheTest, TurnTtlUsesCarryTheRequestsTurnAndLookupClock) {
  auto cell = metadata::Cell::open({.redis = {.url = redis_->url(), .password = redis_->password()}});
  ASSERT_TRUE(cell.is_ok()) << cell.status().to_string();
  ASSERT_TRUE((*cell)->admin().set_policy("turn-ttl").is_ok());
  auto& redis = (*cell)->redis();
  const std::string p = (*cell)->admin().prefix();
  const auto turn_of = [&](const std::string& key) {
    auto r = redis.command({"HGET", p + ":obj:" + key, "turn"});
    return r.is_ok() && !r->is_nil() ? std::string(r->str()) : std::string("none");
  };
  const auto due_of = [&](const std::string& key) {
    auto r = redis.command({"ZSCORE", p + ":ttl:due", key});
    return r.is_ok() && !r->is_nil() ? std::stod(std::string(r->str())) : -1.0;
  };

  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 61), b(shape, 62);
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(5 * 64, 63);
  const KvTokens first = KvTokens(tokens).first(3 * 64);
  const auto blocks_a = scattered_blocks(20, shape.num_blocks, 64);
  const auto blocks_b = scattered_blocks(20, shape.num_blocks, 65);

  // The conversation's first turn: 3 chunks, none stored.
  auto one = kva->lookup_prefix(first);
  ASSERT_TRUE(one.is_ok()) << one.status().to_string();
  EXPECT_EQ(one->chunks, 0u);
  EXPECT_EQ(one->keep.turn, 1u);
  EXPECT_EQ(one->keep.chunks, 3u);
  EXPECT_GT(one->keep.looked_up, 0) << "the cell's turn-ttl clock";
  for (const auto& st : kva->save(first, blocks_a, 0, 3, {}, one->keep))
    ASSERT_TRUE(st.is_ok()) << st.to_string();

  // The next turn, on another cache: the 3 chunks load, 2 more are saved.
  auto two = kvb->lookup_prefix(tokens);
  ASSERT_TRUE(two.is_ok()) << two.status().to_string();
  EXPECT_EQ(two->chunks, 3u);
  EXPECT_EQ(two->keep.turn, 2u) << "one more than the turn of the last chunk found";
  EXPECT_GT(two->keep.looked_up, one->keep.looked_up);
  auto load = kvb->begin_load(tokens, blocks_b, 3, {}, {}, two->keep);
  ASSERT_TRUE(load.is_ok()) << load.status().to_string();
  for (const auto& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const auto& st : kvb->save(tokens, blocks_b, 3, 2, {}, two->keep))
    ASSERT_TRUE(st.is_ok()) << st.to_string();

  const auto keys = kvb->keys(tokens);
  ASSERT_EQ(keys.size(), 5u);
  for (std::size_t c = 0; c < 5; ++c) {
    EXPECT_EQ(turn_of(keys[c]), c < 3 ? "1" : "2") << "chunk " << c << "'s record names its putter's turn";
    // Every use of the second request, the loads as the saves, counts from its lookup: chunk c
    // is due c microseconds of the cell's clock before it.
    EXPECT_NEAR(due_of(keys[c]), two->keep.looked_up - 1e-6 * static_cast<double>(c), 1e-7) << "chunk " << c;
  }
  ASSERT_TRUE((*cell)->admin().set_policy("lru").is_ok());
}

TEST_P(KvCacheTest, ACancelledLoadStopsWritingAndReportsWhatDidNotLand) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 61), b(shape, 62);
  auto kva = open(a), kvb = open(b);
  ASSERT_TRUE(kva && kvb);
  const auto tokens = token_ids(16 * 64, 63);  // 16 chunks of 4 blocks: every block of the cache
  const auto blocks_a = scattered_blocks(64, shape.num_blocks, 64);
  const auto blocks_b = scattered_blocks(64, shape.num_blocks, 65);
  for (const auto& st : kva->save(tokens, blocks_a, 0, 16)) ASSERT_TRUE(st.is_ok()) << st.to_string();

  auto load = kvb->begin_load(tokens, blocks_b, 16);
  ASSERT_TRUE(load.is_ok());
  load->cancel();  // 4 loader threads: most chunks are still queued
  std::vector<std::vector<std::byte>> after;
  for (const auto& l : b.layers) after.emplace_back(l.data(), l.data() + l.size());
  std::this_thread::sleep_for(100ms);
  for (std::size_t l = 0; l < b.layers.size(); ++l) {
    ASSERT_EQ(std::memcmp(after[l].data(), b.layers[l].data(), after[l].size()), 0)
        << "layer " << l << " changed after cancel() returned";
  }
  const auto statuses = load->wait();
  std::size_t cancelled = 0;
  for (std::size_t c = 0; c < statuses.size(); ++c) {
    if (statuses[c].code() == StatusCode::kCancelled) {
      ++cancelled;
      continue;
    }
    ASSERT_TRUE(statuses[c].is_ok()) << statuses[c].to_string();
    for (std::size_t i = c * 4; i < c * 4 + 4; ++i) {  // a chunk reported landed is whole
      for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
        ASSERT_EQ(std::memcmp(a.block(l, 0, blocks_a[i]).data(), b.block(l, 0, blocks_b[i]).data(),
                              shape.block_bytes()),
                  0);
      }
    }
  }
  EXPECT_GT(cancelled, 0u) << "queued chunks never start once cancelled";
  if (cancelled > 0) {
    EXPECT_EQ(load->wait_layer(0).code(), StatusCode::kCancelled);
  }
  // The store still serves: a fresh load lands everything.
  for (const auto& st : kvb->load(tokens, blocks_b, 16)) EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST_P(KvCacheTest, ACancelledSaveLeavesNothingAndFreesItsPages) {
  const KvCacheShape shape = chunked_shape(GetParam());
  HostCache a(shape, 71);
  auto kva = open(a, 256);
  ASSERT_TRUE(kva);
  const auto tokens = token_ids(2 * 256, 72);
  const auto blocks = scattered_blocks(32, shape.num_blocks, 73);
  for (int round = 0; round < 3; ++round) {  // 16 MiB reserved each round, 48 MiB in the node
    auto save = kva->begin_save(tokens, blocks, 0, 2);
    ASSERT_TRUE(save.is_ok());
    for (std::uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(save->save_layer(l).is_ok());
    save->cancel();
    EXPECT_EQ(save->save_layer(4).code(), StatusCode::kCancelled);
    for (const auto& st : save->wait()) EXPECT_EQ(st.code(), StatusCode::kCancelled) << st.to_string();
    EXPECT_EQ(kva->contains_prefix(tokens).value(), 0u);
  }
  for (const auto& st : kva->save(tokens, blocks, 0, 2)) EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(kva->contains_prefix(tokens).value(), 2u);
}

TEST_P(KvCacheTest, ACancelTokenStopsAStoreGet) {
  std::vector<std::byte> data(8u << 20), into(8u << 20, std::byte{0x5a});
  test::fill_random(data, 81);
  Slice in{data.data(), data.size()}, out{into.data(), into.size()};
  ASSERT_TRUE(store_->put("cancel/obj", {&in, 1}).is_ok());
  auto token = CancelToken::make();
  token.cancel();
  auto got = store_->get("cancel/obj", {&out, 1}, {.cancel = token});
  EXPECT_EQ(got.status().code(), StatusCode::kCancelled);
  EXPECT_TRUE(std::all_of(into.begin(), into.end(), [](std::byte x) { return x == std::byte{0x5a}; }))
      << "a get cancelled before it started touches nothing";
  // Cancelled from another thread while it runs: it ends cancelled or whole, never torn.
  for (int i = 0; i < 5; ++i) {
    auto live = CancelToken::make();
    std::thread canceller([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(300 * i));
      live.cancel();
    });
    auto r = store_->get("cancel/obj", {&out, 1}, {.cancel = live});
    canceller.join();
    if (r.is_ok()) {
      EXPECT_EQ(std::memcmp(into.data(), data.data(), data.size()), 0);
    } else {
      EXPECT_EQ(r.status().code(), StatusCode::kCancelled) << r.status().to_string();
    }
  }
  EXPECT_FALSE(CancelToken{}.cancelled()) << "a default token cancels nothing";
}

TEST_P(KvCacheTest, BadInputIsRefusedPerChunk) {
  const KvCacheShape shape = small_shape(GetParam());
  HostCache a(shape, 13);
  const auto tokens = token_ids(2 * 64, 5);
  auto kv = open(a);
  ASSERT_TRUE(kv);
  const auto blocks = scattered_blocks(8, shape.num_blocks, 6);
  auto r = kv->save(tokens, blocks, 1, 2);  // chunk 2 does not exist
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].code(), StatusCode::kInvalidArgument);
  r = kv->load(tokens, std::span(blocks).first(5), 2);  // 5 blocks cannot hold 2 chunks of 4
  EXPECT_EQ(r[1].code(), StatusCode::kInvalidArgument);
  std::vector<std::uint32_t> out_of_range = blocks;
  out_of_range[6] = shape.num_blocks;
  r = kv->save(tokens, out_of_range, 0, 2);
  EXPECT_TRUE(r[0].is_ok()) << "chunk 0 is fine";
  EXPECT_EQ(r[1].code(), StatusCode::kInvalidArgument);
  auto layout = KvLayout::per_layer(shape, a.ptrs).value();
  EXPECT_EQ(KvCache::open(*store_, layout, {.model = "m", .chunk_tokens = 24}).status().code(),
            StatusCode::kInvalidArgument)
      << "not a multiple of the block size";
  EXPECT_EQ(KvCache::open(*store_, layout, {.model = ""}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KvCache::open(*store_, layout, {.model = "m", .tp_rank = 2, .tp_size = 2}).status().code(),
            StatusCode::kInvalidArgument);
}

// The bytes of one head of one token of (layer, part, block), in either block order.
std::span<const std::byte> head_of(const HostCache& c, std::uint32_t l, std::uint32_t part, std::uint32_t b,
                                   std::uint32_t token, std::uint32_t head) {
  const KvCacheShape& s = c.shape;
  const std::size_t hb = std::size_t{s.head_dim} * dtype_bytes(s.dtype);
  const std::size_t at = s.order == KvBlockOrder::kNHD ? (token * s.num_kv_heads + head) * hb
                                                       : (head * s.block_size + token) * hb;
  return c.block(l, part, b).subspan(at, hb);
}

// Whether heads [to_first, +heads) of `to`'s blocks equal heads [from_first, +heads) of
// `from`'s, block for block (as many blocks as both lists have).
::testing::AssertionResult same_heads(const HostCache& from, const std::vector<std::uint32_t>& from_blocks,
                                      const HostCache& to, const std::vector<std::uint32_t>& to_blocks,
                                      std::uint32_t from_first, std::uint32_t to_first, std::uint32_t heads) {
  for (std::size_t i = 0; i < std::min(from_blocks.size(), to_blocks.size()); ++i) {
    for (std::uint32_t l = 0; l < to.shape.num_layers; ++l) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        for (std::uint32_t t = 0; t < to.shape.block_size; ++t) {
          for (std::uint32_t h = 0; h < heads; ++h) {
            auto want = head_of(from, l, p, from_blocks[i], t, from_first + h);
            auto got = head_of(to, l, p, to_blocks[i], t, to_first + h);
            if (std::memcmp(want.data(), got.data(), want.size()) != 0) {
              return ::testing::AssertionFailure() << "block " << i << " layer " << l << " part " << p
                                                   << " token " << t << " head " << to_first + h;
            }
          }
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

TEST_P(KvCacheTest, KeysByHeadsAreReadAtAnyTensorParallelDegree) {
  // A model of 4 KV heads: one engine at TP=1 holds all 4 in its blocks, one at TP=2 holds 2
  // per rank, one at TP=4 one per rank. Keys by heads, one head per object.
  KvCacheShape whole = small_shape(GetParam());
  whole.num_kv_heads = 4;
  auto of_degree = [&](std::uint32_t tp) {
    KvCacheShape s = whole;
    s.num_kv_heads = 4 / tp;
    return s;
  };
  auto open_rank = [&](HostCache& c, std::uint32_t first, std::uint32_t per_object = 1) {
    auto kv = KvCache::open(*store_, KvLayout::per_layer(c.shape, c.ptrs).value(),
                            {.model = "test-model",
                             .chunk_tokens = 64,
                             .heads_total = 4,
                             .head_first = first,
                             .head_count = per_object});
    EXPECT_TRUE(kv.is_ok()) << kv.status().to_string();
    return kv.is_ok() ? std::move(kv).value() : nullptr;
  };
  HostCache tp1(whole, 300);
  HostCache tp2_0(of_degree(2), 310), tp2_1(of_degree(2), 311);
  HostCache tp4_3(of_degree(4), 323);
  auto kv1 = open_rank(tp1, 0);
  auto kv2_0 = open_rank(tp2_0, 0), kv2_1 = open_rank(tp2_1, 2);
  auto kv4_3 = open_rank(tp4_3, 3);
  ASSERT_TRUE(kv1 && kv2_0 && kv2_1 && kv4_3);
  EXPECT_EQ(kv1->objects_per_chunk(), 4u);
  EXPECT_EQ(kv2_1->objects_per_chunk(), 2u);
  EXPECT_EQ(kv1->chunk_bytes(), kv4_3->chunk_bytes()) << "an object is one head at every degree";
  EXPECT_EQ(kv1->key_options().layout_tag, kv2_0->key_options().layout_tag)
      << "an object's tag names its heads";

  const auto tokens = token_ids(3 * 64, 30);
  const auto keys = kv1->keys(tokens);
  ASSERT_EQ(keys.size(), 12u);
  EXPECT_TRUE(keys[1].ends_with(":h1+1/4")) << keys[1];
  EXPECT_EQ(kv2_1->keys(tokens)[1], keys[3]) << "rank 1 of 2 holds heads 2 and 3: the same objects";
  EXPECT_EQ(kv4_3->keys(tokens)[2], keys[11]);

  // Saved at TP=1, read at TP=2 and TP=4: each rank gets exactly its heads.
  const auto blocks_1 = scattered_blocks(12, whole.num_blocks, 31);
  for (const auto& s : kv1->save(tokens, blocks_1, 0, 3)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(kv2_1->contains_prefix(tokens).value(), 3u);
  const auto blocks_2 = scattered_blocks(12, whole.num_blocks, 32);
  for (auto* kv : {kv2_0.get(), kv2_1.get(), kv4_3.get()}) {
    for (const auto& s : kv->load(tokens, blocks_2, 3)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  }
  EXPECT_TRUE(same_heads(tp1, blocks_1, tp2_0, blocks_2, 0, 0, 2));
  EXPECT_TRUE(same_heads(tp1, blocks_1, tp2_1, blocks_2, 2, 0, 2));
  EXPECT_TRUE(same_heads(tp1, blocks_1, tp4_3, blocks_2, 3, 0, 1));

  // Saved at TP=2 (other tokens, each rank its own bytes), read at TP=1, layer by layer.
  const auto other = token_ids(2 * 64, 33);
  const auto blocks_3 = scattered_blocks(8, whole.num_blocks, 34);
  for (auto* kv : {kv2_0.get(), kv2_1.get()}) {
    for (const auto& s : kv->save(other, blocks_3, 0, 2)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  }
  HostCache tp1_b(whole, 340);
  auto kv1_b = open_rank(tp1_b, 0);
  EXPECT_EQ(kv1_b->contains_prefix(other).value(), 2u);
  auto load = kv1_b->begin_load(other, blocks_1, 2);
  ASSERT_TRUE(load.is_ok()) << load.status().to_string();
  for (std::uint32_t l = 0; l < whole.num_layers; ++l) ASSERT_TRUE(load->wait_layer(l).is_ok()) << l;
  for (const auto& s : load->wait()) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(same_heads(tp2_0, blocks_3, tp1_b, blocks_1, 0, 0, 2));
  EXPECT_TRUE(same_heads(tp2_1, blocks_3, tp1_b, blocks_1, 0, 2, 2));
  // The same through host bounce buffers (the staged path a GPU cache takes): the device
  // gathers and scatters each object's runs of heads.
  HostCache staged(whole, 341);
  auto kv_staged = KvCache::open(
      *store_, KvLayout::per_layer(staged.shape, staged.ptrs, MemoryKind::kCuda).value(),
      {.model = "test-model", .chunk_tokens = 64, .heads_total = 4, .head_first = 0, .head_count = 1},
      {.device = host_device(), .path = KvPath::kStaged});
  ASSERT_TRUE(kv_staged.is_ok()) << kv_staged.status().to_string();
  EXPECT_EQ((*kv_staged)->data_path(), "staged");
  for (const auto& s : (*kv_staged)->load(other, blocks_2, 2)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(same_heads(tp2_0, blocks_3, staged, blocks_2, 0, 0, 2));
  EXPECT_TRUE(same_heads(tp2_1, blocks_3, staged, blocks_2, 0, 2, 2));
  const auto staged_tokens = token_ids(64, 37);
  for (const auto& s : (*kv_staged)->save(staged_tokens, blocks_2, 0, 1))
    ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (const auto& s : kv2_1->load(staged_tokens, blocks_3, 1)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  const std::vector<std::uint32_t> chunk_2(blocks_2.begin(), blocks_2.begin() + 4);
  EXPECT_TRUE(same_heads(staged, chunk_2, tp2_1, blocks_3, 2, 0, 2))
      << "a staged save's heads 2 and 3, at rank 1";

  // A chunk is whole only with every head: rank 1 of 2 saving alone is no hit at TP=1, and
  // a load of it fails whole, naming all its blocks for recompute.
  const auto half = token_ids(64, 35);
  for (const auto& s : kv2_1->save(half, blocks_3, 0, 1)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(kv1_b->contains_prefix(half).value(), 0u);
  auto partial = kv1_b->begin_load(half, blocks_1, 1);
  ASSERT_TRUE(partial.is_ok());
  auto st = partial->wait();
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].code(), StatusCode::kNotFound) << st[0].to_string();
  EXPECT_EQ(partial->failed_blocks(), std::vector<std::uint32_t>(blocks_1.begin(), blocks_1.begin() + 4));
  const auto objects = partial->object_statuses();
  ASSERT_EQ(objects.size(), 4u) << "a chunk of 4 heads, one per object";
  for (std::size_t h = 0; h < 4; ++h)
    EXPECT_EQ(objects[h].code(), h < 2 ? StatusCode::kNotFound : StatusCode::kOk) << "head " << h;

  // Keys by rank: a TP=2 rank's chunks are nothing to a TP=1 reader.
  auto by_rank = KvCache::open(*store_, KvLayout::per_layer(tp2_0.shape, tp2_0.ptrs).value(),
                               {.model = "test-model", .tp_rank = 0, .tp_size = 2, .chunk_tokens = 64});
  ASSERT_TRUE(by_rank.is_ok());
  const auto ranked = token_ids(64, 36);
  for (const auto& s : (*by_rank)->save(ranked, blocks_3, 0, 1)) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ((*by_rank)->contains_prefix(ranked).value(), 1u);
  EXPECT_EQ(kv1_b->contains_prefix(ranked).value(), 0u);

  // Heads that do not fit are refused by name.
  auto refused = [&](const HostCache& c, PrefixKeyOptions o) {
    o.model = "test-model";
    o.chunk_tokens = 64;
    return KvCache::open(*store_, KvLayout::per_layer(c.shape, c.ptrs).value(), o).status();
  };
  EXPECT_EQ(refused(tp2_0, {.heads_total = 4, .head_first = 0, .head_count = 3}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(refused(tp2_0, {.heads_total = 4, .head_first = 3, .head_count = 1}).code(),
            StatusCode::kInvalidArgument)
      << "heads 3 and 4 of a model of 4";
  EXPECT_EQ(
      refused(tp2_0, {.tp_rank = 1, .tp_size = 2, .heads_total = 4, .head_first = 2, .head_count = 1}).code(),
      StatusCode::kInvalidArgument)
      << "a key by heads names no rank";
  EXPECT_EQ(refused(tp2_0, {.head_first = 2, .head_count = 1}).code(), StatusCode::kInvalidArgument);
}

TEST_P(KvCacheTest, AHybridModelsGroupsShareOneChainAndNameTheirLayout) {
  // Two KV-cache groups of a hybrid model (a window's layers and full attention's), each a
  // cache of its own layers: one chain, keys whose ends name the group and its layout.
  KvCacheShape shape = small_shape(GetParam());
  HostCache full(shape, 500), window(shape, 501), full_r(shape, 502), window_r(shape, 503);
  auto open_group = [&](HostCache& c, const std::string& group) {
    auto kv = KvCache::open(*store_, KvLayout::per_layer(c.shape, c.ptrs).value(),
                            {.model = "test-model", .chunk_tokens = 64, .group = group});
    EXPECT_TRUE(kv.is_ok()) << kv.status().to_string();
    return kv.is_ok() ? std::move(kv).value() : nullptr;
  };
  auto kf = open_group(full, "full.0a"), kw = open_group(window, "swa128.0b");
  auto rf = open_group(full_r, "full.0a"), rw = open_group(window_r, "swa128.0b");
  ASSERT_TRUE(kf && kw && rf && rw);
  const auto tokens = token_ids(2 * 64, 50);
  const auto f = kf->keys(tokens), w = kw->keys(tokens);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[1].substr(0, f[1].find(":g")), w[1].substr(0, w[1].find(":g")))
      << "every group's object of a chunk is one chain's: one cell, one lookup";
  EXPECT_TRUE(w[1].find(":gswa128.0b.") != std::string::npos) << w[1];
  EXPECT_NE(f[1], w[1]);
  EXPECT_EQ(prefix_chunk_keys(tokens, {.model = "test-model",
                                       .layout_tag = kw->key_options().layout_tag,
                                       .chunk_tokens = 64,
                                       .group = "swa128.0b"})[1],
            w[1])
      << "a scheduler computes a group's keys without its cache";
  auto other_layout = prefix_chunk_keys(tokens, {.model = "test-model",
                                                 .layout_tag = kw->key_options().layout_tag + "x",
                                                 .chunk_tokens = 64,
                                                 .group = "swa128.0b"});
  EXPECT_NE(other_layout[1], w[1]) << "the key's end names the group's layout";

  // The window group saves its second chunk only (its first is out of every window); each
  // group loads what it saved, into its own layers.
  const auto blocks_a = scattered_blocks(8, shape.num_blocks, 51),
             blocks_b = scattered_blocks(8, shape.num_blocks, 52);
  for (const auto& st : kf->save(tokens, blocks_a, 0, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const auto& st : kw->save(tokens, blocks_a, 1, 1)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(store_->contains_each(std::vector<std::string>{f[0], w[0], f[1], w[1]}).value(),
            (std::vector<bool>{true, false, true, true}));
  for (const auto& st : rf->load(tokens, blocks_b, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  auto load = rw->begin_load_range(tokens, blocks_b, 1, 1);
  ASSERT_TRUE(load.is_ok()) << load.status().to_string();
  for (const auto& st : load->wait()) ASSERT_TRUE(st.is_ok()) << st.to_string();
  const std::size_t per = 64 / shape.block_size;
  EXPECT_TRUE(same_heads(full, blocks_a, full_r, blocks_b, 0, 0, shape.num_kv_heads))
      << "the full group's chunks";
  EXPECT_TRUE(same_heads(window, {blocks_a.begin() + per, blocks_a.end()}, window_r,
                         {blocks_b.begin() + per, blocks_b.end()}, 0, 0, shape.num_kv_heads))
      << "the window's chunk";
  EXPECT_FALSE(same_heads(window, blocks_a, window_r, blocks_b, 0, 0, shape.num_kv_heads))
      << "the window's first chunk was neither saved nor loaded";
  EXPECT_EQ(KvCache::open(*store_, KvLayout::per_layer(shape, full.ptrs).value(),
                          {.model = "test-model", .chunk_tokens = 64, .group = "full:0"})
                .status()
                .code(),
            StatusCode::kInvalidArgument)
      << "a group's name cannot forge another key end";
}

TEST_P(KvCacheTest, PipelineStagesStoreTheirOwnLayersUnderOneChain) {
  // A model of 4 layers and 2 KV heads in two pipeline stages of 2 layers each, keys by heads.
  KvCacheShape stage = small_shape(GetParam());
  stage.num_layers = 2;
  auto open_stage = [&](HostCache& c, std::uint32_t first) {
    auto kv = KvCache::open(*store_, KvLayout::per_layer(c.shape, c.ptrs).value(),
                            {.model = "test-model",
                             .chunk_tokens = 64,
                             .heads_total = 2,
                             .head_first = 0,
                             .head_count = 1,
                             .layers_total = 4,
                             .layer_first = first});
    EXPECT_TRUE(kv.is_ok()) << kv.status().to_string();
    return kv.is_ok() ? std::move(kv).value() : nullptr;
  };
  HostCache s0(stage, 400), s1(stage, 401), r0(stage, 402), r1(stage, 403);
  auto kv0 = open_stage(s0, 0), kv1 = open_stage(s1, 2), kr0 = open_stage(r0, 0), kr1 = open_stage(r1, 2);
  ASSERT_TRUE(kv0 && kv1 && kr0 && kr1);
  const auto tokens = token_ids(2 * 64, 40);
  const auto k0 = kv0->keys(tokens), k1 = kv1->keys(tokens);
  ASSERT_EQ(k0.size(), 4u);
  EXPECT_TRUE(k0[1].ends_with(":l0+2/4:h1+1/2")) << k0[1];
  EXPECT_TRUE(k1[1].ends_with(":l2+2/4:h1+1/2")) << k1[1];
  EXPECT_EQ(k0[1].substr(0, k0[1].find(":l")), k1[1].substr(0, k1[1].find(":l")))
      << "both stages' objects of a chunk are one chain's: one cell, one lookup";
  EXPECT_EQ(prefix_chunk_keys(tokens, {.model = "test-model",
                                       .layout_tag = kv1->key_options().layout_tag,
                                       .chunk_tokens = 64,
                                       .heads_total = 2,
                                       .head_first = 1,
                                       .head_count = 1,
                                       .layers_total = 4,
                                       .layer_first = 2,
                                       .layer_count = 2})[0],
            k1[1])
      << "a scheduler computes a stage's keys without its cache";

  const auto blocks_a = scattered_blocks(8, stage.num_blocks, 41),
             blocks_b = scattered_blocks(8, stage.num_blocks, 42);
  for (auto* kv : {kv0.get(), kv1.get()}) {
    for (const auto& st : kv->save(tokens, blocks_a, 0, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  std::vector<std::string> both;  // chunk by chunk, every object of every stage
  for (std::size_t c = 0; c < 2; ++c) {
    for (const auto* k : {&k0, &k1}) both.insert(both.end(), k->begin() + 2 * c, k->begin() + 2 * c + 2);
  }
  EXPECT_EQ(store_->contains_prefix(both).value(), 8u);
  for (const auto& st : kr1->load(tokens, blocks_b, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const auto& st : kr0->load(tokens, blocks_b, 2)) ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_TRUE(same_heads(s0, blocks_a, r0, blocks_b, 0, 0, 2)) << "stage 0 loaded stage 0's layers";
  EXPECT_TRUE(same_heads(s1, blocks_a, r1, blocks_b, 0, 0, 2)) << "stage 1 loaded stage 1's layers";

  // The whole model in one stage holds other objects (every layer in each): no hit.
  HostCache whole(small_shape(GetParam()), 404);
  auto kw = KvCache::open(*store_, KvLayout::per_layer(whole.shape, whole.ptrs).value(),
                          {.model = "test-model", .chunk_tokens = 64, .heads_total = 2, .head_count = 1});
  ASSERT_TRUE(kw.is_ok());
  EXPECT_EQ((*kw)->contains_prefix(tokens).value(), 0u);
  // Layers past the model's are refused.
  EXPECT_EQ(KvCache::open(*store_, KvLayout::per_layer(s1.shape, s1.ptrs).value(),
                          {.model = "test-model", .chunk_tokens = 64, .layers_total = 4, .layer_first = 3})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstash
