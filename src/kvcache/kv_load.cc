// KvLoad: a load's state machine. Each chunk is one store get on the cache's loaders
// (ChunkLoad); its progress callback checks each layer as it lands. Until the engine hands a
// layer to one of its streams, the loaders place every layer as it lands (host waits:
// wait_layer); from the first wait_layer_on/layer_event they only land layers, and each layer
// is placed by the stream it was handed to (KvDeviceHandover), so that a device-side wait
// depends on the host alone.
#include <algorithm>
#include <string_view>

#include "common/checksum.h"
#include "common/log.h"
#include "kvcache/kv_cache_internal.h"
#include "kvcache/object_layout.h"

namespace kvstash {

// ---- One chunk --------------------------------------------------------------------------------

// The steps of KvLoad::State::load_chunk: where the chunk lands, the get, each layer's check
// as it lands, and the chunk's final status. Lives on the loader thread for one call; touches
// the load's shared fields only under `mu`.
//
// load_chunk(c, key): loads chunk `c` from the object `key` into blocks[c] with one store get
// (until the load's deadline), landing the chunk in the cache's memory (direct) or in a bounce
// buffer (staged: each layer is checked there on the host). Each layer, once whole: raises
// landed[c], and is placed at once by the cache's own device streams unless the load hands
// layers to streams. Ends by setting done[c]: the get's error; kCorrupt for an object not
// saved by this layout, a layer that does not match, or a size that is not a chunk's;
// kCancelled when cancel() stopped it; the blocks' or the bounce buffer's error before any
// byte moves. Direct writes wait for the engine's `after` first.
class KvLoad::State::ChunkLoad {
 public:
  ChunkLoad(State& st, std::size_t c, const std::string& key)
      : kv_(*st.kv), st_(st), c_(c), key_(key), layers_(st.layers), layer_bytes_(kv_.layer_bytes()) {}

  void run() {
    Status final = prepare();
    if (final.is_ok()) final = fetch();
    std::lock_guard lock(st_.mu);
    if (!final.is_ok()) {
      st_.landed[c_] = std::min(st_.landed[c_], checked_);
      st_.placed[c_] = std::min(st_.placed[c_], checked_);
    }
    st_.done[c_] = final;
    st_.progress_locked();
  }

 private:
  // The slices the get lands the chunk in: the cache's runs on the direct path; staged, one
  // bounce buffer (kept by the load: a stream may place layers from it after the get).
  Status prepare() {
    if (!st_.unusable[c_].is_ok()) return st_.unusable[c_];
    if (!kv_.staged()) {
      for (std::uint32_t l = 0; l < layers_; ++l) kv_.append_slices(st_.runs[c_][l], slices_);
      return {};
    }
    auto b = kv_.load_bounces->take();
    if (!b.is_ok()) return b.status().with_context("kvcache: bounce buffer");
    bounce_ = (*b)->mem.get();
    slices_.push_back({bounce_, (*b)->bytes, &(*b)->handle});
    std::lock_guard lock(st_.mu);
    st_.bounces[c_] = std::move(b).value();
    return {};
  }

  // The store get; the chunk's status once it returned.
  Status fetch() {
    if (!kv_.staged()) {
      // The NIC writes straight into the blocks: not before the engine's earlier work on them.
      Status after = st_.wait_after();
      if (!after.is_ok()) return after.with_context("kvcache: waiting for the engine's work on the blocks");
    }
    GetOptions o;
    o.deadline = st_.deadline;
    o.verify_checksum = false;  // every byte is in some layer, and every layer is checked
    o.cancel = st_.cancel;
    o.leases = &st_.leases;
    o.progress = [this](std::uint64_t landed, std::string_view stored_layout) {
      check_landed(landed, stored_layout);
    };
    auto r = kv_.store->get(key_, slices_, o);
    if (!r.is_ok()) return r.status();
    if (!bad_layer_.is_ok()) return bad_layer_;
    if (checked_ != layers_ && st_.cancel.cancelled())
      return Status::cancelled("kvcache: load of " + key_ + " cancelled");
    if (r->size != kv_.chunk_bytes() || checked_ != layers_) {
      return Status::corrupt("kvcache: " + key_ + " holds " + std::to_string(r->size) + " bytes, a chunk " +
                             std::to_string(kv_.chunk_bytes()));
    }
    return {};
  }

