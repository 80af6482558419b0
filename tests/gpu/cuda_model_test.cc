// Proves that the CUDA model (tests/gpu/cuda_model) keeps the documented CUDA semantics the kvstash
// CUDA code depends on: implicit stream synchronization, the per-thread last error, lazy
// contexts, hardware queues and their false dependencies, stream memory operations, memory the
// host cannot touch, entry points, capture, a driver too old. Kernels are a twin registered here.
//
// The model reads its configuration once per process, so tests of another configuration run
// this binary again ("Child.*" tests, skipped in the parent run) with the variables set. main()
// gives the parent two devices.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda_model/cuda_model.h"

extern char** environ;

namespace kvstash::cuda_model {
namespace {

using namespace std::chrono_literals;

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// ---- the twin and helpers ------------------------------------------------------------------

// sleep_then_write(std::uint32_t* dst, std::uint32_t value, std::uint32_t us): sleeps, then
// stores `value` at `dst` (device or pinned memory): a kernel that finishes late.
void sleep_then_write(const Launch& l) {
  std::this_thread::sleep_for(std::chrono::microseconds(l.arg<std::uint32_t>(2)));
  auto* dst = static_cast<std::uint32_t*>(view(l.arg<std::uint32_t*>(0), sizeof(std::uint32_t)));
  std::atomic_ref<std::uint32_t>(*dst).store(l.arg<std::uint32_t>(1));
}
const KernelTwin kSleepWrite{
    "sleep_then_write", {sizeof(void*), sizeof(std::uint32_t), sizeof(std::uint32_t)}, sleep_then_write};

// touch_directly(std::uint32_t* dst): a faulty twin that writes device memory without view().
void touch_directly(const Launch& l) { *l.arg<std::uint32_t*>(0) = 1; }
const KernelTwin kTouchDirectly{"touch_directly", {sizeof(void*)}, touch_directly};

cudaError_t sleep_write(void* dst, std::uint32_t value, std::uint32_t us, cudaStream_t stream) {
  void* args[] = {&dst, &value, &us};
  return cudaLaunchKernel(&kSleepWrite, dim3(1), dim3(1), args, 0, stream);
}

constexpr std::uint32_t kLate = 300'000;  // us: long enough that the host sees the kernel unfinished

// A device word and four pinned host words to copy it into (what the tests read to see order).
struct Words {
  std::uint32_t* dev = nullptr;
  std::uint32_t* host = nullptr;
  Words() {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(dev, 0, 4), cudaSuccess);
    EXPECT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), 4 * sizeof(std::uint32_t), 0), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~Words() {
    cudaFree(dev);  // synchronizes the device
    cudaFreeHost(host);
  }
  Words(const Words&) = delete;
  Words& operator=(const Words&) = delete;
};

// A new stream whose hardware queue differs from each of `apart` (streams take queues
// round-robin, so this ends within hardware_queues() tries).
cudaStream_t stream_apart(unsigned flags, std::initializer_list<cudaStream_t> apart) {
  for (;;) {
    cudaStream_t s = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, flags), cudaSuccess);
    bool shared = false;
    for (cudaStream_t a : apart) shared = shared || queue_of(a) == queue_of(s);
    if (!shared) return s;
    cudaStreamDestroy(s);
  }
}

template <class Fn>
Fn entry(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  EXPECT_EQ(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found), cudaSuccess)
      << name;
  EXPECT_EQ(found, cudaDriverEntryPointSuccess) << name;
  return reinterpret_cast<Fn>(p);
}
#define DRIVER(name) entry<decltype(&name)>(#name)

// Whether what is queued on `s` completes within `within` (polling cudaStreamQuery).
bool drains(cudaStream_t s, std::chrono::milliseconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cudaStreamQuery(s) == cudaSuccess) return true;
    std::this_thread::sleep_for(1ms);
  }
  (void)cudaGetLastError();
  return cudaStreamQuery(s) == cudaSuccess;
}

// ---- child processes (a configuration per process) -------------------------------------------

bool is_child() { return std::getenv("KVSTASH_CUDA_MODEL_TEST_CHILD") != nullptr; }

#define CHILD_ONLY() \
  if (!is_child()) GTEST_SKIP() << "runs in a child process with its own configuration"

struct Child {
  int status = -1;
  bool timed_out = false;
  std::string output;
};

