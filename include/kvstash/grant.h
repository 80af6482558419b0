// kvstash/grant.h: what a leased region's owner checks before it serves a lease.
//
// A region registered Access::kLeased is reached only through leases (Peer::lease). With a
// GrantCheck installed (Engine::set_grant_check), a lease is served only when it carries a
// grant (LeaseOptions::grant) the check accepts, and only over the ranges and for the op and
// fence tag the grant names: a peer that knows the cluster token but was granted nothing by
// the region's owner reaches nothing. A memory node's grants are signed by its cell's
// metadata plane (docs/operations.md, "Threat model"); a KvExport's by the exporting engine.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/transfer.h"
#include "kvstash/types.h"

namespace kvstash {

// What one grant allows: `op` over `ranges` (addresses of this process, sorted, disjoint),
// until this process fences through `fence` (Engine::fence; the grant's deadline).
struct Grant {
  TransferOp op = TransferOp::kRead;
  std::uint64_t fence = 0;  // never 0: every grant ends
  std::vector<RemoteRange> ranges;
};

// The most bytes a grant may take on the wire.
inline constexpr std::size_t kMaxGrantBytes = 1u << 20;

class GrantCheck {
 public:
  virtual ~GrantCheck() = default;
  // The terms `grant` proves, or kPermissionDenied saying why it proves nothing (forged,
  // another owner's, an older incarnation's). Called by transports' serving threads: fast
  // (no I/O) and thread-safe.
  virtual Result<Grant> check(std::string_view grant) const = 0;
};

}  // namespace kvstash
