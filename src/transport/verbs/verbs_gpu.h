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
// The CUDA driver is loaded at run time (dlopen of libcuda.so.1), so binaries run on hosts
// without it. It also names the GPU that owns a device pointer (its PCI address), so that the
// transport can move that memory through the NICs nearest it. Thread safety: both functions
// may be called from any thread.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "kvstash/status.h"
#include "transport/verbs/verbs_device.h"

namespace kvstash::transport::verbs {

enum class GpuPath { kDmaBuf, kPeerMem, kStaging };
std::string_view to_string(GpuPath path);

struct GpuRegistration {
  Mr mr;
  GpuPath path = GpuPath::kStaging;
};

// Registers [dptr, dptr + length) of GPU memory on `pd` with `access`. dma-buf needs a range
// aligned to the host page size. Errors: kUnsupported when only staging is possible (the
// message says why each path was ruled out), kInvalidArgument for an empty range.
Result<GpuRegistration> register_gpu_memory(ibv_pd* pd, void* dptr, std::size_t length, int access);

// The PCI address of the GPU that owns device pointer `dptr`, as the driver prints it
// ("00000000:3B:00.0"; pci::parse_address reads it): cuPointerGetAttribute(DEVICE_ORDINAL),
// then cuDeviceGetPCIBusId. nullopt without a CUDA driver, for a pointer the driver does not
// know, or before the driver is initialized in this process.
std::optional<std::string> gpu_pci_bus_id(const void* dptr);

}  // namespace kvstash::transport::verbs
