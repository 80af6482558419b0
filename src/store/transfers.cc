#include "store/transfers.h"

#include <algorithm>

#include "store/store_internal.h"
#include "store/transfer_plan.h"

namespace kvstash::store {

Status submit_range(Engine& engine, const Leased& leased, TransferOp op, const metadata::Placement& p,
                    std::uint64_t begin, std::uint64_t end, std::span<const Slice> slices,
                    std::deque<MemoryHandle>& temp, Deadline deadline, std::uint64_t wave_bytes,
                    std::vector<Wave>& waves, FusedDigests* fused) {
  for (const HeldLease& h : leased.leases)
    deadline = std::min(deadline, h.until);  // a shared write window's end
  std::vector<TransportKind> kinds;          // the transports this object's bytes move over
  for (const NodeLink::Path* path : leased.paths) {
    if (std::ranges::find(kinds, path->peer->transport()) == kinds.end())
      kinds.push_back(path->peer->transport());
  }
  std::vector<const MemoryHandle*> handles;
  std::uint64_t left = end - begin;
  for (const Slice& s : slices) {
    if (left == 0) break;
    left -= std::min<std::uint64_t>(left, s.length);
    if (s.memory != nullptr) {
      handles.push_back(s.memory);
      continue;
    }
    auto h = engine.register_memory({s.addr, s.length}, Access::kLocal, kinds);
    if (!h.is_ok()) return h.status().with_context("registering a slice");
    handles.push_back(&temp.emplace_back(std::move(h).value()));
  }

  std::vector<TransferPlan::Node> nodes(p.nodes.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    nodes[i].pool_base = leased.paths[i]->remote.base();
    nodes[i].lease_of = [&leased, i](std::uint64_t addr) {
      return leased.by_node[i].find(leased.leases, addr);
    };
    nodes[i].digests = fused != nullptr && leased.paths[i]->peer->digests_writes();
  }
  TransferPlan plan(op, p, nodes, slices.first(handles.size()), handles, begin, end, wave_bytes,
                    fused != nullptr ? fused->blocks : nullptr);
  std::vector<std::vector<TransferEntry>> entries;
  for (;;) {
    KVSTASH_ASSIGN_OR_RETURN(std::optional<std::uint64_t> wave_end, plan.next(entries));
    if (!wave_end) {
      if (fused != nullptr) fused->digested = plan.digested();
      return Status::ok();
    }
    Wave& w = waves.emplace_back();
    w.end = *wave_end;
    w.op = op;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].empty()) continue;
      auto b = leased.paths[i]->peer->submit(entries[i], deadline);
      if (!b.is_ok()) return b.status().with_context("memory node " + p.nodes[i].id);
      w.batches.push_back(std::move(b).value());
      w.nodes.push_back(i);
      std::uint64_t bytes = 0;
      for (const TransferEntry& e : entries[i]) bytes += e.length;
      w.bytes.push_back(bytes);
      w.transports.push_back(leased.paths[i]->peer->transport());
    }
  }
}

Status wait_all(Wave& wave, std::vector<std::size_t>* unreachable, Meters* meters) {
  Status first;
  for (std::size_t i = 0; i < wave.batches.size(); ++i) {
    Status s = wave.batches[i].wait();
    if (s.is_ok() && meters != nullptr) {
      meters->moved[wave.op == TransferOp::kRead ? 0 : 1][static_cast<std::size_t>(wave.transports[i])]->add(
          wave.bytes[i]);
    }
    if (s.code() == StatusCode::kUnavailable && unreachable != nullptr) unreachable->push_back(wave.nodes[i]);
    if (first.is_ok() && !s.is_ok()) first = s;
  }
  return first;
}

}  // namespace kvstash::store
