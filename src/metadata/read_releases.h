// Read leases waiting to be ended, ended in batches off the readers' path: the leases that
// queue while one end_gets script runs all go in the next, so a busy reader pays one Redis
// round trip for many gets' ends, and an idle one still ends each lease at once.
//
//   if (releases.add({reader, token, extents})) {
//     pool.submit([&] { releases.drain([&](auto batch) { catalog.end_gets(batch); }); });
//   }
//
// Thread safety: add may be called from any thread; drain runs on one thread at a time (add
// returns true to exactly one caller until that drain has emptied the queue).
#pragma once

#include <cstddef>
#include <functional>
#include <mutex>
#include <span>
#include <vector>

#include "metadata/catalog.h"

namespace kvstash::metadata {

class ReadReleases {
 public:
  static constexpr std::size_t kMaxBatch = 64;  // leases per end_gets script

  // Queues `read`. True when no drain is running or due: the caller must start one.
  bool add(Catalog::EndedRead read);

  // Hands the queue to `end` in batches of at most kMaxBatch, oldest first, until it is empty.
  void drain(const std::function<void(std::span<const Catalog::EndedRead>)>& end);

  // Leases queued and not yet handed to a drain.
  std::size_t pending() const;

 private:
  mutable std::mutex mu_;
  std::vector<Catalog::EndedRead> queue_;
  bool draining_ = false;
};

}  // namespace kvstash::metadata
