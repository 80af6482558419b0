// Tests of the shm transport. Most run two Transport instances in this process, one as the
// target and one as the initiator: shm works between any two endpoints of one host and
// user, so that is the real thing, not a fake. Peer death and foreign users need real
// processes and use fork().
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/system.h"
#include "kvstash/memory.h"
#include "recording_sink.h"
#include "transport/shm/shm_internal.h"
#include "transport/shm/shm_server.h"
#include "transport/shm/shm_wire.h"
#include "transport/shm/shm_transport.h"

namespace kvstash::transport {
namespace {

using namespace std::chrono_literals;

using TestSink = test::RecordingSink;

// Blocks inside complete() until released: pins a copy thread so that later ops stay queued.
class BlockingSink final : public CompletionSink {
 public:
  void complete(std::uint32_t, Status status) override {
    std::unique_lock lock(mu_);
    last_ = std::move(status);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
  }
  void wait_entered() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void release() {
    std::lock_guard lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  Status last() {
    std::lock_guard lock(mu_);
    return last_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool released_ = false;
  Status last_;
};

void fill_random(std::span<std::byte> bytes, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, 8);
  }
  for (; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(rng());
}

std::uint64_t addr_of(const void* p) { return reinterpret_cast<std::uint64_t>(p); }

Deadline soon() { return deadline_after(10s); }

class ShmTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvstash-shm-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // inline_bytes 0: every op goes through the copy threads, which most tests are about.
  ShmOptions options(std::uint32_t threads = 2, std::size_t inline_bytes = 0) const {
    ShmOptions o;
    o.socket_dir = dir_;
    o.copy_threads = threads;
    o.inline_bytes = inline_bytes;
    return o;
  }
  std::unique_ptr<Transport> make(std::uint32_t threads = 2, std::size_t inline_bytes = 0) {
    auto t = make_shm_transport(options(threads, inline_bytes));
    EXPECT_TRUE(t.is_ok()) << t.status().to_string();
    return t.is_ok() ? std::move(t).value() : nullptr;
  }
  std::shared_ptr<Endpoint> connect(Transport& from, const Transport& to) {
    auto ep = from.connect(to.local_address(), soon());
    EXPECT_TRUE(ep.is_ok()) << ep.status().to_string();
    return ep.is_ok() ? std::move(ep).value() : nullptr;
  }
  std::unique_ptr<RemoteKey> import(Endpoint& ep, const Buffer& b, const LocalRegistration& reg) {
    auto k = ep.import_key(addr_of(b.data()), b.size(), reg.packed_key(), soon());
    EXPECT_TRUE(k.is_ok()) << k.status().to_string();
    return k.is_ok() ? std::move(k).value() : nullptr;
  }
  static Buffer alloc(std::size_t n) {
    auto b = Buffer::allocate(n);
    EXPECT_TRUE(b.is_ok()) << b.status().to_string();
    return std::move(b).value();
  }
  // Posts one op and waits for its completion status.
  static Status run_op(Endpoint& ep, TransferOp kind, std::byte* local, const RemoteKey& key,
                       std::uint64_t remote, std::size_t len, std::uint32_t lane = 0) {
    TestSink sink;
    Op op{kind, local, nullptr, remote, &key, len, lane, &sink, 7};
    ep.post({&op, 1});
    if (!sink.wait(1)) return Status::internal("no completion");
    EXPECT_EQ(sink.duplicates(), 0);
    return sink.status(7);
  }

