// What a memory node reads from whoever reaches it: a grant's text (presented with a lease,
// checked by NodeGrants under its current, offered and retired keys) and, after a restart, the
// NVMe tier's headers from a device anyone with write access may have written. The input's
// byte 0 picks what the rest is: a grant (even) or a header (odd). What verifies must be what
// the key signed: a grant re-signs to the same text, a header re-encodes to the same bytes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/grant.h"
#include "fuzz_util.h"
#include "node/node_grants.h"
#include "node/tier_headers.h"

namespace {

using namespace kvstash;

// Fixed keys, so that the seeds' signed texts verify and the fuzzer can reach past the MAC.
const std::vector<std::uint8_t>& grant_key() {
  static const std::vector<std::uint8_t> k(grant::kKeyBytes, 0x42);
  return k;
}
const std::vector<std::uint8_t>& header_key() {
  static const std::vector<std::uint8_t> k = node::tier_header_key("a-cluster-token-of-32-characters");
  return k;
}

void check_grant(std::string_view text) {
  auto t = grant::verify(grant_key(), text);
  if (t.is_ok()) {
    FUZZ_CHECK(grant::sign(grant_key(), *t) == text, "a verified grant re-signs to other text");
  } else {
    const auto c = t.status().code();
    FUZZ_CHECK(c == StatusCode::kPermissionDenied || c == StatusCode::kInvalidArgument, "verify: %s",
               t.status().to_string().c_str());
  }
  // A node: 64 pages at 1 GiB, its keys rotated twice (one retired, one current, one offered).
  static node::NodeGrants* check = [] {
    auto* g = new node::NodeGrants("n1", 1ull << 30, 4096, 64, std::chrono::milliseconds(0));
    g->rotate("e1");
    g->set_clock(1'000'000, Clock::now());
    for (int i = 0; i < 2; ++i) {
      if (auto next = g->next_key()) g->installed(next->word, 1'000'000);
    }
    g->next_key();
    return g;
  }();
  auto g = check->check(text);
  if (g.is_ok()) {
    for (const auto& r : g->ranges) {
      FUZZ_CHECK(r.addr >= (1ull << 30) && r.addr + r.length <= (1ull << 30) + 64 * 4096,
                 "a range outside the pool");
    }
  } else {
    FUZZ_CHECK(g.status().code() == StatusCode::kPermissionDenied ||
                   g.status().code() == StatusCode::kInvalidArgument,
               "check: %s", g.status().to_string().c_str());
  }
}

void check_header(std::string_view bytes) {
  for (bool keyed : {false, true}) {
    const std::span<const std::uint8_t> key =
        keyed ? std::span<const std::uint8_t>(header_key()) : std::span<const std::uint8_t>();
    auto h = node::decode_tier_header(bytes, key);
    if (!h) continue;
    auto again = node::encode_tier_header(*h, bytes.size(), key);
    FUZZ_CHECK(again.is_ok(), "a decoded header does not encode: %s", again.status().to_string().c_str());
    FUZZ_CHECK(bytes.substr(0, again->size()) == *again, "a decoded header encodes to other bytes");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return -1;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    check_grant(rest);
  } else {
    check_header(rest);
  }
  return 0;
}
