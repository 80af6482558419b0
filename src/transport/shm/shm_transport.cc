// The shm transport's control path: the private socket directory, the key table, memory
// registration, the server thread that hands out file descriptors, connect and import_key.
// The datapath (post, abort) lives in shm_transport_datapath.cc.
//
// Trust boundary: the uid. Only processes of our (effective) uid on this boot of this kernel
// can connect, and such a process could read our memory through /proc anyway; the checks
// below keep honest peers from reaching memory by mistake (wrong, stale or revoked keys)
// and keep other users out entirely.
#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "common/log.h"
#include "common/system.h"
#include "common/wire.h"
#include "transport/shm/shm_internal.h"

namespace kvstash::transport {
namespace shm {

// ---- RAII ----------------------------------------------------------------------------------

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

void Mapping::reset() {
  if (addr_ != nullptr) ::munmap(addr_, length_);
  addr_ = nullptr;
  length_ = 0;
}

// ---- records -------------------------------------------------------------------------------

std::string encode_address(const Address& address) {
  wire::Writer w;
  w.u32(kAddressMagic);
  w.u16(kVersion);
  w.bytes(address.boot_id);
  w.u32(address.uid);
  w.bytes(address.socket_path);
  return w.take();
}

Result<Address> decode_address(std::string_view bytes) {
  wire::Reader r(bytes);
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  Address a;
  a.boot_id = std::string(r.bytes());
  a.uid = r.u32();
  a.socket_path = std::string(r.bytes());
  if (!r.at_end() || magic != kAddressMagic) {
    return Status::invalid_argument("malformed shm address");
  }
  if (version != kVersion) {
    return Status::invalid_argument("shm address version " + std::to_string(version) + " not supported");
  }
  if (a.socket_path.empty() || a.socket_path.size() >= sizeof(sockaddr_un::sun_path) ||
      a.socket_path.find('\0') != std::string::npos || a.boot_id.empty()) {
    return Status::invalid_argument("malformed shm address (socket path)");
  }
  return a;
}

std::string encode_key(const PackedKey& key) {
  wire::Writer w;
  w.u32(kKeyMagic);
  w.u16(kVersion);
  w.u32(key.slot);
  w.u64(key.key);
  w.u8(key.leased ? 1 : 0);
  return w.take();
}

Result<PackedKey> decode_key(std::string_view bytes) {
  wire::Reader r(bytes);
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  PackedKey k;
  k.slot = r.u32();
  k.key = r.u64();
  const std::uint8_t leased = r.u8();
  if (!r.at_end() || magic != kKeyMagic || version != kVersion || leased > 1) {
    return Status::invalid_argument("malformed shm remote key");
  }
  k.leased = leased == 1;
  if (k.slot < kFirstKeySlot || k.slot >= kKeySlots || k.key == 0) {
    return Status::invalid_argument("malformed shm remote key (slot or key out of range)");
  }
  return k;
}

namespace {

// ---- the request/response protocol ---------------------------------------------------------
//
// One SOCK_SEQPACKET message per request and per response, so no framing and no partial
// reads. request:  magic u32, version u16, type u8, id u64, [import: slot u32, key u64]
// response: magic u32, version u16, type u8, id u64, code u8, message bytes, a u64, b u64,
// c u64 (hello: a = slots; import: a = region address, b = length, c = fd offset), and on
// success one file descriptor (hello: the key table; import: the region's file).

enum class MsgType : std::uint8_t { kHello = 1, kImport = 2, kRefused = 3 };

constexpr std::size_t kMaxMessage = 1024;

struct Message {
  std::string bytes;
  UniqueFd fd;  // the first descriptor received; others are closed
};

struct Reply {
  MsgType type{};
  std::uint64_t id = 0;
  Status status;
  std::uint64_t a = 0, b = 0, c = 0;
  UniqueFd fd;
};

std::string encode_reply(MsgType type, std::uint64_t id, const Status& s, std::uint64_t a = 0,
                         std::uint64_t b = 0, std::uint64_t c = 0) {
  wire::Writer w;
  w.u32(kMessageMagic);
  w.u16(kVersion);
  w.u8(static_cast<std::uint8_t>(type));
  w.u64(id);
  w.u8(static_cast<std::uint8_t>(s.code()));
  w.bytes(s.message());
  w.u64(a);
  w.u64(b);
  w.u64(c);
  return w.take();
}

Result<Reply> decode_reply(Message m) {
  wire::Reader r(m.bytes);
  Reply out;
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  out.type = static_cast<MsgType>(r.u8());
  out.id = r.u64();
  const std::uint8_t code = r.u8();
  std::string message(r.bytes());
  out.a = r.u64();
  out.b = r.u64();
  out.c = r.u64();
  if (!r.at_end() || magic != kMessageMagic || version != kVersion ||
      code > static_cast<std::uint8_t>(StatusCode::kInternal)) {
    return Status::corrupt("malformed reply from shm peer");
  }
  if (code != 0) out.status = Status(static_cast<StatusCode>(code), std::move(message));
  out.fd = std::move(m.fd);
  return out;
}

int poll_timeout_ms(Deadline deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<long long>(ms, INT_MAX));
}

// Waits until `fd` reports `events` (or a hang-up, which the following call will see).
Status wait_fd(int fd, short events, Deadline deadline, std::string_view what) {
  for (;;) {
    if (Clock::now() >= deadline) return Status::timeout(std::string(what) + ": deadline passed");
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (rc > 0) return Status::ok();
    if (rc < 0 && errno != EINTR) return Status::from_errno(what, errno);
  }
}

}  // namespace

Status send_message(int sock, std::string_view bytes, int fd_to_send, Deadline deadline) {
  for (;;) {
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (fd_to_send >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd_to_send, sizeof(int));
    }
    const ssize_t n = ::sendmsg(sock, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) return Status::ok();
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      KVSTASH_RETURN_IF_ERROR(wait_fd(sock, POLLOUT, deadline, "shm send"));
      continue;
    }
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) {
      return Status::unavailable("shm peer closed the connection");
    }
    return Status::from_errno("shm sendmsg", errno);
  }
}

