// The device stand-in (device_standin.h): a memfd mapped twice, worker-thread streams, and
// kernels that reach the memory only through the device's own mapping.
#include "device_standin.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "common/checksum.h"
#include "common/thread_pool.h"

namespace kvstash::test {

// ---- faults: a host touch of sealed memory names itself -----------------------------------

namespace {

struct Range {
  std::atomic<std::uintptr_t> begin{0}, end{0};
};
std::array<Range, 16> g_sealed;  // read by the signal handler: atomics, no locks
struct sigaction g_previous {};

void on_fault(int sig, siginfo_t* info, void* ctx) {
  const auto at = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (const Range& r : g_sealed) {
    if (at >= r.begin.load() && at < r.end.load()) {
      static constexpr char kMsg[] =
          "\n*** the host touched device memory (a DeviceStandin's sealed mapping): a host code path "
          "read or wrote GPU memory ***\n";
      (void)!::write(2, kMsg, sizeof kMsg - 1);
      ::abort();
    }
  }
  // Not ours: what was there before (the default: die).
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, ctx);
    return;
  }
  ::signal(sig, g_previous.sa_handler == SIG_IGN ? SIG_DFL : g_previous.sa_handler);
  ::raise(sig);
}

void watch(std::byte* base, std::size_t size) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &g_previous);
  });
  for (Range& r : g_sealed) {
    std::uintptr_t expected = 0;
    if (r.begin.compare_exchange_strong(expected, reinterpret_cast<std::uintptr_t>(base))) {
      r.end.store(reinterpret_cast<std::uintptr_t>(base) + size);
      return;
    }
  }
}

void unwatch(std::byte* base) {
  for (Range& r : g_sealed) {
    if (r.begin.load() == reinterpret_cast<std::uintptr_t>(base)) {
      r.end.store(0);
      r.begin.store(0);
    }
  }
}

}  // namespace

// ---- streams and events -------------------------------------------------------------------

struct DeviceStandin::Event {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t recorded = 0;   // records so far
  std::uint64_t completed = 0;  // the latest record reached
  bool done() const { return completed == recorded; }
};

// A stream is one worker running what was queued on it in order: a pool of one thread.
struct DeviceStandin::Stream {
  ThreadPool worker{1};
  void push(std::function<void()> op) { (void)worker.submit(std::move(op)); }
};

namespace {

// Records `e` now; the returned op completes that record.
std::function<void()> record_op(DeviceStandin::Event* e) {
  std::uint64_t n = 0;
  {
    std::lock_guard lock(e->mu);
    n = ++e->recorded;
  }
  return [e, n] {
    {
      std::lock_guard lock(e->mu);
      e->completed = std::max(e->completed, n);
    }
    e->cv.notify_all();
  };
}

// Waits, on a stream's thread, for the record of `e` current when this was queued.
std::function<void()> wait_op(DeviceStandin::Event* e) {
  std::uint64_t n = 0;
  {
    std::lock_guard lock(e->mu);
    n = e->recorded;
  }
  return [e, n] {
    std::unique_lock lock(e->mu);
    e->cv.wait(lock, [&] { return e->completed >= n; });
  };
}

class StandinMark final : public KvDeviceMark {
 public:
  StandinMark(DeviceStandin::Event* e, std::uint64_t n) : e_(e), n_(n) {}
  Status wait(Deadline deadline) override {
    std::unique_lock lock(e_->mu);
    if (!e_->cv.wait_until(lock, deadline, [&] { return e_->completed >= n_; })) {
      return Status::timeout("standin: the engine's work did not finish in time");
    }
    return {};
  }

