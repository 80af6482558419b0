// Private to src/kvcache: host bounce buffers for the staged data path (KvPath::kStaged), of
// one size each, allocated by the cache's device (page-locked for CUDA), registered with the
// store once and reused across saves or loads, so a warm save or load allocates none.
//
// Thread safety: a BouncePool is safe to use from several threads (the cache's savers and
// loaders take and give at once); a Bounce is one user's between take() and give().
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "kvstash/engine.h"
#include "kvstash/kvcache.h"
#include "kvstash/status.h"

namespace kvstash {

class Store;

namespace kvcache {

// A host bounce buffer, registered with the store once.
struct Bounce {
  std::shared_ptr<std::byte> mem;
  std::size_t bytes = 0;
  MemoryHandle handle;
};

// Bounce buffers of `bytes` bytes, reused across saves or loads.
class BouncePool {
 public:
  // Neither `store` nor `device` is owned: both outlive the pool.
  BouncePool(Store* store, KvDevice* device, std::size_t bytes)
      : store_(store), device_(device), bytes_(bytes) {}

  // A free buffer, or a new one (KvDevice::allocate_host, then Store::register_memory):
  // their errors, unchanged.
  Result<std::unique_ptr<Bounce>> take();
  // Returns `b` to the pool for a later take(); a null `b` changes nothing. No transfer may
  // still touch it.
  void give(std::unique_ptr<Bounce> b);
  // Keeps `b` out of use for good: a device copy into or out of it did not finish by its
  // deadline and may still run (a GPU that hung). Freed only with the pool.
  void quarantine(std::unique_ptr<Bounce> b);

 private:
  Store* store_;
  KvDevice* device_;
  std::size_t bytes_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Bounce>> free_;
  std::vector<std::unique_ptr<Bounce>> quarantined_;
};

}  // namespace kvcache
}  // namespace kvstash
