#include "transport/verbs/verbs_gpu.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

namespace kvstash::transport::verbs {
namespace {

// The two CUDA driver entry points used, declared here so the build needs no CUDA headers.
// CUresult is an int; CUdeviceptr an unsigned long long.
using GetHandleFn = int (*)(void* handle, unsigned long long dptr, std::size_t size, int type,
                            unsigned long long flags);
constexpr int kCuMemRangeHandleTypeDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
constexpr int kCudaSuccess = 0;

// The driver's export function, or nullptr (no driver, or older than 11.7). Loaded once.
GetHandleFn get_handle_fn() {
  static GetHandleFn fn = [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib == nullptr ? nullptr
                          : reinterpret_cast<GetHandleFn>(::dlsym(lib, "cuMemGetHandleForAddressRange"));
  }();
  return fn;
}

bool peermem_loaded() {
  struct stat st {};
  return ::stat("/sys/module/nvidia_peermem", &st) == 0 || ::stat("/sys/module/nv_peer_mem", &st) == 0;
}

}  // namespace

std::string_view to_string(GpuPath path) {
  switch (path) {
    case GpuPath::kDmaBuf: return "dma-buf";
    case GpuPath::kPeerMem: return "nvidia-peermem";
    case GpuPath::kStaging: return "staging";
  }
  return "?";
}

Result<GpuRegistration> register_gpu_memory(ibv_pd* pd, void* dptr, std::size_t length, int access) {
  if (dptr == nullptr || length == 0) return Status::invalid_argument("verbs: empty GPU range");
  std::string why = "verbs: GPUDirect unavailable, use the staging path (";

  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto addr = reinterpret_cast<std::uintptr_t>(dptr);
  if (GetHandleFn fn = get_handle_fn(); fn == nullptr) {
    why += "dma-buf: no CUDA driver with cuMemGetHandleForAddressRange; ";
  } else if (addr % page != 0 || length % page != 0) {
    why += "dma-buf: the range is not page-aligned; ";
  } else {
    int fd = -1;
    int rc = fn(&fd, addr, length, kCuMemRangeHandleTypeDmaBufFd, 0);
    if (rc != kCudaSuccess || fd < 0) {
      why += "dma-buf: the driver refused to export the range (CUresult " + std::to_string(rc) + "); ";
    } else {
      Mr mr(ibv_reg_dmabuf_mr(pd, 0, length, addr, fd, access));
      int e = errno;
      ::close(fd);  // the MR holds its own reference to the dma-buf
      if (mr) return GpuRegistration{std::move(mr), GpuPath::kDmaBuf};
      why += "dma-buf: ibv_reg_dmabuf_mr failed (" + std::string(std::strerror(e)) + "); ";
    }
  }

  if (!peermem_loaded()) {
    why += "nvidia-peermem: module not loaded)";
    return Status::unsupported(std::move(why));
  }
  Mr mr(ibv_reg_mr(pd, dptr, length, access));
  if (mr) return GpuRegistration{std::move(mr), GpuPath::kPeerMem};
  why += "nvidia-peermem: ibv_reg_mr failed (" + std::string(std::strerror(errno)) + "))";
  return Status::unsupported(std::move(why));
}

}  // namespace kvstash::transport::verbs
