// The NVMe tier end to end (docs/nvme-tier.md): a real kvstashd with --ssd on a file of this
// machine's disk, a private Redis, and a Store over tcp with its checksum off, so that every
// byte-for-byte check here is the tier's own doing. Objects that outgrow the pool move down
// instead of being evicted and come back on a get; a get may decline the promotion; prefix
// tiers say where chunks are; a device that fails, or bytes changed under the node, make a get
// fail, never return other bytes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "http_get.h"
#include "kvstash/store.h"
#include "metadata/cell.h"
#include "node/ssd_device.h"
#include "node/tier_headers.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;
using test::http_get;
using test::metric;

constexpr std::uint64_t kPage = 64 << 10;  // 16 pages of pool
// A tier of 16 MiB: its superblock's 4 KiB, then per slot a header place of 4 KiB and a page.
constexpr std::uint64_t kSlots = ((16 << 20) - 4096) / (kPage + 4096);
constexpr int kObjects = 48;  // 3x the pool
// The cluster's token: the node signs its tier's headers with a key made from it.
constexpr std::string_view kToken = "a-cluster-token-of-32-characters";

std::string bytes_of(const std::string& key, int version = 0) {
  std::string out(kPage, '\0');
  std::mt19937_64 rng(std::hash<std::string>{}(key) + static_cast<std::uint64_t>(version));
  for (std::size_t i = 0; i < out.size(); i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(out.data() + i, &v, 8);
  }
  return out;
}

class TierTest : public ::testing::Test {
 protected:
  // A node with a 1 MiB pool of 64 KiB pages over a 16 MiB tier; `fault` is --ssd-fault's.
  void start(const std::string& fault = "none") {
    auto redis = harness::LocalRedis::start();
    ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
    redis_ = std::move(redis).value();
    // Beside the build: the disk, where O_DIRECT works (not a tmpfs /tmp).
    path_ = (std::filesystem::current_path() / ("tier-test-" + std::to_string(::getpid()))).string();
    {
      // A file system without O_DIRECT (tmpfs, overlayfs) or a kernel without io_uring: say so.
      const std::string probe = path_ + ".probe";
      const Status can = node::SsdDevice::open({.path = probe, .capacity = 1 << 20}).status();
      ::unlink(probe.c_str());
      if (can.code() == StatusCode::kUnsupported)
        GTEST_SKIP() << "no O_DIRECT tier beside the build: " << can.to_string();
    }
    {
      std::ofstream(path_ + ".token") << kToken;
      ::chmod((path_ + ".token").c_str(), 0600);
    }
    start_node(fault);
    if (IsSkipped() || HasFatalFailure()) return;
    StoreOptions o;
    o.redis_url = redis_->url();
    o.engine.transports = {TransportKind::kTcp};
    o.engine.cluster_token = std::string(kToken);
    o.verify_checksum = false;  // the tier must hold without it
    o.timeout = 20s;
    auto store = Store::open(o);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    store_ = std::move(store).value();
    metadata::CellOptions co;
    co.redis.url = redis_->url();
    auto cell = metadata::Cell::open(co);
    ASSERT_TRUE(cell.is_ok()) << cell.status().to_string();
    cell_ = std::move(cell).value();
  }
  // (Re)starts the node over path_ (kill it first to restart it).
  void start_node(const std::string& fault = "none") {
    auto node = harness::LocalNode::start(
        {.redis_url = redis_->url(),
         .capacity = "1MiB",
         .page_size = "64KiB",
         .node_id = "tiered",
         .extra_args = {"--transports", "tcp", "--huge-pages", "off", "--ssd", path_, "--ssd-capacity",
                        "16MiB", "--ssd-fault", fault, "--heartbeat-ttl", "1s", "--cluster-token-file",
                        path_ + ".token"}});
    if (!node.is_ok() && node.status().message().find("exit") != std::string::npos &&
        !std::filesystem::exists(path_)) {
      GTEST_SKIP() << "kvstashd could not open an O_DIRECT tier here: " << node.status().to_string();
    }
    ASSERT_TRUE(node.is_ok()) << node.status().to_string();
    node_ = std::move(node).value();
  }

