// Deployments of several cells over a Redis Cluster, against real processes: six redis-server
// (three masters, three replicas) and one kvstashd per cell, all on loopback.
//
//   - objects live in the cell their key's route wins (rendezvous hashing), a prefix chain in
//     one cell;
//   - changing the set of cells moves no bytes: old objects stay where they are and are still
//     found; an overwrite lands where the new set routes and removes the older copy;
//   - the client follows its cell's slot to another master (MOVED), waits out a migration
//     (ASK, TRYAGAIN: no script runs on half the cell's keys), and
//     through a failover (the master killed), and the new master fences the cell.
#include <gtest/gtest.h>

#include <hiredis/hiredis.h>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "metadata/cell_directory.h"
#include "metadata/cell_routes.h"
#include "metadata/records.h"
#include "metadata/redis_client.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;
using metadata::pick_cell;
using metadata::route_of;

// ---- routing, pure --------------------------------------------------------------------------

TEST(CellRoutes, AKeyRoutesByItsHashTagElseByItself) {
  EXPECT_EQ(route_of("kvp:{abc}def"), "abc");
  EXPECT_EQ(route_of("a{x}b{y}c"), "x") << "the first tag";
  EXPECT_EQ(route_of("a{}b"), "a{}b") << "an empty tag is no tag";
  EXPECT_EQ(route_of("a{b"), "a{b");
  EXPECT_EQ(route_of("plain"), "plain");
}

TEST(CellRoutes, AChangeOfTheSetMovesOnlyTheKeysTheChangedCellWins) {
  const std::vector<std::string> three{"a", "b", "c"}, four{"a", "b", "c", "d"}, two{"a", "b"};
  int moved_on_add = 0, moved_on_remove = 0;
  std::map<std::string, int> spread;
  constexpr int kKeys = 20000;
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = "key-" + std::to_string(i);
    const auto& before = three[pick_cell(three, key)];
    const auto& added = four[pick_cell(four, key)];
    const auto& removed = two[pick_cell(two, key)];
    ++spread[before];
    if (added != before) {
      ++moved_on_add;
      EXPECT_EQ(added, "d") << key << " moved between two cells that were there before";
    }
    if (removed != before) {
      ++moved_on_remove;
      EXPECT_EQ(before, "c") << key << " moved although its cell stayed";
    }
  }
  // Each cell wins about its share.
  for (const auto& [cell, n] : spread) EXPECT_NEAR(n, kKeys / 3, kKeys / 30) << cell;
  EXPECT_NEAR(moved_on_add, kKeys / 4, kKeys / 40);
  EXPECT_NEAR(moved_on_remove, kKeys / 3, kKeys / 30);
}

