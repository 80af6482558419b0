// The CUDA KvDevice: a layer's scattered blocks packed into a page-locked bounce buffer (and
// back) by one launch of the copy kernel, which reads GPU memory and writes the mapped host
// buffer over PCIe directly; segment checksums computed by the digest kernel on the GPU; the
// engine's streams and events turned into marks the cache's threads wait for, and a load's
// layer readiness into events the engine's streams wait for (stream memory operations on a
// host-written counter). Built into libkvstash where the CUDA toolkit and nvcc are found
// (KVSTASH_HAVE_CUDA_KERNELS); link kvstash_cuda_dep.
#pragma once

#include <memory>

#include "kvstash/kvcache.h"

namespace kvstash::cuda {

// The device for GPU `gpu` (a CUDA ordinal) with `lanes` CUDA streams: that many copies and
// checksums (from the cache's saver and loader threads) run on the GPU at once, each one or
// two kernel launches. kUnavailable when there is no usable GPU or driver (the message says
// which), kInternal for other CUDA errors.
Result<std::shared_ptr<KvDevice>> cuda_device(int gpu, unsigned lanes = 4);

// The GPU that owns device memory `p`: kInvalidArgument when `p` is not CUDA device memory,
// kUnavailable without a GPU or driver.
Result<int> device_of(const void* p);

}  // namespace kvstash::cuda
