// Redis Sentinel against real processes: a master, a replica and a sentinel (redis-server
// --sentinel), all on loopback. Clients reach the master through redis+sentinel:// URLs and
// follow a failover (the master killed) within a measured bound; the first connection to the
// new master fences the cell's nodes (fence_master.lua), so nothing the old master handed out
// is used against the new one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

#include "kvstash/store.h"
#include "metadata/cell.h"
#include "metadata/tier_catalog.h"
#include "redis_server.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::metadata {
namespace {

using namespace std::chrono_literals;

constexpr const char* kService = "kvs-test";

class SentinelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(master_.running()) << "redis-server did not start (is it installed?)";
    replica_ = std::make_unique<test::RedisServer>(
        std::vector<std::string>{"--replicaof", "127.0.0.1", std::to_string(master_.port())});
    ASSERT_TRUE(replica_->running());
    auto sentinel = harness::LocalRedis::start({.sentinel_for = master_.port(), .service = kService});
    ASSERT_TRUE(sentinel.is_ok()) << sentinel.status().to_string();
    sentinel_ = std::move(sentinel).value();
    direct_ = RedisClient::connect({.url = master_.url()}).value();
    // The failover needs the replica in sync and known to the sentinel.
    ASSERT_TRUE(eventually([&] {
      return field(*direct_, "INFO", "replication", "slave0").find("state=online") != std::string::npos;
    })) << "the replica never came in sync";
    auto watcher = RedisClient::connect({.url = "redis://127.0.0.1:" + std::to_string(sentinel_->port())});
    ASSERT_TRUE(watcher.is_ok()) << watcher.status().to_string();
    ASSERT_TRUE(eventually([&] {
      auto r = (*watcher)->command({"SENTINEL", "replicas", kService});
      return r.is_ok() && r->size() == 1;
    })) << "the sentinel never learned of the replica";
  }

  // Waits until `pred` holds, up to `limit`.
  template <typename Pred>
  static bool eventually(Pred pred, std::chrono::milliseconds limit = 20s) {
    for (auto end = Clock::now() + limit; Clock::now() < end; std::this_thread::sleep_for(50ms)) {
      if (pred()) return true;
    }
    return pred();
  }

  // `name:value` from an INFO section.
  static std::string field(RedisClient& c, const char* cmd, const char* section, const std::string& name) {
    auto r = c.command({cmd, section});
    if (!r.is_ok()) return "";
    const std::string text(r->str());
    const auto at = text.find(name + ":");
    if (at == std::string::npos) return "";
    const auto from = at + name.size() + 1;
    return text.substr(from, text.find_first_of("\r\n", from) - from);
  }

  // What the master has acknowledged reaches the replica before the master dies.
  void replicate() {
    auto r = direct_->command({"WAIT", "1", "2000"});
    ASSERT_TRUE(r.is_ok() && r->integer() == 1) << "the replica did not acknowledge";
  }

  // A memory node (id n1) on the sentinel URL.
  std::unique_ptr<harness::LocalNode> node(std::vector<std::string> extra = {}) {
    extra.insert(extra.end(), {"--huge-pages", "off"});
    auto n = harness::LocalNode::start({.redis_url = sentinel_->url(),
                                        .capacity = "32MiB",
                                        .page_size = "1MiB",
                                        .node_id = "n1",
                                        .extra_args = std::move(extra)});
    EXPECT_TRUE(n.is_ok()) << n.status().to_string();
    return n.is_ok() ? std::move(n).value() : nullptr;
  }

  // Kills the master; returns how long `op` kept failing (it is retried until it succeeds or
  // 30 s passed).
  template <typename Op>
  std::chrono::milliseconds kill_master_and_time(Op op) {
    master_.stop();
    const auto t0 = Clock::now();
    while (!op() && Clock::now() - t0 < 30s) std::this_thread::sleep_for(20ms);
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  }

  test::RedisServer master_;
  std::unique_ptr<test::RedisServer> replica_;
  std::unique_ptr<harness::LocalRedis> sentinel_;  // redis+sentinel:// URL over the two
  std::unique_ptr<RedisClient> direct_;            // to the first master
};

