// A load's layers handed to the engine's streams (KvDeviceHandover, include/kvstash/kvcache.h).
//
// On the engine's stream, for layer l:
//   cuStreamWaitValue32(counter >= l + 1)   the host raises the counter once layer l is final
//                                           on the host: it depends on nothing the GPU does
//   cudaMemcpyAsync(layer l's descriptors)   written by the host before the release
//   copy (staged) | digests (direct)         our kernel, on the engine's stream, after the wait
//   cudaEventRecord(event l)                 for sum(), passed(), and other streams
// so no device-side wait ever depends on a kernel of ours queued elsewhere, which could sit
// behind it in a hardware queue the streams share (CUDA_DEVICE_MAX_CONNECTIONS). On the direct
// path, NIC writes are made visible first: by the wait's own flush where the GPU has one,
// else by the host before each release, and not at all where the GPU orders them itself.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/checksum_core.h"
#include "kvcache/cuda/cuda_device.h"
#include "kvcache/cuda/cuda_internal.h"

namespace kvstash::cuda {
namespace {

class CudaHandover final : public KvDeviceHandover {
 public:
  CudaHandover(std::shared_ptr<CudaDevice> device, const KvHandoverPlan& plan)
      : device_(std::move(device)), plan_(plan) {}

  ~CudaHandover() override {
    release_through(plan_.layers);  // no stream waits forever
    const bool reusable = !lost_ && passed();
    device_->give_slot(std::move(slot_), reusable);
  }

  // Lays out every layer's descriptors in the slot (direct: written now, they name the cache;
  // staged: empty until place()).
  Status prepare() {
    const std::size_t chunks = plan_.runs.size();
    layers_.resize(plan_.layers);
    first_.assign(chunks, std::vector<std::size_t>(plan_.layers, 0));
    std::size_t bytes = 0, words = 0;
    for (std::uint32_t l = 0; l < plan_.layers; ++l) {
      Layer& layer = layers_[l];
      layer.offset = bytes;
      if (plan_.staged) {
        for (std::size_t c = 0; c < chunks; ++c) {
          first_[c][l] = layer.count;
          for (const KvRun& r : plan_.runs[c][l]) layer.count += pieces_of(r.length);
        }
        bytes += layer.count * sizeof(CopyPiece);
      } else {
        bytes += chunks * sizeof(DigestSegment);
        for (std::size_t c = 0; c < chunks; ++c) {
          bytes += plan_.runs[c][l].size() * sizeof(DigestRun);
          first_[c][l] = words;  // where its digests start
          words += sum::block_count(length(c, l)) + 1;
          layer.max_length = std::max(layer.max_length, length(c, l));
        }
        layer.count = static_cast<std::uint32_t>(chunks);
      }
      layer.bytes = bytes - layer.offset;
    }
    KVSTASH_ASSIGN_OR_RETURN(slot_, device_->take_slot(bytes, words * sizeof(std::uint64_t), plan_.layers));
    std::memset(slot_->descriptors.host, 0, bytes);
    counter().store(0, std::memory_order_release);
    if (!plan_.staged) write_digest_descriptors();
    return {};
  }

  void place(std::size_t chunk, std::uint32_t layer, const std::byte* src) override {
    if (!plan_.staged || chunk >= plan_.runs.size() || layer >= plan_.layers) return;
    auto* out =
        reinterpret_cast<CopyPiece*>(slot_->descriptors.host + layers_[layer].offset) + first_[chunk][layer];
    std::uint64_t at = 0;
    for (const KvRun& r : plan_.runs[chunk][layer]) {
      out += write_pieces(src + at, r.addr, r.length, out);
      at += r.length;
    }
  }

  void release_through(std::uint32_t n) override {
    std::lock_guard lock(mu_);
    n = std::min(n, plan_.layers);
    if (!slot_ || n <= released_) return;
    if (!plan_.staged && device_->nic_writes_need_flush() && !device_->can_flush_in_stream()) {
      ContextGuard g(device_->context());
      (void)device_->flush_nic_writes();  // best effort: a failure here shows as a bad checksum
    }
    released_ = n;
    counter().store(n, std::memory_order_release);
  }

