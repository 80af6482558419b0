// The CUDA DeviceCopier. A few lanes, each a stream with its own descriptor buffer; a gather
// or scatter takes a free lane, launches one kernel over the runs (descriptors in mapped
// pinned memory the kernel reads directly) and waits for that stream alone, so the saver and
// loader threads' copies overlap on the GPU instead of taking turns.
#include "kvcache/cuda/cuda_copier.h"

#include <cuda_runtime.h>

#include <condition_variable>
#include <mutex>
#include <vector>

#include "kvcache/cuda/copy_runs.h"

namespace kvstash::cuda {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  std::string m = "cuda: ";
  m.append(what).append(": ").append(cudaGetErrorString(e));
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return Status::unavailable(std::move(m));
  return Status::internal(std::move(m));
}

class CudaCopier final : public DeviceCopier {
 public:
  static Result<std::shared_ptr<DeviceCopier>> create(int device, unsigned streams) {
    if (streams == 0) return Status::invalid_argument("cuda: a copier needs at least one stream");
    auto c = std::shared_ptr<CudaCopier>(new CudaCopier());
    c->device_ = device;
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "select the GPU"));
    c->lanes_.resize(streams);
    for (Lane& lane : c->lanes_) {
      KVSTASH_RETURN_IF_ERROR(
          cuda_status(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "stream"));
      c->free_.push_back(&lane);
    }
    return std::shared_ptr<DeviceCopier>(std::move(c));
  }
  ~CudaCopier() override {
    for (Lane& lane : lanes_) {
      if (lane.descriptors != nullptr) cudaFreeHost(lane.descriptors);
      if (lane.stream != nullptr) cudaStreamDestroy(lane.stream);
    }
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
    return run(*lane, runs.size(), "gather");
  }

  Status scatter(const std::byte* src, std::span<const KvRun> runs) override {
    LaneGuard lane(*this);
    KVSTASH_RETURN_IF_ERROR(lane->reserve(runs.size()));
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      lane->descriptors[i] = {src + at, runs[i].addr, runs[i].length};
      at += runs[i].length;
    }
    return run(*lane, runs.size(), "scatter");
  }

  Result<std::shared_ptr<std::byte>> allocate_host(std::size_t bytes) override {
    void* p = nullptr;
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "select the GPU"));
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                                        "pinned bounce buffer"));
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) { cudaFreeHost(q); });
  }

 private:
  struct Lane {
    cudaStream_t stream = nullptr;
    CopyRun* descriptors = nullptr;
    std::size_t capacity = 0;

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
  };

  // A lane held for one copy, returned to the free list on scope exit.
  class LaneGuard {
   public:
    explicit LaneGuard(CudaCopier& c) : c_(c) {
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
    CudaCopier& c_;
    Lane* lane_ = nullptr;
  };

  CudaCopier() = default;

  Status run(Lane& lane, std::size_t n, const char* what) {
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "select the GPU"));
    KVSTASH_RETURN_IF_ERROR(cuda_status(static_cast<cudaError_t>(launch_copy_runs(
                                            lane.descriptors, static_cast<std::uint32_t>(n), lane.stream)),
                                        what));
    return cuda_status(cudaStreamSynchronize(lane.stream), what);
  }

  int device_ = 0;
  std::vector<Lane> lanes_;  // sized once; free_ points into it
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Lane*> free_;
};

}  // namespace

Result<std::shared_ptr<DeviceCopier>> cuda_copier(int device, unsigned streams) {
  return CudaCopier::create(device, streams);
}

Result<int> device_of(const void* p) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls do not see it
    return cuda_status(e, "cudaPointerGetAttributes");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return Status::invalid_argument("cuda: not CUDA device memory");
  }
  return attr.device;
}

}  // namespace kvstash::cuda
