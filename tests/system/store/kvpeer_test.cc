// KvExport and KvImport (prefill/decode disaggregation's direct path), between two stores of
// this process over shm, tcp and verbs (skipped without an RDMA device; the Soft-RoCE lane runs
// it), and the handoff records beside them in a real redis-server.
#include "kvstash/kvpeer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "device_standin.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "rdma_lane.h"
#include "test_util.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;

// 3 layers of (2, 32 blocks, 16 tokens, 2 heads, 64) fp16: 4 KiB per block and part.
const KvCacheShape kShape{
    .num_layers = 3, .num_blocks = 32, .block_size = 16, .num_kv_heads = 2, .head_dim = 64};

// Per-layer tensors in memfd-backed buffers (shm can serve them).
struct HostCache {
  explicit HostCache(std::uint64_t seed, KvCacheShape s = kShape) : shape(s) {
    for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
      layers.push_back(Buffer::allocate(2 * shape.num_blocks * shape.block_bytes()).value());
      test::fill_random(layers.back().bytes(), seed + l);
      ptrs.push_back(layers.back().data());
    }
  }
  std::span<const std::byte> block(std::uint32_t l, std::uint32_t part, std::uint32_t b) const {
    return {layers[l].data() + (part * shape.num_blocks + b) * shape.block_bytes(), shape.block_bytes()};
  }
  // One head of one token of a block (NHD).
  std::span<const std::byte> head(std::uint32_t l, std::uint32_t part, std::uint32_t b, std::uint32_t t,
                                  std::uint32_t h) const {
    const std::size_t hb = std::size_t{shape.head_dim} * dtype_bytes(shape.dtype);
    return block(l, part, b).subspan((t * shape.num_kv_heads + h) * hb, hb);
  }
  // vLLM's per-layer kv-first arrangement, over the buffers' own regions (with their fds).
  KvLayout layout() const {
    std::vector<std::byte*> bases;
    std::vector<MemoryRegion> regions;
    for (const Buffer& b : layers) {
      bases.push_back(b.data());
      regions.push_back(b.region());
    }
    return KvLayout::custom(shape, bases, shape.num_blocks * shape.block_bytes(), shape.block_bytes(),
                            regions)
        .value();
  }
  KvCacheShape shape;
  std::vector<Buffer> layers;
  std::vector<void*> ptrs;
};

bool same(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

std::uint64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

class KvPeerTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  void SetUp() override {
    if (GetParam() == TransportKind::kVerbs) {
      const Status verbs = test::verbs_available();
      KVSTASH_REQUIRE_RDMA(verbs.is_ok(), verbs.to_string());
    }
    auto r = harness::LocalRedis::start({});
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    redis_ = std::move(r).value();
    prefill_ = open_store();
    decode_ = open_store();
    ASSERT_TRUE(prefill_ && decode_);
  }

  std::unique_ptr<Store> open_store() {
    StoreOptions o;
    o.redis_url = redis_->url();
    o.redis_password = redis_->password();
    o.engine.transports = {GetParam()};
    o.timeout = 5s;
    auto s = Store::open(o);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    return s.is_ok() ? std::move(s).value() : nullptr;
  }

  std::unique_ptr<harness::LocalRedis> redis_;
  std::unique_ptr<Store> prefill_, decode_;
};

