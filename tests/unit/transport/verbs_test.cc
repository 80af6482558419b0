// The verbs building blocks on a real verbs stack: device discovery, RC queue pairs, one-sided
// WRITE and READ, remote access errors, memory windows; then the transport itself, a target
// and a client in this process: leases of the most ranges, fences, revocation on every
// connection, and the setup service under idle sockets and connection caps. Without an RDMA
// device (every machine here) the tests skip; the Soft-RoCE lane (scripts/rdma-vm) runs them
// against rxe0 and rxe1 in a qemu guest.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "common/net.h"
#include "kvstash/engine.h"
#include "rdma_lane.h"
#include "recording_sink.h"
#include "test_util.h"
#include "transport/verbs/verbs_device.h"
#include "transport/verbs/verbs_gpu.h"
#include "transport/verbs/verbs_qp.h"
#include "transport/verbs/verbs_transport.h"
#include "transport/verbs/verbs_wire.h"
#include "transport/verbs/verbs_wr.h"

namespace kvstash::transport::verbs {
namespace {

using namespace std::chrono_literals;

// The first device with an active port, or nullopt.
std::optional<std::pair<Device, Port>> active_port() {
  auto devices = discover();
  if (!devices.is_ok()) return std::nullopt;
  for (auto& d : *devices) {
    for (auto& p : d.ports) {
      if (p.active) return std::make_pair(d, p);
    }
  }
  return std::nullopt;
}

#define REQUIRE_RDMA()                                                           \
  auto found = active_port();                                                    \
  KVSTASH_REQUIRE_RDMA(found.has_value(), "no RDMA device with an active port"); \
  const Device& device = found->first;                                           \
  const Port& port = found->second

// Two RC QPs on one device connected to each other: a and b stand for two peers.
struct Loop {
  Context ctx;
  Pd pd;
  Cq cq;
  Qp a, b;
  std::uint32_t psn_a = 0, psn_b = 0;
};

Loop make_loop(const Device& device, const Port& port, const QpConfig& cfg = {}) {
  Loop l;
  l.ctx = open_device(device.name).value();
  l.pd.reset(ibv_alloc_pd(l.ctx.get()));
  l.cq.reset(ibv_create_cq(l.ctx.get(), 1024, nullptr, nullptr, 0));
  EXPECT_TRUE(l.pd && l.cq);
  l.a = create_rc_qp(l.pd.get(), l.cq.get(), cfg).value();
  l.b = create_rc_qp(l.pd.get(), l.cq.get(), cfg).value();
  auto gid = pick_gid(port);
  EXPECT_TRUE(gid.has_value());
  l.psn_a = random_psn();
  l.psn_b = random_psn();
  QpEndpoint ea{l.a->qp_num, l.psn_a, gid->gid, port.lid, port.active_mtu};
  QpEndpoint eb{l.b->qp_num, l.psn_b, gid->gid, port.lid, port.active_mtu};
  Status s1 = connect_rc_qp(l.a.get(), port, *gid, l.psn_a, eb, cfg);
  Status s2 = connect_rc_qp(l.b.get(), port, *gid, l.psn_b, ea, cfg);
  EXPECT_TRUE(s1.is_ok()) << s1.to_string();
  EXPECT_TRUE(s2.is_ok()) << s2.to_string();
  return l;
}

// The next completion, or a WC with status IBV_WC_GENERAL_ERR and wr_id ~0 at the deadline.
ibv_wc wait_one(ibv_cq* cq, std::chrono::milliseconds limit = 10s) {
  ibv_wc wc{};
  for (auto end = std::chrono::steady_clock::now() + limit; std::chrono::steady_clock::now() < end;) {
    int n = ibv_poll_cq(cq, 1, &wc);
    if (n == 1) return wc;
    std::this_thread::yield();
  }
  wc.status = IBV_WC_GENERAL_ERR;
  wc.wr_id = ~0ull;
  return wc;
}

// One signaled WRITE or READ of `sges` against (raddr, rkey) on `qp`; its completion status.
ibv_wc_status one_sided(Loop& l, ibv_qp* qp, ibv_wr_opcode op, std::vector<ibv_sge> sges, std::uint64_t raddr,
                        std::uint32_t rkey) {
  ibv_send_wr wr{};
  wr.wr_id = 42;
  wr.sg_list = sges.data();
  wr.num_sge = static_cast<int>(sges.size());
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(qp, &wr, &bad) != 0) return IBV_WC_LOC_QP_OP_ERR;
  return wait_one(l.cq.get()).status;
}

TEST(Verbs, DiscoveryFindsPortsGidsAndLimits) {
  REQUIRE_RDMA();
  EXPECT_FALSE(device.name.empty());
  EXPECT_GE(device.max_sge, 1);
  EXPECT_GE(device.max_qp_wr, 1);
  EXPECT_GE(device.max_qp_rd_atom, 1);
  EXPECT_GE(mtu_bytes(port.active_mtu), 256);
  auto gid = pick_gid(port);
  ASSERT_TRUE(gid.has_value()) << "an active port must offer a usable GID";
  if (port.ethernet) {
    EXPECT_EQ(gid->type, GidType::kRoceV2);
    EXPECT_TRUE(gid->ipv4_mapped());
  }
  if (device.name.rfind("rxe", 0) == 0) {
    // The lane's guest: rxe0 on veth0 with 192.168.77.1 (its RoCE v2 IPv4 GID is index 1).
    auto by_ip = pick_gid(port, false, "192.168.77.1");
    ASSERT_TRUE(by_ip.has_value());
    EXPECT_EQ(by_ip->index, 1u);
    EXPECT_EQ(by_ip->to_string(), "::ffff:192.168.77.1");
    EXPECT_FALSE(pick_gid(port, false, "10.9.9.9").has_value());
    EXPECT_GT(device.max_mw, 0) << "rxe supports memory windows";
  }
  // KVSTASH_RDMA_DEVICES filters by name.
  auto none = discover({"no-such-device"});
  ASSERT_TRUE(none.is_ok());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(open_device("no-such-device").status().code(), StatusCode::kNotFound);
}

TEST(Verbs, WriteAndReadAreBitExactAcrossSizesOffsetsAndSges) {
  REQUIRE_RDMA();
  Loop l = make_loop(device, port);
  EXPECT_NE(l.psn_a, l.psn_b) << "PSNs must be random per connection";
  constexpr std::size_t kRegion = 4u << 20;
  std::vector<std::byte> local(kRegion), remote(kRegion), back(kRegion);
  constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  Mr lmr(ibv_reg_mr(l.pd.get(), local.data(), kRegion, IBV_ACCESS_LOCAL_WRITE));
  Mr rmr(ibv_reg_mr(l.pd.get(), remote.data(), kRegion, kAccess));
  Mr bmr(ibv_reg_mr(l.pd.get(), back.data(), kRegion, IBV_ACCESS_LOCAL_WRITE));
  ASSERT_TRUE(lmr && rmr && bmr);
  std::uint64_t seed = 1;
  for (std::size_t size :
       {std::size_t{1}, std::size_t{4095}, std::size_t{65539}, std::size_t{1u << 20} + 7}) {
    SCOPED_TRACE(size);
    const std::size_t loff = 13, roff = 4097;
    test::fill_random({local.data() + loff, size}, seed++);
    auto raddr = reinterpret_cast<std::uint64_t>(remote.data() + roff);
    ibv_sge s{reinterpret_cast<std::uint64_t>(local.data() + loff), static_cast<std::uint32_t>(size),
              lmr->lkey};
    ASSERT_EQ(one_sided(l, l.a.get(), IBV_WR_RDMA_WRITE, {s}, raddr, rmr->rkey), IBV_WC_SUCCESS);
    EXPECT_EQ(test::first_mismatch(remote.data() + roff, local.data() + loff, size), -1);
    ibv_sge d{reinterpret_cast<std::uint64_t>(back.data() + 7), static_cast<std::uint32_t>(size), bmr->lkey};
    ASSERT_EQ(one_sided(l, l.a.get(), IBV_WR_RDMA_READ, {d}, raddr, rmr->rkey), IBV_WC_SUCCESS);
    EXPECT_EQ(test::first_mismatch(back.data() + 7, local.data() + loff, size), -1);
  }
  // Three scattered pieces gathered into one remote range, and scattered back on READ.
  test::fill_random({local.data(), kRegion}, seed++);
  std::vector<ibv_sge> gather{{reinterpret_cast<std::uint64_t>(local.data() + 100), 1000, lmr->lkey},
                              {reinterpret_cast<std::uint64_t>(local.data() + 50000), 3, lmr->lkey},
                              {reinterpret_cast<std::uint64_t>(local.data() + 900000), 70000, lmr->lkey}};
  auto raddr = reinterpret_cast<std::uint64_t>(remote.data() + 11);
  ASSERT_EQ(one_sided(l, l.a.get(), IBV_WR_RDMA_WRITE, gather, raddr, rmr->rkey), IBV_WC_SUCCESS);
  std::size_t at = 11;
  for (const auto& g : gather) {
    EXPECT_EQ(test::first_mismatch(remote.data() + at, reinterpret_cast<void*>(g.addr), g.length), -1);
    at += g.length;
  }
  std::vector<ibv_sge> scatter{{reinterpret_cast<std::uint64_t>(back.data() + 3), 500, bmr->lkey},
                               {reinterpret_cast<std::uint64_t>(back.data() + 600000), 70503, bmr->lkey}};
  ASSERT_EQ(one_sided(l, l.a.get(), IBV_WR_RDMA_READ, scatter, raddr, rmr->rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(test::first_mismatch(back.data() + 3, remote.data() + 11, 500), -1);
  EXPECT_EQ(test::first_mismatch(back.data() + 600000, remote.data() + 511, 70503), -1);
}

// Many pieces through the work-request builder: chains of at most 16 requests, every 4th
// signaled, more requests in all than the send queue holds (64), the queue never overrun
// because each signaled completion frees the requests before it.
TEST(Verbs, ChainedSelectivelySignaledBatchesDeeperThanTheSendQueue) {
  REQUIRE_RDMA();
  QpConfig cfg;
  cfg.max_send_wr = 64;
  cfg.max_send_sge = 4;
  Loop l = make_loop(device, port, cfg);
  constexpr std::size_t kRegion = 2u << 20;
  std::vector<std::byte> local(kRegion), remote(kRegion);
  test::fill_random({local.data(), kRegion}, 99);
  Mr lmr(ibv_reg_mr(l.pd.get(), local.data(), kRegion, IBV_ACCESS_LOCAL_WRITE));
  Mr rmr(ibv_reg_mr(l.pd.get(), remote.data(), kRegion,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ));
  ASSERT_TRUE(lmr && rmr);
  WrBuilder b({.max_wrs = 16, .max_sge = 4, .max_msg = device.max_msg_sz ? device.max_msg_sz : 1u << 30});
  // 512 pieces of 4 KiB: remote order is the local order reversed in pairs, so some pieces
  // gather into one request and others do not.
  constexpr std::size_t kPiece = 4096, kPieces = 512;
  std::uint32_t in_flight = 0, posted_requests = 0;
  auto drain_one = [&] {
    ibv_wc wc = wait_one(l.cq.get());
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
    in_flight -= static_cast<std::uint32_t>(wc.wr_id >> 32);  // requests this completion covers
  };
  auto post = [&] {
    std::uint32_t n = b.size();
    ibv_send_wr* head = b.chain(4);
    // Tag each signaled request with how many requests it completes.
    std::uint32_t since = 0;
    for (ibv_send_wr* w = head; w != nullptr; w = w->next) {
      ++since;
      if (w->send_flags & IBV_SEND_SIGNALED) {
        w->wr_id = static_cast<std::uint64_t>(since) << 32;
        since = 0;
      }
    }
    while (in_flight + n > cfg.max_send_wr) drain_one();
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_send(l.a.get(), head, &bad), 0);
    in_flight += n;
    posted_requests += n;
    b.reset();
  };
  for (std::size_t i = 0; i < kPieces; ++i) {
    std::size_t src = i * kPiece, dst = (i ^ 1) * kPiece;
    Piece p{reinterpret_cast<std::uint64_t>(local.data() + src), lmr->lkey,
            reinterpret_cast<std::uint64_t>(remote.data() + dst), rmr->rkey, kPiece};
    if (!b.add(IBV_WR_RDMA_WRITE, p, i)) {
      post();
      ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, p, i));
    }
  }
  post();
  while (in_flight > 0) drain_one();
  EXPECT_GT(posted_requests, cfg.max_send_wr) << "the batch must be deeper than the send queue";
  for (std::size_t i = 0; i < kPieces; ++i) {
    ASSERT_EQ(test::first_mismatch(remote.data() + (i ^ 1) * kPiece, local.data() + i * kPiece, kPiece), -1)
        << i;
  }
}

