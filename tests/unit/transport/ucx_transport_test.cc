// The ucx transport, in one process: two transports (two UCP contexts and workers) act as
// target and initiator. Where there is no RDMA device UCX 1.13 runs RMA over tcp on loopback,
// emulated with active messages (see src/transport/ucx/README.md). In the Soft-RoCE lane
// (scripts/rdma-vm, KVSTASH_RDMA_LANE) it runs true RMA over rc_verbs on rxe: no target opts
// into emulated RMA there, every connection must have RDMA lanes, and keys are enforced.
#include <gtest/gtest.h>

#include <functional>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "kvstash/memory.h"
#include "rdma_lane.h"
#include "recording_sink.h"
#include "transport/ucx/ucx_internal.h"
#include "transport/ucx/ucx_transport.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;

using TestSink = test::RecordingSink;

using test::in_rdma_lane;
using test::rdma_device_listed;

std::uint64_t counter(const Transport& t, std::string_view name) {
  for (const TransportCounter& c : t.counters()) {
    if (c.name == name) return c.value;
  }
  ADD_FAILURE() << "no counter " << name;
  return 0;
}

// In the lane no target accepts emulated RMA: its regions are reachable only through keys
// the NIC checks.
std::unique_ptr<Transport> make(bool progress_thread, bool allow_emulated_rma = !in_rdma_lane()) {
  UcxOptions options;
  options.progress_thread = progress_thread;
  options.allow_emulated_rma = allow_emulated_rma;
  auto t = make_ucx_transport(options);
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  return t.is_ok() ? std::move(*t) : nullptr;
}

Buffer make_buffer(std::size_t size) {
  auto b = Buffer::allocate(size);
  EXPECT_TRUE(b.is_ok()) << b.status().to_string();
  return std::move(*b);
}

void fill_random(std::span<std::byte> bytes, std::uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    std::uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, 8);
  }
  for (; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(rng());
}

constexpr std::size_t kTargetSize = (16u << 20) + 4096;

// A connected pair: the target exposes one region, the initiator has imported its key.
struct Pair {
  explicit Pair(bool initiator_thread = true) {
    target = make(true);
    initiator = make(initiator_thread);
    target_buf = make_buffer(kTargetSize);
    auto reg = target->register_memory(target_buf.region(), Access::kRemote);
    EXPECT_TRUE(reg.is_ok()) << reg.status().to_string();
    target_reg = std::move(*reg);
    auto ep = initiator->connect(target->local_address(), deadline_after(10s));
    EXPECT_TRUE(ep.is_ok()) << ep.status().to_string();
    endpoint = std::move(*ep);
    ucx_ep = dynamic_cast<ucx::UcxEndpoint*>(endpoint.get());
    key = import(*target_reg);
    if (in_rdma_lane()) {
      EXPECT_TRUE(ucx_ep->one_sided()) << "the lane's UCX emulates RMA instead of using rc_verbs";
    }
  }
  std::unique_ptr<RemoteKey> import(const LocalRegistration& reg) {
    auto k = endpoint->import_key(base(), kTargetSize, reg.packed_key(), deadline_after(5s));
    EXPECT_TRUE(k.is_ok()) << k.status().to_string();
    return k.is_ok() ? std::move(*k) : nullptr;
  }
  std::uint64_t base() const { return reinterpret_cast<std::uint64_t>(target_buf.data()); }
  Op op(TransferOp kind, std::byte* local, const LocalRegistration* reg, std::size_t remote_off,
        std::size_t len, CompletionSink* sink, std::uint32_t tag) const {
    Op o;
    o.op = kind;
    o.local = local;
    o.local_reg = reg;
    o.remote_addr = base() + remote_off;
    o.remote_key = key.get();
    o.length = len;
    o.sink = sink;
    o.tag = tag;
    return o;
  }
  // Without a progress thread, waiting must drive the initiator's worker.
  std::function<void()> drive() const {
    if (initiator_thread_) return {};
    return [ep = ucx_ep] { ep->progress(); };
  }

