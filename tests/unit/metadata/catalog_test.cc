// The metadata scripts against a real redis-server: allocation, commit, leases, zombies,
// generations, eviction, expiry, reclaim, dead and restarted nodes, corrupt records.
#include "metadata/cell.h"
#include "metadata/tier_catalog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <hiredis/hiredis.h>

#include "common/grant.h"
#include "metadata/quotas.h"
#include "metadata/read_releases.h"
#include "metadata/scripts.h"
#include "redis_server.h"

namespace kvstash::metadata {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kPage = 1u << 20;
// "o<i>". (Not "o" + std::to_string(i): GCC 12 at -O3 warns -Wrestrict about that, wrongly.)
std::string object_key(int i) {
  std::string k = std::to_string(i);
  k.insert(k.begin(), 'o');
  return k;
}

// The nodes these tests register: an abort that every node confirmed.
const std::vector<std::string> kEveryNode{"a", "b", "c"};

class CatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.running()) << "redis-server did not start (is it installed?)";
    cell_ = Cell::open({.redis = {.url = server_.url()}}).value();
    redis_ = &cell_->redis();
    cat_ = &cell_->catalog();
    node_ = &cell_->node_catalog();
    admin_ = &cell_->admin();
  }
  Status add_node(std::string id, std::uint64_t pages, std::chrono::milliseconds ttl = 30s,
                  std::string epoch = "e1") {
    return node_->register_node({id, epoch, kPage, pages, "addr-" + id, "key-" + id}, ttl).status();
  }
  std::uint64_t free_of(std::string_view id) { return admin_->free_pages(id).value(); }
  // A committed object of `pages` pages.
  Placement put(const std::string& key, std::uint64_t pages, std::chrono::milliseconds ttl = 0ms) {
    std::string token = "t-" + key + "-" + std::to_string(++puts_);
    auto p = cat_->begin_put(token, key, pages * kPage, 30s);
    EXPECT_TRUE(p.is_ok()) << p.status().to_string();
    if (!p.is_ok()) return {};
    Status s = cat_->commit_put(token, key, {0x1234}, "layout-" + key, ttl);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    return std::move(p).value();
  }
  // Whether a get finds `key`; its lease ends at once, so that it keeps nothing from eviction
  // (a lease of 1 ms could outlive the next call on a fast machine).
  StatusCode get_code(const std::string& key) {
    auto g = cat_->begin_get(key, "probe", 1ms);
    if (g.is_ok()) (void)cat_->end_get("probe", *g);
    return g.status().code();
  }

  test::RedisServer server_;
  std::unique_ptr<Cell> cell_;
  RedisClient* redis_ = nullptr;
  Catalog* cat_ = nullptr;       // the client's scripts
  NodeCatalog* node_ = nullptr;  // the memory node's
  CellAdmin* admin_ = nullptr;   // the operator's
  int puts_ = 0;
};

// The recovery scripts (recover_tier.lua) over a tier of 16 slots: a pending recovery hands
// out no slot; objects offered are admitted unless their key holds one, kept when offered
// again by a recovery that restarts; and at the end the free list is every slot no admitted
// object holds, those freed during the recovery (an admitted object removed) included, once.
TEST_F(CatalogTest, ARecoveryAdmitsWhatTheKeyDoesNotHoldAndFreesEverySlotElseOnce) {
  NodeRecord n{"t", "e1", kPage, 8, "addr-t", "key-t", "", 16, 2, "tier-t"};
  ASSERT_TRUE(node_->register_node(n, 30s).is_ok());
  TierCatalog tiers(*redis_);
  ASSERT_EQ(tiers.begin_recovery("t", "e1").value(), true) << "a tier the cell did not know starts over";
  put("taken", 1);  // a put since the loss: newer than what the tier holds
  auto offer = [&](std::vector<TierCatalog::Recovered> objects) {
    return tiers.offer_recovered("t", "e1", {.found = 3, .checked = 3}, objects).value();
  };
  auto object = [](std::string key, std::string runs, std::uint64_t size) {
    return TierCatalog::Recovered{.key = std::move(key),
                                  .token = "r-" + key,
                                  .checksum = "0000000000001234/4194304",
                                  .layout = "",
                                  .runs = std::move(runs),
                                  .sum = "00000000000000ab",
                                  .size = size};
  };
  using O = TierCatalog::Offered;
  EXPECT_EQ(offer({object("a", "0,2", 2 * kPage), object("b", "5,1", kPage), object("taken", "9,1", kPage)}),
            (std::vector<O>{O::kAdmitted, O::kAdmitted, O::kTaken}));
  EXPECT_EQ(offer({object("a", "0,2", 2 * kPage)}), std::vector<O>{O::kKept})
      << "offered again: the same slots";
  EXPECT_EQ(cat_->stat("a").value().tier, "ssd");
  // While it runs, no write-down takes a slot.
  auto down = tiers.begin_write_down("t", "e1", 100, 100, 8, 10s);
  ASSERT_TRUE(down.is_ok()) << down.status().to_string();
  EXPECT_TRUE(down->objects.empty());
  ASSERT_TRUE(cat_->remove("a").is_ok());  // its slots 0-1 go to the free list now
  ASSERT_TRUE(tiers.end_recovery("t", "e1", {.found = 3, .checked = 3}, "0,2;5,1").is_ok());
  const NodeStatus st = admin_->node_status("t").value();
  EXPECT_EQ(st.recovery.state, "done");
  EXPECT_EQ(st.recovery.admitted, 2u);
  EXPECT_EQ(st.recovery.refused, 1u);
  EXPECT_EQ(st.tier_slots, 16u);
  EXPECT_EQ(st.tier_free_slots, 15u) << "every slot but b's is free, a's freed slots counted once";
  EXPECT_EQ(cat_->stat("b").value().tier, "ssd");
  EXPECT_EQ(tiers.begin_recovery("t", "e1").value(), false) << "one recovery per start-over";
}