  std::string dir_;
};

// ---- addresses -------------------------------------------------------------------------------

TEST_F(ShmTransportTest, AddressIsReachableOnlyForSameBootAndUser) {
  auto t = make();
  ASSERT_TRUE(t);
  EXPECT_EQ(t->kind(), TransportKind::kShm);
  const Capabilities caps = t->capabilities();
  EXPECT_TRUE(caps.same_host_only);
  EXPECT_TRUE(caps.one_sided);
  EXPECT_EQ(caps.lanes, 2u);
  EXPECT_EQ(caps.slice_bytes, ShmOptions{}.slice_bytes);

  const std::string addr = t->local_address();
  EXPECT_TRUE(t->can_reach(addr));
  auto decoded = shm::decode_address(addr);
  ASSERT_TRUE(decoded.is_ok());
  EXPECT_EQ(decoded->boot_id, sys::boot_id());
  EXPECT_EQ(decoded->uid, ::geteuid());
  EXPECT_EQ(decoded->socket_path.rfind(dir_ + "/", 0), 0u);

  shm::Address other_user = *decoded;
  other_user.uid += 1;
  EXPECT_FALSE(t->can_reach(shm::encode_address(other_user)));
  shm::Address other_boot = *decoded;
  other_boot.boot_id = "00000000-0000-0000-0000-000000000000";
  EXPECT_FALSE(t->can_reach(shm::encode_address(other_boot)));
  auto other_boot_ep = t->connect(shm::encode_address(other_boot), soon());
  EXPECT_EQ(other_boot_ep.status().code(), StatusCode::kUnavailable);
}

TEST_F(ShmTransportTest, MalformedAddressIsInvalidArgument) {
  auto t = make();
  ASSERT_TRUE(t);
  const std::string good = t->local_address();
  std::vector<std::string> bad = {"",
                                  "x",
                                  "garbage that is not an address",
                                  good.substr(0, good.size() - 1),
                                  good + "!",
                                  std::string(64, '\xff')};
  std::string flipped_magic = good;
  flipped_magic[0] ^= 0x01;
  bad.push_back(flipped_magic);
  std::string huge_length = good;
  huge_length[6] = '\xff';  // the boot id's length field
  bad.push_back(huge_length);
  for (const std::string& a : bad) {
    EXPECT_FALSE(t->can_reach(a));
    auto ep = t->connect(a, soon());
    EXPECT_EQ(ep.status().code(), StatusCode::kInvalidArgument) << ep.status().to_string();
  }
}

TEST_F(ShmTransportTest, ConnectToVanishedPeerIsUnavailable) {
  auto initiator = make();
  std::string addr;
  {
    auto target = make();
    addr = target->local_address();
  }
  auto ep = initiator->connect(addr, soon());
  EXPECT_EQ(ep.status().code(), StatusCode::kUnavailable) << ep.status().to_string();
}

TEST_F(ShmTransportTest, SilentPeerTimesOutInsteadOfHanging) {
  // A socket that accepts connections (through its backlog) but never answers.
  const std::string path = dir_ + "/silent.sock";
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.data(), path.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(fd, 8), 0);
  auto t = make();
  ASSERT_TRUE(t);
  const std::string addr =
      shm::encode_address({sys::boot_id(), static_cast<std::uint32_t>(::geteuid()), path});
  EXPECT_TRUE(t->can_reach(addr));
  auto ep = t->connect(addr, deadline_after(200ms));
  EXPECT_EQ(ep.status().code(), StatusCode::kTimeout) << ep.status().to_string();
  ::close(fd);
}

TEST_F(ShmTransportTest, NoDescriptorOrSocketFileOutlivesTheTransports) {
  auto count_fds = [] {
    std::size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      (void)e;
      ++n;
    }
    return n;
  };
  const std::size_t before = count_fds();
  {
    Buffer remote = alloc(1 << 16);
    Buffer local = alloc(1 << 16);
    auto target = make();
    auto initiator = make();
    auto ep = connect(*initiator, *target);
    ASSERT_TRUE(ep);
    auto reg = target->register_memory(remote.region(), Access::kRemote);
    ASSERT_TRUE(reg.is_ok());
    auto key = import(*ep, remote, **reg);
    ASSERT_TRUE(key);
    ASSERT_TRUE(run_op(*ep, TransferOp::kWrite, local.data(), *key, key->base, 1 << 16).is_ok());
    EXPECT_GT(count_fds(), before);
  }
  EXPECT_EQ(count_fds(), before);
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
}

// ---- connection limits -------------------------------------------------------------------------

// A socket created (and so holding a descriptor) but not yet connected: connect() then needs
// no descriptor, so it works where the target can no longer accept.
int unix_socket() { return ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0); }

bool unix_connect(int fd, const std::string& path) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.data(), std::min(path.size(), sizeof sa.sun_path - 1));
  return ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0;
}

// Whether the peer closed `fd` within `limit`.
bool closed_within(int fd, std::chrono::milliseconds limit) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(limit.count())) <= 0) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT) <= 0;
}