  void TearDown() override {
    store_.reset();
    if (node_) node_->stop();
    ::unlink(path_.c_str());
    ::unlink((path_ + ".token").c_str());
  }

  metadata::NodeStatus node_status() { return cell_->admin().node_status("tiered").value(); }
  // The node's status once no write-down holds slots for objects still in the pool (one may
  // run at any moment): every slot in use is an object's on the tier.
  metadata::NodeStatus settled_status() {
    metadata::NodeStatus ns = node_status();
    for (const Deadline until = deadline_after(3s);
         ns.tier_slots - ns.tier_free_slots != ns.tier_objects && Clock::now() < until; ns = node_status()) {
      std::this_thread::sleep_for(1ms);
    }
    return ns;
  }
  metadata::CellSummary summary() { return cell_->admin().summary().value(); }
  std::string metrics() { return http_get(node_->admin(), "/metrics").second; }

  // Puts `key` (one page), first waiting until the node's write-down left a page free: the
  // test then knows that no put had to evict.
  Status put(const std::string& key, int version = 0) {
    const Deadline until = deadline_after(20s);
    while (node_status().free_pages < 2 && Clock::now() < until) std::this_thread::sleep_for(5ms);
    const std::string data = bytes_of(key, version);
    Slice in{const_cast<char*>(data.data()), data.size()};
    return store_->put(key, {&in, 1});
  }
  // Gets `key` and says whether its bytes are exactly version `version`'s.
  Result<bool> get_matches(const std::string& key, int version = 0, bool promote = true) {
    std::string back(kPage, '\0');
    Slice out{back.data(), back.size()};
    GetOptions g;
    g.promote = promote;
    KVSTASH_RETURN_IF_ERROR(store_->get(key, {&out, 1}, g).status());
    return back == bytes_of(key, version);
  }

  std::unique_ptr<harness::LocalRedis> redis_;
  std::unique_ptr<harness::LocalNode> node_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<metadata::Cell> cell_;
  std::string path_;
};

std::string key_of(int i) { return "tier/obj-" + std::to_string(i); }

// Three pools' worth of objects: none is evicted, the cold ones are on the tier, and every one
// comes back byte for byte (promoted: one round trip more), including twice over.
TEST_F(TierTest, ObjectsOutgrowingThePoolMoveDownAndComeBackByteForByte) {
  start();
  if (IsSkipped()) return;
  for (int i = 0; i < kObjects; ++i) ASSERT_TRUE(put(key_of(i)).is_ok()) << i;
  const metadata::NodeStatus ns = settled_status();
  EXPECT_EQ(ns.tier_slots, kSlots);
  EXPECT_GE(ns.tier_objects, static_cast<std::uint64_t>(kObjects - 16));
  EXPECT_EQ(ns.tier_slots - ns.tier_free_slots, ns.tier_objects);
  EXPECT_EQ(store_->stat(key_of(0))->nodes, std::vector<std::string>{"tiered"});
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < kObjects; ++i) {
      auto same = get_matches(key_of(i));
      ASSERT_TRUE(same.is_ok()) << key_of(i) << ": " << same.status().to_string();
      EXPECT_TRUE(*same) << key_of(i) << " came back with other bytes";
    }
  }
  const metadata::CellSummary s = summary();
  EXPECT_EQ(s.evicted, 0u) << "the tier was there: nothing had to be evicted";
  EXPECT_EQ(s.objects, static_cast<std::uint64_t>(kObjects));
  EXPECT_GE(s.promoted, static_cast<std::uint64_t>(kObjects));
  EXPECT_GE(s.written_down, static_cast<std::uint64_t>(kObjects));
  EXPECT_EQ(s.tier_lost, 0u);
  // The cell's sums over its tiers (kvstash status's nvme line) are the node's.
  const metadata::NodeStatus now = node_status();
  EXPECT_EQ(s.tier_slots, now.tier_slots);
  EXPECT_EQ(s.tier_free_slots, now.tier_free_slots);
  EXPECT_EQ(s.tier_objects, now.tier_objects);
  const std::string m = metrics();
  EXPECT_GE(metric(m, "kvstash_tier_promotions_total"), kObjects) << m;
  EXPECT_GE(metric(m, "kvstash_tier_write_downs_total"), kObjects) << m;
  EXPECT_EQ(metric(m, "kvstash_tier_promotion_failures_total"), 0) << m;
  EXPECT_GT(metric(m, "kvstash_tier_device_bytes_total", "{op=\"read\"}"), 0) << m;
}

