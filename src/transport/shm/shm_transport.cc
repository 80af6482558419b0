// The shm transport's control path: the transport itself (capabilities, memory registration,
// connect), the initiator's side of the request protocol, and import_key. The rest of the
// control path sits beside it, one concern per file: the codecs (shm_wire.cc), the sockets
// and their directory (shm_socket.cc), the key registry (shm_registry.cc) and the server
// thread that hands out file descriptors (shm_server.cc). The datapath (post, abort) lives in
// shm_transport_datapath.cc.
//
// Trust boundary: the uid. Only processes of our (effective) uid on this boot of this kernel
// can connect, and such a process could read our memory through /proc anyway; the checks
// below keep honest peers from reaching memory by mistake (wrong, stale or revoked keys)
// and keep other users out entirely.
#include "transport/shm/shm_transport.h"

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "common/log.h"
#include "common/system.h"
#include "common/wire.h"
#include "transport/shm/shm_internal.h"
#include "transport/shm/shm_registry.h"
#include "transport/shm/shm_server.h"
#include "transport/shm/shm_socket.h"
#include "transport/shm/shm_wire.h"

namespace kvstash::transport {
namespace shm {

void Mapping::reset() {
  if (addr_ != nullptr) ::munmap(addr_, length_);
  addr_ = nullptr;
  length_ = 0;
}

namespace {

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
  KVSTASH_RETURN_IF_ERROR(send_message(conn.socket.get(), encode_request(type, id, slot, key), -1, deadline));
  for (;;) {
    KVSTASH_ASSIGN_OR_RETURN(Message m, recv_message(conn.socket.get(), deadline));
    KVSTASH_ASSIGN_OR_RETURN(Reply reply, decode_reply(m.bytes));
    reply.fd = std::move(m.fd);
    if (reply.type == MsgType::kRefused) {
      return reply.status.is_ok() ? Status::permission_denied("shm peer refused us") : reply.status;
    }
    if (reply.id == id && reply.type == type) return reply;
  }
}

std::size_t page_size() {
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

class ShmTransport final : public Transport {
 public:
  ShmTransport(const ShmOptions& options, std::string socket_path, UniqueFd listen, UniqueFd wake,
               std::shared_ptr<Registry> registry)
      : options_(options),
        socket_path_(std::move(socket_path)),
        address_(encode_address({sys::boot_id(), static_cast<std::uint32_t>(::geteuid()), socket_path_})),
        registry_(std::move(registry)),
        datapath_(std::make_shared<Datapath>(options.copy_threads, options.inline_bytes)),
        server_(socket_path_, std::move(listen), std::move(wake), registry_) {}

  ~ShmTransport() override {
    server_.stop();  // no more imports; the socket file goes
    datapath_->stop();
  }
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  TransportKind kind() const override { return TransportKind::kShm; }
  std::vector<TransportCounter> counters() const override { return server_.counters(); }

  Capabilities capabilities() const override {
    Capabilities c;
    c.same_host_only = true;
    c.one_sided = true;
    c.leases = true;
    c.lanes = datapath_->lanes();
    c.slice_bytes = options_.slice_bytes;
    c.digests_writes = true;
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
  const ShmOptions options_;
  const std::string socket_path_;
  const std::string address_;
  std::shared_ptr<Registry> registry_;
  std::shared_ptr<Datapath> datapath_;
  Server server_;  // last: its thread starts once everything it may use is built
};

Result<std::shared_ptr<Endpoint>> ShmTransport::connect(std::string_view peer_address, Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(Address a, decode_address(peer_address));
  if (a.boot_id != sys::boot_id()) {
    return Status::unavailable("shm: peer " + a.socket_path + " runs on another host or boot");
  }
  if (a.uid != ::geteuid()) {
    return Status::permission_denied("shm: peer " + a.socket_path + " runs as uid " + std::to_string(a.uid));
  }
  KVSTASH_ASSIGN_OR_RETURN(UniqueFd sock, connect_socket(a.socket_path, deadline));  // path checked < size
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
  void* p = sys::map_shared(r.fd.get(), map_len, map_off, map_len <= kPopulateLimit);
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
