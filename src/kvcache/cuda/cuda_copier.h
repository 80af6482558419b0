// The CUDA DeviceCopier: a layer's scattered blocks packed into a page-locked bounce buffer
// (and back) by one launch of the copy_runs kernel, which reads GPU memory and writes the
// mapped host buffer over PCIe directly. In libkvstash_cuda (link kvstash_cuda_dep).
#pragma once

#include <memory>

#include "kvstash/kvcache.h"

namespace kvstash::cuda {

// A copier on GPU `device`. kUnavailable when there is no usable GPU or driver (the message
// says which), kInternal for other CUDA errors.
Result<std::shared_ptr<DeviceCopier>> cuda_copier(int device = 0);

}  // namespace kvstash::cuda
