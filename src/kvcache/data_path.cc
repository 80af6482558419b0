#include "kvcache/data_path.h"

#include <algorithm>

#include "common/log.h"
#include "kvstash/store.h"

namespace kvstash::kvcache {
namespace {

bool on_gpu(const KvLayout& layout) {
  return std::ranges::any_of(layout.regions(),
                             [](const MemoryRegion& r) { return r.kind == MemoryKind::kCuda; });
}

// Registers every region of `layout` with the store's transports (the direct data path).
Status register_direct(Store& store, const KvLayout& layout, std::vector<MemoryHandle>& handles) {
  for (const MemoryRegion& r : layout.regions()) {
    KVSTASH_ASSIGN_OR_RETURN(MemoryHandle h, store.register_memory(r));
    handles.push_back(std::move(h));
  }
  return {};
}

}  // namespace

Result<DataPath> choose_data_path(Store& store, const KvLayout& layout, const KvCacheOptions& options) {
  DataPath chosen;
  chosen.device_memory = on_gpu(layout);
  // The device: the caller's, the host for host memory, else the GPU's own.
  chosen.device = options.device;
  Status no_device;
  if (!chosen.device && !chosen.device_memory) chosen.device = host_device();
  if (!chosen.device) {
    auto gpu = cuda_device_of(layout);
    if (gpu.is_ok()) {
      chosen.device = std::move(gpu).value();
    } else {
      no_device = gpu.status();
    }
  }
  const KvPath path = options.path;
  if (path != KvPath::kStaged) {
    Status direct = register_direct(store, layout, chosen.handles);
    if (direct.is_ok() && !chosen.device) {
      // The transports reach the memory, but its checksums must be computed on its device.
      return Status::unsupported("kvcache: GPU memory on the direct path is checksummed by its GPU, and " +
                                 no_device.message() + ": pass KvCacheOptions::device");
    }
    if (!direct.is_ok()) {
      direct = direct.with_context("kvcache: registering the KV cache");
      if (!chosen.device_memory || path == KvPath::kDirect) return direct;
      if (!chosen.device) {
        return direct.with_context("no transport reaches this GPU memory, and " + no_device.message() +
                                   " to stage it: pass KvCacheOptions::device");
      }
      KVSTASH_LOG_INFO("kvcache: staging GPU memory through host bounce buffers (the {} device): {}",
                       chosen.device->name(), direct.message());
      chosen.handles.clear();
      chosen.staged = true;
    }
  } else if (!chosen.device) {
    return no_device.with_context("kvcache: staging needs the memory's device: pass KvCacheOptions::device");
  } else {
    chosen.staged = true;
  }
  return chosen;
}

}  // namespace kvstash::kvcache