// Runs this binary's test `test` in a new process, with `env` ("NAME=value") replacing or adding
// to this process's environment; kills it after `limit`.
Child run_child(const std::string& test, const std::vector<std::string>& env,
                std::chrono::seconds limit = 30s) {
  std::vector<std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string v = *e;
    bool replaced = false;
    for (const std::string& o : env)
      replaced = replaced || v.substr(0, v.find('=')) == o.substr(0, o.find('='));
    if (!replaced) vars.push_back(v);
  }
  vars.insert(vars.end(), env.begin(), env.end());
  vars.push_back("KVSTASH_CUDA_MODEL_TEST_CHILD=1");
  std::vector<char*> envp;
  for (std::string& v : vars) envp.push_back(v.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=" + test;
  char* argv[] = {exe.data(), filter.data(), nullptr};
  int fds[2];
  Child c;
  if (::pipe2(fds, O_CLOEXEC) != 0) return c;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::execve(exe.c_str(), argv, envp.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      c.timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    c.output.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  ::waitpid(pid, &c.status, 0);
  return c;
}

void expect_child_passes(const std::string& test, const std::vector<std::string>& env) {
  const Child c = run_child(test, env);
  EXPECT_FALSE(c.timed_out) << "the child hung:\n" << c.output;
  EXPECT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.output;
  EXPECT_NE(c.output.find("[  PASSED  ] 1 test."), std::string::npos) << c.output;
  EXPECT_EQ(c.output.find("[  SKIPPED ]"), std::string::npos) << c.output;
}

// ---- implicit synchronization ('Stream synchronization behavior') ------------------------------

TEST(Streams, LegacyStreamWaitsForBlockingStreamsButNotNonBlockingOnes) {
  Words w;
  cudaStream_t blocking = stream_apart(cudaStreamDefault, {cudaStreamLegacy});
  cudaStream_t nonblocking = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy});

  CUDA_OK(sleep_write(w.dev, 1, kLate, blocking));
  cudaEvent_t after_legacy = nullptr;
  CUDA_OK(cudaEventCreateWithFlags(&after_legacy, cudaEventDisableTiming));
  CUDA_OK(cudaMemcpyAsync(&w.host[0], w.dev, 4, cudaMemcpyDeviceToHost, 0));
  CUDA_OK(cudaEventRecord(after_legacy, 0));
  EXPECT_EQ(cudaEventQuery(after_legacy), cudaErrorNotReady);  // behind the blocking stream's kernel
  (void)cudaGetLastError();
  CUDA_OK(cudaStreamSynchronize(0));
  EXPECT_EQ(w.host[0], 1u);

  CUDA_OK(sleep_write(w.dev, 2, kLate, nonblocking));
  CUDA_OK(cudaMemcpyAsync(&w.host[1], w.dev, 4, cudaMemcpyDeviceToHost, cudaStreamLegacy));
  CUDA_OK(cudaStreamSynchronize(cudaStreamLegacy));
  EXPECT_EQ(w.host[1], 1u);  // did not wait for the non-blocking stream
  CUDA_OK(cudaStreamSynchronize(nonblocking));
  CUDA_OK(cudaMemcpy(&w.host[2], w.dev, 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(w.host[2], 2u);
  cudaEventDestroy(after_legacy);
  cudaStreamDestroy(blocking);
  cudaStreamDestroy(nonblocking);
}

TEST(Streams, BlockingStreamWaitsForEarlierLegacyWork) {
  Words w;
  cudaStream_t blocking = stream_apart(cudaStreamDefault, {cudaStreamLegacy});
  cudaStream_t nonblocking = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy, blocking});
  CUDA_OK(sleep_write(w.dev, 3, kLate, 0));
  CUDA_OK(cudaMemcpyAsync(&w.host[0], w.dev, 4, cudaMemcpyDeviceToHost, nonblocking));
  CUDA_OK(cudaStreamSynchronize(nonblocking));
  EXPECT_EQ(w.host[0], 0u);  // a non-blocking stream does not wait for the legacy stream
  CUDA_OK(cudaMemcpyAsync(&w.host[1], w.dev, 4, cudaMemcpyDeviceToHost, blocking));
  CUDA_OK(cudaStreamSynchronize(blocking));
  EXPECT_EQ(w.host[1], 3u);
  cudaStreamDestroy(blocking);
  cudaStreamDestroy(nonblocking);
}

TEST(Streams, PerThreadDefaultStreamSyncsWithTheLegacyStreamOnly) {
  Words w;
  // After earlier legacy work.
  CUDA_OK(sleep_write(w.dev, 4, kLate, cudaStreamLegacy));
  CUDA_OK(cudaMemcpyAsync(&w.host[0], w.dev, 4, cudaMemcpyDeviceToHost, cudaStreamPerThread));
  CUDA_OK(cudaStreamSynchronize(cudaStreamPerThread));
  EXPECT_EQ(w.host[0], 4u);
  // Not after a created blocking stream.
  cudaStream_t blocking = stream_apart(cudaStreamDefault, {cudaStreamLegacy, cudaStreamPerThread});
  CUDA_OK(sleep_write(w.dev, 5, kLate, blocking));
  CUDA_OK(cudaMemcpyAsync(&w.host[1], w.dev, 4, cudaMemcpyDeviceToHost, cudaStreamPerThread));
  CUDA_OK(cudaStreamSynchronize(cudaStreamPerThread));
  EXPECT_EQ(w.host[1], 4u);
  CUDA_OK(cudaStreamSynchronize(blocking));
  // The legacy stream waits for it.
  CUDA_OK(sleep_write(w.dev, 6, kLate, cudaStreamPerThread));
  CUDA_OK(cudaMemcpyAsync(&w.host[2], w.dev, 4, cudaMemcpyDeviceToHost, cudaStreamLegacy));
  CUDA_OK(cudaStreamSynchronize(cudaStreamLegacy));
  EXPECT_EQ(w.host[2], 6u);
  // It is the calling thread's own: another thread's is busy, this one's is not.
  std::atomic<bool> launched{false}, checked{false};
  std::thread other([&] {
    EXPECT_EQ(sleep_write(w.dev, 7, kLate, cudaStreamPerThread), cudaSuccess);
    launched = true;
    while (!checked) std::this_thread::sleep_for(1ms);
    EXPECT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  });
  while (!launched) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(cudaStreamQuery(cudaStreamPerThread), cudaSuccess);
  checked = true;
  other.join();
  cudaStreamDestroy(blocking);
}

