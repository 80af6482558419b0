// The CUDA DeviceCopier: a layer's scattered blocks packed into a page-locked bounce buffer
// (and back) by one launch of the copy_runs kernel, which reads GPU memory and writes the
// mapped host buffer over PCIe directly. Built into libkvstash where the CUDA toolkit and nvcc
// are found (KVSTASH_HAVE_CUDA_KERNELS); link kvstash_cuda_dep.
#pragma once

#include <memory>

#include "kvstash/kvcache.h"

namespace kvstash::cuda {

// A copier on GPU `device` with `streams` CUDA streams: that many gathers and scatters (from
// the cache's saver and loader threads) run on the GPU at once, each one kernel launch.
// kUnavailable when there is no usable GPU or driver (the message says which), kInternal for
// other CUDA errors.
Result<std::shared_ptr<DeviceCopier>> cuda_copier(int device = 0, unsigned streams = 4);

// The GPU that owns device memory `p`: kInvalidArgument when `p` is not CUDA device memory,
// kUnavailable without a GPU or driver.
Result<int> device_of(const void* p);

}  // namespace kvstash::cuda
