// The CUDA device's lanes and marks. A few lanes, each a stream of its own with its
// descriptors and digest buffer; a gather, scatter or checksum takes a free lane, uploads its
// descriptors and launches one kernel on it, and polls the lane's event up to its deadline,
// so the saver and loader threads' work overlaps on the GPU. Every call binds the GPU's
// primary context for its duration (ContextGuard) and restores the caller's.
#include "kvcache/cuda/cuda_device.h"

#include <algorithm>
#include <cstring>

#include "common/checksum_core.h"
#include "kvcache/cuda/cuda_internal.h"

namespace kvstash::cuda {
namespace {

class PassedMark final : public KvDeviceMark {
 public:
  Status wait(Deadline) override { return {}; }
};

bool capture_error(cudaError_t e) {
  return e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureInvalidated ||
         e == cudaErrorStreamCaptureImplicit || e == cudaErrorCapturedEvent ||
         e == cudaErrorStreamCaptureWrongThread || e == cudaErrorStreamCaptureIsolation ||
         e == cudaErrorStreamCaptureUnjoined || e == cudaErrorStreamCaptureMerge;
}

// The error of a call on one of the engine's handles: capture and bad handles are the
// caller's (kInvalidArgument), the rest as status().
Status engine_handle_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  if (capture_error(e)) {
    (void)cudaGetLastError();
    return Status::invalid_argument(
        std::string("kvcache: ") + what +
        ": the stream is capturing a CUDA graph, and kvstash cannot order its work "
        "inside one: call it outside captured regions (" +
        cudaGetErrorString(e) + ")");
  }
  if (e == cudaErrorInvalidResourceHandle || e == cudaErrorInvalidValue || e == cudaErrorContextIsDestroyed) {
    (void)cudaGetLastError();
    return Status::invalid_argument(std::string("kvcache: ") + what +
                                    ": not a stream or event of this GPU's context (" +
                                    cudaGetErrorString(e) + ")");
  }
  return status(e, what);
}

}  // namespace

// ---- marks ------------------------------------------------------------------------------------

CudaMark::~CudaMark() { device_->give_event(event_); }

Status CudaMark::wait(Deadline deadline) {
  ContextGuard g(device_->context());
  KVSTASH_RETURN_IF_ERROR(g.status());
  return wait_event(event_, deadline, "waiting for the engine's work");
}

// ---- the device -------------------------------------------------------------------------------

class CudaDevice::LaneGuard {
 public:
  LaneGuard(CudaDevice& d, Lane* lane) : d_(d), lane_(lane) {}
  ~LaneGuard() { d_.give_lane(lane_, finished_); }
  LaneGuard(const LaneGuard&) = delete;
  LaneGuard& operator=(const LaneGuard&) = delete;
  Lane& operator*() const { return *lane_; }
  Lane* operator->() const { return lane_; }
  // The lane's stream ran everything queued on it: it may be reused at once.
  void finished() { finished_ = true; }

 private:
  CudaDevice& d_;
  Lane* lane_;
  bool finished_ = false;
};

