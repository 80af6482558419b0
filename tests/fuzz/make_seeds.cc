// Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) from the real encoders:
// the engine's, tcp's, shm's and verbs' own encode functions and transports, and, for the
// catalog, replies recorded from a real redis-server (tests/harness/redis_server.h) answering a real
// Catalog through a recording proxy. `scripts/fuzz --seeds` runs it; its output is committed.
//
//   fuzz_make_seeds DIR     writes DIR/<target>/<name> (existing files are overwritten)
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "../harness/redis_server.h"
#include "common/grant.h"
#include "common/system.h"
#include "common/wire.h"
#include "engine/blobs.h"
#include "fuzz_util.h"
#include "kvcache/object_layout.h"
#include "kvstash/engine.h"
#include "kvstash_config.h"
#include "metadata/cell.h"
#include "metadata/redis_client.h"
#include "node/tier_headers.h"
#include "resp.h"
#include "transport/shm/shm_internal.h"
#include "transport/tcp/tcp_internal.h"
#if KVSTASH_HAVE_VERBS
#include "transport/verbs/verbs_wire.h"
#endif

namespace kvstash {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

fs::path out_dir;

void seed(const std::string& target, const std::string& name, std::string_view bytes) {
  const fs::path dir = out_dir / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string u8(std::uint8_t v) { return std::string(1, static_cast<char>(v)); }

template <typename T>
std::string raw(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof v);
}

// ---- engine blobs ----------------------------------------------------------------------------

void engine_blobs() {
  const std::string t = "engine_blobs";
  EngineOptions o;
  o.transports = {TransportKind::kShm, TransportKind::kTcp};
  o.shm.socket_dir = (fuzz::scratch_dir("seeds") / "shm").string();
  auto engine = fuzz::must(Engine::create(o), "engine");
  auto buffer = fuzz::must(Buffer::allocate(4096), "buffer");
  auto remote = fuzz::must(engine->register_memory(buffer.region(), Access::kRemote), "register");
  auto leased = fuzz::must(engine->register_memory(buffer.region(), Access::kLeased), "register leased");
  seed(t, "address_shm_tcp", engine->address());
  seed(t, "key_shm_tcp", remote.remote_key());
  seed(t, "key_leased", leased.remote_key());
  seed(t, "address_text", to_text(engine->address()));
  // What the fuzz target's own engine can import: a tcp part only.
  EngineOptions tcp_only;
  tcp_only.transports = {TransportKind::kTcp};
  auto tcp_engine = fuzz::must(Engine::create(tcp_only), "tcp engine");
  auto tcp_key = fuzz::must(tcp_engine->register_memory(buffer.region(), Access::kRemote), "register tcp");
  seed(t, "address_tcp", tcp_engine->address());
  seed(t, "key_tcp", tcp_key.remote_key());
  // A newer peer's transport (kind 9) next to tcp; an empty address; too many parts.
  blobs::Parts parts{{static_cast<TransportKind>(9), "future"}, {TransportKind::kTcp, "x"}};
  seed(t, "address_unknown_kind", blobs::encode_parts(blobs::kAddressMagic, 0, 0, parts, false));
  seed(t, "key_unknown_kind", blobs::encode_parts(blobs::kKeyMagic, 4096, 8192, parts, true));
  seed(t, "address_empty", blobs::encode_parts(blobs::kAddressMagic, 0, 0, {}, false));
  seed(t, "address_17_parts",
       blobs::encode_parts(blobs::kAddressMagic, 0, 0, blobs::Parts(17, {TransportKind::kTcp, "a"}), false));
}

// ---- tcp target ------------------------------------------------------------------------------

namespace tcpi = transport::tcp;

std::string header(std::uint8_t op, std::uint64_t key, std::uint64_t addr, std::uint64_t length,
                   std::uint64_t lease = 0, std::uint64_t fence = 0) {
  tcpi::RequestHeader h{};
  h.op = op;
  h.key = key;
  h.addr = addr;
  h.length = length;
  h.lease = lease;
  h.fence = fence;
  return raw(h);
}

void tcp_target() {
  const std::string t = "tcp_target";
  constexpr std::uint8_t kToken = 1, kHandshake = 2, kRewrite = 4;
  constexpr std::uint8_t kRead = 0, kWrite = 1, kRevoke = tcpi::kRevokeOp;
  const std::string payload(64, 'w');
  // Keys 0, 1, 2: remote region, leased region, a deregistered one; addr: offset in it.
  seed(t, "write_read_remote",
       u8(kHandshake | kRewrite) + header(kWrite, 0, 128, 64) + payload + header(kRead, 0, 128, 64));
  seed(t, "write_read_leased",
       u8(kToken | kHandshake | kRewrite) + header(kWrite, 1, 0, 64, 77, 0) + payload +
           header(kRead, 1, 0, 64, 77, 0) + header(kRevoke, 1, 0, 0, 77, 0) + header(kRead, 1, 0, 64, 77, 0));
  seed(t, "leased_without_lease",
       u8(kHandshake | kRewrite) + header(kRead, 1, 0, 64) + header(kWrite, 1, 0, 8) + "12345678");
  seed(t, "fenced_lease", u8(kHandshake | kRewrite) + header(kRead, 1, 0, 64, 5, 1));
  seed(t, "deregistered",
       u8(kHandshake | kRewrite) + header(kRead, 2, 0, 64) + header(kWrite, 2, 0, 4) + "abcd");
  seed(t, "out_of_range",
       u8(kHandshake | kRewrite) + header(kRead, 0, 16 << 10, 1) + header(kRead, 0, ~0ull, 2) +
           header(kWrite, 0, 0, (16 << 10) + 1) + payload);
  seed(t, "short_write", u8(kHandshake | kRewrite) + header(kWrite, 0, 0, 4096) + payload);
  seed(t, "huge_write_refused", u8(kHandshake | kRewrite) + header(kWrite, 5, 0, 1ull << 40));
  seed(t, "bad_op", u8(kHandshake | kRewrite) + header(7, 0, 0, 1) + header(kRead, 0, 0, 1));
  // Regression: a revoke of lease 0 (none) spun the target's io thread forever.
  seed(t, "regress_revoke_lease_0", u8(kHandshake | kRewrite) + header(kRevoke, 0, 0, 0, 0, 0));
  seed(t, "revoke_remote_region", u8(kHandshake | kRewrite) + header(kRevoke, 0, 0, 0, 9, 3));
  // The client's own ClientHello: right (no token), wrong magic, wrong version, a guessed MAC.
  tcpi::ClientHello hello{};
  hello.magic = tcpi::kClientMagic;
  hello.version = tcpi::kProtocolVersion;
  seed(t, "raw_hello", u8(0) + raw(hello) + header(kRead, 1234, 0, 8));
  seed(t, "raw_hello_rewritten",
       u8(kRewrite) + raw(hello) + header(kWrite, 0, 0, 8) + "12345678" + header(kRead, 0, 0, 8));
  seed(t, "raw_hello_token", u8(kToken) + raw(hello));
  tcpi::ClientHello wrong = hello;
  wrong.magic = tcpi::kServerMagic;
  seed(t, "raw_hello_magic", u8(0) + raw(wrong));
  wrong = hello;
  wrong.version = tcpi::kProtocolVersion + 1;
  seed(t, "raw_hello_version", u8(0) + raw(wrong));
  seed(t, "raw_short_hello", u8(0) + raw(hello).substr(0, 10));
  seed(t, "empty", u8(kHandshake));
  // Grants checked (8); with 16 the harness grants lease 7 writes over the leased region's
  // first 8 KiB. Inside, beside, forged, released, and a read under a write grant.
  constexpr std::uint8_t kGrants = 8, kGranted = 16;
  const std::uint8_t granted = kHandshake | kRewrite | kGrants | kGranted;
  seed(t, "granted_write_inside",
       u8(granted) + header(kWrite, 1, 0, 64, 7, 0) + payload + header(kRead, 1, 0, 64, 7, 0));
  seed(t, "granted_write_beside",
       u8(granted) + header(kWrite, 1, (8 << 10) - 32, 64, 7, 0) + payload +
           header(kWrite, 1, 12 << 10, 64, 7, 0) + payload);
  seed(t, "granted_read_under_write_grant", u8(granted) + header(kRead, 1, 0, 64, 7, 0));
  seed(t, "granted_then_released",
       u8(granted) + header(tcpi::kReleaseOp, 1, 0, 0, 7, 0) + header(kWrite, 1, 0, 64, 7, 0) + payload);
  const std::string forged = "g1 fuzz 1 w 4611686018427387904 * 0123456789abcdef0123456789abcdef01234567";
  seed(t, "forged_grant",
       u8(kHandshake | kRewrite | kGrants) + header(tcpi::kGrantOp, 1, 0, forged.size(), 9, 0) + forged +
           header(kWrite, 1, 0, 64, 9, 0) + payload);
  seed(t, "grant_without_lease",
       u8(kHandshake | kRewrite | kGrants) + header(tcpi::kGrantOp, 1, 0, forged.size(), 0, 0) + forged);
  seed(t, "lease_without_grant",
       u8(kHandshake | kRewrite | kGrants) + header(kWrite, 1, 0, 64, 9, 0) + payload);
}

// What a target answers a tcp initiator: a response header, and a read's payload.
std::string response(std::uint32_t status, std::uint32_t reason, std::uint64_t length,
                     std::string_view payload = {}) {
  tcpi::ResponseHeader r{};
  r.status = status;
  r.reason = reason;
  r.length = length;
  return raw(r) + std::string(payload);
}

// tcp_initiator_fuzz.cc's chunks: [length u16][bytes].
std::string chunk(std::string_view bytes) {
  wire::Writer w;
  w.u16(static_cast<std::uint16_t>(bytes.size()));
  w.raw(bytes);
  return w.take();
}

void tcp_initiator() {
  const std::string t = "tcp_initiator";
  constexpr std::uint8_t kHandshake = 1;
  constexpr std::uint32_t kOk = 0, kDenied = static_cast<std::uint32_t>(StatusCode::kPermissionDenied);
  // Three requests: a 64-byte read, a 64-byte write, two 32-byte reads as one 64-byte request.
  const std::string a(64, 'a'), b(64, 'b');
  seed(t, "answered",
       u8(kHandshake) + chunk(response(kOk, 0, 64, a)) + chunk(response(kOk, 0, 0)) +
           chunk(response(kOk, 0, 64, b)));
  seed(t, "refused",
       u8(kHandshake) + chunk(response(kDenied, 1, 0)) + chunk(response(kDenied, 2, 0)) +
           chunk(response(kDenied, 5, 0)));
  seed(t, "one_chunk",
       u8(kHandshake) + chunk(response(kOk, 0, 64, a) + response(kOk, 0, 0) + response(kOk, 0, 64, b)));
  seed(t, "wrong_length",
       u8(kHandshake) + chunk(response(kOk, 0, 32, a.substr(0, 32))) + chunk(response(kOk, 0, 0)));
  seed(t, "payload_for_write",
       u8(kHandshake) + chunk(response(kOk, 0, 64, a)) + chunk(response(kOk, 0, 64, a)));
  seed(t, "short_payload", u8(kHandshake) + chunk(response(kOk, 0, 64, a.substr(0, 10))));
  seed(t, "extra_response",
       u8(kHandshake) + chunk(response(kOk, 0, 64, a)) + chunk(response(kOk, 0, 0)) +
           chunk(response(kOk, 0, 64, b) + response(kOk, 0, 0)));
  // Regression: status 256 narrowed to StatusCode's byte read as OK (a read "done", unfilled).
  seed(t, "regress_status_256",
       u8(kHandshake) + chunk(response(256, 1, 0)) + chunk(response(0x37000000, 1, 0)) +
           chunk(response(kOk, 0, 64, b)));
  // The target's own handshake: right, wrong magic, a token this client does not have, refused.
  tcpi::ServerHello hello{};
  hello.magic = tcpi::kServerMagic;
  hello.version = tcpi::kProtocolVersion;
  tcpi::ServerVerdict verdict{};
  seed(t, "handshake", u8(0) + raw(hello) + raw(verdict) + chunk(response(kOk, 0, 64, a)));
  tcpi::ServerHello bad = hello;
  bad.magic = tcpi::kClientMagic;
  seed(t, "handshake_magic", u8(0) + raw(bad) + raw(verdict));
  bad = hello;
  bad.token_required = 1;
  seed(t, "handshake_token", u8(0) + raw(bad) + raw(verdict));
  tcpi::ServerVerdict no = verdict;
  no.status = kDenied;
  seed(t, "handshake_refused", u8(0) + raw(hello) + raw(no));
}

// ---- verbs wire ------------------------------------------------------------------------------

void verbs_wire() {
#if KVSTASH_HAVE_VERBS
  namespace v = transport::verbs;
  const std::string t = "verbs_wire";
  v::PortAddress roce;
  roce.device = "rxe0";
  roce.node_guid = 0x1122334455667788ull;
  roce.gid.raw[10] = roce.gid.raw[11] = 0xff;  // ::ffff:10.0.0.1
  roce.gid.raw[12] = 10;
  roce.gid.raw[15] = 1;
  v::PortAddress ib = roce;
  ib.device = "mlx5_1";
  ib.ethernet = false;
  ib.lid = 7;
  ib.mtu = IBV_MTU_4096;
  seed(t, "address_roce", v::encode_address({"127.0.0.1:7000", {roce}}));
  seed(t, "address_two_rails", v::encode_address({"[::1]:7000", {roce, ib}}));
  v::Hello h;
  h.node_guid = roce.node_guid;
  h.peer_guid = 0x99;
  h.qp = {0x1234, 0x777, roce.gid, 0, IBV_MTU_1024};
  h.max_rd_atomic = 16;
  h.token_required = true;
  seed(t, "hello", v::encode_hello(h));
  const v::KeyPart parts[] = {{roce.node_guid, 0xabcd, false}, {ib.node_guid, 0x1234, true}};
  seed(t, "key_two_devices", v::encode_key(parts));
  v::LeaseRequest q;
  q.id = 42;
  q.region_rkey = 0xabcd;
  q.write = true;
  q.ttl_ms = 1000;
  q.fence = 123456;
  q.ranges = {{0x10000, 4096}, {0x20000, 8192}};
  seed(t, "lease_request", v::encode_lease_request(q));
  q.grant = "g1 node-1 e1 w 123456 16+1,32+2 0123456789abcdef0123456789abcdef01234567";
  seed(t, "lease_request_granted", v::encode_lease_request(q));
  v::LeaseReply ok;
  ok.id = 42;
  ok.rkeys = {0x11, 0x22};
  seed(t, "lease_reply", v::encode_lease_reply(ok));
  v::LeaseReply refused;
  refused.id = 42;
  refused.status = Status::stale("fenced");
  seed(t, "lease_reply_refused", v::encode_lease_reply(refused));
  seed(t, "lease_release", v::encode_lease_release({42}));
  seed(t, "lease_revoke", v::encode_lease_revoke({42, 123456}));
  seed(t, "lease_revoked", v::encode_lease_revoked({42}));
#endif
}

// ---- shm -------------------------------------------------------------------------------------

namespace shm = transport::shm;

constexpr std::uint8_t kHello = 1, kImport = 2, kRefused = 3;  // shm_transport.cc's MsgType

std::string shm_request(std::uint8_t type, std::uint64_t id, std::uint32_t slot = 0, std::uint64_t key = 0,
                        std::uint16_t version = shm::kVersion) {
  wire::Writer w;
  w.u32(shm::kMessageMagic);
  w.u16(version);
  w.u8(type);
  w.u64(id);
  if (type == kImport) {
    w.u32(slot);
    w.u64(key);
  }
  return w.take();
}

std::string shm_reply(std::uint8_t type, std::uint64_t id, StatusCode code, std::string_view message,
                      std::uint64_t a = 0, std::uint64_t b = 0, std::uint64_t c = 0) {
  wire::Writer w;
  w.u32(shm::kMessageMagic);
  w.u16(shm::kVersion);
  w.u8(type);
  w.u64(id);
  w.u8(static_cast<std::uint8_t>(code));
  w.bytes(message);
  w.u64(a);
  w.u64(b);
  w.u64(c);
  return w.take();
}

// A message of the shm targets' inputs: [flags or tag u8][length u16][bytes].
std::string framed(std::uint8_t tag, std::string_view bytes) {
  wire::Writer w;
  w.u8(tag);
  w.u16(static_cast<std::uint16_t>(bytes.size()));
  w.raw(bytes);
  return w.take();
}

void shm_records() {
  const std::string t = "shm_records";
  seed(t, "address", shm::encode_address({sys::boot_id(), 1000, "/run/user/1000/kvstash/shm-1234-1.sock"}));
  seed(t, "key", shm::encode_key({2, 0x1122334455667788ull, false}));
  seed(t, "key_leased", shm::encode_key({8191, 1, true}));
}

void shm_server() {
  const std::string t = "shm_server";
  constexpr std::uint8_t kFd = 1, kRewrite = 2;
  // Key 0 and 1 are rewritten to the remote and the leased region's slot and key.
  seed(t, "hello_import",
       framed(0, shm_request(kHello, 1)) + framed(kRewrite, shm_request(kImport, 2, 0, 0)) +
           framed(kRewrite, shm_request(kImport, 3, 0, 1)));
  seed(t, "import_unknown",
       framed(0, shm_request(kHello, 1)) + framed(0, shm_request(kImport, 2, 5, 99)) +
           framed(0, shm_request(kImport, 3, 0xffffffff, 1)));
  seed(t, "unknown_type", framed(0, shm_request(9, 1)) + framed(0, shm_request(kHello, 2)));
  seed(t, "old_version", framed(0, shm_request(kHello, 1, 0, 0, 1)));
  seed(t, "descriptor_attached",
       framed(kFd, shm_request(kHello, 1)) + framed(kFd | kRewrite, shm_request(kImport, 2, 0, 0)));
  seed(t, "trailing_bytes",
       framed(0, shm_request(kHello, 1) + "x") + framed(0, shm_request(kImport, 2) + "yz"));
  seed(t, "oversized", framed(0, std::string(1500, 'o')));
  seed(t, "empty_message", framed(0, ""));
}

void shm_client() {
  const std::string t = "shm_client";
  constexpr std::uint8_t kNone = 0, kKeyTable = 1, kRegion = 2, kTiny = 3, kPipe = 4, kAnswersImport = 8;
  const std::uint64_t base = 0x7f0000001000ull;
  auto head = [&](std::uint8_t key, std::uint64_t b, std::uint64_t len) {
    wire::Writer w;
    w.u8(key);
    w.u64(b);
    w.u64(len);
    return w.take();
  };
  const std::string hello = framed(kKeyTable, shm_reply(kHello, 1, StatusCode::kOk, "", shm::kKeySlots));
  seed(t, "import",
       head(0, base, 8192) + hello +
           framed(kAnswersImport | kRegion, shm_reply(kImport, 2, StatusCode::kOk, "", base, 65536, 0)));
  seed(t, "import_leased",
       head(8 | 3, base + 4096, 4096) + hello +
           framed(kAnswersImport | kRegion, shm_reply(kImport, 2, StatusCode::kOk, "", base, 16384, 4096)));
  seed(t, "import_tiny_file",
       head(1, base, 1) + hello +
           framed(kAnswersImport | kTiny, shm_reply(kImport, 2, StatusCode::kOk, "", base, 1, 0)));
  seed(t, "import_past_file",
       head(0, base, 65536) + hello +
           framed(kAnswersImport | kRegion, shm_reply(kImport, 2, StatusCode::kOk, "", base, 65536, 4096)));
  seed(t, "import_pipe",
       head(0, base, 16) + hello +
           framed(kAnswersImport | kPipe, shm_reply(kImport, 2, StatusCode::kOk, "", base, 16, 0)));
  seed(
      t, "import_refused",
      head(0, base, 16) + hello +
          framed(kAnswersImport, shm_reply(kImport, 2, StatusCode::kPermissionDenied, "unknown remote key")));
  seed(t, "stale_reply_first",
       head(0, base, 16) + hello +
           framed(kAnswersImport | kRegion, shm_reply(kImport, 1, StatusCode::kOk, "", base, 16, 0)) +
           framed(kAnswersImport | kRegion, shm_reply(kImport, 2, StatusCode::kOk, "", base, 16, 0)));
  seed(
      t, "refused",
      head(0, base, 16) + framed(kNone, shm_reply(kRefused, 0, StatusCode::kPermissionDenied, "other user")));
  seed(t, "hello_without_table",
       head(0, base, 16) + framed(kNone, shm_reply(kHello, 1, StatusCode::kOk, "", shm::kKeySlots)));
  seed(t, "hello_wrong_size",
       head(0, base, 16) + framed(kTiny, shm_reply(kHello, 1, StatusCode::kOk, "", shm::kKeySlots)));
  seed(t, "hello_foreign_table",
       head(0, base, 16) + framed(kRegion, shm_reply(kHello, 1, StatusCode::kOk, "", 8192)));
  seed(t, "hello_error",
       head(0, base, 16) + framed(kNone, shm_reply(kHello, 1, StatusCode::kUnsupported, "version")));
}

// ---- catalog: replies of a real redis-server -------------------------------------------------

// A proxy between a RedisClient and a real Redis that records each reply while `recording`.
class RecordingProxy {
 public:
  explicit RecordingProxy(int redis_port) : redis_port_(redis_port) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    FUZZ_CHECK(::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                   ::listen(listener_, 1) == 0 &&
                   ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len) == 0,
               "proxy: %s", std::strerror(errno));
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { run(); });
  }
  ~RecordingProxy() {
    thread_.join();
    ::close(listener_);
  }
  int port() const { return port_; }
  void start() {
    std::lock_guard lock(mu_);
    replies_.clear();
    recording_ = true;
  }
  // The replies recorded since start(), back to back.
  std::string stop() {
    std::lock_guard lock(mu_);
    recording_ = false;
    std::string all;
    for (auto& r : replies_) all += r;
    return all;
  }

 private:
  // Reads until `buf` starts with one whole RESP message; returns its length (0: closed).
  static std::size_t read_message(int fd, std::string& buf) {
    fuzz::Framing f;
    char chunk[65536];
    for (;;) {
      if (std::size_t len = fuzz::resp_length(buf, f)) return len;
      const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n <= 0) return 0;
      buf.append(chunk, static_cast<std::size_t>(n));
    }
  }

  void run() {
    const int client = ::accept(listener_, nullptr, nullptr);
    const int redis = fuzz::connect_loopback(static_cast<std::uint16_t>(redis_port_));
    std::string from_client, from_redis;
    for (;;) {
      const std::size_t c = read_message(client, from_client);
      if (c == 0) break;
      (void)fuzz::send_all(redis, std::string_view(from_client).substr(0, c), fuzz::Clock::now() + 5s);
      from_client.erase(0, c);
      const std::size_t r = read_message(redis, from_redis);
      if (r == 0) break;
      const std::string reply = from_redis.substr(0, r);
      from_redis.erase(0, r);
      {
        std::lock_guard lock(mu_);
        if (recording_) replies_.push_back(reply);
      }
      (void)fuzz::send_all(client, reply, fuzz::Clock::now() + 5s);
    }
    ::close(client);
    ::close(redis);
  }

  int redis_port_;
  int listener_ = -1;
  int port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  bool recording_ = false;  // guarded by mu_
  std::vector<std::string> replies_;
};

