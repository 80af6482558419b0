// The engine in one process: two engines, transport choice, validation, batches.
#include <sys/resource.h>

#include <algorithm>
#include <thread>

#include <gtest/gtest.h>

#include "common/runtime_library.h"
#include "engine/blobs.h"
#include "kvstash/engine.h"
#include "test_util.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;

struct Two {
  std::unique_ptr<Engine> a, b;
  Buffer local, remote;
  MemoryHandle local_mem, remote_mem;
};

// Two engines of options `o`, a local buffer on the first and a remote one on the second.
Two make_two(const EngineOptions& o, std::size_t size = 1u << 20) {
  Two t;
  t.a = Engine::create(o).value();
  t.b = Engine::create(o).value();
  t.local = Buffer::allocate(size).value();
  t.remote = Buffer::allocate(size).value();
  t.local_mem = t.a->register_memory(t.local.region(), Access::kLocal).value();
  t.remote_mem = t.b->register_memory(t.remote.region(), Access::kRemote).value();
  return t;
}

Two make_two(std::vector<TransportKind> kinds, std::size_t size = 1u << 20) {
  return make_two(EngineOptions{.transports = std::move(kinds)}, size);
}

TEST(Engine, SameHostPeersChooseSharedMemoryAndCanBeForcedToTcp) {
  Two t = make_two({TransportKind::kTcp, TransportKind::kShm});
  auto p = t.a->connect(t.b->address());
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ((*p)->transport(), TransportKind::kShm);
  auto forced = t.a->connect(t.b->address(), {}, TransportKind::kTcp);
  ASSERT_TRUE(forced.is_ok()) << forced.status().to_string();
  EXPECT_EQ((*forced)->transport(), TransportKind::kTcp);

  auto e = Engine::create(
      {.transports = {TransportKind::kTcp, TransportKind::kShm}, .prefer = TransportKind::kTcp});
  ASSERT_TRUE(e.is_ok());
  auto preferred = (*e)->connect(t.b->address());
  ASSERT_TRUE(preferred.is_ok());
  EXPECT_EQ((*preferred)->transport(), TransportKind::kTcp);
}

TEST(Engine, NoTransportInCommonIsUnsupported) {
  auto a = Engine::create({.transports = {TransportKind::kShm}}).value();
  auto b = Engine::create({.transports = {TransportKind::kTcp}}).value();
  auto p = a->connect(b->address());
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
}

TEST(Engine, UnbuiltOrUnknownTransportAskedByNameFailsCreate) {
  auto e = Engine::create({.transports = {TransportKind::kVerbs}});
  ASSERT_FALSE(e.is_ok());
  EXPECT_EQ(e.status().code(), StatusCode::kUnsupported);
}

TEST(Engine, TransferAcrossBothTransportsWithSlicing) {
  for (TransportKind kind : {TransportKind::kShm, TransportKind::kTcp}) {
    Two t = make_two({kind}, 16u << 20);
    auto peer = t.a->connect(t.b->address()).value();
    auto remote = peer->import_key(t.remote_mem.remote_key()).value();
    test::fill_random(t.local.bytes(), 5);
    // 16 MiB is several slices on either transport; they must land in order.
    TransferEntry w{TransferOp::kWrite, &t.local_mem, t.local.data(), remote.base(), &remote, t.local.size()};
    ASSERT_TRUE(peer->transfer({&w, 1}, deadline_after(30s)).is_ok()) << to_string(kind);
    EXPECT_EQ(test::first_mismatch(t.local.data(), t.remote.data(), t.local.size()), -1) << to_string(kind);
  }
}

