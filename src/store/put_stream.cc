// Puts. Every put is a PutStream: begin_put (pages from the client's reservation or from
// Redis, reservations.cc; the nodes leased), appends (the writes, and the checksum while they
// fly), commit (one script) or abort. Store::put is one begin, one append of everything, one
// commit.
#include <algorithm>
#include <atomic>
#include <deque>
#include <future>
#include <map>

#include "common/log.h"
#include "store/slices.h"
#include "store/store_internal.h"
#include "store/transfers.h"

namespace kvstash {

using store::MetadataClock;

namespace {

// How long a failed put may spend confirming at its nodes that none of its writes can land
// any more (Peer::revoke), off the caller's path. Unconfirmed, the pages wait for the nodes'
// fences instead.
constexpr auto kRevokeTimeout = std::chrono::seconds(2);

// Placements a put may try: its first, and again away from a node that went away under it
// (StoreOptions::avoid_unreachable_nodes) or from a reservation that went stale.
constexpr int kPlacements = 3;

Status object_layout_fits(const std::string& object_layout) {
  if (object_layout.size() <= store::kMaxObjectLayout) return {};
  return Status::invalid_argument("store: object_layout is larger than 64 KiB");
}

}  // namespace

struct PutStream::State {
  Store::Impl* impl = nullptr;
  std::string key;
  PutOptions options;
  std::uint64_t size = 0;
  std::uint64_t written = 0;
  store::PutPages pages;
  Deadline deadline;           // the caller's: metadata calls and the abort
  Deadline transfer_deadline;  // the caller's, capped inside the put lease
  Clock::time_point began;     // for OpTimings::transfer
  store::Leased leased;
  std::deque<MemoryHandle> temp;  // slices registered for the writes (the batches use them)
  // Appends whose writes digest their blocks as they copy them (append_fused), in order, until
  // their writes were waited for and their segments folded into `hash`. The batches write
  // into `digests` (a digest per 4 KiB, and a spare word for the fold).
  struct Fused {
    std::uint64_t begin = 0, end = 0;  // object bytes
    std::vector<std::uint64_t> digests;
  };
  std::deque<Fused> fused;
  bool digesting = false;  // every node's transport digests writes
  std::vector<store::Wave> waves;
  sum::ObjectHasher hash;
  Status failed;  // with the key as context
  bool finished = false;
  std::uint64_t waited_end = 0;  // the writes of [0, waited_end) are done
  bool timed = false;            // OpTimings::transfer counted
  bool node_lost = false;        // writes failed because a node went away; it is avoided now
  std::uint32_t copies = 1;      // of a put with replicas (the commit of the object itself says it)
  bool in_put = false;           // Store::put's own stream: that put is what its metrics count
  bool announced = false;        // the commit recorded the put's event data (PutOptions::event)

  explicit State(std::uint64_t segment) : hash(segment) {}

  // Before a commit: every write done, the layout and the size right. Otherwise the put is
  // aborted and that is the commit's status. Marks the stream finished either way.
  Status ready_to_commit() {
    Status moved = wait_writes();  // its failure names the key already
    if (moved.is_ok()) moved = object_layout_fits(options.object_layout).with_context(key);
    if (moved.is_ok() && written != size) {
      moved = Status::invalid_argument("store: put of " + key + " committed with " + std::to_string(written) +
                                       " of its " + std::to_string(size) + " bytes");
    }
    finished = true;
    if (!moved.is_ok()) {
      if (failed.is_ok()) failed = moved;
      abort_put();
      KVSTASH_LOG_DEBUG("put {} failed: {}", key, moved.to_string());
    }
    return moved;
  }

  // After the commit script answered `committed` in `cell`: every write has completed, so
  // whatever became of the commit, no write of this put can land any more, and pages it did
  // not make an object's go back now, not with its lease. Then the replicas and the older copy.
  Status after_commit(metadata::Cell& cell, Status committed) {
    if (committed.is_ok() || metadata::Catalog::condition_failed(committed)) {  // the latter freed them
      impl->settle(pages, true);
    } else {
      impl->end_uncommitted_later(key, pages);
    }
    if (committed.is_ok()) committed = impl->wait_for_replicas(cell.redis(), deadline);
    if (committed.is_ok()) committed = impl->remove_older_copy(key, *pages.cell, deadline);
    if (!in_put) impl->meters.op(store::MeteredOp::kPutStream, committed, began, size);
    return committed.with_context(key);
  }

