// Batches of read leases to end (read_releases.h).
#include "metadata/read_releases.h"

#include <algorithm>
#include <iterator>

namespace kvstash::metadata {

bool ReadReleases::add(Catalog::EndedRead read) {
  std::lock_guard lock(mu_);
  queue_.push_back(std::move(read));
  if (draining_) return false;
  draining_ = true;
  return true;
}

void ReadReleases::drain(const std::function<void(std::span<const Catalog::EndedRead>)>& end) {
  std::vector<Catalog::EndedRead> batch;
  for (;;) {
    batch.clear();
    {
      std::lock_guard lock(mu_);
      if (queue_.empty()) {
        draining_ = false;
        return;
      }
      const auto n = static_cast<std::ptrdiff_t>(std::min(queue_.size(), kMaxBatch));
      std::move(queue_.begin(), queue_.begin() + n, std::back_inserter(batch));
      queue_.erase(queue_.begin(), queue_.begin() + n);
    }
    end(batch);
  }
}

std::size_t ReadReleases::pending() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

}  // namespace kvstash::metadata
