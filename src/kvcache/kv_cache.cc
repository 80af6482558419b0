// KvCache: a request's chunks saved to and loaded from the store, one object per chunk,
// layer by layer: a save streams each layer into the chunk's object as the engine finishes
// it; a load checks each layer against the checksum its save recorded as soon as it lands.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "common/checksum.h"
#include "common/log.h"
#include "common/thread_pool.h"
#include "kvcache/object_layout.h"
#include "kvstash/engine.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"

#if KVSTASH_HAVE_CUDA_KERNELS
#include "kvcache/cuda/cuda_device.h"
#endif

namespace kvstash {
namespace {

// Loads in flight at once per cache (each is one store get, its transfers already parallel).
constexpr unsigned kLoadThreads = 4;
// Threads submitting saves' layers (and checksumming them while the writes fly).
constexpr unsigned kSaveThreads = 4;

using kvcache::object_layout;
using kvcache::parse_layout;

// Host memory bytes long, page-aligned, from operator new (the host device's bounce buffers).
std::shared_ptr<std::byte> aligned_host(std::size_t bytes) {
  auto* p = static_cast<std::byte*>(::operator new (bytes, std::align_val_t{4096}));
  return std::shared_ptr<std::byte>(p, [](std::byte* q) { ::operator delete (q, std::align_val_t{4096}); });
}

// The sum of runs of host memory as one segment.
std::uint64_t host_segment_sum(std::span<const KvRun> runs) {
  std::uint64_t total = 0;
  for (const KvRun& r : runs) total += r.length;
  sum::ObjectHasher h(total);
  for (const KvRun& r : runs) h.update(r.addr, r.length);
  return total == 0 ? sum::segment_sum(nullptr, 0) : *h.last_segment_sum();
}

class PassedMark final : public KvDeviceMark {
 public:
  Status wait(Deadline) override { return {}; }
};

class HostDevice final : public KvDevice {
 public:
  std::string_view name() const override { return "host"; }
  Status gather(std::span<const KvRun> runs, std::byte* dst) override {
    for (const KvRun& r : runs) {
      std::memcpy(dst, r.addr, r.length);
      dst += r.length;
    }
    return {};
  }
  Status scatter(const std::byte* src, std::span<const KvRun> runs) override {
    for (const KvRun& r : runs) {
      std::memcpy(r.addr, src, r.length);
      src += r.length;
    }
    return {};
  }
  Result<std::shared_ptr<std::byte>> allocate_host(std::size_t bytes) override { return aligned_host(bytes); }
  Result<std::uint64_t> segment_sum(std::span<const KvRun> runs) override { return host_segment_sum(runs); }
  Result<std::unique_ptr<KvDeviceMark>> mark(const KvSync& after) override {
    if (after.stream != nullptr || after.event != nullptr) {
      return Status::invalid_argument("kvcache: the host device has no streams or events to wait for");
    }
    return std::unique_ptr<KvDeviceMark>(std::make_unique<PassedMark>());
  }
  Result<std::unique_ptr<KvDeviceSignals>> signals(std::size_t) override {
    return Status::unsupported("kvcache: the host device has no streams to signal (use wait_layer)");
  }
  Status stream_wait(void*, void*) override {
    return Status::unsupported("kvcache: the host device has no streams (use wait_layer)");
  }
};

}  // namespace

std::shared_ptr<KvDevice> host_device() { return std::make_shared<HostDevice>(); }

namespace {

// A host bounce buffer, registered with the store once.
struct Bounce {
  std::shared_ptr<std::byte> mem;
  std::size_t bytes = 0;
  MemoryHandle handle;
};

// Bounce buffers of one size, reused across saves or loads.
class BouncePool {
 public:
  BouncePool(Store* store, KvDevice* device, std::size_t bytes)
      : store_(store), device_(device), bytes_(bytes) {}
  Result<std::unique_ptr<Bounce>> take() {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        auto b = std::move(free_.back());
        free_.pop_back();
        return b;
      }
    }
    auto b = std::make_unique<Bounce>();
    KVSTASH_ASSIGN_OR_RETURN(b->mem, device_->allocate_host(bytes_));
    b->bytes = bytes_;
    KVSTASH_ASSIGN_OR_RETURN(b->handle, store_->register_memory({b->mem.get(), bytes_}));
    return b;
  }
  void give(std::unique_ptr<Bounce> b) {
    if (!b) return;
    std::lock_guard lock(mu_);
    free_.push_back(std::move(b));
  }

