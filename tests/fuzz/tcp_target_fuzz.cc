// The tcp transport's target side as a client on the network sees it: a real tcp Transport
// (with and without a cluster token) serves a kRemote and a kLeased region in this process;
// each input is what one client connection sends it: the handshake (ServerHello is read,
// ClientHello and its MAC come from the input or, on request, from this harness) and then
// RequestHeaders with their payloads (reads, writes, revokes). After each input: the
// connection must have ended within 5 s of the client's last byte, the bytes around the
// regions must be untouched, open descriptors must not pile up, and a real initiator must
// still write and read both regions (the leased one under a fresh lease), through a fresh
// connection every 32nd input.
//
// Input: byte 0 is flags, the rest goes to the socket.
//   bit 0  serve through the transport that requires a cluster token
//   bit 1  the harness does the handshake correctly first (the rest is requests)
//   bit 2  requests are rewritten so they can land: a header whose key is 0, 1 or 2 names
//          the remote region, the leased region, or a region deregistered at start-up, and
//          its addr is then an offset from that region's base (payloads pass through as is)
//   bit 3  serve through a transport that checks grants (kvstash/grant.h; no token): the
//          leased region is reached only under a grant this harness signed
//   bit 4  (with bit 3) the harness sends a grant of its own first: lease 7 may write the
//          first half of the leased region (GRANT frames in the input ride along, forged)
// With grants checked, nothing may change the leased region's second half, nor its first
// half without bit 4: only a grant the harness signed lets a write land.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/grant.h"
#include "common/handshake.h"
#include "common/system.h"
#include "common/wire.h"
#include "fuzz_util.h"
#include "health.h"
#include "kvstash/engine.h"
#include "kvstash/grant.h"
#include "transport/tcp/tcp_internal.h"
#include "transport/tcp/tcp_transport.h"

namespace kvstash {
namespace {

namespace tcpi = transport::tcp;

constexpr std::size_t kRegion = 16 << 10;
constexpr std::size_t kGap = 4096;
constexpr std::uint8_t kCanary = 0xA5;
constexpr char kToken[] = "fuzz-cluster-token";

std::uint64_t key_of(const transport::LocalRegistration& reg) {
  const std::string packed = reg.packed_key();
  wire::Reader r(packed);
  r.u8();  // version
  return r.u64();
}

std::uint16_t port_of(const std::string& address) {
  wire::Reader r(address);
  r.u32();
  r.bytes();
  return r.u16();
}

// Grants this harness signs with its own key: runs are byte offsets into the leased region.
class HarnessGrants final : public GrantCheck {
 public:
  explicit HarnessGrants(std::uintptr_t leased_base) : base_(leased_base), key_(grant::new_key()) {}
  Result<Grant> check(std::string_view text) const override {
    KVSTASH_ASSIGN_OR_RETURN(grant::Terms t, grant::verify(key_, text));
    if (t.issuer != "fuzz" || t.deadline == 0) return Status::permission_denied("not the harness's grant");
    Grant g;
    g.op = t.op;
    g.fence = t.deadline;
    if (t.whole) {
      g.ranges.push_back({base_, kRegion});
      return g;
    }
    for (auto [first, count] : t.runs) {
      if (first >= kRegion || count > kRegion - first) return Status::permission_denied("outside the region");
      g.ranges.push_back({base_ + first, count});
    }
    return g;
  }
  // A grant for `op` over [first, first + count) of the leased region (the whole of it for
  // count 0).
  std::string sign(TransferOp op, std::uint64_t first, std::uint64_t count) const {
    grant::Terms t{.issuer = "fuzz", .epoch = "1", .op = op, .deadline = std::uint64_t{1} << 62};
    t.whole = count == 0;
    if (!t.whole) t.runs.emplace_back(first, count);
    return grant::sign(key_, t);
  }

 private:
  std::uintptr_t base_;
  std::vector<std::uint8_t> key_;
};

// One served transport: [gap][remote region][gap][leased region][gap], the gaps canaries.
struct Served {
  std::unique_ptr<transport::Transport> transport;
  std::string token;
  std::uint16_t port = 0;
  Buffer memory;
  std::unique_ptr<transport::LocalRegistration> remote, leased;
  std::uint64_t keys[3] = {};  // remote, leased, deregistered
  std::byte* bases[3] = {};
  std::unique_ptr<transport::Transport> initiator;  // the health check's, with the same token
  Buffer scratch;
  std::unique_ptr<transport::LocalRegistration> scratch_reg;
  std::shared_ptr<transport::Endpoint> health;  // the health check's connection
  std::uint64_t checks = 0;
  std::shared_ptr<const HarnessGrants> grants;  // checked, for the third transport

