// The CUDA model (cuda_model.h): the runtime's cuda* functions, the driver functions it hands
// out as entry points, streams as operations in per-device hardware queues, device memory as a
// memfd the host cannot touch. The rules each part follows are cited where it is implemented;
// README.md collects them, with what is left out.
#include "cuda_model.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "host_faults.h"

namespace kvstash::cuda_model {
namespace {

// ---- configuration, read once -------------------------------------------------------------

struct Config {
  int devices = 1;
  int queues = 8;
  int driver_version = CUDART_VERSION;
  int rdma_ordering = 0;
  bool can_flush = true;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0') {
    std::fprintf(stderr, "cuda_model: %s=%s is not a number\n", name, v);
    std::abort();
  }
  return static_cast<int>(n);
}

const Config& config() {
  static const Config c = [] {
    Config k;
    k.devices = std::clamp(env_int("KVSTASH_CUDA_MODEL_DEVICES", 1), 0, 64);
    // CUDA Environment Variables: CUDA_DEVICE_MAX_CONNECTIONS, 1 to 32, default 8.
    k.queues = std::clamp(env_int("CUDA_DEVICE_MAX_CONNECTIONS", 8), 1, 32);
    k.driver_version = env_int("KVSTASH_CUDA_MODEL_DRIVER_VERSION", CUDART_VERSION);
    k.rdma_ordering = env_int("KVSTASH_CUDA_MODEL_RDMA_ORDERING", 0);
    k.can_flush = env_int("KVSTASH_CUDA_MODEL_CAN_FLUSH", 1) != 0;
    return k;
  }();
  return c;
}

// The runtime's own initialization (\note_init_rt in cuda_runtime_api.h): a driver of an older
// major version than the runtime, or no device, fails every call that initializes the runtime.
cudaError_t init() {
  if (config().driver_version / 1000 < CUDART_VERSION / 1000) return cudaErrorInsufficientDriver;
  if (config().devices == 0) return cudaErrorNoDevice;
  return cudaSuccess;
}

// ---- state ---------------------------------------------------------------------------------

// One operation in a hardware queue. It starts when everything in `after` is done and `ready`
// (a stream wait-value's condition) holds; until then it holds up its whole queue.
struct Op {
  std::vector<std::shared_ptr<Op>> after;
  std::function<bool()> ready;
  std::function<void()> run;
  bool done = false;  // guarded by State::mu
};
using OpPtr = std::shared_ptr<Op>;

struct Queue {
  std::deque<OpPtr> pending;  // front: running or waiting to start
  OpPtr last;
};

enum class Kind { kLegacy, kPerThread, kCreated };

struct Stream {
  int device = 0;
  Kind kind = Kind::kCreated;
  unsigned flags = cudaStreamDefault;
  int queue = 0;
  OpPtr last;  // the latest operation queued (its queue is FIFO, so all before it are done with it)
  bool capturing = false;
  bool blocking() const { return kind != Kind::kLegacy && (flags & cudaStreamNonBlocking) == 0; }
};

// A device and its primary context (the CUcontext handle is the Device's address).
struct Device {
  int index = 0;
  bool active = false;
  int activations = 0;
  int retains = 0;
  std::vector<Queue> queues;
  int next_queue = 0;
  std::unique_ptr<Stream> legacy;
  std::vector<Stream*> blocking;  // created blocking streams and per-thread default streams
  std::vector<OpPtr> retired;     // last work of blocking streams destroyed before it ran
};

struct Event {
  int device = 0;
  OpPtr recorded;  // the marker of the latest cudaEventRecord; null: never recorded
};

struct Graph {};

struct Allocation {  // cudaMalloc
  std::byte* base;
  std::byte* view;
  std::size_t size;
  int fd;
  int device;
};

struct Pinned {  // cudaHostAlloc; `dev` differs from `host` only for write-combined memory
  std::byte* host;
  std::byte* dev;
  std::size_t size;
  int fd;  // -1 unless write-combined
  int device;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;  // an operation queued or done
  std::vector<Device> devices;
  std::unordered_map<const void*, std::unique_ptr<Stream>> streams;  // created streams
  std::unordered_map<const void*, std::unique_ptr<Stream>> per_thread_streams;
  std::unordered_map<const void*, std::unique_ptr<Event>> events;
  std::unordered_map<const void*, std::unique_ptr<Graph>> graphs;
  std::map<std::uintptr_t, Allocation> allocations;     // by device address
  std::map<std::uintptr_t, Pinned> pinned;              // by host address
  std::map<std::uintptr_t, std::uintptr_t> pinned_dev;  // write-combined device alias -> host address
  std::unordered_set<const KernelTwin*> twins;
  std::atomic<std::uint64_t> launches{0};
};

State& state() {
  // Deliberately never destroyed: detached queue workers may still be blocked on it (a deadlock
  // under test) when the process exits, and exit must not wait for them or free under them.
  static State& s = *[] {
    auto* st = new State;
    st->devices.resize(static_cast<std::size_t>(config().devices));
    for (int i = 0; i < config().devices; ++i) {
      st->devices[i].index = i;
      st->devices[i].queues.resize(static_cast<std::size_t>(config().queues));
    }
    return st;
  }();
  return s;
}

// Per host thread (cudaGetLastError: "in the host thread"; contexts are current per thread).
struct ThreadState {
  int device = 0;           // what cudaSetDevice chose
  Device* bound = nullptr;  // the context current to the thread
  cudaError_t last_error = cudaSuccess;
  std::vector<Stream*> per_thread;  // the thread's per-thread default stream on each device
  ~ThreadState();
};
thread_local ThreadState t_;
thread_local bool t_in_worker = false;

cudaError_t result(cudaError_t e) {
  if (e != cudaSuccess) t_.last_error = e;
  return e;
}

// A blocking stream leaves: the legacy stream still owes its queued work a wait.
void retire(Device& d, Stream& st) {
  std::erase(d.blocking, &st);
  if (st.last && !st.last->done) d.retired.push_back(st.last);
}

ThreadState::~ThreadState() {
  if (per_thread.empty()) return;
  State& s = state();
  std::lock_guard lock(s.mu);
  for (Stream* p : per_thread) {
    if (p == nullptr) continue;
    retire(s.devices[p->device], *p);
    s.per_thread_streams.erase(p);
  }
}

// ---- hardware queues -------------------------------------------------------------------------

// One worker per hardware queue: strictly in order, an operation that cannot start blocks every
// operation behind it, whatever its stream (CUDA_DEVICE_MAX_CONNECTIONS's false dependencies).
void worker(Device* d, int q) {
  t_in_worker = true;
  State& s = state();
  Queue& queue = d->queues[q];
  std::unique_lock lock(s.mu);
  for (;;) {
    s.cv.wait(lock, [&] { return !queue.pending.empty(); });
    OpPtr op = queue.pending.front();
    s.cv.wait(lock, [&] {
      return std::all_of(op->after.begin(), op->after.end(), [](auto& a) { return a->done; });
    });
    op->after.clear();
    lock.unlock();
    // cuStreamWaitValue32: the device polls the word; the model every 30 us.
    if (op->ready) {
      while (!op->ready()) std::this_thread::sleep_for(std::chrono::microseconds(30));
    }
    if (op->run) op->run();
    lock.lock();
    op->done = true;
    queue.pending.pop_front();
    s.cv.notify_all();
  }
}

std::unique_ptr<Stream> new_stream(Device& d, Kind kind, unsigned flags) {
  auto st = std::make_unique<Stream>();
  st->device = d.index;
  st->kind = kind;
  st->flags = flags;
  // Streams take queues round-robin in creation order (the real mapping is not documented);
  // with CUDA_DEVICE_MAX_CONNECTIONS=1 every stream shares one queue.
  st->queue = d.next_queue++ % static_cast<int>(d.queues.size());
  return st;
}

// Initializes a primary context (its legacy stream first, so it takes queue 0).
void activate(Device& d) {
  if (d.active) return;
  d.active = true;
  ++d.activations;
  d.legacy = new_stream(d, Kind::kLegacy, cudaStreamDefault);
  for (int q = 0; q < static_cast<int>(d.queues.size()); ++q) std::thread(worker, &d, q).detach();
}

// The context a runtime call runs in: the one current to the thread, else the current device's
// primary context, initialized and made current ('Interactions with the CUDA Driver API').
Device& context(State& s) {
  if (t_.bound == nullptr) {
    Device& d = s.devices[static_cast<std::size_t>(t_.device)];
    activate(d);
    t_.bound = &d;
  }
  return *t_.bound;
}

Stream* per_thread_stream(State& s, Device& d) {
  if (t_.per_thread.size() < s.devices.size()) t_.per_thread.resize(s.devices.size(), nullptr);
  Stream*& p = t_.per_thread[static_cast<std::size_t>(d.index)];
  if (p == nullptr) {
    auto st = new_stream(d, Kind::kPerThread, cudaStreamDefault);
    p = st.get();
    d.blocking.push_back(p);
    s.per_thread_streams.emplace(p, std::move(st));
  }
  return p;
}

// A stream handle as the runtime reads it in context `d`: 0 and cudaStreamLegacy are d's legacy
// stream, cudaStreamPerThread the thread's own; nullptr for a handle that names no stream.
Stream* stream_of(State& s, Device& d, const void* h, bool zero_is_per_thread = false) {
  if (h == nullptr) return zero_is_per_thread ? per_thread_stream(s, d) : d.legacy.get();
  if (h == cudaStreamLegacy) return d.legacy.get();
  if (h == cudaStreamPerThread) return per_thread_stream(s, d);
  auto it = s.streams.find(h);
  return it == s.streams.end() ? nullptr : it->second.get();
}

// Queues `op` on `st` with the implicit dependencies of 'Stream synchronization behavior': an
// action in the legacy stream first waits on all blocking streams of its context; an action in
// a blocking stream waits on the legacy stream. A capturing stream records instead (the model
// drops the work). Returns whether it was queued.
bool enqueue(State& s, Stream& st, OpPtr op) {
  if (st.capturing) return false;
  Device& d = s.devices[static_cast<std::size_t>(st.device)];
  auto owe = [&](const OpPtr& o) {
    if (o && !o->done) op->after.push_back(o);
  };
  if (st.kind == Kind::kLegacy) {
    for (Stream* b : d.blocking) owe(b->last);
    std::erase_if(d.retired, [](const OpPtr& o) { return o->done; });
    for (const OpPtr& o : d.retired) owe(o);
  } else if (st.blocking()) {
    owe(d.legacy->last);
  }
  st.last = op;
  Queue& q = d.queues[static_cast<std::size_t>(st.queue)];
  q.pending.push_back(op);
  q.last = op;
  s.cv.notify_all();
  return true;
}

void wait_for(State& s, std::unique_lock<std::mutex>& lock, const OpPtr& op) {
  s.cv.wait(lock, [&] { return op == nullptr || op->done; });
}

void synchronize_device(State& s, std::unique_lock<std::mutex>& lock, Device& d) {
  for (Queue& q : d.queues) wait_for(s, lock, q.last);
}

// ---- memory ---------------------------------------------------------------------------------

// What a fault in device memory says (tests/harness/host_faults.h): a twin that skipped view(), or host
// code.
const char* fault_message() {
  return t_in_worker
             ? "\n*** cuda_model: a kernel twin touched CUDA device memory without cuda_model::view(), at "
             : "\n*** the host touched CUDA device memory at ";
}

void watch(std::byte* base, std::size_t size) { test::host_faults::watch(base, size, fault_message); }
void unwatch(std::byte* base) { test::host_faults::unwatch(base); }

const Allocation* allocation_at(const State& s, std::uintptr_t a) {
  auto it = s.allocations.upper_bound(a);
  if (it == s.allocations.begin()) return nullptr;
  const Allocation& al = std::prev(it)->second;
  return a < reinterpret_cast<std::uintptr_t>(al.base) + al.size ? &al : nullptr;
}

const Pinned* pinned_at(const State& s, std::uintptr_t a) {
  auto it = s.pinned.upper_bound(a);
  if (it != s.pinned.begin()) {
    const Pinned& p = std::prev(it)->second;
    if (a < reinterpret_cast<std::uintptr_t>(p.host) + p.size) return &p;
  }
  auto d = s.pinned_dev.upper_bound(a);
  if (d == s.pinned_dev.begin()) return nullptr;
  const Pinned& p = s.pinned.at(std::prev(d)->second);
  return a < reinterpret_cast<std::uintptr_t>(p.dev) + p.size ? &p : nullptr;
}

enum class Where { kDevice, kPinned, kPageable, kBad };

// Where [p, p + n) lives; kBad when it is partly inside a device allocation.
Where where(const State& s, const void* p, std::size_t n) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (const Allocation* al = allocation_at(s, a)) {
    return n <= reinterpret_cast<std::uintptr_t>(al->base) + al->size - a ? Where::kDevice : Where::kBad;
  }
  auto next = s.allocations.upper_bound(a);
  if (next != s.allocations.end() && n > 0 && a + n > next->first) return Where::kBad;
  return pinned_at(s, a) != nullptr ? Where::kPinned : Where::kPageable;
}

void* translate(const State& s, const void* p, std::size_t n) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  switch (where(s, p, n)) {
    case Where::kBad:
      std::fprintf(stderr,
                   "cuda_model: [%p, +%zu) is partly inside CUDA device memory or runs past its end\n", p, n);
      std::abort();
    case Where::kDevice: {
      const Allocation* al = allocation_at(s, a);
      return al->view + (a - reinterpret_cast<std::uintptr_t>(al->base));
    }
    default: return const_cast<void*>(p);
  }
}

// ---- device attributes ------------------------------------------------------------------------

// The attributes the model answers (runtime and driver numbering agree); nullopt for others.
std::optional<int> attribute(int attr) {
  const Config& c = config();
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: return 1024;
    case cudaDevAttrMaxBlockDimX: return 1024;
    case cudaDevAttrMaxBlockDimY: return 1024;
    case cudaDevAttrMaxBlockDimZ: return 64;
    case cudaDevAttrMaxGridDimX: return 0x7fffffff;
    case cudaDevAttrMaxGridDimY: return 65535;
    case cudaDevAttrMaxGridDimZ: return 65535;
    case cudaDevAttrMultiProcessorCount: return 4;
    case cudaDevAttrCanMapHostMemory: return 1;
    case cudaDevAttrUnifiedAddressing: return 1;
    case cudaDevAttrComputeCapabilityMajor: return 9;
    case cudaDevAttrComputeCapabilityMinor: return 0;
    case cudaDevAttrCanUseHostPointerForRegisteredMem: return 1;
    case cudaDevAttrCanFlushRemoteWrites: return c.can_flush ? 1 : 0;
    case cudaDevAttrGPUDirectRDMASupported: return 1;
    case cudaDevAttrGPUDirectRDMAFlushWritesOptions:
      return c.can_flush ? (cudaFlushGPUDirectRDMAWritesOptionHost | cudaFlushGPUDirectRDMAWritesOptionMemOps)
                         : 0;
    case cudaDevAttrGPUDirectRDMAWritesOrdering: return c.rdma_ordering;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1: return 1;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1: return 1;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR: return 1;
    default: return std::nullopt;
  }
}

// ---- driver entry points (static: only reachable through cudaGetDriverEntryPoint*) ------------

Device* device_of_context(State& s, CUcontext c) {
  for (Device& d : s.devices) {
    if (reinterpret_cast<CUcontext>(&d) == c) return &d;
  }
  return nullptr;
}

CUresult CUDAAPI ctx_get_current(CUcontext* pctx) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pctx = reinterpret_cast<CUcontext>(t_.bound);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI ctx_set_current(CUcontext ctx) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (ctx == nullptr) {
    t_.bound = nullptr;
    return CUDA_SUCCESS;
  }
  Device* d = device_of_context(s, ctx);
  if (d == nullptr || !d->active) return CUDA_ERROR_INVALID_CONTEXT;
  t_.bound = d;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI primary_ctx_retain(CUcontext* pctx, CUdevice dev) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config().devices) return CUDA_ERROR_INVALID_DEVICE;
  State& s = state();
  std::lock_guard lock(s.mu);
  Device& d = s.devices[static_cast<std::size_t>(dev)];
  activate(d);  // active, not made current
  ++d.retains;
  *pctx = reinterpret_cast<CUcontext>(&d);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI primary_ctx_release(CUdevice dev) {
  if (dev < 0 || dev >= config().devices) return CUDA_ERROR_INVALID_DEVICE;
  State& s = state();
  std::lock_guard lock(s.mu);
  Device& d = s.devices[static_cast<std::size_t>(dev)];
  if (d.retains > 0) --d.retains;  // the model never deactivates a primary context
  return CUDA_SUCCESS;
}

CUresult CUDAAPI primary_ctx_get_state(CUdevice dev, unsigned int* flags, int* active) {
  if (flags == nullptr || active == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config().devices) return CUDA_ERROR_INVALID_DEVICE;
  State& s = state();
  std::lock_guard lock(s.mu);
  *flags = 0;
  *active = s.devices[static_cast<std::size_t>(dev)].active ? 1 : 0;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI device_get(CUdevice* device, int ordinal) {
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= config().devices) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI device_get_attribute(int* pi, CUdevice_attribute attrib, CUdevice dev) {
  if (pi == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (dev < 0 || dev >= config().devices) return CUDA_ERROR_INVALID_DEVICE;
  const std::optional<int> v = attribute(attrib);
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  *pi = *v;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI mem_get_address_range(CUdeviceptr* pbase, std::size_t* psize, CUdeviceptr dptr) {
  State& s = state();
  std::lock_guard lock(s.mu);
  const Allocation* al = allocation_at(s, static_cast<std::uintptr_t>(dptr));
  if (al == nullptr) return CUDA_ERROR_NOT_FOUND;
  if (pbase != nullptr) *pbase = reinterpret_cast<CUdeviceptr>(al->base);
  if (psize != nullptr) *psize = al->size;
  return CUDA_SUCCESS;
}

// cuStreamWaitValue32 / cuStreamWriteValue32. `addr` is a device address: cudaMalloc memory, or
// pinned host memory at its device address. The implicit streams need a current context (the
// driver API does not initialize one); `ptsz`: the per-thread-default-stream variant, where 0
// means the thread's per-thread stream.
CUresult value_op(CUstream h, CUdeviceptr addr, cuuint32_t value, unsigned flags, bool wait, bool ptsz) {
  State& s = state();
  std::lock_guard lock(s.mu);
  Stream* st = nullptr;
  const void* handle = h;
  if (handle == nullptr || handle == CU_STREAM_LEGACY || handle == CU_STREAM_PER_THREAD) {
    if (t_.bound == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
    st = stream_of(s, *t_.bound, handle, ptsz);
  } else if (auto it = s.streams.find(handle); it != s.streams.end()) {
    st = it->second.get();
  } else {
    return CUDA_ERROR_INVALID_HANDLE;
  }
  const void* p = reinterpret_cast<const void*>(addr);
  if (addr % 4 != 0) return CUDA_ERROR_INVALID_VALUE;
  const Where w = where(s, p, 4);
  if (w != Where::kDevice && w != Where::kPinned) return CUDA_ERROR_INVALID_VALUE;
  auto* word = static_cast<std::uint32_t*>(translate(s, p, 4));
  auto op = std::make_shared<Op>();
  if (wait) {
    const unsigned cond = flags & ~static_cast<unsigned>(CU_STREAM_WAIT_VALUE_FLUSH);
    if (cond > CU_STREAM_WAIT_VALUE_NOR) return CUDA_ERROR_INVALID_VALUE;
    if ((flags & CU_STREAM_WAIT_VALUE_FLUSH) != 0 && !config().can_flush) return CUDA_ERROR_NOT_SUPPORTED;
    // CUstreamWaitValue_flags: GEQ is cyclic, (int32_t)(*addr - value) >= 0.
    op->ready = [word, value, cond] {
      const std::uint32_t v = std::atomic_ref<std::uint32_t>(*word).load(std::memory_order_acquire);
      switch (cond) {
        case CU_STREAM_WAIT_VALUE_GEQ: return static_cast<std::int32_t>(v - value) >= 0;
        case CU_STREAM_WAIT_VALUE_EQ: return v == value;
        case CU_STREAM_WAIT_VALUE_AND: return (v & value) != 0;
        default: return ~(v | value) != 0;  // NOR
      }
    };
  } else {
    // CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER "is not supported in the v2 API".
    if (flags != CU_STREAM_WRITE_VALUE_DEFAULT) return CUDA_ERROR_INVALID_VALUE;
    op->run = [word, value] {
      std::atomic_ref<std::uint32_t>(*word).store(value, std::memory_order_seq_cst);
    };
  }
  enqueue(s, *st, std::move(op));
  return CUDA_SUCCESS;
}

CUresult CUDAAPI stream_wait_value32(CUstream st, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
  return value_op(st, addr, value, flags, true, false);
}
CUresult CUDAAPI stream_wait_value32_ptsz(CUstream st, CUdeviceptr addr, cuuint32_t value,
                                          unsigned int flags) {
  return value_op(st, addr, value, flags, true, true);
}
CUresult CUDAAPI stream_write_value32(CUstream st, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
  return value_op(st, addr, value, flags, false, false);
}
CUresult CUDAAPI stream_write_value32_ptsz(CUstream st, CUdeviceptr addr, cuuint32_t value,
                                           unsigned int flags) {
  return value_op(st, addr, value, flags, false, true);
}

// The symbols the model exports, the CUDA version each (its current ABI) appeared in, and the
// per-thread-stream variant where the driver has one. The casts check each signature against
// the toolkit's cudaTypedefs.h-equivalent declaration through its function type.
struct EntryPoint {
  const char* name;
  unsigned since;
  void* fn;
  void* ptsz;
};

template <class F>
void* fn_ptr(F* f) {
  return reinterpret_cast<void*>(f);
}

const std::array<EntryPoint, 10>& entry_points() {
  static const std::array<EntryPoint, 10> table{{
      {"cuStreamWaitValue32", 8000, fn_ptr<decltype(cuStreamWaitValue32)>(stream_wait_value32),
       fn_ptr<decltype(cuStreamWaitValue32)>(stream_wait_value32_ptsz)},
      {"cuStreamWriteValue32", 8000, fn_ptr<decltype(cuStreamWriteValue32)>(stream_write_value32),
       fn_ptr<decltype(cuStreamWriteValue32)>(stream_write_value32_ptsz)},
      {"cuCtxGetCurrent", 4000, fn_ptr<decltype(cuCtxGetCurrent)>(ctx_get_current), nullptr},
      {"cuCtxSetCurrent", 4000, fn_ptr<decltype(cuCtxSetCurrent)>(ctx_set_current), nullptr},
      {"cuDevicePrimaryCtxRetain", 7000, fn_ptr<decltype(cuDevicePrimaryCtxRetain)>(primary_ctx_retain),
       nullptr},
      {"cuDevicePrimaryCtxRelease", 7000, fn_ptr<decltype(cuDevicePrimaryCtxRelease)>(primary_ctx_release),
       nullptr},
      {"cuDevicePrimaryCtxGetState", 7000,
       fn_ptr<decltype(cuDevicePrimaryCtxGetState)>(primary_ctx_get_state), nullptr},
      {"cuDeviceGet", 2000, fn_ptr<decltype(cuDeviceGet)>(device_get), nullptr},
      {"cuDeviceGetAttribute", 2000, fn_ptr<decltype(cuDeviceGetAttribute)>(device_get_attribute), nullptr},
      {"cuMemGetAddressRange", 3020, fn_ptr<decltype(cuMemGetAddressRange)>(mem_get_address_range), nullptr},
  }};
  return table;
}

}  // namespace

// ---- the model's own API -------------------------------------------------------------------

void register_twin(const KernelTwin* twin) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.twins.insert(twin);
}

void* view(const void* addr, std::size_t bytes) {
  State& s = state();
  std::lock_guard lock(s.mu);
  return translate(s, addr, bytes);
}

std::optional<DeviceRange> device_range(const void* addr) {
  State& s = state();
  std::lock_guard lock(s.mu);
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  const Allocation* al = allocation_at(s, a);
  if (al == nullptr) return std::nullopt;
  const std::uint64_t off = a - reinterpret_cast<std::uintptr_t>(al->base);
  return DeviceRange{al->fd, off, al->size - off, al->base};
}

int context_activations(int device) {
  if (device < 0 || device >= config().devices) return 0;
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.devices[static_cast<std::size_t>(device)].activations;
}

bool context_active(int device) {
  if (device < 0 || device >= config().devices) return false;
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.devices[static_cast<std::size_t>(device)].active;
}

int device_count() { return config().devices; }
int hardware_queues() { return config().queues; }

int queue_of(cudaStream_t stream) {
  if (init() != cudaSuccess) return -1;
  State& s = state();
  std::lock_guard lock(s.mu);
  Stream* st = stream_of(s, context(s), stream);
  return st == nullptr ? -1 : st->queue;
}

std::uint64_t launches() { return state().launches.load(); }

}  // namespace kvstash::cuda_model

// ---- the runtime -----------------------------------------------------------------------------
// Each function: initialize (\note_init_rt), take the context if it needs one, record any error
// as the thread's last error (result()).

using namespace kvstash::cuda_model;  // NOLINT: the definitions below are the C API

// Errors and versions: no context.

extern "C" cudaError_t cudaGetLastError(void) {
  const cudaError_t e = t_.last_error;
  t_.last_error = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) { return t_.last_error; }

#define KVSTASH_CUDA_MODEL_ERRORS(X)                                                             \
  X(cudaSuccess, "no error")                                                                     \
  X(cudaErrorInvalidValue, "invalid argument")                                                   \
  X(cudaErrorMemoryAllocation, "out of memory")                                                  \
  X(cudaErrorInvalidConfiguration, "invalid configuration argument")                             \
  X(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy")                        \
  X(cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime version") \
  X(cudaErrorNoDevice, "no CUDA-capable device is detected")                                     \
  X(cudaErrorInvalidDevice, "invalid device ordinal")                                            \
  X(cudaErrorInvalidDeviceFunction, "invalid device function")                                   \
  X(cudaErrorInvalidResourceHandle, "invalid resource handle")                                   \
  X(cudaErrorIllegalState, "the operation cannot be performed in the present state")             \
  X(cudaErrorNotReady, "device not ready")                                                       \
  X(cudaErrorNotSupported, "operation not supported")                                            \
  X(cudaErrorStreamCaptureUnsupported, "operation not permitted when stream is capturing")

extern "C" const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
#define KVSTASH_NAME(code, text) \
  case code: return #code;
    KVSTASH_CUDA_MODEL_ERRORS(KVSTASH_NAME)
#undef KVSTASH_NAME
    default: return "unrecognized error code";
  }
}

extern "C" const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
#define KVSTASH_TEXT(code, text) \
  case code: return text;
    KVSTASH_CUDA_MODEL_ERRORS(KVSTASH_TEXT)
#undef KVSTASH_TEXT
    default: return "unrecognized error code";
  }
}

extern "C" cudaError_t cudaDriverGetVersion(int* driverVersion) {
  if (driverVersion == nullptr) return result(cudaErrorInvalidValue);
  *driverVersion = config().driver_version;
  return cudaSuccess;
}

extern "C" cudaError_t cudaRuntimeGetVersion(int* runtimeVersion) {
  if (runtimeVersion == nullptr) return result(cudaErrorInvalidValue);
  *runtimeVersion = CUDART_VERSION;
  return cudaSuccess;
}

// Devices: the runtime initializes, but no context is made.

extern "C" cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return result(cudaErrorInvalidValue);
  *count = 0;
  if (cudaError_t e = init(); e != cudaSuccess) return result(e);
  *count = config().devices;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGetDevice(int* device) {
  if (cudaError_t e = init(); e != cudaSuccess) return result(e);
  if (device == nullptr) return result(cudaErrorInvalidValue);
  *device = t_.bound != nullptr ? t_.bound->index : t_.device;
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (cudaError_t e = init(); e != cudaSuccess) return result(e);
  if (value == nullptr) return result(cudaErrorInvalidValue);
  if (device < 0 || device >= config().devices) return result(cudaErrorInvalidDevice);
  const std::optional<int> v = attribute(attr);
  if (!v) return result(cudaErrorInvalidValue);  // an attribute outside the model's subset
  *value = *v;
  return cudaSuccess;
}

// cudaSetDevice: initializes the device's primary context at once and makes it current.
extern "C" cudaError_t cudaSetDevice(int device) {
  if (cudaError_t e = init(); e != cudaSuccess) return result(e);
  if (device < 0 || device >= config().devices) return result(cudaErrorInvalidDevice);
  State& s = state();
  std::lock_guard lock(s.mu);
  t_.device = device;
  Device& d = s.devices[static_cast<std::size_t>(device)];
  activate(d);
  t_.bound = &d;
  return cudaSuccess;
}

namespace {

// The start of every runtime call that needs a context: the runtime initialized, the model's
// lock held, the context taken ('Interactions with the CUDA Driver API'). `error` is the
// initialization's error (already recorded), if any.
struct Call {
  State& s = state();
  cudaError_t error = result(init());
  std::unique_lock<std::mutex> lock{s.mu, std::defer_lock};
  Device* ctx = nullptr;
  Call() {
    if (error != cudaSuccess) return;
    lock.lock();
    ctx = &context(s);
  }
  Stream* stream(const void* handle) { return stream_of(s, *ctx, handle); }
  Event* event(const void* handle) {
    auto it = s.events.find(handle);
    return it == s.events.end() ? nullptr : it->second.get();
  }
};

}  // namespace

extern "C" cudaError_t cudaDeviceSynchronize(void) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  synchronize_device(c.s, c.lock, *c.ctx);
  return cudaSuccess;
}

// cudaDeviceFlushGPUDirectRDMAWrites: the model's memory is coherent, so a supported flush has
// nothing to wait for.
extern "C" cudaError_t cudaDeviceFlushGPUDirectRDMAWrites(enum cudaFlushGPUDirectRDMAWritesTarget target,
                                                          enum cudaFlushGPUDirectRDMAWritesScope scope) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  if (target != cudaFlushGPUDirectRDMAWritesTargetCurrentDevice) return result(cudaErrorInvalidValue);
  if (scope != cudaFlushGPUDirectRDMAWritesToOwner && scope != cudaFlushGPUDirectRDMAWritesToAllDevices)
    return result(cudaErrorInvalidValue);
  return result(config().can_flush ? cudaSuccess : cudaErrorNotSupported);
}

// Streams.

extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  if (pStream == nullptr || (flags & ~static_cast<unsigned>(cudaStreamNonBlocking)) != 0)
    return result(cudaErrorInvalidValue);
  auto st = new_stream(*c.ctx, Kind::kCreated, flags);
  if (st->blocking()) c.ctx->blocking.push_back(st.get());
  *pStream = reinterpret_cast<cudaStream_t>(st.get());
  c.s.streams.emplace(st.get(), std::move(st));
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  return cudaStreamCreateWithFlags(pStream, cudaStreamDefault);
}

// cudaStreamDestroy: returns at once; work already queued still runs.
extern "C" cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  auto it = c.s.streams.find(stream);
  if (it == c.s.streams.end()) return result(cudaErrorInvalidResourceHandle);
  Stream& st = *it->second;
  if (st.blocking()) retire(c.s.devices[static_cast<std::size_t>(st.device)], st);
  c.s.streams.erase(it);
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(stream);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (st->capturing) return result(cudaErrorStreamCaptureUnsupported);
  return result(st->last == nullptr || st->last->done ? cudaSuccess : cudaErrorNotReady);
}

extern "C" cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(stream);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (st->capturing) return result(cudaErrorStreamCaptureUnsupported);
  wait_for(c.s, c.lock, st->last);
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int* device) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(hStream);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (device == nullptr) return result(cudaErrorInvalidValue);
  *device = st->device;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamGetFlags(cudaStream_t hStream, unsigned int* flags) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(hStream);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (flags == nullptr) return result(cudaErrorInvalidValue);
  *flags = st->flags;
  return cudaSuccess;
}

// Capture: the legacy stream cannot be captured; captured work is dropped (never run).
extern "C" cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(stream);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (st->kind == Kind::kLegacy) return result(cudaErrorStreamCaptureUnsupported);
  if (mode < cudaStreamCaptureModeGlobal || mode > cudaStreamCaptureModeRelaxed)
    return result(cudaErrorInvalidValue);
  if (st->capturing) return result(cudaErrorIllegalState);
  st->capturing = true;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamIsCapturing(cudaStream_t stream,
                                             enum cudaStreamCaptureStatus* pCaptureStatus) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(stream);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (pCaptureStatus == nullptr) return result(cudaErrorInvalidValue);
  *pCaptureStatus = st->capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(stream);
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (pGraph == nullptr) return result(cudaErrorInvalidValue);
  if (!st->capturing) return result(cudaErrorIllegalState);
  st->capturing = false;
  auto g = std::make_unique<Graph>();
  *pGraph = reinterpret_cast<cudaGraph_t>(g.get());
  c.s.graphs.emplace(g.get(), std::move(g));
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  return result(c.s.graphs.erase(graph) == 1 ? cudaSuccess : cudaErrorInvalidValue);
}

// Events.

extern "C" cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  constexpr unsigned kKnown = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (event == nullptr || (flags & ~kKnown) != 0) return result(cudaErrorInvalidValue);
  // cudaEventInterprocess "must be specified along with cudaEventDisableTiming".
  if ((flags & cudaEventInterprocess) != 0 && (flags & cudaEventDisableTiming) == 0)
    return result(cudaErrorInvalidValue);
  auto ev = std::make_unique<Event>();
  ev->device = c.ctx->index;
  *event = reinterpret_cast<cudaEvent_t>(ev.get());
  c.s.events.emplace(ev.get(), std::move(ev));
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

// cudaEventDestroy: returns at once; an event still pending completes on its own.
extern "C" cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  return result(c.s.events.erase(event) == 1 ? cudaSuccess : cudaErrorInvalidResourceHandle);
}

// cudaEventRecord: captures the contents of the stream now (a marker queued on it, with the
// stream's implicit dependencies); the event and the stream must share a device ('Stream and
// Event Behavior').
extern "C" cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(stream);
  Event* ev = c.event(event);
  if (st == nullptr || ev == nullptr || ev->device != st->device)
    return result(cudaErrorInvalidResourceHandle);
  auto marker = std::make_shared<Op>();
  if (enqueue(c.s, *st, marker)) ev->recorded = std::move(marker);
  return cudaSuccess;
}

// cudaEventQuery: cudaSuccess when the recorded work is done or the event was never recorded,
// else cudaErrorNotReady, which (as every error) becomes the thread's last error.
extern "C" cudaError_t cudaEventQuery(cudaEvent_t event) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Event* ev = c.event(event);
  if (ev == nullptr) return result(cudaErrorInvalidResourceHandle);
  return result(ev->recorded == nullptr || ev->recorded->done ? cudaSuccess : cudaErrorNotReady);
}

extern "C" cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Event* ev = c.event(event);
  if (ev == nullptr) return result(cudaErrorInvalidResourceHandle);
  wait_for(c.s, c.lock, OpPtr(ev->recorded));  // a copy: the event may be destroyed meanwhile
  return cudaSuccess;
}

// cudaStreamWaitEvent: work queued on the stream later waits for the event as recorded now
// (never recorded: no wait). The event may belong to another device.
extern "C" cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  Stream* st = c.stream(stream);
  Event* ev = c.event(event);
  if (st == nullptr || ev == nullptr) return result(cudaErrorInvalidResourceHandle);
  if ((flags & ~static_cast<unsigned>(cudaEventWaitExternal)) != 0) return result(cudaErrorInvalidValue);
  auto op = std::make_shared<Op>();
  if (ev->recorded && !ev->recorded->done) op->after.push_back(ev->recorded);
  enqueue(c.s, *st, std::move(op));
  return cudaSuccess;
}

// Kernels.

// cudaLaunchKernel returns the launch's own error (and records it); a successful launch leaves
// the thread's last error as it was.
extern "C" cudaError_t cudaLaunchKernel(const void* func, dim3 gridDim, dim3 blockDim, void** args,
                                        size_t sharedMem, cudaStream_t stream) {
  (void)sharedMem;  // not modelled
  Call c;
  if (c.error != cudaSuccess) return c.error;
  const auto* twin = static_cast<const KernelTwin*>(func);
  if (c.s.twins.count(twin) == 0) return result(cudaErrorInvalidDeviceFunction);
  const std::uint64_t threads = std::uint64_t{blockDim.x} * blockDim.y * blockDim.z;
  if (gridDim.x == 0 || gridDim.y == 0 || gridDim.z == 0 || threads == 0 || threads > 1024 ||
      blockDim.x > 1024 || blockDim.y > 1024 || blockDim.z > 64 || gridDim.x > 0x7fffffffu ||
      gridDim.y > 65535 || gridDim.z > 65535)
    return result(cudaErrorInvalidConfiguration);
  Stream* st = c.stream(stream);
  // CUDA C++ Programming Guide, 'Stream and Event Behavior': a launch to a stream of another
  // device fails.
  if (st == nullptr || st->device != c.ctx->index) return result(cudaErrorInvalidResourceHandle);
  if (!twin->arg_sizes.empty() && args == nullptr) return result(cudaErrorInvalidValue);
  Launch launch{gridDim, blockDim, {}};
  for (std::size_t i = 0; i < twin->arg_sizes.size(); ++i) {
    const auto* p = static_cast<const std::byte*>(args[i]);
    launch.args.emplace_back(p, p + twin->arg_sizes[i]);
  }
  auto op = std::make_shared<Op>();
  op->run = [twin, launch = std::move(launch), &s = c.s] {
    twin->run(launch);
    s.launches.fetch_add(1);
  };
  enqueue(c.s, *st, std::move(op));
  return cudaSuccess;
}

// Memory.

namespace {

// Two mappings of a new memfd of `bytes`: the first with `first_prot`, the second read-write.
bool map_twice(std::size_t bytes, int first_prot, int& fd, std::byte*& first, std::byte*& second) {
  fd = ::memfd_create("kvstash-cuda-model", MFD_CLOEXEC);
  void* a = MAP_FAILED;
  void* b = MAP_FAILED;
  if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    a = ::mmap(nullptr, bytes, first_prot, MAP_SHARED | MAP_NORESERVE, fd, 0);
    b = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  }
  if (a != MAP_FAILED && b != MAP_FAILED) {
    first = static_cast<std::byte*>(a);
    second = static_cast<std::byte*>(b);
    return true;
  }
  if (a != MAP_FAILED) ::munmap(a, bytes);
  if (b != MAP_FAILED) ::munmap(b, bytes);
  if (fd >= 0) ::close(fd);
  return false;
}

std::size_t round_to_pages(std::size_t bytes) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

}  // namespace

// cudaMalloc: a memfd mapped PROT_NONE at the device address and read-write for the model.
// Zero bytes: cudaSuccess and a null pointer.
extern "C" cudaError_t cudaMalloc(void** devPtr, size_t size) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  if (devPtr == nullptr) return result(cudaErrorInvalidValue);
  *devPtr = nullptr;
  if (size == 0) return cudaSuccess;
  Allocation al{nullptr, nullptr, round_to_pages(size), -1, c.ctx->index};
  if (!map_twice(al.size, PROT_NONE, al.fd, al.base, al.view)) return result(cudaErrorMemoryAllocation);
  watch(al.base, al.size);
  c.s.allocations.emplace(reinterpret_cast<std::uintptr_t>(al.base), al);
  *devPtr = al.base;
  return cudaSuccess;
}

// cudaFree "may perform implicit synchronization": the model always synchronizes the
// allocation's device first, so no queued work outlives the memory.
extern "C" cudaError_t cudaFree(void* devPtr) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  if (devPtr == nullptr) return cudaSuccess;
  const auto key = reinterpret_cast<std::uintptr_t>(devPtr);
  auto it = c.s.allocations.find(key);
  if (it == c.s.allocations.end()) return result(cudaErrorInvalidValue);
  synchronize_device(c.s, c.lock, c.s.devices[static_cast<std::size_t>(it->second.device)]);
  it = c.s.allocations.find(key);  // freed by another thread meanwhile?
  if (it == c.s.allocations.end()) return result(cudaErrorInvalidValue);
  const Allocation al = it->second;
  c.s.allocations.erase(it);
  unwatch(al.base);
  ::munmap(al.base, al.size);
  ::munmap(al.view, al.size);
  ::close(al.fd);
  return cudaSuccess;
}

// cudaHostAlloc: page-locked host memory the host may touch. With unified addressing its device
// address is its host address, except for write-combined memory ('Unified Addressing',
// 'Exceptions, Disjoint Addressing'), which the model maps a second time for the device.
extern "C" cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  constexpr unsigned kKnown = cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined;
  if (pHost == nullptr || (flags & ~kKnown) != 0) return result(cudaErrorInvalidValue);
  *pHost = nullptr;
  if (size == 0) return cudaSuccess;
  Pinned p{nullptr, nullptr, round_to_pages(size), -1, c.ctx->index};
  if ((flags & cudaHostAllocWriteCombined) == 0) {
    void* m = ::mmap(nullptr, p.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return result(cudaErrorMemoryAllocation);
    p.host = p.dev = static_cast<std::byte*>(m);
  } else {
    if (!map_twice(p.size, PROT_READ | PROT_WRITE, p.fd, p.host, p.dev))
      return result(cudaErrorMemoryAllocation);
    c.s.pinned_dev.emplace(reinterpret_cast<std::uintptr_t>(p.dev), reinterpret_cast<std::uintptr_t>(p.host));
  }
  c.s.pinned.emplace(reinterpret_cast<std::uintptr_t>(p.host), p);
  *pHost = p.host;
  return cudaSuccess;
}

extern "C" cudaError_t cudaMallocHost(void** ptr, size_t size) {
  return cudaHostAlloc(ptr, size, cudaHostAllocDefault);
}

// cudaFreeHost: not documented to synchronize; the model synchronizes every active device first
// (as drivers do in practice), so no queued copy or wait-value outlives the memory.
extern "C" cudaError_t cudaFreeHost(void* ptr) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  if (ptr == nullptr) return cudaSuccess;
  const auto key = reinterpret_cast<std::uintptr_t>(ptr);
  if (c.s.pinned.count(key) == 0) return result(cudaErrorInvalidValue);
  for (Device& d : c.s.devices) {
    if (d.active) synchronize_device(c.s, c.lock, d);
  }
  auto it = c.s.pinned.find(key);
  if (it == c.s.pinned.end()) return result(cudaErrorInvalidValue);
  const Pinned p = it->second;
  c.s.pinned.erase(it);
  ::munmap(p.host, p.size);
  if (p.dev != p.host) {
    c.s.pinned_dev.erase(reinterpret_cast<std::uintptr_t>(p.dev));
    ::munmap(p.dev, p.size);
  }
  if (p.fd >= 0) ::close(p.fd);
  return cudaSuccess;
}

extern "C" cudaError_t cudaHostGetDevicePointer(void** pDevice, void* pHost, unsigned int flags) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  if (pDevice == nullptr || flags != 0) return result(cudaErrorInvalidValue);
  auto it = c.s.pinned.upper_bound(reinterpret_cast<std::uintptr_t>(pHost));
  if (it == c.s.pinned.begin()) return result(cudaErrorInvalidValue);
  const Pinned& p = std::prev(it)->second;
  const auto off = reinterpret_cast<std::uintptr_t>(pHost) - reinterpret_cast<std::uintptr_t>(p.host);
  if (off >= p.size) return result(cudaErrorInvalidValue);
  *pDevice = p.dev + off;
  return cudaSuccess;
}

extern "C" cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* ptr) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  if (attributes == nullptr) return result(cudaErrorInvalidValue);
  *attributes = cudaPointerAttributes{};
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  if (const Allocation* al = allocation_at(c.s, a)) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = al->device;
    attributes->devicePointer = const_cast<void*>(ptr);
  } else if (const Pinned* p = pinned_at(c.s, a)) {
    const auto dev = reinterpret_cast<std::uintptr_t>(p->dev);
    const std::size_t off =
        a - (a >= dev && a < dev + p->size ? dev : reinterpret_cast<std::uintptr_t>(p->host));
    attributes->type = cudaMemoryTypeHost;
    attributes->device = p->device;
    attributes->devicePointer = p->dev + off;
    attributes->hostPointer = p->host + off;
  } else {
    // "In CUDA 11.0 forward passing host pointer will return cudaMemoryTypeUnregistered".
    attributes->type = cudaMemoryTypeUnregistered;
    attributes->device = cudaInvalidDeviceId;
    attributes->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

namespace {

// A copy (`set`: a memset of `value`) queued on a stream (`async`: `stream`, else the legacy
// stream), waited for where 'API synchronization behavior' makes the call synchronous:
// cudaMemcpy except device to device; cudaMemcpyAsync with pageable host memory, which "might
// be synchronous" (the model: it is); cudaMemset into pinned host memory.
cudaError_t queue_copy(void* dst, const void* src, std::size_t count, int kind, cudaStream_t stream,
                       bool async, int value, bool set) {
  Call c;
  if (c.error != cudaSuccess) return c.error;
  if (!set && (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault))
    return result(cudaErrorInvalidMemcpyDirection);
  Stream* st = async ? c.stream(stream) : c.ctx->legacy.get();
  if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (count == 0) return cudaSuccess;
  if (dst == nullptr || (!set && src == nullptr)) return result(cudaErrorInvalidValue);
  const Where to = where(c.s, dst, count);
  const Where from = set ? to : where(c.s, src, count);
  if (to == Where::kBad || from == Where::kBad) return result(cudaErrorInvalidValue);
  if (set && to == Where::kPageable) return result(cudaErrorInvalidValue);
  bool wait = false;
  if (set) {
    wait = !async && to == Where::kPinned;
  } else if (async) {
    wait = to == Where::kPageable || from == Where::kPageable;
  } else {
    wait = !(to == Where::kDevice && from == Where::kDevice);
  }
  auto op = std::make_shared<Op>();
  if (set) {
    op->run = [dst, count, value] { std::memset(view(dst, count), value, count); };
  } else {
    op->run = [dst, src, count] { std::memcpy(view(dst, count), view(src, count), count); };
  }
  const OpPtr mine = op;
  if (enqueue(c.s, *st, std::move(op)) && wait) wait_for(c.s, c.lock, mine);
  return cudaSuccess;
}

}  // namespace

extern "C" cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  return queue_copy(dst, src, count, kind, nullptr, false, 0, false);
}

extern "C" cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                                       cudaStream_t stream) {
  return queue_copy(dst, src, count, kind, stream, true, 0, false);
}

extern "C" cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  return queue_copy(devPtr, nullptr, count, 0, nullptr, false, value, true);
}

extern "C" cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  return queue_copy(devPtr, nullptr, count, 0, stream, true, value, true);
}

// Driver entry points: the driver of the configured version, reached through the runtime (no
// context needed). "If the specified CUDA version is greater than the driver version, the API
// will return cudaErrorInvalidValue"; an unknown symbol, or one newer than cudaVersion, is
// cudaSuccess with a null pointer and the reason in driverStatus.
extern "C" cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr,
                                                        unsigned int cudaVersion, unsigned long long flags,
                                                        enum cudaDriverEntryPointQueryResult* driverStatus) {
  if (cudaError_t e = init(); e != cudaSuccess) return result(e);
  if (symbol == nullptr || funcPtr == nullptr || flags > cudaEnablePerThreadDefaultStream)
    return result(cudaErrorInvalidValue);
  if (cudaVersion > static_cast<unsigned>(config().driver_version)) return result(cudaErrorInvalidValue);
  *funcPtr = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  for (const EntryPoint& ep : entry_points()) {
    if (std::strcmp(ep.name, symbol) != 0) continue;
    if (cudaVersion < ep.since) {
      found = cudaDriverEntryPointVersionNotSufficent;
    } else {
      found = cudaDriverEntryPointSuccess;
      *funcPtr = flags == cudaEnablePerThreadDefaultStream && ep.ptsz != nullptr ? ep.ptsz : ep.fn;
    }
  }
  if (driverStatus != nullptr) *driverStatus = found;
  return cudaSuccess;
}

// Deprecated: the version is the runtime's own (CUDART_VERSION), capped at the driver's.
extern "C" cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** funcPtr, unsigned long long flags,
                                               enum cudaDriverEntryPointQueryResult* driverStatus) {
  const auto version = static_cast<unsigned>(std::min(CUDART_VERSION, config().driver_version));
  return cudaGetDriverEntryPointByVersion(symbol, funcPtr, version, flags, driverStatus);
}