INSTANTIATE_TEST_SUITE_P(Transports, KvPeerTest,
                         ::testing::Values(TransportKind::kShm, TransportKind::kTcp, TransportKind::kVerbs),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST_P(KvPeerTest, ReadsScatteredBlocksIntoOtherBlocksBitExact) {
  HostCache a(1), b(2);
  auto out = KvExport::open(*prefill_, a.layout());
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  auto in = KvImport::open(*decode_, b.layout());
  ASSERT_TRUE(in.is_ok()) << in.status().to_string();
  const std::vector<std::uint32_t> remote{7, 8, 9, 30, 2}, local{0, 1, 2, 11, 20};
  const HostCache before(2);  // b's bytes as they were (same seed)
  const std::uint64_t fence = now_ms() + 10000;
  auto read =
      (*in)->begin_read((*out)->descriptor(), remote, local,
                        {.fence = fence, .grant = (*out)->grant(remote, fence).value()}, deadline_after(5s));
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  ASSERT_TRUE(read->wait().is_ok());
  EXPECT_EQ(read->bytes(), kShape.num_layers * 2 * remote.size() * kShape.block_bytes());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    for (std::uint32_t p = 0; p < 2; ++p) {
      for (std::size_t i = 0; i < remote.size(); ++i) {
        EXPECT_TRUE(same(b.block(l, p, local[i]), a.block(l, p, remote[i]))) << l << "/" << p << "/" << i;
      }
      EXPECT_TRUE(same(b.block(l, p, 5), before.block(l, p, 5))) << "a block not read was written";
    }
  }
}

TEST_P(KvPeerTest, AReaderOfAnotherTensorParallelDegreeReadsItsHeadsOnly) {
  // A model of 4 KV heads: a prefill at TP=2 (2 heads a rank), a decode at TP=1 (4 heads),
  // then the reverse: a prefill at TP=1 read by rank 1 of a decode at TP=2.
  KvCacheShape four = kShape;
  four.num_kv_heads = 4;
  HostCache rank0(11), rank1(12), whole(13, four);
  auto out0 = KvExport::open(*prefill_, rank0.layout()).value();
  auto out1 = KvExport::open(*prefill_, rank1.layout()).value();
  auto in = KvImport::open(*decode_, whole.layout()).value();
  const std::vector<std::uint32_t> remote{3, 9, 4}, local{20, 1, 6};
  const HostCache before(13, four);
  const std::uint64_t fence = now_ms() + 10000;
  for (auto [out, first] : {std::pair{out0.get(), 0u}, std::pair{out1.get(), 2u}}) {
    auto read = in->begin_read(out->descriptor(), remote, local,
                               {.fence = fence,
                                .grant = out->grant(remote, fence).value(),
                                .heads = 2,
                                .remote_head_first = 0,
                                .local_head_first = first},
                               deadline_after(5s));
    ASSERT_TRUE(read.is_ok()) << read.status().to_string();
    ASSERT_TRUE(read->wait().is_ok());
    EXPECT_EQ(read->bytes(), kShape.num_layers * 2 * remote.size() * kShape.block_bytes())
        << "its heads only";
  }
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    for (std::uint32_t p = 0; p < 2; ++p) {
      for (std::size_t i = 0; i < remote.size(); ++i) {
        for (std::uint32_t t = 0; t < kShape.block_size; ++t) {
          for (std::uint32_t h = 0; h < 4; ++h) {
            const HostCache& from = h < 2 ? rank0 : rank1;
            ASSERT_TRUE(same(whole.head(l, p, local[i], t, h), from.head(l, p, remote[i], t, h % 2)))
                << l << "/" << p << "/" << i << " token " << t << " head " << h;
          }
        }
      }
      EXPECT_TRUE(same(whole.block(l, p, 5), before.block(l, p, 5))) << "a block not read was written";
    }
  }

  // The reverse: rank 1 of a TP=2 decode reads heads 2 and 3 of a TP=1 prefill's blocks.
  auto out = KvExport::open(*prefill_, whole.layout()).value();
  HostCache half(14);
  auto in_half = KvImport::open(*decode_, half.layout()).value();
  auto read = in_half->begin_read(out->descriptor(), local, remote,
                                  {.fence = fence,
                                   .grant = out->grant(local, fence).value(),
                                   .heads = 2,
                                   .remote_head_first = 2,
                                   .local_head_first = 0},
                                  deadline_after(5s));
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  ASSERT_TRUE(read->wait().is_ok());
  for (std::size_t i = 0; i < remote.size(); ++i) {
    for (std::uint32_t t = 0; t < kShape.block_size; ++t) {
      for (std::uint32_t h = 0; h < 2; ++h)
        ASSERT_TRUE(same(half.head(1, 1, remote[i], t, h), whole.head(1, 1, local[i], t, 2 + h)))
            << i << "/" << t;
    }
  }
  // Without heads the shapes must match; heads past either side's are refused.
  auto whole_read =
      in_half->begin_read(out->descriptor(), local, remote, {.fence = fence}, deadline_after(2s));
  EXPECT_EQ(whole_read.status().code(), StatusCode::kInvalidArgument) << whole_read.status().to_string();
  auto past = in_half->begin_read(out->descriptor(), local, remote,
                                  {.fence = fence, .heads = 2, .remote_head_first = 3, .local_head_first = 0},
                                  deadline_after(2s));
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument) << past.status().to_string();
}