 private:
  Store* store_;
  KvDevice* device_;
  std::size_t bytes_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Bounce>> free_;
};

bool on_gpu(const KvLayout& layout) {
  return std::ranges::any_of(layout.regions(),
                             [](const MemoryRegion& r) { return r.kind == MemoryKind::kCuda; });
}

}  // namespace

Result<std::shared_ptr<KvDevice>> cuda_device(int gpu) {
#if KVSTASH_HAVE_CUDA_KERNELS
  return cuda::cuda_device(gpu);
#else
  (void)gpu;
  return Status::unsupported("kvcache: this build has no CUDA kernels");
#endif
}

Result<std::shared_ptr<KvDevice>> cuda_device_of(const KvLayout& layout) {
#if KVSTASH_HAVE_CUDA_KERNELS
  if (layout.regions().empty()) return Status::invalid_argument("kvcache: the layout has no memory");
  KVSTASH_ASSIGN_OR_RETURN(const int gpu, cuda::device_of(layout.regions().front().addr));
  return cuda_device(gpu);
#else
  (void)layout;
  return Status::unsupported("kvcache: this build has no CUDA kernels");
#endif
}

struct KvCache::Impl {
  Store* store = nullptr;
  KvLayout layout;
  PrefixKeyOptions keys;
  KvCacheOptions options;                    // .device: see `device`
  std::vector<MemoryHandle> handles;         // one per layout region (direct data path)
  std::unique_ptr<BouncePool> save_bounces;  // bounce_slots layers each (staged data path)
  std::unique_ptr<BouncePool> load_bounces;  // one chunk each
  std::uint32_t blocks_per_chunk = 0;
  std::unique_ptr<ThreadPool> loaders = std::make_unique<ThreadPool>(kLoadThreads);
  std::unique_ptr<ThreadPool> savers = std::make_unique<ThreadPool>(kSaveThreads);

  // Layer `l` of a chunk's blocks, as runs of the cache's memory.
  Result<std::vector<KvRun>> layer_runs(std::uint32_t l, std::span<const std::uint32_t> blocks) const {
    std::vector<KvRun> runs;
    KVSTASH_RETURN_IF_ERROR(layout.layer_runs(l, blocks, runs));
    return runs;
  }

  std::vector<Slice> slices(const std::vector<KvRun>& runs) const {
    std::vector<Slice> out;
    out.reserve(runs.size());
    for (const KvRun& r : runs)
      out.push_back({r.addr, static_cast<std::size_t>(r.length), &handles[r.region]});
    return out;
  }

  std::uint64_t chunk_bytes() const {
    return layout.layer_bytes(blocks_per_chunk) * layout.shape().num_layers;
  }
  bool staged() const { return staged_path; }
  // The cache's bytes, on the direct path, are summed by the device (the host must not read
  // them); host memory is summed by the store while its writes fly.
  bool device_sums() const { return !staged_path && device_memory; }

  std::shared_ptr<KvDevice> device;
  bool staged_path = false;
  bool device_memory = false;  // some region is not host memory

  // The blocks of chunk `c` of a request (covers() checked that there are that many).
  std::vector<std::uint32_t> chunk_blocks(std::span<const std::uint32_t> block_ids, std::size_t c) const {
    const auto first = block_ids.begin() + static_cast<std::ptrdiff_t>(c * blocks_per_chunk);
    return {first, first + static_cast<std::ptrdiff_t>(blocks_per_chunk)};
  }