// Out of file descriptors, accept() fails at once for as long as a connection waits: the
// server must pause, not spin a core (it took 70% of one, 19k failed accepts in 2 s).
TEST_F(ShmTransportTest, AcceptPausesWhenOutOfDescriptors) {
  auto target = make();
  ASSERT_TRUE(target);
  const std::string path = shm::decode_address(target->local_address()).value().socket_path;
  std::vector<int> fds;
  for (int i = 0; i < 4; ++i) fds.push_back(unix_socket());
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  int highest = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1) highest = fd;
  }
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(highest + 1);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  for (int fd : fds) EXPECT_TRUE(unix_connect(fd, path));  // queued: the target cannot accept them
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(1s);
  ::getrusage(RUSAGE_SELF, &after);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  auto cpu = [](const rusage& u) {
    return std::chrono::seconds(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           std::chrono::microseconds(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  EXPECT_LT(cpu(after) - cpu(before), 300ms) << "the shm server spun while out of descriptors";
  std::uint64_t failures = 0;
  for (const auto& c : target->counters()) {
    if (c.name == "accept_failures") failures = c.value;
  }
  EXPECT_GE(failures, 1u);
  EXPECT_LE(failures, 30u) << "about one failed accept per pause (100 ms), not a spin";
  for (int fd : fds) ::close(fd);
}

// Connections that never say hello have their own small budget and a deadline: a flood of
// them cannot keep out a peer that says hello at once.
TEST_F(ShmTransportTest, SilentConnectionsCannotKeepOutOtherPeers) {
  auto target = make();
  auto initiator = make();
  ASSERT_TRUE(target && initiator);
  const std::string path = shm::decode_address(target->local_address()).value().socket_path;
  std::vector<int> silent;
  for (std::size_t i = 0; i < 2 * shm::Server::kMaxUnproven; ++i) {
    silent.push_back(unix_socket());
    ASSERT_TRUE(unix_connect(silent.back(), path));
  }
  EXPECT_TRUE(closed_within(silent.front(), 2s)) << "the oldest silent connection must make room";
  Buffer remote = alloc(1 << 16);
  Buffer local = alloc(1 << 16);
  auto ep = connect(*initiator, *target);
  ASSERT_TRUE(ep);
  auto reg = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg.is_ok());
  auto key = import(*ep, remote, **reg);
  ASSERT_TRUE(key);
  EXPECT_TRUE(run_op(*ep, TransferOp::kWrite, local.data(), *key, key->base, 1 << 16).is_ok());
  // The newest silent ones are dropped at their hello deadline.
  EXPECT_TRUE(closed_within(silent.back(), shm::Server::kHelloTimeout + 2s));
  for (int fd : silent) ::close(fd);
}

// ---- registration ----------------------------------------------------------------------------

TEST_F(ShmTransportTest, RegionWithoutFdIsLocalOnly) {
  auto t = make();
  auto plain = Buffer::allocate(8192, {.shareable = false});
  ASSERT_TRUE(plain.is_ok());
  ASSERT_LT(plain->fd(), 0);
  auto remote = t->register_memory(plain->region(), Access::kRemote);
  EXPECT_EQ(remote.status().code(), StatusCode::kUnsupported);
  auto local = t->register_memory(plain->region(), Access::kLocal);
  ASSERT_TRUE(local.is_ok()) << local.status().to_string();
  EXPECT_TRUE((*local)->packed_key().empty());

  EXPECT_EQ(t->register_memory(MemoryRegion{}, Access::kLocal).status().code(), StatusCode::kInvalidArgument);
  Buffer shared = alloc(4096);
  MemoryRegion cuda = shared.region();
  cuda.kind = MemoryKind::kCuda;
  EXPECT_EQ(t->register_memory(cuda, Access::kRemote).status().code(), StatusCode::kUnsupported);
  MemoryRegion past_end = shared.region();
  past_end.fd_offset = 1 << 20;
  EXPECT_EQ(t->register_memory(past_end, Access::kRemote).status().code(), StatusCode::kInvalidArgument);
}

// ---- data movement ---------------------------------------------------------------------------

TEST_F(ShmTransportTest, WriteThenReadIsBitExactAtManySizes) {
  // Through the copy threads, then with ops up to 2 MiB copied by the posting thread.
  for (std::size_t inline_bytes : {std::size_t{0}, std::size_t{2} << 20}) {
    SCOPED_TRACE("inline_bytes " + std::to_string(inline_bytes));
    auto target = make();
    auto initiator = make(2, inline_bytes);
    auto ep = connect(*initiator, *target);
    ASSERT_TRUE(ep);
    for (std::size_t size :
         {std::size_t{1}, std::size_t{4096 + 3}, std::size_t{1} << 20, std::size_t{64} << 20}) {
      SCOPED_TRACE("size " + std::to_string(size));
      constexpr std::size_t kRemoteOff = 13, kSrcOff = 3, kDstOff = 5;
      Buffer remote = alloc(size + 64);
      Buffer src = alloc(size + 64);
      Buffer dst = alloc(size + 64);
      fill_random(src.bytes(), size);
      auto remote_reg = target->register_memory(remote.region(), Access::kRemote);
      ASSERT_TRUE(remote_reg.is_ok()) << remote_reg.status().to_string();
      auto src_reg = initiator->register_memory(src.region(), Access::kLocal);
      ASSERT_TRUE(src_reg.is_ok());
      auto key = import(*ep, remote, **remote_reg);
      ASSERT_TRUE(key);
      EXPECT_EQ(key->base, addr_of(remote.data()));
      EXPECT_EQ(key->length, remote.size());

      const std::uint64_t raddr = addr_of(remote.data()) + kRemoteOff;
      ASSERT_TRUE(run_op(*ep, TransferOp::kWrite, src.data() + kSrcOff, *key, raddr, size).is_ok());
      EXPECT_EQ(std::memcmp(remote.data() + kRemoteOff, src.data() + kSrcOff, size), 0);
      // Bytes around the target range are untouched.
      for (std::size_t i = 0; i < kRemoteOff; ++i) ASSERT_EQ(remote.data()[i], std::byte{0});
      for (std::size_t i = kRemoteOff + size; i < remote.size(); ++i) {
        ASSERT_EQ(remote.data()[i], std::byte{0});
      }

      ASSERT_TRUE(run_op(*ep, TransferOp::kRead, dst.data() + kDstOff, *key, raddr, size, 1).is_ok());
      EXPECT_EQ(std::memcmp(dst.data() + kDstOff, src.data() + kSrcOff, size), 0);
    }
  }
}

TEST_F(ShmTransportTest, ManyConcurrentOpsFromSeveralThreads) {
  auto target = make(3);
  auto initiator = make(3);
  auto ep = connect(*initiator, *target);
  ASSERT_TRUE(ep);
  constexpr int kThreads = 4;
  constexpr int kOpsPerThread = 256;
  constexpr std::size_t kChunk = 4096 + 17;  // unaligned on purpose
  constexpr std::size_t kTotal = kThreads * kOpsPerThread * kChunk;
  Buffer remote = alloc(kTotal);
  Buffer src = alloc(kTotal);
  Buffer dst = alloc(kTotal);
  fill_random(src.bytes(), 42);
  auto reg = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg.is_ok());
  auto key = import(*ep, remote, **reg);
  ASSERT_TRUE(key);
  const std::uint32_t lanes = initiator->capabilities().lanes;

  auto phase = [&](TransferOp kind, Buffer& local) {
    std::vector<std::thread> threads;
    std::atomic<int> bad{0};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        TestSink sink;
        std::vector<Op> batch;
        for (int i = 0; i < kOpsPerThread; ++i) {
          const std::size_t off = (static_cast<std::size_t>(t) * kOpsPerThread + i) * kChunk;
          batch.push_back(Op{kind, local.data() + off, nullptr, addr_of(remote.data()) + off, key.get(),
                             kChunk, static_cast<std::uint32_t>(i) % lanes, &sink,
                             static_cast<std::uint32_t>(i)});
          if (batch.size() == 16) {  // batches of 16, to exercise batched posting
            ep->post(batch);
            batch.clear();
          }
        }
        ep->post(batch);
        if (!sink.wait(kOpsPerThread)) ++bad;
        for (int i = 0; i < kOpsPerThread; ++i) {
          if (!sink.status(static_cast<std::uint32_t>(i)).is_ok()) ++bad;
        }
        if (sink.count() != kOpsPerThread || sink.duplicates() != 0) ++bad;
      });
    }
    for (auto& th : threads) th.join();
    return bad.load();
  };
  EXPECT_EQ(phase(TransferOp::kWrite, src), 0);
  EXPECT_EQ(std::memcmp(remote.data(), src.data(), kTotal), 0);
  EXPECT_EQ(phase(TransferOp::kRead, dst), 0);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), kTotal), 0);
}