TEST_P(KvPeerTest, AFenceEndsTheReadsUnderItsTagOnly) {
  HostCache a(3), b(4);
  auto out = KvExport::open(*prefill_, a.layout()).value();
  auto in = KvImport::open(*decode_, b.layout()).value();
  const std::uint64_t tag = now_ms();
  const std::vector<std::uint32_t> blocks{4, 5};
  auto first = in->begin_read(out->descriptor(), blocks, blocks,
                              {.fence = tag, .grant = out->grant(blocks, tag).value()}, deadline_after(5s));
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  ASSERT_TRUE(first->wait().is_ok());
  out->fence(tag);  // the prefill gives the blocks of every handoff up to `tag` back
  auto late = in->begin_read(out->descriptor(), blocks, blocks,
                             {.fence = tag, .grant = out->grant(blocks, tag).value()}, deadline_after(5s));
  const Status s = late.is_ok() ? late->wait() : late.status();
  EXPECT_TRUE(s.code() == StatusCode::kPermissionDenied || s.code() == StatusCode::kStale) << s.to_string();
  auto later =
      in->begin_read(out->descriptor(), blocks, blocks,
                     {.fence = tag + 1, .grant = out->grant(blocks, tag + 1).value()}, deadline_after(5s));
  ASSERT_TRUE(later.is_ok()) << later.status().to_string();
  EXPECT_TRUE(later->wait().is_ok()) << "a handoff with a later deadline was fenced too";
}