  // Registers every region of `l` with the store's transports (the direct data path).
  Status register_direct(const KvLayout& l) {
    for (const MemoryRegion& r : l.regions()) {
      KVSTASH_ASSIGN_OR_RETURN(MemoryHandle h, store->register_memory(r));
      handles.push_back(std::move(h));
    }
    return {};
  }

  // Checks that `tokens` and `block_ids` cover chunks [first, first + count).
  Status covers(std::span<const std::uint32_t> tokens, std::span<const std::uint32_t> block_ids,
                std::size_t first, std::size_t count) const {
    const std::size_t end = first + count;
    if (tokens.size() < end * keys.chunk_tokens) {
      return Status::invalid_argument("kvcache: " + std::to_string(tokens.size()) + " tokens do not cover " +
                                      std::to_string(end) + " chunks of " +
                                      std::to_string(keys.chunk_tokens));
    }
    if (block_ids.size() < end * blocks_per_chunk) {
      return Status::invalid_argument("kvcache: " + std::to_string(block_ids.size()) +
                                      " block ids do not cover " + std::to_string(end) + " chunks of " +
                                      std::to_string(blocks_per_chunk) + " blocks");
    }
    return {};  // block ids out of range fail their chunk alone
  }
};

// ---- KvSave -----------------------------------------------------------------------------------

struct KvSave::State {
  const KvCache::Impl* kv = nullptr;
  struct Chunk {
    std::string key;
    std::vector<std::uint32_t> blocks;
    PutStream stream;
    Status status;  // the first failure
    std::vector<std::uint64_t> sums;
    std::shared_future<void> last;   // the chunk's latest layer task: its next one waits for it
    std::unique_ptr<Bounce> bounce;  // staged: bounce_slots layers
  };
  std::vector<Chunk> chunks;
  Deadline deadline;  // the save's: a layer whose engine work is not done by then fails
  std::uint32_t next_layer = 0;
  bool waited = false;
  std::atomic<bool> cancelled = false;

  // Waits for the engine's mark in short steps, so that cancel() is not held up by engine
  // work that never finishes.
  Status wait_for(KvDeviceMark& mark) const {
    for (;;) {
      const Deadline step = std::min(deadline, Clock::now() + std::chrono::milliseconds(5));
      Status s = mark.wait(step);
      if (s.code() != StatusCode::kTimeout || step == deadline) return s;
      if (cancelled) return Status::cancelled("kvcache: save cancelled");
    }
  }

  // Waits for every layer task (they touch the chunks).
  void drain() {
    for (auto& c : chunks) {
      if (c.last.valid()) c.last.wait();
    }
  }
  ~State() {
    drain();
    for (auto& c : chunks) {
      c.stream.abort();  // no write may still read a bounce buffer that goes back to the pool
      if (kv != nullptr && kv->save_bounces) kv->save_bounces->give(std::move(c.bounce));
    }
  }
};

KvSave::KvSave() = default;
KvSave::KvSave(KvSave&&) noexcept = default;
KvSave& KvSave::operator=(KvSave&&) noexcept = default;
KvSave::~KvSave() = default;  // an unfinished PutStream aborts itself