TEST_F(ShmTransportTest, InvalidOpsCompleteWithInvalidArgument) {
  auto target = make();
  auto initiator = make();
  auto ep = connect(*initiator, *target);
  auto ep2 = connect(*initiator, *target);
  ASSERT_TRUE(ep && ep2);
  Buffer remote = alloc(8192);
  Buffer local = alloc(8192);
  auto reg = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg.is_ok());
  auto key = import(*ep, remote, **reg);
  ASSERT_TRUE(key);
  const std::uint64_t base = addr_of(remote.data());

  EXPECT_EQ(run_op(*ep, TransferOp::kWrite, local.data(), *key, base + 8000, 500).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(run_op(*ep, TransferOp::kRead, local.data(), *key, base - 1, 10).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(run_op(*ep, TransferOp::kRead, local.data(), *key, base, 10, 99).code(),
            StatusCode::kInvalidArgument);
  // A key imported through one endpoint is not valid on another.
  EXPECT_EQ(run_op(*ep2, TransferOp::kRead, local.data(), *key, base, 10).code(),
            StatusCode::kInvalidArgument);
  // The exact end of the region is fine; an empty op completes OK without touching memory.
  EXPECT_TRUE(run_op(*ep, TransferOp::kRead, local.data(), *key, base + 8092, 100).is_ok());
  EXPECT_TRUE(run_op(*ep, TransferOp::kRead, nullptr, *key, base, 0).is_ok());
}

// ---- keys ------------------------------------------------------------------------------------

TEST_F(ShmTransportTest, WrongKeyIsPermissionDenied) {
  auto target = make();
  auto initiator = make();
  auto ep = connect(*initiator, *target);
  ASSERT_TRUE(ep);
  Buffer remote = alloc(1 << 16);
  auto reg = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg.is_ok());
  const std::string packed = (*reg)->packed_key();
  ASSERT_FALSE(packed.empty());
  auto decoded = shm::decode_key(packed);
  ASSERT_TRUE(decoded.is_ok());

  for (int bit : {0, 1, 17, 40, 63}) {
    shm::PackedKey k = *decoded;
    k.key ^= std::uint64_t{1} << bit;
    auto r = ep->import_key(addr_of(remote.data()), remote.size(), shm::encode_key(k), soon());
    EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status().to_string();
  }
  shm::PackedKey other_slot = *decoded;
  other_slot.slot = other_slot.slot == shm::kFirstKeySlot ? shm::kFirstKeySlot + 1 : shm::kFirstKeySlot;
  auto r = ep->import_key(addr_of(remote.data()), remote.size(), shm::encode_key(other_slot), soon());
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
  // The right key, but a range beyond what it grants.
  r = ep->import_key(addr_of(remote.data()), remote.size() + 1, packed, soon());
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
  r = ep->import_key(addr_of(remote.data()) - 4096, 4096, packed, soon());
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
  // A sub-range is granted; the connection survived every refusal.
  r = ep->import_key(addr_of(remote.data()) + 4096, 4096, packed, soon());
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE(ep->healthy());
}