namespace {

// Receives one message and at most one descriptor (extra ones are closed at once, so a
// misbehaving peer cannot make us leak descriptors). With `wait` false, returns kTimeout
// when nothing is queued.
Result<Message> recv_message(int sock, Deadline deadline, bool wait = true) {
  constexpr int kMaxFds = 4;
  for (;;) {
    Message m;
    m.bytes.resize(kMaxMessage);
    iovec iov{m.bytes.data(), m.bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!wait) return Status::timeout("no message");
        KVSTASH_RETURN_IF_ERROR(wait_fd(sock, POLLIN, deadline, "shm receive"));
        continue;
      }
      if (errno == ECONNRESET) return Status::unavailable("shm peer closed the connection");
      return Status::from_errno("shm recvmsg", errno);
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (!m.fd.valid()) {
          m.fd.reset(fd);
        } else {
          ::close(fd);
        }
      }
    }
    if (n == 0) return Status::unavailable("shm peer closed the connection");
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
      return Status::corrupt("oversized message from shm peer");
    }
    m.bytes.resize(static_cast<std::size_t>(n));
    return m;
  }
}

// One request/response exchange on a connection. Responses to earlier requests that timed
// out are skipped by id; their descriptors are closed.
Result<Reply> exchange(PeerConnection& conn, MsgType type, std::uint32_t slot, std::uint64_t key,
                       Deadline deadline) {
  {
    std::unique_lock lock(conn.request_mu);
    if (!conn.request_cv.wait_until(lock, deadline, [&] { return !conn.request_busy; })) {
      return Status::timeout("shm: another request to " + conn.peer + " is still waiting");
    }
    conn.request_busy = true;
  }
  struct Release {
    PeerConnection& c;
    ~Release() {
      std::lock_guard lock(c.request_mu);
      c.request_busy = false;
      c.request_cv.notify_one();
    }
  } release{conn};
  const std::uint64_t id = conn.next_request++;
  wire::Writer w;
  w.u32(kMessageMagic);
  w.u16(kVersion);
  w.u8(static_cast<std::uint8_t>(type));
  w.u64(id);
  if (type == MsgType::kImport) {
    w.u32(slot);
    w.u64(key);
  }
  const std::string request = w.take();
  KVSTASH_RETURN_IF_ERROR(send_message(conn.socket.get(), request, -1, deadline));
  for (;;) {
    KVSTASH_ASSIGN_OR_RETURN(Message m, recv_message(conn.socket.get(), deadline));
    KVSTASH_ASSIGN_OR_RETURN(Reply reply, decode_reply(std::move(m)));
    if (reply.type == MsgType::kRefused) {
      return reply.status.is_ok() ? Status::permission_denied("shm peer refused us") : reply.status;
    }
    if (reply.id == id && reply.type == type) return reply;
  }
}

