// TLS on the tcp transport: a node and a client in one process over loopback, with throwaway
// credentials made for each test (tests/harness/throwaway_tls.h). Bytes round trip through TLS
// intact; a node whose certificate does not verify, a plain peer on either side, a missing or
// foreign client certificate and a wrong cluster token are refused quickly with distinct
// statuses; grants hold as they do in the clear.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "common/grant.h"
#include "kvstash/engine.h"
#include "node/node_grants.h"
#include "recording_sink.h"
#include "test_util.h"
#include "tests/harness/throwaway_tls.h"
#include "transport/tcp/tcp_internal.h"
#include "transport/tcp/tcp_transport.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;
using Sink = test::RecordingSink;

// A directory of its own per test, removed after it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "kvstash-tls-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class TcpTls : public ::testing::Test {
 protected:
  void SetUp() override {
    auto made = harness::make_throwaway_tls(dir_.path());
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    tls_ = *made;
    std::filesystem::create_directory(dir_.path() + "/other");
    auto other = harness::make_throwaway_tls(dir_.path() + "/other", "another CA");
    ASSERT_TRUE(other.is_ok()) << other.status().to_string();
    other_ = *other;
  }

  TcpOptions serving(bool require_client_cert = false) const {
    TcpOptions o;
    o.tls.cert_file = tls_.server_cert;
    o.tls.key_file = tls_.server_key;
    if (require_client_cert) o.tls.client_ca_file = tls_.ca_cert;
    return o;
  }
  TcpOptions connecting(bool with_client_cert = false) const {
    TcpOptions o;
    o.tls.ca_file = tls_.ca_cert;
    if (with_client_cert) {
      o.tls.client_cert_file = tls_.client_cert;
      o.tls.client_key_file = tls_.client_key;
    }
    return o;
  }

  // Connects `initiator` to `target`: the result, and how long it took.
  static std::pair<Result<std::shared_ptr<Endpoint>>, std::chrono::milliseconds> connect(Transport& initiator,
                                                                                         Transport& target) {
    const auto t0 = std::chrono::steady_clock::now();
    auto ep = initiator.connect(target.local_address(), deadline_after(10s));
    return {std::move(ep),
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)};
  }

  TempDir dir_;
  harness::ThrowawayTls tls_, other_;
};

struct Pair {
  std::unique_ptr<Transport> target, initiator;
  Buffer remote, local;
  std::unique_ptr<LocalRegistration> reg;
  std::shared_ptr<Endpoint> ep;
  std::unique_ptr<RemoteKey> key;

  Op op(TransferOp what, std::size_t local_off, std::size_t remote_off, std::size_t len, Sink& sink,
        std::uint32_t tag, std::uint32_t lane = 0) {
    Op o;
    o.op = what;
    o.local = local.data() + local_off;
    o.remote_addr = reinterpret_cast<std::uintptr_t>(remote.data()) + remote_off;
    o.remote_key = key.get();
    o.length = len;
    o.lane = lane;
    o.sink = &sink;
    o.tag = tag;
    return o;
  }
};

Pair make_pair(std::size_t size, const TcpOptions& target_opts, const TcpOptions& init_opts) {
  Pair p;
  p.target = make_tcp_transport(target_opts).value();
  p.initiator = make_tcp_transport(init_opts).value();
  p.remote = Buffer::allocate(size).value();
  p.local = Buffer::allocate(size).value();
  p.reg = p.target->register_memory(p.remote.region(), Access::kRemote).value();
  auto ep = p.initiator->connect(p.target->local_address(), deadline_after(5s));
  EXPECT_TRUE(ep.is_ok()) << ep.status().to_string();
  if (!ep.is_ok()) return p;
  p.ep = *ep;
  auto base = reinterpret_cast<std::uintptr_t>(p.remote.data());
  p.key = p.ep->import_key(base, size, p.reg->packed_key(), deadline_after(5s)).value();
  return p;
}