TEST(SentinelUrl, NamesTheSentinelsAndTheService) {
  auto u = RedisUrl::parse("redis+sentinel://app:s%40cret@10.0.0.1,10.0.0.2:26380,[::1]:26381/cache/3");
  ASSERT_TRUE(u.is_ok()) << u.status().to_string();
  EXPECT_TRUE(u->sentinel());
  ASSERT_EQ(u->sentinels.size(), 3u);
  EXPECT_EQ(u->sentinels[0], (std::pair<std::string, int>{"10.0.0.1", 26379}));
  EXPECT_EQ(u->sentinels[1], (std::pair<std::string, int>{"10.0.0.2", 26380}));
  EXPECT_EQ(u->sentinels[2], (std::pair<std::string, int>{"::1", 26381}));
  EXPECT_EQ(u->service, "cache");
  EXPECT_EQ(u->db, 3);
  EXPECT_EQ(u->user, "app");
  EXPECT_EQ(u->password, "s@cret");
  EXPECT_EQ(u->redacted(), "redis+sentinel://app:***@10.0.0.1:26379,10.0.0.2:26380,[::1]:26381/cache/3");
  EXPECT_FALSE(RedisUrl::parse("redis://127.0.0.1:6379/0")->sentinel());
  for (const char* bad :
       {"redis+sentinel://10.0.0.1", "redis+sentinel://10.0.0.1/", "redis+sentinel:///svc",
        "redis+sentinel://h1,,h2/svc", "redis+sentinel://h1:0/svc", "redis+sentinel://h/svc/x"}) {
    EXPECT_EQ(RedisUrl::parse(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(SentinelTest, AClientFindsTheMasterAndFollowsAFailover) {
  auto client = RedisClient::connect({.url = sentinel_->url(), .reconnect_budget = 1s});
  ASSERT_TRUE(client.is_ok()) << client.status().to_string();
  EXPECT_EQ((*client)->url().port, master_.port());
  ASSERT_TRUE((*client)->command({"SET", "k", "before"}).is_ok());
  replicate();
  const auto took = kill_master_and_time([&] {
    auto r = (*client)->command({"SET", "k2", "after"});
    return r.is_ok();
  });
  std::printf("sentinel failover: writes failed for %lld ms after the master was killed\n",
              static_cast<long long>(took.count()));
  ::testing::Test::RecordProperty("failover_ms", std::to_string(took.count()));
  EXPECT_LT(took, 30s) << "the client never reached the new master";
  EXPECT_EQ((*client)->url().port, replica_->port()) << "the client writes somewhere other than the replica";
  auto r = (*client)->command({"GET", "k"});
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->str(), "before") << "what the old master acknowledged and replicated is there";
}

TEST_F(SentinelTest, AServiceNoSentinelKnowsIsAClearError) {
  auto client = RedisClient::connect(
      {.url = "redis+sentinel://127.0.0.1:" + std::to_string(sentinel_->port()) + "/no-such-service",
       .reconnect_budget = 200ms});
  ASSERT_FALSE(client.is_ok());
  EXPECT_EQ(client.status().code(), StatusCode::kNotFound) << client.status().to_string();
  EXPECT_NE(client.status().message().find("no-such-service"), std::string::npos)
      << client.status().to_string();
}

TEST_F(SentinelTest, ANewMasterFencesTheCellsNodesOnce) {
  auto open = [&] {
    return Cell::open({.redis = {.url = sentinel_->url(), .reconnect_budget = 1s}, .cell = "c"});
  };
  auto first = open();
  auto second = open();
  ASSERT_TRUE(first.is_ok() && second.is_ok()) << first.status().to_string();
  // With an NVMe tier: its records on the new master cannot be trusted either.
  const NodeRecord node{"n1", "e1", 1u << 20, 8, "addr-n1", "key-n1", "", 32, 1, "tier-n1"};
  ASSERT_TRUE((*first)->node_catalog().register_node(node, 60s).is_ok());
  ASSERT_TRUE((*first)->admin().node_status("n1").is_ok());
  {
    // Its first registration started the tier (the node offers what its device holds); the
    // node says that is over, as its tier thread would, holding nothing.
    metadata::TierCatalog tiers((*first)->redis(), "c");
    ASSERT_EQ(tiers.begin_recovery("n1", "e1").value(), true);
    ASSERT_TRUE(tiers.end_recovery("n1", "e1", {}, "").is_ok());
    ASSERT_EQ((*first)->admin().node_status("n1")->recovery.state, "done");
  }
  auto before = (*first)->catalog().begin_put("t1", "k1", 1u << 20, 30s);
  ASSERT_TRUE(before.is_ok()) << before.status().to_string();
  ASSERT_TRUE((*first)->catalog().commit_put("t1", "k1", {0x1234}, "", 0ms).is_ok());
  ASSERT_TRUE((*first)->catalog().begin_get("k1", "r0", 30s).is_ok());
  replicate();

  // The old master's node registration reached the replica, but not what the node may have
  // been handed since: on the new master the node is dead until it registers again.
  const auto took = kill_master_and_time([&] {
    auto p = (*first)->catalog().begin_put("t2", "k2", 1u << 20, 30s);
    return p.status().code() != StatusCode::kUnavailable && p.status().code() != StatusCode::kTimeout;
  });
  std::printf("sentinel failover: the cell answered again %lld ms after the master was killed\n",
              static_cast<long long>(took.count()));
  EXPECT_EQ((*first)->catalog().begin_put("t3", "k3", 1u << 20, 30s).status().code(), StatusCode::kNoSpace)
      << "pages were placed on a node the new master cannot vouch for";
  EXPECT_EQ((*first)->node_catalog().heartbeat("n1", "e1", 60s, 0).status().code(), StatusCode::kStale)
      << "the node's heartbeat must make it register again";
  EXPECT_EQ((*first)->catalog().begin_get("k1", "r1", 30s).status().code(), StatusCode::kNotFound)
      << "an object on the fenced node is still readable";

  // The second connection reaches the same new master: no second fence.
  ASSERT_TRUE((*second)->catalog().begin_put("t4", "k4", 1u << 20, 30s).status().code() ==
              StatusCode::kNoSpace);
  auto failovers = (*second)->redis().command({"HGET", (*second)->prefix() + ":stats", "failovers"});
  ASSERT_TRUE(failovers.is_ok());
  EXPECT_EQ(failovers->str(), "1");

  // Registered again (a new epoch), the node takes puts; its tier, the same device, starts
  // over, and a recovery of what its device holds is to run (docs/metadata.md, "A cell that
  // lost its Redis"): a replace or remove of an object on it may be missing here.
  const NodeRecord again{"n1", "e2", 1u << 20, 8, "addr-n1", "key-n1-2", "", 32, 1, "tier-n1"};
  ASSERT_TRUE((*first)->node_catalog().register_node(again, 60s).is_ok());
  EXPECT_TRUE((*first)->catalog().begin_put("t5", "k5", 1u << 20, 30s).is_ok());
  EXPECT_EQ((*first)->admin().node_status("n1")->recovery.state, "pending")
      << "the new master kept the tier's records as the truth";
}

// A memory node and a store on the sentinel URL: after the master dies, the store's puts
// resume once the node has re-registered with the new master, and no get ever returns bytes
// other than its own put's (the checksum off, so only the fence can keep them out).
TEST_F(SentinelTest, ANodeAndAStoreFollowAFailoverWithoutWrongBytes) {
  auto n1 = node({"--heartbeat-ttl", "1s"});
  ASSERT_TRUE(n1);
  StoreOptions o;
  o.redis_url = sentinel_->url();
  o.engine.transports = {TransportKind::kTcp};
  o.timeout = 3s;
  o.verify_checksum = false;
  auto store = Store::open(o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  auto bytes = [](char c) { return std::vector<std::byte>(3u << 20, std::byte(c)); };
  auto put = [&](const std::string& key, const std::vector<std::byte>& data) {
    Slice s{const_cast<std::byte*>(data.data()), data.size()};
    return (*store)->put(key, {&s, 1});
  };
  auto get = [&](const std::string& key) -> Result<std::vector<std::byte>> {
    std::vector<std::byte> out(4u << 20);
    Slice s{out.data(), out.size()};
    KVSTASH_ASSIGN_OR_RETURN(kvstash::ObjectInfo info, (*store)->get(key, {&s, 1}));
    out.resize(info.size);
    return out;
  };
  const auto a = bytes('a'), b = bytes('b');
  ASSERT_TRUE(put("a", a).is_ok());
  replicate();

  const auto took = kill_master_and_time([&] { return put("b", b).is_ok(); });
  std::printf("sentinel failover: store puts resumed %lld ms after the master was killed\n",
              static_cast<long long>(took.count()));
  ::testing::Test::RecordProperty("puts_resumed_ms", std::to_string(took.count()));
  EXPECT_LT(took, 30s) << "puts never resumed";
  auto got_b = get("b");
  ASSERT_TRUE(got_b.is_ok()) << got_b.status().to_string();
  EXPECT_TRUE(*got_b == b) << "wrong bytes for the put made after the failover";
  auto got_a = get("a");
  EXPECT_TRUE(!got_a.is_ok() || *got_a == a) << "wrong bytes for the put made before the failover";
  if (!got_a.is_ok()) {
    EXPECT_EQ(got_a.status().code(), StatusCode::kNotFound) << got_a.status().to_string();
  }
}

// StoreOptions::commit_replicas: a put returns once a replica holds its commit (Redis WAIT),
// at a cost measured here; with the replica gone it returns kUnavailable, committed.
TEST_F(SentinelTest, APutCanWaitForAReplicaToHoldItsCommit) {
  auto n1 = node();
  ASSERT_TRUE(n1);
  auto open = [&](std::uint32_t replicas) {
    StoreOptions o;
    o.redis_url = sentinel_->url();
    o.engine.transports = {TransportKind::kShm};
    o.commit_replicas = replicas;
    return Store::open(o);
  };
  auto plain = open(0), waiting = open(1);
  ASSERT_TRUE(plain.is_ok() && waiting.is_ok()) << waiting.status().to_string();
  std::vector<std::byte> data(64u << 10, std::byte{7});
  Slice slice{data.data(), data.size()};
  auto p50_us = [&](Store& s) {
    std::vector<double> us;
    for (int i = 0; i < 100; ++i) {
      const auto t0 = Clock::now();
      EXPECT_TRUE(s.put("w", {&slice, 1}).is_ok());
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  };
  const double without = p50_us(**plain), with = p50_us(**waiting);
  std::printf("64 KiB put p50: %.0f us, %.0f us waiting for one replica (%.2fx)\n", without, with,
              with / without);
  ::testing::Test::RecordProperty("put_p50_us_wait_0", std::to_string(without));
  ::testing::Test::RecordProperty("put_p50_us_wait_1", std::to_string(with));

  replica_->stop();
  Status s = (*waiting)->put("lonely", {&slice, 1}, {.deadline = deadline_after(500ms)});
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("committed"), std::string::npos) << s.to_string();
  auto info = (*plain)->stat("lonely");
  EXPECT_TRUE(info.is_ok()) << "the put was committed on the master: " << info.status().to_string();
}

}  // namespace
}  // namespace kvstash::metadata
