// Grants: a leased region's owner serves a lease only under a grant it can verify, over the
// grant's ranges, for its op, until its deadline is fenced. The text form and a memory node's
// check alone; then two engines of this process over tcp and verbs (skipped without an RDMA
// device; the Soft-RoCE lane runs it); then a real kvstashd whose cell signs the grants, probed
// by a raw client that knows the cluster token but was granted nothing.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/grant.h"
#include "kvstash/engine.h"
#include "kvstash/store.h"
#include "metadata/cell.h"
#include "node/node_grants.h"
#include "rdma_lane.h"
#include "test_util.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;

std::vector<std::uint8_t> unhex(const std::string& h) {
  std::vector<std::uint8_t> out;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(std::stoi(h.substr(i, 2), nullptr, 16));
  return out;
}

grant::Terms terms(std::string issuer, std::string epoch, TransferOp op, std::uint64_t deadline,
                   std::vector<std::pair<std::uint64_t, std::uint64_t>> runs) {
  grant::Terms t;
  t.issuer = std::move(issuer);
  t.epoch = std::move(epoch);
  t.op = op;
  t.deadline = deadline;
  t.whole = runs.empty();
  t.runs = std::move(runs);
  return t;
}

// ---- the text form --------------------------------------------------------------------------

TEST(GrantText, VerifiesWhatItsKeySignedAndNothingElse) {
  const auto key = grant::new_key(), other = grant::new_key();
  const std::string g = grant::sign(key, terms("n1", "7", TransferOp::kWrite, 1234, {{3, 2}, {9, 1}}));
  auto t = grant::verify(key, g);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->issuer, "n1");
  EXPECT_EQ(t->epoch, "7");
  EXPECT_EQ(t->op, TransferOp::kWrite);
  EXPECT_EQ(t->deadline, 1234u);
  EXPECT_FALSE(t->whole);
  EXPECT_EQ(t->runs, (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{3, 2}, {9, 1}}));

  EXPECT_EQ(grant::verify(other, g).status().code(), StatusCode::kPermissionDenied) << "another owner's key";
  // Any change to what was signed breaks the MAC: more pages, a later deadline, another op.
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"3+2", "3+9"}, {"1234", "9234"}, {" w ", " r "}, {"n1", "n2"}}) {
    std::string forged = g;
    forged.replace(forged.find(from), from.size(), to);
    EXPECT_EQ(grant::verify(key, forged).status().code(), StatusCode::kPermissionDenied) << forged;
  }
  EXPECT_EQ(grant::verify(key, "").status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(grant::verify(key, "g1 n1 7 r 5 1+1").status().code(), StatusCode::kPermissionDenied) << "no MAC";
  // A signed text of the wrong shape is refused as malformed, never half-read.
  for (const char* bad : {"g1 n1 7 x 5 1+1", "g1 n1 7 r 0 1+1", "g1 n1 7 r 5 1+0", "g1 n1 7 r 5 1-1",
                          "g2 n1 7 r 5 *", "g1 n1 7 r 5 1+1 extra"}) {
    const std::string msg(bad);
    auto signed_bad = grant::sign(key, terms("x", "y", TransferOp::kRead, 1, {}));
    signed_bad = msg + signed_bad.substr(signed_bad.rfind(' '));  // a MAC, but not over this text
    EXPECT_EQ(grant::verify(key, signed_bad).status().code(), StatusCode::kPermissionDenied) << bad;
  }
}