Result<std::shared_ptr<KvDevice>> CudaDevice::create(int gpu, unsigned lanes) {
  if (lanes == 0) return Status::invalid_argument("cuda: a device needs at least one lane");
  KVSTASH_RETURN_IF_ERROR(check_driver());
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    (void)cudaGetLastError();
    return status(e, "count the GPUs");
  }
  if (gpu < 0 || gpu >= count) {
    return Status::invalid_argument("cuda: there is no GPU " + std::to_string(gpu) + " (" +
                                    std::to_string(count) + " visible)");
  }
  const Driver& d = driver();
  if (d.device_get == nullptr || d.primary_ctx_retain == nullptr || d.primary_ctx_release == nullptr ||
      d.ctx_get_current == nullptr || d.ctx_set_current == nullptr) {
    return Status::unavailable(
        "cuda: the driver lacks the context functions kvstash needs (cuDevicePrimaryCtxRetain)");
  }
  auto c = std::shared_ptr<CudaDevice>(new CudaDevice());
  c->gpu_ = gpu;
  CUdevice dev = 0;
  if (const CUresult r = d.device_get(&dev, gpu); r != CUDA_SUCCESS)
    return Status::internal("cuda: cuDeviceGet(" + std::to_string(gpu) + ") failed (CUresult " +
                            std::to_string(r) + ")");
  if (const CUresult r = d.primary_ctx_retain(&c->ctx_, dev); r != CUDA_SUCCESS) {
    c->ctx_ = nullptr;
    return Status::unavailable("cuda: GPU " + std::to_string(gpu) +
                               "'s primary context cannot be had (CUresult " + std::to_string(r) + ")");
  }
  ContextGuard g(c->ctx_);
  KVSTASH_RETURN_IF_ERROR(g.status());
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, gpu) == cudaSuccess)
    c->sm_count_ = std::max(v, 1);
  // NIC writes need a flush before this GPU's kernels read them unless the GPU orders them
  // for its own consumers; checked once, not assumed from what a flush call answers.
  v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrGPUDirectRDMAWritesOrdering, gpu) == cudaSuccess)
    c->needs_flush_ = v < cudaGPUDirectRDMAWritesOrderingOwner;
  v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrGPUDirectRDMAFlushWritesOptions, gpu) == cudaSuccess)
    c->flush_memop_ = (v & cudaFlushGPUDirectRDMAWritesOptionMemOps) != 0;
  (void)cudaGetLastError();  // an attribute this GPU lacks leaves the defaults above
  c->lanes_.resize(lanes);
  for (Lane& lane : c->lanes_) {
    KVSTASH_RETURN_IF_ERROR(
        status(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "lane stream"));
    KVSTASH_RETURN_IF_ERROR(
        status(cudaEventCreateWithFlags(&lane.done, cudaEventDisableTiming), "lane event"));
    c->free_lanes_.push_back(&lane);
  }
  KVSTASH_RETURN_IF_ERROR(
      status(cudaStreamCreateWithFlags(&c->mark_stream_, cudaStreamNonBlocking), "mark stream"));
  return std::shared_ptr<KvDevice>(std::move(c));
}

namespace {

void free_staging(const Staging& s) {
  if (s.host != nullptr) cudaFreeHost(s.host);
  if (s.device != nullptr) cudaFree(s.device);
}

void destroy_slot(const Slot& slot) {
  free_staging(slot.counter);
  free_staging(slot.descriptors);
  free_staging(slot.digests);
  for (cudaEvent_t e : slot.events) cudaEventDestroy(e);
  if (slot.own != nullptr) cudaStreamDestroy(slot.own);
}

}  // namespace

CudaDevice::~CudaDevice() {
  if (ctx_ == nullptr) return;
  {
    ContextGuard g(ctx_);
    // Lanes and marks are idle: whatever used them held a reference to the device. Handover
    // slots that streams may still read (lost_slots_) are left allocated on purpose.
    for (Lane& lane : lanes_) {
      if (lane.stream != nullptr) cudaStreamSynchronize(lane.stream);
      free_staging(lane.descriptors);
      free_staging(lane.digests);
      if (lane.done != nullptr) cudaEventDestroy(lane.done);
      if (lane.stream != nullptr) cudaStreamDestroy(lane.stream);
    }
    for (const auto& slot : free_slots_) destroy_slot(*slot);
    for (const Staging& s : outgrown_) free_staging(s);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    if (mark_stream_ != nullptr) cudaStreamDestroy(mark_stream_);
    (void)cudaGetLastError();
  }
  CUdevice dev = 0;
  if (driver().device_get(&dev, gpu_) == CUDA_SUCCESS) (void)driver().primary_ctx_release(dev);
}

