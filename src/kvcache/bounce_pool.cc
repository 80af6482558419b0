#include "kvcache/bounce_pool.h"

#include "kvstash/metrics.h"
#include "kvstash/store.h"

namespace kvstash::kvcache {

namespace {

// The pool's use in its store's metrics: takes served from the pool or by a new buffer, and
// the bytes of buffers made (a warm cache makes none).
void count_take(Store& store, bool made, std::size_t bytes) {
  metrics::Registry& r = store.metrics();
  r.counter("kvstash_kvcache_bounce_takes_total",
            "Host bounce buffers taken by staged loads and saves: from the pool, or made anew",
            {{"from", made ? "new" : "pool"}})
      .add();
  if (made) {
    r.counter("kvstash_kvcache_bounce_bytes_total",
              "Bytes of host bounce buffers made (page-locked, registered)")
        .add(bytes);
  }
}

}  // namespace

Result<std::unique_ptr<Bounce>> BouncePool::take() {
  {
    std::lock_guard lock(mu_);
    if (!free_.empty()) {
      auto b = std::move(free_.back());
      free_.pop_back();
      count_take(*store_, false, bytes_);
      return b;
    }
  }
  auto b = std::make_unique<Bounce>();
  KVSTASH_ASSIGN_OR_RETURN(b->mem, device_->allocate_host(bytes_));
  b->bytes = bytes_;
  KVSTASH_ASSIGN_OR_RETURN(b->handle, store_->register_memory({b->mem.get(), bytes_}));
  count_take(*store_, true, bytes_);
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