Status KvSave::save_layer(std::uint32_t layer, const KvSync& after) {
  if (!state_ || state_->waited) return Status::invalid_argument("kvcache: save already finished");
  if (state_->cancelled) return Status::cancelled("kvcache: save cancelled");
  State& st = *state_;
  if (layer != st.next_layer) {
    return Status::invalid_argument("kvcache: layers are saved in order: expected layer " +
                                    std::to_string(st.next_layer) + ", got " + std::to_string(layer));
  }
  // The engine's work that writes the layer, as a mark the saver threads wait for: the
  // engine's thread never blocks on its own GPU.
  KVSTASH_ASSIGN_OR_RETURN(std::shared_ptr<KvDeviceMark> written, st.kv->device->mark(after));
  // Each chunk's layer goes to a saver thread (submitting it and checksumming it while it
  // flies), after that chunk's previous layer: appends to one object stay in order. The
  // pool runs tasks first in, first out, so a task never waits for one queued behind it.
  for (auto& c : st.chunks) {
    std::shared_future<void> previous = c.last;
    auto task = [&st, &c, layer, previous, written] {
      if (previous.valid()) previous.wait();
      if (!c.status.is_ok()) return;
      c.status = st.wait_for(*written);
      if (!c.status.is_ok()) {
        c.status =
            c.status.with_context("kvcache: waiting for the engine to write layer " + std::to_string(layer));
        return;
      }
      auto runs = st.kv->layer_runs(layer, c.blocks);
      if (!runs.is_ok()) {
        c.status = runs.status();
        return;
      }
      std::uint64_t sum = 0;
      if (st.kv->device_sums()) {
        // Summed on the device, where the bytes are; the store reads none of them.
        auto summed = st.kv->device->segment_sum(*runs);
        c.status =
            summed.is_ok() ? c.stream.append_summed(st.kv->slices(*runs), sum = *summed) : summed.status();
      } else if (!st.kv->staged()) {
        c.status = c.stream.append(st.kv->slices(*runs), &sum);
      } else {
        // Through a bounce slot: the one this layer reuses must have reached the nodes.
        const KvCache::Impl& kv = *st.kv;
        const std::uint64_t lb = kv.layout.layer_bytes(kv.blocks_per_chunk);
        const std::uint32_t slots = kv.options.bounce_slots;
        if (layer >= slots) c.status = c.stream.wait_written(lb * (layer - slots + 1));
        std::byte* slot = c.bounce->mem.get() + (layer % slots) * lb;
        if (c.status.is_ok()) c.status = kv.device->gather(*runs, slot);
        Slice s{slot, static_cast<std::size_t>(lb), &c.bounce->handle};
        if (c.status.is_ok()) c.status = c.stream.append({&s, 1}, &sum);
      }
      c.sums.push_back(sum);
    };
    c.last = st.kv->savers->submit(std::move(task)).share();
  }
  ++st.next_layer;
  return Status::ok();
}

void KvSave::cancel() {
  if (!state_ || state_->waited || state_->cancelled) return;
  State& st = *state_;
  st.cancelled = true;
  st.drain();  // the layer tasks in flight have submitted (or failed) their writes
  for (auto& c : st.chunks) {
    c.stream.abort();  // cancels the writes still moving; the pages go back
    if (c.status.is_ok()) c.status = Status::cancelled("kvcache: save cancelled");
  }
}

std::vector<Status> KvSave::wait() {
  if (!state_ || state_->waited) return {};
  State& st = *state_;
  st.waited = true;
  st.drain();
  if (st.cancelled) {
    std::vector<Status> out;
    for (const auto& c : st.chunks) out.push_back(c.status);
    return out;
  }
  const std::uint32_t layers = st.kv->layout.shape().num_layers;
  std::vector<Status> out;
  for (auto& c : st.chunks) {
    if (c.status.is_ok() && st.next_layer != layers) {
      c.status = Status::invalid_argument("kvcache: " + std::to_string(st.next_layer) + " of " +
                                          std::to_string(layers) + " layers were saved");
    }
    if (!c.status.is_ok()) {
      c.stream.abort();
      out.push_back(c.status);
      continue;
    }
    c.stream.set_object_layout(object_layout(st.kv->keys.layout_tag, c.sums));
    out.push_back(c.stream.commit());
  }
  return out;
}

// ---- KvLoad -----------------------------------------------------------------------------------

struct KvLoad::State {
  std::uint32_t layers = 0;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::uint32_t> verified;             // per chunk: leading layers landed and checked
  std::vector<std::optional<Status>> done;         // per chunk: the final status
  std::vector<std::vector<std::uint32_t>> blocks;  // per chunk: where it loads
  std::vector<std::future<void>> tasks;
  CancelToken cancel = CancelToken::make();  // every chunk's get holds it
  std::shared_ptr<KvDevice> device;
  std::unique_ptr<KvDeviceSignals> signals;  // made at the first layer_event()

