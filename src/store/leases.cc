#include "store/leases.h"

#include <algorithm>

#include "common/log.h"

namespace kvstash::store {
namespace {

// How long a shared pool lease for reads lives (rkey_scope connection): taken again this
// often per node link, at most.
constexpr std::chrono::milliseconds kPoolReadLease = std::chrono::minutes(5);

// The link's pool lease for `op` through `path` when the operation may share it, else a new
// one taken for the pool's whole range (a round trip to the node), kept for the operations
// after it. Reads: a lease of five minutes without a fence tag, shared while it outlives the
// operation's deadline. Writes: a lease whose fence tag is the Redis deadline of the put that
// took it, shared by puts whose own deadline is at least that tag and at most half a put lease
// past it, so that no window outlives a put it serves by more than that put's own lease: a
// node fenced past a failed put's deadline has fenced every window that could write into its
// pages.
Result<NodeLink::PoolLease> pooled_lease(NodeLink& link, const LeasePolicy& policy,
                                         const NodeLink::Path* path, TransferOp op,
                                         const metadata::Placement& p, Clock::time_point until,
                                         Deadline deadline, OpTimings* timings) {
  const int pi = path == &link.main ? 0 : 1;
  const int oi = op == TransferOp::kRead ? 0 : 1;
  const auto half_put_lease = std::chrono::milliseconds(policy.put_lease).count() / 2;
  auto suits = [&](const NodeLink::PoolLease& pl) {
    if (!pl.lease) return false;
    if (op == TransferOp::kRead) return pl.until >= deadline;
    return pl.fence <= p.lease_deadline_ms && p.lease_deadline_ms - pl.fence <= half_put_lease &&
           pl.until > Clock::now();
  };
  {
    std::lock_guard lock(link.pool_mu);
    if (suits(link.pool[pi][oi])) return link.pool[pi][oi];
  }
  NodeLink::PoolLease fresh;
  LeaseOptions lo{.op = op, .deadline = deadline};
  const auto t0 = Clock::now();
  if (!policy.pool_grant) return Status::internal("a pool lease without a way to ask for its grant");
  // The cell grants the whole pool (rkey scope connection), until the lease's tag: a read lease
  // gets one of its own, a write lease the put's deadline.
  auto granted = policy.pool_grant(link.id, op, op == TransferOp::kRead ? 0 : p.lease_deadline_ms,
                                   kPoolReadLease, deadline);
  if (timings != nullptr) {
    ++timings->redis_round_trips;
    timings->metadata += Clock::now() - t0;
  }
  if (!granted.is_ok()) return granted.status().with_context("a grant for a pool lease");
  lo.grant = std::move(granted->grant);
  lo.fence = static_cast<std::uint64_t>(granted->deadline_ms);
  if (op == TransferOp::kRead) {
    lo.ttl = kPoolReadLease;
    fresh.until = Clock::now() + kPoolReadLease - kPoolReadLease / 10;
  } else {
    lo.ttl = std::max(std::chrono::milliseconds(1),
                      std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()));
    fresh.fence = p.lease_deadline_ms;
    fresh.until = until;
  }
  const RemoteRange whole{path->remote.base(), path->remote.length()};
  const auto t1 = Clock::now();
  auto l = path->peer->lease(path->remote, {&whole, 1}, lo);
  if (timings != nullptr) {
    ++timings->node_round_trips;
    timings->node += Clock::now() - t1;
  }
  if (!l.is_ok()) return l.status();
  fresh.lease = std::make_shared<const RemoteMemory>(std::move(l).value());
  std::lock_guard lock(link.pool_mu);
  link.pool[pi][oi] = fresh;
  return fresh;
}

// The node's pages of `p` as runs of adjacent pages, in the node's address space.
std::vector<RemoteRange> page_runs(const metadata::Placement& p, const std::string& node,
                                   std::uint64_t base) {
  std::vector<std::uint64_t> pages;
  for (const auto& e : p.extents) {
    if (e.node == node) pages.push_back(e.page);
  }
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  std::vector<RemoteRange> runs;
  for (std::uint64_t page : pages) {
    const std::uint64_t addr = base + page * p.page_size;
    if (!runs.empty() && runs.back().addr + runs.back().length == addr) {
      runs.back().length += p.page_size;
    } else {
      runs.push_back({addr, p.page_size});
    }
  }
  return runs;
}

// Leases every node's pages of the object for `op` until `until`, with the Redis lease's
// deadline as the fence tag: a node that has fenced through it refuses the lease's requests
// (tcp, verbs) or its copies (shm), so a put whose pages went back to the pool can no longer
// write into them. verbs binds windows over exactly these pages, or with rkey_scope
// connection shares a window over the whole pool (pooled_lease); elsewhere the node checks
// the lease and the engine the ranges. On an error `ni` is the node it met it at.
Status lease_pages(const LeasePolicy& policy, const metadata::Placement& p, TransferOp op,
                   Clock::time_point until, Deadline deadline, OpTimings* timings, Leased& l, std::size_t& ni) {
  // At least 1 ms: a read started after its lease ran out may still finish, and end_get's
  // generations decide whether its bytes are the object's (a revocable key keeps a reader
  // out of reused pages only from 1 ms on; the checksum and generations cover the rest).
  const auto ttl = std::max(std::chrono::milliseconds(1),
                            std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()));
  l.by_node.assign(p.nodes.size(), {});
  for (ni = 0; ni < p.nodes.size(); ++ni) {
    const NodeLink::Path* path = l.paths[ni];
    if (policy.scope == RkeyScope::kConnection && path->peer->lease_asks_peer()) {
      auto shared = pooled_lease(*l.links[ni], policy, path, op, p, until, deadline, timings);
      if (!shared.is_ok())
        return pool_changed_is_stale(shared.status()).with_context("memory node " + p.nodes[ni].id);
      l.by_node[ni].ranges.emplace_back(RemoteRange{path->remote.base(), path->remote.length()},
                                        l.leases.size());
      // A write window's end caps the transfers (a read window outlives the operation).
      const Clock::time_point shared_until =
          op == TransferOp::kWrite ? shared->until : Clock::time_point::max();
      l.leases.push_back({std::move(shared->lease), l.links[ni], true, shared_until});
      continue;
    }
    const std::vector<RemoteRange> runs = page_runs(p, p.nodes[ni].id, path->remote.base());
    // One lease per node where leasing is local (its grant then goes to the node once per
    // connection); one per message's worth of ranges where it asks the node.
    const std::size_t per_lease = path->peer->lease_asks_peer() ? kMaxLeaseRanges : runs.size();
    for (std::size_t at = 0; at < runs.size(); at += per_lease) {
      std::span<const RemoteRange> chunk(runs.data() + at, std::min(per_lease, runs.size() - at));
      const auto t0 = Clock::now();
      auto lease = path->peer->lease(path->remote, chunk,
                                     {.op = op,
                                      .ttl = ttl,
                                      .fence = static_cast<std::uint64_t>(p.lease_deadline_ms),
                                      .grant = p.nodes[ni].grant,
                                      .deadline = deadline});
      if (timings != nullptr && path->peer->lease_asks_peer()) {
        ++timings->node_round_trips;
        timings->node += Clock::now() - t0;
      }
      if (!lease.is_ok())
        return pool_changed_is_stale(lease.status()).with_context("memory node " + p.nodes[ni].id);
      if (op == TransferOp::kWrite && !lease->revocable()) {
        // The node serves its pool without leases on this transport (verbs without memory
        // windows): a write of a failed put could land after its pages were reused.
        return Status::unsupported(
            "memory node " + p.nodes[ni].id + " cannot fence writes over " +
            std::string(to_string(path->peer->transport())) +
            " (its pool has no leases there): puts need tcp, shm or verbs with memory windows");
      }
      for (const RemoteRange& r : chunk) l.by_node[ni].ranges.emplace_back(r, l.leases.size());
      l.leases.push_back(
          {std::make_shared<const RemoteMemory>(std::move(lease).value()), l.links[ni], false});
    }
  }
  return Status::ok();
}

}  // namespace

