// The tcp transport's initiator side against a target that answers with anything (a broken
// or hostile memory node): a fake target on loopback takes a real tcp endpoint's handshake
// and requests, and answers with bytes from the input. The endpoint posts four ops (a read,
// a write, and two reads the stream sends as one request) into buffers fenced by canaries.
// Every op must complete within 5 s; no byte outside the ops' buffers may change; and an op
// may succeed only where the response stream, read the way the protocol frames it, answered
// its request with status 0 and (for a read) exactly the requested payload, which must then
// be what the buffer holds.
//
// Input: byte 0 is flags; bit 0: the fake target does the handshake itself, correctly; else
// the next 24 bytes are its ServerHello and the 36 after them its ServerVerdict. Then chunks,
// each [length u16 LE][bytes]: chunk k is sent once request k has arrived, the rest after the
// last request; then the fake target hangs up.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/system.h"
#include "common/wire.h"
#include "fuzz_util.h"
#include "health.h"
#include "kvstash/engine.h"
#include "transport/tcp/tcp_internal.h"
#include "transport/tcp/tcp_transport.h"

namespace kvstash {
namespace {

namespace tcpi = transport::tcp;

constexpr std::uint64_t kRemoteBase = 0x100000;
constexpr std::size_t kGap = 64;
constexpr std::uint8_t kCanary = 0xC3;

// The ops: remote offset, length, direction. Ops 2 and 3 continue each other remotely, so
// the stream sends them as one request.
struct OpSpec {
  std::uint64_t offset;
  std::size_t length;
  TransferOp op;
};
constexpr std::array<OpSpec, 4> kOps = {{{0, 64, TransferOp::kRead},
                                         {4096, 64, TransferOp::kWrite},
                                         {8192, 32, TransferOp::kRead},
                                         {8224, 32, TransferOp::kRead}}};
// The requests they make: (read?, length).
constexpr std::array<std::pair<bool, std::uint64_t>, 3> kRequests = {{{true, 64}, {false, 64}, {true, 64}}};
constexpr std::array<int, 4> kRequestOf = {0, 1, 2, 2};
// The completion sink each op reports to. The stream merges only ops of one sink (one batch),
// so ops 2 and 3 share theirs; with a sink each they went out as two requests, and the
// fake target's count of requests (and the oracle's framing) was off by one.
constexpr std::array<int, 4> kSinkOf = {0, 1, 2, 2};

struct World {
  std::unique_ptr<transport::Transport> initiator;
  int listener = -1;
  std::string address;  // the fake target's tcp address blob
};

World& world() {
  static World* w = [] {
    fuzz::quiet_logs();
    auto* w = new World;
    TcpOptions o;
    o.streams = 1;
    o.io_threads = 1;
    w->initiator = fuzz::must(transport::make_tcp_transport(o), "tcp initiator");
    w->listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    FUZZ_CHECK(::bind(w->listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                   ::listen(w->listener, 16) == 0 &&
                   ::getsockname(w->listener, reinterpret_cast<sockaddr*>(&a), &len) == 0,
               "fake target: %s", std::strerror(errno));
    wire::Writer addr;
    addr.u32(0x3154564b);  // tcp_transport.cc's address magic, "KVT1"
    addr.bytes("127.0.0.1");
    addr.u16(ntohs(a.sin_port));
    w->address = addr.take();
    return w;
  }();
  return *w;
}

struct Script {
  bool handshake = true;
  std::string hello, verdict;
  std::vector<std::string> chunks;
};

// The fake target. Appends every byte it sends after the handshake to *sent.
void fake_target(const World& w, const Script& s, std::string* sent) {
  const auto deadline = fuzz::Clock::now() + std::chrono::seconds(4);
  const int c = fuzz::accept_until(w.listener, deadline);
  if (c < 0) return;
  tcpi::ClientHello client;
  if (s.handshake) {
    tcpi::ServerHello hello{};
    hello.magic = tcpi::kServerMagic;
    hello.version = tcpi::kProtocolVersion;
    tcpi::ServerVerdict verdict{};
    (void)fuzz::send_all(c, {reinterpret_cast<const char*>(&hello), sizeof hello}, deadline);
    if (!fuzz::recv_exact(c, &client, sizeof client, deadline)) return (void)::close(c);
    (void)fuzz::send_all(c, {reinterpret_cast<const char*>(&verdict), sizeof verdict}, deadline);
  } else {
    (void)fuzz::send_all(c, s.hello, deadline);
    if (!fuzz::recv_exact(c, &client, sizeof client, deadline)) return (void)::close(c);
    (void)fuzz::send_all(c, s.verdict, deadline);
  }
  std::size_t next = 0;
  for (std::size_t request = 0; request < kRequests.size(); ++request) {
    tcpi::RequestHeader h;
    if (!fuzz::recv_exact(c, &h, sizeof h, deadline)) break;
    std::string payload(
        h.op == static_cast<std::uint8_t>(TransferOp::kWrite) ? std::min<std::uint64_t>(h.length, 4096) : 0,
        '\0');
    if (!fuzz::recv_exact(c, payload.data(), payload.size(), deadline)) break;
    const bool last = request + 1 == kRequests.size();
    for (; next < s.chunks.size() && (last || next <= request); ++next) {
      if (!fuzz::send_all(c, s.chunks[next], deadline)) break;
      sent->append(s.chunks[next]);
    }
  }
  ::shutdown(c, SHUT_WR);
  (void)fuzz::drain(c, deadline);  // until the endpoint is closed: no reset overtakes the data
  ::close(c);
}

// What each op may end with, reading `sent` as the initiator frames it: true where its
// request got status 0 and the right length, with its share of the payload in *payload.
std::array<bool, 4> allowed(std::string_view sent, std::array<std::string, 4>* payload) {
  std::array<bool, 3> request_ok{};
  for (std::size_t k = 0; k < kRequests.size(); ++k) {
    tcpi::ResponseHeader r;
    if (sent.size() < sizeof r) break;
    std::memcpy(&r, sent.data(), sizeof r);
    sent.remove_prefix(sizeof r);
    const bool ok = r.status == 0;
    const std::uint64_t expect = ok && kRequests[k].first ? kRequests[k].second : 0;
    if (r.length != expect || sent.size() < expect) break;  // the stream fails every op left
    if (ok && expect > 0) {
      std::string_view data = sent.substr(0, expect);
      for (std::size_t i = 0; i < kOps.size(); ++i) {
        if (kRequestOf[i] != static_cast<int>(k)) continue;
        (*payload)[i] = std::string(data.substr(0, kOps[i].length));
        data.remove_prefix(kOps[i].length);
      }
    }
    sent.remove_prefix(expect);
    request_ok[k] = ok;
  }
  std::array<bool, 4> out{};
  for (std::size_t i = 0; i < kOps.size(); ++i) out[i] = request_ok[kRequestOf[i]];
  return out;
}

}  // namespace
}  // namespace kvstash

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  World& w = world();
  std::string_view in(reinterpret_cast<const char*>(data), size);
  if (in.empty()) return -1;
  Script script;
  script.handshake = (in[0] & 1) != 0;
  in.remove_prefix(1);
  if (!script.handshake) {
    if (in.size() < sizeof(tcpi::ServerHello) + sizeof(tcpi::ServerVerdict)) return -1;
    script.hello = std::string(in.substr(0, sizeof(tcpi::ServerHello)));
    in.remove_prefix(sizeof(tcpi::ServerHello));
    script.verdict = std::string(in.substr(0, sizeof(tcpi::ServerVerdict)));
    in.remove_prefix(sizeof(tcpi::ServerVerdict));
  }
  while (in.size() >= 2) {
    const std::size_t len = std::min<std::size_t>(
        static_cast<std::uint8_t>(in[0]) | static_cast<std::uint8_t>(in[1]) << 8, in.size() - 2);
    script.chunks.emplace_back(in.substr(2, len));
    in.remove_prefix(2 + len);
  }