  bool initiator_thread_ = true;
  std::unique_ptr<Transport> target;
  std::unique_ptr<Transport> initiator;
  Buffer target_buf;
  std::unique_ptr<LocalRegistration> target_reg;
  std::shared_ptr<Endpoint> endpoint;
  ucx::UcxEndpoint* ucx_ep = nullptr;
  std::unique_ptr<RemoteKey> key;
};

class UcxRoundTrip : public ::testing::TestWithParam<bool> {};

TEST_P(UcxRoundTrip, WriteThenReadBackIsBitExact) {
  const bool threaded = GetParam();
  Pair p(threaded);
  p.initiator_thread_ = threaded;
  ASSERT_NE(p.key, nullptr);
  Buffer src = make_buffer(kTargetSize);
  Buffer dst = make_buffer(kTargetSize);
  auto src_reg = p.initiator->register_memory(src.region(), Access::kLocal);
  auto dst_reg = p.initiator->register_memory(dst.region(), Access::kLocal);
  ASSERT_TRUE(src_reg.is_ok() && dst_reg.is_ok());
  EXPECT_TRUE((*src_reg)->packed_key().empty());

  std::uint32_t tag = 0;
  for (std::size_t len :
       {std::size_t{1}, std::size_t{4096 + 3}, std::size_t{1} << 20, std::size_t{16} << 20}) {
    SCOPED_TRACE(len);
    const std::size_t local_off = 3, remote_off = 7;  // deliberately unaligned
    auto s = src.bytes().subspan(local_off, len);
    fill_random(s, static_cast<std::uint32_t>(len));
    std::memset(dst.data(), 0, dst.size());

    TestSink wsink;
    Op w = p.op(TransferOp::kWrite, s.data(), src_reg->get(), remote_off, len, &wsink, ++tag);
    p.endpoint->post({&w, 1});
    ASSERT_TRUE(wsink.wait(1, std::chrono::seconds(60), p.drive()));
    ASSERT_TRUE(wsink.statuses().at(tag).is_ok()) << wsink.statuses().at(tag).to_string();
    // Remote completion: the bytes are in the target's memory when the write completes.
    ASSERT_EQ(std::memcmp(p.target_buf.data() + remote_off, s.data(), len), 0);

    TestSink rsink;
    Op r = p.op(TransferOp::kRead, dst.data() + 5, dst_reg->get(), remote_off, len, &rsink, ++tag);
    p.endpoint->post({&r, 1});
    ASSERT_TRUE(rsink.wait(1, std::chrono::seconds(60), p.drive()));
    ASSERT_TRUE(rsink.statuses().at(tag).is_ok()) << rsink.statuses().at(tag).to_string();
    ASSERT_EQ(std::memcmp(dst.data() + 5, s.data(), len), 0);
    EXPECT_EQ(dst.data()[4], std::byte{0});  // nothing written outside the range
    EXPECT_EQ(dst.data()[5 + len], std::byte{0});
  }
  EXPECT_TRUE(p.endpoint->healthy());
}

INSTANTIATE_TEST_SUITE_P(ProgressThread, UcxRoundTrip, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "thread" : "caller"; });

TEST(UcxTransport, BatchOfMixedOpsCompletesEachOnce) {
  Pair p;
  Buffer local = make_buffer(1 << 20);
  fill_random(local.bytes(), 42);
  TestSink sink;
  std::vector<Op> ops;
  for (std::uint32_t i = 0; i < 16; ++i) {
    ops.push_back(p.op(TransferOp::kWrite, local.data() + i * 4096, nullptr, i * 4096, 4096, &sink, i));
  }
  p.endpoint->post(ops);
  ASSERT_TRUE(sink.wait(16));
  for (auto& [tag, st] : sink.statuses()) EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(std::memcmp(p.target_buf.data(), local.data(), 16 * 4096), 0);
}