TEST(Streams, WaitEventWaitsForTheRecordAsItWasAtTheCall) {
  Words w;
  cudaStream_t s1 = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy});
  cudaStream_t s2 = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy, s1});
  cudaEvent_t e = nullptr, never = nullptr;
  CUDA_OK(cudaEventCreate(&e));
  CUDA_OK(cudaEventCreate(&never));
  EXPECT_EQ(cudaEventQuery(never), cudaSuccess);  // never recorded: complete
  CUDA_OK(sleep_write(w.dev, 8, kLate, s1));
  CUDA_OK(cudaEventRecord(e, s1));
  CUDA_OK(cudaStreamWaitEvent(s2, never, 0));  // no wait
  CUDA_OK(cudaMemcpyAsync(&w.host[0], w.dev, 4, cudaMemcpyDeviceToHost, s2));
  CUDA_OK(cudaStreamSynchronize(s2));
  EXPECT_EQ(w.host[0], 0u);
  CUDA_OK(cudaStreamWaitEvent(s2, e, 0));
  CUDA_OK(cudaEventRecord(e, s2));  // a later record does not change the wait already queued
  CUDA_OK(cudaMemcpyAsync(&w.host[1], w.dev, 4, cudaMemcpyDeviceToHost, s2));
  CUDA_OK(cudaStreamSynchronize(s2));
  EXPECT_EQ(w.host[1], 8u);
  CUDA_OK(cudaEventSynchronize(e));
  cudaEventDestroy(e);
  cudaEventDestroy(never);
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

TEST(Streams, DestroyedStreamStillRunsItsWork) {
  Words w;
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned flags = 9;
  CUDA_OK(cudaStreamGetFlags(s, &flags));
  EXPECT_EQ(flags, static_cast<unsigned>(cudaStreamNonBlocking));
  int device = -1;
  CUDA_OK(cudaStreamGetDevice(s, &device));
  EXPECT_EQ(device, 0);
  CUDA_OK(sleep_write(w.host, 9, 50'000, s));
  CUDA_OK(cudaStreamDestroy(s));
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorInvalidResourceHandle);
  (void)cudaGetLastError();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(w.host[0], 9u);
}

TEST(Streams, StreamsTakeHardwareQueuesRoundRobin) {
  const int n = hardware_queues();
  cudaStream_t a = nullptr, b = nullptr;
  CUDA_OK(cudaStreamCreate(&a));
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  EXPECT_EQ(queue_of(b), (queue_of(a) + 1) % n);
  EXPECT_EQ(queue_of(cudaStreamLegacy), 0);  // the context's first stream
  EXPECT_EQ(queue_of(reinterpret_cast<cudaStream_t>(0x1234)), -1);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

// ---- the last error --------------------------------------------------------------------------

TEST(LastError, NotReadyFromAQueryIsWhatTheNextLaunchCheckSees) {
  Words w;
  (void)cudaGetLastError();
  cudaStream_t s = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy});
  cudaEvent_t e = nullptr;
  CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CUDA_OK(sleep_write(w.dev, 1, kLate, s));
  CUDA_OK(cudaEventRecord(e, s));
  EXPECT_EQ(cudaEventQuery(e), cudaErrorNotReady);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorNotReady);
  // `kernel<<<...>>>(); return cudaGetLastError();`: the launch succeeded, the check says NotReady.
  EXPECT_EQ(sleep_write(w.dev, 2, 0, s), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaErrorNotReady);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  EXPECT_EQ(cudaGetLastError(), cudaErrorNotReady);
  // Per host thread: another thread's error is not this one's.
  std::thread([] { EXPECT_EQ(cudaGetLastError(), cudaSuccess); }).join();
  CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_EQ(cudaEventQuery(e), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaEventDestroy(e);
  cudaStreamDestroy(s);
}

TEST(LastError, LaunchReturnsItsOwnError) {
  (void)cudaGetLastError();
  int not_a_kernel = 0;
  EXPECT_EQ(cudaLaunchKernel(&not_a_kernel, dim3(1), dim3(1), nullptr, 0, 0), cudaErrorInvalidDeviceFunction);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDeviceFunction);
  std::uint32_t* host = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&host), 4, 0));
  void* dst = host;
  std::uint32_t value = 5, us = 0;
  void* args[] = {&dst, &value, &us};
  EXPECT_EQ(cudaLaunchKernel(&kSleepWrite, dim3(0), dim3(1), args, 0, 0), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaLaunchKernel(&kSleepWrite, dim3(1), dim3(1025), args, 0, 0), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaLaunchKernel(&kSleepWrite, dim3(1), dim3(1, 1, 65), args, 0, 0),
            cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaLaunchKernel(&kSleepWrite, dim3(1), dim3(1024), args, 0, 0), cudaSuccess);  // own status
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);                             // the earlier one
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // A stream of another device ('Stream and Event Behavior': the launch fails).
  cudaStream_t other = nullptr;
  std::thread([&] {
    EXPECT_EQ(cudaSetDevice(1), cudaSuccess);
    EXPECT_EQ(cudaStreamCreate(&other), cudaSuccess);
  }).join();
  EXPECT_EQ(cudaLaunchKernel(&kSleepWrite, dim3(1), dim3(1), args, 0, other), cudaErrorInvalidResourceHandle);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(*host, 5u);
  cudaStreamDestroy(other);
  cudaFreeHost(host);
}

TEST(LastError, EveryErrorHasANameAndAString) {
  EXPECT_STREQ(cudaGetErrorName(cudaErrorNotReady), "cudaErrorNotReady");
  EXPECT_STREQ(cudaGetErrorString(cudaErrorNotReady), "device not ready");
  EXPECT_STREQ(cudaGetErrorString(cudaErrorInsufficientDriver),
               "CUDA driver version is insufficient for CUDA runtime version");
  for (cudaError_t e :
       {cudaSuccess, cudaErrorInvalidValue, cudaErrorMemoryAllocation, cudaErrorInvalidConfiguration,
        cudaErrorInvalidMemcpyDirection, cudaErrorInsufficientDriver, cudaErrorNoDevice,
        cudaErrorInvalidDevice, cudaErrorInvalidDeviceFunction, cudaErrorInvalidResourceHandle,
        cudaErrorIllegalState, cudaErrorNotReady, cudaErrorNotSupported, cudaErrorStreamCaptureUnsupported}) {
    EXPECT_STRNE(cudaGetErrorName(e), "unrecognized error code") << e;
    EXPECT_STRNE(cudaGetErrorString(e), "unrecognized error code") << e;
  }
  EXPECT_STREQ(cudaGetErrorName(static_cast<cudaError_t>(12345)), "unrecognized error code");
}