TEST(Verbs, AccessOutsideTheRegionWithAWrongKeyOrAfterDeregistrationIsARemoteAccessError) {
  REQUIRE_RDMA();
  constexpr std::size_t kRegion = 64u << 10;
  std::vector<std::byte> local(kRegion), remote(kRegion);
  constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  auto attempt = [&](auto mutate) {
    Loop l = make_loop(device, port);  // an error moves the QP to ERROR: a fresh pair each time
    Mr lmr(ibv_reg_mr(l.pd.get(), local.data(), kRegion, IBV_ACCESS_LOCAL_WRITE));
    Mr rmr(ibv_reg_mr(l.pd.get(), remote.data(), kRegion, kAccess));
    std::uint64_t raddr = reinterpret_cast<std::uint64_t>(remote.data());
    std::uint32_t rkey = rmr->rkey;
    mutate(raddr, rkey, rmr);
    ibv_sge s{reinterpret_cast<std::uint64_t>(local.data()), 4096, lmr->lkey};
    return one_sided(l, l.a.get(), IBV_WR_RDMA_READ, {s}, raddr, rkey);
  };
  EXPECT_EQ(attempt([](auto&, auto&, auto&) {}), IBV_WC_SUCCESS);
  EXPECT_EQ(attempt([&](std::uint64_t& raddr, auto&, auto&) { raddr += kRegion - 100; }),
            IBV_WC_REM_ACCESS_ERR)
      << "a READ running past the region must fail";
  EXPECT_EQ(attempt([](auto&, std::uint32_t& rkey, auto&) { rkey ^= 0x5a5a00; }), IBV_WC_REM_ACCESS_ERR)
      << "a wrong rkey must fail";
  EXPECT_EQ(attempt([](auto&, auto&, Mr& mr) { mr.reset(); }), IBV_WC_REM_ACCESS_ERR)
      << "a deregistered region must be unreachable";
  // A region registered for memory windows only (a memory node's pool): its own rkey
  // grants no remote access at all.
  EXPECT_EQ(
      attempt([&](auto&, std::uint32_t& rkey, Mr& mr) {
        mr.reset(ibv_reg_mr(mr->pd, remote.data(), kRegion, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND));
        ASSERT_TRUE(mr) << std::strerror(errno);
        rkey = mr->rkey;
      }),
      IBV_WC_REM_ACCESS_ERR)
      << "an MR for windows only must not be reachable through its own rkey";
}

