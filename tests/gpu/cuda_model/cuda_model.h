// A CPU model of the part of the CUDA runtime and driver API that kvstash's CUDA device code
// (src/kvcache/cuda) calls: a test double for a GPU these machines do not have, named as such.
// cuda_model.cc defines the runtime's cuda* functions (extern "C", the signatures of the
// toolkit's cuda_runtime_api.h) and hands out the driver's cu* functions through
// cudaGetDriverEntryPointByVersion, so the real host code links against it instead of libcudart
// and runs here. README.md beside this file lists what is modelled, what is not, and where each
// rule comes from; the short form of each rule is repeated where it is implemented.
//
// The rules it follows (documents are NVIDIA's; sections and functions as they name them):
//  - Contexts. CUDA Runtime API, 'Interactions with the CUDA Driver API' (Primary Contexts;
//    Initialization and Tear-Down): a runtime call that needs a context uses the one current to
//    the thread, else makes the current device's primary context current and initializes it.
//    cudaSetDevice initializes its device's primary context at once and binds it (cudaSetDevice;
//    CUDA C++ Programming Guide, 'Initialization', "as of CUDA 12.0"). cudaGetDevice creates
//    nothing. Driver: cuCtxGetCurrent, cuCtxSetCurrent, cuDevicePrimaryCtxRetain/Release/GetState.
//  - Errors. cudaGetLastError (returns and resets), cudaPeekAtLastError (returns), per host thread.
//    Every failing runtime call records its error, cudaErrorNotReady from cudaEventQuery and
//    cudaStreamQuery included (not documented either way by NVIDIA; see README).
//  - Streams. CUDA Runtime API, 'Stream synchronization behavior' (legacy default stream,
//    per-thread default stream, cudaStreamNonBlocking); cudaStreamQuery, cudaStreamSynchronize,
//    cudaStreamDestroy, cudaStreamWaitEvent, cudaEventRecord, cudaEventQuery, cudaEventSynchronize,
//    cudaDeviceSynchronize; CUDA C++ Programming Guide, 'Stream and Event Behavior' (which calls
//    may name another device's stream or event).
//  - Hardware queues. CUDA Environment Variables: CUDA_DEVICE_MAX_CONNECTIONS (work queues per
//    device, 1..32, default 8). Streams map onto queues round-robin in creation order (the real
//    mapping is not documented); work in one queue runs in order, so a blocked operation holds up
//    every stream that shares its queue (the false dependency the variable is there to relieve).
//  - Stream memory operations. cuStreamWaitValue32, cuStreamWriteValue32, CUstreamWaitValue_flags
//    (GEQ is the cyclic (int32_t)(*addr - value) >= 0), CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES.
//  - Memory. cudaMalloc, cudaFree ("may perform implicit synchronization": the model always does),
//    cudaHostAlloc, cudaHostGetDevicePointer, cudaPointerGetAttributes, cudaMemcpy*/cudaMemset*
//    with CUDA Runtime API, 'API synchronization behavior'; cudaDeviceFlushGPUDirectRDMAWrites.
//  - Capture. cudaStreamBeginCapture, cudaStreamIsCapturing, cudaStreamEndCapture.
//  - Entry points. cudaGetDriverEntryPointByVersion, cudaGetDriverEntryPoint.
//
// Configuration, read from the environment once, at the first CUDA call:
//   KVSTASH_CUDA_MODEL_DEVICES          devices (default 1; 0: cudaErrorNoDevice)
//   CUDA_DEVICE_MAX_CONNECTIONS         hardware queues per device (default 8, clamped to 1..32)
//   KVSTASH_CUDA_MODEL_DRIVER_VERSION   what cudaDriverGetVersion reports (default CUDART_VERSION);
//                                       a major below CUDART_VERSION's: cudaErrorInsufficientDriver
//   KVSTASH_CUDA_MODEL_RDMA_ORDERING    cudaDevAttrGPUDirectRDMAWritesOrdering (0, 100, 200; default 0)
//   KVSTASH_CUDA_MODEL_CAN_FLUSH        cudaDevAttrCanFlushRemoteWrites, and whether flushes succeed
//                                       (default 1; 0: cudaErrorNotSupported, CUDA_ERROR_NOT_SUPPORTED)
//
// Device memory is a memfd mapped twice: at its device address with PROT_NONE, so any host touch
// faults (a SIGSEGV handler says "the host touched CUDA device memory at <addr>" and aborts), and
// once more, read-write, for the model's own workers and kernel twins (view()).
//
// Kernels are host "twins": a test or a build of the kernels for the model registers one per
// __global__ function; its address is the function handle cudaLaunchKernel takes.
//
// Process exit never waits for the model: its state is never destroyed and its queue workers
// are detached, so a queue blocked forever (a deadlock under test) does not hang exit.
//
// Thread safety: every function here and every modelled cuda*/cu* function may be called from
// any thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

