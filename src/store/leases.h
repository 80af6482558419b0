// Private to src/store: an operation's leases over an object's pages at its memory nodes.
// Each node's pages are leased for the operation's op until its Redis lease ends, with the
// Redis lease's deadline as the fence tag, so a node that fenced through it refuses what is
// left of the operation. Under rkey_scope connection, where leasing asks the node (verbs), the
// operation shares a pool lease instead (docs/architecture.md, "The node's CPU and the rkey
// scope").
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvstash/store.h"
#include "metadata/catalog.h"
#include "store/node_links.h"

namespace kvstash::store {

// A lease an operation's transfers go through: the operation's own, or the node link's pool
// lease that it shares with others (rkey_scope connection), which it must never revoke.
struct HeldLease {
  std::shared_ptr<const RemoteMemory> lease;
  std::shared_ptr<NodeLink> link;  // the node link it was made through
  bool shared = false;
  Clock::time_point until = Clock::time_point::max();  // a shared write lease: transfers end by then
};

// One node's pages of an object as leased ranges: [addr, end) -> index into the leases.
struct NodeLeases {
  std::vector<std::pair<RemoteRange, std::size_t>> ranges;  // sorted by address
  const RemoteMemory* find(const std::vector<HeldLease>& leases, std::uint64_t addr) const;
};

// An object's nodes connected and its pages leased for one operation. The leases must
// outlive the batches: destroying one revokes it.
struct Leased {
  std::vector<std::shared_ptr<NodeLink>> links;  // per placement node
  std::vector<const NodeLink::Path*> paths;      // how the operation reaches each link's pool
  std::vector<HeldLease> leases;
  std::vector<NodeLeases> by_node;  // per placement node
};

// Asks the cell for a grant over a node's whole pool (metadata::Catalog::grant_pool): node id,
// op, deadline (ms of Redis time; 0: ttl from now), ttl, and the deadline of the asking.
using PoolGrantFn = std::function<Result<metadata::Catalog::PoolGrant>(
    const std::string& node, TransferOp op, std::int64_t deadline_ms, std::chrono::milliseconds ttl,
    Deadline)>;

// What decides how pages are leased: the cell's rkey scope and the put lease (a shared write
// window serves puts whose deadlines lie within half a put lease of its tag), and where a pool
// lease's grant comes from (the placement's cell).
struct LeasePolicy {
  RkeyScope scope = RkeyScope::kConnection;
  std::chrono::milliseconds put_lease{60000};
  PoolGrantFn pool_grant;
};

// Connects to every node of `p` and leases its pages for `op` until `until`. Timings count the
// round trips to nodes. Errors name the node; kStale when a node no longer knows its pool key
// or fenced the tag already; kUnsupported for a write no transport to a node can fence. A
// node that could not be reached (kUnavailable) is also named in `unreachable`.
Result<Leased> connect_and_lease(NodeLinks& links, const LeasePolicy& policy, TransferOp op,
                                 const metadata::Placement& p, Clock::time_point until, Deadline deadline,
                                 OpTimings* timings, metadata::NodeEndpoint* unreachable = nullptr);

// Drops the pool leases a failed operation went through when the node refused them (it
// fenced them, or it rejoined the cell): the next operation takes fresh ones.
void forget_refused(const std::vector<HeldLease>& leases, const Status& failure);

// Asks every node of a failed put to confirm that none of its writes can land any more
// (Peer::revoke of each of its leases), up to `by`. Returns the put's nodes that confirmed,
// or that were never leased (no write of the put can have gone there). A pool lease other
// puts share is not revoked (that would fail them too): its node stays unconfirmed, and the
// put's pages wait for the node's fence.
std::vector<std::string> revoke_all(const std::string& key, const std::vector<std::string>& nodes,
                                    const std::vector<HeldLease>& leases, Deadline by);

// A memory node refuses a transfer on its pool only when the transfer's lease has ended
// there (fenced past its deadline, revoked) or the pool was registered again (the node
// rejoined the cell): for the caller the object changed under it, kStale.
Status fenced_is_stale(const Status& s);

}  // namespace kvstash::store
