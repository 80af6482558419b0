// The cluster-token handshake's state machine (common/handshake.h), both roles in one
// process: what tcp and verbs each carry in their own messages.
#include <gtest/gtest.h>

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