uid_t peer_uid(int sock, Status* error) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    *error = Status::from_errno("SO_PEERCRED", errno);
    return static_cast<uid_t>(-1);
  }
  return cred.uid;
}

std::size_t page_size() {
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// ---- the socket directory ------------------------------------------------------------------

std::string default_socket_dir() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/kvstash";
  return "/tmp/kvstash-" + std::to_string(::geteuid());
}

// Creates `dir` 0700, or accepts an existing one only if it is a real directory we own;
// permissions wider than 0700 on our own directory are narrowed (with a warning) rather
// than refused, since nobody else can have put anything there that we then trust.
Status prepare_socket_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Status::from_errno("shm: cannot create socket directory " + dir, errno);
  }
  UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!d.valid()) {
    if (errno == ELOOP || errno == ENOTDIR) {
      return Status::permission_denied("shm: socket directory " + dir +
                                       " is not a directory (or is a symlink)");
    }
    return Status::from_errno("shm: cannot open socket directory " + dir, errno);
  }
  struct stat st {};
  if (::fstat(d.get(), &st) != 0) return Status::from_errno("shm: stat " + dir, errno);
  if (st.st_uid != ::geteuid()) {
    return Status::permission_denied("shm: socket directory " + dir + " is owned by uid " +
                                     std::to_string(st.st_uid) + ", not by us");
  }
  if ((st.st_mode & 077) != 0) {
    KVSTASH_LOG_WARN("shm: socket directory {} had mode {:o}; narrowing it to 0700", dir, st.st_mode & 07777);
    if (::fchmod(d.get(), 0700) != 0) {
      return Status::from_errno("shm: chmod 0700 " + dir, errno);
    }
  }
  return Status::ok();
}

// ---- the key table and the registrations behind it -----------------------------------------

class Registry {
 public:
  static Result<std::shared_ptr<Registry>> create() {
    auto reg = std::make_shared<Registry>();
    reg->fd_.reset(::memfd_create("kvstash-shm-keys", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!reg->fd_.valid()) return Status::from_errno("shm: memfd_create (key table)", errno);
    const std::size_t size = kKeySlots * sizeof(std::uint64_t);
    if (::ftruncate(reg->fd_.get(), static_cast<off_t>(size)) != 0) {
      return Status::from_errno("shm: ftruncate (key table)", errno);
    }
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, reg->fd_.get(), 0);
    if (p == MAP_FAILED) return Status::from_errno("shm: mmap (key table)", errno);
    reg->table_ = Mapping(p, size);
    // Peers get the descriptor; seal it so that none can resize it (SIGBUS for everyone) or,
    // where the kernel has F_SEAL_FUTURE_WRITE, map it writable and forge keys.
    int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
#ifdef F_SEAL_FUTURE_WRITE
    if (::fcntl(reg->fd_.get(), F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE) != 0)
#endif
      if (::fcntl(reg->fd_.get(), F_ADD_SEALS, seals) != 0) {
        KVSTASH_LOG_WARN("shm: cannot seal the key table: {}", std::strerror(errno));
      }
    std::atomic_ref<std::uint64_t>(reg->slot(0)).store(kKeyTableMagic, std::memory_order_release);
    reg->entries_.resize(kKeySlots);
    reg->free_.reserve(kKeySlots - kFirstKeySlot);
    for (std::uint32_t s = kKeySlots - 1; s >= kFirstKeySlot; --s) reg->free_.push_back(s);
    return reg;
  }