const RemoteMemory* NodeLeases::find(const std::vector<HeldLease>& leases, std::uint64_t addr) const {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), addr,
                             [](std::uint64_t a, const auto& r) { return a < r.first.addr; });
  return it == ranges.begin() ? nullptr : leases[std::prev(it)->second].lease.get();
}

Result<Leased> connect_and_lease(NodeLinks& links, const LeasePolicy& policy, TransferOp op,
                                 const metadata::Placement& p, Clock::time_point until, Deadline deadline,
                                 OpTimings* timings, metadata::NodeEndpoint* unreachable) {
  auto failed_at = [&](const metadata::NodeEndpoint& n, Status s) {
    if (s.code() == StatusCode::kUnavailable && unreachable != nullptr) *unreachable = n;
    return s;
  };
  Leased l;
  for (const auto& n : p.nodes) {
    auto link_to = links.link(n, deadline);
    if (!link_to.is_ok()) return failed_at(n, link_to.status());
    KVSTASH_ASSIGN_OR_RETURN(const NodeLink::Path* path, (*link_to)->path(op));
    l.links.push_back(std::move(link_to).value());
    l.paths.push_back(path);
  }
  std::size_t ni = 0;
  Status leased = lease_pages(policy, p, op, until, deadline, timings, l, ni);
  if (!leased.is_ok()) return failed_at(p.nodes[ni], leased);
  return l;
}

void forget_refused(const std::vector<HeldLease>& leases, const Status& failure) {
  if (failure.code() != StatusCode::kStale && failure.code() != StatusCode::kPermissionDenied) return;
  for (const HeldLease& h : leases) {
    if (h.shared) h.link->forget(h.lease.get());
  }
}

std::vector<std::string> revoke_all(const std::string& key, const std::vector<std::string>& nodes,
                                    const std::vector<HeldLease>& leases, Deadline by) {
  std::vector<std::string> failed;
  for (const HeldLease& h : leases) {
    const std::string& id = h.link->id;
    if (std::ranges::find(failed, id) != failed.end()) continue;
    auto path = h.link->path(TransferOp::kWrite);
    Status s = !path.is_ok()       ? path.status()
               : h.shared          ? Status::unsupported("a pool lease other puts share")
               : Clock::now() < by ? (*path)->peer->revoke(*h.lease, by)
                                   : Status::timeout("no time left to confirm");
    if (!s.is_ok()) {
      KVSTASH_LOG_DEBUG("put {}: node {} did not confirm its fence: {}", key, id, s.to_string());
      failed.push_back(id);
    }
  }
  std::vector<std::string> confirmed;
  for (const auto& id : nodes) {
    if (std::ranges::find(failed, id) == failed.end()) confirmed.push_back(id);
  }
  return confirmed;
}

Status fenced_is_stale(const Status& s) {
  if (s.code() != StatusCode::kPermissionDenied) return s;
  return Status::stale(
      "store: the memory node ended this transfer's lease (past its deadline, or the node rejoined the "
      "cell): " +
      s.message());
}

}  // namespace kvstash::store
