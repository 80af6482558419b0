// The tcp transport on its own: a target and an initiator transport in one process, talking
// over loopback sockets.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/grant.h"
#include "common/wire.h"
#include "node/node_grants.h"
#include "recording_sink.h"
#include "test_util.h"
#include "transport/tcp/tcp_internal.h"
#include "transport/tcp/tcp_transport.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;

using Sink = test::RecordingSink;

struct Pair {
  std::unique_ptr<Transport> target, initiator;
  Buffer remote, local;
  std::unique_ptr<LocalRegistration> reg;
  std::shared_ptr<Endpoint> ep;
  std::unique_ptr<RemoteKey> key;
};

Pair make_pair(std::size_t size, TcpOptions target_opts = {}, TcpOptions init_opts = {}) {
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

Op make_op(Pair& p, TransferOp op, std::size_t local_off, std::size_t remote_off, std::size_t len, Sink& sink,
           std::uint32_t tag, std::uint32_t lane = 0) {
  Op o;
  o.op = op;
  o.local = p.local.data() + local_off;
  o.remote_addr = reinterpret_cast<std::uintptr_t>(p.remote.data()) + remote_off;
  o.remote_key = p.key.get();
  o.length = len;
  o.lane = lane;
  o.sink = &sink;
  o.tag = tag;
  return o;
}

TEST(TcpTransport, WriteThenReadBackAtManySizesAndOffsets) {
  constexpr std::size_t kSize = 64u << 20;
  Pair p = make_pair(kSize + 8192);
  ASSERT_TRUE(p.ep);
  std::uint32_t tag = 0;
  for (std::size_t len : {std::size_t{1}, std::size_t{4099}, std::size_t{1} << 20, kSize}) {
    const std::size_t loff = len % 7, roff = len % 13 + 1;
    test::fill_random({p.local.data() + loff, len}, len);
    Sink w;
    Op op = make_op(p, TransferOp::kWrite, loff, roff, len, w, tag);
    p.ep->post({&op, 1});
    ASSERT_TRUE(w.wait(1));
    ASSERT_TRUE(w.status(tag).is_ok()) << w.status(tag).to_string();
    ASSERT_EQ(test::first_mismatch(p.local.data() + loff, p.remote.data() + roff, len), -1) << len;
    std::memset(p.local.data(), 0, p.local.size());
    Sink r;
    op = make_op(p, TransferOp::kRead, loff, roff, len, r, tag);
    p.ep->post({&op, 1});
    ASSERT_TRUE(r.wait(1));
    ASSERT_TRUE(r.status(tag).is_ok()) << r.status(tag).to_string();
    ASSERT_EQ(test::first_mismatch(p.local.data() + loff, p.remote.data() + roff, len), -1) << len;
  }
}

TEST(TcpTransport, ManyOpsAcrossLanesFromSeveralThreads) {
  constexpr std::size_t kChunk = 64u << 10, kThreads = 4, kPerThread = 64;
  Pair p = make_pair(kChunk * kThreads * kPerThread, {}, {.streams = 3});
  ASSERT_TRUE(p.ep);
  test::fill_random(p.local.bytes(), 7);
  Sink sink;
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (std::size_t i = 0; i < kPerThread; ++i) {
        std::size_t off = (t * kPerThread + i) * kChunk;
        Op op = make_op(p, TransferOp::kWrite, off, off, kChunk, sink,
                        static_cast<std::uint32_t>(off / kChunk), static_cast<std::uint32_t>(i % 3));
        p.ep->post({&op, 1});
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(sink.wait(kThreads * kPerThread));
  for (std::uint32_t i = 0; i < kThreads * kPerThread; ++i) ASSERT_TRUE(sink.status(i).is_ok());
  EXPECT_EQ(test::first_mismatch(p.local.data(), p.remote.data(), p.local.size()), -1);
}

TEST(TcpTransport, ScatteredPiecesOfOneRemoteRangeMoveIntact) {
  // One post of pieces that continue each other remotely but sit anywhere locally (a KV-cache
  // layer into one object): the stream sends runs of them as one request, up to 64 pieces or
  // 4 MiB; more pieces than one request holds, pieces of several sizes, then a read back
  // into yet another scatter.
  constexpr std::size_t kPieces = 300;
  std::vector<std::size_t> len(kPieces), remote_off(kPieces), local_off(kPieces);
  std::size_t total = 0;
  for (std::size_t i = 0; i < kPieces; ++i) {
    len[i] = i % 7 == 0 ? (1u << 20) + i : 4096 + i * 13;
    remote_off[i] = total;
    total += len[i];
  }
  Pair p = make_pair(2 * total, {}, {.streams = 2});
  ASSERT_TRUE(p.ep);
  std::vector<std::size_t> order(kPieces);
  for (std::size_t i = 0; i < kPieces; ++i) order[i] = (i * 113) % kPieces;  // 113 is coprime to 300
  std::size_t at = 0;
  for (std::size_t i : order) {
    local_off[i] = at;
    at += len[i];
  }
  test::fill_random(p.local.bytes(), 41);
  auto post_all = [&](TransferOp op, Sink& sink) {
    std::vector<Op> ops;
    for (std::size_t i = 0; i < kPieces; ++i) {
      ops.push_back(make_op(p, op, local_off[i], remote_off[i], len[i], sink, static_cast<std::uint32_t>(i),
                            static_cast<std::uint32_t>(i / 100)));  // lanes 0, 1, 2 (stream 0 twice)
    }
    p.ep->post(ops);
    ASSERT_TRUE(sink.wait(kPieces));
    for (std::uint32_t i = 0; i < kPieces; ++i) ASSERT_TRUE(sink.status(i).is_ok()) << i;
  };
  Sink w;
  post_all(TransferOp::kWrite, w);
  for (std::size_t i = 0; i < kPieces; ++i) {
    ASSERT_EQ(test::first_mismatch(p.local.data() + local_off[i], p.remote.data() + remote_off[i], len[i]),
              -1)
        << "piece " << i;
  }
  std::ranges::sort(order, [&](std::size_t a, std::size_t b) { return remote_off[a] > remote_off[b]; });
  at = total;
  for (std::size_t i : order) {  // the read lands in reverse order of the write's scatter
    local_off[i] = at;
    at += len[i];
  }
  std::memset(p.local.data() + total, 0, total);
  Sink r;
  post_all(TransferOp::kRead, r);
  for (std::size_t i = 0; i < kPieces; ++i) {
    ASSERT_EQ(test::first_mismatch(p.local.data() + local_off[i], p.remote.data() + remote_off[i], len[i]),
              -1)
        << "piece " << i;
  }
  EXPECT_TRUE(p.ep->healthy());
}

TEST(TcpTransport, ThousandsOfSmallPiecesInRunsOfEveryLengthMoveIntact) {
  // A KV-cache layer of one head group: a small piece per token, runs of pieces that continue
  // each other remotely broken by pieces that do not. The stream keeps every request it sent
  // until its response, in a ring that grows as it fills, also in the middle of gathering a
  // run: growing it must not move what the run is being gathered from. 1,200 runs (39,000
  // pieces) grow the ring to megabytes, which malloc maps and unmaps whole: a reference into
  // the old ring then faults rather than reading stale bytes.
  constexpr std::size_t kRuns = 1200, kPiece = 64;
  std::vector<std::size_t> remote_off;
  std::size_t at = 0;
  for (std::size_t run = 0; run < kRuns; ++run) {
    const std::size_t n = 1 + run % 64;  // 1, 2, ... 64 pieces that continue each other
    for (std::size_t i = 0; i < n; ++i) remote_off.push_back(at + i * kPiece);
    at += n * kPiece + kPiece;  // a gap: the next run is a request of its own
  }
  const std::size_t pieces = remote_off.size();
  Pair p = make_pair(std::max(at, pieces * kPiece), {}, {.streams = 1});
  ASSERT_TRUE(p.ep);
  test::fill_random(p.remote.bytes(), 43);
  std::memset(p.local.data(), 0, pieces * kPiece);
  Sink sink;
  std::vector<Op> ops;
  for (std::size_t i = 0; i < pieces; ++i)
    ops.push_back(make_op(p, TransferOp::kRead, i * kPiece, remote_off[i], kPiece, sink,
                          static_cast<std::uint32_t>(i)));
  p.ep->post(ops);
  ASSERT_TRUE(sink.wait(pieces));
  for (std::uint32_t i = 0; i < pieces; ++i) {
    ASSERT_TRUE(sink.status(i).is_ok()) << i;
    ASSERT_EQ(test::first_mismatch(p.local.data() + i * kPiece, p.remote.data() + remote_off[i], kPiece), -1)
        << "piece " << i;
  }
  EXPECT_TRUE(p.ep->healthy());
}

TEST(TcpTransport, RefusedRunOfPiecesFailsEveryPieceAndTheStreamStaysInSync) {
  // Four writes that continue each other go out as one request; the last passes the region
  // (a forged key length), so the target refuses the request and every piece of it fails.
  Pair p = make_pair(1u << 20);
  ASSERT_TRUE(p.ep);
  auto* key = static_cast<RemoteKey*>(p.key.get());
  key->length = 2u << 20;
  Sink sink;
  std::vector<Op> ops;
  for (std::uint32_t i = 0; i < 4; ++i) {
    ops.push_back(make_op(p, TransferOp::kWrite, i * 8192, (1u << 20) - 3 * 4096 + i * 4096, 4096, sink, i));
  }
  p.ep->post(ops);
  Op good = make_op(p, TransferOp::kRead, 0, 0, 4096, sink, 4);
  p.ep->post({&good, 1});
  ASSERT_TRUE(sink.wait(5));
  for (std::uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(sink.status(i).code(), StatusCode::kPermissionDenied) << i;
    EXPECT_NE(sink.status(i).message().find("outside the registered region"), std::string::npos) << i;
  }
  EXPECT_TRUE(sink.status(4).is_ok()) << sink.status(4).to_string();
  EXPECT_TRUE(p.ep->healthy());
}

TEST(TcpTransport, TargetRefusesWrongKeyAndOutOfRangeAndKeepsServing) {
  Pair p = make_pair(1u << 20);
  ASSERT_TRUE(p.ep);
  auto* key = static_cast<RemoteKey*>(p.key.get());
  // Out of range: the target checks even when the initiator's view of the region is forged.
  key->length = 2u << 20;
  Sink sink;
  Op op = make_op(p, TransferOp::kWrite, 0, (1u << 20) - 10, 4096, sink, 1);
  p.ep->post({&op, 1});
  op = make_op(p, TransferOp::kRead, 0, (1u << 20) - 10, 4096, sink, 2);
  p.ep->post({&op, 1});
  // Wrong key: the same region under a key the target never issued.
  std::string packed = p.reg->packed_key();
  packed[packed.size() - 2] ^= 0x5a;  // the key's last byte (a flags byte follows)
  auto wrong = p.ep->import_key(key->base, 1u << 20, packed, deadline_after(5s)).value();
  op = make_op(p, TransferOp::kRead, 0, 0, 4096, sink, 3);
  op.remote_key = wrong.get();
  p.ep->post({&op, 1});
  // The stream stays in sync: a good request afterwards succeeds.
  op = make_op(p, TransferOp::kRead, 0, 0, 4096, sink, 4);
  p.ep->post({&op, 1});
  ASSERT_TRUE(sink.wait(4));
  EXPECT_EQ(sink.status(1).code(), StatusCode::kPermissionDenied);
  EXPECT_NE(sink.status(1).message().find("outside the registered region"), std::string::npos);
  EXPECT_EQ(sink.status(2).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(sink.status(3).code(), StatusCode::kPermissionDenied);
  EXPECT_NE(sink.status(3).message().find("unknown or revoked remote key"), std::string::npos);
  EXPECT_TRUE(sink.status(4).is_ok()) << sink.status(4).to_string();
  EXPECT_TRUE(p.ep->healthy());
}

TEST(TcpTransport, DeregisteredRegionCanNoLongerBeReached) {
  Pair p = make_pair(1u << 20);
  ASSERT_TRUE(p.ep);
  p.reg.reset();
  Sink sink;
  Op op = make_op(p, TransferOp::kWrite, 0, 0, 4096, sink, 1);
  p.ep->post({&op, 1});
  ASSERT_TRUE(sink.wait(1));
  EXPECT_EQ(sink.status(1).code(), StatusCode::kPermissionDenied);
}

TEST(TcpTransport, MalformedInputIsRefused) {
  auto t = make_tcp_transport({}).value();
  EXPECT_FALSE(t->can_reach("garbage"));
  auto ep = t->connect("garbage", deadline_after(1s));
  ASSERT_FALSE(ep.is_ok());
  EXPECT_EQ(ep.status().code(), StatusCode::kInvalidArgument);
  for (const char* bad : {"nohostport", "1.2.3.4:99999", "[::1:80", "x:"}) {
    auto r = make_tcp_transport({.listen = bad});
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  Pair p = make_pair(4096);
  ASSERT_TRUE(p.ep);
  auto key = p.ep->import_key(0, 1, "xyz", deadline_after(1s));
  ASSERT_FALSE(key.is_ok());
  EXPECT_EQ(key.status().code(), StatusCode::kInvalidArgument);
}

TEST(TcpTransport, ClusterTokenIsProvedBothWays) {
  auto target = make_tcp_transport({}, "s3cret").value();
  auto open_target = make_tcp_transport({}).value();
  auto good = make_tcp_transport({}, "s3cret").value();
  auto bad = make_tcp_transport({}, "guess").value();
  auto none = make_tcp_transport({}).value();
  EXPECT_TRUE(good->connect(target->local_address(), deadline_after(5s)).is_ok());
  auto r = bad->connect(target->local_address(), deadline_after(5s));
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
  r = none->connect(target->local_address(), deadline_after(5s));
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(r.status().message().find("requires a cluster token"), std::string::npos);
  // A client with a token will not talk to a target that cannot prove it.
  r = good->connect(open_target->local_address(), deadline_after(5s));
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
}

TEST(TcpTransport, ConnectToNothingFailsFast) {
  auto t = make_tcp_transport({}).value();
  std::string addr;
  {
    auto gone = make_tcp_transport({}).value();
    addr = gone->local_address();
  }
  auto r = t->connect(addr, deadline_after(5s));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
}

// A plain TCP socket connected to `target` (no handshake yet); -1 when the connect failed.
int raw_connect(const Transport& target) {
  const std::string address = target.local_address();
  wire::Reader addr(address);
  addr.u32();
  addr.bytes();
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(addr.u16());
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{5, 0};  // no test hangs on a recv
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// A hand-made initiator past the handshake (a target without a token); -1 on failure.
int raw_client(const Transport& target) {
  using namespace tcp;
  int fd = raw_connect(target);
  if (fd < 0) return -1;
  ServerHello hello;
  ClientHello client{};
  client.magic = kClientMagic;
  client.version = kProtocolVersion;
  ServerVerdict verdict{};
  if (::recv(fd, &hello, sizeof hello, MSG_WAITALL) != static_cast<ssize_t>(sizeof hello) ||
      ::send(fd, &client, sizeof client, 0) != static_cast<ssize_t>(sizeof client) ||
      ::recv(fd, &verdict, sizeof verdict, MSG_WAITALL) != static_cast<ssize_t>(sizeof verdict) ||
      verdict.status != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::uint64_t tcp_key_of(const LocalRegistration& reg) {
  const std::string packed = reg.packed_key();
  wire::Reader key(packed);
  key.u8();
  return key.u64();
}

TEST(TcpTransport, StalledInitiatorCannotHoldDeregistrationHostage) {
  using namespace tcp;
  auto target = make_tcp_transport({.io_timeout = std::chrono::milliseconds(300)}).value();
  auto remote = Buffer::allocate(1u << 20).value();
  auto reg = target->register_memory(remote.region(), Access::kRemote).value();
  // A WRITE promising 1 MiB that sends 10 bytes.
  int fd = raw_client(*target);
  ASSERT_GE(fd, 0);
  RequestHeader h{};
  h.op = static_cast<std::uint8_t>(TransferOp::kWrite);
  h.key = tcp_key_of(*reg);
  h.addr = reinterpret_cast<std::uintptr_t>(remote.data());
  h.length = 1u << 20;
  ASSERT_EQ(::send(fd, &h, sizeof h, 0), static_cast<ssize_t>(sizeof h));
  ASSERT_EQ(::send(fd, "0123456789", 10, 0), 10);
  std::this_thread::sleep_for(100ms);  // the target is in the middle of this request
  // The target touches the region only inside one non-blocking syscall at a time:
  // deregistering waits for none of the stalled request, and the rest of it is refused.
  const auto start = Clock::now();
  reg.reset();
  EXPECT_LT(Clock::now() - start, 200ms);
  char byte;
  EXPECT_LE(::recv(fd, &byte, 1, 0), 0) << "the target should have dropped the stalled connection";
  ::close(fd);
}

// A leased region: requests must name a lease, and a lease ends with a fence through its tag
// or a revoke, on every connection.
TEST(TcpTransport, ALeasedRegionIsReachedThroughLiveLeasesOnly) {
  constexpr std::size_t kSize = 1u << 20;
  auto target = make_tcp_transport({}).value();
  auto initiator = make_tcp_transport({}).value();
  auto remote = Buffer::allocate(kSize).value();
  auto local = Buffer::allocate(kSize).value();
  auto reg = target->register_memory(remote.region(), Access::kLeased).value();
  auto ep = initiator->connect(target->local_address(), deadline_after(5s)).value();
  const auto base = reinterpret_cast<std::uintptr_t>(remote.data());
  auto region = ep->import_key(base, kSize, reg->packed_key(), deadline_after(5s)).value();
  const RemoteRange all{base, kSize};
  auto run = [&](const RemoteKey& key) {
    Sink sink;
    Op op;
    op.op = TransferOp::kWrite;
    op.local = local.data();
    op.remote_addr = base;
    op.remote_key = &key;
    op.length = 4096;
    op.sink = &sink;
    ep->post({&op, 1});
    EXPECT_TRUE(sink.wait(1));
    return sink.status(0);
  };
  Status s = run(*region);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("through leases only"), std::string::npos) << s.to_string();

  const LeaseTerms a{.id = 11, .op = TransferOp::kWrite, .ttl = 30s, .fence = 1000};
  const LeaseTerms b{.id = 12, .op = TransferOp::kWrite, .ttl = 30s, .fence = 2000};
  auto lease_a = ep->lease_key(*region, {&all, 1}, a, deadline_after(5s)).value();
  auto lease_b = ep->lease_key(*region, {&all, 1}, b, deadline_after(5s)).value();
  EXPECT_TRUE(run(*lease_a).is_ok());
  target->fence(999);
  EXPECT_TRUE(run(*lease_a).is_ok()) << "a fence below the tag ends nothing";
  target->fence(1000);
  s = run(*lease_a);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("revoked or fenced"), std::string::npos) << s.to_string();
  target->fence(500);  // fences never move back
  EXPECT_FALSE(run(*lease_a).is_ok());
  EXPECT_TRUE(run(*lease_b).is_ok());

  // Revoked through a second connection: the first one's requests are refused too.
  auto other = initiator->connect(target->local_address(), deadline_after(5s)).value();
  auto region2 = other->import_key(base, kSize, reg->packed_key(), deadline_after(5s)).value();
  auto lease_b2 = other->lease_key(*region2, {&all, 1}, b, deadline_after(5s)).value();
  EXPECT_TRUE(other->revoke(*lease_b2, b, deadline_after(5s)).is_ok());
  EXPECT_EQ(run(*lease_b).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(ep->revoke(*lease_b, a, deadline_after(5s)).code(), StatusCode::kInvalidArgument)
      << "a revoke names the key's own lease";

  // A region registered kRemote holds no leases: none is made for it (the engine then checks
  // the lease on its side only, and says so).
  auto plain_reg = target->register_memory(local.region(), Access::kRemote).value();
  const auto lbase = reinterpret_cast<std::uintptr_t>(local.data());
  auto plain = ep->import_key(lbase, kSize, plain_reg->packed_key(), deadline_after(5s)).value();
  const RemoteRange some{lbase, 4096};
  EXPECT_EQ(ep->lease_key(*plain, {&some, 1}, a, deadline_after(5s)).status().code(),
            StatusCode::kUnsupported);
}

// A target whose leased region serves only what its node's grants allow (a NodeGrants of node
// "n1", epoch "e1", over `pages` pages), and initiators that read its pages under leases.
struct GrantedTarget {
  static constexpr std::uint64_t kPage = 4096;

  explicit GrantedTarget(std::uint64_t pages, TcpOptions options = {})
      : target(make_tcp_transport(options).value()),
        remote(Buffer::allocate(pages * kPage).value()),
        local(Buffer::allocate(pages * kPage).value()),
        check(std::make_shared<node::NodeGrants>("n1", base(), kPage, pages)) {
    const std::string hex = check->rotate("e1");
    for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
      key.push_back(std::stoi(hex.substr(i, 2), nullptr, 16));
    target->set_grant_check(check);
    reg = target->register_memory(remote.region(), Access::kLeased).value();
  }

  std::uintptr_t base() const { return reinterpret_cast<std::uintptr_t>(remote.data()); }
  RemoteRange page(std::uint64_t p) const { return {base() + p * kPage, kPage}; }

  // A read grant of `runs` (first page, count) until `deadline`, signed with the node's key.
  std::shared_ptr<const std::string> grant(std::vector<std::pair<std::uint64_t, std::uint64_t>> runs,
                                           std::uint64_t deadline = 1'000'000) const {
    const grant::Terms t{.issuer = "n1",
                         .epoch = "e1",
                         .op = TransferOp::kRead,
                         .deadline = deadline,
                         .runs = std::move(runs)};
    return std::make_shared<const std::string>(grant::sign(key, t));
  }

  struct Client {
    std::unique_ptr<Transport> transport;
    std::shared_ptr<Endpoint> ep;
    std::unique_ptr<RemoteKey> region;
  };
  Client client() const {
    Client c;
    c.transport = make_tcp_transport({}).value();
    c.ep = c.transport->connect(target->local_address(), deadline_after(5s)).value();
    c.region = c.ep->import_key(base(), remote.size(), reg->packed_key(), deadline_after(5s)).value();
    return c;
  }

  // Page `p` read under `lease` through `c` (into the same page of `local`): its status.
  Status read(Client& c, const RemoteKey& lease, std::uint64_t p) {
    Sink sink;
    Op op;
    op.op = TransferOp::kRead;
    op.local = local.data() + p * kPage;
    op.remote_addr = base() + p * kPage;
    op.remote_key = &lease;
    op.length = kPage;
    op.sink = &sink;
    c.ep->post({&op, 1});
    EXPECT_TRUE(sink.wait(1));
    return sink.status(0);
  }

  std::unique_ptr<Transport> target;
  Buffer remote, local;
  std::shared_ptr<node::NodeGrants> check;
  std::vector<std::uint8_t> key;
  std::unique_ptr<LocalRegistration> reg;
};

// Where the target checks grants, a lease is known by its id bound to the grant it came with:
// a client that presents its own (genuine) grant under another client's lease id, then revokes
// that id, revokes only its own lease; and one connection may keep only its share of the
// target's table of revoked leases, so it cannot fill it for the others.
TEST(TcpTransport, ALeaseIsRevokedOnlyUnderTheGrantThatMadeIt) {
  TcpOptions small;
  small.max_connections = 8;  // a share of 65,536 / 8 revokes per connection
  GrantedTarget g(64, small);
  using Client = GrantedTarget::Client;
  Client victim = g.client(), attacker = g.client();
  const RemoteRange one = g.page(1), five = g.page(5);
  const LeaseTerms mine{
      .id = 42, .op = TransferOp::kRead, .ttl = 30s, .fence = 1'000'000, .grant = g.grant({{1, 1}})};
  auto lease = victim.ep->lease_key(*victim.region, {&one, 1}, mine, deadline_after(5s)).value();
  ASSERT_TRUE(g.read(victim, *lease, 1).is_ok());

  // The attacker's own grant, presented under the victim's lease id, then revoked.
  const LeaseTerms theirs{
      .id = 42, .op = TransferOp::kRead, .ttl = 30s, .fence = 1'000'000, .grant = g.grant({{5, 1}})};
  auto forged = attacker.ep->lease_key(*attacker.region, {&five, 1}, theirs, deadline_after(5s)).value();
  ASSERT_TRUE(g.read(attacker, *forged, 5).is_ok());
  ASSERT_TRUE(attacker.ep->revoke(*forged, theirs, deadline_after(5s)).is_ok());
  EXPECT_FALSE(g.read(attacker, *forged, 5).is_ok()) << "the attacker's own lease ended";
  EXPECT_TRUE(g.read(victim, *lease, 1).is_ok()) << "another client revoked the victim's lease";
  ASSERT_TRUE(victim.ep->revoke(*lease, mine, deadline_after(5s)).is_ok());
  EXPECT_FALSE(g.read(victim, *lease, 1).is_ok()) << "its holder's revoke ends it";

  // One connection's share of revoked leases: 65,536 / 8. Past it, its revokes are refused
  // (kNoSpace: the put waits for the fence instead), and another connection's still work.
  const std::size_t share = transport::tcp::Fences::kMaxRevoked / small.max_connections;
  Status refused;
  std::size_t revoked = 0;
  for (std::uint64_t id = 1000; revoked <= share && refused.is_ok(); ++id) {
    const LeaseTerms t{
        .id = id, .op = TransferOp::kRead, .ttl = 30s, .fence = 1'000'000, .grant = g.grant({{7, 1}})};
    auto k = attacker.ep->lease_key(*attacker.region, {&one, 1}, t, deadline_after(5s)).value();
    refused = attacker.ep->revoke(*k, t, deadline_after(5s));
    if (refused.is_ok()) ++revoked;
  }
  EXPECT_EQ(revoked + 1, share) << "the revoke above counts too";
  EXPECT_EQ(refused.code(), StatusCode::kNoSpace) << refused.to_string();
  const LeaseTerms again{
      .id = 43, .op = TransferOp::kRead, .ttl = 30s, .fence = 1'000'000, .grant = g.grant({{1, 1}})};
  auto next = victim.ep->lease_key(*victim.region, {&one, 1}, again, deadline_after(5s)).value();
  ASSERT_TRUE(g.read(victim, *next, 1).is_ok());
  EXPECT_TRUE(victim.ep->revoke(*next, again, deadline_after(5s)).is_ok()) << "another connection's share";
  // A fence past their tags frees the share.
  g.target->fence(1'000'000);
  const LeaseTerms later{.id = 44,
                         .op = TransferOp::kRead,
                         .ttl = 30s,
                         .fence = 2'000'000,
                         .grant = g.grant({{7, 1}}, 2'000'000)};
  auto k = attacker.ep->lease_key(*attacker.region, {&one, 1}, later, deadline_after(5s)).value();
  EXPECT_TRUE(attacker.ep->revoke(*k, later, deadline_after(5s)).is_ok()) << "the fence gave the share back";
}

// The ranges a connection's grants may pin at the target are bounded (65,536 of them, each
// grant one more): past that its grants are refused, and a released lease gives its share back.
TEST(TcpTransport, AConnectionPinsABoundedNumberOfGrantedRanges) {
  GrantedTarget g(2048);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> runs;
  for (std::uint64_t p = 0; p < 2000; p += 2) runs.emplace_back(p, 1);  // 1,000 runs
  const auto grant = g.grant(std::move(runs));
  auto c = g.client();
  const RemoteRange first = g.page(0);
  const auto lease = [&](std::uint64_t id) {
    const LeaseTerms terms{.id = id, .op = TransferOp::kRead, .ttl = 30s, .fence = 1'000'000, .grant = grant};
    return c.ep->lease_key(*c.region, {&first, 1}, terms, deadline_after(5s)).value();
  };
  std::vector<std::unique_ptr<RemoteKey>> held;
  Status last;
  for (std::uint64_t id = 1; id <= 100 && last.is_ok(); ++id) {
    held.push_back(lease(id));
    last = g.read(c, *held.back(), 0);
  }
  EXPECT_EQ(held.size(), 66u) << "65 grants of 1,001 ranges fit in 65,536, the 66th does not";
  // The grant's refusal (kTooManyGrants) leaves the lease without one: its request is refused.
  EXPECT_EQ(last.code(), StatusCode::kPermissionDenied) << last.to_string();
  // A lease released gives its ranges back: the next grant fits.
  held.erase(held.begin());
  auto again = lease(1000);
  const Status s = g.read(c, *again, 0);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

// The hole a timed-out put left open: bytes already in a socket reach the target after the
// initiator gave up. Once a revoke or a fence has returned, none of them lands.
TEST(TcpTransport, BytesStillQueuedUnderAnEndedLeaseNeverLand) {
  using namespace tcp;
  constexpr std::size_t kSize = 1u << 20;
  for (const bool by_fence : {false, true}) {
    SCOPED_TRACE(by_fence ? "fence" : "revoke");
    auto target = make_tcp_transport({}).value();
    auto remote = Buffer::allocate(kSize).value();
    std::memset(remote.data(), 0, kSize);
    auto reg = target->register_memory(remote.region(), Access::kLeased).value();
    int fd = raw_client(*target);
    ASSERT_GE(fd, 0);
    RequestHeader h{};
    h.op = static_cast<std::uint8_t>(TransferOp::kWrite);
    h.key = tcp_key_of(*reg);
    h.addr = reinterpret_cast<std::uintptr_t>(remote.data());
    h.length = kSize;
    h.lease = 77;
    h.fence = 5000;
    std::vector<std::byte> payload(kSize, std::byte{0xab});
    ASSERT_EQ(::send(fd, &h, sizeof h, 0), static_cast<ssize_t>(sizeof h));
    ASSERT_EQ(::send(fd, payload.data(), kSize / 2, 0), static_cast<ssize_t>(kSize / 2));
    // The first half lands while the lease is live.
    ASSERT_TRUE(test::eventually([&] { return remote.data()[kSize / 2 - 1] == std::byte{0xab}; }));
    if (by_fence) {
      target->fence(5000);
    } else {
      auto initiator = make_tcp_transport({}).value();
      auto ep = initiator->connect(target->local_address(), deadline_after(5s)).value();
      const auto base = reinterpret_cast<std::uintptr_t>(remote.data());
      auto region = ep->import_key(base, kSize, reg->packed_key(), deadline_after(5s)).value();
      const RemoteRange all{base, kSize};
      const LeaseTerms terms{.id = 77, .op = TransferOp::kWrite, .ttl = 30s, .fence = 5000};
      auto lease = ep->lease_key(*region, {&all, 1}, terms, deadline_after(5s)).value();
      ASSERT_TRUE(ep->revoke(*lease, terms, deadline_after(5s)).is_ok());
    }
    // The rest arrives after the lease ended: read and dropped, the request refused.
    ASSERT_EQ(::send(fd, payload.data(), kSize / 2, 0), static_cast<ssize_t>(kSize / 2));
    ResponseHeader r{};
    ASSERT_EQ(::recv(fd, &r, sizeof r, MSG_WAITALL), static_cast<ssize_t>(sizeof r));
    EXPECT_EQ(r.status, static_cast<std::uint32_t>(StatusCode::kPermissionDenied));
    EXPECT_EQ(r.reason, static_cast<std::uint32_t>(RefusalReason::kLeaseEnded));
    for (std::size_t i = kSize / 2; i < kSize; ++i) {
      ASSERT_EQ(remote.data()[i], std::byte{0}) << "a byte landed after the lease ended, at " << i;
    }
    ::close(fd);
  }
}

// Connections are capped per peer and in all; the excess is closed at once, and an
// authenticated connection that stays idle is dropped (the initiator connects again).
TEST(TcpTransport, ConnectionsAreCappedAndIdleOnesDropped) {
  using namespace tcp;
  auto target = make_tcp_transport({.idle_timeout = 300ms, .max_connections_per_peer = 3}).value();
  std::vector<int> fds;
  for (int i = 0; i < 5; ++i) fds.push_back(raw_connect(*target));
  int greeted = 0, closed = 0;
  for (int fd : fds) {
    ServerHello hello;
    const ssize_t n = ::recv(fd, &hello, sizeof hello, MSG_WAITALL);
    if (n == static_cast<ssize_t>(sizeof hello)) ++greeted;
    if (n == 0) ++closed;
  }
  EXPECT_EQ(greeted, 3);
  EXPECT_EQ(closed, 2);
  for (int fd : fds) ::close(fd);
  std::this_thread::sleep_for(100ms);  // the target counts the closed ones out

  int idle = raw_client(*target);
  ASSERT_GE(idle, 0) << "closed connections still counted against the cap";
  const auto start = Clock::now();
  char byte;
  EXPECT_EQ(::recv(idle, &byte, 1, 0), 0) << "an idle connection was not dropped";
  EXPECT_LT(Clock::now() - start, 3s);
  ::close(idle);
}

// When every connection slot is taken, one that has done nothing useful for a second gives
// way to a client that just proved the token (before, idle proven connections held every
// slot until their idle timeout); connections that work keep theirs, and a newcomer is then
// refused.
TEST(TcpTransport, AnIdleConnectionGivesWayWhenEverySlotIsTaken) {
  using namespace tcp;
  auto target = make_tcp_transport({.max_connections = 4}).value();
  auto remote = Buffer::allocate(1u << 16).value();
  auto reg = target->register_memory(remote.region(), Access::kRemote).value();
  const auto read_once = [&](int fd) {
    RequestHeader h{};
    h.op = static_cast<std::uint8_t>(TransferOp::kRead);
    h.key = tcp_key_of(*reg);
    h.addr = reinterpret_cast<std::uintptr_t>(remote.data());
    h.length = 64;
    std::vector<char> back(sizeof(ResponseHeader) + h.length);
    return ::send(fd, &h, sizeof h, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof h) &&
           ::recv(fd, back.data(), back.size(), MSG_WAITALL) == static_cast<ssize_t>(back.size());
  };
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) held.push_back(raw_client(*target));
  for (int fd : held) ASSERT_GE(fd, 0);
  EXPECT_LT(raw_client(*target), 0) << "four connections proven just now, none idle: full";
  std::this_thread::sleep_for(1200ms);
  ASSERT_TRUE(read_once(held[0])) << "one of them works";
  const int newcomer = raw_client(*target);
  ASSERT_GE(newcomer, 0) << "an idle connection did not give way";
  std::vector<int> gone;
  for (int fd : held) {
    timeval tv{0, 300000};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char byte;
    if (::recv(fd, &byte, 1, 0) == 0) gone.push_back(fd);
  }
  ASSERT_EQ(gone.size(), 1u) << "exactly one gave way";
  EXPECT_NE(gone[0], held[0]) << "the one that worked kept its place";
  EXPECT_TRUE(read_once(newcomer));
  // Everyone works now: a newcomer is refused rather than displace a working connection.
  std::this_thread::sleep_for(1200ms);
  for (int fd : held) {
    if (fd != gone[0]) {
      ASSERT_TRUE(read_once(fd));
    }
  }
  ASSERT_TRUE(read_once(newcomer));
  EXPECT_LT(raw_client(*target), 0) << "a working connection gave way";
  for (int fd : held) ::close(fd);
  ::close(newcomer);
}

// Only requests that do something keep a connection: one that sends nothing but releases of
// leases it does not hold (which change nothing) is dropped at the idle timeout like a silent
// one, while one that reads keeps its place.
TEST(TcpTransport, RequestsThatChangeNothingDoNotKeepAConnection) {
  using namespace tcp;
  auto target = make_tcp_transport({.idle_timeout = 300ms}).value();
  auto remote = Buffer::allocate(1u << 16).value();
  auto reg = target->register_memory(remote.region(), Access::kRemote).value();
  const auto keep_sending = [&](int fd, std::uint8_t op) {
    RequestHeader h{};
    h.op = op;
    h.key = tcp_key_of(*reg);
    h.addr = reinterpret_cast<std::uintptr_t>(remote.data());
    h.length = op == kReleaseOp ? 0 : 64;
    h.lease = 77;
    std::vector<char> back(sizeof(ResponseHeader) + h.length);
    const auto start = Clock::now();
    while (Clock::now() - start < 1200ms) {
      if (::send(fd, &h, sizeof h, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof h)) break;
      if (::recv(fd, back.data(), back.size(), MSG_WAITALL) != static_cast<ssize_t>(back.size())) break;
      std::this_thread::sleep_for(100ms);
    }
    return Clock::now() - start;
  };
  const int idle = raw_client(*target);
  ASSERT_GE(idle, 0);
  EXPECT_LT(keep_sending(idle, kReleaseOp), 1s) << "no-op releases kept the connection";
  ::close(idle);
  const int busy = raw_client(*target);
  ASSERT_GE(busy, 0);
  EXPECT_GE(keep_sending(busy, static_cast<std::uint8_t>(TransferOp::kRead)), 1200ms)
      << "a connection that reads was dropped";
  ::close(busy);
}

// Out of file descriptors, accept() fails at once for as long as the connection waits: the
// accept loop must pause, not spin a core.
TEST(TcpTransport, AcceptPausesWhenOutOfDescriptors) {
  auto target = make_tcp_transport({}).value();
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  // Connections made before the limit drops; the target then cannot accept them.
  std::vector<int> fds;
  for (int i = 0; i < 4; ++i) fds.push_back(raw_connect(*target));
  int highest = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1) highest = fd;
  }
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(highest + 1);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  for (int i = 0; i < 4; ++i) fds.push_back(raw_connect(*target));  // may fail: no descriptors
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(1s);
  ::getrusage(RUSAGE_SELF, &after);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  auto cpu = [](const rusage& u) {
    return std::chrono::seconds(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           std::chrono::microseconds(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  EXPECT_LT(cpu(after) - cpu(before), 300ms) << "the accept loop spun while out of descriptors";
  for (int fd : fds) {
    if (fd >= 0) ::close(fd);
  }
}

TEST(TcpTransport, WritesToAVanishedTargetFailWithoutSigpipe) {
  // The test process does not ignore SIGPIPE: a send racing the peer's close must become an
  // error status, not the signal's default action (death). The race is not deterministic;
  // posting right as the target goes makes it likely.
  Pair p = make_pair(1u << 20);
  ASSERT_TRUE(p.ep);
  Sink sink;
  std::thread closer([&] {
    p.reg.reset();
    p.target.reset();  // closes its end of every connection
  });
  constexpr std::uint32_t kOps = 300;
  for (std::uint32_t n = 0; n < kOps; ++n) {
    Op op = make_op(p, TransferOp::kWrite, 0, 0, 64u << 10, sink, n, n % 4);
    p.ep->post({&op, 1});
  }
  closer.join();
  ASSERT_TRUE(sink.wait(kOps));
  Op op = make_op(p, TransferOp::kWrite, 0, 0, 4096, sink, kOps);
  p.ep->post({&op, 1});
  ASSERT_TRUE(sink.wait(kOps + 1));
  EXPECT_FALSE(p.ep->healthy());
  EXPECT_EQ(sink.status(kOps).code(), StatusCode::kUnavailable) << sink.status(kOps).to_string();
}

TEST(TcpTransport, AbortCompletesEveryOpOfTheSinkAndLeavesOthersConsistent) {
  Pair p = make_pair(64u << 20, {}, {.streams = 2});
  ASSERT_TRUE(p.ep);
  Sink mine;
  std::vector<Op> ops;
  for (std::uint32_t i = 0; i < 64; ++i)
    ops.push_back(make_op(p, TransferOp::kRead, i * (1u << 20), i * (1u << 20), 1u << 20, mine, i, i % 2));
  p.ep->post(ops);
  p.ep->abort(&mine, Status::cancelled("test abort"));
  // abort returns only when every op of the sink has completed.
  EXPECT_EQ(mine.count(), 64u);
  for (std::uint32_t i = 0; i < 64; ++i) {
    Status s = mine.status(i);
    EXPECT_TRUE(s.is_ok() || s.code() == StatusCode::kCancelled) << s.to_string();
  }
}

}  // namespace
}  // namespace kvstash::transport