  void start(std::string cluster_token, bool check_grants = false) {
    token = std::move(cluster_token);
    TcpOptions o;
    o.streams = 1;
    o.io_threads = 1;
    // Most inputs are failed handshakes from 127.0.0.1, each followed by a good one that must
    // get through: the guessing backoff would (rightly) refuse those.
    o.guess_backoff = false;
    transport = fuzz::must(transport::make_tcp_transport(o, token), "tcp target");
    port = port_of(transport->local_address());
    memory = fuzz::must(Buffer::allocate(3 * kGap + 2 * kRegion), "regions");
    std::memset(memory.data(), kCanary, memory.size());
    bases[0] = memory.data() + kGap;
    bases[1] = bases[0] + kRegion + kGap;
    remote = fuzz::must(transport->register_memory({bases[0], kRegion, MemoryKind::kHost}, Access::kRemote),
                        "remote");
    leased = fuzz::must(transport->register_memory({bases[1], kRegion, MemoryKind::kHost}, Access::kLeased),
                        "leased");
    keys[0] = key_of(*remote);
    keys[1] = key_of(*leased);
    if (check_grants) {
      grants = std::make_shared<HarnessGrants>(reinterpret_cast<std::uintptr_t>(bases[1]));
      transport->set_grant_check(grants);
    }
    {
      auto gone = fuzz::must(
          transport->register_memory({bases[0], kRegion, MemoryKind::kHost}, Access::kRemote), "gone");
      keys[2] = key_of(*gone);
      bases[2] = bases[0];
    }
    initiator = fuzz::must(transport::make_tcp_transport(o, token), "tcp initiator");
    scratch = fuzz::must(Buffer::allocate(2 * kRegion), "scratch");
    scratch_reg = fuzz::must(initiator->register_memory(scratch.region(), Access::kLocal), "scratch reg");
  }