  bool ready_locked(std::uint32_t layer) const {
    for (std::size_t c = 0; c < done.size(); ++c) {
      if (verified[c] <= layer && !done[c]) return false;
    }
    return true;
  }
  // Wakes wait_layer and completes the device events of every layer now ready.
  void progress_locked() {
    cv.notify_all();
    if (!signals) return;
    std::uint32_t ready = 0;
    while (ready < layers && ready_locked(ready)) ++ready;
    signals->complete_through(ready);
  }
  ~State() {
    if (signals) signals->complete_through(layers);  // no engine stream waits forever
  }
};

KvLoad::KvLoad() = default;
KvLoad::KvLoad(KvLoad&&) noexcept = default;
KvLoad& KvLoad::operator=(KvLoad&&) noexcept = default;
KvLoad::~KvLoad() {
  if (state_) wait();
}

Result<void*> KvLoad::layer_event(std::uint32_t layer) {
  if (!state_) return Status::invalid_argument("kvcache: no load");
  if (layer >= state_->layers) return Status::invalid_argument("kvcache: layer out of range");
  std::lock_guard lock(state_->mu);
  if (!state_->signals) {
    KVSTASH_ASSIGN_OR_RETURN(state_->signals, state_->device->signals(state_->layers));
    state_->progress_locked();  // the layers that landed already
  }
  return state_->signals->event(layer);
}

Status KvLoad::wait_layer_on(std::uint32_t layer, void* stream) {
  KVSTASH_ASSIGN_OR_RETURN(void* event, layer_event(layer));
  return state_->device->stream_wait(stream, event);
}

bool KvLoad::layer_ready(std::uint32_t layer) const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->ready_locked(layer);
}

Status KvLoad::wait_layer(std::uint32_t layer) {
  if (!state_) return Status::invalid_argument("kvcache: no load");
  if (layer >= state_->layers) return Status::invalid_argument("kvcache: layer out of range");
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->ready_locked(layer); });
  for (std::size_t c = 0; c < state_->done.size(); ++c) {
    if (state_->verified[c] <= layer) {
      return state_->done[c]->is_ok() ? Status::internal("kvcache: a chunk ended without its layers")
                                      : *state_->done[c];
    }
  }
  return Status::ok();
}

void KvLoad::cancel() {
  if (!state_) return;
  state_->cancel.cancel();  // the gets in flight stop moving bytes; the queued ones never start
  for (auto& t : state_->tasks) {
    if (t.valid()) t.wait();  // and their tasks have stopped scattering into the cache
  }
}

std::vector<std::uint32_t> KvLoad::failed_blocks() {
  const std::vector<Status> statuses = wait();
  std::vector<std::uint32_t> out;
  for (std::size_t c = 0; c < statuses.size(); ++c) {
    if (!statuses[c].is_ok()) out.insert(out.end(), state_->blocks[c].begin(), state_->blocks[c].end());
  }
  return out;
}

std::vector<Status> KvLoad::wait() {
  if (!state_) return {};
  for (auto& t : state_->tasks) {
    if (t.valid()) t.get();
  }
  std::lock_guard lock(state_->mu);
  std::vector<Status> out;
  for (const auto& d : state_->done)
    out.push_back(d.value_or(Status::internal("kvcache: load not finished")));
  return out;
}

// ---- KvCache ----------------------------------------------------------------------------------

KvCache::KvCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvCache::~KvCache() = default;