// ---- hardware queues and stream memory operations ---------------------------------------------

TEST(WaitValue, BlocksOnlyItsOwnQueue) {
  auto wait = DRIVER(cuStreamWaitValue32);
  auto write = DRIVER(cuStreamWriteValue32);
  ASSERT_NE(wait, nullptr);
  ASSERT_NE(write, nullptr);
  std::uint32_t* flag = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 8, cudaHostAllocMapped));
  void* dflag = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(&dflag, flag, 0));
  EXPECT_EQ(dflag, flag);  // unified addressing: the same address
  Words w;
  cudaStream_t a = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy});
  cudaStream_t b = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy, a});
  ASSERT_EQ(
      wait(reinterpret_cast<CUstream>(a), reinterpret_cast<CUdeviceptr>(dflag), 1, CU_STREAM_WAIT_VALUE_GEQ),
      CUDA_SUCCESS);
  CUDA_OK(sleep_write(w.host, 7, 0, a));
  CUDA_OK(sleep_write(&w.host[1], 8, 0, b));
  EXPECT_TRUE(drains(b, 2000ms));  // another queue: runs
  EXPECT_FALSE(drains(a, 100ms));
  EXPECT_EQ(w.host[0], 0u);
  std::atomic_ref<std::uint32_t>(*flag).store(1);
  EXPECT_TRUE(drains(a, 2000ms));
  EXPECT_EQ(w.host[0], 7u);
  // The device writes a word in stream order.
  ASSERT_EQ(write(reinterpret_cast<CUstream>(b), reinterpret_cast<CUdeviceptr>(w.dev), 42, 0), CUDA_SUCCESS);
  CUDA_OK(cudaMemcpyAsync(&w.host[2], w.dev, 4, cudaMemcpyDeviceToHost, b));
  CUDA_OK(cudaStreamSynchronize(b));
  EXPECT_EQ(w.host[2], 42u);
  // Pageable memory is not a device address; misaligned neither.
  std::uint32_t pageable = 0;
  EXPECT_EQ(wait(reinterpret_cast<CUstream>(a), reinterpret_cast<CUdeviceptr>(&pageable), 0, 0),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(wait(reinterpret_cast<CUstream>(a), reinterpret_cast<CUdeviceptr>(flag) + 1, 0, 0),
            CUDA_ERROR_INVALID_VALUE);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  cudaFreeHost(flag);
}

TEST(WaitValue, ConditionsAsCudaHDefinesThem) {
  auto wait = DRIVER(cuStreamWaitValue32);
  std::uint32_t* flag = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 4, 0));
  cudaStream_t s = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy});
  auto passes = [&](std::uint32_t word, std::uint32_t value, unsigned flags) {
    std::atomic_ref<std::uint32_t>(*flag).store(word);
    EXPECT_EQ(wait(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value, flags),
              CUDA_SUCCESS);
    const bool passed = drains(s, 100ms);
    std::atomic_ref<std::uint32_t>(*flag).store(value);  // releases a blocked wait of each kind used here
    EXPECT_TRUE(drains(s, 2000ms));
    return passed;
  };
  EXPECT_TRUE(passes(5, 5, CU_STREAM_WAIT_VALUE_GEQ));
  EXPECT_FALSE(passes(4, 5, CU_STREAM_WAIT_VALUE_GEQ));
  EXPECT_TRUE(passes(1, 0xfffffffeu, CU_STREAM_WAIT_VALUE_GEQ));   // cyclic: 1 is "after" 0xfffffffe
  EXPECT_FALSE(passes(0xfffffff0u, 5, CU_STREAM_WAIT_VALUE_GEQ));  // and 0xfffffff0 "before" 5
  EXPECT_TRUE(passes(3, 3, CU_STREAM_WAIT_VALUE_EQ));
  EXPECT_FALSE(passes(4, 3, CU_STREAM_WAIT_VALUE_EQ));
  EXPECT_TRUE(passes(6, 2, CU_STREAM_WAIT_VALUE_AND));
  EXPECT_FALSE(passes(4, 2, CU_STREAM_WAIT_VALUE_AND));
  EXPECT_TRUE(passes(0xf0f0f0f0u, 0x0f0f0f0eu, CU_STREAM_WAIT_VALUE_NOR));  // bit 0 clear in both
  EXPECT_FALSE(passes(0xf0f0f0f0u, 0x0f0f0f0fu, CU_STREAM_WAIT_VALUE_NOR));
  EXPECT_EQ(wait(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), 0, 7),
            CUDA_ERROR_INVALID_VALUE);
  // The implicit streams need a current context (the driver API makes none).
  std::thread([&] {
    EXPECT_EQ(wait(nullptr, reinterpret_cast<CUdeviceptr>(flag), 0, 0), CUDA_ERROR_INVALID_CONTEXT);
  }).join();
  cudaStreamDestroy(s);
  cudaFreeHost(flag);
}

TEST(WaitValue, OneConnectionMakesEveryStreamWaitBehindIt) {
  expect_child_passes("Child.WaitValueBlocksTheOnlyQueue", {"CUDA_DEVICE_MAX_CONNECTIONS=1"});
}

TEST(Child, WaitValueBlocksTheOnlyQueue) {
  CHILD_ONLY();
  ASSERT_EQ(hardware_queues(), 1);
  auto wait = DRIVER(cuStreamWaitValue32);
  std::uint32_t* flag = nullptr;
  std::uint32_t* out = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 4, cudaHostAllocMapped));
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&out), 4, cudaHostAllocMapped));
  cudaStream_t a = nullptr, b = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  EXPECT_EQ(queue_of(a), queue_of(b));
  ASSERT_EQ(
      wait(reinterpret_cast<CUstream>(a), reinterpret_cast<CUdeviceptr>(flag), 1, CU_STREAM_WAIT_VALUE_GEQ),
      CUDA_SUCCESS);
  CUDA_OK(sleep_write(out, 7, 0, b));  // another stream, no dependency on `a` CUDA knows of
  EXPECT_FALSE(drains(b, 300ms));      // ... but the same hardware queue
  EXPECT_EQ(*out, 0u);
  EXPECT_EQ(launches(), 0u);
  std::atomic_ref<std::uint32_t>(*flag).store(1);
  CUDA_OK(cudaStreamSynchronize(b));
  EXPECT_EQ(*out, 7u);
  EXPECT_EQ(launches(), 1u);
}

TEST(Exit, NeverWaitsForABlockedQueue) {
  const Child c = run_child("Child.LeavesAQueueBlockedForever", {"CUDA_DEVICE_MAX_CONNECTIONS=1"}, 20s);
  EXPECT_FALSE(c.timed_out) << c.output;
  EXPECT_TRUE(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) << c.output;
  EXPECT_NE(c.output.find("[  PASSED  ] 1 test."), std::string::npos) << c.output;
}

TEST(Child, LeavesAQueueBlockedForever) {
  CHILD_ONLY();
  auto wait = DRIVER(cuStreamWaitValue32);
  std::uint32_t* flag = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 4, 0));
  cudaStream_t a = nullptr, b = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  ASSERT_EQ(wait(reinterpret_cast<CUstream>(a), reinterpret_cast<CUdeviceptr>(flag), 1, 0), CUDA_SUCCESS);
  CUDA_OK(sleep_write(flag, 0, 0, b));
  EXPECT_FALSE(drains(b, 100ms));
  // Returns with both queued forever; the process must still exit.
}

// ---- contexts ------------------------------------------------------------------------------

TEST(Contexts, CreatedLazilyAndPerDevice) {
  expect_child_passes("Child.Contexts", {"KVSTASH_CUDA_MODEL_DEVICES=2"});
}

TEST(Child, Contexts) {
  CHILD_ONLY();
  ASSERT_EQ(device_count(), 2);
  auto get_current = DRIVER(cuCtxGetCurrent);
  auto set_current = DRIVER(cuCtxSetCurrent);
  auto retain = DRIVER(cuDevicePrimaryCtxRetain);
  auto release = DRIVER(cuDevicePrimaryCtxRelease);
  auto get_state = DRIVER(cuDevicePrimaryCtxGetState);
  EXPECT_FALSE(context_active(0));  // finding entry points made no context
  EXPECT_FALSE(context_active(1));

  std::thread([&] {  // cudaGetDevice makes none
    int d = -1;
    EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
    EXPECT_EQ(d, 0);
    CUcontext c = reinterpret_cast<CUcontext>(0x1);
    EXPECT_EQ(get_current(&c), CUDA_SUCCESS);
    EXPECT_EQ(c, nullptr);
  })
      .join();
  EXPECT_FALSE(context_active(0));

  CUcontext ctx1 = nullptr;
  std::thread([&] {  // retaining activates without making current
    unsigned flags = 9;
    int active = 9;
    EXPECT_EQ(get_state(1, &flags, &active), CUDA_SUCCESS);
    EXPECT_EQ(active, 0);
    EXPECT_EQ(retain(&ctx1, 1), CUDA_SUCCESS);
    EXPECT_NE(ctx1, nullptr);
    EXPECT_EQ(get_state(1, &flags, &active), CUDA_SUCCESS);
    EXPECT_EQ(active, 1);
    CUcontext c = nullptr;
    EXPECT_EQ(get_current(&c), CUDA_SUCCESS);
    EXPECT_EQ(c, nullptr);
  })
      .join();
  EXPECT_EQ(context_activations(1), 1);

  cudaEvent_t e = nullptr;
  std::thread([&] {  // cudaSetDevice(1) makes 1's context current, and touches no other
    EXPECT_EQ(cudaSetDevice(1), cudaSuccess);
    CUcontext c = nullptr;
    EXPECT_EQ(get_current(&c), CUDA_SUCCESS);
    EXPECT_EQ(c, ctx1);
    EXPECT_EQ(cudaEventCreate(&e), cudaSuccess);
  })
      .join();
  EXPECT_FALSE(context_active(0));
  EXPECT_EQ(context_activations(1), 1);

  std::thread([&] {  // a query on a fresh thread initializes device 0's context: "context on GPU 0"
    EXPECT_EQ(cudaEventQuery(e), cudaSuccess);
    int d = -1;
    EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
    EXPECT_EQ(d, 0);
  })
      .join();
  EXPECT_TRUE(context_active(0));
  EXPECT_EQ(context_activations(0), 1);

  std::thread([&] {  // cuCtxSetCurrent round trip
    EXPECT_EQ(set_current(ctx1), CUDA_SUCCESS);
    int d = -1;
    EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
    EXPECT_EQ(d, 1);
    CUcontext c = nullptr;
    EXPECT_EQ(get_current(&c), CUDA_SUCCESS);
    EXPECT_EQ(c, ctx1);
    cudaStream_t s = nullptr;
    EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess);
    EXPECT_EQ(cudaStreamGetDevice(s, &d), cudaSuccess);
    EXPECT_EQ(d, 1);
    EXPECT_EQ(set_current(nullptr), CUDA_SUCCESS);
    EXPECT_EQ(get_current(&c), CUDA_SUCCESS);
    EXPECT_EQ(c, nullptr);
    EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
    EXPECT_EQ(d, 0);
    EXPECT_EQ(set_current(reinterpret_cast<CUcontext>(&d)), CUDA_ERROR_INVALID_CONTEXT);
  })
      .join();
  EXPECT_EQ(release(1), CUDA_SUCCESS);
  EXPECT_TRUE(context_active(1));  // the model never deactivates
  EXPECT_EQ(context_activations(0), 1);
  EXPECT_EQ(context_activations(1), 1);
}

