// Private to src/store: the connections to the cell's memory nodes. One NodeLink per node,
// shared by every operation that touches the node: its peers (the best transport, and for
// writes one that can fence them at the node), the pool key imported through each, and the
// pool leases that operations share under rkey_scope connection.
//
// Thread safety: NodeLinks and NodeLink are safe to use from many threads; connecting is one
// caller's turn, the others wait for it only up to their own deadlines.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/turn.h"
#include "kvstash/engine.h"
#include "metadata/catalog.h"

namespace kvstash::store {

struct NodeLink {
  struct Path {
    std::unique_ptr<Peer> peer;
    RemoteMemory remote;  // the pool, imported through `peer`
  };

  std::string id;
  std::string address;
  std::string key;
  // Guards the fields below; never held while connecting. Once connected they do not change.
  std::mutex mu;
  Turn connecting;
  bool connected = false;
  // The best transport to the node; and for writes, when that one cannot be fenced at the
  // node (UCX), the best one that can: a put's writes must be stoppable at the node.
  Path main;
  Path fenced_writes;

  // rkey_scope connection: per path and op, a lease over the whole pool that operations share
  // (leases.cc, pooled_lease, says which it suits). Guarded by pool_mu; swapping one in
  // leaves the old one to the operations still holding it (the last releases it).
  struct PoolLease {
    std::shared_ptr<const RemoteMemory> lease;
    std::int64_t fence = 0;   // its fence tag: writes, the Redis deadline of the put that took it
    Clock::time_point until;  // when it ends by our clock, less a margin
  };
  std::mutex pool_mu;
  PoolLease pool[2][2];  // [&main, &fenced_writes][op]

  // Drops `lease` from the pool (the node refused it: it rejoined, or fenced it).
  void forget(const RemoteMemory* lease);

  // How `op` reaches the pool. kUnsupported for a write when no transport to the node can
  // fence it.
  Result<const Path*> path(TransferOp op) const;
};

class NodeLinks {
 public:
  explicit NodeLinks(Engine& engine) : engine_(engine) {}

  // The link to node `n`'s pool, connected and its key imported (again, when the node's
  // address or key changed: it rejoined the cell). Errors name the node: kStale when the node
  // no longer knows the key Redis named, else the engine's (kUnavailable, kTimeout, ...).
  Result<std::shared_ptr<NodeLink>> link(const metadata::NodeEndpoint& n, Deadline deadline);

 private:
  Status connect_path(const NodeLink& l, bool require_leases, Deadline deadline, NodeLink::Path& out);

  Engine& engine_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<NodeLink>, std::less<>> links_;
};

// Nodes this client failed to reach lately (a link that would not connect, writes that failed
// kUnavailable), each for `period`: meanwhile its puts ask Redis for pages elsewhere
// (Catalog::begin_put's avoid). Between a node's death and the end of its heartbeat TTL
// Redis still places pages on it; a period past that TTL covers the gap, after which the
// cell has declared the node dead, or it answers again.
class AvoidedNodes {
 public:
  explicit AvoidedNodes(std::chrono::milliseconds period) : period_(period) {}
  // Avoids node `n` as registered now (its pool key): registered again, it is back. False,
  // adding nothing, when avoiding is off (a period of 0).
  bool add(const metadata::NodeEndpoint& n);
  // The nodes avoided now.
  std::vector<metadata::NodeEndpoint> list();
  // Whether any node of `p` is avoided now.
  bool any_in(const metadata::Placement& p);

 private:
  void prune(Clock::time_point now);  // needs mu_

  const std::chrono::milliseconds period_;
  std::mutex mu_;
  struct Entry {
    metadata::NodeEndpoint node;
    Clock::time_point until;
  };
  std::map<std::string, Entry, std::less<>> avoided_;  // by node id
};

// A node that refuses, once connected, the pool key Redis named (importing it, leasing under
// it) no longer knows it: it registered its pool again (it rejoined the cell) since the key
// was read. For the caller the object changed under it: kStale.
Status pool_changed_is_stale(const Status& s);

}  // namespace kvstash::store