Result<std::unique_ptr<KvCache>> KvCache::open(Store& store, KvLayout layout, PrefixKeyOptions keys,
                                               KvCacheOptions options) {
  const std::uint32_t bs = layout.shape().block_size;
  if (keys.chunk_tokens == 0 || keys.chunk_tokens % bs != 0) {
    return Status::invalid_argument("kvcache: chunk_tokens (" + std::to_string(keys.chunk_tokens) +
                                    ") must be a positive multiple of the block size (" + std::to_string(bs) +
                                    ")");
  }
  if (keys.model.empty()) return Status::invalid_argument("kvcache: the model name salts every key: set it");
  if (keys.tp_size == 0 || keys.tp_rank >= keys.tp_size) {
    return Status::invalid_argument("kvcache: tp_rank must be below tp_size");
  }
  auto impl = std::make_unique<Impl>();
  impl->store = &store;
  keys.layout_tag = layout.tag();
  impl->keys = std::move(keys);
  impl->blocks_per_chunk = impl->keys.chunk_tokens / bs;
  if (options.bounce_slots == 0) return Status::invalid_argument("kvcache: bounce_slots must be at least 1");
  impl->options = std::move(options);
  impl->device_memory = on_gpu(layout);
  // The device: the caller's, the host for host memory, else the GPU's own.
  impl->device = impl->options.device;
  Status no_device;
  if (!impl->device && !impl->device_memory) impl->device = host_device();
  if (!impl->device) {
    auto gpu = cuda_device_of(layout);
    if (gpu.is_ok()) {
      impl->device = std::move(gpu).value();
    } else {
      no_device = gpu.status();
    }
  }
  const KvPath path = impl->options.path;
  if (path != KvPath::kStaged) {
    Status direct = impl->register_direct(layout);
    if (direct.is_ok() && !impl->device) {
      // The transports reach the memory, but its checksums must be computed on its device.
      return Status::unsupported("kvcache: GPU memory on the direct path is checksummed by its GPU, and " +
                                 no_device.message() + ": pass KvCacheOptions::device");
    }
    if (!direct.is_ok()) {
      direct = direct.with_context("kvcache: registering the KV cache");
      if (!impl->device_memory || path == KvPath::kDirect) return direct;
      if (!impl->device) {
        return direct.with_context("no transport reaches this GPU memory, and " + no_device.message() +
                                   " to stage it: pass KvCacheOptions::device");
      }
      KVSTASH_LOG_INFO("kvcache: staging GPU memory through host bounce buffers (the {} device): {}",
                       impl->device->name(), direct.message());
      impl->handles.clear();
      impl->staged_path = true;
    }
  } else if (!impl->device) {
    return no_device.with_context("kvcache: staging needs the memory's device: pass KvCacheOptions::device");
  } else {
    impl->staged_path = true;
  }
  if (impl->staged()) {
    const std::uint64_t lb = layout.layer_bytes(impl->blocks_per_chunk);
    impl->save_bounces = std::make_unique<BouncePool>(
        &store, impl->device.get(), static_cast<std::size_t>(lb * impl->options.bounce_slots));
    impl->load_bounces = std::make_unique<BouncePool>(
        &store, impl->device.get(), static_cast<std::size_t>(lb * layout.shape().num_layers));
  }
  impl->layout = std::move(layout);
  return std::unique_ptr<KvCache>(new KvCache(std::move(impl)));
}

const KvLayout& KvCache::layout() const { return impl_->layout; }
std::string_view KvCache::data_path() const { return impl_->staged() ? "staged" : "direct"; }
const KvDevice& KvCache::device() const { return *impl_->device; }
const PrefixKeyOptions& KvCache::key_options() const { return impl_->keys; }

std::vector<std::string> KvCache::keys(std::span<const std::uint32_t> tokens) const {
  return prefix_chunk_keys(tokens, impl_->keys);
}

std::uint64_t KvCache::chunk_bytes() const { return impl_->chunk_bytes(); }

Result<std::size_t> KvCache::contains_prefix(std::span<const std::uint32_t> tokens,
                                             std::optional<Deadline> deadline) {
  auto k = keys(tokens);
  if (k.empty()) return std::size_t{0};
  return impl_->store->contains_prefix(k, deadline);
}

