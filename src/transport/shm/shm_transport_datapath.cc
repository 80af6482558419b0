// The shm datapath: post() validates and queues ops on per-lane copy threads; a copy thread
// checks that the peer is alive and the key not revoked, memcpys (a write that asks for its
// block digests computes them as it copies), checks the peer again and completes. No
// allocation once warm (tests/unit/memory/alloc_test.cc), no lock held while bytes move.
//
// Revocation is checked before every copy, not during it: an op that passed the check
// finishes its copy even if the target deregisters meanwhile. Ops that start after the
// target's LocalRegistration is gone complete with kPermissionDenied.
#include <poll.h>

#include <algorithm>
#include <cstring>

#include "common/checksum.h"
#include "common/log.h"
#include "transport/shm/shm_internal.h"

namespace kvstash::transport::shm {
namespace {

// The lane whose worker runs on this thread, so that abort() called from inside a sink's
// complete() does not wait for itself.
thread_local const void* t_current_lane = nullptr;

constexpr std::uint32_t kMaxLanes = 256;

}  // namespace

bool PeerConnection::gone() {
  if (!healthy.load(std::memory_order_relaxed)) return true;
  pollfd p{socket.get(), POLLRDHUP, 0};
  // POLLIN alone (a late response to a timed-out request) is not death; only hang-ups are.
  if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0) {
    if (healthy.exchange(false)) KVSTASH_LOG_INFO_LIMITED("shm: peer {} hung up", peer);
    return true;
  }
  return false;
}

Datapath::Datapath(std::uint32_t lanes, std::size_t inline_bytes) : inline_bytes_(inline_bytes) {
  lanes = std::clamp<std::uint32_t>(lanes, 1, kMaxLanes);
  lanes_.reserve(lanes);
  for (std::uint32_t i = 0; i < lanes; ++i) lanes_.push_back(std::make_unique<Lane>());
  for (auto& lane : lanes_) {
    Lane* l = lane.get();
    l->thread = std::thread([this, l] { run(*l); });
  }
}

Datapath::~Datapath() { stop(); }