TEST(Verbs, AnInvalidatedMemoryWindowRevokesItsKey) {
  REQUIRE_RDMA();
  if (device.max_mw == 0) GTEST_SKIP() << device.name << " has no memory windows";
  Loop l = make_loop(device, port);
  constexpr std::size_t kRegion = 1u << 20;
  std::vector<std::byte> local(kRegion), remote(kRegion);
  test::fill_random({remote.data(), kRegion}, 7);
  Mr lmr(ibv_reg_mr(l.pd.get(), local.data(), kRegion, IBV_ACCESS_LOCAL_WRITE));
  Mr rmr(ibv_reg_mr(l.pd.get(), remote.data(), kRegion,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_MW_BIND));
  ASSERT_TRUE(lmr && rmr);
  Mw mw(ibv_alloc_mw(l.pd.get(), IBV_MW_TYPE_2));
  ASSERT_TRUE(mw) << "ibv_alloc_mw: " << std::strerror(errno);

  // The window covers one "object": 64 KiB at offset 128 KiB. b binds it (b is the owner side).
  const std::uint64_t obj = reinterpret_cast<std::uint64_t>(remote.data()) + (128u << 10);
  const std::uint32_t rkey = ibv_inc_rkey(mw->rkey);
  ibv_send_wr bind{};
  bind.wr_id = 1;
  bind.opcode = IBV_WR_BIND_MW;
  bind.send_flags = IBV_SEND_SIGNALED;
  bind.bind_mw.mw = mw.get();
  bind.bind_mw.rkey = rkey;
  bind.bind_mw.bind_info.mr = rmr.get();
  bind.bind_mw.bind_info.addr = obj;
  bind.bind_mw.bind_info.length = 64u << 10;
  bind.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(l.b.get(), &bind, &bad), 0);
  ASSERT_EQ(wait_one(l.cq.get()).status, IBV_WC_SUCCESS);

  ibv_sge s{reinterpret_cast<std::uint64_t>(local.data()), 4096, lmr->lkey};
  ASSERT_EQ(one_sided(l, l.a.get(), IBV_WR_RDMA_READ, {s}, obj, rkey), IBV_WC_SUCCESS);
  EXPECT_EQ(test::first_mismatch(local.data(), reinterpret_cast<void*>(obj), 4096), -1);

  // The lease ends: the owner invalidates the window, and the same key now fails.
  ibv_send_wr inv{};
  inv.wr_id = 2;
  inv.opcode = IBV_WR_LOCAL_INV;
  inv.send_flags = IBV_SEND_SIGNALED;
  inv.invalidate_rkey = rkey;
  ASSERT_EQ(ibv_post_send(l.b.get(), &inv, &bad), 0);
  ASSERT_EQ(wait_one(l.cq.get()).status, IBV_WC_SUCCESS);
  EXPECT_EQ(one_sided(l, l.a.get(), IBV_WR_RDMA_READ, {s}, obj, rkey), IBV_WC_REM_ACCESS_ERR)
      << "a revoked window must refuse the reader";
}

