#include "store/node_links.h"

#include <algorithm>

#include "common/log.h"

namespace kvstash::store {

void NodeLink::forget(const RemoteMemory* lease) {
  std::lock_guard lock(pool_mu);
  for (auto& by_path : pool) {
    for (PoolLease& p : by_path) {
      if (p.lease.get() == lease) p = {};
    }
  }
}

Result<const NodeLink::Path*> NodeLink::path(TransferOp op) const {
  if (op == TransferOp::kRead || main.peer->leases()) return &main;
  if (fenced_writes.peer) return &fenced_writes;
  return Status::unsupported(
      "memory node " + id + ": no transport to it can fence a put's writes at the node (" +
      std::string(to_string(main.peer->transport())) + " cannot); puts need tcp, shm or verbs");
}

Status pool_changed_is_stale(const Status& s) {
  if (s.code() != StatusCode::kPermissionDenied) return s;
  return Status::stale("store: the node's pool changed (it rejoined the cell): " + s.message());
}

Result<std::shared_ptr<NodeLink>> NodeLinks::link(const metadata::NodeEndpoint& n, Deadline deadline) {
  std::shared_ptr<NodeLink> l;
  {
    std::lock_guard lock(mu_);
    auto& slot = links_[n.id];
    if (!slot || slot->address != n.address || slot->key != n.key) {
      slot = std::make_shared<NodeLink>();
      slot->id = n.id;
      slot->address = n.address;
      slot->key = n.key;
    }
    l = slot;
  }
  {
    std::unique_lock lock(l->mu);
    auto ready = l->connecting.take(
        lock, deadline, [&] { return l->connected; }, "connect");
    if (!ready.is_ok()) return ready.status().with_context("memory node " + n.id);
    if (*ready) return l;
  }
  // Connecting without the lock: a caller with a shorter deadline is never held behind it.
  NodeLink::Path main, fenced;
  Status made = connect_path(*l, false, deadline, main);
  if (made.is_ok() && !main.peer->leases()) {
    Status second = connect_path(*l, true, deadline, fenced);
    if (second.code() == StatusCode::kUnsupported) {
      // No transport in common that holds leases: reads only (path() says why to puts).
      KVSTASH_LOG_INFO_LIMITED("memory node {}: puts cannot reach it: {}", n.id, second.to_string());
    } else if (!second.is_ok()) {
      made = second;  // a passing failure: the next operation connects both again
    }
  }
  std::lock_guard lock(l->mu);
  l->connecting.end();
  if (!made.is_ok()) return made.with_context("memory node " + n.id);
  l->main = std::move(main);
  l->fenced_writes = std::move(fenced);
  l->connected = true;
  return l;
}

// Connects to the node and imports its pool key into `out`; on an error `out` stays empty.
Status NodeLinks::connect_path(const NodeLink& l, bool require_leases, Deadline deadline,
                               NodeLink::Path& out) {
  KVSTASH_ASSIGN_OR_RETURN(auto peer, engine_.connect(l.address, deadline, std::nullopt, require_leases));
  auto remote = peer->import_key(l.key, deadline);
  KVSTASH_RETURN_IF_ERROR(pool_changed_is_stale(remote.status()));
  out.peer = std::move(peer);
  out.remote = std::move(remote).value();
  return Status::ok();
}

bool AvoidedNodes::add(const metadata::NodeEndpoint& n) {
  if (period_.count() <= 0) return false;
  std::lock_guard lock(mu_);
  avoided_[n.id] = {n, Clock::now() + period_};
  return true;
}

void AvoidedNodes::prune(Clock::time_point now) {
  std::erase_if(avoided_, [&](const auto& entry) { return entry.second.until <= now; });
}

std::vector<metadata::NodeEndpoint> AvoidedNodes::list() {
  std::lock_guard lock(mu_);
  if (avoided_.empty()) return {};
  prune(Clock::now());
  std::vector<metadata::NodeEndpoint> nodes;
  for (const auto& [id, entry] : avoided_) nodes.push_back(entry.node);
  return nodes;
}

bool AvoidedNodes::any_in(const metadata::Placement& p) {
  std::lock_guard lock(mu_);
  if (avoided_.empty()) return false;
  prune(Clock::now());
  return std::ranges::any_of(p.nodes, [&](const metadata::NodeEndpoint& n) {
    auto it = avoided_.find(n.id);
    return it != avoided_.end() && it->second.node.key == n.key;
  });
}

}  // namespace kvstash::store
