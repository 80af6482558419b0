#include "kvcache/bounce_pool.h"

#include "kvstash/store.h"

namespace kvstash::kvcache {

Result<std::unique_ptr<Bounce>> BouncePool::take() {
  {
    std::lock_guard lock(mu_);
    if (!free_.empty()) {
      auto b = std::move(free_.back());
      free_.pop_back();
      return b;
    }
  }
  auto b = std::make_unique<Bounce>();
  KVSTASH_ASSIGN_OR_RETURN(b->mem, device_->allocate_host(bytes_));
  b->bytes = bytes_;
  KVSTASH_ASSIGN_OR_RETURN(b->handle, store_->register_memory({b->mem.get(), bytes_}));
  return b;
}

void BouncePool::give(std::unique_ptr<Bounce> b) {
  if (!b) return;
  std::lock_guard lock(mu_);
  free_.push_back(std::move(b));
}

void BouncePool::quarantine(std::unique_ptr<Bounce> b) {
  if (!b) return;
  std::lock_guard lock(mu_);
  quarantined_.push_back(std::move(b));
}

}  // namespace kvstash::kvcache