// A get may decline the promotion (kNotFound that says where the object is); prefix_tiers says
// which chunks are in a pool and which on the tier; stat names the tier.
TEST_F(TierTest, AGetMayDeclineThePromotionAndPrefixTiersSayWhereChunksAre) {
  start();
  if (IsSkipped()) return;
  std::vector<std::string> keys;
  for (int i = 0; i < 24; ++i) {
    keys.push_back(key_of(i));
    ASSERT_TRUE(put(keys.back()).is_ok());
  }
  const std::string cold = keys.front(), hot = keys.back();
  auto where = store_->prefix_tiers(keys);
  ASSERT_TRUE(where.is_ok()) << where.status().to_string();
  ASSERT_EQ(where->size(), keys.size());
  EXPECT_EQ(where->front(), Tier::kSsd);
  EXPECT_EQ(where->back(), Tier::kDram);
  auto absent = keys;
  absent.insert(absent.begin() + 3, "tier/never-put");
  EXPECT_EQ(store_->prefix_tiers(absent)->size(), 3u);
  EXPECT_EQ(*store_->contains_prefix(keys), keys.size());

  auto declined = get_matches(cold, 0, false);
  ASSERT_FALSE(declined.is_ok());
  EXPECT_EQ(declined.status().code(), StatusCode::kNotFound);
  EXPECT_NE(declined.status().message().find("NVMe tier"), std::string::npos)
      << declined.status().to_string();
  EXPECT_EQ(store_->prefix_tiers({&cold, 1})->front(), Tier::kSsd) << "declining left it where it was";
  EXPECT_EQ(*get_matches(hot, 0, false), true) << "a pool object needs no promotion";
  EXPECT_EQ(*get_matches(cold), true);
  EXPECT_EQ(store_->prefix_tiers({&cold, 1})->front(), Tier::kDram) << "promoted";
}

// A put over an object on the tier, and a remove of one, free its slots; the old bytes never
// come back.
TEST_F(TierTest, ReplacingOrRemovingAnObjectOnTheTierFreesItsSlots) {
  start();
  if (IsSkipped()) return;
  for (int i = 0; i < 24; ++i) ASSERT_TRUE(put(key_of(i)).is_ok());
  ASSERT_EQ(store_->prefix_tiers(std::vector<std::string>{key_of(0), key_of(1)})->at(1), Tier::kSsd);
  const std::uint64_t on_tier = node_status().tier_objects;
  ASSERT_TRUE(put(key_of(0), 1).is_ok());
  EXPECT_TRUE(store_->remove(key_of(1)).is_ok());
  EXPECT_EQ(*get_matches(key_of(0), 1), true) << "the new version, not the one on the tier";
  EXPECT_EQ(get_matches(key_of(1)).status().code(), StatusCode::kNotFound);
  const metadata::NodeStatus ns = settled_status();
  EXPECT_EQ(ns.tier_slots - ns.tier_free_slots, ns.tier_objects) << "a slot outlived its object";
  EXPECT_GT(on_tier, 0u);
  EXPECT_EQ(summary().objects, 23u);
}