  int fd() const { return fd_.get(); }

  // Raises the fence peers check before each copy under a lease (never lowers it).
  void fence(std::uint64_t through) {
    std::atomic_ref<std::uint64_t> f(slot(kFenceSlot));
    std::uint64_t cur = f.load(std::memory_order_seq_cst);
    while (cur < through && !f.compare_exchange_weak(cur, through, std::memory_order_seq_cst)) {
    }
  }

  // Publishes a region under a fresh slot and key. `fd` is duplicated: the registry's copy
  // stays valid for as long as the registration, whatever the caller does with its own.
  Result<PackedKey> add(const MemoryRegion& region, bool leased) {
    UniqueFd dup(::fcntl(region.fd, F_DUPFD_CLOEXEC, 3));
    if (!dup.valid()) return Status::from_errno("shm: dup region fd", errno);
    std::uint64_t key = 0;
    while (key == 0) key = sys::random_u64();  // 0 marks a free slot
    std::lock_guard lock(mu_);
    if (free_.empty()) {
      return Status::no_space("shm: all " + std::to_string(kKeySlots - kFirstKeySlot) +
                              " key slots are in use");
    }
    const std::uint32_t s = free_.back();
    free_.pop_back();
    Entry& e = entries_[s];
    e.key = key;
    e.fd = std::move(dup);
    e.fd_offset = region.fd_offset;
    e.addr = reinterpret_cast<std::uint64_t>(region.addr);
    e.length = region.length;
    std::atomic_ref<std::uint64_t>(slot(s)).store(key, std::memory_order_release);
    return PackedKey{s, key, leased};
  }

  // Revokes: from the release store on, copies that check the slot are refused.
  void remove(std::uint32_t s) {
    std::lock_guard lock(mu_);
    std::atomic_ref<std::uint64_t>(slot(s)).store(0, std::memory_order_release);
    entries_[s] = Entry{};
    free_.push_back(s);
  }

  // The import reply for (slot, key), sent on `sock` with the region's descriptor. The
  // descriptor is only valid under the lock, hence sending from here (never blocks).
  Status reply_import(int sock, std::uint64_t id, std::uint32_t s, std::uint64_t key) {
    std::lock_guard lock(mu_);
    if (s < kFirstKeySlot || s >= kKeySlots || entries_[s].key == 0 || entries_[s].key != key) {
      return send_message(sock,
                          encode_reply(MsgType::kImport, id, Status::permission_denied("unknown remote key")),
                          -1, Clock::now());
    }
    const Entry& e = entries_[s];
    return send_message(sock, encode_reply(MsgType::kImport, id, Status::ok(), e.addr, e.length, e.fd_offset),
                        e.fd.get(), Clock::now());
  }

 private:
  struct Entry {
    std::uint64_t key = 0;
    UniqueFd fd;
    std::uint64_t fd_offset = 0;
    std::uint64_t addr = 0;
    std::uint64_t length = 0;
  };

  std::uint64_t& slot(std::uint32_t s) { return reinterpret_cast<std::uint64_t*>(table_.data())[s]; }

  UniqueFd fd_;
  Mapping table_;
  std::mutex mu_;
  std::vector<Entry> entries_;       // guarded by mu_
  std::vector<std::uint32_t> free_;  // guarded by mu_
};

class ShmRegistration final : public LocalRegistration {
 public:
  ShmRegistration() = default;  // local use only
  ShmRegistration(std::shared_ptr<Registry> registry, PackedKey key)
      : registry_(std::move(registry)), slot_(key.slot), packed_(encode_key(key)) {}
  ~ShmRegistration() override {
    if (registry_) registry_->remove(slot_);
  }
  ShmRegistration(const ShmRegistration&) = delete;
  ShmRegistration& operator=(const ShmRegistration&) = delete;