TEST(Engine, UnslicedTransfersCompleteWhenTheirOpCompletes) {
  // slice_bytes 0 means "never split": each entry is one op, and the batch must finish when
  // that op does, not at its deadline.
  EngineOptions o{.transports = {TransportKind::kTcp}};
  o.tcp.slice_bytes = 0;
  Two t = make_two(o, 3u << 20);
  auto peer = t.a->connect(t.b->address()).value();
  auto remote = peer->import_key(t.remote_mem.remote_key()).value();
  test::fill_random(t.local.bytes(), 11);
  TransferEntry w{TransferOp::kWrite, &t.local_mem, t.local.data(), remote.base(), &remote, t.local.size()};
  const auto start = Clock::now();
  auto batch = peer->submit({&w, 1}, deadline_after(60s)).value();
  ASSERT_TRUE(batch.wait().is_ok());
  EXPECT_LT(Clock::now() - start, 30s) << "the batch waited for its deadline";
  EXPECT_EQ(test::first_mismatch(t.local.data(), t.remote.data(), t.local.size()), -1);
}

// This process's CPU time (every thread) so far.
std::chrono::microseconds process_cpu() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return std::chrono::seconds(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         std::chrono::microseconds(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

TEST(Engine, BusyPollMovesTheSameBytesAndSleepsWhenIdle) {
  // Latency mode on both sides: callers and tcp I/O threads spin before they sleep.
  Two t = make_two(EngineOptions{.transports = {TransportKind::kTcp}, .busy_poll = 2ms}, 4u << 20);
  auto peer = t.a->connect(t.b->address()).value();
  auto remote = peer->import_key(t.remote_mem.remote_key()).value();
  int round = 0;
  for (std::size_t size : {std::size_t{1}, std::size_t{4096}, std::size_t{65536}, std::size_t{4u << 20}}) {
    for (int i = 0; i < 20; ++i, ++round) {
      test::fill_random(t.local.bytes().first(size), 100 + round);
      TransferEntry w{TransferOp::kWrite, &t.local_mem, t.local.data(), remote.base(), &remote, size};
      ASSERT_TRUE(peer->transfer({&w, 1}, deadline_after(10s)).is_ok()) << size;
      ASSERT_EQ(test::first_mismatch(t.local.data(), t.remote.data(), size), -1) << size;
      test::fill_random(t.remote.bytes().first(size), 900 + round);
      TransferEntry r{TransferOp::kRead, &t.local_mem, t.local.data(), remote.base(), &remote, size};
      ASSERT_TRUE(peer->transfer({&r, 1}, deadline_after(10s)).is_ok()) << size;
      ASSERT_EQ(test::first_mismatch(t.local.data(), t.remote.data(), size), -1) << size;
    }
  }
  // Idle, the spinning stops: four I/O threads and no caller use a fraction of the time
  // (spinning on, they would use up to every core of the host for all of it).
  std::this_thread::sleep_for(50ms);
  const auto cpu0 = process_cpu();
  const auto wall0 = Clock::now();
  std::this_thread::sleep_for(500ms);
  const auto cpu = process_cpu() - cpu0;
  EXPECT_LT(cpu, (Clock::now() - wall0) / 10) << "threads kept spinning while nothing moved";
}

TEST(Engine, SubmitValidatesEveryEntry) {
  Two t = make_two({TransportKind::kTcp});
  auto peer = t.a->connect(t.b->address()).value();
  auto remote = peer->import_key(t.remote_mem.remote_key()).value();
  EXPECT_EQ(peer->submit({}, deadline_after(1s)).status().code(), StatusCode::kInvalidArgument);
  TransferEntry e{TransferOp::kRead, &t.local_mem, t.local.data(), remote.base(), &remote, 0};
  EXPECT_EQ(peer->submit({&e, 1}, deadline_after(1s)).status().code(), StatusCode::kInvalidArgument);
  e.length = 16;
  e.local = nullptr;
  EXPECT_EQ(peer->submit({&e, 1}, deadline_after(1s)).status().code(), StatusCode::kInvalidArgument);
  e.local = &t.local_mem;
  e.remote_addr = remote.base() - 1;
  EXPECT_EQ(peer->submit({&e, 1}, deadline_after(1s)).status().code(), StatusCode::kInvalidArgument);
  // A key imported through another peer is not this peer's to use.
  auto other = t.a->connect(t.b->address()).value();
  auto foreign = other->import_key(t.remote_mem.remote_key()).value();
  e.remote_addr = remote.base();
  e.remote = &foreign;
  auto r = peer->submit({&e, 1}, deadline_after(1s));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("not imported through this peer"), std::string::npos);
}

TEST(Engine, PerEntryStatusesReportOnlyTheFailingEntry) {
  Two t = make_two({TransportKind::kTcp});
  auto peer = t.a->connect(t.b->address()).value();
  auto good = peer->import_key(t.remote_mem.remote_key()).value();
  // Register and drop a second region: its key is revoked at the target.
  auto extra = Buffer::allocate(4096).value();
  std::string revoked_key;
  {
    auto m = t.b->register_memory(extra.region(), Access::kRemote).value();
    revoked_key = m.remote_key();
  }
  auto revoked = peer->import_key(revoked_key).value();
  std::vector<TransferEntry> es{
      {TransferOp::kRead, &t.local_mem, t.local.data(), good.base(), &good, 4096},
      {TransferOp::kRead, &t.local_mem, t.local.data() + 4096, revoked.base(), &revoked, 4096},
      {TransferOp::kRead, &t.local_mem, t.local.data() + 8192, good.base() + 8192, &good, 4096},
  };
  auto b = peer->submit(es, deadline_after(10s)).value();
  Status s = b.wait();
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  ASSERT_EQ(b.statuses().size(), 3u);
  EXPECT_TRUE(b.statuses()[0].is_ok());
  EXPECT_EQ(b.statuses()[1].code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(b.statuses()[2].is_ok());
}

TEST(Engine, RegisterRefusesEmptyRegionsAndLocalHandlesHaveNoKey) {
  auto e = Engine::create({.transports = {TransportKind::kTcp}}).value();
  EXPECT_EQ(e->register_memory({}, Access::kLocal).status().code(), StatusCode::kInvalidArgument);
  auto b = Buffer::allocate(4096).value();
  auto local = e->register_memory(b.region(), Access::kLocal).value();
  EXPECT_TRUE(local.remote_key().empty());
  EXPECT_TRUE(local.covers(b.data() + 10, 100));
  EXPECT_FALSE(local.covers(b.data() + 4000, 100));
}

// Memory used once through peers of one transport is registered with that transport only.
TEST(Engine, RegistersWithTheTransportsAskedForOnly) {
  auto e = Engine::create({.transports = {TransportKind::kTcp, TransportKind::kShm}}).value();
  auto b = Buffer::allocate(4096).value();
  const TransportKind tcp[] = {TransportKind::kTcp};
  auto only_tcp = e->register_memory(b.region(), Access::kLocal, tcp);
  ASSERT_TRUE(only_tcp.is_ok()) << only_tcp.status().to_string();
  EXPECT_EQ(only_tcp->transports(), std::vector<TransportKind>{TransportKind::kTcp});
  EXPECT_EQ(e->register_memory(b.region(), Access::kLocal, {})->transports().size(), 2u);
  const TransportKind absent[] = {TransportKind::kVerbs};
  EXPECT_EQ(e->register_memory(b.region(), Access::kLocal, absent).status().code(), StatusCode::kUnsupported);
}

TEST(Engine, TextFormRoundTrips) {
  auto e = Engine::create({.transports = {TransportKind::kTcp}}).value();
  auto back = from_text(to_text(e->address()) + "\n");
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(*back, e->address());
  EXPECT_EQ(from_text("xyz").status().code(), StatusCode::kInvalidArgument);
}

// A newer peer may publish parts of transports this build does not know: they are kept, no
// transport claims them, and the peer is reached over the ones both sides have.
TEST(Engine, PartsOfUnknownTransportsArePassedOver) {
  Two t = make_two({TransportKind::kTcp}, 4096);
  constexpr auto kFuture = static_cast<TransportKind>(200);
  auto address = blobs::decode_parts(t.b->address(), blobs::kAddressMagic, false).value();
  address.parts.insert(address.parts.begin(), {kFuture, "a transport from the future"});
  auto key = blobs::decode_parts(t.remote_mem.remote_key(), blobs::kKeyMagic, true).value();
  key.parts.insert(key.parts.begin(), {kFuture, "its key"});

  auto p = t.a->connect(blobs::encode_parts(blobs::kAddressMagic, 0, 0, address.parts, false));
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ((*p)->transport(), TransportKind::kTcp);
  auto remote =
      (*p)->import_key(blobs::encode_parts(blobs::kKeyMagic, key.base, key.length, key.parts, true));
  ASSERT_TRUE(remote.is_ok()) << remote.status().to_string();
  std::memset(t.local.data(), 0x5a, 4096);
  TransferEntry e{TransferOp::kWrite, &t.local_mem, t.local.data(), remote->base(), &*remote, 4096};
  ASSERT_TRUE((*p)->transfer({&e, 1}, deadline_after(5s)).is_ok());
  EXPECT_EQ(std::memcmp(t.local.data(), t.remote.data(), 4096), 0);

  // Only the unknown kind in common: nothing to connect over.
  blobs::Parts only_future{{kFuture, "a transport from the future"}};
  auto none = t.a->connect(blobs::encode_parts(blobs::kAddressMagic, 0, 0, only_future, false));
  EXPECT_EQ(none.status().code(), StatusCode::kUnsupported);
}

// Each transport built in looks at the host itself; a kind the build lacks says so.
TEST(Engine, ProbeReportsEveryTransport) {
  const std::vector<TransportFinding> found = probe_transports();
  auto named = [&](const std::string& check) {
    return std::find_if(found.begin(), found.end(), [&](const auto& f) { return f.check == check; });
  };
  ASSERT_NE(named("transport tcp"), found.end());
  EXPECT_EQ(named("transport tcp")->level, TransportFinding::Level::kOk);
  ASSERT_NE(named("transport shm"), found.end());
  for (TransportKind kind : kTransportKinds) {
    auto started = Engine::create({.transports = {kind}});
    const bool built =
        started.is_ok() || started.status().message().find("this build has no") == std::string::npos;
    const auto missing = named("transport " + std::string(to_string(kind)));
    if (!built) {
      ASSERT_NE(missing, found.end()) << to_string(kind);
      EXPECT_EQ(missing->level, TransportFinding::Level::kInfo);
    }
  }
  for (const auto& f : found) {
    EXPECT_FALSE(f.detail.empty()) << f.check;
    if (f.level == TransportFinding::Level::kWarn || f.level == TransportFinding::Level::kFail) {
      EXPECT_FALSE(f.fix.empty()) << f.check << " says what is wrong but not how to fix it";
    }
  }
}

}  // namespace
}  // namespace kvstash

