// GPUDirect RDMA registration: lets the NIC read and write GPU memory directly.
//
// Paths, in order of preference:
// 1. dma-buf: the CUDA driver exports the range as a dma-buf fd
//    (cuMemGetHandleForAddressRange) and rdma-core registers it (ibv_reg_dmabuf_mr). Needs
//    CUDA driver >= 11.7, a kernel with dma-buf peer-to-peer and a NIC driver that takes it.
// 2. nvidia-peermem: the kernel module lets ibv_reg_mr take the device pointer itself.
// 3. staging: neither works; the caller copies through registered host memory. This module
//    only reports it (kUnsupported naming the path); the copy belongs to the KV-cache layer.
//
// The driver exports whole host pages only, so a range that is not page-aligned (an MLA cache
// with an odd block count, a buffer sized as SGLang's are) is exported rounded out to pages,
// within the pages of the allocation that holds it, and registered at its offset into that
// export. Memory mapped with the CUDA virtual-memory API (cuMemCreate + cuMemMap: PyTorch's
// expandable_segments) is one mapping per physical chunk: a range over several contiguous
// mappings is exported as one dma-buf; one over a hole is refused, naming the allocator setting.
//
// The CUDA driver is loaded at run time (dlopen of libcuda.so.1), so binaries run on hosts
// without it. It also names the GPU that owns a device pointer (its PCI address), so that the
// transport can move that memory through the NICs nearest it. Thread safety: every function
// may be called from any thread.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/fd.h"
#include "kvstash/status.h"
#include "transport/verbs/verbs_device.h"