// ---- memory --------------------------------------------------------------------------------

TEST(Memory, CopiesSetsAndTheDeviceView) {
  std::byte* dev = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev), 10000));
  std::vector<unsigned char> in(10000), out(10000);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<unsigned char>(i * 7);
  CUDA_OK(cudaMemcpy(dev, in.data(), in.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(out.data(), dev, out.size(), cudaMemcpyDefault));
  EXPECT_EQ(in, out);
  EXPECT_EQ(std::memcmp(view(dev, in.size()), in.data(), in.size()), 0);
  CUDA_OK(cudaMemset(dev + 100, 0xab, 10));  // asynchronous on the legacy stream ...
  CUDA_OK(cudaMemcpy(out.data(), dev + 100, 10, cudaMemcpyDeviceToHost));  // ... which this follows
  EXPECT_EQ(out[0], 0xab);
  EXPECT_EQ(out[9], 0xab);
  std::byte* dev2 = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev2), 64));
  CUDA_OK(cudaMemcpy(dev2, dev, 64, cudaMemcpyDeviceToDevice));
  CUDA_OK(cudaMemsetAsync(dev2, 1, 1, cudaStreamPerThread));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(static_cast<unsigned char*>(view(dev2, 64))[0], 1);
  EXPECT_EQ(static_cast<unsigned char*>(view(dev2, 64))[1], 7);

  // The memfd reaches the same bytes (what a test transport writes as a NIC would).
  const auto range = device_range(dev + 5000);
  ASSERT_TRUE(range.has_value());
  EXPECT_EQ(range->base, dev);
  EXPECT_EQ(range->offset, 5000u);
  unsigned char byte = 0;
  ASSERT_EQ(::pread(range->fd, &byte, 1, static_cast<off_t>(range->offset)), 1);
  EXPECT_EQ(byte, in[5000]);
  byte = 0x5a;
  ASSERT_EQ(::pwrite(range->fd, &byte, 1, static_cast<off_t>(range->offset)), 1);
  CUDA_OK(cudaMemcpy(out.data(), dev + 5000, 1, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out[0], 0x5a);
  EXPECT_FALSE(device_range(in.data()).has_value());

  EXPECT_EQ(cudaMemcpy(out.data(), dev, 1, static_cast<cudaMemcpyKind>(7)), cudaErrorInvalidMemcpyDirection);
  EXPECT_EQ(cudaMemcpy(out.data(), dev + 4096 * 3 - 10, 20, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(dev + 1), cudaErrorInvalidValue);
  EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev2), dev, 0), cudaErrorInvalidValue);
  (void)cudaGetLastError();
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaFree(dev2));
  CUDA_OK(cudaFree(nullptr));
}

TEST(Memory, FreeSynchronizesTheDevice) {
  void* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, 4));
  cudaStream_t s = stream_apart(cudaStreamNonBlocking, {cudaStreamLegacy});
  CUDA_OK(cudaDeviceSynchronize());
  const std::uint64_t before = launches();
  CUDA_OK(sleep_write(dev, 1, 100'000, s));
  CUDA_OK(cudaFree(dev));
  EXPECT_EQ(launches(), before + 1);
  cudaStreamDestroy(s);
}

TEST(Memory, PointerAttributes) {
  cudaPointerAttributes a{};
  std::byte* dev = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev), 8192));
  CUDA_OK(cudaPointerGetAttributes(&a, dev + 5000));
  EXPECT_EQ(a.type, cudaMemoryTypeDevice);
  EXPECT_EQ(a.device, 0);
  EXPECT_EQ(a.devicePointer, dev + 5000);
  EXPECT_EQ(a.hostPointer, nullptr);

  void* pinned = nullptr;
  CUDA_OK(cudaHostAlloc(&pinned, 100, cudaHostAllocMapped | cudaHostAllocPortable));
  CUDA_OK(cudaPointerGetAttributes(&a, pinned));
  EXPECT_EQ(a.type, cudaMemoryTypeHost);
  EXPECT_EQ(a.devicePointer, pinned);
  EXPECT_EQ(a.hostPointer, pinned);
  void* by_malloc_host = nullptr;
  CUDA_OK(cudaMallocHost(&by_malloc_host, 10));
  CUDA_OK(cudaPointerGetAttributes(&a, by_malloc_host));
  EXPECT_EQ(a.type, cudaMemoryTypeHost);

  // Write-combined memory has a device address of its own ('Exceptions, Disjoint Addressing').
  std::uint32_t* wc = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&wc), 64, cudaHostAllocWriteCombined | cudaHostAllocMapped));
  void* wc_dev = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(&wc_dev, wc + 1, 0));
  EXPECT_NE(wc_dev, wc + 1);
  CUDA_OK(cudaPointerGetAttributes(&a, wc_dev));
  EXPECT_EQ(a.type, cudaMemoryTypeHost);
  EXPECT_EQ(a.hostPointer, wc + 1);
  wc[1] = 77;
  CUDA_OK(sleep_write(wc_dev, 78, 0, 0));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(wc[1], 78u);

  int on_stack = 0;
  CUDA_OK(cudaPointerGetAttributes(&a, &on_stack));
  EXPECT_EQ(a.type, cudaMemoryTypeUnregistered);
  EXPECT_EQ(a.devicePointer, nullptr);

  std::thread([&] {
    void* dev1 = nullptr;
    EXPECT_EQ(cudaSetDevice(1), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&dev1, 16), cudaSuccess);
    cudaPointerAttributes b{};
    EXPECT_EQ(cudaPointerGetAttributes(&b, dev1), cudaSuccess);
    EXPECT_EQ(b.type, cudaMemoryTypeDevice);
    EXPECT_EQ(b.device, 1);
    EXPECT_EQ(cudaFree(dev1), cudaSuccess);
  }).join();

  EXPECT_EQ(cudaFreeHost(dev), cudaErrorInvalidValue);
  (void)cudaGetLastError();
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaFreeHost(pinned));
  CUDA_OK(cudaFreeHost(by_malloc_host));
  CUDA_OK(cudaFreeHost(wc));
}

