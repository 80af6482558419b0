#include "common/grant.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <charconv>

#include "common/system.h"
#include "kvstash/grant.h"

namespace kvstash::grant {
namespace {

constexpr std::string_view kVersion = "g1";
constexpr std::size_t kMacHex = 40;  // HMAC-SHA1, hex

std::string mac_hex(std::span<const std::uint8_t> key, std::string_view message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha1(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &len);
  return hex({mac, len});
}

std::string_view next_word(std::string_view& s) {
  const auto at = s.find(' ');
  std::string_view w = s.substr(0, at);
  s.remove_prefix(at == std::string_view::npos ? s.size() : at + 1);
  return w;
}

bool number(std::string_view s, std::uint64_t& out) {
  if (s.empty()) return false;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size();
}

Status malformed(std::string_view why) { return Status::invalid_argument("grant: " + std::string(why)); }

}  // namespace

std::string hex(std::span<const std::uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

std::vector<std::uint8_t> new_key() {
  std::vector<std::uint8_t> key(kKeyBytes);
  sys::random_bytes(key.data(), key.size());
  return key;
}

std::string sign(std::span<const std::uint8_t> key, const Terms& t) {
  std::string msg;
  msg.append(kVersion).append(" ").append(t.issuer).append(" ").append(t.epoch);
  msg.append(t.op == TransferOp::kWrite ? " w " : " r ").append(std::to_string(t.deadline)).append(" ");
  if (t.whole) {
    msg.push_back('*');
  } else {
    for (std::size_t i = 0; i < t.runs.size(); ++i) {
      if (i > 0) msg.push_back(',');
      msg.append(std::to_string(t.runs[i].first)).append("+").append(std::to_string(t.runs[i].second));
    }
  }
  std::string mac = mac_hex(key, msg);
  return msg.append(" ").append(mac);
}

Result<Terms> verify(std::span<const std::uint8_t> key, std::string_view text) {
  if (text.size() > kMaxGrantBytes)
    return malformed("longer than " + std::to_string(kMaxGrantBytes) + " bytes");
  const auto cut = text.rfind(' ');
  if (cut == std::string_view::npos || text.size() - cut - 1 != kMacHex) {
    return Status::permission_denied("grant: not signed (no MAC)");
  }
  const std::string_view message = text.substr(0, cut);
  const std::string expect = mac_hex(key, message);
  if (CRYPTO_memcmp(expect.data(), text.data() + cut + 1, kMacHex) != 0) {
    return Status::permission_denied(
        "grant: its MAC does not match this owner's key (forged, or another owner's)");
  }
  std::string_view rest = message;
  Terms t;
  if (next_word(rest) != kVersion) return malformed("unknown version");
  t.issuer = std::string(next_word(rest));
  t.epoch = std::string(next_word(rest));
  const std::string_view op = next_word(rest);
  if (op != "r" && op != "w") return malformed("op must be r or w");
  t.op = op == "w" ? TransferOp::kWrite : TransferOp::kRead;
  if (!number(next_word(rest), t.deadline) || t.deadline == 0) return malformed("no valid deadline");
  const std::string_view runs = next_word(rest);
  if (!rest.empty() || runs.empty()) return malformed("trailing or missing fields");
  if (runs == "*") {
    t.whole = true;
    return t;
  }
  for (std::string_view left = runs; !left.empty();) {
    const auto comma = left.find(',');
    const std::string_view run = left.substr(0, comma);
    left.remove_prefix(comma == std::string_view::npos ? left.size() : comma + 1);
    const auto plus = run.find('+');
    std::uint64_t first = 0, count = 0;
    if (plus == std::string_view::npos || !number(run.substr(0, plus), first) ||
        !number(run.substr(plus + 1), count) || count == 0) {
      return malformed("a run is not first+count");
    }
    t.runs.emplace_back(first, count);
  }
  return t;
}

}  // namespace kvstash::grant