TEST(NodeGrantsCheck, MapsPagesToThePoolAndRefusesOtherNodesAndIncarnations) {
  const std::uint64_t base = 1ull << 30, ps = 4096, pages = 100;
  node::NodeGrants check("n1", base, ps, pages);
  EXPECT_EQ(check.check("anything").status().code(), StatusCode::kPermissionDenied) << "before the first key";
  const auto key = unhex(check.rotate("e1"));
  ASSERT_EQ(key.size(), grant::kKeyBytes);

  auto g = check.check(grant::sign(key, terms("n1", "e1", TransferOp::kRead, 99, {{5, 2}, {7, 1}, {50, 3}})));
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  EXPECT_EQ(g->op, TransferOp::kRead);
  EXPECT_EQ(g->fence, 99u);
  ASSERT_EQ(g->ranges.size(), 2u) << "adjacent runs merge";
  EXPECT_EQ(g->ranges[0].addr, base + 5 * ps);
  EXPECT_EQ(g->ranges[0].length, 3 * ps);
  EXPECT_EQ(g->ranges[1].addr, base + 50 * ps);
  EXPECT_EQ(g->ranges[1].length, 3 * ps);

  auto whole = check.check(grant::sign(key, terms("n1", "e1", TransferOp::kWrite, 99, {})));
  ASSERT_TRUE(whole.is_ok());
  ASSERT_EQ(whole->ranges.size(), 1u);
  EXPECT_EQ(whole->ranges[0].length, pages * ps);

  EXPECT_EQ(check.check(grant::sign(key, terms("n2", "e1", TransferOp::kRead, 99, {{1, 1}}))).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(check.check(grant::sign(key, terms("n1", "e0", TransferOp::kRead, 99, {{1, 1}}))).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(
      check.check(grant::sign(key, terms("n1", "e1", TransferOp::kRead, 99, {{99, 2}}))).status().code(),
      StatusCode::kPermissionDenied)
      << "past the last page";
  // A new registration: the earlier key's grants stop verifying at once.
  const std::string old = grant::sign(key, terms("n1", "e1", TransferOp::kRead, 99, {{1, 1}}));
  check.rotate("e2");
  EXPECT_EQ(check.check(old).status().code(), StatusCode::kPermissionDenied);
}

// Once the node has heard its cell's clock, a grant ending further than the cell's longest lease
// past that clock (now) is no cell's: refused, however well signed.
TEST(NodeGrantsCheck, RefusesAGrantThatOutlivesTheCellsLongestLease) {
  node::NodeGrants check("n1", 1ull << 30, 4096, 100);
  const auto key = unhex(check.rotate("e1"));
  const auto grant_until = [&](std::uint64_t deadline) {
    return check.check(grant::sign(key, terms("n1", "e1", TransferOp::kRead, deadline, {{1, 1}})));
  };
  const std::uint64_t decade = 10ull * 365 * 24 * 3600 * 1000;
  ASSERT_TRUE(grant_until(decade).is_ok()) << "before the node heard the cell's clock, only the MAC counts";
  const std::uint64_t redis_ms = 5'000'000;
  check.set_clock(static_cast<std::int64_t>(redis_ms), Clock::now());
  const std::uint64_t longest = redis_ms + grant::kMaxLease.count();
  EXPECT_TRUE(grant_until(longest).is_ok()) << "the longest lease the cell signs";
  EXPECT_EQ(grant_until(longest + 60'000).status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(grant_until(decade).status().code(), StatusCode::kPermissionDenied);
  // The clock heard a minute ago reads a minute later now.
  check.set_clock(static_cast<std::int64_t>(redis_ms), Clock::now() - 60s);
  EXPECT_TRUE(grant_until(longest + 50'000).is_ok());
}

// The cell signs with a key for the rotation period, then with the next the node hands it;
// a retired key verifies only grants within the longest lease of its retirement (the ones
// the cell signed with it), a key the node never handed out nothing.
TEST(NodeGrantsCheck, RotatesItsKeyAndKeepsTheRetiredOneOnlyForGrantsInFlight) {
  node::NodeGrants check("n1", 1ull << 30, 4096, 100, 0ms);
  const auto first = unhex(check.rotate("e1"));
  const auto grant_by = [&](const std::vector<std::uint8_t>& key, const std::string& word,
                            std::uint64_t deadline) {
    return check.check(grant::sign(key, terms("n1", word, TransferOp::kRead, deadline, {{1, 1}})))
        .status()
        .code();
  };
  const std::uint64_t redis_ms = 5'000'000;
  check.set_clock(static_cast<std::int64_t>(redis_ms), Clock::now());
  const auto next = check.next_key();
  ASSERT_TRUE(next.has_value()) << "a rotation period of 0 is always due";
  EXPECT_EQ(next->word, "e1/1");
  EXPECT_EQ(check.next_key()->hex, next->hex) << "the same key is offered until the cell took it";
  const auto second = unhex(next->hex);
  EXPECT_EQ(grant_by(second, "e1/1", redis_ms + 1000), StatusCode::kOk) << "an offered key may be in Redis";
  EXPECT_EQ(grant_by(first, "e1", redis_ms + 1000), StatusCode::kOk);

  check.installed("e1/1", static_cast<std::int64_t>(redis_ms));
  EXPECT_EQ(check.live_keys(), 2u);
  const std::uint64_t last_signed = redis_ms + grant::kMaxLease.count();
  EXPECT_EQ(grant_by(first, "e1", last_signed), StatusCode::kOk) << "signed just before the rotation";
  EXPECT_EQ(grant_by(first, "e1", last_signed + 30'000), StatusCode::kPermissionDenied)
      << "a retired key minting past what it signed";
  EXPECT_EQ(grant_by(second, "e1/1", last_signed + 30'000), StatusCode::kPermissionDenied)
      << "the clock bound still holds for the current key";
  check.set_clock(static_cast<std::int64_t>(redis_ms + 60'000), Clock::now());
  EXPECT_EQ(grant_by(second, "e1/1", last_signed + 30'000), StatusCode::kOk)
      << "a minute later, it is in reach";
  EXPECT_EQ(grant_by(first, "e1", last_signed + 30'000), StatusCode::kPermissionDenied);

  EXPECT_EQ(grant_by(first, "e1/1", redis_ms + 1000), StatusCode::kPermissionDenied) << "another key's name";
  EXPECT_EQ(grant_by(second, "e1/2", redis_ms + 1000), StatusCode::kPermissionDenied)
      << "a key not handed out";
  EXPECT_EQ(grant_by(second, "e0/1", redis_ms + 1000), StatusCode::kPermissionDenied)
      << "another incarnation";
  check.installed("e1/7", static_cast<std::int64_t>(redis_ms));  // never offered: ignored
  EXPECT_EQ(check.live_keys(), 2u);

  check.rotate("e2");
  EXPECT_EQ(check.live_keys(), 1u);
  EXPECT_EQ(grant_by(second, "e1/1", redis_ms + 1000), StatusCode::kPermissionDenied) << "a new registration";
  EXPECT_EQ(grant_by(first, "e1", redis_ms + 1000), StatusCode::kPermissionDenied);
}

// ---- two engines: a leased region behind a grant check ---------------------------------------

class GrantedLeases : public ::testing::TestWithParam<TransportKind> {
 protected:
  static constexpr std::uint64_t kPages = 64, kPage = 4096;

  void SetUp() override {
    if (GetParam() == TransportKind::kVerbs) {
      const Status verbs = test::verbs_available();
      KVSTASH_REQUIRE_RDMA(verbs.is_ok(), verbs.to_string());
    }
    EngineOptions o;
    o.transports = {GetParam()};
    o.cluster_token = "a-cluster-token-of-32-characters";
    target_ = Engine::create(o).value();
    initiator_ = Engine::create(o).value();
    pool_ = Buffer::allocate(kPages * kPage).value();
    test::fill_random(pool_.bytes(), 11);
    check_ = std::make_shared<node::NodeGrants>("n1", reinterpret_cast<std::uint64_t>(pool_.data()), kPage,
                                                kPages);
    key_ = unhex(check_->rotate("e1"));
    target_->set_grant_check(check_);
    handle_ = target_->register_memory(pool_.region(), Access::kLeased).value();
    auto peer = initiator_->connect(target_->address(), deadline_after(5s));
    ASSERT_TRUE(peer.is_ok()) << peer.status().to_string();
    peer_ = std::move(peer).value();
    auto region = peer_->import_key(handle_.remote_key());
    ASSERT_TRUE(region.is_ok()) << region.status().to_string();
    region_ = std::move(region).value();
    local_ = Buffer::allocate(kPages * kPage).value();
    local_handle_ = initiator_->register_memory(local_.region(), Access::kLocal).value();
  }

  std::uint64_t page(std::uint64_t i) const {
    return reinterpret_cast<std::uint64_t>(pool_.data()) + i * kPage;
  }

  std::string sign(TransferOp op, std::vector<std::pair<std::uint64_t, std::uint64_t>> runs,
                   std::uint64_t deadline = 1'000'000, const std::string& node = "n1") const {
    return grant::sign(key_, terms(node, "e1", op, deadline, std::move(runs)));
  }

  // Leases [first, first + count) pages for `op` under `grant`, then moves them (a read into
  // local_ at the same offsets, a write from it): the first error either step met.
  Status reach(TransferOp op, std::uint64_t first, std::uint64_t count, const std::string& grant) {
    const RemoteRange r{page(first), count * kPage};
    auto lease = peer_->lease(region_, {&r, 1}, {.op = op, .ttl = 5s, .fence = 1'000'000, .grant = grant});
    if (!lease.is_ok()) return lease.status();
    const TransferEntry e{.op = op,
                          .local = &local_handle_,
                          .local_addr = local_.data() + first * kPage,
                          .remote_addr = r.addr,
                          .remote = &*lease,
                          .length = r.length};
    return peer_->transfer({&e, 1}, deadline_after(5s));
  }

  std::unique_ptr<Engine> target_, initiator_;
  Buffer pool_, local_;
  std::shared_ptr<node::NodeGrants> check_;
  std::vector<std::uint8_t> key_;
  MemoryHandle handle_, local_handle_;
  std::unique_ptr<Peer> peer_;
  RemoteMemory region_;
};

INSTANTIATE_TEST_SUITE_P(Transports, GrantedLeases,
                         ::testing::Values(TransportKind::kTcp, TransportKind::kVerbs),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST_P(GrantedLeases, ALeaseReachesExactlyWhatItsGrantAllows) {
  // Granted: pages 2-3 for reading. They read, byte for byte.
  const std::string g = sign(TransferOp::kRead, {{2, 2}});
  ASSERT_TRUE(reach(TransferOp::kRead, 2, 2, g).is_ok());
  EXPECT_EQ(std::memcmp(local_.data() + 2 * kPage, pool_.data() + 2 * kPage, 2 * kPage), 0);
  // Everything else is refused: no grant, a made-up one, another node's, a page beside the
  // grant, the whole pool, and a write under a read grant.
  const auto before = std::vector<std::byte>(pool_.data(), pool_.data() + pool_.size());
  test::fill_random(local_.bytes(), 99);
  const std::string forged =
      grant::sign(grant::new_key(), terms("n1", "e1", TransferOp::kRead, 1'000'000, {}));
  struct Case {
    const char* what;
    TransferOp op;
    std::uint64_t first, count;
    std::string grant;
  };
  for (const Case& c : std::vector<Case>{
           {"no grant", TransferOp::kRead, 2, 2, ""},
           {"a forged grant", TransferOp::kRead, 0, kPages, forged},
           {"another node's", TransferOp::kRead, 2, 2, sign(TransferOp::kRead, {{2, 2}}, 1'000'000, "n2")},
           {"a page beside", TransferOp::kRead, 4, 1, g},
           {"the whole pool", TransferOp::kRead, 0, kPages, g},
           {"a write under a read grant", TransferOp::kWrite, 2, 1, g},
           {"a write with no grant", TransferOp::kWrite, 0, kPages, ""}}) {
    const Status s = reach(c.op, c.first, c.count, c.grant);
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << c.what << ": " << s.to_string();
  }
  EXPECT_EQ(std::memcmp(before.data(), pool_.data(), pool_.size()), 0) << "a refused write changed the pool";
  // A write grant writes, where it says.
  ASSERT_TRUE(reach(TransferOp::kWrite, 10, 1, sign(TransferOp::kWrite, {{10, 1}})).is_ok());
  EXPECT_EQ(std::memcmp(local_.data() + 10 * kPage, pool_.data() + 10 * kPage, kPage), 0);
}

TEST_P(GrantedLeases, AGrantEndsWithItsDeadlineAndWithTheKey) {
  const std::string g = sign(TransferOp::kRead, {{1, 1}}, 5000);
  ASSERT_TRUE(reach(TransferOp::kRead, 1, 1, g).is_ok());
  target_->fence(5000);  // the owner's clock passed the grant's deadline
  EXPECT_FALSE(reach(TransferOp::kRead, 1, 1, g).is_ok()) << "a grant fenced already";
  const std::string later = sign(TransferOp::kRead, {{1, 1}}, 9000);
  ASSERT_TRUE(reach(TransferOp::kRead, 1, 1, later).is_ok());
  check_->rotate("e2");  // the node registered again
  EXPECT_EQ(reach(TransferOp::kRead, 1, 1, later).code(), StatusCode::kPermissionDenied);
}

// A revoke names a lease granted on its connection: a flood of revokes of made-up leases (one
// peer can send 65,536 in 0.3 s; were they kept, every later confirmed revoke would get kNoSpace)
// is refused one by one and leaves the real ones working.
TEST_P(GrantedLeases, RevokesOfLeasesNeverGrantedAreRefusedAndTakeNoRoom) {
  if (GetParam() != TransportKind::kTcp) GTEST_SKIP() << "verbs forgets the oldest revoked ids instead";
  const RemoteRange r{page(3), kPage};
  for (int i = 0; i < 66'000; ++i) {
    auto made_up = peer_->lease(region_, {&r, 1}, {.op = TransferOp::kWrite, .ttl = 5s, .fence = 1'000'000});
    ASSERT_TRUE(made_up.is_ok());
    const Status s = peer_->revoke(*made_up, deadline_after(5s));
    ASSERT_EQ(s.code(), StatusCode::kPermissionDenied) << i << ": " << s.to_string();
  }
  auto granted = peer_->lease(
      region_, {&r, 1},
      {.op = TransferOp::kWrite, .ttl = 5s, .fence = 1'000'000, .grant = sign(TransferOp::kWrite, {{3, 1}})});
  ASSERT_TRUE(granted.is_ok());
  EXPECT_TRUE(peer_->revoke(*granted, deadline_after(5s)).is_ok()) << "a real revoke after the flood";
}

// ---- a real memory node, and a raw client with the token ------------------------------------

// A real kvstashd on tcp, an object put through it, and the attacker: the cluster token, read
// access to Redis (the node's address and pool key), and a raw engine connected to the node.
class GrantsOfARealNode : public ::testing::Test {
 protected:
  void SetUp() override {
    auto redis = harness::LocalRedis::start({});
    ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
    redis_ = std::move(redis).value();
    const std::string token = "a-cluster-token-of-32-characters";
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
    const std::string token_file = dir_ + "/token";
    {
      std::ofstream(token_file) << token;
      ::chmod(token_file.c_str(), 0600);
    }
    auto node = harness::LocalNode::start({.redis_url = redis_->url(),
                                           .redis_password = redis_->password(),
                                           .capacity = "4MiB",
                                           .page_size = "64KiB",
                                           .extra_args = {"--transports", "tcp", "--cluster-token-file",
                                                          token_file, "--grant-key-rotation", "1s"}});
    ASSERT_TRUE(node.is_ok()) << node.status().to_string();
    node_ = std::move(node).value();

    StoreOptions so;
    so.redis_url = redis_->url();
    so.redis_password = redis_->password();
    so.engine.transports = {TransportKind::kTcp};
    so.engine.cluster_token = token;
    auto store = Store::open(so);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    store_ = std::move(store).value();
    object_.resize(200'000);
    test::fill_random(object_, 5);
    const Slice in{object_.data(), object_.size()};
    ASSERT_TRUE(store_->put("secret-prompt", {&in, 1}).is_ok());

    metadata::CellOptions co;
    co.redis.url = redis_->url();
    co.redis.password = redis_->password();
    auto cell = metadata::Cell::open(co);
    ASSERT_TRUE(cell.is_ok()) << cell.status().to_string();
    cell_ = std::move(cell).value();
    auto nodes = cell_->catalog().live_nodes();
    ASSERT_TRUE(nodes.is_ok() && nodes->size() == 1) << nodes.status().to_string();
    node_id_ = (*nodes)[0].id;
    EngineOptions eo;
    eo.transports = {TransportKind::kTcp};
    eo.cluster_token = token;
    engine_ = Engine::create(eo).value();
    auto peer = engine_->connect((*nodes)[0].address, deadline_after(5s));
    ASSERT_TRUE(peer.is_ok()) << peer.status().to_string();
    peer_ = std::move(peer).value();
    into_ = Buffer::allocate(4u << 20).value();
    local_ = engine_->register_memory(into_.region(), Access::kLocal).value();
    // The pool's base and length travel in the key; find them the way a client does: a grant
    // names the object's pages (a legit reader's), and the key says where the pool lies.
    auto legit = cell_->catalog().begin_get("secret-prompt", "a-legit-reader", 5000ms);
    ASSERT_TRUE(legit.is_ok()) << legit.status().to_string();
    placement_ = legit->placement;
    ASSERT_FALSE(placement_.nodes[0].grant.empty()) << "the cell signs a grant per node";
    auto pool = peer_->import_key(placement_.nodes[0].key);
    ASSERT_TRUE(pool.is_ok()) << pool.status().to_string();
    pool_ = std::move(pool).value();
  }
  void TearDown() override {
    // Nothing was overwritten: the object reads back whole.
    if (store_ != nullptr) {
      std::vector<std::byte> back(object_.size());
      const Slice out{back.data(), back.size()};
      ASSERT_TRUE(store_->get("secret-prompt", {&out, 1}).is_ok());
      EXPECT_EQ(back, object_);
    }
    std::filesystem::remove_all(dir_);
  }

  // The node's grant key as Redis holds it now (out of its inner pad), and the word grants
  // name it by: what whoever reads P:grant:<id> (a backup, a replica) has.
  std::pair<std::vector<std::uint8_t>, std::string> copied_grant_key() {
    auto r =
        cell_->redis().command({"HMGET", cell_->admin().prefix() + ":grant:" + node_id_, "ipad", "epoch"});
    EXPECT_TRUE(r.is_ok() && r->size() == 2) << r.status().to_string();
    if (!r.is_ok() || r->size() != 2) return {};
    std::vector<std::uint8_t> key;
    for (char c : std::string(r->element(0)->str, r->element(0)->len).substr(0, grant::kKeyBytes))
      key.push_back(static_cast<std::uint8_t>(c) ^ 0x36);
    return {key, std::string(r->element(1)->str, r->element(1)->len)};
  }

  // [addr, addr + length) of the pool read into into_ (or written from it) under a lease with
  // `grant`, fenced at `fence` (0: the legit reader's deadline).
  Status reach(std::uint64_t addr, std::uint64_t length, TransferOp op, const std::string& grant,
               std::uint64_t fence = 0) {
    const RemoteRange r{addr, length};
    if (fence == 0) fence = static_cast<std::uint64_t>(placement_.lease_deadline_ms);
    auto lease = peer_->lease(pool_, {&r, 1}, {.op = op, .ttl = 5s, .fence = fence, .grant = grant});
    if (!lease.is_ok()) return lease.status();
    const TransferEntry e{.op = op,
                          .local = &local_,
                          .local_addr = into_.data(),
                          .remote_addr = addr,
                          .remote = &*lease,
                          .length = length};
    return peer_->transfer({&e, 1}, deadline_after(5s));
  }

  std::unique_ptr<harness::LocalRedis> redis_;
  std::string dir_ = "/tmp/kvstash-grants-XXXXXX";
  std::unique_ptr<harness::LocalNode> node_;
  std::unique_ptr<Store> store_;
  std::vector<std::byte> object_;
  std::unique_ptr<metadata::Cell> cell_;
  std::string node_id_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Peer> peer_;
  Buffer into_;
  MemoryHandle local_;
  metadata::Placement placement_;
  RemoteMemory pool_;
};

TEST_F(GrantsOfARealNode, AClientWithTheTokenReachesNothingTheCellDidNotGrant) {
  const std::uint64_t base = pool_.base(), whole = pool_.length();
  const auto& p = placement_;
  // Made-up leases over the whole pool, for reading and for writing: refused.
  EXPECT_EQ(reach(base, whole, TransferOp::kRead, "").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reach(base, whole, TransferOp::kWrite, "").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reach(base, whole, TransferOp::kRead, "g1 forged").code(), StatusCode::kPermissionDenied);
  // A legit reader's grant reaches the object's first page, and no page beside it.
  const std::uint64_t first = base + p.extents[0].page * p.page_size;
  ASSERT_TRUE(reach(first, p.page_size, TransferOp::kRead, p.nodes[0].grant).is_ok());
  EXPECT_EQ(std::memcmp(into_.data(), object_.data(), p.page_size), 0);
  EXPECT_EQ(reach(base, whole, TransferOp::kRead, p.nodes[0].grant).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reach(first, p.page_size, TransferOp::kWrite, p.nodes[0].grant).code(),
            StatusCode::kPermissionDenied);
}

// The cell signs no lease longer than grant::kMaxLease: a client that asks for ten years is
// refused, and a grant minted with the node's key (as whoever reads P:grant:<id>, a replica or
// a backup of Redis, can) for ten years is refused by the node, while one within the longest
// lease still serves (the minting is right: the bound is what refuses).
TEST_F(GrantsOfARealNode, NoGrantOutlivesTheCellsLongestLease) {
  constexpr std::int64_t kTenYearsMs = 10ll * 365 * 24 * 3600 * 1000;
  EXPECT_EQ(cell_->catalog()
                .begin_get("secret-prompt", "greedy", std::chrono::milliseconds(kTenYearsMs))
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cell_->catalog()
                .begin_put("greedy-put", "greedy", 4096, std::chrono::milliseconds(kTenYearsMs))
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(cell_->catalog().begin_get("secret-prompt", "patient", grant::kMaxLease).is_ok());

  const auto pads = copied_grant_key();
  const std::vector<std::uint8_t>& key = pads.first;
  const std::string& epoch = pads.second;
  ASSERT_EQ(key.size(), grant::kKeyBytes);
  auto now = cell_->redis().command({"TIME"});
  ASSERT_TRUE(now.is_ok());
  const std::uint64_t now_ms = std::stoull(std::string(now->element(0)->str, now->element(0)->len)) * 1000;
  const auto mint = [&](std::uint64_t deadline) {
    grant::Terms t;
    t.issuer = node_id_;
    t.epoch = epoch;
    t.op = TransferOp::kRead;
    t.deadline = deadline;
    t.whole = true;
    return grant::sign(key, t);
  };
  const std::uint64_t base = pool_.base(), whole = pool_.length();
  const std::uint64_t soon = now_ms + 60'000, decade = now_ms + kTenYearsMs;
  EXPECT_TRUE(reach(base, whole, TransferOp::kRead, mint(soon), soon).is_ok())
      << "a minted grant within the longest lease serves (the key leaked)";
  EXPECT_EQ(reach(base, whole, TransferOp::kRead, mint(decade), decade).code(), StatusCode::kPermissionDenied)
      << "a grant for ten years";
  const std::uint64_t just_past = now_ms + grant::kMaxLease.count() + 60'000;
  EXPECT_EQ(reach(base, whole, TransferOp::kRead, mint(just_past), just_past).code(),
            StatusCode::kPermissionDenied)
      << "a grant a minute past the longest lease";
}

// The node hands its cell a new grant key every second here (--grant-key-rotation): grants
// the cell signed before keep serving, and a key copied out of Redis (a backup, a replica, a
// Redis user since revoked) mints nothing beyond the longest lease of its retirement, while
// the cell's current key does.
TEST_F(GrantsOfARealNode, AKeyCopiedOutOfRedisRetiresWithTheNextRotation) {
  const auto redis_ms = [&] {
    auto now = cell_->redis().command({"TIME"});
    EXPECT_TRUE(now.is_ok());
    return std::stoull(std::string(now->element(0)->str, now->element(0)->len)) * 1000;
  };
  const auto mint = [&](const std::pair<std::vector<std::uint8_t>, std::string>& key,
                        std::uint64_t deadline) {
    return grant::sign(key.first,
                       {.issuer = node_id_, .epoch = key.second, .deadline = deadline, .whole = true});
  };
  auto before = cell_->catalog().begin_get("secret-prompt", "a-reader-across-rotations", 60s);
  ASSERT_TRUE(before.is_ok()) << before.status().to_string();
  const auto copied = copied_grant_key();
  const auto copied_at = redis_ms();
  // Retired (the word moved on), then 6 s more: past the 5 s the node allows for clocks.
  const auto give_up = Clock::now() + 15s;
  while (copied_grant_key().second == copied.second && Clock::now() < give_up)
    std::this_thread::sleep_for(50ms);
  const auto retired = copied_grant_key();
  ASSERT_NE(retired.second, copied.second) << "the cell still signs with the key of " << copied.second;
  EXPECT_EQ(retired.second.rfind(copied.second.substr(0, copied.second.find('/')) + "/", 0), 0u)
      << "the same incarnation's next generation: " << retired.second;
  std::this_thread::sleep_for(7s);

  const std::uint64_t base = pool_.base(), whole = pool_.length();
  const auto& p = before->placement;
  const std::uint64_t first = base + p.extents[0].page * p.page_size;
  EXPECT_TRUE(reach(first, p.page_size, TransferOp::kRead, p.nodes[0].grant,
                    static_cast<std::uint64_t>(p.lease_deadline_ms))
                  .is_ok())
      << "a grant the cell signed before the rotations still serves until its deadline";
  const std::uint64_t later = redis_ms() + grant::kMaxLease.count() - 1000;
  ASSERT_GT(later, copied_at + grant::kMaxLease.count() + 5000);
  EXPECT_TRUE(reach(base, whole, TransferOp::kRead, mint(copied_grant_key(), later), later).is_ok())
      << "the current key (whoever reads it now) mints within the longest lease";
  EXPECT_EQ(reach(base, whole, TransferOp::kRead, mint(copied, later), later).code(),
            StatusCode::kPermissionDenied)
      << "the copied key, retired, minting past the leases it signed";
}

// ---- two tenants on one Redis ---------------------------------------------------------------

// docs/operations.md's recipe: a cell, a Redis ACL user and a cluster token per tenant, on nodes
// of its own. Each tenant's credentials reach its own objects and nothing of the other's:
// not its metadata (the ACL), not its nodes (the token), not its pages (no grant).
TEST(Tenants, OneTenantsCredentialsReachNothingOfTheOthers) {
  auto redis = harness::LocalRedis::start({.password = "admin-password-1234"});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  const int port = (*redis)->port();
  metadata::CellOptions admin;
  admin.redis.url = (*redis)->url();
  admin.redis.password = (*redis)->password();
  auto cell = metadata::Cell::open(admin);
  ASSERT_TRUE(cell.is_ok()) << cell.status().to_string();
  char dir[] = "/tmp/kvstash-tenants-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);

  struct Tenant {
    std::string name, token, url;
    std::unique_ptr<harness::LocalNode> node;
    std::unique_ptr<Store> store;
  };
  auto open_tenant = [&](const std::string& name) {
    Tenant t;
    t.name = name;
    t.token = "token-of-tenant-" + name + "-0123456789";
    t.url = "redis://" + name + ":pw-" + name + "-0123456789@127.0.0.1:" + std::to_string(port) + "/0";
    // The user may touch its own cell's keys alone.
    EXPECT_TRUE((*cell)
                    ->redis()
                    .command({"ACL", "SETUSER", name, "on", ">pw-" + name + "-0123456789",
                              "~kvs:{kvs:" + name + "}*", "+@all"})
                    .is_ok());
    const std::string token_file = std::string(dir) + "/" + name;
    std::ofstream(token_file) << t.token;
    ::chmod(token_file.c_str(), 0600);
    auto node = harness::LocalNode::start(
        {.redis_url = t.url,
         .capacity = "4MiB",
         .page_size = "64KiB",
         .node_id = "node-" + name,
         .extra_args = {"--cell", name, "--transports", "tcp", "--cluster-token-file", token_file}});
    EXPECT_TRUE(node.is_ok()) << node.status().to_string();
    if (node.is_ok()) t.node = std::move(node).value();
    StoreOptions so;
    so.redis_url = t.url;
    so.cell = name;
    so.engine.transports = {TransportKind::kTcp};
    so.engine.cluster_token = t.token;
    auto store = Store::open(so);
    EXPECT_TRUE(store.is_ok()) << store.status().to_string();
    if (store.is_ok()) t.store = std::move(store).value();
    return t;
  };
  Tenant a = open_tenant("a"), b = open_tenant("b");
  ASSERT_TRUE(a.store && b.store && a.node && b.node);
  std::vector<std::byte> secret(100'000), back(100'000);
  test::fill_random(secret, 9);
  const Slice in{secret.data(), secret.size()}, out{back.data(), back.size()};
  ASSERT_TRUE(b.store->put("b-prompt", {&in, 1}).is_ok());

  // a's Redis user against b's cell: refused by the ACL, before any script runs.
  StoreOptions cross;
  cross.redis_url = a.url;
  cross.cell = "b";
  cross.engine.transports = {TransportKind::kTcp};
  cross.engine.cluster_token = a.token;
  auto a_in_b = Store::open(cross);
  EXPECT_EQ(a_in_b.status().code(), StatusCode::kPermissionDenied) << a_in_b.status().to_string();
  // a's own store: b's keys are simply not in a's cell.
  EXPECT_EQ(a.store->get("b-prompt", {&out, 1}).status().code(), StatusCode::kNotFound);
  // a's token against b's node (its address known by other means): the handshake refuses it.
  metadata::CellOptions b_admin = admin;
  b_admin.cell = "b";
  auto b_cell = metadata::Cell::open(b_admin);
  ASSERT_TRUE(b_cell.is_ok());
  auto b_nodes = (*b_cell)->catalog().live_nodes();
  ASSERT_TRUE(b_nodes.is_ok() && b_nodes->size() == 1);
  EngineOptions eo;
  eo.transports = {TransportKind::kTcp};
  eo.cluster_token = a.token;
  auto engine = Engine::create(eo).value();
  auto peer = engine->connect((*b_nodes)[0].address, deadline_after(5s));
  EXPECT_EQ(peer.status().code(), StatusCode::kPermissionDenied) << peer.status().to_string();
  // b reads its own, whole.
  ASSERT_TRUE(b.store->get("b-prompt", {&out, 1}).is_ok());
  EXPECT_EQ(back, secret);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvstash
