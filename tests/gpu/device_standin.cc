// The device stand-in (device_standin.h): a memfd mapped twice, worker-thread streams, and
// kernels that reach the memory only through the device's own mapping.
#include "device_standin.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>

#include "common/checksum.h"
#include "common/thread_pool.h"
#include "host_faults.h"

namespace kvstash::test {

// ---- faults: a host touch of sealed memory names itself (tests/harness/host_faults.h) ---------------

namespace {

const char* fault_message() {
  return "\n*** the host touched device memory (a DeviceStandin's sealed mapping): a host code path read or "
         "wrote GPU memory, at ";
}

void watch(std::byte* base, std::size_t size) { host_faults::watch(base, size, fault_message); }
void unwatch(std::byte* base) { host_faults::unwatch(base); }

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
  bool blocking = true;
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

// A mark: records of events, each completed when its stream reaches it.
class StandinMark final : public KvDeviceMark {
 public:
  void add(DeviceStandin::Event* e, std::uint64_t n) { records_.push_back({e, n}); }
  Status wait(Deadline deadline) override {
    for (const auto& [e, n] : records_) {
      std::unique_lock lock(e->mu);
      if (!e->cv.wait_until(lock, deadline, [&, n = n] { return e->completed >= n; })) {
        return Status::timeout("standin: the engine's work did not finish in time");
      }
    }
    return {};
  }
  const std::vector<std::pair<DeviceStandin::Event*, std::uint64_t>>& records() const { return records_; }

 private:
  std::vector<std::pair<DeviceStandin::Event*, std::uint64_t>> records_;
};

// The digests of a segment as the CUDA device's kernel computes them: one per 4 KiB block of
// the runs' concatenation, folded.
std::uint64_t standin_segment_sum(const DeviceStandin& d, std::span<const KvRun> runs) {
  std::uint64_t length = 0;
  for (const KvRun& r : runs) length += r.length;
  std::vector<unsigned char> packed(length);
  std::uint64_t at = 0;
  for (const KvRun& r : runs) {
    std::memcpy(packed.data() + at, d.view(r.addr), r.length);
    at += r.length;
  }
  const std::uint64_t k = sum::block_count(length);
  std::vector<std::uint64_t> digests(k);
  for (std::uint64_t i = 0; i < k; ++i) {
    const std::uint64_t off = i * sum::kBlockBytes;
    digests[i] = sum::xxh3_64(packed.data() + off, std::min(sum::kBlockBytes, length - off));
  }
  return sum::fold_digests(std::move(digests), length);
}

// A load's handover on the stand-in's streams: a queued layer's op waits (on the stream's
// thread) for the host's release, then copies (staged) or sums (direct) the layer, then
// completes the layer's event. Its state is shared with the queued ops, which may outlive it.
class StandinHandover final : public KvDeviceHandover {
 public:
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::uint32_t released = 0;
    KvHandoverPlan plan;
    std::vector<std::vector<const std::byte*>> src;  // staged: [chunk][layer]
    std::vector<std::vector<std::uint64_t>> sums;    // direct: [chunk][layer]
  };

  StandinHandover(std::shared_ptr<DeviceStandin> d, const KvHandoverPlan& plan)
      : device_(std::move(d)), shared_(std::make_shared<Shared>()) {
    shared_->plan = plan;
    shared_->src.assign(plan.runs.size(), std::vector<const std::byte*>(plan.layers, nullptr));
    shared_->sums.assign(plan.runs.size(), std::vector<std::uint64_t>(plan.layers, 0));
    for (std::uint32_t l = 0; l < plan.layers; ++l)
      events_.push_back(static_cast<DeviceStandin::Event*>(device_->create_event()));
    own_ = device_->create_stream(false);
    queued_.assign(plan.layers, 0);
  }
  ~StandinHandover() override { release_through(shared_->plan.layers); }