  // GetOptions::progress: bytes [0, landed) are in. Lands every layer whole by now, in order,
  // until one fails (bad_layer_) or the load is cancelled.
  void check_landed(std::uint64_t landed, std::string_view stored_layout) {
    if (!sums_known_) {
      auto sums = kvcache::parse_layout(stored_layout, kv_.keys.layout_tag, layers_);
      if (!sums) {
        bad_layer_ = Status::corrupt("kvcache: " + key_ + " was not saved by a cache of layout " +
                                     kv_.keys.layout_tag);
        return;
      }
      sums_known_ = true;
      std::lock_guard lock(st_.mu);
      st_.sums[c_] = std::move(sums);
    }
    while (bad_layer_.is_ok() && checked_ < layers_ && (checked_ + 1) * layer_bytes_ <= landed &&
           !st_.cancel.cancelled()) {
      Status s = land_layer(checked_);
      if (!s.is_ok()) {
        bad_layer_ = s.with_context("kvcache: layer " + std::to_string(checked_) + " of " + key_);
        break;
      }
      ++checked_;
    }
  }

  // Layer `l` is whole. Staged, its sum is checked in the bounce buffer on the host; then it
  // is placed by the loaders (scatter, or the device's check where it landed), or, once the
  // load hands layers to streams, left to the stream (staged: told where it is).
  Status land_layer(std::uint32_t l) {
    const std::byte* src = bounce_ == nullptr ? nullptr : bounce_ + l * layer_bytes_;
    if (src != nullptr && sum::segment_sum(src, layer_bytes_) != expected(l))
      return Status::corrupt("kvcache: does not match its checksum");
    {
      std::lock_guard lock(st_.mu);
      if (st_.streams) {
        if (src != nullptr) st_.handover->place(c_, l, src);
        st_.landed[c_] = l + 1;
        st_.progress_locked();
        return {};
      }
      ++st_.lane_busy;
    }
    Status placed = place(l, src);
    std::lock_guard lock(st_.mu);
    --st_.lane_busy;
    if (placed.is_ok()) st_.landed[c_] = st_.placed[c_] = l + 1;
    st_.progress_locked();
    return placed;
  }

  Status place(std::uint32_t l, const std::byte* src) {
    const Deadline deadline = st_.deadline.value_or(deadline_after(std::chrono::seconds(30)));
    if (src != nullptr) {
      KVSTASH_RETURN_IF_ERROR(st_.wait_after());
      Status s = kv_.device->scatter(src, st_.runs[c_][l], deadline);
      if (s.code() == StatusCode::kTimeout) st_.taint(c_);
      return s;
    }
    KVSTASH_ASSIGN_OR_RETURN(const std::uint64_t got,
                             kv_.device->segment_sum(st_.runs[c_][l], true, deadline));
    if (got != expected(l)) return Status::corrupt("kvcache: does not match its checksum");
    return {};
  }

  std::uint64_t expected(std::uint32_t l) const {
    std::lock_guard lock(st_.mu);
    return (*st_.sums[c_])[l];
  }

