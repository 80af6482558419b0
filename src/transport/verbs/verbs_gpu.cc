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

// The CUDA driver entry points used, declared here so the build needs no CUDA headers.
// CUresult is an int; CUdeviceptr an unsigned long long; CUdevice an int.
using GetHandleFn = int (*)(void* handle, unsigned long long dptr, std::size_t size, int type,
                            unsigned long long flags);
using PointerGetAttributeFn = int (*)(void* data, int attribute, unsigned long long ptr);
using DeviceGetFn = int (*)(int* device, int ordinal);
using DeviceGetPciBusIdFn = int (*)(char* bus_id, int len, int device);
constexpr int kCuMemRangeHandleTypeDmaBufFd = 1;     // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
constexpr int kCuPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr int kCudaSuccess = 0;

// libcuda.so.1, or nullptr without a driver. Loaded once, never unloaded.
void* libcuda() {
  static void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  return lib;
}

template <typename Fn>
Fn driver_fn(const char* name) {
  void* lib = libcuda();
  return lib == nullptr ? nullptr : reinterpret_cast<Fn>(::dlsym(lib, name));
}

// The driver's export function, or nullptr (no driver, or older than 11.7). Looked up once.
GetHandleFn get_handle_fn() {
  static GetHandleFn fn = driver_fn<GetHandleFn>("cuMemGetHandleForAddressRange");
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

std::optional<std::string> gpu_pci_bus_id(const void* dptr) {
  static const auto attribute = driver_fn<PointerGetAttributeFn>("cuPointerGetAttribute");
  static const auto device_get = driver_fn<DeviceGetFn>("cuDeviceGet");
  static const auto bus_id = driver_fn<DeviceGetPciBusIdFn>("cuDeviceGetPCIBusId");
  if (dptr == nullptr || attribute == nullptr || device_get == nullptr || bus_id == nullptr)
    return std::nullopt;
  int ordinal = -1;
  int device = -1;
  char buf[32] = {};  // "00000000:3B:00.0" and its NUL fit
  if (attribute(&ordinal, kCuPointerAttributeDeviceOrdinal, reinterpret_cast<std::uintptr_t>(dptr)) !=
          kCudaSuccess ||
      ordinal < 0 || device_get(&device, ordinal) != kCudaSuccess ||
      bus_id(buf, static_cast<int>(sizeof buf), device) != kCudaSuccess) {
    return std::nullopt;
  }
  return std::string(buf);
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