TEST(UcxTransport, ConcurrentPostsFromSeveralThreads) {
  Pair p;
  constexpr int kThreads = 4, kOps = 16;
  constexpr std::size_t kLen = 64 * 1024 + 1;
  std::vector<Buffer> src, dst;
  for (int t = 0; t < kThreads; ++t) {
    src.push_back(make_buffer(kOps * kLen));
    dst.push_back(make_buffer(kOps * kLen));
    fill_random(src.back().bytes(), 100 + t);
  }
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      TestSink wsink, rsink;
      for (int i = 0; i < kOps; ++i) {
        std::size_t off = (t * kOps + i) * kLen;  // disjoint target ranges
        Op w = p.op(TransferOp::kWrite, src[t].data() + i * kLen, nullptr, off, kLen, &wsink, i);
        p.endpoint->post({&w, 1});
      }
      if (!wsink.wait(kOps)) ++failures;
      for (int i = 0; i < kOps; ++i) {
        std::size_t off = (t * kOps + i) * kLen;
        Op r = p.op(TransferOp::kRead, dst[t].data() + i * kLen, nullptr, off, kLen, &rsink, i);
        p.endpoint->post({&r, 1});
      }
      if (!rsink.wait(kOps)) ++failures;
      for (auto& [tag, st] : wsink.statuses())
        if (!st.is_ok()) ++failures;
      for (auto& [tag, st] : rsink.statuses())
        if (!st.is_ok()) ++failures;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(std::memcmp(src[t].data(), dst[t].data(), kOps * kLen), 0) << "thread " << t;
  }
}

TEST(UcxTransport, MalformedAddressesAreRefused) {
  auto a = make(true);
  auto b = make(true);
  std::string good = b->local_address();
  EXPECT_TRUE(a->can_reach(good));
  std::vector<std::string> bad = {"", "x", "garbage that is long enough to look like a record",
                                  good.substr(0, good.size() / 2), good + "trailing"};
  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x01;
  bad.push_back(flipped);
  std::string wrong_version = good;
  wrong_version[2] = 9;
  bad.push_back(wrong_version);
  for (const std::string& addr : bad) {
    EXPECT_FALSE(a->can_reach(addr));
    auto ep = a->connect(addr, deadline_after(2s));
    ASSERT_FALSE(ep.is_ok());
    EXPECT_EQ(ep.status().code(), StatusCode::kInvalidArgument) << ep.status().to_string();
  }
}

TEST(UcxTransport, MalformedKeysAreRefused) {
  Pair p;
  std::string good = p.target_reg->packed_key();
  std::string flipped = good;
  flipped[good.size() - 12] ^= 0x40;
  for (const std::string& key :
       {std::string(), std::string("nonsense"), good.substr(1), flipped, good.substr(0, good.size() - 1)}) {
    auto k = p.endpoint->import_key(p.base(), 16, key, deadline_after(2s));
    ASSERT_FALSE(k.is_ok());
    EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument) << k.status().to_string();
  }
  // A well-formed key, but a range outside the region it covers.
  auto k = p.endpoint->import_key(p.base() + kTargetSize - 8, 16, good, deadline_after(2s));
  ASSERT_FALSE(k.is_ok());
  EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument);
  // An address record is not a key.
  auto k2 = p.endpoint->import_key(p.base(), 16, p.target->local_address(), deadline_after(2s));
  EXPECT_EQ(k2.status().code(), StatusCode::kInvalidArgument);
}

TEST(UcxTransport, CapabilitiesOnThisHost) {
  const bool rdma = rdma_device_listed();
  if (in_rdma_lane()) {
    ASSERT_TRUE(rdma) << "the Soft-RoCE lane has no RDMA device";
  }
  Pair p;
  Capabilities c = p.initiator->capabilities();
  EXPECT_EQ(c.lanes, 1u);
  EXPECT_FALSE(c.cuda_memory);
  EXPECT_FALSE(c.same_host_only);
  EXPECT_FALSE(c.leases);
  // Without an RDMA device UCX 1.13 (error-handling mode PEER) uses tcp, emulating RMA with
  // active messages; with one (the lane's rxe) it puts and gets over rc_verbs.
  EXPECT_EQ(c.rdma, rdma);
  EXPECT_EQ(c.one_sided, rdma);
  EXPECT_EQ(p.ucx_ep->one_sided(), rdma);
  if (rdma) {
    EXPECT_TRUE(p.ucx_ep->rdma_lanes().starts_with("rc_")) << p.ucx_ep->rdma_lanes();
  } else {
    EXPECT_EQ(p.ucx_ep->rdma_lanes(), "");
  }
  EXPECT_EQ(counter(*p.initiator, "connections_one_sided"), rdma ? 1u : 0u);
  EXPECT_EQ(counter(*p.initiator, "connections_emulated"), rdma ? 0u : 1u);
}

