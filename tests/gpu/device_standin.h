// A stand-in for a GPU on machines without one: device memory this process cannot touch, and
// a device (KvDevice) whose own "kernels" reach it. A fake, named as such: it exists so that
// tests prove, without a GPU, that the host never reads or writes the memory a KV cache lives
// in, and that the cache orders its work after the engine's streams.
//
// The memory is a memfd mapped twice (MAP_SHARED both). The device address mapping is what
// the engine, the KvLayout and a NIC use; seal() makes it PROT_NONE, so any host access
// faults (a handler names the address and aborts the test). Memory a NIC must reach is
// registered before seal(): ibv_reg_mr pins the pages, and RDMA into and out of them still
// completes (tried on rxe, kernel 6.1; registering memory that is already PROT_NONE fails
// with EFAULT, and MAP_PRIVATE would give the NIC a private copy). The second mapping is the
// device's own: its copier and its checksum kernel (the same common/checksum_core.h the CUDA
// kernel compiles) go through it, as a GPU's copy engines and SMs would.
//
// Streams are worker threads that run what was queued on them in order; events are flags
// those threads set. Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kvstash/kvcache.h"
#include "kvstash/memory.h"

namespace kvstash::test {

class DeviceStandin final : public KvDevice, public std::enable_shared_from_this<DeviceStandin> {
 public:
  // `bytes` of device memory (rounded up to pages), zero-filled. kIoError from the OS.
  static Result<std::shared_ptr<DeviceStandin>> create(std::size_t bytes);
  ~DeviceStandin() override;

  std::byte* base() const { return base_; }  // the device address of the memory
  std::size_t size() const { return size_; }
  // The memory as a region to register: MemoryKind::kCuda, with its memfd.
  MemoryRegion region() const;
  // From now on no host code may touch the device addresses: any access faults. Idempotent.
  Status seal();
  // The device's own view of a device address (its kernels, and tests playing the engine's).
  std::byte* view(const void* device_addr) const;
  // Bytes its checksum kernel and its copier went through (what the device did, not the host).
  std::uint64_t summed_bytes() const;
  std::uint64_t copied_bytes() const;

  // Streams, events and kernels, owned by the device; handles are what KvSync carries.
  // A blocking stream (the engine's kind: the legacy default stream, a null handle, orders
  // after it) or a non-blocking one (the device's own).
  void* create_stream(bool blocking = true);
  void* create_event();
  // Runs `kernel` on the stream's thread after everything queued on it before.
  void launch(void* stream, std::function<void()> kernel);
  // The event completes when the stream reaches this point (as cudaEventRecord).
  void record(void* event, void* stream);
  // The stream waits for the event before what is queued on it later (as cudaStreamWaitEvent).
  void wait_event(void* stream, void* event);
  // Blocks until everything queued on the stream ran.
  void synchronize(void* stream);

  // KvDevice.
  std::string_view name() const override { return "standin"; }
  Status reserve(const KvDeviceSizes&) override { return {}; }
  Status gather(std::span<const KvRun> runs, std::byte* dst, Deadline deadline) override;
  Status scatter(const std::byte* src, std::span<const KvRun> runs, Deadline deadline) override;
  Result<std::shared_ptr<std::byte>> allocate_host(std::size_t bytes) override;
  Result<std::uint64_t> segment_sum(std::span<const KvRun> runs, bool nic_wrote, Deadline deadline) override;
  Result<std::unique_ptr<KvDeviceMark>> mark(const KvSync& after) override;
  Result<std::unique_ptr<KvDeviceHandover>> handover(const KvHandoverPlan& plan) override;

  struct Event;
  struct Stream;

 private:
  DeviceStandin() = default;
  Status check_runs(std::span<const KvRun> runs) const;
  Event* event_of(void* handle) const;
  Stream* stream_of(void* handle) const;

  int fd_ = -1;
  std::byte* base_ = nullptr;
  std::byte* view_ = nullptr;
  std::size_t size_ = 0;
  bool sealed_ = false;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<std::unique_ptr<Event>> events_;
  Stream* mark_stream_ = nullptr;  // where marks of engine events are captured
  std::atomic<std::uint64_t> summed_{0}, copied_{0};
};

}  // namespace kvstash::test
