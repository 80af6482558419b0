// Quotas per key prefix: a prefix of a cell's keys (a tenant's, a model's) may hold at most so
// many objects and so many bytes of the pool. The object scripts enforce them (prelude/quotas.lua,
// "Quotas"): a put over its prefix's quota first evicts that prefix's own least recently used
// objects that no reader leases, and is refused (kNoSpace, naming the quota) only when they
// cannot make room. Other prefixes' objects are never evicted for it. The operator sets them
// with `kvstash quota` and sees them in `kvstash status` (docs/operations.md, "Quotas").
//
// Thread safety: as the RedisClient it uses (one thread at a time).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata {

struct QuotaLimits {
  std::uint64_t max_objects = 0;  // 0: no limit
  std::uint64_t max_bytes = 0;    // of the pool, in whole pages; 0: no limit
};

// A quota and what is charged to it.
struct QuotaUse {
  std::string prefix;
  QuotaLimits limits;
  std::uint64_t objects = 0;   // committed objects (a replica's copy counts as one)
  std::uint64_t bytes = 0;     // their pages' bytes
  std::uint64_t evicted = 0;   // objects its own eviction took, to make room under it
  std::uint64_t refused = 0;   // puts refused because it was full of leased objects
  std::uint64_t reserved = 0;  // pages of puts and page reservations not committed yet (bytes)
  bool counting = false;       // its first pass over the cell's objects is not done
};

class CellQuotas {
 public:
  // Over `redis`, which must outlive it; `cell_prefix` is the cell's key prefix
  // (kvs:{kvs:<cell>}, CellAdmin::prefix()).
  CellQuotas(RedisClient& redis, std::string cell_prefix);

  // Sets the quota of `prefix` (a new one, or new limits for one), or removes it when both
  // limits are 0. When that changes which quota governs objects already in the cell, charges
  // them anew (recount) before it returns. Errors: kInvalidArgument (an empty prefix, limits
  // of 10^15 or more, a 257th quota), kTimeout (the recount did not finish by `deadline`: it
  // goes on with `kvstash quota recount`), Redis's.
  Status set(std::string_view prefix, QuotaLimits limits, Deadline deadline);
  // One pass over the cell's objects, in steps of about 256, charging each to the quota that
  // governs it now; `gen`, when given, is the quota whose first count it completes. Returns
  // how many objects' charge moved.
  Result<std::uint64_t> recount(std::string_view gen, Deadline deadline);
  // Every quota of the cell, by prefix.
  Result<std::vector<QuotaUse>> list();

 private:
  RedisClient& redis_;
  std::string prefix_;
};

}  // namespace kvstash::metadata
