// The verbs datapath: ops become chains of RDMA WRITE/READ work requests (the last of each op
// signaled, so every op gets exactly one completion), posted while the send queue has room
// and queued otherwise; one thread per connection reaps completions in bulk, sleeping on the
// completion channel when idle, and watches the setup socket for a dead peer.
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "common/log.h"
#include "transport/verbs/verbs_internal.h"
#include "transport/verbs/verbs_wire.h"

namespace kvstash::transport::verbs {
namespace {

constexpr int kReapBatch = 32;

std::uint64_t wr_id(std::uint32_t slot, std::uint32_t generation) {
  return (static_cast<std::uint64_t>(generation) << 32) | slot;
}

}  // namespace

Status from_wc(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return {};
    case IBV_WC_REM_ACCESS_ERR:
      return Status::permission_denied(
          "verbs: remote access error: the peer's key does not grant this range (revoked, deregistered or "
          "wrong)");
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return Status::unavailable("verbs: peer unreachable (transport retries exhausted)");
    case IBV_WC_WR_FLUSH_ERR:
      return Status::unavailable("verbs: the connection broke before this request ran");
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_MW_BIND_ERR:
      return Status::invalid_argument(std::string("verbs: local memory not usable: ") +
                                      ibv_wc_status_str(status));
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
      return Status::io_error(std::string("verbs: the peer refused the request: ") +
                              ibv_wc_status_str(status));
    default: return Status::io_error(std::string("verbs: ") + ibv_wc_status_str(status));
  }
}

VerbsEndpoint::VerbsEndpoint(std::shared_ptr<DeviceState> dev, std::uint64_t peer_guid,
                             ibv_comp_channel* channel, Cq cq, Qp qp, UniqueFd control,
                             const VerbsOptions& options)
    : dev_(std::move(dev)),
      peer_guid_(peer_guid),
      channel_(channel),
      cq_(std::move(cq)),
      qp_(std::move(qp)),
      control_(std::move(control)),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)),
      depth_(std::max<std::uint32_t>(1, options.send_queue_depth)),
      builder_({.max_wrs = std::max<std::uint32_t>(1, options.send_queue_depth),
                .max_sge = static_cast<std::uint32_t>(std::max(1, std::min(dev_->device.max_sge, 16))),
                .max_msg = dev_->device.max_msg_sz ? dev_->device.max_msg_sz : (1ull << 30)}) {
  slots_.resize(depth_);
  for (std::uint32_t i = depth_; i-- > 0;) free_slots_.push_back(i);
  ibv_req_notify_cq(cq_.get(), 0);
  poller_ = std::thread([this] { poll_loop(); });
}

VerbsEndpoint::~VerbsEndpoint() {
  {
    std::lock_guard lock(mu_);
    if (broken_.is_ok()) fail(Status::cancelled("verbs: connection closed"));
  }
  // Every posted request flushes; wait (bounded) for the poller to complete them.
  {
    std::unique_lock lock(mu_);
    idle_.wait_for(lock, std::chrono::seconds(5), [&] { return in_flight_wrs_ == 0 && pending_.empty(); });
    stopping_ = true;
  }
  std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  if (poller_.joinable()) poller_.join();
  qp_.reset();
  cq_.reset();
  if (channel_ != nullptr) ibv_destroy_comp_channel(channel_);
}

bool VerbsEndpoint::healthy() const {
  std::lock_guard lock(mu_);
  return broken_.is_ok();
}

Result<std::unique_ptr<RemoteKey>> VerbsEndpoint::import_key(std::uint64_t base, std::uint64_t length,
                                                             std::string_view packed, Deadline) {
  KVSTASH_ASSIGN_OR_RETURN(auto parts, decode_key(packed));
  for (const KeyPart& p : parts) {
    // The peer registered the region on each of its devices: this lane reaches one of them.
    if (p.node_guid != peer_guid_) continue;
    auto key = std::make_unique<ImportedKey>();
    key->base = base;
    key->length = length;
    key->rkey = p.rkey;
    key->leases_only = p.leases_only;
    return std::unique_ptr<RemoteKey>(std::move(key));
  }
  return Status::unsupported(
      "verbs: the peer registered this region on none of the devices we reach it by (GPU memory is "
      "registered only on the NICs nearest its GPU)");
}

