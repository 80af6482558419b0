#include "common/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

namespace kvstash::handshake {

void mac(const std::string& token, std::string_view role, const std::uint8_t* nonce_s,
         const std::uint8_t* nonce_c, std::uint8_t* mac_out) {
  std::string msg(role);
  msg.append(reinterpret_cast<const char*>(nonce_s), kNonceBytes);
  msg.append(reinterpret_cast<const char*>(nonce_c), kNonceBytes);
  unsigned int len = kMacBytes;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac_out, &len);
}

bool equal(const std::uint8_t* a, const std::uint8_t* b) { return CRYPTO_memcmp(a, b, kMacBytes) == 0; }

}  // namespace kvstash::handshake
