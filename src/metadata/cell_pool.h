// A bounded pool of connections to one cell (cell.h), for a process whose threads each need
// the cell for one operation at a time (the store: a put, a get, a stat).
//
//   auto pool = CellPool::open({.redis = {.url = url}, .cell = "prod"}, 4).value();
//   auto c = pool->borrow(deadline_after(2s));   // Result<CellPool::Borrowed>
//   if (!c.is_ok()) return c.status();           // kTimeout: none came free in time
//   auto placement = (*c)->begin_put(token, key, size, lease);   // the client's Catalog
//
// At most `size` connections are open at once; they open on demand, the first one in open().
// A borrower that finds none idle and the pool at its bound waits for one to come back, until
// its deadline (then kTimeout). While borrowed, a connection's commands, their reconnects
// included, are bounded by the borrower's deadline as well as by the options' timeouts
// (RedisClient::set_deadline); the bound is lifted when it comes back. A connection whose
// command failed is still given back: its RedisClient reconnects on its next command.
//
// Thread safety: open, borrow and the Borrowed's return may be called from any thread; a
// Borrowed (and the Cell it lends) is used by one thread at a time. The pool must outlive
// every Borrowed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"
#include "metadata/cell.h"

namespace kvstash::metadata {

class CellPool {
 public:
  // One connection, lent until this goes (or is moved from); then it is back in the pool.
  class Borrowed {
   public:
    Borrowed(Borrowed&& other) noexcept = default;
    Borrowed& operator=(Borrowed&& other) noexcept;
    ~Borrowed();

    // The client's catalog over the connection (what the store calls).
    Catalog* operator->() { return &cell_->catalog(); }
    Catalog& operator*() { return cell_->catalog(); }
    // The connection, for another audience's catalog or a plain command.
    Cell& cell() { return *cell_; }
    RedisClient& redis() { return cell_->redis(); }

   private:
    friend class CellPool;
    Borrowed(CellPool* pool, std::unique_ptr<Cell> cell) : pool_(pool), cell_(std::move(cell)) {}
    void give_back();

    CellPool* pool_ = nullptr;
    std::unique_ptr<Cell> cell_;  // null once moved from or given back
  };

  // A pool of at most `size` connections (0 counts as 1). Opens the first one now, so that a
  // wrong URL, password or unreachable Redis fails here. Errors: Cell::open's.
  static Result<std::unique_ptr<CellPool>> open(const CellOptions& options, std::uint32_t size);
  CellPool(const CellPool&) = delete;
  CellPool& operator=(const CellPool&) = delete;
  ~CellPool();

  // A connection for one operation, its commands bounded by `deadline` until it is given
  // back. Blocks while every connection is lent and the pool is at its bound, until one comes
  // back or `deadline` passes: kTimeout then. Opening a new connection is bounded by the
  // options' connect timeout; its errors are Cell::open's, and the slot is freed for the next
  // borrower.
  Result<Borrowed> borrow(Deadline deadline);

  std::uint32_t size() const { return size_; }
  // Connections open now, lent or idle.
  std::uint32_t open_connections() const;
  const CellOptions& options() const { return options_; }

 private:
  CellPool(CellOptions options, std::uint32_t size);
  void give_back(std::unique_ptr<Cell> cell);

  const CellOptions options_;
  const std::uint32_t size_;
  mutable std::mutex mu_;
  std::condition_variable came_back_;
  std::vector<std::unique_ptr<Cell>> idle_;  // guarded by mu_
  std::uint32_t open_ = 0;                   // guarded by mu_: idle, lent and being opened
};

}  // namespace kvstash::metadata