namespace kvstash::cuda_model {

// One kernel launch as a twin sees it: the launch's grid and block, and a copy of each argument's
// bytes taken when cudaLaunchKernel was called (as the real launch copies them).
struct Launch {
  dim3 grid;
  dim3 block;
  std::vector<std::vector<std::byte>> args;

  // Argument i as a T; aborts naming the argument if its size is not sizeof(T).
  template <class T>
  T arg(std::size_t i) const {
    if (i >= args.size() || args[i].size() != sizeof(T)) {
      std::fprintf(stderr, "cuda_model: kernel argument %zu read as %zu bytes, but it has %zu\n", i,
                   sizeof(T), i < args.size() ? args[i].size() : std::size_t{0});
      std::abort();
    }
    T value;
    std::memcpy(&value, args[i].data(), sizeof(T));
    return value;
  }
};

// The host twin of a __global__ function: its name (for messages), the size of each parameter in
// order (what cudaLaunchKernel copies out of its args array), and what it does. `run` executes
// the whole launch (every block and thread of the grid: it loops over them itself) on one host
// thread, a queue worker of the launch's device, and reaches device memory only through view()
// (a direct touch of a device address faults like any host touch, with its own message).
struct KernelTwin {
  const char* name;
  std::vector<std::size_t> arg_sizes;
  void (*run)(const Launch&);
};

// Makes `twin` launchable: its address is the handle passed to cudaLaunchKernel as `func`. The
// twin must outlive every launch of it. Registering twice is harmless.
void register_twin(const KernelTwin* twin);

// What a twin (or the model's copy engine) dereferences for [addr, addr + bytes): device memory
// through the model's read-write view of it, any other address unchanged (pinned host memory is
// reachable from the device at its own address, as with unified addressing). Aborts, naming the
// address, if the range is partly inside a device allocation or runs past its end.
void* view(const void* addr, std::size_t bytes);

// The cudaMalloc allocation containing `addr`: its memfd, the offset of `addr` in that file,
// the bytes from `addr` to the allocation's end, and the allocation's device address (what a
// test transport maps or pwrites to reach device memory as GPUDirect would). nullopt for an
// address outside every allocation. The fd stays owned by the model (closed by cudaFree).
struct DeviceRange {
  int fd;
  std::uint64_t offset;
  std::size_t length;
  void* base;
};
std::optional<DeviceRange> device_range(const void* addr);

// Times device `device`'s primary context went from inactive to active (0 or 1: the model has
// no cudaDeviceReset), and whether it is active now. Neither initializes anything.
int context_activations(int device);
bool context_active(int device);

// The configuration in effect (reads it if no CUDA call has yet).
int device_count();
int hardware_queues();

// The hardware queue (0 .. hardware_queues() - 1) that `stream` is mapped to, resolving 0,
// cudaStreamLegacy and cudaStreamPerThread for the calling thread as the runtime would (creating
// the per-thread stream, and the context, if needed); -1 for a handle that is not a stream.
int queue_of(cudaStream_t stream);

// Kernels run to completion so far, on all devices (a captured launch never runs).
std::uint64_t launches();

}  // namespace kvstash::cuda_model