TEST_F(ShmTransportTest, MalformedKeyIsInvalidArgument) {
  auto target = make();
  auto initiator = make();
  auto ep = connect(*initiator, *target);
  ASSERT_TRUE(ep);
  Buffer remote = alloc(4096);
  auto reg = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg.is_ok());
  const std::string packed = (*reg)->packed_key();
  std::string bad_magic = packed;
  bad_magic[1] ^= 0x40;
  std::string bad_version = packed;
  bad_version[4] ^= 0x02;
  for (const std::string& k :
       {std::string(), std::string("nonsense"), packed.substr(0, 9), packed + '\0', bad_magic, bad_version}) {
    auto r = ep->import_key(addr_of(remote.data()), remote.size(), k, soon());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
  }
  auto r = ep->import_key(addr_of(remote.data()), 0, packed, soon());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ShmTransportTest, DeregisteredRegionCannotBeReached) {
  auto target = make();
  auto initiator = make();
  auto ep = connect(*initiator, *target);
  ASSERT_TRUE(ep);
  Buffer remote = alloc(4096);
  Buffer local = alloc(4096);
  fill_random(local.bytes(), 7);
  auto reg = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg.is_ok());
  const std::string packed = (*reg)->packed_key();
  auto key = import(*ep, remote, **reg);
  ASSERT_TRUE(key);
  const std::uint64_t base = addr_of(remote.data());
  ASSERT_TRUE(run_op(*ep, TransferOp::kWrite, local.data(), *key, base, 4096).is_ok());

  reg->reset();  // deregister on the target
  std::memset(remote.data(), 0, 4096);
  for (TransferOp kind : {TransferOp::kWrite, TransferOp::kRead}) {
    Status s = run_op(*ep, kind, local.data(), *key, base, 4096);
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  }
  for (std::size_t i = 0; i < 4096; ++i) ASSERT_EQ(remote.data()[i], std::byte{0});
  auto again = ep->import_key(base, 4096, packed, soon());
  EXPECT_EQ(again.status().code(), StatusCode::kPermissionDenied);

  // The slot is reused by a new registration with a fresh key: the old import stays dead.
  auto reg2 = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg2.is_ok());
  EXPECT_NE((*reg2)->packed_key(), packed);
  EXPECT_EQ(run_op(*ep, TransferOp::kWrite, local.data(), *key, base, 4096).code(),
            StatusCode::kPermissionDenied);
  auto key2 = import(*ep, remote, **reg2);
  ASSERT_TRUE(key2);
  EXPECT_TRUE(run_op(*ep, TransferOp::kWrite, local.data(), *key2, base, 4096).is_ok());
  EXPECT_EQ(std::memcmp(remote.data(), local.data(), 4096), 0);
}