TEST_F(TcpTls, WritesAndReadsRoundTripByteForByte) {
  constexpr std::size_t kSize = 24u << 20;
  Pair p = make_pair(kSize + 8192, serving(), connecting());
  ASSERT_TRUE(p.ep);
  std::uint32_t tag = 0;
  // Below, at and across a record (16 KiB), a request's 4 MiB cap, and many MiB.
  for (std::size_t len : {std::size_t{1}, std::size_t{4099}, std::size_t{16384 - 48}, std::size_t{16385},
                          std::size_t{1} << 20, std::size_t{5} << 20, kSize}) {
    SCOPED_TRACE(len);
    const std::size_t loff = len % 7, roff = len % 13 + 1;
    test::fill_random({p.local.data() + loff, len}, len);
    Sink w;
    Op op = p.op(TransferOp::kWrite, loff, roff, len, w, tag);
    p.ep->post({&op, 1});
    ASSERT_TRUE(w.wait(1));
    ASSERT_TRUE(w.status(tag).is_ok()) << w.status(tag).to_string();
    ASSERT_EQ(test::first_mismatch(p.local.data() + loff, p.remote.data() + roff, len), -1);
    std::memset(p.local.data(), 0, p.local.size());
    Sink r;
    op = p.op(TransferOp::kRead, loff, roff, len, r, tag);
    p.ep->post({&op, 1});
    ASSERT_TRUE(r.wait(1));
    ASSERT_TRUE(r.status(tag).is_ok()) << r.status(tag).to_string();
    ASSERT_EQ(test::first_mismatch(p.local.data() + loff, p.remote.data() + roff, len), -1);
  }
}