void catalog() {
  const std::string t = "catalog";
  test::RedisServer redis;
  FUZZ_CHECK(redis.running(), "redis-server did not start (is it installed?)");
  RecordingProxy proxy(redis.port());
  metadata::RedisOptions o;
  o.url = "redis://127.0.0.1:" + std::to_string(proxy.port()) + "/0";
  auto cell = fuzz::must(metadata::Cell::open({.redis = o, .cell = "fuzz"}), "connect through the proxy");
  metadata::RedisClient* client = &cell->redis();
  metadata::Catalog& c = cell->catalog();
  metadata::NodeCatalog& node = cell->node_catalog();
  metadata::CellAdmin& admin = cell->admin();
  const std::vector<std::string> keys = {"chunk/0", "chunk/1", "chunk/2"};

  // A cell with one node, one object and one pending put, as the fuzz target's calls expect.
  auto setup = [&] {
    (void)client->command({"FLUSHALL"});
    fuzz::must(node.register_node({"node-1", "epoch-1", 4096, 64, "address", "key"}, 10s), "register_node");
    auto p = fuzz::must(c.begin_put("put-0", "object", 10000, 5s), "begin_put");
    FUZZ_CHECK(c.commit_put("put-0", "object", sum::ObjectSum{0x0123456789abcdefull}, "layout", 0ms).is_ok(),
               "commit_put");
    for (const auto& k : {"chunk/0", "chunk/1"}) {
      fuzz::must(c.begin_put(std::string("put-") + k, k, 100, 5s), "begin_put");
      FUZZ_CHECK(c.commit_put(std::string("put-") + k, k, sum::ObjectSum{1}, "layout", 0ms).is_ok(),
                 "commit_put");
    }
    (void)p;
  };
  // One seed per fuzz-target method: its index, then the replies its call read.
  struct Method {
    const char* name;
    std::uint8_t index;  // catalog_fuzz.cc's calls()
    std::function<void()> call;
    std::function<void()> prepare = [] {};  // not recorded
  };
  const std::vector<Method> methods = {
      {"check_schema", 0, [&] { (void)c.check_schema(); }},
      {"register_node", 1,
       [&] {
         (void)node.register_node({"node-1", "epoch-1", 4096, 64, "address", "key"}, 10s);
       }},
      {"heartbeat", 2, [&] { (void)node.heartbeat("node-1", "epoch-1", 10s, 1000); }},
      {"drain_node", 3, [&] { (void)node.drain_node("node-1", "epoch-1"); }},
      {"deregister_node", 4, [&] { (void)node.deregister_node("node-1", "epoch-1"); }},
      {"node_status", 5, [&] { (void)admin.node_status("node-1"); }},
      {"list_nodes", 6, [&] { (void)admin.list_nodes(); }},
      {"free_pages", 7, [&] { (void)admin.free_pages("node-1"); }},
      {"begin_put", 8, [&] { (void)c.begin_put("put-token", "object", 10000, 5s); }},
      {"commit_put", 9,
       [&] {
         (void)c.commit_put("put-token", "object", sum::ObjectSum{0x0123456789abcdefull}, "layout", 0ms,
                            std::string("old"));
       },
       [&] { (void)c.begin_put("put-token", "object", 10000, 5s); }},
      {"abort_put", 10,
       [&] {
         const std::vector<std::string> fenced = {"node-1"};
         (void)c.abort_put("put-token", fenced);
       },
       [&] { (void)c.begin_put("put-token", "object", 10000, 5s); }},
      {"begin_get", 11,
       [&] {
         auto g = c.begin_get("object", "reader-1", 5s);
         if (g.is_ok()) (void)c.end_get("reader-1", *g);
       }},
      {"stat", 12, [&] { (void)c.stat("object"); }},
      {"remove", 13, [&] { (void)c.remove("object"); }},
      {"touch", 14, [&] { (void)c.touch("object", 1s); }},
      {"contains_prefix", 15, [&] { (void)c.contains_prefix(keys); }},
      {"evict", 16, [&] { (void)admin.evict(1 << 20); }},
      {"cordon_node", 17, [&] { (void)admin.cordon_node("node-1"); }},
      {"known_nodes", 18, [&] { (void)admin.known_nodes(); }},
      {"forget_node", 19, [&] { (void)admin.forget_node("node-1"); }},
      {"summary", 20, [&] { (void)admin.summary(); }},
      {"scan_objects", 21, [&] { (void)admin.scan_objects("*", "0", 10); }},
      {"scan_node_objects", 22, [&] { (void)admin.scan_node_objects("node-1", "0", 10); }},
      {"describe", 23,
       [&] {
         std::int64_t now = 0;
         (void)admin.describe(keys, &now);
       }},
      {"evict_lru", 24,
       [&] {
         std::int64_t now = 0;
         (void)admin.evict_lru(0ms, 1 << 20, true, 16, &now);
       }},
      {"reclaim", 25, [&] { (void)node.reclaim(64); }},
  };
  for (const Method& m : methods) {
    setup();
    // Some seeds start from Redis without the scripts (restarted empty, never saw this build):
    // "Function not found", FUNCTION LOAD, and the call again.
    const bool flush = m.index % 4 == 0;
    m.prepare();
    if (flush) (void)client->command({"FUNCTION", "FLUSH"});
    proxy.start();
    m.call();
    seed(t, std::string(m.name) + (flush ? "_noscript" : ""), u8(m.index) + proxy.stop());
  }
  // The whole run, every call answered as a real Redis did (the target goes in index order).
  setup();
  proxy.start();
  for (const Method& m : methods) m.call();
  seed(t, "all_calls", u8(0) + proxy.stop());
  // A node past its deadline, an object without a node, and replies no Redis sends.
  // Logged in as an ACL user into database 3 (bit 7): AUTH and SELECT answered first.
  seed(t, "acl_login",
       u8(0x80 | 5) + "+OK\r\n+OK\r\n" +
           "*8\r\n$2\r\nup\r\n$7\r\nepoch-1\r\n:4096\r\n:64\r\n:60\r\n:1\r\n:2000\r\n:1000\r\n");
  seed(t, "acl_refused", u8(0x80) + "-WRONGPASS invalid username-password pair or user is disabled.\r\n");
  seed(t, "wrongtype", u8(11) + "-WRONGTYPE Operation against a key holding the wrong kind of value\r\n");
  seed(t, "busy", u8(12) + "-BUSY Redis is busy running a script\r\n");
  seed(t, "nil_reply", u8(5) + "$-1\r\n*-1\r\n:0\r\n");
  // Regressions: counts and clocks a corrupt reply carried past what the caller could handle.
  seed(t, "regress_contains_prefix_count", u8(15) + ":60\r\n");
  seed(t, "regress_begin_get_size_wraps",
       u8(11) +
           "*7\r\n:4096\r\n$3\r\ntok\r\n$20\r\n18446744073709551615\r\n$0\r\n\r\n$16\r\n0123456789abcdef\r\n"
           "$3\r\nlay\r\n:123456\r\n");
  seed(t, "regress_node_status_clock",
       u8(5) +
           "*8\r\n$2\r\nup\r\n$7\r\nepoch-1\r\n:4096\r\n:64\r\n:60\r\n:1\r\n:9000000000000000000\r\n"
           ":-9000000000000000000\r\n");
  cell.reset();  // closes the connection: the proxy's loop ends
}