// What UCX 1.13's ucp_ep_print_info says, as measured: the RMA lanes on RDMA transports are
// the one-sided ones; tcp, ud and shared memory lanes are not.
TEST(UcxTransport, RdmaLanesAreReadFromTheEndpointInfo) {
  using ucx::rdma_lanes_from_ep_info;
  // The Soft-RoCE guest (rxe0, rxe1), error mode PEER.
  constexpr const char* kSoftRoce = R"(#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]:  6:rc_verbs/rxe0:1.0 md[4]       -> md[4]/ib/sysdev[255] am am_bw#0
#                 lane[1]:  7:ud_verbs/rxe0:1.0 md[4]       -> md[4]/ib/sysdev[255] keepalive wireup
#
#                  put[0]: 0..<short>..81..<bcopy>..16384..<zcopy>..(inf)
#                  get[0]: 0..<bcopy>..945..<zcopy>..(inf)
#
#                  rma_bw: mds #
)";
  EXPECT_EQ(rdma_lanes_from_ep_info(kSoftRoce), "rc_verbs/rxe0:1");
  // A host without RDMA: one tcp lane, RMA emulated.
  constexpr const char* kTcp = R"(#
#                 lane[0]:  1:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] am am_bw#0 keepalive wireup
#
#
#                  rma_bw: mds #
)";
  EXPECT_EQ(rdma_lanes_from_ep_info(kTcp), "");
  // Shared-memory RMA lanes, which serve only memory UCX allocated itself.
  constexpr const char* kSharedMemory = R"(#
#                 lane[0]:  2:sysv/memory.0 md[1]           -> md[1]/sysv/sysdev[255] am am_bw#0
#                 lane[1]:  3:posix/memory.0 md[2]          -> md[2]/posix/sysdev[255]
#
#                  put[0]: 0..<short>..4294967296..<bcopy>..(inf)
#                  put[1]: 0..<short>..4294967296..<bcopy>..(inf)
)";
  EXPECT_EQ(rdma_lanes_from_ep_info(kSharedMemory), "");
  // Two rails, large RMA tagged rma_bw, a proxy lane (written from UCX's print format, not
  // measured: no mlx5 here).
  constexpr const char* kTwoRails = R"(#
#                 lane[0]:  4:rc_mlx5/mlx5_0:1.0 md[2]      -> md[2]/ib/sysdev[0] rma_bw#0 am am_bw#0
#                 lane[1]:  5:rc_mlx5/mlx5_1:1.0 md[3]      -> md[3]/ib/sysdev[1] rma_bw#1
#                 lane[2]: proxy to lane[0]              -> md[2]/ib/sysdev[0] wireup
#                  put[0]: 0..<short>..2048..<bcopy>..(inf)
)";
  EXPECT_EQ(rdma_lanes_from_ep_info(kTwoRails), "rc_mlx5/mlx5_0:1,rc_mlx5/mlx5_1:1");
  EXPECT_EQ(rdma_lanes_from_ep_info(""), "");
}

