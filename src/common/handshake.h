// The cluster-token handshake both network transports (tcp, verbs) run before serving a peer:
// each side sends a random nonce and proves it knows the shared token with
// HMAC-SHA256(token, role || nonce_server || nonce_client); the token never crosses the wire.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvstash::handshake {

inline constexpr std::size_t kNonceBytes = 16;
inline constexpr std::size_t kMacBytes = 32;

// HMAC-SHA256(token, role || nonce_s || nonce_c) into mac_out (kMacBytes).
void mac(const std::string& token, std::string_view role, const std::uint8_t* nonce_s,
         const std::uint8_t* nonce_c, std::uint8_t* mac_out);

// Constant-time comparison of two MACs.
bool equal(const std::uint8_t* a, const std::uint8_t* b);

}  // namespace kvstash::handshake
