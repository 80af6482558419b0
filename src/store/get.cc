// Gets: begin_get (a read lease on the record), the reads in waves of 4 MiB with the checksum
// of each wave as it lands, and end_get, off the critical path while the lease held.
#include <algorithm>
#include <deque>
#include <map>
#include <optional>

#include "common/log.h"
#include "store/slices.h"
#include "store/store_internal.h"
#include "store/transfers.h"

namespace kvstash {

using store::MetadataClock;

namespace {

// A get's reads go in waves of this many bytes so that each wave is checksummed while the
// next ones still move (and while its bytes are still in cache).
constexpr std::uint64_t kWaveBytes = 4u << 20;

}  // namespace

// Registers a get's batches with its cancel token while they may run, so that
// CancelToken::cancel can stop them from another thread; a token cancelled already cancels
// them at once.
class CancelToken::Scope {
 public:
  Scope(const CancelToken& token, std::vector<store::Wave>& waves) : token_(token.state_.get()) {
    if (token_ == nullptr) return;
    std::lock_guard lock(token_->mu);
    for (auto& w : waves) {
      for (auto& b : w.batches) {
        if (token_->cancelled) {
          b.cancel();
        } else {
          token_->waiting.push_back(&b);
          mine_.push_back(&b);
        }
      }
    }
  }
  ~Scope() {
    if (token_ == nullptr || mine_.empty()) return;
    std::lock_guard lock(token_->mu);
    std::erase_if(token_->waiting, [&](Batch* b) { return std::ranges::find(mine_, b) != mine_.end(); });
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  State* token_;
  std::vector<Batch*> mine_;
};

Result<ObjectInfo> Store::Impl::get(std::string_view key, std::span<const Slice> into,
                                    const GetInto* into_for, const GetOptions& o) {
  KVSTASH_RETURN_IF_ERROR(metadata::validate_object_key(key));
  if (o.cancel.cancelled()) return Status::cancelled("store: get of " + std::string(key) + " cancelled");
  const Deadline deadline = o.deadline.value_or(deadline_after(options.timeout));
  std::string reader = store::random_token();
  auto leased_at = Clock::now();
  Result<metadata::ReadLease> lease = Status::internal("unset");
  store::CellLink* cell = nullptr;  // the one that holds it
  // A lease from a batch (Store::lease_reads), handed back to it when this get is done.
  std::shared_ptr<ReadLeases::State> batch = o.leases != nullptr ? o.leases->state_ : nullptr;
  std::optional<ReadLeases::State::Taken> taken;
  if (batch) taken = batch->take(key);
  if (taken) {
    lease = std::move(taken->lease);
    reader = std::move(taken->reader);
    cell = taken->cell;
    leased_at = taken->leased_at;
    if (!lease.is_ok()) batch.reset();  // nothing to hand back
  } else {
    batch.reset();
    const std::string hint = metadata::keep_hint_text(o.keep);
    for (store::CellLink* looked : get_cells(key, deadline)) {
      KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(*looked, deadline));
      MetadataClock mc(o.timings);
      lease = c->begin_get(key, reader, options.read_lease, o.promote, hint);
      cell = looked;
      if (lease.status().code() != StatusCode::kNotFound) break;
    }
    // On a node's NVMe tier: its promotion is queued. Wait for its end (the node wakes the
    // waiters), a short while at a time (a cancel is seen, and a wake-up lost with a node that
    // died costs one wait), and ask again, until it is back in a pool.
    while (lease.is_ok() && !lease->promoting_node.empty()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left <= std::chrono::milliseconds(1)) {
        return Status::timeout("store: object " + std::string(key) +
                               " was not promoted from the NVMe tier of node " + lease->promoting_node +
                               " within the get's deadline");
      }
      if (o.cancel.cancelled()) return Status::cancelled("store: get of " + std::string(key) + " cancelled");
      KVSTASH_ASSIGN_OR_RETURN(auto c, borrow(*cell, deadline));
      MetadataClock mc(o.timings);
      const auto wait = std::min(
          {left - std::chrono::milliseconds(1), std::chrono::milliseconds(25), options.redis_timeout / 2});
      if (Status waited = c->wait_promotion(*lease, wait); !waited.is_ok()) {
        KVSTASH_LOG_DEBUG("get {}: waiting for its promotion: {}", key, waited.to_string());
      }
      leased_at = Clock::now();
      lease = c->begin_get(key, reader, options.read_lease, o.promote, hint);
    }
  }
  if (!lease.is_ok()) return lease.status().with_context(std::string(key));
  // Ended while it held, a lease needs no check of its pages' generations (none could move):
  // no extents, and Redis skips the check, a lookup per page.
  const metadata::Catalog::EndedRead ended{reader, lease->object_token, ""};

