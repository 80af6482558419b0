// The cluster-token handshake both network transports (tcp, verbs) run before serving a peer,
// as one state machine: each side draws a random nonce, learns the other's, and proves it
// knows the shared token with HMAC-SHA256(token, role || nonce_server || nonce_client). The
// token never crosses the wire, and a proof is good for one pair of nonces only.
//
// The transport carries the nonces and proofs in its own messages and order (tcp: the server
// speaks first and proves last; verbs: the client's hello comes first and the server proves
// first); the decisions are all here:
//
//   Handshake me(Role::kClient, token);     // draws me.nonce()
//   send(me.nonce()) / receive peer's nonce and whether it requires a token
//   KVSTASH_RETURN_IF_ERROR(me.on_peer_hello(nonce, requires));  // a token we lack: refused
//   send(me.proof());                        // zeros when this side has no token
//   KVSTASH_RETURN_IF_ERROR(me.check_proof(peer_proof));  // kPermissionDenied unless proven
//
// Thread safety: one Handshake per connection, used by one thread at a time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvstash/status.h"

namespace kvstash::handshake {

inline constexpr std::size_t kNonceBytes = 16;
inline constexpr std::size_t kMacBytes = 32;

using Nonce = std::array<std::uint8_t, kNonceBytes>;
using Mac = std::array<std::uint8_t, kMacBytes>;

enum class Role : std::uint8_t { kClient, kServer };

class Handshake {
 public:
  // Draws this side's nonce. An empty `token`: this side proves nothing and requires nothing
  // (a server without one serves anyone; a client without one reaches only such servers).
  Handshake(Role role, std::string token);

  const Nonce& nonce() const { return mine_; }
  // Whether this side requires the peer to prove the token (it has one).
  bool token_required() const { return !token_.empty(); }

  // Records the peer's nonce and whether it requires the token. kPermissionDenied when it
  // does and this side has none; kInvalidArgument when called twice.
  Status on_peer_hello(const Nonce& peer, bool peer_requires_token);

  // This side's proof over both nonces, for the peer's check_proof; zeros without a token.
  // Only after on_peer_hello.
  Mac proof() const;

  // Checks the peer's proof: OK when this side has no token, else only for the proof of the
  // other role over these nonces (constant time). kPermissionDenied otherwise, or before
  // on_peer_hello.
  Status check_proof(const std::uint8_t* peer_mac, std::size_t size) const;
  Status check_proof(const Mac& peer_mac) const { return check_proof(peer_mac.data(), peer_mac.size()); }

 private:
  Mac mac_of(Role role) const;

  Role role_;
  std::string token_;
  Nonce mine_{};
  Nonce theirs_{};
  bool heard_ = false;
};

}  // namespace kvstash::handshake
