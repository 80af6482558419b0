// host_device(): the KvDevice for memory the host may touch. Copies are memcpy, checksums
// are computed on the CPU, bounce buffers come from operator new, and there are no streams:
// mark() passes at once for KvSync::none() and the legacy default stream (there is no GPU
// work to order after), and a load's layers cannot be handed to streams.
#include <cstring>
#include <new>

#include "common/checksum.h"
#include "kvstash/kvcache.h"

namespace kvstash {
namespace {

// Host memory bytes long, page-aligned, from operator new (the host device's bounce buffers).
std::shared_ptr<std::byte> aligned_host(std::size_t bytes) {
  auto* p = static_cast<std::byte*>(::operator new (bytes, std::align_val_t{4096}));
  return std::shared_ptr<std::byte>(p, [](std::byte* q) { ::operator delete (q, std::align_val_t{4096}); });
}

// The sum of runs of host memory as one segment.
std::uint64_t host_segment_sum(std::span<const KvRun> runs) {
  std::uint64_t total = 0;
  for (const KvRun& r : runs) total += r.length;
  sum::ObjectHasher h(total);
  for (const KvRun& r : runs) h.update(r.addr, r.length);
  return total == 0 ? sum::segment_sum(nullptr, 0) : *h.last_segment_sum();
}

class PassedMark final : public KvDeviceMark {
 public:
  Status wait(Deadline) override { return {}; }
};

class HostDevice final : public KvDevice {
 public:
  std::string_view name() const override { return "host"; }
  Status reserve(const KvDeviceSizes&) override { return {}; }
  Status gather(std::span<const KvRun> runs, std::byte* dst, Deadline) override {
    for (const KvRun& r : runs) {
      std::memcpy(dst, r.addr, r.length);
      dst += r.length;
    }
    return {};
  }
  Status scatter(const std::byte* src, std::span<const KvRun> runs, Deadline) override {
    for (const KvRun& r : runs) {
      std::memcpy(r.addr, src, r.length);
      src += r.length;
    }
    return {};
  }
  Result<std::shared_ptr<std::byte>> allocate_host(std::size_t bytes) override { return aligned_host(bytes); }
  Result<std::uint64_t> segment_sum(std::span<const KvRun> runs, bool, Deadline) override {
    return host_segment_sum(runs);
  }
  Result<std::unique_ptr<KvDeviceMark>> mark(const KvSync& after) override {
    const bool nothing =
        after.kind == KvSync::Kind::kNone || (after.kind == KvSync::Kind::kStream && after.handle == nullptr);
    if (!nothing) {
      return Status::invalid_argument(
          "kvcache: the host device has no streams or events to wait for (pass KvSync::none())");
    }
    return std::unique_ptr<KvDeviceMark>(std::make_unique<PassedMark>());
  }
  Result<std::unique_ptr<KvDeviceHandover>> handover(const KvHandoverPlan&) override {
    return Status::unsupported("kvcache: the host device has no streams to hand layers to (use wait_layer)");
  }
};

}  // namespace

std::shared_ptr<KvDevice> host_device() { return std::make_shared<HostDevice>(); }

}  // namespace kvstash