bool VerbsEndpoint::try_post(const Op& op, std::vector<Done>& done) {
  const auto* reg = dynamic_cast<const Registration*>(op.local_reg);
  const auto* key = static_cast<const ImportedKey*>(op.remote_key);
  if (reg == nullptr || key == nullptr) {
    done.push_back({op.sink, op.tag,
                    Status::invalid_argument(
                        "verbs: an op needs memory registered with the engine and an imported key")});
    return true;
  }
  const std::optional<std::uint32_t> rkey = key->rkey_for(op.remote_addr, op.length);
  if (!rkey) {
    done.push_back(
        {op.sink, op.tag,
         Status::permission_denied(key->leases_only && key->windows.empty()
                                       ? "verbs: the peer lets this region be reached only through leases"
                                       : "verbs: the range lies outside the lease's windows")});
    return true;
  }
  const std::optional<std::uint32_t> lkey = reg->lkey(dev_->device.node_guid);
  if (!lkey) {
    // GPU memory is registered only on the NICs nearest its GPU; the op came to this lane because
    // no lane on those is up (or the peer's key reaches it only here). Nothing is posted.
    done.push_back(
        {op.sink, op.tag,
         Status::unavailable("verbs: the local memory is not registered on " + dev_->device.name +
                             ": GPU memory is registered only on the NICs nearest its GPU, and no "
                             "lane of this connection on them is up or reaches the peer's memory")});
    return true;
  }
  if (free_slots_.empty()) return false;
  builder_.reset();
  Piece piece{reinterpret_cast<std::uint64_t>(op.local), *lkey, op.remote_addr, *rkey, op.length};
  const ibv_wr_opcode opcode = op.op == TransferOp::kWrite ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
  if (!builder_.add(opcode, piece, 0)) {
    if (in_flight_wrs_ > 0) return false;  // retried as completions free the queue
    done.push_back(
        {op.sink, op.tag,
         Status::invalid_argument("verbs: an op needs more work requests than the send queue holds")});
    return true;
  }
  const std::uint32_t n = builder_.size();
  if (in_flight_wrs_ + n > depth_ && in_flight_wrs_ > 0) return false;
  const std::uint32_t s = free_slots_.back();
  Slot& slot = slots_[s];
  ibv_send_wr* head = builder_.chain(n);  // only the op's last request is signaled
  for (ibv_send_wr* w = head; w != nullptr; w = w->next) w->wr_id = wr_id(s, slot.generation);
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(qp_.get(), head, &bad); rc != 0) {
    done.push_back({op.sink, op.tag, Status::from_errno("verbs: post", rc)});
    return true;
  }
  free_slots_.pop_back();
  Counters& c = *dev_->counters;
  Counters::add(c.ops_posted);
  Counters::add(op.op == TransferOp::kWrite ? c.bytes_written : c.bytes_read, op.length);
  slot.sink = op.sink;
  slot.tag = op.tag;
  slot.wrs = n;
  slot.busy = true;
  in_flight_wrs_ += n;
  return true;
}

void VerbsEndpoint::post_pending(std::vector<Done>& done) {
  while (!pending_.empty() && broken_.is_ok()) {
    if (!try_post(pending_.front(), done)) return;
    pending_.pop_front();
  }
}

void VerbsEndpoint::post(std::span<const Op> ops) {
  std::vector<Done> done;
  {
    std::lock_guard lock(mu_);
    for (const Op& op : ops) {
      if (op.length == 0) {
        done.push_back({op.sink, op.tag, Status::ok()});
      } else if (!broken_.is_ok()) {
        done.push_back({op.sink, op.tag, broken_});
      } else if (!pending_.empty() || !try_post(op, done)) {
        pending_.push_back(op);  // the send queue is full: the poller posts it as room frees
      }
    }
  }
  for (auto& d : done) d.sink->complete(d.tag, std::move(d.status));
}

void VerbsEndpoint::fail(const Status& why) {
  if (!broken_.is_ok()) return;
  broken_ = why;
  Counters::add(dev_->counters->connections_broken);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(qp_.get(), &a, IBV_QP_STATE);  // every posted request completes (flushed)
}

