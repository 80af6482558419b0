// The cluster-token handshake's state machine (common/handshake.h), both roles in one
// process: what tcp and verbs each carry in their own messages; and the backoff failed proofs
// earn (common/admission.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>

#include "common/admission.h"
#include "common/handshake.h"

namespace kvstash::handshake {
namespace {

// Runs the exchange between a client and a server; returns the client's and server's verdicts
// on each other.
struct Outcome {
  Status client_heard, server_heard, client_checked, server_checked;
};

Outcome exchange(const std::string& client_token, const std::string& server_token) {
  Handshake client(Role::kClient, client_token), server(Role::kServer, server_token);
  Outcome o;
  o.client_heard = client.on_peer_hello(server.nonce(), server.token_required());
  // Neither wire protocol tells the server whether the client requires the token: the client
  // judges the server by its proof.
  o.server_heard = server.on_peer_hello(client.nonce(), false);
  o.server_checked = server.check_proof(client.proof());
  o.client_checked = client.check_proof(server.proof());
  return o;
}

TEST(Handshake, BothSidesWithTheTokenProveItToEachOther) {
  Outcome o = exchange("s3cret", "s3cret");
  EXPECT_TRUE(o.client_heard.is_ok());
  EXPECT_TRUE(o.server_checked.is_ok()) << o.server_checked.to_string();
  EXPECT_TRUE(o.client_checked.is_ok()) << o.client_checked.to_string();
}

TEST(Handshake, NeitherSideWithATokenNeedsNoProof) {
  Outcome o = exchange("", "");
  EXPECT_TRUE(o.client_heard.is_ok());
  EXPECT_TRUE(o.server_checked.is_ok());
  EXPECT_TRUE(o.client_checked.is_ok());
}

TEST(Handshake, AWrongTokenIsRefusedBothWays) {
  Outcome o = exchange("guess", "s3cret");
  EXPECT_EQ(o.server_checked.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(o.client_checked.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(o.client_checked.message().find("could not prove"), std::string::npos);
}

TEST(Handshake, AClientWithoutTheTokenIsRefusedBeforeItSendsAnything) {
  Outcome o = exchange("", "s3cret");
  EXPECT_EQ(o.client_heard.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(o.client_heard.message().find("requires a cluster token"), std::string::npos);
  EXPECT_EQ(o.server_checked.code(), StatusCode::kPermissionDenied);  // its zeros prove nothing
}

// A client that has a token does not trust a server that cannot prove it (it may be anyone).
TEST(Handshake, AClientWithATokenRefusesAServerWithout) {
  Outcome o = exchange("s3cret", "");
  EXPECT_TRUE(o.server_checked.is_ok());
  EXPECT_EQ(o.client_checked.code(), StatusCode::kPermissionDenied);
}

// A proof is bound to its pair of nonces and to its role: replaying one, or reflecting the
// server's own proof back at it, proves nothing.
TEST(Handshake, ProofsDoNotReplayOrReflect) {
  Handshake client(Role::kClient, "s3cret"), server(Role::kServer, "s3cret");
  ASSERT_TRUE(client.on_peer_hello(server.nonce(), true).is_ok());
  ASSERT_TRUE(server.on_peer_hello(client.nonce(), true).is_ok());
  const Mac recorded = client.proof();
  ASSERT_TRUE(server.check_proof(recorded).is_ok());

  Handshake later(Role::kServer, "s3cret");
  ASSERT_TRUE(later.on_peer_hello(client.nonce(), true).is_ok());
  EXPECT_EQ(later.check_proof(recorded).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(server.check_proof(server.proof()).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(server.check_proof(recorded.data(), recorded.size() - 1).code(), StatusCode::kPermissionDenied);
}

TEST(Handshake, OrderIsEnforced) {
  Handshake server(Role::kServer, "s3cret");
  EXPECT_EQ(server.proof(), Mac{}) << "no proof before the peer's nonce";
  EXPECT_EQ(server.check_proof(Mac{}).code(), StatusCode::kPermissionDenied);
  Handshake client(Role::kClient, "s3cret");
  ASSERT_TRUE(server.on_peer_hello(client.nonce(), false).is_ok());
  EXPECT_EQ(server.on_peer_hello(client.nonce(), false).code(), StatusCode::kInvalidArgument);
  EXPECT_NE(Handshake(Role::kClient, "").nonce(), Handshake(Role::kClient, "").nonce());
}

}  // namespace
}  // namespace kvstash::handshake

// ---- admission.h: what failed proofs cost the next ones -------------------------------------

namespace kvstash::admission {
namespace {

using namespace std::chrono_literals;

TEST(GuessThrottle, AnAddressThatKeepsFailingWaitsLongerEachTime) {
  GuessThrottle t;
  const Clock::time_point t0 = Clock::now();
  for (std::uint32_t i = 0; i < ThrottleOptions{}.free_failures; ++i) {
    ASSERT_EQ(t.admit("10.0.0.1", t0), Verdict::kAdmit) << "failure " << i << " is free";
    t.failed("10.0.0.1", t0);
  }
  EXPECT_EQ(t.admit("10.0.0.1", t0), Verdict::kAdmit);
  t.failed("10.0.0.1", t0);  // the first one not free: 250 ms
  EXPECT_EQ(t.admit("10.0.0.1", t0 + 200ms), Verdict::kPeerBackoff);
  EXPECT_EQ(t.admit("10.0.0.2", t0 + 200ms), Verdict::kAdmit) << "other addresses are not backed off";
  EXPECT_EQ(t.admit("10.0.0.1", t0 + 260ms), Verdict::kAdmit);
  t.failed("10.0.0.1", t0 + 260ms);  // the fifth: 500 ms
  EXPECT_EQ(t.admit("10.0.0.1", t0 + 700ms), Verdict::kPeerBackoff);
  EXPECT_EQ(t.admit("10.0.0.1", t0 + 770ms), Verdict::kAdmit);
  // Many more: capped at 30 s.
  for (int i = 0; i < 40; ++i) t.failed("10.0.0.1", t0 + 1s);
  EXPECT_EQ(t.admit("10.0.0.1", t0 + 30s), Verdict::kPeerBackoff);
  EXPECT_EQ(t.admit("10.0.0.1", t0 + 31s + 1ms), Verdict::kAdmit);
  // Proving the token forgets the failures.
  t.proven("10.0.0.1", false, t0 + 32s);
  t.failed("10.0.0.1", t0 + 32s);
  EXPECT_EQ(t.admit("10.0.0.1", t0 + 32s), Verdict::kAdmit);
}

TEST(GuessThrottle, TheListenerChecksFewProofsOfUnknownAddressesButKnownOnesPass) {
  GuessThrottle t;  // 16 at once, 4 a second
  const Clock::time_point t0 = Clock::now();
  bool spent = false;
  ASSERT_TRUE(t.may_check("10.0.9.9", &spent, t0));
  EXPECT_TRUE(spent);
  t.proven("10.0.9.9", spent, t0);  // a good proof gives its share back
  int checked = 0;
  for (int i = 0; i < 100; ++i) {
    const std::string peer = "10.0.1." + std::to_string(i);
    if (t.admit(peer, t0) != Verdict::kAdmit) continue;
    if (t.may_check(peer, &spent, t0)) ++checked;
    t.failed(peer, t0);
  }
  EXPECT_EQ(checked, 16);
  EXPECT_EQ(t.admit("10.0.2.1", t0), Verdict::kListenerBackoff);
  EXPECT_FALSE(t.may_check("10.0.2.1", &spent, t0));
  EXPECT_EQ(t.admit("10.0.9.9", t0), Verdict::kAdmit) << "an address that proved the token still gets in";
  EXPECT_TRUE(t.may_check("10.0.9.9", &spent, t0));
  EXPECT_FALSE(spent);
  // The allowance refills at 4 a second.
  EXPECT_TRUE(t.may_check("10.0.2.1", &spent, t0 + 300ms));
  EXPECT_FALSE(t.may_check("10.0.2.2", &spent, t0 + 300ms));
}

TEST(GuessThrottle, RemembersABoundedNumberOfAddresses) {
  ThrottleOptions o;
  o.max_addresses = 64;
  o.burst = 1e9;
  GuessThrottle t(o);
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < 100000; ++i) {
    const std::string peer = "10." + std::to_string(i / 65536) + "." + std::to_string(i / 256 % 256) + "." +
                             std::to_string(i % 256);
    t.failed(peer, t0);
    t.proven(peer + "p", false, t0);
  }
  // Nothing to assert on memory directly: the run finishing quickly with the bound in place
  // is the check, and a recent address is still remembered.
  for (int i = 0; i < 10; ++i) t.failed("10.9.9.9", t0);
  EXPECT_EQ(t.admit("10.9.9.9", t0), Verdict::kPeerBackoff);
}

// A full budget displaces the oldest handshake of the source holding the most places: a flood
// from two addresses displaces its own, never the one client that waits on its round trip;
// a known source (it proved the token) is displaced only by another known one.
TEST(UnprovenBudget, AFloodDisplacesItsOwnHandshakesNotASlowClients) {
  UnprovenBudget b(8);
  std::vector<std::uint64_t> dropped;
  const auto add = [&](const std::string& peer, bool known = false) {
    auto id = std::make_shared<std::uint64_t>(0);
    *id = b.add(peer, known, [&dropped, id] { dropped.push_back(*id); });
    return *id;
  };
  const std::uint64_t slow = add("10.0.0.50");
  const std::uint64_t known = add("10.0.0.60", true);
  for (int i = 0; i < 10'000; ++i) ASSERT_NE(add(i % 2 ? "10.0.0.2" : "10.0.0.3"), 0u);
  EXPECT_EQ(b.size(), 8u);
  EXPECT_EQ(b.displaced(), 10'000u - 6);
  EXPECT_EQ(std::count(dropped.begin(), dropped.end(), slow), 0) << "the slow client kept its place";
  EXPECT_EQ(std::count(dropped.begin(), dropped.end(), known), 0);
  b.remove(slow);
  EXPECT_EQ(b.size(), 7u);
  b.remove(slow);  // a second remove is a no-op
  EXPECT_EQ(b.size(), 7u);

  // Sources holding one place each: the oldest unknown goes first, a known one never for them.
  UnprovenBudget one(3);
  dropped.clear();
  const auto add_one = [&](const std::string& peer, bool k) {
    auto id = std::make_shared<std::uint64_t>(0);
    *id = one.add(peer, k, [&dropped, id] { dropped.push_back(*id); });
    return *id;
  };
  const std::uint64_t k1 = add_one("10.1.0.1", true), u1 = add_one("10.1.0.2", false);
  add_one("10.1.0.3", false);
  ASSERT_NE(add_one("10.1.0.4", false), 0u);
  EXPECT_EQ(dropped, std::vector<std::uint64_t>{u1});
  const std::uint64_t k2 = add_one("10.1.0.5", true), k3 = add_one("10.1.0.6", true);
  EXPECT_NE(k2, 0u);
  EXPECT_NE(k3, 0u);
  EXPECT_EQ(add_one("10.1.0.7", false), 0u) << "a full budget of known sources refuses an unknown one";
  EXPECT_NE(add_one("10.1.0.8", true), 0u) << "and displaces its oldest for a known one";
  EXPECT_EQ(dropped.back(), k1);
}

TEST(UnprovenBudget, AnIPv6SourceIsItsSlash64) {
  EXPECT_EQ(UnprovenBudget::source_of("10.0.0.7"), "10.0.0.7");
  EXPECT_EQ(UnprovenBudget::source_of("2001:db8:1:2:a:b:c:d"), "2001:db8:1:2::/64");
  EXPECT_EQ(UnprovenBudget::source_of("2001:db8:1:2::9"), "2001:db8:1:2::/64");
  EXPECT_EQ(UnprovenBudget::source_of("2001:db8::1"), "2001:db8:0:0::/64");
  EXPECT_EQ(UnprovenBudget::source_of("::1"), "0:0:0:0::/64");
  // Many addresses of one /64 count as one source: they displace each other.
  UnprovenBudget b(4);
  int dropped_slow = 0;
  (void)b.add("2001:db8:9:9::1", false, [&] { ++dropped_slow; });
  for (int i = 0; i < 100; ++i) (void)b.add("2001:db8:1:2::" + std::to_string(i + 10), false, {});
  EXPECT_EQ(dropped_slow, 0);
}

}  // namespace
}  // namespace kvstash::admission