Status CudaDevice::grow(Staging& s, std::size_t bytes, bool device_copy) {
  if (s.bytes >= bytes && (!device_copy || s.device != nullptr)) return {};
  bytes = std::max(bytes, s.bytes * 2);
  Staging fresh;
  fresh.bytes = bytes;
  void* p = nullptr;
  KVSTASH_RETURN_IF_ERROR(status(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                                 "page-locked descriptors"));
  fresh.host = static_cast<std::byte*>(p);
  std::memset(fresh.host, 0, bytes);
  void* on_device = nullptr;
  if (Status st = status(cudaHostGetDevicePointer(&on_device, p, 0), "map descriptors"); !st.is_ok()) {
    cudaFreeHost(p);
    return st;
  }
  fresh.host_on_device = static_cast<std::byte*>(on_device);
  if (device_copy) {
    void* dp = nullptr;
    if (Status st = status(cudaMalloc(&dp, bytes), "device descriptors"); !st.is_ok()) {
      cudaFreeHost(p);
      return st;
    }
    fresh.device = static_cast<std::byte*>(dp);
  }
  std::lock_guard lock(mu_);
  if (s.host != nullptr || s.device != nullptr) outgrown_.push_back(s);
  s = fresh;
  return {};
}

Status CudaDevice::reserve(const KvDeviceSizes& sizes) {
  ContextGuard g(ctx_);
  KVSTASH_RETURN_IF_ERROR(g.status());
  const std::size_t pieces = sizes.runs_per_layer + pieces_of(sizes.layer_bytes);
  const std::size_t descriptors =
      std::max(pieces * sizeof(CopyPiece), sizes.runs_per_layer * sizeof(DigestRun) + sizeof(DigestSegment));
  const std::size_t digests = (sum::block_count(sizes.layer_bytes) + 1) * sizeof(std::uint64_t);
  // Every lane is held while they grow (another cache on this GPU may be using them).
  const Deadline deadline = deadline_after(std::chrono::seconds(30));
  std::vector<std::unique_ptr<LaneGuard>> held;
  for (std::size_t i = 0; i < lanes_.size(); ++i) {
    KVSTASH_ASSIGN_OR_RETURN(Lane * taken, take_lane(deadline));
    held.push_back(std::make_unique<LaneGuard>(*this, taken));
  }
  for (auto& lane : held) {
    KVSTASH_RETURN_IF_ERROR(grow((*lane)->descriptors, descriptors, true));
    KVSTASH_RETURN_IF_ERROR(grow((*lane)->digests, digests, false));
    lane->finished();
  }
  held.clear();
  // Two handovers' worth, for loads of `chunks` chunks on either path.
  const std::size_t per_layer =
      std::max(sizes.chunks * pieces * sizeof(CopyPiece),
               sizes.chunks * (sizes.runs_per_layer * sizeof(DigestRun) + sizeof(DigestSegment)));
  std::vector<std::unique_ptr<Slot>> made;
  for (int i = 0; i < 2; ++i) {
    KVSTASH_ASSIGN_OR_RETURN(
        auto slot, take_slot(per_layer * sizes.layers, sizes.chunks * sizes.layers * digests, sizes.layers));
    made.push_back(std::move(slot));
  }
  for (auto& slot : made) give_slot(std::move(slot), true);
  std::lock_guard lock(mu_);
  sizes_ = sizes;
  return {};
}

Result<Lane*> CudaDevice::take_lane(Deadline deadline) {
  std::unique_lock lock(mu_);
  for (;;) {
    // A parked lane comes back once its stream caught up (the caller's context is current).
    for (auto it = parked_lanes_.begin(); it != parked_lanes_.end();) {
      if (event_done((*it)->done)) {
        free_lanes_.push_back(*it);
        it = parked_lanes_.erase(it);
      } else {
        ++it;
      }
    }
    if (!free_lanes_.empty()) break;
    const auto step =
        parked_lanes_.empty() ? deadline : std::min(deadline, Clock::now() + std::chrono::milliseconds(1));
    if (lane_free_.wait_until(lock, step) == std::cv_status::timeout && Clock::now() >= deadline)
      return Status::timeout("cuda: every lane of the GPU was busy until the deadline");
  }
  Lane* lane = free_lanes_.back();
  free_lanes_.pop_back();
  return lane;
}

void CudaDevice::give_lane(Lane* lane, bool finished) {
  {
    std::lock_guard lock(mu_);
    (finished ? free_lanes_ : parked_lanes_).push_back(lane);
  }
  lane_free_.notify_one();
}

