// The shm transport's initiator side against a peer that answers with anything: a fake peer
// listens where a (well-formed) shm address points, and answers the real transport's hello
// and import requests with replies from the input, each optionally carrying a descriptor (a
// valid key table, a region file, a one-byte file, a pipe). That drives the reply decoder,
// the checks on the key table, and import_key's range checks and mapping; when an import
// succeeds, a write and a read through it must land in the mapping (a mapping past the end
// of the peer's file would turn them into SIGBUS) and give the bytes back.
//
// Input: [key u8][base u64][length u64] then replies, each [tag u8][length u16 LE][bytes]:
//   key     bits 0-2: the slot (2 + n) of the packed key imported; bit 3: leased
//   tag     bits 0-2: the descriptor sent along: none, key table, region, one-byte file,
//           a pipe; bit 3: answers the import (else the hello)
// A reply batch is sent when the request it answers arrives; the fake peer hangs up when the
// batch holds no reply the client would take (a mirror of its checks), so nothing waits.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

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

// The request and reply types of shm_transport.cc (private there) this fake peer tells apart.
constexpr std::uint8_t kImport = 2, kRefused = 3;  // and kHello = 1
constexpr std::uint8_t kLastCode = static_cast<std::uint8_t>(StatusCode::kInternal);
constexpr std::size_t kRegionFile = 64 << 10;

struct Reply {
  std::string bytes;
  int fd_kind = 0;
};

struct World {
  std::unique_ptr<transport::Transport> client;
  int listener = -1;
  std::string address;
  int key_table = -1, region = -1, tiny = -1, pipe_r = -1, pipe_w = -1;
  int baseline_fds = 0;
};

int memfd(const char* name, std::size_t size) {
  int fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  FUZZ_CHECK(fd >= 0 && ::ftruncate(fd, static_cast<off_t>(size)) == 0, "memfd: %s", std::strerror(errno));
  return fd;
}

World& world() {
  static World* w = [] {
    fuzz::quiet_logs();
    auto* w = new World;
    const auto dir = fuzz::scratch_dir("shmc");
    w->client =
        fuzz::must(transport::make_shm_transport({.socket_dir = (dir / "client").string()}), "shm client");
    const std::string path = (dir / "fake.sock").string();
    ::unlink(path.c_str());
    w->listener = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, path.data(), path.size());
    FUZZ_CHECK(::bind(w->listener, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0 &&
                   ::listen(w->listener, 16) == 0,
               "fake peer: %s", std::strerror(errno));
    w->address = shm::encode_address({sys::boot_id(), static_cast<std::uint32_t>(::geteuid()), path});
    // A key table as a real peer's: the magic, no fence, key 1 in every slot.
    w->key_table = memfd("fuzz-key-table", shm::kKeySlots * sizeof(std::uint64_t));
    std::vector<std::uint64_t> slots(shm::kKeySlots, 1);
    slots[0] = shm::kKeyTableMagic;
    slots[shm::kFenceSlot] = 0;
    FUZZ_CHECK(
        ::pwrite(w->key_table, slots.data(), slots.size() * 8, 0) == static_cast<ssize_t>(slots.size() * 8),
        "key table");
    // Sealed like a real peer's, so that a client mapping it as a region cannot write it.
    FUZZ_CHECK(::fcntl(w->key_table, F_ADD_SEALS,
                       F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) == 0,
               "seal: %s", std::strerror(errno));
    w->region = memfd("fuzz-region", kRegionFile);
    w->tiny = memfd("fuzz-tiny", 1);
    int p[2];
    FUZZ_CHECK(::pipe2(p, O_CLOEXEC) == 0, "pipe");
    w->pipe_r = p[0];
    w->pipe_w = p[1];
    w->baseline_fds = fuzz::open_fds();
    return w;
  }();
  return *w;
}

int fd_of(const World& w, int kind) {
  switch (kind) {
    case 1: return w.key_table;
    case 2: return w.region;
    case 3: return w.tiny;
    case 4: return w.pipe_r;
    default: return -1;
  }
}

// Whether the client takes `m` as the reply to request (id, type): shm_transport.cc's
// decode_reply and exchange(), mirrored.
bool takes(std::string_view m, std::uint64_t id, std::uint8_t type) {
  wire::Reader r(m);
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  const std::uint8_t t = r.u8();
  const std::uint64_t reply_id = r.u64();
  const std::uint8_t code = r.u8();
  r.bytes();
  r.u64();
  r.u64();
  r.u64();
  if (!r.at_end() || magic != shm::kMessageMagic || version != shm::kVersion || code > kLastCode)
    return false;
  return t == kRefused || (reply_id == id && t == type);
}