// A device whose reads fail: objects move down, and a get of one fails (the object is dropped
// as lost), never with other bytes; the cell keeps taking puts.
TEST_F(TierTest, ADeviceThatFailsReadsFailsTheGetNeverWithOtherBytes) {
  start("read-eio");
  if (IsSkipped()) return;
  for (int i = 0; i < 24; ++i) ASSERT_TRUE(put(key_of(i)).is_ok());
  ASSERT_EQ(store_->prefix_tiers(std::vector<std::string>{key_of(0)})->front(), Tier::kSsd);
  auto got = get_matches(key_of(0));
  ASSERT_FALSE(got.is_ok()) << "a failed device gave bytes";
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound) << got.status().to_string();
  EXPECT_GE(summary().tier_lost, 1u);
  EXPECT_GE(metric(metrics(), "kvstash_tier_promotion_failures_total"), 1);
  EXPECT_GE(metric(metrics(), "kvstash_tier_device_errors_total"), 1);
  EXPECT_TRUE(put("tier/after", 0).is_ok());
  EXPECT_EQ(*get_matches("tier/after"), true);
}

// A device whose writes fail: nothing moves down, the objects stay whole in the pool, and a full
// pool evicts as it would without a tier.
TEST_F(TierTest, ADeviceThatFailsWritesLeavesObjectsInThePool) {
  start("write-eio");
  if (IsSkipped()) return;
  for (int i = 0; i < 24; ++i) {
    const std::string data = bytes_of(key_of(i));
    Slice in{const_cast<char*>(data.data()), data.size()};
    ASSERT_TRUE(store_->put(key_of(i), {&in, 1}).is_ok()) << i;
  }
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(node_status().tier_objects, 0u);
  EXPECT_GE(metric(metrics(), "kvstash_tier_write_down_failures_total"), 1);
  // A write-down may be taking slots this moment; between tries they are all free again.
  bool all_free = false;
  for (const Deadline until = deadline_after(3s); !all_free && Clock::now() < until;
       std::this_thread::sleep_for(1ms)) {
    all_free = node_status().tier_free_slots == kSlots;
  }
  EXPECT_TRUE(all_free) << "a failed write-down kept its slots";
  EXPECT_EQ(*get_matches(key_of(23)), true);
  EXPECT_GT(summary().evicted, 0u);
}

// Bytes changed on the device under the node (a torn or stray write): the promotion's own sum
// catches them with the client's checksum off; the get fails and the object is dropped.
TEST_F(TierTest, BytesChangedOnTheDeviceAreCaughtWithTheChecksumOff) {
  start();
  if (IsSkipped()) return;
  for (int i = 0; i < 24; ++i) ASSERT_TRUE(put(key_of(i)).is_ok());
  ASSERT_EQ(store_->prefix_tiers(std::vector<std::string>{key_of(0)})->front(), Tier::kSsd);
  {
    // Every slot's bytes (and most header places: from 80 KiB on) flipped, as a stray writer
    // would.
    const int fd = ::open(path_.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    std::string junk(1 << 20, '\x5a');
    for (off_t at = 80 << 10; at < (16 << 20); at += static_cast<off_t>(junk.size())) {
      ASSERT_EQ(::pwrite(fd, junk.data(), junk.size(), at), static_cast<ssize_t>(junk.size()));
    }
    ::fsync(fd);
    ::close(fd);
  }
  auto got = get_matches(key_of(0));
  ASSERT_FALSE(got.is_ok()) << "changed bytes were served";
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound) << got.status().to_string();
  EXPECT_GE(metric(metrics(), "kvstash_tier_promotion_corrupt_total"), 1);
  EXPECT_GE(summary().tier_lost, 1u);
}