  Status queue(std::uint32_t layer, void* engine_stream) override {
    if (layer >= plan_.layers) return Status::invalid_argument("kvcache: layer out of range");
    ContextGuard g(device_->context());
    KVSTASH_RETURN_IF_ERROR(g.status());
    auto stream = static_cast<cudaStream_t>(engine_stream);
    KVSTASH_RETURN_IF_ERROR(device_->usable(stream, "wait_layer_on's stream"));
    std::lock_guard lock(mu_);
    Layer& l = layers_[layer];
    if (l.queued) {
      // Another stream finishes it already: this one waits for that.
      return status(cudaStreamWaitEvent(stream, slot_->events[layer], 0), "wait for the layer's event");
    }
    if (auto* after = dynamic_cast<CudaMark*>(plan_.after); after != nullptr && !waited_after(stream)) {
      KVSTASH_RETURN_IF_ERROR(
          status(cudaStreamWaitEvent(stream, after->event(), 0), "wait for the engine's earlier work"));
      after_streams_.push_back(stream);
    }
    unsigned flags = CU_STREAM_WAIT_VALUE_GEQ;
    if (!plan_.staged && device_->nic_writes_need_flush() && device_->can_flush_in_stream())
      flags |= CU_STREAM_WAIT_VALUE_FLUSH;
    const CUresult waited =
        driver().wait_value32(reinterpret_cast<CUstream>(stream),
                              reinterpret_cast<CUdeviceptr>(slot_->counter.host_on_device), layer + 1, flags);
    if (waited != CUDA_SUCCESS)
      return Status::internal("cuda: cuStreamWaitValue32 failed (CUresult " + std::to_string(waited) + ")");
    // From here on the stream holds a wait on this slot: it must be tracked even if what
    // follows fails, so the slot is not reused under it.
    l.queued = true;
    Status s =
        status(cudaMemcpyAsync(slot_->descriptors.device + l.offset, slot_->descriptors.host + l.offset,
                               l.bytes, cudaMemcpyHostToDevice, stream),
               "upload the layer's descriptors");
    if (s.is_ok()) {
      const int launched = plan_.staged
                               ? launch_copy(slot_->descriptors.on_device<CopyPiece>(l.offset), l.count,
                                             device_->sm_count(), stream)
                               : launch_digests(slot_->descriptors.on_device<DigestSegment>(l.offset),
                                                l.count, l.max_length, device_->sm_count(), stream);
      s = status(static_cast<cudaError_t>(launched), plan_.staged ? "place the layer" : "check the layer");
    }
    if (const cudaError_t recorded = cudaEventRecord(slot_->events[layer], stream); recorded != cudaSuccess) {
      lost_ = true;
      if (s.is_ok()) s = status(recorded, "record the layer's event");
    }
    return s;
  }

  Result<void*> queue_event(std::uint32_t layer) override {
    KVSTASH_RETURN_IF_ERROR(queue(layer, slot_->own));
    return static_cast<void*>(slot_->events[layer]);
  }

  Result<std::uint64_t> sum(std::size_t chunk, std::uint32_t layer, Deadline deadline) override {
    if (plan_.staged || chunk >= plan_.runs.size() || layer >= plan_.layers)
      return Status::invalid_argument("kvcache: no such checksum in this handover");
    {
      std::lock_guard lock(mu_);
      if (!layers_[layer].queued) return Status::unavailable("kvcache: the layer was not handed to a stream");
    }
    ContextGuard g(device_->context());
    KVSTASH_RETURN_IF_ERROR(g.status());
    KVSTASH_RETURN_IF_ERROR(
        wait_event(slot_->events[layer], deadline, "checking a layer on the engine's stream"));
    auto* words = reinterpret_cast<std::uint64_t*>(slot_->digests.host) + first_[chunk][layer];
    const std::uint64_t n = length(chunk, layer);
    return sum::fold(words, sum::block_count(n), n);
  }

  bool passed() override {
    if (!slot_) return true;
    ContextGuard g(device_->context());
    std::lock_guard lock(mu_);
    for (std::uint32_t l = 0; l < plan_.layers; ++l) {
      Layer& layer = layers_[l];
      if (!layer.queued || layer.passed) continue;
      if (!event_done(slot_->events[l])) return false;
      layer.passed = true;
    }
    return true;
  }

 private:
  struct Layer {
    std::size_t offset = 0;  // of its descriptors in the slot
    std::size_t bytes = 0;
    std::uint32_t count = 0;  // pieces (staged) or segments (direct)
    std::uint64_t max_length = 0;
    bool queued = false;
    bool passed = false;
  };