void Datapath::stop() {
  std::lock_guard stop_lock(stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  for (auto& lane : lanes_) {
    std::lock_guard lock(lane->mu);
    lane->stopping = true;
    lane->work_cv.notify_all();
  }
  for (auto& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
  }
}

Result<const ShmRemoteKey*> Datapath::validate(const PeerConnection* conn, const Op& op,
                                               std::uint32_t lanes) {
  if (op.lane >= lanes) {
    return Status::invalid_argument("shm: lane " + std::to_string(op.lane) + " >= " + std::to_string(lanes));
  }
  if (op.length == 0) return static_cast<const ShmRemoteKey*>(nullptr);  // nothing to move
  if (op.local == nullptr) return Status::invalid_argument("shm: null local address");
  const auto* key = dynamic_cast<const ShmRemoteKey*>(op.remote_key);
  if (key == nullptr || key->region()->conn.get() != conn) {
    return Status::invalid_argument("shm: remote key was not imported through this endpoint");
  }
  // Defence in depth: the engine has checked the range, but a copy outside the mapping
  // would touch unrelated memory of this process.
  const RemoteRegion& r = *key->region();
  if (op.remote_addr < r.base || op.length > r.length || op.remote_addr - r.base > r.length - op.length) {
    return Status::invalid_argument("shm: remote range outside the remote key");
  }
  return key;
}

void Datapath::complete_here(const PeerConnection* conn, const Op& op, std::uint32_t lanes, bool copy) {
  auto key = validate(conn, op, lanes);
  if (!key.is_ok()) {
    op.sink->complete(op.tag, key.status());
  } else if (*key == nullptr) {
    op.sink->complete(op.tag, Status::ok());
  } else if (copy) {
    op.sink->complete(op.tag, execute(Job{op, (*key)->region()}));
  } else {
    op.sink->complete(op.tag, Status::unavailable("shm transport shut down"));
  }
}

void Datapath::post(const PeerConnection* conn, std::span<const Op> ops) {
  for (const Op& op : ops) {
    if (op.sink == nullptr) KVSTASH_LOG_ERROR("shm: op posted without a completion sink, dropped");
  }
  const std::uint32_t n = lanes();
  // Small ops are copied right here: waking a copy thread and being woken by it costs more
  // than the copy. Large ones (slices of a striped transfer) go to the lanes to run in
  // parallel.
  bool all_inline = true;
  for (const Op& op : ops) all_inline = all_inline && op.length <= inline_bytes_;
  if (all_inline) {
    bool stopping;
    {
      std::lock_guard lock(lanes_[0]->mu);  // stop() marks every lane
      stopping = lanes_[0]->stopping;
    }
    for (const Op& op : ops) {
      if (op.sink != nullptr) complete_here(conn, op, n, !stopping);
    }
    return;
  }
  for (std::uint32_t l = 0; l < n; ++l) {
    Lane& lane = *lanes_[l];
    bool stopping = false;
    bool leftovers = false;  // ops of this lane that must complete inline
    std::size_t queued = 0;
    {
      std::lock_guard lock(lane.mu);
      stopping = lane.stopping;
      for (const Op& op : ops) {
        if (op.lane != l) continue;
        auto key = validate(conn, op, n);
        if (!stopping && key.is_ok() && *key != nullptr && op.sink != nullptr) {
          lane.queue.push_back(Job{op, (*key)->region()});
          ++queued;
        } else {
          leftovers = true;
        }
      }
    }
    if (queued > 0) lane.work_cv.notify_one();
    if (!leftovers) continue;
    // Completions run outside the lock: a sink may post again from complete(). Queued ops
    // were valid and not stopping; everything else completes here without a copy.
    for (const Op& op : ops) {
      if (op.lane != l || op.sink == nullptr) continue;
      auto key = validate(conn, op, n);
      if (!key.is_ok() || *key == nullptr || stopping) complete_here(conn, op, n, false);
    }
  }
  // Ops naming a lane that does not exist belong to no loop above.
  for (const Op& op : ops) {
    if (op.lane < n) continue;
    if (op.sink == nullptr) continue;
    op.sink->complete(op.tag, validate(conn, op, n).status());
  }
}

Status Datapath::execute(const Job& job) {
  const Op& op = job.op;
  const RemoteRegion& r = *job.region;
  PeerConnection& conn = *r.conn;
  if (conn.gone()) return Status::unavailable("shm: peer " + conn.peer + " gone");
  if (load_slot(conn.slot(r.slot)) != r.key) {
    return Status::permission_denied("shm: remote key revoked");
  }
  if (r.leased) {
    const auto* key = static_cast<const ShmRemoteKey*>(op.remote_key);
    if (key->lease() == 0)
      return Status::permission_denied("shm: the region is reachable through leases only");
    if (key->revoked()) return Status::permission_denied("shm: the lease was revoked");
    if (key->fence() != 0 && key->fence() <= load_slot(conn.slot(kFenceSlot))) {
      return Status::permission_denied("shm: the lease was fenced by the region's owner");
    }
  }
  std::byte* remote = r.data + (op.remote_addr - r.base);
  if (op.op == TransferOp::kWrite && op.digests != nullptr) {
    sum::copy_and_digest(remote, op.local, op.length, op.digests);
  } else if (op.op == TransferOp::kWrite) {
    std::memcpy(remote, op.local, op.length);
  } else {
    std::memcpy(op.local, remote, op.length);
  }
  // A write into a peer that died meanwhile reached nobody; a read may have raced its
  // last writes. Either way the caller must not trust the op.
  if (conn.gone()) return Status::unavailable("shm: peer " + conn.peer + " gone");
  return Status::ok();
}

void Datapath::run(Lane& lane) {
  t_current_lane = &lane;
  std::unique_lock lock(lane.mu);
  for (;;) {
    lane.work_cv.wait(lock, [&] { return lane.stopping || !lane.queue.empty(); });
    if (lane.stopping) break;
    Job job = lane.queue.pop_front();
    lane.busy_sink = job.op.sink;
    lock.unlock();
    Status status = execute(job);
    job.op.sink->complete(job.op.tag, std::move(status));
    job.region.reset();  // may unmap; better here than under the lock
    lock.lock();
    // Only now may abort() return for this sink: its complete() has run.
    lane.busy_sink = nullptr;
    lane.idle_cv.notify_all();
  }
  std::vector<Job> rest;
  lane.queue.take_if([](const Job&) { return true; }, rest);
  lock.unlock();
  for (Job& job : rest) {
    job.op.sink->complete(job.op.tag, Status::unavailable("shm transport shut down"));
  }
}

void Datapath::abort(CompletionSink* sink, const Status& reason) {
  for (auto& lane_ptr : lanes_) {
    Lane& lane = *lane_ptr;
    std::vector<Job> taken;
    {
      std::unique_lock lock(lane.mu);
      lane.queue.take_if([&](const Job& job) { return job.op.sink == sink; }, taken);
      // The op being copied cannot be stopped halfway; wait until it has completed. Not when
      // abort() runs inside that very op's complete() on this lane: it would wait for itself.
      if (t_current_lane != &lane) {
        lane.idle_cv.wait(lock, [&] { return lane.busy_sink != sink; });
      }
    }
    for (Job& job : taken) sink->complete(job.op.tag, reason);
  }
}

// ---- ShmEndpoint's datapath half ---------------------------------------------------------

void ShmEndpoint::post(std::span<const Op> ops) { datapath_->post(conn_.get(), ops); }

void ShmEndpoint::abort(CompletionSink* sink, const Status& reason) { datapath_->abort(sink, reason); }

bool ShmEndpoint::healthy() const { return !conn_->gone(); }

}  // namespace kvstash::transport::shm