// ---- abort -----------------------------------------------------------------------------------

TEST_F(ShmTransportTest, AbortCompletesQueuedOpsWithTheReason) {
  auto target = make();
  auto initiator = make(1);  // one lane: ops queue behind the pinned one
  auto ep = connect(*initiator, *target);
  ASSERT_TRUE(ep);
  Buffer remote = alloc(1 << 20);
  Buffer local = alloc(1 << 20);
  fill_random(local.bytes(), 9);
  auto reg = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg.is_ok());
  auto key = import(*ep, remote, **reg);
  ASSERT_TRUE(key);
  const std::uint64_t base = addr_of(remote.data());

  BlockingSink pin;
  Op first{TransferOp::kWrite, local.data(), nullptr, base, key.get(), 4096, 0, &pin, 0};
  ep->post({&first, 1});
  pin.wait_entered();  // the only copy thread is now inside pin.complete()

  TestSink aborted, other;
  std::vector<Op> ops;
  constexpr int kQueued = 32;
  for (int i = 0; i < kQueued; ++i) {
    const std::size_t off = 4096 + static_cast<std::size_t>(i) * 4096;
    ops.push_back(Op{TransferOp::kWrite, local.data() + off, nullptr, base + off, key.get(), 4096, 0,
                     i % 2 == 0 ? static_cast<CompletionSink*>(&aborted) : &other,
                     static_cast<std::uint32_t>(i)});
  }
  ep->post(ops);
  ep->abort(&aborted, Status::cancelled("test abort"));
  // abort returned: every op of `aborted` has completed, with the reason.
  ASSERT_EQ(aborted.count(), static_cast<std::size_t>(kQueued / 2));
  for (int i = 0; i < kQueued; i += 2) {
    Status s = aborted.status(static_cast<std::uint32_t>(i));
    EXPECT_EQ(s.code(), StatusCode::kCancelled);
    EXPECT_EQ(s.message(), "test abort");
  }
  EXPECT_EQ(other.count(), 0u);
  pin.release();
  ASSERT_TRUE(other.wait(kQueued / 2));
  EXPECT_TRUE(pin.last().is_ok());
  for (int i = 0; i < kQueued; ++i) {
    const std::size_t off = 4096 + static_cast<std::size_t>(i) * 4096;
    if (i % 2 == 1) {
      EXPECT_TRUE(other.status(static_cast<std::uint32_t>(i)).is_ok());
      EXPECT_EQ(std::memcmp(remote.data() + off, local.data() + off, 4096), 0);
    } else {
      // Aborted ops never touched memory.
      for (std::size_t j = 0; j < 4096; ++j) ASSERT_EQ(remote.data()[off + j], std::byte{0});
    }
  }
  EXPECT_EQ(aborted.duplicates(), 0);
  EXPECT_EQ(other.duplicates(), 0);
}