  bool canaries_intact() const {
    const std::byte* p = memory.data();
    const std::size_t gaps[3] = {0, kGap + kRegion, 2 * (kGap + kRegion)};
    for (std::size_t g : gaps) {
      for (std::size_t i = 0; i < kGap; ++i) {
        if (p[g + i] != std::byte{kCanary}) return false;
      }
    }
    return true;
  }
};

Served& served(bool with_token, bool grants = false) {
  static Served* s = [] {
    fuzz::quiet_logs();
    auto* s = new Served[3];
    s[0].start("");
    s[1].start(kToken);
    s[2].start("", true);
    return s;
  }();
  return s[grants ? 2 : with_token ? 1 : 0];
}

// Rewrites requests so that they can reach the served regions (flags bit 2).
std::string rewrite(const Served& s, std::string_view in, bool hello_first) {
  std::string out;
  if (hello_first) {  // the client's own ClientHello leads
    out.append(in.substr(0, sizeof(tcpi::ClientHello)));
    in.remove_prefix(std::min(in.size(), sizeof(tcpi::ClientHello)));
  }
  while (in.size() >= sizeof(tcpi::RequestHeader)) {
    tcpi::RequestHeader h;
    std::memcpy(&h, in.data(), sizeof h);
    in.remove_prefix(sizeof h);
    if (h.key < 3) {
      const std::size_t i = static_cast<std::size_t>(h.key);
      h.key = s.keys[i];
      h.addr += reinterpret_cast<std::uintptr_t>(s.bases[i]);
    }
    out.append(reinterpret_cast<const char*>(&h), sizeof h);
    if (h.op == static_cast<std::uint8_t>(TransferOp::kWrite) || h.op == tcpi::kGrantOp) {
      const std::size_t payload = static_cast<std::size_t>(std::min<std::uint64_t>(h.length, in.size()));
      out.append(in.substr(0, payload));
      in.remove_prefix(payload);
    }
  }
  out.append(in);
  return out;
}

// The client half of the handshake, done right; the target must accept it.
void client_handshake(const Served& s, int fd, fuzz::Clock::time_point deadline) {
  tcpi::ServerHello hello;
  FUZZ_CHECK(fuzz::recv_exact(fd, &hello, sizeof hello, deadline), "no ServerHello within 5 s");
  FUZZ_CHECK(hello.magic == tcpi::kServerMagic && hello.token_required == (s.token.empty() ? 0 : 1),
             "malformed ServerHello");
  handshake::Handshake proof(handshake::Role::kClient, s.token);
  FUZZ_CHECK(proof.on_peer_hello(hello.nonce, hello.token_required != 0).is_ok(), "the handshake refused");
  tcpi::ClientHello mine{};
  mine.magic = tcpi::kClientMagic;
  mine.version = tcpi::kProtocolVersion;
  mine.nonce = proof.nonce();
  mine.mac = proof.proof();
  FUZZ_CHECK(fuzz::send_all(fd, {reinterpret_cast<const char*>(&mine), sizeof mine}, deadline),
             "target did not take a ClientHello");
  tcpi::ServerVerdict verdict;
  FUZZ_CHECK(fuzz::recv_exact(fd, &verdict, sizeof verdict, deadline), "no ServerVerdict within 5 s");
  FUZZ_CHECK(verdict.status == static_cast<std::uint32_t>(StatusCode::kOk),
             "a correct handshake was refused");
}

// An initiator writes and reads both regions (the leased one under a fresh lease): through
// a fresh connection every 32nd input, else through the last one (a connection per input
// would leave thousands a second in TIME_WAIT and use up the ephemeral ports).
void check_healthy(Served& s) {
  const Deadline deadline = deadline_after(std::chrono::seconds(5));
  if (!s.health || !s.health->healthy() || ++s.checks % 32 == 0) {
    s.health.reset();
    Result<std::shared_ptr<transport::Endpoint>> ep = Status::unavailable("not yet");
    for (int attempt = 0; attempt < 50 && !ep.is_ok(); ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      ep = s.initiator->connect(s.transport->local_address(), deadline);
    }
    FUZZ_CHECK(ep.is_ok(), "a fresh initiator cannot connect: %s", ep.status().to_string().c_str());
    s.health = std::move(ep).value();
  }
  transport::Endpoint& ep = *s.health;
  const std::string pattern(1024, static_cast<char>(sys::random_u64() | 1));
  for (int i = 0; i < 2; ++i) {
    const auto base = reinterpret_cast<std::uintptr_t>(s.bases[i]);
    auto key = ep.import_key(base, kRegion, (i == 0 ? s.remote : s.leased)->packed_key(), deadline);
    FUZZ_CHECK(key.is_ok(), "import_key: %s", key.status().to_string().c_str());
    std::unique_ptr<transport::RemoteKey> use = std::move(key).value();
    std::unique_ptr<transport::RemoteKey> read;  // under grants: a lease of its own, for reads
    if (i == 1) {
      const RemoteRange range{base, kRegion};
      auto lease = [&](TransferOp op) {
        transport::LeaseTerms terms;
        terms.id = sys::random_u64() | 1;
        terms.op = op;
        terms.ttl = std::chrono::seconds(10);
        if (s.grants) terms.grant = std::make_shared<const std::string>(s.grants->sign(op, 0, 0));
        return fuzz::must(ep.lease_key(*use, {&range, 1}, terms, deadline), "lease_key");
      };
      if (s.grants) read = lease(TransferOp::kRead);
      use = lease(TransferOp::kWrite);
    }
    const std::string why =
        fuzz::write_read(ep, *use, base + 512, pattern, s.scratch.data(), s.scratch_reg.get(), read.get());
    FUZZ_CHECK(why.empty(), "region %d after the input: %s", i, why.c_str());
  }
}

}  // namespace
}  // namespace kvstash

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  static const int baseline_fds = [] {
    served(false);
    served(true);
    served(false, true);
    return fuzz::open_fds();
  }();
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const bool grants = (flags & 8) != 0, granted = grants && (flags & 16) != 0;
  Served& s = served((flags & 1) != 0 && !grants, grants);
  // What no input may change: the leased region's second half (with grants checked), and its
  // first half too unless the harness grants it.
  const std::size_t kept_from = granted ? kRegion / 2 : 0;
  const std::string kept = grants ? std::string(reinterpret_cast<const char*>(s.bases[1]) + kept_from,
                                                kRegion - kept_from)
                                  : std::string();

  const auto deadline = fuzz::Clock::now() + std::chrono::seconds(5);
  int fd = fuzz::connect_loopback(s.port);
  FUZZ_CHECK(fd >= 0, "cannot connect to the target: %s", std::strerror(errno));
  const bool ours = (flags & 2) != 0;
  if (ours) client_handshake(s, fd, deadline);
  std::string bytes = (flags & 4) != 0 ? rewrite(s, rest, !ours) : std::string(rest);
  if (granted && ours) {
    const std::string text = s.grants->sign(TransferOp::kWrite, 0, kRegion / 2);
    tcpi::RequestHeader h{};
    h.op = tcpi::kGrantOp;
    h.key = s.keys[1];
    h.lease = 7;
    h.length = text.size();
    bytes.insert(0, reinterpret_cast<const char*>(&h), sizeof h);
    bytes.insert(sizeof h, text);
  }
  // The target may stop reading (a refused request closes the connection): not a failure.
  (void)fuzz::converse(fd, bytes, deadline);
  ::shutdown(fd, SHUT_WR);
  const auto ended = fuzz::drain(fd, fuzz::Clock::now() + std::chrono::seconds(5));
  ::close(fd);
  FUZZ_CHECK(ended == fuzz::Drain::kClosed,
             "the target kept the connection open 5 s after the client's last byte");

  FUZZ_CHECK(s.canaries_intact(), "memory next to a served region was written");
  FUZZ_CHECK(!grants || std::memcmp(kept.data(), s.bases[1] + kept_from, kept.size()) == 0,
             "a write landed in the leased region where no grant the harness signed reached");
  check_healthy(s);
  FUZZ_CHECK(s.canaries_intact(), "memory next to a served region was written");
  FUZZ_CHECK(fuzz::open_fds() < baseline_fds + 64, "open descriptors pile up: %d, %d at start",
             fuzz::open_fds(), baseline_fds);
  return 0;
}
