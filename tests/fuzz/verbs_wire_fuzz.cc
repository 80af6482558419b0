// The verbs transport's wire messages (src/transport/verbs/verbs_wire.h), as a peer or Redis
// hands them over: its address (control endpoint and RDMA ports), the queue-pair hello, the
// packed remote key, and the lease messages both sides of a setup connection exchange. The
// input is one message, given to every public decoder. What decodes must encode to bytes that
// decode to the same thing again (the encoding is then stable), and the port pairing of a
// decoded address must stay inside both port lists. Only public functions are called, so the
// target keeps up with the format (verbs_wire.h's kWireVersion says when it changed).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "fuzz_util.h"
#include "transport/verbs/verbs_wire.h"

namespace kvstash::transport::verbs {
namespace {

std::string encode(const LeaseMessage& m) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, LeaseRequest>) return encode_lease_request(v);
        if constexpr (std::is_same_v<T, LeaseRelease>) return encode_lease_release(v);
        if constexpr (std::is_same_v<T, LeaseRevoke>) return encode_lease_revoke(v);
      },
      m);
}

std::string encode(const std::vector<KeyPart>& parts) { return encode_key(parts); }
std::string encode(const Address& a) { return encode_address(a); }
std::string encode(const Hello& h) { return encode_hello(h); }
std::string encode(const LeaseReply& r) { return encode_lease_reply(r); }
std::string encode(const LeaseRevoked& r) { return encode_lease_revoked(r); }

// decode(encode(decode(x))) succeeds and encodes to the same bytes as decode(x).
template <typename Decode>
void round_trip(std::string_view in, Decode decode, const char* what) {
  auto first = decode(in);
  if (!first.is_ok()) {
    FUZZ_CHECK(first.status().code() == StatusCode::kInvalidArgument, "%s: refused with %s", what,
               first.status().to_string().c_str());
    return;
  }
  const std::string bytes = encode(*first);
  auto second = decode(bytes);
  FUZZ_CHECK(second.is_ok(), "%s: its own encoding does not decode: %s", what,
             second.status().to_string().c_str());
  FUZZ_CHECK(encode(*second) == bytes, "%s: the encoding is not stable", what);
}

}  // namespace
}  // namespace kvstash::transport::verbs

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash::transport::verbs;
  static const bool quiet = (kvstash::fuzz::quiet_logs(), true);
  (void)quiet;
  const std::string_view in(reinterpret_cast<const char*>(data), size);

  round_trip(in, decode_address, "address");
  round_trip(in, decode_hello, "hello");
  round_trip(in, decode_key, "remote key");
  round_trip(in, decode_lease_message, "lease message");
  round_trip(in, decode_lease_reply, "lease reply");
  round_trip(in, decode_lease_revoked, "lease revoke answer");

  if (auto a = decode_address(in); a.is_ok()) {
    // Our ports against theirs, as a connect pairs them (here both lists are the peer's).
    const auto& ports = a->ports;
    for (auto [ours, theirs] : pair_rails(ports, ports)) {
      FUZZ_CHECK(ours < ports.size() && theirs < ports.size(), "pair_rails pairs a port that is not there");
    }
    if (auto m = match_ports(ports, ports)) {
      FUZZ_CHECK(m->first < ports.size() && m->second < ports.size(),
                 "match_ports names a port that is not there");
    }
  }
  return 0;
}
