// The shm transport's key registry: the key table peers map read-only (a sealed memfd of
// 64-bit slots, layout in shm_wire.h), and behind each slot the region a remote-access
// registration published there. The server thread reads it to answer imports; registration
// and deregistration write it. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "kvstash/status.h"
#include "transport/shm/shm_internal.h"
#include "transport/transport.h"

namespace kvstash::transport::shm {

class Registry {
 public:
  // The key table, created, sized, mapped and sealed (where the kernel can), with slot 0
  // holding kKeyTableMagic and every key slot free. Errors: the kernel's (Status::from_errno).
  static Result<std::shared_ptr<Registry>> create();

  // The key table's descriptor, what a hello is answered with. Valid while the registry is.
  int fd() const { return fd_.get(); }

  // Raises the fence peers check before each copy under a lease (never lowers it).
  void fence(std::uint64_t through);

  // Publishes a region under a fresh slot and key. `region.fd` is duplicated: the registry's
  // copy stays valid for as long as the registration, whatever the caller does with its own.
  // kNoSpace when every key slot is taken.
  Result<PackedKey> add(const MemoryRegion& region, bool leased);

  // Revokes: from the release store on, copies that check the slot are refused.
  void remove(std::uint32_t s);

  // The import reply for (slot, key), sent on `sock` with the region's descriptor, or a
  // refusal (kPermissionDenied) for a key this registry does not hold. The descriptor is
  // only valid under the lock, hence sending from here (never blocks). The send's status.
  Status reply_import(int sock, std::uint64_t id, std::uint32_t s, std::uint64_t key);

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

// A registration: for remote access, a slot of the registry, revoked when it is destroyed.
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

}  // namespace kvstash::transport::shm