  void place(std::size_t chunk, std::uint32_t layer, const std::byte* src) override {
    std::lock_guard lock(shared_->mu);
    if (chunk < shared_->src.size() && layer < shared_->plan.layers) shared_->src[chunk][layer] = src;
  }
  void release_through(std::uint32_t n) override {
    {
      std::lock_guard lock(shared_->mu);
      shared_->released = std::max(shared_->released, std::min(n, shared_->plan.layers));
    }
    shared_->cv.notify_all();
  }
  Status queue(std::uint32_t layer, void* stream) override {
    if (layer >= shared_->plan.layers) return Status::invalid_argument("standin: layer out of range");
    if (stream == nullptr) return Status::invalid_argument("standin: pass one of the stand-in's streams");
    {
      std::lock_guard lock(mu_);
      if (queued_[layer] != 0) {
        device_->wait_event(stream, events_[layer]);
        return {};
      }
      queued_[layer] = 1;
      if (auto* after = dynamic_cast<StandinMark*>(shared_->plan.after); after != nullptr) {
        for (const auto& [e, n] : after->records()) device_->wait_event(stream, e);
      }
    }
    auto shared = shared_;
    auto device = device_;
    device_->launch(stream, [shared, device, layer] {
      std::unique_lock lock(shared->mu);
      shared->cv.wait(lock, [&] { return shared->released > layer; });
      for (std::size_t c = 0; c < shared->plan.runs.size(); ++c) {
        const auto& runs = shared->plan.runs[c][layer];
        if (shared->plan.staged) {
          const std::byte* src = shared->src[c][layer];
          if (src == nullptr) continue;  // never placed: not copied
          for (const KvRun& r : runs) {
            std::memcpy(device->view(r.addr), src, r.length);
            src += r.length;
          }
        } else {
          // The device's checksum kernel, on this stream (counted in summed_bytes()).
          shared->sums[c][layer] = device->segment_sum(runs, true, Deadline::max()).value();
        }
      }
    });
    device_->record(events_[layer], stream);
    return {};
  }
  Result<void*> queue_event(std::uint32_t layer) override {
    KVSTASH_RETURN_IF_ERROR(queue(layer, own_));
    return static_cast<void*>(events_[layer]);
  }
  Result<std::uint64_t> sum(std::size_t chunk, std::uint32_t layer, Deadline deadline) override {
    {
      std::lock_guard lock(mu_);
      if (layer >= queued_.size() || queued_[layer] == 0)
        return Status::unavailable("standin: layer not queued");
    }
    DeviceStandin::Event* e = events_[layer];
    std::unique_lock lock(e->mu);
    if (!e->cv.wait_until(lock, deadline, [&] { return e->done(); }))
      return Status::timeout("standin: not run");
    std::lock_guard s(shared_->mu);
    return shared_->sums.at(chunk).at(layer);
  }
  bool passed() override {
    std::lock_guard lock(mu_);
    for (std::size_t l = 0; l < queued_.size(); ++l) {
      if (queued_[l] == 0) continue;
      std::lock_guard e(events_[l]->mu);
      if (!events_[l]->done()) return false;
    }
    return true;
  }

 private:
  std::shared_ptr<DeviceStandin> device_;
  std::shared_ptr<Shared> shared_;
  std::vector<DeviceStandin::Event*> events_;  // the device's (it owns every event)
  void* own_ = nullptr;
  std::mutex mu_;
  std::vector<std::uint8_t> queued_;
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
  d->mark_stream_ = static_cast<Stream*>(d->create_stream(false));
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

void* DeviceStandin::create_stream(bool blocking) {
  std::lock_guard lock(mu_);
  streams_.push_back(std::make_unique<Stream>());
  streams_.back()->blocking = blocking;
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

Status DeviceStandin::gather(std::span<const KvRun> runs, std::byte* dst, Deadline) {
  KVSTASH_RETURN_IF_ERROR(check_runs(runs));
  for (const KvRun& r : runs) {
    std::memcpy(dst, view(r.addr), r.length);
    dst += r.length;
    copied_ += r.length;
  }
  return {};
}

Status DeviceStandin::scatter(const std::byte* src, std::span<const KvRun> runs, Deadline) {
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

Result<std::uint64_t> DeviceStandin::segment_sum(std::span<const KvRun> runs, bool, Deadline) {
  KVSTASH_RETURN_IF_ERROR(check_runs(runs));
  std::uint64_t length = 0;
  for (const KvRun& r : runs) length += r.length;
  summed_ += length;
  return standin_segment_sum(*this, runs);
}

Result<std::unique_ptr<KvDeviceMark>> DeviceStandin::mark(const KvSync& after) {
  auto mark = std::make_unique<StandinMark>();
  if (after.kind == KvSync::Kind::kNone) return std::unique_ptr<KvDeviceMark>(std::move(mark));
  // Records `mine` on `on`, to complete once `on` reaches this point.
  auto record_on = [&](Stream* on) {
    auto* mine = static_cast<Event*>(create_event());
    auto op = record_op(mine);
    mark->add(mine, mine->recorded);
    on->push(std::move(op));
  };
  if (after.kind == KvSync::Kind::kEvent) {
    Event* e = after.handle == nullptr ? nullptr : event_of(after.handle);
    if (e == nullptr) return Status::invalid_argument("standin: not an event of this device");
    mark_stream_->push(wait_op(e));  // the event as recorded now
    record_on(mark_stream_);
  } else if (after.handle == nullptr) {
    // The legacy default stream: everything queued on every stream of the device so far (the
    // stand-in's streams are all blocking ones).
    std::vector<Stream*> all;
    {
      std::lock_guard lock(mu_);
      for (const auto& st : streams_) {
        if (st->blocking) all.push_back(st.get());
      }
    }
    for (Stream* st : all) record_on(st);
  } else {
    Stream* on = stream_of(after.handle);
    if (on == nullptr) return Status::invalid_argument("standin: not a stream of this device");
    record_on(on);
  }
  return std::unique_ptr<KvDeviceMark>(std::move(mark));
}

Result<std::unique_ptr<KvDeviceHandover>> DeviceStandin::handover(const KvHandoverPlan& plan) {
  return std::unique_ptr<KvDeviceHandover>(std::make_unique<StandinHandover>(shared_from_this(), plan));
}

}  // namespace kvstash::test