// KV events (docs/events.md): while they are off an announce records nothing; on, each present
// object takes its data and is logged stored (an absent one skipped); whatever removes it later
// (a client, a put that replaces it, eviction) logs it removed with the same data, in the order
// the scripts ran, and takes it out of the set a relay restates from. A failover's fence moves
// the epoch on.
TEST_F(CatalogTest, AnnouncedObjectsAreLoggedStoredThenRemovedWithTheirDataInOrder) {
  ASSERT_TRUE(add_node("a", 3).is_ok());
  put("x", 1);
  put("y", 1);
  const std::string p = cell_->prefix();
  using Items = std::vector<std::pair<std::string, std::string>>;
  const Items items{{"x", "ev-x"}, {"y", "ev-y"}, {"never", "ev-n"}};
  EXPECT_EQ(cat_->announce(items).value(), std::nullopt) << "events off";
  EXPECT_EQ(redis_->command({"EXISTS", p + ":events:log"}).value().integer(), 0);
  ASSERT_TRUE(redis_->command({"HSET", p + ":events", "maxlen", "1000"}).is_ok());
  EXPECT_EQ(cat_->announce(items).value(), 2u) << "a key never stored is skipped";
  EXPECT_EQ(cat_->announce(Items{{"x", ""}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cat_->announce(Items{{"x", std::string(kMaxEventData + 1, 'e')}}).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(cat_->remove("x").is_ok());
  put("y", 1);  // replaced: the new y was never announced
  put("z", 1);
  ASSERT_TRUE(cat_->announce(Items{{"z", "ev-z"}}).is_ok());
  put("w", 3);  // a full pool: y and z go

  auto log = redis_->command({"XRANGE", p + ":events:log", "-", "+"}).value();
  std::vector<std::string> got;
  for (std::size_t i = 0; i < log.size(); ++i) {
    const redisReply* f = log.element(i)->element[1];
    std::string line;
    for (std::size_t j = 1; j < f->elements; j += 2) {
      if (j > 1) line += ' ';
      line.append(f->element[j]->str, f->element[j]->len);
    }
    got.push_back(line);
  }
  EXPECT_EQ(
      got, (std::vector<std::string>{"stored x ev-x ", "stored y ev-y ", "removed x ev-x removed",
                                     "removed y ev-y replaced", "stored z ev-z ", "removed z ev-z evicted"}));
  EXPECT_EQ(redis_->command({"SCARD", p + ":events:objs"}).value().integer(), 0);

  ASSERT_TRUE(redis_->eval(scripts::fence_master(), {p}, {"master-1"}).is_ok());
  EXPECT_TRUE(redis_->command({"HGET", p + ":events", "epoch"}).value().is_nil()) << "the first master seen";
  ASSERT_TRUE(redis_->eval(scripts::fence_master(), {p}, {"master-2"}).is_ok());
  EXPECT_EQ(redis_->command({"HGET", p + ":events", "epoch"}).value().str(), "1") << "a failover";
}

// A commit carries its object's event data in its own script (a KV save's chunks: one Redis
// call, not a commit and then an announce): recorded, logged stored and later removed with the
// same data while the cell's events are on; nothing recorded while they are off. Each commit says
// whether it recorded it. Batched commits (commit_reserveds) say it per put.
TEST_F(CatalogTest, ACommitRecordsItsEventDataInItsOwnScript) {
  ASSERT_TRUE(add_node("a", 8).is_ok());
  const std::string p = cell_->prefix();
  auto log = [&] {
    std::vector<std::string> got;
    auto r = redis_->command({"XRANGE", p + ":events:log", "-", "+"}).value();
    for (std::size_t i = 0; i < r.size(); ++i) {
      const redisReply* f = r.element(i)->element[1];
      got.push_back(std::string(f->element[1]->str) + " " + f->element[3]->str + " " + f->element[5]->str);
    }
    return got;
  };
  auto commit = [&](const std::string& key, std::string_view event, bool* announced) {
    const std::string token = "t-" + key + "-" + std::to_string(++puts_);
    EXPECT_TRUE(cat_->begin_put(token, key, kPage, 30s).is_ok());
    return cat_->commit_put(token, key, {1}, "", 0ms, std::nullopt, 1, {}, 0, event, announced);
  };
  bool announced = true;
  ASSERT_TRUE(commit("off", "ev-off", &announced).is_ok());
  EXPECT_FALSE(announced) << "events off";
  EXPECT_TRUE(redis_->command({"HGET", p + ":obj:off", "ev"}).value().is_nil());
  EXPECT_EQ(redis_->command({"EXISTS", p + ":events:log"}).value().integer(), 0);

  ASSERT_TRUE(redis_->command({"HSET", p + ":events", "maxlen", "1000"}).is_ok());
  ASSERT_TRUE(commit("a", "ev-a", &announced).is_ok());
  EXPECT_TRUE(announced);
  ASSERT_TRUE(commit("plain", "", &announced).is_ok());
  EXPECT_FALSE(announced) << "no event data";
  EXPECT_EQ(commit("big", std::string(kMaxEventData + 1, 'e'), &announced).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(redis_->command({"SISMEMBER", p + ":events:objs", "a"}).value().integer(), 1);

  ASSERT_TRUE(cat_->reserve_pages("res", 2 * kPage, 0, 30s).is_ok());
  const std::vector<Catalog::ReservedCommit> batch{
      {.pages = {"res", 0, 1}, .token = "r1", .key = "b", .size = kPage, .checksum = {1}, .event = "ev-b"},
      {.pages = {"res", 1, 1}, .token = "r2", .key = "c", .size = kPage, .checksum = {1}}};
  std::vector<bool> each;
  auto committed = cat_->commit_reserveds(batch, &each);
  ASSERT_TRUE(committed.is_ok()) << committed.status().to_string();
  EXPECT_TRUE((*committed)[0].is_ok() && (*committed)[1].is_ok());
  EXPECT_EQ(each, (std::vector<bool>{true, false}));

  ASSERT_TRUE(cat_->remove("a").is_ok());
  ASSERT_TRUE(cat_->remove("b").is_ok());
  ASSERT_TRUE(cat_->remove("c").is_ok());
  EXPECT_EQ(log(),
            (std::vector<std::string>{"stored a ev-a", "stored b ev-b", "removed a ev-a", "removed b ev-b"}));
}

TEST_F(CatalogTest, PutSpansNodesMostFreeFirstAndGetSeesTheSamePages) {
  ASSERT_TRUE(add_node("a", 10).is_ok());
  ASSERT_TRUE(add_node("b", 6).is_ok());
  auto p = cat_->begin_put("tok", "obj", 13 * kPage - 5, 30s);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  ASSERT_EQ(p->extents.size(), 13u);
  EXPECT_EQ(p->page_size, kPage);
  std::set<std::pair<std::string, std::uint64_t>> distinct;
  int on_a = 0;
  for (const Extent& e : p->extents) {
    distinct.emplace(e.node, e.page);
    on_a += e.node == "a";
    EXPECT_EQ(e.generation, 1);
  }
  EXPECT_EQ(distinct.size(), 13u) << "a page was handed out twice";
  EXPECT_EQ(on_a, 10) << "the node with most free pages is used first";
  ASSERT_EQ(p->nodes.size(), 2u);
  EXPECT_EQ(p->nodes[0].address, "addr-a");
  EXPECT_EQ(p->nodes[1].key, "key-b");
  EXPECT_EQ(free_of("a"), 0u);
  EXPECT_EQ(free_of("b"), 3u);

  EXPECT_EQ(get_code("obj"), StatusCode::kNotFound) << "a pending put is not visible";
  ASSERT_TRUE(cat_->commit_put("tok", "obj", {0xfeedface}, "L", 0ms).is_ok());
  // A retried commit (reply lost) is fine; so is a retried begin_put of the same token.
  EXPECT_TRUE(cat_->commit_put("tok", "obj", {0xfeedface}, "L", 0ms).is_ok());

  auto g = cat_->begin_get("obj", "r1", 30s);
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  EXPECT_EQ(g->size, 13 * kPage - 5);
  EXPECT_EQ(g->checksum.value, 0xfeedfaceu);
  EXPECT_EQ(g->layout, "L");
  EXPECT_EQ(g->placement.extents, p->extents);
  EXPECT_TRUE(cat_->end_get("r1", *g).is_ok());

  auto st = cat_->stat("obj");
  ASSERT_TRUE(st.is_ok());
  EXPECT_EQ(st->pages, 13u);
  EXPECT_EQ(st->nodes, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(st->ttl_ms, -1);

  ASSERT_TRUE(cat_->remove("obj").is_ok());
  EXPECT_EQ(free_of("a"), 10u);
  EXPECT_EQ(free_of("b"), 6u);
  EXPECT_EQ(get_code("obj"), StatusCode::kNotFound);
  EXPECT_EQ(cat_->remove("obj").code(), StatusCode::kNotFound);
}

// Every lease the cell grants lasts 1 ms to its longest lease (so does every grant it signs):
// gets, batched gets, puts and reservations refuse a longer one, or none, with kInvalidArgument.
TEST_F(CatalogTest, NoScriptLeasesLongerThanTheCellsLongestLease) {
  ASSERT_TRUE(add_node("a", 8).is_ok());
  put("obj", 1);
  const std::vector<std::string> keys{"obj"}, readers{"r"};
  for (const auto lease : {grant::kMaxLease + 1ms, 0ms, std::chrono::milliseconds(315'360'000'000)}) {
    SCOPED_TRACE(std::to_string(lease.count()) + " ms");
    EXPECT_EQ(cat_->begin_get("obj", "r", lease).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(cat_->begin_gets(keys, readers, lease).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(cat_->begin_put("t-long", "long", kPage, lease).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(cat_->reserve_pages("r-long", kPage, 0, lease).status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(free_of("a"), 7u) << "a refused put or reservation takes no page";
  auto g = cat_->begin_get("obj", "r", grant::kMaxLease);
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  EXPECT_TRUE(cat_->end_get("r", *g).is_ok());
  EXPECT_TRUE(cat_->begin_put("t-longest", "longest", kPage, grant::kMaxLease).is_ok());
}

TEST_F(CatalogTest, PagesComeFromNoNodeTheClientAvoidsWhileOthersHaveRoom) {
  ASSERT_TRUE(add_node("a", 10).is_ok());
  ASSERT_TRUE(add_node("b", 6).is_ok());
  const std::vector<NodeEndpoint> avoid_a{{"a", "addr-a", "key-a"}};
  auto nodes_of = [](const Placement& p) {
    std::set<std::string> ids;
    for (const Extent& e : p.extents) ids.insert(e.node);
    return ids;
  };
  // "a" has most free pages, so it would come first; avoided, "b" alone gives them.
  auto p = cat_->begin_put("t1", "k1", 4 * kPage, 30s, avoid_a);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(nodes_of(*p), std::set<std::string>{"b"});
  auto r = cat_->reserve_pages("t2", kPage, 0, 30s, avoid_a);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(nodes_of(*r), std::set<std::string>{"b"}) << "a reservation avoids as a put does";
  // When only the avoided node has room it is used: it may be back already.
  auto big = cat_->begin_put("t3", "k3", 3 * kPage, 30s, avoid_a);
  ASSERT_TRUE(big.is_ok()) << big.status().to_string();
  EXPECT_EQ(nodes_of(*big), std::set<std::string>{"a"});
  EXPECT_EQ(free_of("a"), 7u);
  EXPECT_EQ(free_of("b"), 1u);
  // Nodes that are not in the cell change nothing; nor does a node avoided under a pool key
  // it no longer has (it registered again: it is back).
  const std::vector<NodeEndpoint> gone{{"x", "", "key-x"}, {"a", "addr-a", "key-of-an-earlier-life"}};
  auto q = cat_->begin_put("t4", "k4", kPage, 30s, gone);
  ASSERT_TRUE(q.is_ok()) << q.status().to_string();
  EXPECT_EQ(nodes_of(*q), std::set<std::string>{"a"});
}

TEST_F(CatalogTest, RetriedBeginPutReturnsTheSamePages) {
  ASSERT_TRUE(add_node("a", 8).is_ok());
  auto first = cat_->begin_put("tok", "k", 3 * kPage, 30s).value();
  auto again = cat_->begin_put("tok", "k", 3 * kPage, 30s).value();
  EXPECT_EQ(first.extents, again.extents);
  EXPECT_EQ(free_of("a"), 5u);
  ASSERT_TRUE(cat_->abort_put("tok", kEveryNode).is_ok());
  EXPECT_TRUE(cat_->abort_put("tok", kEveryNode).is_ok()) << "abort is idempotent";
  EXPECT_EQ(free_of("a"), 8u);
  EXPECT_EQ(cat_->commit_put("tok", "k", {1}, "", 0ms).code(), StatusCode::kStale);
}

TEST_F(CatalogTest, OverwriteFreesTheOldPagesUnlessAReaderHoldsThem) {
  ASSERT_TRUE(add_node("a", 8).is_ok());
  put("k", 2);
  put("k", 2);
  EXPECT_EQ(free_of("a"), 6u) << "overwrite must free the replaced object's pages";

  auto g = cat_->begin_get("k", "reader", 30s).value();
  put("k", 3);  // replaces the object the reader is reading
  EXPECT_EQ(free_of("a"), 3u) << "a leased object's pages must stay out of the pool";
  // The old pages were not reused: the read is consistent and ends OK; the zombie goes.
  EXPECT_TRUE(cat_->end_get("reader", g).is_ok());
  EXPECT_EQ(free_of("a"), 5u);
}

TEST_F(CatalogTest, AReaderWhoseLeaseRanOutWhileThePagesWereReusedIsStale) {
  ASSERT_TRUE(add_node("a", 2).is_ok());
  put("k", 2);
  auto g = cat_->begin_get("k", "slow", 100ms).value();
  std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(cat_->remove("k").is_ok());
  EXPECT_EQ(free_of("a"), 2u) << "an expired read lease must not hold pages";
  put("other", 2);  // reuses the pages: generations move on
  EXPECT_EQ(cat_->end_get("slow", g).code(), StatusCode::kStale);
  // Removed but not yet reused is stale too: the page may be reused any moment.
  auto g2 = cat_->begin_get("other", "slow2", 100ms).value();
  std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(cat_->remove("other").is_ok());
  EXPECT_EQ(cat_->end_get("slow2", g2).code(), StatusCode::kStale);
  // A lease that ran out is stale even when nothing touched the pages (yet).
  put("quiet", 1);
  auto g3 = cat_->begin_get("quiet", "late", 100ms).value();
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(cat_->end_get("late", g3).code(), StatusCode::kStale);
  ASSERT_TRUE(cat_->remove("quiet").is_ok());
}

TEST_F(CatalogTest, EndGetsEndsEachLeaseAsEndGetAloneWould) {
  ASSERT_TRUE(add_node("a", 8).is_ok());
  put("fine", 1);
  put("replaced", 2);
  put("late", 1);
  auto fine = cat_->begin_get("fine", "r1", 30s).value();
  auto replaced = cat_->begin_get("replaced", "r2", 30s).value();
  auto late = cat_->begin_get("late", "r3", 100ms).value();
  put("replaced", 2);  // the old pages wait as a zombie for r2
  ASSERT_EQ(free_of("a"), 2u);
  std::this_thread::sleep_for(200ms);  // r3's lease runs out
  using Ended = metadata::Catalog::EndedRead;
  const std::vector<Ended> reads = {{"r1", fine.object_token, fine.placement.extents_text},
                                    {"r2", replaced.object_token, replaced.placement.extents_text},
                                    {"r3", late.object_token, late.placement.extents_text}};
  auto ended = cat_->end_gets(reads);
  ASSERT_TRUE(ended.is_ok()) << ended.status().to_string();
  ASSERT_EQ(ended->size(), 3u);
  EXPECT_TRUE((*ended)[0].is_ok()) << (*ended)[0].to_string();
  EXPECT_TRUE((*ended)[1].is_ok()) << "the zombie's pages were never reused: " << (*ended)[1].to_string();
  EXPECT_EQ((*ended)[2].code(), StatusCode::kStale) << "the lease had run out";
  EXPECT_EQ(free_of("a"), 4u) << "the last reader of the zombie freed its pages";
  // Ending them again: no lease is held any more, so each is stale, and nothing is freed twice.
  auto again = cat_->end_gets(reads);
  ASSERT_TRUE(again.is_ok());
  for (const Status& s : *again) EXPECT_EQ(s.code(), StatusCode::kStale) << s.to_string();
  EXPECT_EQ(free_of("a"), 4u);
  auto none = cat_->end_gets({});
  ASSERT_TRUE(none.is_ok());
  EXPECT_TRUE(none->empty());
}

TEST_F(CatalogTest, FullPoolEvictsLeastRecentlyUsedObjectsWithoutReaders) {
  ASSERT_TRUE(add_node("a", 6).is_ok());
  put("old", 2);
  put("mid", 2);
  put("new", 2);
  auto lease = cat_->begin_get("old", "reader", 30s).value();  // oldest, but leased
  ASSERT_EQ(free_of("a"), 0u);
  put("next", 2);
  EXPECT_EQ(get_code("mid"), StatusCode::kNotFound) << "the least recently used unleased object goes";
  EXPECT_TRUE(cat_->stat("old").is_ok()) << "a leased object must not be evicted";
  EXPECT_TRUE(cat_->stat("new").is_ok());
  EXPECT_TRUE(cat_->stat("next").is_ok());

  // Bigger than the cell: refused without evicting anything.
  auto huge = cat_->begin_put("t-huge", "huge", 7 * kPage, 30s);
  EXPECT_EQ(huge.status().code(), StatusCode::kNoSpace);
  EXPECT_TRUE(cat_->stat("new").is_ok());
  // Fits the cell only if the leased object went: no space, and the lease is honoured.
  auto all = cat_->begin_put("t-all", "all", 6 * kPage, 30s);
  EXPECT_EQ(all.status().code(), StatusCode::kNoSpace);
  EXPECT_TRUE(cat_->stat("old").is_ok());
  EXPECT_TRUE(cat_->stat("new").is_ok()) << "a put that fails anyway must not evict";
  EXPECT_TRUE(cat_->end_get("reader", lease).is_ok());

  auto ev = admin_->evict(3 * kPage).value();
  EXPECT_GE(ev.pages, 3u);
  EXPECT_GE(free_of("a"), 3u);
}

// The arc policy (prelude/policy.lua): objects used twice outlive a scan of new
// ones that LRU would keep instead; a leased object is never evicted; ghosts move p; the
// state reads back; a policy kvstash does not know is refused.
TEST_F(CatalogTest, ArcKeepsObjectsUsedTwiceThroughAScanThatLruKeepsInstead) {
  auto run = [&](const std::string& policy) {
    EXPECT_EQ(admin_->set_policy(policy)->name, policy);
    // Four objects each used once more (T2 under arc), then a scan of eight new ones through a
    // pool of six pages: LRU keeps the last six of the scan, ARC the four and two of the scan.
    for (int i = 0; i < 4; ++i) put(policy + "-hot" + std::to_string(i), 1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(get_code(policy + "-hot" + std::to_string(i)), StatusCode::kOk);
    for (int i = 0; i < 8; ++i) put(policy + "-scan" + std::to_string(i), 1);
    int hot = 0;
    for (int i = 0; i < 4; ++i) hot += cat_->stat(policy + "-hot" + std::to_string(i)).is_ok() ? 1 : 0;
    return hot;
  };
  ASSERT_TRUE(add_node("a", 6).is_ok());
  EXPECT_EQ(admin_->policy()->name, "lru") << "a new cell's policy";
  EXPECT_EQ(run("lru"), 0);
  // Switching drops the scan's objects from the order arc builds: they go first, oldest first.
  EXPECT_EQ(run("arc"), 4);
  auto state = admin_->policy().value();
  EXPECT_EQ(state.t1 + state.t2, 6u);
  EXPECT_EQ(state.t2, 4u);
  EXPECT_GT(state.b1, 0u) << "the scan's evicted keys are remembered";

  // A key B1 remembers comes back: p grows, and it enters T2.
  const std::string ghost = "arc-scan5";  // the last evicted (B1 holds the objects held at most)
  ASSERT_EQ(get_code(ghost), StatusCode::kNotFound);
  const double p_before = state.t1_target;
  put(ghost, 1);
  state = admin_->policy().value();
  EXPECT_GT(state.t1_target, p_before);
  EXPECT_EQ(state.t2, 5u) << "a remembered key enters T2";

  // A get is a use (into T2), and so is a put over a key held, whose new copy's page comes
  // first: with T1 empty, T2's least recent object (hot0) goes for it.
  EXPECT_EQ(get_code("arc-scan7"), StatusCode::kOk);
  put("arc-scan7", 1);
  state = admin_->policy().value();
  EXPECT_EQ(state.t1, 0u);
  EXPECT_EQ(state.t2, 5u);
  EXPECT_EQ(get_code("arc-hot0"), StatusCode::kNotFound);
  // A leased object at the head of the list that goes next is skipped.
  auto lease = cat_->begin_get("arc-hot1", "reader", 30s).value();
  for (const char* key : {"arc-hot2", "arc-hot3", "arc-scan5", "arc-scan7"})
    EXPECT_EQ(get_code(key), StatusCode::kOk);
  put("arc-new1", 1);  // the free page
  put("arc-new2", 1);  // T1 holds no more than p: T2's least recent, hot1, but it is leased: hot2
  EXPECT_TRUE(cat_->stat("arc-hot1").is_ok()) << "a leased object must not be evicted";
  EXPECT_EQ(get_code("arc-hot2"), StatusCode::kNotFound);
  EXPECT_TRUE(cat_->end_get("reader", lease).is_ok());

  // Back to lru: ARC's lists are gone; eviction is least recently used again.
  EXPECT_EQ(admin_->set_policy("lru")->t1, 0u);
  EXPECT_EQ(admin_->set_policy("fifo").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(admin_->policy()->name, "lru");
}

// turn-ttl (prelude/policy.lua) before it has learned anything: a request's
// chunks count from its lookup, a parent outlives its child, a chunk of the next turn finds
// the turn its prefix ends in (or a ghost remembers), objects stored before the switch go
// first, a leased one never.
TEST_F(CatalogTest, TurnTtlEvictsAChildBeforeItsParentAndCountsTurnsAlongTheChain) {
  ASSERT_TRUE(add_node("a", 6).is_ok());
  put("before", 1);  // stored under lru
  EXPECT_EQ(admin_->set_policy("turn-ttl")->name, "turn-ttl");
  const auto put_kept = [&](const std::string& key, const KeepHint& hint) {
    const std::string token = "t-" + key + "-" + std::to_string(++puts_);
    ASSERT_TRUE(cat_->begin_put(token, key, kPage, 30s).is_ok());
    ASSERT_TRUE(
        cat_->commit_put(token, key, {0x1234}, "", 0ms, std::nullopt, 1, keep_hint_text(hint)).is_ok());
  };
  // A first turn of three chunks, saved in the prompt's order.
  const std::vector<std::string> chain{"c0", "c1", "c2", "c3"};
  auto first = cat_->lookup_prefix(chain).value();
  EXPECT_EQ(first.hit, 0u);
  EXPECT_EQ(first.turn, 1u);
  for (std::uint32_t j = 0; j < 3; ++j) {
    put_kept(chain[j],
             {.turn = first.turn, .chunks = 3, .index = j, .tokens = 512, .looked_up = first.clock});
  }
  auto second = cat_->lookup_prefix(chain).value();
  EXPECT_EQ(second.hit, 3u);
  EXPECT_EQ(second.turn, 2u) << "the next turn of the conversation";
  EXPECT_GE(second.clock, first.clock);
  put("x1", 1);
  auto lease = cat_->begin_get("x1", "reader", 30s).value();
  put("x2", 1);  // the pool is full now
  put("x3", 1);
  EXPECT_EQ(get_code("before"), StatusCode::kNotFound) << "stored before turn-ttl: it goes first";
  put("x4", 1);
  EXPECT_EQ(get_code("c2"), StatusCode::kNotFound) << "the child goes before its parents";
  EXPECT_EQ(get_code("c0"), StatusCode::kOk);
  EXPECT_EQ(get_code("c1"), StatusCode::kOk);
  // c2's ghost keeps its turn: a request ending at c1 is still the conversation's second turn.
  auto third = cat_->lookup_prefix(chain).value();
  EXPECT_EQ(third.hit, 2u);
  EXPECT_EQ(third.turn, 2u);
  EXPECT_EQ(admin_->policy()->ghosts, 1u);
  put("x5", 1);  // x1 was used first, but it is leased: x2 goes
  EXPECT_TRUE(cat_->stat("x1").is_ok()) << "a leased object must not be evicted";
  EXPECT_EQ(get_code("x2"), StatusCode::kNotFound);
  EXPECT_TRUE(cat_->end_get("reader", lease).is_ok());
  auto state = admin_->policy().value();
  EXPECT_EQ(state.ordered, 6u);
  EXPECT_EQ(state.clock_rate, 1.0);
  EXPECT_EQ(admin_->set_policy("turn-ttl", 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(admin_->set_policy("lru")->ordered, 0u) << "turn-ttl's order is dropped";
}

// turn-ttl learns: chunks of a class that comes back (a conversation's next turn, two minutes
// later) are kept through a scan of one-shot prompts that LRU keeps instead. Its clock runs a
// thousand times as fast here: reuse gaps of minutes in a fraction of a second.
TEST_F(CatalogTest, TurnTtlLearnsToKeepChunksThatComeBackThroughAScanOfOneShotPrompts) {
  const auto run = [&](const std::string& policy, const std::string& p) {
    EXPECT_EQ(admin_->set_policy(policy, 1000)->name, policy);
    const auto put_kept = [&](const std::string& key, const KeepHint& hint) {
      const std::string token = "t-" + key + "-" + std::to_string(++puts_);
      auto placed = cat_->begin_put(token, key, kPage, 30s);
      ASSERT_TRUE(placed.is_ok()) << placed.status().to_string();
      ASSERT_TRUE(
          cat_->commit_put(token, key, {0x1234}, "", 0ms, std::nullopt, 1, keep_hint_text(hint)).is_ok());
    };
    const auto use_kept = [&](const std::string& key, const KeepHint& hint) {
      const std::vector<std::string> keys{key}, readers{"reader"}, hints{keep_hint_text(hint)};
      auto got = cat_->begin_gets(keys, readers, 30s, hints).value();
      if (!got[0].is_ok()) return false;
      using Ended = metadata::Catalog::EndedRead;
      const std::vector<Ended> done{{"reader", got[0]->object_token, got[0]->placement.extents_text}};
      (void)cat_->end_gets(done);
      return true;
    };
    // A conversation's chunk (a second turn) and a one-shot prompt's (a first), each its
    // prompt's last.
    const auto conversation = [](std::uint64_t i) {
      return KeepHint{.turn = 2, .chunks = 1, .index = 0, .tokens = 512, .key_hash = i, .split_hash = i};
    };
    const auto one_shot = [](std::uint64_t i) {
      return KeepHint{.turn = 1, .chunks = 1, .index = 0, .tokens = 512, .key_hash = i, .split_hash = i};
    };
    // Learning: each round a new chunk of each, and the conversation chunk of twenty rounds
    // ago used again; 1,500 policy seconds (900 before a reuse gap counts).
    const auto start = std::chrono::steady_clock::now();
    int reused = 0;
    for (std::uint64_t i = 0; std::chrono::steady_clock::now() - start < 1500ms; ++i) {
      put_kept(p + "conv" + std::to_string(i), conversation(i));
      put_kept(p + "once" + std::to_string(i), one_shot(1000000 + i));
      if (i >= 20 && use_kept(p + "conv" + std::to_string(i - 20), conversation(i - 20))) ++reused;
      std::this_thread::sleep_for(3ms);
    }
    EXPECT_GT(reused, 50);
    // Then a conversation's chunk, and a scan of one-shot prompts as many as the pool holds.
    put_kept(p + "kept", conversation(7));
    for (int i = 0; i < 64; ++i) put_kept(p + "scan" + std::to_string(i), one_shot(2000000 + i));
    return cat_->stat(p + "kept").is_ok();
  };
  ASSERT_TRUE(add_node("a", 64).is_ok());
  EXPECT_FALSE(run("lru", "l-")) << "LRU keeps the scan";
  EXPECT_TRUE(run("turn-ttl", "t-")) << "turn-ttl keeps the conversation's chunk";
}

TEST_F(CatalogTest, ExpiredObjectsVanishAndReclaimReturnsTheirPages) {
  ASSERT_TRUE(add_node("a", 4).is_ok());
  put("short", 1, 100ms);
  put("swept", 2, 100ms);
  put("kept", 1, 30s);
  auto st = cat_->stat("short").value();
  EXPECT_GT(st.ttl_ms, 0);
  EXPECT_LE(st.ttl_ms, 100);
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(get_code("short"), StatusCode::kNotFound);  // released on the spot
  EXPECT_EQ(free_of("a"), 1u);
  auto counts = node_->reclaim().value();
  EXPECT_EQ(counts.expired, 1u);  // "swept"
  EXPECT_EQ(free_of("a"), 3u);
  EXPECT_TRUE(cat_->stat("kept").is_ok());
}

TEST_F(CatalogTest, TouchSetsANewTimeToLive) {
  ASSERT_TRUE(add_node("a", 4).is_ok());
  put("k", 1, 150ms);
  ASSERT_TRUE(cat_->touch("k", 30s).is_ok());
  std::this_thread::sleep_for(250ms);
  EXPECT_TRUE(cat_->stat("k").is_ok()) << "touch must extend the TTL";
  ASSERT_TRUE(cat_->touch("k", 0ms).is_ok());
  EXPECT_EQ(cat_->stat("k")->ttl_ms, -1);
  EXPECT_EQ(cat_->touch("absent", 1s).code(), StatusCode::kNotFound);
}

TEST_F(CatalogTest, AbandonedPutsAreReclaimedOnceTheirNodeFencedThroughTheirLease) {
  ASSERT_TRUE(add_node("a", 4).is_ok());
  auto p = cat_->begin_put("dead-client", "k", 3 * kPage, 100ms);
  ASSERT_TRUE(p.is_ok());
  EXPECT_GT(p->lease_deadline_ms, 0);
  EXPECT_EQ(free_of("a"), 1u);
  std::this_thread::sleep_for(200ms);
  // Past its lease, but the node has not fenced it: a write of it may still be queued there.
  auto counts = node_->reclaim().value();
  EXPECT_EQ(counts.abandoned_puts, 0u);
  EXPECT_EQ(counts.fencing_puts, 1u);
  EXPECT_EQ(free_of("a"), 1u) << "pages returned before the node fenced the put";
  ASSERT_TRUE(node_->heartbeat("a", "e1", 30s, p->lease_deadline_ms - 1).is_ok());
  EXPECT_EQ(node_->reclaim()->abandoned_puts, 0u) << "a fence short of the deadline does not cover it";
  ASSERT_TRUE(node_->heartbeat("a", "e1", 30s, p->lease_deadline_ms).is_ok());
  counts = node_->reclaim().value();
  EXPECT_EQ(counts.abandoned_puts, 1u);
  EXPECT_EQ(counts.fencing_puts, 0u);
  EXPECT_EQ(free_of("a"), 4u);
  EXPECT_EQ(cat_->commit_put("dead-client", "k", {1}, "", 0ms).code(), StatusCode::kStale);
  EXPECT_EQ(get_code("k"), StatusCode::kNotFound);
}

// A failed put whose nodes did not all confirm its fence: the confirmed node's pages return
// at once, the other's once that node has fenced through the put's lease.
TEST_F(CatalogTest, AnAbortFreesThePagesOfTheNodesThatConfirmedItsFence) {
  ASSERT_TRUE(add_node("a", 3).is_ok());
  ASSERT_TRUE(add_node("b", 3).is_ok());
  auto p = cat_->begin_put("t", "k", 6 * kPage, 100ms);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(free_of("a") + free_of("b"), 0u);
  const std::vector<std::string> only_a{"a"};
  EXPECT_EQ(cat_->abort_put("t", only_a).value(), 3u) << "b's three pages wait";
  EXPECT_EQ(free_of("a"), 3u);
  EXPECT_EQ(free_of("b"), 0u);
  EXPECT_EQ(cat_->commit_put("t", "k", {1}, "", 0ms).code(), StatusCode::kStale) << "an aborted put commits";
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(node_->reclaim()->abandoned_puts, 0u) << "b has not fenced the put";
  ASSERT_TRUE(node_->heartbeat("b", "e1", 30s, p->lease_deadline_ms).is_ok());
  EXPECT_EQ(node_->reclaim()->abandoned_puts, 1u);
  EXPECT_EQ(free_of("b"), 3u);
  EXPECT_EQ(cat_->abort_put("t", only_a).value(), 0u) << "abort is idempotent";
}

// Schema 4: pages allocated together are one run, in the record and on the free list, and a
// run's pages return together.
TEST_F(CatalogTest, PagesAllocatedTogetherAreOneRunAndReturnAsOne) {
  ASSERT_TRUE(add_node("a", 64).is_ok());
  const std::string prefix = cat_->prefix();
  auto text = [&](const std::vector<std::string_view>& args) {
    auto r = redis_->command(args);
    return r.is_ok() && !r->is_nil() ? std::string(r->str()) : std::string();
  };
  auto free_runs = [&] { return redis_->command({"LLEN", prefix + ":free:a"})->integer(); };
  Placement k = put("k", 32);
  ASSERT_EQ(k.extents.size(), 32u);
  for (std::size_t i = 0; i < 32; ++i) {
    EXPECT_EQ(k.extents[i].page, i);
    EXPECT_EQ(k.extents[i].generation, k.extents[0].generation);
  }
  EXPECT_EQ(text({"HGET", prefix + ":obj:k", "extents"}),
            "a,0," + std::to_string(k.extents[0].generation) + ",32");
  ASSERT_TRUE(cat_->remove("k").is_ok());
  EXPECT_EQ(free_runs(), 1) << "32 pages return as one run";
  EXPECT_EQ(free_of("a"), 64u);
  EXPECT_EQ(text({"HGET", prefix + ":node:a", "free_pages"}), "32");
  // The freed run serves the next two puts, oldest pages first, split between them.
  Placement k2 = put("k2", 16), k3 = put("k3", 16);
  EXPECT_EQ(k2.extents.front().page, 0u);
  EXPECT_EQ(k3.extents.front().page, 16u);
  EXPECT_GT(k2.extents.front().generation, k.extents.front().generation)
      << "page 0 again: a later generation";
  EXPECT_EQ(free_runs(), 0);
  EXPECT_EQ(text({"HGET", prefix + ":node:a", "free_pages"}), "0");
  EXPECT_EQ(free_of("a"), 32u);
  // Ending k's read lease late checks k's run against its first page, which k2 holds now:
  // stale, and nothing of k2 or k3 moves.
  ASSERT_TRUE(cat_->remove("k2").is_ok());
  EXPECT_EQ(free_of("a"), 48u);
  EXPECT_TRUE(cat_->begin_get("k3", "r", 1s).is_ok());
  // No object spans more pages than a client reads back.
  auto huge = cat_->begin_put("huge", "huge", (kMaxObjectPages + 1) * kPage, 30s);
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument) << huge.status().to_string();
}

// A cell knows at most 1,024 nodes, so that the scripts that walk its node lists stay bounded:
// a new id beyond that is refused, one it knows still registers again.
TEST_F(CatalogTest, ACellKnowsAtMost1024Nodes) {
  for (int i = 0; i < 1024; ++i) {
    std::string id = object_key(i);
    id[0] = 'n';
    ASSERT_TRUE(add_node(id, 1).is_ok()) << i;
  }
  const Status more = add_node("n1024", 1);
  EXPECT_EQ(more.code(), StatusCode::kInvalidArgument) << more.to_string();
  EXPECT_NE(more.message().find("kvstash node rm"), std::string::npos) << more.to_string();
  EXPECT_TRUE(add_node("n7", 1).is_ok()) << "a known node registers again";
}

// No script's work grows faster than the runs of the object it touches, and no object spans
// more than 4,096 pages, so no script holds Redis for long whatever the object (without these
// bounds a 65,536-page object can hold it for 0.13-0.49 s per script, and a commit of 4,096
// scattered pages for 2 s). Timed by Redis's own SLOWLOG, as a ratio: 4x the runs may cost
// about 4x, not 16x.
TEST_F(CatalogTest, ScriptTimeGrowsWithTheRunsOfAnObjectNotTheirSquareAndObjectsAreCapped) {
  ASSERT_TRUE(redis_->command({"CONFIG", "SET", "slowlog-log-slower-than", "0"}).is_ok());
  auto slowest_commit = [&](const std::string& node, std::uint64_t runs) -> std::int64_t {
    EXPECT_TRUE(add_node(node, 2 * runs).is_ok());
    for (std::uint64_t i = 0; i < 2 * runs; ++i) put(node + "-s" + std::to_string(i), 1);
    for (std::uint64_t i = 0; i < 2 * runs; i += 2)
      EXPECT_TRUE(cat_->remove(node + "-s" + std::to_string(i)).is_ok());
    // The node's free pages are `runs` single pages, none next to another.
    const std::string res = "res-" + node;
    auto r = cat_->reserve_pages(res, runs * kPage, 0, 30s);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_TRUE(redis_->command({"SLOWLOG", "RESET"}).is_ok());
    EXPECT_TRUE(
        cat_->commit_reserved({res, 0, runs}, "t-big-" + node, "big-" + node, runs * kPage, {1}, "", 0ms)
            .is_ok());
    auto log = redis_->command({"SLOWLOG", "GET", "16"});
    std::int64_t most = 0;
    for (std::size_t i = 0; log.is_ok() && i < log->size(); ++i) {
      const redisReply* entry = log->element(i);  // id, time, microseconds, command, ...
      if (entry->type == REDIS_REPLY_ARRAY && entry->elements > 2)
        most = std::max<std::int64_t>(most, entry->element[2]->integer);
    }
    auto stopped = node_->drain_node(node, "e1");  // its pages out of the next round's way
    EXPECT_TRUE(stopped.is_ok());
    return most;
  };
  const std::int64_t small = slowest_commit("a", 1024), large = slowest_commit("b", 4096);
  ASSERT_GT(small, 0);
  EXPECT_LT(large, 8 * small) << "1,024 scattered pages: " << small << " us, 4,096: " << large << " us";
  auto huge = cat_->begin_put("huge", "huge", 4097 * kPage, 30s);
  EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument) << huge.status().to_string();
  EXPECT_NE(huge.status().message().find("at most 4096 pages"), std::string::npos)
      << huge.status().to_string();
}

// Commits carve their pages out of a reservation in any order; pages a commit took, an abort
// freed or the client released can never be committed again, and what is left stays
// committable.
TEST_F(CatalogTest, CommitsCarveTheirPagesOutOfAReservationInAnyOrder) {
  ASSERT_TRUE(add_node("a", 16).is_ok());
  auto r = cat_->reserve_pages("res", 15 * kPage, 0, 30s);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->extents.size(), 15u);
  EXPECT_EQ(free_of("a"), 1u);
  auto commit = [&](std::uint64_t first, std::uint64_t count, const std::string& key) {
    return cat_->commit_reserved({"res", first, count}, "p-" + key, key, count * kPage, {1}, "", 0ms);
  };
  auto pages_of = [&](const std::string& key) {
    std::vector<std::uint64_t> pages;
    auto g = cat_->begin_get(key, "r-" + key, 1s);
    if (!g.is_ok()) return pages;
    for (const Extent& e : g->placement.extents) pages.push_back(e.page);
    EXPECT_TRUE(cat_->end_get("r-" + key, *g).is_ok());
    return pages;
  };
  auto reserved = [&](std::uint64_t first, std::uint64_t count) {
    std::vector<std::uint64_t> pages;
    for (std::uint64_t i = first; i < first + count; ++i) pages.push_back(r->extents[i].page);
    return pages;
  };
  ASSERT_TRUE(commit(9, 3, "k3").is_ok());
  ASSERT_TRUE(commit(0, 3, "k1").is_ok());
  ASSERT_TRUE(commit(3, 3, "k2").is_ok());
  EXPECT_EQ(pages_of("k3"), reserved(9, 3));
  EXPECT_EQ(pages_of("k1"), reserved(0, 3));
  EXPECT_EQ(pages_of("k2"), reserved(3, 3));
  EXPECT_EQ(commit(2, 2, "overlap").code(), StatusCode::kStale) << "pages k1 and k2 took";
  EXPECT_EQ(cat_->stat("overlap").status().code(), StatusCode::kNotFound);
  // A put of [6, 9) fails; its node confirmed: those pages return at once.
  const std::vector<std::string> only_a{"a"};
  EXPECT_EQ(cat_->abort_reserved({"res", 6, 3}, only_a).value(), 0u);
  EXPECT_EQ(free_of("a"), 4u);
  EXPECT_EQ(commit(6, 1, "aborted").code(), StatusCode::kStale) << "an aborted put's page";
  // k2 goes; its commit repeated (a retry after a lost reply) must not take pages again.
  ASSERT_TRUE(cat_->remove("k2").is_ok());
  EXPECT_EQ(free_of("a"), 7u);
  EXPECT_EQ(commit(3, 3, "k2").code(), StatusCode::kStale);
  EXPECT_EQ(free_of("a"), 7u);
  // The store closes: [12, 15) were never handed out.
  EXPECT_EQ(cat_->release_reservation("res", 12, false).value(), 3u);
  EXPECT_EQ(free_of("a"), 10u);
  EXPECT_EQ(commit(12, 1, "late").code(), StatusCode::kInvalidArgument) << "released: past the end";
  EXPECT_EQ(cat_->release_reservation("res", 12, true).value(), 0u);
  EXPECT_EQ(redis_->command({"EXISTS", cat_->prefix() + ":put:res"})->integer(), 0)
      << "every page handed out was committed or freed: the record goes";
  EXPECT_EQ(pages_of("k1"), reserved(0, 3));
  EXPECT_EQ(pages_of("k3"), reserved(9, 3));
  // Every page is accounted for: the 6 of k1 and k3, and 10 free, in runs the counter matches.
  std::uint64_t in_runs = 0;
  auto list = redis_->command({"LRANGE", cat_->prefix() + ":free:a", "0", "-1"});
  ASSERT_TRUE(list.is_ok());
  for (std::size_t i = 0; i < list->size(); ++i) {
    const std::string e(list->element(i)->str, list->element(i)->len);
    const auto comma = e.find(',');
    in_runs += comma == std::string::npos ? 1 : std::stoull(e.substr(comma + 1));
  }
  auto counted = redis_->command({"HGET", cat_->prefix() + ":node:a", "free_pages"});
  ASSERT_TRUE(counted.is_ok());
  EXPECT_EQ(std::to_string(in_runs), std::string(counted->str()));
  EXPECT_EQ(free_of("a"), 10u);
}

// A page reservation: puts commit runs of it in one script each; the commits raise the pages'
// generation, so ending the reservation frees only what no commit took.
TEST_F(CatalogTest, AReservationsCommittedRunsOutliveItAndItsOtherPagesReturn) {
  ASSERT_TRUE(add_node("a", 10).is_ok());
  auto r = cat_->reserve_pages("res", 2 * kPage, 6 * kPage, 100ms);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->extents.size(), 4u) << "2 needed, and a quarter of the 8 other free pages";
  EXPECT_EQ(free_of("a"), 6u);
  ASSERT_TRUE(cat_->commit_reserved({"res", 0, 2}, "p1", "k1", 2 * kPage, {1}, "", 0ms).is_ok());
  EXPECT_TRUE(cat_->commit_reserved({"res", 0, 2}, "p1", "k1", 2 * kPage, {1}, "", 0ms).is_ok())
      << "a repeated commit (a lost reply) succeeds";
  auto got = cat_->begin_get("k1", "reader", 1s);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got->placement.extents[i].page, r->extents[i].page);
    EXPECT_EQ(got->placement.extents[i].generation, r->extents[i].generation + 1);
  }
  EXPECT_EQ(cat_->commit_reserved({"res", 2, 3}, "p2", "k2", 3 * kPage, {1}, "", 0ms).code(),
            StatusCode::kInvalidArgument)
      << "a run past the reservation's end";
  // Past its lease and fenced: the two pages no commit took return, k1's stay k1's.
  std::this_thread::sleep_for(150ms);
  ASSERT_TRUE(node_->heartbeat("a", "e1", 30s, r->lease_deadline_ms).is_ok());
  EXPECT_EQ(node_->reclaim()->abandoned_puts, 1u);
  EXPECT_EQ(free_of("a"), 8u);
  EXPECT_TRUE(cat_->begin_get("k1", "reader2", 1s).is_ok());
  EXPECT_EQ(cat_->commit_reserved({"res", 2, 1}, "p2", "k2", kPage, {1}, "", 0ms).code(), StatusCode::kStale)
      << "a commit after the reservation was reclaimed";
  EXPECT_EQ(get_code("k2"), StatusCode::kNotFound);
}

TEST_F(CatalogTest, AReservationReleasesWhatNoPutTookAndAbortsFreeConfirmedPages) {
  ASSERT_TRUE(add_node("a", 3).is_ok());
  ASSERT_TRUE(add_node("b", 3).is_ok());
  auto r = cat_->reserve_pages("res", 4 * kPage, 0, 30s);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->extents.size(), 4u) << "no free pages beyond the need: nothing extra";
  // A put of the first two pages fails; only node a confirmed that its writes cannot land.
  const std::string on_first = r->extents[0].node, other = on_first == "a" ? "b" : "a";
  const std::vector<std::string> confirmed{on_first};
  const auto first_two_on = [&](const std::string& id) {
    return static_cast<std::uint64_t>(r->extents[0].node == id) + (r->extents[1].node == id);
  };
  EXPECT_EQ(cat_->abort_reserved({"res", 0, 2}, confirmed).value(), first_two_on(other));
  EXPECT_EQ(free_of(on_first) + free_of(other), 2u + first_two_on(on_first));
  // The store closes: pages 2 and 3 were never given to a put and return at once.
  EXPECT_EQ(cat_->release_reservation("res", 2).value(), 2u);
  EXPECT_EQ(cat_->release_reservation("res", 2).value(), 0u) << "release is idempotent";
  EXPECT_EQ(free_of("a") + free_of("b"), 4u + first_two_on(on_first));
  EXPECT_EQ(cat_->commit_reserved({"res", 2, 1}, "p", "k", kPage, {1}, "", 0ms).code(),
            StatusCode::kInvalidArgument)
      << "released pages cannot be committed";
  EXPECT_EQ(cat_->stat("k").status().code(), StatusCode::kNotFound);
}

TEST_F(CatalogTest, AReservedCommitOnALeavingNodeOrAFailedConditionIsStale) {
  ASSERT_TRUE(add_node("a", 4).is_ok());
  put("k", 1);
  auto r = cat_->reserve_pages("res", kPage, kPage, 30s);
  ASSERT_TRUE(r.is_ok());
  ASSERT_EQ(r->extents.size(), 1u) << "a quarter of the two other free pages rounds down to none";
  Status cond = cat_->commit_reserved({"res", 0, 1}, "p", "k", kPage, {1}, "", 0ms, std::string(""));
  EXPECT_EQ(cond.code(), StatusCode::kStale);
  EXPECT_TRUE(Catalog::condition_failed(cond)) << cond.to_string();
  EXPECT_EQ(free_of("a"), 3u) << "the refused put's page is free again";
  auto r2 = cat_->reserve_pages("res2", kPage, 0, 30s);
  ASSERT_TRUE(r2.is_ok());
  ASSERT_TRUE(node_->drain_node("a", "e1").is_ok());
  Status leaving = cat_->commit_reserved({"res2", 0, 1}, "p2", "k2", kPage, {1}, "", 0ms);
  EXPECT_EQ(leaving.code(), StatusCode::kStale) << leaving.to_string();
  EXPECT_FALSE(Catalog::condition_failed(leaving));
}

// A node past its heartbeat deadline cannot take it up again: pages may have been freed
// without its fence, so it must register again, after fencing its whole pool.
TEST_F(CatalogTest, ANodePastItsDeadlineMustRegisterAgainEvenBeforeItIsSwept) {
  ASSERT_TRUE(add_node("a", 2, 200ms).is_ok());
  EXPECT_TRUE(node_->heartbeat("a", "e1", 200ms, 0).is_ok());
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(node_->heartbeat("a", "e1", 30s, 0).status().code(), StatusCode::kStale);
}

// Dropping a dead or restarted node's objects is unbounded work: they become unreadable at
// once and each reclaim releases a bounded batch of them.
TEST_F(CatalogTest, ADeadNodesObjectsAreSweptInBatches) {
  ASSERT_TRUE(add_node("a", 40, 200ms).is_ok());
  for (int i = 0; i < 25; ++i) put(object_key(i), 1);
  std::this_thread::sleep_for(300ms);
  auto first = node_->reclaim(10).value();
  EXPECT_EQ(first.dead_nodes, 1u);
  EXPECT_EQ(first.orphaned_objects, 25u);
  auto lru = [&] { return redis_->command({"ZCARD", cat_->prefix() + ":lru"})->integer(); };
  EXPECT_EQ(lru(), 15) << "one reclaim released a batch of 10";
  ASSERT_TRUE(node_->reclaim(10).is_ok());
  EXPECT_EQ(lru(), 5);
  ASSERT_TRUE(node_->reclaim(10).is_ok());
  EXPECT_EQ(lru(), 0);
  EXPECT_EQ(redis_->command({"EXISTS", cat_->prefix() + ":sweep"})->integer(), 0) << "the sweep list emptied";
}

// Eviction makes room only where a put can use it: objects on a cordoned node stay.
TEST_F(CatalogTest, EvictionOnlyCountsPagesOnNodesThatTakeAllocations) {
  ASSERT_TRUE(add_node("a", 2).is_ok());
  ASSERT_TRUE(add_node("b", 2).is_ok());
  put("x", 2);  // the most free node first: a or b
  const std::string x_node = cat_->stat("x")->nodes.at(0);
  put("y", 2);
  ASSERT_TRUE(admin_->cordon_node(x_node).is_ok());  // x, the least recently used, sits there
  auto p = cat_->begin_put("t", "z", 2 * kPage, 30s);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(cat_->stat("x").is_ok()) << "evicting x frees nothing the put can use";
  EXPECT_EQ(get_code("y"), StatusCode::kNotFound);
  for (const Extent& e : p->extents) EXPECT_NE(e.node, x_node);
}

// A put short of room looks at a bounded part of the LRU for objects to evict (what it needs
// plus 256 entries), never the whole cell: behind 300 leased objects it finds no room and says
// so, instead of holding Redis while it walks a million.
TEST_F(CatalogTest, EvictionWalksABoundedPartOfTheLru) {
  ASSERT_TRUE(add_node("a", 301).is_ok());
  for (int i = 0; i < 301; ++i) put(object_key(i), 1);
  for (int i = 0; i < 300; ++i) ASSERT_TRUE(cat_->begin_get(object_key(i), "r", 30s).is_ok());
  ASSERT_TRUE(cat_->touch("o300", 0ms).is_ok());
  // o300, the only unleased object, stands 301st in the LRU: past the walk's bound.
  EXPECT_EQ(cat_->begin_put("t", "new", kPage, 30s).status().code(), StatusCode::kNoSpace);
  EXPECT_TRUE(cat_->stat("o300").is_ok());
  // Read 100 of the leased ones again (to the LRU's tail, with leases that end at once): o300
  // now stands within the bound, and the same put evicts it.
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(cat_->begin_get(object_key(i), "r", 1ms).is_ok());
  std::this_thread::sleep_for(50ms);
  auto p = cat_->begin_put("t2", "new", kPage, 30s);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(get_code("o300"), StatusCode::kNotFound);
}

TEST_F(CatalogTest, ADeadNodesObjectsVanishAndItMustRegisterAgain) {
  ASSERT_TRUE(add_node("a", 4, 200ms).is_ok());
  ASSERT_TRUE(add_node("b", 4).is_ok());
  put("spans", 6);  // more than one node holds: spread over a and b
  ASSERT_EQ(cat_->stat("spans")->nodes.size(), 2u);
  put("on-b", 1);
  std::this_thread::sleep_for(300ms);  // a misses its heartbeat
  EXPECT_EQ(get_code("spans"), StatusCode::kNotFound) << "an object on a dead node must vanish";
  EXPECT_EQ(free_of("b"), 3u) << "its pages on live nodes come back";
  auto p = cat_->begin_put("t", "fresh", 2 * kPage, 30s).value();
  for (const Extent& e : p.extents) EXPECT_EQ(e.node, "b") << "a dead node got pages";
  ASSERT_TRUE(cat_->abort_put("t", kEveryNode).is_ok());

  auto counts = node_->reclaim().value();
  EXPECT_EQ(counts.dead_nodes, 1u);
  EXPECT_EQ(node_->heartbeat("a", "e1", 30s, 0).status().code(), StatusCode::kStale);
  EXPECT_EQ(admin_->node_status("a")->state, "dead");
  EXPECT_EQ(admin_->list_nodes().value(), std::vector<std::string>{"b"});
  ASSERT_TRUE(add_node("a", 4, 30s, "e2").is_ok());
  EXPECT_EQ(free_of("a"), 4u);
  EXPECT_TRUE(node_->heartbeat("a", "e2", 30s, 0).is_ok());
  EXPECT_TRUE(cat_->stat("on-b").is_ok());
}

TEST_F(CatalogTest, ARestartedNodeDropsTheObjectsOfItsPreviousLife) {
  ASSERT_TRUE(add_node("a", 4, 300ms).is_ok());
  put("k", 2);
  auto pending = cat_->begin_put("inflight", "p", kPage, 30s).value();
  // While the old incarnation is alive the id is taken: two daemons must not share it.
  EXPECT_EQ(add_node("a", 4, 30s, "e2").code(), StatusCode::kInvalidArgument);
  std::this_thread::sleep_for(400ms);  // it died (its heartbeat lapsed) and comes back
  ASSERT_TRUE(add_node("a", 4, 30s, "e2").is_ok());
  EXPECT_EQ(get_code("k"), StatusCode::kNotFound);
  EXPECT_EQ(free_of("a"), 4u);
  EXPECT_EQ(cat_->commit_put("inflight", "p", {1}, "", 0ms).code(), StatusCode::kStale)
      << "a put into the old incarnation's memory must not commit";
  auto fresh = cat_->begin_put("t-new", "n", 4 * kPage, 30s).value();
  for (const Extent& e : fresh.extents) {
    EXPECT_GT(e.generation, pending.extents[0].generation) << "generations must rise across incarnations";
  }
  EXPECT_EQ(node_->heartbeat("a", "e1", 30s, 0).status().code(), StatusCode::kStale);
}

TEST_F(CatalogTest, DrainingNodeTakesNoPagesAndDropsItsObjects) {
  ASSERT_TRUE(add_node("a", 4).is_ok());
  ASSERT_TRUE(add_node("b", 4).is_ok());
  put("k1", 3);  // a or b
  auto where = cat_->stat("k1")->nodes.at(0);
  EXPECT_EQ(node_->drain_node(where, "e1").value(), 1u);
  EXPECT_EQ(get_code("k1"), StatusCode::kNotFound);
  auto p = cat_->begin_put("t", "k2", 4 * kPage, 30s).value();
  for (const Extent& e : p.extents) EXPECT_NE(e.node, where);
  EXPECT_TRUE(node_->heartbeat(where, "e1", 30s, 0).is_ok()) << "a draining node still heartbeats";
  ASSERT_TRUE(node_->deregister_node(where, "e1").is_ok());
  EXPECT_EQ(admin_->node_status(where)->state, "gone");
  EXPECT_EQ(node_->drain_node(where, "other-epoch").status().code(), StatusCode::kStale);
}

TEST_F(CatalogTest, ContainsPrefixCountsLeadingPresentKeys) {
  ASSERT_TRUE(add_node("a", 8).is_ok());
  for (const char* k : {"c0", "c1", "c2", "c4"}) put(k, 1);
  std::vector<std::string> keys{"c0", "c1", "c2", "c3", "c4"};
  EXPECT_EQ(cat_->contains_prefix(keys).value(), 3u);
  EXPECT_EQ(cat_->contains_prefix(std::span(keys).subspan(3)).value(), 0u);
  EXPECT_EQ(cat_->contains_prefix({}).value(), 0u);
  std::vector<std::string> bad{"c0", ""};
  EXPECT_EQ(cat_->contains_prefix(bad).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(CatalogTest, CorruptAndForeignRecordsAreCorruptNotACrash) {
  ASSERT_TRUE(add_node("a", 8).is_ok());
  put("k", 1);
  const std::string obj = cat_->prefix() + ":obj:";
  auto cmd = [&](std::vector<std::string_view> args) { ASSERT_TRUE(redis_->command(args).is_ok()); };

  cmd({"HSET", obj + "k", "size", "twelve"});
  EXPECT_EQ(get_code("k"), StatusCode::kCorrupt);
  cmd({"HSET", obj + "k", "size", "100", "extents", "a,zz,1"});
  EXPECT_EQ(get_code("k"), StatusCode::kCorrupt);
  cmd({"HSET", obj + "k", "extents", "a,0,1;a,1,1;a,2,1"});  // 3 pages for 100 bytes
  EXPECT_EQ(get_code("k"), StatusCode::kCorrupt);
  cmd({"HSET", obj + "k", "extents", "a,0,1,3"});  // a run of 3 pages for 100 bytes
  EXPECT_EQ(get_code("k"), StatusCode::kCorrupt);
  for (std::string_view bad :
       {"a,0,1,0", "a,0,1,1,1", "a,0,1,", "a,0,1,99999999999", "a,18446744073709551615,1,2"}) {
    cmd({"HSET", obj + "k", "extents", bad});
    EXPECT_EQ(get_code("k"), StatusCode::kCorrupt) << bad;
  }
  cmd({"HSET", obj + "k", "extents", "a,0,1", "checksum", "not-hex!"});
  EXPECT_EQ(get_code("k"), StatusCode::kCorrupt);
  cmd({"SET", obj + "foreign", "a string, not a hash"});
  EXPECT_EQ(get_code("foreign"), StatusCode::kCorrupt);
  EXPECT_EQ(cat_->stat("foreign").status().code(), StatusCode::kCorrupt);
  cmd({"HSET", cat_->prefix() + ":cell", "schema", "7"});
  EXPECT_EQ(cat_->check_schema().code(), StatusCode::kCorrupt);
  // Schema 1 freed failed puts' pages without the nodes' fences: refused, by name.
  cmd({"HSET", cat_->prefix() + ":cell", "schema", "1"});
  Status old = cat_->check_schema();
  EXPECT_EQ(old.code(), StatusCode::kCorrupt);
  EXPECT_NE(old.message().find("schema '1'"), std::string::npos) << old.to_string();
  // Schema 2 checksummed objects with one xxh3 stream: refused, saying what changed; and an
  // object whose checksum is of that form is refused by name.
  cmd({"HSET", cat_->prefix() + ":cell", "schema", "2"});
  Status two = cat_->check_schema();
  EXPECT_EQ(two.code(), StatusCode::kCorrupt);
  EXPECT_NE(two.message().find("checksummed"), std::string::npos) << two.to_string();
  cmd({"HSET", obj + "k", "extents", "a,0,1", "checksum", "0123456789abcdef"});
  auto old_sum = cat_->begin_get("k", "r", 1000ms);
  EXPECT_EQ(old_sum.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(old_sum.status().message().find("<hex>/<segment>"), std::string::npos)
      << old_sum.status().to_string();
  // The cell keeps working for well-formed objects.
  cmd({"HSET", cat_->prefix() + ":cell", "schema", "3"});
  EXPECT_EQ(cat_->check_schema().code(), StatusCode::kCorrupt) << "schema 3 kept free pages one by one";
  cmd({"HSET", cat_->prefix() + ":cell", "schema", "4"});
  EXPECT_TRUE(cat_->check_schema().is_ok());
  put("fine", 1);
  EXPECT_TRUE(cat_->stat("fine").is_ok());
}

TEST_F(CatalogTest, RegistrationAndKeysAreValidated) {
  ASSERT_TRUE(add_node("a", 4).is_ok());
  NodeRecord other{"b", "e1", 4096, 4, "addr", "key"};
  EXPECT_EQ(node_->register_node(other, 10s).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(add_node("c", 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(add_node("", 4).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(add_node("bad id;", 4).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(admin_->free_pages("zzz").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(cat_->begin_put("t", "", 1, 1s).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cat_->begin_put("t", std::string(1025, 'k'), 1, 1s).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(CatalogTest, NoNodesIsNoSpace) {
  EXPECT_EQ(cat_->begin_put("t", "k", 1, 1s).status().code(), StatusCode::kNoSpace);
}

// A put refused because every page is busy is told what holds them, and that they come back by
// themselves (Catalog::pages_held: the store waits for them); one beyond the cell's capacity
// is refused for good.
TEST_F(CatalogTest, ARefusalSaysWhatHoldsThePagesAndWhetherTheyComeBack) {
  ASSERT_TRUE(add_node("a", 8).is_ok());
  put("read", 2);
  ASSERT_TRUE(cat_->begin_get("read", "r", 30s).is_ok());                  // 2 pages a reader leases
  ASSERT_TRUE(cat_->begin_put("t-w", "writing", 3 * kPage, 30s).is_ok());  // 3 being written
  ASSERT_TRUE(cat_->reserve_pages("res", kPage, 0, 30s).is_ok());          // 1 reserved ahead
  ASSERT_TRUE(cat_->begin_put("t-f", "failed", 2 * kPage, 30s).is_ok());
  ASSERT_EQ(cat_->abort_put("t-f", {}).value(), 2u);  // 2 wait for the node's fence
  ASSERT_EQ(free_of("a"), 0u);

  auto busy = cat_->begin_put("t-x", "x", kPage, 30s);
  ASSERT_EQ(busy.status().code(), StatusCode::kNoSpace);
  EXPECT_TRUE(Catalog::pages_held(busy.status())) << busy.status().to_string();
  EXPECT_NE(
      busy.status().message().find("0 are free; of the others 3 are being written by puts, 1 reserved ahead "
                                   "by clients, 2 wait for their memory nodes to fence failed puts, and 2 "
                                   "hold objects that readers lease"),
      std::string::npos)
      << busy.status().to_string();
  auto reserve = cat_->reserve_pages("res-2", kPage, 0, 30s);
  EXPECT_TRUE(Catalog::pages_held(reserve.status())) << reserve.status().to_string();

  auto huge = cat_->begin_put("t-h", "huge", 9 * kPage, 30s);
  ASSERT_EQ(huge.status().code(), StatusCode::kNoSpace);
  EXPECT_FALSE(Catalog::pages_held(huge.status())) << "never: " << huge.status().to_string();
  EXPECT_FALSE(Catalog::pages_held(Status::no_space("the caller's own")));
}

}  // namespace
// The batching alone, no Redis: what queues while a batch is being ended goes in the next one,
// every read is handed on exactly once, and one drain runs at a time.
// ---- quotas per key prefix ---------------------------------------------------------------

class QuotaTest : public CatalogTest {
 protected:
  void SetUp() override {
    CatalogTest::SetUp();
    quotas_ = std::make_unique<CellQuotas>(*redis_, admin_->prefix());
    ASSERT_TRUE(add_node("a", 400).is_ok());
    ASSERT_TRUE(add_node("b", 400).is_ok());
  }
  Status set(const std::string& prefix, std::uint64_t objects, std::uint64_t bytes) {
    return quotas_->set(prefix, {objects, bytes}, deadline_after(30s));
  }
  QuotaUse use(const std::string& prefix) {
    auto all = quotas_->list();
    EXPECT_TRUE(all.is_ok()) << all.status().to_string();
    if (!all.is_ok()) return {};
    for (const auto& q : *all) {
      if (q.prefix == prefix) return q;
    }
    ADD_FAILURE() << "no quota for " << prefix;
    return {};
  }
  // A put that may be refused: begin and commit, or the first failure.
  Status try_put(const std::string& key, std::uint64_t pages) {
    const std::string token = "t-" + key + "-" + std::to_string(++puts_);
    auto p = cat_->begin_put(token, key, pages * kPage, 30s);
    if (!p.is_ok()) return p.status();
    return cat_->commit_put(token, key, {0x1234}, "L", 0ms);
  }
  // The objects whose keys start with `prefix`, counted by scanning the cell.
  std::pair<std::uint64_t, std::uint64_t> scanned(const std::string& prefix) {
    std::uint64_t objects = 0, bytes = 0;
    std::string cursor = "0";
    do {
      auto step = admin_->scan_objects(prefix + "*", cursor, 500);
      EXPECT_TRUE(step.is_ok()) << step.status().to_string();
      if (!step.is_ok()) break;
      auto infos = admin_->describe(step->keys);
      EXPECT_TRUE(infos.is_ok()) << infos.status().to_string();
      if (!infos.is_ok()) break;
      for (const auto& info : *infos) {
        if (!info.exists || get_code(info.key) != StatusCode::kOk) continue;
        ++objects;
        bytes += (info.size + kPage - 1) / kPage * kPage;
      }
      cursor = step->cursor;
    } while (cursor != "0");
    return {objects, bytes};
  }
  std::unique_ptr<CellQuotas> quotas_;
};

// A prefix at its quota makes room from its own least recently used objects: the other
// prefixes' objects, older still, stay.
TEST_F(QuotaTest, APrefixAtItsQuotaEvictsItsOwnObjectsNotOthers) {
  put("other/old", 1);
  ASSERT_TRUE(set("t1/", 3, 0).is_ok());
  for (const char* k : {"t1/a", "t1/b", "t1/c"}) put(k, 1);
  EXPECT_EQ(use("t1/").objects, 3u);
  ASSERT_TRUE(try_put("t1/d", 1).is_ok());
  EXPECT_EQ(get_code("t1/a"), StatusCode::kNotFound) << "the prefix's least recently used object makes room";
  for (const char* k : {"t1/b", "t1/c", "t1/d", "other/old"}) EXPECT_EQ(get_code(k), StatusCode::kOk) << k;
  // A read moves an object to the back of its quota's order.
  ASSERT_TRUE(cat_->touch("t1/b", 0ms).is_ok());
  ASSERT_TRUE(try_put("t1/e", 1).is_ok());
  EXPECT_EQ(get_code("t1/c"), StatusCode::kNotFound);
  EXPECT_EQ(get_code("t1/b"), StatusCode::kOk);
  auto q = use("t1/");
  EXPECT_EQ(q.objects, 3u);
  EXPECT_EQ(q.bytes, 3 * kPage);
  EXPECT_EQ(q.evicted, 2u);
  EXPECT_FALSE(q.counting);
  // Overwriting a key at the limit replaces it: nothing else goes.
  ASSERT_TRUE(try_put("t1/e", 2).is_ok());
  for (const char* k : {"t1/b", "t1/d", "t1/e"}) EXPECT_EQ(get_code(k), StatusCode::kOk) << k;
  EXPECT_EQ(use("t1/").bytes, 4 * kPage);
}

TEST_F(QuotaTest, BytesAreWholePagesAndAnObjectLargerThanItsQuotaIsRefused) {
  ASSERT_TRUE(set("t2/", 0, 3 * kPage).is_ok());
  ASSERT_TRUE(try_put("t2/a", 1).is_ok());
  const std::string token = "t-small";
  ASSERT_TRUE(cat_->begin_put(token, "t2/b", 100, 30s).is_ok());  // 100 bytes: one whole page
  ASSERT_TRUE(cat_->commit_put(token, "t2/b", {1}, "L", 0ms).is_ok());
  EXPECT_EQ(use("t2/").bytes, 2 * kPage);
  ASSERT_TRUE(try_put("t2/c", 2).is_ok());
  EXPECT_EQ(get_code("t2/a"), StatusCode::kNotFound);
  EXPECT_EQ(get_code("t2/b"), StatusCode::kOk);
  Status big = try_put("t2/huge", 4);
  EXPECT_EQ(big.code(), StatusCode::kNoSpace) << big.to_string();
  EXPECT_NE(big.message().find("quota of prefix t2/"), std::string::npos) << big.to_string();
  EXPECT_EQ(get_code("t2/b"), StatusCode::kOk) << "a refused put evicts nothing";
  EXPECT_EQ(use("t2/").refused, 1u);
}

// Objects under a read lease are never evicted for a quota: a prefix full of them refuses
// the put, naming the quota, and its objects are intact.
TEST_F(QuotaTest, AQuotaFullOfLeasedObjectsRefusesAndEvictsNothing) {
  ASSERT_TRUE(set("t3/", 2, 0).is_ok());
  put("t3/a", 1);
  put("t3/b", 1);
  ASSERT_TRUE(cat_->begin_get("t3/a", "r", 30s).is_ok());
  ASSERT_TRUE(cat_->begin_get("t3/b", "r", 30s).is_ok());
  Status refused = try_put("t3/c", 1);
  EXPECT_EQ(refused.code(), StatusCode::kNoSpace) << refused.to_string();
  EXPECT_NE(refused.message().find("quota"), std::string::npos) << refused.to_string();
  EXPECT_EQ(get_code("t3/a"), StatusCode::kOk);
  EXPECT_EQ(get_code("t3/b"), StatusCode::kOk);
  EXPECT_EQ(use("t3/").refused, 1u);
  // Other prefixes keep taking puts.
  EXPECT_TRUE(try_put("t4/x", 1).is_ok());
}

// Two puts admitted together cannot both land past the quota: the commit checks again.
TEST_F(QuotaTest, TheCommitHoldsTheQuotaAgainstPutsThatRaced) {
  ASSERT_TRUE(set("r/", 2, 0).is_ok());
  put("r/a", 1);
  ASSERT_TRUE(cat_->begin_get("r/a", "r", 30s).is_ok());  // leased: it cannot make room
  auto p1 = cat_->begin_put("p1", "r/b", kPage, 30s);
  auto p2 = cat_->begin_put("p2", "r/c", kPage, 30s);
  ASSERT_TRUE(p1.is_ok() && p2.is_ok()) << "each alone fits";
  ASSERT_TRUE(cat_->commit_put("p1", "r/b", {1}, "L", 0ms).is_ok());
  ASSERT_TRUE(cat_->begin_get("r/b", "r", 30s).is_ok());
  Status second = cat_->commit_put("p2", "r/c", {1}, "L", 0ms);
  EXPECT_EQ(second.code(), StatusCode::kNoSpace) << second.to_string();
  EXPECT_EQ(get_code("r/c"), StatusCode::kNotFound);
  EXPECT_EQ(use("r/").objects, 2u);
  // A reserved put is held to it the same way.
  auto res = cat_->reserve_pages("res", kPage, 0, 30s);
  ASSERT_TRUE(res.is_ok()) << res.status().to_string();
  Status reserved = cat_->commit_reserved({"res", 0, 1}, "p3", "r/d", kPage, {1}, "", 0ms);
  EXPECT_EQ(reserved.code(), StatusCode::kNoSpace) << reserved.to_string();
  EXPECT_EQ(use("r/").objects, 2u);
}

// Pages not committed yet are the quota's too, from their allocation until the put commits,
// aborts or its lease ends: puts in flight and page reservations cannot hold more of the pool
// than their prefix may (before, a prefix with a 1 MiB quota held 15 MiB this way and the
// quota read 0 B), and what they held comes back.
TEST_F(QuotaTest, UncommittedPagesAreChargedToTheirQuotaUntilTheyEnd) {
  ASSERT_TRUE(set("u/", 0, 4 * kPage).is_ok());
  ASSERT_TRUE(cat_->begin_put("pa", "u/a", 3 * kPage, 30s).is_ok());
  EXPECT_EQ(use("u/").reserved, 3 * kPage);
  EXPECT_EQ(use("u/").bytes, 0u);
  auto over = cat_->begin_put("pb", "u/b", 2 * kPage, 30s);
  EXPECT_EQ(over.status().code(), StatusCode::kNoSpace) << "3 pages in flight and 2 more: past 4";
  EXPECT_TRUE(try_put("other/x", 2).is_ok()) << "another prefix is not held to it";

  const std::vector<std::string> none;
  ASSERT_TRUE(cat_->abort_put("pa", none).is_ok());
  EXPECT_EQ(use("u/").reserved, 0u) << "an abort gives the quota back at once, fenced or not";
  ASSERT_TRUE(cat_->begin_put("pb", "u/b", 2 * kPage, 30s).is_ok());
  ASSERT_TRUE(cat_->commit_put("pb", "u/b", {1}, "L", 0ms).is_ok());
  EXPECT_EQ(use("u/").reserved, 0u);
  EXPECT_EQ(use("u/").bytes, 2 * kPage);

  // A reservation for a key of the prefix: its spare pages stay within the quota's room.
  auto res = cat_->reserve_pages("res", kPage, 8 * kPage, 30s, {}, "u/c");
  ASSERT_TRUE(res.is_ok()) << res.status().to_string();
  EXPECT_EQ(res->extents.size(), 2u) << "4 pages of quota, 2 in objects: the put's page and one spare";
  EXPECT_EQ(use("u/").reserved, 2 * kPage);
  ASSERT_TRUE(cat_->commit_reserved({"res", 0, 1}, "pc", "u/c", kPage, {1}, "", 0ms).is_ok());
  EXPECT_EQ(use("u/").reserved, kPage);
  EXPECT_EQ(use("u/").bytes, 3 * kPage);
  ASSERT_TRUE(cat_->release_reservation("res", 1, true).is_ok());
  EXPECT_EQ(use("u/").reserved, 0u);

  // A put whose lease ended holds nothing of the quota, even while its pages wait for a fence.
  ASSERT_TRUE(cat_->begin_put("pd", "u/d", kPage, 100ms).is_ok());
  EXPECT_EQ(use("u/").reserved, kPage);
  std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(node_->reclaim().is_ok());
  EXPECT_EQ(use("u/").reserved, 0u);
  EXPECT_TRUE(try_put("u/e", 1).is_ok());
}

// A quota set over objects already in the cell counts them; the longest prefix governs; a
// lowered quota comes down as the prefix's next puts evict; a removed and re-added quota
// counts afresh.
TEST_F(QuotaTest, QuotasCountWhatIsThereNestAndChange) {
  for (int i = 0; i < 300; ++i) put("n/" + object_key(i), 1);
  for (int i = 0; i < 20; ++i) put("n/vip/" + object_key(i), 1);
  ASSERT_TRUE(set("n/", 1000, 0).is_ok());
  EXPECT_EQ(use("n/").objects, 320u);
  EXPECT_FALSE(use("n/").counting);
  ASSERT_TRUE(set("n/vip/", 50, 0).is_ok());
  EXPECT_EQ(use("n/").objects, 300u) << "the longer prefix governs its keys";
  EXPECT_EQ(use("n/vip/").objects, 20u);
  ASSERT_TRUE(set("n/", 100, 0).is_ok());
  EXPECT_EQ(use("n/").objects, 300u) << "new limits keep the counts";
  ASSERT_TRUE(try_put("n/new", 1).is_ok());
  EXPECT_EQ(use("n/").objects, 100u) << "an over-quota prefix comes down on its next put";
  EXPECT_EQ(scanned("n/").first, 120u);
  EXPECT_EQ(use("n/vip/").objects, 20u) << "the nested quota's objects were not taken";
  ASSERT_TRUE(set("n/vip/", 0, 0).is_ok());
  EXPECT_EQ(use("n/").objects, 120u) << "a removed quota's objects fall to the shorter prefix";
  ASSERT_TRUE(set("n/vip/", 10, 0).is_ok());
  EXPECT_EQ(use("n/vip/").objects, 20u) << "re-added, it counts afresh";
  EXPECT_EQ(use("n/").objects, 100u);
  EXPECT_EQ(set("", 1, 0).code(), StatusCode::kInvalidArgument);
}

// The counters stay exact through puts, overwrites, removes, expiry, eviction and a dead node.
TEST_F(QuotaTest, CountsStayExactThroughChurn) {
  ASSERT_TRUE(add_node("mortal", 1000, 1s).is_ok());  // the most free: it takes the first puts
  ASSERT_TRUE(set("c/", 40, 60 * kPage).is_ok());
  std::mt19937 rng(7);
  for (int i = 0; i < 400; ++i) {
    const std::string key = "c/" + object_key(static_cast<int>(rng() % 60));
    switch (rng() % 5) {
      case 0: (void)cat_->remove(key); break;
      case 1: {
        const std::string token = "ttl-" + std::to_string(i);
        if (cat_->begin_put(token, key, kPage, 30s).is_ok()) {
          (void)cat_->commit_put(token, key, {1}, "L", std::chrono::milliseconds(1 + rng() % 20));
        }
        break;
      }
      default: (void)try_put(key, 1 + rng() % 3); break;
    }
    if (i == 200) std::this_thread::sleep_for(1200ms);  // "mortal" misses its heartbeat
  }
  std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(node_->reclaim().is_ok());
  const auto [objects, bytes] = scanned("c/");  // every expired or dead object is released by now
  auto q = use("c/");
  EXPECT_EQ(q.objects, objects);
  EXPECT_EQ(q.bytes, bytes);
  EXPECT_LE(q.objects, 40u);
  EXPECT_LE(q.bytes, 60 * kPage);
  EXPECT_GT(q.evicted, 0u);
}

TEST(ReadReleases, BatchesWhatQueuedMeanwhileAndHandsEachReadOnOnce) {
  metadata::ReadReleases releases;
  std::mutex mu;
  std::vector<std::size_t> batches;
  std::multiset<std::string> ended;
  std::atomic<int> drains{0}, running{0}, overlapped{0};
  auto drain = [&] {
    drains.fetch_add(1);
    releases.drain([&](std::span<const metadata::Catalog::EndedRead> batch) {
      if (running.fetch_add(1) != 0) overlapped.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // a round trip
      {
        std::lock_guard lock(mu);
        batches.push_back(batch.size());
        for (const auto& r : batch) ended.insert(r.reader);
      }
      running.fetch_sub(1);
    });
  };
  constexpr int kThreads = 4, kEach = 500;
  std::vector<std::thread> threads;
  std::vector<std::thread> drainers;
  std::mutex drainers_mu;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        std::string reader = std::to_string(t);  // (GCC 12 -O3 warns, wrongly, on "r" + to_string)
        reader.append("-").append(std::to_string(i));
        if (releases.add({std::move(reader), "tok", "a,1,1"})) {
          std::lock_guard lock(drainers_mu);
          drainers.emplace_back(drain);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  {
    std::lock_guard lock(drainers_mu);
    for (auto& d : drainers) d.join();
  }
  EXPECT_EQ(releases.pending(), 0u);
  EXPECT_EQ(overlapped.load(), 0) << "two drains ran at once";
  ASSERT_EQ(ended.size(), static_cast<std::size_t>(kThreads * kEach));
  EXPECT_EQ(std::set<std::string>(ended.begin(), ended.end()).size(), ended.size()) << "a read ended twice";
  std::size_t biggest = 0;
  for (std::size_t b : batches) biggest = std::max(biggest, b);
  EXPECT_LE(biggest, metadata::ReadReleases::kMaxBatch);
  EXPECT_LT(batches.size(), ended.size()) << "reads that queued during a batch went together";
  // Idle again: the next read starts a drain of its own.
  EXPECT_TRUE(releases.add({"late", "tok", "a,1,1"}));
  EXPECT_FALSE(releases.add({"later", "tok", "a,1,1"}));
  drain();
  EXPECT_EQ(releases.pending(), 0u);
}

}  // namespace kvstash::metadata