TEST(CellRoutes, ClusterUrls) {
  auto u = metadata::RedisUrl::parse("redis+cluster://app:s3cret@10.0.0.1,10.0.0.2:7001,[::1]:7002");
  ASSERT_TRUE(u.is_ok()) << u.status().to_string();
  ASSERT_EQ(u->cluster_nodes.size(), 3u);
  EXPECT_EQ(u->cluster_nodes[0], (std::pair<std::string, int>{"10.0.0.1", 6379}));
  EXPECT_EQ(u->cluster_nodes[2], (std::pair<std::string, int>{"::1", 7002}));
  EXPECT_EQ(u->user, "app");
  EXPECT_EQ(u->redacted(), "redis+cluster://app:***@10.0.0.1:6379,10.0.0.2:7001,[::1]:7002");
  EXPECT_EQ(metadata::RedisUrl::parse("redis+cluster://h1,h2/3").status().code(),
            StatusCode::kInvalidArgument)
      << "a cluster has only database 0";
  // A redirection reaches a client that is not a cluster's: a configuration error, not a retry.
  EXPECT_EQ(metadata::error_status("MOVED 8076 10.0.0.2:6379").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(metadata::error_status("TRYAGAIN Multiple keys request during rehashing of slot").code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(metadata::error_status("CLUSTERDOWN The cluster is down").code(), StatusCode::kUnavailable);
}

// ---- against a Redis Cluster ----------------------------------------------------------------

const std::vector<std::string> kCells{"c1", "c2", "c3"};

class CellsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto cluster = harness::LocalRedisCluster::start({});
    if (!cluster.is_ok()) {
      setup_error_ = new std::string(cluster.status().to_string());
      return;
    }
    cluster_ = std::move(cluster).value().release();
    nodes_ = new std::map<std::string, std::unique_ptr<harness::LocalNode>>;
    for (const auto& cell : kCells) start_node(cell);
  }
  static void TearDownTestSuite() {
    delete nodes_;
    delete cluster_;
    delete setup_error_;
  }
  void SetUp() override {
    ASSERT_EQ(setup_error_, nullptr) << *setup_error_;
    for (const auto& cell : kCells) ASSERT_TRUE((*nodes_)[cell]) << "no memory node for " << cell;
  }

  static void start_node(const std::string& cell) {
    auto n =
        harness::LocalNode::start({.redis_url = cluster_->url(),
                                   .capacity = "32MiB",
                                   .page_size = "1MiB",
                                   .node_id = "n-" + cell,
                                   .extra_args = {"--cell", cell, "--huge-pages", "off", "--heartbeat-ttl",
                                                  "2s", "--reclaim-interval", "200ms"}});
    EXPECT_TRUE(n.is_ok()) << cell << ": " << n.status().to_string();
    (*nodes_)[cell] = n.is_ok() ? std::move(n).value() : nullptr;
  }

  static StoreOptions options() {
    StoreOptions o;
    o.redis_url = cluster_->url();
    o.cells = kCells;
    o.timeout = 10s;
    o.engine.transports = {TransportKind::kTcp};
    o.put_reservation = 0;
    return o;
  }

  static std::unique_ptr<metadata::RedisClient> directory() {
    return metadata::RedisClient::connect(
               {.url = cluster_->url(), .cluster_key = std::string(metadata::kCellDirectoryKey)})
        .value();
  }

  static std::string bytes_of(const std::string& key, int version, std::size_t size = 3000) {
    std::string b(size, '\0');
    for (std::size_t i = 0; i < size; ++i)
      b[i] = static_cast<char>(std::hash<std::string>{}(key) + version * 7 + i);
    return b;
  }
  static Status put(Store& s, const std::string& key, const std::string& bytes) {
    const Slice slice{const_cast<char*>(bytes.data()), bytes.size()};
    return s.put(key, std::span(&slice, 1));
  }
  // The object's bytes, or "(the error)".
  static std::string get(Store& s, const std::string& key) {
    std::string out(8192, '\0');
    const Slice slice{out.data(), out.size()};
    auto info = s.get(key, std::span(&slice, 1));
    if (!info.is_ok()) return std::string("(").append(info.status().to_string()).append(")");
    out.resize(info->size);
    return out;
  }
  // The one node an object is on.
  static std::string node_of(Store& s, const std::string& key) {
    auto info = s.stat(key);
    if (info.is_ok() && info->nodes.size() == 1) return info->nodes[0];
    return std::string("(").append(info.status().to_string()).append(")");
  }

  static inline harness::LocalRedisCluster* cluster_ = nullptr;
  static inline std::map<std::string, std::unique_ptr<harness::LocalNode>>* nodes_ = nullptr;
  static inline std::string* setup_error_ = nullptr;
};

