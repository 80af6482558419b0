// The CUDA DeviceCopier. One stream; a gather or scatter is one kernel launch over the runs
// (descriptors in mapped pinned memory the kernel reads directly), then a stream sync. Calls
// from several threads take turns (one stream, one descriptor buffer).
#include "kvcache/cuda/cuda_copier.h"

#include <cuda_runtime.h>

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
  static Result<std::shared_ptr<DeviceCopier>> create(int device) {
    auto c = std::shared_ptr<CudaCopier>(new CudaCopier());
    c->device_ = device;
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "select the GPU"));
    KVSTASH_RETURN_IF_ERROR(
        cuda_status(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking), "stream"));
    return std::shared_ptr<DeviceCopier>(std::move(c));
  }
  ~CudaCopier() override {
    if (descriptors_ != nullptr) cudaFreeHost(descriptors_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda"; }

  Status gather(std::span<const KvRun> runs, std::byte* dst) override {
    std::lock_guard lock(mu_);
    KVSTASH_RETURN_IF_ERROR(reserve(runs.size()));
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      descriptors_[i] = {runs[i].addr, dst + at, runs[i].length};
      at += runs[i].length;
    }
    return run(runs.size(), "gather");
  }

  Status scatter(const std::byte* src, std::span<const KvRun> runs) override {
    std::lock_guard lock(mu_);
    KVSTASH_RETURN_IF_ERROR(reserve(runs.size()));
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      descriptors_[i] = {src + at, runs[i].addr, runs[i].length};
      at += runs[i].length;
    }
    return run(runs.size(), "scatter");
  }

  Result<std::shared_ptr<std::byte>> allocate_host(std::size_t bytes) override {
    void* p = nullptr;
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "select the GPU"));
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                                        "pinned bounce buffer"));
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) { cudaFreeHost(q); });
  }

 private:
  CudaCopier() = default;

  // Room for n descriptors in mapped pinned memory (the kernel reads them over PCIe).
  Status reserve(std::size_t n) {
    if (n <= capacity_) return {};
    if (descriptors_ != nullptr) cudaFreeHost(descriptors_);
    descriptors_ = nullptr;
    capacity_ = 0;
    void* p = nullptr;
    KVSTASH_RETURN_IF_ERROR(
        cuda_status(cudaHostAlloc(&p, n * sizeof(CopyRun), cudaHostAllocMapped), "descriptors"));
    descriptors_ = static_cast<CopyRun*>(p);
    capacity_ = n;
    return {};
  }

  Status run(std::size_t n, const char* what) {
    KVSTASH_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "select the GPU"));
    KVSTASH_RETURN_IF_ERROR(cuda_status(
        static_cast<cudaError_t>(launch_copy_runs(descriptors_, static_cast<std::uint32_t>(n), stream_)),
        what));
    return cuda_status(cudaStreamSynchronize(stream_), what);
  }

  std::mutex mu_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  CopyRun* descriptors_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace

Result<std::shared_ptr<DeviceCopier>> cuda_copier(int device) { return CudaCopier::create(device); }

}  // namespace kvstash::cuda