  std::string packed_key() const override { return packed_; }

 private:
  std::shared_ptr<Registry> registry_;
  std::uint32_t slot_ = 0;
  std::string packed_;
};

// ---- the transport ---------------------------------------------------------------------------

class ShmTransport final : public Transport {
 public:
  ShmTransport(const ShmOptions& options, std::string socket_path, UniqueFd listen, UniqueFd wake,
               std::shared_ptr<Registry> registry)
      : options_(options),
        socket_path_(std::move(socket_path)),
        address_(encode_address({sys::boot_id(), static_cast<std::uint32_t>(::geteuid()), socket_path_})),
        listen_(std::move(listen)),
        wake_(std::move(wake)),
        registry_(std::move(registry)),
        datapath_(std::make_shared<Datapath>(options.copy_threads, options.inline_bytes)) {
    server_ = std::thread([this] { serve(); });
  }

  ~ShmTransport() override {
    const std::uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof one) != sizeof one) {
      KVSTASH_LOG_ERROR("shm: cannot wake the server thread: {}", std::strerror(errno));
    }
    server_.join();
    ::unlink(socket_path_.c_str());
    datapath_->stop();
  }
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  TransportKind kind() const override { return TransportKind::kShm; }

  Capabilities capabilities() const override {
    Capabilities c;
    c.same_host_only = true;
    c.one_sided = true;
    c.leases = true;
    c.lanes = datapath_->lanes();
    c.slice_bytes = options_.slice_bytes;
    return c;
  }

  std::string local_address() const override { return address_; }

  bool can_reach(std::string_view peer_address) const override {
    auto a = decode_address(peer_address);
    return a.is_ok() && a->boot_id == sys::boot_id() && a->uid == ::geteuid();
  }

  void fence(std::uint64_t through) override { registry_->fence(through); }

  Result<std::unique_ptr<LocalRegistration>> register_memory(const MemoryRegion& region,
                                                             Access access) override {
    const bool remote_access = access != Access::kLocal;
    if (region.addr == nullptr || region.length == 0) {
      return Status::invalid_argument("shm: null or empty region");
    }
    if (region.kind != MemoryKind::kHost) {
      return Status::unsupported("shm: only host memory can be copied by the CPU");
    }
    if (!remote_access) return std::unique_ptr<LocalRegistration>(new ShmRegistration());
    if (region.fd < 0) {
      return Status::unsupported(
          "shm: a region without a file descriptor cannot be shared (allocate it with "
          "Buffer::allocate, shareable)");
    }
    struct stat st {};
    if (::fstat(region.fd, &st) != 0) return Status::invalid_argument("shm: bad region fd");
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (region.fd_offset > size || region.length > size - region.fd_offset) {
      return Status::invalid_argument("shm: region runs past the end of its file");
    }
    KVSTASH_ASSIGN_OR_RETURN(PackedKey key, registry_->add(region, access == Access::kLeased));
    return std::unique_ptr<LocalRegistration>(new ShmRegistration(registry_, key));
  }

  Result<std::shared_ptr<Endpoint>> connect(std::string_view peer_address, Deadline deadline) override;

 private:
  void serve();
  // Handles one request on an accepted connection; false: close it.
  bool handle(int sock);

  const ShmOptions options_;
  const std::string socket_path_;
  const std::string address_;
  UniqueFd listen_;
  UniqueFd wake_;  // eventfd: written once by the destructor
  std::shared_ptr<Registry> registry_;
  std::shared_ptr<Datapath> datapath_;
  std::thread server_;
};