 private:
  DeviceStandin::Event* e_;
  std::uint64_t n_;
};

// Events the host completes: each has one record, completed by complete_through.
class StandinSignals final : public KvDeviceSignals {
 public:
  explicit StandinSignals(std::vector<DeviceStandin::Event*> events) : events_(std::move(events)) {
    for (auto* e : events_) {
      std::lock_guard lock(e->mu);
      ++e->recorded;
    }
  }
  ~StandinSignals() override { complete_through(events_.size()); }
  void* event(std::size_t i) const override { return events_.at(i); }
  void complete_through(std::size_t n) override {
    for (std::size_t i = 0; i < n && i < events_.size(); ++i) {
      DeviceStandin::Event* e = events_[i];
      {
        std::lock_guard lock(e->mu);
        e->completed = e->recorded;
      }
      e->cv.notify_all();
    }
  }

 private:
  std::vector<DeviceStandin::Event*> events_;
};

}  // namespace

// ---- the device ---------------------------------------------------------------------------

Result<std::shared_ptr<DeviceStandin>> DeviceStandin::create(std::size_t bytes) {
  if (bytes == 0) return Status::invalid_argument("standin: no memory asked for");
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t size = (bytes + page - 1) / page * page;
  auto d = std::shared_ptr<DeviceStandin>(new DeviceStandin());
  d->fd_ = ::memfd_create("kvstash-device-standin", MFD_CLOEXEC);
  if (d->fd_ < 0) return Status::from_errno("standin: memfd_create", errno);
  if (::ftruncate(d->fd_, static_cast<off_t>(size)) != 0)
    return Status::from_errno("standin: ftruncate", errno);
  for (std::byte** m : {&d->base_, &d->view_}) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, d->fd_, 0);
    if (p == MAP_FAILED) return Status::from_errno("standin: mmap", errno);
    *m = static_cast<std::byte*>(p);
  }
  d->size_ = size;
  d->mark_stream_ = static_cast<Stream*>(d->create_stream());
  return d;
}

DeviceStandin::~DeviceStandin() {
  streams_.clear();  // joins the workers: no kernel runs any more
  if (sealed_) unwatch(base_);
  if (base_ != nullptr) ::munmap(base_, size_);
  if (view_ != nullptr) ::munmap(view_, size_);
  if (fd_ >= 0) ::close(fd_);
}

MemoryRegion DeviceStandin::region() const { return {base_, size_, MemoryKind::kCuda, fd_, 0}; }

Status DeviceStandin::seal() {
  std::lock_guard lock(mu_);
  if (sealed_) return {};
  if (::mprotect(base_, size_, PROT_NONE) != 0) return Status::from_errno("standin: mprotect", errno);
  watch(base_, size_);
  sealed_ = true;
  return {};
}

std::byte* DeviceStandin::view(const void* device_addr) const {
  return view_ + (static_cast<const std::byte*>(device_addr) - base_);
}

std::uint64_t DeviceStandin::summed_bytes() const { return summed_.load(); }
std::uint64_t DeviceStandin::copied_bytes() const { return copied_.load(); }

void* DeviceStandin::create_stream() {
  std::lock_guard lock(mu_);
  streams_.push_back(std::make_unique<Stream>());
  return streams_.back().get();
}

void* DeviceStandin::create_event() {
  std::lock_guard lock(mu_);
  events_.push_back(std::make_unique<Event>());
  return events_.back().get();
}

DeviceStandin::Event* DeviceStandin::event_of(void* handle) const {
  std::lock_guard lock(mu_);
  for (const auto& e : events_) {
    if (e.get() == handle) return e.get();
  }
  return nullptr;
}

DeviceStandin::Stream* DeviceStandin::stream_of(void* handle) const {
  std::lock_guard lock(mu_);
  for (const auto& s : streams_) {
    if (s.get() == handle) return s.get();
  }
  return nullptr;
}

void DeviceStandin::launch(void* stream, std::function<void()> kernel) {
  stream_of(stream)->push(std::move(kernel));
}

void DeviceStandin::record(void* event, void* stream) { stream_of(stream)->push(record_op(event_of(event))); }

void DeviceStandin::wait_event(void* stream, void* event) {
  stream_of(stream)->push(wait_op(event_of(event)));
}

void DeviceStandin::synchronize(void* stream) {
  Event done;
  stream_of(stream)->push(record_op(&done));
  std::unique_lock lock(done.mu);
  done.cv.wait(lock, [&] { return done.done(); });
}

Status DeviceStandin::check_runs(std::span<const KvRun> runs) const {
  for (const KvRun& r : runs) {
    if (r.addr < base_ || r.addr + r.length > base_ + size_) {
      return Status::invalid_argument("standin: a run lies outside the device's memory");
    }
  }
  return {};
}

Status DeviceStandin::gather(std::span<const KvRun> runs, std::byte* dst) {
  KVSTASH_RETURN_IF_ERROR(check_runs(runs));
  for (const KvRun& r : runs) {
    std::memcpy(dst, view(r.addr), r.length);
    dst += r.length;
    copied_ += r.length;
  }
  return {};
}

Status DeviceStandin::scatter(const std::byte* src, std::span<const KvRun> runs) {
  KVSTASH_RETURN_IF_ERROR(check_runs(runs));
  for (const KvRun& r : runs) {
    std::memcpy(view(r.addr), src, r.length);
    src += r.length;
    copied_ += r.length;
  }
  return {};
}

Result<std::shared_ptr<std::byte>> DeviceStandin::allocate_host(std::size_t bytes) {
  auto* p = static_cast<std::byte*>(::operator new (bytes, std::align_val_t{4096}));
  return std::shared_ptr<std::byte>(p, [](std::byte* q) { ::operator delete (q, std::align_val_t{4096}); });
}

Result<std::uint64_t> DeviceStandin::segment_sum(std::span<const KvRun> runs) {
  KVSTASH_RETURN_IF_ERROR(check_runs(runs));
  // As the CUDA device does: pack the runs into device scratch, one digest per 4 KiB block
  // (each what one GPU thread computes), then fold the digests.
  std::uint64_t length = 0;
  for (const KvRun& r : runs) length += r.length;
  std::vector<unsigned char> scratch(length);
  std::uint64_t at = 0;
  for (const KvRun& r : runs) {
    std::memcpy(scratch.data() + at, view(r.addr), r.length);
    at += r.length;
  }
  const std::uint64_t k = sum::block_count(length);
  std::vector<std::uint64_t> digests(k);
  for (std::uint64_t i = 0; i < k; ++i) {
    const std::uint64_t off = i * sum::kBlockBytes;
    digests[i] = sum::xxh3_64(scratch.data() + off, std::min(sum::kBlockBytes, length - off));
  }
  summed_ += length;
  return sum::fold_digests(std::move(digests), length);
}

Result<std::unique_ptr<KvDeviceMark>> DeviceStandin::mark(const KvSync& after) {
  if (after.stream != nullptr && after.event != nullptr) {
    return Status::invalid_argument("standin: pass a stream or an event, not both");
  }
  Stream* on = mark_stream_;
  if (after.stream != nullptr && (on = stream_of(after.stream)) == nullptr) {
    return Status::invalid_argument("standin: not a stream of this device");
  }
  if (after.event != nullptr) {
    Event* e = event_of(after.event);
    if (e == nullptr) return Status::invalid_argument("standin: not an event of this device");
    on->push(wait_op(e));  // the event as recorded now
  }
  auto* mine = static_cast<Event*>(create_event());
  auto op = record_op(mine);
  const std::uint64_t n = mine->recorded;
  on->push(std::move(op));
  return std::unique_ptr<KvDeviceMark>(std::make_unique<StandinMark>(mine, n));
}

Result<std::unique_ptr<KvDeviceSignals>> DeviceStandin::signals(std::size_t n) {
  std::vector<Event*> events;
  for (std::size_t i = 0; i < n; ++i) events.push_back(static_cast<Event*>(create_event()));
  return std::unique_ptr<KvDeviceSignals>(std::make_unique<StandinSignals>(std::move(events)));
}

Status DeviceStandin::stream_wait(void* stream, void* event) {
  if (stream_of(stream) == nullptr || event_of(event) == nullptr) {
    return Status::invalid_argument("standin: not a stream or event of this device");
  }
  wait_event(stream, event);
  return {};
}

}  // namespace kvstash::test