// The exporter's grant names the blocks a reader may read: a read of other blocks, under
// another export's grant, or with none, reaches nothing (shm peers map the regions themselves:
// the same host and user are trusted with them).
TEST_P(KvPeerTest, AReadReachesOnlyTheBlocksItsGrantNames) {
  if (GetParam() == TransportKind::kShm) GTEST_SKIP() << "shm peers of the same uid map the whole region";
  HostCache a(11), b(12), c(13);
  auto out = KvExport::open(*prefill_, a.layout()).value();
  auto other = KvExport::open(*prefill_, c.layout()).value();
  auto in = KvImport::open(*decode_, b.layout()).value();
  const std::uint64_t fence = now_ms() + 10000;
  const std::vector<std::uint32_t> granted{4, 5}, beside{6}, some_of_them{5};
  auto read = [&](std::span<const std::uint32_t> blocks, const std::string& grant) {
    auto r = in->begin_read(out->descriptor(), blocks, blocks, {.fence = fence, .grant = grant},
                            deadline_after(5s));
    return r.is_ok() ? r->wait() : r.status();
  };
  const std::string g = out->grant(granted, fence).value();
  EXPECT_TRUE(read(granted, g).is_ok());
  EXPECT_TRUE(read(some_of_them, g).is_ok());
  EXPECT_EQ(read(beside, g).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(read(granted, "").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(read(granted, other->grant(granted, fence).value()).code(), StatusCode::kPermissionDenied);
  std::string forged = g;
  forged.replace(forged.find("+"), 1, "0+");  // a longer first range, same MAC
  EXPECT_EQ(read(granted, forged).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(out->grant({}, fence).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(out->grant(granted, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(KvPeerTest, ForgedOrForeignDescriptorsAreRefusedBeforeAnythingMoves) {
  HostCache a(5), b(6);
  auto out = KvExport::open(*prefill_, a.layout()).value();
  auto in = KvImport::open(*decode_, b.layout()).value();
  const std::string good = out->descriptor();
  const std::vector<std::uint32_t> one{1};
  auto refused = [&](const std::string& d, std::span<const std::uint32_t> remote = {},
                     std::span<const std::uint32_t> local = {}) {
    if (remote.empty()) remote = local = one;
    auto r = in->begin_read(d, remote, local, {.fence = now_ms() + 10000}, deadline_after(2s));
    return r.is_ok() ? Status() : r.status();
  };
  EXPECT_EQ(refused("garbage").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(refused(good.substr(0, good.size() / 2)).code(), StatusCode::kInvalidArgument);
  // Another shape: the tag names 8 heads.
  std::string other = good;
  other.replace(other.find(".H2."), 4, ".H8.");
  EXPECT_EQ(refused(other).code(), StatusCode::kInvalidArgument);
  // A region shorter than its layer: blocks outside what the peer named.
  std::string shrunk = good;
  const std::size_t at = shrunk.find("region ");
  const std::size_t len = shrunk.find(' ', at + 7) + 1;
  shrunk.replace(len, shrunk.find(' ', len) - len, "4096");
  EXPECT_EQ(refused(shrunk).code(), StatusCode::kInvalidArgument);
  const std::vector<std::uint32_t> out_of_range{kShape.num_blocks};
  EXPECT_EQ(refused(good, out_of_range, one).code(), StatusCode::kInvalidArgument);
  const std::vector<std::uint32_t> two{1, 2};
  EXPECT_EQ(refused(good, two, one).code(), StatusCode::kInvalidArgument);
}

TEST_P(KvPeerTest, AGoneExporterFailsTheReadByItsDeadline) {
  HostCache a(7), b(8);
  std::string descriptor;
  {
    auto out = KvExport::open(*prefill_, a.layout()).value();
    descriptor = out->descriptor();
  }
  prefill_.reset();  // the prefill process is gone: its engine with it
  auto in = KvImport::open(*decode_, b.layout()).value();
  const std::vector<std::uint32_t> blocks{3};
  const auto start = std::chrono::steady_clock::now();
  auto read = in->begin_read(descriptor, blocks, blocks, {.fence = now_ms() + 10000}, deadline_after(2s));
  const Status s = read.is_ok() ? read->wait() : read.status();
  EXPECT_FALSE(s.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s) << s.to_string();
}

TEST_P(KvPeerTest, HandoffRecordsGoWithTheirLastReaderOrTheirTtl) {
  const std::vector<std::string> readers{"0", "1"};
  KvHandoffs prefill(*prefill_), decode(*decode_);
  ASSERT_TRUE(prefill.publish("e1:req:a", "descriptor", readers, 10s).is_ok());
  EXPECT_EQ(decode.descriptor("e1:req:a").value(), "descriptor");
  EXPECT_TRUE(prefill.pending("e1:req:a", "0").value());
  EXPECT_TRUE(decode.end("e1:req:a", "0").value());
  EXPECT_FALSE(decode.end("e1:req:a", "0").value()) << "a reader ended twice";
  EXPECT_FALSE(prefill.pending("e1:req:a", "0").value());
  EXPECT_TRUE(prefill.pending("e1:req:a", "1").value());
  EXPECT_TRUE(decode.end("e1:req:a", "1").value());
  EXPECT_EQ(decode.descriptor("e1:req:a").status().code(), StatusCode::kNotFound)
      << "the last reader ended it";

  ASSERT_TRUE(prefill.publish("e1:req:b", "d", readers, 200ms).is_ok());
  std::this_thread::sleep_for(400ms);
  EXPECT_EQ(decode.descriptor("e1:req:b").status().code(), StatusCode::kNotFound) << "its ttl passed";
  EXPECT_FALSE(prefill.pending("e1:req:b", "0").value()) << "an expired handoff holds nothing";

  EXPECT_EQ(prefill.publish("has space", "d", readers, 1s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(prefill.publish("e1:req:c", "d", readers, 0ms).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(prefill.publish(std::string(300, 'x'), "d", readers, 1s).code(), StatusCode::kInvalidArgument);
}

// GPU to GPU without a GPU: both caches in device stand-in memory (the host cannot touch it once
// sealed), the decode's NIC reading the prefill's device memory into its own (GPUDirect's
// shape). Only verbs reaches device memory; without an RDMA device this skips (the Soft-RoCE
// lane runs it).
TEST(KvPeerDeviceTest, OverVerbsTheNicReadsDeviceMemoryIntoDeviceMemory) {
  const Status verbs = test::verbs_available();
  KVSTASH_REQUIRE_RDMA(verbs.is_ok(), verbs.to_string());
  auto redis = harness::LocalRedis::start({});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  auto open_store = [&] {
    StoreOptions o;
    o.redis_url = (*redis)->url();
    o.redis_password = (*redis)->password();
    o.engine.transports = {TransportKind::kVerbs};
    o.engine.verbs.device_memory_by_address = true;  // the NIC reaches the stand-in (GPUDirect-style)
    o.timeout = 5s;
    return Store::open(o);
  };
  auto prefill = open_store(), decode = open_store();
  ASSERT_TRUE(prefill.is_ok() && decode.is_ok());
  const std::size_t layer_bytes = 2 * kShape.num_blocks * kShape.block_bytes();
  auto a = test::DeviceStandin::create(kShape.num_layers * layer_bytes).value();
  auto b = test::DeviceStandin::create(kShape.num_layers * layer_bytes).value();
  test::fill_random({a->base(), a->size()}, 9);  // the prefill's KV, before the memory is sealed
  auto layout = [&](const test::DeviceStandin& d) {
    std::vector<std::byte*> bases;
    for (std::uint32_t l = 0; l < kShape.num_layers; ++l) bases.push_back(d.base() + l * layer_bytes);
    return KvLayout::custom(kShape, bases, kShape.num_blocks * kShape.block_bytes(), kShape.block_bytes(),
                            {d.region()})
        .value();
  };
  auto out = KvExport::open(**prefill, layout(*a));  // registered before seal (ibv_reg_mr pins)
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  auto in = KvImport::open(**decode, layout(*b));
  ASSERT_TRUE(in.is_ok()) << in.status().to_string();
  ASSERT_TRUE(a->seal().is_ok() && b->seal().is_ok());
  const std::vector<std::uint32_t> remote{3, 4, 17}, local{10, 0, 31};
  const std::uint64_t fence = now_ms() + 10000;
  auto read =
      (*in)->begin_read((*out)->descriptor(), remote, local,
                        {.fence = fence, .grant = (*out)->grant(remote, fence).value()}, deadline_after(5s));
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  ASSERT_TRUE(read->wait().is_ok());
  for (std::uint32_t l = 0; l < kShape.num_layers; ++l) {
    for (std::uint32_t p = 0; p < 2; ++p) {
      for (std::size_t i = 0; i < remote.size(); ++i) {
        const auto at = [&](const test::DeviceStandin& d, std::uint32_t block) {
          return d.view(d.base() + l * layer_bytes + (p * kShape.num_blocks + block) * kShape.block_bytes());
        };
        EXPECT_EQ(std::memcmp(at(*b, local[i]), at(*a, remote[i]), kShape.block_bytes()), 0)
            << "layer " << l << " part " << p << " block " << i;
      }
    }
  }
  EXPECT_EQ(a->copied_bytes() + b->copied_bytes(), 0u) << "the NIC moved the bytes, no device copy";
}

}  // namespace
}  // namespace kvstash