// The optional transports' libraries (libibverbs, libucp) are opened at run time: one that is
// missing says which file, why and what to install, and yields no symbols; one that is present
// yields its functions.
TEST(RuntimeLibrary, AMissingLibrarySaysWhatToInstallAndAPresentOneResolves) {
  const kvstash::sys::RuntimeLibrary missing({"libkvstash-absent.so.7", "libkvstash-absent.so"},
                                             "install the absent package");
  EXPECT_FALSE(missing.available());
  EXPECT_NE(missing.error().find("libkvstash-absent.so.7, libkvstash-absent.so"), std::string::npos)
      << missing.error();
  EXPECT_NE(missing.error().find("install the absent package"), std::string::npos) << missing.error();
  EXPECT_EQ(missing.symbol("getpid"), nullptr);

  const kvstash::sys::RuntimeLibrary libc({"libkvstash-absent.so.7", "libc.so.6"}, "");
  ASSERT_TRUE(libc.available()) << libc.error();
  EXPECT_TRUE(libc.error().empty());
  using Getpid = int (*)();
  auto* getpid_fn = reinterpret_cast<Getpid>(libc.symbol("getpid"));
  ASSERT_NE(getpid_fn, nullptr);
  EXPECT_EQ(getpid_fn(), ::getpid());
  EXPECT_EQ(libc.symbol("kvstash_no_such_function"), nullptr);
}