Result<KvSave> KvCache::begin_save(std::span<const std::uint32_t> tokens,
                                   std::span<const std::uint32_t> block_ids, std::size_t first,
                                   std::size_t count, std::optional<Deadline> deadline) {
  KVSTASH_RETURN_IF_ERROR(impl_->covers(tokens, block_ids, first, count));
  const auto k = keys(tokens.first((first + count) * impl_->keys.chunk_tokens));
  auto st = std::make_unique<KvSave::State>();
  st->kv = impl_.get();
  st->deadline = deadline.value_or(deadline_after(std::chrono::seconds(30)));
  for (std::size_t c = first; c < first + count; ++c) {
    auto& chunk = st->chunks.emplace_back();
    chunk.key = k[c];
    chunk.blocks = impl_->chunk_blocks(block_ids, c);
    if (impl_->staged()) {
      auto b = impl_->save_bounces->take();
      if (!b.is_ok()) {
        chunk.status = b.status().with_context("kvcache: bounce buffer");
        continue;
      }
      chunk.bounce = std::move(b).value();
    }
    // One checksum segment per layer: each layer's sum is the one its device computed.
    auto stream = impl_->store->begin_put(
        chunk.key, impl_->chunk_bytes(),
        {.deadline = deadline, .checksum_segment = impl_->layout.layer_bytes(impl_->blocks_per_chunk)});
    if (stream.is_ok()) {
      chunk.stream = std::move(stream).value();
    } else {
      chunk.status = stream.status();
    }
  }
  KvSave save;
  save.state_ = std::move(st);
  return save;
}

Result<KvLoad> KvCache::begin_load(std::span<const std::uint32_t> tokens,
                                   std::span<const std::uint32_t> block_ids, std::size_t count,
                                   std::optional<Deadline> deadline) {
  return begin_load_range(tokens, block_ids, 0, count, deadline);
}