  // Cancels what still moves (returning once nothing reads the caller's buffers), then ends
  // the put at the nodes and in Redis (Store::Impl::abort_put).
  void abort_put() {
    waves.clear();
    store::forget_refused(leased.leases, failed);
    impl->abort_put(key, pages, std::move(leased.leases), deadline);
  }

  // Waits for the writes of the object's bytes [0, end) (all of them by default); a failure
  // is kept, and the stream is dead from then on.
  Status wait_writes(std::uint64_t end = ~0ull) {
    std::size_t i = 0;
    // A wave holds the bytes from the previous one's end to its own: wait while it starts
    // before `end`.
    std::vector<std::size_t> unreachable;
    for (; i < waves.size() && (i == 0 ? waited_end : waves[i - 1].end) < end; ++i) {
      Status s = store::wait_all(waves[i], &unreachable, &impl->meters);
      if (failed.is_ok() && !s.is_ok()) failed = store::fenced_is_stale(s).with_context(key);
    }
    for (std::size_t node : unreachable) node_lost |= impl->avoided->add(pages.placement.nodes[node]);
    if (i > 0) waited_end = waves[i - 1].end;
    waves.erase(waves.begin(), waves.begin() + static_cast<std::ptrdiff_t>(i));
    if (failed.is_ok()) fold_fused();
    if (waves.empty() && written == size && options.timings != nullptr && failed.is_ok() && !timed) {
      options.timings->transfer += Clock::now() - began;  // the checksum overlaps it
      timed = true;
    }
    return failed;
  }

  // Starts the writes of the next `n` bytes from `data` (with `fused`: digesting their blocks
  // where the transports can). A failure is kept, with the key.
  Status submit(std::span<const Slice> data, std::uint64_t n, store::FusedDigests* fused_digests = nullptr) {
    Status submitted =
        store::submit_range(*impl->engine, leased, TransferOp::kWrite, pages.placement, written, written + n,
                            data, temp, transfer_deadline, n, waves, fused_digests);
    if (!submitted.is_ok()) {
      failed = submitted.with_context(key);
      return failed;
    }
    written += n;
    return Status::ok();
  }

  // Whether an append of `n` bytes can take its checksum from the copy: every node's
  // transport digests writes, and the piece is whole segments (or ends the object) from a
  // segment boundary, the segment a multiple of the digests' 4 KiB blocks.
  bool can_fuse(std::uint64_t n) const {
    const std::uint64_t segment = hash.segment_bytes();
    return digesting && segment % sum::kBlockBytes == 0 && written % segment == 0 &&
           (n % segment == 0 || written + n == size);
  }

  // Writes the next `n` bytes with the transports digesting their blocks as they copy them;
  // only the blocks they cannot take whole (a slice's edge inside a block) are hashed here.
  // The segments are folded into the object's sum once the writes completed (fold_fused).
  Status append_fused(std::span<const Slice> data, std::uint64_t n) {
    const auto t0 = Clock::now();
    Fused& f = fused.emplace_back();
    f.begin = written;
    f.end = written + n;
    f.digests.assign(sum::block_count(n) + 1, 0);
    store::FusedDigests fd{f.digests.data(), {}};
    KVSTASH_RETURN_IF_ERROR(submit(data, n, &fd));
    std::uint64_t at = f.begin, covered = 0;  // the blocks between the transports' ranges: here
    std::sort(fd.digested.begin(), fd.digested.end());
    fd.digested.emplace_back(f.end, f.end);
    for (const auto& [from, to] : fd.digested) {
      for (; at < from; at += sum::kBlockBytes) {
        f.digests[(at - f.begin) / sum::kBlockBytes] =
            store::block_digest_at(data, at - f.begin, std::min(n, at - f.begin + sum::kBlockBytes));
      }
      covered += to - from;
      at = to;
    }
    if (options.timings != nullptr) {
      options.timings->checksummed_in_copy += covered;
      options.timings->checksum += Clock::now() - t0;
    }
    return Status::ok();
  }

