// Private to src/store: the transfer planner. It turns an object's bytes [begin, end) into
// the one-sided transfers between its pages and the caller's slices, wave by wave (a wave is
// `wave_bytes` of the object; a reader checksums a wave as it lands while the later ones
// still move), one list of entries per memory node. Pieces contiguous on both sides travel as
// one entry. It is pure: it reads no memory and asks no one, so tests drive it without Redis,
// nodes or registered memory (tests/transfer_plan_test.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "kvstash/engine.h"
#include "kvstash/status.h"
#include "kvstash/store.h"
#include "metadata/catalog.h"

namespace kvstash::store {

class TransferPlan {
 public:
  // Where the planner finds a node's pool and the lease a remote address lies in.
  struct Node {
    std::uint64_t pool_base = 0;  // remote address of the node's pool (page 0)
    // The lease covering remote address `addr` of the node (the RemoteMemory entries name).
    std::function<const RemoteMemory*(std::uint64_t addr)> lease_of;
  };

  // `nodes` has one entry per p.nodes; `handles[i]` is the registration of `slices[i]`, and
  // the slices hold the object's bytes [begin, end) in order (at least end - begin bytes).
  TransferPlan(TransferOp op, const metadata::Placement& p, std::span<const Node> nodes,
               std::span<const Slice> slices, std::span<const MemoryHandle* const> handles,
               std::uint64_t begin, std::uint64_t end, std::uint64_t wave_bytes);

  // The next wave: fills `by_node` (resized to one list per node; lists of nodes the wave does
  // not touch are empty) and returns the object offset where the wave ends; nullopt once
  // [begin, end) is planned. kCorrupt for a page on a node the placement does not list.
  Result<std::optional<std::uint64_t>> next(std::vector<std::vector<TransferEntry>>& by_node);

 private:
  std::size_t node_index(const std::string& id) const;

  TransferOp op_;
  const metadata::Placement& p_;
  std::span<const Node> nodes_;
  std::span<const Slice> slices_;
  std::span<const MemoryHandle* const> handles_;
  std::uint64_t offset_, end_, wave_bytes_;
  std::size_t si_ = 0, soff_ = 0;  // the slice and the offset in it where offset_ lies
};

}  // namespace kvstash::store