TEST(MemoryDeathTest, TheHostTouchingDeviceMemoryDies) {
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, 4096), cudaSuccess);
  EXPECT_DEATH(
      {
        volatile unsigned char c = *static_cast<volatile unsigned char*>(dev);
        (void)c;
      },
      "the host touched CUDA device memory at 0x");
  EXPECT_DEATH(view(static_cast<std::byte*>(dev) + 4090, 16), "partly inside CUDA device memory");
  EXPECT_DEATH(
      {
        void* args[] = {&dev};
        cudaLaunchKernel(&kTouchDirectly, dim3(1), dim3(1), args, 0, 0);
        cudaDeviceSynchronize();
      },
      "a kernel twin touched CUDA device memory without cuda_model::view\\(\\), at 0x");
  cudaFree(dev);
}

// ---- entry points, attributes, capture ------------------------------------------------------------

TEST(EntryPoints, KnownUnknownAndVersions) {
  for (const char* name :
       {"cuStreamWaitValue32", "cuStreamWriteValue32", "cuCtxGetCurrent", "cuCtxSetCurrent",
        "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxGetState", "cuDeviceGet",
        "cuDeviceGetAttribute", "cuMemGetAddressRange"}) {
    EXPECT_NE(entry<void*>(name), nullptr) << name;
  }
  void* p = reinterpret_cast<void*>(0x1);
  cudaDriverEntryPointQueryResult found{};
  EXPECT_EQ(cudaGetDriverEntryPointByVersion("cuNoSuchFunction", &p, 12000, cudaEnableDefault, &found),
            cudaSuccess);
  EXPECT_EQ(found, cudaDriverEntryPointSymbolNotFound);
  EXPECT_EQ(p, nullptr);
  EXPECT_EQ(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 7000, cudaEnableDefault, &found),
            cudaSuccess);
  EXPECT_EQ(found, cudaDriverEntryPointVersionNotSufficent);
  EXPECT_EQ(p, nullptr);
  // A version above the driver's: cudaErrorInvalidValue (cudaGetDriverEntryPointByVersion).
  EXPECT_EQ(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 99000, cudaEnableDefault, &found),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  void* legacy = nullptr;
  void* ptsz = nullptr;
  EXPECT_EQ(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &ptsz, 12000,
                                             cudaEnablePerThreadDefaultStream, &found),
            cudaSuccess);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  EXPECT_EQ(cudaGetDriverEntryPoint("cuStreamWaitValue32", &legacy, cudaEnableDefault, &found), cudaSuccess);
#pragma GCC diagnostic pop
  EXPECT_EQ(found, cudaDriverEntryPointSuccess);
  EXPECT_NE(legacy, nullptr);
  EXPECT_NE(ptsz, legacy);  // 0 means the per-thread stream there

  auto range = DRIVER(cuMemGetAddressRange);
  std::byte* dev = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dev), 5000));
  CUdeviceptr base = 0;
  std::size_t size = 0;
  EXPECT_EQ(range(&base, &size, reinterpret_cast<CUdeviceptr>(dev + 4999)), CUDA_SUCCESS);
  EXPECT_EQ(base, reinterpret_cast<CUdeviceptr>(dev));
  EXPECT_GE(size, 5000u);
  int on_stack = 0;
  EXPECT_EQ(range(&base, &size, reinterpret_cast<CUdeviceptr>(&on_stack)), CUDA_ERROR_NOT_FOUND);
  CUDA_OK(cudaFree(dev));
}

TEST(EntryPoints, AttributesAndFlushAsConfigured) {
  auto attribute = DRIVER(cuDeviceGetAttribute);
  auto device_get = DRIVER(cuDeviceGet);
  CUdevice d = -1;
  EXPECT_EQ(device_get(&d, 1), CUDA_SUCCESS);
  EXPECT_EQ(d, 1);
  EXPECT_EQ(device_get(&d, 2), CUDA_ERROR_INVALID_DEVICE);
  int v = -1;
  EXPECT_EQ(attribute(&v, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, 0), CUDA_SUCCESS);
  EXPECT_EQ(v, 1);
  EXPECT_EQ(attribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, 0), CUDA_SUCCESS);
  EXPECT_EQ(v, 1);
  CUDA_OK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 1));
  EXPECT_EQ(v, 4);
  CUDA_OK(cudaDeviceGetAttribute(&v, cudaDevAttrGPUDirectRDMASupported, 0));
  EXPECT_EQ(v, 1);
  CUDA_OK(cudaDeviceGetAttribute(&v, cudaDevAttrGPUDirectRDMAWritesOrdering, 0));
  EXPECT_EQ(v, cudaGPUDirectRDMAWritesOrderingNone);
  EXPECT_EQ(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 2), cudaErrorInvalidDevice);
  (void)cudaGetLastError();
  CUDA_OK(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                             cudaFlushGPUDirectRDMAWritesToOwner));
  int driver = 0, runtime = 0;
  CUDA_OK(cudaDriverGetVersion(&driver));
  CUDA_OK(cudaRuntimeGetVersion(&runtime));
  EXPECT_EQ(driver, CUDART_VERSION);
  EXPECT_EQ(runtime, CUDART_VERSION);
}