// ---- admin HTTP ------------------------------------------------------------------------------

void admin_http() {
  const std::string t = "admin_http";
  seed(t, "get_metrics", u8(0) + "GET /metrics HTTP/1.1\r\nHost: node-1:9100\r\nAccept: */*\r\n\r\n");
  seed(t, "get_healthz_split", u8(0x15) + "GET /healthz HTTP/1.1\r\nUser-Agent: kube-probe/1.29\r\n\r\n");
  seed(t, "head_healthz", u8(0x3f) + "HEAD /healthz?verbose=1 HTTP/1.0\r\n\r\n");
  seed(t, "absolute_form", u8(0) + "GET http://127.0.0.1:9100/metrics HTTP/1.1\r\n\r\n");
  seed(t, "not_found", u8(0) + "GET /debug/pprof HTTP/1.1\r\n\r\n");
  seed(t, "post", u8(0) + "POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc");
  seed(t, "http2", u8(0) + "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
  seed(t, "blank_lines_first", u8(0) + "\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n");
  seed(t, "bad_header", u8(0) + "GET /metrics HTTP/1.1\r\nBad Header: x\r\n\r\n");
  seed(t, "folded_header", u8(0) + "GET /metrics HTTP/1.1\r\nA: b\r\n c\r\n\r\n");
  seed(t, "long_line", u8(0) + "GET /" + std::string(9000, 'a') + " HTTP/1.1\r\n\r\n");
  std::string many = "GET /metrics HTTP/1.1\r\n";
  for (int i = 0; i < 400; ++i) many += "X-" + std::to_string(i) + ": yyyyyyyyyy\r\n";
  seed(t, "many_headers", u8(0) + many + "\r\n");
  seed(t, "bare_lf", u8(0) + "GET /metrics HTTP/1.1\nHost: x\n\n");
  seed(t, "unfinished", u8(0) + "GET /metrics HTTP/1.1\r\nHost: x\r\n");
}

// ---- Redis records ---------------------------------------------------------------------------

void redis_records() {
  const std::string t = "redis_records";
  seed(t, "extents", u8(0) + "node-1,0,1;node-2,17,3;node-1,4294967296,9223372036854775807");
  seed(t, "extents_bad", u8(0) + "node 1,0,1;node-2,x,3");
  const std::string tag = "L2.P2.H8.D128.B16.bf16.nhd";
  seed(t, "layout", u8(2) + kvcache::object_layout(tag, {0x0123456789abcdefull, 0xfedcba9876543210ull}));
  seed(t, "layout_one_layer", u8(1) + kvcache::object_layout(tag, {0}));
  // Regression: a trailing comma was taken ("...,<16 hex>," parsed as the checksums before it).
  seed(t, "regress_layout_trailing_comma", u8(2) + kvcache::object_layout(tag, {1, 2}) + ",");
  seed(t, "layout_other_tag", u8(2) + kvcache::object_layout("L2.P1.H1.D576.B16.fp8_e4m3.nhd", {1, 2}));
  for (const char* d : {"fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "fp8"}) {
    seed(t, std::string("dtype_") + d, u8(0) + d);
  }
}

// ---- grants and tier headers ------------------------------------------------------------------

void grants() {
  const std::string t = "grants";
  const std::vector<std::uint8_t> key(grant::kKeyBytes, 0x42);  // grants_fuzz.cc's
  const auto g = [&](std::string word, TransferOp op, std::uint64_t deadline,
                     std::vector<std::pair<std::uint64_t, std::uint64_t>> runs) {
    return grant::sign(key, {.issuer = "n1",
                             .epoch = std::move(word),
                             .op = op,
                             .deadline = deadline,
                             .whole = runs.empty(),
                             .runs = std::move(runs)});
  };
  seed(t, "grant_registration_key", u8(0) + g("e1", TransferOp::kRead, 1'100'000, {{5, 2}, {7, 1}}));
  seed(t, "grant_retired_key", u8(0) + g("e1/1", TransferOp::kWrite, 1'200'000, {{0, 64}}));
  seed(t, "grant_current_whole", u8(0) + g("e1/2", TransferOp::kRead, 1'300'000, {}));
  seed(t, "grant_offered_past_pool", u8(0) + g("e1/3", TransferOp::kRead, 1'300'000, {{60, 8}}));
  seed(t, "grant_unsigned", u8(0) + "g1 n1 e1 r 99 1+1 " + std::string(40, '0'));
  node::TierHeader h{.sequence = 7,
                     .cell = "default",
                     .key = "kvp:{m}chunk-1",
                     .token = "tok",
                     .size = 100000,
                     .checksum = "0123456789abcdef/65536",
                     .layout = "L2.P2.H8.D128.B16.bf16.nhd;xxh3=0123456789abcdef",
                     .sum = "fedcba9876543210",
                     .expires_ms = 0,
                     .runs = {{3, 1}, {9, 1}}};
  const auto hk = node::tier_header_key("a-cluster-token-of-32-characters");
  seed(t, "header_keyed", u8(1) + node::encode_tier_header(h, 4096, hk).value());
  seed(t, "header_unkeyed", u8(1) + node::encode_tier_header(h, 4096).value());
}

}  // namespace
}  // namespace kvstash

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  kvstash::fuzz::quiet_logs();
  kvstash::out_dir = argv[1];
  kvstash::engine_blobs();
  kvstash::tcp_target();
  kvstash::tcp_initiator();
  kvstash::verbs_wire();
  kvstash::shm_records();
  kvstash::shm_server();
  kvstash::shm_client();
  kvstash::catalog();
  kvstash::admin_http();
  kvstash::redis_records();
  kvstash::grants();
  return 0;
}