void ShmTransport::serve() {
  constexpr std::size_t kMaxConnections = 1024;
  std::vector<UniqueFd> conns;
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({listen_.get(), static_cast<short>(conns.size() < kMaxConnections ? POLLIN : 0), 0});
    for (const UniqueFd& c : conns) fds.push_back({c.get(), POLLIN | POLLRDHUP, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      KVSTASH_LOG_ERROR("shm: server poll failed: {}", std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;
    // Requests first, while fds[i] still lines up with conns[i - 2].
    std::vector<bool> drop(conns.size(), false);
    for (std::size_t i = 0; i < conns.size(); ++i) {
      const short ev = fds[i + 2].revents;
      if ((ev & POLLIN) != 0) {
        drop[i] = !handle(conns[i].get());
      } else if (ev != 0) {
        drop[i] = true;  // hang-up or error
      }
    }
    for (std::size_t i = conns.size(); i-- > 0;) {
      if (drop[i]) conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if ((fds[1].revents & POLLIN) != 0) {
      for (;;) {
        UniqueFd c(::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!c.valid()) break;  // EAGAIN, or a connection that died before we got to it
        Status error;
        const uid_t uid = peer_uid(c.get(), &error);
        if (uid != ::geteuid()) {
          KVSTASH_LOG_WARN("shm: refused a connection from uid {} on {}", uid, socket_path_);
          (void)send_message(
              c.get(),
              encode_reply(MsgType::kRefused, 0, Status::permission_denied("shm peer runs as another user")),
              -1, Clock::now());
          continue;
        }
        conns.push_back(std::move(c));
        if (conns.size() >= kMaxConnections) break;
      }
    }
  }
}

bool ShmTransport::handle(int sock) {
  auto m = recv_message(sock, Clock::now(), /*wait=*/false);
  if (!m.is_ok()) return m.status().code() == StatusCode::kTimeout;  // spurious wake-up
  // Clients never send descriptors; one that arrived anyway is closed with `m`.
  wire::Reader r(m->bytes);
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  const auto type = static_cast<MsgType>(r.u8());
  const std::uint64_t id = r.u64();
  if (!r.ok() || magic != kMessageMagic) return false;
  if (version != kVersion) {
    (void)send_message(
        sock, encode_reply(type, id, Status::unsupported("shm protocol version " + std::to_string(version))),
        -1, Clock::now());
    return false;
  }
  switch (type) {
    case MsgType::kHello:
      if (!r.at_end()) return false;
      return send_message(sock, encode_reply(type, id, Status::ok(), kKeySlots), registry_->fd(),
                          Clock::now())
          .is_ok();
    case MsgType::kImport: {
      const std::uint32_t slot = r.u32();
      const std::uint64_t key = r.u64();
      if (!r.at_end()) return false;
      return registry_->reply_import(sock, id, slot, key).is_ok();
    }
    default:
      (void)send_message(sock, encode_reply(type, id, Status::invalid_argument("unknown shm request")), -1,
                         Clock::now());
      return true;
  }
}

Result<std::shared_ptr<Endpoint>> ShmTransport::connect(std::string_view peer_address, Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(Address a, decode_address(peer_address));
  if (a.boot_id != sys::boot_id()) {
    return Status::unavailable("shm: peer " + a.socket_path + " runs on another host or boot");
  }
  if (a.uid != ::geteuid()) {
    return Status::permission_denied("shm: peer " + a.socket_path + " runs as uid " + std::to_string(a.uid));
  }
  UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return Status::from_errno("shm: socket", errno);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, a.socket_path.data(), a.socket_path.size());  // checked < size
  for (;;) {
    if (::connect(sock.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0) break;
    if (errno == EINTR) continue;
    if (errno == EAGAIN) {  // the peer's backlog is full: retry until the deadline
      if (Clock::now() >= deadline) return Status::timeout("shm: connect " + a.socket_path);
      ::poll(nullptr, 0, std::min(1, poll_timeout_ms(deadline)));
      continue;
    }
    if (errno == EINPROGRESS) {
      KVSTASH_RETURN_IF_ERROR(wait_fd(sock.get(), POLLOUT, deadline, "shm connect"));
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(sock.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == 0) break;
      errno = err;
    }
    if (errno == ENOENT || errno == ECONNREFUSED) {
      return Status::unavailable("shm: nothing listens at " + a.socket_path);
    }
    if (errno == EACCES || errno == EPERM) {
      return Status::permission_denied("shm: no access to " + a.socket_path);
    }
    return Status::from_errno("shm: connect " + a.socket_path, errno);
  }
  Status error;
  const uid_t uid = peer_uid(sock.get(), &error);
  KVSTASH_RETURN_IF_ERROR(error);
  if (uid != ::geteuid()) {
    return Status::permission_denied("shm: " + a.socket_path + " is served by uid " + std::to_string(uid));
  }

  auto conn = std::make_shared<PeerConnection>();
  conn->socket = std::move(sock);
  conn->peer = a.socket_path;
  KVSTASH_ASSIGN_OR_RETURN(Reply hello, exchange(*conn, MsgType::kHello, 0, 0, deadline));
  if (!hello.status.is_ok()) return hello.status.with_context("shm: " + a.socket_path);
  struct stat st {};
  if (!hello.fd.valid() || ::fstat(hello.fd.get(), &st) != 0 || hello.a < 2 || hello.a > (1u << 24) ||
      static_cast<std::uint64_t>(st.st_size) != hello.a * sizeof(std::uint64_t)) {
    return Status::corrupt("shm: " + a.socket_path + " sent no valid key table");
  }
  const std::size_t size = static_cast<std::size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, hello.fd.get(), 0);
  if (p == MAP_FAILED) return Status::from_errno("shm: mmap the peer's key table", errno);
  conn->key_table = Mapping(p, size);
  conn->slots = static_cast<std::uint32_t>(hello.a);
  if (load_slot(conn->slot(0)) != kKeyTableMagic) {
    return Status::corrupt("shm: " + a.socket_path + " sent a foreign key table");
  }
  KVSTASH_LOG_DEBUG("shm: connected to {}", a.socket_path);
  return std::shared_ptr<Endpoint>(std::make_shared<ShmEndpoint>(std::move(conn), datapath_));
}

}  // namespace

// ---- ShmEndpoint's control half ------------------------------------------------------------

Result<std::unique_ptr<RemoteKey>> ShmEndpoint::import_key(std::uint64_t base, std::uint64_t length,
                                                           std::string_view packed, Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(PackedKey key, decode_key(packed));
  if (length == 0 || base + length < base) {
    return Status::invalid_argument("shm: empty or wrapping remote range");
  }
  if (key.slot >= conn_->slots) return Status::permission_denied("shm: unknown remote key");
  if (conn_->gone()) return Status::unavailable("shm: peer " + conn_->peer + " gone");
  KVSTASH_ASSIGN_OR_RETURN(Reply r, exchange(*conn_, MsgType::kImport, key.slot, key.key, deadline));
  if (!r.status.is_ok()) return r.status;
  if (!r.fd.valid()) return Status::corrupt("shm: import reply without a descriptor");
  const std::uint64_t region_addr = r.a, region_len = r.b, fd_offset = r.c;
  // The caller's idea of the region must lie within the peer's: never map more than granted.
  if (base < region_addr || length > region_len || base - region_addr > region_len - length) {
    return Status::permission_denied("shm: the remote key does not grant the requested range");
  }
  struct stat st {};
  if (::fstat(r.fd.get(), &st) != 0) return Status::from_errno("shm: fstat remote region", errno);
  const std::uint64_t file_off = fd_offset + (base - region_addr);
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_off < fd_offset || file_off > file_size || length > file_size - file_off) {
    // Mapping past the end of the file would turn the first copy into SIGBUS.
    return Status::corrupt("shm: remote region runs past the end of its file");
  }
  // hugetlbfs files need huge-page-aligned offsets; st_blksize says the page size.
  std::uint64_t align = page_size();
  const auto blk = static_cast<std::uint64_t>(st.st_blksize);
  if (blk > align && (blk & (blk - 1)) == 0) align = blk;
  const std::uint64_t map_off = file_off & ~(align - 1);
  std::uint64_t map_len = file_off - map_off + length;
  const std::uint64_t rounded = (map_len + align - 1) & ~(align - 1);
  if (map_off + rounded <= file_size) map_len = rounded;
  // Page tables filled now, not by faults in the first copies (64 MiB of 4 KiB pages is
  // 16384 faults, about as long as the copy). Bounded: a huge pool maps lazily.
  constexpr std::uint64_t kPopulateLimit = 4ull << 30;
  const int flags = MAP_SHARED | (map_len <= kPopulateLimit ? MAP_POPULATE : 0);
  void* p = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, flags, r.fd.get(), static_cast<off_t>(map_off));
  if (p == MAP_FAILED) return Status::from_errno("shm: mmap remote region", errno);
  auto region = std::make_shared<RemoteRegion>();
  region->conn = conn_;
  region->mapping = Mapping(p, map_len);
  region->data = region->mapping.data() + (file_off - map_off);
  region->base = base;
  region->length = length;
  region->slot = key.slot;
  region->key = key.key;
  region->leased = key.leased;
  return std::unique_ptr<RemoteKey>(std::make_unique<ShmRemoteKey>(std::move(region)));
}

