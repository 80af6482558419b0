// Private to src/kvcache: how a cache's bytes travel, chosen once by KvCache::open from the
// memory's kind (host or GPU), what the store's transports can register, and KvPath. Direct:
// the transports move the cache's memory themselves (it is registered with the store, region
// by region). Staged: the device copies it through host bounce buffers (bounce_pool.h),
// which the transports move.
//
// Thread safety: choose_data_path is called by one thread (open) and touches only the store.
#pragma once

#include <memory>
#include <vector>

#include "kvstash/engine.h"
#include "kvstash/kvcache.h"
#include "kvstash/status.h"

namespace kvstash::kvcache {

// What choose_data_path chose.
struct DataPath {
  std::vector<MemoryHandle> handles;  // the direct path: one per layout region, in order
  std::shared_ptr<KvDevice> device;   // the memory's device; never null in a chosen DataPath
  bool staged = false;
  bool device_memory = false;  // some region is not host memory
};

// The device: options.device, else host_device() for host memory, else
// cuda_device_of(layout). The path: KvPath::kStaged stages through that device; kDirect and
// kAuto register every region of `layout` with `store`, and kAuto falls back to staging (and
// logs why) when that fails for GPU memory. Blocks while registering. Errors: the
// registration's for host memory or on kDirect; kUnsupported for GPU memory the transports
// reach when no device was found; the device lookup's error with context when staging needs
// one.
Result<DataPath> choose_data_path(Store& store, const KvLayout& layout, const KvCacheOptions& options);

}  // namespace kvstash::kvcache
