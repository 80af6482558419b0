// The CUDA KvDevice. A few lanes, each a stream with its own descriptor buffer, checksum
// scratch and digest buffer; a copy or checksum takes a free lane, launches its kernels and
// waits for that stream alone, so the saver and loader threads' work overlaps on the GPU
// instead of taking turns.
#include "kvcache/cuda/cuda_device.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "common/checksum.h"
#include "kvcache/cuda/kernels.h"

namespace kvstash::cuda {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  std::string m = "cuda: ";
  m.append(what).append(": ").append(cudaGetErrorString(e));
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return Status::unavailable(std::move(m));
  return Status::internal(std::move(m));
}

// Polls an event until it completes or the deadline passes (cudaEventSynchronize cannot
// time out, and a stream that never reaches the event must not hold a saver thread forever).
Status wait_event(cudaEvent_t e, Deadline deadline) {
  for (auto pause = std::chrono::microseconds(2);;
       pause = std::min(pause * 2, std::chrono::microseconds(200))) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaSuccess) return {};
    if (q != cudaErrorNotReady) return cuda_status(q, "waiting for the engine's work");
    if (Clock::now() >= deadline) return Status::timeout("cuda: the engine's work did not finish in time");
    std::this_thread::sleep_for(pause);
  }
}

class CudaMark final : public KvDeviceMark {
 public:
  explicit CudaMark(cudaEvent_t e) : event_(e) {}
  ~CudaMark() override { cudaEventDestroy(event_); }
  Status wait(Deadline deadline) override { return wait_event(event_, deadline); }

 private:
  cudaEvent_t event_;
};

// cuStreamWaitValue32, from the driver through the runtime (no libcuda link).
using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
WaitValueFn wait_value_fn() {
  static WaitValueFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<WaitValueFn>(nullptr);
    }
    return reinterpret_cast<WaitValueFn>(p);
  }();
  return fn;
}

// Event i completes when the host's counter reaches i + 1: a private stream waits on the
// counter (in mapped pinned memory) before recording each event.
class CudaSignals final : public KvDeviceSignals {
 public:
  static Result<std::unique_ptr<KvDeviceSignals>> create(int gpu, std::size_t n) {
    WaitValueFn wait = wait_value_fn();
    if (wait == nullptr) return Status::unsupported("cuda: the driver has no stream memory operations");
    auto s = std::unique_ptr<CudaSignals>(new CudaSignals());
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(gpu), "select the GPU"));
    void* counter = nullptr;
    KVSTASH_RETURN_IF_ERROR(
        cuda_status(cudaHostAlloc(&counter, sizeof(std::uint32_t), cudaHostAllocMapped), "signal counter"));
    s->counter_ = static_cast<std::uint32_t*>(counter);
    *s->counter_ = 0;
    void* dev = nullptr;
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaHostGetDevicePointer(&dev, counter, 0), "signal counter"));
    KVSTASH_RETURN_IF_ERROR(
        cuda_status(cudaStreamCreateWithFlags(&s->stream_, cudaStreamNonBlocking), "signal stream"));
    s->events_.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      cudaEvent_t e = nullptr;
      KVSTASH_RETURN_IF_ERROR(
          cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "signal event"));
      s->events_.push_back(e);
      const CUresult r = wait(reinterpret_cast<CUstream>(s->stream_), reinterpret_cast<CUdeviceptr>(dev),
                              static_cast<cuuint32_t>(i + 1), CU_STREAM_WAIT_VALUE_GEQ);
      if (r != CUDA_SUCCESS)
        return Status::internal("cuda: cuStreamWaitValue32 failed (" + std::to_string(r) + ")");
      KVSTASH_RETURN_IF_ERROR(cuda_status(cudaEventRecord(e, s->stream_), "signal event"));
    }
    return std::unique_ptr<KvDeviceSignals>(std::move(s));
  }
  ~CudaSignals() override {
    complete_through(events_.size());
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);  // nothing reads the counter after
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (counter_ != nullptr) cudaFreeHost(counter_);
  }
  void* event(std::size_t i) const override { return events_.at(i); }
  void complete_through(std::size_t n) override {
    if (counter_ == nullptr) return;
    std::atomic_ref<std::uint32_t> c(*counter_);
    const auto want = static_cast<std::uint32_t>(n);
    if (want > c.load(std::memory_order_relaxed)) c.store(want, std::memory_order_release);
  }

 private:
  CudaSignals() = default;
  std::uint32_t* counter_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