  const KvCache::Impl& kv_;
  State& st_;
  const std::size_t c_;
  const std::string& key_;
  const std::uint32_t layers_;
  const std::uint64_t layer_bytes_;
  std::vector<Slice> slices_;    // where the get lands the chunk
  std::byte* bounce_ = nullptr;  // staged: the whole chunk
  bool sums_known_ = false;
  Status bad_layer_;           // the first layer that failed its check
  std::uint32_t checked_ = 0;  // leading layers landed (and checked, staged)
};

void KvLoad::State::load_chunk(std::size_t c, const std::string& key) { ChunkLoad(*this, c, key).run(); }

// ---- The load's state -------------------------------------------------------------------------

Status KvLoad::State::wait_after() {
  {
    std::lock_guard lock(mu);
    if (after_passed || !after) return {};
  }
  const Deadline until = deadline.value_or(deadline_after(std::chrono::seconds(30)));
  for (;;) {  // short steps, so that cancel() is not held up by engine work that never ends
    const Deadline step = std::min(until, Clock::now() + std::chrono::milliseconds(5));
    Status s = after->wait(step);
    if (s.is_ok()) break;
    if (s.code() != StatusCode::kTimeout || step == until) return s;
    if (cancel.cancelled()) return Status::cancelled("kvcache: load cancelled");
  }
  std::lock_guard lock(mu);
  after_passed = true;
  return {};
}

bool KvLoad::State::ready_locked(std::uint32_t layer) const {
  for (std::size_t c = 0; c < done.size(); ++c) {
    if (landed[c] <= layer && !done[c]) return false;
  }
  return true;
}

bool KvLoad::State::placed_locked(std::uint32_t layer) const {
  for (std::size_t c = 0; c < done.size(); ++c) {
    if (placed[c] <= layer && !done[c]) return false;
  }
  return true;
}

Status KvLoad::State::failure_locked(std::uint32_t layer) const {
  for (std::size_t c = 0; c < done.size(); ++c) {
    if (!late[c].is_ok()) return late[c];
    if (landed[c] <= layer && done[c] && !done[c]->is_ok()) return *done[c];
    if (landed[c] <= layer && done[c]) return Status::internal("kvcache: a chunk ended without its layers");
  }
  return {};
}

void KvLoad::State::progress_locked() {
  cv.notify_all();
  if (!releasing) return;
  std::uint32_t ready = 0;
  while (ready < layers && ready_locked(ready)) ++ready;
  handover->release_through(ready);
}

Status KvLoad::State::to_streams() {
  std::unique_lock lock(mu);
  if (result) return Status::invalid_argument("kvcache: the load has finished (wait() returned)");
  if (handover) return {};
  KvHandoverPlan plan;
  plan.staged = kv->staged();
  plan.layers = layers;
  plan.layer_bytes = kv->layer_bytes();
  plan.runs = runs;
  plan.after = after.get();
  auto made = device->handover(plan);
  if (!made.is_ok()) return made.status();
  // From here the loaders only land layers (and tell the handover where, staged); those
  // placing one now finish first. Nothing is released before every landed layer was placed.
  handover = std::move(made).value();
  streams = true;
  cv.wait(lock, [&] { return lane_busy == 0; });
  if (plan.staged) {
    for (std::size_t c = 0; c < landed.size(); ++c) {
      for (std::uint32_t l = placed[c]; l < landed[c]; ++l)
        handover->place(c, l, bounces[c]->mem.get() + l * plan.layer_bytes);
    }
  }
  releasing = true;
  progress_locked();
  return {};
}

void KvLoad::State::place_on_host(std::unique_lock<std::mutex>& lock, std::uint32_t l) {
  if (host_placed[l] == 0) {
    host_placed[l] = 1;
    lock.unlock();
    place_layer(l);
    lock.lock();
    host_placed[l] = 2;
    cv.notify_all();
  }
  cv.wait(lock, [&] { return host_placed[l] == 2; });
}

void KvLoad::State::place_layer(std::uint32_t l) {
  const Deadline until = deadline.value_or(deadline_after(std::chrono::seconds(30)));
  const std::uint64_t layer_bytes = kv->layer_bytes();
  for (std::size_t c = 0; c < runs.size(); ++c) {
    const std::byte* src = nullptr;
    std::uint64_t want = 0;
    {
      std::lock_guard lock(mu);
      if (placed[c] > l || landed[c] <= l || !late[c].is_ok()) continue;
      if (kv->staged()) {
        src = bounces[c]->mem.get() + l * layer_bytes;
      } else {
        want = (*sums[c])[l];
      }
    }
    Status s;
    if (src != nullptr) {
      s = wait_after();
      if (s.is_ok()) s = device->scatter(src, runs[c][l], until);
      if (s.code() == StatusCode::kTimeout) taint(c);
    } else {
      auto got = device->segment_sum(runs[c][l], true, until);
      s = !got.is_ok()   ? got.status()
          : *got == want ? Status::ok()
                         : Status::corrupt("kvcache: does not match its checksum");
    }
    if (!s.is_ok()) {
      std::lock_guard lock(mu);
      if (late[c].is_ok())
        late[c] = s.with_context("kvcache: layer " + std::to_string(l) + " of chunk " + std::to_string(c));
    }
  }
}

void KvLoad::State::taint(std::size_t c) {
  std::lock_guard lock(mu);
  tainted[c] = 1;
}

void KvLoad::State::give_bounces() {
  if (!kv->load_bounces) return;
  for (std::size_t c = 0; c < bounces.size(); ++c) {
    if (tainted[c] != 0) {
      kv->load_bounces->quarantine(std::move(bounces[c]));  // a scatter from it may still run
    } else {
      kv->load_bounces->give(std::move(bounces[c]));
    }
  }
}

KvLoad::State::~State() {
  if (handover) handover->release_through(layers);  // no engine stream waits forever
  if (handover && !handover->passed()) {
    for (std::size_t c = 0; c < bounces.size(); ++c) {
      if (tainted[c] != 0 && kv->load_bounces) kv->load_bounces->quarantine(std::move(bounces[c]));
    }
    kv->retire({std::move(handover), std::move(bounces)});
    return;
  }
  give_bounces();
}

// ---- KvLoad -----------------------------------------------------------------------------------

KvLoad::KvLoad() = default;
KvLoad::KvLoad(KvLoad&&) noexcept = default;
KvLoad& KvLoad::operator=(KvLoad&&) noexcept = default;
KvLoad::~KvLoad() {
  if (state_) wait();
}

Result<bool> KvLoad::State::hand_to_stream(std::uint32_t layer, bool even_if_placed) {
  if (layer >= layers) return Status::invalid_argument("kvcache: layer out of range");
  KVSTASH_RETURN_IF_ERROR(to_streams());
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return host_placed[layer] != 1; });
  if (host_placed[layer] == 2 && !even_if_placed) return false;
  queued[layer] = 1;
  return true;
}