// kill -9 of the node: its pool's objects are gone, its tier's are kept; unreadable while it
// is down (a miss, not an error, and never other bytes), readable again byte for byte once the
// same node serves over the same device.
TEST_F(TierTest, ObjectsOnTheTierSurviveAKillOfTheirNode) {
  start();
  if (IsSkipped()) return;
  for (int i = 0; i < 24; ++i) ASSERT_TRUE(put(key_of(i)).is_ok());
  std::vector<std::string> keys;
  for (int i = 0; i < 24; ++i) keys.push_back(key_of(i));
  settled_status();
  std::vector<bool> on_tier;
  for (const std::string& k : keys) on_tier.push_back(store_->prefix_tiers({&k, 1})->front() == Tier::kSsd);
  const auto tiered = std::count(on_tier.begin(), on_tier.end(), true);
  ASSERT_GT(tiered, 4);
  node_->kill();
  // Down (its heartbeat past): nothing is readable, nothing is lost yet.
  std::this_thread::sleep_for(1500ms);
  EXPECT_EQ(get_matches(key_of(0)).status().code(), StatusCode::kNotFound);
  start_node();
  ASSERT_FALSE(HasFatalFailure());
  int back = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto same = get_matches(keys[i]);
    if (on_tier[i]) {
      ASSERT_TRUE(same.is_ok()) << keys[i] << " was on the tier: " << same.status().to_string();
      EXPECT_TRUE(*same) << keys[i] << " came back with other bytes";
      ++back;
    } else {
      EXPECT_EQ(same.status().code(), StatusCode::kNotFound) << keys[i] << " was in the dead pool";
    }
  }
  EXPECT_EQ(back, tiered);
  EXPECT_EQ(summary().tier_lost, 0u);
}

// A node that comes back over another device (here: its tier file replaced) starts its tier
// over: the objects the cell had on the old one are gone, never read from the new one.
TEST_F(TierTest, ANodeBackOverAnotherDeviceStartsItsTierOver) {
  start();
  if (IsSkipped()) return;
  for (int i = 0; i < 24; ++i) ASSERT_TRUE(put(key_of(i)).is_ok());
  settled_status();
  ASSERT_EQ(store_->prefix_tiers(std::vector<std::string>{key_of(0)})->front(), Tier::kSsd);
  node_->kill();
  ASSERT_EQ(::unlink(path_.c_str()), 0);
  start_node();
  ASSERT_FALSE(HasFatalFailure());
  for (int i = 0; i < 24; ++i) {
    EXPECT_EQ(get_matches(key_of(i)).status().code(), StatusCode::kNotFound) << key_of(i);
  }
  // Gone because the cell knew the tier was another, not because a read of the new device
  // failed its sum (which would have been the last line of defence).
  EXPECT_EQ(summary().tier_lost, 0u);
  const metadata::NodeStatus ns = settled_status();
  EXPECT_EQ(ns.tier_objects, 0u);
  EXPECT_EQ(ns.tier_free_slots, ns.tier_slots);
  EXPECT_TRUE(put("tier/new").is_ok());
  EXPECT_EQ(*get_matches("tier/new"), true);
}

// Redis restarts empty under a running node: the node registers again into the empty cell,
// which starts its tier over, and gives the recoverable keys' objects back (the other keys
// are gone), byte for byte.
TEST_F(TierTest, RedisRestartedEmptyUnderARunningNodeGetsTheRecoverableKeysBack) {
  start();
  if (IsSkipped()) return;
  auto chunk = [](int i) { return "kvp:{m}chunk-" + std::to_string(i); };
  for (int i = 0; i < 24; ++i) {
    ASSERT_TRUE(put(chunk(i)).is_ok()) << i;
    ASSERT_TRUE(put(key_of(i)).is_ok()) << i;
  }
  settled_status();
  std::vector<std::string> tiered;
  for (int i = 0; i < 24; ++i) {
    const std::string k = chunk(i);
    if (store_->prefix_tiers({&k, 1})->front() == Tier::kSsd) tiered.push_back(k);
  }
  ASSERT_GE(tiered.size(), 6u);
  ASSERT_TRUE(redis_->restart().is_ok());
  metadata::NodeStatus ns;
  for (const Deadline until = deadline_after(20s); Clock::now() < until; std::this_thread::sleep_for(20ms)) {
    auto s = cell_->admin().node_status("tiered");
    if (s.is_ok() && s->recovery.state == "done") {
      ns = *s;
      break;
    }
  }
  ASSERT_EQ(ns.recovery.state, "done") << "no recovery ended after Redis restarted empty";
  EXPECT_EQ(ns.recovery.admitted, tiered.size());
  EXPECT_EQ(ns.recovery.bad, 0u);
  for (const std::string& k : tiered) {
    auto same = get_matches(k);
    ASSERT_TRUE(same.is_ok()) << k << ": " << same.status().to_string();
    EXPECT_TRUE(*same) << k << " came back with other bytes";
  }
  for (int i = 0; i < 24; ++i)
    EXPECT_EQ(get_matches(key_of(i)).status().code(), StatusCode::kNotFound) << key_of(i);
}

