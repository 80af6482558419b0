#include "kvcache/cuda/cuda_api.h"

#include "common/cuda_floor.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace kvstash::cuda {
namespace {

// The CUDA version the driver functions are asked for: the CUDA 12.0 forms (what every driver
// from R525 on has; cuStreamWaitValue32 is its v2 there).
constexpr unsigned kDriverApiVersion = 12000;

template <typename Fn>
Fn entry_point(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(name, &p, kDriverApiVersion, cudaEnableDefault, &found);
#else
  const cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // a missing function is an answer, not the caller's error
    return nullptr;
  }
  return found == cudaDriverEntryPointSuccess ? reinterpret_cast<Fn>(p) : nullptr;
}

std::string version_text(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

}  // namespace

std::string driver_floor() { return cuda_driver_floor(CUDART_VERSION / 1000); }

Status check_driver() {
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
    (void)cudaGetLastError();
    return Status::unavailable("cuda: no NVIDIA driver is installed (cudaDriverGetVersion)");
  }
  if (driver / 1000 >= CUDART_VERSION / 1000) return {};
  return Status::unavailable(
      "cuda: the NVIDIA driver supports CUDA " + version_text(driver) + ", and this kvstash links the CUDA " +
      version_text(CUDART_VERSION) + " runtime, which needs " + driver_floor() +
      ": update the driver, or build kvstash with the CUDA toolkit your engine's torch uses "
      "(docs/operations.md, 'GPU drivers')");
}

Status status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  std::string m = "cuda: ";
  m.append(what).append(": ").append(cudaGetErrorString(e));
  if (e == cudaErrorInsufficientDriver) {
    Status floor = check_driver();
    return floor.is_ok() ? Status::unavailable(std::move(m)) : floor.with_context(m);
  }
  if (e == cudaErrorNoDevice) return Status::unavailable(std::move(m));
  return Status::internal(std::move(m));
}

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    x.wait_value32 = entry_point<decltype(x.wait_value32)>("cuStreamWaitValue32");
    x.ctx_get_current = entry_point<decltype(x.ctx_get_current)>("cuCtxGetCurrent");
    x.ctx_set_current = entry_point<decltype(x.ctx_set_current)>("cuCtxSetCurrent");
    x.device_get = entry_point<decltype(x.device_get)>("cuDeviceGet");
    x.primary_ctx_retain = entry_point<decltype(x.primary_ctx_retain)>("cuDevicePrimaryCtxRetain");
    x.primary_ctx_release = entry_point<decltype(x.primary_ctx_release)>("cuDevicePrimaryCtxRelease");
    x.device_get_attribute = entry_point<decltype(x.device_get_attribute)>("cuDeviceGetAttribute");
    return x;
  }();
  return d;
}

ContextGuard::ContextGuard(CUcontext ctx) {
  const Driver& d = driver();
  if (d.ctx_get_current == nullptr || d.ctx_set_current == nullptr) {
    status_ = Status::unavailable("cuda: the driver has no cuCtxGetCurrent/cuCtxSetCurrent");
    return;
  }
  if (d.ctx_get_current(&previous_) != CUDA_SUCCESS) previous_ = nullptr;
  if (previous_ == ctx) return;
  const CUresult r = d.ctx_set_current(ctx);
  if (r != CUDA_SUCCESS) {
    status_ = Status::internal("cuda: cuCtxSetCurrent failed (CUresult " + std::to_string(r) + ")");
    return;
  }
  rebound_ = true;
}

ContextGuard::~ContextGuard() {
  if (rebound_) (void)driver().ctx_set_current(previous_);
}

bool event_done(cudaEvent_t e) {
  const cudaError_t q = cudaEventQuery(e);
  if (q == cudaErrorNotReady) (void)cudaGetLastError();  // "not yet" is an answer, not an error
  return q != cudaErrorNotReady;
}

Status wait_event(cudaEvent_t e, Deadline deadline, const char* what) {
  for (auto pause = std::chrono::microseconds(2);;
       pause = std::min(pause * 2, std::chrono::microseconds(200))) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaSuccess) return {};
    if (q != cudaErrorNotReady) return status(q, what);
    (void)cudaGetLastError();  // clear the not-ready result where it was produced
    if (Clock::now() >= deadline)
      return Status::timeout(std::string("cuda: ") + what + ": not done by the deadline");
    std::this_thread::sleep_for(pause);
  }
}

}  // namespace kvstash::cuda