TEST(Verbs, ADeadPeerFailsPendingRequestsWithinTheRetryBudget) {
  REQUIRE_RDMA();
  QpConfig cfg;
  cfg.timeout = 10;  // ~4 ms x 2 retries: fast for the test
  cfg.retry_cnt = 2;
  Loop l = make_loop(device, port, cfg);
  std::vector<std::byte> local(4096), remote(4096);
  Mr lmr(ibv_reg_mr(l.pd.get(), local.data(), 4096, IBV_ACCESS_LOCAL_WRITE));
  Mr rmr(ibv_reg_mr(l.pd.get(), remote.data(), 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
  l.b.reset();  // the peer's QP is gone: nothing answers a's requests
  ibv_sge s{reinterpret_cast<std::uint64_t>(local.data()), 4096, lmr->lkey};
  auto start = std::chrono::steady_clock::now();
  auto st = one_sided(l, l.a.get(), IBV_WR_RDMA_READ, {s}, reinterpret_cast<std::uint64_t>(remote.data()),
                      rmr->rkey);
  EXPECT_NE(st, IBV_WC_SUCCESS);
  EXPECT_NE(st, IBV_WC_GENERAL_ERR) << "no completion within 10 s: the request hung";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

// Without a GPU (every machine here, and the lane's guest) no GPUDirect path exists: the
// registration says so, naming why each path was ruled out, instead of failing obscurely.
TEST(Verbs, GpuRegistrationTakesAPathOrExplainsWhyOnlyStagingIsLeft) {
  REQUIRE_RDMA();
  (void)port;
  EXPECT_EQ(to_string(GpuPath::kDmaBuf), "dma-buf");
  EXPECT_EQ(to_string(GpuPath::kPeerMem), "nvidia-peermem");
  EXPECT_EQ(to_string(GpuPath::kStaging), "staging");
  Context ctx = open_device(device.name).value();
  Pd pd(ibv_alloc_pd(ctx.get()));
  ASSERT_TRUE(pd);
  alignas(4096) static std::byte page[1u << 16];
  auto r = register_gpu_memory(pd.get(), page, sizeof page, IBV_ACCESS_LOCAL_WRITE);
  if (r.is_ok()) {
    // A GPU host with nvidia-peermem takes any pointer; the path must be named.
    EXPECT_NE(r->path, GpuPath::kStaging);
    return;
  }
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  const std::string m = r.status().message();
  EXPECT_NE(m.find("staging"), std::string::npos) << m;
  EXPECT_NE(m.find("dma-buf:"), std::string::npos) << m;
  EXPECT_NE(m.find("nvidia-peermem:"), std::string::npos) << m;
  EXPECT_EQ(register_gpu_memory(pd.get(), nullptr, 0, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(Verbs, OnDemandPagingRegistersWhereTheDeviceCanAndIsRefusedByNameElsewhere) {
  REQUIRE_RDMA();
  (void)port;
  EngineOptions o;
  o.transports = {TransportKind::kVerbs};
  o.verbs.devices = {device.name};
  o.verbs.on_demand_paging = true;
  auto engine = Engine::create(o);
  ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
  auto buffer = Buffer::allocate(1u << 20, {.shareable = false}).value();
  auto h = (*engine)->register_memory(buffer.region(), Access::kRemote);
  if (device.odp_rc) {
    EXPECT_TRUE(h.is_ok()) << h.status().to_string();
    return;
  }
  ASSERT_FALSE(h.is_ok()) << device.name << " reports no RC on-demand paging, yet registration succeeded";
  EXPECT_EQ(h.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(h.status().message().find("on_demand_paging"), std::string::npos) << h.status().to_string();
}

// ---- the transport: a target and a client in this process ------------------------------------

// A verbs transport, or a skip (a failure in the lane) where none can start.
#define START_VERBS(var, ...)                                                \
  auto var##_made = make_verbs_transport(__VA_ARGS__);                       \
  KVSTASH_REQUIRE_RDMA(var##_made.is_ok(), var##_made.status().to_string()); \
  std::unique_ptr<Transport> var = std::move(var##_made).value()

std::uint64_t counter(const Transport& t, std::string_view name) {
  for (const auto& c : t.counters()) {
    if (c.name == name) return c.value;
  }
  ADD_FAILURE() << "no counter " << name;
  return 0;
}

// Waits (bounded) until `pred` holds; whether it did.
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = 5s) {
  for (auto end = std::chrono::steady_clock::now() + limit; std::chrono::steady_clock::now() < end;) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

std::string control_of(const Transport& t) { return decode_address(t.local_address()).value().control; }

// A TCP connection to `t`'s setup listener that sends `bytes` (maybe none) and then nothing.
UniqueFd raw_setup_socket(const Transport& t, std::string_view bytes = {}) {
  auto fd = net::connect_tcp(net::parse_host_port(control_of(t)).value(), deadline_after(5s));
  EXPECT_TRUE(fd.is_ok()) << fd.status().to_string();
  if (!fd.is_ok()) return UniqueFd();
  if (!bytes.empty()) {
    EXPECT_TRUE(net::send_all(fd->get(), bytes.data(), bytes.size(), deadline_after(5s), "raw").is_ok());
  }
  return std::move(fd).value();
}

// Whether the peer closed `fd` within `limit` (it sends nothing, so readable means closed).
bool closed_within(int fd, std::chrono::milliseconds limit) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(limit.count())) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT) <= 0;
}

// A target region registered for leases (filled with a pattern), and a client's local region.
struct Leased {
  static constexpr std::size_t kRegion = 16u << 20;
  Buffer remote = Buffer::allocate(kRegion).value();
  Buffer local = Buffer::allocate(kRegion).value();
  std::unique_ptr<LocalRegistration> remote_reg, local_reg;

  Leased(Transport& target, Transport& client) {
    test::fill_random(remote.bytes(), 42);
    remote_reg = target.register_memory(remote.region(), Access::kLeased).value();
    local_reg = client.register_memory(local.region(), Access::kLocal).value();
  }
  std::uint64_t base() const { return reinterpret_cast<std::uint64_t>(remote.data()); }
  std::unique_ptr<RemoteKey> region_key(Endpoint& ep) {
    auto k = ep.import_key(base(), kRegion, remote_reg->packed_key(), deadline_after(5s));
    EXPECT_TRUE(k.is_ok()) << k.status().to_string();
    return k.is_ok() ? std::move(k).value() : nullptr;
  }
  // READs `len` bytes at `offset` of the region through `key` on `lane`; its status, and on
  // success whether the bytes are the region's.
  Status read(Endpoint& ep, const RemoteKey& key, std::size_t offset, std::size_t len,
              std::uint32_t lane = 0) {
    test::RecordingSink sink;
    std::memset(local.data(), 0, len);
    Op op{TransferOp::kRead, local.data(), local_reg.get(), base() + offset, &key, len, lane, &sink, 7};
    ep.post({&op, 1});
    if (!sink.wait(1, 30s)) return Status::internal("the READ never completed");
    Status s = sink.status(7);
    if (s.is_ok() && std::memcmp(local.data(), remote.data() + offset, len) != 0) {
      return Status::corrupt("the READ returned other bytes than the region's");
    }
    return s;
  }
};

Result<std::unique_ptr<RemoteKey>> lease(Endpoint& ep, const RemoteKey& region,
                                         std::span<const RemoteRange> ranges, std::uint64_t id,
                                         std::uint64_t fence = 0) {
  return ep.lease_key(region, ranges, {.id = id, .op = TransferOp::kRead, .ttl = 60s, .fence = fence},
                      deadline_after(10s));
}

// A lease of more than 254 ranges must not overflow the 4,096-byte setup frame (the target would
// drop the connection). The largest lease the engine allows (kMaxLeaseRanges, what the store
// chunks at) binds a real window per range on every lane.
TEST(VerbsTransport, ALeaseOfTheMostRangesBindsAWindowPerRangeOnEveryLane) {
  START_VERBS(target, {});
  START_VERBS(client, {});
  Leased m(*target, *client);
  auto ep = client->connect(target->local_address(), deadline_after(10s)).value();
  auto region = m.region_key(*ep);
  ASSERT_TRUE(region);
  const std::uint32_t lanes = client->capabilities().lanes;
  constexpr std::size_t kStep = 8192, kLen = 4096;  // fragmented: a range every other page
  std::vector<RemoteRange> ranges;
  for (std::size_t i = 0; i < kMaxLeaseRanges; ++i) ranges.push_back({m.base() + i * kStep, kLen});
  const std::uint64_t bound = counter(*target, "windows_bound");
  auto key = lease(*ep, *region, ranges, 0x1234'5678'9abc'def1);
  ASSERT_TRUE(key.is_ok()) << key.status().to_string();
  EXPECT_EQ(counter(*target, "windows_bound") - bound, kMaxLeaseRanges * lanes);
  EXPECT_TRUE(ep->healthy());
  for (std::uint32_t lane = 0; lane < lanes; ++lane) {
    for (std::size_t i : {std::size_t{0}, std::size_t{511}, kMaxLeaseRanges - 1}) {
      Status s = m.read(*ep, **key, i * kStep, kLen, lane);
      EXPECT_TRUE(s.is_ok()) << "range " << i << " lane " << lane << ": " << s.to_string();
    }
  }
  // Dropping the key releases every window.
  const std::uint64_t revoked = counter(*target, "windows_revoked");
  key->reset();
  EXPECT_TRUE(
      eventually([&] { return counter(*target, "windows_revoked") - revoked == kMaxLeaseRanges * lanes; }));
}

TEST(VerbsTransport, FenceRevokesTaggedLeasesOnEveryConnectionAndRefusesThemFromThenOn) {
  START_VERBS(target, {});
  START_VERBS(client, {});
  Leased m(*target, *client);
  auto e1 = client->connect(target->local_address(), deadline_after(10s)).value();
  auto e2 = client->connect(target->local_address(), deadline_after(10s)).value();
  auto r1 = m.region_key(*e1), r2 = m.region_key(*e2);
  ASSERT_TRUE(r1 && r2);
  const std::uint32_t lanes = client->capabilities().lanes;
  const RemoteRange at0[] = {{m.base(), 4096}}, at1[] = {{m.base() + (1u << 20), 4096}},
                    at2[] = {{m.base() + (2u << 20), 4096}};
  // Lease A (tag 100) through both connections under one id, B (tag 200), C (no tag).
  auto a1 = lease(*e1, *r1, at0, 0xa, 100), a2 = lease(*e2, *r2, at0, 0xa, 100);
  auto b = lease(*e2, *r2, at1, 0xb, 200), c = lease(*e2, *r2, at2, 0xc, 0);
  ASSERT_TRUE(a1.is_ok() && a2.is_ok() && b.is_ok() && c.is_ok());

  const std::uint64_t fenced = counter(*target, "leases_fenced");
  target->fence(150);  // returns once A's windows are gone, on every connection and lane
  EXPECT_EQ(counter(*target, "leases_fenced") - fenced, 2u * lanes);
  EXPECT_TRUE(m.read(*e2, **b, 1u << 20, 4096).is_ok()) << "tag 200 is past the fence";
  EXPECT_TRUE(m.read(*e2, **c, 2u << 20, 4096).is_ok()) << "an untagged lease is never fenced";

  // Tags up to the fence are refused from now on, with a clear reason; later ones are not.
  auto late = lease(*e1, *r1, at1, 0xd, 150);
  ASSERT_EQ(late.status().code(), StatusCode::kStale) << late.status().to_string();
  EXPECT_NE(late.status().message().find("fenced"), std::string::npos) << late.status().to_string();
  EXPECT_TRUE(lease(*e1, *r1, at1, 0xe, 151).is_ok());
  EXPECT_TRUE(lease(*e1, *r1, at1, 0xf, 0).is_ok());
  target->fence(120);  // lower: fences nothing new, and unfences nothing
  EXPECT_EQ(lease(*e1, *r1, at1, 0x10, 140).status().code(), StatusCode::kStale);
  EXPECT_TRUE(m.read(*e2, **b, 1u << 20, 4096).is_ok());

  // A's windows are gone on both connections: the target's NIC refuses the READ.
  EXPECT_EQ(m.read(*e2, **a2, 0, 4096).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(m.read(*e1, **a1, 0, 4096).code(), StatusCode::kPermissionDenied);
}

TEST(VerbsTransport, RevokeEndsALeaseOnEveryConnectionAndLaneBeforeItIsConfirmed) {
  START_VERBS(target, {});
  START_VERBS(client, {});
  Leased m(*target, *client);
  const std::uint32_t lanes = client->capabilities().lanes;
  std::vector<std::shared_ptr<Endpoint>> eps;
  std::vector<std::unique_ptr<RemoteKey>> regions, keys;
  const RemoteRange ranges[] = {{m.base(), 64u << 10}, {m.base() + (4u << 20), 64u << 10}};
  constexpr std::uint64_t kId = 0x5eed'0000'0000'0001;
  for (int i = 0; i < 3; ++i) {
    eps.push_back(client->connect(target->local_address(), deadline_after(10s)).value());
    regions.push_back(m.region_key(*eps.back()));
    ASSERT_TRUE(regions.back());
    auto k = lease(*eps.back(), *regions.back(), ranges, kId);
    ASSERT_TRUE(k.is_ok()) << k.status().to_string();
    keys.push_back(std::move(k).value());
  }
  // The third connection breaks (a window of another connection's queue pair is no key on
  // its own: the target's NIC refuses it) but its socket, and so its windows at the target,
  // stay.
  EXPECT_EQ(m.read(*eps[2], *keys[0], 0, 4096).code(), StatusCode::kPermissionDenied);
  EXPECT_FALSE(eps[2]->healthy());

  const std::uint64_t revoked = counter(*target, "windows_revoked");
  // Through the first connection, with the second's key: the id names the lease.
  Status s = eps[0]->revoke(*keys[1], {.id = kId, .op = TransferOp::kRead, .ttl = 60s, .fence = 0},
                            deadline_after(5s));
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  // Confirmed means done: every window of the lease, on all three connections and every lane.
  EXPECT_EQ(counter(*target, "windows_revoked") - revoked, 3u * lanes * 2u);
  EXPECT_EQ(counter(*target, "leases_revoked"), 1u);
  for (std::uint32_t lane = 0; lane < lanes; ++lane) {
    auto fresh = client->connect(target->local_address(), deadline_after(10s)).value();
    auto region = m.region_key(*fresh);
    auto k = lease(*fresh, *region, ranges, kId + 2 + lane);
    ASSERT_TRUE(k.is_ok());
    EXPECT_TRUE(m.read(*fresh, **k, 0, 4096, lane).is_ok()) << "another lease is untouched";
  }
  EXPECT_EQ(m.read(*eps[1], *keys[1], 0, 4096, lanes - 1).code(), StatusCode::kPermissionDenied);
  // A late request under the revoked id is refused, on any connection.
  auto again = lease(*eps[0], *regions[0], ranges, kId);
  EXPECT_EQ(again.status().code(), StatusCode::kStale) << again.status().to_string();
  EXPECT_NE(again.status().message().find("revoked"), std::string::npos) << again.status().to_string();
  // Revoking an id the target does not hold is confirmed too (it may have expired).
  EXPECT_TRUE(
      eps[0]
          ->revoke(*keys[0], {.id = 0x77, .op = TransferOp::kRead, .ttl = 1s, .fence = 5}, deadline_after(5s))
          .is_ok());
  // A target that is gone cannot confirm: kUnavailable, within the deadline.
  target.reset();
  const auto t0 = std::chrono::steady_clock::now();
  s = eps[0]->revoke(*keys[0], {.id = 0x78, .op = TransferOp::kRead, .ttl = 1s, .fence = 0},
                     deadline_after(2s));
  EXPECT_TRUE(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kTimeout) << s.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
}

// Idle setup sockets must not stall connects and leases (as they would if the setup service
// waited on each silent connection in turn): ten of them delay nothing, and are closed at the
// handshake timeout (an oversize hello at once).
TEST(VerbsTransport, IdleSetupSocketsDelayNoConnectAndAreClosedAtTheHandshakeTimeout) {
  VerbsOptions o;
  o.handshake_timeout = 3s;
  START_VERBS(target, o);
  START_VERBS(client, {});
  Leased m(*target, *client);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 10; ++i)
    idle.push_back(raw_setup_socket(*target, i % 2 == 0 ? "" : std::string_view("\0\0", 2)));
  UniqueFd oversize = raw_setup_socket(*target, std::string_view("\x00\x10\x00\x00", 4));  // a 1 MiB "hello"
  const auto t0 = std::chrono::steady_clock::now();
  auto ep = client->connect(target->local_address(), deadline_after(10s));
  ASSERT_TRUE(ep.is_ok()) << ep.status().to_string();
  auto region = m.region_key(**ep);
  const RemoteRange r[] = {{m.base() + 8192, 4096}};
  auto key = lease(**ep, *region, r, 99);
  ASSERT_TRUE(key.is_ok()) << key.status().to_string();
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 1500ms) << "ten idle setup sockets delayed a connect and a lease";
  EXPECT_TRUE(m.read(**ep, **key, 8192, 4096).is_ok());
  EXPECT_TRUE(closed_within(oversize.get(), 1s)) << "an oversize hello must be refused at once";
  for (auto& fd : idle)
    EXPECT_TRUE(closed_within(fd.get(), 5s)) << "an idle socket outlived the handshake timeout";
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 2s) << "closed before the handshake timeout";
  EXPECT_GE(counter(*target, "handshakes_failed"), 11u);
  EXPECT_TRUE(m.read(**ep, **key, 8192, 4096).is_ok()) << "the connection that is up stays up";
}

// The target answers a hello with a challenge that proves nothing (no queue pair, no mac: a
// proof over a nonce the client chose would be an offline oracle for the token), and closes
// the connection on a wrong proof; it proves the token only after the client did.
TEST(VerbsTransport, TheTargetProvesTheTokenOnlyAfterTheClientDid) {
  VerbsOptions o;
  START_VERBS(target, o, "verbs-test-cluster-token-0123");
  Hello h;
  h.qp = {2, 1, {}, 0, IBV_MTU_1024};
  h.max_rd_atomic = 1;
  h.nonce.fill(7);
  // Setup frames: a u32 length in network order, then the message.
  auto framed = [](std::string_view m) {
    const std::uint32_t n = htonl(static_cast<std::uint32_t>(m.size()));
    return std::string(reinterpret_cast<const char*>(&n), 4).append(m);
  };
  UniqueFd sock = raw_setup_socket(*target, framed(encode_hello(h)));
  std::uint32_t n = 0;
  ASSERT_TRUE(net::recv_all(sock.get(), &n, 4, deadline_after(5s), "raw").is_ok());
  ASSERT_LE(ntohl(n), kMaxSetupFrame);
  Result<std::string> reply = std::string(ntohl(n), '\0');
  ASSERT_TRUE(net::recv_all(sock.get(), reply->data(), reply->size(), deadline_after(5s), "raw").is_ok());
  auto challenge = decode_challenge(*reply);
  ASSERT_TRUE(challenge.is_ok()) << challenge.status().to_string();
  EXPECT_TRUE(challenge->token_required);
  EXPECT_FALSE(decode_hello(*reply).is_ok()) << "the target sent a hello (a queue pair, a proof) first";
  handshake::Mac wrong{};
  wrong.fill(1);
  const std::string proof = framed({reinterpret_cast<const char*>(wrong.data()), wrong.size()});
  ASSERT_TRUE(net::send_all(sock.get(), proof.data(), proof.size(), deadline_after(5s), "raw").is_ok());
  EXPECT_TRUE(closed_within(sock.get(), 2s)) << "a wrong proof must be refused";
  EXPECT_GE(counter(*target, "handshakes_failed"), 1u);
}

TEST(VerbsTransport, ConnectionsOverTheCapsAreRefusedAtAccept) {
  VerbsOptions per_peer;
  per_peer.max_connections_per_peer = 3;
  START_VERBS(target, per_peer);
  START_VERBS(client, {});
  std::vector<UniqueFd> held;
  for (int i = 0; i < 3; ++i) held.push_back(raw_setup_socket(*target));
  UniqueFd over = raw_setup_socket(*target);
  EXPECT_TRUE(closed_within(over.get(), 2s))
      << "a fourth connection from one address must be closed at accept";
  const auto t0 = std::chrono::steady_clock::now();
  auto refused = client->connect(target->local_address(), deadline_after(5s));
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_GE(counter(*target, "connections_refused"), 2u);
  held.clear();  // the slots free as the target sees them close
  EXPECT_TRUE(
      eventually([&] { return client->connect(target->local_address(), deadline_after(5s)).is_ok(); }));

  // Connections in the handshake have their own budget: when it is full the oldest goes for
  // the newcomer, so sockets that never prove the token cannot keep out a client that does.
  VerbsOptions unproven;
  unproven.max_unproven_connections = 2;
  START_VERBS(small, unproven);
  held.push_back(raw_setup_socket(*small));
  held.push_back(raw_setup_socket(*small));
  over = raw_setup_socket(*small);
  EXPECT_TRUE(closed_within(held[0].get(), 2s)) << "the oldest handshake must make room for a newer one";
  EXPECT_TRUE(client->connect(small->local_address(), deadline_after(5s)).is_ok())
      << "silent setup sockets kept out a client that proves the token";
  EXPECT_GE(counter(*small, "unproven_evicted"), 2u);

  // The main budget counts connections that are up only: one connect takes a connection per
  // lane (per device of the client's: the Soft-RoCE guest has two).
  VerbsOptions total;
  total.max_connections = client->capabilities().lanes;
  START_VERBS(one, total);
  auto first = client->connect(one->local_address(), deadline_after(5s));
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  EXPECT_FALSE(client->connect(one->local_address(), deadline_after(5s)).is_ok());
  EXPECT_GE(counter(*one, "connections_refused"), 1u);
}

}  // namespace
}  // namespace kvstash::transport::verbs
