// MemoryNode: the heart of kvstashd. Donates one region of DRAM to a cell: allocates it,
// registers it with every transport of its engine (peers then read and write it one-sided,
// without this process's CPU), publishes itself in Redis, and keeps a heartbeat. A
// background loop also runs the cell's reclaim (expired objects, abandoned puts, zombies,
// dead nodes), so pages come back even when no client is active.
//
// The write fence: every client lease on the pool carries the Redis deadline of the put or
// read it serves. Each heartbeat, the node fences (Engine::fence) every lease whose deadline
// has surely passed by Redis's clock, and reports how far it fenced; Redis frees a failed
// put's pages only once its nodes have fenced through its deadline, so a write still queued
// at this node (stopped, slow, or behind a broken connection) can never land in a page
// another put was given. A node whose deadline passed registers again only after fencing the
// whole pool: it deregisters the pool from every transport (no old key reaches it any more)
// and registers it afresh.
//
// Thread safety: start/drain from one thread; metrics() and health() from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvstash/engine.h"
#include "kvstash/memory.h"
#include "kvstash/status.h"
#include "node/node_grants.h"
#include "node/tier.h"

namespace kvstash::node {

class MetricsText;

struct MemoryNodeOptions {
  std::string redis_url = "redis://127.0.0.1:6379/0";
  std::string redis_password;  // overrides the URL's
  std::string cell = "default";
  // Stable id of this node in the cell; empty: the host name.
  std::string node_id;
  // Bytes donated to the cell, rounded down to whole pages.
  std::uint64_t capacity = 1ull << 30;
  // The unit of allocation (docs/operations.md explains the 4 MiB default).
  std::uint64_t page_size = 4ull << 20;
  // Back the pool with 2 MiB huge pages when the system has them reserved (fewer TLB
  // misses for the copy engines and NICs); `require_huge_pages` makes their absence fatal.
  bool huge_pages = true;
  bool require_huge_pages = false;
  EngineOptions engine;
  // A node that misses its heartbeat for this long is declared dead and its objects dropped.
  std::chrono::milliseconds heartbeat_ttl{3000};
  // How long start() keeps trying to reach the cell's Redis and register while Redis is
  // unavailable (not up yet, failing over, a new master refusing writes until its replicas
  // catch up) before it gives up with Redis's error.
  std::chrono::milliseconds join_timeout{30000};
  // How often the cell's reclaim sweep runs from this node.
  std::chrono::milliseconds reclaim_interval{1000};
  // How long the cell signs this node's grants with one key before a heartbeat hands it the
  // next (node_grants.h).
  std::chrono::milliseconds grant_key_rotation{60000};
  // An NVMe tier under the pool (kvstashd --ssd): cold objects move down instead of being
  // evicted, and come back on a get (docs/nvme-tier.md).
  std::optional<TierOptions> tier;
};

class MemoryNode {
 public:
  // Allocates the pool, registers it, joins the cell and starts the heartbeat loop.
  // Errors: kInvalidArgument (options), kNoSpace (memory), Redis and engine errors.
  static Result<std::unique_ptr<MemoryNode>> start(const MemoryNodeOptions& options);
  // Stops the loop; leaves the cell as drain() left it (a node that did not drain is
  // declared dead when its heartbeat deadline passes).
  ~MemoryNode();

  // Graceful leave: takes no new pages, drops its objects from the metadata, deregisters.
  // Returns how many objects were dropped.
  Result<std::uint64_t> drain();

  const std::string& id() const { return id_; }
  std::uint64_t page_count() const { return page_count_; }
  std::uint64_t page_size() const { return options_.page_size; }
  bool huge_pages() const { return pool_.huge_pages(); }
  const Engine& engine() const { return *engine_; }
  // The NVMe tier; null without one.
  const NodeTier* tier() const { return tier_.get(); }
  // How far the node has fenced (ms of Redis time) and reported to the cell.
  std::int64_t fenced_ms() const { return fenced_reported_.load(); }
  // The transports serving the pool ("shm,tcp").
  std::string transports() const;

  // Prometheus text of the node's counters and gauges.
  std::string metrics() const;
  // Healthy, and why not: "ok", "draining", "redis unreachable: ...".
  std::pair<bool, std::string> health() const;

 private:
  MemoryNode() = default;
  void loop();
  Status join();  // (re)registers under a fresh epoch
  // Connects to the cell's Redis, checks its schema and joins: start()'s one attempt.
  Status open_and_join(const metadata::CellOptions& co);
  // After the cell declared this node dead: fences the whole pool (deregisters it from every
  // transport, waits out copies peers began) and registers it again. Caller holds the lock.
  Status rejoin();
  // Fences what Redis's clock has surely put behind every lease, and returns the fence to
  // report: the largest one made at least kCopyGrace ago (peers' shm copies that began
  // before it have ended).
  std::int64_t fence();
  void tier_metrics(MetricsText& m) const;

  struct Shared;  // Redis state, touched by the loop and drain
  MemoryNodeOptions options_;
  std::string id_;
  std::uint64_t page_count_ = 0;
  Buffer pool_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<NodeGrants> grants_;     // the leases on the pool need the cell's grants
  MemoryHandle handle_;                    // replaced on rejoin (under the lock)
  std::vector<TransportKind> transports_;  // serving the pool, fixed at start
  std::unique_ptr<Shared> shared_;
  std::unique_ptr<NodeTier> tier_;  // its thread stops before shared_ goes
  std::thread thread_;
  Clock::time_point started_ = Clock::now();
  // The loop's view of Redis's clock: a reading (from register_node or heartbeat), and when it
  // arrived here.
  std::optional<std::pair<std::int64_t, Clock::time_point>> redis_clock_;
  std::vector<std::pair<std::int64_t, Clock::time_point>> fences_made_;  // not yet reportable
  std::int64_t fenced_ready_ = 0;                                        // reportable now
  std::atomic<std::int64_t> fenced_reported_{0};
};

}  // namespace kvstash::node
