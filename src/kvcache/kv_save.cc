// KvSave: a save's state machine. save_layer(l) queues, per chunk, a task on the cache's
// savers that waits for the engine's work writing layer l and appends the layer to the
// chunk's PutStream (direct, or through a bounce slot); wait() commits each chunk with its
// layers' checksums in the object's layout; cancel() and destruction drop it.
#include <algorithm>
#include <chrono>

#include "kvcache/kv_cache_internal.h"
#include "kvcache/object_layout.h"

namespace kvstash {

Status KvSave::State::wait_for(KvDeviceMark& mark) const {
  for (;;) {
    const Deadline step = std::min(deadline, Clock::now() + std::chrono::milliseconds(5));
    Status s = mark.wait(step);
    if (s.code() != StatusCode::kTimeout || step == deadline) return s;
    if (cancelled) return Status::cancelled("kvcache: save cancelled");
  }
}

void KvSave::State::drain() {
  for (auto& c : chunks) {
    if (c.last.valid()) c.last.wait();
  }
}

KvSave::State::~State() {
  drain();
  for (auto& c : chunks) {
    c.stream.abort();  // no write may still read a bounce buffer that goes back to the pool
    if (kv == nullptr || !kv->save_bounces) continue;
    if (c.bounce_tainted) {
      kv->save_bounces->quarantine(std::move(c.bounce));
    } else {
      kv->save_bounces->give(std::move(c.bounce));
    }
  }
}

void KvSave::State::write_layer(Chunk& c, std::uint32_t layer, KvDeviceMark& written) {
  if (!c.status.is_ok()) return;
  c.status = wait_for(written);
  if (!c.status.is_ok()) {
    c.status =
        c.status.with_context("kvcache: waiting for the engine to write layer " + std::to_string(layer));
    return;
  }
  auto runs = kv->layer_runs(c.object, layer, c.blocks);
  if (!runs.is_ok()) {
    c.status = runs.status();
    return;
  }
  // Each layer is one checksum segment; the stream keeps the layers' sums (segment_sums),
  // which the layout records at the end.
  if (kv->device_sums()) {
    // Summed on the device, where the bytes are; the store reads none of them.
    auto summed = kv->device->segment_sum(*runs, false, deadline);
    c.status = summed.is_ok() ? c.stream.append_summed(kv->slices(*runs), *summed) : summed.status();
  } else if (!kv->staged()) {
    c.status = c.stream.append(kv->slices(*runs));  // summed as shm copies it, or here
  } else {
    // Through a bounce slot: the one this layer reuses must have reached the nodes.
    const std::uint64_t lb = kv->layer_bytes();
    const std::uint32_t slots = kv->options.bounce_slots;
    if (layer >= slots) c.status = c.stream.wait_written(lb * (layer - slots + 1));
    std::byte* slot = c.bounce->mem.get() + (layer % slots) * lb;
    if (c.status.is_ok()) {
      c.status = kv->device->gather(*runs, slot, deadline);
      // A gather that did not finish may still write the slot: the buffer is never reused.
      if (c.status.code() == StatusCode::kTimeout) c.bounce_tainted = true;
    }
    Slice s{slot, static_cast<std::size_t>(lb), &c.bounce->handle};
    if (c.status.is_ok()) c.status = c.stream.append({&s, 1});
  }
}

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
      st.write_layer(c, layer, *written);
    };
    c.last = st.kv->savers->submit(std::move(task)).share();
  }
  ++st.next_layer;
  return Status::ok();
}

std::vector<std::string> KvSave::keys() const {
  std::vector<std::string> out;
  if (!state_) return out;
  out.reserve(state_->chunks.size());
  for (const auto& c : state_->chunks) out.push_back(c.key);
  return out;
}

std::size_t KvSave::announced() const { return state_ ? state_->announced : 0; }

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
    return kvcache::fold_objects(out, st.kv->per_chunk());
  }
  const std::uint32_t layers = st.kv->layout.shape().num_layers;
  std::vector<Status> out;
  std::vector<PutStream> ready;  // committed together: one Redis round trip for the request
  std::vector<std::size_t> ready_at;
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
    // The layers' sums are all known once their writes completed.
    Status written = c.stream.wait_written(c.stream.size());
    if (!written.is_ok()) {
      c.stream.abort();
      out.push_back(written);
      continue;
    }
    c.stream.set_object_layout(kvcache::object_layout(st.kv->keys.layout_tag, c.stream.segment_sums()));
    ready_at.push_back(out.size());
    ready.push_back(std::move(c.stream));
    out.emplace_back();
  }
  const std::vector<Status> committed = st.kv->store->commit_all(ready);
  for (std::size_t i = 0; i < ready.size(); ++i) {
    out[ready_at[i]] = committed[i];
    if (committed[i].is_ok() && ready[i].announced()) ++st.announced;
  }
  out = kvcache::fold_objects(out, st.kv->per_chunk());
  count_chunks(*st.kv->store, "save", out);
  return out;
}

}  // namespace kvstash