  // Folds the fused appends whose writes have completed into the object's sum, in order.
  void fold_fused() {
    const auto t0 = Clock::now();
    const std::uint64_t segment = hash.segment_bytes();
    while (!fused.empty() && fused.front().end <= waited_end) {
      Fused& f = fused.front();
      const std::uint64_t n = f.end - f.begin;
      const std::vector<std::uint64_t> sums = sum::fold_segments(f.digests.data(), n, segment);
      for (std::uint64_t i = 0; i < sums.size(); ++i)
        hash.add_segment(sums[i], std::min(segment, n - i * segment));
      fused.pop_front();
    }
    if (options.timings != nullptr) options.timings->checksum += Clock::now() - t0;
  }

  // Before an append hashed here, or summed elsewhere: the fused ones before it are folded
  // (the object's sum takes its segments in order), once their writes completed.
  Status settle_fused() {
    if (fused.empty()) return failed;
    return wait_writes(fused.back().end);
  }

  // Hashes appended host bytes. From a segment boundary, whole segments are independent: the
  // caller and the store's hashing threads take them in turn. What is left continues the
  // stream's current segment on this thread.
  void hash_appended(std::span<const Slice> data, std::uint64_t n) {
    const auto t0 = Clock::now();
    const std::uint64_t segment = hash.segment_bytes();
    const bool ends_object = written == size;  // `written` already counts this append
    std::uint64_t whole = hash.at_segment_boundary() ? (ends_object ? n : n / segment * segment) : 0;
    if (whole < 2 * segment) whole = 0;  // one segment: no one to share it with
    if (whole > 0) {
      const std::vector<std::uint64_t> sums = impl->sum_segments(data, whole, segment);
      for (std::size_t i = 0; i < sums.size(); ++i) {
        hash.add_segment(sums[i], std::min(whole, (i + 1) * segment) - i * segment);
      }
    }
    std::uint64_t at = 0;
    for (const Slice& s : data) {  // the rest, in order
      const std::uint64_t from = std::max(whole, at), to = at + s.length;
      if (from < to) hash.update(static_cast<const std::byte*>(s.addr) + (from - at), to - from);
      at = to;
    }
    if (options.timings != nullptr) options.timings->checksum += Clock::now() - t0;
  }
};

PutStream::PutStream() = default;
PutStream::PutStream(PutStream&&) noexcept = default;
PutStream& PutStream::operator=(PutStream&& other) noexcept {
  if (this != &other) {
    abort();
    state_ = std::move(other.state_);
  }
  return *this;
}
PutStream::~PutStream() { abort(); }

std::uint64_t PutStream::size() const { return state_ ? state_->size : 0; }
std::uint64_t PutStream::written() const { return state_ ? state_->written : 0; }
bool PutStream::announced() const { return state_ && state_->announced; }

Status PutStream::wait_written(std::uint64_t end) {
  if (!state_) return Status::invalid_argument("store: wait on an empty put stream");
  return state_->wait_writes(end);
}

std::vector<std::uint64_t> PutStream::segment_sums() const {
  return state_ ? state_->hash.segment_sums() : std::vector<std::uint64_t>{};
}

void PutStream::set_object_layout(std::string object_layout) {
  if (state_) state_->options.object_layout = std::move(object_layout);
}

// Checks an append of `n` bytes against the stream's state; with `whole_segment`, also that
// the piece is exactly the object's next checksum segment.
Status PutStream::check_append(std::uint64_t n, bool whole_segment) const {
  if (!state_ || state_->finished) return Status::invalid_argument("store: append to a finished put");
  const State& st = *state_;
  if (!st.failed.is_ok()) return st.failed;
  if (n > st.size - st.written) {
    return Status::invalid_argument("store: " + std::to_string(n) + " more bytes would pass the object's " +
                                    std::to_string(st.size));
  }
  if (whole_segment) {
    const std::uint64_t segment = st.hash.segment_bytes();
    if (!st.hash.at_segment_boundary() || (n != segment && st.written + n != st.size) || n > segment) {
      return Status::invalid_argument(
          "store: a summed piece must be the object's next checksum segment (" + std::to_string(segment) +
          " bytes at offset " + std::to_string(st.hash.bytes()) + "), not " + std::to_string(n) + " bytes");
    }
  }
  return {};
}

Status PutStream::append(std::span<const Slice> data, std::uint64_t* segment_sum) {
  const std::uint64_t n = store::total_length(data);
  // A sum returned now is this thread's to compute: what was fused before is folded first.
  if (segment_sum != nullptr && state_ && !state_->finished) KVSTASH_RETURN_IF_ERROR(state_->settle_fused());
  KVSTASH_RETURN_IF_ERROR(check_append(n, segment_sum != nullptr));
  KVSTASH_RETURN_IF_ERROR(store::host_only(data, "append"));
  if (n == 0) return Status::ok();
  State& st = *state_;
  if (segment_sum == nullptr && st.can_fuse(n)) return st.append_fused(data, n);
  KVSTASH_RETURN_IF_ERROR(st.settle_fused());
  KVSTASH_RETURN_IF_ERROR(st.submit(data, n));
  st.hash_appended(data, n);  // while the writes fly
  if (segment_sum != nullptr) {
    if (st.written == st.size) st.hash.end_object();  // a short last segment is complete too
    *segment_sum = *st.hash.last_segment_sum();
  }
  return Status::ok();
}

Status PutStream::append_summed(std::span<const Slice> data, std::uint64_t segment_sum) {
  const std::uint64_t n = store::total_length(data);
  if (n == 0) return Status::invalid_argument("store: a summed piece must not be empty");
  if (state_ && !state_->finished) KVSTASH_RETURN_IF_ERROR(state_->settle_fused());
  KVSTASH_RETURN_IF_ERROR(check_append(n, true));
  KVSTASH_RETURN_IF_ERROR(state_->submit(data, n));
  state_->hash.add_segment(segment_sum, n);  // check_append made it the next segment
  return Status::ok();
}

Status PutStream::commit() {
  if (!state_ || state_->finished) return Status::invalid_argument("store: commit of a finished put");
  State& st = *state_;
  KVSTASH_RETURN_IF_ERROR(st.ready_to_commit());
  auto c = st.impl->borrow(*st.pages.cell, st.deadline);
  if (!c.is_ok()) {
    st.impl->end_uncommitted_later(st.key, st.pages);
    return c.status().with_context(st.key);
  }
  MetadataClock mc(st.options.timings);
  Status committed = st.impl->commit_pages(**c, st.pages, st.key, st.size, st.hash.finish(), st.options,
                                           st.copies, st.deadline, &st.announced);
  return st.after_commit(c->cell(), committed);
}

std::vector<Status> Store::commit_all(std::span<PutStream> streams) {
  std::vector<Status> out(streams.size());
  // Puts from reservations, by cell: one script commits each cell's.
  std::map<store::CellLink*, std::vector<std::size_t>> batches;
  for (std::size_t i = 0; i < streams.size(); ++i) {
    PutStream::State* st = streams[i].state_.get();
    if (st == nullptr || st->finished) {
      out[i] = Status::invalid_argument("store: commit of a finished put");
    } else if (!st->pages.reservation || st->copies > 1) {
      out[i] = streams[i].commit();
    } else if (Status ready = st->ready_to_commit(); !ready.is_ok()) {
      out[i] = ready;
    } else {
      batches[st->pages.cell].push_back(i);
    }
  }
  for (auto& [cell, batch] : batches) {
    Deadline deadline = Deadline::max();
    for (std::size_t i : batch) deadline = std::min(deadline, streams[i].state_->deadline);
    auto c = impl_->borrow(*cell, deadline);
    if (!c.is_ok()) {
      for (std::size_t i : batch) {
        PutStream::State& st = *streams[i].state_;
        impl_->end_uncommitted_later(st.key, st.pages);
        out[i] = c.status().with_context(st.key);
      }
      continue;
    }
    std::vector<metadata::Catalog::ReservedCommit> puts;
    std::vector<std::string> keep;  // the puts' keep hints, which `puts` views
    puts.reserve(batch.size());
    keep.reserve(batch.size());
    for (std::size_t i : batch) {
      PutStream::State& st = *streams[i].state_;
      keep.push_back(metadata::keep_hint_text(st.options.keep));
      puts.push_back({.pages = st.pages.run(),
                      .token = st.pages.token,
                      .key = st.key,
                      .size = st.size,
                      .checksum = st.hash.finish(),
                      .layout = st.options.object_layout,
                      .ttl = st.options.ttl,
                      .if_version = st.options.if_version,
                      .copies = 1,
                      .keep = keep.back(),
                      .commit_by_ms = impl_->commit_by(st.pages, deadline),
                      .event = st.options.event});
    }
    Result<std::vector<Status>> committed = Status::internal("unset");
    std::vector<bool> announced;
    {
      MetadataClock mc(streams[batch.front()].state_->options.timings);
      committed = (*c)->commit_reserveds(puts, &announced);
    }
    for (std::size_t k = 0; k < batch.size(); ++k) {
      PutStream::State& st = *streams[batch[k]].state_;
      const Status s = committed.is_ok() ? (*committed)[k] : committed.status();
      st.announced = committed.is_ok() && announced[k];
      impl_->reservation_committed(st.pages, s);
      out[batch[k]] = st.after_commit(c->cell(), s);
    }
  }
  return out;
}

void PutStream::abort() {
  if (!state_ || state_->finished) return;
  state_->finished = true;
  state_->abort_put();
}

Result<PutStream> Store::begin_put(std::string_view key, std::uint64_t size, const PutOptions& options) {
  if (options.replicas > 1) {
    return Status::invalid_argument("store: a put with replicas is Store::put's (a stream writes one copy)");
  }
  return begin_put(key, size, options, nullptr);
}

Result<PutStream> Store::begin_put(std::string_view key, std::uint64_t size, const PutOptions& options,
                                   Copy* copy) {
  KVSTASH_RETURN_IF_ERROR(metadata::validate_object_key(key));
  KVSTASH_RETURN_IF_ERROR(object_layout_fits(options.object_layout));
  auto st = std::make_unique<PutStream::State>(options.checksum_segment);
  st->impl = impl_.get();
  st->key = std::string(key);
  st->options = options;
  st->size = size;
  st->deadline = options.deadline.value_or(deadline_after(impl_->options.timeout));
  if (copy != nullptr) st->copies = copy->copies;
  store::CellLink& cell = impl_->put_cell(key, st->deadline);  // a copy routes as its object
  std::span<const metadata::NodeEndpoint> apart;               // the nodes of a replica's earlier copies
  if (copy != nullptr) apart = copy->apart;
  for (int attempt = 0;; ++attempt) {
    auto pages = impl_->put_pages(cell, key, size, st->deadline, options.timings, apart,
                                  copy != nullptr && copy->copies > 1);
    if (!pages.is_ok()) return pages.status().with_context(st->key);
    st->pages = std::move(pages).value();
    // Redis places a copy elsewhere while other nodes have room, else beside another copy:
    // that is no copy at all.
    const bool beside = std::ranges::any_of(st->pages.placement.nodes, [&](const metadata::NodeEndpoint& n) {
      return std::ranges::any_of(apart, [&](const metadata::NodeEndpoint& a) { return a.id == n.id; });
    });
    if (beside) {
      impl_->abort_put(st->key, st->pages, {}, st->deadline);
      return Status::no_space("store: no room for each of " + std::to_string(copy->copies) +
                              " copies on memory nodes apart from the others'")
          .with_context(st->key);
    }
    st->began = Clock::now();
    st->transfer_deadline = std::min(st->deadline, st->pages.lease_until);
    if (size == 0) break;
    metadata::NodeEndpoint unreachable;
    auto leased = store::connect_and_lease(*impl_->links, impl_->lease_policy(*st->pages.cell),
                                           TransferOp::kWrite, st->pages.placement, st->pages.lease_until,
                                           st->transfer_deadline, options.timings, &unreachable);
    if (leased.is_ok()) {
      st->leased = std::move(leased).value();
      st->digesting = std::ranges::all_of(
          st->leased.paths, [](const store::NodeLink::Path* path) { return path->peer->digests_writes(); });
      break;
    }
    impl_->abort_put(st->key, st->pages, {}, st->deadline);  // nothing was written; drops the reservation
    // Its node failed while the reservation waited, or a node of its pages cannot be reached:
    // again, with pages Redis gives now, away from that node.
    const bool elsewhere = !unreachable.id.empty() && impl_->avoided->add(unreachable);
    const bool again = (attempt == 0 && st->pages.held) || elsewhere;
    if (!again || attempt + 1 >= kPlacements || Clock::now() >= st->deadline) {
      return leased.status().with_context(st->key);
    }
  }
  PutStream stream;
  stream.state_ = std::move(st);
  return stream;
}

Status Store::put(std::string_view key, std::span<const Slice> data, const PutOptions& options) {
  const auto started = Clock::now();
  Status s = put_all(key, data, options);
  impl_->meters.op(store::MeteredOp::kPut, s, started, store::total_length(data));
  return s;
}

Status Store::put_all(std::string_view key, std::span<const Slice> data, const PutOptions& options) {
  KVSTASH_RETURN_IF_ERROR(store::host_only(data, "put"));
  PutOptions o = options;
  if (!o.deadline) o.deadline = deadline_after(impl_->options.timeout);  // one for every placement
  if (o.replicas <= 1) return put(key, data, o, nullptr);
  if (o.replicas > metadata::kMaxCopies) {
    return Status::invalid_argument("store: replicas is 1 to " + std::to_string(metadata::kMaxCopies));
  }
  if (o.if_version)
    return Status::invalid_argument("store: a put with replicas cannot be conditional (if_version)");
  // The copies first, each apart from the ones before; the object itself last, its commit
  // naming how many copies there are (and dropping any beyond, an earlier put's).
  Copy copy{.copies = o.replicas, .apart = {}};
  PutOptions copy_options = o;
  copy_options.event.clear();  // a router hears of the object, not of its copies
  for (std::uint32_t i = 1; i < o.replicas; ++i) {
    const std::string copy_key = metadata::copy_key(key, i);
    Status s = put(copy_key, data, copy_options, &copy);
    if (!s.is_ok()) return s.with_context("copy " + std::to_string(i) + " of " + std::string(key));
  }
  return put(key, data, o, &copy);
}

Status Store::put(std::string_view key, std::span<const Slice> data, const PutOptions& o, Copy* copy) {
  for (int attempt = 1;; ++attempt) {
    KVSTASH_ASSIGN_OR_RETURN(PutStream stream, begin_put(key, store::total_length(data), o, copy));
    stream.state_->in_put = true;
    Status done = stream.append(data);
    if (done.is_ok()) {
      done = stream.commit();
    } else {
      stream.abort();
    }
    const PutStream::State& st = *stream.state_;
    // Pages from a reservation held since before this put can have gone with their node (or
    // their lease) meanwhile: the put runs once more, on pages Redis gives now.
    const bool stale_reservation = attempt == 1 && done.code() == StatusCode::kStale && st.pages.held &&
                                   !metadata::Catalog::condition_failed(done);
    // A node went away under the writes (nothing was committed): placed again, away from it.
    const bool node_lost = done.code() == StatusCode::kUnavailable && st.node_lost;
    if (done.is_ok() && copy != nullptr) {
      copy->apart.insert(copy->apart.end(), st.pages.placement.nodes.begin(), st.pages.placement.nodes.end());
    }
    if (done.is_ok() || !(stale_reservation || node_lost) || attempt >= kPlacements ||
        Clock::now() >= *o.deadline) {
      return done;
    }
    KVSTASH_LOG_DEBUG("put {}: placing it again: {}", st.key, done.to_string());
  }
}

// Ends a put that will not commit; its batches have ended (finished, failed or cancelled),
// so only writes already on their way to a node can still land. Each node is asked to confirm
// that none can (Peer::revoke of the put's leases), within the caller's deadline and then, if
// one did not answer in time, off the caller's path: when all confirm, the pages return at
// once; otherwise they wait in Redis until the put's lease has passed and its nodes have
// fenced through it, so a late write never lands in a page another put was given.
void Store::Impl::abort_put(const std::string& key, const store::PutPages& pages,
                            std::vector<store::HeldLease> leases, Deadline deadline) {
  std::vector<std::string> nodes;
  for (const auto& n : pages.placement.nodes) nodes.push_back(n.id);
  if (pages.reservation) retire(pages.reservation);  // a node of it may be gone
  if (Clock::now() < deadline) {
    auto confirmed = store::revoke_all(key, nodes, leases, deadline);
    if (confirmed.size() == nodes.size()) {
      end_put(key, pages, confirmed, deadline);
      return;
    }
    if (std::ranges::all_of(leases, [](const store::HeldLease& h) { return h.shared; })) {
      end_put(key, pages, confirmed, deadline);  // no node can confirm more later
      return;
    }
  }
  const Deadline confirm_by = deadline_after(kRevokeTimeout);
  aborter->submit([this, key, pages, confirm_by, nodes, leases = std::move(leases)] {
    // A queue that fell behind a stalled node does not wait again for each put.
    auto confirmed = store::revoke_all(key, nodes, leases, confirm_by);
    if (confirmed.size() < nodes.size()) {
      KVSTASH_LOG_INFO_LIMITED(
          "put {}: its pages on an unconfirmed node return once the node fenced its lease", key);
    }
    end_put(key, pages, confirmed, deadline_after(options.redis_timeout * 2));
  });
}

Status Store::Impl::wait_for_replicas(metadata::RedisClient& redis, Deadline deadline) {
  if (options.commit_replicas == 0) return {};
  // WAIT blocks the connection: it must answer well inside the socket's timeout, which is the
  // command timeout or what is left of the put's deadline, whichever is shorter.
  const auto left =
      std::min(std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()), options.redis_timeout) *
      3 / 4;
  const std::string want = std::to_string(options.commit_replicas);
  const std::string ms = std::to_string(std::max<std::int64_t>(1, left.count()));
  KVSTASH_ASSIGN_OR_RETURN(metadata::Reply acked, redis.command({"WAIT", want, ms}));
  if (acked.integer() >= static_cast<std::int64_t>(options.commit_replicas)) return {};
  return Status::unavailable("committed, but only " + std::to_string(acked.integer()) + " of " + want +
                             " Redis replicas had it before the deadline: a failover now may lose it");
}