namespace kvstash::transport::verbs {

enum class GpuPath { kDmaBuf, kPeerMem, kStaging };
std::string_view to_string(GpuPath path);

struct GpuRegistration {
  Mr mr;
  GpuPath path = GpuPath::kStaging;
};

// Registers [dptr, dptr + length) of GPU memory on `pd` with `access`, plus
// IBV_ACCESS_RELAXED_ORDERING (an optional flag: a device that does not do it ignores it). The
// MR is addressed by the caller's addresses (its iova is dptr) whatever the path. Any alignment.
// Errors: kUnsupported when only staging is possible (the message says why each path was ruled
// out, and names PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False where that is the cause),
// kInvalidArgument for an empty range. Blocks while the driver and the NIC register it.
Result<GpuRegistration> register_gpu_memory(ibv_pd* pd, void* dptr, std::size_t length, int access);

// The PCI address of the GPU that owns device pointer `dptr`, as the driver prints it
// ("00000000:3B:00.0"; pci::parse_address reads it): cuPointerGetAttribute(DEVICE_ORDINAL),
// then cuDeviceGetPCIBusId. nullopt without a CUDA driver, for a pointer the driver does not
// know, or before the driver is initialized in this process.
std::optional<std::string> gpu_pci_bus_id(const void* dptr);

// What is exported to register [addr, addr + length) through dma-buf.
struct DmaBufSpan {
  std::uint64_t start = 0;   // the first byte exported
  std::uint64_t length = 0;  // bytes exported
  std::uint64_t offset = 0;  // addr - start: where the caller's range begins in the export
};

// [page_floor(addr), page_ceil(addr + length)) for a range that lies inside the allocation
// [base, base + size) holding it (for virtual-memory mappings: the contiguous run of them), with
// `page` the host page size. The export is thus clamped to the pages the allocation occupies; a
// bound of the allocation that is not page-aligned is taken out to its page, since the driver
// exports whole pages only (and the MR still reaches only the range). Pure arithmetic,
// allocation-free. Errors (kInvalidArgument): an empty range, a range or allocation that wraps
// past 2^64 (or ends in its last page), a range not inside the allocation, a page size that is
// not a power of two.
Result<DmaBufSpan> dmabuf_span(std::uint64_t addr, std::uint64_t length, std::uint64_t base,
                               std::uint64_t size, std::uint64_t page);

// ---- the dma-buf path, step by step (register_gpu_memory takes them in turn) ---------------

// CUmemAllocationProp as cuda.h lays it out on 64-bit Linux (32 bytes, all the driver writes),
// with room to spare should a later driver write more. Only gpu_direct_rdma_capable is read.
struct CuMemAllocationProp {
  int type = 0;
  int requested_handle_types = 0;
  int location_type = 0;
  int location_id = 0;
  void* win32_handle_meta_data = nullptr;
  unsigned char compression_type = 0;
  unsigned char gpu_direct_rdma_capable = 0;  // allocFlags.gpuDirectRDMACapable
  unsigned short usage = 0;
  unsigned char reserved[4] = {};
  unsigned char spare[32] = {};
};

// The CUDA driver entry points the dma-buf path calls, with cuda.h's signatures (CUresult is an
// int; CUdeviceptr and CUmemGenericAllocationHandle are unsigned long long), so that the build
// needs no CUDA headers; nullptr where the driver lacks one.
struct CudaDriver {
  int (*mem_get_address_range)(unsigned long long* base, std::size_t* size,
                               unsigned long long dptr) = nullptr;  // cuMemGetAddressRange_v2
  int (*mem_retain_allocation_handle)(unsigned long long* handle, void* addr) = nullptr;
  int (*mem_get_allocation_properties_from_handle)(CuMemAllocationProp* prop,
                                                   unsigned long long handle) = nullptr;
  int (*mem_release)(unsigned long long handle) = nullptr;
  int (*mem_get_handle_for_address_range)(void* handle, unsigned long long dptr, std::size_t size, int type,
                                          unsigned long long flags) = nullptr;  // CUDA >= 11.7
  int (*get_error_name)(int error, const char** name) = nullptr;
};

// libcuda.so.1's entry points, looked up on first use (dlopen; never unloaded); every one
// nullptr without a driver.
const CudaDriver& cuda_driver();

// What the dma-buf path exports for a range, from what the driver says of the memory there.
struct DmaBufPlan {
  DmaBufSpan span;
  std::size_t mappings = 1;          // virtual-memory mappings the range runs over (1: cudaMalloc memory)
  bool vmm = false;                  // mapped with cuMemCreate + cuMemMap (PyTorch's expandable segments)
  std::optional<bool> rdma_capable;  // such memory's allocFlags.gpuDirectRDMACapable, if known
};

// Where [addr, addr + length) lives, asked of `driver`: the allocation holding it
// (cuMemGetAddressRange); for virtual-memory mappings, which cuMemRetainAllocationHandle alone
// accepts, the run of mappings that follow one another from the one holding `addr` (the driver
// reports one mapping, one physical chunk, at a time); then dmabuf_span over that. Errors
// (kUnsupported, saying why): the entry points missing, an address the driver does not know, a
// virtual-memory range with a hole (naming PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False),
// a range past the cudaMalloc allocation holding its start, dmabuf_span's refusals.
Result<DmaBufPlan> plan_dmabuf(const CudaDriver& driver, std::uint64_t addr, std::uint64_t length,
                               std::uint64_t page);

// Exports `plan.span` as a dma-buf (cuMemGetHandleForAddressRange, DMA_BUF_FD, no flags).
// kUnsupported when the driver refuses, naming its CUresult and, for a range over several
// virtual-memory mappings, the allocator setting; for such memory the driver did not make
// GPUDirect-RDMA capable, that.
Result<UniqueFd> export_dmabuf(const CudaDriver& driver, const DmaBufPlan& plan);

// pick_lane (verbs_device.h) among the lanes on which the peer's key is valid: a peer registers
// GPU memory only on the NICs nearest its GPU, so only the lanes to those devices can reach it.
// `keyed` has bit i set for each such lane i (lanes from the 65th on cannot be named, so they are
// never picked). The keyed lanes on `preferred` devices take the engine's lanes in turn, else
// every keyed lane does. Allocates nothing: called on the datapath. Precondition: `keyed` names
// at least one of the lanes (when it names none, lane `lane` modulo the lanes).
std::size_t pick_keyed_lane(std::span<const std::size_t> lane_devices, std::uint64_t preferred,
                            std::uint64_t keyed, std::uint32_t lane);

}  // namespace kvstash::transport::verbs