// A cell that lost its Redis (restarted empty, the node killed meanwhile) gets back from the
// node's tier the objects of its recoverable keys ("kvp:", the KV cache's chunks, whose keys
// name their content), each checked against its sum: byte for byte, under the node's new
// registration. Keys of other prefixes are gone; a key written anew meanwhile keeps its new
// bytes; bytes changed on the device are not offered. The tier then works on: new objects
// move down around the recovered ones, which stay whole.
TEST_F(TierTest, ACellThatLostItsRedisGetsTheRecoverableKeysBackFromTheTier) {
  start();
  if (IsSkipped()) return;
  auto chunk = [](int i) { return "kvp:{m}chunk-" + std::to_string(i); };
  auto tier_of = [&](const std::string& k) { return store_->prefix_tiers({&k, 1})->front(); };
  for (int i = 0; i < 24; ++i) {
    ASSERT_TRUE(put(chunk(i)).is_ok()) << i;
    ASSERT_TRUE(put(key_of(i)).is_ok()) << i;
  }
  settled_status();
  std::vector<std::string> tiered, plain;  // on the tier: chunks, other keys
  for (int i = 0; i < 24; ++i) {
    if (tier_of(chunk(i)) == Tier::kSsd) tiered.push_back(chunk(i));
    if (tier_of(key_of(i)) == Tier::kSsd) plain.push_back(key_of(i));
  }
  ASSERT_GE(tiered.size(), 6u);
  ASSERT_GE(plain.size(), 1u);
  ASSERT_GE(tiered.size(), 3u);
  const std::string replaced = tiered[0], damaged = tiered[1], forged_over = tiered[2];
  const std::string forged = "kvp:{m}forged";
  node_->kill();
  ASSERT_TRUE(redis_->restart().is_ok());  // no persistence: empty
  {
    // One chunk's bytes changed on the device while nothing ran: its header still verifies,
    // its bytes no longer match the sum in it.
    auto device = node::SsdDevice::open({.path = path_, .capacity = 16 << 20});
    ASSERT_TRUE(device.is_ok()) << device.status().to_string();
    const node::TierLayout layout((*device)->capacity(), kPage, (*device)->block_size());
    const auto key = node::tier_header_key(kToken);
    EXPECT_TRUE(node::scan_tier_headers(**device, layout, deadline_after(10s))->empty())
        << "the headers are signed: none verifies without the node's key";
    auto headers = node::scan_tier_headers(**device, layout, deadline_after(10s), key);
    ASSERT_TRUE(headers.is_ok()) << headers.status().to_string();
    std::uint64_t at = 0;
    std::optional<std::pair<node::TierHeader, std::uint64_t>> victim;
    for (const auto& [h, slot] : *headers) {
      EXPECT_TRUE(h.key.starts_with("kvp:")) << "a header for " << h.key << ", not a recoverable key";
      if (h.key == damaged) at = layout.slot_offset(slot);
      if (h.key == forged_over) victim = {h, slot};
    }
    ASSERT_GT(at, 0u) << "no header for " << damaged;
    ASSERT_TRUE(victim.has_value()) << "no header for " << forged_over;
    device->reset();
    const int fd = ::open(path_.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const std::string junk(4096, '\x5a');
    ASSERT_EQ(::pwrite(fd, junk.data(), junk.size(), static_cast<off_t>(at)), 4096);
    // Whoever can write the device but lacks the token: a header of their own (unkeyed, as
    // the code anyone can read writes it) naming a real chunk's slots, bytes and sum.
    node::TierHeader fake = victim->first;
    fake.key = forged;
    fake.sequence += 1000;
    const auto bytes = node::encode_tier_header(fake, 4096).value();
    ASSERT_EQ(
        ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(layout.header_offset(victim->second))),
        static_cast<ssize_t>(bytes.size()));
    ::fsync(fd);
    ::close(fd);
  }
  // Before the node is back, another node takes a new version of one chunk.
  auto other = harness::LocalNode::start({.redis_url = redis_->url(),
                                          .capacity = "1MiB",
                                          .page_size = "64KiB",
                                          .node_id = "other",
                                          .extra_args = {"--transports", "tcp", "--huge-pages", "off",
                                                         "--cluster-token-file", path_ + ".token"}});
  ASSERT_TRUE(other.is_ok()) << other.status().to_string();
  Status again = Status::unavailable("not tried");
  for (const Deadline until = deadline_after(10s); !again.is_ok() && Clock::now() < until;) {
    const std::string data = bytes_of(replaced, 1);
    Slice in{const_cast<char*>(data.data()), data.size()};
    again = store_->put(replaced, {&in, 1});  // the first may meet the connection Redis dropped
  }
  ASSERT_TRUE(again.is_ok()) << again.to_string();
  start_node();
  ASSERT_FALSE(HasFatalFailure());
  metadata::NodeStatus ns = node_status();
  for (const Deadline until = deadline_after(20s); ns.recovery.state != "done" && Clock::now() < until;) {
    std::this_thread::sleep_for(20ms);
    ns = node_status();
  }
  ASSERT_EQ(ns.recovery.state, "done");
  // The forged header is no header: found are the real ones less the one it overwrote.
  EXPECT_EQ(ns.recovery.found, tiered.size() - 1);
  EXPECT_EQ(ns.recovery.checked, tiered.size() - 1);
  EXPECT_EQ(ns.recovery.bad, 1u);
  EXPECT_EQ(ns.recovery.admitted, tiered.size() - 3);
  EXPECT_EQ(ns.recovery.refused, 1u) << "the chunk written anew";
  EXPECT_EQ(metric(metrics(), "kvstash_tier_recovered_total"), static_cast<double>(tiered.size() - 3));
  {
    // What an operator sees of it.
    const std::string cmd =
        harness::find_tool("kvstash") + " --redis " + redis_->url() + " node show tiered 2>&1";
    FILE* p = ::popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string shown;
    for (char buf[512]; std::fgets(buf, sizeof buf, p) != nullptr;) shown += buf;
    EXPECT_EQ(::pclose(p), 0) << shown;
    const std::string want = "done: " + std::to_string(tiered.size() - 1) + " of " +
                             std::to_string(tiered.size() - 1) + " objects on the device checked, " +
                             std::to_string(tiered.size() - 3) +
                             " admitted, 1 not "
                             "matching their sum, 1 refused";
    EXPECT_NE(shown.find(want), std::string::npos) << shown;
  }
  auto check_all = [&](const char* when) {
    for (const std::string& k : tiered) {
      auto same = get_matches(k, k == replaced ? 1 : 0);
      if (k == damaged || k == forged_over) {
        EXPECT_EQ(same.status().code(), StatusCode::kNotFound)
            << when << ": changed bytes of " << k << " came back";
        continue;
      }
      ASSERT_TRUE(same.is_ok()) << when << ": " << k << ": " << same.status().to_string();
      EXPECT_TRUE(*same) << when << ": " << k << " came back with other bytes";
    }
  };
  check_all("after the recovery");
  EXPECT_EQ(get_matches(forged).status().code(), StatusCode::kNotFound) << "a forged header was admitted";
  for (const std::string& k : plain) {
    EXPECT_EQ(get_matches(k).status().code(), StatusCode::kNotFound) << k << " is not a recoverable key";
  }
  // The tier works on, its free slots made around the recovered objects (the other node gone,
  // so that every put lands here; the chunk written anew goes with it).
  (*other)->stop();
  std::erase(tiered, replaced);
  for (int i = 100; i < 132; ++i) ASSERT_TRUE(put(key_of(i)).is_ok()) << i;
  EXPECT_GT(settled_status().tier_objects, 8u);
  check_all("after more objects moved down");
  for (int i = 100; i < 132; ++i) EXPECT_EQ(*get_matches(key_of(i)), true) << key_of(i);
}

}  // namespace
}  // namespace kvstash