// ---- dead peers ------------------------------------------------------------------------------

TEST_F(ShmTransportTest, OpsFailUnavailableAfterTargetTransportCloses) {
  auto target = make();
  auto initiator = make();
  auto ep = connect(*initiator, *target);
  ASSERT_TRUE(ep);
  Buffer remote = alloc(4096);
  Buffer local = alloc(4096);
  auto reg = target->register_memory(remote.region(), Access::kRemote);
  ASSERT_TRUE(reg.is_ok());
  auto key = import(*ep, remote, **reg);
  ASSERT_TRUE(key);
  ASSERT_TRUE(run_op(*ep, TransferOp::kRead, local.data(), *key, key->base, 4096).is_ok());
  EXPECT_TRUE(ep->healthy());

  target.reset();  // closes its accepted connections: the socket hangs up
  Status s = run_op(*ep, TransferOp::kRead, local.data(), *key, key->base, 4096);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_FALSE(ep->healthy());
  auto k = ep->import_key(key->base, 4096, (*reg)->packed_key(), soon());
  EXPECT_EQ(k.status().code(), StatusCode::kUnavailable);
}

// Reads and writes exactly n bytes of a pipe; false on EOF or error.
bool read_all(int fd, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}
bool write_all(int fd, const void* p, std::size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t r = ::write(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}
bool write_string(int fd, const std::string& s) {
  const std::uint32_t n = static_cast<std::uint32_t>(s.size());
  return write_all(fd, &n, sizeof n) && write_all(fd, s.data(), s.size());
}
bool read_string(int fd, std::string* s) {
  std::uint32_t n = 0;
  if (!read_all(fd, &n, sizeof n) || n > (1u << 20)) return false;
  s->resize(n);
  return read_all(fd, s->data(), n);
}

// Kills and reaps a forked child when a test returns early, so that no process is left.
struct ChildGuard {
  pid_t pid;
  bool reaped = false;
  ~ChildGuard() {
    if (pid > 0 && !reaped) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

TEST_F(ShmTransportTest, PeerKilledBySigkillTurnsIntoUnavailable) {
  constexpr std::size_t kSize = 1 << 20;
  int to_parent[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The target process: serve one buffer full of a known pattern until killed.
    ::close(to_parent[0]);
    auto t = make_shm_transport(options());
    if (!t.is_ok()) ::_exit(2);
    auto buf = Buffer::allocate(kSize);
    if (!buf.is_ok()) ::_exit(3);
    fill_random(buf->bytes(), 1234);
    auto reg = (*t)->register_memory(buf->region(), Access::kRemote);
    if (!reg.is_ok()) ::_exit(4);
    const std::uint64_t base = addr_of(buf->data());
    if (!write_string(to_parent[1], (*t)->local_address()) ||
        !write_string(to_parent[1], (*reg)->packed_key()) || !write_all(to_parent[1], &base, sizeof base)) {
      ::_exit(5);
    }
    for (;;) ::pause();
  }
  ChildGuard guard{child};
  ::close(to_parent[1]);
  std::string address, packed;
  std::uint64_t base = 0;
  const bool got = read_string(to_parent[0], &address) && read_string(to_parent[0], &packed) &&
                   read_all(to_parent[0], &base, sizeof base);
  ::close(to_parent[0]);
  ASSERT_TRUE(got) << "the target process did not start";

  auto initiator = make();
  auto ep = initiator->connect(address, soon());
  ASSERT_TRUE(ep.is_ok()) << ep.status().to_string();
  auto key = (*ep)->import_key(base, kSize, packed, soon());
  ASSERT_TRUE(key.is_ok()) << key.status().to_string();
  Buffer local = alloc(kSize);
  Buffer expected = alloc(kSize);
  fill_random(expected.bytes(), 1234);
  ASSERT_TRUE(run_op(**ep, TransferOp::kRead, local.data(), **key, base, kSize).is_ok());
  EXPECT_EQ(std::memcmp(local.data(), expected.data(), kSize), 0);
  EXPECT_TRUE((*ep)->healthy());

  ASSERT_EQ(::kill(child, SIGKILL), 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // its sockets are closed by now
  guard.reaped = true;
  for (TransferOp kind : {TransferOp::kRead, TransferOp::kWrite}) {
    Status s = run_op(**ep, kind, local.data(), **key, base, kSize);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  }
  EXPECT_FALSE((*ep)->healthy());
}

// ---- the socket directory and other users -----------------------------------------------------

TEST_F(ShmTransportTest, SocketDirectoryIsPrivateAndSocketRemoved) {
  ASSERT_EQ(::chmod(dir_.c_str(), 0777), 0);  // too open: narrowed on start
  std::string path;
  {
    auto t = make();
    ASSERT_TRUE(t);
    struct stat st {};
    ASSERT_EQ(::stat(dir_.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u);
    path = shm::decode_address(t->local_address())->socket_path;
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  EXPECT_NE(::access(path.c_str(), F_OK), 0);  // removed on destruction

  // A directory that does not exist yet is created 0700.
  ShmOptions o = options();
  o.socket_dir = dir_ + "/fresh";
  {
    auto t = make_shm_transport(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    struct stat st {};
    ASSERT_EQ(::stat(o.socket_dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0700u);
  }
  // A symlink is refused, even to a good directory.
  o.socket_dir = dir_ + "/link";
  ASSERT_EQ(::symlink((dir_ + "/fresh").c_str(), o.socket_dir.c_str()), 0);
  EXPECT_EQ(make_shm_transport(o).status().code(), StatusCode::kPermissionDenied);
  // A directory someone else owns is refused (needs root to arrange).
  o.socket_dir = dir_ + "/foreign";
  ASSERT_EQ(::mkdir(o.socket_dir.c_str(), 0700), 0);
  if (::chown(o.socket_dir.c_str(), 65534, 65534) != 0) {
    GTEST_SKIP() << "cannot chown (not root): foreign-owner case not run";
  }
  auto foreign = make_shm_transport(o);
  EXPECT_EQ(foreign.status().code(), StatusCode::kPermissionDenied) << foreign.status().to_string();
}

TEST_F(ShmTransportTest, AnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another user";
  // Fork before any thread exists here; the child learns the address through a pipe.
  int to_child[2];
  ASSERT_EQ(::pipe(to_child), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(to_child[1]);
    std::string addr;
    if (!read_string(to_child[0], &addr)) ::_exit(9);
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    char tmpl[] = "/tmp/kvstash-shm-test-other-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) ::_exit(11);
    ShmOptions o;
    o.socket_dir = tmpl;
    auto t = make_shm_transport(o);
    if (!t.is_ok()) ::_exit(12);
    int rc = 0;
    if ((*t)->can_reach(addr)) rc |= 1;
    // The address says root: refused before any I/O.
    if ((*t)->connect(addr, soon()).status().code() != StatusCode::kPermissionDenied) rc |= 2;
    // Forge an address claiming our uid for the same socket: SO_PEERCRED still refuses.
    auto a = *shm::decode_address(addr);
    a.uid = 65534;
    auto forged = (*t)->connect(shm::encode_address(a), soon());
    if (forged.status().code() != StatusCode::kPermissionDenied) rc |= 4;
    t->reset();
    std::filesystem::remove_all(tmpl);
    ::_exit(rc);
  }
  ::close(to_child[0]);
  ChildGuard guard{child};
  auto target = make();
  ASSERT_TRUE(target);
  const std::string addr = target->local_address();
  const std::string path = shm::decode_address(addr)->socket_path;
  // Open the locks a bit so that the other user reaches the socket at all: this test is
  // about the SO_PEERCRED check behind them.
  ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  const bool sent = write_string(to_child[1], addr);
  ::close(to_child[1]);  // also unblocks the child when a check above failed
  ASSERT_TRUE(sent);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  guard.reaped = true;
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  ASSERT_EQ(::chmod(dir_.c_str(), 0700), 0);
}

}  // namespace
}  // namespace kvstash::transport
