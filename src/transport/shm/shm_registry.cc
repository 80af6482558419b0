// The shm transport's key registry (shm_registry.h).
#include "transport/shm/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "common/system.h"
#include "transport/shm/shm_socket.h"
#include "transport/shm/shm_wire.h"

namespace kvstash::transport::shm {

Result<std::shared_ptr<Registry>> Registry::create() {
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

void Registry::fence(std::uint64_t through) {
  std::atomic_ref<std::uint64_t> f(slot(kFenceSlot));
  std::uint64_t cur = f.load(std::memory_order_seq_cst);
  while (cur < through && !f.compare_exchange_weak(cur, through, std::memory_order_seq_cst)) {
  }
}

Result<PackedKey> Registry::add(const MemoryRegion& region, bool leased) {
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

void Registry::remove(std::uint32_t s) {
  std::lock_guard lock(mu_);
  std::atomic_ref<std::uint64_t>(slot(s)).store(0, std::memory_order_release);
  entries_[s] = Entry{};
  free_.push_back(s);
}

Status Registry::reply_import(int sock, std::uint64_t id, std::uint32_t s, std::uint64_t key) {
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

}  // namespace kvstash::transport::shm
