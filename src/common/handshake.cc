#include "common/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "common/system.h"

namespace kvstash::handshake {

Handshake::Handshake(Role role, std::string token) : role_(role), token_(std::move(token)) {
  sys::random_bytes(mine_.data(), mine_.size());
}

Status Handshake::on_peer_hello(const Nonce& peer, bool peer_requires_token) {
  if (heard_) return Status::invalid_argument("handshake: the peer's hello came twice");
  if (peer_requires_token && token_.empty()) {
    return Status::permission_denied(role_ == Role::kClient
                                         ? "the target requires a cluster token and none is configured"
                                         : "the client requires a cluster token and none is configured");
  }
  theirs_ = peer;
  heard_ = true;
  return {};
}

Mac Handshake::proof() const {
  if (token_.empty() || !heard_) return Mac{};
  return mac_of(role_);
}

Status Handshake::check_proof(const std::uint8_t* peer_mac, std::size_t size) const {
  if (!heard_) return Status::permission_denied("handshake: a proof before the peer's hello");
  if (token_.empty()) return {};
  const Mac expect = mac_of(role_ == Role::kClient ? Role::kServer : Role::kClient);
  if (size != expect.size() || CRYPTO_memcmp(expect.data(), peer_mac, expect.size()) != 0) {
    return Status::permission_denied(role_ == Role::kClient ? "the target could not prove the cluster token"
                                                            : "the client could not prove the cluster token");
  }
  return {};
}

// HMAC-SHA256(token, role || nonce_server || nonce_client).
Mac Handshake::mac_of(Role role) const {
  const Nonce& server = role_ == Role::kServer ? mine_ : theirs_;
  const Nonce& client = role_ == Role::kClient ? mine_ : theirs_;
  std::string msg(role == Role::kClient ? "client" : "server");
  msg.append(reinterpret_cast<const char*>(server.data()), server.size());
  msg.append(reinterpret_cast<const char*>(client.data()), client.size());
  Mac out{};
  unsigned int len = out.size();
  HMAC(EVP_sha256(), token_.data(), static_cast<int>(token_.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out.data(), &len);
  return out;
}

}  // namespace kvstash::handshake