  std::atomic_ref<std::uint32_t> counter() {
    return std::atomic_ref<std::uint32_t>(*reinterpret_cast<std::uint32_t*>(slot_->counter.host));
  }
  std::uint64_t length(std::size_t c, std::uint32_t l) const {
    std::uint64_t n = 0;
    for (const KvRun& r : plan_.runs[c][l]) n += r.length;
    return n;
  }
  bool waited_after(cudaStream_t s) const {
    return std::find(after_streams_.begin(), after_streams_.end(), s) != after_streams_.end();
  }

  // Direct: each layer's segments (one per chunk) and their runs in the cache.
  void write_digest_descriptors() {
    const auto* digests_on_device = reinterpret_cast<std::uint64_t*>(slot_->digests.host_on_device);
    for (std::uint32_t l = 0; l < plan_.layers; ++l) {
      std::byte* base = slot_->descriptors.host + layers_[l].offset;
      auto* segments = reinterpret_cast<DigestSegment*>(base);
      std::size_t at = plan_.runs.size() * sizeof(DigestSegment);
      for (std::size_t c = 0; c < plan_.runs.size(); ++c) {
        auto* runs = reinterpret_cast<DigestRun*>(base + at);
        std::uint64_t begin = 0;
        for (const KvRun& r : plan_.runs[c][l]) {
          *runs++ = {r.addr, r.length, begin};
          begin += r.length;
        }
        segments[c] = {slot_->descriptors.on_device<DigestRun>(layers_[l].offset + at),
                       static_cast<std::uint32_t>(plan_.runs[c][l].size()), begin,
                       const_cast<std::uint64_t*>(digests_on_device) + first_[c][l]};
        at += plan_.runs[c][l].size() * sizeof(DigestRun);
      }
    }
  }

  std::shared_ptr<CudaDevice> device_;
  KvHandoverPlan plan_;
  std::unique_ptr<Slot> slot_;
  std::vector<Layer> layers_;
  std::vector<std::vector<std::size_t>> first_;  // [chunk][layer]: first piece, or first digest word
  std::mutex mu_;
  std::uint32_t released_ = 0;
  std::vector<cudaStream_t> after_streams_;  // streams that wait for plan_.after already
  bool lost_ = false;                        // a stream may hold work on the slot we cannot see
};

}  // namespace

Result<std::unique_ptr<Slot>> CudaDevice::take_slot(std::size_t descriptor_bytes, std::size_t digest_bytes,
                                                    std::uint32_t layers) {
  std::unique_ptr<Slot> slot;
  {
    std::lock_guard lock(mu_);
    if (!free_slots_.empty()) {
      slot = std::move(free_slots_.back());
      free_slots_.pop_back();
    }
  }
  if (!slot) {
    slot = std::make_unique<Slot>();
    KVSTASH_RETURN_IF_ERROR(
        status(cudaStreamCreateWithFlags(&slot->own, cudaStreamNonBlocking), "handover stream"));
  }
  Status grown = grow(slot->counter, sizeof(std::uint32_t), false);
  if (grown.is_ok()) grown = grow(slot->descriptors, std::max<std::size_t>(descriptor_bytes, 64), true);
  if (grown.is_ok() && digest_bytes > 0) grown = grow(slot->digests, digest_bytes, false);
  while (grown.is_ok() && slot->events.size() < layers) {
    cudaEvent_t e = nullptr;
    grown = status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "layer event");
    if (grown.is_ok()) slot->events.push_back(e);
  }
  if (!grown.is_ok()) {
    give_slot(std::move(slot), true);  // idle: what it has is fine for a later take
    return grown;
  }
  return slot;
}

void CudaDevice::give_slot(std::unique_ptr<Slot> slot, bool reusable) {
  if (!slot) return;
  std::lock_guard lock(mu_);
  (reusable ? free_slots_ : lost_slots_).push_back(std::move(slot));
}

Result<std::unique_ptr<KvDeviceHandover>> CudaDevice::handover(const KvHandoverPlan& plan) {
  if (driver().wait_value32 == nullptr)
    return Status::unsupported("cuda: the driver has no stream memory operations (cuStreamWaitValue32)");
  if (plan.layers == 0) return Status::invalid_argument("kvcache: a handover of no layers");
  ContextGuard g(ctx_);
  KVSTASH_RETURN_IF_ERROR(g.status());
  auto h = std::make_unique<CudaHandover>(shared_from_this(), plan);
  KVSTASH_RETURN_IF_ERROR(h->prepare());
  return std::unique_ptr<KvDeviceHandover>(std::move(h));
}

}  // namespace kvstash::cuda