Status CudaDevice::run_on_lane(Lane& lane, int launched, Deadline deadline, const char* what) {
  // Recorded even after a failed launch: the upload before it must finish before the lane's
  // descriptors are written again.
  const cudaError_t recorded = cudaEventRecord(lane.done, lane.stream);
  KVSTASH_RETURN_IF_ERROR(status(static_cast<cudaError_t>(launched), what));
  KVSTASH_RETURN_IF_ERROR(status(recorded, what));
  return wait_event(lane.done, deadline, what);
}

Status CudaDevice::copy_on_lane(std::span<const KvRun> runs, const std::byte* host, bool to_host,
                                Deadline deadline) {
  ContextGuard g(ctx_);
  KVSTASH_RETURN_IF_ERROR(g.status());
  std::size_t count = 0;
  for (const KvRun& r : runs) count += pieces_of(r.length);
  KVSTASH_ASSIGN_OR_RETURN(Lane * taken, take_lane(deadline));
  LaneGuard lane(*this, taken);
  KVSTASH_RETURN_IF_ERROR(grow(lane->descriptors, count * sizeof(CopyPiece), true));
  auto* pieces = reinterpret_cast<CopyPiece*>(lane->descriptors.host);
  std::size_t n = 0;
  std::uint64_t at = 0;
  for (const KvRun& r : runs) {
    n += to_host ? write_pieces(r.addr, const_cast<std::byte*>(host) + at, r.length, pieces + n)
                 : write_pieces(host + at, r.addr, r.length, pieces + n);
    at += r.length;
  }
  const char* what = to_host ? "gather" : "scatter";
  const std::size_t bytes = n * sizeof(CopyPiece);
  if (bytes != 0) {
    KVSTASH_RETURN_IF_ERROR(status(cudaMemcpyAsync(lane->descriptors.device, lane->descriptors.host, bytes,
                                                   cudaMemcpyHostToDevice, lane->stream),
                                   "upload the copy's descriptors"));
  }
  const int launched = launch_copy(lane->descriptors.on_device<CopyPiece>(0), static_cast<std::uint32_t>(n),
                                   sm_count_, lane->stream);
  Status s = run_on_lane(*lane, launched, deadline, what);
  if (s.is_ok()) lane.finished();
  return s;
}

Status CudaDevice::gather(std::span<const KvRun> runs, std::byte* dst, Deadline deadline) {
  return copy_on_lane(runs, dst, true, deadline);
}

Status CudaDevice::scatter(const std::byte* src, std::span<const KvRun> runs, Deadline deadline) {
  return copy_on_lane(runs, src, false, deadline);
}

Status CudaDevice::flush_nic_writes() {
  return status(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                   cudaFlushGPUDirectRDMAWritesToOwner),
                "flush GPUDirect writes");
}

Result<std::uint64_t> CudaDevice::segment_sum(std::span<const KvRun> runs, bool nic_wrote,
                                              Deadline deadline) {
  ContextGuard g(ctx_);
  KVSTASH_RETURN_IF_ERROR(g.status());
  std::uint64_t length = 0;
  for (const KvRun& r : runs) length += r.length;
  const std::uint64_t blocks = sum::block_count(length);
  if (nic_wrote && needs_flush_) KVSTASH_RETURN_IF_ERROR(flush_nic_writes());
  KVSTASH_ASSIGN_OR_RETURN(Lane * taken, take_lane(deadline));
  LaneGuard lane(*this, taken);
  const std::size_t seg_at = runs.size() * sizeof(DigestRun);
  const std::size_t bytes = seg_at + sizeof(DigestSegment);
  KVSTASH_RETURN_IF_ERROR(grow(lane->descriptors, bytes, true));
  KVSTASH_RETURN_IF_ERROR(grow(lane->digests, (blocks + 1) * sizeof(std::uint64_t), false));
  auto* out = reinterpret_cast<DigestRun*>(lane->descriptors.host);
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    out[i] = {runs[i].addr, runs[i].length, at};
    at += runs[i].length;
  }
  auto* seg = reinterpret_cast<DigestSegment*>(lane->descriptors.host + seg_at);
  *seg = {lane->descriptors.on_device<DigestRun>(0), static_cast<std::uint32_t>(runs.size()), length,
          reinterpret_cast<std::uint64_t*>(lane->digests.host_on_device)};
  KVSTASH_RETURN_IF_ERROR(status(cudaMemcpyAsync(lane->descriptors.device, lane->descriptors.host, bytes,
                                                 cudaMemcpyHostToDevice, lane->stream),
                                 "upload the checksum's descriptors"));
  const int launched =
      launch_digests(lane->descriptors.on_device<DigestSegment>(seg_at), 1, length, sm_count_, lane->stream);
  KVSTASH_RETURN_IF_ERROR(run_on_lane(*lane, launched, deadline, "checksum"));
  lane.finished();
  // The digests landed in page-locked host memory; the fold is host work on host bytes.
  return sum::fold(reinterpret_cast<std::uint64_t*>(lane->digests.host), blocks, length);
}