void VerbsEndpoint::abort(CompletionSink* sink, const Status& reason) {
  std::vector<Done> done;
  std::unique_lock lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->sink == sink) {
      done.push_back({sink, it->tag, reason});
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  bool posted =
      std::any_of(slots_.begin(), slots_.end(), [&](const Slot& s) { return s.busy && s.sink == sink; });
  if (posted) {
    // RDMA cannot recall one posted request: the connection goes down so that the memory of
    // these ops can no longer be touched, and the engine reconnects.
    aborted_.emplace_back(sink, reason);
    fail(Status::unavailable("verbs: connection torn down to cancel an op"));
  }
  // The poller may hold completions of this sink it reaped but has not delivered yet (their
  // slots are free already): the sink may be destroyed once this returns, so those must be
  // delivered first. Found by ASan in the Soft-RoCE history run (a put stream dropped while
  // its writes completed).
  idle_.wait(lock, [&] {
    return undelivered_ == 0 && std::none_of(slots_.begin(), slots_.end(),
                                             [&](const Slot& s) { return s.busy && s.sink == sink; });
  });
  if (posted) std::erase_if(aborted_, [&](const auto& a) { return a.first == sink; });
  lock.unlock();
  for (auto& d : done) d.sink->complete(d.tag, std::move(d.status));
}

void VerbsEndpoint::reap(std::vector<Done>& done) {
  ibv_wc wcs[kReapBatch];
  for (;;) {
    int n = ibv_poll_cq(cq_.get(), kReapBatch, wcs);
    if (n <= 0) return;
    std::lock_guard lock(mu_);
    for (int i = 0; i < n; ++i) {
      const auto s = static_cast<std::uint32_t>(wcs[i].wr_id & 0xffffffff);
      const auto gen = static_cast<std::uint32_t>(wcs[i].wr_id >> 32);
      if (s >= slots_.size()) continue;
      Slot& slot = slots_[s];
      // A failed op's later requests flush too: only the first completion counts.
      if (!slot.busy || slot.generation != gen) continue;
      Status st = from_wc(wcs[i].status);
      if (wcs[i].status == IBV_WC_REM_ACCESS_ERR) Counters::add(dev_->counters->remote_access_errors);
      if (wcs[i].status == IBV_WC_RETRY_EXC_ERR || wcs[i].status == IBV_WC_RNR_RETRY_EXC_ERR) {
        Counters::add(dev_->counters->retries_exhausted);
      }
      if (!st.is_ok()) {
        fail(st);
        for (const auto& [sink, why] : aborted_) {
          if (sink == slot.sink) st = why;
        }
      }
      done.push_back({slot.sink, slot.tag, std::move(st)});
      slot.busy = false;
      ++slot.generation;
      in_flight_wrs_ -= slot.wrs;
      free_slots_.push_back(s);
    }
    post_pending(done);
    if (!broken_.is_ok()) {
      // Nothing new will post: fail what still waits.
      for (const Op& op : pending_) done.push_back({op.sink, op.tag, broken_});
      pending_.clear();
    }
    undelivered_ = done.size();
  }
}

void VerbsEndpoint::deliver(std::vector<Done>& done) {
  for (auto& d : done) d.sink->complete(d.tag, std::move(d.status));
  std::lock_guard lock(mu_);
  undelivered_ = 0;
  done.clear();
  idle_.notify_all();
}

void VerbsEndpoint::poll_loop() {
  std::vector<Done> done;
  for (;;) {
    reap(done);
    deliver(done);
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
    }
    // Re-arm, then look again: a completion may have landed between the reap and the arm.
    ibv_req_notify_cq(cq_.get(), 0);
    reap(done);
    if (!done.empty()) continue;
    // The setup socket is watched for its hang-up only: lease answers on it are read by the
    // thread that asked.
    bool watch_control = false;
    {
      std::lock_guard lock(mu_);
      watch_control = !peer_closed_;
    }
    pollfd fds[3] = {{channel_->fd, POLLIN, 0},
                     {wake_.get(), POLLIN, 0},
                     {watch_control ? control_.get() : -1, POLLRDHUP, 0}};
    if (::poll(fds, 3, 1000) < 0 && errno != EINTR) continue;
    if (fds[0].revents & POLLIN) {
      ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      if (ibv_get_cq_event(channel_, &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
    }
    if (fds[2].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
      // The peer closed its end of the setup connection: it is gone (or dropped us).
      std::lock_guard lock(mu_);
      fail(Status::unavailable("verbs: the peer closed the connection"));
      peer_closed_ = true;
    }
  }
}

}  // namespace kvstash::transport::verbs
