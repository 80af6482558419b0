// The CUDA KvDevice: a layer's scattered blocks packed into a page-locked bounce buffer (and
// back) by one launch of the copy kernel, which reads GPU memory and writes the mapped host
// buffer over PCIe directly; segment checksums computed by the digest kernel on the GPU; the
// engine's streams and events turned into marks the cache's threads wait for; a load's
// layers handed to the engine's streams (cuda_handover.cc), each stream waiting on the GPU
// for a host-written counter alone and then placing or checking the layer itself. Built into
// libkvstash where the CUDA toolkit and nvcc are found (KVSTASH_HAVE_CUDA_KERNELS); the tests
// also link it against a CPU model of the CUDA runtime (tests/gpu/cuda_model).
#pragma once

#include <memory>

#include "kvstash/kvcache.h"

namespace kvstash::cuda {

// The device for GPU `gpu` (a CUDA ordinal) with `lanes` CUDA streams: that many copies and
// checksums (from the cache's saver and loader threads) run on the GPU at once, each one
// kernel launch. Errors as kvstash::cuda_device's (include/kvstash/kvcache.h).
Result<std::shared_ptr<KvDevice>> cuda_device(int gpu, unsigned lanes = 4);

// The GPU that owns device memory `p`: kInvalidArgument when `p` is not CUDA device memory,
// kUnavailable without a GPU or driver.
Result<int> device_of(const void* p);

}  // namespace kvstash::cuda