class CudaDevice final : public KvDevice {
 public:
  static Result<std::shared_ptr<KvDevice>> create(int gpu, unsigned lanes) {
    if (lanes == 0) return Status::invalid_argument("cuda: a device needs at least one lane");
    auto c = std::shared_ptr<CudaDevice>(new CudaDevice());
    c->gpu_ = gpu;
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(gpu), "select the GPU"));
    c->lanes_.resize(lanes);
    for (Lane& lane : c->lanes_) {
      KVSTASH_RETURN_IF_ERROR(
          cuda_status(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "stream"));
      c->free_.push_back(&lane);
    }
    KVSTASH_RETURN_IF_ERROR(
        cuda_status(cudaStreamCreateWithFlags(&c->mark_stream_, cudaStreamNonBlocking), "stream"));
    return std::shared_ptr<KvDevice>(std::move(c));
  }
  ~CudaDevice() override {
    for (Lane& lane : lanes_) {
      if (lane.descriptors != nullptr) cudaFreeHost(lane.descriptors);
      if (lane.digests != nullptr) cudaFreeHost(lane.digests);
      if (lane.scratch != nullptr) cudaFree(lane.scratch);
      if (lane.stream != nullptr) cudaStreamDestroy(lane.stream);
    }
    if (mark_stream_ != nullptr) cudaStreamDestroy(mark_stream_);
  }

  std::string_view name() const override { return "cuda"; }

  Status gather(std::span<const KvRun> runs, std::byte* dst) override {
    LaneGuard lane(*this);
    KVSTASH_RETURN_IF_ERROR(lane->reserve(runs.size()));
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      lane->descriptors[i] = {runs[i].addr, dst + at, runs[i].length};
      at += runs[i].length;
    }
    KVSTASH_RETURN_IF_ERROR(copy(*lane, runs.size(), "gather"));
    return cuda_status(cudaStreamSynchronize(lane->stream), "gather");
  }

  Status scatter(const std::byte* src, std::span<const KvRun> runs) override {
    LaneGuard lane(*this);
    KVSTASH_RETURN_IF_ERROR(lane->reserve(runs.size()));
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      lane->descriptors[i] = {src + at, runs[i].addr, runs[i].length};
      at += runs[i].length;
    }
    KVSTASH_RETURN_IF_ERROR(copy(*lane, runs.size(), "scatter"));
    return cuda_status(cudaStreamSynchronize(lane->stream), "scatter");
  }

  Result<std::shared_ptr<std::byte>> allocate_host(std::size_t bytes) override {
    void* p = nullptr;
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(gpu_), "select the GPU"));
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                                        "pinned bounce buffer"));
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) { cudaFreeHost(q); });
  }

  Result<std::uint64_t> segment_sum(std::span<const KvRun> runs) override {
    std::uint64_t length = 0;
    for (const KvRun& r : runs) length += r.length;
    const std::uint64_t blocks = sum::block_count(length);
    LaneGuard lane(*this);
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(gpu_), "select the GPU"));
    // Bytes a NIC wrote into this GPU's memory (GPUDirect) are made visible to its kernels.
    // (A GPU whose NIC writes are ordered already may say the flush is not supported.)
    const cudaError_t flushed = cudaDeviceFlushGPUDirectRDMAWrites(
        cudaFlushGPUDirectRDMAWritesTargetCurrentDevice, cudaFlushGPUDirectRDMAWritesToOwner);
    if (flushed == cudaErrorNotSupported) cudaGetLastError();
    if (flushed != cudaErrorNotSupported)
      KVSTASH_RETURN_IF_ERROR(cuda_status(flushed, "flush GPUDirect writes"));
    KVSTASH_RETURN_IF_ERROR(lane->reserve_sum(length, blocks));
    // One run is summed in place; scattered runs are packed into the lane's scratch first
    // (device to device), since a 4 KiB block may span runs.
    const void* segment = runs.size() == 1 ? static_cast<const void*>(runs[0].addr) : lane->scratch;
    if (runs.size() > 1) {
      KVSTASH_RETURN_IF_ERROR(lane->reserve(runs.size()));
      std::uint64_t at = 0;
      for (std::size_t i = 0; i < runs.size(); ++i) {
        lane->descriptors[i] = {runs[i].addr, lane->scratch + at, runs[i].length};
        at += runs[i].length;
      }
      KVSTASH_RETURN_IF_ERROR(copy(*lane, runs.size(), "pack for the checksum"));
    }
    KVSTASH_RETURN_IF_ERROR(cuda_status(
        static_cast<cudaError_t>(launch_block_digests(segment, length, lane->digests_device, lane->stream)),
        "checksum"));
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(lane->stream), "checksum"));
    // The digests landed in mapped pinned memory; the fold over them is host work on host bytes.
    std::vector<std::uint64_t> words(lane->digests, lane->digests + blocks);
    return sum::fold_digests(std::move(words), length);
  }

  Result<std::unique_ptr<KvDeviceMark>> mark(const KvSync& after) override {
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(gpu_), "select the GPU"));
    cudaEvent_t e = nullptr;
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "mark"));
    auto mark = std::make_unique<CudaMark>(e);
    // An event is captured as recorded now (the engine may record it again later): a stream
    // of ours waits for it, and our own event marks that point.
    cudaStream_t on = static_cast<cudaStream_t>(after.stream);
    if (on == nullptr) {
      std::lock_guard lock(mark_mu_);
      if (after.event != nullptr) {
        KVSTASH_RETURN_IF_ERROR(
            cuda_status(cudaStreamWaitEvent(mark_stream_, static_cast<cudaEvent_t>(after.event), 0),
                        "wait for the event"));
      }
      KVSTASH_RETURN_IF_ERROR(cuda_status(cudaEventRecord(e, mark_stream_), "mark"));
    } else {
      if (after.event != nullptr)
        return Status::invalid_argument("kvcache: pass a stream or an event, not both");
      KVSTASH_RETURN_IF_ERROR(cuda_status(cudaEventRecord(e, on), "mark the engine's stream"));
    }
    return std::unique_ptr<KvDeviceMark>(std::move(mark));
  }

  Result<std::unique_ptr<KvDeviceSignals>> signals(std::size_t n) override {
    return CudaSignals::create(gpu_, n);
  }

  Status stream_wait(void* stream, void* event) override {
    return cuda_status(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "make the engine's stream wait");
  }

 private:
  struct Lane {
    cudaStream_t stream = nullptr;
    CopyRun* descriptors = nullptr;
    std::size_t capacity = 0;
    std::byte* scratch = nullptr;  // device memory a scattered segment is packed into
    std::uint64_t scratch_bytes = 0;
    std::uint64_t* digests = nullptr;  // mapped pinned memory the digest kernel writes
    std::uint64_t* digests_device = nullptr;
    std::uint64_t digest_capacity = 0;

    // Room for n descriptors in mapped pinned memory (the kernel reads them over PCIe).
    Status reserve(std::size_t n) {
      if (n <= capacity) return {};
      if (descriptors != nullptr) cudaFreeHost(descriptors);
      descriptors = nullptr;
      capacity = 0;
      void* p = nullptr;
      KVSTASH_RETURN_IF_ERROR(
          cuda_status(cudaHostAlloc(&p, n * sizeof(CopyRun), cudaHostAllocMapped), "descriptors"));
      descriptors = static_cast<CopyRun*>(p);
      capacity = n;
      return {};
    }
    // Room to pack `bytes` and to hold `blocks` digests.
    Status reserve_sum(std::uint64_t bytes, std::uint64_t blocks) {
      if (bytes > scratch_bytes) {
        if (scratch != nullptr) cudaFree(scratch);
        scratch = nullptr;
        scratch_bytes = 0;
        void* p = nullptr;
        KVSTASH_RETURN_IF_ERROR(cuda_status(cudaMalloc(&p, bytes), "checksum scratch"));
        scratch = static_cast<std::byte*>(p);
        scratch_bytes = bytes;
      }
      if (blocks > digest_capacity) {
        if (digests != nullptr) cudaFreeHost(digests);
        digests = nullptr;
        digest_capacity = 0;
        void* p = nullptr;
        KVSTASH_RETURN_IF_ERROR(
            cuda_status(cudaHostAlloc(&p, blocks * sizeof(std::uint64_t), cudaHostAllocMapped), "digests"));
        digests = static_cast<std::uint64_t*>(p);
        void* d = nullptr;
        KVSTASH_RETURN_IF_ERROR(cuda_status(cudaHostGetDevicePointer(&d, p, 0), "digests"));
        digests_device = static_cast<std::uint64_t*>(d);
        digest_capacity = blocks;
      }
      return {};
    }
  };

  // A lane held for one operation, returned to the free list on scope exit.
  class LaneGuard {
   public:
    explicit LaneGuard(CudaDevice& c) : c_(c) {
      std::unique_lock lock(c_.mu_);
      c_.cv_.wait(lock, [&] { return !c_.free_.empty(); });
      lane_ = c_.free_.back();
      c_.free_.pop_back();
    }
    ~LaneGuard() {
      {
        std::lock_guard lock(c_.mu_);
        c_.free_.push_back(lane_);
      }
      c_.cv_.notify_one();
    }
    LaneGuard(const LaneGuard&) = delete;
    LaneGuard& operator=(const LaneGuard&) = delete;
    Lane* operator->() const { return lane_; }
    Lane& operator*() const { return *lane_; }

   private:
    CudaDevice& c_;
    Lane* lane_ = nullptr;
  };

  CudaDevice() = default;

  // Launches the copy of the lane's first n descriptors (not waited for).
  Status copy(Lane& lane, std::size_t n, const char* what) {
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(gpu_), "select the GPU"));
    return cuda_status(static_cast<cudaError_t>(
                           launch_copy_runs(lane.descriptors, static_cast<std::uint32_t>(n), lane.stream)),
                       what);
  }

  int gpu_ = 0;
  std::vector<Lane> lanes_;  // sized once; free_ points into it
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Lane*> free_;
  std::mutex mark_mu_;  // mark_stream_ is shared by every caller of mark()
  cudaStream_t mark_stream_ = nullptr;
};

}  // namespace

Result<std::shared_ptr<KvDevice>> cuda_device(int gpu, unsigned lanes) {
  return CudaDevice::create(gpu, lanes);
}

Result<int> device_of(const void* p) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the error so later calls do not see it
    return cuda_status(e, "cudaPointerGetAttributes");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return Status::invalid_argument("cuda: not CUDA device memory");
  }
  return attr.device;
}

}  // namespace kvstash::cuda