TEST(UcxTransport, AbortEndsEveryOpOfTheSink) {
  Pair p;
  Buffer local = make_buffer(16 << 20);
  TestSink victim, bystander;
  std::vector<Op> ops;
  for (std::uint32_t i = 0; i < 16; ++i) {
    ops.push_back(p.op(TransferOp::kWrite, local.data() + (i << 20), nullptr, i << 20, 1 << 20, &victim, i));
  }
  Op other = p.op(TransferOp::kRead, local.data(), nullptr, 0, 1 << 20, &bystander, 99);
  p.endpoint->post(ops);
  p.endpoint->post({&other, 1});
  p.endpoint->abort(&victim, Status::cancelled("test abort"));
  // abort() returned: every op of the victim has completed (exactly once, checked by the sink).
  EXPECT_EQ(victim.count(), 16u);
  bool cancelled = false;
  for (auto& [tag, st] : victim.statuses()) {
    // An op that finished before the abort reached it may report OK; none reports anything else.
    EXPECT_TRUE(st.is_ok() || st.code() == StatusCode::kCancelled) << st.to_string();
    cancelled = cancelled || st.code() == StatusCode::kCancelled;
  }
  ASSERT_TRUE(bystander.wait(1));
  auto b = bystander.statuses().at(99);
  EXPECT_TRUE(b.is_ok() || b.code() == StatusCode::kUnavailable) << b.to_string();
  // With real RMA (the Soft-RoCE lane) all 16 may have finished before the abort reached
  // them: then nothing was torn down, and there is nothing more to check.
  if (std::getenv("KVSTASH_RDMA_LANE") == nullptr) {
    EXPECT_TRUE(cancelled) << "over emulated RMA the abort catches ops of the victim in flight";
  }
  if (!cancelled) return;
  EXPECT_FALSE(p.endpoint->healthy());
  // The endpoint is broken now: further ops fail fast instead of hanging.
  TestSink late;
  Op w = p.op(TransferOp::kWrite, local.data(), nullptr, 0, 64, &late, 1);
  p.endpoint->post({&w, 1});
  ASSERT_TRUE(late.wait(1));
  EXPECT_EQ(late.statuses().at(1).code(), StatusCode::kUnavailable);
}

TEST(UcxTransport, AbortOfAnIdleSinkKeepsTheConnection) {
  Pair p;
  TestSink idle;
  p.endpoint->abort(&idle, Status::cancelled("nothing to abort"));
  EXPECT_TRUE(p.endpoint->healthy());
  EXPECT_EQ(idle.count(), 0u);
}