  Status moved;
  std::vector<Slice> placed;
  if (into_for != nullptr) {
    auto p = (*into_for)(lease->size);
    if (p.is_ok()) {
      placed = std::move(p).value();
      into = placed;
    } else {
      moved = p.status();
    }
  }
  const bool verify = o.verify_checksum.value_or(options.verify_checksum);
  store::SliceHasher hasher(into, lease->checksum.segment);
  if (moved.is_ok() && verify) moved = store::host_only(into, "a get that verifies its checksum");
  if (!moved.is_ok()) {
    // into device memory with the check on: nothing is read
  } else if (store::total_length(into) < lease->size) {
    moved = Status::invalid_argument("store: buffers hold " + std::to_string(store::total_length(into)) +
                                     " bytes, object " + std::string(key) + " has " +
                                     std::to_string(lease->size));
  } else if (lease->size > 0) {
    std::deque<MemoryHandle> temp;
    const auto t0 = Clock::now();
    // Not capped at the lease: a read that outlives it is caught by end_get's generations, or
    // fails at the node where its windows were revoked (then reported as kStale).
    const Clock::time_point lease_until = store::within_lease(Deadline::max(), leased_at, options.read_lease);
    std::vector<store::Wave> waves;
    auto leased = store::connect_and_lease(*links, lease_policy(*cell), TransferOp::kRead, lease->placement,
                                           lease_until, deadline, o.timings);
    moved = leased.status();
    if (moved.is_ok()) {
      moved = store::submit_range(*engine, *leased, TransferOp::kRead, lease->placement, 0, lease->size, into,
                                  temp, deadline, kWaveBytes, waves);
    }
    std::optional<CancelToken::Scope> cancellable;
    if (moved.is_ok()) cancellable.emplace(o.cancel, waves);
    std::chrono::nanoseconds hashing{0};
    for (std::size_t i = 0; moved.is_ok() && i < waves.size(); ++i) {
      // On an error the later waves are cancelled (their batches' destructors).
      moved = store::fenced_is_stale(store::wait_all(waves[i], nullptr, &meters));
      if (moved.is_ok() && verify) {
        const auto c0 = Clock::now();
        hasher.advance_to(waves[i].end);
        hashing += Clock::now() - c0;
      }
      if (moved.is_ok() && o.progress) o.progress(waves[i].end, lease->layout);
    }
    if (o.timings != nullptr) {
      o.timings->transfer += Clock::now() - t0 - hashing;
      o.timings->checksum += hashing;
    }
    cancellable.reset();
    waves.clear();  // cancels what still moves before the leases go
  }

  // While the read lease held, no page of the object could be freed, so no generation could
  // move: the lease is ended off the critical path. A read that outlived its lease (less a
  // margin for clock drift) asks Redis whether its pages were reused meanwhile.
  const bool lease_held = Clock::now() < leased_at + options.read_lease - options.read_lease / 10;
  if (!moved.is_ok() || lease_held) {
    if (batch) {
      batch->hand_back(*cell, ended);
    } else {
      release_later(*cell, {&ended, 1});
    }
    if (!moved.is_ok()) return moved.with_context(std::string(key));
  } else {
    if (batch) batch->hand_back(*cell, std::nullopt);
    auto c = borrow(*cell, deadline);
    if (!c.is_ok()) return c.status().with_context(std::string(key));
    MetadataClock mc(o.timings);
    KVSTASH_RETURN_IF_ERROR((*c)->end_get(reader, *lease).with_context(std::string(key)));
  }

  if (verify) {
    const sum::ObjectSum sum = hasher.digest();
    if (sum != lease->checksum) {
      KVSTASH_LOG_ERROR("get {}: checksum mismatch (record {}, bytes {})", key, sum::to_text(lease->checksum),
                        sum::to_text(sum));
      return Status::corrupt("store: object " + std::string(key) + " failed its checksum");
    }
  }
  ObjectInfo info;
  info.size = lease->size;
  info.object_layout = std::move(lease->layout);
  info.checksum = lease->checksum.value;
  info.checksum_segment = lease->checksum.segment;
  info.pages = lease->placement.extents.size();
  for (auto& n : lease->placement.nodes) info.nodes.push_back(std::move(n.id));
  info.version = lease->object_token;
  return info;
}

void Store::Impl::release_later(store::CellLink& cell, std::span<const metadata::Catalog::EndedRead> reads) {
  bool start = false;
  for (const auto& r : reads) start |= cell.read_releases.add(r);
  if (!start) return;
  releaser->submit([this, &cell] {
    cell.read_releases.drain([this, &cell](std::span<const metadata::Catalog::EndedRead> batch) {
      auto c = borrow(cell, deadline_after(options.redis_timeout * 2));
      auto ended = c.is_ok() ? (*c)->end_gets(batch) : Result<std::vector<Status>>(c.status());
      if (!ended.is_ok()) {
        KVSTASH_LOG_DEBUG("ending {} read leases failed, they will expire: {}", batch.size(),
                          ended.status().to_string());
      }
    });
  });
}

