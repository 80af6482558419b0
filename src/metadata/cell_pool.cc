#include "metadata/cell_pool.h"

#include <algorithm>

namespace kvstash::metadata {

CellPool::Borrowed& CellPool::Borrowed::operator=(Borrowed&& other) noexcept {
  if (this != &other) {
    give_back();
    pool_ = other.pool_;
    cell_ = std::move(other.cell_);
  }
  return *this;
}

CellPool::Borrowed::~Borrowed() { give_back(); }

void CellPool::Borrowed::give_back() {
  if (cell_) pool_->give_back(std::move(cell_));
}

CellPool::CellPool(CellOptions options, std::uint32_t size)
    : options_(std::move(options)), size_(std::max<std::uint32_t>(1, size)) {}

CellPool::~CellPool() = default;

Result<std::unique_ptr<CellPool>> CellPool::open(const CellOptions& options, std::uint32_t size) {
  std::unique_ptr<CellPool> pool(new CellPool(options, size));
  KVSTASH_ASSIGN_OR_RETURN(auto first, Cell::open(pool->options_));
  pool->idle_.push_back(std::move(first));
  pool->open_ = 1;
  return pool;
}

Result<CellPool::Borrowed> CellPool::borrow(Deadline deadline) {
  std::unique_lock lock(mu_);
  for (;;) {
    if (!idle_.empty()) {
      auto c = std::move(idle_.back());
      idle_.pop_back();
      c->redis().set_deadline(deadline);
      return Borrowed(this, std::move(c));
    }
    if (open_ < size_) break;
    if (came_back_.wait_until(lock, deadline) == std::cv_status::timeout) {
      return Status::timeout("metadata: no Redis connection came free before the deadline");
    }
  }
  ++open_;  // the slot is this borrower's while it connects, outside the lock
  lock.unlock();
  auto c = Cell::open(options_);
  if (!c.is_ok()) {
    {
      std::lock_guard relock(mu_);
      --open_;
    }
    came_back_.notify_one();
    return c.status();
  }
  (*c)->redis().set_deadline(deadline);
  return Borrowed(this, std::move(c).value());
}

void CellPool::give_back(std::unique_ptr<Cell> cell) {
  cell->redis().set_deadline(std::nullopt);
  {
    std::lock_guard lock(mu_);
    idle_.push_back(std::move(cell));
  }
  came_back_.notify_one();
}

std::uint32_t CellPool::open_connections() const {
  std::lock_guard lock(mu_);
  return open_;
}

}  // namespace kvstash::metadata
