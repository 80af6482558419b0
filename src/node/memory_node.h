// MemoryNode: the heart of kvstashd. Donates one region of DRAM to a cell: allocates it,
// registers it with every transport of its engine (peers then read and write it one-sided,
// without this process's CPU), publishes itself in Redis, and keeps a heartbeat. A
// background loop also runs the cell's reclaim (expired objects, abandoned puts, zombies,
// dead nodes), so pages come back even when no client is active.
//
// Thread safety: start/drain from one thread; metrics() and health() from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "kvstash/engine.h"
#include "kvstash/memory.h"
#include "kvstash/status.h"

namespace kvstash::node {

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
  // How often the cell's reclaim sweep runs from this node.
  std::chrono::milliseconds reclaim_interval{1000};
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

  struct Shared;  // Redis state, touched by the loop and drain
  MemoryNodeOptions options_;
  std::string id_;
  std::uint64_t page_count_ = 0;
  Buffer pool_;
  std::unique_ptr<Engine> engine_;
  MemoryHandle handle_;
  std::unique_ptr<Shared> shared_;
  std::thread thread_;
  Clock::time_point started_ = Clock::now();
};

}  // namespace kvstash::node