// ---- batches of read leases

ReadLeases::ReadLeases() = default;
ReadLeases::ReadLeases(ReadLeases&&) noexcept = default;
ReadLeases& ReadLeases::operator=(ReadLeases&&) noexcept = default;
ReadLeases::~ReadLeases() = default;

ReadLeases::State::~State() {
  std::lock_guard lock(mu);
  for (auto& [key, e] : entries) {
    if (!e.taken && e.lease.is_ok())
      ended.emplace_back(e.cell, metadata::Catalog::EndedRead{e.reader, e.lease->object_token, ""});
  }
  flush_locked();
}

std::optional<ReadLeases::State::Taken> ReadLeases::State::take(std::string_view key) {
  std::lock_guard lock(mu);
  auto it = entries.find(key);
  if (it == entries.end() || it->second.taken) return std::nullopt;
  it->second.taken = true;
  return Taken{it->second.lease, it->second.reader, it->second.cell, leased_at};
}

void ReadLeases::State::hand_back(store::CellLink& cell, std::optional<metadata::Catalog::EndedRead> read) {
  std::lock_guard lock(mu);
  if (read) ended.emplace_back(&cell, std::move(*read));
  if (open > 0) --open;
  if (open == 0) flush_locked();
}

void ReadLeases::State::flush_locked() {
  while (!ended.empty()) {
    store::CellLink* cell = ended.front().first;
    std::vector<metadata::Catalog::EndedRead> reads;
    std::erase_if(ended, [&](auto& e) {
      if (e.first != cell) return false;
      reads.push_back(std::move(e.second));
      return true;
    });
    impl->release_later(*cell, reads);
  }
}

Result<ReadLeases> Store::lease_reads(std::span<const std::string> keys, std::optional<Deadline> deadline,
                                      std::span<const KeepHint> keep) {
  const Deadline d = deadline.value_or(deadline_after(impl_->options.timeout));
  for (const auto& k : keys) KVSTASH_RETURN_IF_ERROR(metadata::validate_object_key(k));
  if (!keep.empty() && keep.size() != keys.size()) {
    return Status::invalid_argument("lease_reads: one keep hint per key, or none");
  }
  std::map<std::string_view, std::string> hint_of;  // key -> its keep hint's text
  for (std::size_t i = 0; i < keep.size(); ++i) hint_of.emplace(keys[i], metadata::keep_hint_text(keep[i]));
  auto state = std::make_shared<ReadLeases::State>();
  state->impl = impl_.get();
  state->leased_at = Clock::now();
  // Keys grouped by the one cell a get would look in; keys of an unsettled change stay out.
  std::map<store::CellLink*, std::vector<std::string>> by_cell;
  for (const auto& k : keys) {
    const auto cells = impl_->get_cells(k, d);
    if (cells.size() == 1 && !state->entries.contains(k)) {
      by_cell[cells.front()].push_back(k);
      state->entries[k].cell = cells.front();
    }
  }
  Status failed;
  std::size_t leased_cells = 0;
  for (auto& [cell, batch] : by_cell) {
    std::vector<std::string> readers, hints;
    for (std::size_t i = 0; i < batch.size(); ++i) readers.push_back(store::random_token());
    if (!keep.empty()) {
      for (const auto& k : batch) hints.push_back(hint_of[k]);
    }
    auto c = impl_->borrow(*cell, d);
    auto leased = c.is_ok() ? (*c)->begin_gets(batch, readers, impl_->options.read_lease, hints)
                            : Result<std::vector<Result<metadata::ReadLease>>>(c.status());
    std::lock_guard lock(state->mu);
    if (!leased.is_ok()) {
      // These keys lease for themselves; the other cells' leases serve their gets.
      for (const auto& k : batch) state->entries.erase(k);
      failed = leased.status();
      continue;
    }
    ++leased_cells;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      if ((*leased)[i].is_ok() && !(*leased)[i]->promoting_node.empty()) {
        // On an NVMe tier: the script queued its promotion; the get waits for it itself.
        state->entries.erase(batch[i]);
        continue;
      }
      auto& e = state->entries[batch[i]];
      e.lease = std::move((*leased)[i]);
      e.reader = std::move(readers[i]);
      state->open += e.lease.is_ok();
    }
  }
  if (leased_cells == 0 && !failed.is_ok()) return failed;
  ReadLeases out;
  out.state_ = std::move(state);
  return out;
}

}  // namespace kvstash