TEST_F(TcpTls, ManyConcurrentOpsAcrossStreamsMoveIntact) {
  // Threads post writes and reads at once on every stream: the caller's thread sends while the
  // stream's strand reads responses, through one TLS session per connection.
  constexpr std::size_t kChunk = 40000, kThreads = 4, kPerThread = 96;
  constexpr std::size_t kHalf = kChunk * kThreads * kPerThread;
  Pair p = make_pair(2 * kHalf, serving(), [&] {
    TcpOptions o = connecting();
    o.streams = 3;
    return o;
  }());
  ASSERT_TRUE(p.ep);
  test::fill_random(p.local.bytes(), 7);
  test::fill_random(p.remote.bytes().subspan(kHalf), 8);  // what the reads fetch
  Sink sink;
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (std::size_t i = 0; i < kPerThread; ++i) {
        const std::size_t off = (t * kPerThread + i) * kChunk;
        const auto tag = static_cast<std::uint32_t>(off / kChunk);
        const auto lane = static_cast<std::uint32_t>(i % 3);
        Op ops[2] = {p.op(TransferOp::kWrite, off, off, kChunk, sink, 2 * tag, lane),
                     p.op(TransferOp::kRead, kHalf + off, kHalf + off, kChunk, sink, 2 * tag + 1, lane)};
        p.ep->post(ops);
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(sink.wait(2 * kThreads * kPerThread));
  for (std::uint32_t i = 0; i < 2 * kThreads * kPerThread; ++i) ASSERT_TRUE(sink.status(i).is_ok()) << i;
  EXPECT_EQ(test::first_mismatch(p.local.data(), p.remote.data(), 2 * kHalf), -1);
}

TEST_F(TcpTls, ANodeWhoseCertificateDoesNotVerifyIsRefused) {
  auto target = make_tcp_transport(serving()).value();
  // Another CA, and the right CA but a name the certificate does not carry.
  TcpOptions wrong_ca;
  wrong_ca.tls.ca_file = other_.ca_cert;
  TcpOptions wrong_name = connecting();
  wrong_name.tls.server_name = "node.elsewhere.example";
  for (const TcpOptions& o : {wrong_ca, wrong_name}) {
    auto initiator = make_tcp_transport(o).value();
    auto [ep, took] = connect(*initiator, *target);
    ASSERT_FALSE(ep.is_ok());
    EXPECT_EQ(ep.status().code(), StatusCode::kPermissionDenied) << ep.status().to_string();
    EXPECT_NE(ep.status().message().find("certificate failed verification"), std::string::npos)
        << ep.status().to_string();
    EXPECT_LT(took, 5s);
  }
  // The name it does carry.
  TcpOptions by_name = connecting();
  by_name.tls.server_name = "localhost";
  auto initiator = make_tcp_transport(by_name).value();
  auto [ep, took] = connect(*initiator, *target);
  EXPECT_TRUE(ep.is_ok()) << ep.status().to_string();
}

TEST_F(TcpTls, APlainPeerOnEitherSideFailsFastAndSaysWhy) {
  auto tls_node = make_tcp_transport(serving()).value();
  auto plain_node = make_tcp_transport({}).value();
  auto plain_client = make_tcp_transport({}).value();
  auto tls_client = make_tcp_transport(connecting()).value();

  auto [plain_to_tls, t1] = connect(*plain_client, *tls_node);
  ASSERT_FALSE(plain_to_tls.is_ok());
  EXPECT_EQ(plain_to_tls.status().code(), StatusCode::kUnsupported) << plain_to_tls.status().to_string();
  EXPECT_NE(plain_to_tls.status().message().find("serves TLS only"), std::string::npos);
  EXPECT_LT(t1, 2s) << "not a wait for the deadline";

  auto [tls_to_plain, t2] = connect(*tls_client, *plain_node);
  ASSERT_FALSE(tls_to_plain.is_ok());
  EXPECT_EQ(tls_to_plain.status().code(), StatusCode::kUnsupported) << tls_to_plain.status().to_string();
  EXPECT_NE(tls_to_plain.status().message().find("serves plain tcp"), std::string::npos);
  EXPECT_LT(t2, 2s);

  // Both nodes still serve their own kind.
  EXPECT_TRUE(connect(*tls_client, *tls_node).first.is_ok());
  EXPECT_TRUE(connect(*plain_client, *plain_node).first.is_ok());
}

TEST_F(TcpTls, ANodeWithAClientCaRequiresAndChecksClientCertificates) {
  auto target = make_tcp_transport(serving(/*require_client_cert=*/true)).value();
  TcpOptions foreign = connecting();
  foreign.tls.client_cert_file = other_.client_cert;
  foreign.tls.client_key_file = other_.client_key;
  for (const TcpOptions& o : {connecting(), foreign}) {
    auto initiator = make_tcp_transport(o).value();
    auto [ep, took] = connect(*initiator, *target);
    ASSERT_FALSE(ep.is_ok());
    EXPECT_EQ(ep.status().code(), StatusCode::kPermissionDenied) << ep.status().to_string();
    EXPECT_NE(ep.status().message().find("certificate"), std::string::npos) << ep.status().to_string();
    EXPECT_LT(took, 5s);
  }
  Pair p = make_pair(1u << 20, serving(true), connecting(/*with_client_cert=*/true));
  ASSERT_TRUE(p.ep);
  test::fill_random(p.local.bytes(), 3);
  Sink sink;
  Op op = p.op(TransferOp::kWrite, 0, 0, 1u << 20, sink, 0);
  p.ep->post({&op, 1});
  ASSERT_TRUE(sink.wait(1));
  EXPECT_TRUE(sink.status(0).is_ok()) << sink.status(0).to_string();
  EXPECT_EQ(test::first_mismatch(p.local.data(), p.remote.data(), 1u << 20), -1);
}

std::uint64_t counter(const Transport& t, const std::string& name) {
  for (const auto& c : t.counters()) {
    if (c.name == name) return c.value;
  }
  return 0;
}

// A raw connection to `target`'s listener (loopback).
int raw_connect(const Transport& target) {
  const std::string address = target.local_address();
  // The address blob ends with the port, little-endian (tcp_transport.cc's encode_address).
  const auto port = static_cast<std::uint16_t>(static_cast<std::uint8_t>(address[address.size() - 2]) |
                                               static_cast<std::uint8_t>(address[address.size() - 1]) << 8);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whoever connects without finishing TLS, or speaks something else, holds its connection no
// longer than the handshake timeout, and a client that does finish still gets in.
TEST_F(TcpTls, NoUnfinishedHandshakeStallsTheNode) {
  TcpOptions o = serving();
  o.handshake_timeout = 300ms;
  auto target = make_tcp_transport(o, "a-cluster-token-of-32-characters").value();
  const int silent = raw_connect(*target);
  const int babbler = raw_connect(*target);
  ASSERT_GE(silent, 0);
  ASSERT_GE(babbler, 0);
  tcp::ServerHello hello{};
  ASSERT_EQ(::recv(silent, &hello, sizeof hello, MSG_WAITALL), static_cast<ssize_t>(sizeof hello));
  EXPECT_EQ(hello.magic, tcp::kTlsServerMagic) << "the clear-text hello says TLS follows";
  const std::string junk(512, 'x');
  ASSERT_EQ(::send(babbler, junk.data(), junk.size(), 0), static_cast<ssize_t>(junk.size()));
  // Both end: the babbler at once (not TLS), the silent one at the timeout.
  for (int fd : {babbler, silent}) {
    char buf[256];
    const auto t0 = std::chrono::steady_clock::now();
    ssize_t n;
    do {
      n = ::recv(fd, buf, sizeof buf, 0);
    } while (n > 0 && std::chrono::steady_clock::now() - t0 < 5s);
    EXPECT_LE(n, 0);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
    ::close(fd);
  }
  EXPECT_TRUE(test::eventually([&] { return counter(*target, "handshakes_failed") >= 1; }));
  EXPECT_TRUE(test::eventually([&] { return counter(*target, "handshake_timeouts") >= 1; }));
  auto client = make_tcp_transport(connecting(), "a-cluster-token-of-32-characters").value();
  EXPECT_TRUE(connect(*client, *target).first.is_ok());
}

// TLS 1.3 by default; a peer that can only do 1.2 is still served (forward-secret AEAD
// suites), and one that offers less than 1.2 is refused.
TEST_F(TcpTls, TlsOneThreeByDefaultAndOneTwoAtLeast) {
  auto target = make_tcp_transport(serving()).value();
  auto handshake = [&](int max_version) -> Result<std::string> {
    auto context = tcp::TlsContext::connecting(connecting().tls);
    if (!context.is_ok()) return context.status();
    if (max_version != 0) {
      // A peer that offers up to `max_version` (older versions need OpenSSL's security level 0).
      SSL_CTX_set_security_level((*context)->get(), 0);
      SSL_CTX_set_cipher_list((*context)->get(), "DEFAULT:@SECLEVEL=0");
      SSL_CTX_set_min_proto_version((*context)->get(), TLS1_VERSION);
      SSL_CTX_set_max_proto_version((*context)->get(), max_version);
    }
    const int fd = raw_connect(*target);
    tcp::ServerHello hello{};
    if (::recv(fd, &hello, sizeof hello, MSG_WAITALL) != static_cast<ssize_t>(sizeof hello)) {
      ::close(fd);
      return Status::unavailable("no hello");
    }
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    auto session = tcp::connect_tls(**context, fd, "127.0.0.1", deadline_after(5s));
    Result<std::string> out =
        session.is_ok() ? Result<std::string>((*session)->describe()) : session.status();
    if (session.is_ok()) {
      // The kvstash hello follows inside TLS.
      Status got = tcp::tls_recv_all(**session, fd, &hello, sizeof hello, deadline_after(5s));
      if (!got.is_ok() || hello.magic != tcp::kServerMagic)
        out = Status::corrupt("no kvstash hello inside TLS");
    }
    ::close(fd);
    return out;
  };
  auto v13 = handshake(0);
  ASSERT_TRUE(v13.is_ok()) << v13.status().to_string();
  EXPECT_NE(v13->find("TLSv1.3"), std::string::npos) << *v13;
  EXPECT_NE(v13->find("AES_128_GCM"), std::string::npos) << *v13;
  auto v12 = handshake(TLS1_2_VERSION);
  ASSERT_TRUE(v12.is_ok()) << v12.status().to_string();
  EXPECT_NE(v12->find("TLSv1.2"), std::string::npos) << *v12;
  EXPECT_NE(v12->find("ECDHE"), std::string::npos) << *v12;
  EXPECT_NE(v12->find("GCM"), std::string::npos) << *v12;
  auto v11 = handshake(TLS1_1_VERSION);
  ASSERT_FALSE(v11.is_ok());
  EXPECT_NE(v11.status().message().find("protocol version"), std::string::npos) << v11.status().to_string();
}

TEST_F(TcpTls, TheClusterTokenIsStillProvedInsideTls) {
  const std::string token = "a-cluster-token-of-32-characters";
  auto target = make_tcp_transport(serving(), token).value();
  auto right = make_tcp_transport(connecting(), token).value();
  auto wrong = make_tcp_transport(connecting(), "another-token-of-32-characters!!").value();
  EXPECT_TRUE(connect(*right, *target).first.is_ok());
  auto [ep, took] = connect(*wrong, *target);
  ASSERT_FALSE(ep.is_ok());
  EXPECT_EQ(ep.status().code(), StatusCode::kPermissionDenied) << ep.status().to_string();
  EXPECT_NE(ep.status().message().find("cluster token"), std::string::npos) << ep.status().to_string();
}

TEST_F(TcpTls, BadOptionsAreRefusedAtStart) {
  auto code = [](const TcpOptions& o) { return make_tcp_transport(o).status().code(); };
  TcpOptions no_key;
  no_key.tls.cert_file = tls_.server_cert;
  EXPECT_EQ(code(no_key), StatusCode::kInvalidArgument);
  TcpOptions wrong_key = serving();
  wrong_key.tls.key_file = tls_.client_key;
  EXPECT_EQ(code(wrong_key), StatusCode::kInvalidArgument) << "a key that is not the certificate's";
  TcpOptions missing = connecting();
  missing.tls.ca_file = dir_.path() + "/nothing.pem";
  EXPECT_EQ(code(missing), StatusCode::kInvalidArgument);
  TcpOptions unverified;
  unverified.tls.client_cert_file = tls_.client_cert;
  unverified.tls.client_key_file = tls_.client_key;
  EXPECT_EQ(code(unverified), StatusCode::kInvalidArgument)
      << "a client certificate but no CA to verify the node";
  TcpOptions ca_without_cert;
  ca_without_cert.tls.client_ca_file = tls_.ca_cert;
  EXPECT_EQ(code(ca_without_cert), StatusCode::kInvalidArgument);
  auto made = make_tcp_transport(no_key);
  EXPECT_NE(made.status().message().find("key_file"), std::string::npos) << made.status().to_string();
}

TEST_F(TcpTls, TheEnvironmentGivesUnplumbedClientsTheirCa) {
  auto target = make_tcp_transport(serving()).value();
  ::setenv("KVSTASH_TLS_CA", tls_.ca_cert.c_str(), 1);
  auto from_env = make_tcp_transport({});
  ::unsetenv("KVSTASH_TLS_CA");
  ASSERT_TRUE(from_env.is_ok()) << from_env.status().to_string();
  auto [ep, took] = connect(**from_env, *target);
  EXPECT_TRUE(ep.is_ok()) << ep.status().to_string();
  // Options that name a CA win over the environment.
  ::setenv("KVSTASH_TLS_CA", other_.ca_cert.c_str(), 1);
  auto own = make_tcp_transport(connecting());
  ::unsetenv("KVSTASH_TLS_CA");
  ASSERT_TRUE(own.is_ok());
  EXPECT_TRUE(connect(**own, *target).first.is_ok());
}

// ---- grants under TLS: two engines, a leased pool behind a grant check -----------------------

TEST_F(TcpTls, GrantsStillBoundWhatALeaseReaches) {
  constexpr std::uint64_t kPages = 16, kPage = 4096;
  EngineOptions to, io;
  to.transports = io.transports = {TransportKind::kTcp};
  to.cluster_token = io.cluster_token = "a-cluster-token-of-32-characters";
  to.tcp = serving(true);
  io.tcp = connecting(true);
  auto target = Engine::create(to).value();
  auto initiator = Engine::create(io).value();
  auto pool = Buffer::allocate(kPages * kPage).value();
  test::fill_random(pool.bytes(), 11);
  const auto base = reinterpret_cast<std::uint64_t>(pool.data());
  auto check = std::make_shared<node::NodeGrants>("n1", base, kPage, kPages);
  const std::string hex = check->rotate("e1");
  std::vector<std::uint8_t> key;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) key.push_back(std::stoi(hex.substr(i, 2), nullptr, 16));
  target->set_grant_check(check);
  auto handle = target->register_memory(pool.region(), Access::kLeased).value();
  auto peer = initiator->connect(target->address(), deadline_after(5s));
  ASSERT_TRUE(peer.is_ok()) << peer.status().to_string();
  auto region = (*peer)->import_key(handle.remote_key()).value();
  auto local = Buffer::allocate(kPages * kPage).value();
  auto local_handle = initiator->register_memory(local.region(), Access::kLocal).value();
  auto sign = [&](TransferOp op, std::uint64_t first, std::uint64_t count) {
    grant::Terms t;
    t.issuer = "n1";
    t.epoch = "e1";
    t.op = op;
    t.deadline = 1'000'000;
    t.runs = {{first, count}};
    return grant::sign(key, t);
  };
  auto reach = [&](TransferOp op, std::uint64_t first, std::uint64_t count, const std::string& grant) {
    const RemoteRange r{base + first * kPage, count * kPage};
    auto lease = (*peer)->lease(region, {&r, 1}, {.op = op, .ttl = 5s, .fence = 1'000'000, .grant = grant});
    if (!lease.is_ok()) return lease.status();
    const TransferEntry e{.op = op,
                          .local = &local_handle,
                          .local_addr = local.data() + first * kPage,
                          .remote_addr = r.addr,
                          .remote = &*lease,
                          .length = r.length};
    return (*peer)->transfer({&e, 1}, deadline_after(5s));
  };
  const std::string g = sign(TransferOp::kRead, 2, 2);
  ASSERT_TRUE(reach(TransferOp::kRead, 2, 2, g).is_ok());
  EXPECT_EQ(std::memcmp(local.data() + 2 * kPage, pool.data() + 2 * kPage, 2 * kPage), 0);
  const auto before = std::vector<std::byte>(pool.data(), pool.data() + pool.size());
  test::fill_random(local.bytes(), 99);
  EXPECT_EQ(reach(TransferOp::kRead, 4, 1, g).code(), StatusCode::kPermissionDenied)
      << "a page beside the grant";
  EXPECT_EQ(reach(TransferOp::kRead, 0, kPages, g).code(), StatusCode::kPermissionDenied) << "the whole pool";
  EXPECT_EQ(reach(TransferOp::kWrite, 2, 1, g).code(), StatusCode::kPermissionDenied)
      << "a write under a read grant";
  EXPECT_EQ(reach(TransferOp::kWrite, 0, kPages, "").code(), StatusCode::kPermissionDenied) << "no grant";
  EXPECT_EQ(std::memcmp(before.data(), pool.data(), pool.size()), 0) << "a refused write changed the pool";
  ASSERT_TRUE(reach(TransferOp::kWrite, 10, 1, sign(TransferOp::kWrite, 10, 1)).is_ok());
  EXPECT_EQ(std::memcmp(local.data() + 10 * kPage, pool.data() + 10 * kPage, kPage), 0);
}

}  // namespace
}  // namespace kvstash::transport