  // Each op's local bytes between canaries: [gap][op 0][gap][op 1][gap]...
  static std::vector<std::byte> local((kGap + 64) * kOps.size() + kGap);
  std::memset(local.data(), kCanary, local.size());
  auto at = [](std::size_t i) { return local.data() + kGap + i * (kGap + 64); };
  std::string sent;
  std::thread target(fake_target, std::cref(w), std::cref(script), &sent);
  std::array<std::optional<Status>, 4> results;
  {
    auto ep = w.initiator->connect(w.address, deadline_after(std::chrono::seconds(2)));
    if (ep.is_ok()) {
      auto key =
          fuzz::must((*ep)->import_key(kRemoteBase, 1 << 20,
                                       std::string("\x02") + std::string(8, 'k') + std::string(1, '\0'),
                                       deadline_after(std::chrono::seconds(1))),
                     "import_key");
      std::array<fuzz::WaitSink, 3> sinks;
      std::array<transport::Op, 4> ops;
      for (std::size_t i = 0; i < kOps.size(); ++i) {
        if (kOps[i].op == TransferOp::kWrite) std::memset(at(i), 'w', kOps[i].length);
        ops[i] = {.op = kOps[i].op,
                  .local = at(i),
                  .remote_addr = kRemoteBase + kOps[i].offset,
                  .remote_key = key.get(),
                  .length = kOps[i].length,
                  .sink = &sinks[kSinkOf[i]],
                  .tag = static_cast<std::uint32_t>(i)};
      }
      (*ep)->post(ops);
      for (std::size_t i = 0; i < kOps.size(); ++i) {
        const auto shared = static_cast<std::size_t>(std::count(kSinkOf.begin(), kSinkOf.end(), kSinkOf[i]));
        results[i] = sinks[kSinkOf[i]].wait(shared, deadline_after(std::chrono::seconds(5)));
        FUZZ_CHECK(results[i].has_value(), "op %zu did not complete within 5 s", i);
      }
    }
  }
  target.join();

  for (std::size_t i = 0; i <= kOps.size(); ++i) {
    const std::byte* gap = local.data() + i * (kGap + 64);
    for (std::size_t b = 0; b < kGap; ++b)
      FUZZ_CHECK(gap[b] == std::byte{kCanary}, "a byte next to op %zu changed", i);
    if (i < kOps.size()) {
      for (std::size_t b = kOps[i].length; b < 64; ++b) {
        FUZZ_CHECK(at(i)[b] == std::byte{kCanary}, "a byte past op %zu's buffer changed", i);
      }
    }
  }
  std::array<std::string, 4> payload;
  const auto ok = allowed(sent, &payload);
  for (std::size_t i = 0; i < kOps.size(); ++i) {
    if (!results[i] || !results[i]->is_ok()) continue;
    FUZZ_CHECK(ok[i], "op %zu succeeded, but its response was a refusal or malformed", i);
    if (kOps[i].op == TransferOp::kRead) {
      FUZZ_CHECK(std::memcmp(at(i), payload[i].data(), kOps[i].length) == 0,
                 "op %zu read other bytes than sent", i);
    }
  }
  return 0;
}
