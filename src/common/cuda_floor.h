// The oldest NVIDIA driver a CUDA runtime of a given major version runs on, as operators read
// it (branch numbers, as nvidia-smi prints them). NVIDIA's CUDA Compatibility guide: a CUDA 12.x
// runtime runs on R525 and newer by minor version compatibility; CUDA 13.x needs R580. Shared by
// the CUDA device (src/kvcache/cuda, which refuses an older driver naming it) and
// `kvstash doctor`, which needs no CUDA headers.
#pragma once

#include <string>

namespace kvstash {

inline std::string cuda_driver_floor(int cuda_major) {
  switch (cuda_major) {
    case 13: return "R580 or newer (drivers for CUDA 13.0)";
    case 12: return "R525 or newer (drivers for CUDA 12.0, by CUDA's minor version compatibility)";
    case 11: return "R450 or newer (drivers for CUDA 11.0, by CUDA's minor version compatibility)";
    default: return "a driver for CUDA " + std::to_string(cuda_major) + ".0 or newer";
  }
}

}  // namespace kvstash
