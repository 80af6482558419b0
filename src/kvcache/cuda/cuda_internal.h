// Private to src/kvcache/cuda: the CUDA device's state, shared by its two files:
// cuda_device.cc (lanes: gather, scatter, checksums; marks) and cuda_handover.cc (a load's
// layers handed to the engine's streams).
//
// Memory rules. Every buffer the device uses is allocated when the cache opens (reserve) or,
// for a larger request, on first need; a buffer outgrown is kept until the device is
// destroyed, never freed on the way (cudaFree and cudaFreeHost may synchronize the device).
// Descriptors are written by the host into page-locked memory and copied to device memory on
// the stream that uses them, so kernels never chase pointers over PCIe.
//
// Thread safety: CudaDevice's methods may be called from any thread; a Lane or a Slot is
// held by one operation at a time.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kvcache/cuda/cuda_api.h"
#include "kvcache/cuda/kernels.h"
#include "kvstash/kvcache.h"

namespace kvstash::cuda {

// Page-locked host memory the device can address (`device` is its device pointer), and the
// device memory it is uploaded to. Either may be unused (null).
struct Staging {
  std::byte* host = nullptr;
  std::byte* host_on_device = nullptr;  // the same host bytes, as a device pointer
  std::byte* device = nullptr;
  std::size_t bytes = 0;
  // A device pointer to byte `offset` of the uploaded copy.
  template <typename T>
  const T* on_device(std::size_t offset) const {
    return reinterpret_cast<const T*>(device + offset);
  }
};

// A stream of the device's own with its buffers: one gather, scatter or checksum at a time.
struct Lane {
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;  // recorded after each operation
  Staging descriptors;         // pieces, or digest runs and the segment
  Staging digests;             // host side only: block digests (+ 1 spare word for the fold)
};

// What one load's handover keeps on the device (cuda_handover.cc), reused across loads.
struct Slot {
  Staging counter;                  // one 32-bit word the host raises and streams wait on
  Staging descriptors;              // per layer: pieces (staged) or digest runs and segments (direct)
  Staging digests;                  // direct: per chunk and layer, block digests + 1 spare word
  std::vector<cudaEvent_t> events;  // per layer: recorded after the layer's work
  cudaStream_t own = nullptr;       // KvLoad::layer_event's stream
};

class CudaDevice;

// A mark: an event from the device's pool, recorded at the engine's point of work; waited for
// by polling (with the device's context current), so a waiter has a deadline.
class CudaMark final : public KvDeviceMark {
 public:
  CudaMark(std::shared_ptr<CudaDevice> device, cudaEvent_t event)
      : device_(std::move(device)), event_(event) {}
  ~CudaMark() override;
  Status wait(Deadline deadline) override;
  cudaEvent_t event() const { return event_; }

 private:
  std::shared_ptr<CudaDevice> device_;
  cudaEvent_t event_;
};

class CudaDevice final : public KvDevice, public std::enable_shared_from_this<CudaDevice> {
 public:
  static Result<std::shared_ptr<KvDevice>> create(int gpu, unsigned lanes);
  ~CudaDevice() override;

  std::string_view name() const override { return "cuda"; }
  Status reserve(const KvDeviceSizes& sizes) override;
  Status gather(std::span<const KvRun> runs, std::byte* dst, Deadline deadline) override;
  Status scatter(const std::byte* src, std::span<const KvRun> runs, Deadline deadline) override;
  Result<std::shared_ptr<std::byte>> allocate_host(std::size_t bytes) override;
  Result<std::uint64_t> segment_sum(std::span<const KvRun> runs, bool nic_wrote, Deadline deadline) override;
  Result<std::unique_ptr<KvDeviceMark>> mark(const KvSync& after) override;
  Result<std::unique_ptr<KvDeviceHandover>> handover(const KvHandoverPlan& plan) override;

  // ---- for cuda_handover.cc and the marks (the context must be current: ContextGuard)

  CUcontext context() const { return ctx_; }
  int sm_count() const { return sm_count_; }
  // Whether bytes a NIC wrote into this GPU's memory need a flush before its kernels read
  // them (cudaDevAttrGPUDirectRDMAWritesOrdering below Owner), and how it can be done.
  bool nic_writes_need_flush() const { return needs_flush_; }
  bool can_flush_in_stream() const { return flush_memop_; }
  Status flush_nic_writes();
  // Grows `s` to `bytes` of host (and, with `device_copy`, device) memory; what it had is kept
  // until the device goes. `bytes` only grows.
  Status grow(Staging& s, std::size_t bytes, bool device_copy);
  // Checks that `stream` can take work now: kInvalidArgument while it (or, for the legacy
  // stream, another stream) captures a CUDA graph.
  Status usable(cudaStream_t stream, const char* what);
  // Events: taken from and given back to a pool (none created on the engine's thread once warm).
  Result<cudaEvent_t> take_event();
  void give_event(cudaEvent_t e);
  // Slots for handovers, sized for `descriptor_bytes`, `digest_bytes` and `layers`.
  Result<std::unique_ptr<Slot>> take_slot(std::size_t descriptor_bytes, std::size_t digest_bytes,
                                          std::uint32_t layers);
  void give_slot(std::unique_ptr<Slot> slot, bool reusable);

 private:
  CudaDevice() = default;

  // A lane held for one operation, returned on scope exit; a lane whose operation did not
  // finish by its deadline is parked until its stream catches up.
  class LaneGuard;
  Result<Lane*> take_lane(Deadline deadline);
  void give_lane(Lane* lane, bool finished);
  // After a launch (its result `launched`): records the lane's event and waits for it.
  Status run_on_lane(Lane& lane, int launched, Deadline deadline, const char* what);
  Status copy_on_lane(std::span<const KvRun> runs, const std::byte* host, bool to_host, Deadline deadline);

  int gpu_ = 0;
  CUcontext ctx_ = nullptr;
  int sm_count_ = 1;
  bool needs_flush_ = true;
  bool flush_memop_ = false;
  KvDeviceSizes sizes_;

  std::mutex mu_;  // guards everything below
  std::condition_variable lane_free_;
  std::vector<Lane> lanes_;  // sized once; the lists point into it
  std::vector<Lane*> free_lanes_;
  std::vector<Lane*> parked_lanes_;
  std::vector<cudaEvent_t> free_events_;
  std::vector<std::unique_ptr<Slot>> free_slots_;
  std::vector<std::unique_ptr<Slot>> lost_slots_;  // never reused: a stream may still read them
  std::vector<Staging> outgrown_;                  // freed with the device
  cudaStream_t mark_stream_ = nullptr;             // where engine events are captured
};

}  // namespace kvstash::cuda
