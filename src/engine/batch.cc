// Batches: per-entry completion counting, deadlines and cancellation.
#include "common/system.h"
#include "engine/engine_internal.h"

namespace kvstash {

Batch::State::State(std::size_t entries, Deadline d)
    : deadline(d),
      statuses(entries),
      parts_left(std::make_unique<std::atomic<std::uint32_t>[]>(entries)),
      parts_capacity(entries),
      entries_left(entries) {
  finished.store(entries == 0, std::memory_order_relaxed);
}

void Batch::State::reset(std::size_t entries, Deadline d) {
  deadline = d;
  statuses.assign(entries, Status::ok());
  if (entries > parts_capacity) {
    parts_left = std::make_unique<std::atomic<std::uint32_t>[]>(entries);
    parts_capacity = entries;
  }
  std::lock_guard lock(mu);
  entries_left = entries;
  finished.store(entries == 0, std::memory_order_relaxed);
}

void Batch::State::release() {
  endpoint.reset();
  keys.clear();
}

void Batch::State::complete(std::uint32_t tag, Status status) {
  std::lock_guard lock(mu);
  // The first failing slice decides the entry's status.
  if (!status.is_ok() && statuses[tag].is_ok()) statuses[tag] = std::move(status);
  if (parts_left[tag].fetch_sub(1, std::memory_order_acq_rel) == 1 && --entries_left == 0) {
    finished.store(true, std::memory_order_release);
    cv.notify_all();
  }
}

void Batch::State::abort(const Status& reason) {
  {
    std::lock_guard lock(mu);
    if (done_locked()) return;
  }
  endpoint->abort(this, reason);
  // The transport promised that every op has completed. Should one have been lost anyway,
  // its entry must not look successful: it ends with the abort's reason.
  std::lock_guard lock(mu);
  for (std::size_t i = 0; i < statuses.size() && entries_left > 0; ++i) {
    if (parts_left[i].exchange(0, std::memory_order_acq_rel) != 0) {
      if (statuses[i].is_ok()) statuses[i] = reason;
      --entries_left;
    }
  }
  finished.store(entries_left == 0, std::memory_order_release);
  cv.notify_all();
}

Batch::Batch() = default;
Batch::Batch(Batch&&) noexcept = default;
Batch& Batch::operator=(Batch&& other) noexcept {
  if (this != &other) {
    if (state_) {
      cancel();
      state_->release();
    }
    state_ = std::move(other.state_);
  }
  return *this;
}
Batch::~Batch() {
  if (!state_) return;
  cancel();  // returns once no op can complete any more
  state_->release();
}

bool Batch::poll() {
  if (!state_) return true;
  {
    std::lock_guard lock(state_->mu);
    if (state_->done_locked()) return true;
  }
  if (Clock::now() < state_->deadline) return false;
  state_->abort(Status::timeout("batch deadline passed"));
  return true;
}

Status Batch::wait() {
  if (!state_) return Status::invalid_argument("wait on an empty batch handle");
  if (state_->busy_poll.count() > 0) {
    // Latency mode: the completing thread finds this one running, not asleep.
    const auto until = std::min(state_->deadline, Clock::now() + state_->busy_poll);
    while (!state_->finished.load(std::memory_order_acquire) && Clock::now() < until) sys::cpu_relax();
  }
  bool done;
  {
    std::unique_lock lock(state_->mu);
    done = state_->cv.wait_until(lock, state_->deadline, [&] { return state_->done_locked(); });
  }
  if (!done) state_->abort(Status::timeout("batch deadline passed"));
  for (const Status& s : state_->statuses) {
    if (!s.is_ok()) return s;
  }
  return {};
}

void Batch::cancel() {
  if (state_) state_->abort(Status::cancelled("batch cancelled"));
}

std::span<const Status> Batch::statuses() const {
  if (!state_) return {};
  return state_->statuses;
}

}  // namespace kvstash