Result<std::unique_ptr<RemoteKey>> ShmEndpoint::lease_key(const RemoteKey& region,
                                                          std::span<const RemoteRange>,
                                                          const LeaseTerms& terms, Deadline) {
  // Made here, no round trip: the copies are ours, and each checks the lease first.
  const auto& k = static_cast<const ShmRemoteKey&>(region);
  return std::unique_ptr<RemoteKey>(std::make_unique<ShmRemoteKey>(k.region(), terms.id, terms.fence));
}

Status ShmEndpoint::revoke(const RemoteKey& key, const LeaseTerms& terms, Deadline) {
  const auto& k = static_cast<const ShmRemoteKey&>(key);
  if (k.lease() != terms.id) return Status::invalid_argument("shm: revoke of another lease than the key's");
  // Only this process copies under the lease, and the caller has ended its batches (abort
  // waits for a copy in progress): refusing copies that have not started is the whole fence.
  k.revoke();
  return Status::ok();
}

}  // namespace shm

Result<std::unique_ptr<Transport>> make_shm_transport(const ShmOptions& options) {
  using namespace shm;
  if (sys::boot_id().empty()) {
    return Status::unavailable("shm: no boot id (/proc/sys/kernel/random/boot_id)");
  }
  const std::string dir = options.socket_dir.empty() ? default_socket_dir() : options.socket_dir;
  KVSTASH_RETURN_IF_ERROR(prepare_socket_dir(dir));
  // Random, so that a stale file of a dead process with our pid never gets in the way.
  const std::uint64_t nonce = sys::random_u64();
  const std::string path = dir + "/shm-" + std::to_string(::getpid()) + "-" +
                           wire::to_hex(std::string_view(reinterpret_cast<const char*>(&nonce), 6)) + ".sock";
  sockaddr_un sa{};
  if (path.size() >= sizeof sa.sun_path) {
    return Status::invalid_argument("shm: socket path too long: " + path);
  }
  KVSTASH_ASSIGN_OR_RETURN(std::shared_ptr<Registry> registry, Registry::create());
  UniqueFd listen(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listen.valid()) return Status::from_errno("shm: socket", errno);
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.data(), path.size());
  if (::bind(listen.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0) {
    return Status::from_errno("shm: bind " + path, errno);
  }
  // The directory is 0700 already; 0600 on the socket itself is the second lock.
  if (::chmod(path.c_str(), 0600) != 0 || ::listen(listen.get(), 128) != 0) {
    Status s = Status::from_errno("shm: chmod/listen " + path, errno);
    ::unlink(path.c_str());
    return s;
  }
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) {
    ::unlink(path.c_str());
    return Status::from_errno("shm: eventfd", errno);
  }
  KVSTASH_LOG_INFO("shm: serving on {}", path);
  return std::unique_ptr<Transport>(
      new ShmTransport(options, path, std::move(listen), std::move(wake), std::move(registry)));
}

}  // namespace kvstash::transport