void Store::Impl::end_put(const std::string& key, const store::PutPages& pages,
                          const std::vector<std::string>& fenced, Deadline deadline) {
  auto c = borrow(*pages.cell, deadline);
  Result<std::uint64_t> waiting = c.is_ok() ? abort_pages(**c, pages, fenced) : c.status();
  if (!waiting.is_ok()) {
    KVSTASH_LOG_WARN_LIMITED("put {}: abort failed, the lease will reclaim: {}", key,
                             waiting.status().to_string());
  }
  settle(pages, waiting.is_ok() && *waiting == 0);
}

void Store::Impl::end_uncommitted_later(const std::string& key, const store::PutPages& pages) {
  std::vector<std::string> nodes;
  for (const auto& n : pages.placement.nodes) nodes.push_back(n.id);
  aborter->submit([this, key, pages, nodes = std::move(nodes)] {
    end_put(key, pages, nodes, deadline_after(options.redis_timeout * 2));
  });
}

std::vector<std::uint64_t> Store::Impl::sum_segments(std::span<const Slice> slices, std::uint64_t size,
                                                     std::uint64_t segment) {
  const std::uint64_t n = (size + segment - 1) / segment;
  std::vector<std::uint64_t> sums(n);
  std::atomic<std::uint64_t> next{0};
  auto work = [&] {
    for (std::uint64_t i = next++; i < n; i = next++) {
      sums[i] = store::segment_sum_at(slices, i * segment, std::min(size, (i + 1) * segment));
    }
  };
  std::vector<std::future<void>> helpers;
  for (unsigned t = 0; t < hasher_count && t + 1 < n; ++t) helpers.push_back(hashers->submit(work));
  work();
  for (auto& h : helpers) h.wait();  // `work` and `sums` are this frame's
  return sums;
}

}  // namespace kvstash
