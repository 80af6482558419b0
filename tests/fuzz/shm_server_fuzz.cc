// The shm transport's server thread as a local peer sees it: a real shm Transport serves a
// kRemote and a kLeased region; each input is a series of SOCK_SEQPACKET messages one client
// connection sends it (hello and import requests, malformed ones, ones carrying descriptors
// it never asked for). After every message the server must answer or hang up within 5 s;
// after each input, descriptors must not pile up (a received descriptor it failed to close
// is a leak no sanitizer sees), and a fresh real initiator must still connect, import both
// regions and write and read them.
//
// Input: messages, each [flags u8][length u16 LE][bytes]:
//   flags bit 0  attach a descriptor (/dev/null) to the message
//   flags bit 1  an import request whose key field is 0 or 1 gets the slot and key of the
//                remote or the leased region (the real keys are random)
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "common/system.h"
#include "common/wire.h"
#include "fuzz_util.h"
#include "health.h"
#include "kvstash/engine.h"
#include "kvstash/memory.h"
#include "transport/shm/shm_internal.h"
#include "transport/shm/shm_transport.h"

namespace kvstash {
namespace {

namespace shm = transport::shm;

constexpr std::size_t kRegion = 16 << 10;
// Where an import request's slot and key sit: magic u32, version u16, type u8, id u64.
constexpr std::size_t kSlotAt = 4 + 2 + 1 + 8;

struct World {
  std::unique_ptr<transport::Transport> server;
  std::string socket_path;
  Buffer regions[2];
  std::unique_ptr<transport::LocalRegistration> regs[2];
  shm::PackedKey keys[2];
  std::unique_ptr<transport::Transport> initiator;
  Buffer scratch;
  std::unique_ptr<transport::LocalRegistration> scratch_reg;
  int devnull = -1;
  int baseline_fds = 0;
};

World& world() {
  static World* w = [] {
    fuzz::quiet_logs();
    auto* w = new World;
    const auto dir = fuzz::scratch_dir("shm");
    w->server =
        fuzz::must(transport::make_shm_transport({.socket_dir = (dir / "server").string()}), "shm server");
    w->socket_path = fuzz::must(shm::decode_address(w->server->local_address()), "own address").socket_path;
    for (int i = 0; i < 2; ++i) {
      w->regions[i] = fuzz::must(Buffer::allocate(kRegion), "region");
      w->regs[i] = fuzz::must(
          w->server->register_memory(w->regions[i].region(), i == 0 ? Access::kRemote : Access::kLeased),
          "register");
      w->keys[i] = fuzz::must(shm::decode_key(w->regs[i]->packed_key()), "own key");
    }
    w->initiator = fuzz::must(transport::make_shm_transport({.socket_dir = (dir / "initiator").string()}),
                              "shm initiator");
    w->scratch = fuzz::must(Buffer::allocate(2 * kRegion), "scratch");
    w->scratch_reg =
        fuzz::must(w->initiator->register_memory(w->scratch.region(), Access::kLocal), "scratch reg");
    w->devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    w->baseline_fds = fuzz::open_fds();
    return w;
  }();
  return *w;
}

int connect_server(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  FUZZ_CHECK(fd >= 0, "socket: %s", std::strerror(errno));
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.data(), path.size());
  FUZZ_CHECK(::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0, "connect %s: %s",
             path.c_str(), std::strerror(errno));
  return fd;
}

// Waits for the server's answer to one message: a reply (its descriptors closed) or the
// connection's end. False when it hung up.
bool answered(int fd) {
  FUZZ_CHECK(fuzz::wait_for(fd, POLLIN, fuzz::Clock::now() + std::chrono::seconds(5)),
             "the shm server neither answered nor hung up within 5 s");
  char buf[2048];
  iovec iov{buf, sizeof buf};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n >= 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    for (std::size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
      ::close(got);
    }
  }
  return n > 0;
}

void check_healthy(World& w) {
  const Deadline deadline = deadline_after(std::chrono::seconds(5));
  auto ep = w.initiator->connect(w.server->local_address(), deadline);
  FUZZ_CHECK(ep.is_ok(), "a fresh initiator cannot connect: %s", ep.status().to_string().c_str());
  const std::string pattern(1024, static_cast<char>(sys::random_u64() | 1));
  for (int i = 0; i < 2; ++i) {
    const auto base = reinterpret_cast<std::uintptr_t>(w.regions[i].data());
    auto key = (*ep)->import_key(base, kRegion, w.regs[i]->packed_key(), deadline);
    FUZZ_CHECK(key.is_ok(), "import_key: %s", key.status().to_string().c_str());
    std::unique_ptr<transport::RemoteKey> use = std::move(key).value();
    if (i == 1) {
      const RemoteRange range{base, kRegion};
      transport::LeaseTerms terms;
      terms.id = sys::random_u64() | 1;
      terms.op = TransferOp::kWrite;
      terms.ttl = std::chrono::seconds(10);
      auto lease = (*ep)->lease_key(*use, {&range, 1}, terms, deadline);
      FUZZ_CHECK(lease.is_ok(), "lease_key: %s", lease.status().to_string().c_str());
      use = std::move(lease).value();
    }
    const std::string why =
        fuzz::write_read(**ep, *use, base + 512, pattern, w.scratch.data(), w.scratch_reg.get());
    FUZZ_CHECK(why.empty(), "region %d after the input: %s", i, why.c_str());
  }
}

}  // namespace
}  // namespace kvstash

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  World& w = world();
  std::string_view in(reinterpret_cast<const char*>(data), size);
  const int fd = connect_server(w.socket_path);
  while (in.size() >= 3) {
    const std::uint8_t flags = static_cast<std::uint8_t>(in[0]);
    const std::size_t len = std::min<std::size_t>(
        static_cast<std::uint8_t>(in[1]) | static_cast<std::uint8_t>(in[2]) << 8, in.size() - 3);
    std::string msg(in.substr(3, len));
    in.remove_prefix(3 + len);
    if ((flags & 2) != 0 && msg.size() >= kSlotAt + 12) {
      std::uint64_t which;
      std::memcpy(&which, msg.data() + kSlotAt + 4, sizeof which);
      if (which < 2) {
        std::memcpy(msg.data() + kSlotAt, &w.keys[which].slot, 4);
        std::memcpy(msg.data() + kSlotAt + 4, &w.keys[which].key, 8);
      }
    }
    if (!shm::send_message(fd, msg, (flags & 1) != 0 ? w.devnull : -1,
                           deadline_after(std::chrono::seconds(5)))
             .is_ok()) {
      break;
    }
    if (!answered(fd)) break;
  }
  ::close(fd);
  check_healthy(w);
  FUZZ_CHECK(fuzz::open_fds() < w.baseline_fds + 64, "open descriptors pile up: %d, %d at start",
             fuzz::open_fds(), w.baseline_fds);
  return 0;
}