Result<KvLoad> KvCache::begin_load_range(std::span<const std::uint32_t> tokens,
                                         std::span<const std::uint32_t> block_ids, std::size_t first,
                                         std::size_t count, std::optional<Deadline> deadline) {
  KVSTASH_RETURN_IF_ERROR(impl_->covers(tokens, block_ids, first, count));
  const auto k = keys(tokens.first((first + count) * impl_->keys.chunk_tokens));
  auto st = std::make_shared<KvLoad::State>();
  st->device = impl_->device;
  const std::uint32_t layers = impl_->layout.shape().num_layers;
  st->layers = layers;
  st->verified.assign(count, 0);
  st->done.assign(count, std::nullopt);
  const std::uint64_t layer_bytes = impl_->layout.layer_bytes(impl_->blocks_per_chunk);
  // Every chunk's blocks are in place before any task runs (the tasks read them from `st`).
  for (std::size_t c = 0; c < count; ++c) st->blocks.push_back(impl_->chunk_blocks(block_ids, first + c));
  for (std::size_t c = 0; c < count; ++c) {  // status c is chunk first + c
    st->tasks.push_back(
        impl_->loaders->submit([this, st, c, key = k[first + c], deadline, layer_bytes, layers] {
          const Impl& kv = *impl_;
          const std::vector<std::uint32_t>& blocks = st->blocks[c];
          std::vector<std::vector<KvRun>> runs(layers);
          std::vector<Slice> slices;
          Status failed;
          for (std::uint32_t l = 0; l < layers && failed.is_ok(); ++l) {
            auto r = kv.layer_runs(l, blocks);
            if (!r.is_ok()) {
              failed = r.status();
              break;
            }
            runs[l] = std::move(r).value();
            if (!kv.staged()) {
              for (const Slice& s : kv.slices(runs[l])) slices.push_back(s);
            }
          }
          // Staged: the chunk lands in a bounce buffer, and each layer is checked there and
          // then scattered into the cache.
          std::unique_ptr<Bounce> bounce;
          if (kv.staged() && failed.is_ok()) {
            auto b = kv.load_bounces->take();
            if (b.is_ok()) {
              bounce = std::move(b).value();
              slices.push_back({bounce->mem.get(), bounce->bytes, &bounce->handle});
            } else {
              failed = b.status().with_context("kvcache: bounce buffer");
            }
          }
          // Each layer is checked against its save's checksum as soon as it is whole.
          std::optional<std::vector<std::uint64_t>> sums;
          Status bad_layer;
          std::uint32_t checked = 0;
          GetOptions o;
          o.deadline = deadline;
          o.verify_checksum = false;  // every byte is in some layer, and every layer is checked
          o.cancel = st->cancel;
          o.progress = [&](std::uint64_t landed, std::string_view stored_layout) {
            if (!sums) sums = parse_layout(stored_layout, kv.keys.layout_tag, layers);
            if (!sums) {
              bad_layer = Status::corrupt("kvcache: " + key + " was not saved by a cache of layout " +
                                          kv.keys.layout_tag);
              return;
            }
            while (bad_layer.is_ok() && checked < layers && (checked + 1) * layer_bytes <= landed &&
                   !o.cancel.cancelled()) {
              // In the bounce buffer (host memory) on the host; in the cache's memory by its device.
              Result<std::uint64_t> sum =
                  bounce ? sum::segment_sum(bounce->mem.get() + checked * layer_bytes, layer_bytes)
                         : kv.device->segment_sum(runs[checked]);
              if (!sum.is_ok()) {
                bad_layer = sum.status().with_context("kvcache: checking layer " + std::to_string(checked) +
                                                      " of " + key);
                break;
              }
              if (*sum != (*sums)[checked]) {
                bad_layer = Status::corrupt("kvcache: layer " + std::to_string(checked) + " of " + key +
                                            " does not match its checksum");
                break;
              }
              if (bounce) {
                bad_layer = kv.device->scatter(bounce->mem.get() + checked * layer_bytes, runs[checked]);
                if (!bad_layer.is_ok()) break;
              }
              ++checked;
              std::lock_guard lock(st->mu);
              st->verified[c] = checked;
              st->progress_locked();
            }
          };
          Status final = failed;
          if (final.is_ok()) {
            auto r = kv.store->get(key, slices, o);
            if (!r.is_ok()) {
              final = r.status();
            } else if (!bad_layer.is_ok()) {
              final = bad_layer;
            } else if (checked != layers && o.cancel.cancelled()) {
              final = Status::cancelled("kvcache: load of " + key + " cancelled");
            } else if (r->size != kv.chunk_bytes() || checked != layers) {
              final = Status::corrupt("kvcache: " + key + " holds " + std::to_string(r->size) +
                                      " bytes, a chunk " + std::to_string(kv.chunk_bytes()));
            }
          }
          if (bounce) kv.load_bounces->give(std::move(bounce));  // the get has returned: no write is left
          std::lock_guard lock(st->mu);
          if (!final.is_ok()) st->verified[c] = std::min(st->verified[c], checked);
          st->done[c] = final;
          st->progress_locked();
        }));
  }
  KvLoad load;
  load.state_ = std::move(st);
  return load;
}

std::vector<Status> KvCache::save(std::span<const std::uint32_t> tokens,
                                  std::span<const std::uint32_t> block_ids, std::size_t first,
                                  std::size_t count, std::optional<Deadline> deadline) {
  auto s = begin_save(tokens, block_ids, first, count, deadline);
  if (!s.is_ok()) return std::vector<Status>(count, s.status());
  for (std::uint32_t l = 0; l < impl_->layout.shape().num_layers; ++l) (void)s->save_layer(l);
  return s->wait();
}

std::vector<Status> KvCache::load(std::span<const std::uint32_t> tokens,
                                  std::span<const std::uint32_t> block_ids, std::size_t count,
                                  std::optional<Deadline> deadline) {
  auto l = begin_load(tokens, block_ids, count, deadline);
  if (!l.is_ok()) return std::vector<Status>(count, l.status());
  return l->wait();
}

}  // namespace kvstash
