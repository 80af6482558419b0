// Leases: revocable keys over exactly the ranges a client was granted, for a bounded time.
//
// A region registered Access::kLeased (a memory node's pool) gets an MR that allows binding
// memory windows and nothing remote, so its rkey grants no access by itself. A client asks
// over the setup connection for windows over some ranges of it for a time; the target binds
// one type-2B window per range to that connection's queue pair (no other queue pair can use
// its rkey) and answers with their rkeys. The windows are revoked (deallocated) when the
// client releases the lease, when its time is up by the target's clock, when the connection
// closes, or when the region is deregistered. A READ or WRITE through a revoked window fails
// at the target's NIC with a remote access error: a reader that outlived its lease gets an
// error, never the bytes of whatever object reuses the pages.
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/log.h"
#include "transport/verbs/verbs_internal.h"

namespace kvstash::transport::verbs {
namespace {

static_assert(kMaxLeaseRanges >= kvstash::kMaxLeaseRanges, "a lease the engine allows must fit one message");

// A lease longer than this is cut to it: a client cannot pin windows for good.
constexpr std::chrono::minutes kMaxLeaseTtl{10};
// Windows one connection may hold at once: bounds what one client can take of max_mw.
constexpr std::size_t kMaxWindowsPerConnection = 4096;
constexpr auto kReleaseTimeout = std::chrono::milliseconds(200);
// A lease message must arrive whole, and its answer leave, within this.
constexpr auto kMessageTimeout = std::chrono::seconds(2);

// Waits for the completion with `wr_id` on the bind CQ (binds take microseconds).
Status wait_bind(ibv_cq* cq, std::uint64_t wr_id, Deadline deadline) {
  for (int spins = 0;; ++spins) {
    ibv_wc wc[8];
    int n = ibv_poll_cq(cq, 8, wc);
    if (n < 0) return Status::io_error("verbs: poll the bind CQ");
    for (int i = 0; i < n; ++i) {
      // Anything else is the flush of an earlier connection's request; only ours counts.
      if (wc[i].wr_id != wr_id) continue;
      return from_wc(wc[i].status).with_context("verbs: bind a memory window");
    }
    if (Clock::now() >= deadline) return Status::timeout("verbs: a memory-window bind did not complete");
    if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace

// ---- the target ------------------------------------------------------------------------------

Result<std::vector<std::uint32_t>> Target::bind(Accepted& a, const LeaseRequest& q, Deadline deadline) {
  auto region = leasable.find({a.dev, q.region_rkey});
  if (region == leasable.end()) {
    return Status::permission_denied("verbs: no region here is leased under that key");
  }
  const ibv_mr* mr = region->second;
  const auto base = reinterpret_cast<std::uint64_t>(mr->addr);
  for (const LeaseRange& r : q.ranges) {
    if (r.addr < base || r.addr - base > mr->length || r.length > mr->length - (r.addr - base)) {
      return Status::permission_denied("verbs: a leased range lies outside the region");
    }
  }
  if (a.windows + q.ranges.size() > kMaxWindowsPerConnection) {
    return Status::no_space("verbs: this connection holds too many memory windows (release leases)");
  }
  if (a.leases.count(q.id) != 0) return Status::invalid_argument("verbs: lease id reused");

  Lease lease;
  lease.mr = mr;
  lease.until =
      Clock::now() + std::min<std::chrono::milliseconds>(std::chrono::milliseconds(q.ttl_ms), kMaxLeaseTtl);
  std::vector<std::uint32_t> rkeys;
  rkeys.reserve(q.ranges.size());
  std::vector<ibv_send_wr> wrs(q.ranges.size());
  for (std::size_t i = 0; i < q.ranges.size(); ++i) {
    Mw mw(ibv_alloc_mw(devs[a.dev]->pd.get(), IBV_MW_TYPE_2));
    if (!mw) {
      return Status::no_space(std::string("verbs: cannot allocate a memory window: ") + std::strerror(errno));
    }
    ibv_send_wr& w = wrs[i];
    w.opcode = IBV_WR_BIND_MW;
    w.bind_mw.mw = mw.get();
    w.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
    w.bind_mw.bind_info.mr = const_cast<ibv_mr*>(mr);
    w.bind_mw.bind_info.addr = q.ranges[i].addr;
    w.bind_mw.bind_info.length = q.ranges[i].length;
    w.bind_mw.bind_info.mw_access_flags = q.write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ;
    rkeys.push_back(w.bind_mw.rkey);
    lease.windows.push_back(std::move(mw));
  }
  // Posted in chains the send queue holds, the last of each signaled and waited for: a
  // window is usable once its bind completed, and only then does its rkey leave this side.
  for (std::size_t at = 0; at < wrs.size();) {
    const std::size_t n = std::min<std::size_t>(wrs.size() - at, a.max_send_wr);
    for (std::size_t i = at; i < at + n; ++i) {
      wrs[i].next = i + 1 < at + n ? &wrs[i + 1] : nullptr;
      wrs[i].send_flags = i + 1 < at + n ? 0 : IBV_SEND_SIGNALED;
      wrs[i].wr_id = next_wr_id;
    }
    const std::uint64_t id = next_wr_id++;
    ibv_send_wr* bad = nullptr;
    Status bound = Status::ok();
    if (int rc = ibv_post_send(a.qp.get(), &wrs[at], &bad); rc != 0) {
      bound = Status::from_errno("verbs: post memory-window binds", rc);
    } else {
      bound = wait_bind(cqs[a.dev].get(), id, deadline);
    }
    if (!bound.is_ok()) {
      a.broken = true;  // the QP is in error, or has binds we no longer wait for
      return bound;
    }
    at += n;
  }
  a.windows += lease.windows.size();
  Counters::add(devs[0]->counters->windows_bound, lease.windows.size());
  a.leases.emplace(q.id, std::move(lease));
  return rkeys;
}

Target::LeaseMap::iterator Target::revoke(Accepted& a, LeaseMap::iterator it) {
  a.windows -= it->second.windows.size();
  return a.leases.erase(it);  // deallocating a bound window revokes it
}

void Target::release(Accepted& a, std::uint64_t lease_id) {
  auto it = a.leases.find(lease_id);
  if (it == a.leases.end()) return;
  revoke(a, it);
  Counters::add(devs[0]->counters->leases_released);
}

bool Target::serve(Accepted& a) {
  const Deadline deadline = deadline_after(kMessageTimeout);
  auto frame = read_frame(a.socket.get(), deadline);
  if (!frame.is_ok()) return false;  // the peer closed (or stalled mid-message)
  auto msg = decode_lease_message(*frame);
  if (!msg.is_ok()) {
    KVSTASH_LOG_WARN("verbs: dropped a connection that sent a malformed lease message: {}",
                     msg.status().to_string());
    return false;
  }
  if (const auto* rel = std::get_if<LeaseRelease>(&*msg)) {
    release(a, rel->id);
    return true;
  }
  const auto& q = std::get<LeaseRequest>(*msg);
  auto rkeys = bind(a, q, deadline);
  LeaseReply reply;
  reply.id = q.id;
  if (rkeys.is_ok()) {
    reply.rkeys = std::move(rkeys).value();
    Counters::add(devs[0]->counters->leases_granted);
  } else {
    reply.status = rkeys.status();
    Counters::add(devs[0]->counters->leases_refused);
  }
  return write_frame(a.socket.get(), encode_lease_reply(reply), deadline).is_ok() && !a.broken;
}

std::optional<Clock::time_point> Target::expire(Clock::time_point now) {
  std::optional<Clock::time_point> next;
  for (auto& a : accepted) {
    for (auto it = a.leases.begin(); it != a.leases.end();) {
      if (it->second.until <= now) {
        it = revoke(a, it);
        Counters::add(devs[0]->counters->leases_expired);
        continue;
      }
      if (!next || it->second.until < *next) next = it->second.until;
      ++it;
    }
  }
  return next;
}

void Target::forget(const ibv_mr* mr) {
  std::lock_guard lock(mu);
  std::erase_if(leasable, [&](const auto& e) { return e.second == mr; });
  for (auto& a : accepted) {
    for (auto it = a.leases.begin(); it != a.leases.end();) {
      if (it->second.mr == mr) {
        it = revoke(a, it);
      } else {
        ++it;
      }
    }
  }
}

// ---- registrations ---------------------------------------------------------------------------

Registration::Registration(std::vector<Part> parts, bool remote, std::shared_ptr<Target> target)
    : parts_(std::move(parts)), remote_(remote), target_(std::move(target)) {
  if (!target_) return;
  std::lock_guard lock(target_->mu);
  for (std::size_t i = 0; i < parts_.size(); ++i)
    target_->leasable[{i, parts_[i].mr->rkey}] = parts_[i].mr.get();
}

Registration::~Registration() {
  // Windows bound over an MR must go before it can be deregistered.
  if (target_) {
    for (const Part& p : parts_) target_->forget(p.mr.get());
  }
}

std::string Registration::packed_key() const {
  if (!remote_) return {};
  std::vector<KeyPart> parts;
  for (const Part& p : parts_) parts.push_back({p.guid, p.mr->rkey, target_ != nullptr});
  return encode_key(parts);
}

// ---- the client ------------------------------------------------------------------------------

ImportedKey::~ImportedKey() {
  if (lease_id == 0) return;
  if (auto ep = owner.lock()) ep->release(lease_id);
}

std::optional<std::uint32_t> ImportedKey::rkey_for(std::uint64_t addr, std::uint64_t length) const {
  if (windows.empty()) {
    if (leases_only) return std::nullopt;
    return rkey;
  }
  auto it = std::upper_bound(windows.begin(), windows.end(), addr,
                             [](std::uint64_t a, const Window& w) { return a < w.addr; });
  if (it == windows.begin()) return std::nullopt;
  --it;
  if (addr - it->addr > it->length || length > it->length - (addr - it->addr)) return std::nullopt;
  return it->rkey;
}

Result<std::unique_ptr<RemoteKey>> VerbsEndpoint::lease_key(const RemoteKey& region,
                                                            std::span<const RemoteRange> ranges,
                                                            TransferOp op, std::chrono::milliseconds ttl,
                                                            Deadline deadline) {
  const auto& rk = static_cast<const ImportedKey&>(region);
  if (!rk.leases_only) return Status::unsupported("verbs: the region was not registered for leases");
  if (ranges.empty() || ranges.size() > kMaxLeaseRanges) {
    return Status::invalid_argument("verbs: a lease carries 1 to " + std::to_string(kMaxLeaseRanges) +
                                    " ranges");
  }
  {
    std::lock_guard lock(mu_);
    if (!broken_.is_ok()) return broken_;
  }
  LeaseRequest q;
  q.region_rkey = rk.rkey;
  q.write = op == TransferOp::kWrite;
  q.ttl_ms = static_cast<std::uint32_t>(std::clamp<std::int64_t>(
      ttl.count(), 1, std::chrono::duration_cast<std::chrono::milliseconds>(kMaxLeaseTtl).count()));
  for (const RemoteRange& r : ranges) q.ranges.push_back({r.addr, r.length});

  Result<LeaseReply> reply = Status::internal("unset");
  {
    std::lock_guard lock(control_mu_);
    q.id = next_lease_++;
    Status sent = write_frame(control_.get(), encode_lease_request(q), deadline);
    auto frame = sent.is_ok() ? read_frame(control_.get(), deadline) : Result<std::string>(sent);
    reply = frame.is_ok() ? decode_lease_reply(*frame) : Result<LeaseReply>(frame.status());
    if (reply.is_ok() &&
        (reply->id != q.id || (reply->status.is_ok() && reply->rkeys.size() != q.ranges.size()))) {
      reply = Status::corrupt("verbs: the peer answered another lease request than ours");
    }
  }
  if (!reply.is_ok()) {
    // The setup stream is out of step now (a half-read answer): this connection is done.
    std::lock_guard lock(mu_);
    fail(Status::unavailable("verbs: the lease exchange broke: " + reply.status().to_string()));
    return reply.status().with_context("verbs: lease");
  }
  if (!reply->status.is_ok()) return reply->status;

  auto key = std::make_unique<ImportedKey>();
  key->base = rk.base;
  key->length = rk.length;
  key->leases_only = true;
  key->lease_id = q.id;
  key->owner = weak_from_this();
  for (std::size_t i = 0; i < q.ranges.size(); ++i) {
    key->windows.push_back({q.ranges[i].addr, q.ranges[i].length, reply->rkeys[i]});
  }
  std::sort(key->windows.begin(), key->windows.end(),
            [](const auto& a, const auto& b) { return a.addr < b.addr; });
  return std::unique_ptr<RemoteKey>(std::move(key));
}

void VerbsEndpoint::release(std::uint64_t lease_id) {
  {
    std::lock_guard lock(mu_);
    if (!broken_.is_ok()) return;  // the connection's windows went with it
  }
  std::lock_guard lock(control_mu_);
  Status s = write_frame(control_.get(), encode_lease_release({lease_id}), deadline_after(kReleaseTimeout));
  if (!s.is_ok()) {
    std::lock_guard fail_lock(mu_);
    fail(Status::unavailable("verbs: could not release a lease: " + s.to_string()));
  }
}

}  // namespace kvstash::transport::verbs
