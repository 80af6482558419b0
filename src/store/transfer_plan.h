// Private to src/store: the transfer planner. It turns an object's bytes [begin, end) into
// the one-sided transfers between its pages and the caller's slices, wave by wave (a wave is
// `wave_bytes` of the object; a reader checksums a wave as it lands while the later ones
// still move), one list of entries per memory node. Pieces contiguous on both sides travel as
// one entry. It is pure: it reads no memory and asks no one, so tests drive it without Redis,
// nodes or registered memory (tests/unit/store/transfer_plan_test.cc).
//
// A put's writes to nodes whose transport digests them (Peer::digests_writes) can carry
// where their 4 KiB block digests go: the planner gives an entry the digests of the blocks it
// holds whole, so that no digest is written by two hands, and says which bytes those are.
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
    bool digests = false;  // its transport digests writes: entries may carry block_digests
  };

  // `nodes` has one entry per p.nodes; `handles[i]` is the registration of `slices[i]`, and
  // the slices hold the object's bytes [begin, end) in order (at least end - begin bytes).
  // `digests`, when set, holds a block digest per 4 KiB of [begin, end) (index: (offset -
  // begin) / 4096; `begin` on a block's start), and `end` is a block's end or the object's
  // (its last block may be short).
  TransferPlan(TransferOp op, const metadata::Placement& p, std::span<const Node> nodes,
               std::span<const Slice> slices, std::span<const MemoryHandle* const> handles,
               std::uint64_t begin, std::uint64_t end, std::uint64_t wave_bytes,
               std::uint64_t* digests = nullptr);

  // The next wave: fills `by_node` (resized to one list per node; lists of nodes the wave does
  // not touch are empty) and returns the object offset where the wave ends; nullopt once
  // [begin, end) is planned. kCorrupt for a page on a node the placement does not list.
  Result<std::optional<std::uint64_t>> next(std::vector<std::vector<TransferEntry>>& by_node);

  // The object's bytes whose block digests the planned entries carry, as [from, to) ranges
  // (each from a block's start to a block's end or the object's end).
  const std::vector<std::pair<std::uint64_t, std::uint64_t>>& digested() const { return digested_; }

 private:
  // Cuts the entries of a wave that carry digests at their last whole block, so that a short
  // block before the object's end is left to the caller; records what stays digested.
  void settle_digests(std::vector<std::vector<TransferEntry>>& by_node);

  std::size_t node_index(const std::string& id) const;

  TransferOp op_;
  const metadata::Placement& p_;
  std::span<const Node> nodes_;
  std::span<const Slice> slices_;
  std::span<const MemoryHandle* const> handles_;
  std::uint64_t offset_, end_, wave_bytes_;
  std::uint64_t begin_;
  std::uint64_t* digests_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> digested_;
  std::size_t si_ = 0, soff_ = 0;  // the slice and the offset in it where offset_ lies
};

}  // namespace kvstash::store
