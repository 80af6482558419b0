// KvLoad: a load's state machine. Each chunk is one store get on the cache's loaders
// (ChunkLoad); its progress callback checks each layer as it lands and raises the chunk's
// verified count, which wait_layer, layer_ready and the device's layer events follow.
#include <algorithm>
#include <string_view>

#include "common/checksum.h"
#include "kvcache/kv_cache_internal.h"
#include "kvcache/object_layout.h"

namespace kvstash {

// ---- One chunk --------------------------------------------------------------------------------

// The steps of KvLoad::State::load_chunk (its comment is the contract): where the chunk
// lands, the get, each layer's check as it lands, and the chunk's final status. Lives on the
// loader thread for one call; touches the load's shared fields only under `mu`.
class KvLoad::State::ChunkLoad {
 public:
  ChunkLoad(const KvCache::Impl& kv, State& st, std::size_t c, const std::string& key,
            std::optional<Deadline> deadline)
      : kv_(kv),
        st_(st),
        c_(c),
        key_(key),
        deadline_(deadline),
        layers_(kv.layout.shape().num_layers),
        layer_bytes_(kv.layout.layer_bytes(kv.blocks_per_chunk)),
        runs_(layers_) {}

  void run() {
    Status final = prepare();
    if (final.is_ok()) final = fetch();
    if (bounce_) kv_.load_bounces->give(std::move(bounce_));  // the get has returned: no write is left
    std::lock_guard lock(st_.mu);
    if (!final.is_ok()) st_.verified[c_] = std::min(st_.verified[c_], checked_);
    st_.done[c_] = final;
    st_.progress_locked();
  }

 private:
  // Each layer's runs of the cache's memory, and the slices the get lands the chunk in: those
  // runs on the direct path; staged, one bounce buffer, where each layer is checked and then
  // scattered into the cache.
  Status prepare() {
    const std::vector<std::uint32_t>& blocks = st_.blocks[c_];
    for (std::uint32_t l = 0; l < layers_; ++l) {
      auto r = kv_.layer_runs(l, blocks);
      if (!r.is_ok()) return r.status();
      runs_[l] = std::move(r).value();
      if (!kv_.staged()) kv_.append_slices(runs_[l], slices_);
    }
    if (kv_.staged()) {
      auto b = kv_.load_bounces->take();
      if (!b.is_ok()) return b.status().with_context("kvcache: bounce buffer");
      bounce_ = std::move(b).value();
      slices_.push_back({bounce_->mem.get(), bounce_->bytes, &bounce_->handle});
    }
    return {};
  }

  // The store get; the chunk's status once it returned.
  Status fetch() {
    GetOptions o;
    o.deadline = deadline_;
    o.verify_checksum = false;  // every byte is in some layer, and every layer is checked
    o.cancel = st_.cancel;
    o.progress = [this](std::uint64_t landed, std::string_view stored_layout) {
      check_landed(landed, stored_layout);
    };
    auto r = kv_.store->get(key_, slices_, o);
    if (!r.is_ok()) return r.status();
    if (!bad_layer_.is_ok()) return bad_layer_;
    if (checked_ != layers_ && st_.cancel.cancelled()) {
      return Status::cancelled("kvcache: load of " + key_ + " cancelled");
    }
    if (r->size != kv_.chunk_bytes() || checked_ != layers_) {
      return Status::corrupt("kvcache: " + key_ + " holds " + std::to_string(r->size) + " bytes, a chunk " +
                             std::to_string(kv_.chunk_bytes()));
    }
    return {};
  }

  // GetOptions::progress: bytes [0, landed) are in. Checks every layer whole by now, in
  // order, until one fails (bad_layer_) or the load is cancelled.
  void check_landed(std::uint64_t landed, std::string_view stored_layout) {
    if (!sums_) sums_ = kvcache::parse_layout(stored_layout, kv_.keys.layout_tag, layers_);
    if (!sums_) {
      bad_layer_ =
          Status::corrupt("kvcache: " + key_ + " was not saved by a cache of layout " + kv_.keys.layout_tag);
      return;
    }
    while (bad_layer_.is_ok() && checked_ < layers_ && (checked_ + 1) * layer_bytes_ <= landed &&
           !st_.cancel.cancelled()) {
      Status s = check_layer(checked_);
      if (!s.is_ok()) {
        bad_layer_ = s;
        break;
      }
      ++checked_;
      std::lock_guard lock(st_.mu);
      st_.verified[c_] = checked_;
      st_.progress_locked();
    }
  }

  // Layer `l`, landed whole: its sum against the one its save recorded, computed in the
  // bounce buffer (host memory) on the host, in the cache's memory by its device; staged,
  // then scattered into the cache.
  Status check_layer(std::uint32_t l) {
    Result<std::uint64_t> sum = bounce_
                                    ? sum::segment_sum(bounce_->mem.get() + l * layer_bytes_, layer_bytes_)
                                    : kv_.device->segment_sum(runs_[l]);
    if (!sum.is_ok()) {
      return sum.status().with_context("kvcache: checking layer " + std::to_string(l) + " of " + key_);
    }
    if (*sum != (*sums_)[l]) {
      return Status::corrupt("kvcache: layer " + std::to_string(l) + " of " + key_ +
                             " does not match its checksum");
    }
    if (bounce_) return kv_.device->scatter(bounce_->mem.get() + l * layer_bytes_, runs_[l]);
    return {};
  }

  const KvCache::Impl& kv_;
  State& st_;
  const std::size_t c_;
  const std::string& key_;
  const std::optional<Deadline> deadline_;
  const std::uint32_t layers_;
  const std::uint64_t layer_bytes_;
  std::vector<std::vector<KvRun>> runs_;            // per layer: where it goes in the cache
  std::vector<Slice> slices_;                       // where the get lands the chunk
  std::unique_ptr<kvcache::Bounce> bounce_;         // staged: the whole chunk
  std::optional<std::vector<std::uint64_t>> sums_;  // per layer, from the object's layout
  Status bad_layer_;                                // the first layer that failed its check
  std::uint32_t checked_ = 0;                       // leading layers checked (staged: and scattered)
};

void KvLoad::State::load_chunk(const KvCache::Impl& kv, std::size_t c, const std::string& key,
                               std::optional<Deadline> deadline) {
  ChunkLoad(kv, *this, c, key, deadline).run();
}

// ---- The load's state -------------------------------------------------------------------------

bool KvLoad::State::ready_locked(std::uint32_t layer) const {
  for (std::size_t c = 0; c < done.size(); ++c) {
    if (verified[c] <= layer && !done[c]) return false;
  }
  return true;
}

void KvLoad::State::progress_locked() {
  cv.notify_all();
  if (!signals) return;
  std::uint32_t ready = 0;
  while (ready < layers && ready_locked(ready)) ++ready;
  signals->complete_through(ready);
}

KvLoad::State::~State() {
  if (signals) signals->complete_through(layers);  // no engine stream waits forever
}

// ---- KvLoad -----------------------------------------------------------------------------------

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

}  // namespace kvstash