TEST(EntryPoints, NoFlushWhereTheDeviceCannot) {
  expect_child_passes("Child.NoFlush",
                      {"KVSTASH_CUDA_MODEL_CAN_FLUSH=0", "KVSTASH_CUDA_MODEL_RDMA_ORDERING=100"});
}

TEST(Child, NoFlush) {
  CHILD_ONLY();
  int v = -1;
  CUDA_OK(cudaDeviceGetAttribute(&v, cudaDevAttrCanFlushRemoteWrites, 0));
  EXPECT_EQ(v, 0);
  CUDA_OK(cudaDeviceGetAttribute(&v, cudaDevAttrGPUDirectRDMAWritesOrdering, 0));
  EXPECT_EQ(v, cudaGPUDirectRDMAWritesOrderingOwner);
  EXPECT_EQ(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                               cudaFlushGPUDirectRDMAWritesToOwner),
            cudaErrorNotSupported);
  EXPECT_EQ(cudaGetLastError(), cudaErrorNotSupported);
  auto wait = DRIVER(cuStreamWaitValue32);
  std::uint32_t* flag = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 4, 0));
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_EQ(
      wait(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), 0, CU_STREAM_WAIT_VALUE_FLUSH),
      CUDA_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(
      wait(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), 0, CU_STREAM_WAIT_VALUE_GEQ),
      CUDA_SUCCESS);
  CUDA_OK(cudaStreamSynchronize(s));
}

TEST(Capture, StatusAndLegacyStream) {
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  CUDA_OK(cudaStreamIsCapturing(s, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  CUDA_OK(cudaDeviceSynchronize());
  const std::uint64_t before = launches();
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CUDA_OK(cudaStreamIsCapturing(s, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  std::uint32_t word = 0;
  CUDA_OK(sleep_write(&word, 1, 0, s));  // recorded, not run
  EXPECT_EQ(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
  (void)cudaGetLastError();
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  EXPECT_NE(graph, nullptr);
  CUDA_OK(cudaStreamIsCapturing(s, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(launches(), before);
  EXPECT_EQ(word, 0u);
  CUDA_OK(cudaGraphDestroy(graph));
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorIllegalState);
  EXPECT_EQ(cudaStreamBeginCapture(0, cudaStreamCaptureModeGlobal), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamBeginCapture(cudaStreamLegacy, cudaStreamCaptureModeRelaxed),
            cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaGetLastError(), cudaErrorStreamCaptureUnsupported);
  cudaStreamDestroy(s);
}

// ---- a driver too old, no device ----------------------------------------------------------------

TEST(Driver, TooOldFailsEveryCallThatInitializes) {
  expect_child_passes("Child.InsufficientDriver", {"KVSTASH_CUDA_MODEL_DRIVER_VERSION=12020"});
}

TEST(Child, InsufficientDriver) {
  CHILD_ONLY();
  int n = 5;
  EXPECT_EQ(cudaGetDeviceCount(&n), cudaErrorInsufficientDriver);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInsufficientDriver);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  int v = 0;
  EXPECT_EQ(cudaDriverGetVersion(&v), cudaSuccess);
  EXPECT_EQ(v, 12020);
  EXPECT_EQ(cudaRuntimeGetVersion(&v), cudaSuccess);
  EXPECT_EQ(v, CUDART_VERSION);
  EXPECT_EQ(cudaGetDevice(&v), cudaErrorInsufficientDriver);
  EXPECT_EQ(cudaSetDevice(0), cudaErrorInsufficientDriver);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 16), cudaErrorInsufficientDriver);
  EXPECT_EQ(cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault, nullptr),
            cudaErrorInsufficientDriver);
  EXPECT_FALSE(context_active(0));
}

TEST(Driver, NoDevice) { expect_child_passes("Child.NoDevice", {"KVSTASH_CUDA_MODEL_DEVICES=0"}); }

TEST(Child, NoDevice) {
  CHILD_ONLY();
  int n = 5;
  EXPECT_EQ(cudaGetDeviceCount(&n), cudaErrorNoDevice);
  EXPECT_EQ(n, 0);
  cudaStream_t s = nullptr;
  EXPECT_EQ(cudaStreamCreate(&s), cudaErrorNoDevice);
}

}  // namespace
}  // namespace kvstash::cuda_model

int main(int argc, char** argv) {
  ::setenv("KVSTASH_CUDA_MODEL_DEVICES", "2", 0);  // a second device for the tests that need one
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the model's queue workers are threads
  testing::InitGoogleTest(&argc, argv);
  if (!kvstash::cuda_model::is_child()) {
    // Child.* tests run only in the processes the parent tests start.
    std::string filter = GTEST_FLAG_GET(filter);
    filter += filter.find('-') == std::string::npos ? "-Child.*" : ":Child.*";
    GTEST_FLAG_SET(filter, filter);
  }
  kvstash::cuda_model::register_twin(&kvstash::cuda_model::kSleepWrite);
  kvstash::cuda_model::register_twin(&kvstash::cuda_model::kTouchDirectly);
  return RUN_ALL_TESTS();
}