void KvLoad::State::unhand(std::uint32_t layer) {
  std::lock_guard lock(mu);
  queued[layer] = 0;  // a host waiter or wait() places it
}

Status KvLoad::wait_layer_on(std::uint32_t layer, void* stream) {
  if (!state_) return Status::invalid_argument("kvcache: no load");
  // Placed already by a host waiter (who waited for it): the stream has nothing to wait for.
  KVSTASH_ASSIGN_OR_RETURN(const bool hand, state_->hand_to_stream(layer, false));
  if (!hand) return {};
  Status s = state_->handover->queue(layer, stream);
  if (!s.is_ok()) state_->unhand(layer);
  return s;
}

Result<void*> KvLoad::layer_event(std::uint32_t layer) {
  if (!state_) return Status::invalid_argument("kvcache: no load");
  // Placed or not, the event is the handover's: it completes after the layer's release.
  KVSTASH_RETURN_IF_ERROR(state_->hand_to_stream(layer, true).status());
  auto e = state_->handover->queue_event(layer);
  if (!e.is_ok()) state_->unhand(layer);
  return e;
}

bool KvLoad::layer_ready(std::uint32_t layer) const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  if (layer >= state_->layers) return true;
  if (!state_->streams) return state_->placed_locked(layer);
  return state_->ready_locked(layer) && (state_->queued[layer] != 0 || state_->host_placed[layer] == 2);
}

