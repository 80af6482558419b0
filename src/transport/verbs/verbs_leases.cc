// Leases: revocable keys over exactly the ranges a client was granted, for a bounded time.
//
// A region registered Access::kLeased (a memory node's pool) gets an MR that allows binding
// memory windows and nothing remote, so its rkey grants no access by itself. A client asks
// over the setup connection for windows over some ranges of it for a time; the target binds
// one type-2B window per range to that connection's queue pair (no other queue pair can use
// its rkey) and answers with their rkeys. The windows are revoked (deallocated) when the
// client releases the lease, when its time is up by the target's clock, when the connection
// closes, when the region is deregistered, when the owner fences past the lease's tag
// (Transport::fence), or when the client revokes the lease id (Endpoint::revoke: on every
// connection, confirmed). A READ or WRITE through a revoked window fails at the target's NIC
// with a remote access error: a reader that outlived its lease gets an error, never the bytes
// of whatever object reuses the pages.
//
// A lease id is the client's, the same on every connection (lane, reconnect) it uses the
// lease through; the target refuses a request under an id it saw revoked, or under a fence
// tag it has fenced already (kStale), so a late request cannot bring a lease back.
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/log.h"
#include "common/ranges.h"
#include "transport/verbs/verbs_internal.h"

namespace kvstash::transport::verbs {
namespace {

static_assert(kMaxLeaseRanges >= kvstash::kMaxLeaseRanges, "a lease the engine allows must fit one message");

// A lease longer than this is cut to it: a client cannot pin windows for good.
constexpr std::chrono::minutes kMaxLeaseTtl{10};
// Windows one connection may hold at once: bounds what one client can take of max_mw.
constexpr std::size_t kMaxWindowsPerConnection = 4096;
constexpr auto kReleaseTimeout = std::chrono::milliseconds(200);
constexpr std::string_view kLeaseExchange = "verbs lease exchange";

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

void RevokedLeases::add(std::uint64_t id, std::uint64_t fence) {
  if (!tags_.emplace(id, fence).second) return;
  order_.push_back(id);
  while (tags_.size() > kMaxRevokedLeases) {
    tags_.erase(order_.front());  // a no-op for an id a fence forgot already
    order_.pop_front();
  }
}

void RevokedLeases::fence(std::uint64_t through) {
  const std::size_t before = tags_.size();
  std::erase_if(tags_, [&](const auto& e) { return e.second != 0 && e.second <= through; });
  if (tags_.size() != before) std::erase_if(order_, [&](std::uint64_t id) { return tags_.count(id) == 0; });
}

Result<std::vector<std::uint32_t>> Target::bind(Accepted& a, const LeaseRequest& q, Deadline deadline) {
  if (q.fence != 0 && q.fence <= fenced_through) {
    return Status::stale("verbs: lease fence tag " + std::to_string(q.fence) +
                         " is fenced already (the owner " + "fenced through " +
                         std::to_string(fenced_through) + ")");
  }
  if (revoked.contains(q.id))
    return Status::stale("verbs: the lease was revoked (its id cannot be leased again)");
  auto region = leasable.find({a.dev, q.region_rkey});
  if (region == leasable.end()) {
    return Status::permission_denied("verbs: no region here is leased under that key");
  }
  const ibv_mr* mr = region->second;
  const auto base = reinterpret_cast<std::uint64_t>(mr->addr);
  for (const LeaseRange& r : q.ranges) {
    if (r.addr < base || r.addr - base > mr->length || r.length > mr->length - (r.addr - base)) {
      return Status::permission_denied(
          fmt::format("verbs: a leased range [{:#x}, +{}) lies outside the region "
                      "[{:#x}, +{})",
                      r.addr, r.length, base, mr->length));
    }
  }
  std::uint64_t fence = q.fence;
  if (grants) {
    // Windows only over what the owner granted, for its op, under its deadline as the tag.
    auto g = grants->check(q.grant);
    if (!g.is_ok()) return g.status().with_context("verbs: the lease's grant");
    if ((g->op == TransferOp::kWrite) != q.write) {
      return Status::permission_denied("verbs: the lease asks for another op than its grant allows");
    }
    if (g->fence <= fenced_through) {
      return Status::stale("verbs: the lease's grant ended (its deadline " + std::to_string(g->fence) +
                           " is fenced already)");
    }
    for (const LeaseRange& r : q.ranges) {
      if (!rangeset::covers(g->ranges, r.addr, r.length)) {
        return Status::permission_denied(fmt::format(
            "verbs: a leased range [{:#x}, +{}) lies outside what its grant allows", r.addr, r.length));
      }
    }
    fence = g->fence;
  }
  if (a.windows + q.ranges.size() > kMaxWindowsPerConnection) {
    return Status::no_space("verbs: this connection holds too many memory windows (release leases)");
  }
  if (a.leases.count(q.id) != 0) return Status::invalid_argument("verbs: lease id reused");

  Lease lease;
  lease.mr = mr;
  lease.fence = fence;
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
  Counters::add(counters().windows_bound, lease.windows.size());
  a.leases.emplace(q.id, std::move(lease));
  return rkeys;
}

Target::LeaseMap::iterator Target::revoke(Accepted& a, LeaseMap::iterator it) {
  a.windows -= it->second.windows.size();
  Counters::add(counters().windows_revoked, it->second.windows.size());
  return a.leases.erase(it);  // deallocating a bound window revokes it
}

void Target::release(Accepted& a, std::uint64_t lease_id) {
  auto it = a.leases.find(lease_id);
  if (it == a.leases.end()) return;
  revoke(a, it);
  Counters::add(counters().leases_released);
}

void Target::revoke_everywhere(std::uint64_t id, std::uint64_t fence) {
  // Remembered first: nothing after this can lease the id again (every lease message is
  // served under `mu`). A tag that is fenced already refuses the id by itself.
  if (fence == 0 || fence > fenced_through) revoked.add(id, fence);
  for (Accepted& a : accepted) {
    auto it = a.leases.find(id);
    if (it != a.leases.end()) revoke(a, it);
  }
  Counters::add(counters().leases_revoked);
}

void Target::fence(std::uint64_t through) {
  std::lock_guard lock(mu);
  if (through <= fenced_through) return;  // tags up to it are revoked and refused already
  fenced_through = through;
  for (Accepted& a : accepted) {
    for (auto it = a.leases.begin(); it != a.leases.end();) {
      if (it->second.fence != 0 && it->second.fence <= through) {
        it = revoke(a, it);
        Counters::add(counters().leases_fenced);
      } else {
        ++it;
      }
    }
  }
  revoked.fence(through);
}

Result<std::string> Target::serve(Accepted& a, std::string_view frame, Deadline deadline) {
  auto msg = decode_lease_message(frame);
  if (!msg.is_ok()) return msg.status().with_context("a malformed lease message");
  if (const auto* rel = std::get_if<LeaseRelease>(&*msg)) {
    release(a, rel->id);
    return std::string();
  }
  if (const auto* rev = std::get_if<LeaseRevoke>(&*msg)) {
    revoke_everywhere(rev->id, rev->fence);
    return encode_lease_revoked({rev->id});
  }
  const auto& q = std::get<LeaseRequest>(*msg);
  auto rkeys = bind(a, q, deadline);
  LeaseReply reply;
  reply.id = q.id;
  if (rkeys.is_ok()) {
    reply.rkeys = std::move(rkeys).value();
    Counters::add(counters().leases_granted);
  } else {
    reply.status = rkeys.status();
    Counters::add(counters().leases_refused);
  }
  return encode_lease_reply(reply);
}

std::optional<Clock::time_point> Target::expire(Clock::time_point now) {
  std::optional<Clock::time_point> next;
  for (auto& a : accepted) {
    for (auto it = a.leases.begin(); it != a.leases.end();) {
      if (it->second.until <= now) {
        it = revoke(a, it);
        Counters::add(counters().leases_expired);
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

void Target::drop(std::list<Accepted>::iterator it) {
  Counters::add(counters().windows_revoked, it->windows);
  accepted.erase(it);  // the windows, then the queue pair
}

// ---- registrations ---------------------------------------------------------------------------

Registration::Registration(std::vector<Part> parts, bool remote, std::shared_ptr<Target> target,
                           std::uint64_t preferred)
    : target_(std::move(target)), parts_(std::move(parts)), remote_(remote), preferred_(preferred) {
  if (!target_) return;
  std::lock_guard lock(target_->mu);
  for (std::size_t i = 0; i < parts_.size(); ++i) target_->leasable[{i, region_id(*parts_[i].mr)}] = parts_[i].mr.get();
}

// What names a leased region to its peers (LeaseRequest::region_rkey): its MR's lkey, unique per
// MR on a device. Its rkey is not: an MR without remote access has none, and rxe reports 0 for
// every such MR, so with a second leased region a lease would bind windows over the wrong one.
// The lkey grants a peer nothing (only this process's own work requests can use it).
std::uint32_t Registration::region_id(const ibv_mr& mr) { return mr.lkey; }

Registration::~Registration() {
  // Windows bound over an MR must go before it can be deregistered.
  if (target_) {
    for (const Part& p : parts_) target_->forget(p.mr.get());
  }
}

std::string Registration::packed_key() const {
  if (!remote_) return {};
  std::vector<KeyPart> parts;
  for (const Part& p : parts_) parts.push_back({p.guid, target_ ? region_id(*p.mr) : p.mr->rkey, target_ != nullptr});
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

Result<std::string> VerbsEndpoint::exchange(std::string_view message, Deadline deadline) {
  std::string out;
  {
    std::unique_lock lock(control_mu_);
    if (!control_cv_.wait_until(lock, deadline, [&] { return !control_busy_; })) {
      return Status::timeout("verbs: another lease exchange held the connection past this caller's deadline");
    }
    if (control_broken_) return Status::unavailable("verbs: the connection's setup stream broke");
    if (Clock::now() >= deadline)
      return Status::timeout("verbs: the deadline passed before the lease exchange");
    control_busy_ = true;
    for (std::uint64_t id : pending_releases_) append_frame(out, encode_lease_release({id}));
    pending_releases_.clear();
  }
  append_frame(out, message);
  Status sent = net::send_all(control_.get(), out.data(), out.size(), deadline, kLeaseExchange);
  Result<std::string> answer =
      sent.is_ok() ? read_frame(control_.get(), kMaxLeaseFrame, deadline) : Result<std::string>(sent);
  {
    std::lock_guard lock(control_mu_);
    control_busy_ = false;
    control_cv_.notify_all();
  }
  if (!answer.is_ok()) break_control(answer.status());
  return answer;
}

void VerbsEndpoint::break_control(const Status& why) {
  {
    std::lock_guard lock(control_mu_);
    control_broken_ = true;
    pending_releases_.clear();
  }
  // The setup stream is out of step (a half-sent message or a half-read answer): this
  // connection is done, and the engine reconnects.
  std::lock_guard lock(mu_);
  fail(Status::unavailable("verbs: the lease exchange broke: " + why.to_string()));
}

Result<std::unique_ptr<RemoteKey>> VerbsEndpoint::lease_key(const RemoteKey& region,
                                                            std::span<const RemoteRange> ranges,
                                                            const LeaseTerms& terms, Deadline deadline) {
  const auto& rk = static_cast<const ImportedKey&>(region);
  if (!rk.leases_only) return Status::unsupported("verbs: the region was not registered for leases");
  if (ranges.empty() || ranges.size() > kMaxLeaseRanges) {
    return Status::invalid_argument("verbs: a lease carries 1 to " + std::to_string(kMaxLeaseRanges) +
                                    " ranges");
  }
  if (terms.id == 0) return Status::invalid_argument("verbs: lease id 0");
  {
    std::lock_guard lock(mu_);
    if (!broken_.is_ok()) return broken_;
  }
  LeaseRequest q;
  q.region_rkey = rk.rkey;
  q.id = terms.id;
  q.write = terms.op == TransferOp::kWrite;
  q.ttl_ms = static_cast<std::uint32_t>(std::clamp<std::int64_t>(
      terms.ttl.count(), 1, std::chrono::duration_cast<std::chrono::milliseconds>(kMaxLeaseTtl).count()));
  q.fence = terms.fence;
  if (terms.grant) q.grant = *terms.grant;
  q.ranges.reserve(ranges.size());
  for (const RemoteRange& r : ranges) q.ranges.push_back({r.addr, r.length});

  auto frame = exchange(encode_lease_request(q), deadline);
  if (!frame.is_ok()) return frame.status().with_context("verbs: lease");
  auto reply = decode_lease_reply(*frame);
  if (!reply.is_ok() ||
      (reply->id != q.id || (reply->status.is_ok() && reply->rkeys.size() != q.ranges.size()))) {
    Status why = reply.is_ok() ? Status::corrupt("verbs: the peer answered another lease request than ours")
                               : reply.status();
    break_control(why);
    return why.with_context("verbs: lease");
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

Status VerbsEndpoint::revoke(const RemoteKey& key, const LeaseTerms& terms, Deadline deadline) {
  (void)key;  // the id names the lease on every connection, this one's key or not
  if (terms.id == 0) return Status::invalid_argument("verbs: revoke: lease id 0");
  auto frame = exchange(encode_lease_revoke({terms.id, terms.fence}), deadline);
  if (!frame.is_ok()) {
    const Status& s = frame.status();
    std::string why = "verbs: the peer did not confirm the revocation: " + s.to_string();
    return s.code() == StatusCode::kTimeout ? Status::timeout(std::move(why))
                                            : Status::unavailable(std::move(why));
  }
  auto ack = decode_lease_revoked(*frame);
  if (!ack.is_ok() || ack->id != terms.id) {
    Status why = ack.is_ok() ? Status::corrupt("verbs: the peer confirmed another revocation than ours")
                             : ack.status();
    break_control(why);
    return Status::unavailable("verbs: the peer did not confirm the revocation: " + why.to_string());
  }
  return Status::ok();
}

void VerbsEndpoint::release(std::uint64_t lease_id) {
  std::string out;
  {
    std::unique_lock lock(control_mu_);
    if (control_broken_) return;  // the connection's windows go with it
    pending_releases_.push_back(lease_id);
    // Another caller's exchange sends it first thing otherwise: never wait long here (a key
    // is destroyed on the engine's threads).
    if (!control_cv_.wait_until(lock, deadline_after(kReleaseTimeout), [&] { return !control_busy_; }))
      return;
    if (control_broken_ || pending_releases_.empty()) return;
    control_busy_ = true;
    for (std::uint64_t id : pending_releases_) append_frame(out, encode_lease_release({id}));
    pending_releases_.clear();
  }
  Status s =
      net::send_all(control_.get(), out.data(), out.size(), deadline_after(kReleaseTimeout), kLeaseExchange);
  {
    std::lock_guard lock(control_mu_);
    control_busy_ = false;
    control_cv_.notify_all();
  }
  if (!s.is_ok()) break_control(Status::unavailable("could not release a lease: " + s.to_string()));
}

}  // namespace kvstash::transport::verbs