TEST_F(CellsTest, EachObjectLivesInTheCellItsRouteWinsAndAChainInOne) {
  auto store = Store::open(options());
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  std::map<std::string, int> per_cell;
  for (int i = 0; i < 30; ++i) {
    const std::string key = "obj-" + std::to_string(i);
    ASSERT_TRUE(put(**store, key, bytes_of(key, 1)).is_ok()) << key;
    const std::string& cell = kCells[pick_cell(kCells, key)];
    ++per_cell[cell];
    EXPECT_EQ(node_of(**store, key), "n-" + cell) << key;
    EXPECT_EQ(get(**store, key), bytes_of(key, 1)) << key;
  }
  EXPECT_EQ(per_cell.size(), 3u) << "30 keys over 3 cells, and one got none";

  std::vector<std::uint32_t> tokens(64);
  for (std::uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i * 31 + 7;
  const auto chain = prefix_chunk_keys(tokens, {.model = "m", .layout_tag = "t", .chunk_tokens = 16});
  ASSERT_EQ(chain.size(), 4u);
  for (const auto& key : chain) ASSERT_TRUE(put(**store, key, bytes_of(key, 1)).is_ok()) << key;
  const std::string home = node_of(**store, chain[0]);
  for (const auto& key : chain) EXPECT_EQ(node_of(**store, key), home) << key << ": a chain spans cells";
  auto found = (*store)->contains_prefix(chain);
  ASSERT_TRUE(found.is_ok()) << found.status().to_string();
  EXPECT_EQ(*found, 4u);
}

TEST_F(CellsTest, ChangingTheCellsMovesNoBytesAndOverwritesLeaveNoOlderCopy) {
  auto dir = directory();
  ASSERT_TRUE(metadata::set_cell_directory(*dir, {"c1", "c2"}).is_ok());
  ASSERT_TRUE(metadata::settle_cell_directory(*dir).is_ok());
  StoreOptions o = options();
  o.cells.clear();
  o.cell_directory = true;
  o.cell_directory_refresh = 50ms;
  auto store = Store::open(o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  const std::vector<std::string> two{"c1", "c2"}, three{"c1", "c2", "c3"};
  std::map<std::string, std::string> where;  // key -> node before the change
  std::vector<std::string> moved;            // keys the new set routes to c3
  for (int i = 0; i < 40; ++i) {
    const std::string key = "dir-" + std::to_string(i);
    ASSERT_TRUE(put(**store, key, bytes_of(key, 1)).is_ok()) << key;
    where[key] = node_of(**store, key);
    EXPECT_EQ(where[key], "n-" + two[pick_cell(two, key)]);
    if (three[pick_cell(three, key)] == "c3") moved.push_back(key);
  }
  ASSERT_FALSE(moved.empty()) << "no key of 40 routes to the added cell";

  auto changed = metadata::set_cell_directory(*dir, three);
  ASSERT_TRUE(changed.is_ok()) << changed.status().to_string();
  EXPECT_EQ(changed->previous, two);
  std::this_thread::sleep_for(100ms);  // past the store's refresh
  for (const auto& [key, node] : where) {
    EXPECT_EQ(get(**store, key), bytes_of(key, 1)) << key << " is no longer found";
    EXPECT_EQ(node_of(**store, key), node) << key << " moved";
  }
  // A new key the new set routes to c3 goes there; an overwrite of an old one too, and the
  // older copy is gone from the cell it was in.
  std::string fresh;
  for (int i = 0; fresh.empty(); ++i) {
    if (three[pick_cell(three, "new-" + std::to_string(i))] == "c3") fresh = "new-" + std::to_string(i);
  }
  ASSERT_TRUE(put(**store, fresh, bytes_of(fresh, 1)).is_ok());
  EXPECT_EQ(node_of(**store, fresh), "n-c3");
  const std::string& over = moved.front();
  ASSERT_TRUE(put(**store, over, bytes_of(over, 2)).is_ok());
  EXPECT_EQ(node_of(**store, over), "n-c3");
  EXPECT_EQ(get(**store, over), bytes_of(over, 2)) << "the older copy was read";
  StoreOptions old_cell = options();
  old_cell.cells = {two[pick_cell(two, over)]};
  auto old_view = Store::open(old_cell);
  ASSERT_TRUE(old_view.is_ok());
  EXPECT_EQ((*old_view)->stat(over).status().code(), StatusCode::kNotFound)
      << "the older copy is still there";

  // Removing a key finds it wherever it is; settling leaves the unmoved keys readable.
  const std::string& gone = moved.back();
  if (gone != over) {
    ASSERT_TRUE((*store)->remove(gone).is_ok());
    EXPECT_EQ((*store)->stat(gone).status().code(), StatusCode::kNotFound);
  }
  ASSERT_TRUE(metadata::settle_cell_directory(*dir).is_ok());
  std::this_thread::sleep_for(100ms);
  for (const auto& [key, node] : where) {
    if (three[pick_cell(three, key)] == "c3") continue;
    EXPECT_EQ(get(**store, key), bytes_of(key, 1)) << key;
  }
}

TEST_F(CellsTest, AMemoryNodeWithCellAutoJoinsTheLeastLoadedCell) {
  auto dir = directory();
  ASSERT_TRUE(metadata::set_cell_directory(*dir, {"c1", "c2", "c4"}).is_ok());
  ASSERT_TRUE(metadata::settle_cell_directory(*dir).is_ok());
  auto joined = harness::LocalNode::start({.redis_url = cluster_->url(),
                                           .capacity = "16MiB",
                                           .page_size = "1MiB",
                                           .node_id = "n-auto",
                                           .extra_args = {"--cell", "auto", "--huge-pages", "off"}});
  ASSERT_TRUE(joined.is_ok()) << joined.status().to_string();
  // c4 had no node: the new one is there, and serves its puts.
  StoreOptions o = options();
  o.cells = {"c4"};
  auto store = Store::open(o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  ASSERT_TRUE(put(**store, "auto", bytes_of("auto", 1)).is_ok());
  EXPECT_EQ(node_of(**store, "auto"), "n-auto");
  EXPECT_EQ(get(**store, "auto"), bytes_of("auto", 1));
}

// Moves `slot`'s keys and ownership from the server `from` to the server `to`, the store's
// `during` running with the slot half migrated (its scripts then see ASK or TRYAGAIN).
void migrate_slot(harness::LocalRedisCluster& c, std::size_t from, std::size_t to, long slot,
                  const std::function<void()>& during) {
  auto src = metadata::RedisClient::connect({.url = c.server(from).url()}).value();
  auto dst = metadata::RedisClient::connect({.url = c.server(to).url()}).value();
  const std::string src_id(src->command({"CLUSTER", "MYID"}).value().str());
  const std::string dst_id(dst->command({"CLUSTER", "MYID"}).value().str());
  const std::string s = std::to_string(slot);
  ASSERT_TRUE(dst->command({"CLUSTER", "SETSLOT", s, "IMPORTING", src_id}).is_ok());
  ASSERT_TRUE(src->command({"CLUSTER", "SETSLOT", s, "MIGRATING", dst_id}).is_ok());
  const std::string port = std::to_string(c.server(to).port());
  bool halfway = false;
  for (;;) {
    auto keys = src->command({"CLUSTER", "GETKEYSINSLOT", s, "3"});
    ASSERT_TRUE(keys.is_ok());
    if (keys->size() == 0) break;
    for (std::size_t i = 0; i < keys->size(); ++i) {
      const std::string_view key(keys->element(i)->str, keys->element(i)->len);
      ASSERT_TRUE(src->command({"MIGRATE", "127.0.0.1", port, key, "0", "5000"}).is_ok());
    }
    if (!halfway) {
      halfway = true;
      during();
    }
  }
  for (auto* server : {dst.get(), src.get()}) {
    ASSERT_TRUE(server->command({"CLUSTER", "SETSLOT", s, "NODE", dst_id}).is_ok());
  }
}

TEST_F(CellsTest, TheClientFollowsItsCellsSlotToAnotherMasterAndThroughAFailover) {
  StoreOptions o = options();
  o.cells = {"c2"};
  auto store = Store::open(o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  ASSERT_TRUE(put(**store, "before", bytes_of("before", 1)).is_ok());
  const std::string prefix = metadata::cell_prefix("c2");
  auto master = cluster_->master_of(prefix);
  ASSERT_TRUE(master.is_ok()) << master.status().to_string();
  std::size_t other = *master;  // another master
  for (std::size_t i = 0; i < cluster_->size() && other == *master; ++i) {
    if (i == *master || !cluster_->server(i).running()) continue;
    auto role = metadata::RedisClient::connect({.url = cluster_->server(i).url()}).value()->command({"ROLE"});
    if (role.is_ok() && role->size() > 0 && std::string_view(role->element(0)->str) == "master") other = i;
  }
  ASSERT_NE(other, *master);
  auto keyslot = directory()->command({"CLUSTER", "KEYSLOT", prefix});
  ASSERT_TRUE(keyslot.is_ok());

  // Resharding: mid-migration a put either commits or fails in time; after it, puts work.
  Status during = Status::internal("not run");
  migrate_slot(*cluster_, *master, other, keyslot->integer(), [&] {
    const auto t0 = Clock::now();
    during = put(**store, "mid", bytes_of("mid", 1));
    EXPECT_LT(Clock::now() - t0, o.timeout + 1s);
  });
  std::printf("a put with the cell's slot half migrated: %s\n", during.to_string().c_str());
  // Half the cell's keys on each master: the put waited (ASK, TRYAGAIN) and gave up in time,
  // rather than run its script on a master that holds only some of them.
  EXPECT_TRUE(during.code() == StatusCode::kUnavailable || during.code() == StatusCode::kTimeout)
      << during.to_string();
  auto moved_to = cluster_->master_of(prefix);
  ASSERT_TRUE(moved_to.is_ok());
  ASSERT_NE(*moved_to, *master) << "the slot did not move";
  const auto t0 = Clock::now();
  Status after = Status::internal("not run");
  while (!(after = put(**store, "after-move", bytes_of("after-move", 1))).is_ok() &&
         Clock::now() - t0 < 20s) {
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_TRUE(after.is_ok()) << after.to_string();
  EXPECT_EQ(get(**store, "after-move"), bytes_of("after-move", 1));
  std::printf("after the slot moved to another master, puts worked again in %lld ms\n",
              static_cast<long long>(
                  std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()));

  // Failover: the slot's master killed; its replica takes over and the cell is fenced.
  const std::size_t victim = *moved_to;
  cluster_->server(victim).kill();
  const auto k0 = Clock::now();
  Status again = Status::internal("not run");
  while (!(again = put(**store, "after-failover", bytes_of("after-failover", 1))).is_ok() &&
         Clock::now() - k0 < 30s) {
    std::this_thread::sleep_for(50ms);
  }
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - k0);
  ASSERT_TRUE(again.is_ok()) << again.to_string();
  std::printf("the master of the cell's slot killed: puts worked again after %lld ms\n",
              static_cast<long long>(took.count()));
  EXPECT_LT(took, 20s);
  EXPECT_EQ(get(**store, "after-failover"), bytes_of("after-failover", 1));
  auto cell = metadata::RedisClient::connect({.url = cluster_->url(), .cluster_key = prefix});
  ASSERT_TRUE(cell.is_ok());
  auto fenced = (*cell)->command({"HGET", prefix + ":stats", "failovers"});
  ASSERT_TRUE(fenced.is_ok());
  EXPECT_GE(std::atoll(std::string(fenced->str()).c_str()), 1) << "no new master fenced the cell";
  // Every get returns its put's bytes or an error, never another's.
  for (const char* key : {"before", "mid", "after-move"}) {
    const std::string bytes = get(**store, key);
    if (!bytes.starts_with("(")) {
      EXPECT_EQ(bytes, bytes_of(key, 1)) << key;
    }
  }
  ASSERT_TRUE(cluster_->server(victim).restart().is_ok());
  EXPECT_TRUE(cluster_->wait_healthy(deadline_after(30s)).is_ok());
}

}  // namespace
}  // namespace kvstash
