// Private to src/kvcache/cuda: how the CUDA device talks to the CUDA runtime and driver.
//
// - status(): a cudaError_t as a Status (kUnavailable for no GPU or an old driver, kInternal
//   otherwise), naming the call.
// - Driver: the driver entry points the device needs (stream memory operations and context
//   binding), through the runtime (no link against libcuda), looked up once.
// - ContextGuard: makes a GPU's primary context current for one call and restores the
//   caller's binding exactly (even "none"), so that no thread gains a context on another GPU
//   and the caller's current device is left as it was. cudaSetDevice cannot do that: setting
//   the caller's device back would create a context there if it had none.
// - wait_event(): polls an event up to a deadline, clearing the not-ready result from the
//   thread's last error (a query that says "not yet" records cudaErrorNotReady there, and a
//   later `kernel<<<>>>; cudaGetLastError()` anywhere on the thread would report it).
// - driver_floor(): the oldest driver the linked runtime runs on, as users read it.
//
// Thread safety: everything here may be called from any thread.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::cuda {

// OK for cudaSuccess; else "cuda: <what>: <CUDA's message>", kUnavailable for no device or an
// insufficient driver (with the driver floor), kInternal otherwise. Does not touch the
// thread's last error.
Status status(cudaError_t e, const char* what);

// The driver functions the device calls, or a null member where the driver lacks one.
struct Driver {
  CUresult (*wait_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*primary_ctx_release)(CUdevice) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
};
// Looked up once, on the first call. Missing context functions make cuda_device() fail
// (kUnavailable); a missing wait_value32 makes only the stream handover kUnsupported.
const Driver& driver();

// Binds `ctx` to the calling thread for the guard's life, then restores what was bound.
class ContextGuard {
 public:
  explicit ContextGuard(CUcontext ctx);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;
  // The bind's error (cuCtxSetCurrent failed), OK otherwise.
  const Status& status() const { return status_; }

 private:
  CUcontext previous_ = nullptr;
  bool rebound_ = false;
  Status status_;
};

// Polls `e` until it completes (OK), the deadline passes (kTimeout naming `what`), or CUDA
// reports an error. The caller's context must be current.
Status wait_event(cudaEvent_t e, Deadline deadline, const char* what);
// One query: true once complete; false while not ready (the thread's last error cleared of it).
bool event_done(cudaEvent_t e);

// "R580 or newer (CUDA 13.0 drivers)" for the runtime this build links, and a check of the
// installed driver against it: kUnavailable naming both when the driver is older.
std::string driver_floor();
Status check_driver();

}  // namespace kvstash::cuda