void send_reply(int fd, const Reply& reply, const World& w) {
  // Without waiting (a deadline already passed): a client that stopped reading loses it.
  (void)shm::send_message(fd, reply.bytes, fd_of(w, reply.fd_kind), Clock::now());
}

// The fake peer: one connection, one batch of replies per request, hung up as soon as the
// client would wait for a reply the input does not hold. Replies it has not read yet stay
// queued for its next request, as on a real socket: `queued` follows what it reads.
void serve(const World& w, const std::vector<Reply>* batches) {
  const auto deadline = fuzz::Clock::now() + std::chrono::seconds(3);
  const int c = fuzz::accept_until(w.listener, deadline);
  if (c < 0) return;
  std::deque<const Reply*> queued;
  for (int request = 0; request < 2; ++request) {
    char buf[2048];
    const ssize_t n = fuzz::recv_some(c, buf, sizeof buf, deadline);
    if (n <= 0) break;
    wire::Reader r(std::string_view(buf, static_cast<std::size_t>(n)));
    r.u32();
    r.u16();
    const std::uint8_t type = r.u8();
    const std::uint64_t id = r.u64();
    for (const Reply& reply : batches[type == kImport ? 1 : 0]) {
      send_reply(c, reply, w);
      queued.push_back(&reply);
    }
    // The client reads replies until it takes one (exchange() in shm_transport.cc).
    bool taken = false;
    while (!taken && !queued.empty()) {
      taken = takes(queued.front()->bytes, id, type);
      queued.pop_front();
    }
    if (!taken) {  // the client would wait: hang up, so it fails at once
      ::close(c);
      return;
    }
  }
  // Until the client is done with the connection (it polls for a hang-up before each copy).
  (void)fuzz::drain(c, deadline);
  ::close(c);
}

std::uint64_t u64_at(std::string_view in, std::size_t at) {
  std::uint64_t v = 0;
  if (in.size() >= at + 8) std::memcpy(&v, in.data() + at, 8);
  return v;
}

}  // namespace
}  // namespace kvstash

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  World& w = world();
  std::string_view in(reinterpret_cast<const char*>(data), size);
  if (in.size() < 17) return -1;
  const std::uint8_t key_byte = static_cast<std::uint8_t>(in[0]);
  const std::uint64_t base = u64_at(in, 1), length = u64_at(in, 9);
  in.remove_prefix(17);
  std::vector<Reply> batches[2];
  while (in.size() >= 3) {
    const std::uint8_t tag = static_cast<std::uint8_t>(in[0]);
    const std::size_t len = std::min<std::size_t>(
        static_cast<std::uint8_t>(in[1]) | static_cast<std::uint8_t>(in[2]) << 8, in.size() - 3);
    batches[(tag & 8) != 0 ? 1 : 0].push_back({std::string(in.substr(3, len)), tag & 7});
    in.remove_prefix(3 + len);
  }
  const shm::PackedKey packed{static_cast<std::uint32_t>(shm::kFirstKeySlot + (key_byte & 7)), 1,
                              (key_byte & 8) != 0};

  std::thread peer(serve, std::cref(w), batches);
  {
    auto ep = w.client->connect(w.address, deadline_after(std::chrono::seconds(2)));
    if (ep.is_ok()) {
      auto key =
          (*ep)->import_key(base, length, shm::encode_key(packed), deadline_after(std::chrono::seconds(2)));
      if (key.is_ok()) {
        FUZZ_CHECK((*key)->base == base && (*key)->length == length, "import_key granted another range");
        // The leased flag makes copies need a lease; take one over the first bytes.
        std::unique_ptr<transport::RemoteKey> use = std::move(key).value();
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(length, 4096));
        if (packed.leased) {
          const RemoteRange range{base, n};
          transport::LeaseTerms terms;
          terms.id = 7;
          terms.op = TransferOp::kWrite;
          terms.ttl = std::chrono::seconds(10);
          use =
              fuzz::must((*ep)->lease_key(*use, {&range, 1}, terms, deadline_after(std::chrono::seconds(1))),
                         "lease_key");
        }
        static std::vector<std::byte> scratch(2 * 4096);
        const std::string pattern(n, 'p');
        const std::string why = fuzz::write_read(**ep, *use, base, pattern, scratch.data(), nullptr);
        FUZZ_CHECK(why.empty(), "a copy through an imported key: %s", why.c_str());
      }
    }
  }
  peer.join();
  FUZZ_CHECK(fuzz::open_fds() < w.baseline_fds + 16, "open descriptors pile up: %d, %d at start",
             fuzz::open_fds(), w.baseline_fds);
  return 0;
}
