// The page pool of a cell of memory nodes, kept in Redis: node registration and heartbeats,
// allocation of pages across live nodes, and freeing. First slice of the metadata plane
// (docs/metadata.md); objects, leases and eviction build on it.
//
// Every operation is one Lua script (atomic); time comes from Redis. Thread safety: as the
// RedisClient it uses (one thread at a time).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "metadata/redis_client.h"

namespace kvstash::metadata {

struct NodeRecord {
  std::string id;       // stable across restarts (host name, configured id)
  std::string epoch;    // random per start: a new epoch means the old memory is gone
  std::uint64_t page_size = 0;
  std::uint64_t page_count = 0;
  std::string address;  // the node engine's address blob
  std::string key;      // the pool region's remote-key blob
};

// One page of an object: which node, which page, and the page's generation at allocation.
struct Extent {
  std::string node;
  std::uint64_t page = 0;
  std::int64_t generation = 0;
  bool operator==(const Extent&) const = default;
};

class PagePool {
 public:
  explicit PagePool(RedisClient& redis, std::string cell = "default");

  // Creates or refreshes a node and starts its heartbeat. A new epoch resets the node's pool
  // and invalidates every extent allocated under the old one. Errors: kInvalidArgument
  // (page size differs from the cell's, zero pages), Redis errors.
  Status register_node(const NodeRecord& node, std::chrono::milliseconds heartbeat_ttl);
  // Keeps a node alive for `ttl` more. kStale when the node re-registered with another
  // epoch or was never registered (the caller must register again).
  Status heartbeat(std::string_view id, std::string_view epoch, std::chrono::milliseconds ttl);

  // Takes `pages` pages from live nodes, most free first, spilling onto further nodes; all or
  // nothing. kNoSpace when the live nodes lack free pages.
  Result<std::vector<Extent>> allocate(std::uint64_t pages);
  // Returns pages to their nodes' pools. An extent whose page was already freed or reused
  // (generation moved on) is skipped, so a repeated free never double-frees.
  Status free(std::span<const Extent> extents);
  // Free pages of one node. kNotFound for an unknown node.
  Result<std::uint64_t> free_pages(std::string_view node);

 private:
  RedisClient& redis_;
  std::string prefix_;  // kvs:{kvs:<cell>}
};

}  // namespace kvstash::metadata
