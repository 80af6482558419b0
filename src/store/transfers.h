// Private to src/store: starting and ending an object's transfers. The planner
// (transfer_plan.h) says what moves; this submits it through the leased node links, wave by
// wave, and waits for it.
#pragma once

#include <deque>
#include <span>
#include <vector>

#include "kvstash/engine.h"
#include "kvstash/store.h"
#include "metadata/catalog.h"
#include "store/leases.h"

namespace kvstash::store {

// The transfers of one stretch of the object: a batch per node, and where the stretch ends.
struct Wave {
  std::vector<Batch> batches;
  std::vector<std::size_t> nodes;  // each batch's node, an index into the placement's nodes
  std::vector<std::uint64_t> bytes;       // each batch's
  std::vector<TransportKind> transports;  // each batch's
  TransferOp op = TransferOp::kRead;
  std::uint64_t end = 0;
};

// Submits the transfers of object bytes [begin, end) from or into `slices` (which hold them
// in order) in waves of `wave_bytes`, appended to `waves`, all at once. A slice with no
// registration is registered for this call in `temp` (which must outlive the batches), with
// the transports of the object's node links only. On an error the waves submitted before it
// stay there (their batches may be moving). Never blocks on the network.
//
// With `fused` (a put of the whole object, [0, size)), writes to nodes whose transport
// digests them fill fused->blocks (a digest per 4 KiB of the object) as they move, and
// fused->digested says which bytes' digests they will fill (TransferPlan::digested).
struct FusedDigests {
  std::uint64_t* blocks = nullptr;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> digested;
};
Status submit_range(Engine& engine, const Leased& leased, TransferOp op, const metadata::Placement& p,
                    std::uint64_t begin, std::uint64_t end, std::span<const Slice> slices,
                    std::deque<MemoryHandle>& temp, Deadline deadline, std::uint64_t wave_bytes,
                    std::vector<Wave>& waves, FusedDigests* fused = nullptr);

// Waits for every batch of `wave`; the first error. Adds to `unreachable` the node (index into
// the placement's nodes) of each batch that failed kUnavailable: the node went away, or the
// link to it broke. Counts the bytes of the batches that completed in `meters`.
struct Meters;
Status wait_all(Wave& wave, std::vector<std::size_t>* unreachable = nullptr, Meters* meters = nullptr);

// The transfer deadline: the caller's, but never past the lease (minus a margin for the
// commit or end_get), so a slow put cannot write into pages that were reclaimed.
inline Deadline within_lease(Deadline deadline, Clock::time_point leased_at,
                             std::chrono::milliseconds lease) {
  return std::min(deadline, leased_at + lease - lease / 10);
}

}  // namespace kvstash::store