Status KvLoad::wait_layer(std::uint32_t layer) {
  if (!state_) return Status::invalid_argument("kvcache: no load");
  State& st = *state_;
  if (layer >= st.layers) return Status::invalid_argument("kvcache: layer out of range");
  const auto started = Clock::now();
  std::unique_lock lock(st.mu);
  st.cv.wait(lock, [&] { return st.streams ? st.ready_locked(layer) : st.placed_locked(layer); });
  st.layer_waits->observe(std::chrono::duration<double>(Clock::now() - started).count());
  if (!st.streams) {
    // Host mode: a chunk placed at most up to `layer` ended; its status says why.
    for (std::size_t c = 0; c < st.done.size(); ++c) {
      if (st.placed[c] <= layer) {
        return st.done[c]->is_ok() ? Status::internal("kvcache: a chunk ended without its layers")
                                   : *st.done[c];
      }
    }
    return {};
  }
  // Stream mode: a layer no stream was handed is placed here.
  if (st.queued[layer] == 0) st.place_on_host(lock, layer);
  return st.failure_locked(layer);
}

void KvLoad::cancel() {
  if (!state_) return;
  state_->cancel.cancel();  // the gets in flight stop moving bytes; the queued ones never start
  for (auto& t : state_->tasks) {
    if (t.valid()) t.wait();  // and their tasks have stopped placing into the cache
  }
}

std::vector<std::uint32_t> KvLoad::failed_blocks() {
  const std::vector<Status> statuses = wait();  // per chunk; blocks are per object
  const std::size_t per_chunk = state_ ? state_->kv->per_chunk() : 1;
  std::vector<std::uint32_t> out;
  for (std::size_t c = 0; c < statuses.size(); ++c) {
    const auto& blocks = state_->blocks[c * per_chunk];
    if (!statuses[c].is_ok()) out.insert(out.end(), blocks.begin(), blocks.end());
  }
  return out;
}

std::vector<Status> KvLoad::object_statuses() {
  if (!state_) return {};
  wait();
  std::lock_guard lock(state_->mu);
  return state_->objects;
}

std::vector<Status> KvLoad::wait() {
  if (!state_) return {};
  State& st = *state_;
  for (auto& t : st.tasks) {
    if (t.valid()) t.get();
  }
  std::unique_lock lock(st.mu);
  if (st.result) return *st.result;
  if (st.streams) {
    const Deadline until = st.deadline.value_or(deadline_after(std::chrono::seconds(30)));
    for (std::uint32_t l = 0; l < st.layers; ++l) {
      if (st.queued[l] == 0) {
        st.place_on_host(lock, l);  // never handed to a stream: placed on the cache's own streams
        continue;
      }
      if (st.kv->staged()) continue;  // checked on the host as it landed
      // Direct: the stream checked the layer where the NIC put it; its verdict, when it ran.
      for (std::size_t c = 0; c < st.runs.size(); ++c) {
        if (st.placed[c] > l || st.landed[c] <= l || !st.late[c].is_ok()) continue;
        if (st.done[c] && !st.done[c]->is_ok()) continue;  // failed anyway
        const std::uint64_t want = (*st.sums[c])[l];
        lock.unlock();
        auto got = st.handover->sum(c, l, until);
        lock.lock();
        if (!got.is_ok()) {
          st.late[c] = got.status().with_context("kvcache: layer " + std::to_string(l) + " of chunk " +
                                                 std::to_string(c));
        } else if (*got != want) {
          st.late[c] =
              Status::corrupt("kvcache: layer " + std::to_string(l) + " of chunk " + std::to_string(c) +
                              " does not match its checksum (checked on the engine's stream)");
        }
      }
    }
  }
  std::vector<Status> out;
  for (std::size_t c = 0; c < st.done.size(); ++c) {
    const Status& d = st.done[c] ? *st.done[c] : Status::internal("kvcache: load not finished");
    out.push_back(!d.is_ok() ? d : st.late[c]);
  }
  st.objects = out;
  out = kvcache::fold_objects(out, st.kv->per_chunk());
  st.result = out;
  if (!st.streams) st.give_bounces();  // every layer is in place: the bounce buffers go back now
  count_chunks(*st.kv->store, "load", out);
  return out;
}

}  // namespace kvstash
