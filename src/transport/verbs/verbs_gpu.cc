#include "transport/verbs/verbs_gpu.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstring>
#include <limits>
#include <string>

#include "common/fd.h"
#include "common/log.h"
#include "common/runtime_library.h"

namespace kvstash::transport::verbs {
namespace {

// The entry points that name a GPU, declared here so the build needs no CUDA headers.
using PointerGetAttributeFn = int (*)(void* data, int attribute, unsigned long long ptr);
using DeviceGetFn = int (*)(int* device, int ordinal);
using DeviceGetPciBusIdFn = int (*)(char* bus_id, int len, int device);
constexpr int kCuMemRangeHandleTypeDmaBufFd = 1;     // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
constexpr int kCuPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr int kCudaSuccess = 0;
static_assert(offsetof(CuMemAllocationProp, gpu_direct_rdma_capable) == 25, "cuda.h's layout");

// What an allocator setting that maps memory in chunks can do about a refusal.
constexpr std::string_view kExpandableHint =
    "(PyTorch maps its expandable segments so: register memory allocated with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or let the KV-cache layer stage it)";

// libcuda.so.1 (unavailable without a driver). Loaded once, never unloaded.
const sys::RuntimeLibrary& libcuda() {
  static const sys::RuntimeLibrary lib({"libcuda.so.1"}, "install the NVIDIA driver");
  return lib;
}

template <typename Fn>
void load(Fn& fn, const char* name) {
  fn = libcuda().function<Fn>(name);
}

std::string cu_error(const CudaDriver& d, int rc) {
  const char* name = nullptr;
  if (d.get_error_name != nullptr && d.get_error_name(rc, &name) == kCudaSuccess && name != nullptr)
    return name;
  return "CUresult " + std::to_string(rc);
}

std::string hex(std::uint64_t v) {
  char buf[2 + 16] = {'0', 'x'};
  auto [end, ec] = std::to_chars(buf + 2, buf + sizeof buf, v, 16);
  return std::string(buf, end);
}

std::uint64_t page_size() {
  static const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

bool peermem_loaded() {
  struct stat st {};
  return ::stat("/sys/module/nvidia_peermem", &st) == 0 || ::stat("/sys/module/nv_peer_mem", &st) == 0;
}

// Registers with IBV_ACCESS_RELAXED_ORDERING: the NIC's writes into GPU memory may then pass one
// another on PCIe, which some root complexes and switches need to take them at line rate (NCCL
// registers GPU memory so too). A completion is still written in order and cannot pass the data
// it reports, and nothing here reads memory an op is writing before that op completed. The flag
// is optional (IBV_ACCESS_OPTIONAL_RANGE): rdma-core drops it for a kernel that predates optional
// flags on the ibv_reg_mr path (ibv_reg_mr_iova2), and drivers ignore the optional flags they do
// not do; ibv_reg_dmabuf_mr passes it through as is, which every kernel with dma-buf MRs
// (5.12+) takes. Should a driver refuse it all the same (EINVAL), the MR is registered without.
template <typename Register>
Mr register_relaxed(Register reg, int access) {
  Mr mr(reg(access | IBV_ACCESS_RELAXED_ORDERING));
  if (!mr && errno == EINVAL) mr.reset(reg(access));
  return mr;
}

// The dma-buf path; nullptr with the reason appended to `why` when it cannot be taken.
Mr register_dmabuf(ibv_pd* pd, std::uint64_t addr, std::uint64_t length, int access, std::string& why) {
  const CudaDriver& d = cuda_driver();
  Result<DmaBufPlan> plan = plan_dmabuf(d, addr, length, page_size());
  Result<UniqueFd> fd = plan.is_ok() ? export_dmabuf(d, *plan) : Result<UniqueFd>(plan.status());
  if (!fd.is_ok()) {
    why += "dma-buf: " + fd.status().message() + "; ";
    return nullptr;
  }
  // The MR starts at the range's offset into the export and has the caller's addresses as its
  // iova; the fd is closed on return, the MR holding its own reference to the dma-buf.
  Mr mr = register_relaxed(
      [&](int a) { return ibv_reg_dmabuf_mr(pd, plan->span.offset, length, addr, fd->get(), a); }, access);
  if (!mr) {
    why += "dma-buf: ibv_reg_dmabuf_mr failed (" + std::string(std::strerror(errno)) + "); ";
    return nullptr;
  }
  // libibverbs leaves a dma-buf MR's addr at the dma-buf offset; the transport reads a region's
  // base from mr->addr as it does for ibv_reg_mr's (leases check their ranges against it), so it
  // is set to the address the MR is reached by. Safe: nothing in libibverbs reads it back for a
  // dma-buf MR (ibv_dereg_mr uses it only for IBV_MR_TYPE_MR).
  mr->addr = reinterpret_cast<void*>(addr);
  if (plan->mappings > 1) {
    KVSTASH_LOG_DEBUG("verbs: GPU range {} (+{}) spans {} virtual-memory mappings: one dma-buf", hex(addr),
                      length, plan->mappings);
  }
  return mr;
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

const CudaDriver& cuda_driver() {
  // The exported names: cuda.h maps cuMemGetAddressRange to cuMemGetAddressRange_v2 (since CUDA
  // 3.2); the others were never versioned.
  static const CudaDriver d = [] {
    CudaDriver d;
    load(d.mem_get_address_range, "cuMemGetAddressRange_v2");
    load(d.mem_retain_allocation_handle, "cuMemRetainAllocationHandle");
    load(d.mem_get_allocation_properties_from_handle, "cuMemGetAllocationPropertiesFromHandle");
    load(d.mem_release, "cuMemRelease");
    load(d.mem_get_handle_for_address_range, "cuMemGetHandleForAddressRange");
    load(d.get_error_name, "cuGetErrorName");
    return d;
  }();
  return d;
}

Result<DmaBufPlan> plan_dmabuf(const CudaDriver& d, std::uint64_t addr, std::uint64_t length,
                               std::uint64_t page) {
  if (d.mem_get_handle_for_address_range == nullptr || d.mem_get_address_range == nullptr)
    return Status::unsupported("no CUDA driver with cuMemGetHandleForAddressRange");
  unsigned long long base = 0;
  std::size_t size = 0;
  if (int rc = d.mem_get_address_range(&base, &size, addr); rc != kCudaSuccess)
    return Status::unsupported("the driver knows no allocation at " + hex(addr) + " (" + cu_error(d, rc) +
                               ")");
  DmaBufPlan plan;
  // Memory mapped with cuMemMap: cuMemRetainAllocationHandle takes any address inside such a
  // mapping and refuses every other (cudaMalloc) address. The handle tells whether the allocation
  // was made GPUDirect-RDMA capable (which some platforms require, and PyTorch asks for only
  // where the device reports GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED).
  if (unsigned long long handle = 0;
      d.mem_retain_allocation_handle != nullptr && d.mem_release != nullptr &&
      d.mem_retain_allocation_handle(&handle, reinterpret_cast<void*>(addr)) == kCudaSuccess) {
    plan.vmm = true;
    CuMemAllocationProp prop;
    if (d.mem_get_allocation_properties_from_handle != nullptr &&
        d.mem_get_allocation_properties_from_handle(&prop, handle) == kCudaSuccess) {
      plan.rdma_capable = prop.gpu_direct_rdma_capable != 0;
    }
    d.mem_release(handle);  // the retain took a reference; the mapping holds its own
  }
  // Virtual-memory mappings are one per physical chunk (PyTorch's expandable segments grow by
  // 20 MiB ones), and cuMemGetAddressRange reports only the chunk holding the address, so a
  // range over several is taken as the run of mappings that follow one another without a hole.
  // The driver exports such a run as one dma-buf: cuda.h allows a reserved range that is mapped
  // whole, its physical allocations on one device with identical properties (and Mooncake #3538,
  // UCX #11461, libfabric #12473, torchcomms #3078 rely on it).
  const std::uint64_t end = addr + length;
  std::uint64_t run_end = base + size;
  while (plan.vmm && run_end < end && run_end > base) {
    unsigned long long next = 0;
    std::size_t next_size = 0;
    if (d.mem_get_address_range(&next, &next_size, run_end) != kCudaSuccess || next != run_end ||
        next_size == 0) {
      return Status::unsupported("the range is mapped in virtual-memory chunks with a hole at " +
                                 hex(run_end) + " " + std::string(kExpandableHint));
    }
    run_end = next + next_size;
    ++plan.mappings;
  }
  Result<DmaBufSpan> span = dmabuf_span(addr, length, base, run_end - base, page);
  if (!span.is_ok()) {
    std::string_view why = span.status().message();
    if (why.starts_with("verbs: ")) why.remove_prefix(7);
    return Status::unsupported(std::string(why));
  }
  plan.span = *span;
  return plan;
}

Result<UniqueFd> export_dmabuf(const CudaDriver& d, const DmaBufPlan& plan) {
  if (d.mem_get_handle_for_address_range == nullptr)
    return Status::unsupported("no CUDA driver with cuMemGetHandleForAddressRange");
  int fd = -1;
  const int rc = d.mem_get_handle_for_address_range(&fd, plan.span.start, plan.span.length,
                                                    kCuMemRangeHandleTypeDmaBufFd, 0);
  UniqueFd owned(fd);
  if (rc == kCudaSuccess && owned.valid()) return owned;
  std::string why = "the driver refused to export " + std::to_string(plan.span.length) + " bytes at " +
                    hex(plan.span.start) + " (" + cu_error(d, rc) + ")";
  if (plan.mappings > 1) {
    why.append(", a range over ").append(std::to_string(plan.mappings));
    why.append(" virtual-memory mappings (they must be on one device, with identical properties) ");
    why.append(kExpandableHint);
  } else if (plan.vmm && plan.rdma_capable == false) {
    why +=
        ", virtual-memory mapped and not made GPUDirect-RDMA capable "
        "(CUmemAllocationProp::allocFlags.gpuDirectRDMACapable)";
  }
  return Status::unsupported(std::move(why));
}

Result<DmaBufSpan> dmabuf_span(std::uint64_t addr, std::uint64_t length, std::uint64_t base,
                               std::uint64_t size, std::uint64_t page) {
  if (length == 0) return Status::invalid_argument("verbs: empty GPU range");
  if (page == 0 || (page & (page - 1)) != 0)
    return Status::invalid_argument("verbs: page size " + std::to_string(page) + " is not a power of two");
  if (addr + length < addr || base + size < base)
    return Status::invalid_argument("verbs: a GPU range past the end of the address space");
  const std::uint64_t end = addr + length;
  const std::uint64_t alloc_end = base + size;
  if (addr < base || end > alloc_end) {
    return Status::invalid_argument("verbs: the range " + hex(addr) + " (+" + std::to_string(length) +
                                    ") runs past the CUDA allocation " + hex(base) + " (+" +
                                    std::to_string(size) + ") that holds its start");
  }
  // Rounded out to whole pages, within the pages the allocation occupies. Why that range is
  // valid to export, even where it reaches past a bound of the allocation that is not
  // page-aligned: cuMemGetHandleForAddressRange takes only a dptr and a size aligned to the host
  // page (cuda.h says so), and CUDA maps device memory, and the virtual addresses for it, in
  // units of its allocation granularity (2 MiB on current GPUs; cuMemCreate and cuMemMap take
  // only multiples of it; small cudaMallocs are packed into such chunks), which is a multiple of
  // the host page. So a page that holds any byte of an allocation is mapped device memory whole,
  // and the export is too. Allocations as PyTorch, SGLang and vLLM make them start and end on
  // such boundaries anyway, and rounding out changes nothing there. Stopping the export at an
  // unaligned allocation end instead would ask for a size the driver refuses. Bytes the export
  // holds outside [addr, addr + length) are not reachable through the MR: it is registered at
  // `offset` into the export for `length` bytes only.
  const std::uint64_t start = addr & ~(page - 1);
  const std::uint64_t tail = end & (page - 1);
  if (tail != 0 && end > std::numeric_limits<std::uint64_t>::max() - (page - tail))
    return Status::invalid_argument("verbs: a GPU range in the last page of the address space");
  const std::uint64_t stop = tail == 0 ? end : end + (page - tail);
  return DmaBufSpan{start, stop - start, addr - start};
}

std::size_t pick_keyed_lane(std::span<const std::size_t> lane_devices, std::uint64_t preferred,
                            std::uint64_t keyed, std::uint32_t lane) {
  const std::size_t lanes = std::min<std::size_t>(lane_devices.size(), 64);
  auto is_keyed = [&](std::size_t i) { return (keyed >> i & 1) != 0; };
  auto is_preferred = [&](std::size_t i) {
    const std::size_t dev = lane_devices[i];
    return dev < 64 && (preferred >> dev & 1) != 0;
  };
  std::size_t n_keyed = 0, n_preferred = 0;
  for (std::size_t i = 0; i < lanes; ++i) {
    n_keyed += is_keyed(i);
    n_preferred += is_keyed(i) && is_preferred(i);
  }
  if (n_keyed == 0) return lane % lane_devices.size();
  // The keyed lanes on preferred devices when there are some, else every keyed lane.
  const bool by_preference = n_preferred > 0;
  std::size_t k = lane % (by_preference ? n_preferred : n_keyed);
  for (std::size_t i = 0; i < lanes; ++i) {
    if (is_keyed(i) && (!by_preference || is_preferred(i)) && k-- == 0) return i;
  }
  return lane % lane_devices.size();  // not reached
}

std::optional<std::string> gpu_pci_bus_id(const void* dptr) {
  static const auto attribute = libcuda().function<PointerGetAttributeFn>("cuPointerGetAttribute");
  static const auto device_get = libcuda().function<DeviceGetFn>("cuDeviceGet");
  static const auto bus_id = libcuda().function<DeviceGetPciBusIdFn>("cuDeviceGetPCIBusId");
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
  if (Mr mr = register_dmabuf(pd, reinterpret_cast<std::uintptr_t>(dptr), length, access, why))
    return GpuRegistration{std::move(mr), GpuPath::kDmaBuf};

  if (!peermem_loaded()) {
    why += "nvidia-peermem: module not loaded)";
    return Status::unsupported(std::move(why));
  }
  Mr mr = register_relaxed([&](int a) { return ibv_reg_mr(pd, dptr, length, a); }, access);
  if (mr) return GpuRegistration{std::move(mr), GpuPath::kPeerMem};
  why += "nvidia-peermem: ibv_reg_mr failed (" + std::string(std::strerror(errno)) + "))";
  return Status::unsupported(std::move(why));
}

}  // namespace kvstash::transport::verbs