Result<std::shared_ptr<std::byte>> CudaDevice::allocate_host(std::size_t bytes) {
  ContextGuard g(ctx_);
  KVSTASH_RETURN_IF_ERROR(g.status());
  void* p = nullptr;
  KVSTASH_RETURN_IF_ERROR(
      status(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "pinned bounce buffer"));
  // Freed with this GPU's context current, whichever thread drops the last reference.
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [self = shared_from_this()](std::byte* q) {
    ContextGuard fg(self->ctx_);
    cudaFreeHost(q);
  });
}

Status CudaDevice::usable(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &capturing);
  if (e != cudaSuccess) return engine_handle_status(e, what);
  if (capturing != cudaStreamCaptureStatusNone)
    return engine_handle_status(cudaErrorStreamCaptureUnsupported, what);
  return {};
}

Result<cudaEvent_t> CudaDevice::take_event() {
  {
    std::lock_guard lock(mu_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  KVSTASH_RETURN_IF_ERROR(status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event"));
  return e;
}

void CudaDevice::give_event(cudaEvent_t e) {
  std::lock_guard lock(mu_);
  free_events_.push_back(e);
}

Result<std::unique_ptr<KvDeviceMark>> CudaDevice::mark(const KvSync& after) {
  if (after.kind == KvSync::Kind::kNone) return std::unique_ptr<KvDeviceMark>(std::make_unique<PassedMark>());
  if (after.kind == KvSync::Kind::kEvent && after.handle == nullptr)
    return Status::invalid_argument(
        "kvcache: KvSync::event needs an event (KvSync::none() is nothing to wait for)");
  ContextGuard g(ctx_);
  KVSTASH_RETURN_IF_ERROR(g.status());
  KVSTASH_ASSIGN_OR_RETURN(cudaEvent_t e, take_event());
  auto mark = std::make_unique<CudaMark>(shared_from_this(), e);
  if (after.kind == KvSync::Kind::kStream) {
    // A null handle is the legacy default stream, as CUDA defines it (KvSync).
    auto stream = static_cast<cudaStream_t>(after.handle);
    KVSTASH_RETURN_IF_ERROR(usable(stream, "save_layer's stream"));
    KVSTASH_RETURN_IF_ERROR(engine_handle_status(cudaEventRecord(e, stream), "mark the engine's stream"));
  } else {
    // The engine may record its event again later: capture it as recorded now, on a stream of
    // ours that waits for it and records our own.
    std::lock_guard lock(mu_);
    KVSTASH_RETURN_IF_ERROR(
        engine_handle_status(cudaStreamWaitEvent(mark_stream_, static_cast<cudaEvent_t>(after.handle), 0),
                             "wait for the engine's event"));
    KVSTASH_RETURN_IF_ERROR(status(cudaEventRecord(e, mark_stream_), "mark"));
  }
  return std::unique_ptr<KvDeviceMark>(std::move(mark));
}

Result<std::shared_ptr<KvDevice>> cuda_device(int gpu, unsigned lanes) {
  return CudaDevice::create(gpu, lanes);
}

Result<int> device_of(const void* p) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not see it
    return status(e, "cudaPointerGetAttributes");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return Status::invalid_argument("cuda: not CUDA device memory");
  }
  return attr.device;
}

}  // namespace kvstash::cuda