TEST(UcxTransport, PeerDeathFailsOpsWithUnavailable) {
  Pair p;
  Buffer local = make_buffer(1 << 20);
  // The target dies: its worker and sockets go away (its buffer stays, so nothing but UCX's
  // error handling can stop the op).
  p.target_reg.reset();
  p.target.reset();
  TestSink sink;
  Op w = p.op(TransferOp::kWrite, local.data(), nullptr, 0, 1 << 20, &sink, 1);
  p.endpoint->post({&w, 1});
  // An error within the bound, not a hang (in the lane UCX notices through its keepalive
  // over ud: about 50 s).
  ASSERT_TRUE(sink.wait(1, 180s));
  Status st = sink.statuses().at(1);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  Deadline deadline = deadline_after(60s);
  while (p.endpoint->healthy() && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(p.endpoint->healthy());
}

TEST(UcxTransport, ConnectToADeadPeerFailsWithinTheDeadline) {
  if (rdma_device_listed()) {
    // Wireup then runs over a ud_verbs lane whose request to the dead peer stays queued;
    // UCX 1.13 (Debian builds it with assertions on) aborts the process when that endpoint
    // is closed or times out ("ucp_request.c:684 ... got REQ message"; the assertion was
    // dropped upstream in openucx/ucx#8175). Nothing the transport does avoids it: see
    // src/transport/ucx/README.md.
    GTEST_SKIP() << "UCX 1.13 aborts on a failed wireup over ud_verbs (openucx/ucx#8175)";
  }
  auto a = make(true);
  std::string addr;
  {
    auto b = make(true);
    addr = b->local_address();
  }
  auto ep = a->connect(addr, deadline_after(5s));
  if (ep.is_ok()) {
    // UCX may finish wireup lazily; the endpoint must then turn unhealthy, not hang.
    Deadline deadline = deadline_after(60s);
    while ((*ep)->healthy() && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
    EXPECT_FALSE((*ep)->healthy());
  } else {
    EXPECT_TRUE(ep.status().code() == StatusCode::kUnavailable || ep.status().code() == StatusCode::kTimeout)
        << ep.status().to_string();
  }
}

// What UCX 1.13 does with a key after the target unmapped its region. With true RMA
// (rma_bw lanes: RDMA, or posix/sysv on UCX-allocated memory) the rkey dies with the
// mapping and access fails. With RMA emulated over active messages (tcp here), the
// target's UCX copies to the requested address without checking any registration, so the
// write still lands while the memory stays mapped; the test pins that down so a change in
// UCX shows up here.
TEST(UcxTransport, AccessAfterTargetDeregisters) {
  Pair p;
  Buffer local = make_buffer(4096);
  fill_random(local.bytes(), 7);
  // The key works until the target deregisters.
  TestSink before;
  Op first = p.op(TransferOp::kWrite, local.data(), nullptr, 0, 4096, &before, 1);
  p.endpoint->post({&first, 1});
  ASSERT_TRUE(before.wait(1));
  ASSERT_TRUE(before.statuses().at(1).is_ok()) << before.statuses().at(1).to_string();
  std::memset(p.target_buf.data() + 128, 0, 4096);
  p.target_reg.reset();  // deregister (ucp_mem_unmap); the buffer itself stays mapped
  TestSink sink;
  Op w = p.op(TransferOp::kWrite, local.data(), nullptr, 128, 4096, &sink, 1);
  p.endpoint->post({&w, 1});
  ASSERT_TRUE(sink.wait(1));
  Status st = sink.statuses().at(1);
  if (p.ucx_ep->one_sided()) {
    // The target's NIC refuses the old rkey: the connection fails (UCX reports a remote
    // access error as a reset) and nothing lands. This holds only because the transport
    // turns off UCX's registration cache, which would keep the region registered.
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_EQ(std::count(p.target_buf.data() + 128, p.target_buf.data() + 128 + 4096, std::byte{0}), 4096);
    EXPECT_FALSE(p.endpoint->healthy());
  } else {
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ(std::memcmp(p.target_buf.data() + 128, local.data(), 4096), 0);
  }
}

TEST(UcxTransport, UnsupportedAndInvalidRegistrations) {
  auto t = make(true);
  Buffer b = make_buffer(4096);
  MemoryRegion cuda = b.region();
  cuda.kind = MemoryKind::kCuda;
  EXPECT_EQ(t->register_memory(cuda, Access::kRemote).status().code(), StatusCode::kUnsupported);
  MemoryRegion empty;
  EXPECT_EQ(t->register_memory(empty, Access::kRemote).status().code(), StatusCode::kInvalidArgument);
}

TEST(UcxTransport, EmulatedRmaExposesNothingUnlessAllowed) {
  auto t = make(true, /*allow_emulated_rma=*/false);
  if (t->capabilities().rdma) GTEST_SKIP() << "UCX has an RDMA device here: keys are enforced";
  Buffer b = make_buffer(4096);
  auto remote = t->register_memory(b.region(), Access::kRemote);
  ASSERT_FALSE(remote.is_ok());
  EXPECT_EQ(remote.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(remote.status().message().find("allow_emulated_rma"), std::string::npos);
  // Local use (the initiator's own buffers) stays possible.
  EXPECT_TRUE(t->register_memory(b.region(), Access::kLocal).is_ok());
}

TEST(UcxTransport, BadTransportListIsRefused) {
  UcxOptions options;
  options.transports = "no_such_transport_xyz";
  auto t = make_ucx_transport(options);
  // UCX accepts unknown names in TLS and then finds no usable transport at connect time, or
  // refuses at init: either way no crash, and a clear status.
  if (t.is_ok()) {
    auto peer = make(true);
    auto ep = (*t)->connect(peer->local_address(), deadline_after(3s));
    EXPECT_FALSE(ep.is_ok());
  } else {
    EXPECT_NE(t.status().code(), StatusCode::kOk);
  }
}

}  // namespace
}  // namespace kvstash::transport
